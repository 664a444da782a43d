"""Every accelerate config shipped for CPU is launched once; the plan the recipe prints matches the YAML."""


import pytest
import yaml

from conftest import REPO, accelerate_launch, read_metrics

CONFIGS = sorted(p.name for p in (REPO / "accelerate_configs").glob("*.yaml"))
CPU_CONFIGS = [name for name in CONFIGS if yaml.safe_load((REPO / "accelerate_configs" / name).read_text()).get("use_cpu")]


def expected_plan(config: dict, world: int = 2) -> list[str]:
    """The plan lines the YAML implies, written out independently of the code that prints them (the parameter
    count only for the tiny test model on 2 ranks)."""
    fsdp = config["fsdp_config"]
    version = fsdp["fsdp_version"]
    if version == 1:
        engine, strategy = "FSDP1 (FullyShardedDataParallel)", f"{fsdp['fsdp_sharding_strategy']}, mesh {world}"
    else:
        engine, strategy = "FSDP2 (fully_shard)", f"shard mesh {world}, reshard_after_forward={fsdp['fsdp_reshard_after_forward']}"
    assert config["mixed_precision"] == "bf16"
    return [
        f"engine: {engine} over {world} ranks",
        "wrapped: 2 x LlamaDecoderLayer, then the root",
        f"strategy: {strategy}",
        "precision: bf16 compute, fp32 master weights, fp32 gradient reduction, fp32 optimizer state",
        "offload: " + ("parameters, gradients and optimizer state on CPU" if fsdp["fsdp_offload_params"] else "none"),
        "activation checkpointing: " + ("each decoder layer" if fsdp["fsdp_activation_checkpointing"] else "off"),
        "loading: " + ("rank 0 reads the weights, broadcast while sharding" if fsdp["fsdp_cpu_ram_efficient_loading"]
                       else "every rank reads the weights"),
    ] + (["parameters: 80,192 total, 40,096 on rank 0"] if world == 2 else [])


def test_cpu_configs_are_found():
    assert CPU_CONFIGS == ["fsdp1_cpu.yaml", "fsdp2_ac_cpu.yaml", "fsdp2_cpu.yaml", "fsdp2_offload_cpu.yaml"]


@pytest.mark.parametrize("name", CONFIGS)
def test_each_config_starts_by_saying_when_to_use_it(name):
    assert (REPO / "accelerate_configs" / name).read_text().startswith("# ")


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_cpu_config_launches_and_prints_its_plan(tiny, tmp_path, name):
    config = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
    proc = accelerate_launch(f"accelerate_configs/{name}", "recipes/llama_sft.py", "--model_name_or_path",
                             tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path,
                             "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_seq_length", "64")
    printed = proc.stdout.split("sharding plan:\n")[1].split("training:")[0]
    assert [line.strip() for line in printed.strip().splitlines()] == expected_plan(config)
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "final" / "model.safetensors").is_file()
