"""Gradients of one optimizer step, computed several ways that must agree, for tests/test_loss.py.

    torchrun --nproc_per_node 2 tests/drivers/loss_grads.py <out.json> --model_name_or_path <tiny model>

Global batch: 8 examples whose label counts differ a lot (1 to 29), so that averaging per micro-batch or per rank
would give a different gradient. Every rank computes the reference on an unsharded copy of the model, as a single
process would: one micro-batch of 8, token-weighted. Then:
  - the same unsharded model with accumulation 2 x 4 and 4 x 2, and with the 8 examples packed;
  - the FSDP2-sharded model on 2 ranks, 4 examples each, with accumulation 1 x 4 and 2 x 2;
  - the per-micro-batch mean (the classic accumulation bug), to show the comparison can fail.
Rank 0 writes the largest absolute gradient deviation from the reference of each to <out.json>.
"""

import json
import random
import sys

import pyarrow as pa
import torch

from fsdp_recipes.config import parse_config
from fsdp_recipes.data import collate, pack_examples
from fsdp_recipes.data_formats import tokenize_example
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.model import load_model, load_tokenizer
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import shard_model
from fsdp_recipes.trainer import forward_backward, step_token_counts, token_loss_sum

out_file, argv = sys.argv[1], sys.argv[2:]
cfg = parse_config(["--dataset_name", "unused", "--mixed_precision", "no", *argv])
with distributed() as env:
    tokenizer = load_tokenizer(cfg)
    rng = random.Random(0)
    examples = [
        tokenize_example({"prompt": "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 20))),
                          "completion": "".join(rng.choice("abcdefgh") for _ in range(n))},
                         "prompt_completion", tokenizer, max_seq_length=64)
        for n in [0, 28, 3, 12, 1, 20, 6, 9]
    ]
    pad = tokenizer.pad_token_id

    def micro_batches(rows, accumulation):
        size = len(rows) // accumulation
        return [collate(rows[i * size:(i + 1) * size], pad) for i in range(accumulation)]

    def grads(model):
        return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in model.named_parameters()}

    def local_step(model, batches):
        """One process alone: token counts of this step only, no other rank."""
        model.zero_grad(set_to_none=True)
        label_tokens = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in batches)
        loss = forward_backward(model, batches, label_tokens, world_size=1, device=env.device)[0].item() / label_tokens
        return grads(model), loss, label_tokens

    def deviation(a, b):
        return max((a[n] - b[n]).abs().max().item() for n in a)

    plain = load_model(cfg)
    reference, ref_loss, ref_tokens = local_step(plain, micro_batches(examples, 1))
    result = {"label_tokens": ref_tokens, "grad_scale": max(g.abs().max().item() for g in reference.values())}
    for k in (2, 4):
        result[f"accumulation_{k}"] = deviation(local_step(plain, micro_batches(examples, k))[0], reference)
    packed_rows = pack_examples(pa.Table.from_pylist(examples), max_seq_length=64).to_pylist()
    result["packed_rows"] = len(packed_rows)
    result["packed"] = deviation(local_step(plain, [collate(packed_rows, pad)])[0], reference)

    # The accumulation bug: each micro-batch's mean loss, averaged over micro-batches.
    plain.zero_grad(set_to_none=True)
    for mb in micro_batches(examples, 4):
        n = int((mb["labels"][:, 1:] != -100).sum())
        (token_loss_sum(plain(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits, mb["labels"])
         / n / 4).backward()
    result["per_micro_batch_mean"] = deviation(grads(plain), reference)

    sharded = load_model(cfg)
    shard_model(sharded, resolve_plan(cfg))
    mine = examples[env.rank * 4:(env.rank + 1) * 4]
    for k in (1, 2):
        batches = micro_batches(mine, k)
        sharded.zero_grad(set_to_none=True)
        label_tokens, *_ = step_token_counts(batches)
        loss_sum, _ = forward_backward(sharded, batches, label_tokens, env.world_size, env.device)
        torch.distributed.all_reduce(loss_sum)
        result[f"ranks_{env.world_size}_accumulation_{k}"] = deviation(grads(sharded), reference)
        result[f"ranks_{env.world_size}_accumulation_{k}_loss"] = abs(loss_sum.item() / label_tokens - ref_loss)
    if env.is_main:
        with open(out_file, "w") as f:
            json.dump(result, f, indent=1)
exit_process(0)
