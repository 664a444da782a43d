"""Checkpoints: exact resume, world-size change, kills during and after a save, retention, bad input, conversion.

Every test compares against one uninterrupted 2-process run (fp32, accumulation 2, 6 steps of a 16-step epoch,
a checkpoint every 2 steps), so that a resume lands in the middle of an epoch: FSDP2's, and for the resume and
world-size tests also FSDP1's.
"""

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import pickle
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import accelerate
import datasets
import numpy as np
import pytest
import torch
from packaging.version import Version
from safetensors.torch import load_file, save_file
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from tokenizers import normalizers, processors
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer, Gemma3Config, Qwen3MoeConfig,
                          get_scheduler)


from fsdp_recipes.checkpoint import (CheckpointError, _save_failure_remedy, apply_retention, latest_checkpoint,
                                     load_checkpoint, load_model_weights, point_latest_at, resolve_state_dict_type,
                                     save_checkpoint, training_data_identity, validate_checkpoint)
from fsdp_recipes.data_formats import DEFAULT_CHAT_TEMPLATE
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.convert import convert
from fsdp_recipes.data import build_datasets
from fsdp_recipes.distributed import DistEnv, RunComplete
from fsdp_recipes import convert as convert_module, demo, trainer
from fsdp_recipes.export import fsync as export_fsync, replace_dir, save_hf_model
from fsdp_recipes.metrics import MetricsLogger, library_versions
from fsdp_recipes.model import load_model, load_tokenizer
from fsdp_recipes.output_dir import lock_output_dir, prepare_output_dir, remove_earlier_run
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.resume import (export_of, model_config_differences, report_newer_checkpoints, resolve_resume,
                                 settings_only_in, tokenizer_differences, training_config_differences)
from fsdp_recipes.sharding import shard_model, state_dict_name
from fsdp_recipes.trainer import build_optimizer, train

from conftest import REPO, file_size_limit, read_metrics, run, subprocess_env, torchrun, write_tiny_model
from test_data import two_ranks
from test_readme import readme_commands

RECIPE = "recipes/llama_sft.py"


def recipe_args(tiny, output_dir, *extra):
    return ["--model_name_or_path", tiny["tied_model"], "--dataset_name", tiny["data"], "--output_dir", output_dir,
            "--max_steps", "6", "--save_steps", "2", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--mixed_precision", "no", "--max_seq_length", "64",
            "--learning_rate", "1e-2", "--save_dtype", "float32",
            # Weight decay on the matrices only: a parameter put in the wrong group changes the numbers.
            "--weight_decay", "0.1", *extra]


def losses(output_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(Path(output_dir) / "metrics.jsonl")}


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(Path(output_dir) / "final" / "model.safetensors")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def dcp_contents(folder: Path, tmp_path: Path) -> dict:
    """A DCP folder's contents, gathered into one dict."""
    out = tmp_path / "dcp_contents.pt"  # read back at once, so each call may overwrite it
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, state in b.items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        # Both moments exist and differ: the trap where exp_avg comes back as a copy of exp_avg_sq would show.
        assert not torch.equal(state["exp_avg"], state["exp_avg_sq"]), name
        for key, value in state.items():
            assert torch.equal(a[name][key], value), (name, key)


def snapshot(path: Path) -> dict[str, int]:
    """Every file and folder with its size, but the lock a run takes at start, which names the process."""
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.name != ".run.lock"}


@pytest.fixture(scope="module")
def references(tiny, tmp_path_factory):
    """fsdp_version -> the uninterrupted run of that engine (made on first use), keeping the newest 2 checkpoints,
    logging to an offline W&B run."""
    runs = {}

    def reference(fsdp_version: int) -> Path:
        if fsdp_version not in runs:
            out = tmp_path_factory.mktemp(f"reference_fsdp{fsdp_version}")
            torchrun(RECIPE, *recipe_args(tiny, out, "--fsdp_version", fsdp_version, "--save_total_limit", "2",
                                          "--report_to", "wandb"), WANDB_DIR=str(out))
            runs[fsdp_version] = out
        return runs[fsdp_version]

    return reference


@pytest.fixture(scope="module")
def reference(references) -> Path:
    return references(2)


def test_format_follows_the_accelerate_config_unless_set(monkeypatch):
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d"])
    assert resolve_state_dict_type(cfg) == "sharded"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    assert resolve_state_dict_type(cfg) == "full"
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--save_steps", "1",
                        "--save_state_dict_type", "sharded"])
    assert resolve_state_dict_type(cfg) == "sharded"


def test_retention_latest_and_layout(reference):
    assert sorted(p.name for p in reference.iterdir()) == [".run.lock", "checkpoint-4", "checkpoint-6", "final",
                                                           "latest", "metrics.jsonl", "wandb"]
    assert (reference / "latest").read_text() == "checkpoint-6"
    state = validate_checkpoint(str(reference / "checkpoint-4"))
    assert (state["step"], state["epoch"], state["world_size"], state["format"]) == (4, 0, 2, "sharded")
    assert state["config"]["gradient_accumulation_steps"] == 2 and state["scheduler"]["last_epoch"] == 4
    assert sorted(os.listdir(reference / "checkpoint-4" / "rng")) == ["rank_0.pt", "rank_1.pt"]
    [wandb_run] = (reference / "wandb").glob("offline-run-*")
    assert state["wandb_run_id"] and wandb_run.name.endswith("-" + state["wandb_run_id"])


def training_state(cfg):
    """The sharded model, its optimizer and a cosine schedule of 6 steps, as a recipe builds them for `cfg`."""
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    optimizer = build_optimizer(model, cfg)
    return model, optimizer, get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=6)


def can_mount_a_tmpfs() -> bool:
    return os.geteuid() == 0 and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not can_mount_a_tmpfs(), reason="needs root and unshare, to mount a small tmpfs of its own")
def test_a_save_onto_a_full_disk_says_how_much_space_is_left(tiny, tmp_path):
    # output_dir on a 2 MB tmpfs (in a mount namespace of the run's own), room for one checkpoint of the tiny model:
    # the second save fails. The shell copies what the run left there to tmp_path/left before the tmpfs goes.
    out = tmp_path / "small_disk"
    out.mkdir()
    script = 'mount -t tmpfs -o size=2m tmpfs "$0" && "$@"; rc=$?; cp -r "$0" "$0/../left"; exit $rc'
    proc = run(["unshare", "-m", "sh", "-c", script, out, sys.executable, RECIPE,
                *recipe_args(tiny, out, "--max_steps", "4", "--save_steps", "1")], expect_rc=2)
    error = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        f"error: writing the checkpoint {out}/checkpoint-2.tmp failed \\(rank 0: .+\\), with [0-9.]+ MiB free on the "
        f"file system of {out} \\(its unfinished folder removed\\): make room \\(or set --save_total_limit: every "
        f"checkpoint is kept\\), then resume with --resume_from_checkpoint auto \\(`latest` still names the previous "
        f"checkpoint, if any\\)", error), error
    left = tmp_path / "left"
    assert sorted(os.listdir(left)) == [".run.lock", "checkpoint-1", "latest", "metrics.jsonl"]
    assert (left / "latest").read_text() == "checkpoint-1"
    assert validate_checkpoint(str(left / "checkpoint-1"))["step"] == 1


def test_a_rank_out_of_memory_in_the_weight_gather_stops_with_that_error(tiny, tmp_path):
    # The failure check of a save's parts is a collective: a rank that failed inside the gather must not reach it
    # while the other waits in the gather's next all-gather (gloo: "collective mismatch"; NCCL: a hang).
    proc = torchrun("tests/drivers/ckpt_oom_gather.py", RECIPE,
                    *recipe_args(tiny, tmp_path, "--max_steps", "1", "--save_steps", "1",
                                 "--save_state_dict_type", "full"), expect_rc=1)
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (simulated)" in proc.stderr
    assert "mismatch" not in proc.stderr and not (tmp_path / "checkpoint-1").exists()


def test_a_folder_that_cannot_be_synced_does_not_stop_a_save(tiny, tmp_path, one_process_group, monkeypatch):
    """SMB and some FUSE and Ceph mounts refuse to fsync a folder (EINVAL); they keep its entries themselves."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path)])
    model, optimizer, scheduler = training_state(cfg)
    fsync = os.fsync

    def fsync_files_only(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_files_only)
    save_checkpoint(cfg, model, optimizer, scheduler, load_tokenizer(cfg), 2, 0, None)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "checkpoint-2"
    assert validate_checkpoint(str(tmp_path / "checkpoint-2"))["step"] == 2
    # A file that cannot be synced is another matter: its bytes may not be on the disk.
    def fsync_refused(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", fsync_refused)
    with pytest.raises(OSError, match=r"^\[Errno 22\] Invalid argument$"):
        export_fsync(str(tmp_path / "latest"))


@pytest.fixture
def ctrl_c_interrupts():
    """Python's Ctrl-C handler, which raises KeyboardInterrupt: a process started in the background by a shell
    without job control (`cmd &`) inherits SIGINT ignored, and Python then installs none."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def after_ctrl_c(method):
    """`method`, run after this process is sent a Ctrl-C (SIGINT): one that arrives in the middle of DCP's work."""
    def interrupted(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return method(self, *args, **kwargs)
    return interrupted


def test_ctrl_c_during_a_save_stops_the_run_as_an_interrupt(tiny, tmp_path, one_process_group, monkeypatch,
                                                            ctrl_c_interrupts):
    """DCP wraps every exception of a write, Ctrl-C's KeyboardInterrupt too: it was reported as a failed write
    ("make room"), exit 2 as for a config error."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path)])
    model, optimizer, scheduler = training_state(cfg)
    monkeypatch.setattr(FileSystemWriter, "write_data", after_ctrl_c(FileSystemWriter.write_data))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(cfg, model, optimizer, scheduler, load_tokenizer(cfg), 2, 0, None)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2.tmp"]  # no `latest` names it


def save_failing_at_the_rng_file(cfg, monkeypatch, error: Exception) -> str:
    """The error of a save whose write of rank 0's RNG file raises `error` (DCP's own writes go through torch.save
    too), with nothing else left in output_dir."""
    model, optimizer, scheduler = training_state(cfg)
    save = torch.save

    def failing_at_the_rng_file(obj, file, *args, **kwargs):
        if str(file).endswith("rank_0.pt"):
            raise error
        return save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_at_the_rng_file)
    with pytest.raises(CheckpointError) as failed:
        save_checkpoint(cfg, model, optimizer, scheduler, load_tokenizer(cfg), 2, 0, None)
    # No `latest` names it, and the unfinished save is gone: on a full disk it held the room the error asks for.
    assert os.listdir(cfg.output_dir) == []
    return str(failed.value)


@pytest.mark.parametrize("limit, room", [
    ([], "or set --save_total_limit: every checkpoint is kept"),
    (["--save_total_limit", "3"], "or lower --save_total_limit 3: a save needs room for 4 checkpoints, as the oldest "
                                  "is removed once the new one is complete"),
    # Nothing lower to set: the advice was to lower it.
    (["--save_total_limit", "1"], "a save needs room for 2 checkpoints, as the oldest is removed once the new one is "
                                  "complete")], ids=["no_limit", "limit_3", "limit_1"])
def test_a_full_disk_in_torch_save_is_a_failed_save_that_names_the_checkpoint(tiny, tmp_path, one_process_group,
                                                                              monkeypatch, limit, room):
    """torch.save reports a full disk as a RuntimeError ("unexpected pos"): it must become the same failed save as
    an OSError, which every rank learns of; escaping on one rank, it left the others waiting in the next gather."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path, *limit)])
    message = save_failing_at_the_rng_file(
        cfg, monkeypatch, RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0"))
    assert re.fullmatch(
        f"writing the checkpoint {tmp_path}/checkpoint-2.tmp failed \\(rank 0: RuntimeError: \\[enforce fail at "
        f"inline_container.cc:664\\] . unexpected pos 64 vs 0\\), with [0-9.,]+ MiB free on the file system of "
        f"{tmp_path} \\(its unfinished folder removed\\): make room \\({re.escape(room)}\\), then resume with "
        f"--resume_from_checkpoint auto \\(`latest` still names the previous checkpoint, if any\\)", message), message


def test_a_save_the_file_system_refuses_says_to_fix_that_not_to_make_room(tiny, tmp_path, one_process_group,
                                                                           monkeypatch):
    # Flaky permissions, a file system remounted read-only: the advice was to make room and change save_total_limit.
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path)])
    rng_file = f"{tmp_path}/checkpoint-2.tmp/rng/rank_0.pt"
    message = save_failing_at_the_rng_file(cfg, monkeypatch, PermissionError(errno.EACCES, "Permission denied",
                                                                             rng_file))
    assert re.fullmatch(
        f"writing the checkpoint {tmp_path}/checkpoint-2.tmp failed \\(rank 0: PermissionError: \\[Errno 13\\] "
        f"Permission denied: '{rng_file}'\\), with [0-9.,]+ MiB free on the file system of {tmp_path} \\(its "
        f"unfinished folder removed\\): fix what it names \\(the folder's permissions, a file system mounted "
        f"read-only\\), then resume with --resume_from_checkpoint auto \\(`latest` still names the previous "
        f"checkpoint, if any\\)", message), message
    # With several ranks: one out of room asks for room, beside a rank that wrote its part or was refused.
    for reports in ([("RuntimeError: unexpected pos 64 vs 0", True), None],
                    [("PermissionError: [Errno 13] Permission denied", False), ("OSError: [Errno 28]", True)]):
        assert _save_failure_remedy(reports, cfg).startswith("make room (")


def test_a_failed_latest_write_keeps_the_complete_checkpoint_and_names_it(tiny, tmp_path, one_process_group,
                                                                          monkeypatch):
    """The checkpoint is renamed into place before `latest` is written: a failure there was reported as a failed
    save whose unfinished folder was removed, while the complete checkpoint stayed (auto resumed from an older one)."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path)])
    model, optimizer, scheduler = training_state(cfg)
    replace = os.replace

    def full_disk_at_latest(src, dst):
        if os.path.basename(dst) == "latest":
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", full_disk_at_latest)
    with pytest.raises(CheckpointError) as failed:
        save_checkpoint(cfg, model, optimizer, scheduler, load_tokenizer(cfg), 2, 0, None)
    assert re.fullmatch(
        f"the checkpoint {tmp_path}/checkpoint-2 is complete, but making `latest` name it failed \\(rank 0: OSError: "
        f"\\[Errno 28\\] No space left on device: '{tmp_path}/latest'\\), with [0-9.,]+ MiB free on the file system "
        f"of {tmp_path}: make room \\(or set --save_total_limit: every checkpoint is kept\\), then resume with "
        f"--resume_from_checkpoint {tmp_path}/checkpoint-2 \\(`latest` still names the previous checkpoint, if "
        f"any\\)", str(failed.value)), str(failed.value)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "latest.tmp"]
    assert validate_checkpoint(str(tmp_path / "checkpoint-2"))["step"] == 2


def test_a_damaged_shard_is_named_with_the_checkpoint(tiny, reference, tmp_path, one_process_group):
    # Same size, other bytes (bit rot, a copy that went wrong): DCP's own error named no file, and escaped run_main.
    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(reference / "checkpoint-6", checkpoint)
    with open(checkpoint / "optimizer" / "__0_0.distcp", "r+b") as f:
        f.write(bytes(4096))
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path / "out")])
    model, optimizer, scheduler = training_state(cfg)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(str(checkpoint), model, optimizer, scheduler)
    assert str(error.value).startswith(f"{checkpoint}/optimizer cannot be read (rank 0: UnpicklingError: ")
    assert str(error.value).endswith("): a file in it is damaged, or it holds another model's state. Resume from "
                                     "another checkpoint")


def test_a_full_checkpoint_loads_every_weight_and_one_without_a_weight_or_its_file_is_refused(tiny, tmp_path,
                                                                                               one_process_group):
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path, "--save_state_dict_type", "full")])
    model, optimizer, scheduler = training_state(cfg)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()  # weights other than the source's, which the model below starts from
    checkpoint = save_checkpoint(cfg, model, optimizer, scheduler, load_tokenizer(cfg), 2, 0, None)
    resumed = shard_model(load_model(cfg), resolve_plan(cfg))
    load_model_weights(checkpoint, "full", resumed)  # the tied output weight too: the file holds the embedding alone
    weights = {state_dict_name(name): param for name, param in resumed.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(full(weights[state_dict_name(name)]), full(param)), name
    saved = load_file(f"{checkpoint}/model.safetensors")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    # A hand-edited file: one line that names the weights, not torch's load_state_dict traceback.
    saved["model.extra.weight"] = saved.pop("model.norm.weight")
    save_file(saved, f"{checkpoint}/model.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_model_weights(checkpoint, "full", resumed)
    assert str(error.value) == (f"{checkpoint} lacks model.norm.weight and holds model.extra.weight, which the model "
                                f"has not: its weights are not this model's. Resume from another checkpoint")
    os.remove(f"{checkpoint}/model.safetensors")
    with pytest.raises(CheckpointError) as error:
        validate_checkpoint(checkpoint)
    assert str(error.value) == f"{checkpoint} is incomplete: model.safetensors missing"


def test_a_dcp_folder_missing_its_metadata_short_by_a_byte_or_whose_metadata_would_run_code_is_refused(
        tiny, tmp_path, one_process_group):
    checkpoint = small_checkpoint(tiny, tmp_path)
    shard = f"{checkpoint}/optimizer/__0_0.distcp"
    size = os.path.getsize(shard)
    os.truncate(shard, size - 1)  # the last tensor's last byte: the check takes the end of the file's last item
    with pytest.raises(CheckpointError) as error:
        validate_checkpoint(checkpoint)
    assert str(error.value) == f"{shard} is truncated: {size - 1} bytes, expected at least {size}"
    metadata = Path(checkpoint) / "model" / ".metadata"
    metadata.rename(metadata.with_suffix(".kept"))  # as a rank 0 killed before DCP's last write leaves it
    with pytest.raises(CheckpointError) as error:
        validate_checkpoint(checkpoint)
    assert str(error.value) == f"{checkpoint}/model is incomplete: its .metadata file is missing"

    class RunsCode:  # a .metadata crafted to run a command when unpickled
        def __reduce__(self):
            return os.makedirs, (str(tmp_path / "made_by_the_metadata"),)

    metadata.write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(CheckpointError) as error:
        validate_checkpoint(checkpoint)
    assert str(error.value) == (f"{checkpoint}/model/.metadata cannot be read (UnpicklingError: os.makedirs is not "
                                f"allowed in checkpoint metadata)")
    assert not (tmp_path / "made_by_the_metadata").exists()


def test_a_checkpoint_without_a_weight_of_the_model_is_refused_not_loaded_around_it(tiny, tmp_path, one_process_group):
    # DCP's default planner loads the others and leaves that one as the model has it: a resume would go on with the
    # source's value of a weight the run had trained.
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path)])
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    weights = get_model_state_dict(model)
    del weights["model.norm.weight"]
    dcp.save(weights, checkpoint_id=tmp_path / "checkpoint-2" / "model")
    with pytest.raises(CheckpointError) as error:
        load_model_weights(str(tmp_path / "checkpoint-2"), "sharded", model)
    assert str(error.value) == (
        f"{tmp_path}/checkpoint-2/model cannot be read (rank 0: RuntimeError: Missing key in checkpoint state_dict: "
        f"model.norm.weight.): a file in it is damaged, or it holds another model's state. Resume from another "
        f"checkpoint")


def test_ctrl_c_or_out_of_memory_during_a_resume_is_not_called_damage(tiny, tmp_path, one_process_group, monkeypatch,
                                                                      ctrl_c_interrupts):
    """DCP wraps Ctrl-C's KeyboardInterrupt during a read too: it was reported as a damaged checkpoint file, with
    advice to resume from another checkpoint, exit 2 as for a config error."""
    checkpoint = small_checkpoint(tiny, tmp_path)
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path / "out")])
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    optimizer = build_optimizer(model, cfg)
    monkeypatch.setattr(FileSystemReader, "read_data", after_ctrl_c(FileSystemReader.read_data))
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(checkpoint, model, optimizer, get_scheduler("constant", optimizer))

    # Nor is running out of memory while reading: the checkpoint is whole.
    def out_of_memory_while_reading(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(FileSystemReader, "read_data", out_of_memory_while_reading)
    with pytest.raises(torch.OutOfMemoryError, match="^CUDA out of memory. Tried to allocate 2.00 GiB$"):
        load_checkpoint(checkpoint, model, optimizer, get_scheduler("constant", optimizer))


def full(tensor: torch.Tensor) -> torch.Tensor:
    """FSDP2's DTensor whole; FSDP1's and Adam's step count as they are."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.parametrize("fsdp_version, checkpointing", [(2, "false"), (1, "false"), (2, "true"), (1, "true")])
def test_a_parameter_that_had_no_gradient_resumes_without_optimizer_state(tiny, tmp_path, one_process_group,
                                                                          fsdp_version, checkpointing):
    """A parameter without a gradient before the save (a vision tower on text-only data) has no Adam state in the
    checkpoint; the resume must load the others and leave it without state, as the run that saved it. With
    activation checkpointing too (FSDP1's wrapper outside its units made torch name them so that none loaded)."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path, "--fsdp_version", fsdp_version,
                                                        "--fsdp_activation_checkpointing", checkpointing)])
    model, optimizer, scheduler = training_state(cfg)
    # A whole FSDP unit, as a vision tower's layers (FSDP1 cannot save state for part of a unit's flat parameter).
    unused = {name for name, _ in model.named_parameters() if ".layers.1." in state_dict_name(name)}
    for name, param in model.named_parameters():
        param.grad = None if name in unused else torch.ones_like(param)
    optimizer.step()
    save_checkpoint(cfg, model, optimizer, scheduler, load_tokenizer(cfg), 1, 0, None)

    resumed = shard_model(load_model(cfg), resolve_plan(cfg))
    resumed_optimizer = build_optimizer(resumed, cfg)
    resumed_scheduler = get_scheduler("cosine", resumed_optimizer, num_warmup_steps=0, num_training_steps=6)
    load_checkpoint(str(tmp_path / "checkpoint-1"), resumed, resumed_optimizer, resumed_scheduler)
    saved = {state_dict_name(name): optimizer.state[param] for name, param in model.named_parameters()
             if param in optimizer.state}
    loaded = {state_dict_name(name): resumed_optimizer.state[param] for name, param in resumed.named_parameters()
              if param in resumed_optimizer.state}
    assert sorted(loaded) == sorted(saved) and len(saved) == len(dict(model.named_parameters())) - len(unused)
    for name, state in saved.items():
        for key, value in state.items():
            assert torch.equal(full(loaded[name][key]), full(value)), (name, key)
    # And the weights Adam moved (FSDP1 reads them into copies, which must then be set into the model).
    weights = {state_dict_name(name): param for name, param in resumed.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(full(weights[state_dict_name(name)]), full(param)), name


def test_a_checkpoint_with_other_weight_decay_groups_is_refused(tiny, tmp_path, one_process_group):
    # As an earlier version saved Cohere's 2-D q_norm weights: decayed. torch would load the groups and leave one
    # without hyperparameters (KeyError 'betas' at the first step); the resume says what differs instead.
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path)])
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    decay, no_decay = build_optimizer(model, cfg).param_groups
    norms = [p for name, p in model.named_parameters() if name.endswith("model.norm.weight")]
    optimizer = torch.optim.AdamW([{"params": decay["params"] + norms, "weight_decay": 0.1},
                                   {"params": [p for p in no_decay["params"] if all(p is not n for n in norms)],
                                    "weight_decay": 0.0}])
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=6)
    save_checkpoint(cfg, model, optimizer, scheduler, load_tokenizer(cfg), 1, 0, None)
    resumed = shard_model(load_model(cfg), resolve_plan(cfg))
    resumed_optimizer = build_optimizer(resumed, cfg)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(str(tmp_path / "checkpoint-1"), resumed, resumed_optimizer,
                        get_scheduler("cosine", resumed_optimizer, num_warmup_steps=0, num_training_steps=6))
    assert str(error.value) == (
        f"{tmp_path / 'checkpoint-1'} groups the parameters for weight decay otherwise than this version of the "
        f"project does (it moved model.norm.weight; biases and norm weights get none): resume with the version that "
        f"saved it, or convert its weights (`python -m fsdp_recipes.convert {tmp_path / 'checkpoint-1'} <out_dir>`) to "
        f"train them further in a fresh run with --model_name_or_path <out_dir>")


def rng_draws() -> tuple:
    """The next numbers of Python's, NumPy's and torch's generators, each of which a checkpoint saves per rank."""
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_the_resume_state_holds_each_key_and_a_resume_restores_each_value(tiny, tmp_path, one_process_group):
    """Every key of trainer_state.json and of a rank's RNG file, with its value; load_checkpoint gives the state
    back and restores the scheduler, the weights, Adam's moments and each generator as they were saved."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path)])
    tokenizer = load_tokenizer(cfg)
    train_data, _ = build_datasets(cfg, tokenizer)

    def model_optimizer_scheduler():
        model = shard_model(load_model(cfg), resolve_plan(cfg))
        optimizer = build_optimizer(model, cfg)
        return model, optimizer, get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=6)

    model, optimizer, scheduler = model_optimizer_scheduler()
    for step in range(2):
        for param in model.parameters():
            param.grad = torch.full_like(param, step + 1.0)
        optimizer.step()
        scheduler.step()
    wandb_run = {"wandb_run_id": "run123", "wandb_project": "fsdp-recipes-tests", "wandb_entity": "fsdp-team"}
    train_identity = training_data_identity(train_data)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    checkpoint = save_checkpoint(cfg, model, optimizer, scheduler, tokenizer, 2, 0, wandb_run, train_identity)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved_draws = rng_draws()  # the save draws none: these follow the saved states

    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state.keys() == {"step", "epoch", "world_size", "format", "model_files", "master_dtype", "compute",
                            "loaded_in_model_layout", "scheduler", "wandb_run_id", "wandb_project", "wandb_entity",
                            "config", "train_data", "versions"}
    assert {k: v for k, v in state.items() if k not in ("model_files", "scheduler", "config")} == {
        "step": 2, "epoch": 0, "world_size": 1, "format": "sharded", "master_dtype": "float32",
        "compute": {"attn_implementation": "sdpa", "fsdp_version": 2, "mixed_precision": "no", "offload_params": False,
                    "torch_compile": False, "gradient_sync": "every_micro_batch"},
        "loaded_in_model_layout": True, **wandb_run, "train_data": train_identity, "versions": library_versions()}
    assert state["config"] == cfg.to_dict() and state["config"]["learning_rate"] == 1e-2
    assert state["scheduler"] == json.loads(json.dumps(scheduler.state_dict()))
    assert state["scheduler"]["last_epoch"] == 2
    assert state["scheduler"]["_last_lr"] == pytest.approx([0.01 * 0.9045] * 2, rel=1e-4)
    written_by_resume = ("rng", "model", "optimizer", "trainer_state.json")
    assert state["model_files"] == sorted(
        str(p.relative_to(checkpoint)) for p in Path(checkpoint).rglob("*")
        if p.is_file() and p.relative_to(checkpoint).parts[0] not in written_by_resume)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(state["model_files"])
    rng = torch.load(tmp_path / "checkpoint-2" / "rng" / "rank_0.pt", weights_only=True)
    assert rng.keys() == {"python", "numpy", "torch"}  # and "cuda" where CUDA runs

    resumed, resumed_optimizer, resumed_scheduler = model_optimizer_scheduler()
    random.seed(10), np.random.seed(20), torch.manual_seed(30)
    assert load_checkpoint(checkpoint, resumed, resumed_optimizer, resumed_scheduler) == state
    assert rng_draws() == saved_draws
    assert resumed_scheduler.state_dict() == scheduler.state_dict()
    assert [g["lr"] for g in resumed_optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
    names = {state_dict_name(name): param for name, param in resumed.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(full(names[state_dict_name(name)]), full(param)), name
        saved, loaded = optimizer.state[param], resumed_optimizer.state[names[state_dict_name(name)]]
        assert saved.keys() == loaded.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in saved:
            assert torch.equal(full(loaded[key]), full(saved[key])), (name, key)
    # A run made longer (12 steps) trains and logs (get_last_lr) the next step with its own schedule's LR.
    longer, longer_optimizer, _ = model_optimizer_scheduler()
    longer_scheduler = get_scheduler("cosine", longer_optimizer, num_warmup_steps=1, num_training_steps=12)
    load_checkpoint(checkpoint, longer, longer_optimizer, longer_scheduler)
    assert longer_scheduler.get_last_lr() == [g["lr"] for g in longer_optimizer.param_groups] == pytest.approx(
        [0.01 * 0.97975] * 2, rel=1e-4)


def test_each_rank_resumes_with_its_own_rng_states(tiny, tmp_path):
    # set_seed gives every rank one state, but dropout on micro-batches of other lengths draws other amounts on each:
    # a rank restored from another rank's file would draw other masks than in the uninterrupted run.
    torchrun("tests/drivers/ckpt_rng.py", tmp_path, *recipe_args(tiny, tmp_path))
    draws = [json.loads((tmp_path / f"draws_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert draws[0]["saved"] != draws[1]["saved"]
    assert [rank["loaded"] for rank in draws] == [rank["saved"] for rank in draws]


def record_fsync_and_replace(monkeypatch) -> list[tuple]:
    """Each os.fsync (with the path it syncs) and os.replace from now on, in order; both still do their work."""
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", str(src), str(dst))),
                                                         replace(src, dst)))
    return events


def test_a_save_is_on_disk_before_latest_names_it(tiny, tmp_path, one_process_group, monkeypatch):
    """Every file and folder of the checkpoint is fsynced before its rename, and `latest` after it: a node that
    crashes right after a save cannot leave `latest` naming a folder of empty files. Retention removes the older
    checkpoint only once `latest` names the new one (os.fsync and os.replace are recorded, and still called)."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path, "--save_state_dict_type", "full",
                                                        "--save_total_limit", "1")])
    (tmp_path / "checkpoint-1").mkdir()  # the one retention removes
    (tmp_path / "checkpoint-2.tmp" / "rng").mkdir(parents=True)  # a killed save's, by 2 ranks: it starts afresh
    (tmp_path / "checkpoint-2.tmp" / "rng" / "rank_1.pt").write_bytes(b"")
    model, optimizer, scheduler = training_state(cfg)
    tokenizer = load_tokenizer(cfg)  # with a named chat template: the tokenizer writes it into a folder of its own
    tokenizer.chat_template = {"default": tokenizer.chat_template, "tool_use": "{{ tools }}"}
    events = record_fsync_and_replace(monkeypatch)
    save_checkpoint(cfg, model, optimizer, scheduler, tokenizer, 2, 0, None)
    monkeypatch.undo()
    tmp, final = tmp_path / "checkpoint-2.tmp", tmp_path / "checkpoint-2"
    assert (final / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert os.listdir(final / "rng") == ["rank_0.pt"]
    renamed = events.index(("replace", str(tmp), str(final)))
    latest = events.index(("replace", f"{tmp_path}/latest.tmp", f"{tmp_path}/latest"))
    synced_before = {path for _, path in events[:renamed]}
    written = {str(p) for p in tmp_path.glob("checkpoint-2/**/*")}
    # DCP syncs its .metadata as .metadata.tmp, which it renames in the folder synced after it.
    synced_before = {path.replace(str(tmp), str(final)).replace(".metadata.tmp", ".metadata") for path in synced_before}
    assert synced_before >= written | {str(final)}, written - synced_before
    assert ("fsync", str(tmp_path)) in events[renamed:latest] and ("fsync", f"{tmp_path}/latest.tmp") in events
    assert events[latest + 1] == ("fsync", str(tmp_path))
    # A kill before `latest` is replaced leaves it naming checkpoint-1, which must still be there.
    assert events.index(("replace", f"{tmp_path}/checkpoint-1", f"{tmp_path}/checkpoint-1.old")) > latest
    assert (tmp_path / "latest").read_text() == "checkpoint-2"
    assert not (tmp_path / "checkpoint-1").exists()
    # final/ too: every file and folder before its rename, the rename itself after it.
    events = record_fsync_and_replace(monkeypatch)
    save_hf_model(model, tokenizer, str(tmp_path / "final"), torch.float32)
    monkeypatch.undo()
    renamed = events.index(("replace", f"{tmp_path}/final.tmp", f"{tmp_path}/final"))
    synced_before = {path.replace(f"{tmp_path}/final.tmp", f"{tmp_path}/final") for _, path in events[:renamed]}
    written = {str(p) for p in tmp_path.glob("final/**/*")}
    assert written and synced_before >= written | {f"{tmp_path}/final"}, written - synced_before
    assert events[renamed + 1:] == [("fsync", str(tmp_path))]


@pytest.mark.parametrize("held, saved_step, limit, kept", [
    # A resume from checkpoint-2 left checkpoint-6 of the earlier run behind; the new checkpoint-4 is `latest`.
    (["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8.tmp"], 4, 1, ["checkpoint-4"]),
    # Resumed from checkpoint-2 of a run that had reached checkpoint-6: this run's checkpoint-2 and -3 are its newest
    # two, not checkpoint-3 and the left branch's checkpoint-6.
    (["checkpoint-2", "checkpoint-3", "checkpoint-4", "checkpoint-6"], 3, 2, ["checkpoint-2", "checkpoint-3"]),
    # Steps by number: as text, checkpoint-10 sorts before checkpoint-8 and would go while the older one stays.
    (["checkpoint-8", "checkpoint-10", "checkpoint-12"], 12, 2, ["checkpoint-10", "checkpoint-12"]),
    # Fewer checkpoints than save_total_limit: none is removed, the oldest included.
    (["checkpoint-2", "checkpoint-4", "checkpoint-6"], 6, 4, ["checkpoint-2", "checkpoint-4", "checkpoint-6"]),
], ids=["keeps_the_checkpoint_just_saved", "removes_the_left_branch_before_this_runs_own",
        "removes_the_lowest_steps_not_the_first_names", "keeps_every_checkpoint_below_the_limit"])
def test_retention_keeps_this_runs_newest_checkpoints(tmp_path, held, saved_step, limit, kept):
    for name in held:
        (tmp_path / name).mkdir()
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path),
                        "--save_steps", "1", "--save_total_limit", str(limit)])
    apply_retention(cfg, saved_step=saved_step)
    assert sorted(os.listdir(tmp_path)) == kept


def test_a_checkpoint_retention_cannot_remove_is_a_warning_not_a_failed_save(tmp_path, monkeypatch, capsys):
    # On NFS a folder holding a file still open elsewhere (.nfsXXXX) cannot be removed: EBUSY.
    for name in ["checkpoint-2", "checkpoint-4"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text("{}")
    rmtree = shutil.rmtree

    def busy(path, *args, **kwargs):
        if not kwargs.get("ignore_errors"):
            raise OSError(errno.EBUSY, "Device or resource busy", f"{path}/.nfs0001")
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", busy)
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path),
                        "--save_steps", "2", "--save_total_limit", "1"])
    apply_retention(cfg, saved_step=4)
    assert capsys.readouterr().out == (
        f"warning: save_total_limit 1: {tmp_path}/checkpoint-2 could not be removed (OSError: [Errno 16] Device or "
        f"resource busy: '{tmp_path}/checkpoint-2.old/.nfs0001'); the next save tries again\n")
    # Renamed before its removal began: no longer a checkpoint to resume from, and the next save removes it.
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2.old", "checkpoint-4"]
    monkeypatch.undo()
    apply_retention(cfg, saved_step=4)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]


@pytest.mark.parametrize("fsdp_version", [2, 1])
def test_resume_mid_epoch_gives_equal_losses_optimizer_and_weights(tiny, references, tmp_path, fsdp_version):
    reference = references(fsdp_version)
    engine = ["--fsdp_version", fsdp_version]
    # From the sharded checkpoint-4, saving full checkpoints at steps 5 and 6; then from the full checkpoint-5.
    torchrun(RECIPE, *recipe_args(tiny, tmp_path / "from_sharded", *engine, "--resume_from_checkpoint",
                                  reference / "checkpoint-4", "--save_state_dict_type", "full", "--save_steps", "1"))
    torchrun(RECIPE, *recipe_args(tiny, tmp_path / "from_full", *engine, "--resume_from_checkpoint",
                                  tmp_path / "from_sharded" / "checkpoint-5"))
    uninterrupted = losses(reference)
    saved_optimizer = dcp_contents(reference / "checkpoint-6" / "optimizer", tmp_path)
    for resumed, first_step in [(tmp_path / "from_sharded", 5), (tmp_path / "from_full", 6)]:
        # Exact: the same floats, not approximately.
        assert losses(resumed) == {step: uninterrupted[step] for step in range(first_step, 7)}
        assert_same_weights(final_weights(resumed), final_weights(reference))
        # Adam's moments at step 6 are the uninterrupted run's only if those at the resumed step were restored.
        optimizer = dcp_contents(resumed / "checkpoint-6" / "optimizer", tmp_path)
        assert_same_optimizer_state(optimizer["state"], saved_optimizer["state"])
        assert optimizer["param_groups"] == saved_optimizer["param_groups"]
    # A full checkpoint converts to the HF folder the run exports at that step.
    convert(str(tmp_path / "from_sharded" / "checkpoint-6"), str(tmp_path / "converted"))
    assert_same_weights(load_file(tmp_path / "converted" / "model.safetensors"), final_weights(reference))
    assert sorted(os.listdir(tmp_path / "converted")) == sorted(os.listdir(reference / "final"))


def test_fsdp1_resumes_a_parameter_with_fewer_rows_than_ranks(tiny, tmp_path):
    """Qwen2-MoE's shared_expert_gate has 1 row: under FSDP1 rank 1 holds none of it, and its state dicts leave it out.
    DCP's load took the checkpoint for one of torch 2.3 then, and failed on rank 1 ("param_groups" missing: "a file in
    it is damaged")."""
    tokenizer = demo.build_tokenizer()
    config = AutoConfig.for_model("qwen2_moe", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.model.layers[0].mlp.shared_expert_gate.weight.shape == (1, 64)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    args = ["recipes/sft.py", "--config", "recipes/configs/sft.yaml", "--model_name_or_path", tmp_path / "model",
            "--dataset_name", tiny["data"], "--max_steps", "2", "--save_steps", "1", "--logging_steps", "1",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_seq_length", "64",
            "--mixed_precision", "no", "--save_dtype", "float32", "--learning_rate", "1e-2", "--fsdp_version", "1"]
    torchrun(*args, "--output_dir", tmp_path / "uninterrupted")
    torchrun(*args, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint",
             tmp_path / "uninterrupted" / "checkpoint-1")
    assert losses(tmp_path / "resumed") == {2: losses(tmp_path / "uninterrupted")[2]}
    assert_same_weights(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "uninterrupted"))


def scheduled_lr(step: int, total_steps: int) -> float:
    """The LR an uninterrupted run of total_steps trains step + 1 with (recipe_args' LR, cosine, no warm-up)."""
    optimizer = torch.optim.SGD([torch.zeros(1)], lr=1e-2)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=total_steps)
    for _ in range(step):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


@pytest.mark.parametrize("fsdp_version, saved_by, loaded_by", [(2, 2, 1), (2, 1, 2), (1, 2, 1)])
def test_checkpoint_loads_exactly_into_another_world_size(tiny, references, tmp_path, fsdp_version, saved_by,
                                                          loaded_by):
    engine = ["--fsdp_version", fsdp_version]
    if saved_by == 2:
        checkpoint = references(fsdp_version) / "checkpoint-4"
    else:
        run([sys.executable, RECIPE, *recipe_args(tiny, tmp_path / "one", *engine, "--max_steps", "2")])
        checkpoint = tmp_path / "one" / "checkpoint-2"
    loader = ["tests/drivers/ckpt_load.py", checkpoint, tmp_path / "loaded.pt",
              *recipe_args(tiny, tmp_path / "x", *engine)]
    proc = run([sys.executable, *loader]) if loaded_by == 1 else torchrun(*loader)
    assert f"saved by {saved_by} rank{'s' * (saved_by > 1)}, this run has {loaded_by}: RNG states are not restored" in proc.stdout
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    saved_model = dcp_contents(checkpoint / "model", tmp_path)
    saved_optim = dcp_contents(checkpoint / "optimizer", tmp_path)
    assert_same_weights(loaded["model"], saved_model)
    assert_same_optimizer_state(loaded["optimizer"]["state"], saved_optim["state"])
    # All but the LR, which follows the loader's schedule (below).
    assert ([{k: v for k, v in group.items() if k != "lr"} for group in loaded["optimizer"]["param_groups"]]
            == [{k: v for k, v in group.items() if k != "lr"} for group in saved_optim["param_groups"]])
    # Weight decay on the matrices, none on the norm weights (FSDP1's sharded parameters are all 1-D views).
    decay, no_decay = saved_optim["param_groups"]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert {saved_model[name].ndim for name in decay["params"]} == {2}
    assert {saved_model[name].ndim for name in no_decay["params"]} == {1}
    # The LRs of the next step follow the loader's schedule (6 steps), also from the 2-step run's checkpoint.
    step = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    assert loaded["lr"] == loaded["group_lr"] == [scheduled_lr(step, total_steps=6)] * 2


def test_a_run_that_diverges_on_one_rank_stops_before_saving_nan_weights(tiny, tmp_path):
    # Rank 1's logits are NaN in step 3 only, a step that neither logs nor saves; the next check is step 4's save.
    args = recipe_args(tiny, tmp_path, "--logging_steps", "4", "--save_total_limit", "1")
    proc = torchrun("tests/drivers/nan_on_rank1.py", 3, *args, expect_rc=1)  # torchrun exits 1 for any failure
    # The gradient norm is global: both ranks stop at step 4, neither waits in the save for the other.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[0] == errors[1], proc.stderr[-3000:]
    assert errors[0].startswith("error: training diverged: the gradient norm is nan at step 4 (checked at logging, "
                                "saving and evaluation steps, finite at step 2)"), errors[0]
    assert "lower --learning_rate (now 0.01)" in errors[0]
    # Step 4's metrics are logged (the NaNs as null, in strict JSON), its weights are not saved, and retention (one
    # checkpoint) kept step 2's.
    [line] = (tmp_path / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert (metrics["step"], metrics["loss"], metrics["grad_norm"]) == (4, None, None)
    assert (tmp_path / "latest").read_text() == "checkpoint-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock", "checkpoint-2", "latest", "metrics.jsonl"]
    weights = dcp_contents(tmp_path / "checkpoint-2" / "model", tmp_path)
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize("mode, fmt", [("after_checkpoint", "full"), ("during_save", "sharded")])
def test_killed_run_resumes_with_auto_to_the_same_weights(tiny, reference, tmp_path, mode, fmt):
    args = recipe_args(tiny, tmp_path, "--save_state_dict_type", fmt, "--resume_from_checkpoint", "auto")
    # The first run starts from scratch (auto, no checkpoint yet); rank 1 is killed at the second save.
    killed = torchrun("tests/drivers/ckpt_kill.py", mode, 2, *args, expect_rc=1)
    assert "resume: no checkpoint" in killed.stdout
    if mode == "after_checkpoint":
        assert (tmp_path / "latest").read_text() == "checkpoint-4"
        assert validate_checkpoint(str(tmp_path / "checkpoint-4"))["format"] == "full"
    else:
        # The save in progress is left under .tmp; the previous checkpoint is complete and `latest` names it.
        assert (tmp_path / "checkpoint-4.tmp").is_dir() and not (tmp_path / "checkpoint-4").exists()
        assert (tmp_path / "latest").read_text() == "checkpoint-2"
        validate_checkpoint(str(tmp_path / "checkpoint-2"))
    assert not (tmp_path / "final").exists()

    resumed = torchrun(RECIPE, *args)
    start = 4 if mode == "after_checkpoint" else 2
    assert f"resumed from {tmp_path / f'checkpoint-{start}'} at step {start}" in resumed.stdout
    assert "computes its steps otherwise" not in resumed.stdout  # the same settings: nothing to say
    uninterrupted = losses(reference)
    # metrics.jsonl keeps the steps up to the checkpoint, drops those the killed run logged after it, continues.
    assert losses(tmp_path) == uninterrupted
    assert_same_weights(final_weights(tmp_path), final_weights(reference))
    assert not list(tmp_path.glob("*.tmp"))
    if fmt == "full":
        # The full checkpoint folder itself loads with from_pretrained, with the fp32 weights of its step.
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-6").state_dict()
        assert_same_weights({k: v for k, v in loaded.items() if k != "lm_head.weight"}, final_weights(reference))
        # A truncated safetensors file of a full checkpoint is refused too.
        shutil.copytree(tmp_path / "checkpoint-6", tmp_path / "truncated")
        weights = tmp_path / "truncated" / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
        with pytest.raises(CheckpointError, match="truncated/model.safetensors is corrupt or truncated"):
            validate_checkpoint(str(tmp_path / "truncated"))


def test_a_run_killed_in_its_last_retention_is_finished_without_what_retention_left(tiny, reference, tmp_path):
    """save_total_limit 1, rank 0 killed in the last save's retention, checkpoint-4 renamed to .old and half removed:
    the resume trains nothing and no save follows, so it finishes that retention itself (the .old folder, or the
    older checkpoint of a kill just before retention, stayed for good)."""
    args = recipe_args(tiny, tmp_path, "--save_total_limit", "1", "--resume_from_checkpoint", "auto")
    torchrun("tests/drivers/ckpt_kill.py", "in_removal", 2, *args, expect_rc=1)  # the first removal is checkpoint-2's
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock", "checkpoint-4.old", "checkpoint-6", "latest",
                                                          "metrics.jsonl"]
    finished = torchrun(RECIPE, *args)
    assert f"resumed from {tmp_path / 'checkpoint-6'} at step 6" in finished.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock", "checkpoint-6", "final", "latest",
                                                          "metrics.jsonl"]
    assert losses(tmp_path) == losses(reference)
    assert_same_weights(final_weights(tmp_path), final_weights(reference))


def test_a_return_to_an_earlier_checkpoint_killed_before_its_first_save_resumes_there(tiny, reference, tmp_path):
    """A run resumed from checkpoint-4 of its own output_dir, whose `latest` names checkpoint-6 (a return to an
    earlier step), is killed in its first save: auto resumes from checkpoint-4 again, not from the branch it left."""
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns(".run.lock"))
    args = recipe_args(tiny, out)
    # The second get_optimizer_state_dict: the first is the resume's load.
    rollback = torchrun("tests/drivers/ckpt_kill.py", "during_save", 2, *args, "--resume_from_checkpoint",
                        out / "checkpoint-4", expect_rc=1)
    assert f"`latest` in {out} now names checkpoint-4, where this run starts (it named checkpoint-6" in rollback.stdout
    assert (out / "latest").read_text() == "checkpoint-4"
    resumed = torchrun(RECIPE, *args, "--resume_from_checkpoint", "auto")
    assert f"resumed from {out / 'checkpoint-4'} at step 4" in resumed.stdout
    assert losses(out) == losses(reference)
    assert_same_weights(final_weights(out), final_weights(reference))
    assert (out / "latest").read_text() == "checkpoint-6"


def test_bad_checkpoints_are_named_and_left_untouched(reference, tmp_path):
    cases = {}
    shutil.copytree(reference / "checkpoint-6", tmp_path / "missing_rank")
    os.remove(tmp_path / "missing_rank" / "model" / "__1_0.distcp")
    cases["missing_rank"] = r"missing_rank/model is incomplete: __1_0.distcp is missing"
    shutil.copytree(reference / "checkpoint-6", tmp_path / "truncated")
    shard = tmp_path / "truncated" / "optimizer" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    cases["truncated"] = r"truncated/optimizer/__0_0.distcp is truncated"
    shutil.copytree(reference / "checkpoint-6", tmp_path / "bad_metadata")
    os.truncate(tmp_path / "bad_metadata" / "model" / ".metadata", 100)
    cases["bad_metadata"] = r"bad_metadata/model/.metadata cannot be read"
    shutil.copytree(reference / "checkpoint-6", tmp_path / "no_rng")
    os.remove(tmp_path / "no_rng" / "rng" / "rank_1.pt")
    cases["no_rng"] = r"no_rng is incomplete: rng/rank_1.pt is missing"
    # Removed to save space, as the converter allows: the folder was reported as "its .metadata file is missing".
    shutil.copytree(reference / "checkpoint-6", tmp_path / "no_optimizer", ignore=shutil.ignore_patterns("optimizer"))
    cases["no_optimizer"] = (rf"no_optimizer has no optimizer/ folder, which a resume needs: resume from a complete "
                             rf"checkpoint, or convert its weights \(`python -m fsdp_recipes.convert "
                             rf"{tmp_path}/no_optimizer <out_dir>`\) to train them further in a fresh run with "
                             rf"--model_name_or_path <out_dir>$")
    shutil.copytree(reference / "checkpoint-6", tmp_path / "for_convert",
                    ignore=shutil.ignore_patterns("optimizer", "rng"))
    cases["for_convert"] = r"for_convert has no optimizer/ or rng/ folder, which a resume needs"
    shutil.copytree(reference / "checkpoint-6", tmp_path / "bad_rng")
    rng = tmp_path / "bad_rng" / "rng" / "rank_0.pt"
    os.truncate(rng, rng.stat().st_size // 2)
    cases["bad_rng"] = r"bad_rng/rng/rank_0.pt is corrupt or truncated"
    shutil.copytree(reference / "checkpoint-6", tmp_path / "no_config")
    os.remove(tmp_path / "no_config" / "config.json")
    cases["no_config"] = r"no_config is incomplete: config.json is missing"
    for name in ("trainer_state.json", "config.json", "tokenizer.json"):  # json's own error names no file
        shutil.copytree(reference / "checkpoint-6", tmp_path / f"cut_{name}")
        os.truncate(tmp_path / f"cut_{name}" / name, (tmp_path / f"cut_{name}" / name).stat().st_size // 2)
        cases[f"cut_{name}"] = rf"cut_{name}/{name} is corrupt or truncated: "
    (tmp_path / "not_a_checkpoint").mkdir()
    cases["not_a_checkpoint"] = r"not_a_checkpoint is not a checkpoint: it has no trainer_state.json"
    # A mistyped step, or a checkpoint retention removed: the message lists those beside it.
    shutil.copytree(reference / "checkpoint-6", tmp_path / "run" / "checkpoint-6")
    cases["run/checkpoint-60"] = (rf"run/checkpoint-60 does not exist \({tmp_path}/run holds checkpoint-6\): pass a "
                                  rf"checkpoint-<step> folder$")
    cases["typo"] = r"typo does not exist: pass a checkpoint-<step> folder$"
    before = snapshot(tmp_path)
    for name, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            validate_checkpoint(str(tmp_path / name))
    assert snapshot(tmp_path) == before


def test_resume_into_a_different_model_is_refused_before_writing(tiny, reference, tmp_path):
    checkpoint = reference / "checkpoint-6"
    before = snapshot(reference)
    proc = run([sys.executable, RECIPE, "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"],
                "--output_dir", tmp_path / "out", "--max_steps", "6", "--resume_from_checkpoint", checkpoint],
               expect_rc=2)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {checkpoint} was saved from a different model config (tie_word_embeddings: "
                           f"checkpoint True, model False")
    # Created (and checked for every rank) at start, nothing written but the lock the run held.
    assert os.listdir(tmp_path / "out") == [".run.lock"]
    assert snapshot(reference) == before


def test_a_multimodal_config_is_compared_entry_by_entry_without_the_dtype():
    # A checkpoint's config.json records float32 in every sub-config; a pure-bf16 run's model says bfloat16 there.
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=64)
    model = Gemma3Config(text_config=text, vision_config=dict(hidden_size=16, num_hidden_layers=1))
    model.dtype = model.text_config.dtype = model.vision_config.dtype = torch.bfloat16
    saved = Gemma3Config.from_dict(json.loads(model.to_json_string()))
    saved.dtype = saved.text_config.dtype = saved.vision_config.dtype = torch.float32
    assert model_config_differences(saved.to_dict(), model.to_dict()) == []
    saved.text_config.num_hidden_layers = 3
    assert model_config_differences(saved.to_dict(), model.to_dict()) == [
        "text_config.num_hidden_layers: checkpoint 3, model 2"]


def test_a_setting_unknown_here_in_a_sub_config_is_found_and_left_out_by_its_dotted_name():
    """Gemma 3's vision_config.vision_use_head (written by 5.25, unknown to 5.17) is in a sub-config: found there and
    left out there alone, the runtime entries not being settings."""
    saved = {"use_cache": True, "vision_config": {"hidden_size": 16, "vision_use_head": True, "dtype": "float32"},
             "text_config": {"hidden_size": 32}}
    current = {"vision_config": {"hidden_size": 16}, "text_config": {"hidden_size": 32}}
    assert settings_only_in(saved, current) == ["vision_config.vision_use_head"]
    assert model_config_differences(saved, current) == ["vision_config.vision_use_head: checkpoint True, model None"]
    assert model_config_differences(saved, current, left_out=frozenset({"vision_config.vision_use_head"})) == []


def test_converter_streams_a_sharded_checkpoint_to_an_hf_folder(reference, tmp_path):
    checkpoint = reference / "checkpoint-6"
    # The README's command, with its example paths replaced.
    [command] = [c for c in readme_commands() if "fsdp_recipes.convert" in c]
    paths = {"outputs/llama/checkpoint-500": str(checkpoint), "outputs/llama/hf": str(tmp_path / "bf16")}
    args = [paths.get(a, a) for a in shlex.split(command)]
    assert args[:3] == ["python", "-m", "fsdp_recipes.convert"] and "--dtype" in args
    run([sys.executable, *args[1:]])
    # Shards small enough that the tiny model needs several files and an index.
    convert(str(checkpoint), str(tmp_path / "fp32"), torch.float32, "100KB")
    index = json.loads((tmp_path / "fp32" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    # As save_pretrained writes it: the bytes of all the tensors, which tools read as the model's size.
    tensors = [t for file in set(index["weight_map"].values()) for t in load_file(tmp_path / "fp32" / file).values()]
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in tensors)}
    for name in ["config.json", "tokenizer.json", "generation_config.json"]:
        assert (tmp_path / "bf16" / name).is_file() and (tmp_path / "fp32" / name).is_file()
    # In final/'s dtype (the run's save_dtype float32) and shard size, the folder the run exported at that step, byte
    # for byte: a diff of the two shows nothing (config.json lacked save_pretrained's closing newline).
    convert(str(checkpoint), str(tmp_path / "as_final"))
    final_files = sorted(str(p.relative_to(reference / "final")) for p in (reference / "final").rglob("*"))
    assert sorted(str(p.relative_to(tmp_path / "as_final")) for p in (tmp_path / "as_final").rglob("*")) == final_files
    for name in final_files:
        assert (tmp_path / "as_final" / name).read_bytes() == (reference / "final" / name).read_bytes(), name
    assert "lm_head.weight" not in load_file(tmp_path / "bf16" / "model.safetensors")

    # Named chat templates: transformers 5 saves all but the default under additional_chat_templates/. The optimizer
    # and RNG states, removed from old checkpoints to save space, are not needed.
    named = shutil.copytree(checkpoint, tmp_path / "checkpoint-named-templates")
    shutil.rmtree(named / "optimizer")
    shutil.rmtree(named / "rng")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = {"default": "{{ messages[0].content }}", "tool_use": "{{ tools }}{{ messages }}"}
    tokenizer.save_pretrained(named)
    assert (named / "additional_chat_templates" / "tool_use.jinja").is_file()
    convert(str(named), str(tmp_path / "named_templates"))
    assert AutoTokenizer.from_pretrained(tmp_path / "named_templates").chat_template == tokenizer.chat_template

    # The run's final/ (fp32) holds the gathered weights at step 6, the step of the checkpoint.
    gathered = final_weights(reference)
    config = AutoConfig.from_pretrained(reference / "final")
    inputs = torch.randint(5, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    for dtype, folder in [(torch.bfloat16, "bf16"), (torch.float32, "fp32")]:
        converted = AutoModelForCausalLM.from_pretrained(tmp_path / folder).eval()
        assert converted.dtype == dtype
        assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
        if dtype == torch.float32:
            assert_same_weights({k: v for k, v in converted.state_dict().items() if k in gathered}, gathered)
        expected = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        expected.load_state_dict({k: v.to(dtype) for k, v in gathered.items()}, strict=False)
        expected.tie_weights()
        with torch.no_grad():
            assert torch.equal(converted(inputs).logits, expected(inputs).logits)


def test_converter_reads_a_tensor_with_fewer_rows_than_ranks(tmp_path):
    """FSDP2 shards a 1-row tensor (Qwen2-MoE's shared_expert_gate) over 2 ranks as rows [0, 1) and an empty [1, 1),
    which rank 1 writes as an empty tensor: the converter failed on that shard ("memoryview: cannot cast view with
    zeros in shape or strides"), for every such checkpoint."""
    gate = torch.randn(1, 64)
    model_dir = tmp_path / "checkpoint" / "model"
    dcp.save({"gate": gate, "rank1_shard": gate[1:]}, checkpoint_id=model_dir, no_dist=True)
    # The metadata FSDP2's save writes: the empty tensor is the gate's second chunk.
    metadata = pickle.loads((model_dir / ".metadata").read_bytes())
    [(index, info)] = [(i, v) for i, v in metadata.storage_data.items() if i.fqn == "rank1_shard"]
    del metadata.state_dict_metadata["rank1_shard"], metadata.storage_data[index]
    metadata.state_dict_metadata["gate"].chunks.append(ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([0, 64])))
    metadata.storage_data[MetadataIndex("gate", torch.Size([1, 0]), 1)] = info
    (model_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    _, _, load_tensor, load_row = convert_module.sharded_checkpoint_tensors(str(tmp_path / "checkpoint"))
    assert torch.equal(load_tensor("gate"), gate) and torch.equal(load_row("gate", 0), gate)
    # Both chunks are read straight into the tensor's bytes: the empty one is not a layout left to dcp.load.
    tensor, chunks = torch.empty(1, 64), metadata.state_dict_metadata["gate"].chunks
    infos = [metadata.storage_data[MetadataIndex("gate", chunk.offsets)] for chunk in chunks]
    assert [convert_module.read_chunk_into(tensor, 0, chunk, info, str(model_dir))
            for chunk, info in zip(chunks, infos)] == [True, True]
    assert torch.equal(tensor, gate)


def test_converter_reads_a_tensor_stored_with_other_strides_in_its_own_order(tmp_path):
    """DCP saves a transposed tensor (a persistent buffer made by .t()) with its strides: the direct reader, which
    copies the storage's bytes in order, converted it transposed, without a word."""
    weight = torch.arange(24.0).reshape(4, 6)
    model_dir = tmp_path / "checkpoint" / "model"
    dcp.save({"transposed": weight.t(), "plain": weight}, checkpoint_id=model_dir, no_dist=True)
    _, _, load_tensor, load_row = convert_module.sharded_checkpoint_tensors(str(tmp_path / "checkpoint"))
    assert torch.equal(load_tensor("transposed"), weight.t())
    assert torch.equal(load_row("transposed", 2), weight.t()[2:3])
    assert torch.equal(load_tensor("plain"), weight)
    # Only the transposed one is left to dcp.load: the plain one is still read straight into place.
    metadata = pickle.loads((model_dir / ".metadata").read_bytes())
    read = {}
    for name in ["transposed", "plain"]:
        [chunk] = metadata.state_dict_metadata[name].chunks
        info = metadata.storage_data[MetadataIndex(name, chunk.offsets)]
        read[name] = convert_module.read_chunk_into(torch.empty(chunk.sizes), 0, chunk, info, str(model_dir))
    assert read == {"transposed": False, "plain": True}


def test_converter_refuses_an_empty_mount_point_before_writing(reference, tmp_path):
    # The finished folder is renamed onto the output folder, which a mount point cannot take: refused at once, not
    # after writing the whole model on the parent's filesystem.
    (tmp_path / "volume").mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", tmp_path / "volume"],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        with pytest.raises(CheckpointError) as error:
            convert(str(reference / "checkpoint-6"), str(tmp_path / "volume"))
        assert str(error.value) == (f"{tmp_path}/volume is a mount point: give a new folder inside it, such as "
                                    f"{tmp_path}/volume/hf")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["volume"]
    finally:
        subprocess.run(["umount", tmp_path / "volume"], check=True)


def small_checkpoint(tiny, tmp_path) -> str:
    """A sharded checkpoint of the tiny tied Llama, saved by this process (a one-process group)."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path / "run")])
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    optimizer = build_optimizer(model, cfg)
    return save_checkpoint(cfg, model, optimizer, get_scheduler("constant", optimizer), load_tokenizer(cfg), 2, 0,
                           None)


def test_converter_writes_a_tied_output_weight_once_whatever_its_name(tiny, tmp_path, one_process_group):
    # BioGPT ties output_projection.weight, not lm_head.weight, to its embedding: the sharded checkpoint holds both
    # names, and the converted folder, as final/, holds the embedding alone (it held both: 12 KB more here).
    from transformers import BioGptConfig, BioGptForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    torch.manual_seed(0)
    source = BioGptForCausalLM(BioGptConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64))
    source.save_pretrained(tmp_path / "biogpt")
    tokenizer.save_pretrained(tmp_path / "biogpt")
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path / "run")]
                       + ["--model_name_or_path", str(tmp_path / "biogpt")])
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    optimizer = build_optimizer(model, cfg)
    checkpoint = save_checkpoint(cfg, model, optimizer, get_scheduler("constant", optimizer), load_tokenizer(cfg), 2,
                                 0, None)
    save_hf_model(model, load_tokenizer(cfg), str(tmp_path / "final"), torch.float32)
    convert(checkpoint, str(tmp_path / "hf"))
    final, converted = (load_file(tmp_path / folder / "model.safetensors") for folder in ("final", "hf"))
    assert "output_projection.weight" not in converted
    assert_same_weights(converted, final)
    reloaded = BioGptForCausalLM.from_pretrained(tmp_path / "hf")
    assert reloaded.output_projection.weight is reloaded.biogpt.embed_tokens.weight


def test_converter_names_an_output_folder_it_cannot_create(tiny, tmp_path, one_process_group):
    # A file where a folder of the path should be: makedirs' FileExistsError named the file, not the problem.
    checkpoint = small_checkpoint(tiny, tmp_path)
    (tmp_path / "notes").write_text("mine")
    for out in ["notes/hf", "notes/models/hf"]:
        with pytest.raises(CheckpointError) as error:
            convert(checkpoint, str(tmp_path / out))
        assert str(error.value) == (f"{tmp_path}/{out} cannot be created: {tmp_path}/notes is a file, not a folder: "
                                    f"choose another output folder")
    assert (tmp_path / "notes").read_text() == "mine"
    if not can_mount_a_tmpfs():
        pytest.skip("a read-only file system needs root and unshare, to mount a tmpfs of its own")
    # A read-only file system (in a mount namespace of the converter's own): one line, no traceback.
    (tmp_path / "read_only").mkdir()
    proc = run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$0" && "$@"', tmp_path / "read_only",
                sys.executable, "-m", "fsdp_recipes.convert", checkpoint, tmp_path / "read_only" / "hf"], expect_rc=2)
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot write in {tmp_path}/read_only (Read-only file system): choose an output folder where you "
        f"can write"]


def test_a_conversion_onto_a_full_disk_says_so_and_leaves_no_unfinished_folder(tiny, tmp_path, one_process_group):
    # It showed OSError's traceback alone ([Errno 27] File too large), naming neither the folder nor what to do.
    checkpoint = small_checkpoint(tiny, tmp_path)
    with file_size_limit(4096), pytest.raises(CheckpointError) as error:
        convert(checkpoint, str(tmp_path / "hf"))
    assert re.fullmatch(
        f"writing {tmp_path}/hf failed \\(OSError: \\[Errno 27\\] File too large\\), with [0-9.,]+ MiB free on the "
        f"file system of {tmp_path} \\(its unfinished folder removed\\): make room and convert again, or give an "
        f"output folder on another file system", str(error.value)), str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["run"]
    # A read error is not a write's: it stays as it is (a link in the checkpoint to a file that is gone).
    os.symlink(tmp_path / "gone.txt", os.path.join(checkpoint, "notes.txt"))
    with pytest.raises(FileNotFoundError, match="checkpoint-2/notes.txt"):
        convert(checkpoint, str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_checkpoint_missing_a_model_file_is_refused_and_one_without_its_resume_parts_converts(
        tiny, tmp_path, one_process_group):
    # trainer_state.json lists the model files the save wrote: a copy missing one (an interrupted rsync) would
    # otherwise convert into a folder without its tokenizer.
    checkpoint = small_checkpoint(tiny, tmp_path)
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["model_files"] == ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
                                    "tokenizer_config.json"]
    shutil.rmtree(os.path.join(checkpoint, "optimizer"))  # removable to save space: the converter does not read it
    shutil.rmtree(os.path.join(checkpoint, "rng"))
    (tmp_path / "hf").mkdir()  # made beforehand: an empty output folder is taken
    convert(checkpoint, str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path / "hf")) == ["chat_template.jinja", "config.json", "generation_config.json",
                                                   "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    os.remove(os.path.join(checkpoint, "tokenizer.json"))
    with pytest.raises(CheckpointError) as error:
        convert(checkpoint, str(tmp_path / "hf2"))
    assert str(error.value) == f"{checkpoint} is incomplete: tokenizer.json is missing"
    assert not (tmp_path / "hf2").exists()


def test_a_full_checkpoint_in_several_files_converts_into_one_without_its_index(tiny, tmp_path, one_process_group):
    # The checkpoint's own index names its fp32 files: copied with the model files, it would replace the output's.
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path / "run", "--save_state_dict_type", "full",
                                                        "--max_shard_size", "100KB")])
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    optimizer = build_optimizer(model, cfg)
    checkpoint = Path(save_checkpoint(cfg, model, optimizer, get_scheduler("constant", optimizer),
                                      load_tokenizer(cfg), 2, 0, None))
    shards = sorted(checkpoint.glob("*.safetensors"))
    assert len(shards) > 1 and (checkpoint / "model.safetensors.index.json").is_file()
    convert(str(checkpoint), str(tmp_path / "hf"))
    assert sorted(p.name for p in (tmp_path / "hf").glob("model*")) == ["model.safetensors"]
    saved = {name: tensor for shard in shards for name, tensor in load_file(shard).items()}
    assert "lm_head.weight" not in saved  # tied: the embedding alone, as final/ holds it
    assert_same_weights(load_file(tmp_path / "hf" / "model.safetensors"), saved)


def test_a_converted_folder_is_on_disk_before_its_rename(tiny, tmp_path, one_process_group, monkeypatch):
    """As final/: every file and folder the converter wrote is fsynced before the rename, the rename after it (the
    checkpoint is often removed once the folder is there; os.fsync and os.replace are recorded, and still called)."""
    checkpoint = small_checkpoint(tiny, tmp_path)
    events = record_fsync_and_replace(monkeypatch)
    umask = os.umask(0o022)
    try:
        convert(checkpoint, str(tmp_path / "hf"), torch.bfloat16, "100KB")
    finally:
        os.umask(umask)
    monkeypatch.undo()
    # An ordinary folder, as the umask makes it, though the converter writes it in a private one (mkdtemp's 0700).
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o755
    [(_, tmp, out)] = [event for event in events if event[0] == "replace"]
    assert out == f"{tmp_path}/hf" and os.path.basename(tmp).startswith("hf.converting-")
    renamed = events.index(("replace", tmp, out))
    synced_before = {path.replace(tmp, out) for _, path in events[:renamed]}
    written = {str(p) for p in (tmp_path / "hf").glob("**/*")}
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    assert synced_before >= written | {out}, written - synced_before
    assert events[renamed + 1:] == [("fsync", str(tmp_path))]


def test_a_conversion_stopped_by_ctrl_c_removes_its_own_folder(tiny, tmp_path, one_process_group, monkeypatch,
                                                                ctrl_c_interrupts):
    checkpoint = small_checkpoint(tiny, tmp_path)
    fsync_tree = convert_module.fsync_tree

    def ctrl_c_then_sync(root):  # a Ctrl-C once the weights are written, before the folder is renamed
        os.kill(os.getpid(), signal.SIGINT)
        fsync_tree(root)

    monkeypatch.setattr(convert_module, "fsync_tree", ctrl_c_then_sync)
    with pytest.raises(KeyboardInterrupt):
        convert(checkpoint, str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no hf.converting-* folder left beside the checkpoint's run


def test_a_conversion_killed_before_its_rename_is_named_by_the_next_one(reference, tmp_path):
    """A killed converter leaves its own folder (part of a model's weights, a 70B one's 140 GB): the next conversion
    into the same folder names it, and removes nothing (another conversion may still be writing it)."""
    checkpoint, out = reference / "checkpoint-6", tmp_path / "hf"
    run([sys.executable, "tests/drivers/ckpt_kill.py", "in_convert", 1, checkpoint, out], expect_rc=-signal.SIGKILL)
    [left] = tmp_path.iterdir()
    assert left.name.startswith("hf.converting-") and (left / "model.safetensors").is_file()
    again = run([sys.executable, "-m", "fsdp_recipes.convert", checkpoint, out])
    assert again.stdout == (f"note: {left} is left by a conversion into {out} that was killed: nothing uses it; remove "
                            f"it once no other conversion into {out} runs\nwrote {out}\n")
    assert sorted(tmp_path.iterdir()) == [out, left]
    assert_same_weights(load_file(out / "model.safetensors"), final_weights(reference))


def test_a_conversion_names_only_the_folders_of_killed_conversions_into_its_own_out_dir(tiny, tmp_path,
                                                                                        one_process_group, capsys):
    """Leftovers made by hand (test_a_conversion_killed_before_its_rename_is_named_by_the_next_one kills a converter):
    not its own folder, nor another out_dir's, nor a file."""
    checkpoint = small_checkpoint(tiny, tmp_path)
    out = tmp_path / "hf"
    for name in ["hf.converting-abc", "hf2.converting-def", "hf-converting-ghi", "hf.converting-jkl"]:
        (tmp_path / name).mkdir()
    (tmp_path / "hf.converting-notes.txt").write_text("mine")
    capsys.readouterr()
    convert(checkpoint, str(out))
    assert capsys.readouterr().out == "".join(
        f"note: {tmp_path / name} is left by a conversion into {out} that was killed: nothing uses it; remove it once "
        f"no other conversion into {out} runs\n" for name in ["hf.converting-abc", "hf.converting-jkl"])


def test_converter_refuses_bad_input_without_writing(reference, tmp_path):
    (tmp_path / "not_a_checkpoint").mkdir()
    with pytest.raises(CheckpointError, match="not_a_checkpoint is not a checkpoint"):
        convert(str(tmp_path / "not_a_checkpoint"), str(tmp_path / "out"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="taken already exists and is not empty"):
        convert(str(reference / "checkpoint-6"), str(tmp_path / "taken"))
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(CheckpointError, match="a_file already exists and is a file, not a folder"):
        convert(str(reference / "checkpoint-6"), str(tmp_path / "a_file"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    for spelling in ("link", "link/"):  # with the slash a shell's completion adds, the link names the folder
        with pytest.raises(CheckpointError,
                           match=f"link is a symbolic link: give the folder it points to, {tmp_path}/empty"):
            convert(str(reference / "checkpoint-6"), str(tmp_path / spelling))
    with pytest.raises(CheckpointError, match="the output folder is an empty string"):  # an unset shell variable
        convert(str(reference / "checkpoint-6"), "")
    assert os.listdir(tmp_path / "empty") == []
    os.remove(tmp_path / "link")
    os.rmdir(tmp_path / "empty")
    # The checkpoint's own files are copied into the output: one inside it would be copied into itself.
    before = snapshot(reference)
    with pytest.raises(CheckpointError) as error:
        convert(str(reference / "checkpoint-6"), str(reference / "checkpoint-6" / "hf"))
    assert str(error.value) == (f"{reference}/checkpoint-6/hf is inside the checkpoint {reference}/checkpoint-6: "
                                f"choose an output folder outside it")
    assert snapshot(reference) == before
    with pytest.raises(ConfigError, match="max_shard_size must be a positive size such as 5GB, 500MB or 4GiB"):
        convert(str(reference / "checkpoint-6"), str(tmp_path / "new" / "out"), max_shard_size="5G")  # no new/ made
    # A failure while writing (a dtype safetensors cannot hold) removes the converter's own folder, nothing else.
    with pytest.raises(ValueError, match="cannot write torch.int8 weights"):
        convert(str(reference / "checkpoint-6"), str(tmp_path / "out"), torch.int8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "not_a_checkpoint", "taken"]
    assert os.listdir(tmp_path / "taken") == ["keep.txt"]
    assert (tmp_path / "a_file").read_text() == "mine"
    # The user's own hf.old and hf.tmp folders are not the converter's: they stay, as they were.
    for name, file in [("hf.old", "model.safetensors"), ("hf.tmp", "notes.txt")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text("mine")
    convert(str(reference / "checkpoint-6"), str(tmp_path / "hf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "hf", "hf.old", "hf.tmp", "not_a_checkpoint",
                                                          "taken"]
    for name, file in [("hf.old", "model.safetensors"), ("hf.tmp", "notes.txt")]:
        assert os.listdir(tmp_path / name) == [file] and (tmp_path / name / file).read_text() == "mine"
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_replace_dir_after_a_kill_that_left_the_old_folder(tmp_path):
    # A kill between replace_dir's two renames left out.old (the previous folder) and out (the newer one).
    for name, text in [("out.old", "oldest"), ("out", "older"), ("out.tmp", "new")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_text(text)
    replace_dir(str(tmp_path / "out.tmp"), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["out"] and (tmp_path / "out" / "weights").read_text() == "new"


def config(tmp_path, *extra):
    return parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path),
                         *map(str, extra)])


def fake_checkpoint(path):
    """A folder that passes for a checkpoint until its files are read."""
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    return path


def test_a_fresh_run_into_an_earlier_runs_output_dir_is_refused(tmp_path_factory, one_process_group):
    tmp_path, elsewhere = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("elsewhere")
    for name in ["checkpoint-4", "checkpoint-6"]:
        fake_checkpoint(tmp_path / name)
    for name in ["checkpoint-8.tmp", "final", "wandb"]:
        (tmp_path / name).mkdir()
    (tmp_path / "latest").write_text("checkpoint-6")
    (tmp_path / "metrics.jsonl").write_text('{"step": 6}\n')
    before = snapshot(tmp_path)
    earlier = "holds checkpoint-4, checkpoint-6, latest, final of an earlier run"
    with pytest.raises(ConfigError, match=f"{earlier}, which this fresh run would overwrite or mix with its own: pass "
                                          f"--resume_from_checkpoint auto .* --overwrite_output_dir true .* or another "
                                          f"output_dir"):
        prepare_output_dir(config(tmp_path))
    prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", "auto"))  # `latest` names the one to resume
    prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", str(tmp_path / "checkpoint-4")))
    other_run = fake_checkpoint(elsewhere / "checkpoint-2")
    with pytest.raises(ConfigError, match=f"holds checkpoint-4, checkpoint-6, latest, final of another run than "
                                          f"{other_run}'s, which this run would overwrite or mix with its own: pass "
                                          f"--overwrite_output_dir true"):
        prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", other_run))
    # The output_dir itself is not a checkpoint: the advice is `auto`, not the flag that would remove its checkpoints.
    for overwrite in [[], ["--overwrite_output_dir", "true"]]:
        with pytest.raises(CheckpointError) as error:
            prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", tmp_path, *overwrite))
        assert str(error.value) == (
            f"{tmp_path} is a run's output_dir, not a checkpoint (it holds checkpoint-4, checkpoint-6): pass one of "
            f"its checkpoint-<step> folders, or --output_dir {tmp_path} --resume_from_checkpoint auto to resume from "
            f"the one its `latest` file names")
    assert snapshot(tmp_path) == before
    # A model or tokenizer in what overwrite_output_dir removes (the earlier run's final/) would be gone before
    # the run reads it; a data file beside the run's outputs is not removed, and may stay there.
    (tmp_path / "data.jsonl").write_text("{}")
    for key, path in [("model_name_or_path", tmp_path / "final"), ("tokenizer_name_or_path", tmp_path / "final"),
                      ("dataset_name", tmp_path / "checkpoint-4")]:
        cfg = dataclasses.replace(config(tmp_path, "--overwrite_output_dir", "true", "--dataset_name",
                                         tmp_path / "data.jsonl"), **{key: str(path)})
        with pytest.raises(ConfigError) as error:
            prepare_output_dir(cfg)
        assert str(error.value) == (
            f"{key} {path} is in {path}, which overwrite_output_dir true removes before this run reads it: move it "
            f"out of {tmp_path}, or write this run to another output_dir")
    assert snapshot(tmp_path) == {**before, "data.jsonl": 2}
    os.remove(tmp_path / "data.jsonl")
    # `latest` naming a checkpoint removed by hand (only the killed save's .tmp is left) names those still there.
    (tmp_path / "latest").write_text("checkpoint-8")
    with pytest.raises(CheckpointError) as error:
        latest_checkpoint(str(tmp_path))
    assert str(error.value) == (
        f"resume_from_checkpoint auto: `latest` names {tmp_path}/checkpoint-8, which does not exist; {tmp_path} holds "
        f"checkpoint-4, checkpoint-6: pass --resume_from_checkpoint {tmp_path}/checkpoint-6 (the newest) or another "
        f"of them")
    # `latest` naming a file (edited by hand; here itself): not said not to exist.
    (tmp_path / "latest").write_text("latest")
    with pytest.raises(CheckpointError, match=re.escape(
            f"auto: `latest` names {tmp_path}/latest, which is a file, not a checkpoint folder; {tmp_path} holds "
            f"checkpoint-4, checkpoint-6: pass")):
        latest_checkpoint(str(tmp_path))
    # An empty `latest` (truncated by hand) names no checkpoint: not output_dir itself, "not a checkpoint".
    (tmp_path / "latest").write_text("")
    with pytest.raises(CheckpointError) as error:
        latest_checkpoint(str(tmp_path))
    assert str(error.value) == (
        f"resume_from_checkpoint auto: `latest` in {tmp_path} is empty; {tmp_path} holds checkpoint-4, checkpoint-6: "
        f"pass --resume_from_checkpoint {tmp_path}/checkpoint-6 (the newest) or another of them")
    (tmp_path / "latest").write_text("checkpoint-6")
    # A save of step 6 again (after a resume from checkpoint-4, by a version whose `latest` still named step 6),
    # killed between replace_dir's two renames: the whole older copy is put back, and the killed save's .tmp is left
    # to the next save of step 6.
    (tmp_path / "checkpoint-6").rename(tmp_path / "checkpoint-6.old")
    (tmp_path / "checkpoint-6.tmp").mkdir()
    assert latest_checkpoint(str(tmp_path)) == f"{tmp_path}/checkpoint-6"
    assert not (tmp_path / "checkpoint-6.old").exists() and (tmp_path / "checkpoint-6" / "trainer_state.json").exists()
    os.rmdir(tmp_path / "checkpoint-6.tmp")
    # Named by hand, neither the killed save's folder nor a copy being removed is taken for a checkpoint.
    for name, what in [("checkpoint-8.tmp", "an unfinished save (a .tmp folder)"),
                       ("checkpoint-6.old", "a checkpoint being replaced or removed (an .old folder)")]:
        fake_checkpoint(tmp_path / "more" / name)
        with pytest.raises(CheckpointError) as error:
            prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", tmp_path / "more" / name))
        assert str(error.value) == f"{tmp_path}/more/{name} is {what}: pass a checkpoint-<step> folder"
    shutil.rmtree(tmp_path / "more")
    with pytest.raises(ConfigError, match="overwrite_output_dir true removes the checkpoints in .* pass only one"):
        prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", "auto", "--overwrite_output_dir", "true"))
    with pytest.raises(ConfigError, match="resumes from one of them"):
        prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", str(tmp_path / "checkpoint-4"),
                                  "--overwrite_output_dir", "true"))
    os.remove(tmp_path / "latest")
    before = snapshot(tmp_path)
    # auto without `latest` no longer starts from step 0 over the checkpoints: it names them.
    with pytest.raises(ConfigError, match=f"auto: {tmp_path} has no `latest` file naming a checkpoint to resume, but "
                                          f"holds checkpoint-4, checkpoint-6, final of an earlier run: pass "
                                          f"--resume_from_checkpoint {tmp_path}/checkpoint-6 \\(the newest\\)"):
        prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", "auto"))
    # A fresh run is not told to pass `auto`, which would then stop on the missing `latest`.
    with pytest.raises(ConfigError) as error:
        prepare_output_dir(config(tmp_path))
    assert str(error.value) == (
        f"{tmp_path} holds checkpoint-4, checkpoint-6, final of an earlier run, which this fresh run would overwrite "
        f"or mix with its own, and no `latest` file naming a checkpoint to resume: pass --resume_from_checkpoint "
        f"{tmp_path}/checkpoint-6 (the newest) or another of them to continue, --overwrite_output_dir true to remove "
        f"them and start over, or another output_dir")
    assert snapshot(tmp_path) == before
    for name in ["checkpoint-4", "checkpoint-6"]:
        shutil.rmtree(tmp_path / name)
    with pytest.raises(ConfigError, match=f"this fresh run would overwrite or mix with its own, and no `latest` file "
                                          f"naming a checkpoint to resume: to train its final/ further, start a run "
                                          f"with --model_name_or_path {tmp_path}/final and another output_dir"):
        prepare_output_dir(config(tmp_path))
    with pytest.raises(ConfigError) as error:
        prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", "auto"))
    assert str(error.value) == (
        f"resume_from_checkpoint auto: {tmp_path} has no `latest` file naming a checkpoint to resume, but holds final "
        f"of an earlier run: to train its final/ further, start a run with --model_name_or_path {tmp_path}/final and "
        f"another output_dir, or pass --overwrite_output_dir true to remove them and start over, or another "
        f"output_dir")
    # A killed first save (.tmp), metrics or a wandb folder alone hold nothing to resume: a fresh run goes ahead.
    shutil.rmtree(tmp_path / "final")
    prepare_output_dir(config(tmp_path))
    prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", "auto"))


def test_a_relative_checkpoint_is_read_from_the_working_directory_and_the_error_says_so(
        tmp_path_factory, one_process_group, monkeypatch):
    """`--resume_from_checkpoint checkpoint-4`, as `latest` names it, is not looked for in output_dir: the error
    names the directory it was looked for in, and output_dir's checkpoint of that name."""
    out, cwd = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("cwd")
    fake_checkpoint(out / "checkpoint-4")
    monkeypatch.chdir(cwd)
    with pytest.raises(CheckpointError) as error:
        prepare_output_dir(config(out, "--resume_from_checkpoint", "checkpoint-4"))
    assert str(error.value) == (f"checkpoint-4 does not exist in {cwd}: pass a checkpoint-<step> folder, such as "
                                f"{out}/checkpoint-4")
    with pytest.raises(CheckpointError) as error:  # nothing of that name in output_dir: no suggestion
        prepare_output_dir(config(out, "--resume_from_checkpoint", "checkpoint-40"))
    assert str(error.value) == f"checkpoint-40 does not exist in {cwd}: pass a checkpoint-<step> folder"


def test_a_checkpoint_named_where_a_moved_output_dir_was_points_to_its_new_place(tmp_path, one_process_group):
    """`mv run1 run2`, then the old command line with the new output_dir: the error names run2's checkpoint of that
    name, as it does for a relative path."""
    fake_checkpoint(tmp_path / "run1" / "checkpoint-4")
    os.rename(tmp_path / "run1", tmp_path / "run2")
    with pytest.raises(CheckpointError) as error:
        prepare_output_dir(config(tmp_path / "run2", "--resume_from_checkpoint", tmp_path / "run1" / "checkpoint-4"))
    assert str(error.value) == (f"{tmp_path}/run1/checkpoint-4 does not exist: pass a checkpoint-<step> folder, such "
                                f"as {tmp_path}/run2/checkpoint-4")


def test_a_save_killed_while_replacing_its_step_leaves_a_whole_checkpoint_to_resume(tmp_path, one_process_group,
                                                                                   monkeypatch):
    # replace_dir moves checkpoint-6 to checkpoint-6.old, the new save into place, then removes the .old copy.
    (tmp_path / "latest").write_text("checkpoint-6")
    (fake_checkpoint(tmp_path / "checkpoint-6.old") / "trainer_state.json").write_text('{"step": 6, "copy": "old"}')
    # Killed after the first rename: the old copy is put back, and the rename is on disk before the resume reads it.
    events = record_fsync_and_replace(monkeypatch)
    assert latest_checkpoint(str(tmp_path)) == f"{tmp_path}/checkpoint-6"
    monkeypatch.undo()
    assert events == [("replace", f"{tmp_path}/checkpoint-6.old", f"{tmp_path}/checkpoint-6"), ("fsync", str(tmp_path))]
    # Killed after the second (while the old copy was being removed): the new checkpoint is whole and stays.
    (fake_checkpoint(tmp_path / "checkpoint-6.old") / "trainer_state.json").write_text('{"step": 6, "copy": "old"}')
    (tmp_path / "checkpoint-6" / "trainer_state.json").write_text('{"step": 6, "copy": "new"}')
    assert latest_checkpoint(str(tmp_path)) == f"{tmp_path}/checkpoint-6"
    assert json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())["copy"] == "new"


def test_a_latest_written_by_hand_with_a_newline_names_its_checkpoint(tmp_path, one_process_group):
    fake_checkpoint(tmp_path / "checkpoint-4")
    (tmp_path / "latest").write_text("checkpoint-4\n")  # as `echo checkpoint-4 > latest` writes it
    assert latest_checkpoint(str(tmp_path)) == f"{tmp_path}/checkpoint-4"


def test_a_resume_points_latest_at_its_checkpoint_only_in_its_own_output_dir(tmp_path, one_process_group, capsys):
    out, elsewhere = tmp_path / "run", fake_checkpoint(tmp_path / "other" / "checkpoint-2")
    for step in [4, 6]:
        fake_checkpoint(out / f"checkpoint-{step}")
    (out / "latest").write_text("checkpoint-6")
    point_latest_at(str(out), str(elsewhere))  # another run's checkpoint: output_dir has no checkpoint-2
    assert (out / "latest").read_text() == "checkpoint-6" and capsys.readouterr().out == ""
    point_latest_at(str(out), f"{out}/checkpoint-4/")  # a return to an earlier step, spelled with a slash
    assert (out / "latest").read_text() == "checkpoint-4"
    assert capsys.readouterr().out == (f"resume: `latest` in {out} now names checkpoint-4, where this run starts (it "
                                       f"named checkpoint-6)\n")
    # A resume from the checkpoint `latest` names already: nothing to write or say.
    inode = (out / "latest").stat().st_ino  # write_latest replaces the file
    point_latest_at(str(out), f"{out}/checkpoint-4")
    assert (out / "latest").stat().st_ino == inode and capsys.readouterr().out == ""


def test_latest_given_as_the_checkpoint_says_what_to_pass(tmp_path, one_process_group, monkeypatch):
    # A run's `latest` file is a natural guess for the checkpoint to resume or convert, and `latest` the word other
    # trainers take for the newest checkpoint: each is told what to pass instead of "not a checkpoint".
    run = tmp_path / "run"
    fake_checkpoint(run / "checkpoint-6")
    (run / "latest").write_text("checkpoint-6")
    with pytest.raises(CheckpointError) as error:
        prepare_output_dir(config(tmp_path / "new", "--resume_from_checkpoint", run / "latest"))
    assert str(error.value) == (
        f"{run}/latest is the file that names a run's newest checkpoint, not a checkpoint: pass {run}/checkpoint-6, or "
        f"--output_dir {run} --resume_from_checkpoint auto to resume from the one its `latest` file names")
    with pytest.raises(CheckpointError) as error:
        validate_checkpoint(str(run / "latest"))  # the converter's check: no resume advice
    assert str(error.value) == (f"{run}/latest is the file that names a run's newest checkpoint, not a checkpoint: "
                                f"pass {run}/checkpoint-6")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as error:
        prepare_output_dir(config(run, "--resume_from_checkpoint", "latest"))
    assert str(error.value) == (
        "latest does not exist: pass --resume_from_checkpoint auto to resume from the checkpoint that output_dir's "
        "`latest` file names, or a checkpoint-<step> folder")
    for word in ("Auto", "AUTO", "Latest"):  # the keyword is lower case: another case is a path
        with pytest.raises(CheckpointError, match=rf"^{word} does not exist: pass --resume_from_checkpoint auto "):
            prepare_output_dir(config(run, "--resume_from_checkpoint", word))
    with pytest.raises(CheckpointError) as error:
        validate_checkpoint("latest")  # the converter's check: no resume advice
    assert str(error.value) == f"latest does not exist in {tmp_path}: pass a checkpoint-<step> folder"
    assert sorted(os.listdir(run)) == [".run.lock", "checkpoint-6", "latest"]


def test_an_output_dir_with_checkpoints_or_latest_alone_given_as_the_checkpoint_is_named_as_one(tmp_path):
    """Either one marks a run's output_dir: checkpoints whose `latest` is gone, or a `latest` whose checkpoints are."""
    fake_checkpoint(tmp_path / "no_latest" / "checkpoint-4")
    (tmp_path / "latest_alone").mkdir()
    (tmp_path / "latest_alone" / "latest").write_text("checkpoint-4")
    for name, held in [("no_latest", "checkpoint-4"), ("latest_alone", "no checkpoint")]:
        with pytest.raises(CheckpointError) as error:
            validate_checkpoint(str(tmp_path / name))
        assert str(error.value) == (f"{tmp_path}/{name} is a run's output_dir, not a checkpoint (it holds {held}): "
                                    f"pass one of its checkpoint-<step> folders")


def test_a_model_folder_given_as_the_checkpoint_says_what_to_pass(tiny, tmp_path, one_process_group):
    # A run without save_steps leaves final/ alone, the natural guess for a resume: the advice is to resume from a
    # checkpoint where there is one, else to start a run from those weights, into an output_dir that accepts one.
    run = tmp_path / "run"
    shutil.copytree(tiny["model"], run / "final")
    (run / "metrics.jsonl").write_text('{"step": 6}\n')
    what = (f"{run}/final is a Hugging Face model folder (such as a run's final/), not a checkpoint: it holds the "
            f"weights without the optimizer state and data position of a run")
    train_further = (f"to train these weights further, start a fresh run (without resume_from_checkpoint) with "
                     f"--model_name_or_path {run}/final and an output_dir other than {run}")
    with pytest.raises(CheckpointError) as error:
        prepare_output_dir(config(run, "--resume_from_checkpoint", run / "final"))
    assert str(error.value) == f"{what}: {train_further}"
    fake_checkpoint(run / "checkpoint-4")
    fake_checkpoint(run / "checkpoint-6")
    with pytest.raises(CheckpointError) as error:
        prepare_output_dir(config(tmp_path / "new", "--resume_from_checkpoint", run / "final"))
    assert str(error.value) == (
        f"{what}: to continue its run, pass one of the checkpoints of {run} (checkpoint-4, checkpoint-6) or "
        f"--output_dir {run} --resume_from_checkpoint auto; {train_further}")
    with pytest.raises(CheckpointError) as error:
        validate_checkpoint(str(run / "final"))  # the converter's check
    assert str(error.value) == f"{what}, and from_pretrained loads it as it is"
    # A model folder of its own (not in a run's output_dir) needs no other output_dir.
    with pytest.raises(CheckpointError) as error:
        prepare_output_dir(config(tmp_path / "new", "--resume_from_checkpoint", tiny["model"]))
    assert str(error.value).endswith(f"with --model_name_or_path {tiny['model']}")
    assert sorted(os.listdir(run)) == [".run.lock", "checkpoint-4", "checkpoint-6", "final", "metrics.jsonl"]


def test_an_output_dir_reached_through_a_symlink_holds_the_same_run(tmp_path, one_process_group):
    real, link = tmp_path / "real", tmp_path / "link"
    fake_checkpoint(real / "checkpoint-4")
    (real / "latest").write_text("checkpoint-4")
    link.symlink_to(real)
    for out, checkpoint in [(link, real / "checkpoint-4"), (real, link / "checkpoint-4")]:
        prepare_output_dir(config(out, "--resume_from_checkpoint", str(checkpoint)))
        # overwrite_output_dir would remove the checkpoint being resumed.
        with pytest.raises(ConfigError, match="resumes from one of them: pass only one of the two"):
            prepare_output_dir(config(out, "--resume_from_checkpoint", str(checkpoint), "--overwrite_output_dir",
                                      "true"))
    assert sorted(os.listdir(real)) == [".run.lock", "checkpoint-4", "latest"]


def test_a_checkpoint_of_an_output_dir_whose_name_extends_this_one_is_another_runs(tmp_path, one_process_group):
    # run2/ starts with the letters of run/, but is not inside it: its checkpoint is another run's.
    out, other = tmp_path / "run", fake_checkpoint(tmp_path / "run2" / "checkpoint-2")
    fake_checkpoint(out / "checkpoint-4")
    (out / "latest").write_text("checkpoint-4")
    with pytest.raises(ConfigError) as error:
        prepare_output_dir(config(out, "--resume_from_checkpoint", other))
    assert str(error.value) == (
        f"{out} holds checkpoint-4, latest of another run than {other}'s, which this run would overwrite or mix with "
        f"its own: pass --overwrite_output_dir true to remove them and start over, or another output_dir")
    # Removing run/'s checkpoints leaves the one resumed from: not refused as a resume from one of them.
    prepare_output_dir(config(out, "--resume_from_checkpoint", other, "--overwrite_output_dir", "true"))


def test_a_resume_removes_nothing_of_its_output_dir(tmp_path, one_process_group):
    # The recipes call remove_earlier_run on every run: without overwrite_output_dir it must remove nothing.
    fake_checkpoint(tmp_path / "checkpoint-4")
    (tmp_path / "latest").write_text("checkpoint-4")
    (tmp_path / "metrics.jsonl").write_text('{"step": 4}\n')
    before = snapshot(tmp_path)
    remove_earlier_run(config(tmp_path, "--resume_from_checkpoint", "auto"))
    assert snapshot(tmp_path) == before


def test_overwrite_output_dir_takes_a_symlink_for_a_link(tmp_path, one_process_group):
    model, out = tmp_path / "model", tmp_path / "out"
    (model / "weights").mkdir(parents=True)
    out.mkdir()
    # final/ a symlink to the model: removing final/ removes the link alone, and the model is read at its own path.
    (out / "final").symlink_to(model)
    cfg = dataclasses.replace(config(out, "--overwrite_output_dir", "true"), model_name_or_path=str(model))
    prepare_output_dir(cfg)
    remove_earlier_run(cfg)
    assert os.listdir(out) == [".run.lock"] and os.listdir(model) == ["weights"]
    # The model reached through a symlink inside final/: gone with final/, though its target stays.
    (out / "final").mkdir()
    (out / "final" / "base").symlink_to(model)
    with pytest.raises(ConfigError, match=f"^model_name_or_path {out}/final/base is in {out}/final, which "):
        prepare_output_dir(dataclasses.replace(config(out, "--overwrite_output_dir", "true"),
                                               model_name_or_path=str(out / "final" / "base")))
    assert os.listdir(out / "final") == ["base"]


def test_overwrite_output_dir_removes_the_leftovers_of_killed_writes(tmp_path, one_process_group):
    """A kill while `latest`, final/, metrics.jsonl or samples.jsonl was replaced leaves its .tmp or .old beside it."""
    for name in ["final.tmp", "final.old", "wandb"]:
        (tmp_path / name).mkdir()
    for name in ["latest.tmp", "metrics.jsonl.tmp", "samples.jsonl.tmp"]:
        (tmp_path / name).write_text("x")
    cfg = config(tmp_path, "--overwrite_output_dir", "true")
    prepare_output_dir(cfg)
    remove_earlier_run(cfg)
    assert sorted(os.listdir(tmp_path)) == [".run.lock", "wandb"]


def test_every_rank_must_see_the_same_output_dir(tmp_path):
    # Per-node disks, simulated with an output_dir of each rank's own: refused on every rank, and `auto` resolves
    # to the checkpoint rank 0 reads on every rank.
    torchrun("tests/drivers/ckpt_shared_dir.py", tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        # The marker file is removed again; the lock stays, held by rank 0 until its process ends.
        assert result["shared"] is None and result["shared_files"] == [".run.lock"]
        assert result["per_node"] == (
            f"output_dir {tmp_path}/node{rank} is not on a file system that every rank sees (rank 1 finds no file "
            f"where rank 0 wrote one (FileNotFoundError)): put it on a shared file system")
        assert result["resume_auto"] == (
            f"resume_from_checkpoint auto: `latest` names {tmp_path}/node0/checkpoint-2, which does not exist; "
            f"{tmp_path}/node{rank} holds no checkpoint: start afresh with --overwrite_output_dir true")


def test_an_output_dir_that_cannot_be_written_is_refused_at_once(tmp_path, one_process_group):
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(ConfigError) as error:
        prepare_output_dir(config(tmp_path / "a_file" / "out"))
    assert str(error.value) == (
        f"output_dir {tmp_path}/a_file/out cannot be created or written (NotADirectoryError: [Errno 20] Not a "
        f"directory: '{tmp_path}/a_file/out'): choose an output_dir this user can write, on a file system that "
        f"every rank sees")
    with pytest.raises(ConfigError) as error:  # no permission or shared file system would help
        prepare_output_dir(config(tmp_path / "a_file"))
    assert str(error.value) == f"output_dir {tmp_path}/a_file is a file, not a folder: choose another output_dir"
    assert (tmp_path / "a_file").read_text() == "mine"


def test_the_shared_file_system_check_removes_a_file_a_killed_run_left(tmp_path, one_process_group):
    """A run killed between writing its check file (a new name each run) and removing it left it in output_dir for
    good; the next run, holding the lock, removes it (found by a kill at a random file operation)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".shared_check_0123abcd").write_text("0123abcd")
    (out / "notes.shared_check_txt").write_text("mine")
    prepare_output_dir(config(out))
    assert sorted(os.listdir(out)) == [".run.lock", "notes.shared_check_txt"]
    with file_size_limit(0), pytest.raises(ConfigError) as error:  # a full disk: no other user or file system needed
        prepare_output_dir(config(tmp_path / "full"))
    assert re.fullmatch(f"output_dir {tmp_path}/full cannot be created or written \\(OSError: \\[Errno 27\\] File too "
                        f"large\\): make room on its file system \\([0-9.,]+ MiB free on the file system of "
                        f"{tmp_path}/full\\), or choose an output_dir with room", str(error.value)), str(error.value)


def test_a_second_run_into_an_output_dir_in_use_is_refused_until_the_first_ends(tiny, tmp_path):
    # The first run's rank 0 holds the lock from prepare_output_dir to its end: here a process that takes it as that
    # rank does, then waits. Two runs at once overwrote each other's checkpoints and interleaved metrics.jsonl.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from fsdp_recipes.output_dir import "
                               "lock_output_dir; assert lock_output_dir(sys.argv[1]) is None; print(flush=True); "
                               "time.sleep(600)", tmp_path], stdout=subprocess.PIPE, env=subprocess_env())
    try:
        holder.stdout.readline()  # the lock is held
        args = [sys.executable, RECIPE, "--model_name_or_path", tiny["model"], "--dataset_name",
                tmp_path / "no_such_data.jsonl", "--output_dir", tmp_path]
        proc = run(args, expect_rc=2)
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: output_dir {tmp_path} is in use by another run (process {holder.pid} on {socket.gethostname()} "
            f"holds {tmp_path}/.run.lock): the two would overwrite each other's checkpoints. Wait for it to end (or "
            f"stop it), or choose another output_dir")
    finally:
        holder.kill()  # as a kill -9 of the first run: the kernel releases its lock
        holder.wait()
    proc = run(args, expect_rc=2)  # the output_dir is free again; the run goes on to read its data
    assert "no_such_data.jsonl" in proc.stderr.strip().splitlines()[-1]
    assert sorted(os.listdir(tmp_path)) == [".run.lock"]


def test_the_lock_ends_with_rank_0_though_a_forked_worker_lives_on(tmp_path):
    # A DataLoader worker forked by rank 0 outlives it by up to 5 s (until it notices) and ignores SLURM's SIGTERM:
    # with rank 0's copy of the lock file open, a resume started at once was refused as a second run.
    # The worker closes its stdin, stdout and stderr, as the pipe of run() would wait for it.
    rank0 = ("import os, sys, time; from fsdp_recipes.output_dir import lock_output_dir; "
             "assert lock_output_dir(sys.argv[1]) is None; child = os.fork(); "
             "child or (os.closerange(0, 3), time.sleep(600)); print(child, flush=True); os._exit(0)")
    holder = subprocess.run([sys.executable, "-c", rank0, tmp_path], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env(), check=True)
    worker = int(holder.stdout)
    try:
        with open(tmp_path / ".run.lock") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while the worker held it
        os.kill(worker, 0)  # the worker was alive all along
    finally:
        os.kill(worker, signal.SIGKILL)


def test_an_output_dir_on_a_file_system_without_locks_is_a_warning_not_an_error(tmp_path, monkeypatch, capsys):
    """Lustre mounted without -o flock answers flock with an error: "the run prints a warning and goes on"."""
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert lock_output_dir(str(tmp_path)) is None
    assert capsys.readouterr().out == (
        f"warning: output_dir {tmp_path} cannot be locked (OSError: [Errno {errno.ENOLCK}] "
        f"{os.strerror(errno.ENOLCK)}): a second run started into it would not be noticed\n")


def test_the_lock_file_names_this_process_alone_over_a_longer_name_an_earlier_run_left(tmp_path):
    """A second run's refusal quotes the lock file: the tail of an earlier holder's longer name must not stay in it."""
    (tmp_path / ".run.lock").write_text(f"process 4194304 on {socket.gethostname()}.a-longer-domain.example")
    assert lock_output_dir(str(tmp_path)) is None
    assert (tmp_path / ".run.lock").read_text() == f"process {os.getpid()} on {socket.gethostname()}"


def test_the_recipe_refuses_the_output_dir_before_loading_data_or_model(tiny, tmp_path):
    (tmp_path / "final").mkdir()
    proc = run([sys.executable, RECIPE, "--model_name_or_path", tiny["model"], "--dataset_name",
                tmp_path / "no_such_data.jsonl", "--output_dir", tmp_path], expect_rc=2)
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path} holds final of an earlier run")
    assert sorted(os.listdir(tmp_path)) == [".run.lock", "final"]


def test_a_resume_logging_to_wandb_must_name_the_project_of_the_checkpoints_run(tmp_path, one_process_group):
    """The run's id in another project would be a second W&B run there, with the rest of the history."""
    checkpoint = fake_checkpoint(tmp_path / "checkpoint-4")
    (tmp_path / "latest").write_text("checkpoint-4")
    state = {"wandb_run_id": "ab12cd34", "wandb_project": "proj-a", "wandb_entity": "team",
             "config": {"wandb_project": "proj-a"}}
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    expected = f"{checkpoint} continues W&B run ab12cd34 of project proj-a: pass --wandb_project proj-a"
    for resume in ["auto", checkpoint]:
        for project in [[], ["--wandb_project", "proj-b"]]:  # the default project, or another
            with pytest.raises(ConfigError) as error:
                prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", resume, "--report_to", "wandb",
                                          *project))
            assert str(error.value) == expected
        prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", resume, "--report_to", "wandb",
                                  "--wandb_project", "proj-a"))
        prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", resume))  # not logging to W&B
    # Saved before the project was: the config of the checkpoint's run names it.
    (checkpoint / "trainer_state.json").write_text(json.dumps({**state, "wandb_project": None}))
    with pytest.raises(ConfigError, match=f"^{expected}$"):
        prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", "auto", "--report_to", "wandb"))
    # A checkpoint of a run without W&B: this run starts a W&B run of its own, in any project.
    (checkpoint / "trainer_state.json").write_text(json.dumps({**state, "wandb_run_id": None}))
    prepare_output_dir(config(tmp_path, "--resume_from_checkpoint", "auto", "--report_to", "wandb"))


def test_an_evaluation_that_failed_after_its_checkpoint_runs_first_on_resume(tiny, tmp_path, one_process_group,
                                                                              monkeypatch):
    """A step saves its checkpoint, then evaluates; the resume from that checkpoint starts at the next step. So an
    evaluation that failed (out of memory, simulated) runs before it, logged at its own step, once."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path, "--max_steps", "2", "--eval_fraction", "0.07",
                                                        "--eval_steps", "2", "--logging_steps", "1")])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    tokenizer = load_tokenizer(cfg)
    train_data, eval_data = build_datasets(cfg, tokenizer)
    model = shard_model(load_model(cfg), resolve_plan(cfg))

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(trainer, "evaluate", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        train(cfg, env, model, tokenizer, train_data, MetricsLogger(cfg, is_main=True), None, eval_data)
    monkeypatch.undo()
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]  # and checkpoint-2
    step_2 = trainer.evaluate(model, eval_data, cfg, tokenizer, env)  # the weights checkpoint-2 holds
    longer = dataclasses.replace(cfg, max_steps=3)
    for _ in range(2):  # the second resume finds the evaluation in metrics.jsonl
        resumed = shard_model(load_model(longer), resolve_plan(longer))
        train(longer, env, resumed, tokenizer, train_data, MetricsLogger(longer, is_main=True),
              str(tmp_path / "checkpoint-2"), eval_data)
        metrics = read_metrics(tmp_path / "metrics.jsonl")
        assert [(m["step"], "eval/loss" in m) for m in metrics] == [(1, False), (2, False), (2, True), (3, False),
                                                                    (3, True)]
        assert metrics[2] == {"step": 2, "epoch": metrics[1]["epoch"], **step_2}


def test_a_run_whose_final_evaluation_failed_is_finished_by_a_resume(tiny, tmp_path):
    """The last step saves, then evaluates, then the recipe exports: a resume from the last checkpoint trains
    nothing, and writes the evaluation and final/ of the uninterrupted run; once final/ exists, it is refused."""
    args = ["--max_steps", "2", "--eval_fraction", "0.07", "--logging_steps", "1"]
    run([sys.executable, RECIPE, *recipe_args(tiny, tmp_path / "whole", *args)])
    failed = run([sys.executable, "tests/drivers/final_eval_fails.py", RECIPE,
                  *recipe_args(tiny, tmp_path / "failed", *args)], expect_rc=1)
    assert "CUDA out of memory (simulated)" in failed.stderr
    assert (tmp_path / "failed" / "checkpoint-2").is_dir() and not (tmp_path / "failed" / "final").exists()
    resume = recipe_args(tiny, tmp_path / "failed", *args, "--resume_from_checkpoint", "auto")
    finished = run([sys.executable, RECIPE, *resume])
    assert (f"resume: {tmp_path / 'failed' / 'checkpoint-2'} is at the run's last step (2) and "
            f"{tmp_path / 'failed' / 'final'} does not exist: the run is finished from it") in finished.stdout
    numbers = ("step", "loss", "grad_norm", "eval/loss", "eval/perplexity")  # not the timings
    assert ([{k: m[k] for k in numbers if k in m} for m in read_metrics(tmp_path / "failed" / "metrics.jsonl")]
            == [{k: m[k] for k in numbers if k in m} for m in read_metrics(tmp_path / "whole" / "metrics.jsonl")])
    assert "eval/loss" in read_metrics(tmp_path / "whole" / "metrics.jsonl")[-1]
    assert_same_weights(final_weights(tmp_path / "failed"), final_weights(tmp_path / "whole"))
    # Once more (a job requeued after its run finished): nothing is done, and the job succeeds.
    def files():  # but .run.lock, which each run takes
        return {p: p.stat().st_mtime_ns for p in (tmp_path / "failed").rglob("*") if p.name != ".run.lock"}

    before = files()
    again = run([sys.executable, RECIPE, *resume])
    assert (f"resume: the run in {tmp_path / 'failed'} is complete: {tmp_path / 'failed' / 'checkpoint-2'} is at its "
            f"last step (2) and {tmp_path / 'failed' / 'final'} holds its export, so nothing is left to do (raise "
            f"max_steps or num_train_epochs to extend the run)") in again.stdout.splitlines()
    assert files() == before
    # Into another output_dir, as a way to train more that forgot to raise max_steps: the checkpoint's run has its
    # final/ beside it.
    elsewhere = run([sys.executable, RECIPE, *recipe_args(tiny, tmp_path / "more", *args, "--resume_from_checkpoint",
                                                          tmp_path / "whole" / "checkpoint-2")], expect_rc=2)
    assert f"and {tmp_path / 'whole' / 'final'} holds its export: nothing is left to train" in elsewhere.stderr


def test_a_complete_run_resumed_on_two_ranks_says_so_once_and_every_rank_exits_0():
    """A job requeued after its run finished: resolve_resume raises RunComplete on every rank; rank 0 alone prints
    it, and every rank exits 0, so that the launcher reports success."""
    script = ("import torch.distributed as dist\n"
              "from fsdp_recipes.cli import run_main\n"
              "from fsdp_recipes.distributed import RunComplete\n"
              "def main():\n"
              "    dist.init_process_group('gloo')\n"
              "    raise RunComplete('resume: the run is complete')\n"
              "run_main(main)\n")
    procs = two_ranks("-c", script)  # stdout buffered (subprocess_env): exit_process flushes it
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert [stdout for stdout, _ in outputs] == ["resume: the run is complete\n", ""], outputs


def test_a_run_stopped_while_generating_its_samples_is_finished_by_a_resume(tiny, tmp_path):
    """A SIGTERM, a failure or a kill in sample generation comes after the export: final/ is complete and
    samples.jsonl is not written (a kill while writing it leaves no samples.jsonl cut short, which the resume would
    take for written). A resume finishes the run again for the samples (the same final/ and answers); then it is
    refused. The output_dir is relative (as the README's outputs/...): its final/ is also found, by its absolute
    path, beside the checkpoint, and is the same folder."""
    out = os.path.relpath(tmp_path, REPO)  # the recipe runs in REPO
    args = recipe_args(tiny, out, "--max_steps", "2", "--generation_prompts", "abc", "--generation_max_new_tokens",
                       "4", "--resume_from_checkpoint", "auto")
    killed = run([sys.executable, "tests/drivers/ckpt_kill.py", "in_samples", 1, *args], expect_rc=-signal.SIGKILL)
    [answer] = [line for line in killed.stdout.splitlines() if line.startswith("sample: ")]
    assert not (tmp_path / "samples.jsonl").exists()
    exported = final_weights(tmp_path)
    finished = run([sys.executable, RECIPE, *args])
    assert (f"resume: {out}/checkpoint-2 is at the run's last step (2) and {out}/final holds its export but {out} no "
            f"samples.jsonl (this run's export replaces it): the run is finished from it") in finished.stdout
    assert answer in finished.stdout
    [sample] = read_metrics(tmp_path / "samples.jsonl")
    assert answer == f"sample: {sample['prompt']!r} -> {sample['completion']!r}"
    assert_same_weights(final_weights(tmp_path), exported)
    again = run([sys.executable, RECIPE, *args])
    assert f"and {out}/final holds its export, so nothing is left to do" in again.stdout


def test_an_extended_run_whose_final_evaluation_failed_replaces_the_earlier_export(tiny, tmp_path):
    """A run of 2 steps, extended to 4 (max_steps raised), fails after its last save: final/ still holds the 2-step
    export, which a resume must not take for the 4-step run's. The resume finishes the run and replaces it."""
    args = recipe_args(tiny, tmp_path, "--eval_fraction", "0.07", "--resume_from_checkpoint", "auto")
    run([sys.executable, RECIPE, *args, "--max_steps", "2"])
    earlier = final_weights(tmp_path)
    run([sys.executable, "tests/drivers/final_eval_fails.py", RECIPE, *args, "--max_steps", "4"], expect_rc=1)
    assert (tmp_path / "checkpoint-4").is_dir() and (tmp_path / "latest").read_text() == "checkpoint-4"
    finished = run([sys.executable, RECIPE, *args, "--max_steps", "4"])
    assert (f"resume: {tmp_path / 'checkpoint-4'} is at the run's last step (4) and {tmp_path / 'final'} holds an "
            f"earlier export, older than the checkpoint (this run's export replaces it): the run is finished from "
            f"it") in finished.stdout
    convert(str(tmp_path / "checkpoint-4"), str(tmp_path / "step4"))
    assert_same_weights(final_weights(tmp_path), load_file(tmp_path / "step4" / "model.safetensors"))
    assert not torch.equal(final_weights(tmp_path)["model.norm.weight"], earlier["model.norm.weight"])
    assert "eval/loss" in read_metrics(tmp_path / "metrics.jsonl")[-1]
    # Now final/ is the 4-step run's export: nothing is left to do.
    again = run([sys.executable, RECIPE, *args, "--max_steps", "4"])
    assert f"and {tmp_path / 'final'} holds its export, so nothing is left to do" in again.stdout
    # Ended at a step the 4-step run has passed, the same auto is refused: final/ would be checkpoint-4's weights.
    shorter = run([sys.executable, RECIPE, *args, "--max_steps", "3"], expect_rc=2)
    assert "is at step 4 and this run has 3 steps" in shorter.stderr


def test_a_resume_owes_the_samples_of_this_runs_export_alone(tiny, reference, tmp_path, one_process_group, capsys):
    """output_dir's final/ without samples.jsonl: the export of the checkpoint (newer than it) is finished again for
    its samples; an earlier export (older, of the run before max_steps was raised) is replaced, and said so."""
    out = tmp_path / "out"
    shutil.copytree(reference / "checkpoint-6", out / "checkpoint-6")  # copystat: the mtimes of the reference run
    shutil.copytree(reference / "final", out / "final")
    (out / "latest").write_text("checkpoint-6")
    cfg, model, tokenizer, data = resume_inputs(  # the checkpoint's global batch of 2 ranks x 4 x 2, on 1 rank
        tiny, "--resume_from_checkpoint", "auto", "--output_dir", out, "--gradient_accumulation_steps", "4",
        "--generation_prompts", "abc")
    assert resolve_resume(cfg, model, tokenizer, data) == str(out / "checkpoint-6")
    assert (f"and {out / 'final'} holds its export but {out} no samples.jsonl (this run's export replaces it): the run "
            f"is finished from it") in capsys.readouterr().out
    saved = os.path.getmtime(out / "checkpoint-6" / "trainer_state.json")
    os.utime(out / "final", (saved - 60, saved - 60))
    assert resolve_resume(cfg, model, tokenizer, data) == str(out / "checkpoint-6")
    assert (f"and {out / 'final'} holds an earlier export, older than the checkpoint (this run's export replaces "
            f"it): the run is finished from it") in capsys.readouterr().out


def test_a_final_folder_with_its_checkpoints_modification_time_is_its_export(tmp_path):
    """A file system of whole-second times (ext3, HFS+) gives an export written in the second of its run's last save
    that save's time: still the checkpoint's export (a resume would otherwise finish the run again)."""
    checkpoint, final = tmp_path / "checkpoint-6", tmp_path / "final"
    checkpoint.mkdir()
    final.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    os.utime(checkpoint / "trainer_state.json", (1000, 1000))
    for final_time, exported in [(1000, True), (1001, True), (999, False)]:
        os.utime(final, (final_time, final_time))
        assert export_of(str(final), str(checkpoint)) == exported


def resume_inputs(tiny, *args):
    """What a recipe hands resolve_resume: the config, the model, the tokenizer and the training data."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, "unused", *args)])
    tokenizer = load_tokenizer(cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny["tied_model"], dtype=torch.float32)  # fp32 master weights
    return cfg, model, tokenizer, build_datasets(cfg, tokenizer)[0]


def test_auto_says_it_resumes_from_the_checkpoint_latest_names_though_a_newer_one_is_there(tiny, reference, tmp_path,
                                                                                           one_process_group, capsys):
    """A kill between a save's rename and `latest` (the save's finish) leaves a complete checkpoint that `latest` does
    not name: auto resumes from the one it names, which a log line explains, with the way to the newer one."""
    out = tmp_path / "out"
    for name in ["checkpoint-4", "checkpoint-6"]:
        shutil.copytree(reference / name, out / name)
    (out / "latest").write_text("checkpoint-4")
    cfg, model, tokenizer, data = resume_inputs(  # the checkpoint's global batch of 2 ranks x 4 x 2, on 1 rank
        tiny, "--resume_from_checkpoint", "auto", "--output_dir", out, "--gradient_accumulation_steps", "4")
    assert resolve_resume(cfg, model, tokenizer, data) == str(out / "checkpoint-4")
    assert (f"resume: {out} also holds checkpoint-6, of a later step than {out / 'checkpoint-4'}, which `latest` names "
            f"(a save killed before `latest` named it, or a checkpoint that a return to an earlier step left): this "
            f"run resumes from checkpoint-4; to continue from the newer one instead, pass --resume_from_checkpoint "
            f"{out / 'checkpoint-6'}\n") in capsys.readouterr().out
    # Passed by name (a return to an earlier step, say): the user's choice, not `latest`'s, and nothing to explain.
    cfg.resume_from_checkpoint = str(out / "checkpoint-4")
    assert resolve_resume(cfg, model, tokenizer, data) == str(out / "checkpoint-4")
    assert "also holds" not in capsys.readouterr().out


def test_a_setting_another_transformers_wrote_that_this_one_does_not_know_is_left_out_with_a_note(
        tiny, reference, tmp_path, one_process_group, capsys):
    """A newer transformers writes its own settings at their defaults (5.25 writes Gemma 3's vision_use_head and
    gpt-oss' swiglu_limit, which 5.17 lacks): resuming on the older one was refused as another model config."""
    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(reference / "checkpoint-6", checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    cfg, model, tokenizer, data = resume_inputs(
        tiny, "--resume_from_checkpoint", checkpoint, "--gradient_accumulation_steps", "4")
    for written_by in ("99.0.0", transformers.__version__):
        (checkpoint / "config.json").write_text(json.dumps({**config, "swiglu_limit": 7.0,
                                                            "transformers_version": written_by}))
        if written_by != transformers.__version__:
            assert resolve_resume(cfg, model, tokenizer, data) == str(checkpoint)
            assert (f"resume: {checkpoint}/config.json, written by transformers 99.0.0, sets swiglu_limit: that "
                    f"version's defaults for settings the model's config.json leaves out and transformers "
                    f"{transformers.__version__} does not define, left out of the comparison"
                    ) in capsys.readouterr().out.splitlines()
        else:  # written by this version: another model's config
            with pytest.raises(CheckpointError, match=r"different model config \(swiglu_limit: checkpoint 7.0, model "
                                                      r"None\)"):
                resolve_resume(cfg, model, tokenizer, data)


def test_a_resume_on_other_torch_or_transformers_versions_says_so(tiny, reference, tmp_path, one_process_group,
                                                                   capsys):
    """A cluster upgraded between a run and its resume: the checkpoint loads exactly, but the steps may round
    otherwise (bf16 on the CPU, torch 2.13 and 2.11: 1e-4 relative), which the run says."""
    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(reference / "checkpoint-6", checkpoint)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    cfg, model, tokenizer, data = resume_inputs(
        tiny, "--resume_from_checkpoint", checkpoint, "--gradient_accumulation_steps", "4")
    capsys.readouterr()
    assert resolve_resume(cfg, model, tokenizer, data) == str(checkpoint)
    assert "library versions" not in capsys.readouterr().out
    # Below the floors (requirements.txt): never the versions the suite runs on.
    saved = {**state["versions"], "torch": "2.10.0+cu126", "transformers": "5.16.0", "datasets": "4.8.4"}
    (checkpoint / "trainer_state.json").write_text(json.dumps({**state, "versions": saved}))
    assert resolve_resume(cfg, model, tokenizer, data) == str(checkpoint)
    assert (f"resume: {checkpoint} was saved with other library versions (torch 2.10.0+cu126, now {torch.__version__}; "
            f"transformers 5.16.0, now {transformers.__version__}): the weights, optimizer, RNG states and data "
            f"position load exactly, but kernels that changed may round otherwise, so the losses from here can differ "
            f"from an uninterrupted run's in their last digits (see README, \"Checkpoints and resume\")"
            ) in capsys.readouterr().out.splitlines()
    # A checkpoint from before the versions were recorded: nothing to compare, nothing said.
    (checkpoint / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "versions"}))
    assert resolve_resume(cfg, model, tokenizer, data) == str(checkpoint)
    assert "library versions" not in capsys.readouterr().out


def test_auto_before_the_first_checkpoint_starts_from_step_0_and_says_so(tmp_path, one_process_group, capsys):
    """A job that passes auto on every start, started for the first time: nothing to resume yet."""
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path),
                        "--resume_from_checkpoint", "auto"])
    assert resolve_resume(cfg, None, None, None) is None
    assert capsys.readouterr().out == f"resume: no checkpoint in {tmp_path} yet, starting from step 0\n"


def test_a_resume_that_computes_otherwise_says_so(tiny, reference, tmp_path, one_process_group, capsys):
    """Another launcher config (engine, bf16 or no), attention kernel or batch layout of the same global batch: the
    checkpoint loads exactly but the losses round otherwise, which the run says (it was silent)."""
    checkpoint = tmp_path / "checkpoint-6"  # without the run's final/ beside it: the run is not done
    shutil.copytree(reference / "checkpoint-6", checkpoint)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["compute"] == {
        "attn_implementation": "sdpa", "fsdp_version": 2, "mixed_precision": "no", "offload_params": False,
        "torch_compile": False, "gradient_sync": "every_micro_batch"}
    said = "resume: this run computes its steps otherwise than the run that saved"
    rounding = ("the weights, optimizer, RNG states and data position load exactly, but the losses from here can "
                "differ from an uninterrupted run's by rounding")
    for args, changed in [
        # The checkpoint's settings, on 1 rank (the global batch of 2 ranks x 4 x 2 kept by accumulating 4).
        ([], "batch layout 1 rank x 4 x 4, was 2 ranks x 4 x 2"),
        (["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "8", "--fsdp_version", "1",
          "--mixed_precision", "bf16", "--attn_implementation", "eager"],
         "attn_implementation eager, was sdpa; fsdp_version 1, was 2; mixed_precision bf16, was no; batch layout 1 "
         "rank x 2 x 8, was 2 ranks x 4 x 2")]:
        cfg, _, tokenizer, data = resume_inputs(tiny, "--resume_from_checkpoint", checkpoint,
                                                "--gradient_accumulation_steps", "4", *args)
        model = shard_model(load_model(cfg), resolve_plan(cfg))
        capsys.readouterr()
        assert resolve_resume(cfg, model, tokenizer, data) == str(checkpoint)
        assert f"{said} {checkpoint} ({changed}): {rounding}" in capsys.readouterr().out.splitlines()
    # A checkpoint of no compute record (before it, 2026-12-07) compares the batch layout alone.
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    (checkpoint / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "compute"}))
    assert resolve_resume(cfg, model, tokenizer, data) == str(checkpoint)
    assert f"{said} {checkpoint} (batch layout 1 rank x 2 x 8, was 2 ranks x 4 x 2): {rounding}" in (
        capsys.readouterr().out)


def test_the_newer_checkpoints_auto_does_not_take_are_named_with_the_newest_to_continue_from(tmp_path, capsys):
    for name in ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-10", "checkpoint-12.tmp"]:
        (tmp_path / name).mkdir()
    report_newer_checkpoints(str(tmp_path), str(tmp_path / "checkpoint-4"), 4)
    assert capsys.readouterr().out == (
        f"resume: {tmp_path} also holds checkpoint-6, checkpoint-10, of a later step than {tmp_path / 'checkpoint-4'}, "
        f"which `latest` names (a save killed before `latest` named it, or a checkpoint that a return to an earlier "
        f"step left): this run resumes from checkpoint-4; to continue from the newer one instead, pass "
        f"--resume_from_checkpoint {tmp_path / 'checkpoint-10'}\n")
    report_newer_checkpoints(str(tmp_path), str(tmp_path / "checkpoint-10"), 10)  # the newest: nothing to say
    assert capsys.readouterr().out == ""


def test_resume_with_another_training_config_is_refused_listing_each_key(tiny, reference, one_process_group):
    checkpoint = reference / "checkpoint-6"
    # One process: the global batch of 2 ranks x 4 x 2 is kept with an accumulation of 4. Logging, saving, the
    # output folder and the run's length may change.
    cfg, model, tokenizer, data = resume_inputs(
        tiny, "--resume_from_checkpoint", checkpoint, "--gradient_accumulation_steps", "4", "--logging_steps", "3",
        "--save_steps", "5", "--output_dir", "elsewhere", "--report_to", "wandb", "--max_steps", "8")
    assert resolve_resume(cfg, model, tokenizer, data) == str(checkpoint)
    # The same data file under another spelling: its tokens are compared, not its name.
    respelled = dataclasses.replace(cfg, dataset_name=os.path.relpath(cfg.dataset_name))
    assert respelled.dataset_name != cfg.dataset_name
    assert resolve_resume(respelled, model, tokenizer, data) == str(checkpoint)
    changed = dataclasses.replace(cfg, learning_rate=2e-2, weight_decay=0.0, seed=1, packing=True,
                                  gradient_accumulation_steps=2)
    with pytest.raises(CheckpointError) as error:
        resolve_resume(changed, model, tokenizer, data)
    assert str(error.value) == (
        f"{checkpoint} was saved by a run with another training config (packing: checkpoint False, now True; seed: "
        f"checkpoint 42, now 1; learning_rate: checkpoint 0.01, now 0.02; weight_decay: checkpoint 0.1, now 0.0; "
        f"global batch (world size x per_device_train_batch_size x gradient_accumulation_steps): checkpoint 16 "
        f"(2 ranks x 4 x 2), now 8 (1 rank x 4 x 2), kept on 1 rank by --gradient_accumulation_steps 4 (1 rank "
        f"x 4 x 4)): a resume continues that run, whose data position and optimizer settings the checkpoint holds, "
        f"so resume with the checkpoint's values, or convert its weights (`python -m fsdp_recipes.convert {checkpoint} "
        f"<out_dir>`) to train them further in a fresh run with --model_name_or_path <out_dir>")
    # A world size whose layouts cannot give the checkpoint's 16 sequences, or a batch that does not divide them.
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert training_config_differences(state, cfg, 3, "float32") == [
        "global batch (world size x per_device_train_batch_size x gradient_accumulation_steps): checkpoint 16 (2 ranks "
        "x 4 x 2), now 48 (3 ranks x 4 x 4), which no layout of 3 ranks gives: resume on a world size that divides 16"]
    assert training_config_differences(state, dataclasses.replace(cfg, per_device_train_batch_size=3), 1,
                                       "float32") == [
        "global batch (world size x per_device_train_batch_size x gradient_accumulation_steps): checkpoint 16 (2 ranks "
        "x 4 x 2), now 12 (1 rank x 3 x 4), kept on 1 rank by per_device_train_batch_size x "
        "gradient_accumulation_steps = 16"]
    # pure_bf16 keeps master weights and Adam's moments in bf16: the checkpoint's fp32 ones would be rounded.
    with pytest.raises(CheckpointError, match=r"\(master weights and optimizer state \(mixed_precision\): checkpoint "
                                              r"float32 \(mixed_precision bf16 or no\), now bfloat16\)"):
        resolve_resume(cfg, model.to(torch.bfloat16), tokenizer, data)


def test_a_resume_keeps_the_router_loss_settings_of_the_checkpoint():
    # The mixture-of-experts loss decides the updates as the learning rate does: a resume with another coefficient,
    # or with the loss turned on or off, continues another run than the checkpoint's.
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_router_logits", "true",
                        "--router_aux_loss_coef", "0.001"])
    state = {"config": cfg.to_dict(), "world_size": 1, "master_dtype": "float32", "train_data": None}
    assert training_config_differences(state, cfg, 1, "float32") == []
    changed = dataclasses.replace(cfg, output_router_logits=None, router_aux_loss_coef=0.01)
    assert training_config_differences(state, changed, 1, "float32") == [
        "output_router_logits: checkpoint True, now None", "router_aux_loss_coef: checkpoint 0.001, now 0.01"]


# The settings README's "Checkpoints and resume" says a resume must keep, in its order: the data keys, the seed, the
# optimizer's and scheduler's, the router loss's.
KEPT_BY_A_RESUME = ["dataset_name", "dataset_weights", "dataset_config_name", "dataset_split", "dataset_format",
                    "dataset_column_mapping", "completion_only_loss", "eval_fraction", "eval_split", "max_seq_length",
                    "overlong_examples", "packing", "seed", "learning_rate", "lr_scheduler_type", "warmup_steps",
                    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
                    "output_router_logits", "router_aux_loss_coef"]


def test_each_setting_a_resume_must_keep_is_compared():
    # Each changed alone would be taken without a word if its key were left out of the comparison.
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d"])
    saved = {**cfg.to_dict(), **{key: "changed" for key in KEPT_BY_A_RESUME}}
    older = {"config": saved, "world_size": 1, "master_dtype": "float32"}  # before the training data were recorded
    assert training_config_differences(older, cfg, 1, "float32") == [
        f"{key}: checkpoint 'changed', now {getattr(cfg, key)!r}" for key in KEPT_BY_A_RESUME]
    # Where the checkpoint records its training data, those are compared instead of the name (the same file under
    # another spelling resumes); before that record, the name is all there is to compare.
    recorded = {**older, "train_data": {"rows": 256, "sha256": "0" * 64}}
    assert training_config_differences(recorded, cfg, 1, "float32") == [
        f"{key}: checkpoint 'changed', now {getattr(cfg, key)!r}" for key in KEPT_BY_A_RESUME[1:]]


def test_a_pure_bf16_checkpoint_is_refused_by_a_run_with_fp32_master_weights():
    # Adam's moments and the weights, kept in bf16, would go on in fp32 from rounded values; the other way round
    # (tested with resolve_resume above) they would be rounded.
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d"])
    state = {"config": cfg.to_dict(), "world_size": 1, "master_dtype": "bfloat16"}
    assert training_config_differences(state, cfg, 1, "bfloat16") == []
    assert training_config_differences(state, cfg, 1, "float32") == [
        "master weights and optimizer state (mixed_precision): checkpoint bfloat16 (mixed_precision pure_bf16), now "
        "float32"]


def test_what_an_older_checkpoint_did_not_record_is_not_compared():
    """A checkpoint from before a setting was recorded, or whose master_dtype its Adam moments do not tell
    (saved_master_dtype None), resumes: there is nothing to compare them with."""
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d"])
    saved = {k: v for k, v in cfg.to_dict().items() if k not in ("output_router_logits", "router_aux_loss_coef")}
    state = {"config": saved, "world_size": 1, "master_dtype": None}
    assert training_config_differences(state, cfg, 1, "bfloat16") == []
    assert training_config_differences({**state, "config": {**saved, "seed": 1}}, cfg, 1, "bfloat16") == [
        "seed: checkpoint 1, now 42"]


def test_a_resume_compares_the_router_loss_the_model_trained_with(tiny, one_process_group, tmp_path):
    # Unset in the recipe config means config.json's value: a resume that writes that value out continues the
    # same run (it was refused as "checkpoint None, now True"); one that changes what the model trained with is not.
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=2,
                            num_experts_per_tok=1, moe_intermediate_size=16, max_position_embeddings=64,
                            output_router_logits=True, router_aux_loss_coef=0.001,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    args = ["--model_name_or_path", str(tmp_path / "moe"), "--dataset_name", str(tiny["data"]), "--output_dir",
            str(tmp_path / "run"), "--max_steps", "4", "--save_steps", "2", "--per_device_train_batch_size", "4",
            "--mixed_precision", "no", "--max_seq_length", "64"]
    run([sys.executable, "recipes/qwen3_moe_sft.py", *args, "--max_steps", "2"])
    checkpoint = tmp_path / "run" / "checkpoint-2"

    def resume(*extra):
        cfg = parse_config([*args, "--resume_from_checkpoint", str(checkpoint), *extra])
        tokenizer = load_tokenizer(cfg)
        return resolve_resume(cfg, load_model(cfg), tokenizer, build_datasets(cfg, tokenizer)[0])

    assert resume() == str(checkpoint)
    assert resume("--output_router_logits", "true", "--router_aux_loss_coef", "0.001") == str(checkpoint)
    with pytest.raises(CheckpointError, match=r"\(output_router_logits: checkpoint True, now False; "
                                              r"router_aux_loss_coef: checkpoint 0.001, now 0.01\)"):
        resume("--output_router_logits", "false", "--router_aux_loss_coef", "0.01")


def test_a_checkpoint_from_before_the_master_dtype_record_is_compared_by_its_adam_moments(
        tiny, reference, one_process_group, tmp_path):
    """A checkpoint saved before trainer_state.json recorded master_dtype (2026-12-02) was resumed in another
    mixed_precision without a word: its Adam moments, kept in the master weights' dtype, tell it."""
    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(reference / "checkpoint-6", checkpoint)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["master_dtype"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    cfg, model, tokenizer, data = resume_inputs(tiny, "--resume_from_checkpoint", checkpoint,
                                                "--gradient_accumulation_steps", "4", "--max_steps", "8")
    assert resolve_resume(cfg, model, tokenizer, data) == str(checkpoint)
    with pytest.raises(CheckpointError, match=r"\(master weights and optimizer state \(mixed_precision\): checkpoint "
                                              r"float32 \(mixed_precision bf16 or no\), now bfloat16\)"):
        resolve_resume(cfg, model.to(torch.bfloat16), tokenizer, data)


def test_resume_with_no_steps_left_is_refused(tiny, reference, one_process_group, tmp_path, capsys):
    checkpoint = reference / "checkpoint-6"
    cfg, model, tokenizer, data = resume_inputs(tiny, "--resume_from_checkpoint", checkpoint,
                                                "--gradient_accumulation_steps", "4")
    # 256 examples in global batches of 16: 16 steps an epoch, so a quarter epoch ends at step 4 and half at 8.
    assert len(data) == 256
    # At the last step, a run whose output_dir has its final/ (the run was done) is refused as a shorter one.
    (tmp_path / "final").mkdir()
    for length, total, done in [({"max_steps": 6}, 6, f", and {tmp_path / 'final'} holds its export"),
                                ({"max_steps": 5}, 5, ""), ({"max_steps": -1, "num_train_epochs": 0.25}, 4, "")]:
        with pytest.raises(CheckpointError) as error:
            resolve_resume(dataclasses.replace(cfg, output_dir=str(tmp_path), **length), model, tokenizer, data)
        assert str(error.value) == (
            f"{checkpoint} is at step 6 and this run has {total} steps (max_steps, or num_train_epochs when "
            f"max_steps is -1){done}: nothing is left to train; raise max_steps or num_train_epochs to extend the "
            f"run, or write the checkpoint as a Hugging Face folder with `python -m fsdp_recipes.convert "
            f"{checkpoint} <out_dir>`")
    extended = dataclasses.replace(cfg, max_steps=-1, num_train_epochs=0.5)
    assert resolve_resume(extended, model, tokenizer, data) == str(checkpoint)
    out = capsys.readouterr().out
    # The checkpoint's run of 6 steps made 8 (half an epoch of 16 steps): said, with the keys that changed.
    assert ("resume: the run's length changes from 6 to 8 steps (max_steps 6 -> -1, num_train_epochs 1.0 -> 0.5): "
            "the LR schedule (and a warm-up given as a fraction of the run) follows the new total from step 6\n") in out
    # A resume that saves no checkpoint leaves `latest` where it was: a later auto would repeat its steps.
    assert "save_steps 0" not in out
    assert resolve_resume(dataclasses.replace(extended, save_steps=0), model, tokenizer, data) == str(checkpoint)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"resume: this run saves no checkpoint (save_steps 0), so resuming it again, also with auto after it ends, "
        f"starts from {checkpoint} (step 6) and trains its steps again: set save_steps to keep its progress")
    # Step 4 of the 6-step run, with no final/ anywhere, is not the end of a run shortened to 4 steps.
    shutil.copytree(reference / "checkpoint-4", tmp_path / "copy" / "checkpoint-4")
    shortened = dataclasses.replace(cfg, resume_from_checkpoint=str(tmp_path / "copy" / "checkpoint-4"),
                                    output_dir=str(tmp_path / "copy"), max_steps=4)
    with pytest.raises(CheckpointError, match=r"this run has 4 steps \(max_steps, or num_train_epochs when max_steps "
                                              r"is -1\), where the checkpoint's run, of another length, did not end: "
                                              r"nothing is left to train"):
        resolve_resume(shortened, model, tokenizer, data)
    # Step 6 ends the run whatever keys say so: max_steps 6, or 0.375 of an epoch of 16 steps.
    shutil.copytree(reference / "checkpoint-6", tmp_path / "copy" / "checkpoint-6")
    same_end = dataclasses.replace(shortened, resume_from_checkpoint=str(tmp_path / "copy" / "checkpoint-6"),
                                   max_steps=-1, num_train_epochs=0.375, save_steps=0)
    capsys.readouterr()
    assert resolve_resume(same_end, model, tokenizer, data) == str(tmp_path / "copy" / "checkpoint-6")
    # A run finished from its last checkpoint trains no steps: no word of training them again, with save_steps 0.
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "the run is finished from it (the final evaluation if metrics.jsonl lacks it, the export, the samples)")
    # Into an output_dir whose final/ is newer than the checkpoint: its export, unless overwrite_output_dir removes
    # it (an earlier run's) before this run trains.
    into_tmp_path = dataclasses.replace(same_end, output_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match=re.escape(f"and {tmp_path / 'final'} holds its export: nothing is left")):
        resolve_resume(into_tmp_path, model, tokenizer, data)
    overwrite = dataclasses.replace(into_tmp_path, overwrite_output_dir=True)
    assert resolve_resume(overwrite, model, tokenizer, data) == str(tmp_path / "copy" / "checkpoint-6")
    # With auto and the export written after the checkpoint, the run is complete; but not a run shortened to end at
    # the checkpoint `latest` names.
    (tmp_path / "copy" / "final").mkdir()
    for name, length, done in [("checkpoint-6", {"max_steps": 6}, True), ("checkpoint-4", {"max_steps": 4}, False)]:
        (tmp_path / "copy" / "latest").write_text(name)
        auto = dataclasses.replace(shortened, resume_from_checkpoint="auto", **length)
        with pytest.raises(RunComplete if done else CheckpointError) as error:
            resolve_resume(auto, model, tokenizer, data)
        assert ("is complete" in str(error.value)) == done


def test_resume_with_another_tokenizer_is_refused(tiny, reference, one_process_group):
    checkpoint = reference / "checkpoint-6"
    cfg, model, tokenizer, data = resume_inputs(tiny, "--resume_from_checkpoint", checkpoint,
                                                "--gradient_accumulation_steps", "4", "--max_steps", "8")
    # The same tokenizer from another folder (the checkpoint's own copy) is the same tokenizer.
    from_checkpoint = load_tokenizer(dataclasses.replace(cfg, tokenizer_name_or_path=str(checkpoint)))
    assert resolve_resume(cfg, model, from_checkpoint, data) == str(checkpoint)
    template = load_tokenizer(cfg)
    template.chat_template = template.chat_template.replace("<|end|>", "\n")
    added = load_tokenizer(cfg)
    added.add_tokens(["<|tool|>"])
    lowercase = load_tokenizer(cfg)
    lowercase.backend_tokenizer.normalizer = normalizers.Lowercase()
    eos = load_tokenizer(cfg)  # another of its special tokens ends each example
    eos.eos_token = "<|pad|>"
    bos = load_tokenizer(cfg)  # a BOS in front of every encoding, as Llama's post-processor adds
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos.bos_token_id)])
    # A checkpoint saved with the default template (before it was given to chat and instruction data only) and a
    # run on other data, whose tokenizer has none: the template played no part.
    default, without = load_tokenizer(cfg), load_tokenizer(cfg)
    default.chat_template, without.chat_template = DEFAULT_CHAT_TEMPLATE, None
    assert tokenizer_differences(default, without) == []
    assert tokenizer_differences(without, default) == ["chat_template"]  # a run that would use it: not the same
    # Another BOS (put in front of plain text) or pad token, over the same vocabulary and pipeline.
    bos_token, pad_token = load_tokenizer(cfg), load_tokenizer(cfg)
    bos_token.bos_token, pad_token.pad_token = "<|pad|>", "<|end|>"
    assert tokenizer_differences(from_checkpoint, bos_token) == ["bos_token"]
    assert tokenizer_differences(from_checkpoint, pad_token) == ["pad_token"]
    # Padding and truncation, which encoding a batch sets on the backend (and a tokenizer.json may hold): no part.
    truncating = load_tokenizer(cfg)
    truncating.backend_tokenizer.enable_truncation(8)
    truncating.backend_tokenizer.enable_padding()
    assert tokenizer_differences(from_checkpoint, truncating) == []
    # A tokenizer of Python code alone (no backend_tokenizer, as ByT5's) is compared by its vocabulary.
    byt5, added_byt5 = ByT5Tokenizer(), ByT5Tokenizer()
    assert tokenizer_differences(byt5, added_byt5) == []
    added_byt5.add_tokens(["<|tool|>"])
    assert tokenizer_differences(byt5, added_byt5) == ["vocabulary"]
    for changed, parts in [(template, "chat_template"), (added, "added_tokens"), (lowercase, "normalizer"),
                           (eos, "eos_token"), (bos, "post_processor")]:
        with pytest.raises(CheckpointError) as error:
            resolve_resume(cfg, model, changed, data)
        assert str(error.value) == (
            f"{checkpoint} was saved with another tokenizer (its {parts} differ): resume with the checkpoint's "
            f"tokenizer (--tokenizer_name_or_path {checkpoint}), or convert its weights (`python -m "
            f"fsdp_recipes.convert {checkpoint} <out_dir>`) to train them further in a fresh run with "
            f"--model_name_or_path <out_dir>")


def test_resume_with_training_data_changed_in_place_is_refused(tiny, reference, tmp_path, one_process_group):
    checkpoint = reference / "checkpoint-6"
    cfg, model, tokenizer, data = resume_inputs(tiny, "--resume_from_checkpoint", checkpoint,
                                                "--gradient_accumulation_steps", "4", "--max_steps", "8")
    # Recorded by the run's process, equal in this one: a resume with the same data goes ahead.
    assert json.loads((checkpoint / "trainer_state.json").read_text())["train_data"] == training_data_identity(data)
    rows = [json.loads(line) for line in tiny["data"].read_text().splitlines()]
    edited = json.loads(json.dumps(rows))
    edited[100]["messages"][-1]["content"] += " Also."

    def built(name: str, examples: list[dict]):
        """`examples` tokenized as this run does, standing for the run's dataset_name with another content."""
        path = tmp_path / name
        path.write_text("".join(json.dumps(example) + "\n" for example in examples))
        return build_datasets(dataclasses.replace(cfg, dataset_name=str(path)), tokenizer)[0]

    for changed, what in [(built("edited.jsonl", edited), "the same 256 rows, but other tokens"),
                          (built("shorter.jsonl", rows[:240]), "it had 256 rows after tokenization, now 240")]:
        with pytest.raises(CheckpointError) as error:
            resolve_resume(cfg, model, tokenizer, changed)
        assert str(error.value).startswith(
            f"{checkpoint} was saved by a run whose training data differ from this run's {tiny['data']} ({what}")
        assert str(error.value).endswith(
            "): a resume continues at step 6 of that data's order, so resume with the data the checkpoint was trained "
            f"on, or convert its weights (`python -m fsdp_recipes.convert {checkpoint} <out_dir>`) to train them further "
            f"in a fresh run with --model_name_or_path <out_dir>")
    # A data file copied or touched with the same content keeps its identity (not the datasets fingerprint).
    copy = built("copy.jsonl", rows)
    os.utime(tmp_path / "copy.jsonl", (1e9, 1e9))
    touched = build_datasets(dataclasses.replace(cfg, dataset_name=str(tmp_path / "copy.jsonl")), tokenizer)[0]
    assert touched._fingerprint != copy._fingerprint
    assert training_data_identity(touched) == training_data_identity(copy) == training_data_identity(data)
    # A checkpoint written before the record was kept resumes (nothing to compare with).
    shutil.copytree(checkpoint, tmp_path / "older")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["train_data"]
    (tmp_path / "older" / "trainer_state.json").write_text(json.dumps(state))
    older = dataclasses.replace(cfg, resume_from_checkpoint=str(tmp_path / "older"))
    assert resolve_resume(older, model, tokenizer, built("edited_again.jsonl", edited)) == str(tmp_path / "older")


def test_the_training_data_identity_changes_with_any_token_row_boundary_order_or_selection():
    """The identity a resume compares: equal for the same rows however the table is chunked, other for a token
    changed anywhere (the row lengths kept), the same tokens split into other rows, or other rows or order selected."""
    long = list(range(1500))  # more tokens than one read would hash, were it cut short
    data = datasets.Dataset.from_dict({"input_ids": [long, [7, 8], [9]]})
    identity = training_data_identity(data)
    # What checkpoints have recorded (a change refuses their resume): the SHA-256 of the SHA-256s of the row lengths
    # (int64) and of the tokens as stored (int32).
    lengths, tokens = np.array([1500, 2, 1], np.int64), np.array(long + [7, 8, 9], np.int32)
    assert identity == {"rows": 3, "sha256": hashlib.sha256(hashlib.sha256(lengths.tobytes()).digest()
                                                            + hashlib.sha256(tokens.tobytes()).digest()).hexdigest()}
    rechunked = datasets.concatenate_datasets([data.select(range(1)), data.select(range(1, 3))])
    assert len(rechunked.data.column("input_ids").chunks) == 2 and training_data_identity(rechunked) == identity
    changed = {
        "last token": datasets.Dataset.from_dict({"input_ids": [long[:-1] + [0], [7, 8], [9]]}),
        "rows split": datasets.Dataset.from_dict({"input_ids": [long, [7], [8, 9]]}),
        "order": data.select([2, 1, 0]),
        "selection": data.select([0, 2]),
    }
    assert {what: training_data_identity(d)["rows"] for what, d in changed.items()} == {
        "last token": 3, "rows split": 3, "order": 3, "selection": 2}
    assert len({training_data_identity(d)["sha256"] for d in changed.values()} | {identity["sha256"]}) == 5


def test_resume_on_another_world_size_with_the_same_global_batch_continues_the_data(tiny, reference, tmp_path):
    # From 2 ranks x 4 x 2 to 1 rank x 4 x 4: each step trains on the same 16 examples as the uninterrupted run.
    resumed = run([sys.executable, RECIPE, *recipe_args(tiny, tmp_path, "--gradient_accumulation_steps", "4",
                                                        "--save_steps", "0", "--resume_from_checkpoint",
                                                        reference / "checkpoint-4")])
    assert "saved by 2 ranks, this run has 1: RNG states are not restored" in resumed.stdout
    uninterrupted = losses(reference)
    # The same sums in another order (over ranks and micro-batches): equal to float rounding, not bit for bit.
    assert losses(tmp_path) == pytest.approx({step: uninterrupted[step] for step in (5, 6)}, rel=1e-5, abs=0)
    # Neighbouring steps' losses differ far more than that: a data position off by a step would show.
    assert all(abs(uninterrupted[step] - uninterrupted[step - 1]) > 1e-3 for step in (5, 6))


@pytest.fixture(scope="module")
def dropout_run(tiny, reference, tmp_path_factory):
    """4 steps of one process with attention dropout, started with --overwrite_output_dir over a copy of the
    reference run's folder (and leftovers of its killed saves and sample generation, and a user's own files). A
    first try, whose warm-up covers the whole run, fails once the data are read, and leaves the folder as it was."""
    root = tmp_path_factory.mktemp("dropout")
    model = write_tiny_model(root / "model", dtype=torch.float32, tie_word_embeddings=True, hidden_size=64,
                             intermediate_size=128, num_hidden_layers=2, attention_dropout=0.5)
    shutil.copytree(reference, root / "out")
    for name in ["checkpoint-8.tmp", "final.old", "checkpoint-best"]:
        (root / "out" / name).mkdir()
    (root / "out" / "samples.jsonl").write_text("{}\n")
    (root / "out" / "metrics.jsonl.tmp").write_text("{}\n")  # a resume's rewrite, killed
    (root / "out" / "samples.jsonl.tmp").write_text("{}\n")  # a run killed while writing its samples
    (root / "out" / "checkpoint-notes.txt").write_text("the best so far: checkpoint-best\n")
    args = [*recipe_args(tiny, root / "out", "--model_name_or_path", model, "--max_steps", "4"),
            "--overwrite_output_dir", "true"]
    before = snapshot(root / "out")
    failed = run([sys.executable, RECIPE, *args, "--warmup_steps", "4"], expect_rc=2)
    kept = snapshot(root / "out") == before
    run([sys.executable, RECIPE, *args])
    return {"root": root, "out": root / "out", "args": args, "failed": failed, "kept": kept}


def test_overwrite_output_dir_removes_the_earlier_run(dropout_run):
    out = dropout_run["out"]
    # A run that fails on its data or schedule removes nothing.
    assert "warmup_steps 4 covers the whole run" in dropout_run["failed"].stderr and dropout_run["kept"]
    # The reference's checkpoint-6, its final/, samples and the .tmp/.old leftovers are gone; its wandb folder and
    # the user's checkpoint-best/ and notes (not written by a run) stay.
    assert sorted(p.name for p in out.iterdir()) == [".run.lock", "checkpoint-2", "checkpoint-4",
                                                     "checkpoint-best", "checkpoint-notes.txt", "final", "latest",
                                                     "metrics.jsonl", "wandb"]
    assert (out / "latest").read_text() == "checkpoint-4"
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert validate_checkpoint(str(out / "checkpoint-4"))["world_size"] == 1
    assert json.loads((out / "final" / "config.json").read_text())["attention_dropout"] == 0.5


def test_an_overwrite_killed_half_way_leaves_no_partial_checkpoint_or_latest(tiny, reference, tmp_path,
                                                                              one_process_group):
    """overwrite_output_dir's removal of the earlier run, killed half-way through a checkpoint: `latest` named that
    partly removed folder, and auto stopped on a file missing from it as from a damaged save."""
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns(".run.lock"))
    # Rank 0 is killed in the removal of the second checkpoint, checkpoint-6 (the one `latest` names).
    torchrun("tests/drivers/ckpt_kill.py", "in_removal", 2, *recipe_args(tiny, out), "--overwrite_output_dir",
             "true", expect_rc=1)
    assert sorted(p.name for p in out.iterdir()) == [".run.lock", "checkpoint-6.old", "final", "metrics.jsonl",
                                                     "wandb"]
    assert not (out / "checkpoint-6.old" / "model").exists()
    with pytest.raises(ConfigError) as error:
        prepare_output_dir(config(out, "--resume_from_checkpoint", "auto"))
    assert str(error.value).startswith(f"resume_from_checkpoint auto: {out} has no `latest` file naming a checkpoint "
                                       f"to resume, but holds final of an earlier run")
    # The same command again finishes the removal.
    remove_earlier_run(config(out, "--overwrite_output_dir", "true"))
    assert sorted(p.name for p in out.iterdir()) == [".run.lock", "wandb"]


def test_an_overwrite_stopped_in_a_removal_leaves_no_latest_nor_a_partial_checkpoint(tmp_path, monkeypatch,
                                                                                     one_process_group):
    """remove_earlier_run stopped (as by a kill) half-way through removing a folder, twice: `latest` is gone first,
    the folder stopped in is under a name no resume takes (its .old form; a .tmp one stays as it is, for the next
    overwrite to remove), the others are whole; the same overwrite again removes the rest, with the .old folder an
    earlier stop left beside its checkpoint."""
    out = tmp_path / "run"
    for name in ["checkpoint-4", "checkpoint-6", "checkpoint-6.old", "checkpoint-8.tmp", "final"]:
        (out / name / "model").mkdir(parents=True)
        (out / name / "model" / "shard").write_text("weights")
    (out / "latest").write_text("checkpoint-6")
    for name in ["metrics.jsonl", "samples.jsonl.tmp"]:
        (out / name).write_text("{}\n")
    (out / "wandb").mkdir()

    class Killed(BaseException):
        pass

    rmtree, stops = shutil.rmtree, [out / "checkpoint-4.old", out / "checkpoint-8.tmp"]

    def killed_half_way(path, *args, **kwargs):
        if stops and Path(path) == stops[0]:
            stops.pop(0)
            rmtree(os.path.join(path, "model"))
            raise Killed
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_half_way)
    cfg = config(out, "--overwrite_output_dir", "true")
    with pytest.raises(Killed):
        remove_earlier_run(cfg)
    assert sorted(os.listdir(out)) == ["checkpoint-4.old", "checkpoint-6", "checkpoint-6.old", "checkpoint-8.tmp",
                                       "final", "metrics.jsonl", "samples.jsonl.tmp", "wandb"]
    assert os.listdir(out / "checkpoint-6" / "model") == ["shard"]
    with pytest.raises(Killed):
        remove_earlier_run(cfg)
    assert sorted(os.listdir(out)) == ["checkpoint-8.tmp", "final", "metrics.jsonl", "samples.jsonl.tmp", "wandb"]
    assert os.listdir(out / "final" / "model") == ["shard"]
    remove_earlier_run(cfg)
    assert sorted(os.listdir(out)) == ["wandb"]


def test_overwrite_output_dir_keeps_the_earlier_run_when_the_checkpoint_is_refused(tiny, reference, tmp_path):
    # Resuming another run's last checkpoint (without its final/) into an output_dir to overwrite: a refused
    # checkpoint removes nothing; an accepted one finishes its run there, whose final/ the earlier run's does not hide.
    shutil.copytree(reference, tmp_path / "out")
    shutil.copytree(reference / "checkpoint-6", tmp_path / "alone" / "checkpoint-6")
    args = recipe_args(tiny, tmp_path / "out", "--gradient_accumulation_steps", "4", "--overwrite_output_dir", "true",
                       "--resume_from_checkpoint", tmp_path / "alone" / "checkpoint-6")
    before = snapshot(tmp_path / "out")
    proc = run([sys.executable, RECIPE, *args, "--learning_rate", "2e-2"], expect_rc=2)
    assert "another training config (learning_rate: checkpoint 0.01, now 0.02)" in proc.stderr
    assert snapshot(tmp_path / "out") == before
    run([sys.executable, RECIPE, *args])
    assert sorted(os.listdir(tmp_path / "out")) == [".run.lock", "final", "metrics.jsonl", "wandb"]
    assert_same_weights(final_weights(tmp_path / "out"), final_weights(reference))


def test_a_copied_recipe_without_remove_earlier_run_stops_before_training(tiny, tmp_path):
    # A recipe copied before remove_earlier_run existed: the earlier run's checkpoints would mix with the new ones.
    source = (Path(REPO) / RECIPE).read_text()
    call = "        remove_earlier_run(cfg)"
    assert source.count(call) == 1
    stale = tmp_path / "stale_sft.py"
    stale.write_text("\n".join(line for line in source.splitlines() if not line.startswith(call)))
    fake_checkpoint(tmp_path / "out" / "checkpoint-8")
    proc = run([sys.executable, stale, *recipe_args(tiny, tmp_path / "out", "--overwrite_output_dir", "true")],
               expect_rc=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: overwrite_output_dir true, but {tmp_path / 'out'} still holds checkpoint-8 of the earlier run: the "
        f"recipe must call remove_earlier_run(cfg) (fsdp_recipes.output_dir) after resolve_resume, as "
        f"recipes/llama_sft.py does; `python -m fsdp_recipes.new_recipe --sync --recipes_dir {tmp_path}` updates the "
        f"recipes there")
    assert sorted(os.listdir(tmp_path / "out")) == [".run.lock", "checkpoint-8"]
    run([sys.executable, "-m", "fsdp_recipes.new_recipe", "--sync", "--recipes_dir", tmp_path])  # as the error says
    assert call in stale.read_text()


def test_resume_with_dropout_gives_bit_equal_losses(dropout_run, tmp_path):
    # The RNG states come back with the checkpoint, and nothing draws from them before the first resumed step.
    args = [*dropout_run["args"][:-2], "--output_dir", tmp_path, "--resume_from_checkpoint",
            dropout_run["out"] / "checkpoint-2"]
    run([sys.executable, RECIPE, *args])
    uninterrupted = losses(dropout_run["out"])
    assert losses(tmp_path) == {3: uninterrupted[3], 4: uninterrupted[4]}
    assert_same_weights(final_weights(tmp_path), final_weights(dropout_run["out"]))


def test_resume_into_a_longer_run_follows_its_schedule(dropout_run, reference, tmp_path):
    # From the end of the 4-step run (cosine: LR 0 next) to 6 steps: steps 5 and 6 train with the LRs of the
    # uninterrupted 6-step run, not with the 4-step schedule's.
    resumed = run([sys.executable, RECIPE, *dropout_run["args"][:-2], "--max_steps", "6", "--output_dir", tmp_path,
                   "--resume_from_checkpoint", dropout_run["out"] / "checkpoint-4"])
    assert "the LR schedule (and a warm-up given as a fraction of the run) follows the new total from step 4" in (
        resumed.stdout)
    learning_rates = {m["step"]: m["learning_rate"] for m in read_metrics(tmp_path / "metrics.jsonl")}
    uninterrupted = {m["step"]: m["learning_rate"] for m in read_metrics(reference / "metrics.jsonl")}
    assert learning_rates == {step: uninterrupted[step] for step in (5, 6)}
    assert learning_rates == {step: scheduled_lr(step - 1, total_steps=6) for step in (5, 6)}
    assert learning_rates[5] > 0


def test_weights_load_memory_per_rank_and_engine(tmp_path):
    """README, "Checkpoints and resume": the memory a resume's weight loading takes on each rank (anonymous memory
    above that before the load; 129 MiB fp32 model, largest tensor 16 MiB)."""
    torchrun("tests/drivers/ckpt_full_load_memory.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    model_mb = ranks[0]["model_mb"]
    for key in ["fsdp1 full", "fsdp1 sharded", "fsdp2 full", "fsdp2 sharded"]:
        assert all(r[key]["equal"] for r in ranks), key  # every weight came back
    # FSDP2: about one tensor at a time, in either format.
    assert max(r[key]["extra_mb"] for r in ranks for key in ["fsdp2 full", "fsdp2 sharded"]) < 0.25 * model_mb
    # FSDP1: torch's FSDP1 state-dict load holds more than the whole model on rank 1 from a full checkpoint (1.48x
    # with torch 2.13), and most of it on every rank from a sharded one (1.27x).
    assert max(r["fsdp1 full"]["extra_mb"] for r in ranks) > model_mb
    assert min(r["fsdp1 sharded"]["extra_mb"] for r in ranks) > 0.75 * model_mb


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of each process torchrun started, from /proc."""
    pids = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    ranks = {}
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        [rank] = [entry.split(b"=", 1)[1] for entry in environ if entry.startswith(b"RANK=")]
        ranks[int(rank)] = int(pid)
    return ranks


def descendants(pid: int) -> list[int]:
    children = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [d for child in children for d in [child, *descendants(child)]]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def sigterm_after_first_log(args: list, ranks: tuple[int, ...], launcher_too: bool, output_dir: Path,
                            launch: list = TORCHRUN) -> tuple[int, str]:
    """Run the recipe on 2 processes under `launch` (torchrun) and send SIGTERM to `ranks`, or with launcher_too to
    every process of the run (the launcher forwards its own to each rank), once step 1 is in metrics.jsonl; return the
    launcher's exit code and output."""
    logs = output_dir.parent / f"{output_dir.name}.log"
    with open(logs, "w") as log, subprocess.Popen(
            [*launch, RECIPE, *map(str, args)], cwd=REPO, env=subprocess_env(), stdout=log,
            stderr=subprocess.STDOUT) as launcher:
        metrics = output_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text()) and launcher.poll() is None:
            time.sleep(0.05)
        pids = worker_pids(launcher)
        # As SLURM signals the processes of a job step (in the order of their ids): torchrun's SIGTERM to each rank
        # comes a moment after SLURM's own, and the ranks' DataLoader workers get one too.
        for pid in [launcher.pid, *descendants(launcher.pid)] if launcher_too else [pids[rank] for rank in ranks]:
            os.kill(pid, signal.SIGTERM)
        launcher.wait(timeout=300)
    return launcher.returncode, logs.read_text()


@pytest.mark.parametrize("ranks, launcher_too", [((1,), False), ((0, 1), True)],
                         ids=["rank_1", "as_slurm_every_process"])
def test_sigterm_stops_every_rank_after_a_saved_step_that_resumes_exactly(tiny, reference, tmp_path, ranks,
                                                                          launcher_too):
    """SLURM signals every process of the job at once: torchrun, which forwards its own SIGTERM to each rank, and the
    ranks' DataLoader workers too."""
    # No checkpoint before the last step but the one the SIGTERM asks for. Rank 1 alone gets steps to spare, so that
    # rank 0 stopping only at the run's end (any_rank_received_sigterm) cannot pass for the stop after the next step.
    steps = 6 if launcher_too else 100
    args = recipe_args(tiny, tmp_path, "--save_steps", "100", "--max_steps", steps, "--resume_from_checkpoint", "auto",
                       "--dataloader_num_workers", int(launcher_too))
    code, output = sigterm_after_first_log(args, ranks, launcher_too, tmp_path)
    assert code == 1, output  # torchrun's code for any failed rank, and for a SIGTERM of its own
    if launcher_too:
        assert "Received 15 death signal, shutting down workers" in output
    else:  # torchrun names each rank's code
        assert sorted(re.findall(r"rank +: ([01]) \(local_rank: [01]\)\n +exitcode +: ([0-9]+)", output)) == [
            ("0", "143"), ("1", "143")], output
    [message] = [line for line in output.splitlines() if line.startswith("stopped by SIGTERM")]
    step = int(re.fullmatch(f"stopped by SIGTERM after step ([0-9]+): saved {tmp_path}/checkpoint-\\1; resume with "
                            f"--resume_from_checkpoint auto", message)[1])
    assert 1 < step < steps or step == steps == 6  # a signal in the last step stops after it
    assert output.count("Traceback") == 1, output  # torchrun's, not the ranks'
    # Both ranks wrote the checkpoint of that step: the one that got no SIGTERM stopped at the same step.
    assert (tmp_path / "latest").read_text() == f"checkpoint-{step}" and not (tmp_path / "final").exists()
    assert validate_checkpoint(str(tmp_path / f"checkpoint-{step}"))["step"] == step
    assert max(losses(tmp_path)) == step
    if not launcher_too:
        return  # the checkpoint is the same kind as below; one resume is enough for the suite's time

    resumed = torchrun(RECIPE, *args)
    assert f"resumed from {tmp_path / f'checkpoint-{step}'} at step {step}" in resumed.stdout
    assert losses(tmp_path) == losses(reference)
    assert_same_weights(final_weights(tmp_path), final_weights(reference))


def test_a_sigterm_stop_lets_rank_0_finish_its_wandb_run_before_any_rank_exits(tiny, tmp_path):
    """A rank's exit (143) makes its launcher stop the others at once, rank 0 too while it still uploads its W&B run
    (which W&B then marks crashed, its last data lost): every rank waits for rank 0's W&B run to finish."""
    args = recipe_args(tiny, tmp_path / "run", "--save_steps", "100", "--max_steps", "100", "--report_to", "wandb")
    launch = [*TORCHRUN, "tests/drivers/slow_wandb_finish.py"]
    code, output = sigterm_after_first_log(args, (1,), False, tmp_path / "run", launch)
    assert sorted(re.findall(r"rank +: ([01]) \(local_rank: [01]\)\n +exitcode +: ([0-9]+)", output)) == [
        ("0", "143"), ("1", "143")], output
    assert (tmp_path / "run" / "wandb_finished").read_text() == "143", output


def test_accelerate_launch_given_a_sigterm_exits_with_the_code_the_readme_gives(tiny, tmp_path):
    """accelerate 1.16 exits 128 + SIGTERM where torchrun exits 1; the README gave 1 for every launcher."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp2_cpu.yaml",
              "--main_process_port", "0"]
    args = recipe_args(tiny, tmp_path, "--save_steps", "100", "--max_steps", 100)
    code, output = sigterm_after_first_log(args, (0, 1), True, tmp_path, launch)
    assert "Received 15 death signal, shutting down workers" in output
    [step] = re.findall(f"stopped by SIGTERM after step ([0-9]+): saved {tmp_path}/checkpoint-\\1;", output)
    assert (tmp_path / "latest").read_text() == f"checkpoint-{step}"
    readme = (REPO / "README.md").read_text().replace("\n", " ")
    # accelerate 1.16 exits 128 + the signal itself; before it, its launcher exits as torchrun does (the floor, 1.10).
    readme_codes = dict(re.findall(r"`accelerate launch` \((1\.16|before 1\.16)\) exits ([0-9]+)", readme))
    version = "1.16" if Version(accelerate.__version__) >= Version("1.16") else "before 1.16"
    assert str(code) == readme_codes[version] == {"1.16": "143", "before 1.16": "1"}[version], output


def test_a_sigterm_stops_a_one_process_run_with_its_line_and_exit_code_143(tiny, tmp_path):
    """Without a launcher the recipe's exit code is the job's: 128 + SIGTERM, which SLURM requeue scripts test for,
    after the line that says what was saved."""
    args = recipe_args(tiny, tmp_path / "run", "--save_steps", "100", "--max_steps", "100")  # steps to spare
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(tmp_path / "stderr", "w+") as stderr, subprocess.Popen(
            [sys.executable, RECIPE, *map(str, args)], cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
            stderr=stderr) as proc:
        while not (metrics.exists() and metrics.read_text()) and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        stderr.seek(0)
        lines = stderr.read().strip().splitlines()
    assert proc.returncode == 143, lines
    step = max(losses(tmp_path / "run"))
    assert 1 < step < 100
    assert lines[-1:] == [f"stopped by SIGTERM after step {step}: saved {tmp_path}/run/checkpoint-{step}; resume with "
                          f"--resume_from_checkpoint auto"]


@pytest.mark.parametrize("in_step, save_steps, message", ids=["mid_run_without_checkpoints", "last_step"], argvalues=[
    (2, 0, "stopped by SIGTERM after step 3: nothing saved, as this run saves no checkpoints (--save_steps 0; set it "
           "to make a stopped run resumable)"),
    (6, 100, "stopped by SIGTERM after step 6: saved {out}/checkpoint-6; resume with --resume_from_checkpoint auto"),
])
def test_a_sigterm_in_a_step_stops_the_run_after_the_next(tiny, tmp_path, one_process_group, monkeypatch, in_step,
                                                           save_steps, message):
    """A SIGTERM during step k's compute is read at the start of step k + 1, which is trained, logged and saved;
    one during the last step stops the run after it, without final/."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path, "--save_steps", save_steps,
                                                        "--logging_steps", "5")])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    tokenizer = load_tokenizer(cfg)
    train_data, _ = build_datasets(cfg, tokenizer)
    model = shard_model(load_model(cfg), resolve_plan(cfg))
    forward_backward = trainer.forward_backward
    steps = []

    def sigterm_in_step(*args, **kwargs):
        steps.append(len(steps) + 1)
        if len(steps) == in_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward_backward(*args, **kwargs)

    def earlier_handler(signum, frame):  # the handler train() must put back
        pass

    monkeypatch.setattr(trainer, "forward_backward", sigterm_in_step)
    previous = signal.signal(signal.SIGTERM, earlier_handler)
    try:
        with pytest.raises(trainer.StoppedBySigterm) as stop:
            train(cfg, env, model, tokenizer, train_data, MetricsLogger(cfg, is_main=True))
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert str(stop.value) == message.format(out=tmp_path)
    assert restored is earlier_handler
    assert steps == list(range(1, min(in_step + 1, 6) + 1))
    # The last step trained is logged (logging_steps 5 would skip step 3) and, with save_steps, saved.
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == ([5, 6] if in_step == 6 else [3])
    assert sorted(os.listdir(tmp_path)) == (["checkpoint-6", "latest", "metrics.jsonl"] if save_steps
                                            else ["metrics.jsonl"])


def sigterm_in_the_next_step(monkeypatch) -> None:
    """A SIGTERM to this process in the next training step's forward-backward (its first micro-batch), once."""
    forward_backward = trainer.forward_backward

    def sigterm_then_step(*args, **kwargs):
        monkeypatch.setattr(trainer, "forward_backward", forward_backward)
        os.kill(os.getpid(), signal.SIGTERM)
        return forward_backward(*args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward", sigterm_then_step)


def test_a_resumed_run_without_checkpoints_stopped_by_sigterm_says_nothing_was_saved(tiny, tmp_path,
                                                                                     one_process_group, monkeypatch):
    """Resumed from checkpoint-2 with --save_steps 0, stopped after step 4: the checkpoint resumed from does not hold
    steps 3 and 4, so the message must not name it as saved."""
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    def run_train(*extra, resume_from=None):
        cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path, *extra)])
        tokenizer = load_tokenizer(cfg)
        train(cfg, env, shard_model(load_model(cfg), resolve_plan(cfg)), tokenizer, build_datasets(cfg, tokenizer)[0],
              MetricsLogger(cfg, is_main=True), resume_from)

    run_train("--max_steps", "2")
    sigterm_in_the_next_step(monkeypatch)  # step 3
    with pytest.raises(trainer.StoppedBySigterm) as stop:
        run_train("--save_steps", "0", resume_from=str(tmp_path / "checkpoint-2"))
    assert str(stop.value) == ("stopped by SIGTERM after step 4: nothing saved, as this run saves no checkpoints "
                               "(--save_steps 0; set it to make a stopped run resumable)")


def test_a_step_stopped_by_sigterm_leaves_its_evaluation_to_the_resume(tiny, tmp_path, one_process_group, monkeypatch):
    """A SIGTERM in step 1 stops the run after step 2, an evaluation step: step 2 is saved but not evaluated (the
    evaluation would eat into the time left before the kill), and the resume evaluates it before step 3."""
    cfg = parse_config([str(arg) for arg in recipe_args(tiny, tmp_path, "--max_steps", "3", "--eval_fraction", "0.07",
                                                        "--eval_steps", "2", "--logging_steps", "1")])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    tokenizer = load_tokenizer(cfg)
    train_data, eval_data = build_datasets(cfg, tokenizer)
    sigterm_in_the_next_step(monkeypatch)  # step 1
    with pytest.raises(trainer.StoppedBySigterm, match="^stopped by SIGTERM after step 2: saved .*checkpoint-2;"):
        train(cfg, env, shard_model(load_model(cfg), resolve_plan(cfg)), tokenizer, train_data,
              MetricsLogger(cfg, is_main=True), None, eval_data)
    assert [(m["step"], "eval/loss" in m) for m in read_metrics(tmp_path / "metrics.jsonl")] == [(1, False), (2, False)]
    train(cfg, env, shard_model(load_model(cfg), resolve_plan(cfg)), tokenizer, train_data,
          MetricsLogger(cfg, is_main=True), str(tmp_path / "checkpoint-2"), eval_data)
    assert [(m["step"], "eval/loss" in m) for m in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, False), (2, False), (2, True), (3, False), (3, True)]


@pytest.mark.parametrize("save_steps", [0, 6])
def test_a_sigterm_in_the_final_evaluation_of_a_resume_at_the_last_step_names_its_checkpoint(
        tiny, tmp_path, one_process_group, monkeypatch, save_steps):
    """A checkpoint of a run's last step without its final/ (the run failed in its export), resumed into another
    output_dir, where `auto` finds no checkpoint and would train from step 0: a SIGTERM in the final evaluation
    stops the run before anything is trained, and the message names the checkpoint to resume from."""
    earlier, out = tmp_path / "earlier", tmp_path / "out"
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    def run_train(output_dir, *extra, resume_from=None):
        cfg = parse_config([str(arg) for arg in recipe_args(tiny, output_dir, "--eval_fraction", "0.07", *extra)])
        tokenizer = load_tokenizer(cfg)
        train_data, eval_data = build_datasets(cfg, tokenizer)
        model = shard_model(load_model(cfg), resolve_plan(cfg))
        train(cfg, env, model, tokenizer, train_data, MetricsLogger(cfg, is_main=True), resume_from, eval_data)

    run_train(earlier, "--save_steps", 6)
    checkpoint = str(earlier / "checkpoint-6")
    evaluate = trainer.evaluate

    def sigterm_in_evaluation(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate", sigterm_in_evaluation)
    with pytest.raises(trainer.StoppedBySigterm) as stop:
        run_train(out, "--save_steps", save_steps, resume_from=checkpoint)
    assert str(stop.value) == (f"stopped by SIGTERM after step 6, before the run's end: nothing trained, so nothing "
                               f"saved; resume with --resume_from_checkpoint {checkpoint}")
    assert latest_checkpoint(str(out)) is None  # where `auto` would have started the run again from step 0


def test_a_repeated_sigterm_is_the_same_stop_and_a_later_one_ends_the_process():
    """SLURM's SIGTERM reaches a rank, and the launcher's forwarded one a moment later: the run must go on to its
    save. A SIGTERM after that (here 0.5 s; 5 s in runs) ends the process, as without the handler."""
    script = ("import os, signal, time\n"
              "from fsdp_recipes.distributed import SigtermNote, sigterm_noted\n"
              "SigtermNote.SAME_STOP_S = 0.5\n"
              "with sigterm_noted() as note:\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(0.1)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    print('noted', note.received, flush=True)\n"
              "    time.sleep(1)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    print('not ended', flush=True)\n")
    proc = run([sys.executable, "-c", script], expect_rc=-signal.SIGTERM)
    assert proc.stdout == "noted True\n"
