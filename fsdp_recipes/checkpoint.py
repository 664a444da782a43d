"""Training checkpoints: save, validate, load, `latest` and retention (resume.py decides whether a run resumes from
one, output_dir.py keeps runs apart).

A checkpoint is a folder `<output_dir>/checkpoint-<step>`:
- `model/`: the model, with `torch.distributed.checkpoint` (each rank writes its shards) when the format is
  "sharded"; in the "full" format the folder itself holds the fp32 weights as HF safetensors, written by rank 0.
- `optimizer/`: the optimizer state (DCP, each rank its shards; DCP reloads it into any world size).
- `rng/rank_<r>.pt`: the RNG states of every rank (tensors and numbers, read with weights_only=True).
- `trainer_state.json`: step, epoch, LR scheduler, world size, format, the master weights' dtype, whether the
  source's weights were in transformers' own layout (export.loaded_in_model_layout), W&B run (id, project,
  entity), the resolved config and the training data's identity (rows and a hash of its tokens).
- `config.json`, `generation_config.json`, tokenizer files (named chat templates in `additional_chat_templates/`),
  the source's processor files: what the converter needs to write an HF folder.

A save is written to `checkpoint-<step>.tmp` and renamed by rank 0 once every rank has finished; `latest` (a text
file naming the newest checkpoint) is replaced after the rename. A kill at any moment leaves the previous
checkpoint complete and `latest` pointing at it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from typing import Callable, Optional

import numpy as np
import pyarrow.compute as pc
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from .config import ConfigError, TrainConfig, looked_in
from .distributed import long_wait_group, print_rank0, ranks, run_on_rank0
from .export import (DISK_FULL, INDEX_NAME, fsync, gather_full_state_dict, loaded_in_model_layout, replace_dir,
                     space_left, tied_parameter_names, write_gathered_weights, write_model_files)
from .metrics import library_versions
from .plan import STATE_DICT_TYPES, TRUE, env_enum
from .progress import print_line
from .sharding import buffers_beside_parameters, compute_device, state_dict_name

STATE_NAME = "trainer_state.json"
LATEST_NAME = "latest"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# What a save writes: the checkpoint, and while it is written or replaced its .tmp and .old folders. Only these are
# removed (retention, overwrite_output_dir): a user's own checkpoint-best/ stays.
SAVE_RE = re.compile(r"^checkpoint-\d+(\.tmp|\.old)?$")


def __getattr__(name: str):
    """A recipe copied before output_dir.py and resume.py were split from this module imports these from here: its
    ImportError says where they went and how to update the copy."""
    moved = {"prepare_output_dir": "output_dir", "remove_earlier_run": "output_dir", "resolve_resume": "resume"}
    if name in moved:
        raise ImportError(f"{name} is in fsdp_recipes.{moved[name]}, no longer in fsdp_recipes.checkpoint: a recipe "
                          f"copied before 2026-12-06 imports it from there; `python -m fsdp_recipes.new_recipe --sync "
                          f"--recipes_dir <the recipe's folder>` updates its shared part")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message names the problem and the path."""


# --- Reading DCP metadata without unpickling arbitrary objects --------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: allow only the classes DCP metadata is made of."""

    def find_class(self, module, name):
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module, name) in {("torch", "Size"), ("torch.serialization", "_get_layout"),
                                  ("collections", "OrderedDict"), ("pathlib", "PosixPath")}
            or (module == "torch" and isinstance(getattr(torch, name, None),
                                                 (torch.dtype, torch.layout, torch.memory_format)))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read with an allow-list unpickler (tensors are already weights_only)."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_dcp_metadata(path: str):
    """The metadata of the DCP folder `path`, after checking that every file it refers to is complete."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is incomplete: its .metadata file is missing")
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except Exception as error:  # a truncated pickle raises EOFError, UnpicklingError, ...
        raise CheckpointError(f"{path}/.metadata cannot be read ({type(error).__name__}: {error})") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{path} is incomplete: {name} is missing (a rank did not finish writing)")
        if os.path.getsize(file) < size:
            raise CheckpointError(f"{file} is truncated: {os.path.getsize(file)} bytes, expected at least {size}")
    return metadata


# --- Format, paths ----------------------------------------------------------------------------------------------

def resolve_state_dict_type(cfg: TrainConfig) -> str:
    """save_state_dict_type, else the accelerate config's fsdp_state_dict_type, else sharded."""
    if cfg.save_state_dict_type:
        return cfg.save_state_dict_type
    if os.environ.get("ACCELERATE_USE_FSDP", "").strip().lower() not in TRUE:
        return "sharded"
    accelerate_type = env_enum("FSDP_STATE_DICT_TYPE", STATE_DICT_TYPES) or "SHARDED_STATE_DICT"
    formats = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}
    if accelerate_type not in formats:
        raise ConfigError(f"fsdp_state_dict_type {accelerate_type} is not supported: use FULL_STATE_DICT or "
                          f"SHARDED_STATE_DICT")
    return formats[accelerate_type]


def checkpoint_steps(output_dir: str) -> list[int]:
    """Steps of the complete checkpoints in `output_dir` (renamed from .tmp), oldest first."""
    if not os.path.isdir(output_dir):
        return []
    matches = (_CHECKPOINT_RE.match(name) for name in os.listdir(output_dir))
    return sorted(int(m.group(1)) for m in matches if m)


def previous_run(output_dir: str) -> list[str]:
    """The checkpoint-<step> folders, `latest` and final/ of an earlier run in `output_dir`."""
    found = [f"checkpoint-{step}" for step in checkpoint_steps(output_dir)]
    return found + [name for name in (LATEST_NAME, "final") if os.path.exists(os.path.join(output_dir, name))]


def check_checkpoint_folder(path: str, resuming: bool = False, output_dir: Optional[str] = None) -> None:
    """A CheckpointError unless `path` is a checkpoint-<step> folder, saying what it is instead; `resuming` adds the
    advice to resume with `auto`, and `output_dir` the checkpoint a relative path names there."""
    def auto(output_dir: str) -> str:
        return (f", or --output_dir {output_dir} --resume_from_checkpoint auto to resume from the one its `latest` "
                f"file names" if resuming else "")

    if path.rstrip("/").endswith(".tmp"):
        raise CheckpointError(f"{path} is an unfinished save (a .tmp folder): pass a checkpoint-<step> folder")
    if path.rstrip("/").endswith(".old"):  # replace_dir's, or retention's, partly removed perhaps
        raise CheckpointError(f"{path} is a checkpoint being replaced or removed (an .old folder): pass a "
                              f"checkpoint-<step> folder")
    if os.path.isfile(os.path.join(path, STATE_NAME)):
        return
    if os.path.basename(os.path.normpath(path)) == LATEST_NAME and os.path.isfile(path):  # a run's `latest` file
        with open(path) as f:
            named = os.path.join(os.path.dirname(path), f.read().strip())
        raise CheckpointError(f"{path} is the file that names a run's newest checkpoint, not a checkpoint: pass "
                              f"{named}{auto(os.path.dirname(path) or '.')}")
    # `latest`: the word other trainers take for it; `Auto`, `AUTO`: the keyword in another case, read as a path.
    if path.lower() in (LATEST_NAME, "auto") and resuming and not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist: pass --resume_from_checkpoint auto to resume from the "
                              f"checkpoint that output_dir's `latest` file names, or a checkpoint-<step> folder")
    if not os.path.exists(path):  # a mistyped step, or one retention has removed: say which are there
        parent = os.path.dirname(os.path.abspath(path))
        held = ", ".join(f"checkpoint-{step}" for step in checkpoint_steps(parent))
        # A relative path is read from the working directory, not from output_dir as `latest` is (checkpoint-6); an
        # absolute one may name output_dir's checkpoint where it was before the folder was moved or renamed.
        name = path if not os.path.isabs(path) else os.path.basename(os.path.normpath(path))
        beside = os.path.join(output_dir, name) if output_dir else ""
        mean = f", such as {beside}" if beside and os.path.isdir(beside) else ""
        raise CheckpointError(f"{path} does not exist{looked_in(path)}{f' ({parent} holds {held})' if held else ''}: "
                              f"pass a checkpoint-<step> folder{mean}")
    if os.path.isdir(path) and (os.path.isfile(os.path.join(path, LATEST_NAME)) or checkpoint_steps(path)):
        held = ", ".join(f"checkpoint-{step}" for step in checkpoint_steps(path)) or "no checkpoint"
        raise CheckpointError(f"{path} is a run's output_dir, not a checkpoint (it holds {held}): pass one of its "
                              f"checkpoint-<step> folders{auto(path)}")
    if os.path.isfile(os.path.join(path, "config.json")):  # final/ or a converted folder: the weights alone
        raise CheckpointError(model_folder_advice(path, resuming))
    raise CheckpointError(f"{path} is not a checkpoint: it has no {STATE_NAME} "
                          f"(expected a checkpoint-<step> folder written by this project)")


def model_folder_advice(path: str, resuming: bool) -> str:
    """What to do with a Hugging Face model folder (a run's final/, a converted checkpoint) given as a checkpoint. A
    run that saved no checkpoint (save_steps 0) leaves only final/, the natural guess for a resume."""
    what = (f"{path} is a Hugging Face model folder (such as a run's final/), not a checkpoint: it holds the weights "
            f"without the optimizer state and data position of a run")
    if not resuming:
        return f"{what}, and from_pretrained loads it as it is"
    parent = os.path.dirname(os.path.abspath(path))
    steps = checkpoint_steps(parent)
    resume = (f"to continue its run, pass one of the checkpoints of {parent} ("
              f"{', '.join(f'checkpoint-{step}' for step in steps)}) or --output_dir {parent} --resume_from_checkpoint "
              f"auto; " if steps else "")
    # The run's own output_dir refuses a fresh run (prepare_output_dir), and overwrite_output_dir would remove path.
    elsewhere = f" and an output_dir other than {parent}" if previous_run(parent) else ""
    return (f"{what}: {resume}to train these weights further, start a fresh run (without resume_from_checkpoint) "
            f"with --model_name_or_path {path}{elsewhere}")


def train_weights_further(path: str) -> str:
    """The way on for a checkpoint a run cannot resume: its weights, converted, start a fresh run."""
    return (f"convert its weights (`python -m fsdp_recipes.convert {path} <out_dir>`) to train them further in a "
            f"fresh run with --model_name_or_path <out_dir>")


def validate_checkpoint(path: str, parts: tuple[str, ...] = ("optimizer", "rng")) -> dict:
    """The trainer state of the checkpoint at `path`; a CheckpointError that names the problem if it is unusable.
    Checks the model, config.json and `parts` (the converter reads neither the optimizer state nor the RNG states)."""
    check_checkpoint_folder(path)
    # The trainer state, config.json, the weight index and the tokenizer's files: json's own error names no file.
    json_files = {name: _read_json(os.path.join(path, name)) for name in sorted(os.listdir(path))
                  if name.endswith(".json")}
    state = json_files[STATE_NAME]
    if state.get("format") == "sharded":
        read_dcp_metadata(os.path.join(path, "model"))
    else:
        for file in safetensors_files(path):
            try:
                with safe_open(file, "pt") as f:
                    f.keys()
            except Exception as error:
                raise CheckpointError(f"{file} is corrupt or truncated: {error}") from None
    # A copy kept for the converter, which reads neither, may lack these folders whole (removed to save space).
    absent = [name for name in parts if not os.path.isdir(os.path.join(path, name))]
    if absent:
        raise CheckpointError(f"{path} has no {' or '.join(f'{name}/' for name in absent)} folder, which a resume "
                              f"needs: resume from a complete checkpoint, or {train_weights_further(path)}")
    if "optimizer" in parts:
        read_dcp_metadata(os.path.join(path, "optimizer"))
    for name in ["config.json", *state.get("model_files", [])]:  # the list: since 2026-12 (older ones lack it)
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
    for rank in range(state["world_size"] if "rng" in parts else 0):
        rng_file = os.path.join(path, "rng", f"rank_{rank}.pt")
        if not os.path.isfile(rng_file):
            raise CheckpointError(f"{path} is incomplete: rng/rank_{rank}.pt is missing")
        try:  # a few KB each: read now, so that a bad one stops the resume before anything else happens
            torch.load(rng_file, weights_only=True)
        except Exception as error:
            raise CheckpointError(f"{rng_file} is corrupt or truncated ({type(error).__name__}: {error})") from None
    return state


def _read_json(file: str):
    try:
        with open(file) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file} is corrupt or truncated: {error}") from None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        names = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise CheckpointError(f"{path} is incomplete: {', '.join(missing)} missing")
    return [os.path.join(path, n) for n in names]


def latest_checkpoint(output_dir: str) -> Optional[str]:
    """The checkpoint `<output_dir>/latest` names, as rank 0 reads it (None: no `latest`), so that every rank resumes
    from the same one. Every rank calls this."""
    found: list[Optional[str]] = [None]
    name = read_latest(output_dir) if dist.get_rank() == 0 else None
    if name:
        found[0] = os.path.join(output_dir, name)
        restore_replaced_checkpoint(found[0])
    elif name == "":  # an empty `latest` (truncated by hand): joined, it would name output_dir itself
        found[0] = ""
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    if not found[0] or not os.path.isdir(found[0]):
        steps = checkpoint_steps(output_dir)
        present = (f"{output_dir} holds {', '.join(f'checkpoint-{step}' for step in steps)}: pass "
                   f"--resume_from_checkpoint {os.path.join(output_dir, f'checkpoint-{steps[-1]}')} (the newest) or "
                   f"another of them" if steps else
                   f"{output_dir} holds no checkpoint: start afresh with --overwrite_output_dir true")
        what = (f"in {output_dir} is empty" if not found[0]
                else f"names {found[0]}, which is a file, not a checkpoint folder" if os.path.exists(found[0])
                else f"names {found[0]}, which does not exist")
        raise CheckpointError(f"resume_from_checkpoint auto: `latest` {what}; {present}")
    return found[0]


def read_latest(output_dir: str) -> Optional[str]:
    """The checkpoint folder name `<output_dir>/latest` holds; None without one."""
    latest = os.path.join(output_dir, LATEST_NAME)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def write_latest(output_dir: str, name: str) -> None:
    """Make `<output_dir>/latest` name the checkpoint folder `name`: written aside and renamed, so that a kill leaves
    the old or the new name, never half of one."""
    latest_tmp = os.path.join(output_dir, LATEST_NAME + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(name)
    fsync(latest_tmp)
    os.replace(latest_tmp, os.path.join(output_dir, LATEST_NAME))
    fsync(output_dir)


def point_latest_at(output_dir: str, checkpoint: str) -> None:
    """A resume from a checkpoint of output_dir other than the one `latest` names (a return to an earlier step)
    makes `latest` name it: a run killed before its first save then resumes with auto where this one started, not
    on the branch it left. Rank 0 writes; a checkpoint elsewhere leaves output_dir's `latest` as it is."""
    checkpoint = os.path.normpath(os.path.abspath(checkpoint))
    if dist.get_rank() != 0 or os.path.realpath(os.path.dirname(checkpoint)) != os.path.realpath(output_dir):
        return
    name, named = os.path.basename(checkpoint), read_latest(output_dir)
    if named != name:
        write_latest(output_dir, name)
        print_line(f"resume: `latest` in {output_dir} now names {name}, where this run starts"
                   + (f" (it named {named})" if named else ""))


def restore_replaced_checkpoint(path: str) -> None:
    """Put back `path` from its .old copy if a save of the same step was killed between replace_dir's two renames.
    Only an output_dir from before point_latest_at holds one: a resume from an older checkpoint then left `latest`
    naming a later step, which the run saved again. The .old copy is whole: replace_dir removes it only once the new
    folder is in place."""
    if not os.path.exists(path) and os.path.isdir(path + ".old"):
        os.replace(path + ".old", path)
        fsync(os.path.dirname(path))
        print_line(f"{path}: restored from {os.path.basename(path)}.old, left by a save killed while replacing it")


def training_data_identity(dataset) -> dict:
    """What a resume compares of the tokenized training data: its rows, and a SHA-256 of its token ids (and of each
    row's length) in the order the data set reads them. Not the datasets fingerprint: that also hashes the data
    files' modification times, so a file copied or touched with the same content would refuse a normal resume.
    Reads the memory-mapped Arrow columns without copying them (0.3 s for 50 million int32 tokens on 2 cores)."""
    lengths, tokens = hashlib.sha256(), hashlib.sha256()
    for chunk in dataset.data.column("input_ids").chunks:  # the stored rows; _indices (if any) maps them
        lengths.update(pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
        tokens.update(np.ascontiguousarray(chunk.flatten().to_numpy()))
    digest = hashlib.sha256(lengths.digest() + tokens.digest())
    if dataset._indices is not None:  # a selection or shuffle of the stored rows (datasets' select, shuffle)
        for chunk in dataset._indices.column("indices").chunks:
            digest.update(np.ascontiguousarray(chunk.to_numpy()))
    return {"rows": len(dataset), "sha256": digest.hexdigest()}


def master_dtype(model: nn.Module) -> str:
    """The dtype of the weights the optimizer updates, such as 'float32' (bfloat16 with pure_bf16)."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


# --- Save -------------------------------------------------------------------------------------------------------

def _rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # A tensor, not an ndarray: the file must load with weights_only=True.
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    # A run that never touched CUDA (`accelerate launch --cpu` on a GPU machine) has no CUDA state to save: asking
    # would start CUDA on GPU 0 in every rank.
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_initialized():  # as saved: not in a CPU run
        torch.cuda.set_rng_state(state["cuda"])


def save_options(model: nn.Module) -> StateDictOptions:
    """For the sharded state dicts a save writes with DCP. FSDP2's are the local tensors of the parameters and of
    the optimizer state themselves. FSDP1, where it shards, copies its part of each parameter and each Adam moment
    on the compute device (torch cannot offload before it chunks), so on a GPU each copy goes to the CPU as it is
    made: otherwise a save would hold another copy of the rank's shard of the weights and two of Adam's on the GPU,
    offload or not. Without sharding (NO_SHARD, or one GPU) torch gives the optimizer's own tensors and clones the
    weights whole before any offload: copying them to the CPU would only cost host memory on every rank."""
    fsdp1_shards = isinstance(model, FSDP) and any(unit.sharding_strategy != ShardingStrategy.NO_SHARD
                                                   for unit in FSDP.fsdp_modules(model))
    return StateDictOptions(cpu_offload=fsdp1_shards and compute_device(model).type != "cpu")


def sharded_model_state_dict(model: nn.Module) -> dict:
    """This rank's shards of the weights, for DCP."""
    return get_model_state_dict(model, options=save_options(model))


# The sharding plan's settings that change how a step is computed (its rounding), not what it trains.
_COMPUTE_PLAN_KEYS = ("fsdp_version", "mixed_precision", "offload_params", "torch_compile", "gradient_sync")


def compute_settings(model: nn.Module) -> dict:
    """How `model` computes a step, beyond the batch layout: its attention kernel and, where shard_model recorded it
    (model.sharding_plan), the engine, mixed precision, optimizer offload, compile and gradient sync. A resume may
    change them (resume.report_other_computation)."""
    unwrapped = model.module if isinstance(model, FSDP) else model
    plan = getattr(model, "sharding_plan", None)
    return {"attn_implementation": unwrapped.config._attn_implementation,
            **({k: getattr(plan, k) for k in _COMPUTE_PLAN_KEYS} if plan is not None else {})}


def save_checkpoint(cfg: TrainConfig, model, optimizer, scheduler, tokenizer, step: int, epoch: int,
                    wandb_run: Optional[dict], train_data: Optional[dict] = None) -> str:
    """Every rank calls this. Returns the path of the finished checkpoint. `wandb_run` is MetricsLogger's
    wandb_run_state (None: not recorded); `train_data` is rank 0's training_data_identity of the run's data (None: not
    recorded, and a resume cannot compare it)."""
    fmt = resolve_state_dict_type(cfg)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    final = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"

    def make_folder():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            os.makedirs(os.path.join(tmp, "rng"))

    def write_own_files():
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        fsync(os.path.join(tmp, "rng", f"rank_{rank}.pt"))  # each rank its own: another client's fsync may not
        if rank == 0:
            write_model_files(model, tokenizer, tmp, torch.float32)
            # The files rank 0 wrote: the model and tokenizer files (named chat templates in a folder of their own),
            # the full format's weights. DCP syncs its own files, and each rank its RNG file. Listed in the state, so
            # that a copy missing one (an interrupted rsync) is refused, not converted without it.
            model_files = [os.path.relpath(file, tmp) for file in files_outside(tmp, ("rng", "model", "optimizer"))]
            state = {"step": step, "epoch": epoch, "world_size": world_size, "format": fmt, "model_files": model_files,
                     "master_dtype": master_dtype(model), "compute": compute_settings(model),
                     "loaded_in_model_layout": loaded_in_model_layout(model),
                     "scheduler": scheduler.state_dict(), **(wandb_run or {}),
                     "config": cfg.to_dict(), "train_data": train_data, "versions": library_versions()}
            with open(os.path.join(tmp, STATE_NAME), "w") as f:
                json.dump(state, f, indent=2)
            for name in [*model_files, STATE_NAME]:
                fsync(os.path.join(tmp, name))

    def finish():
        # On disk before `latest` names the checkpoint and retention removes older ones: a node that crashes right
        # after a save could otherwise leave `latest` naming a folder of empty files.
        if rank == 0:
            for folder, _, _ in os.walk(tmp, topdown=False):
                fsync(folder)  # its entries: the names of the files in it
            replace_dir(tmp, final)

    def make_latest_name_it():
        if rank == 0:
            fsync(cfg.output_dir)  # the rename
            write_latest(cfg.output_dir, os.path.basename(final))
            apply_retention(cfg, step)

    # One part at a time, each ending when every rank has done it, so that a rank that fails alone stops them all.
    # The gathers run outside the guarded parts, on every rank: a rank that failed in the middle of one (out of
    # memory) would go on to the failure check while the others wait in the gather's next collective. DCP reports
    # its own write failures on every rank.
    _write_on_every_rank(make_folder, tmp, cfg)
    if fmt == "sharded":
        write_model = functools.partial(dcp.save, sharded_model_state_dict(model),
                                        checkpoint_id=os.path.join(tmp, "model"))
    else:  # fp32 master weights, so that a resume is exact; final/ is written in save_dtype
        write_model = functools.partial(write_gathered_weights, model, gather_full_state_dict(model), tmp,
                                        torch.float32, cfg.max_shard_size, original_layout=False)
    _write_on_every_rank(write_model, tmp, cfg)
    del write_model  # and with it the model's state dict
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=save_options(model))
    write_optimizer = functools.partial(dcp.save, optimizer_state, checkpoint_id=os.path.join(tmp, "optimizer"))
    del optimizer_state
    _write_on_every_rank(write_optimizer, tmp, cfg)
    del write_optimizer
    _write_on_every_rank(write_own_files, tmp, cfg)
    _write_on_every_rank(finish, tmp, cfg)
    _write_on_every_rank(make_latest_name_it, tmp, cfg, saved=final)
    print_line(f"saved {final} ({fmt})")
    return final


def files_outside(root: str, subfolders: tuple[str, ...]) -> list[str]:
    """The files under `root`, sorted, but for those in its `subfolders`."""
    found = []
    for folder, children, files in os.walk(root):
        if folder == root:
            children[:] = [name for name in children if name not in subfolders]
        found += [os.path.join(folder, name) for name in files]
    return sorted(found)


def _write_on_every_rank(write: Callable[[], None], tmp: str, cfg: TrainConfig, saved: Optional[str] = None) -> None:
    """Run this rank's part of a save; then every rank learns whether any rank failed, and all raise the same
    CheckpointError. A full disk shows up as torch's "unexpected pos" or DCP's CheckpointException, which do not
    say so: the error gives the space left. `saved`: the complete checkpoint, for a part that runs after its rename
    (it is kept, and the error names it)."""
    failure, report = None, None
    try:
        write()
    except (OSError, RuntimeError, CheckpointException) as error:
        failure = error
        if isinstance(error, CheckpointException):  # DCP's, on every rank, with each failed rank's exception
            own = error.failures.get(dist.get_rank())
            error = own[0] if own else None
            if isinstance(error, KeyboardInterrupt):  # DCP wraps a Ctrl-C too: the run stops as it does elsewhere
                raise error from None
        if error is not None:
            # An OSError of another kind (a permission, a read-only file system) needs no room; torch's full disk is
            # a RuntimeError.
            needs_room = not isinstance(error, OSError) or error.errno in DISK_FULL
            report = (f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
                      needs_room)
    reports: list[Optional[tuple[str, bool]]] = [None] * dist.get_world_size()
    # Not on the training group's timeout: in the full format rank 0 alone writes the fp32 weights (282 GB for 70B).
    dist.all_gather_object(reports, report, group=long_wait_group())
    failed = [f"rank {rank}: {report[0]}" for rank, report in enumerate(reports) if report]
    if failed:
        # Every rank has stopped writing: the unfinished save would only hold the room the error asks for (a full
        # disk stays full, and the space it reports leaves out what the save took).
        if dist.get_rank() == 0 and saved is None:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=long_wait_group())  # every rank then reports the same space
        if saved is not None:
            raise CheckpointError(f"the checkpoint {saved} is complete, but making `latest` name it failed "
                                  f"({'; '.join(failed)}), with {space_left(cfg.output_dir)}: "
                                  f"{_save_failure_remedy(reports, cfg)}, then resume with --resume_from_checkpoint "
                                  f"{saved} (`latest` still names the previous checkpoint, if any)") from failure
        raise CheckpointError(f"writing the checkpoint {tmp} failed ({'; '.join(failed)}), with "
                              f"{space_left(cfg.output_dir)} (its unfinished folder removed): "
                              f"{_save_failure_remedy(reports, cfg)}, "
                              f"then resume with --resume_from_checkpoint auto (`latest` still names the previous "
                              f"checkpoint, if any)") from failure


def _save_failure_remedy(reports: list[Optional[tuple[str, bool]]], cfg: TrainConfig) -> str:
    """What to do about a failed save, from every rank's (error, needs room) report, None where the rank's part was
    written: room where any rank ran out of it (in the full format rank 0 alone writes the weights)."""
    if any(report and report[1] for report in reports):
        return f"make room ({_room_advice(cfg)})"
    return "fix what it names (the folder's permissions, a file system mounted read-only)"


def _room_advice(cfg: TrainConfig) -> str:
    """How save_total_limit bears on the room a save needs: retention removes the oldest checkpoint only once the new
    one is complete, so save_total_limit 1 needs room for 2 (there is nothing lower to set)."""
    if not cfg.save_total_limit:
        return "or set --save_total_limit: every checkpoint is kept"
    needs = (f"a save needs room for {cfg.save_total_limit + 1} checkpoints, as the oldest is removed once the new "
             f"one is complete")
    return needs if cfg.save_total_limit == 1 else f"or lower --save_total_limit {cfg.save_total_limit}: {needs}"


def apply_retention(cfg: TrainConfig, saved_step: int) -> None:
    """Keep the newest save_total_limit checkpoints of this run, always including the one just saved (which `latest`
    names, even when a resume from an older checkpoint left newer ones behind); remove folders of killed saves.

    The new checkpoint is complete by now: a folder that cannot be removed (on a network file system, while a file
    in it is still open elsewhere) is a warning, not a failed save. Each save tries again."""
    for name in os.listdir(cfg.output_dir):
        if SAVE_RE.match(name) and not _CHECKPOINT_RE.match(name):
            shutil.rmtree(os.path.join(cfg.output_dir, name), ignore_errors=True)
    if cfg.save_total_limit:
        steps = checkpoint_steps(cfg.output_dir)
        # A run saves ever higher steps, so a checkpoint of a later step than this save's predates this run: the
        # branch that a return to an earlier checkpoint left (or a killed save's, which this run trains again). It
        # goes first, so that the checkpoint resumed from is not removed while that branch's is kept.
        others = [step for step in steps if step > saved_step] + [step for step in steps if step < saved_step]
        for step in others[: max(0, len(others) - (cfg.save_total_limit - 1))]:
            path = os.path.join(cfg.output_dir, f"checkpoint-{step}")
            try:
                os.replace(path, path + ".old")  # first: a folder half removed must not look like a checkpoint
                shutil.rmtree(path + ".old")
            except OSError as error:
                print_line(f"warning: save_total_limit {cfg.save_total_limit}: {path} could not be removed "
                           f"({type(error).__name__}: {error}); the next save tries again")


# --- Load -------------------------------------------------------------------------------------------------------

def load_checkpoint(path: str, model: nn.Module, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and (same world size only) RNG states. Every rank calls this."""
    state = validate_checkpoint(path)
    load_model_weights(path, state["format"], model)
    load_optimizer_state(os.path.join(path, "optimizer"), model, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    # The checkpoint's LRs (the param groups' and the scheduler's last) are its own run's schedule at this step; a
    # run whose length changed (max_steps, num_train_epochs) trains the next step with its own schedule's, as an
    # uninterrupted run of that length would. The same float LambdaLR.step computes: unchanged length, same LRs.
    for group, base_lr, lr_lambda in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                         strict=True):
        group["lr"] = base_lr * lr_lambda(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() returns
    if state["world_size"] == dist.get_world_size():
        _set_rng_state(torch.load(os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt"), weights_only=True))
    else:
        print_rank0(f"resume: {path} was saved by {ranks(state['world_size'])}, this run has "
                    f"{dist.get_world_size()}: RNG states are not restored")
    print_rank0(f"resumed from {path} at step {state['step']}")
    return state


def load_optimizer_state(path: str, model: nn.Module, optimizer) -> None:
    """The optimizer state saved in the DCP folder `path`. A parameter that had no gradient before the save (a vision
    tower on text-only data) has no state there, as in the run that saved it: it gets none here either, although
    torch's get_optimizer_state_dict gives every parameter some to load into."""
    optim_sd = get_optimizer_state_dict(model, optimizer)
    # DCP's keys are "state.<fqn>.<name>" (step, exp_avg, ...) and "param_groups.<...>".
    saved = {key[len("state."):key.rindex(".")] for key in read_dcp_metadata(path).state_dict_metadata
             if key.startswith("state.")}
    absent = [fqn for fqn in optim_sd["state"] if fqn not in saved]
    for fqn in absent:
        del optim_sd["state"][fqn]
    groups = [sorted(group["params"]) for group in optim_sd["param_groups"]]
    read_dcp_folder(optim_sd, path)  # the saved groups replace this run's
    saved_groups = [sorted(group["params"]) for group in optim_sd["param_groups"]]
    if saved_groups != groups:  # torch would load them and leave a group without hyperparameters
        moved = sorted({p for ours, theirs in zip(groups, saved_groups) for p in set(ours) ^ set(theirs)})
        raise CheckpointError(
            f"{os.path.dirname(path)} groups the parameters for weight decay otherwise than this version of the "
            f"project does (it moved {', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}; biases and norm "
            f"weights get none): resume with the version that saved it, or {train_weights_further(os.path.dirname(path))}")
    # Optimizer.load_state_dict replaces the whole state: the absent parameters are left without any.
    set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(strict=not absent))


class ExactKeysLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner without its fallback to torch 2.3's key format, which it takes when the checkpoint holds a
    key this rank's state dict lacks. Under FSDP1 a rank holds no shard of a parameter whose first dimension is
    smaller than the world size (Qwen2-MoE's shared_expert_gate, 1 row), and its state dict leaves the key out: the
    fallback then looked for an optimizer key `param_groups` that no checkpoint of torch 2.4 or later has. Every key
    this rank does hold must still be in the checkpoint."""

    def create_local_plan(self) -> LoadPlan:
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)


def read_dcp_folder(state_dict: dict, path: str) -> None:
    """dcp.load of the DCP folder `path` into `state_dict`. A file whose content is damaged (its size is checked
    before: read_dcp_metadata) fails in DCP as a CheckpointException, a BaseException that names neither the file
    nor the checkpoint and escaped cli.run_main: here it is a CheckpointError naming the folder, on every rank. A
    Ctrl-C or an out-of-memory error during the read is raised as it is."""
    try:
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path), planner=ExactKeysLoadPlanner())
    except CheckpointException as error:
        # DCP wraps these too (on any rank, in the failures every rank gets): the run stops with them, not with
        # advice to give up on a checkpoint that is whole.
        not_damage = [exc for exc, _ in error.failures.values()
                      if isinstance(exc, (KeyboardInterrupt, MemoryError, torch.OutOfMemoryError))]
        if not_damage:
            raise not_damage[0] from None
        # The first sentence: torch.load's message for a damaged file goes on to advise weights_only=False.
        failures = "; ".join(f"rank {rank}: {type(exc).__name__}: {str(exc).strip().split('. ')[0]}"
                             for rank, (exc, _) in sorted(error.failures.items()))
        raise CheckpointError(f"{path} cannot be read ({failures}): a file in it is damaged, or it holds another "
                              f"model's state. Resume from another checkpoint") from None


def load_model_weights(path: str, fmt: str, model: nn.Module) -> None:
    """Load the checkpoint's weights into the sharded model (every rank calls this)."""
    if fmt == "sharded":
        model_sd = get_model_state_dict(model)
        read_dcp_folder(model_sd, os.path.join(path, "model"))
        set_model_state_dict(model, model_sd)
        return

    # The keys a strict load needs, taken on every rank: FSDP's state_dict is called by all ranks or none.
    expected = set(get_model_state_dict(model))

    def read_on_rank0() -> dict:
        full = {}
        for file in safetensors_files(path):
            with safe_open(file, "pt") as f:
                full.update({name: f.get_tensor(name) for name in f.keys()})
        for name in tied_parameter_names(model):
            full[name] = full[_tied_source(model, name)]
        # Refused here in a line, not in torch's load_state_dict traceback (a hand-edited file: another model's
        # checkpoint was refused by its config.json before).
        missing, unexpected = sorted(expected - full.keys()), sorted(full.keys() - expected)
        if missing or unexpected:
            named = lambda names: ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
            differences = [f"lacks {named(missing)}"] * bool(missing) + [
                f"holds {named(unexpected)}, which the model has not"] * bool(unexpected)
            raise CheckpointError(f"{path} {' and '.join(differences)}: its weights are not this model's. Resume "
                                  f"from another checkpoint")
        return full

    # The others get None: an empty dict, which the broadcast fills.
    full = run_on_rank0(read_on_rank0, f"to read {path}") or {}
    # strict (the default): a missing or unexpected weight is an error.
    with buffers_beside_parameters(model):
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _tied_source(model: nn.Module, tied_name: str) -> str:
    params = {state_dict_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    return next(state_dict_name(n) for n, p in model.named_parameters() if p is params[tied_name])
