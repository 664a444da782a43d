"""Shard models as the recipe does, take one AdamW step, and record the bytes each rank holds.

    torchrun --nproc_per_node 2 tests/drivers/estimate_held.py <out_dir> '<variants json>'

`variants` maps a name to {"config": a config.json, "mixed_precision": "bf16" | "no" | "pure_bf16",
"strategy": "FULL_SHARD" | "SHARD_GRAD_OP" | "HSDP" (one replica per rank), "offload": bool}. For each it writes
<out_dir>/<name>_rank<r>.json: the bytes of parameters, gradients and optimizer state this rank holds after one
forward, backward and optimizer step, counted from the tensors' local shards.
"""

import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.config import TrainConfig
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.plan import ShardingPlan
from fsdp_recipes.sharding import MASTER_DTYPE, local_numel, shard_model
from fsdp_recipes.trainer import build_optimizer, token_loss_sum


def local_bytes(tensors) -> int:
    return sum(local_numel(t) * t.element_size() for t in tensors)


def held_bytes(spec: dict, env) -> dict:
    config = AutoConfig.from_pretrained(spec["config"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=MASTER_DTYPE[spec["mixed_precision"]])
    plan = ShardingPlan(
        fsdp_version=2, sharding_strategy="SHARD_GRAD_OP" if spec["strategy"] == "SHARD_GRAD_OP" else "FULL_SHARD",
        reshard_after_forward=spec["strategy"] != "SHARD_GRAD_OP",
        dp_replicate_size=env.world_size if spec["strategy"] == "HSDP" else None,
        auto_wrap_policy="TRANSFORMER_BASED_WRAP", layer_cls_names=None, min_num_params=0,
        offload_params=spec["offload"], activation_checkpointing=False, cpu_ram_efficient_loading=False,
        mixed_precision=spec["mixed_precision"], backward_prefetch=None,
    )
    model = shard_model(model, plan, env.device)
    optimizer = build_optimizer(model, TrainConfig(model_name_or_path=spec["config"], dataset_name="unused"))
    ids = torch.randint(0, config.get_text_config().vocab_size, (2, 16), device=env.device)  # text only
    token_loss_sum(model(input_ids=ids).logits, ids).backward()
    grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if t.ndim > 0]  # not the scalar `step`
    return {"params": local_bytes(model.parameters()), "grads": grads, "optimizer_state": local_bytes(state),
            "mesh": list(plan.mesh_shape)}


out_dir, variants = sys.argv[1], json.loads(sys.argv[2])
with distributed() as env:
    for name, spec in variants.items():
        with open(os.path.join(out_dir, f"{name}_rank{env.rank}.json"), "w") as f:
            json.dump(held_bytes(spec, env), f)
exit_process(0)
