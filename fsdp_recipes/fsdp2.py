"""FSDP2: `fully_shard` on each wrapped unit (decoder layers, or modules chosen by size), then on the root."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .plan import ShardingPlan

# Models sharded with reshard_after_forward=False: they hold each gathered layer from its forward to its backward.
_NOT_RESHARDED_AFTER_FORWARD: weakref.WeakSet = weakref.WeakSet()


def mixed_precision_policy(plan: ShardingPlan) -> MixedPrecisionPolicy:
    if plan.mixed_precision == "bf16":
        # fp32 reduce: a bf16 reduce-scatter loses precision as the number of ranks grows.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # "no" and "pure_bf16": compute in the dtype the parameters have


def shard(model: nn.Module, units: list[nn.Module], plan: ShardingPlan, mesh: DeviceMesh) -> None:
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if plan.offload_params else OffloadPolicy()
    kwargs = dict(mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=mixed_precision_policy(plan),
                  offload_policy=offload)
    for unit in units:
        fully_shard(unit, **kwargs)
    # The root group holds what no unit owns: embeddings, final norm and lm_head (tied or not, in one group).
    # It is never resharded after forward (as FSDP1's root, and FSDP2's when reshard_after_forward is left unset):
    # backward starts with its lm_head, so resharding would only all-gather it again, once per micro-batch.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    if not plan.reshard_after_forward:
        _NOT_RESHARDED_AFTER_FORWARD.add(model)


@contextlib.contextmanager
def no_sync(model: FSDPModule):
    """One micro-batch whose gradients accumulate unreduced (full-size) on each rank, as FSDP1's `no_sync`.

    The root unit stays gathered after backward, for the next micro-batch. Like FSDP1's with SHARD_GRAD_OP, a model
    not resharded after forward also keeps its layers gathered: one all-gather per step instead of one per
    micro-batch. Neither costs peak memory: what is kept is gathered at the end of each forward anyway.
    """
    keep_gathered = model in _NOT_RESHARDED_AFTER_FORWARD
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(not keep_gathered)
    # The root (embeddings, lm_head) is gathered from the start of each forward to the end of its backward anyway.
    model.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
