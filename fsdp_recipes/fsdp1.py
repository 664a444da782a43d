"""FSDP1: `FullyShardedDataParallel` around each unit sharding.py chose (decoder layers, or modules chosen by size),
then the root."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import CustomPolicy

from .config import ConfigError
from .plan import ShardingPlan


def mixed_precision(plan: ShardingPlan) -> Optional[MixedPrecision]:
    if plan.mixed_precision == "bf16":
        # fp32 reduce, as for FSDP2; buffers (e.g. rotary frequencies) keep their dtype. Each unit casts its inputs to
        # bf16, as FSDP2's do: XGLM adds its fp32 positions buffer to the hidden states, which bf16 weights refuse.
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    return None


def check_offload_device(plan: ShardingPlan, device: torch.device) -> None:
    """FSDP1's offload on a machine without a GPU: an error before the model loads, not after."""
    if plan.fsdp_version == 1 and plan.offload_params and device.type == "cpu":
        raise ConfigError("FSDP1 CPU offload (CPUOffload) needs a GPU: torch cannot run it on CPU. On CPU use "
                          "fsdp_version 2, whose CPUOffloadPolicy works there")


def check_no_shard_tied_bf16_sync(model: nn.Module, plan: ShardingPlan) -> None:
    """NO_SHARD (asked for, or what torch runs on 1 rank) with bf16 compute and gradient_sync last_micro_batch: torch's
    no_sync hands a weight shared by two modules (tied embeddings) the bf16 gradient of the other, which torch refuses
    at the first step ('attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float')."""
    no_shard = plan.sharding_strategy == "NO_SHARD" or dist.get_world_size() == 1
    if not (no_shard and plan.mixed_precision == "bf16" and plan.gradient_sync == "last_micro_batch"):
        return
    seen, tied = set(), []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.append(name)
        seen.add(id(param))
    if tied:
        where = "NO_SHARD" if plan.sharding_strategy == "NO_SHARD" else "on 1 rank (which torch runs as NO_SHARD)"
        # FSDP1 offload with accumulation needs last_micro_batch (plan.py), so only the other ways out remain.
        fixes = ([] if plan.offload_params else ["gradient_sync every_micro_batch"]) + ["fsdp_version 2"] + (
            ["FULL_SHARD or SHARD_GRAD_OP"] if dist.get_world_size() > 1 else [])
        raise ConfigError(f"FSDP1 {where} with mixed_precision bf16 and gradient_sync last_micro_batch fails at the "
                          f"first step for a model with tied weights ({', '.join(tied)}): torch's no_sync gives them "
                          f"bf16 gradients it cannot assign. Use {', or '.join(fixes)}")


def shard(model: nn.Module, units: list[nn.Module], plan: ShardingPlan, mesh: Optional[DeviceMesh],
          device: torch.device) -> FSDP:
    """Wrap each of `units` (decoder layers, or the size-based units) and the root."""
    check_offload_device(plan, device)
    check_no_shard_tied_bf16_sync(model, plan)
    unit_ids = {id(unit) for unit in units}
    policy = CustomPolicy(lambda module: id(module) in unit_ids)
    is_meta = any(p.is_meta for p in model.parameters())
    return FSDP(
        model,
        sharding_strategy=ShardingStrategy[plan.sharding_strategy],
        cpu_offload=CPUOffload(offload_params=True) if plan.offload_params else None,
        auto_wrap_policy=policy,
        backward_prefetch=None if plan.backward_prefetch == "NO_PREFETCH"
        else BackwardPrefetch[plan.backward_prefetch or "BACKWARD_PRE"],
        mixed_precision=mixed_precision(plan),
        # Meta-device ranks (rank-0 loading) get empty storage here; the weights are broadcast afterwards.
        param_init_fn=_materializer(device) if is_meta else None,
        device_id=device,  # also on CPU: without it FSDP1 asks for an accelerator
        use_orig_params=True,  # the optimizer's weight-decay groups and the tests see the model's own parameters
        device_mesh=mesh,
    )


def _materializer(device: torch.device):
    """FSDP1's param_init_fn: empty storage for a module's meta parameters. Unlike `to_empty`, a parameter shared by
    two modules (tied embeddings) gets one new parameter, so the tie survives."""
    new_params: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta) -> (meta kept alive, new)

    def materialize(module: nn.Module) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in new_params:
                    new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                    new_params[id(param)] = (param, new)
                setattr(module, name, new_params[id(param)][1])

    return materialize
