"""Model FLOPs per trained token and the peak FLOP/s of known accelerators, for MFU (model FLOPs utilisation)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name(); the first match wins.
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # SXM, and GH200 (Grace Hopper: "NVIDIA GH200 480GB")
    ("A100", 312e12),
    ("L40S", 362e12),
]


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (CPUs, unlisted GPUs): MFU is then not logged."""
    return None if device.type != "cuda" else peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> float | None:
    """The dense bf16 peak of the accelerator torch names `device_name`, or None where it is not listed."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def build_meta_model(config: PretrainedConfig, dtype: torch.dtype | None = None,
                     trust_remote_code: bool = False) -> nn.Module:
    """The model with every tensor on the meta device: shapes and dtypes only, nothing allocated or read."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # a tied lm_head is the embedding, counted once by parameters()
    return model


# Parameters of two or more dimensions that no matmul reads: Mamba's state decay A_log (d_inner x d_state, applied
# elementwise in the scan; FalconMamba's and Jamba's too) and RWKV's token-shift mixes time_mix_* (1 x 1 x hidden).
ELEMENTWISE = ("A_log", "time_mix_")


def active_matmul_params(model: nn.Module) -> float:
    """Parameters one token multiplies through: the lm_head, and the language model's but its embeddings (lookups:
    the input embedding, Gemma 3n's and 4's per-layer input embeddings, learned positions), its norms and biases and
    its ELEMENTWISE parameters (no matmul); a convolution's weights over the tokens (Mamba's, LFM2's) count as a
    matmul's, each multiplying once per token; of a mixture-of-experts layer's experts only the share a token is
    routed to (expert_counts). A multimodal model's vision and audio towers do not run on text."""
    config = model.config.get_text_config()
    experts, routed = expert_counts(config)
    decoder = model.get_decoder()
    lookups = {id(module.weight) for module in decoder.modules() if isinstance(module, nn.Embedding)}
    total = float(model.get_output_embeddings().weight.numel())  # tied to the input embedding or not, a matmul
    for name, param in decoder.named_parameters():
        elementwise = name.endswith("bias") or name.rsplit(".", 1)[-1].startswith(ELEMENTWISE)  # gpt-oss's biases: 2-D
        if param.ndim < 2 or id(param) in lookups or elementwise:
            continue
        share = routed / experts if experts and routed and is_expert_weight(name, param, experts) else 1.0
        total += param.numel() * share
    return total


def expert_counts(config) -> tuple[int | None, int | None]:
    """A mixture of experts' experts per layer and how many of them a token is routed to: num_local_experts or
    num_experts, and num_experts_per_tok or Gemma 4's top_k_experts (the configs' attribute maps give these names to
    DeepSeek's n_routed_experts and Ernie 4.5's moe_num_experts and moe_k); DBRX's ffn_config holds its own
    (moe_num_experts, moe_top_k). None for a dense model."""
    ffn = getattr(config, "ffn_config", None)  # DBRX
    if getattr(ffn, "moe_num_experts", None):
        return ffn.moe_num_experts, ffn.moe_top_k
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return experts, getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k_experts", None)


def is_expert_weight(name: str, param: nn.Parameter, experts: int) -> bool:
    """A weight of the experts a token is routed to: in a module named experts, but for a router (JetMoE's attention
    router sits in one), or a fused tensor whose first dimension is the experts (JetMoE's mlp.input_linear)."""
    in_experts = ".experts." in f".{name}." and ".router." not in f".{name}."
    return in_experts or (param.ndim == 3 and param.shape[0] == experts)


# Layer types (config.layer_types) without softmax attention: recurrent and convolutional mixers (Qwen3-Next's
# gated delta net, Mamba, LFM2's conv; transformers files them all as linear_attention) and Nemotron-H's MLP-only
# and MoE-only layers. Their projections are in the parameters; they add no attention term. Their recurrence (Mamba's
# selective scan, Mamba 2's chunked scan, the gated delta rule, RG-LRU, mLSTM) is not counted either, as MFU's
# convention of 6 per parameter plus softmax attention leaves it out: at 2,048 tokens, torch's FlopCounterMode finds
# 1.6% more FLOPs than this count in a Qwen3-Next layer pair (hidden 2,048) and 3.7% more in Falcon-H1 layers
# (hidden 3,072, a 256-wide state), nearly all in the scans' matmuls.
NO_SOFTMAX_ATTENTION = ("linear_attention", "mamba", "conv", "mlp", "moe")


def layer_configs(config) -> list:
    """Each decoder layer's config: Gemma 4's full-attention layers, for one, have a head_dim of their own (its
    global_head_dim), which transformers keeps in config.per_layer_config and refuses to read as config.head_dim."""
    per_layer = getattr(config, "per_layer_config", None)  # absent in transformers without per-layer attributes
    return list(per_layer) if per_layer is not None else [config] * config.num_hidden_layers


def attended_lengths(config, seq_len: int) -> list[int]:
    """The keys a query attends to through softmax attention in each decoder layer: seq_len; the sliding window in
    a layer that has one (every layer of Mistral v0.1 and Phi-3 mini; 5 of every 6 of Gemma 3's, per
    config.layer_types; GPT-Neo's local layers); the chunk in Llama 4's chunked layers; none in a layer without
    softmax attention (NO_SOFTMAX_ATTENTION). Another attention type (a sparse one) counts the whole row, an upper
    bound."""
    lengths = []
    for kind, layer in zip(layer_types(config), layer_configs(config)):
        if kind in NO_SOFTMAX_ATTENTION:
            lengths.append(0)
        elif kind == "sliding_attention":  # no window set (Qwen2 without use_sliding_window): the whole row
            window = getattr(layer, "sliding_window", None) or getattr(layer, "window_size", None)  # GPT-Neo's
            lengths.append(min(seq_len, window or seq_len))
        elif kind == "chunked_attention":
            lengths.append(min(seq_len, getattr(layer, "attention_chunk_size", None) or seq_len))
        else:
            lengths.append(seq_len)
    return lengths


def layer_types(config) -> list[str]:
    """config.layer_types, or for a config without them: no softmax attention in a model without attention heads
    (Mamba 2, FalconMamba, RWKV, xLSTM); GPT-Neo's attention_layers; every layer sliding where the config has a
    window in use (Mistral v0.1, Phi-3 mini; Qwen2's only with use_sliding_window); else every layer full
    attention."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    if getattr(config, "num_attention_heads", None) is None:
        return ["linear_attention"] * config.num_hidden_layers
    if getattr(config, "attention_layers", None):  # GPT-Neo's "local" layers attend to the last window_size tokens
        return ["sliding_attention" if kind == "local" else "full_attention" for kind in config.attention_layers]
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward and backward FLOPs per token (PaLM, appendix B): 6 per active matmul parameter, plus attention's
    6 * heads * (query-key width + value width) * (the keys attended to), summed over the layers, each with its own
    widths (12 * heads * head_dim * keys where both are head_dim). Activation-checkpointing recomputation is not
    counted (MFU, not HFU), nor a recurrent layer's scan (NO_SOFTMAX_ATTENTION)."""
    config = model.config.get_text_config()  # a multimodal model's (Gemma 3 and 4): its language model's
    attention = 0
    for layer, keys in zip(layer_configs(config), attended_lengths(config, seq_len)):
        if not keys:  # no softmax attention: Mamba's layers have no attention heads to read
            continue
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
        # Multi-head latent attention (DeepSeek V2/V3, MiniCPM3): head_dim is only the rotary part of a query-key
        # head; QK^T runs over qk_head_dim (rotary + non-rotary), AV over v_head_dim.
        qk_width = getattr(layer, "qk_head_dim", None) or head_dim
        v_width = getattr(layer, "v_head_dim", None) or head_dim
        attention += 6 * layer.num_attention_heads * (qk_width + v_width) * keys
    return 6 * active_matmul_params(model) + attention
