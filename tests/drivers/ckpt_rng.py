"""Save a checkpoint while each rank's generators hold states of their own, load it back, and dump what follows.

    torchrun --nproc_per_node 2 tests/drivers/ckpt_rng.py <out_dir> <recipe args...>

Writes <out_dir>/draws_rank<r>.json: the next numbers of Python's, NumPy's and torch's generators after the states
the rank saved ("saved") and after the load ("loaded"), which restores them.
"""

import json
import os
import random
import sys

import numpy as np
import torch
from transformers import get_scheduler

from fsdp_recipes.checkpoint import load_checkpoint, save_checkpoint
from fsdp_recipes.config import parse_config
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.model import load_model, load_tokenizer
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import shard_model
from fsdp_recipes.trainer import build_optimizer


def seed(value: int) -> None:
    random.seed(value), np.random.seed(value), torch.manual_seed(value)


def draws() -> list[float]:
    return [random.random(), float(np.random.rand()), torch.rand(1).item()]


def built(cfg):
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    optimizer = build_optimizer(model, cfg)
    return model, optimizer, get_scheduler("constant", optimizer)


out_dir, argv = sys.argv[1], sys.argv[2:]
cfg = parse_config(argv)
with distributed() as env:
    model, optimizer, scheduler = built(cfg)
    # Each rank its own states, as dropout on micro-batches of other lengths leaves them (set_seed gives all ranks one).
    seed(env.rank + 1)
    checkpoint = save_checkpoint(cfg, model, optimizer, scheduler, load_tokenizer(cfg), 1, 0, None)
    seed(env.rank + 1)
    saved = draws()  # the save draws none: these follow the saved states
    model, optimizer, scheduler = built(cfg)
    seed(100)  # the same on both ranks: only the load can set them apart again
    load_checkpoint(checkpoint, model, optimizer, scheduler)
    with open(os.path.join(out_dir, f"draws_rank{env.rank}.json"), "w") as f:
        json.dump({"saved": saved, "loaded": draws()}, f)
exit_process(0)
