"""The run's output_dir: on a file system every rank sees, held by one run at a time, and never mixing two runs'
checkpoints: an earlier run's outputs are refused, or removed with overwrite_output_dir once this run is known to
start (prepare_output_dir, then remove_earlier_run after resolve_resume)."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import socket
import sys
from typing import Optional

import torch.distributed as dist

from .checkpoint import (LATEST_NAME, SAVE_RE, check_checkpoint_folder, checkpoint_steps, latest_checkpoint,
                         previous_run)
from .config import ConfigError, TrainConfig
from .distributed import run_on_rank0
from .export import DISK_FULL, space_left
from .metrics import saved_wandb_run
from .progress import print_line

# What a run writes into output_dir; --overwrite_output_dir removes these (and the folders SAVE_RE matches).
_RUN_OUTPUTS = ("latest", "latest.tmp", "final", "final.tmp", "final.old", "metrics.jsonl", "metrics.jsonl.tmp",
                "samples.jsonl", "samples.jsonl.tmp")


_MARKER_PREFIX = ".shared_check_"  # the name of the file check_shared_output_dir writes, before its token


def check_shared_output_dir(out: str) -> None:
    """Rank 0 creates `out` and writes a random token into it, which every rank must read back: with per-node disks
    (or a stale view of a network file system) the ranks would resolve `latest` to different checkpoints, and a save
    would fail once rank 0 has renamed what the others wrote. An output_dir rank 0 cannot write, or one another run
    holds (lock_output_dir), fails here too, not after the data and the model are loaded. Every rank calls this;
    every rank raises the same error."""
    sent: list[tuple[Optional[str], Optional[str]]] = [(None, None)]  # rank 0's token, or why it wrote none
    if dist.get_rank() == 0 and os.path.exists(out) and not os.path.isdir(out):
        # makedirs' "File exists" would read as the permission or file-system problem of the message below.
        sent[0] = (None, f"output_dir {out} is a file, not a folder: choose another output_dir")
    elif dist.get_rank() == 0:
        try:
            os.makedirs(out, exist_ok=True)
            in_use = lock_output_dir(out)
            if in_use:
                sent[0] = (None, in_use)
            else:
                # A run killed between writing its file and removing it left one behind: stale, as this run holds the
                # lock.
                for name in os.listdir(out):
                    if name.startswith(_MARKER_PREFIX):
                        os.remove(os.path.join(out, name))
                token = secrets.token_hex(16)
                # A new name each run: no cached lookup of an earlier run's file (network file systems) can answer.
                with open(os.path.join(out, f"{_MARKER_PREFIX}{token}"), "w") as f:
                    f.write(token)
                sent[0] = (token, None)
        except OSError as error:
            # A full disk: no permission or other file system is needed, only room.
            remedy = (f"make room on its file system ({space_left(out)}), or choose an output_dir with room"
                      if error.errno in DISK_FULL else
                      "choose an output_dir this user can write, on a file system that every rank sees")
            sent[0] = (None, f"output_dir {out} cannot be created or written ({type(error).__name__}: {error}): "
                             f"{remedy}")
    dist.broadcast_object_list(sent, src=0)
    token, failure = sent[0]
    if failure:
        raise ConfigError(failure)
    marker = os.path.join(out, f"{_MARKER_PREFIX}{token}")
    try:
        with open(marker) as f:
            seen = None if f.read() == token else "other content in the file rank 0 wrote"
    except OSError as error:
        seen = f"no file where rank 0 wrote one ({type(error).__name__})"
    everyone: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        os.remove(marker)  # every rank has read it: the gather above waited for them all
    dist.barrier()  # and no rank goes on before it is gone
    differ = [(rank, what) for rank, what in enumerate(everyone) if what]
    if differ:
        rank, what = differ[0]
        raise ConfigError(f"output_dir {out} is not on a file system that every rank sees (rank {rank} finds {what}): "
                          f"put it on a shared file system")


_LOCK_NAME = ".run.lock"
_held_locks: dict[str, int] = {}  # real path of an output_dir -> the open lock file this process holds in it


def _close_inherited_locks() -> None:
    """In a forked child (a DataLoader worker, a datasets.map process): its copy of the lock file would hold the
    lock after rank 0 ends, until the child notices, and a resume started at once would be refused. Close, never
    unlock: the lock belongs to the open file that rank 0 shares with it."""
    for fd in _held_locks.values():
        os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def lock_output_dir(out: str) -> Optional[str]:
    """Rank 0 holds an exclusive lock on `<out>/.run.lock` until its process ends (the kernel releases it then, kill
    -9 included): two runs started into one output_dir would both pass prepare_output_dir, then overwrite each
    other's checkpoints, remove each other's unfinished saves and interleave metrics.jsonl. Returns why `out` is in
    use, or None once this process holds the lock."""
    real = os.path.realpath(out)
    if real in _held_locks:
        return None
    fd = os.open(os.path.join(out, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "a process"
        os.close(fd)
        return (f"output_dir {out} is in use by another run ({holder} holds {os.path.join(out, _LOCK_NAME)}): the "
                f"two would overwrite each other's checkpoints. Wait for it to end (or stop it), or choose another "
                f"output_dir")
    except OSError as error:  # a file system without locks (Lustre mounted without -o flock, NFS without lockd)
        os.close(fd)
        print_line(f"warning: output_dir {out} cannot be locked ({type(error).__name__}: {error}): a second run "
                   f"started into it would not be noticed")
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
    _held_locks[real] = fd
    return None


def prepare_output_dir(cfg: TrainConfig) -> None:
    """Every rank calls this before loading anything. It checks that every rank sees the same output_dir (see
    check_shared_output_dir). A fresh run (or a resume from a checkpoint elsewhere) into an output_dir that holds
    an earlier run's checkpoints or final/ is refused: it would overwrite them, and its checkpoints would mix with
    them (retention keeps the highest steps, whichever run wrote them). With overwrite_output_dir, it checks that
    the run reads nothing from them, and remove_earlier_run removes them once the data, the schedule, the model and
    the checkpoint to resume from (if any) are known to work. A resume logging to W&B must log to the project of
    the checkpoint's W&B run (check_wandb_project)."""
    resume, out = cfg.resume_from_checkpoint, cfg.output_dir
    check_shared_output_dir(out)
    if resume and resume != "auto":  # before anything is removed, and before the advice below assumes it is one
        check_checkpoint_folder(resume, resuming=True, output_dir=out)
    # Real paths: an output_dir reached through a symlink holds the same checkpoints as its target.
    inside = resume and (resume == "auto" or os.path.realpath(resume).startswith(os.path.realpath(out) + os.sep))
    if cfg.overwrite_output_dir and inside:
        raise ConfigError(f"overwrite_output_dir true removes the checkpoints in {out}, and resume_from_checkpoint "
                          f"{resume} resumes from one of them: pass only one of the two")
    check_wandb_project(cfg)  # before anything is removed
    if cfg.overwrite_output_dir:
        check_inputs_outside(cfg, earlier_run_outputs(out))
        return
    previous = previous_run(out)
    if not previous or (inside and resume != "auto") or (resume == "auto" and LATEST_NAME in previous):
        return  # nothing to overwrite, or the run resumes from its own output_dir
    start_over = "--overwrite_output_dir true to remove them and start over, or another output_dir"
    if resume and resume != "auto":
        raise ConfigError(f"{out} holds {', '.join(previous)} of another run than {resume}'s, which this run would "
                          f"overwrite or mix with its own: pass {start_over}")
    if resume != "auto" and LATEST_NAME in previous:
        raise ConfigError(f"{out} holds {', '.join(previous)} of an earlier run, which this fresh run would overwrite "
                          f"or mix with its own: pass --resume_from_checkpoint auto (or a checkpoint folder) to "
                          f"continue that run, {start_over}")
    # Without `latest` (removed, a kill between the first rename and `latest`, checkpoints copied without it), `auto`
    # cannot continue: which checkpoint to continue is the user's choice, not a guess.
    steps = checkpoint_steps(out)
    # Without checkpoints, previous holds final/ alone: a run without save_steps, whose weights are all there is.
    resume_one = (f"pass --resume_from_checkpoint {os.path.join(out, f'checkpoint-{steps[-1]}')} (the newest) or "
                  f"another of them to continue, " if steps else
                  f"to train its final/ further, start a run with --model_name_or_path {os.path.join(out, 'final')} "
                  f"and another output_dir, or pass ")
    if resume != "auto":
        raise ConfigError(f"{out} holds {', '.join(previous)} of an earlier run, which this fresh run would overwrite "
                          f"or mix with its own, and no `latest` file naming a checkpoint to resume: {resume_one}"
                          f"{start_over}")
    raise ConfigError(f"resume_from_checkpoint auto: {out} has no `latest` file naming a checkpoint to resume, but "
                      f"holds {', '.join(previous)} of an earlier run: {resume_one}{start_over}")


def earlier_run_outputs(output_dir: str) -> list[str]:
    """The paths of what a run writes in `output_dir` (_RUN_OUTPUTS, SAVE_RE); not others, such as a wandb folder."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return [os.path.join(output_dir, name) for name in sorted(names) if name in _RUN_OUTPUTS or SAVE_RE.match(name)]


def remove_earlier_run(cfg: TrainConfig) -> None:
    """With overwrite_output_dir, rank 0 removes the earlier run's outputs (prepare_output_dir has checked that this
    run reads nothing from them); every rank calls this, and none goes on while rank 0 removes (several 70B
    checkpoints can take long on a network file system)."""
    if not cfg.overwrite_output_dir:
        return

    def remove():
        # `latest` first, then each checkpoint and final/ under its .old name: a kill half-way leaves neither a
        # `latest` naming a folder partly removed nor such a folder under a name a resume or from_pretrained takes
        # (the next save, export or overwrite removes the .old ones).
        paths = earlier_run_outputs(cfg.output_dir)
        for path in sorted(paths, key=lambda path: os.path.basename(path) != LATEST_NAME):
            if not os.path.lexists(path):
                continue  # an earlier .old folder, removed to make room for its checkpoint's rename
            if os.path.isdir(path) and not os.path.islink(path) and not path.endswith((".tmp", ".old")):
                if os.path.lexists(path + ".old"):
                    _remove(path + ".old")
                os.replace(path, path + ".old")
                path += ".old"
            _remove(path)

    run_on_rank0(remove, f"to remove the earlier run in {cfg.output_dir}")


def _remove(path: str) -> None:
    """A folder and what it holds; a file or a symbolic link (not what it points to) alone."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def check_earlier_run_removed(cfg: TrainConfig) -> None:
    """Before the first step: a recipe copied before remove_earlier_run existed never calls it, and retention would
    then mix the earlier run's checkpoints with this run's."""
    left = previous_run(cfg.output_dir) if cfg.overwrite_output_dir else []
    if left:
        recipes_dir = os.path.dirname(os.path.abspath(sys.argv[0]))  # the running recipe's folder, wherever copied
        raise ConfigError(f"overwrite_output_dir true, but {cfg.output_dir} still holds {', '.join(left)} of the "
                          f"earlier run: the recipe must call "
                          f"remove_earlier_run(cfg) (fsdp_recipes.output_dir) after resolve_resume, as "
                          f"recipes/llama_sft.py does; `python -m fsdp_recipes.new_recipe --sync --recipes_dir "
                          f"{recipes_dir}` updates the recipes there")


def check_wandb_project(cfg: TrainConfig) -> None:
    """A resume that logs to W&B continues the W&B run of its checkpoint, which lives in one project: its id in
    another project (the default one, for a resume without the first run's --wandb_project) would start a second
    run there, each with part of the history. Every rank calls this, and reads the checkpoint `latest` names as
    rank 0 does."""
    resume = cfg.resume_from_checkpoint
    if cfg.report_to != "wandb" or not resume:
        return
    path = latest_checkpoint(cfg.output_dir) if resume == "auto" else resume
    if path is None:
        return  # auto, and no checkpoint yet: a fresh run
    try:
        saved = saved_wandb_run(path)
    except (OSError, ValueError):  # unreadable: validate_checkpoint says so before the resume
        return
    # No run id: the checkpoint's run did not log to W&B, and this one starts a W&B run of its own.
    if saved["wandb_run_id"] and saved["wandb_project"] != cfg.wandb_project:
        raise ConfigError(f"{path} continues W&B run {saved['wandb_run_id']} of project {saved['wandb_project']}: "
                          f"pass --wandb_project {saved['wandb_project']}")


def check_inputs_outside(cfg: TrainConfig, removed: list[str]) -> None:
    """The model, tokenizer and data this run reads must not lie in what overwrite_output_dir removes (e.g. the
    earlier run's final/ as the model to fine-tune further): they would be gone before the run reads them. A path
    is compared as written and, in a removed folder, resolved; a removed symlink takes only itself."""
    within = lambda path, folder: os.path.commonpath([path, folder]) == folder
    inputs = [("model_name_or_path", cfg.model_name_or_path), ("tokenizer_name_or_path", cfg.tokenizer_name_or_path)]
    inputs += [("dataset_name", name.strip()) for name in (cfg.dataset_name or "").split(",")]
    for key, value in inputs:
        written = os.path.abspath(os.path.expanduser(value)) if value else ""
        if not written or not os.path.exists(written):
            continue  # a Hub id
        for path in removed:
            if within(written, os.path.abspath(path)) or (
                    not os.path.islink(path) and within(os.path.realpath(written), os.path.realpath(path))):
                raise ConfigError(f"{key} {value} is in {path}, which overwrite_output_dir true removes before this "
                                  f"run reads it: move it out of {cfg.output_dir}, or write this run to another "
                                  f"output_dir")

