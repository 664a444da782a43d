"""Resuming a run: which checkpoint (`auto`: the one output_dir's `latest` names), and whether it continues this
run, checked before anything is written: the same model config, tokenizer, training data, global batch and
optimizer settings, and steps left to train."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch.distributed as dist
import transformers
from torch import nn
from transformers import AutoTokenizer

from .checkpoint import (STATE_NAME, CheckpointError, checkpoint_steps, compute_settings, latest_checkpoint,
                         master_dtype, read_dcp_metadata, train_weights_further, training_data_identity,
                         validate_checkpoint)
from .config import ROUTER_LOSS_KEYS, TrainConfig
from .data_formats import DEFAULT_CHAT_TEMPLATE
from .distributed import RunComplete, print_rank0, ranks
from .metrics import library_versions
from .schedule import count_total_steps

# Config entries that may differ between a checkpoint and the run resuming it. The router-loss settings the recipe
# config overrides are saved with config.json's values and compared as training config keys (_RESUME_KEYS).
_RUNTIME_CONFIG_KEYS = {"use_cache", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
                        *ROUTER_LOSS_KEYS}
# The libraries whose kernels compute a step: another version may round it otherwise (torch's names its CUDA build).
_COMPUTE_LIBRARIES = ("torch", "transformers")
# Training config keys a resume must keep. The data keys decide which examples the data position (the step count)
# points at; the optimizer's param_groups (learning rate, betas, eps, weight decay) and the scheduler's base LRs come
# back from the checkpoint, so a new value would be ignored; the schedule and clipping must stay those of the run.
# The batch layout is compared as the global batch size (see training_config_differences). max_steps and
# num_train_epochs may change (a run is extended): the scheduler then follows the new total from the resumed step;
# resolve_resume refuses a total the checkpoint has already reached.
_RESUME_KEYS = (
    "dataset_name", "dataset_weights", "dataset_config_name", "dataset_split", "dataset_format",
    "dataset_column_mapping", "completion_only_loss", "eval_fraction", "eval_split", "max_seq_length",
    "overlong_examples", "packing", "seed", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "output_router_logits", "router_aux_loss_coef",
)


def resolve_resume(cfg: TrainConfig, model: nn.Module, tokenizer, train_dataset) -> Optional[str]:
    """The checkpoint to resume from, validated against `model`, the tokenizer and the run's training config and
    length; None to start from scratch.

    `auto` means the one `<output_dir>/latest` names; with no checkpoint in output_dir yet, the run starts fresh, and
    with the run complete (at its last step, exported) it raises RunComplete.
    Nothing is deleted here, and nothing written but for the rename that puts back a checkpoint a killed re-save
    left as .old (restore_replaced_checkpoint).
    """
    path = cfg.resume_from_checkpoint
    if not path:
        return None
    if path == "auto":
        path = latest_checkpoint(cfg.output_dir)
        if path is None:
            print_rank0(f"resume: no checkpoint in {cfg.output_dir} yet, starting from step 0")
            return None
    state = validate_checkpoint(path)
    if cfg.resume_from_checkpoint == "auto":
        report_newer_checkpoints(cfg.output_dir, path, state["step"])
    report_other_versions(path, state)
    # Through the model's own config class, so that defaults not written to config.json compare equal.
    saved = type(model.config).from_json_file(os.path.join(path, "config.json")).to_dict()
    current = model.config.to_dict()
    differ = model_config_differences(saved, current, left_out=settings_unknown_here(path, saved, current))
    if differ:
        raise CheckpointError(f"{path} was saved from a different model config ({', '.join(differ[:5])})")
    # The router-loss settings as each run trained with them: unset in the recipe config means config.json's value
    # (the checkpoint's config.json keeps the model's own, see export.write_model_files).
    trained = {k: saved.get(k) for k in ROUTER_LOSS_KEYS if k in state["config"] and state["config"][k] is None}
    recorded = {**state, "config": {**state["config"], **trained}, "master_dtype": saved_master_dtype(path, state)}
    now = dataclasses.replace(cfg, **{k: getattr(model.config, k, None) for k in ROUTER_LOSS_KEYS})
    differ = training_config_differences(recorded, now, dist.get_world_size(), master_dtype(model))
    if differ:
        raise CheckpointError(f"{path} was saved by a run with another training config ({'; '.join(differ)}): a "
                              f"resume continues that run, whose data position and optimizer settings the checkpoint "
                              f"holds, so resume with the checkpoint's values, or {train_weights_further(path)}")
    # The same examples as other tokens would make the data position point at other data.
    differ = tokenizer_differences(AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code),
                                   tokenizer)
    if differ:
        raise CheckpointError(f"{path} was saved with another tokenizer (its {', '.join(differ)} differ): resume "
                              f"with the checkpoint's tokenizer (--tokenizer_name_or_path {path}), or "
                              f"{train_weights_further(path)}")
    # The same dataset_name with other content (a file edited or replaced in place): the data position would
    # point at other examples.
    differ = training_data_differences(state, train_dataset)
    if differ:
        raise CheckpointError(f"{path} was saved by a run whose training data differ from this run's "
                              f"{cfg.dataset_name} ({differ}): a resume continues at step {state['step']} of that "
                              f"data's order, so resume with the data the checkpoint was trained on, or "
                              f"{train_weights_further(path)}")
    report_other_computation(path, state, model, cfg, dist.get_world_size())  # a resume the checks above let through
    total_steps = count_total_steps(cfg, train_dataset, dist.get_world_size())
    # The checkpoint's own run's length: the same data and global batch (compared above), its max_steps and epochs.
    saved_length = {k: state["config"].get(k, getattr(cfg, k)) for k in ("max_steps", "num_train_epochs")}
    saved_total = count_total_steps(dataclasses.replace(cfg, **saved_length), train_dataset, dist.get_world_size())
    if saved_total != total_steps:
        changed = ", ".join(f"{k} {saved_length[k]} -> {getattr(cfg, k)}" for k in saved_length
                            if saved_length[k] != getattr(cfg, k))
        print_rank0(f"resume: the run's length changes from {saved_total} to {total_steps} steps ({changed}): the LR "
                    f"schedule (and a warm-up given as a fraction of the run) follows the new total from step "
                    f"{state['step']}")
    final = os.path.join(cfg.output_dir, "final")
    # At its run's last step (the same length), a run that failed after its last save (in the final evaluation or the
    # export) is finished; one that has its final/ (here or beside the checkpoint) is not done again, nor is a
    # checkpoint of a longer or shorter run taken for an end.
    # output_dir's final/ is an earlier run's where overwrite_output_dir removes it before this run trains.
    ours = () if cfg.overwrite_output_dir else (final,)
    folders = [f for f in (*ours, os.path.join(os.path.dirname(os.path.abspath(path)), "final")) if os.path.isdir(f)]
    exported = [f for f in folders if export_of(f, path)]
    # A run stopped while it generated its samples (after its export) is finished again, for the samples.
    samples_owed = (final in exported and cfg.generation_prompts
                    and not os.path.isfile(os.path.join(cfg.output_dir, "samples.jsonl")))
    if samples_owed:  # output_dir's final/, which may also be listed as the checkpoint's neighbour
        exported = [f for f in exported if os.path.realpath(f) != os.path.realpath(final)]
    at_end = state["step"] == total_steps
    if cfg.resume_from_checkpoint == "auto" and at_end and final in exported and saved_total == total_steps:
        raise RunComplete(f"resume: the run in {cfg.output_dir} is complete: {path} is at its last step "
                          f"({total_steps}) and {final} holds its export, so nothing is left to do (raise max_steps "
                          f"or num_train_epochs to extend the run)")
    if state["step"] > total_steps or (at_end and (exported or saved_total != total_steps)):
        why = (f", and {exported[0]} holds its export" if at_end and exported
               else ", where the checkpoint's run, of another length, did not end" if at_end else "")
        raise CheckpointError(
            f"{path} is at step {state['step']} and this run has {total_steps} steps (max_steps, or num_train_epochs "
            f"when max_steps is -1){why}: nothing is left to train; raise max_steps or num_train_epochs to extend "
            f"the run, or write the checkpoint as a Hugging Face folder with `python -m fsdp_recipes.convert {path} "
            f"<out_dir>`")
    if at_end:
        found = (f"{final} holds its export but {cfg.output_dir} no samples.jsonl (this run's export replaces it)"
                 if samples_owed else
                 f"{final} holds an earlier export, older than the checkpoint (this run's export replaces it)"
                 if final in folders else f"{final} does not exist")
        print_rank0(f"resume: {path} is at the run's last step ({total_steps}) and {found}: the run is finished from "
                    f"it (the final evaluation if metrics.jsonl lacks it, the export, the samples)")
    elif not cfg.save_steps:
        # `latest` keeps naming the checkpoint: a later auto cannot tell that this run went on from it, or ended.
        print_rank0(f"resume: this run saves no checkpoint (save_steps 0), so resuming it again, also with auto after "
                    f"it ends, starts from {path} (step {state['step']}) and trains its steps again: set save_steps to "
                    f"keep its progress")
    return path


def report_newer_checkpoints(output_dir: str, path: str, step: int) -> None:
    """auto resumes from the checkpoint `latest` names: one of a later step beside it is said, not taken. A save
    killed between its rename and `latest` leaves one, and so does a return to an earlier checkpoint (point_latest_at),
    whose later ones are of the branch it left: the two look alike."""
    newer = [f"checkpoint-{later}" for later in checkpoint_steps(output_dir) if later > step]
    if newer:
        print_rank0(f"resume: {output_dir} also holds {', '.join(newer)}, of a later step than {path}, which `latest` "
                    f"names (a save killed before `latest` named it, or a checkpoint that a return to an earlier "
                    f"step left): this run resumes from {os.path.basename(path)}; to continue from the newer one "
                    f"instead, pass --resume_from_checkpoint {os.path.join(output_dir, newer[-1])}")


def report_other_versions(path: str, state: dict) -> None:
    """A resume on other torch or transformers versions (a cluster upgraded between a run and its resume) loads
    exactly, but its steps may round otherwise: said, so that losses that move in their last digits are not taken for
    a broken resume."""
    saved = state.get("versions")
    if saved is None:  # a checkpoint from before this record
        return
    now = library_versions()
    changed = [f"{name} {saved[name]}, now {now[name]}" for name in _COMPUTE_LIBRARIES if saved[name] != now[name]]
    if changed:
        print_rank0(f"resume: {path} was saved with other library versions ({'; '.join(changed)}): the weights, "
                    f"optimizer, RNG states and data position load exactly, but kernels that changed may round "
                    f"otherwise, so the losses from here can differ from an uninterrupted run's in their last digits "
                    f"(see README, \"Checkpoints and resume\")")


def report_other_computation(path: str, state: dict, model: nn.Module, cfg: TrainConfig, world_size: int) -> None:
    """A resume may change how a step is computed (another launcher config: engine, mixed precision bf16 or no; the
    attention kernel, compile, the batch layout of the same global batch): it loads exactly, but the losses then round
    otherwise, which is said, as for other library versions. A setting the checkpoint does not record is not
    compared."""
    saved = {**state.get("compute", {}), "batch layout": _global_batch(state["config"], state["world_size"])[1]}
    now = {**compute_settings(model), "batch layout": _global_batch(cfg.to_dict(), world_size)[1]}
    shown = lambda value: str(value).lower() if isinstance(value, bool) else value  # as the flags take them
    changed = [f"{key} {shown(now[key])}, was {shown(saved[key])}" for key in now
               if key in saved and saved[key] != now[key]]
    if changed:
        print_rank0(f"resume: this run computes its steps otherwise than the run that saved {path} "
                    f"({'; '.join(changed)}): the weights, optimizer, RNG states and data position load exactly, but "
                    f"the losses from here can differ from an uninterrupted run's by rounding")


def export_of(final: str, checkpoint: str) -> bool:
    """Whether the folder `final` is the export of `checkpoint`: a run exports after its last save, so its final/ is
    the newer. The final/ of an earlier segment of the run (before max_steps was raised) is older than the checkpoint
    of the extended run's last step, which a kill in that run's export (or a SIGTERM in its last step) leaves
    without its own."""
    return os.path.getmtime(final) >= os.path.getmtime(os.path.join(checkpoint, STATE_NAME))


def model_config_differences(saved: dict, current: dict, prefix: str = "", left_out: frozenset[str] = frozenset()
                             ) -> list[str]:
    """'key: checkpoint <value>, model <value>' for each entry that differs, sub-configs (a multimodal model's
    text_config) entry by entry, with the runtime entries left out at every level, and the `left_out` ones
    ('vision_config.vision_use_head')."""
    differ = []
    for key in sorted(set(saved) | set(current)):
        ours, theirs = saved.get(key), current.get(key)
        if key in _RUNTIME_CONFIG_KEYS or f"{prefix}{key}" in left_out or ours == theirs:
            continue
        if isinstance(ours, dict) and isinstance(theirs, dict):
            differ += model_config_differences(ours, theirs, f"{prefix}{key}.", left_out)
        else:
            differ.append(f"{prefix}{key}: checkpoint {ours!r}, model {theirs!r}")
    return differ


def settings_unknown_here(path: str, saved: dict, current: dict) -> frozenset[str]:
    """The settings of the checkpoint's config.json that this transformers does not define, where another version
    wrote it. The model's config.json leaves them out (a setting it holds is kept, known or not), so the saving
    version wrote its own defaults, which keep the behaviour of versions without the setting (5.25 writes Gemma 3's
    vision_config.vision_use_head true, the head 5.17 builds where it is unset). Said, and left out of the
    comparison. Written by this version, a setting the model's config lacks is a difference (another model)."""
    with open(os.path.join(path, "config.json")) as f:
        written_by = json.load(f).get("transformers_version")
    unknown = [] if written_by == transformers.__version__ else settings_only_in(saved, current)
    if unknown:
        print_rank0(f"resume: {path}/config.json, written by transformers {written_by}, sets {', '.join(unknown)}: "
                    f"that version's defaults for settings the model's config.json leaves out and transformers "
                    f"{transformers.__version__} does not define, left out of the comparison")
    return frozenset(unknown)


def settings_only_in(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """The entries of `saved` that `current` lacks, sub-configs entry by entry, but the runtime entries."""
    only = []
    for key, value in saved.items():
        if key in _RUNTIME_CONFIG_KEYS:
            continue
        if key not in current:
            only.append(f"{prefix}{key}")
        elif isinstance(value, dict) and isinstance(current[key], dict):
            only += settings_only_in(value, current[key], f"{prefix}{key}.")
    return only


def training_data_differences(state: dict, dataset) -> Optional[str]:
    """What changed in the training data since the checkpoint (None: nothing, or a checkpoint that predates the
    record)."""
    saved = state.get("train_data")
    if saved is None:
        return None
    current = training_data_identity(dataset)
    if saved["rows"] != current["rows"]:
        return f"it had {saved['rows']} rows after tokenization, now {current['rows']}"
    if saved["sha256"] != current["sha256"]:
        return f"the same {current['rows']} rows, but other tokens (sha256 {saved['sha256'][:12]}..., now " \
               f"{current['sha256'][:12]}...)"
    return None


def _global_batch(config: dict, world_size: int) -> tuple[int, str]:
    """Sequences per optimizer step over all ranks, and how they are made up."""
    batch, accumulation = config["per_device_train_batch_size"], config["gradient_accumulation_steps"]
    return world_size * batch * accumulation, f"{ranks(world_size)} x {batch} x {accumulation}"


def global_batch_advice(saved_batch: int, world_size: int, batch: int) -> str:
    """How this run's world size keeps the checkpoint's global batch: after a lost node the checkpoint's own layout
    is out of reach, so the error names the accumulation that fits (or says that none does)."""
    if saved_batch % world_size:
        return f", which no layout of {ranks(world_size)} gives: resume on a world size that divides {saved_batch}"
    per_rank = saved_batch // world_size
    if per_rank % batch:
        return (f", kept on {ranks(world_size)} by per_device_train_batch_size x gradient_accumulation_steps = "
                f"{per_rank}")
    return (f", kept on {ranks(world_size)} by --gradient_accumulation_steps {per_rank // batch} "
            f"({ranks(world_size)} x {batch} x {per_rank // batch})")


def saved_master_dtype(path: str, state: dict) -> Optional[str]:
    """The master_dtype of the run that saved the checkpoint at `path`: as its state records it, else (a checkpoint
    from before the record, 2026-12-02) the dtype of its Adam moments, which AdamW keeps in the weights' dtype; None
    where it holds none."""
    if "master_dtype" in state:
        return state["master_dtype"]
    metadata = read_dcp_metadata(os.path.join(path, "optimizer")).state_dict_metadata
    dtypes = {str(item.properties.dtype).removeprefix("torch.") for key, item in metadata.items()
              if key.startswith("state.") and key.endswith(".exp_avg")}
    return dtypes.pop() if len(dtypes) == 1 else None


def training_config_differences(state: dict, cfg: TrainConfig, world_size: int, master: str) -> list[str]:
    """'key: checkpoint <value>, now <value>' for each training setting a resume must keep (empty: none); `master`
    is the master_dtype of the model resuming.

    The data position is the step count: each step trains on the next global batch of the epoch's shuffled order
    (DistributedSampler hands rank r the positions r, r + world_size, ..., so a step of any layout covers one
    contiguous block of that order), and the epoch has len(data) // global batch steps. So the world size, the
    per-device batch and the accumulation may change as long as their product, the global batch, does not.
    """
    saved, current = state["config"], cfg.to_dict()
    keys = [k for k in _RESUME_KEYS if k in saved]  # a checkpoint from an older version may lack a newer key
    if "train_data" in state:
        # The data themselves are compared (training_data_differences): the same file under another spelling
        # (./data.jsonl, an absolute path, another working directory) or a copy resumes.
        keys.remove("dataset_name")
    differ = [f"{k}: checkpoint {saved[k]!r}, now {current[k]!r}" for k in keys if saved[k] != current[k]]
    saved_batch, saved_layout = _global_batch(saved, state["world_size"])
    batch, layout = _global_batch(current, world_size)
    if saved_batch != batch:
        differ.append(f"global batch (world size x per_device_train_batch_size x gradient_accumulation_steps): "
                      f"checkpoint {saved_batch} ({saved_layout}), now {batch} ({layout})"
                      + global_batch_advice(saved_batch, world_size, current["per_device_train_batch_size"]))
    # pure_bf16 against bf16 or no: the master weights and Adam's moments would be rounded to bf16, or go on from
    # bf16-rounded values. bf16 and no differ in compute only, and may change like the engine.
    saved_master = state.get("master_dtype") or master  # None: not known (saved_master_dtype), not compared
    if saved_master != master:
        needed = "pure_bf16" if saved_master == "bfloat16" else "bf16 or no"
        differ.append(f"master weights and optimizer state (mixed_precision): checkpoint {saved_master} "
                      f"(mixed_precision {needed}), now {master}")
    return differ


def tokenizer_differences(saved, current) -> list[str]:
    """The parts of two tokenizers that tokenize differently (empty: none)."""
    differ = [name for name in ("chat_template", "bos_token", "eos_token", "pad_token")
              if getattr(saved, name) != getattr(current, name)]
    if saved.chat_template == DEFAULT_CHAT_TEMPLATE and current.chat_template is None:
        # A checkpoint from before the default template was given to chat and instruction data only: this run has
        # none of those, so the template it saved played no part in the data.
        differ.remove("chat_template")
    if hasattr(saved, "backend_tokenizer") and hasattr(current, "backend_tokenizer"):
        # The whole pipeline: vocabulary, merges, added tokens, normalizer, pre-tokenizer and the post-processor
        # that adds BOS. Not padding and truncation: encoding a batch sets those on the backend.
        saved_json, current_json = (json.loads(t.backend_tokenizer.to_str()) for t in (saved, current))
        differ += [part for part in saved_json.keys() - {"padding", "truncation"}
                   if saved_json[part] != current_json.get(part)]
    elif saved.get_vocab() != current.get_vocab():
        differ.append("vocabulary")
    return sorted(differ)

