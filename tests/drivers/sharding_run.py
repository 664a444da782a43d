"""Train several sharding variants one after the other, each on a fresh model, and record what each rank holds.

    torchrun --nproc_per_node 2 tests/drivers/sharding_run.py <out_dir> '<variants json>' <recipe args...>

`variants` maps a name to extra recipe flags, e.g. {"fsdp1": {"fsdp_version": 1}}; a name starting with "unsharded"
trains the plain model without FSDP (the single-process reference). For each variant it writes <out_dir>/<name>/
metrics.jsonl (the trainer's), and <out_dir>/<name>/rank<r>.json: the plan's description and the bytes of
parameters, gradients and optimizer state this rank holds after one extra optimizer step. The flag
"profile_training": true (not a recipe flag) also counts the reduce-scatters the trainer runs.
"""

import contextlib
import json
import os
import sys
from collections import Counter

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsdp_recipes.checkpoint import save_options, sharded_model_state_dict
from fsdp_recipes.config import parse_config
from fsdp_recipes.data import build_dataloader, build_datasets
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.export import gather_full_state_dict
from fsdp_recipes.metrics import MetricsLogger
from fsdp_recipes.model import load_model, load_sharded_model, load_tokenizer
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import describe_plan, gradient_sync, local_numel
from fsdp_recipes.trainer import build_optimizer, clip_grad_norm, token_loss_sum, train


def local_bytes(tensors) -> int:
    return sum(local_numel(t) * t.element_size() for t in tensors)


def local_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, DTensor):
        return [value.to_local()]
    if isinstance(value, ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    return [value]


def tensors_in(state_dict: dict) -> list[torch.Tensor]:
    """The local tensors of a (nested) state dict."""
    return [t for value in state_dict.values()
            for t in (tensors_in(value) if isinstance(value, dict) else local_tensors(value))
            if isinstance(t, torch.Tensor)]


def gpu_bytes_copied(own: list[torch.Tensor], state_dicts: list[dict]) -> int:
    """Bytes of the GPU storages the state dicts hold besides those of the tensors they were made from (Adam's
    scalar `step` counters aside: the optimizer state dict copies them, 4 bytes each)."""
    own_storages = {t.untyped_storage().data_ptr() for tensor in own for t in local_tensors(tensor)}
    copies = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for state_dict in state_dicts for t in tensors_in(state_dict)
              if t.is_cuda and t.ndim > 0 and t.untyped_storage().data_ptr() not in own_storages}
    return sum(copies.values())


def collectives(profile) -> dict:
    """How many times each collective ran, e.g. {"c10d::_allgather_base_": 5}."""
    # The raw events: profile.events() builds a Python object for every op first, 5 s for 10 training steps.
    names = (e.name() for e in profile.profiler.kineto_results.events())
    return dict(Counter(name for name in names if name.startswith("c10d::")))


def held_bytes(model, cfg, env, batch) -> dict:
    """One forward, backward and AdamW step; then the bytes of what this rank holds, from the tensors themselves,
    and how often decoder layers ran forward (twice per layer with activation checkpointing: the recomputation).
    The collectives that first micro-batch runs; last, two micro-batches without gradient sync, and the collectives
    the second one runs."""
    optimizer = build_optimizer(model, cfg)
    batch = {k: v.to(env.device) for k, v in batch.items()}

    def micro_batch():
        token_loss_sum(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                       batch["labels"]).backward()

    calls = []
    # A pre-hook: the recomputation stops early, after the last tensor backward needs, so no post-hook fires.
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in model.modules()
             if isinstance(m, LlamaDecoderLayer)]
    with torch.profiler.profile() as synced:
        micro_batch()
    for hook in hooks:
        hook.remove()
    grad_norm = clip_grad_norm(model, 0)  # 0: measure only; the trainer's engine-aware global norm
    clip_grad_norm(model, grad_norm.item() / 4)  # clipping scales every rank's shards to a quarter of the norm
    clipped_grad_norm = clip_grad_norm(model, 0)
    grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if t.ndim > 0]  # not `step`
    # What a sharded save gives DCP: FSDP1 makes copies, which must not stay on a GPU.
    saved = [sharded_model_state_dict(model), get_optimizer_state_dict(model, optimizer, options=save_options(model))]
    copied = gpu_bytes_copied([*model.parameters(), *state], saved)
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    held = local_bytes(model.parameters())

    def micro_batch_without_sync():
        with gradient_sync(model, enabled=False):
            micro_batch()

    micro_batch_without_sync()
    with torch.profiler.profile() as unsynced:
        micro_batch_without_sync()
    return {"collectives_in_synced_micro_batch": collectives(synced),
            "collectives_in_second_micro_batch_without_sync": collectives(unsynced),
            "params": held, "grads": grads, "optimizer_state": local_bytes(state),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "state_dtypes": sorted({str(t.dtype) for t in state}),
            "param_devices": sorted({p.device.type for p in params}),
            "params_pinned": all(p.is_pinned() for p in params) if torch.cuda.is_available() else False,
            "layer_forward_calls": len(calls), "grad_norm": grad_norm.item(),
            "clipped_grad_norm": clipped_grad_norm.item(), "gpu_bytes_copied_for_sharded_save": copied,
            "optimizer_groups": [[g["weight_decay"], len(g["params"])] for g in optimizer.param_groups]}


def checkpoint_facts(model) -> dict:
    """State-dict keys, and whether the input and output embeddings are still one parameter."""
    inner = model.module if isinstance(model, FSDP) else model
    tied = inner.config.tie_word_embeddings
    return {"state_dict_keys": sorted(get_model_state_dict(model)),
            "tied": inner.lm_head.weight is inner.model.embed_tokens.weight if tied else None}


def offload_policies(model) -> list[str]:
    """The offload policy of each FSDP unit, as the engine holds it (on a CPU run the parameters' device cannot
    tell an offloaded unit from another)."""
    if isinstance(model, FSDP):
        return [f"FSDP1 offload_params={unit.cpu_offload.offload_params}" for unit in FSDP.fsdp_modules(model)]
    return [type(unit._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
            for unit in model.modules() if isinstance(unit, FSDPModule)]


out_dir, variants, argv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
with distributed() as env:
    base = parse_config(argv)
    tokenizer = load_tokenizer(base)
    dataset = build_datasets(base, tokenizer)[0]
    for name, flags in variants.items():
        profile_training = flags.pop("profile_training", False)  # slow: the variants whose test reads it
        extra = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
        cfg = parse_config(argv + extra + ["--output_dir", os.path.join(out_dir, name)])
        torch.manual_seed(cfg.seed)
        if name.startswith("unsharded"):
            model, description = load_model(cfg).to(env.device), "unsharded"
        else:
            plan = resolve_plan(cfg)
            model = load_sharded_model(cfg, plan, env.device)
            description = describe_plan(model, plan)
        # The trainer's own collectives (how it applies gradient_sync).
        with torch.profiler.profile() if profile_training else contextlib.nullcontext() as training:
            train(cfg, env, model, tokenizer, dataset, MetricsLogger(cfg, env.is_main))
        batch = next(iter(build_dataloader(dataset, cfg, tokenizer, env.rank, env.world_size, pin_memory=False)))
        # What the export gathers: with CPU offload too, the full weights must not stay on a GPU.
        gpu_tensors_in_export = sum(t.is_cuda for t in gather_full_state_dict(model).values())
        record = {"plan": description, **checkpoint_facts(model), **held_bytes(model, cfg, env, batch),
                  "offload_policies": offload_policies(model),
                  "reduce_scatters_in_training": sum(n for op, n in collectives(training).items()
                                                     if "reduce_scatter" in op) if profile_training else None,
                  "gpu_tensors_in_export": gpu_tensors_in_export}
        with open(os.path.join(out_dir, name, f"rank{env.rank}.json"), "w") as f:
            json.dump(record, f)
exit_process(0)
