"""Every accelerate config shipped: the CPU ones are launched once, the GPU ones go through accelerate's own launcher
code into the recipe's plan; in both cases the plan printed matches the one the YAML describes."""

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

from conftest import REPO, accelerate_launch, read_metrics
from fsdp_recipes import demo
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import describe_plan, shard_model

CONFIGS = sorted(p.name for p in (REPO / "accelerate_configs").glob("*.yaml"))
CPU_CONFIGS = [name for name in CONFIGS if yaml.safe_load((REPO / "accelerate_configs" / name).read_text()).get("use_cpu")]
GPU_CONFIGS = [name for name in CONFIGS if name not in CPU_CONFIGS]


def expected_plan(config: dict, world: int = 2, device: str = "cpu (gloo)") -> list[str]:
    """The plan lines the YAML implies on `world` ranks of `device`, written out independently of the code that
    prints them (the parameter count for the tiny test model, whose dimensions every shard count divides)."""
    fsdp = config["fsdp_config"]
    version = fsdp["fsdp_version"]
    replicate = config.get("parallelism_config", {}).get("parallelism_config_dp_replicate_size", 1)
    shard = world // replicate
    if version == 1:
        engine, strategy = "FSDP1 (FullyShardedDataParallel)", f"{fsdp['fsdp_sharding_strategy']}, mesh {world}"
    else:
        mesh = f"HSDP (replicate x shard) mesh {replicate} x {shard}" if replicate > 1 else f"shard mesh {world}"
        engine, strategy = "FSDP2 (fully_shard)", f"{mesh}, reshard_after_forward={fsdp['fsdp_reshard_after_forward']}"
    assert config["mixed_precision"] == "bf16"
    return [
        f"engine: {engine} over {world} ranks on {device}",
        "wrapped: 2 x LlamaDecoderLayer, then the root",
        f"strategy: {strategy}",
        "precision: bf16 compute, fp32 master weights, fp32 gradient reduction, fp32 optimizer state",
        "offload: " + ("parameters, gradients and optimizer state on CPU" if fsdp["fsdp_offload_params"] else "none"),
        "activation checkpointing: " + ("each decoder layer" if fsdp["fsdp_activation_checkpointing"] else "off"),
        "loading: " + ("rank 0 reads the weights, broadcast while sharding" if fsdp["fsdp_cpu_ram_efficient_loading"]
                       else "every rank reads the weights"),
        "gradient sync: every micro-batch",
        f"parameters: 80,192 total, {80_192 // shard:,} on rank 0",
    ]


def test_cpu_configs_are_found():
    assert CPU_CONFIGS == ["fsdp1_cpu.yaml", "fsdp2_ac_cpu.yaml", "fsdp2_cpu.yaml", "fsdp2_offload_cpu.yaml"]


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_each_cpu_config_has_its_gpu_configs_settings(name):
    # As the README's table says: the one difference on purpose is fsdp2_ac_cpu.yaml's layers kept gathered.
    def read(config):
        return yaml.safe_load((REPO / "accelerate_configs" / config).read_text())
    cpu, gpu = read(name), read(name.replace("_cpu", ""))
    expected = {**gpu["fsdp_config"], "fsdp_reshard_after_forward": False} if name == "fsdp2_ac_cpu.yaml" else \
        gpu["fsdp_config"]
    assert cpu["fsdp_config"] == expected
    assert cpu["mixed_precision"] == gpu["mixed_precision"]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_key_is_one_accelerate_reads(name):
    """accelerate drops a key it does not know without a word (a misspelled fsdp_config key would never reach the
    recipe), so each key of a shipped config must be one of its config fields or launch options."""
    config = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
    options = {action.dest for action in launch_command_parser()._actions}
    assert set(config) <= {field.name for field in dataclasses.fields(ClusterConfig)}
    for section in ("fsdp_config", "parallelism_config"):
        assert set(config.get(section, {})) <= options, section


@pytest.mark.parametrize("name", CONFIGS)
def test_every_launcher_key_reaches_accelerate(name):
    """accelerate also drops, without a word, a top-level key whose launch option has a default of its own (as
    rdzv_backend's `static`): each one of a shipped config must come out of accelerate's launcher code as written."""
    config = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(REPO / "accelerate_configs" / name), "recipe.py"]))
    for key, value in config.items():
        if not isinstance(value, dict) and key not in ("compute_environment", "distributed_type"):
            assert getattr(args, key) == value, key


@pytest.mark.parametrize("name", CONFIGS)
def test_each_config_starts_by_saying_when_to_use_it(name):
    assert (REPO / "accelerate_configs" / name).read_text().startswith("# ")


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_cpu_config_launches_and_prints_its_plan(tiny, tmp_path, name):
    config = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
    proc = accelerate_launch(f"accelerate_configs/{name}", "recipes/llama_sft.py", "--model_name_or_path",
                             tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path,
                             "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_seq_length", "64",
                             "--save_steps", "2")
    printed = proc.stdout.split("sharding plan:\n")[1].split("training:")[0]
    assert [line.strip() for line in printed.strip().splitlines()] == expected_plan(config)
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "checkpoint-2" / "model" / ".metadata").is_file()  # the YAML's SHARDED_STATE_DICT
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_cpu_config_hides_the_gpus(name):
    """use_cpu alone reaches only accelerate's one-process launcher: with FSDP, gpu_ids "" is what keeps the
    processes off a machine's GPUs (and off cuda:1 of a one-GPU machine)."""
    assert launched_env(name)["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("name", CONFIGS)
def test_checkpoints_are_sharded(name):
    assert launched_env(name)["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"


def launched_env(name) -> dict[str, str]:
    """The environment `accelerate launch --config_file <name>` (a shipped config, or a path) gives each process of
    node 0, made by accelerate's own launcher code (`accelerate launch` runs the same functions, then torchrun adds WORLD_SIZE and
    LOCAL_WORLD_SIZE)."""
    args = launch_command_parser().parse_args(["--config_file", str(REPO / "accelerate_configs" / name),
                                               "--main_process_port", "0", "recipes/llama_sft.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    env.update(WORLD_SIZE=str(args.num_processes), LOCAL_WORLD_SIZE=str(args.nproc_per_node))
    return env


@contextlib.contextmanager
def process_group_of(world: int):
    """`world` ranks in this one process, this one rank 0 (torch's fake backend, whose collectives do nothing):
    enough to build the mesh and shard a model as rank 0 of 8 or 16 GPUs does, without starting them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_config_resolves_to_the_plan_its_yaml_describes(monkeypatch, name):
    config = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
    for key, value in launched_env(name).items():
        monkeypatch.setenv(key, value)
    plan = resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d"]))
    model = demo.LlamaForCausalLM(demo.tiny_llama_config(demo.build_tokenizer(), hidden_size=64, intermediate_size=128,
                                                         num_hidden_layers=2))
    expected = expected_plan(config, world=config["num_processes"])
    with process_group_of(config["num_processes"]):
        if plan.fsdp_version == 1 and plan.offload_params:
            # Sharding here runs on CPU, where FSDP1's offload cannot (it is checked on GPU by test_sharding_gpu.py):
            # the plan is complete but for the per-rank parameter count, which needs the sharded model.
            with pytest.raises(ConfigError, match="FSDP1 CPU offload .* needs a GPU"):
                shard_model(model, plan, torch.device("cpu"))
            expected = expected[:-1] + ["parameters: 80,192 total, 80,192 on rank 0"]
        else:
            model = shard_model(model, plan, torch.device("cpu"))
        printed = describe_plan(model, plan)
    assert [line.strip() for line in printed.splitlines()] == expected


def test_a_key_left_out_of_an_accelerate_config_takes_accelerates_default(monkeypatch, tmp_path):
    # As the README's Sharding section says: accelerate exports its own defaults (FSDP1, fp32, rank-0 loading),
    # which the recipe cannot tell from values set on purpose; the recipe config wins over them.
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp2.yaml").read_text())
    del config["fsdp_config"]["fsdp_version"], config["mixed_precision"]
    del config["fsdp_config"]["fsdp_cpu_ram_efficient_loading"], config["fsdp_config"]["fsdp_sync_module_states"]
    (tmp_path / "trimmed.yaml").write_text(yaml.safe_dump(config))
    for key, value in launched_env(tmp_path / "trimmed.yaml").items():
        monkeypatch.setenv(key, value)
    plan = resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d"]))
    assert (plan.fsdp_version, plan.mixed_precision, plan.cpu_ram_efficient_loading) == (1, "no", True)
    plan = resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--fsdp_version", "2",
                                      "--mixed_precision", "bf16"]))
    assert (plan.fsdp_version, plan.mixed_precision) == (2, "bf16")


def test_a_config_whose_distributed_type_is_not_fsdp_is_refused(monkeypatch, tmp_path):
    # accelerate exports none of a MULTI_GPU config's fsdp_config: its offload and rank-0 loading would be dropped.
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp2_offload.yaml").read_text())
    (tmp_path / "multi_gpu.yaml").write_text(yaml.safe_dump({**config, "distributed_type": "MULTI_GPU"}))
    env = launched_env(tmp_path / "multi_gpu.yaml")
    assert not any(key.startswith("FSDP_") for key in env)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"^the accelerate config's distributed_type is not FSDP, so accelerate "
                                          r"passes none of its fsdp_config on: set distributed_type: FSDP"):
        resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d"]))
    # One process launched by accelerate without a config (the simple launcher): nothing is dropped.
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d"])).fsdp_version == 2


def test_accelerates_one_process_launcher_for_a_config_of_several_is_refused(monkeypatch, tmp_path):
    # `accelerate launch --cpu` skips FSDP's launcher, as a MULTI_CPU config without mpirun skips any: one process
    # starts, given none of the fsdp_config, where the config asks for 2.
    multi_cpu = yaml.safe_load((REPO / "accelerate_configs" / "fsdp2_offload_cpu.yaml").read_text())
    (tmp_path / "multi_cpu.yaml").write_text(yaml.safe_dump({**multi_cpu, "distributed_type": "MULTI_CPU"}))
    launches = [["--cpu", "--config_file", str(REPO / "accelerate_configs" / "fsdp2_offload_cpu.yaml")],
                ["--config_file", str(tmp_path / "multi_cpu.yaml")]]
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # the launcher passes the shell's on, as below
    for launch in launches:
        with monkeypatch.context() as patched:
            env = simple_launched_env(launch)
            assert not any(key.startswith("FSDP_") or key in ("RANK", "WORLD_SIZE") for key in env)
            for key, value in env.items():
                patched.setenv(key, value)
            with pytest.raises(ConfigError, match=r"^accelerate launch started this one process for a config of "
                                                  r"several, and passed none of its fsdp_config on: accelerate "
                                                  r"launch --cpu .* Drop --cpu .*\(MASTER_ADDR, which that launcher "
                                                  r"sets only for several processes, is 127.0.0.1"):
                resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d"]))
    # One process asked for (`accelerate launch --cpu` without a config): nothing is dropped, and its
    # --mixed_precision applies.
    for key, value in simple_launched_env(["--cpu", "--mixed_precision", "no"]).items():
        monkeypatch.setenv(key, value)
    plan = resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d"]))
    assert (plan.fsdp_version, plan.mixed_precision) == (2, "no")
    # Unless the shell exports a MASTER_ADDR, which the launcher passes on: the error names it.
    monkeypatch.setenv("MASTER_ADDR", "node0")
    for key, value in simple_launched_env(["--cpu"]).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"MASTER_ADDR, which that launcher sets only for several processes, is "
                                          r"node0: for one process, unset it where your shell exports it\)$"):
        resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d"]))
    # A process a launcher ranked (torchrun sets RANK) is not the one-process launcher's, whatever MASTER_ADDR says.
    monkeypatch.setenv("RANK", "0")
    assert resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d"])).fsdp_version == 2


def simple_launched_env(launch: list[str]) -> dict[str, str]:
    """The environment of the one process accelerate's simple launcher starts for `accelerate launch <launch>`."""
    args = launch_command_parser().parse_args([*launch, "--main_process_port", "0", "recipes/llama_sft.py"])
    args, _, _ = _validate_launch_command(args)
    return prepare_simple_launcher_cmd_env(args)[1]
