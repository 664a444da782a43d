"""Run the llama_sft recipe and record, on every rank, what the metrics are made of, for tests/test_metrics.py.

    torchrun --nproc_per_node 2 tests/drivers/observe_run.py <record_dir> <recipe args...>

Writes <record_dir>/rank_<r>.jsonl, one line per event:
- {"memory": ...}: this rank's own peak-memory figures each time the trainer reduces them over the ranks;
- {"eval": ..., "reference": ..., "forward_passes": n, "checkpoints": [...]}: evaluate()'s result, the
  token-weighted loss of the whole held-out split computed by this rank alone on an unsharded copy of the model,
  this rank's forward passes, and the checkpoint folders in output_dir when the evaluation started.
Rank 1 holds 200 MB more than rank 0, so that its peak memory is the larger one.
"""

import json
import os
import runpy
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdp_recipes.device_stats
import fsdp_recipes.trainer
from fsdp_recipes.data import collate
from fsdp_recipes.model import load_model

record_dir, sys.argv = sys.argv[1], ["llama_sft.py", *sys.argv[2:]]
rank = int(os.environ["RANK"])
ballast = b"\x01" * (200 * 2**20) if rank == 1 else b""  # touched bytes: resident memory of rank 1 only


def record(event: dict) -> None:
    with open(os.path.join(record_dir, f"rank_{rank}.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")


local_peak_memory = fsdp_recipes.device_stats.local_peak_memory


def recorded_peak_memory(device):
    figures = local_peak_memory(device)
    record({"memory": figures})
    return figures


evaluate = fsdp_recipes.trainer.evaluate


def checked_evaluate(model, eval_dataset, cfg, tokenizer, env):
    checkpoints = sorted(name for name in os.listdir(cfg.output_dir) if name.startswith("checkpoint-"))
    passes = []
    hook = model.register_forward_hook(lambda *args: passes.append(1))
    result = evaluate(model, eval_dataset, cfg, tokenizer, env)
    hook.remove()
    # Reference: the whole split on one process, unsharded, as one batch.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = load_model(cfg)
    plain.load_state_dict(full)
    batch = collate([eval_dataset[i] for i in range(len(eval_dataset))], tokenizer.pad_token_id)
    with torch.no_grad():
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss_sum = fsdp_recipes.trainer.token_loss_sum(logits, batch["labels"]).item()
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    record({"eval": result, "reference": loss_sum / tokens, "forward_passes": len(passes),
            "eval_examples": len(eval_dataset), "checkpoints": checkpoints})
    return result


fsdp_recipes.device_stats.local_peak_memory = recorded_peak_memory
fsdp_recipes.trainer.evaluate = checked_evaluate
runpy.run_path("recipes/llama_sft.py", run_name="__main__")
