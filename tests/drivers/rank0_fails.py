"""A recipe's entry point when rank 0's work alone fails (out of memory while generating, say): rank 0 prints its
traceback, rank 1 one line naming rank 0, and both exit 1. With `config`, the work finds a config error (a bad row in
the data it reads): every rank prints that error's line and exits 2, as for a config error found on every rank.

    torchrun --nproc_per_node 2 tests/drivers/rank0_fails.py [config]
"""

import sys

import torch.distributed as dist

from fsdp_recipes.cli import run_main
from fsdp_recipes.config import ConfigError
from fsdp_recipes.distributed import run_on_rank0


def refuse():
    raise ConfigError("the work's config error: change it")


def main():
    dist.init_process_group("gloo")
    run_on_rank0(refuse if sys.argv[1:] == ["config"] else lambda: 1 / 0, "to divide")


if __name__ == "__main__":
    run_main(main)
