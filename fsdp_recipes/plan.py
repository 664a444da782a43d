"""The sharding plan: what FSDP will do, resolved from the recipe config and the accelerate config.

`accelerate launch --config_file X.yaml` exports the YAML's `fsdp_config` as FSDP_* environment variables and
`mixed_precision` as ACCELERATE_MIXED_PRECISION. accelerate itself drops FSDP on CPU without a word, so the project
reads those variables and applies the plan with torch APIs: the same YAML works on GPU (NCCL) and CPU (gloo).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .config import ConfigError, TrainConfig


@dataclass
class ShardingPlan:
    fsdp_version: int
    layer_cls_names: Optional[list[str]]  # None: the model's _no_split_modules
    reshard_after_forward: bool
    mixed_precision: str  # "bf16" or "no"
    overrides: list[str]  # recipe settings that replaced the accelerate config's, reported at start
    wrapped: str = ""  # filled by shard_model, e.g. "16 x LlamaDecoderLayer"


def _env_bool(name: str) -> Optional[bool]:
    value = os.environ.get(name)
    return None if value is None else value.strip().lower() in ("1", "true", "yes")


def _reject_unsupported_env() -> None:
    unsupported = {
        "FSDP_OFFLOAD_PARAMS": "CPU offload",
        "FSDP_ACTIVATION_CHECKPOINTING": "activation checkpointing",
    }
    for var, what in unsupported.items():
        if _env_bool(var):
            raise ConfigError(f"the accelerate config asks for {what} ({var}=true), which is not supported yet")
    wrap = os.environ.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    if wrap != "TRANSFORMER_BASED_WRAP":
        raise ConfigError(f"fsdp_auto_wrap_policy {wrap} is not supported yet: use TRANSFORMER_BASED_WRAP")


def resolve_plan(cfg: TrainConfig) -> ShardingPlan:
    """Recipe config first, then the accelerate config, then the project's defaults."""
    overrides: list[str] = []

    def pick(name: str, recipe_value, env_value, default):
        if recipe_value is not None and env_value is not None and recipe_value != env_value:
            overrides.append(f"{name}: recipe config {recipe_value!r} overrides accelerate config {env_value!r}")
        if recipe_value is not None:
            return recipe_value
        return env_value if env_value is not None else default

    if _env_bool("ACCELERATE_USE_FSDP"):
        _reject_unsupported_env()
    env_version = os.environ.get("FSDP_VERSION")
    fsdp_version = pick("fsdp_version", cfg.fsdp_version, int(env_version) if env_version else None, 2)
    if fsdp_version != 2:
        raise ConfigError(f"fsdp_version {fsdp_version} is not supported yet: use fsdp_version 2")

    env_layers = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    layers = pick("fsdp_transformer_layer_cls_to_wrap", cfg.fsdp_transformer_layer_cls_to_wrap, env_layers, None)

    env_precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    mixed_precision = pick("mixed_precision", cfg.mixed_precision, env_precision, "bf16")
    if mixed_precision not in ("bf16", "no"):
        raise ConfigError(f"mixed_precision must be bf16 or no, got {mixed_precision!r}")

    return ShardingPlan(
        fsdp_version=fsdp_version,
        layer_cls_names=[n.strip() for n in layers.split(",")] if layers else None,
        reshard_after_forward=_env_bool("FSDP_RESHARD_AFTER_FORWARD") is not False,
        mixed_precision=mixed_precision,
        overrides=overrides,
    )
