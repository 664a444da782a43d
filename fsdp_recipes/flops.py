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
    ("H200", 989e12),  # SXM
    ("GH200", 989e12),
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


def active_matmul_params(model: nn.Module) -> float:
    """Parameters one token multiplies through: all but the input embedding (a lookup) and the norms and biases
    (1-D, no matmul); of a mixture-of-experts layer's experts only the num_experts_per_tok it is routed to."""
    config = model.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    routed = getattr(config, "num_experts_per_tok", None)
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    total = 0.0
    for name, param in model.named_parameters():  # a tied lm_head appears once, as the embedding
        if param.ndim < 2:
            continue
        if param is embedding:
            if output is not None and output.weight is embedding:  # tied: still a matmul, as lm_head
                total += param.numel()
            continue
        share = routed / experts if experts and routed and ".experts." in f".{name}." else 1.0
        total += param.numel() * share
    return total


def attended_lengths(config, seq_len: int) -> list[int]:
    """The keys a query attends to in each decoder layer: seq_len, or the sliding window in a layer that has one
    (every layer of Mistral v0.1 and Phi-3 mini; 5 of every 6 of Gemma 3's, per config.layer_types)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [seq_len] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return [min(seq_len, window) if kind == "sliding_attention" else seq_len for kind in types]


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward and backward FLOPs per token (PaLM, appendix B): 6 per active matmul parameter, plus attention's
    12 * heads * head_dim * (the keys attended to), summed over the layers. Activation-checkpointing recomputation
    is not counted (MFU, not HFU)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_attention_heads * head_dim * sum(attended_lengths(config, seq_len))
    return 6 * active_matmul_params(model) + attention
