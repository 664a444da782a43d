"""Peak memory (the largest of all ranks) and model FLOPs utilisation (MFU), for the logged metrics."""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from .flops import build_meta_model

GIB = 2 ** 30


def local_peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak memory since it started, in GiB: resident set size, and CUDA allocated and reserved
    (the caching allocator's pool) on a GPU."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"peak_rss_gib": rss / GIB if sys.platform == "darwin" else rss * 1024 / GIB}  # Linux: KiB, macOS: bytes
    if device.type == "cuda":
        peak["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        peak["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    return peak


def peak_memory_across_ranks(device: torch.device) -> dict[str, float]:
    """local_peak_memory's figures, each the maximum over all ranks (one all-reduce; every rank calls this)."""
    local = local_peak_memory(device)
    values = torch.tensor(list(local.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(local, values.tolist()))


def flops_model(model: nn.Module, trust_remote_code: bool = False) -> nn.Module:
    """A parameter-free (meta device) copy of the model's architecture, for counting FLOPs.

    FSDP1's parameters are 1-D views of this rank's shard, so the sharded model does not show the shapes that
    training_flops_per_token needs; a copy built from the config does, whatever the engine.
    """
    config = (model.module if isinstance(model, FSDP) else model).config
    return build_meta_model(config, trust_remote_code=trust_remote_code)


def mfu(tokens_per_second_per_device: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the share of the device's peak FLOP/s that the model's training FLOPs use."""
    return tokens_per_second_per_device * flops_per_token / peak_flops
