"""Save the trained model as a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads."""

from __future__ import annotations

import copy
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch import nn
from transformers import PreTrainedModel


def tied_parameter_names(model: nn.Module) -> set[str]:
    """Names of parameters that alias an earlier one (lm_head.weight when embeddings are tied)."""
    first_name: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")  # state-dict keys
        if id(param) in first_name:
            tied.add(name)
        first_name.setdefault(id(param), name)
    return tied


def save_hf_model(model: PreTrainedModel, tokenizer, out_dir: str, dtype: torch.dtype) -> None:
    """Every rank takes part in the gather; rank 0 writes `out_dir` atomically.

    Tied weights are written once and reload tied. The folder is written under a temporary name and renamed when complete, so a crash never leaves a
    half-written model where a finished one is expected.
    """
    # FSDP1's full state dict with CPU offload crashes when the parameters are on the CPU already.
    on_cpu_fsdp1 = isinstance(model, FSDP) and next(model.parameters()).device.type == "cpu"
    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_cpu_fsdp1)
    state_dict = get_model_state_dict(model, options=options)  # full tensors on rank 0, empty elsewhere
    if dist.get_rank() == 0:
        tied = tied_parameter_names(model)
        state_dict = {name: tensor.to(dtype) for name, tensor in state_dict.items() if name not in tied}
        tmp_dir = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        model.save_pretrained(tmp_dir, state_dict=state_dict, safe_serialization=True)
        # save_pretrained records the dtype of the fp32 master weights; the file holds `dtype`.
        config = copy.deepcopy(model.config)
        config.dtype, config.use_cache = dtype, True
        config.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        old_dir = out_dir.rstrip("/") + ".old"
        if os.path.exists(out_dir):
            os.replace(out_dir, old_dir)
        os.replace(tmp_dir, out_dir)
        shutil.rmtree(old_dir, ignore_errors=True)
    dist.barrier()
