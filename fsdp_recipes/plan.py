"""The sharding plan: what FSDP will do, resolved from the recipe config and the accelerate config.

`accelerate launch --config_file X.yaml` exports the YAML's `fsdp_config` as FSDP_* environment variables,
`parallelism_config` as PARALLELISM_CONFIG_* and `mixed_precision` as ACCELERATE_MIXED_PRECISION. accelerate itself
drops FSDP on CPU without a word, so the project reads those variables and applies the plan with torch APIs: the same
YAML works on GPU (NCCL) and CPU (gloo).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from .config import ConfigError, TrainConfig

FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP")
PRECISIONS = ("bf16", "no", "pure_bf16")


def check_flash_precision(attn_implementation: str, mixed_precision: str) -> None:
    """A flash kernel (flash_attention_2, or a Hub kernel such as kernels-community/flash-attn3) with mixed_precision
    no: refused by the run at start, and by the memory estimate, which would otherwise plan a run that cannot train."""
    if mixed_precision == "no" and "flash" in attn_implementation:
        # transformers only warns, and passes fp32 queries on to the kernel, which refuses them at the first step.
        raise ConfigError(f"attn_implementation {attn_implementation} computes in bf16 or fp16 only, and "
                          f"mixed_precision no runs the model in fp32: use mixed_precision bf16 (fp32 master weights, "
                          f"bf16 compute), or attn_implementation sdpa")


@dataclass
class ShardingPlan:
    fsdp_version: int
    sharding_strategy: str  # FSDP1's; FSDP2 reads reshard_after_forward and dp_replicate_size instead
    reshard_after_forward: bool
    dp_replicate_size: Optional[int]  # None: FSDP1 HYBRID_SHARD uses the number of nodes, FSDP2 no replication
    auto_wrap_policy: str
    layer_cls_names: Optional[list[str]]  # None: the model's _no_split_modules, else its decoder layers
    min_num_params: int
    offload_params: bool
    activation_checkpointing: bool
    cpu_ram_efficient_loading: bool
    mixed_precision: str  # "bf16", "no" or "pure_bf16"
    backward_prefetch: Optional[str]  # FSDP1 only; None: torch's default (BACKWARD_PRE)
    torch_compile: bool = False  # the recipe config's torch_compile: compile each decoder layer
    gradient_sync: str = "every_micro_batch"  # the recipe config's gradient_sync
    overrides: list[str] = field(default_factory=list)  # recipe settings that replaced accelerate's, printed at start
    # Filled by shard_model: what was wrapped, which layer classes checkpointing and compile apply to, the mesh.
    wrapped: str = ""
    layer_classes: str = ""
    units_in_compiled_layers: str = ""  # the classes of units inside a compiled layer, which cut its graph
    mesh_shape: tuple = ()
    total_params: int = 0


TRUE, FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


def _env_bool(name: str) -> Optional[bool]:
    """accelerate's truth values (its str_to_bool); anything else is an error, not a silent false."""
    value = os.environ.get(name)
    if value is None:
        return None
    if value.strip().lower() not in TRUE + FALSE:
        raise ConfigError(f"{name.lower().removeprefix('accelerate_')} must be true or false, got {value!r}")
    return value.strip().lower() in TRUE


def _env_name(name: str) -> Optional[str]:
    """An enum setting (FULL_SHARD, SIZE_BASED_WRAP, ...), which accelerate takes in any case."""
    value = os.environ.get(name)
    return None if value is None else value.strip().upper()


def _env_int(name: str) -> Optional[int]:
    """A whole number; accelerate writes 1e8 as "100000000", a YAML may hold "1e8"."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is None or not number.is_integer():
        raise ConfigError(f"the accelerate config's {name.lower()} must be a whole number, got {value!r}")
    return int(number)


# torch's enums in their order from 1, for the numbers accelerate also reads (older `accelerate config` versions
# wrote them).
BACKWARD_PREFETCHES = ("BACKWARD_PRE", "BACKWARD_POST")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")


def env_enum(name: str, members: tuple[str, ...]) -> Optional[str]:
    """An enum setting by name in any case or, as accelerate also reads it, by torch's number for it (`members` in
    torch's order: FSDP1's strategies 1: FULL_SHARD, 2: SHARD_GRAD_OP, 3: NO_SHARD, 4: HYBRID_SHARD)."""
    value = _env_name(name)
    if value is not None and value.isdigit() and 1 <= int(value) <= len(members):
        return members[int(value) - 1]
    return value


def _env_strategy(name: str) -> Optional[str]:
    """FSDP1's sharding strategy, by name or number."""
    return env_enum(name, FSDP1_STRATEGIES)


def _env_reshard(name: str, fsdp1: bool) -> bool | str | None:
    """accelerate's fsdp_reshard_after_forward: true or false for FSDP2, or, as `accelerate config` writes it for
    FSDP1, a sharding strategy: by name, or for an FSDP1 config (`fsdp1`) by number, where FSDP2 reads 1 as true."""
    value = os.environ.get(name)
    if value is None:
        return None
    if _env_name(name) in FSDP1_STRATEGIES or (fsdp1 and _env_strategy(name) in FSDP1_STRATEGIES):
        return _env_strategy(name)
    if value.strip().lower() not in TRUE + FALSE:
        raise ConfigError(f"fsdp_reshard_after_forward must be true or false (FSDP2) or one of "
                          f"{', '.join(FSDP1_STRATEGIES)} (FSDP1), got {value!r}")
    return _env_bool(name)


def _reject_unsupported_env() -> None:
    """accelerate settings this project does not implement: an error, never silently ignored.

    FSDP_SYNC_MODULE_STATES needs nothing: with rank-0 loading the weights are broadcast, otherwise every rank reads
    the same checkpoint.
    """
    for var, what in {
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "offloading checkpointed activations",
        "FSDP_FORWARD_PREFETCH": "forward prefetch",
    }.items():
        if _env_bool(var):
            raise ConfigError(f"the accelerate config asks for {what} ({var.lower()}: true), which is not "
                              f"supported: set it to false or remove it")
    if _env_bool("FSDP_USE_ORIG_PARAMS") is False:
        raise ConfigError("fsdp_use_orig_params false is not supported: the optimizer groups and gradient clipping "
                          "need the original parameters; set it to true")
    if os.environ.get("FSDP_IGNORED_MODULES"):
        raise ConfigError("fsdp_ignored_modules is not supported: remove it from the accelerate config")


def _check_parallelism_config(replicate: Optional[int]) -> None:
    """accelerate's parallelism_config: only its data-parallel sizes (replicate x shard) are implemented, and, as
    accelerate itself requires, they must cover every process the launcher started (checked when `replicate`, the
    replica count from accelerate, is given)."""
    for dim in ("tp", "cp", "sp"):
        size = _env_int(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE")
        if size is not None and size > 1:
            raise ConfigError(f"parallelism_config_{dim}_size {size} is not supported (only data parallelism: "
                              f"dp_replicate_size x dp_shard_size): set it to 1")
    shard, world = _env_int("PARALLELISM_CONFIG_DP_SHARD_SIZE"), _env_int("WORLD_SIZE")
    if replicate is not None and shard is not None and world is not None and replicate * shard != world:
        raise ConfigError(f"parallelism_config_dp_replicate_size {replicate} x parallelism_config_dp_shard_size "
                          f"{shard} is {replicate * shard}, but {world} processes were launched: set them to the "
                          f"number of nodes and the number of GPUs per node")


def resolve_plan(cfg: TrainConfig) -> ShardingPlan:
    """Recipe config first, then the accelerate config, then the project's defaults."""
    overrides: list[str] = []
    dynamo_backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO")
    if dynamo_backend.upper() != "NO":
        raise ConfigError(f"the accelerate config's dynamo_config (dynamo_backend {dynamo_backend}) is not applied: "
                          f"remove it, and set torch_compile true in the recipe config to compile each decoder layer")
    for engine, config in (("DEEPSPEED", "fsdp2_offload.yaml for ZeRO-3 with offload"),
                           ("MEGATRON_LM", "fsdp2.yaml")):
        if _env_bool(f"ACCELERATE_USE_{engine}"):
            raise ConfigError(f"the accelerate config uses {engine.replace('_', '-')}, which these recipes do not "
                              f"run (they apply FSDP): launch with an FSDP config, e.g. accelerate_configs/{config}")
    # Both exported by `accelerate launch`, and applied only by accelerate's own Accelerator, which the recipes
    # do not create.
    if _env_bool("ACCELERATE_CPU_AFFINITY"):
        raise ConfigError("accelerate launch --enable_cpu_affinity is not applied (accelerate sets the affinity in its "
                          "own Accelerator, which these recipes do not use): remove it")
    if _env_bool("ACCELERATE_DEBUG_MODE"):
        raise ConfigError("the accelerate config's debug mode (debug: true, or accelerate launch --debug) is not "
                          "applied (it checks the collectives of accelerate's own operations, which these recipes do "
                          "not use): remove it")
    use_env = bool(_env_bool("ACCELERATE_USE_FSDP"))
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
    if use_env:
        _reject_unsupported_env()
    elif launched_by_accelerate and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # MULTI_GPU or MULTI_CPU: accelerate exports none of the config's fsdp_config, which would go unapplied.
        raise ConfigError("the accelerate config's distributed_type is not FSDP, so accelerate passes none of its "
                          "fsdp_config on: set distributed_type: FSDP, or launch with one of accelerate_configs/ "
                          "(fsdp2.yaml, or fsdp2_cpu.yaml on CPU)")
    elif (launched_by_accelerate and _env_bool("ACCELERATE_USE_CPU") and "RANK" not in os.environ
          and "MASTER_ADDR" in os.environ):
        # accelerate's one-process launcher (`--cpu`, which skips FSDP's launcher, or a MULTI_CPU config without
        # mpirun) exports MASTER_ADDR only for a config of several processes, and starts this one alone. It also
        # passes on a MASTER_ADDR of the shell's (a SLURM script's), which the error names.
        raise ConfigError("accelerate launch started this one process for a config of several, and passed none of "
                          "its fsdp_config on: accelerate launch --cpu (or a MULTI_CPU config) runs accelerate's "
                          "one-process launcher. Drop --cpu and launch an FSDP config that stays on the CPU, such as "
                          "accelerate_configs/fsdp2_cpu.yaml (its gpu_ids \"\" hides the GPUs), or run one process "
                          "with python (MASTER_ADDR, which that launcher sets only for several processes, is "
                          f"{os.environ['MASTER_ADDR']}: for one process, unset it where your shell exports it)")

    def env(getter, name):
        return getter(name) if use_env else None

    def pick(name: str, recipe_value, env_value, default):
        if recipe_value is not None and env_value is not None and recipe_value != env_value:
            overrides.append(f"{name}: recipe config {recipe_value!r} overrides accelerate config {env_value!r}")
        if recipe_value is not None:
            return recipe_value
        return env_value if env_value is not None else default

    version = pick("fsdp_version", cfg.fsdp_version, env(_env_int, "FSDP_VERSION"), 2)
    if version not in (1, 2):
        raise ConfigError(f"fsdp_version must be 1 or 2, got {version}")
    if version == 1 and cfg.torch_compile:
        raise ConfigError("torch_compile needs fsdp_version 2: FSDP1 wraps the layers in flat parameters that "
                          "torch.compile does not trace per layer; set fsdp_version 2 or torch_compile false")

    # accelerate always exports both settings, with FULL_SHARD and true as defaults; each engine reads only its own.
    # Under the recipe config's fsdp_version of the other engine (crossed), the accelerate config's setting is
    # applied in the chosen engine's terms (FULL_SHARD: true, SHARD_GRAD_OP: false), or replaced by the recipe
    # config's own, and the plan prints which.
    env_version = env(_env_int, "FSDP_VERSION")
    crossed = env_version not in (None, version)
    env_strategy = env(_env_strategy, "FSDP_SHARDING_STRATEGY")
    env_reshard = _env_reshard("FSDP_RESHARD_AFTER_FORWARD", fsdp1=env_version == 1) if use_env else None
    if version == 1:
        if cfg.fsdp_reshard_after_forward is not None:
            raise ConfigError("fsdp_reshard_after_forward is an FSDP2 setting: with fsdp_version 1 set "
                              "fsdp_sharding_strategy (FULL_SHARD or SHARD_GRAD_OP) instead")
        if env_reshard is False and not crossed:
            raise ConfigError("the accelerate config sets fsdp_reshard_after_forward false, an FSDP2 setting: with "
                              "fsdp_version 1 use fsdp_sharding_strategy SHARD_GRAD_OP instead")
        if env_reshard is False and cfg.fsdp_sharding_strategy is not None:
            overrides.append(f"fsdp_reshard_after_forward: accelerate config false (FSDP2) replaced by the recipe "
                             f"config's fsdp_sharding_strategy {cfg.fsdp_sharding_strategy}")
        elif env_reshard is False:
            overrides.append("fsdp_reshard_after_forward: accelerate config false (FSDP2) applied as "
                             "fsdp_sharding_strategy SHARD_GRAD_OP with fsdp_version 1")
            env_strategy = "SHARD_GRAD_OP"
        if isinstance(env_reshard, str):
            # accelerate exports fsdp_sharding_strategy as FULL_SHARD when the YAML leaves it out.
            written = {"fsdp_reshard_after_forward": env_reshard}
            if env_strategy not in (None, "FULL_SHARD", env_reshard):
                written["fsdp_sharding_strategy"] = env_strategy
            if cfg.fsdp_sharding_strategy is None and len(written) > 1:
                raise ConfigError(f"the accelerate config sets fsdp_sharding_strategy {env_strategy} and "
                                  f"fsdp_reshard_after_forward {env_reshard}: keep one of them")
            if cfg.fsdp_sharding_strategy is not None and set(written.values()) != {cfg.fsdp_sharding_strategy}:
                # The note names each strategy the accelerate config wrote, under the key it wrote it.
                replaced = " and ".join(f"{key} {value!r}" for key, value in written.items())
                overrides.append(f"fsdp_sharding_strategy: recipe config {cfg.fsdp_sharding_strategy!r} overrides "
                                 f"accelerate config {replaced}")
            env_strategy = None if cfg.fsdp_sharding_strategy is not None else env_reshard
        strategy = pick("fsdp_sharding_strategy", cfg.fsdp_sharding_strategy, env_strategy, "FULL_SHARD")
        if strategy not in FSDP1_STRATEGIES:
            raise ConfigError(f"fsdp_sharding_strategy must be one of {', '.join(FSDP1_STRATEGIES)}, got {strategy}")
        reshard = strategy in ("FULL_SHARD", "HYBRID_SHARD")
    else:
        if cfg.fsdp_sharding_strategy is not None:
            raise ConfigError("fsdp_sharding_strategy is an FSDP1 setting (the recipe config sets it, and "
                              "fsdp_version is 2): with fsdp_version 2 set fsdp_reshard_after_forward (true: "
                              "FULL_SHARD, false: SHARD_GRAD_OP), and dp_replicate_size (accelerate: "
                              "parallelism_config_dp_replicate_size) for HSDP")
        # The FSDP1 strategy the accelerate config names, under either key (FULL_SHARD alone is the default export).
        key, env_fsdp1 = (("fsdp_reshard_after_forward", env_reshard) if isinstance(env_reshard, str) else
                          ("fsdp_sharding_strategy", env_strategy if env_strategy != "FULL_SHARD" else None))
        if env_fsdp1 is not None and not crossed:
            raise ConfigError(f"the accelerate config sets {key} {env_fsdp1}, an FSDP1 sharding strategy, and "
                              f"fsdp_version 2: set fsdp_reshard_after_forward true (FULL_SHARD) or false "
                              f"(SHARD_GRAD_OP), and parallelism_config_dp_replicate_size for HSDP")
        if env_fsdp1 is not None and cfg.fsdp_reshard_after_forward is not None:
            overrides.append(f"{key}: accelerate config {env_fsdp1} (FSDP1) replaced by the recipe config's "
                             f"fsdp_reshard_after_forward {str(cfg.fsdp_reshard_after_forward).lower()}")
            env_reshard = None
        elif env_fsdp1 in ("FULL_SHARD", "SHARD_GRAD_OP"):
            env_reshard = env_fsdp1 == "FULL_SHARD"
            overrides.append(f"{key}: accelerate config {env_fsdp1} (FSDP1) applied as fsdp_reshard_after_forward "
                             f"{str(env_reshard).lower()} with fsdp_version 2")
        elif env_fsdp1 is not None:
            raise ConfigError(f"the accelerate config sets {key} {env_fsdp1}, an FSDP1 sharding strategy with no "
                              f"FSDP2 equivalent: set fsdp_reshard_after_forward in the recipe config (and "
                              f"dp_replicate_size for HSDP), or launch with an FSDP2 accelerate config")
        reshard = pick("fsdp_reshard_after_forward", cfg.fsdp_reshard_after_forward, env_reshard, True)
        strategy = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"

    env_replicate = (_env_int("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")
                     if _env_bool("ACCELERATE_USE_PARALLELISM_CONFIG") else None)
    replicate = pick("dp_replicate_size", cfg.dp_replicate_size, env_replicate, None)
    if env_replicate is not None:
        # A recipe dp_replicate_size replaces accelerate's: accelerate's dp_shard_size then no longer applies.
        _check_parallelism_config(None if cfg.dp_replicate_size is not None else replicate)
    where = "" if cfg.dp_replicate_size is not None else " (the accelerate config's parallelism_config)"
    if version == 1 and replicate not in (None, 1) and strategy != "HYBRID_SHARD":
        raise ConfigError(f"dp_replicate_size {replicate}{where} needs fsdp_sharding_strategy HYBRID_SHARD with "
                          f"fsdp_version 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # a plain `python recipe.py` is one process
    if replicate is not None and (replicate < 1 or world % replicate):
        raise ConfigError(f"dp_replicate_size {replicate}{where} does not divide the {world} processes launched: "
                          f"set it to a divisor, such as the number of nodes")

    env_wrap = env(_env_name, "FSDP_AUTO_WRAP_POLICY")
    env_layers = env(os.environ.get, "FSDP_TRANSFORMER_CLS_TO_WRAP")
    wrap = pick("fsdp_auto_wrap_policy", cfg.fsdp_auto_wrap_policy, env_wrap, "TRANSFORMER_BASED_WRAP")
    if wrap not in WRAP_POLICIES:
        raise ConfigError(f"fsdp_auto_wrap_policy must be one of {', '.join(WRAP_POLICIES)}, got {wrap}")
    checkpointing = pick("fsdp_activation_checkpointing", cfg.fsdp_activation_checkpointing,
                         env(_env_bool, "FSDP_ACTIVATION_CHECKPOINTING"), False)
    # The layer classes are what TRANSFORMER_BASED_WRAP wraps, and what activation checkpointing and torch_compile
    # apply to. accelerate exports them only when its config sets them (unlike fsdp_min_num_params).
    layers_read = wrap == "TRANSFORMER_BASED_WRAP" or checkpointing or cfg.torch_compile
    # The recipe's SIZE_BASED_WRAP too: restating the policy left the accelerate config's layer classes unread unsaid.
    if env_wrap == "SIZE_BASED_WRAP" and env_layers and not layers_read:
        raise ConfigError("the accelerate config sets fsdp_transformer_layer_cls_to_wrap with fsdp_auto_wrap_policy "
                          "SIZE_BASED_WRAP, which does not read it (nor does anything else in this run): remove one "
                          "of the two")
    layers = pick("fsdp_transformer_layer_cls_to_wrap", cfg.fsdp_transformer_layer_cls_to_wrap, env_layers, None)
    min_num_params = pick("fsdp_min_num_params", cfg.fsdp_min_num_params, env(_env_int, "FSDP_MIN_NUM_PARAMS"),
                          100_000_000)
    if wrap == "SIZE_BASED_WRAP" and min_num_params < 1:
        # Every module would then be a unit, those without parameters (activations, rotary embeddings) too.
        raise ConfigError(f"fsdp_min_num_params must be at least 1 with SIZE_BASED_WRAP (a unit is a module holding "
                          f"that many parameters not yet in a unit), got {min_num_params}")
    # Each policy reads one of the two keys: the other would be ignored without a word. (accelerate exports
    # fsdp_min_num_params whatever its policy, as 100000000 when its config leaves it out.)
    if wrap == "TRANSFORMER_BASED_WRAP" and cfg.fsdp_min_num_params is not None:
        raise ConfigError("fsdp_min_num_params is a SIZE_BASED_WRAP setting: remove it, or set "
                          "fsdp_auto_wrap_policy SIZE_BASED_WRAP")
    if (wrap == "TRANSFORMER_BASED_WRAP" and cfg.fsdp_auto_wrap_policy is None
            and env(_env_int, "FSDP_MIN_NUM_PARAMS") not in (None, 100_000_000)):
        raise ConfigError("the accelerate config sets fsdp_min_num_params, which TRANSFORMER_BASED_WRAP does not "
                          "read: remove it, or set fsdp_auto_wrap_policy SIZE_BASED_WRAP")
    if cfg.fsdp_transformer_layer_cls_to_wrap is not None and not layers_read:
        raise ConfigError("fsdp_transformer_layer_cls_to_wrap is read by TRANSFORMER_BASED_WRAP, activation "
                          "checkpointing and torch_compile, none of which this run uses: remove it, or set "
                          "fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP")

    precision = pick("mixed_precision", cfg.mixed_precision, os.environ.get("ACCELERATE_MIXED_PRECISION"), "bf16")
    if precision not in PRECISIONS:  # the recipe config's parser takes only these: the value is accelerate's
        raise ConfigError(f"the accelerate config (or accelerate launch --mixed_precision) sets mixed_precision "
                          f"{precision}, which these recipes do not run: set bf16 or no there, or mixed_precision in "
                          f"the recipe config ({', '.join(PRECISIONS)}), which wins")
    check_flash_precision(cfg.attn_implementation, precision)

    prefetch = env(lambda name: env_enum(name, BACKWARD_PREFETCHES), "FSDP_BACKWARD_PREFETCH")
    if prefetch and version == 2 and env_version == 1:
        # An FSDP1 accelerate config (each shipped one sets it) under the recipe config's fsdp_version 2.
        overrides.append(f"fsdp_backward_prefetch: accelerate config {prefetch!r} is an FSDP1 setting, not applied "
                         f"with fsdp_version 2 (FSDP2 always prefetches)")
        prefetch = None
    if prefetch and version == 2:
        raise ConfigError("the accelerate config sets fsdp_backward_prefetch, an FSDP1 setting (FSDP2 always "
                          "prefetches): remove it")
    if prefetch not in (None, "BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"):
        raise ConfigError(f"fsdp_backward_prefetch must be BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH, got {prefetch}")

    # The checkpoint format (checkpoint.resolve_state_dict_type) is read from either config too: say which won.
    env_state_dict = env(lambda name: env_enum(name, STATE_DICT_TYPES), "FSDP_STATE_DICT_TYPE")
    env_format = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}.get(env_state_dict)
    # LOCAL_STATE_DICT (no format of ours: refused without the recipe's) is replaced by either.
    if cfg.save_state_dict_type and env_state_dict and cfg.save_state_dict_type != env_format:
        overrides.append(f"save_state_dict_type: recipe config {cfg.save_state_dict_type!r} overrides accelerate "
                         f"config fsdp_state_dict_type {env_state_dict!r}")

    offload = pick("fsdp_offload_params", cfg.fsdp_offload_params, env(_env_bool, "FSDP_OFFLOAD_PARAMS"), False)
    if (version == 1 and offload and cfg.gradient_accumulation_steps > 1
            and cfg.gradient_sync == "every_micro_batch"):
        # torch: FSDP1 replaces an offloaded gradient with the newest reduced one instead of adding to it.
        raise ConfigError("FSDP1 with CPU offload cannot accumulate gradients over micro-batches that each reduce "
                          "theirs (torch keeps only the last one): set gradient_sync last_micro_batch (full "
                          "gradients stay on the GPU until the step's last micro-batch), gradient_accumulation_steps "
                          "1, or fsdp_version 2 (on a machine without a GPU the only choice: FSDP1 offload runs on "
                          "a GPU only)")

    return ShardingPlan(
        fsdp_version=version,
        sharding_strategy=strategy,
        reshard_after_forward=reshard,
        dp_replicate_size=replicate,
        auto_wrap_policy=wrap,
        layer_cls_names=[n.strip() for n in layers.split(",")] if layers and layers_read else None,
        min_num_params=min_num_params,
        offload_params=offload,
        activation_checkpointing=checkpointing,
        cpu_ram_efficient_loading=pick("fsdp_cpu_ram_efficient_loading", cfg.fsdp_cpu_ram_efficient_loading,
                                       env(_env_bool, "FSDP_CPU_RAM_EFFICIENT_LOADING"), False),
        mixed_precision=precision,
        backward_prefetch=prefetch,
        torch_compile=cfg.torch_compile,
        gradient_sync=cfg.gradient_sync,
        overrides=overrides,
    )
