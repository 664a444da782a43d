"""The fast training step gives the numbers of the plain one, for tests/test_fast_step.py.

    torchrun --nproc_per_node 2 tests/drivers/fast_step.py <out.json> --model_name_or_path <tiny model>

Three FSDP2 copies of the same fp32 model train the same 3 optimizer steps (accumulation 2, each rank its own
micro-batches): the recipe's AdamW (fused), the same with torch.compile on each decoder layer, and a single-tensor
(unfused, non-foreach) AdamW as the reference. Rank 0 writes their per-step losses and the largest deviation of the
final weights and Adam moments from the reference to <out.json>, and how many decoder layers were compiled and
how many graphs dynamo made.
"""

import json
import sys

import torch

from fsdp_recipes.config import parse_config
from fsdp_recipes.data import collate
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.model import load_model
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import describe_plan, shard_model
from fsdp_recipes.trainer import build_optimizer, clip_grad_norm, forward_backward, step_token_counts

out_file, argv = sys.argv[1], sys.argv[2:]
cfg = parse_config(["--dataset_name", "unused", "--mixed_precision", "no", "--learning_rate", "1e-3",
                    "--weight_decay", "0.1", *argv])
with distributed() as env:
    generator = torch.Generator().manual_seed(env.rank)
    # Fixed shapes: one compiled graph serves every step. Labels mask the first 5 tokens (a prompt).
    steps = []
    for _ in range(3):
        rows = []
        for _ in range(4):
            ids = torch.randint(5, 40, (24,), generator=generator).tolist()
            rows.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
        steps.append([collate(rows[:2], 0), collate(rows[2:], 0)])

    def train(compile_layers: bool, reference_optimizer: bool):
        cfg.torch_compile = compile_layers
        plan = resolve_plan(cfg)
        model = shard_model(load_model(cfg), plan, env.device)
        printed = "  torch.compile: each decoder layer" in describe_plan(model, plan).splitlines()
        compiled = sum(layer._compiled_call_impl is not None for layer in model.model.layers)
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        optimizer = build_optimizer(model, cfg)
        if reference_optimizer:
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
            optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, foreach=False, fused=False)
        losses = []
        for micro_batches in steps:
            label_tokens, *_ = step_token_counts(micro_batches)
            loss_sum, _ = forward_backward(model, micro_batches, label_tokens, env.world_size, env.device)
            clip_grad_norm(model, cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.distributed.all_reduce(loss_sum)
            losses.append(loss_sum.item() / label_tokens)
        state = {}
        for name, param in model.named_parameters():
            state[name] = param.full_tensor()
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"{name}.{key}"] = optimizer.state[param][key].full_tensor()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
        return losses, state, optimizer.param_groups[0], {"compiled_layers": compiled, "graphs": graphs,
                                                         "plan_says_compiled": printed}

    ref_losses, ref_state, _, _ = train(compile_layers=False, reference_optimizer=True)
    fused_losses, fused_state, group, eager = train(compile_layers=False, reference_optimizer=False)
    compiled_losses, compiled_state, _, compiled = train(compile_layers=True, reference_optimizer=False)

    def deviation(state):
        return max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)

    if env.is_main:
        with open(out_file, "w") as f:
            json.dump({"reference_losses": ref_losses, "fused_losses": fused_losses,
                       "compiled_losses": compiled_losses, "fused": group["fused"],
                       "fused_state_deviation": deviation(fused_state),
                       "compiled_state_deviation": deviation(compiled_state), "eager": eager,
                       "compiled": compiled}, f)
exit_process(0)
