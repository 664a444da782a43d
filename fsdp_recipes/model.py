"""Load the tokenizer and the model, by hub id or local folder, through `from_pretrained`."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .config import TrainConfig


def load_tokenizer(cfg: TrainConfig):
    tokenizer = AutoTokenizer.from_pretrained(
        cfg.tokenizer_name_or_path or cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code
    )
    if tokenizer.pad_token is None:
        # Padding positions carry no loss and are masked out of attention, so any token will do.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def export_dtype(cfg: TrainConfig) -> torch.dtype:
    """save_dtype, where "auto" means the dtype the checkpoint was saved in (e.g. bf16 for most hub models)."""
    if cfg.save_dtype != "auto":
        return getattr(torch, cfg.save_dtype)
    config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_model(cfg: TrainConfig) -> PreTrainedModel:
    """The model in fp32: these are the master weights that the optimizer updates."""
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model_name_or_path,
        dtype=torch.float32,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
    )
    model.config.use_cache = False  # the KV cache only costs memory in training
    return model
