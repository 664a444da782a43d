"""Resolving the sharding plan from the recipe config and accelerate's environment variables, and the errors for
settings that cannot work. accelerate exports its config as these variables; the tests set them directly."""

import warnings

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import BackwardPrefetch, FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor
from transformers import MambaConfig, MambaForCausalLM

from fsdp_recipes import demo, fsdp1, sharding
from fsdp_recipes.checkpoint import resolve_state_dict_type
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.estimate import fsdp_groups
from fsdp_recipes.model import load_sharded_model
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import (build_mesh, check_master_dtype, check_tied_parameters_share_a_unit,
                                   describe_plan, find_layer_classes, gradient_sync, shard_model,
                                   size_based_units, tied_parameter_ids)
from test_accelerate_configs import process_group_of

ACCELERATE_DEFAULTS = {  # what `accelerate launch` exports for fsdp2_cpu.yaml, defaults included
    "ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "bf16", "FSDP_VERSION": "2",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_MIN_NUM_PARAMS": "100000000", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_FORWARD_PREFETCH": "false", "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_SYNC_MODULE_STATES": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}


@pytest.fixture
def accelerate_env(monkeypatch):
    for key, value in ACCELERATE_DEFAULTS.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def plan_for(*args):
    return resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", *args]))


def test_defaults_without_a_launcher(monkeypatch):
    for key in ACCELERATE_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    plan = plan_for()
    assert (plan.fsdp_version, plan.reshard_after_forward, plan.mixed_precision) == (2, True, "bf16")
    assert not (plan.offload_params or plan.activation_checkpointing or plan.cpu_ram_efficient_loading)
    assert plan.overrides == []
    assert (plan.auto_wrap_policy, plan.gradient_sync) == ("TRANSFORMER_BASED_WRAP", "every_micro_batch")
    assert plan_for("--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP").min_num_params == 100_000_000  # README: 1e8


def test_fsdp_variables_apply_only_under_accelerate_use_fsdp(accelerate_env):
    # As accelerate reads them: FSDP_* left in a shell, or beside ACCELERATE_USE_FSDP false, configure nothing.
    for key, value in {"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "1", "FSDP_OFFLOAD_PARAMS": "true",
                       "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_FORWARD_PREFETCH": "true"}.items():
        accelerate_env.setenv(key, value)
    plan = plan_for()
    assert (plan.fsdp_version, plan.offload_params, plan.activation_checkpointing) == (2, False, False)
    assert (plan.cpu_ram_efficient_loading, plan.overrides) == (False, [])


def test_the_recipe_format_over_accelerate_local_state_dict_is_reported(accelerate_env):
    accelerate_env.setenv("FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT")
    assert plan_for("--save_state_dict_type", "sharded", "--save_steps", "10").overrides == [
        "save_state_dict_type: recipe config 'sharded' overrides accelerate config fsdp_state_dict_type "
        "'LOCAL_STATE_DICT'"]
    # The format the accelerate config names, set again in the recipe config, overrides nothing.
    for env_format, recipe_format in [("SHARDED_STATE_DICT", "sharded"), ("FULL_STATE_DICT", "full")]:
        accelerate_env.setenv("FSDP_STATE_DICT_TYPE", env_format)
        assert plan_for("--save_state_dict_type", recipe_format, "--save_steps", "10").overrides == []


def test_accelerate_settings_apply_and_recipe_overrides_are_reported(accelerate_env):
    accelerate_env.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    plan = plan_for()
    assert plan.activation_checkpointing and plan.cpu_ram_efficient_loading and plan.overrides == []
    plan = plan_for("--fsdp_version", "1", "--mixed_precision", "no", "--fsdp_activation_checkpointing", "true",
                    "--save_state_dict_type", "full", "--save_steps", "10")
    assert (plan.fsdp_version, plan.sharding_strategy, plan.mixed_precision) == (1, "FULL_SHARD", "no")
    assert plan.overrides == ["fsdp_version: recipe config 1 overrides accelerate config 2",
                              "mixed_precision: recipe config 'no' overrides accelerate config 'bf16'",
                              "save_state_dict_type: recipe config 'full' overrides accelerate config "
                              "fsdp_state_dict_type 'SHARDED_STATE_DICT'"]


def test_recipe_fsdp_version_2_over_an_fsdp1_accelerate_config(accelerate_env):
    # Every shipped FSDP1 config sets fsdp_backward_prefetch: FSDP2 has no such setting, and the plan says so.
    accelerate_env.setenv("FSDP_VERSION", "1")
    accelerate_env.setenv("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE")
    plan = plan_for("--fsdp_version", "2")
    assert (plan.fsdp_version, plan.backward_prefetch) == (2, None)
    version_note, prefetch_note = ("fsdp_version: recipe config 2 overrides accelerate config 1",
                                   "fsdp_backward_prefetch: accelerate config 'BACKWARD_PRE' is an FSDP1 setting, "
                                   "not applied with fsdp_version 2 (FSDP2 always prefetches)")
    assert plan.overrides == [version_note, prefetch_note]
    # Its strategy, under either key (`accelerate config` writes it as fsdp_reshard_after_forward), is applied in
    # FSDP2's terms, or replaced by the recipe config's own fsdp_reshard_after_forward; the plan says which, once.
    for key in ("FSDP_SHARDING_STRATEGY", "FSDP_RESHARD_AFTER_FORWARD"):
        accelerate_env.setenv(key, "SHARD_GRAD_OP")
        plan = plan_for("--fsdp_version", "2")
        assert (plan.fsdp_version, plan.reshard_after_forward, plan.sharding_strategy) == (2, False, "SHARD_GRAD_OP")
        assert plan.overrides == [version_note, f"{key.lower()}: accelerate config SHARD_GRAD_OP (FSDP1) applied as "
                                                f"fsdp_reshard_after_forward false with fsdp_version 2", prefetch_note]
        plan = plan_for("--fsdp_version", "2", "--fsdp_reshard_after_forward", "true")
        assert plan.reshard_after_forward and plan.overrides == [
            version_note, f"{key.lower()}: accelerate config SHARD_GRAD_OP (FSDP1) replaced by the recipe config's "
                          f"fsdp_reshard_after_forward true", prefetch_note]
        # HYBRID_SHARD's replicas come from elsewhere in FSDP2 (dp_replicate_size): no translation is made.
        accelerate_env.setenv(key, "HYBRID_SHARD")
        with pytest.raises(ConfigError, match=f"^the accelerate config sets {key.lower()} HYBRID_SHARD, an FSDP1 "
                                              f"sharding strategy with no FSDP2 equivalent: set "
                                              f"fsdp_reshard_after_forward in the recipe config"):
            plan_for("--fsdp_version", "2")
        accelerate_env.setenv(key, "HYBRID_SHARD")
        assert plan_for("--fsdp_version", "2", "--fsdp_reshard_after_forward", "false").reshard_after_forward is False
        accelerate_env.setenv(key, {"FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "true"}[key])
    # FULL_SHARD as `accelerate config` writes it for FSDP1, and a strategy by torch's number: translated alike.
    for value, strategy, reshard in [("FULL_SHARD", "FULL_SHARD", True), ("2", "SHARD_GRAD_OP", False)]:
        accelerate_env.setenv("FSDP_RESHARD_AFTER_FORWARD", value)
        plan = plan_for("--fsdp_version", "2")
        assert plan.reshard_after_forward is reshard and plan.overrides == [
            version_note, f"fsdp_reshard_after_forward: accelerate config {strategy} (FSDP1) applied as "
                          f"fsdp_reshard_after_forward {str(reshard).lower()} with fsdp_version 2", prefetch_note]


def test_recipe_fsdp_version_1_over_an_fsdp2_accelerate_config(accelerate_env):
    # fsdp2_ac.yaml keeps layers gathered after forward: FSDP1's SHARD_GRAD_OP, unless the recipe names a strategy.
    accelerate_env.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    plan = plan_for("--fsdp_version", "1")
    assert (plan.fsdp_version, plan.sharding_strategy, plan.reshard_after_forward) == (1, "SHARD_GRAD_OP", False)
    assert plan.overrides[1] == ("fsdp_reshard_after_forward: accelerate config false (FSDP2) applied as "
                                 "fsdp_sharding_strategy SHARD_GRAD_OP with fsdp_version 1")
    for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
        plan = plan_for("--fsdp_version", "1", "--fsdp_sharding_strategy", strategy)
        assert plan.sharding_strategy == strategy
        assert plan.overrides[1] == (f"fsdp_reshard_after_forward: accelerate config false (FSDP2) replaced by the "
                                     f"recipe config's fsdp_sharding_strategy {strategy}")


def test_fsdp1_strategy_as_accelerate_config_writes_it(accelerate_env):
    """`accelerate config` writes FSDP1's strategy as fsdp_reshard_after_forward, and `accelerate launch` exports it
    lower-cased beside its default fsdp_sharding_strategy FULL_SHARD."""
    accelerate_env.setenv("FSDP_VERSION", "1")
    accelerate_env.setenv("FSDP_RESHARD_AFTER_FORWARD", "shard_grad_op")
    plan = plan_for()
    assert (plan.sharding_strategy, plan.reshard_after_forward) == ("SHARD_GRAD_OP", False)
    accelerate_env.setenv("FSDP_RESHARD_AFTER_FORWARD", "true")
    assert plan_for().sharding_strategy == "FULL_SHARD"
    # Two strategies under the two keys are an error, unless the recipe config's own strategy replaces them.
    accelerate_env.setenv("FSDP_SHARDING_STRATEGY", "NO_SHARD")
    accelerate_env.setenv("FSDP_RESHARD_AFTER_FORWARD", "SHARD_GRAD_OP")
    plan = plan_for("--fsdp_sharding_strategy", "FULL_SHARD")
    assert (plan.sharding_strategy, plan.reshard_after_forward) == ("FULL_SHARD", True)
    assert plan.overrides == ["fsdp_sharding_strategy: recipe config 'FULL_SHARD' overrides accelerate config "
                              "fsdp_reshard_after_forward 'SHARD_GRAD_OP' and fsdp_sharding_strategy 'NO_SHARD'"]
    # One strategy, under fsdp_reshard_after_forward: the note names that key; the same strategy: no note.
    accelerate_env.setenv("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
    assert plan_for("--fsdp_sharding_strategy", "NO_SHARD").overrides == [
        "fsdp_sharding_strategy: recipe config 'NO_SHARD' overrides accelerate config fsdp_reshard_after_forward "
        "'SHARD_GRAD_OP'"]
    plan = plan_for("--fsdp_sharding_strategy", "SHARD_GRAD_OP")
    assert (plan.sharding_strategy, plan.overrides) == ("SHARD_GRAD_OP", [])
    # The same strategy under both keys is one strategy, not two to choose from.
    accelerate_env.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    plan = plan_for()
    assert (plan.sharding_strategy, plan.overrides) == ("SHARD_GRAD_OP", [])


def test_accelerate_spellings_are_read_as_accelerate_reads_them(accelerate_env):
    for key, value in {"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "shard_grad_op", "FSDP_OFFLOAD_PARAMS": "on",
                       "FSDP_ACTIVATION_CHECKPOINTING": "T", "FSDP_CPU_RAM_EFFICIENT_LOADING": "off",
                       "FSDP_BACKWARD_PREFETCH": "backward_post", "FSDP_MIN_NUM_PARAMS": "1e8"}.items():
        accelerate_env.setenv(key, value)
    plan = plan_for("--gradient_sync", "last_micro_batch", "--gradient_accumulation_steps", "2")
    assert (plan.sharding_strategy, plan.offload_params, plan.activation_checkpointing) == ("SHARD_GRAD_OP", True, True)
    assert (plan.cpu_ram_efficient_loading, plan.backward_prefetch) == (False, "BACKWARD_POST")
    # A hand-set value's spaces are dropped: not a false, nor an unknown strategy.
    accelerate_env.setenv("FSDP_ACTIVATION_CHECKPOINTING", " true ")
    accelerate_env.setenv("FSDP_SHARDING_STRATEGY", " no_shard ")
    plan = plan_for("--gradient_sync", "last_micro_batch", "--gradient_accumulation_steps", "2")
    assert (plan.activation_checkpointing, plan.sharding_strategy) == (True, "NO_SHARD")
    # Strategies by torch's number, as older `accelerate config` versions wrote them, under either key of an FSDP1
    # config; an FSDP2 config's fsdp_reshard_after_forward reads 1 and 0 as true and false.
    for number, strategy in [("2", "SHARD_GRAD_OP"), ("3", "NO_SHARD")]:
        accelerate_env.setenv("FSDP_SHARDING_STRATEGY", number)
        assert plan_for("--gradient_sync", "last_micro_batch", "--gradient_accumulation_steps",
                        "2").sharding_strategy == strategy
    # Backward prefetch and the checkpoint format by torch's number too (BackwardPrefetch, StateDictType).
    accelerate_env.setenv("FSDP_BACKWARD_PREFETCH", "1")
    accelerate_env.setenv("FSDP_STATE_DICT_TYPE", "1")
    args = ["--gradient_sync", "last_micro_batch", "--gradient_accumulation_steps", "2"]
    assert plan_for(*args).backward_prefetch == "BACKWARD_PRE"
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", *args])
    assert resolve_state_dict_type(cfg) == "full"
    accelerate_env.setenv("FSDP_STATE_DICT_TYPE", "3")
    assert resolve_state_dict_type(cfg) == "sharded"
    accelerate_env.setenv("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
    accelerate_env.setenv("FSDP_RESHARD_AFTER_FORWARD", "2")
    assert plan_for("--gradient_sync", "last_micro_batch", "--gradient_accumulation_steps",
                    "2").sharding_strategy == "SHARD_GRAD_OP"
    accelerate_env.setenv("FSDP_VERSION", "2")
    accelerate_env.delenv("FSDP_BACKWARD_PREFETCH")
    for value, reshard in [("1", True), ("0", False)]:
        accelerate_env.setenv("FSDP_RESHARD_AFTER_FORWARD", value)
        assert plan_for().reshard_after_forward is reshard


def test_fsdp1_units_prefetch_as_the_accelerate_config_says(accelerate_env):
    # accelerate's three values, and torch's default (BACKWARD_PRE) without the key.
    accelerate_env.setenv("FSDP_VERSION", "1")
    for value, expected in [("BACKWARD_POST", BackwardPrefetch.BACKWARD_POST), ("NO_PREFETCH", None),
                            (None, BackwardPrefetch.BACKWARD_PRE)]:
        if value is None:
            accelerate_env.delenv("FSDP_BACKWARD_PREFETCH", raising=False)
        else:
            accelerate_env.setenv("FSDP_BACKWARD_PREFETCH", value)
        plan = plan_for("--mixed_precision", "no")
        with process_group_of(2):
            model = shard_model(tiny_model(), plan, torch.device("cpu"))
            assert [unit.backward_prefetch for unit in FSDP.fsdp_modules(model)] == [expected] * 2, value


def test_fsdp1_offload_accumulates_with_one_reduction_per_step(accelerate_env):
    accelerate_env.setenv("FSDP_VERSION", "1")
    accelerate_env.setenv("FSDP_OFFLOAD_PARAMS", "true")
    assert plan_for("--gradient_accumulation_steps", "2", "--gradient_sync", "last_micro_batch").offload_params
    assert plan_for("--gradient_accumulation_steps", "1").offload_params


HSDP_2X8 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8", "PARALLELISM_CONFIG_TP_SIZE": "1",
            "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_SP_SIZE": "1", "WORLD_SIZE": "16"}


def test_hsdp_replicas_come_from_accelerates_parallelism_config(accelerate_env):
    for key, value in HSDP_2X8.items():
        accelerate_env.setenv(key, value)
    assert plan_for().dp_replicate_size == 2
    # A recipe dp_replicate_size replaces accelerate's sizes (its dp_shard_size no longer applies), and says so.
    plan = plan_for("--dp_replicate_size", "4")
    assert plan.dp_replicate_size == 4
    assert plan.overrides == ["dp_replicate_size: recipe config 4 overrides accelerate config 2"]


def test_one_replica_beside_an_fsdp1_strategy_is_no_hybrid_sharding(accelerate_env):
    # parallelism_config's dp_replicate_size 1 (accelerate's default) asks for no replication: not for HYBRID_SHARD.
    for key, value in {**HSDP_2X8, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
                       "PARALLELISM_CONFIG_DP_SHARD_SIZE": "16", "FSDP_VERSION": "1"}.items():
        accelerate_env.setenv(key, value)
    plan = plan_for()
    assert (plan.fsdp_version, plan.sharding_strategy, plan.dp_replicate_size) == (1, "FULL_SHARD", 1)
    assert plan_for("--dp_replicate_size", "1").sharding_strategy == "FULL_SHARD"


@pytest.mark.parametrize("env, args, message", [
    ({"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, [], "^the accelerate config sets fsdp_sharding_strategy "
                                                      "SHARD_GRAD_OP, an FSDP1 sharding strategy, and fsdp_version 2: "
                                                      "set fsdp_reshard_after_forward true"),
    ({}, ["--fsdp_sharding_strategy", "NO_SHARD"], "fsdp_sharding_strategy is an FSDP1 setting"),
    ({}, ["--fsdp_version", "1", "--fsdp_reshard_after_forward", "false"], "an FSDP2 setting"),
    ({"FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "false"}, [], "use fsdp_sharding_strategy SHARD_GRAD_OP"),
    ({"FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}, [], "fsdp_auto_wrap_policy must be one of"),
    ({"FSDP_RESHARD_AFTER_FORWARD": "sometimes"}, [],
     r"^fsdp_reshard_after_forward must be true or false \(FSDP2\) or one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
     r"HYBRID_SHARD \(FSDP1\), got 'sometimes'$"),
    ({}, ["--fsdp_min_num_params", "1000"], "fsdp_min_num_params is a SIZE_BASED_WRAP setting"),
    ({}, ["--fsdp_min_num_params", "0"], "^fsdp_min_num_params is a SIZE_BASED_WRAP setting"),  # not "at least 1"
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, ["--fsdp_min_num_params", "0"],
     r"^fsdp_min_num_params must be at least 1 with SIZE_BASED_WRAP \(a unit is a module holding that many "
     r"parameters not yet in a unit\), got 0$"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "-5"}, [],
     "^fsdp_min_num_params must be at least 1 with SIZE_BASED_WRAP .*, got -5$"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, ["--fsdp_transformer_layer_cls_to_wrap", "LlamaMLP"],
     "fsdp_transformer_layer_cls_to_wrap is read by TRANSFORMER_BASED_WRAP, activation checkpointing and "
     "torch_compile, none of which this run uses"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}, [],
     "sets fsdp_transformer_layer_cls_to_wrap with fsdp_auto_wrap_policy SIZE_BASED_WRAP, which does not read it"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"},
     ["--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP"],
     "sets fsdp_transformer_layer_cls_to_wrap with fsdp_auto_wrap_policy SIZE_BASED_WRAP, which does not read it"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, [], r"^the accelerate config \(or accelerate launch --mixed_precision\) "
                                                 r"sets mixed_precision fp16, which these recipes do not run: set bf16 "
                                                 r"or no there, or mixed_precision in the recipe config \(bf16, no, "
                                                 r"pure_bf16\), which wins"),
    ({"ACCELERATE_MIXED_PRECISION": "no"}, ["--attn_implementation", "kernels-community/flash-attn3"],
     r"^attn_implementation kernels-community/flash-attn3 computes in bf16 or fp16 only, and mixed_precision no runs "
     r"the model in fp32: use mixed_precision bf16 \(fp32 master weights, bf16 compute\), or attn_implementation "
     r"sdpa$"),
    ({}, ["--mixed_precision", "no", "--attn_implementation", "flash_attention_2"], "computes in bf16 or fp16 only"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "100k"}, [],
     "^the accelerate config's fsdp_min_num_params must be a whole number, got '100k'"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "1500.7"}, [], "got '1500.7'"),
    ({"WORLD_SIZE": "3"}, ["--dp_replicate_size", "2"], "^dp_replicate_size 2 does not divide the 3 processes "
                                                        "launched: set it to a divisor"),
    ({}, ["--dp_replicate_size", "2"], "^dp_replicate_size 2 does not divide the 1 processes"),
    # Each says what to change in the accelerate config (it named the variable accelerate sets, and no fix).
    ({"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, [], "^the accelerate config asks for offloading checkpointed "
     "activations \\(fsdp_activation_checkpointing_offload: true\\), which is not supported: set it to false or remove "
     "it$"),
    ({"FSDP_FORWARD_PREFETCH": "true"}, [], "^the accelerate config asks for forward prefetch "
     "\\(fsdp_forward_prefetch: true\\), which is not supported: set it to false or remove it$"),
    ({"FSDP_USE_ORIG_PARAMS": "false"}, [], "fsdp_use_orig_params false is not supported"),
    ({"FSDP_IGNORED_MODULES": "model.embed_tokens"}, [], "^fsdp_ignored_modules is not supported: remove it"),
    ({"FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE"}, [],
     "the accelerate config sets fsdp_backward_prefetch, an FSDP1 setting"),
    ({}, ["--fsdp_version", "1", "--dp_replicate_size", "2"], "^dp_replicate_size 2 needs fsdp_sharding_strategy "
                                                              "HYBRID_SHARD"),
    (HSDP_2X8, ["--fsdp_version", "1"], r"^dp_replicate_size 2 \(the accelerate config's parallelism_config\) needs "
                                        r"fsdp_sharding_strategy HYBRID_SHARD with fsdp_version 1"),
    ({"FSDP_VERSION": "1", "FSDP_BACKWARD_PREFETCH": "EARLY"}, [], "must be BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH"),
    ({**HSDP_2X8, "WORLD_SIZE": "2"}, [],
     r"parallelism_config_dp_replicate_size 2 x parallelism_config_dp_shard_size 8 is 16, but 2 processes were "
     r"launched: set them to the number of nodes"),
    ({**HSDP_2X8, "PARALLELISM_CONFIG_TP_SIZE": "2"}, [], r"parallelism_config_tp_size 2 is not supported"),
    ({**HSDP_2X8, "PARALLELISM_CONFIG_CP_SIZE": "2"}, ["--dp_replicate_size", "1"], "parallelism_config_cp_size 2"),
    ({**HSDP_2X8, "PARALLELISM_CONFIG_SP_SIZE": "2"}, [], r"^parallelism_config_sp_size 2 is not supported"),
    # Sizes that cover fewer processes than were launched: as wrong as more.
    ({**HSDP_2X8, "WORLD_SIZE": "32"}, [], r"parallelism_config_dp_shard_size 8 is 16, but 32 processes were launched"),
    ({"FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op"}, [], "sets fsdp_reshard_after_forward SHARD_GRAD_OP, an FSDP1 "
                                                          "sharding strategy, and fsdp_version 2"),
    ({"FSDP_RESHARD_AFTER_FORWARD": "sometimes"}, [], "fsdp_reshard_after_forward must be true or false"),
    # torch's numbers start at 1: 0 is no strategy (Python's index -1 would make it the last, HYBRID_SHARD).
    ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "0"}, [], "^fsdp_sharding_strategy must be one of FULL_SHARD, "
                                                               "SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, got 0$"),
    ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "NO_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "SHARD_GRAD_OP"}, [],
     "sets fsdp_sharding_strategy NO_SHARD and fsdp_reshard_after_forward SHARD_GRAD_OP: keep one of them"),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, [], r"dynamo_config \(dynamo_backend INDUCTOR\) is not applied"),
    # Applied by accelerate's Accelerator only, which the recipes do not create.
    ({"ACCELERATE_CPU_AFFINITY": "1"}, [], r"^accelerate launch --enable_cpu_affinity is not applied \(accelerate "
                                           r"sets the affinity in its own Accelerator, which these recipes do not "
                                           r"use\): remove it$"),
    ({"ACCELERATE_DEBUG_MODE": "true"}, [], r"^the accelerate config's debug mode \(debug: true, or accelerate launch "
                                            r"--debug\) is not applied"),
    # A DeepSpeed config exports no FSDP settings: its offload would be dropped without a word.
    ({"ACCELERATE_USE_FSDP": "false", "ACCELERATE_USE_DEEPSPEED": "true"}, [],
     "the accelerate config uses DEEPSPEED, which these recipes do not run .*accelerate_configs/fsdp2_offload.yaml"),
    ({"ACCELERATE_USE_FSDP": "false", "ACCELERATE_USE_MEGATRON_LM": "true"}, [], "uses MEGATRON-LM"),
    # accelerate's truth values; anything else would have been a silent false.
    ({"FSDP_OFFLOAD_PARAMS": "ture"}, [], "fsdp_offload_params must be true or false, got 'ture'"),
    ({"FSDP_MIN_NUM_PARAMS": "1000"}, [], "sets fsdp_min_num_params, which TRANSFORMER_BASED_WRAP does not read"),
    ({}, ["--fsdp_version", "1", "--torch_compile", "true"], "torch_compile needs fsdp_version 2"),
    # torch's FSDP1 replaces an offloaded gradient with the newest micro-batch's instead of adding to it.
    ({"FSDP_VERSION": "1", "FSDP_OFFLOAD_PARAMS": "true"}, ["--gradient_accumulation_steps", "2"],
     "FSDP1 with CPU offload cannot accumulate gradients .* set gradient_sync last_micro_batch .* or fsdp_version 2 "
     r"\(on a machine without a GPU the only choice: FSDP1 offload runs on a GPU only\)$"),
])
def test_settings_that_cannot_work_are_errors(accelerate_env, env, args, message):
    for key, value in env.items():
        accelerate_env.setenv(key, value)
    with pytest.raises(ConfigError, match=message):
        plan_for(*args)


def test_size_based_units_take_layer_classes_for_checkpointing_and_compile(accelerate_env):
    accelerate_env.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    for args in (["--fsdp_activation_checkpointing", "true"], ["--torch_compile", "true"]):
        assert plan_for("--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer", *args).layer_cls_names == \
            ["LlamaDecoderLayer"]
    accelerate_env.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer")
    assert plan_for("--fsdp_activation_checkpointing", "true").layer_cls_names == ["LlamaDecoderLayer"]
    # The printed plan names what is checkpointed, since the size-based units do not.
    plan = plan_for("--fsdp_activation_checkpointing", "true", "--fsdp_transformer_layer_cls_to_wrap", "LlamaMLP",
                    "--fsdp_min_num_params", "1000")
    with process_group_of(2):
        printed = describe_plan(shard_model(tiny_model(), plan, torch.device("cpu")), plan)
    assert "  activation checkpointing: each LlamaMLP" in printed.splitlines()


def test_a_declared_class_inside_another_is_no_unit_of_its_own(accelerate_env):
    """Mamba's _no_split_modules names its decoder layer and the mixer inside it: both were units ("wrapped: 4 x
    MambaBlock, MambaMixer" for 2 layers), a second gather per layer, the mixers recomputed twice with activation
    checkpointing, and counted twice by the memory estimate."""
    model = MambaForCausalLM(MambaConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, state_size=8))
    assert set(model._no_split_modules) == {"MambaBlock", "MambaMixer"}
    layers, root = fsdp_groups(model)
    assert sum(map(len, layers)) + len(root) == len(list(model.parameters()))  # each parameter in one unit
    plan = plan_for("--fsdp_activation_checkpointing", "true", "--mixed_precision", "no")
    with process_group_of(2):
        model = shard_model(model, plan, torch.device("cpu"))
        printed = describe_plan(model, plan).splitlines()
    assert "  wrapped: 2 x MambaBlock, then the root" in printed
    assert [type(m._checkpoint_wrapped_module).__name__ for m in model.modules()
            if hasattr(m, "_checkpoint_wrapped_module")] == ["MambaBlock"] * 2


class Mixer(torch.nn.Linear):
    pass


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Mixer(4, 4)


class BlocksAndMixer(torch.nn.Module):
    """Two blocks, each with a mixer inside, and a mixer of its own outside them."""
    _no_split_modules = ["Block", "Mixer"]

    def __init__(self, head: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = Mixer(4, 4) if head else None


def test_a_declared_class_found_outside_the_others_too_stays_a_unit():
    # Only a class found nowhere but inside another declared class is dropped: a module of it outside them stays a
    # unit, not left to the root.
    assert find_layer_classes(BlocksAndMixer(head=True), None) == (Block, Mixer)
    assert find_layer_classes(BlocksAndMixer(head=False), None) == (Block,)


def test_a_module_of_exactly_min_num_params_is_a_size_based_unit():
    # "fsdp_min_num_params parameters or more", as the plan prints it and FSDP1's own size policy counts.
    model = tiny_model()
    mlp = model.model.layers[0].mlp
    size = sum(p.numel() for p in mlp.parameters())
    assert size_based_auto_wrap_policy(mlp, recurse=False, nonwrapped_numel=size, min_num_params=size)
    assert mlp in size_based_units(model, size, tied=set())
    assert mlp not in size_based_units(model, size + 1, tied=set())


def test_size_based_units_leave_tied_modules_and_containers_to_the_module_above():
    # The tied embedding and lm_head stay in the root: as two units they would shard the one weight twice.
    model = tiny_model(tie_word_embeddings=True)
    size = model.model.embed_tokens.weight.numel()
    units = size_based_units(model, size, tied_parameter_ids(model))
    assert model.model.layers[0].mlp.gate_proj in units  # 2,048 parameters to the embedding's 1,536
    assert model.model.embed_tokens not in units and model.lm_head not in units
    # Two layers of 9,280 under a threshold of 9,281: their ModuleList has no forward for FSDP2's hooks (torch:
    # "fully_shard does not support containers that do not implement forward"), so LlamaModel takes them.
    model = demo.LlamaForCausalLM(demo.tiny_llama_config(demo.build_tokenizer(), hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=2))
    assert sum(p.numel() for p in model.model.layers[0].parameters()) == 9280
    assert size_based_units(model, 9281, tied=set()) == [model.model]


def test_the_plan_names_the_layer_classes_checkpointed_and_compiled_when_not_the_decoder_layers(accelerate_env):
    for classes, applied_to in [(None, "each decoder layer"), ("LlamaMLP", "each LlamaMLP")]:
        args = ["--fsdp_transformer_layer_cls_to_wrap", classes] if classes else []
        plan = plan_for("--fsdp_activation_checkpointing", "true", "--mixed_precision", "no", *args)
        with process_group_of(2):
            model = shard_model(tiny_model(), plan, torch.device("cpu"))
            printed = describe_plan(model, plan).splitlines()
        wrapped = "LlamaMLP" if classes else "LlamaDecoderLayer"
        assert [type(m._checkpoint_wrapped_module).__name__ for m in model.modules()
                if hasattr(m, "_checkpoint_wrapped_module")] == [wrapped]
        assert f"  wrapped: 1 x {wrapped}, then the root" in printed
        assert f"  activation checkpointing: {applied_to}" in printed


@pytest.mark.parametrize("args, inside", [
    ([], None),  # each decoder layer a unit: FSDP2's hooks run around its compiled code
    (["--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "--fsdp_min_num_params", "5000"], "LlamaMLP"),  # MLP: 6,144
    (["--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer,LlamaMLP"], "LlamaMLP"),
    # The MLP's checkpoint wrapper is the unit, named by the class it wraps.
    (["--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer,LlamaMLP", "--fsdp_activation_checkpointing", "true"],
     "LlamaMLP"),
])
def test_the_plan_says_when_units_inside_a_compiled_layer_break_its_graph(monkeypatch, one_process_group, args,
                                                                          inside):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plan = plan_for("--torch_compile", "true", "--mixed_precision", "no", *args)
    model = shard_model(tiny_model(use_cache=False), plan, torch.device("cpu"))  # as training loads it
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids = torch.arange(8).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    printed = [line for line in describe_plan(model, plan).splitlines() if "torch.compile" in line]
    assert len(printed) == 1
    if inside is None:
        assert graph_breaks == 0 and "graph breaks" not in printed[0]
    else:
        assert graph_breaks > 0
        assert printed[0].endswith(f", with graph breaks at the FSDP2 hooks of the units inside it ({inside})")


def test_the_plan_prints_the_strategy_fsdp1_runs_on_one_rank(accelerate_env, one_process_group):
    # FSDP1 runs NO_SHARD on one rank whatever it is asked (torch warns): the plan says what runs, and why.
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        plan = plan_for("--fsdp_version", "1", "--fsdp_sharding_strategy", strategy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            printed = describe_plan(shard_model(tiny_model(), plan, torch.device("cpu")), plan).splitlines()
        assert printed[0].endswith(" over 1 rank on cpu (gloo)")
        asked = "" if strategy == "NO_SHARD" else f" (what torch runs on 1 rank, for the {strategy} asked)"
        assert f"  strategy: NO_SHARD, mesh 1{asked}" in printed


def tiny_model(dtype=torch.float32, **config):
    return demo.LlamaForCausalLM(demo.tiny_llama_config(demo.build_tokenizer(), hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, **config)).to(dtype)


def mixed_precision_of_each_unit(model) -> list[tuple]:
    """(compute dtype, gradient reduce dtype) of each FSDP unit, as the engine holds them (None: the parameters')."""
    if isinstance(model, FSDP):
        policies = [unit.mixed_precision for unit in FSDP.fsdp_modules(model)]
    else:
        policies = [unit._get_fsdp_state()._fsdp_param_group.mp_policy for unit in model.modules()
                    if isinstance(unit, FSDPModule)]
    return [(policy.param_dtype, policy.reduce_dtype) for policy in policies]


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_bf16_computes_in_bf16_and_reduces_gradients_in_fp32_in_every_unit(fsdp_version):
    # A bf16 reduce-scatter would round each sum of the ranks' gradients to bf16 (8 bits of mantissa).
    for mixed_precision, dtype, expected in [("bf16", torch.float32, (torch.bfloat16, torch.float32)),
                                             ("no", torch.float32, (None, None)),
                                             ("pure_bf16", torch.bfloat16, (None, None))]:
        plan = plan_for("--fsdp_version", str(fsdp_version), "--mixed_precision", mixed_precision)
        with process_group_of(2):
            model = shard_model(tiny_model(dtype), plan, torch.device("cpu"))
            assert mixed_precision_of_each_unit(model) == [expected] * 2, mixed_precision  # the layer and the root


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_the_plan_names_the_dtype_gradients_accumulate_in_between_syncs(monkeypatch, one_process_group, fsdp_version):
    # With bf16, FSDP1's no_sync holds the full gradients in the compute dtype (on one rank torch runs it as
    # NO_SHARD, which holds them alike); FSDP2 in the reduction dtype (fp32).
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plan = plan_for("--fsdp_version", str(fsdp_version), "--mixed_precision", "bf16", "--gradient_sync",
                    "last_micro_batch", "--gradient_accumulation_steps", "2")
    model = shard_model(tiny_model(), plan, torch.device("cpu"))
    ids = torch.arange(8).unsqueeze(0)
    with gradient_sync(model, enabled=False):
        model(input_ids=ids, labels=ids).loss.backward()
    if fsdp_version == 1:
        held = {unit._handle.flat_param.grad.dtype for unit in FSDP.fsdp_modules(model)}
    else:
        held = {param.unsharded_accumulated_grad.dtype for unit in model.modules() if isinstance(unit, FSDPModule)
                for param in unit._get_fsdp_state()._fsdp_param_group.fsdp_params}
    assert held in ({torch.bfloat16}, {torch.float32})
    in_bf16 = " in bf16" if held == {torch.bfloat16} else ""
    assert (f"  gradient sync: last micro-batch of each step, full gradients accumulate{in_bf16} in between"
            in describe_plan(model, plan).splitlines())


def test_fsdp2_leaves_only_shards_after_a_synced_backward_and_after_reshard(monkeypatch, one_process_group):
    # A module holds a plain tensor while gathered, its sharded DTensor once resharded. The optimizer updates the
    # shards: a unit still gathered at the next forward would compute with the weights from before the step.
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plan = plan_for("--mixed_precision", "no", "--fsdp_reshard_after_forward", "false", "--gradient_sync",
                    "last_micro_batch", "--gradient_accumulation_steps", "2")
    model = shard_model(tiny_model(), plan, torch.device("cpu"))
    ids = torch.arange(8).unsqueeze(0)

    def sharded() -> set[bool]:
        return {isinstance(param, DTensor) for param in model.parameters()}

    with torch.no_grad():  # an evaluation: no backward to reshard after
        model(input_ids=ids)
    assert sharded() == {False}
    sharding.reshard(model)
    assert sharded() == {True}
    with gradient_sync(model, enabled=False):  # the root, and layers not resharded after forward, stay gathered
        model(input_ids=ids, labels=ids).loss.backward()
    assert sharded() == {False}
    model(input_ids=ids, labels=ids).loss.backward()  # the last micro-batch syncs and reshards everything
    assert sharded() == {True}


def test_layer_class_names_may_have_spaces_around_the_commas(accelerate_env):
    accelerate_env.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer, LlamaMLP")
    assert plan_for().layer_cls_names == ["LlamaDecoderLayer", "LlamaMLP"]
    plan = plan_for("--fsdp_transformer_layer_cls_to_wrap", "LlamaMLP ,LlamaDecoderLayer")
    assert plan.layer_cls_names == ["LlamaMLP", "LlamaDecoderLayer"]


def test_layer_class_comes_from_the_model_and_a_wrong_name_lists_its_classes():
    model = tiny_model()
    assert [c.__name__ for c in find_layer_classes(model, None)] == ["LlamaDecoderLayer"]
    with pytest.raises(ConfigError, match=r"names LlamaBlock, which is not a module class of LlamaForCausalLM; "
                                          r"its module classes are: .*LlamaDecoderLayer.*LlamaRMSNorm"):
        find_layer_classes(model, ["LlamaBlock"])
    # The model's own class: FSDP2 stopped on torch's "can only be applied to a module once", FSDP1 trained one unit.
    with pytest.raises(ConfigError, match=r"^fsdp_transformer_layer_cls_to_wrap names LlamaForCausalLM, the model's "
                                          r"own class, which is always the root unit: name the class of its decoder "
                                          r"layers, or leave the key unset to wrap them$"):
        find_layer_classes(model, ["LlamaDecoderLayer", "LlamaForCausalLM"])


def test_a_tied_parameter_split_over_two_units_is_refused(monkeypatch):
    # fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer,Embedding: the embedding becomes a unit of its own,
    # while lm_head, which shares its weight, stays in the root.
    model = tiny_model(tie_word_embeddings=True)
    layers = [m for m in model.modules() if isinstance(m, find_layer_classes(model, None))]
    check_tied_parameters_share_a_unit(model, layers)
    with pytest.raises(ConfigError) as error:
        check_tied_parameters_share_a_unit(model, [*layers, model.model.embed_tokens])
    assert str(error.value) == (
        "model.embed_tokens.weight is tied (shared) across FSDP units (model.embed_tokens, the root), which would "
        "shard it twice: leave Embedding out of the classes wrapped (set fsdp_transformer_layer_cls_to_wrap "
        "LlamaDecoderLayer)")
    # A unit that holds the tied module deeper down (LlamaModel, around the embedding) is named by its own class;
    # under activation checkpointing too (FSDP2 shards the checkpoint wrapper).
    with pytest.raises(ConfigError, match=r"across FSDP units \(model, the root\), which would shard it twice: leave "
                                          r"LlamaModel out of the classes wrapped \(set "
                                          r"fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer\)$"):
        check_tied_parameters_share_a_unit(model, [*layers, model.model])
    checkpointed = tiny_model(tie_word_embeddings=True)
    checkpointed.model = checkpoint_wrapper(checkpointed.model)
    with pytest.raises(ConfigError, match=r"^model.embed_tokens.weight is tied \(shared\) across FSDP units \(model, "
                                          r"the root\), which would shard it twice: leave LlamaModel out of the "
                                          r"classes wrapped \(set fsdp_transformer_layer_cls_to_wrap "
                                          r"LlamaDecoderLayer\)$"):
        check_tied_parameters_share_a_unit(checkpointed, [*[m for m in checkpointed.modules() if isinstance(
            m, find_layer_classes(model, None))], checkpointed.model])
    with pytest.raises(ConfigError, match=r"leave LlamaModel out of the classes wrapped \(set fsdp_auto_wrap_policy "
                                          r"SIZE_BASED_WRAP, which keeps tied modules in the root\)$"):
        check_tied_parameters_share_a_unit(model, [model.model])
    # Sharding checks the units it chose, before torch's unreadable error (or, on torch 2.11, FSDP2's silent untying).
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plan = plan_for("--mixed_precision", "no", "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer,Embedding")
    with process_group_of(2), pytest.raises(ConfigError, match=r"^model.embed_tokens.weight is tied \(shared\) across "
                                                              r"FSDP units \(model.embed_tokens, the root\)"):
        shard_model(tiny_model(tie_word_embeddings=True), plan, torch.device("cpu"))


def test_master_weights_must_have_the_planned_dtype(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(ConfigError, match=r"master weights must be torch.float32 .* is torch.bfloat16"):
        check_master_dtype(tiny_model(torch.bfloat16), plan_for("--mixed_precision", "bf16"))
    check_master_dtype(tiny_model(torch.bfloat16), plan_for("--mixed_precision", "pure_bf16"))
    with pytest.raises(ConfigError, match=r"master weights must be torch.bfloat16"):
        check_master_dtype(tiny_model(), plan_for("--mixed_precision", "pure_bf16"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_fsdp1_offload_on_cpu_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plan = plan_for("--fsdp_version", "1", "--fsdp_offload_params", "true")
    with pytest.raises(ConfigError, match="FSDP1 CPU offload .* needs a GPU.* use fsdp_version 2"):
        fsdp1.shard(tiny_model(), (), plan, None, torch.device("cpu"))
    # Before the model loads (a folder with no weights in it would be the error otherwise), on either loading path.
    tiny_model().config.save_pretrained(tmp_path)
    for rank0_loading in ["false", "true"]:
        cfg = parse_config(["--model_name_or_path", str(tmp_path), "--dataset_name", "d", "--fsdp_version", "1",
                            "--fsdp_offload_params", "true", "--fsdp_cpu_ram_efficient_loading", rank0_loading])
        with pytest.raises(ConfigError, match="FSDP1 CPU offload .* needs a GPU"):
            load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))


def test_flex_attention_on_cpu_is_a_clear_error_before_the_model_loads(tmp_path):
    # torch's FlexAttention has no backward on the CPU: the first step would stop with its traceback on every rank.
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        flex_attention(q, q, q).sum().backward()
    tiny_model().config.save_pretrained(tmp_path)  # no weights: the error must come before the load
    cfg = parse_config(["--model_name_or_path", str(tmp_path), "--dataset_name", "d", "--attn_implementation",
                        "flex_attention"])
    with pytest.raises(ConfigError, match=r"^attn_implementation flex_attention trains on a GPU only .* on the CPU "
                                          r"use sdpa, the default, or eager$"):
        load_sharded_model(cfg, resolve_plan(cfg), torch.device("cpu"))


def test_fsdp1_hybrid_shard_refuses_shard_groups_of_one_rank_but_runs_as_one_process(monkeypatch):
    # 1 rank per node: each shard group is 1 rank, which torch runs as NO_SHARD with no all-reduce across replicas.
    for key in ACCELERATE_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    hybrid = ["--fsdp_version", "1", "--fsdp_sharding_strategy", "HYBRID_SHARD"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher sets it
    for extra, replicas, advice in [([], "one replica per node (2 nodes of 1 rank; dp_replicate_size unset)", ""),
                                    (["--dp_replicate_size", "2"], "dp_replicate_size 2", ", or fewer replicas")]:
        with process_group_of(2), pytest.raises(ConfigError) as error:
            build_mesh(plan_for(*hybrid, *extra), torch.device("cpu"))
        assert str(error.value) == (f"FSDP1 HYBRID_SHARD with {replicas} leaves 1 rank per shard group, which torch "
                                    f"does not synchronise: use NO_SHARD{advice}")
    # One process (python recipes/...py): nothing to synchronise.
    monkeypatch.delenv("WORLD_SIZE")
    with process_group_of(1):
        plan = plan_for(*hybrid)
        build_mesh(plan, torch.device("cpu"))
    assert plan.mesh_shape == (1, 1)
    # 7 processes, 3 on this node: no replica per node can be made of them (a node started with another count).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("WORLD_SIZE", "7")
    with process_group_of(7), pytest.raises(ConfigError) as error:
        build_mesh(plan_for(*hybrid), torch.device("cpu"))
    assert str(error.value) == ("FSDP1 HYBRID_SHARD replicates once per node, and the 7 ranks do not make nodes of 3 "
                                "(this node's processes): start as many on every node, or set dp_replicate_size to a "
                                "divisor of 7")
