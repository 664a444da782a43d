"""Load a checkpoint into a freshly built model and optimizer, on any number of processes, and dump what was loaded.

    torchrun --nproc_per_node N tests/drivers/ckpt_load.py <checkpoint> <out.pt> <recipe args...>

<out.pt> holds the full (gathered) model and optimizer state dicts, for the test to compare with the checkpoint.
"""

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from transformers import get_scheduler

from fsdp_recipes.checkpoint import load_checkpoint
from fsdp_recipes.config import parse_config
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.model import load_model
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import shard_model
from fsdp_recipes.trainer import build_optimizer

checkpoint, out, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
cfg = parse_config(argv)
with distributed() as env:
    model = load_model(cfg)
    model = shard_model(model, resolve_plan(cfg))  # FSDP1 returns its wrapper
    optimizer = build_optimizer(model, cfg)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=cfg.max_steps)
    load_checkpoint(checkpoint, model, optimizer, scheduler)
    # No cpu_offload: the tensors are on CPU already, and with it FSDP1 on CPU segfaults (model) or returns
    # exp_avg_sq in place of exp_avg (optimizer).
    full = StateDictOptions(full_state_dict=True)
    model_sd = get_model_state_dict(model, options=full)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=full)
    if env.is_main:
        torch.save({"model": model_sd, "optimizer": optim_sd, "lr": scheduler.get_last_lr(),
                    "group_lr": [group["lr"] for group in optimizer.param_groups]}, out)
exit_process(0)  # past the interpreter's teardown, where a gloo rank can abort (exit -6) once its work is done
