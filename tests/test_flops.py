"""FLOPs per token, counted from the model's parameters, against the formula written out by hand."""

import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MixtralConfig, MixtralForCausalLM, Qwen2Config)

from fsdp_recipes.flops import (active_matmul_params, attended_lengths, peak_flops, peak_flops_of,
                                training_flops_per_token)

DIMS = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


def llama_matmul_params(vocab, hidden, inter, layers, kv_dim):
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim
    return layers * (attention + 3 * hidden * inter) + vocab * hidden  # lm_head; the input embedding is a lookup


def test_dense_model_counts_lm_head_once_whether_tied_or_not():
    for tied in (False, True):
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=128, tie_word_embeddings=tied, **DIMS))
        expected = llama_matmul_params(1000, 64, 128, 3, kv_dim=2 * 16)
        assert active_matmul_params(model) == expected
        assert training_flops_per_token(model, seq_len=256) == 6 * expected + 12 * 3 * 4 * 16 * 256


def test_sliding_window_layers_attend_to_the_window_only():
    # Gemma 3: 5 sliding layers of every 6 (window 512), then a full one; at 2048 tokens the attention term
    # counts 5 x 512 + 2048 keys per 6 layers.
    config = Gemma3TextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=512)
    model = Gemma3ForCausalLM(config)
    assert attended_lengths(config, 2048) == [512] * 5 + [2048]
    assert attended_lengths(config, 256) == [256] * 6  # shorter than the window: the whole row
    assert training_flops_per_token(model, 2048) == 6 * active_matmul_params(model) + 12 * 4 * 16 * (5 * 512 + 2048)
    # Mistral v0.1 slides in every layer; Qwen2's window applies only with use_sliding_window.
    assert attended_lengths(MistralConfig(num_hidden_layers=2, sliding_window=4096), 8192) == [4096, 4096]
    assert attended_lengths(MistralConfig(num_hidden_layers=2, sliding_window=None), 8192) == [8192, 8192]
    assert attended_lengths(Qwen2Config(num_hidden_layers=2, sliding_window=4096), 8192) == [8192, 8192]
    assert attended_lengths(LlamaConfig(num_hidden_layers=2), 8192) == [8192, 8192]


def test_moe_counts_only_the_routed_experts():
    config = MixtralConfig(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, **DIMS)
    model = MixtralForCausalLM(config)
    dense = llama_matmul_params(1000, 64, 128, 3, kv_dim=2 * 16) - 3 * 3 * 64 * 128
    router = 3 * 8 * 64
    experts = 3 * 8 * 3 * 64 * 128
    assert active_matmul_params(model) == dense + router + experts * 2 / 8


def test_peak_flops_unknown_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_peak_flops_by_the_name_torch_gives():
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == peak_flops_of("NVIDIA H200") == 989e12  # SXM
    assert peak_flops_of("NVIDIA H200 NVL") == peak_flops_of("NVIDIA H100 NVL") == 835e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA GeForce RTX 4090") is None
