"""Every rank reading the weights itself: the ranks wait for the slowest on the long-wait group.

    torchrun --nproc_per_node 2 tests/drivers/model_load_wait.py <seconds rank 1 reads longer> <training timeout> <args...>

Rank 1 reads the weights slowly (a node whose download or disk is slower); the training collectives' timeout is
shorter than that. The model must then shard and pass a barrier on the training group on both ranks.
"""

import sys
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from transformers import AutoModelForCausalLM

from fsdp_recipes.config import parse_config
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.model import load_sharded_model
from fsdp_recipes.plan import resolve_plan

slow_seconds, timeout_seconds, argv = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
cfg = parse_config(argv + ["--fsdp_cpu_ram_efficient_loading", "false"])
with distributed() as env:
    _set_pg_timeout(timedelta(seconds=timeout_seconds), dist.group.WORLD)  # the training collectives' timeout
    if env.rank == 1:
        read = AutoModelForCausalLM.from_pretrained
        AutoModelForCausalLM.from_pretrained = lambda *a, **kw: time.sleep(slow_seconds) or read(*a, **kw)
    model = load_sharded_model(cfg, resolve_plan(cfg), env.device)
    dist.barrier()
    print(f"rank {env.rank}: sharded, past the training group's barrier", flush=True)
exit_process(0)
