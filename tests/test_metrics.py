"""What a run shows: W&B (offline) that survives a resume, metrics.jsonl, peak memory over ranks, evaluation on the
held-out split, progress and sample generations. One 2-process run of 4 steps, resumed to 6, feeds most tests."""

import fcntl
import http.server
import io
import itertools
import json
import math
import os
import re
import struct
import subprocess
import sys
import termios
import threading
import types

import pytest
import torch
import wandb
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import (REPO, file_size_limit, read_metrics, run, run_on_terminal, subprocess_env, torchrun,
                      write_tiny_model)
from fsdp_recipes import progress, trainer
from fsdp_recipes.config import ConfigError, TrainConfig, parse_config
from fsdp_recipes.data import build_dataloader, build_datasets, optimizer_step_batches
from fsdp_recipes.data_formats import IGNORE_INDEX
from fsdp_recipes.device_stats import flops_model, local_peak_memory
from fsdp_recipes.distributed import DistEnv
from fsdp_recipes.evaluation import eval_batches, perplexity
from fsdp_recipes.flops import training_flops_per_token
from fsdp_recipes.export import WriteError
from fsdp_recipes.metrics import MetricsLogger, check_wandb_credentials
from fsdp_recipes.model import load_model, load_tokenizer
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.progress import TrainingProgress, use_progress_bars
from fsdp_recipes.schedule import describe_schedule
from fsdp_recipes.sharding import shard_model
from wandb_records import read_records, run_summary

RECIPE = "recipes/llama_sft.py"
DRIVER = REPO / "tests" / "drivers" / "observe_run.py"
PROMPTS = ["reverse: abcd", "reverse: deadbeef"]


@pytest.fixture(scope="module")
def observed(tiny, tmp_path_factory):
    """4 steps under the recording driver (checkpoints at 2 and 4), then resumed by the plain recipe to step 6.
    The first run shows on a terminal (progress bar), the resumed one writes to pipes (plain progress lines). Only
    the first run sets WANDB_ENTITY, as when a default entity changes between the two.

    17 held-out examples (7% of 256) in eval batches of 8: rank 0 gets 9 rows, rank 1 gets 8 and one dummy batch.
    """
    root = tmp_path_factory.mktemp("observed")
    (root / "records").mkdir()
    common = ["--config", "recipes/configs/llama_sft.yaml", "--model_name_or_path", tiny["model"],
              "--dataset_name", tiny["data"], "--output_dir", root / "out", "--per_device_train_batch_size", "4",
              "--max_seq_length", "64", "--logging_steps", "1", "--mixed_precision", "no", "--eval_fraction", "0.07",
              "--eval_steps", "2", "--per_device_eval_batch_size", "8", "--save_steps", "2", "--report_to", "wandb",
              "--wandb_project", "fsdp-recipes-tests"]
    first = run_on_terminal([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             DRIVER, root / "records", *common, "--max_steps", "4"], WANDB_DIR=str(root),
                            WANDB_ENTITY="fsdp-team")
    resumed = torchrun(RECIPE, *common, "--max_steps", "6", "--resume_from_checkpoint", "auto",
                       "--generation_prompts", *PROMPTS, "--generation_max_new_tokens", "8", WANDB_DIR=str(root))
    records = {r: read_metrics(root / "records" / f"rank_{r}.jsonl") for r in (0, 1)}
    return {"root": root, "out": root / "out", "first": first, "resumed": resumed, "records": records}


def split_metrics(path):
    lines = read_metrics(path)
    return [m for m in lines if "loss" in m], [m for m in lines if "eval/loss" in m]


def test_wandb_run_continues_across_a_resume_with_config_plan_and_versions(observed):
    runs = sorted((observed["root"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2  # one W&B run per launch, by rank 0 only
    first, resumed = (run_summary(path) for path in runs)
    state = json.loads((observed["out"] / "checkpoint-4" / "trainer_state.json").read_text())
    assert first["id"] == resumed["id"] == state["wandb_run_id"]
    # Where the run is, saved beside its id: the resumed run continues it there.
    assert (first["project"], first["entity"]) == (state["wandb_project"], state["wandb_entity"]) == (
        "fsdp-recipes-tests", "fsdp-team")
    assert (resumed["project"], resumed["entity"]) == ("fsdp-recipes-tests", "fsdp-team")
    # The step axis continues: 1-4, then 5-6, with nothing repeated and no gap.
    assert sorted(first["history"]) == [1, 2, 3, 4] and sorted(resumed["history"]) == [5, 6]
    history = {**first["history"], **resumed["history"]}

    train, evals = split_metrics(observed["out"] / "metrics.jsonl")
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6] and [m["step"] for m in evals] == [2, 4, 6]
    for step, row in history.items():  # W&B holds the numbers of metrics.jsonl at their step, and no others
        logged = {k: v for m in train + evals if m["step"] == step for k, v in m.items() if k != "step"}
        assert {k: v for k, v in row.items() if not k.startswith("samples/")} == logged
    # The packed sequences an epoch trains, in global batches of accumulation x batch x ranks.
    found = re.search(r"of (\d+) x (\d+) sequences on each of (\d+) ranks; an epoch trains (\d+) of its",
                      observed["first"].stdout)
    steps_per_epoch = int(found[4]) // (int(found[1]) * int(found[2]) * int(found[3]))
    for m in train:
        assert m.keys() == {"step", "epoch", "loss", "learning_rate", "grad_norm", "tokens", "input_tokens",
                            "real_token_share", "tokens_per_second", "tokens_per_second_per_device", "step_time",
                            "peak_rss_gib"}
        assert m["epoch"] == m["step"] / steps_per_epoch
        assert m["tokens_per_second_per_device"] == pytest.approx(m["tokens_per_second"] / 2)
        assert 0 < m["real_token_share"] <= 1 and m["step_time"] > 0 and m["grad_norm"] > 0
    for m in evals:
        assert m.keys() == {"step", "epoch", "eval/loss", "eval/perplexity"}
        assert m["epoch"] == m["step"] / steps_per_epoch

    config = first["config"]
    assert config["learning_rate"] == 1e-5 and config["eval_fraction"] == 0.07 and config["max_steps"] == 4
    assert "engine: FSDP2 (fully_shard) over 2 ranks" in config["sharding_plan"]["description"]
    assert config["sharding_plan"]["mixed_precision"] == "no"
    assert config["versions"]["torch"] == torch.__version__ and config["versions"]["wandb"] == wandb.__version__
    # Python, CUDA and every library the README lists, this package included, each with a version.
    assert config["versions"].keys() == {"python", "cuda", "torch", "transformers", "accelerate", "datasets",
                                         "safetensors", "wandb", "fsdp-recipes"}
    assert "not installed" not in config["versions"].values()
    assert resumed["config"]["max_steps"] == 6
    # The run's length in steps, as the training line gives it: the resumed run's is longer.
    for summary, total, launch in ((first, 4, "first"), (resumed, 6, "resumed")):
        assert summary["config"]["schedule"] == {"total_steps": total, "warmup_steps": 1,
                                             "steps_per_epoch": steps_per_epoch,
                                             "train_sequences": int(re.search(r"of its (\d+) sequences",
                                                                              observed[launch].stdout)[1])}


def test_logged_learning_rate_warms_up_for_the_yamls_fraction_of_the_run(observed):
    # llama_sft.yaml's warmup_steps 0.03 of the first run's 4 steps: 1 step (rounded up), then the cosine decay.
    train, _ = split_metrics(observed["out"] / "metrics.jsonl")
    cosine = [0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(3)]
    assert [m["learning_rate"] for m in train[:4]] == pytest.approx([0.0] + [1e-5 * c for c in cosine], rel=1e-12)
    assert "training: 4 steps (1 of warm-up) of 4 x 4 sequences on each of 2 ranks" in observed["first"].stdout


def test_logged_peak_memory_is_the_largest_of_all_ranks(observed):
    mine, other = ([r["memory"]["peak_rss_gib"] for r in observed["records"][rank] if "memory" in r] for rank in (0, 1))
    assert len(mine) == len(other) == 4  # one reduction per logged step, on every rank
    train, _ = split_metrics(observed["out"] / "metrics.jsonl")
    assert [m["peak_rss_gib"] for m in train[:4]] == [max(a, b) for a, b in zip(mine, other)]
    assert all(b > a + 0.1 for a, b in zip(mine, other))  # rank 1's 200 MB ballast: the logged peak is rank 1's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's figure in /proc")
def test_peak_rss_is_the_kernels_high_water_mark_in_gib():
    def high_water_mark_gib():  # the kernel's VmHWM, in kB of 1024 bytes
        line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024 / 2 ** 30

    peak = local_peak_memory(torch.device("cpu"))
    assert peak.keys() == {"peak_rss_gib"}
    # The kernel sums its per-CPU page counters approximately for getrusage (here 0.2 MiB below /proc's figure);
    # 1000-byte kB would be 2.3% lower.
    assert peak["peak_rss_gib"] == pytest.approx(high_water_mark_gib(), rel=0.005)


def test_eval_loss_equals_the_whole_split_in_one_process(observed):
    results = {rank: [r for r in observed["records"][rank] if "eval" in r] for rank in (0, 1)}
    assert len(results[0]) == len(results[1]) == 2  # steps 2 and 4
    _, evals = split_metrics(observed["out"] / "metrics.jsonl")
    for logged, mine, other in zip(evals, results[0], results[1]):
        assert mine["eval_examples"] == 17
        assert mine["forward_passes"] == other["forward_passes"] == 2  # rank 1 runs a dummy batch
        assert mine["eval"] == other["eval"]
        assert mine["eval"]["eval/loss"] == pytest.approx(mine["reference"], rel=1e-6)
        assert logged["eval/loss"] == mine["eval"]["eval/loss"]
        assert logged["eval/perplexity"] == pytest.approx(math.exp(logged["eval/loss"]), rel=1e-12)
    assert "eval at step 6: loss" in observed["resumed"].stdout
    # The step's checkpoint is saved before its evaluation starts: an evaluation that fails loses no step.
    assert [r["checkpoints"] for r in results[0]] == [["checkpoint-2"], ["checkpoint-2", "checkpoint-4"]]


def test_eval_loss_is_the_mean_over_label_tokens_from_position_1_counted_by_hand(tiny, one_process_group):
    """Position 0 is never predicted: its label, set in A, counts for nothing. Labels counted by hand: A 4, B 1
    (position 1 masked), C 2; 8 if position 0 were counted, 6 without C's last. Batches of 2: A and B padded
    together, then C."""
    examples = [{"input_ids": [1, 5, 6, 7, 4], "labels": [1, 5, 6, 7, 4]},
                {"input_ids": [1, 8, 9], "labels": [IGNORE_INDEX, IGNORE_INDEX, 9]},
                {"input_ids": [1, 5, 4, 6], "labels": [IGNORE_INDEX, IGNORE_INDEX, 4, 6]}]
    cfg = TrainConfig(model_name_or_path=str(tiny["model"]), dataset_name="unused", mixed_precision="no",
                      per_device_eval_batch_size=2)
    tokenizer = load_tokenizer(cfg)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    plain = load_model(cfg)
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    result = trainer.evaluate(model, examples, cfg, tokenizer, env)
    # The root unit (embeddings, lm_head) is sharded again, not held gathered until the next step's backward.
    assert all(isinstance(p, DTensor) for p in model.parameters())
    loss_sum = 0.0
    with torch.no_grad():  # each example alone, unpadded: minus the log-probability of each label from position 1
        for ex in examples:
            log_probs = plain(input_ids=torch.tensor([ex["input_ids"]])).logits[0].log_softmax(-1)
            loss_sum -= sum(log_probs[t - 1, label].item() for t, label in enumerate(ex["labels"])
                            if t > 0 and label != IGNORE_INDEX)
    assert result["eval/loss"] == pytest.approx(loss_sum / 7, rel=1e-6)
    assert result["eval/perplexity"] == pytest.approx(math.exp(loss_sum / 7), rel=1e-6)


def test_throughput_counts_the_steps_since_the_last_log(tiny, tmp_path, one_process_group, monkeypatch):
    """logging_steps 2: each logged tokens/s is the input tokens of the 2 steps since the previous log over their
    time, not a running total since the start. The trainer's clock ticks 1 s per reading: each step takes 1 s. The
    last step (5) is logged too, though not a multiple of logging_steps, over the one step since step 4."""
    cfg = parse_config([str(arg) for arg in [
        "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path,
        "--max_steps", "5", "--logging_steps", "2", "--per_device_train_batch_size", "4", "--mixed_precision", "no",
        "--max_seq_length", "64"]])
    tokenizer = load_tokenizer(cfg)
    train_data, _ = build_datasets(cfg, tokenizer)
    loader = build_dataloader(train_data, cfg, tokenizer, rank=0, world_size=1, pin_memory=False)
    stream = optimizer_step_batches(loader, cfg.gradient_accumulation_steps)
    input_tokens = [sum(int(mb["attention_mask"].sum()) for mb in next(stream)) for _ in range(5)]
    assert len(set(input_tokens)) > 2  # steps of other lengths: a running mean would differ
    clock = itertools.count()
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    trainer.train(cfg, env, model, tokenizer, train_data, MetricsLogger(cfg, is_main=True))
    logged = read_metrics(tmp_path / "metrics.jsonl")
    assert [(m["step"], m["input_tokens"], m["step_time"]) for m in logged] == [
        (2, input_tokens[1], 1.0), (4, input_tokens[3], 1.0), (5, input_tokens[4], 1.0)]
    assert [m["tokens_per_second"] for m in logged] == [
        (input_tokens[0] + input_tokens[1]) / 2, (input_tokens[2] + input_tokens[3]) / 2, input_tokens[4] / 1]


def test_the_training_line_counts_the_global_batch_of_every_rank():
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--per_device_train_batch_size", "4",
                        "--gradient_accumulation_steps", "2"])
    assert describe_schedule(cfg, 6, 1, 2, 35, 2) == (  # global batch 2 x 4 x 2: 3 of 35 sequences left out
        "training: 6 steps (1 of warm-up) of 2 x 4 sequences on each of 2 ranks; an epoch trains 32 of its 35 "
        "sequences (the 3 that do not fill a global batch of 16 are left out, others each epoch)")
    assert describe_schedule(cfg, 6, 1, 2, 32, 2) == ("training: 6 steps (1 of warm-up) of 2 x 4 sequences on each "
                                                      "of 2 ranks")  # none left out


def test_epoch_counts_optimizer_steps_of_the_global_batches_an_epoch_fills(tiny, tmp_path, one_process_group, capsys):
    """41 sequences in global batches of 4 x 2 (accumulation): an epoch is 5 optimizer steps (1 sequence left out),
    so step 6 is logged as epoch 1.2. A checkpoint records the whole epochs done: none before checkpoint-5, the last
    step of the first epoch, then 1."""
    cfg = parse_config([str(arg) for arg in [
        "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path,
        "--max_steps", "6", "--save_steps", "1", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
        "2", "--mixed_precision", "no", "--max_seq_length", "64"]])
    tokenizer = load_tokenizer(cfg)
    train_data = build_datasets(cfg, tokenizer)[0].select(range(41))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer.train(cfg, env, shard_model(load_model(cfg), resolve_plan(cfg)), tokenizer, train_data,
                  MetricsLogger(cfg, is_main=True))
    assert ("training: 6 steps (0 of warm-up) of 2 x 4 sequences on 1 rank; an epoch trains 40 of its 41 "
            "sequences (the 1 that does not fill a global batch of 8 is left out, others each epoch)"
            in capsys.readouterr().out)
    assert [m["epoch"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [step / 5 for step in range(1, 7)]
    assert [json.loads((tmp_path / f"checkpoint-{step}" / "trainer_state.json").read_text())["epoch"]
            for step in range(1, 7)] == [0, 0, 0, 0, 1, 1]


def test_an_evaluation_between_steps_leaves_the_training_steps_as_they_were(tiny, tmp_path, one_process_group):
    """With attention dropout, the losses of a run evaluated after step 2 and after its last step (3, not a multiple
    of eval_steps) equal those of the run without evaluation: evaluation puts the model back in training mode
    (dropout on) and draws nothing from the RNG."""
    model_dir = write_tiny_model(tmp_path / "model", dtype=torch.float32, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, attention_dropout=0.5)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    losses = {}
    for evaluated in (False, True):
        out = tmp_path / str(evaluated)
        cfg = parse_config([str(arg) for arg in [
            "--model_name_or_path", model_dir, "--dataset_name", tiny["data"], "--output_dir", out,
            "--max_steps", "3", "--per_device_train_batch_size", "4", "--mixed_precision", "no", "--max_seq_length",
            "64", "--eval_fraction", "0.07", "--eval_steps", "2", "--logging_steps", "1"]])
        tokenizer = load_tokenizer(cfg)
        train_data, eval_data = build_datasets(cfg, tokenizer)
        model = shard_model(load_model(cfg), resolve_plan(cfg))
        torch.manual_seed(0)
        trainer.train(cfg, env, model, tokenizer, train_data, MetricsLogger(cfg, is_main=True), None,
                      eval_data if evaluated else None)
        metrics = read_metrics(out / "metrics.jsonl")
        assert [m["step"] for m in metrics if "eval/loss" in m] == ([2, 3] if evaluated else [])
        losses[evaluated] = [m["loss"] for m in metrics if "loss" in m]
    assert losses[True] == losses[False]


def test_eval_batch_defaults_to_the_training_micro_batch():
    # Evaluation then holds no more than a training micro-batch: qwen3_moe_sft.yaml trains 1 sequence of 4096
    # tokens, whose fp32 logits over Qwen3's 151,936-token vocabulary take 2.3 GiB; the old default (8) held 8 times
    # that.
    def eval_batch_size(*args):
        return parse_config(["--model_name_or_path", "m", "--dataset_name", "d", *args]).per_device_eval_batch_size

    assert eval_batch_size("--config", "recipes/configs/qwen3_moe_sft.yaml") == 1
    assert eval_batch_size("--config", "recipes/configs/llama_sft.yaml") == 4
    assert eval_batch_size("--per_device_train_batch_size", "3") == 3
    assert eval_batch_size("--per_device_train_batch_size", "3", "--per_device_eval_batch_size", "8",
                           "--eval_fraction", "0.1") == 8
    with pytest.raises(ConfigError, match="per_device_eval_batch_size must be at least 1, got 0"):
        eval_batch_size("--per_device_eval_batch_size", "0")


def test_sample_generation_is_what_from_pretrained_generates(observed):
    final = observed["out"] / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append({"prompt": prompt,
                         "completion": tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)})
    assert read_metrics(observed["out"] / "samples.jsonl") == expected
    # ... and the W&B table `samples`, logged at the last step.
    run_file = sorted((observed["root"] / "wandb").glob("offline-run-*/run-*.wandb"))[-1]
    table = run_summary(run_file)["history"][6]
    assert (table["samples/_type"], table["samples/nrows"]) == ("table-file", 2)
    rows = json.loads((run_file.parent / "files" / table["samples/path"]).read_text())["data"]
    assert rows == [[s["prompt"], s["completion"]] for s in expected]
    for sample in expected:
        assert f"sample: {sample['prompt']!r} -> {sample['completion']!r}" in observed["resumed"].stdout
    # Without a terminal: plain progress lines with the time left.
    assert "step 6/6 loss" in observed["resumed"].stdout and "time left 0:00:00" in observed["resumed"].stdout


def test_missing_wandb_api_key_stops_the_run_before_the_model_is_loaded(tmp_path):
    proc = run([sys.executable, RECIPE, "--model_name_or_path", tmp_path / "no_such_model", "--dataset_name", "x",
                "--report_to", "wandb"], expect_rc=2, WANDB_MODE="online", WANDB_API_KEY="", HOME=str(tmp_path),
               NETRC=str(tmp_path / "netrc"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"))
    assert "error: report_to is wandb but no W&B API key is configured: set WANDB_API_KEY or run `wandb login`" in proc.stderr
    assert "WANDB_MODE=offline" in proc.stderr and "--report_to none" in proc.stderr
    assert "no_such_model" not in proc.stderr


def test_a_malformed_wandb_api_key_stops_the_run_before_the_model_is_loaded(tmp_path):
    # A key cut short when pasted: wandb.login raises an AuthenticationError, here one error line.
    proc = run([sys.executable, RECIPE, "--model_name_or_path", tmp_path / "no_such_model", "--dataset_name", "x",
                "--report_to", "wandb"], expect_rc=2, WANDB_MODE="online", WANDB_API_KEY="0123456789",
               HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"))
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: report_to is wandb but W&B refuses the API key (")
    assert "API key must have 40+ characters, has 10." in line  # wandb's words, which some versions prefix
    assert line.endswith("): set WANDB_API_KEY or run `wandb login`; or log without network with WANDB_MODE=offline "
                         "(then `wandb sync`), or pass --report_to none")


def test_a_wandb_project_name_wandb_refuses_stops_the_run_before_the_model_is_loaded(tmp_path):
    # An entity/project path, as W&B shows it: wandb.init refuses it as a project name, once the model is loaded.
    proc = run([sys.executable, RECIPE, "--model_name_or_path", tmp_path / "no_such_model", "--dataset_name", "x",
                "--report_to", "wandb", "--wandb_project", "my-team/my-project"], expect_rc=2, WANDB_DIR=str(tmp_path))
    assert proc.stderr.startswith("error: wandb_project 'my-team/my-project' is not a name W&B accepts (Invalid")
    assert proc.stderr.endswith("pass the project's name alone, and set WANDB_ENTITY to log to a team's project\n")
    assert "no_such_model" not in proc.stderr


def test_a_refused_wandb_project_from_the_environment_is_named_with_advice_that_fits(tmp_path, monkeypatch):
    # Not a team path: the advice about WANDB_ENTITY would mislead; and the name came from WANDB_PROJECT, not a flag.
    proc = run([sys.executable, RECIPE, "--model_name_or_path", tmp_path / "no_such_model", "--dataset_name", "x",
                "--report_to", "wandb"], expect_rc=2, WANDB_DIR=str(tmp_path), WANDB_PROJECT="sft:v2")
    assert proc.stderr.startswith("error: wandb_project 'sft:v2' (from WANDB_PROJECT) is not a name W&B accepts "
                                  "(Invalid project name 'sft:v2'")
    assert proc.stderr.endswith("found ':'): choose another name\n")
    # --wandb_project replaces WANDB_PROJECT: the name refused is the flag's, not the environment's.
    monkeypatch.setenv("WANDB_PROJECT", "sft:v2")
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--report_to", "wandb",
                        "--wandb_project", "sft:v3"])
    with pytest.raises(ConfigError, match=r"^wandb_project 'sft:v3' is not a name W&B accepts \(Invalid project"):
        check_wandb_credentials(cfg)


@pytest.mark.parametrize("variable, value, reason", [
    ("WANDB_MODE", "ofline", "mode 'ofline': Input should be 'online', 'offline'"),  # pydantic's check
    ("WANDB_RUN_ID", "sft/1", "Run ID cannot contain the characters"),  # one of wandb's own
])
def test_a_wandb_setting_wandb_refuses_stops_the_run_before_the_model_is_loaded(tmp_path, variable, value, reason):
    # wandb's settings refuse these with a traceback; here one error line. Its words change with its version.
    proc = run([sys.executable, RECIPE, "--model_name_or_path", tmp_path / "no_such_model", "--dataset_name", "x",
                "--report_to", "wandb"], expect_rc=2, WANDB_DIR=str(tmp_path), **{variable: value})
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: W&B refuses its settings (from the WANDB_ environment variables or a wandb "
                           f"settings file): {reason}")
    assert line.endswith(". Correct the setting, or pass --report_to none")


def test_only_rank_0_checks_the_wandb_api_key(tmp_path):
    # wandb.login starts wandb's service process: on the other ranks it would idle for the whole run.
    check = ("import sys; from fsdp_recipes.config import parse_config; from fsdp_recipes.metrics import "
             "check_wandb_credentials; check_wandb_credentials(parse_config(['--model_name_or_path', 'm', "
             "'--dataset_name', 'd', '--report_to', 'wandb'])); print('wandb' in sys.modules)")
    no_key = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc"),
              "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config")}
    assert run([sys.executable, "-c", check], RANK="1", **no_key).stdout == "False\n"
    proc = run([sys.executable, "-c", check], expect_rc=1, RANK="0", **no_key)
    assert "no W&B API key is configured" in proc.stderr
    # Offline or disabled, W&B needs no key: the run goes on.
    for mode in ("offline", "disabled"):
        assert run([sys.executable, "-c", check], RANK="0", **{**no_key, "WANDB_MODE": mode}).stdout == "True\n"


def test_a_wandb_run_that_cannot_start_stops_every_rank_with_its_error(tiny, tmp_path):
    # Online, with a key the server refuses: wandb.init fails on rank 0, the only rank that starts a run. (A server
    # that never answers fails the same way after WANDB_INIT_TIMEOUT and wandb's retries: 25 s more of this suite.)
    refusal = json.dumps({"errors": [{"message": "invalid API key"}]}).encode()

    class RefusesTheKey(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(401)
            self.send_header("Content-Length", str(len(refusal)))
            self.end_headers()
            self.wfile.write(refusal)

        do_GET = do_POST

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RefusesTheKey)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    wandb_server = {"WANDB_MODE": "online", "WANDB_API_KEY": "0" * 40,
                    "WANDB_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}", "HOME": str(tmp_path),
                    "NETRC": str(tmp_path / "netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
                    "WANDB_DIR": str(tmp_path)}
    try:
        proc = torchrun(RECIPE, "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir",
                        tmp_path / "out", "--max_steps", "1", "--max_seq_length", "64", "--report_to", "wandb",
                        expect_rc=1, **wandb_server)
    finally:
        server.shutdown()
    assert "wandb.errors.errors.CommError: invalid API key" in proc.stderr  # rank 0's traceback
    # Rank 1 names it, instead of crashing in its next collective ("Connection closed by peer").
    assert "error: rank 0 failed to start the W&B run: CommError('invalid API key')" in proc.stderr
    assert "Connection closed by peer" not in proc.stderr


def test_a_config_error_after_wandb_started_finishes_the_run(tiny, tmp_path):
    # A checkpoint format the project cannot write: the trainer refuses it before the first step, after the W&B
    # run started.
    proc = run([sys.executable, RECIPE, "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"],
                "--output_dir", tmp_path / "out", "--max_seq_length", "64", "--save_steps", "1",
                "--report_to", "wandb"], expect_rc=2, WANDB_DIR=str(tmp_path), ACCELERATE_USE_FSDP="true",
               FSDP_STATE_DICT_TYPE="LOCAL_STATE_DICT")
    # The error first, then W&B's own lines as it finishes the run (an online finish can take a while).
    lines = proc.stderr.strip().splitlines()
    error = lines.index(
        "error: fsdp_state_dict_type LOCAL_STATE_DICT is not supported: use FULL_STATE_DICT or SHARDED_STATE_DICT")
    assert all(line.startswith("wandb:") for line in lines[error + 1:]), lines[error:]
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    [exit_record] = [r.exit for r in read_records(run_file) if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 2


def test_a_crash_after_wandb_started_finishes_the_run_with_exit_code_1(tmp_path):
    """exit_process skips wandb's teardown: a failure that is no config error (out of memory, say) must still finish
    the W&B run, with the process's exit code, not leave it running until W&B marks it crashed."""
    script = ("import wandb\n"
              "from fsdp_recipes.cli import run_main\n"
              "def main():\n"
              "    wandb.init(project='p')\n"
              "    raise RuntimeError('out of memory')\n"
              "run_main(main)\n")
    proc = run([sys.executable, "-c", script], expect_rc=1, WANDB_DIR=str(tmp_path))
    assert "RuntimeError: out of memory" in proc.stderr
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    [exit_record] = [r.exit for r in read_records(run_file) if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 1


def test_a_resumed_runs_new_length_replaces_the_one_in_its_w_and_b_config(tmp_path, monkeypatch):
    """Online, a resumed W&B run's config comes back from the server with the first segment's schedule (offline it
    starts empty, so the resume test cannot show it): here run_config holds it, and a longer run replaces it, which
    W&B refuses without allow_val_change."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path / "out"),
                        "--report_to", "wandb"])
    first = {"total_steps": 4, "warmup_steps": 1, "steps_per_epoch": 7, "train_sequences": 239}
    logger = MetricsLogger(cfg, is_main=True, run_config={"schedule": first})
    try:
        logger.add_to_config({"schedule": {**first, "total_steps": 6}})
        assert logger.wandb_run.config["schedule"]["total_steps"] == 6
    finally:
        logger.close()


def test_a_metrics_line_cut_off_by_a_crash_is_dropped_on_resume(tmp_path):
    logger = MetricsLogger(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir",
                                         str(tmp_path)]), is_main=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n'
                                            '{"step": 3, "loss": 2.0}\n{"step": 4, "lo')
    (tmp_path / "samples.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    # An earlier resume's rewrite, killed before its rename: this one starts the file afresh.
    (tmp_path / "metrics.jsonl.tmp").write_text('{"step": 1, "loss": 2.5}\n')
    logger.start_at(3)
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25},
                                                        {"step": 3, "loss": 2.0}]
    assert logger.last_step == 3  # the W&B step of samples a resume that only finishes the run logs
    # A kill between a kept line and its newline: the next line starts a line of its own.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}')
    logger.start_at(2)
    logger.log({"step": 3, "loss": 2.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25},
                                                        {"step": 3, "loss": 2.0}]
    # The earlier run's samples describe a final/ this run replaces: gone, even if this run generates none.
    assert not (tmp_path / "samples.jsonl").exists()


def test_samples_are_on_disk_whole_before_their_rename(tmp_path, monkeypatch):
    """samples.jsonl is written aside and renamed once on disk: a node lost right after the rename must not leave it
    empty, which a resume would take for written samples (os.fsync records the size it syncs, os.replace its names;
    both still do their work)."""
    logger = MetricsLogger(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir",
                                         str(tmp_path)]), is_main=True)
    samples = [{"prompt": "reverse: abc", "completion": "cba"}, {"prompt": "reverse: de", "completion": "ed"}]
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"),
                                                                os.fstat(fd).st_size)), fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", src, dst)), replace(src, dst)))
    logger.log_samples(samples)
    path = str(tmp_path / "samples.jsonl")
    assert events == [("fsync", f"{path}.tmp", os.path.getsize(path)), ("replace", f"{path}.tmp", path)]
    assert read_metrics(path) == samples


def test_metrics_lines_are_strict_json_and_a_nan_loss_has_a_nan_perplexity(tmp_path):
    logger = MetricsLogger(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir",
                                         str(tmp_path)]), is_main=True)
    logger.start_at(0)
    logger.log({"step": 1, "loss": math.nan, "grad_norm": math.inf, "tokens": 7})
    strict = json.loads((tmp_path / "metrics.jsonl").read_text(),
                        parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert strict == {"step": 1, "loss": None, "grad_norm": None, "tokens": 7}
    assert math.isnan(perplexity(math.nan)) and perplexity(800.0) == math.inf and perplexity(2.0) == math.exp(2.0)
    assert perplexity(708.0) == math.exp(708.0)  # 3e307: float64 holds it


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_a_disabled_wandb_run_is_not_saved_for_a_resume(tmp_path, monkeypatch, mode):
    # WANDB_MODE=disabled gives a placeholder run (entity "dummy"): a resume must not continue it.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", mode)
    wandb.teardown()  # wandb reads WANDB_MODE once per process, at its set-up
    logger = MetricsLogger(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "out",
                                         "--report_to", "wandb", "--wandb_project", "p"]), is_main=True)
    state = logger.wandb_run_state
    logger.close()
    if mode == "disabled":
        assert state == {"wandb_run_id": None, "wandb_project": None, "wandb_entity": None}
    else:
        assert state["wandb_run_id"] == logger.wandb_run.id and state["wandb_project"] == "p"


def test_a_resume_without_wandb_keeps_the_checkpoints_wandb_run(tmp_path):
    # W&B down: the run goes on with --report_to none; its checkpoints keep the W&B run, which a later resume with
    # --report_to wandb continues.
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    saved = {"wandb_run_id": "k3x9q2ab", "wandb_project": "p", "wandb_entity": "team"}
    (checkpoint / "trainer_state.json").write_text(json.dumps({**saved, "config": {"wandb_project": "p"}}))
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path / "out")])
    assert MetricsLogger(cfg, is_main=True, resume_from=str(checkpoint)).wandb_run_state == saved
    # A fresh run, or a checkpoint of a run that did not log to W&B either: nothing to continue.
    none = {"wandb_run_id": None, "wandb_project": None, "wandb_entity": None}
    assert MetricsLogger(cfg, is_main=True).wandb_run_state == none
    (checkpoint / "trainer_state.json").write_text(json.dumps({**none, "config": {"wandb_project": "fsdp-recipes"}}))
    assert MetricsLogger(cfg, is_main=True, resume_from=str(checkpoint)).wandb_run_state == none


def test_a_resumed_run_continues_the_checkpoints_wandb_run(tmp_path, monkeypatch):
    # The offline run file records how wandb.init was called: the checkpoint's run id and entity, and resume set
    # (an existing id without it does not ask the server to continue that run).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb.teardown()  # wandb reads WANDB_MODE once per process, at its set-up
    checkpoint = tmp_path / "out" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    saved = {"wandb_run_id": "k3x9q2ab", "wandb_project": "p", "wandb_entity": "team"}
    (checkpoint / "trainer_state.json").write_text(json.dumps(saved))
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "out", "--report_to",
                        "wandb", "--wandb_project", "p", "--run_name", "sft-1"])
    run_files = []
    for resume_from in (None, str(checkpoint)):
        MetricsLogger(cfg, is_main=True, resume_from=resume_from).close()
        wandb.teardown()  # stops wandb's service, which writes the run file after finish() returns
        [new_file] = set(tmp_path.glob("wandb/offline-run-*/run-*.wandb")) - set(run_files)
        run_files.append(new_file)
    fresh, resumed = map(run_summary, run_files)
    assert fresh["id"] != "k3x9q2ab" and not fresh["resume"]
    assert fresh["name"] == resumed["name"] == "sft-1"  # --run_name, the name W&B shows
    assert (resumed["id"], resumed["project"], resumed["entity"], resumed["resume"]) == ("k3x9q2ab", "p", "team", True)


def test_samples_of_a_resume_that_only_finishes_are_logged_at_its_last_step(tmp_path, monkeypatch):
    # Resumed at the last step (4) with its evaluation done, the run logs nothing before its samples: W&B's own next
    # step would be 0, behind the history of the run it continues, and W&B drops such a row.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb.teardown()  # wandb reads WANDB_MODE once per process, at its set-up
    logger = MetricsLogger(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "out",
                                         "--report_to", "wandb"]), is_main=True)
    logger.start_at(4)
    logger.log_samples([{"prompt": "reverse: ab", "completion": "ba"}])
    logger.close()
    wandb.teardown()  # stops wandb's service, which writes the run file after finish() returns
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = run_summary(run_file)["history"]
    assert list(history) == [4] and history[4]["samples/nrows"] == 1


def test_eval_batches_cover_the_split_once_with_the_same_count_on_every_rank():
    for n, world, size in [(17, 2, 8), (1, 3, 2), (10, 3, 4), (8, 2, 4)]:
        dataset = [{"input_ids": [7] * (i + 2), "labels": [i] * (i + 2)} for i in range(n)]
        per_rank = [list(eval_batches(dataset, size, 0, rank, world)) for rank in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1
        # per_device_eval_batch_size bounds each forward pass: a dummy row fills an empty batch, never a full one.
        assert all(len(b["input_ids"]) <= size for batches in per_rank for b in batches)
        labels = [row[row != IGNORE_INDEX] for batches in per_rank for b in batches for row in b["labels"]]
        assert sorted(int(row[0]) for row in labels if row.numel()) == list(range(n))  # dummy rows: no label


def test_progress_bar_only_on_rank0_in_a_terminal(observed):
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    with os.fdopen(follower, "w") as terminal:
        assert use_progress_bars(True, terminal, terminal) and not use_progress_bars(False, terminal, terminal)
        # stdout sent to a file (`| tee train.log`): the file gets the step lines, so no bar stands for them.
        assert not use_progress_bars(True, terminal, io.StringIO())
        # stderr sent to a file (`2> train.err`): tqdm would draw the bars into it (and it has no terminal size).
        assert not use_progress_bars(True, io.StringIO(), terminal)
    os.close(leader)
    assert not use_progress_bars(True, io.StringIO(), io.StringIO())
    progress = TrainingProgress(total_steps=10, start_step=4, show_bar=True)
    progress.advance()
    progress.logged({"step": 5, "loss": 1.25, "tokens_per_second": 300.0})
    assert progress.bar.n == 5 and "loss=1.2500" in str(progress.bar)
    progress.close()
    # The first observed run, on a terminal: what stays on screen for each count of the bar is that step's loss.
    screen = observed["first"].stdout
    shown = {}
    for count, loss in re.findall(r"training:[^\r\n]*?\| (\d+)/4 \[[^\]\r\n]*loss=(\d+\.\d+)", screen):
        shown[int(count)] = loss  # each draw overwrites the previous one
    train, _ = split_metrics(observed["out"] / "metrics.jsonl")
    assert shown == {m["step"]: f"{m['loss']:.4f}" for m in train[:4]}
    # Save and eval lines are lines of their own: the bar is cleared (back to the line's start) before them.
    for step in (2, 4):
        assert f"\rsaved {observed['out']}/checkpoint-{step} (sharded)\r\n" in screen, screen
        # Rank 0's alone: rank 1 writes to the same terminal, but draws no bars and prints no line.
        assert screen.count(f"saved {observed['out']}/checkpoint-{step} (sharded)") == 1, screen
        assert re.search(rf"\reval at step {step}: loss \d+\.\d+ perplexity \d+\.\d+\r\n", screen), screen


def test_plain_progress_lines_show_the_logged_numbers(observed):
    # The resumed run writes to a pipe: one line per logged step and per evaluation, as the README shows them.
    train, evals = split_metrics(observed["out"] / "metrics.jsonl")
    printed = observed["resumed"].stdout
    for m in train[4:]:
        line = (f"step {m['step']}/6 loss {m['loss']:.4f} lr {m['learning_rate']:.2e} grad_norm {m['grad_norm']:.3f} "
                f"tokens/s {m['tokens_per_second']:.0f} time left ")
        assert re.search(rf"^{re.escape(line)}\d+:\d\d:\d\d$", printed, flags=re.M), (line, printed)
    last = evals[-1]
    assert f"eval at step 6: loss {last['eval/loss']:.4f} perplexity {last['eval/perplexity']:.3f}\n" in printed


def test_loading_and_tokenization_bars_only_in_a_terminal():
    # Rank 0's datasets (tokenization) and transformers (loading) bars; use_progress_bars decides for other ranks.
    check = ("import datasets, transformers; from fsdp_recipes.progress import configure_progress_bars; "
             "shown = configure_progress_bars(True); "
             "print(shown, datasets.is_progress_bar_enabled(), transformers.utils.logging.is_progress_bar_enabled())")
    assert run_on_terminal([sys.executable, "-c", check]).stdout.strip() == "True True True"
    assert run([sys.executable, "-c", check]).stdout.strip() == "False False False"  # a log file: no bars
    # stderr on a terminal, stdout to a pipe (`| tee train.log`): no bars either.
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    piped = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                           stderr=follower, text=True, check=True)
    os.close(follower)
    os.close(leader)
    assert piped.stdout.strip() == "False False False"
    # A terminal of 0 columns (`script`, `docker run -t` in a job), on which tqdm would draw nothing: plain lines.
    assert run_on_terminal([sys.executable, "-c", check], columns=0).stdout.strip() == "False False False"


def test_plain_progress_time_left_is_paced_by_the_steps_this_run_trained(monkeypatch, capsys):
    # Resumed at step 4 of 10: 2 steps in 20 s since the run started is 10 s a step, so 4 steps left take 40 s.
    clock = iter([100.0, 120.0])
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    resumed = TrainingProgress(total_steps=10, start_step=4, show_bar=False)
    resumed.logged({"step": 6, "loss": 1.25, "learning_rate": 3e-4, "grad_norm": 0.5, "tokens_per_second": 812.4})
    printed = "step 6/10 loss 1.2500 lr 3.00e-04 grad_norm 0.500 tokens/s 812 time left 0:00:40\n"
    assert capsys.readouterr().out == printed


def test_flops_come_from_the_architecture_whatever_the_sharding(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny["model"])
    assert training_flops_per_token(flops_model(model), 64) == training_flops_per_token(model, 64)


def test_eval_steps_need_a_held_out_split():
    with pytest.raises(ConfigError, match="^eval_steps evaluates the held-out split every N steps, and the run has no held-out split"):
        parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--eval_steps", "10"])


def test_metrics_and_samples_that_cannot_be_written_name_the_file_and_what_to_do(tmp_path):
    # A full disk showed OSError's traceback alone ([Errno 28] No space left on device, naming no file) on rank 0.
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path)])
    logger = MetricsLogger(cfg, is_main=True)
    logger.start_at(0)
    logger.log({"step": 1, "loss": 2.5})
    then = (", then resume with --resume_from_checkpoint auto \\(from the run's last checkpoint, if it saved "
            "one\\)")
    room = os.path.getsize(tmp_path / "metrics.jsonl") + 8  # part of the next line fits
    for path, limit, write in [
            ("metrics.jsonl", room, lambda: logger.log({"step": 2, "loss": 2.25})),
            ("samples.jsonl", 8, lambda: logger.log_samples([{"prompt": "reverse: ab", "completion": "ba"}]))]:
        with file_size_limit(limit), pytest.raises(WriteError) as error:
            write()
        assert re.fullmatch(f"writing {tmp_path}/{path} failed \\(OSError: \\[Errno 27\\] File too large\\), with "
                            f"[0-9.,]+ MiB free on the file system of {tmp_path}: make room{then}", str(error.value)), \
            str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # samples.jsonl.tmp removed
    # A resume's rewrite of the steps it keeps: the history is left whole, its .tmp removed.
    history = (tmp_path / "metrics.jsonl").read_text()
    with file_size_limit(8), pytest.raises(WriteError) as error:
        MetricsLogger(cfg, is_main=True).start_at(1)
    assert re.fullmatch(f"writing {tmp_path}/metrics.jsonl failed \\(OSError: \\[Errno 27\\] File too large\\), with "
                        f"[0-9.,]+ MiB free on the file system of {tmp_path}: make room{then}", str(error.value)), \
        str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"] and (tmp_path / "metrics.jsonl").read_text() == history
