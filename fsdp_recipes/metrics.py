"""Metrics: one JSON line per logged event in <output_dir>/metrics.jsonl, and W&B when asked. Rank 0 writes.

Only global rank 0 creates a W&B run. Its id, project and entity are saved in every checkpoint; a run resumed from a
checkpoint continues the same W&B run there, on the same step axis (the optimizer step).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import torch

from .config import ConfigError, TrainConfig
from .distributed import run_on_rank0
from .export import WriteError, write_failure

_VERSIONED_PACKAGES = ["fsdp-recipes", "transformers", "accelerate", "datasets", "safetensors", "wandb"]
# Where a checkpoint's trainer_state.json says its W&B run is.
WANDB_STATE_KEYS = ("wandb_run_id", "wandb_project", "wandb_entity")


def library_versions() -> dict[str, str]:
    """Versions of Python, CUDA and the libraries that decide a run's numbers, for the W&B config."""
    # torch's own version names its build (2.11.0+cu130); the package metadata of PyPI's CUDA wheels does not.
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def check_wandb_credentials(cfg: TrainConfig) -> None:
    """With report_to wandb, fail now, before the model is loaded, where wandb.init would: a wandb_project name that
    wandb refuses, a setting of the environment it refuses, and in online mode no API key configured, or one that is
    malformed.

    Reads WANDB_API_KEY, the netrc file and wandb's settings, as wandb.init would; contacts no server. Only the
    rank that logs (rank 0) checks: wandb.login starts wandb's service process, which would idle on every other rank.
    """
    if cfg.report_to != "wandb" or os.environ.get("RANK", "0") != "0":
        return
    import wandb
    from pydantic import ValidationError  # wandb's settings are pydantic models
    from wandb.sdk import wandb_setup

    try:
        wandb.Settings(project=cfg.wandb_project)  # wandb's own checks of the name
    except wandb.errors.UsageError as error:
        # The config takes WANDB_PROJECT where --wandb_project is unset: a user who never passed it is told where.
        source = " (from WANDB_PROJECT)" if os.environ.get("WANDB_PROJECT") == cfg.wandb_project else ""
        advice = ("pass the project's name alone, and set WANDB_ENTITY to log to a team's project"
                  if "/" in cfg.wandb_project else "choose another name")  # entity/project, as W&B shows it
        raise ConfigError(f"wandb_project {cfg.wandb_project!r}{source} is not a name W&B accepts ({error}): "
                          f"{advice}") from None
    try:
        mode = wandb_setup.singleton().settings.mode  # the settings wandb.login reads (environment, settings files)
    except (ValidationError, wandb.errors.UsageError) as error:  # WANDB_MODE=ofline, a '/' in WANDB_RUN_ID: tracebacks
        # pydantic's error lists each setting refused and its value; wandb's own validators say it in their message.
        refused = ("; ".join(f"{'.'.join(map(str, e['loc']))} {e['input']!r}: {e['msg']}" for e in error.errors())
                   if isinstance(error, ValidationError) else str(error))
        raise ConfigError(f"W&B refuses its settings (from the WANDB_ environment variables or a wandb settings "
                          f"file): {refused}. Correct the setting, or pass --report_to none") from None
    if mode in ("offline", "dryrun", "disabled"):
        return
    advice = ("set WANDB_API_KEY or run `wandb login`; or log without network with WANDB_MODE=offline (then `wandb "
              "sync`), or pass --report_to none")
    try:
        logged_in = wandb.login(verify=False, prompt=False)
    except wandb.errors.AuthenticationError as error:  # a malformed key (cut short when pasted): a traceback
        raise ConfigError(f"report_to is wandb but W&B refuses the API key ({error}): {advice}") from None
    if not logged_in:
        raise ConfigError(f"report_to is wandb but no W&B API key is configured: {advice}")


def parsed_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a blank line or one a crash cut off while it was written."""
    try:
        return json.loads(line)["step"]
    except json.JSONDecodeError:
        return math.inf


def saved_wandb_run(checkpoint: Optional[str]) -> dict[str, Optional[str]]:
    """The W&B run saved in a checkpoint's trainer_state.json, by WANDB_STATE_KEYS: its id (None if the run did not
    log to W&B), project and entity."""
    if checkpoint is None:
        return dict.fromkeys(WANDB_STATE_KEYS)
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    saved = {key: state.get(key) for key in WANDB_STATE_KEYS}
    # Saved before the project was: the run's config names the project it logged to.
    saved["wandb_project"] = saved["wandb_project"] or state.get("config", {}).get("wandb_project")
    return saved


def strict_json(metrics: dict) -> dict:
    """NaN and infinities (a diverged step's grad_norm) as null: JSON has no such numbers, and strict parsers (jq,
    JavaScript, pandas' engines) reject Python's NaN."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


def start_wandb_run(cfg: TrainConfig, run_config: dict | None, resume_from: Optional[str]):
    """A new W&B run, or for a resumed training run the W&B run saved in its checkpoint."""
    import wandb

    saved = saved_wandb_run(resume_from)
    run_id = saved["wandb_run_id"]
    return wandb.init(
        # A resumed run continues where its W&B run is: the project output_dir.check_wandb_project compared,
        # and the entity saved (another default entity or WANDB_ENTITY would split the run).
        project=cfg.wandb_project, entity=saved["wandb_entity"] or None, name=cfg.run_name, id=run_id,
        resume="allow" if run_id else None,
        config={**cfg.to_dict(), **(run_config or {}), "versions": library_versions()},
        allow_val_change=bool(run_id),  # a resumed run may change e.g. max_steps
    )


@contextlib.contextmanager
def stop_on_write_error(path: str):
    """A write of `path` that fails inside (a full disk) stops the run with an error naming it and what to do, not
    with OSError alone (which names no file); `path`.tmp, written aside to be renamed onto it, is removed."""
    try:
        yield
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise WriteError(f"{write_failure(path, error)}, then resume with --resume_from_checkpoint auto (from the "
                         f"run's last checkpoint, if it saved one)") from error


class MetricsLogger:
    """`run_config` goes to W&B next to the resolved config (e.g. the sharding plan); `resume_from` is the
    checkpoint a resumed run starts from, whose W&B run it continues."""

    def __init__(self, cfg: TrainConfig, is_main: bool, run_config: dict | None = None,
                 resume_from: Optional[str] = None):
        self.is_main = is_main
        self.wandb_run = None
        self.last_step = 0
        # The W&B run of the checkpoint resumed from, kept in this run's checkpoints where it does not log to W&B
        # (--report_to none while W&B is down): a later resume that logs to W&B continues it, not a new run.
        self.resumed_wandb_run = dict.fromkeys(WANDB_STATE_KEYS)
        if is_main:
            os.makedirs(cfg.output_dir, exist_ok=True)
            self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
            saved = saved_wandb_run(resume_from)
            if saved["wandb_run_id"]:
                self.resumed_wandb_run = saved
        if cfg.report_to == "wandb":
            # Every rank waits for it: where wandb.init fails (no server answers, a refused setting), the others stop
            # with a line naming rank 0's error, not with a crash in the next collective.
            self.wandb_run = run_on_rank0(lambda: start_wandb_run(cfg, run_config, resume_from),
                                          "to start the W&B run")

    def add_to_config(self, values: dict) -> None:
        """Add `values` (known once the data are loaded: the run's length) to the W&B run's config."""
        if self.wandb_run is not None:
            self.wandb_run.config.update(values, allow_val_change=True)  # a resumed run's length may change

    @property
    def wandb_run_state(self) -> dict[str, Optional[str]]:
        """The W&B run's id, project and entity by WANDB_STATE_KEYS, for each checkpoint; without W&B, those of the
        checkpoint resumed from (None: it had none)."""
        if self.wandb_run is None or self.wandb_run.disabled:  # WANDB_MODE=disabled: a placeholder run, not resumable
            return self.resumed_wandb_run
        return dict(zip(WANDB_STATE_KEYS, (self.wandb_run.id, self.wandb_run.project, self.wandb_run.entity)))

    def start_at(self, step: int) -> None:
        """Keep the lines of steps up to `step` (those a resumed run does not repeat), drop the rest; remove the
        samples of an earlier run's final/, which this run replaces (its own samples, if any, follow its final/)."""
        if not self.is_main:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(os.path.dirname(self.path), "samples.jsonl"))
        self.last_step = step  # the W&B step of samples logged before any other event (a resume that only finishes)
        kept = []
        if step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                # A kill just before a line's newline leaves it whole but open: the next line would join it.
                kept = [line.rstrip("\n") + "\n" for line in f if parsed_step(line) <= step]
        # Written aside, then renamed: a process killed while writing leaves the whole history, not a part of it.
        with stop_on_write_error(self.path):
            with open(self.path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(self.path + ".tmp", self.path)

    def evaluated(self, step: int) -> bool:
        """Whether metrics.jsonl holds an evaluation of `step`, as rank 0 reads it after start_at (False elsewhere)."""
        if not self.is_main:
            return False
        with open(self.path) as f:
            return any(m["step"] == step and "eval/loss" in m for m in map(json.loads, f))

    def log(self, metrics: dict) -> None:
        """One event of step metrics["step"]: a line of metrics.jsonl, and the same keys in W&B at that step."""
        if not self.is_main:
            return
        self.last_step = metrics["step"]
        with stop_on_write_error(self.path), open(self.path, "a") as f:
            f.write(json.dumps(strict_json(metrics), allow_nan=False) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def log_samples(self, samples: list[dict]) -> None:
        """Sample generations ({"prompt", "completion"}): <output_dir>/samples.jsonl and a W&B table."""
        if not self.is_main:
            return
        # Written aside, then renamed: a samples.jsonl cut short by a kill would tell a resume that they were written.
        path = os.path.join(os.path.dirname(self.path), "samples.jsonl")
        with stop_on_write_error(path):
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(sample) + "\n" for sample in samples)
                f.flush()
                os.fsync(f.fileno())  # and on disk before the rename: a node lost right after must not leave it empty
            os.replace(path + ".tmp", path)
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=["prompt", "completion"], data=[[s["prompt"], s["completion"]] for s in samples])
            self.wandb_run.log({"samples": table}, step=self.last_step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
