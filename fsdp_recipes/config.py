"""The training config: one dataclass, filled from a recipe's YAML and overridden on the command line.

Field names follow `transformers.TrainingArguments` wherever the concept is the same, so that a Hugging Face
user can read a recipe's YAML without a glossary.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml
from transformers import HfArgumentParser
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .new_recipe import PROJECT_RECIPES


@dataclass
class TrainConfig:
    # Model and tokenizer: a hub id or a local folder, both through `from_pretrained`.
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Hub id or local folder of the model."})
    tokenizer_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer hub id or folder; defaults to model_name_or_path."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code shipped with the checkpoint."})
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "sdpa, eager, flash_attention_2, flex_attention, or a Hub kernel (org/repo)."}
    )
    output_router_logits: Optional[bool] = field(
        default=None,
        metadata={"help": "Mixture of experts: add the router load-balancing loss (x router_aux_loss_coef) to the "
                          "loss. Default: the model config's."},
    )
    router_aux_loss_coef: Optional[float] = field(
        default=None, metadata={"help": "Weight of the router load-balancing loss. Default: the model config's."}
    )

    # Data (see README, "Data").
    dataset_name: Optional[str] = field(
        default=None,
        metadata={"help": "Hub id, a local json/jsonl/csv/parquet file, a folder of such files, or a saved datasets "
                          "folder; several, comma-separated, for a mixture."},
    )
    dataset_weights: Optional[str] = field(
        default=None,
        metadata={"help": "Comma-separated, one per dataset_name: a data set contributes round(weight x its size) "
                          "examples (a seeded sample; above 1 repeats it). Default: 1 each."},
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config name of a hub data set."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    eval_split: Optional[str] = field(
        default=None, metadata={"help": "Held-out split of the data sets, or a slice of one that dataset_split leaves "
                                        "out (train[90%%:] with dataset_split train[:90%%])."}
    )
    eval_fraction: float = field(
        default=0.0, metadata={"help": "Hold out this fraction of the training split (seeded), when no eval_split."}
    )
    dataset_format: Literal["auto", "chat", "instruction", "prompt_completion", "text"] = field(
        default="auto", metadata={"help": "auto: detected from the columns."}
    )
    dataset_column_mapping: Optional[str] = field(
        default=None, metadata={"help": "Rename columns, e.g. 'question=prompt,answer=completion'."}
    )
    completion_only_loss: bool = field(
        default=True, metadata={"help": "Loss on assistant turns and completions only; false: on every token."}
    )
    max_seq_length: int = field(default=1024, metadata={"help": "Longest sequence in tokens."})
    overlong_examples: Literal["truncate", "drop"] = field(
        default="truncate", metadata={"help": "What to do with an example longer than max_seq_length."}
    )
    packing: bool = field(
        default=False, metadata={"help": "Pack several examples per sequence; attention stays within each example."}
    )
    dataset_num_proc: Optional[int] = field(
        default=None, metadata={"help": "Processes that tokenize the data (rank 0's, then each node's first); "
                                        "unset: one. The same tokens whatever the number."}
    )

    # Optimisation.
    output_dir: str = field(default="outputs/run", metadata={"help": "Where metrics, checkpoints and final/ go."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1 means use num_train_epochs."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs, when max_steps is -1."})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "Sequences per rank per micro-batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=2e-5, metadata={"help": "Peak learning rate of AdamW."})
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup", "inverse_sqrt"] = field(
        default="cosine", metadata={"help": "transformers' scheduler of that name, after warmup_steps."}
    )
    warmup_steps: float = field(
        default=0,
        metadata={"help": "Linear warm-up: a number of steps, or a fraction below 1 of the run's steps (rounded up), "
                          "as in transformers' TrainingArguments. It must end before the run does."},
    )
    weight_decay: float = field(default=0.0, metadata={
        "help": "AdamW weight decay; none on biases and norm weights (named as transformers.Trainer names them) and "
                "other 1-D parameters."})
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clip the global gradient norm; 0 (or less, as in TrainingArguments) disables."}
    )
    seed: int = 42

    # Sharding and precision. Unset (None) fields come from the accelerate config, else from the default shown.
    fsdp_version: Optional[int] = field(
        default=None, metadata={"help": "1 (FullyShardedDataParallel) or 2 (fully_shard). Default: accelerate's, else 2."}
    )
    fsdp_sharding_strategy: Optional[Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]] = field(
        default=None, metadata={"help": "FSDP1 only. Default: accelerate's, else FULL_SHARD."}
    )
    fsdp_reshard_after_forward: Optional[bool] = field(
        default=None,
        metadata={"help": "FSDP2 only: free the gathered layer after forward (ZeRO-3). Default: accelerate's, else "
                          "true."},
    )
    dp_replicate_size: Optional[int] = field(
        default=None,
        metadata={"help": "Hybrid sharding: replicas (e.g. nodes) x shards. FSDP2: >1 turns on HSDP. FSDP1 "
                          "HYBRID_SHARD: default the number of nodes. Default: accelerate's parallelism_config, else 1."},
    )
    fsdp_auto_wrap_policy: Optional[Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"]] = field(
        default=None,
        metadata={"help": "Which modules get their own FSDP unit. Default: accelerate's, else TRANSFORMER_BASED_WRAP."},
    )
    fsdp_transformer_layer_cls_to_wrap: Optional[str] = field(
        default=None,
        metadata={"help": "Comma-separated layer classes: the FSDP units (TRANSFORMER_BASED_WRAP), and what activation "
                          "checkpointing and torch_compile apply to. Default: accelerate's, else the model's "
                          "_no_split_modules, else its decoder layers (the one nn.ModuleList of num_hidden_layers "
                          "modules of one class)."},
    )
    fsdp_min_num_params: Optional[int] = field(
        default=None, metadata={"help": "SIZE_BASED_WRAP: parameters per unit at least. Default: accelerate's, else 1e8."}
    )
    fsdp_offload_params: Optional[bool] = field(
        default=None,
        metadata={"help": "Keep parameters, gradients and optimizer state on the CPU. Default: accelerate's, else "
                          "false."},
    )
    fsdp_activation_checkpointing: Optional[bool] = field(
        default=None,
        metadata={"help": "Recompute each decoder layer's activations in backward. Default: accelerate's, else "
                          "false."},
    )
    fsdp_cpu_ram_efficient_loading: Optional[bool] = field(
        default=None,
        metadata={"help": "Only rank 0 reads the weights; the others start on the meta device. Default: "
                          "accelerate's (true when its config leaves it out), else false."},
    )
    mixed_precision: Optional[Literal["bf16", "no", "pure_bf16"]] = field(
        default=None,
        metadata={"help": "bf16: bf16 compute, fp32 master weights, reduction and optimizer state. no: all fp32. "
                          "pure_bf16: everything bf16. Default: accelerate's, else bf16."},
    )
    gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = field(
        default="every_micro_batch",
        metadata={"help": "every_micro_batch keeps only sharded gradients (memory-safe); last_micro_batch "
                          "communicates once per step but holds full gradients between micro-batches."},
    )
    save_dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(
        default="auto", metadata={"help": "dtype of the exported model; auto: the dtype in the config.json of the "
                                          "checkpoint you started from."}
    )

    # Evaluation and sample generation (see README, "Metrics, W&B and evaluation" and "Sample generation").
    eval_steps: int = field(
        default=0,
        metadata={"help": "Evaluate on the held-out split every N steps and at the end; 0: at the end only (when "
                          "there is a held-out split)."},
    )
    per_device_eval_batch_size: Optional[int] = field(
        default=None,
        metadata={"help": "Sequences per rank per eval batch. Default: per_device_train_batch_size, a batch the "
                          "run's memory already fits."},
    )
    generation_prompts: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Prompts that rank 0 answers greedily with the exported model at the end of the run."},
    )
    generation_max_new_tokens: int = field(default=64, metadata={"help": "Longest generated answer, in tokens."})
    generation_use_chat_template: Optional[bool] = field(
        default=None,
        metadata={"help": "true: send each prompt as a user turn through the tokenizer's chat template; false: as "
                          "plain text after the BOS token. Default: as the data were trained (chat and instruction "
                          "data: true; prompt/completion and text data: false)."},
    )

    # Speed (see README, "Performance").
    torch_compile: bool = field(
        default=False,
        metadata={"help": "torch.compile each decoder layer (after activation checkpointing, before sharding). "
                          "FSDP2 only."},
    )
    dataloader_num_workers: int = field(
        default=0,
        metadata={"help": "Worker processes per rank that collate batches ahead of the step; 0: in the main process."},
    )

    # Logging and saving.
    logging_steps: int = field(default=1, metadata={"help": "Log every N optimizer steps."})
    save_steps: int = field(
        default=0, metadata={"help": "Save a checkpoint every N steps and at the end; 0: only final/ at the end."}
    )
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "Keep the newest N checkpoints."})
    save_state_dict_type: Optional[Literal["full", "sharded"]] = field(
        default=None,
        metadata={"help": "Checkpoint format: sharded (DCP, each rank its shards) or full (rank 0 writes HF "
                          "safetensors). Default: the accelerate config's fsdp_state_dict_type, else sharded."},
    )
    max_shard_size: str = field(
        default="5GB", metadata={"help": "Largest safetensors file of an HF folder, e.g. 5GB, 500MB or 4GiB."}
    )
    report_to: Literal["none", "wandb"] = field(default="none", metadata={"help": "none or wandb (rank 0 logs)."})
    run_name: Optional[str] = field(default=None, metadata={"help": "W&B run name."})
    wandb_project: Optional[str] = field(
        default=None, metadata={"help": "W&B project. Default: the environment's WANDB_PROJECT, else fsdp-recipes."}
    )
    resume_from_checkpoint: Optional[str] = field(
        default=None,
        metadata={"help": "Checkpoint folder to resume, or auto: the one output_dir's `latest` names (if none: start "
                          "fresh)."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start a fresh run in an output_dir that holds a previous run's checkpoints or final/: "
                          "they are removed first. Without it, such an output_dir is refused."},
    )

    def __post_init__(self):
        if str(self.resume_from_checkpoint).lower() == "true":
            raise ConfigError("resume_from_checkpoint true: set it to auto (the checkpoint output_dir's `latest` "
                              "names) or to a checkpoint folder")
        if str(self.resume_from_checkpoint).lower() == "false":  # not a folder, nor quoted into one
            raise ConfigError("resume_from_checkpoint false: leave it unset (null) to start fresh, or set it to auto "
                              "or to a checkpoint folder")
        check_field_types(self)
        # As TrainingArguments does: YAML and `--key=~/x` leave the home folder unexpanded. (dataset_name is
        # expanded name by name where it is read, so that a checkpoint records it as written.)
        for name in ("model_name_or_path", "tokenizer_name_or_path", "output_dir", "resume_from_checkpoint"):
            if getattr(self, name):
                setattr(self, name, os.path.expanduser(getattr(self, name)))
        required = {"model_name_or_path": self.model_name_or_path, "dataset_name": self.dataset_name}
        for name, value in required.items():
            if not value:
                raise ConfigError(f"{name} is required: set it in the YAML config or pass --{name}")
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = self.per_device_train_batch_size
        # As wandb.init reads it, which a project passed to it would override; not read by a run that logs no W&B.
        if self.wandb_project is None and self.report_to == "wandb":
            self.wandb_project = os.environ.get("WANDB_PROJECT") or "fsdp-recipes"
            if not self.wandb_project.strip():
                raise ConfigError(f"WANDB_PROJECT={self.wandb_project!r} names no W&B project: give it a name, unset "
                                  f"it, or pass --wandb_project <name>")
        for name in ("wandb_project", "run_name"):  # online, W&B files an empty name under a default of its own
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ConfigError(f"{name} is empty: give it a name, or leave it out (null) for the default")
        positive = ["per_device_train_batch_size", "gradient_accumulation_steps", "max_seq_length", "logging_steps",
                    "per_device_eval_batch_size", "generation_max_new_tokens"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps must be -1 (use num_train_epochs) or positive, got {self.max_steps}")
        if self.max_steps == -1 and not 0 < self.num_train_epochs < math.inf:
            raise ConfigError(f"num_train_epochs must be positive when max_steps is -1, got {self.num_train_epochs}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_split and not self.eval_split.replace(",", "").strip():
            # Every data set's entry empty: no held-out split, while the eval settings would count as used.
            raise ConfigError(f"eval_split {self.eval_split!r} names no split: name the held-out split (one for all "
                              f"data sets, or one per data set, comma-separated), or leave eval_split unset")
        if self.eval_split and self.eval_fraction:
            raise ConfigError("set eval_split or eval_fraction, not both")
        if self.eval_steps < 0:
            raise ConfigError(f"eval_steps must be 0 (evaluate at the end only) or positive, got {self.eval_steps}")
        if self.fsdp_version not in (None, 1, 2):
            raise ConfigError(f"fsdp_version must be 1 or 2, got {self.fsdp_version}")
        if self.dp_replicate_size is not None and self.dp_replicate_size < 1:
            raise ConfigError(f"dp_replicate_size must be at least 1, got {self.dp_replicate_size}")
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            raise ConfigError(f"dataset_num_proc must be at least 1 or unset, got {self.dataset_num_proc}")
        if self.dataloader_num_workers < 0:
            raise ConfigError(f"dataloader_num_workers must be 0 or more, got {self.dataloader_num_workers}")
        if self.save_steps < 0:
            raise ConfigError(f"save_steps must be 0 (no checkpoints: only final/ is saved) or a positive N (a "
                              f"checkpoint every N steps and at the end), got {self.save_steps}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ConfigError(f"save_total_limit must be at least 1 or unset, got {self.save_total_limit}")
        unused = [k for k in CHECKPOINT_KEYS if getattr(self, k) is not None]
        if unused and not self.save_steps:
            raise ConfigError(f"{' and '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} to checkpoints, "
                              f"which save_steps 0 turns off (only final/ is saved): set save_steps N to save one "
                              f"every N steps, or leave {' and '.join(unused)} unset")
        if not (0 <= self.warmup_steps < 1 or float(self.warmup_steps).is_integer() and self.warmup_steps > 0):
            raise ConfigError(f"warmup_steps must be a whole number of steps, or a fraction in [0, 1) of the run's "
                              f"steps, got {self.warmup_steps}")
        if not 0 < self.learning_rate < math.inf:
            raise ConfigError(f"learning_rate must be a positive number, got {self.learning_rate}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"weight_decay must be 0 or a positive number, got {self.weight_decay}")
        if not 0 < self.adam_epsilon < math.inf:
            # AdamW divides by sqrt(v) + eps: 0/0 for any weight whose gradient is 0 at the first step.
            raise ConfigError(f"adam_epsilon must be a positive number, got {self.adam_epsilon}: AdamW divides by "
                              f"sqrt(v) + adam_epsilon, so with 0 a weight whose gradient is 0 (the embedding row of "
                              f"a token not in the batch) becomes NaN at the first step. Set it to 1e-8, the default")
        if self.router_aux_loss_coef is not None and not 0 <= self.router_aux_loss_coef < math.inf:
            # Negative, the loss would reward routing every token to the same experts; NaN, it would be NaN.
            raise ConfigError(f"router_aux_loss_coef must be 0 or a positive number (most of transformers' MoE "
                              f"models default to 0.001), got {self.router_aux_loss_coef}")
        if math.isnan(self.max_grad_norm):  # NaN > 0 is false: clipping would be silently off
            raise ConfigError("max_grad_norm must be a number, got nan: set the norm to clip to, or 0 to disable "
                              "clipping")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")
        shard_size_in_bytes(self.max_shard_size)
        # A typo otherwise fails at the model load, after the data is tokenized, as a traceback on every rank.
        known = {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
        if self.attn_implementation not in known and "/" not in self.attn_implementation:
            raise ConfigError(f"attn_implementation must be one of {', '.join(sorted(known))}, or a Hub kernel "
                              f"(org/repo), got {self.attn_implementation!r}")
        if self.gradient_sync == "last_micro_batch" and self.gradient_accumulation_steps == 1:
            raise ConfigError("gradient_sync last_micro_batch skips the reduction of all but the last micro-batch of a "
                              "step, and gradient_accumulation_steps 1 has one: set gradient_accumulation_steps above "
                              "1, or gradient_sync every_micro_batch")
        if self.lr_scheduler_type == "constant" and self.warmup_steps:
            raise ConfigError("lr_scheduler_type constant has no warm-up: use constant_with_warmup, or warmup_steps 0")

    def num_warmup_steps(self, total_steps: int) -> int:
        """warmup_steps in steps of a run of total_steps. A fraction is rounded up, and ends a step before the run
        does (a 1-step smoke test trains at learning_rate); a number of steps as long as the run is refused: the
        learning rate would never reach learning_rate, nor decay."""
        if self.warmup_steps < 1:
            # Rounded first, as the run's length: 0.07 of 100 steps is 7.000000000000001 in floats.
            return min(math.ceil(round(self.warmup_steps * total_steps, 6)), total_steps - 1)
        if self.warmup_steps >= total_steps:
            raise ConfigError(
                f"warmup_steps {self.warmup_steps:g} covers the whole run of {total_steps} steps: the learning rate "
                f"would never reach learning_rate {self.learning_rate:g}, nor decay. Lower warmup_steps (steps below "
                f"{total_steps}, or a fraction of the run such as 0.03) or train longer (max_steps, num_train_epochs)")
        return int(self.warmup_steps)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A config value the user must change; the message says which and how."""


def is_local_path(name: str) -> bool:
    """Whether a model, tokenizer or data set name can only be a local path: it starts as one does, or holds more
    than one '/', which no Hub id (namespace/name) does (outputs/run1/final)."""
    return name.startswith(("/", ".", "~")) or (name.count("/") > 1 and "://" not in name)


def looked_in(path: str) -> str:
    """' in <working directory>' after a relative path that is not there: relative paths, in the YAML config as on the
    command line, are read from the directory the run starts in (not the YAML config's), so the error names it."""
    return "" if os.path.isabs(os.path.expanduser(path)) else f" in {os.getcwd()}"


# The keys that apply to checkpoints alone, which save_steps 0 turns off.
CHECKPOINT_KEYS = ("save_total_limit", "save_state_dict_type")
# The TrainConfig keys that are set on the model's config (the MoE router loss), where None keeps config.json's value.
ROUTER_LOSS_KEYS = ("output_router_logits", "router_aux_loss_coef")
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_size_in_bytes(size: str) -> int:
    """`max_shard_size` in bytes: huggingface_hub's units (5GB: 10**9) and binary ones (4GiB: 2**30), as
    transformers' `save_pretrained` takes both. Checked at start: a typo would otherwise fail at the export, after
    the whole run."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]I?B)\s*", size, flags=re.IGNORECASE)
    if not match or float(match.group(1)) * SIZE_UNITS[match.group(2).upper()] < 1:
        raise ConfigError(f"max_shard_size must be a positive size such as 5GB, 500MB or 4GiB, got {size!r}")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


# Keys that take several values as one comma-separated string, which a YAML list of them is not.
COMMA_SEPARATED = {"dataset_name", "dataset_weights", "dataset_config_name", "dataset_split", "eval_split",
                   "dataset_column_mapping", "fsdp_transformer_layer_cls_to_wrap"}


def check_field_types(cfg) -> None:
    """Every field against its annotation. argparse checks only the command line: a YAML value reaches the config
    as written, and a typo there (`save_dtype: bf16`) would otherwise fail hours later, or silently change a run."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        _check_type(f.name, getattr(cfg, f.name), hints[f.name])


def _check_type(name: str, value, annotation) -> None:
    if not _matches(value, annotation):
        hint = (" (YAML reads ~ and an empty value as null)" if value is None else
                " (YAML reads an unquoted yes, no, on or off as true or false: quote it)"
                if isinstance(value, bool) else
                # A text field given a number (dataset_weights: 0.5, run_name: 2024), which argparse would take.
                " (YAML reads an unquoted number as a number: quote it)"
                if isinstance(value, (int, float)) and _matches("", annotation) else
                f" (write several as one comma-separated string: '{','.join(map(str, value))}')"
                if isinstance(value, list) and name in COMMA_SEPARATED else "")
        raise ConfigError(f"{name} must be {_describe(annotation)}, got {value!r}{hint}")


def _matches(value, annotation) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        return any(_matches(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and all(_matches(item, args[0]) for item in value)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _describe(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        return " or ".join(_describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('a ')}s"
    return {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string"}[annotation]


# transformers.TrainingArguments' (and TRL's) names for what this config names otherwise: a Hugging Face user's
# YAML holds them, and difflib finds no key near bf16.
TRAINING_ARGUMENTS_NAMES = {
    "bf16": "mixed_precision: bf16", "fp16": "mixed_precision (bf16, no or pure_bf16; fp16 is not offered)",
    "gradient_checkpointing": "fsdp_activation_checkpointing: true", "warmup_ratio": "warmup_steps: <fraction>",
    "eval_strategy": "eval_steps: N", "evaluation_strategy": "eval_steps: N", "save_strategy": "save_steps: N",
    "max_length": "max_seq_length", "torch_dtype": "save_dtype (the export's; training is set by mixed_precision)",
}


def _unknown_key_error(key: str, source: str, known: list[str]) -> ConfigError:
    name = key.replace("-", "_")  # argparse, HfArgumentParser's too, takes --gradient-checkpointing for the key
    close = difflib.get_close_matches(name, known, n=1)
    hint = (f" TrainingArguments' {name} is {TRAINING_ARGUMENTS_NAMES[name]} here." if name in TRAINING_ARGUMENTS_NAMES
            else f" Did you mean '{close[0]}'?" if close else
            " (A key of your own: declare it in a @dataclass subclass of TrainConfig, passed to parse_config as "
            "config_class.)")
    return ConfigError(f"unknown config key '{key}' in {source}.{hint} Run the recipe with --help to list the keys.")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key set twice: YAML keeps the last one, so an edit at the bottom of a copied recipe
    would be silently overridden, or silently override."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):  # every config key is a name
                quote = (" (YAML reads an unquoted yes, no, on, off, true or false as a boolean: quote it)"
                         if isinstance(key, bool) else "")
                shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else f"a {type(key).__name__}"
                raise yaml.constructor.ConstructorError(problem=f"key {shown} is not a name{quote}",
                                                        problem_mark=key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(problem=f"key '{key}' is set twice",
                                                        problem_mark=key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def integer(text) -> int:
    """An int field's value: whole numbers in any notation (1e8, as `accelerate config` shows fsdp_min_num_params'
    default; its YAML holds 100000000)."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise
        return int(value)


def _raise_config_error(source: str):
    def error(message: str):
        raise ConfigError(f"{source}: {message}")
    return error


# Keys of an accelerate config (`accelerate config`'s file) that no recipe config has.
ACCELERATE_CONFIG_KEYS = ("compute_environment", "distributed_type", "fsdp_config", "num_processes", "num_machines",
                          "machine_rank", "main_process_ip", "main_process_port", "main_training_function",
                          "parallelism_config", "use_cpu")


def _read_yaml(path: str, parser: HfArgumentParser, config_class: type[TrainConfig]) -> dict:
    field_names = [f.name for f in dataclasses.fields(config_class)]
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            values = yaml.load(f, Loader=_UniqueKeyLoader) or {}
    except OSError as error:
        raise ConfigError(f"cannot read --config {path}: {error.strerror}{looked_in(path)}") from error
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text: {error.reason} at byte {error.start}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from error
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(values).__name__}")
    # The two YAML files of a launch are easily swapped: an accelerate config's first key would be "unknown".
    launcher_keys = [key for key in ACCELERATE_CONFIG_KEYS if key in values]
    if launcher_keys:
        raise ConfigError(f"--config {path} is an accelerate config (it sets {launcher_keys[0]}): pass it to accelerate "
                          f"launch --config_file, and a recipe config (recipes/configs/<recipe>.yaml) as --config")
    actions = {action.dest: action for action in parser._actions}
    for key, value in values.items():
        if key not in field_names:
            raise _unknown_key_error(key, path, field_names)
        # argparse converts string defaults itself, but blames a bad one on a command-line flag nobody passed.
        convert = actions[key].type
        if convert is integer and isinstance(value, float) and value.is_integer():
            values[key] = int(value)
        elif isinstance(value, str) and convert not in (None, str):
            try:
                values[key] = convert(value)
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                raise ConfigError(f"{key} in {path} must be {_describe(typing.get_type_hints(config_class)[key])}, "
                                  f"got {value!r}") from None
    return values


def _recipe_parser(config_class: type[TrainConfig]) -> HfArgumentParser:
    # No abbreviations: --max_step must not silently mean --max_steps.
    parser = HfArgumentParser(config_class, allow_abbrev=False)
    parser.error = _raise_config_error("the command line")
    parser.add_argument("--config", help="YAML file with the recipe's defaults; command-line flags override it.")
    for action in parser._actions:
        if action.type is int:
            action.type = integer
    return parser


def read_yaml_config(path: str) -> dict:
    """The keys a recipe YAML sets, converted and checked as parse_config reads them."""
    values = _read_yaml(path, _recipe_parser(TrainConfig), TrainConfig)
    hints = typing.get_type_hints(TrainConfig)
    for key, value in values.items():
        _check_type(key, value, hints[key])
    return values


def parse_config(argv: Optional[list[str]] = None, recipe: Optional[str] = None,
                 config_class: type[TrainConfig] = TrainConfig) -> TrainConfig:
    """`--config recipe.yaml` gives the defaults, every other `--key value` overrides one field. `recipe`, the
    running recipe's file: a run without --config is warned that its YAML configs were left out. `config_class`: a
    dataclass subclass of TrainConfig, for a recipe's keys of its own."""
    if not (isinstance(config_class, type) and issubclass(config_class, TrainConfig)):
        raise TypeError(f"config_class must be a subclass of TrainConfig, got {config_class!r}")
    if "__dataclass_fields__" not in vars(config_class):  # without @dataclass, its keys would be no fields
        raise TypeError(f"config_class {config_class.__name__} must be decorated with @dataclass: its keys are its "
                        f"fields")
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.error = _raise_config_error("the command line")
    pre.add_argument("--config", action="append")
    known, rest = pre.parse_known_args(argv)
    if known.config and len(known.config) > 1:
        raise ConfigError(f"--config is given {len(known.config)} times ({', '.join(known.config)}): pass one YAML, "
                          f"and override its keys with --key value")
    if recipe and not known.config and "-h" not in rest and "--help" not in rest:
        _warn_without_a_config(recipe)

    parser = _recipe_parser(config_class)
    field_names = [f.name for f in dataclasses.fields(config_class)]
    yaml_values = _read_yaml(known.config[0], parser, config_class) if known.config else {}
    parser.set_defaults(**yaml_values)

    rest, nulls = _take_nulls(rest, {name for name, hint in typing.get_type_hints(config_class).items()
                                     if type(None) in typing.get_args(hint)})
    namespace, remaining = parser.parse_known_args(rest)
    for arg in remaining:
        if arg.startswith("--"):
            raise _unknown_key_error(arg[2:].split("=")[0], "the command line", field_names)
    if remaining:
        raise ConfigError(f"unexpected command-line arguments {remaining}: pass options as --key value")
    values = {**{k: v for k, v in vars(namespace).items() if k in field_names}, **nulls}
    given = {arg[2:].partition("=")[0].replace("-", "_") for arg in rest if arg.startswith("--")}
    if "save_steps" in given and not values["save_steps"]:
        # --save_steps 0 turns checkpoints off as --report_to none turns W&B off: the YAML's keys for them do not
        # apply, and are dropped (TrainConfig refuses them set without checkpoints); the command line's still are.
        values.update({key: None for key in CHECKPOINT_KEYS if key not in given})
    cfg = config_class(**values)
    # The values as given (__post_init__ fills some defaults in: per_device_eval_batch_size); null is left unset.
    set_keys = {key for key in set(yaml_values) | given if values.get(key) is not None}
    check_keys_take_effect(cfg, set_keys, given | set(nulls))
    return cfg


def _warn_without_a_config(recipe: str) -> None:
    """A recipe run without --config takes the dataclass defaults, not its family's YAML (its model, learning rate,
    sequence length, Qwen3-MoE's router loss): said once (by the launcher's first rank), not left to be found."""
    if os.environ.get("RANK", "0") != "0":
        return
    configs = os.path.join(os.path.dirname(recipe), "configs")
    own = os.path.join(configs, os.path.splitext(os.path.basename(recipe))[0] + ".yaml")
    choice = (f"--config {own}" if os.path.isfile(own) else f"--config with one of {configs}/*.yaml"
              if os.path.isdir(configs) else
              # A recipe copied into a folder of its own, its YAML beside it or anywhere: no folder of its own to name.
              f"--config with your copy of its YAML config (the project's are in {PROJECT_CONFIGS})")
    print(f"warning: no --config: this run takes the built-in defaults of every key it does not set (see --help), "
          f"not a recipe YAML's; pass {choice} for the recipe's settings", flush=True)


# The project's recipe YAML configs: the clone's, or the copies an installed package holds.
PROJECT_CONFIGS = os.path.join(PROJECT_RECIPES, "configs")


# Keys that do nothing unless another key turns their feature on: what each does, whether it is on, the keys that
# turn it on, why it is off, and what to set.
FEATURE_KEYS = {
    "per_device_eval_batch_size": ("sizes the evaluation batches", lambda c: bool(c.eval_split or c.eval_fraction),
                                   {"eval_split", "eval_fraction"}, "the run has no held-out split",
                                   "set eval_split or eval_fraction"),
    # 0 (the default) asks for no evaluation in between, so it is ignored by no run.
    "eval_steps": ("evaluates the held-out split every N steps",
                   lambda c: not c.eval_steps or bool(c.eval_split or c.eval_fraction), {"eval_split", "eval_fraction"},
                   "the run has no held-out split", "set eval_split or eval_fraction"),
    "generation_max_new_tokens": ("applies to sample generation", lambda c: bool(c.generation_prompts),
                                  {"generation_prompts"}, "generation_prompts is unset", "set generation_prompts"),
    "generation_use_chat_template": ("applies to sample generation", lambda c: bool(c.generation_prompts),
                                     {"generation_prompts"}, "generation_prompts is unset", "set generation_prompts"),
    # TrainingArguments ignores it beside max_steps; a user who sets both expects one of them to count.
    "num_train_epochs": ("sets the run's length in epochs", lambda c: c.max_steps == -1, {"max_steps"},
                         "max_steps sets it", "set max_steps -1 to count the run in epochs"),
    "run_name": ("names the W&B run", lambda c: c.report_to == "wandb", {"report_to"}, "report_to is none",
                 "pass --report_to wandb"),
    "wandb_project": ("names the W&B project", lambda c: c.report_to == "wandb", {"report_to"}, "report_to is none",
                      "pass --report_to wandb"),
}


def check_keys_take_effect(cfg: TrainConfig, set_keys: set[str], command_line_keys: set[str]) -> None:
    """A key set (not to null) in the YAML or on the command line whose feature is off would be silently ignored:
    refused. One exception: a command line that turns a feature off (`--report_to none` over a YAML that logs to
    W&B) leaves the YAML's keys for that feature alone, as it says in so many words that they do not apply."""
    for key, (what, is_on, switches, why_off, how) in FEATURE_KEYS.items():
        turned_off_on_command_line = key not in command_line_keys and command_line_keys & switches
        if key in set_keys and not is_on(cfg) and not turned_off_on_command_line:
            raise ConfigError(f"{key} {what}, and {why_off}: {how}, or leave {key} unset")


def _take_nulls(argv: list[str], optional: set[str]) -> tuple[list[str], dict]:
    """`--key null` for a key that may be null, as in the YAML: argparse would read the word as a string, or refuse
    it as a number or choice. Returns the other arguments and the keys set to None (the last of a key's
    values wins, as in argparse)."""
    kept, nulls, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        key, equals, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")  # argparse takes --eval-split for --eval_split too
        if key in optional and not equals:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if key in optional and value in ("null", "Null", "NULL"):  # YAML's words for it (~ is the shell's home)
            nulls[key] = None
            i += 1 if equals else 2
            continue
        nulls.pop(key, None)
        kept.append(arg)
        i += 1
    return kept, nulls
