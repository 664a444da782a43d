"""Run a recipe in which rank 1 runs out of device memory in the middle of a `full` checkpoint's weight gather.

    torchrun --nproc_per_node 2 tests/drivers/ckpt_oom_gather.py recipes/llama_sft.py <recipe args>

Simulated: torch.OutOfMemoryError at rank 1's third parameter all-gather of the save, as a GPU with less headroom
would raise. Rank 1 must stop with that error, not go on to a collective the other rank is not in.
"""

import os
import runpy
import sys

import torch
from torch.distributed.tensor import DTensor

import fsdp_recipes.checkpoint as checkpoint

gathers = {"active": False, "calls": 0}
gather_full_state_dict, redistribute = checkpoint.gather_full_state_dict, DTensor.redistribute


def gather_on_rank1_until_oom(model):
    gathers["active"] = True
    try:
        return gather_full_state_dict(model)
    finally:
        gathers["active"] = False


def redistribute_or_oom(self, *args, **kwargs):
    if gathers["active"] and os.environ["RANK"] == "1":
        gathers["calls"] += 1
        if gathers["calls"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    return redistribute(self, *args, **kwargs)


checkpoint.gather_full_state_dict, DTensor.redistribute = gather_on_rank1_until_oom, redistribute_or_oom
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
