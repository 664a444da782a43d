"""A recipe's entry point when rank 0's work alone fails with an error other than a config error (out of memory
while generating, say): rank 0 prints its traceback, rank 1 one line naming rank 0, and both exit 1.

    torchrun --nproc_per_node 2 tests/drivers/rank0_fails.py
"""

import torch.distributed as dist

from fsdp_recipes.cli import run_main
from fsdp_recipes.distributed import run_on_rank0


def main():
    dist.init_process_group("gloo")
    run_on_rank0(lambda: 1 / 0, "to divide")


if __name__ == "__main__":
    run_main(main)
