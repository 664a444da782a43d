"""Train several sharding variants one after the other, each on a fresh model, and record what each rank holds.

    torchrun --nproc_per_node 2 tests/drivers/sharding_run.py <out_dir> '<variants json>' <recipe args...>

`variants` maps a name to extra recipe flags, e.g. {"fsdp1": {"fsdp_version": 1}}; the name "unsharded" trains
the plain model without FSDP (the single-process reference). For each variant it writes <out_dir>/<name>/
metrics.jsonl (the trainer's), and <out_dir>/<name>/rank<r>.json: the plan's description and the bytes of
parameters, gradients and optimizer state this rank holds after one extra optimizer step.
"""

import json
import os
import sys

import torch

from fsdp_recipes.config import parse_config
from fsdp_recipes.data import build_dataloader, build_train_dataset
from fsdp_recipes.distributed import distributed
from fsdp_recipes.metrics import MetricsLogger
from fsdp_recipes.model import load_model, load_sharded_model, load_tokenizer
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import describe_plan, local_numel
from fsdp_recipes.trainer import build_optimizer, token_loss_sum, train


def local_bytes(tensors) -> int:
    return sum(local_numel(t) * t.element_size() for t in tensors)


def held_bytes(model, cfg, env, batch) -> dict:
    """One forward, backward and AdamW step; then the bytes of what this rank holds, from the tensors themselves."""
    optimizer = build_optimizer(model, cfg)
    batch = {k: v.to(env.device) for k, v in batch.items()}
    token_loss_sum(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                   batch["labels"]).backward()
    grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = local_bytes(t for s in optimizer.state.values() for t in s.values() if t.ndim > 0)  # not `step`
    return {"params": local_bytes(model.parameters()), "grads": grads, "optimizer_state": state,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "state_dtypes": sorted({str(t.dtype) for s in optimizer.state.values() for t in s.values() if t.ndim})}


out_dir, variants, argv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
with distributed() as env:
    base = parse_config(argv)
    tokenizer = load_tokenizer(base)
    dataset = build_train_dataset(base, tokenizer)
    for name, flags in variants.items():
        extra = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
        cfg = parse_config(argv + extra + ["--output_dir", os.path.join(out_dir, name)])
        torch.manual_seed(cfg.seed)
        if name == "unsharded":
            model, description = load_model(cfg).to(env.device), "unsharded"
        else:
            plan = resolve_plan(cfg)
            model = load_sharded_model(cfg, plan, env.device)
            description = describe_plan(model, plan)
        train(cfg, env, model, tokenizer, dataset, MetricsLogger(cfg, env.is_main))
        batch = next(iter(build_dataloader(dataset, cfg, tokenizer, env.rank, env.world_size)))
        record = {"plan": description, **held_bytes(model, cfg, env, batch)}
        with open(os.path.join(out_dir, name, f"rank{env.rank}.json"), "w") as f:
            json.dump(record, f)
