"""Token-weighted loss: one optimizer step has the same gradient however its global batch is split.

The loss of a step is the sum of per-token losses over all micro-batches and all ranks, divided by the number of
label tokens in the whole step (see tests/drivers/loss_grads.py for the cases). The logged loss, gradient norm,
token counts and learning rate of a clipped run equal those of a reference step written out here.
"""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, GptOssConfig, Trainer

from fsdp_recipes.config import TrainConfig, parse_config
from fsdp_recipes.data import IGNORE_INDEX, build_dataloader, build_datasets, optimizer_step_batches
from fsdp_recipes.distributed import DistEnv
from fsdp_recipes.metrics import MetricsLogger
from fsdp_recipes.model import load_model, load_tokenizer
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import shard_model, state_dict_name
from fsdp_recipes.trainer import build_optimizer, clip_grad_norm, token_loss_sum, train

from conftest import read_metrics, torchrun


def test_token_loss_sum_is_the_sum_of_next_token_cross_entropies():
    logits = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[3, IGNORE_INDEX, 2, 5]])  # position 0 is never predicted; 1 is masked
    log_probs = logits.log_softmax(-1)
    expected = -(log_probs[0, 1, 2] + log_probs[0, 2, 5])
    assert abs(token_loss_sum(logits, labels) - expected) < 1e-6


def test_gradients_equal_across_accumulation_ranks_and_packing(tiny, tmp_path):
    out = tmp_path / "grads.json"
    torchrun("tests/drivers/loss_grads.py", out, "--model_name_or_path", tiny["model"])
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    assert result["label_tokens"] == 87 and result["packed_rows"] < 8
    for case in ["accumulation_2", "accumulation_4", "packed", "ranks_2_accumulation_1", "ranks_2_accumulation_2"]:
        assert result[case] < 1e-6, case  # largest absolute deviation of any gradient entry from 1 x 8 on 1 rank
    for case in ["ranks_2_accumulation_1_loss", "ranks_2_accumulation_2_loss"]:
        assert result[case] < 1e-6, case
    # Averaging per micro-batch instead is off by far more than the tolerance: the comparison can fail.
    assert result["per_micro_batch_mean"] > 1e-3
    assert result["grad_scale"] > 1e-2


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_weight_decay_spares_biases_and_norm_weights_of_any_shape(one_process_group, fsdp_version):
    # Cohere's per-head q_norm/k_norm weights and gpt-oss's expert biases are 2-D: the decision goes by name, as
    # transformers.Trainer's does, and the parameter's shape before sharding.
    configs = [CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True, tie_word_embeddings=False),
               GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                            num_experts_per_tok=2, layer_types=["full_attention"] * 2)]
    cfg = TrainConfig(model_name_or_path="unused", dataset_name="unused", fsdp_version=fsdp_version,
                      mixed_precision="no", weight_decay=0.1)
    for config in configs:
        model = AutoModelForCausalLM.from_config(config)
        # And none on the other 1-D parameters (gpt-oss's attention sinks), which transformers.Trainer decays.
        decayed_by_transformers = set(Trainer.get_decay_parameter_names(None, model))
        one_d = {name for name, p in model.named_parameters() if p.ndim < 2}
        assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.experts.gate_up_proj_bias"}.isdisjoint(
            decayed_by_transformers)
        sharded = shard_model(model, resolve_plan(cfg), torch.device("cpu"))
        names = {id(p): state_dict_name(name) for name, p in sharded.named_parameters()}
        decay, no_decay = build_optimizer(sharded, cfg).param_groups
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
        assert {names[id(p)] for p in decay["params"]} == decayed_by_transformers - one_d
        assert len(decay["params"]) + len(no_decay["params"]) == len(names)


def reference_run(cfg: TrainConfig, train_data, tokenizer, max_grad_norm: float) -> list[dict]:
    """The logged numbers of cfg.max_steps steps, computed here on an unsharded model with torch's own AdamW and
    clipping: a step's loss is its label tokens' mean (position 0 is never predicted), and the learning rate is
    cfg's linear decay from the first step."""
    model = load_model(cfg)
    model.train()
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=cfg.learning_rate, eps=cfg.adam_epsilon)
    loader = build_dataloader(train_data, cfg, tokenizer, rank=0, world_size=1, pin_memory=False)
    stream = optimizer_step_batches(loader, cfg.gradient_accumulation_steps)
    logged = []
    for step in range(1, cfg.max_steps + 1):
        micro_batches = next(stream)
        tokens = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)
        loss = sum(token_loss_sum(model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits,
                                  mb["labels"]) for mb in micro_batches) / tokens
        loss.backward()
        grad_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        scale = min(1.0, max_grad_norm / (grad_norm + 1e-6))  # torch's clip_grad_norm_
        learning_rate = cfg.learning_rate * (cfg.max_steps - step + 1) / cfg.max_steps
        for p in model.parameters():
            p.grad *= scale
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        optimizer.step()
        optimizer.zero_grad()
        logged.append({"step": step, "loss": loss.item(), "grad_norm": grad_norm, "learning_rate": learning_rate,
                       "tokens": tokens, "input_tokens": sum(int(mb["attention_mask"].sum()) for mb in micro_batches),
                       "real_token_share": sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
                       / sum(mb["attention_mask"].numel() for mb in micro_batches)})
    return logged


def test_logged_loss_grad_norm_tokens_and_learning_rate_equal_a_reference_step_with_clipping(tiny, tmp_path,
                                                                                             one_process_group):
    # Loss on every token (position 0's label is set, and must not count); adam_epsilon 1 makes AdamW's update
    # follow the gradient's size, so that the clipping to max_grad_norm shows in the later losses.
    cfg = parse_config([str(arg) for arg in [
        "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path,
        "--completion_only_loss", "false", "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "2", "--mixed_precision", "no", "--max_seq_length", "64",
        "--learning_rate", "0.05", "--lr_scheduler_type", "linear", "--warmup_steps", "0", "--adam_epsilon", "1",
        "--weight_decay", "0.1", "--max_grad_norm", "0.5"]])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    tokenizer = load_tokenizer(cfg)
    train_data, _ = build_datasets(cfg, tokenizer)
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    train(cfg, env, model, tokenizer, train_data, MetricsLogger(cfg, is_main=True))
    logged = read_metrics(tmp_path / "metrics.jsonl")
    reference = reference_run(cfg, train_data, tokenizer, cfg.max_grad_norm)
    for line, expected in zip(logged, reference, strict=True):
        assert {k: line[k] for k in ("step", "tokens", "input_tokens")} == {
            k: expected[k] for k in ("step", "tokens", "input_tokens")}
        assert line["learning_rate"] == pytest.approx(expected["learning_rate"], rel=1e-12)
        for key in ("loss", "grad_norm", "real_token_share"):
            assert line[key] == pytest.approx(expected[key], rel=1e-5), (line["step"], key)
    assert all(m["grad_norm"] > 2 * cfg.max_grad_norm for m in logged)  # every step is clipped
    # Without the clipping the later losses differ by far more than the tolerance: the comparison can fail.
    unclipped = reference_run(cfg, train_data, tokenizer, math.inf)
    assert abs(unclipped[-1]["loss"] - reference[-1]["loss"]) > 1e-3 * reference[-1]["loss"]


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_max_grad_norm_0_or_less_leaves_the_gradient_unclipped(tiny, one_process_group, fsdp_version):
    # 0 (or less, as in TrainingArguments) disables clipping: a clip to 0 would zero every gradient, and the run would
    # train nothing while logging the unclipped norm.
    cfg = parse_config(["--model_name_or_path", str(tiny["model"]), "--dataset_name", "unused", "--fsdp_version",
                        str(fsdp_version), "--mixed_precision", "no"])
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    ids = torch.randint(5, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def clipped(max_norm: float) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        token_loss_sum(model(input_ids=ids).logits, ids).backward()
        norm = clip_grad_norm(model, max_norm).item()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        return norm, torch.cat([g.flatten() for g in grads])

    norm, unclipped = clipped(math.inf)
    assert norm == pytest.approx(unclipped.norm().item(), rel=1e-5) and norm > 2  # the default of 1 would clip it
    for max_norm in (0.0, -1.0):
        disabled_norm, grad = clipped(max_norm)
        assert disabled_norm == norm and torch.equal(grad, unclipped), max_norm
    # A positive max_norm does clip, so the comparison above can fail.
    assert clipped(norm / 4)[1].norm().item() == pytest.approx(norm / 4, rel=1e-4)


def test_a_warmup_fraction_is_of_the_run_the_scheduler_follows(tiny, tmp_path, one_process_group, capsys):
    # warmup_steps 0.5 of a 4-step run (max_steps) whose data would give 32 steps an epoch: 2 steps of warm-up, then
    # the linear decay to 0 at step 4, as TrainingArguments counts them (tests/test_warmup.py).
    cfg = parse_config([str(arg) for arg in [
        "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path,
        "--max_steps", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
        "--mixed_precision", "no", "--max_seq_length", "64", "--learning_rate", "0.01", "--lr_scheduler_type",
        "linear", "--warmup_steps", "0.5"]])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    tokenizer = load_tokenizer(cfg)
    train_data, _ = build_datasets(cfg, tokenizer)
    assert len(train_data) // 8 == 32
    train(cfg, env, shard_model(load_model(cfg), resolve_plan(cfg)), tokenizer, train_data,
          MetricsLogger(cfg, is_main=True))
    assert "training: 4 steps (2 of warm-up) of 2 x 4 sequences" in capsys.readouterr().out
    assert [m["learning_rate"] for m in read_metrics(tmp_path / "metrics.jsonl")] == pytest.approx(
        [0.0, 0.005, 0.01, 0.005], rel=1e-12)
