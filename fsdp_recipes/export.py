"""Write a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads: config.json, safetensors weights
(sharded with an index once over `max_shard_size`), tokenizer files and generation_config.json.

The writer takes shards one at a time, so the converter (convert.py) can stream a sharded checkpoint through it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel

INDEX_NAME = "model.safetensors.index.json"


def state_dict_name(parameter_name: str) -> str:
    """A parameter's name as state-dict keys spell it: without FSDP1's and activation checkpointing's wrappers."""
    return parameter_name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def tied_parameter_names(model: nn.Module) -> set[str]:
    """State-dict names of parameters that alias an earlier one (lm_head.weight when embeddings are tied)."""
    first_name: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        name = state_dict_name(name)
        if id(param) in first_name:
            tied.add(name)
        first_name.setdefault(id(param), name)
    return tied


def write_hf_weights(
    out_dir: str,
    shapes: dict[str, torch.Size],
    dtype: torch.dtype,
    max_shard_size: int | str,
    load_tensors: Callable[[list[str]], dict[str, torch.Tensor]],
) -> None:
    """Write the tensors named in `shapes` as safetensors files of at most `max_shard_size` each.

    `load_tensors(names)` returns the tensors of one output file; only one file's tensors are held at a time.
    """
    # Meta tensors: the split needs only sizes, so planning costs no memory.
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in shapes.items()}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        tensors = {name: tensor.to(dtype).contiguous() for name, tensor in load_tensors(names).items()}
        save_file(tensors, os.path.join(out_dir, filename), metadata={"format": "pt"})
        del tensors
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def replace_dir(tmp_dir: str, out_dir: str) -> None:
    """Move the finished `tmp_dir` to `out_dir`, replacing an older `out_dir` only once the new one is complete."""
    old_dir = out_dir.rstrip("/") + ".old"
    if os.path.exists(out_dir):
        os.replace(out_dir, old_dir)
    os.replace(tmp_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)


def write_model_files(model: PreTrainedModel, tokenizer, out_dir: str, dtype: torch.dtype) -> None:
    """config.json (recording `dtype`), generation_config.json and the tokenizer files."""
    # The model holds fp32 master weights; the folder records the dtype its files hold.
    config = copy.deepcopy(model.config)
    config.dtype, config.use_cache = dtype, True
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def save_hf_model(model: PreTrainedModel, tokenizer, out_dir: str, dtype: torch.dtype, max_shard_size="5GB") -> None:
    """Every rank takes part in the gather; rank 0 writes `out_dir` atomically.

    Tied weights are written once and reload tied. The folder is written under a temporary name and renamed when
    complete, so a crash never leaves a half-written model where a finished one is expected.
    """
    tmp_dir = out_dir.rstrip("/") + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    write_full_weights(model, tmp_dir, dtype, max_shard_size)
    if dist.get_rank() == 0:
        write_model_files(model, tokenizer, tmp_dir, dtype)
        replace_dir(tmp_dir, out_dir)
    dist.barrier()


def write_full_weights(model: nn.Module, out_dir: str, dtype: torch.dtype, max_shard_size) -> None:
    """Gather the full weights (every rank calls this) and write them from rank 0 into `out_dir`."""
    # Offloading to CPU what is already on CPU breaks FSDP1 (a segfault, or "storage of size 0"); on an
    # accelerator it keeps the full tensors off the GPU and on rank 0 only.
    on_accelerator = next(model.parameters()).device.type != "cpu"
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_accelerator))
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        tied = tied_parameter_names(model)
        shapes = {name: t.shape for name, t in state_dict.items() if name not in tied}
        write_hf_weights(out_dir, shapes, dtype, max_shard_size, lambda names: {n: state_dict[n] for n in names})
