"""Token-weighted loss: one optimizer step has the same gradient however its global batch is split.

The loss of a step is the sum of per-token losses over all micro-batches and all ranks, divided by the number of
label tokens in the whole step (see tests/drivers/loss_grads.py for the cases).
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, GptOssConfig, Trainer

from fsdp_recipes.config import TrainConfig
from fsdp_recipes.data import IGNORE_INDEX
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import shard_model, state_dict_name
from fsdp_recipes.trainer import build_optimizer, token_loss_sum

from conftest import torchrun


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
