"""FLOPs per token, counted from the model's parameters, against the formula written out by hand."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (AutoModelForCausalLM, BloomConfig, DbrxConfig, DeepseekV3Config, FalconMambaConfig,
                          Gemma3ForCausalLM, Gemma3TextConfig, Gemma4AudioConfig, Gemma4Config,
                          Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig, GPT2Config,
                          GPTNeoConfig, GptOssConfig, JetMoeConfig, Lfm2Config, Llama4TextConfig, LlamaConfig,
                          LlamaForCausalLM, Mamba2Config, MambaConfig, MistralConfig, MixtralConfig, MixtralForCausalLM,
                          NemotronHConfig, PretrainedConfig, Qwen2Config, Qwen2MoeConfig, Qwen3NextConfig, RwkvConfig,
                          RwkvForCausalLM, xLSTMConfig)

from conftest import REPO, read_metrics, torchrun
from fsdp_recipes import demo
from fsdp_recipes.flops import (active_matmul_params, attended_lengths, build_meta_model, peak_flops, peak_flops_of,
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


TINY = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
TINY_MOE = dict(TINY, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("config", [  # Qwen2-MoE's shared expert is gated
    GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4),  # Conv1D projections, a tied lm_head
    BloomConfig(vocab_size=100, hidden_size=64, n_layer=2, n_head=4),  # fused query-key-value, ALiBi
    MixtralConfig(**TINY, num_key_value_heads=2, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    Qwen2MoeConfig(**TINY_MOE, num_key_value_heads=2, num_experts=4, shared_expert_intermediate_size=64),
    DeepseekV3Config(**TINY_MOE, num_key_value_heads=4, intermediate_size=128, q_lora_rank=24, kv_lora_rank=16,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                     first_k_dense_replace=1, n_group=1, topk_group=1),  # latent attention, a dense first layer
], ids=lambda config: config.model_type)
def test_count_equals_torchs_count_of_a_forward_and_backward(config):
    # Eager attention computes every query-key pair of the row (the causal half masked), as the count does; eager
    # experts multiply only the tokens routed to them: however unevenly a batch routes, each token goes to 2 of 4.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    ids = torch.randint(100, (2, 32))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    # transformers 5.17's eager experts add 256 FLOPs per MoE layer and batch, whatever the tokens (measured at the
    # floors; 0 in 5.25): no per-token work the count could miss.
    assert counter.get_total_flops() == pytest.approx(training_flops_per_token(model, 32) * ids.numel(),
                                                      abs=256 * config.num_hidden_layers, rel=0)


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
    # A config of a model's own code (trust_remote_code) keeps config.json's window without layer_types: off too.
    remote = PretrainedConfig(num_hidden_layers=2, num_attention_heads=4, sliding_window=4096, use_sliding_window=False)
    assert attended_lengths(remote, 8192) == [8192, 8192]
    assert attended_lengths(LlamaConfig(num_hidden_layers=2), 8192) == [8192, 8192]
    # GPT-Neo alternates global and local layers (a window of 256 in the hub's models); the local ones counted the row.
    gpt_neo = GPTNeoConfig(num_layers=4, attention_types=[[["global", "local"], 2]], window_size=256)
    assert attended_lengths(gpt_neo, 2048) == [2048, 256, 2048, 256]
    # Llama 4: 3 chunked layers of every 4 attend within their chunk of 8192 tokens, the 4th to the whole row.
    llama4 = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8192)
    assert attended_lengths(llama4, 16384) == [8192, 8192, 8192, 16384]
    assert attended_lengths(llama4, 4096) == [4096] * 4


def test_moe_counts_only_the_routed_experts():
    config = MixtralConfig(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, **DIMS)
    model = MixtralForCausalLM(config)
    dense = llama_matmul_params(1000, 64, 128, 3, kv_dim=2 * 16) - 3 * 3 * 64 * 128
    router = 3 * 8 * 64
    experts = 3 * 8 * 3 * 64 * 128
    assert active_matmul_params(model) == dense + router + experts * 2 / 8
    # Mixtral's config sets no head_dim: a head is hidden_size / num_attention_heads = 16 wide, in query and key-value
    # heads alike (2 KV heads of 4 query heads).
    assert config.head_dim is None
    assert training_flops_per_token(model, 256) == 6 * active_matmul_params(model) + 12 * 3 * 4 * 16 * 256


def test_moe_experts_are_found_by_their_fused_tensor_not_their_module_name():
    # JetMoE: its MLP's experts are mlp.input_linear and mlp.output_linear; its attention's experts (with their
    # router, which every token passes) in self_attention.experts. 8 experts, 2 per token, a tied lm_head.
    model = build_meta_model(JetMoeConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, kv_channels=16,
                                          intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                                          num_key_value_heads=4))
    mlp_experts = 8 * (2 * 128 * 64 + 64 * 128)  # input_linear (gate and up), output_linear
    attention_experts = 8 * (64 * 64 + 64 * 64)  # query and output, per expert: 4 heads x 16
    routers, kv_proj = 2 * 8 * 64, 2 * 4 * 16 * 64
    expected = 100 * 64 + (mlp_experts + attention_experts) * 2 / 8 + routers + kv_proj
    assert active_matmul_params(model) == expected
    # gpt-oss: its experts' biases are 2-D (one row per expert), and no matmul. 4 experts, 2 per token.
    model = build_meta_model(GptOssConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                          num_local_experts=4, num_experts_per_tok=2))
    attention, router, experts = 2 * 64 * 64 + 2 * 64 * 32, 4 * 64, 4 * (64 * 2 * 32 + 32 * 64)
    assert active_matmul_params(model) == 100 * 64 + attention + router + experts * 2 / 4


def test_dbrx_counts_the_routed_experts_its_ffn_config_names():
    # DBRX keeps its experts' counts in ffn_config (4, 2 per token): all 4 were counted, twice the experts' FLOPs.
    model = build_meta_model(DbrxConfig(vocab_size=100, d_model=64, n_heads=4, n_layers=1,
                                        attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
                                        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)))
    attention = (64 + 2 * 2 * 16) * 64 + 64 * 64  # Wqkv: 4 query and 2 key-value heads of 16; out_proj
    router, experts = 4 * 64, 4 * 3 * 32 * 64  # w1, v1, w2: each expert's 32 x 64, stacked
    assert active_matmul_params(model) == 100 * 64 + attention + router + experts * 2 / 4


def test_gemma4_counts_each_layers_head_dim_and_no_per_layer_lookup_table():
    # A sliding layer (head_dim 16), then a full one (global_head_dim 32, which transformers keeps per layer and
    # refuses to read as config.head_dim); 4 query and 2 KV heads, a window of 8, tied embeddings.
    dims = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=500)
    model = build_meta_model(Gemma4TextConfig(**dims))
    attention = sum(64 * (4 + 2 + 2) * head_dim + 4 * head_dim * 64 for head_dim in (16, 32))  # q, k, v; o
    mlp = 2 * 3 * 64 * 128
    # Per-layer inputs: the model's projection to 2 layers x 8, each layer's gate and projection. Their table,
    # embed_tokens_per_layer (500 x 2 x 8), is a lookup like the input embedding.
    per_layer_inputs = 64 * 2 * 8 + 2 * (64 * 8 + 8 * 64)
    expected = attention + mlp + per_layer_inputs + 1000 * 64  # the tied lm_head
    assert active_matmul_params(model) == expected
    assert attended_lengths(model.config, 64) == [8, 64]
    assert training_flops_per_token(model, 64) == 6 * expected + 12 * 4 * (16 * 8 + 32 * 64)
    # The hub's Gemma 4 checkpoints are multimodal: the same language model, and vision and audio towers (472M
    # parameters at their default sizes) that do not run on text.
    multimodal = build_meta_model(Gemma4Config(text_config=dims, vision_config=Gemma4VisionConfig(),
                                               audio_config=Gemma4AudioConfig()))
    assert active_matmul_params(multimodal) == expected
    assert training_flops_per_token(multimodal, 64) == training_flops_per_token(model, 64)

    # Gemma 4's mixture of experts routes each token to top_k_experts of num_experts (and keeps the dense MLP).
    moe = build_meta_model(Gemma4TextConfig(**dims, enable_moe_block=True, num_experts=16, top_k_experts=2,
                                            moe_intermediate_size=32))
    router = 2 * 16 * 64
    experts = 2 * 16 * (2 * 32 * 64 + 64 * 32)  # gate_up_proj, down_proj
    assert active_matmul_params(moe) == expected + router + experts * 2 / 16
    # The hub's Gemma 4 mixture of experts is multimodal too: its experts are routed as in the language model alone.
    moe_dims = dict(dims, enable_moe_block=True, num_experts=16, top_k_experts=2, moe_intermediate_size=32)
    multimodal_moe = build_meta_model(Gemma4Config(text_config=moe_dims, vision_config=None, audio_config=None))
    assert active_matmul_params(multimodal_moe) == expected + router + experts * 2 / 16


def test_linear_attention_layers_add_no_attention_term():
    # Qwen3-Next: three gated-delta-net (linear_attention) layers, then one of softmax attention; MoE in each layer.
    config = Qwen3NextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8)
    model = build_meta_model(config)
    # A delta-net layer's convolution (64 channels x 4 taps, 3-D as the experts' tensors are) runs for every token,
    # like its projections: query, key (2 heads x 8), value, z (4 heads x 8); b and a (4 heads each); out.
    delta_net = 64 * 4 + (2 * 16 + 2 * 32) * 64 + 2 * 4 * 64 + 64 * 32
    softmax = (2 * 4 * 16 + 2 * 2 * 16) * 64 + 64 * 64  # q_proj (queries and their gates), k, v; o_proj
    moe = 8 * 64 + 8 * (2 * 32 * 64 + 64 * 32) * 2 / 8 + 3 * 32 * 64 + 64  # router, experts, shared expert, its gate
    assert active_matmul_params(model) == 1000 * 64 + 3 * delta_net + softmax + 4 * moe
    assert attended_lengths(config, 512) == [0, 0, 0, 512]
    assert training_flops_per_token(model, 512) == 6 * active_matmul_params(model) + 12 * 4 * 16 * 512
    # Nemotron-H: a Mamba layer, an attention layer, an MLP-only and a MoE-only layer (pattern "M*-E"); LFM2's
    # convolution layers. Only the attention layers attend.
    assert attended_lengths(NemotronHConfig(num_hidden_layers=4, hybrid_override_pattern="M*-E"), 512) == [0, 512, 0, 0]
    lfm2 = Lfm2Config(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"])
    assert attended_lengths(lfm2, 512) == [0, 512, 0, 512]



@pytest.mark.parametrize("config_class, dims", [(MambaConfig, {}), (FalconMambaConfig, {}), (RwkvConfig, {}),
                                                (Mamba2Config, dict(num_heads=8, head_dim=16)), (xLSTMConfig, {})])
def test_attention_free_models_count_their_matmuls_alone(config_class, dims):
    # Their configs have no num_attention_heads (Mamba's declares linear_attention layers, the others no layer types):
    # the trainer's mfu stopped the run at its first logging step (AttributeError) on a GPU with a known peak.
    model = build_meta_model(config_class(vocab_size=100, hidden_size=64, num_hidden_layers=2, **dims))
    flops = 6 * active_matmul_params(model)
    assert training_flops_per_token(model, 64) == training_flops_per_token(model, 4096) == flops
    assert attended_lengths(model.config, 4096) == [0, 0]


def test_elementwise_parameters_count_no_matmul():
    # Mamba's A_log (128 x 8 here) decays the scan's state elementwise; its depthwise convolution's weight (128 x 4)
    # multiplies once per token, as a matmul's would. The lm_head is tied.
    mamba = build_meta_model(MambaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, state_size=8, expand=2,
                                         conv_kernel=4, time_step_rank=8))
    in_proj, conv, x_proj, dt_proj, out_proj = 64 * 2 * 128, 128 * 4, 128 * (8 + 2 * 8), 8 * 128, 128 * 64
    assert active_matmul_params(mamba) == 100 * 64 + in_proj + conv + x_proj + dt_proj + out_proj
    # RWKV's time_mix_* (1 x 1 x 64) interpolate each token with the previous one; its recurrence is elementwise too,
    # so the count is all that torch's counter finds in a forward and backward.
    torch.manual_seed(0)
    rwkv = RwkvForCausalLM(RwkvConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, intermediate_size=128))
    ids = torch.randint(100, (2, 16))
    with FlopCounterMode(display=False) as counter:
        rwkv(input_ids=ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == training_flops_per_token(rwkv, 16) * ids.numel()


def test_latent_attention_counts_query_key_and_value_widths():
    # DeepSeek V3's multi-head latent attention: config.head_dim is the rotary part of a query-key head only (8);
    # QK^T runs over qk_nope_head_dim + qk_rope_head_dim = 24, AV over v_head_dim = 12, in each of 2 layers.
    config = DeepseekV3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)
    model = build_meta_model(config)
    assert config.head_dim == 8
    attention = 2 * 2 * 4 * (24 * 512 + 12 * 512) * 3  # layers x 2 FLOPs x heads x (QK^T + AV) x forward+backward
    assert training_flops_per_token(model, 512) == 6 * active_matmul_params(model) + attention


def test_peak_flops_unknown_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_peak_flops_by_the_name_torch_gives():
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == peak_flops_of("NVIDIA H200") == 989e12  # SXM
    assert peak_flops_of("NVIDIA H200 NVL") == peak_flops_of("NVIDIA H100 NVL") == 835e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA GH200 480GB") == 989e12
    # The datasheets' dense figures, not those "with sparsity" (twice as large: 624 and 733 TFLOPS).
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == peak_flops_of("NVIDIA A100 80GB PCIe") == 312e12
    assert peak_flops_of("NVIDIA L40S") == 362e12
    assert peak_flops_of("NVIDIA GeForce RTX 4090") is None


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_trainer_logs_mfu_of_a_model_with_per_layer_head_dims(tmp_path, fsdp_version):
    """The MFU path of a GPU with a known peak, on the CPU: two processes train a tiny Gemma 4, multimodal as the
    hub's checkpoints are (without their towers), whose full-attention layer has a head_dim of its own; the logged
    mfu is one device's share of the step's tokens/s x the FLOPs per token at its mean row length over the peak.
    FSDP1's parameters are flat 1-D shards, without the shapes the count needs."""
    tokenizer = demo.build_tokenizer()
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=len(tokenizer), **special)
    config = Gemma4Config(text_config=text, vision_config=None, audio_config=None, **special)
    torch.manual_seed(0)
    Gemma4ForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    demo.write_jsonl(tmp_path / "train.jsonl", demo.make_split(seed=1, n_train=16, n_eval=0)[0])
    peak = 1e12
    torchrun(REPO / "tests" / "drivers" / "known_peak_run.py", peak, "recipes/sft.py", "--model_name_or_path",
             tmp_path / "model", "--dataset_name", tmp_path / "train.jsonl", "--output_dir", tmp_path / "run",
             "--max_steps", "2", "--per_device_train_batch_size", "4", "--max_seq_length", "64",
             "--mixed_precision", "no", "--save_dtype", "float32", "--fsdp_version", fsdp_version)
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    architecture = build_meta_model(config)
    for m in metrics:
        # One micro-batch of 4 rows per step on each rank, padded to its longest: the token slots of 8 rows.
        row_length = m["input_tokens"] / m["real_token_share"] / 8
        assert row_length > 8  # longer than the window, so both head_dims count
        flops = training_flops_per_token(architecture, round(row_length))
        assert m["mfu"] == pytest.approx(m["tokens_per_second"] / 2 * flops / peak, rel=1e-12)
