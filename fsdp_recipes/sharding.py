"""Apply a ShardingPlan to a model: FSDP2 `fully_shard` on every decoder layer, then on the root."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .config import ConfigError
from .plan import ShardingPlan


def find_layer_classes(model: nn.Module, names: list[str] | None) -> tuple[type, ...]:
    """The module classes to wrap: the names given, else the model's `_no_split_modules`."""
    names = names or list(getattr(model, "_no_split_modules", None) or [])
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    if not names:
        raise ConfigError(
            f"{type(model).__name__} declares no _no_split_modules: set fsdp_transformer_layer_cls_to_wrap to its "
            f"decoder layer class, one of: {', '.join(sorted(by_name))}"
        )
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ConfigError(
            f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which is not a module class of "
            f"{type(model).__name__}; its module classes are: {', '.join(sorted(by_name))}"
        )
    return tuple(by_name[n] for n in names)


def mixed_precision_policy(plan: ShardingPlan) -> MixedPrecisionPolicy:
    if plan.mixed_precision == "bf16":
        # fp32 reduce: a bf16 reduce-scatter loses precision as the number of ranks grows.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: nn.Module, plan: ShardingPlan) -> None:
    """Shard `model` in place; record in `plan.wrapped` what was wrapped."""
    layer_classes = find_layer_classes(model, plan.layer_cls_names)
    for name, param in model.named_parameters():
        if param.dtype != torch.float32:
            raise ConfigError(f"master weights must be fp32, but {name} is {param.dtype}: load the model in fp32")
    kwargs = {"mp_policy": mixed_precision_policy(plan), "reshard_after_forward": plan.reshard_after_forward}
    layers = [m for m in model.modules() if isinstance(m, layer_classes)]
    plan.wrapped = f"{len(layers)} x {', '.join(c.__name__ for c in layer_classes)}"
    for layer in layers:
        fully_shard(layer, **kwargs)
    # The root group holds what no layer owns: embeddings, final norm and lm_head (tied or not, in one group).
    fully_shard(model, **kwargs)


def describe_plan(model: nn.Module, plan: ShardingPlan) -> str:
    """The resolved plan as rank 0 prints it at start."""
    total = sum(p.numel() for p in model.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    precision = (
        "bf16 compute, fp32 master weights, fp32 gradient reduction"
        if plan.mixed_precision == "bf16"
        else "fp32 compute and reduction"
    )
    lines = [
        f"engine: FSDP{plan.fsdp_version} (fully_shard) over {dist.get_world_size()} ranks",
        f"wrapped: {plan.wrapped}, then the root",
        f"strategy: FULL_SHARD, reshard_after_forward={plan.reshard_after_forward}",
        f"precision: {precision}",
        "offload: none",
        "activation checkpointing: off",
        f"parameters: {total:,} total, {local:,} on rank {dist.get_rank()}",
    ]
    lines += [f"note: {o}" for o in plan.overrides]
    return "\n".join("  " + line for line in lines)
