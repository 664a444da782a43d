"""What only a GPU can check: NCCL, pinned CPU offload (FSDP2), FSDP1's CPUOffload, and the GPU accelerate configs.
Run by bench/gpu_sharding_check.sh on a machine with GPUs; skipped without CUDA."""

import json
import sys

import pytest
import torch
import yaml

from conftest import REPO, read_metrics, run, torchrun
from test_accelerate_configs import CONFIGS, CPU_CONFIGS, expected_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: bench/gpu_sharding_check.sh runs it on the GPUs")
WORLD = torch.cuda.device_count()
GPU_CONFIGS = [n for n in CONFIGS if n not in CPU_CONFIGS and n != "fsdp2_hsdp_multinode.yaml"]
VARIANTS = {
    "fsdp2": {"fsdp_version": 2},
    "fsdp1": {"fsdp_version": 1},
    "fsdp2_offload": {"fsdp_offload_params": "true", "fsdp_cpu_ram_efficient_loading": "true"},
    "fsdp1_offload": {"fsdp_version": 1, "fsdp_offload_params": "true", "fsdp_cpu_ram_efficient_loading": "true",
                      "gradient_sync": "last_micro_batch"},  # FSDP1 offload cannot accumulate outside no_sync
    "fsdp2_bf16": {"mixed_precision": "bf16"},
    **({"fsdp2_hsdp": {"dp_replicate_size": WORLD}} if WORLD > 1 else {}),
}


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    if 8 % WORLD:
        pytest.skip(f"the global batch of 8 does not split over {WORLD} GPUs")
    out = tmp_path_factory.mktemp("gpu")
    common = ["--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--max_steps", "10",
              "--gradient_accumulation_steps", "2", "--mixed_precision", "no", "--learning_rate", "1e-2",
              "--max_seq_length", "64"]
    torchrun("tests/drivers/sharding_run.py", out, json.dumps(VARIANTS), *common,
             "--per_device_train_batch_size", str(8 // WORLD), nproc=WORLD)
    run([sys.executable, "tests/drivers/sharding_run.py", out, json.dumps({"unsharded": {}}), *common,
         "--per_device_train_batch_size", "8"], CUDA_VISIBLE_DEVICES="0")
    return {name: {"losses": [m["loss"] for m in read_metrics(out / name / "metrics.jsonl")],
                   "rank0": json.loads((out / name / "rank0.json").read_text())} for name in [*VARIANTS, "unsharded"]}


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "fsdp2_bf16"])
def test_fp32_losses_on_gpu_equal_the_unsharded_process(runs, name):
    reference = runs["unsharded"]["losses"]
    assert max(abs(a - b) / b for a, b in zip(runs[name]["losses"], reference)) <= 1e-5


def test_bf16_on_gpu_stays_close_to_fp32(runs):
    reference = runs["unsharded"]["losses"]
    assert 0 < max(abs(a - b) / b for a, b in zip(runs["fsdp2_bf16"]["losses"], reference)) <= 1e-2


def test_offloaded_state_lives_in_cpu_memory(runs):
    assert runs["fsdp2"]["rank0"]["param_devices"] == ["cuda"]
    for name in ["fsdp2_offload", "fsdp1_offload"]:
        assert runs[name]["rank0"]["param_devices"] == ["cpu"]
    assert runs["fsdp2_offload"]["rank0"]["params_pinned"]  # pinned where an accelerator exists


@pytest.mark.parametrize("name", VARIANTS)
def test_the_export_gathers_into_cpu_memory(runs, name):
    """Offloaded parameters live on the CPU, but the model computes on the GPU: the gathered weights must not."""
    assert runs[name]["rank0"]["gpu_tensors_in_export"] == 0


@pytest.mark.parametrize("name", VARIANTS)
def test_a_sharded_save_copies_nothing_onto_the_gpu(runs, name):
    """FSDP1 copies its part of each parameter and each Adam moment on the GPU for a sharded state dict; the
    copies must go to the CPU. On one GPU FSDP1 does not shard (NO_SHARD): torch then clones the weights whole on the
    GPU, and no offload could avoid it; the optimizer state is its own."""
    rank0 = runs[name]["rank0"]
    fsdp1_unsharded_on_gpu = name == "fsdp1" and WORLD == 1
    assert rank0["gpu_bytes_copied_for_sharded_save"] == (rank0["params"] if fsdp1_unsharded_on_gpu else 0)


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_config_launches_and_prints_its_plan(tiny, tmp_path, name):
    config = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{name}",
                "--num_processes", str(WORLD), "--main_process_port", "0", "recipes/llama_sft.py",
                "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path,
                "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_seq_length", "64",
                "--save_steps", "2"])
    printed = proc.stdout.split("sharding plan:\n")[1].split("training:")[0]
    assert [line.strip() for line in printed.strip().splitlines()] == expected_plan(config, WORLD, "cuda (NCCL)")
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "checkpoint-2" / "model" / ".metadata").is_file()  # the YAML's SHARDED_STATE_DICT


def test_a_cpu_config_runs_on_the_cpu_where_there_is_a_gpu(tiny, tmp_path):
    """The *_cpu.yaml configs (gpu_ids "") keep the run off the GPUs: on one GPU, rank 1 would ask for cuda:1."""
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp2_cpu.yaml",
         "--main_process_port", "0", "recipes/llama_sft.py", "--model_name_or_path", tiny["model"], "--dataset_name",
         tiny["data"], "--output_dir", tmp_path, "--max_steps", "2", "--per_device_train_batch_size", "2",
         "--max_seq_length", "64"])
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert not any("peak_allocated_gib" in m for m in metrics)  # logged on CUDA only


def test_offload_loads_persistent_buffers_from_rank0_and_from_a_full_checkpoint(tmp_path):
    """Gemma 4's layer_scalar is a persistent buffer on the GPU while the offloaded parameters are on the CPU: the
    rank-0 load and the resume from a full checkpoint put both through one full-state-dict load."""
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from fsdp_recipes import demo

    tokenizer = demo.build_tokenizer()
    config = Gemma4TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                              hidden_size_per_layer_input=8, vocab_size_per_layer_input=len(tokenizer),
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer, value in zip(model.model.layers, (0.5, 1.5)):
        layer.layer_scalar.fill_(value)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    demo.write_jsonl(data, demo.make_split(seed=1, n_train=64, n_eval=0)[0])
    args = ["recipes/sft.py", "--model_name_or_path", tmp_path / "model", "--dataset_name", data, "--output_dir",
            tmp_path / "run", "--per_device_train_batch_size", "2", "--max_seq_length", "64", "--mixed_precision",
            "no", "--save_dtype", "float32", "--fsdp_offload_params", "true", "--fsdp_cpu_ram_efficient_loading",
            "true", "--save_steps", "2", "--save_state_dict_type", "full"]
    torchrun(*args, "--max_steps", "2", nproc=WORLD)
    torchrun(*args, "--max_steps", "3", "--resume_from_checkpoint", "auto", nproc=WORLD)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert [layer.layer_scalar.item() for layer in exported.model.layers] == [0.5, 1.5]


def test_a_resume_on_the_gpu_continues_the_cuda_random_stream(tiny, tmp_path):
    """Dropout on the GPU draws from the CUDA generator: the checkpoint keeps its state, so the resumed steps draw
    the masks of the uninterrupted run (another mask gives another loss)."""
    from conftest import write_tiny_model

    model = write_tiny_model(tmp_path / "model", dtype=torch.float32, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, attention_dropout=0.5)
    args = ["recipes/llama_sft.py", "--model_name_or_path", model, "--dataset_name", tiny["data"], "--max_steps", "4",
            "--save_steps", "2", "--per_device_train_batch_size", "2", "--max_seq_length", "64", "--mixed_precision",
            "no", "--learning_rate", "1e-2"]
    torchrun(*args, "--output_dir", tmp_path / "straight", nproc=WORLD)
    torchrun(*args, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint",
             tmp_path / "straight" / "checkpoint-2", nproc=WORLD)
    straight, resumed = ({m["step"]: m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")}
                         for name in ("straight", "resumed"))
    # A tolerance for GPU kernels' rounding, far below a changed dropout mask's effect at p=0.5.
    assert resumed == pytest.approx({step: straight[step] for step in (3, 4)}, rel=1e-5)
