"""Write a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads: config.json, safetensors weights
(sharded with an index once over `max_shard_size`), tokenizer files and generation_config.json.

The writer takes tensors one at a time, so the converter (convert.py) can stream a sharded checkpoint through it.
The weights are written in the model's original (Hub) layout, as save_pretrained writes them: transformers 5 fuses
some on load (a mixture of experts' per-expert matrices into one tensor), which other tools (vLLM, older
transformers) do not read.
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import math
import os
import shutil
import struct
import sys
from typing import Callable

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import PretrainedConfig, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.dynamic_module_utils import custom_object_save
from transformers.utils import cached_file

from .config import ConfigError, shard_size_in_bytes
from .data_formats import turn_closing_token_id
from .distributed import run_on_rank0
from .model import set_use_cache
from .sharding import compute_device, kept_in_fp32, state_dict_name

INDEX_NAME = "model.safetensors.index.json"

# A multimodal model's processor files (image, video and processor settings): vLLM needs them to serve the model.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


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


WRITE_CHUNK_ELEMENTS = 1 << 20  # elements cast and written at a time: 4 MB of fp32

# safetensors' names for the dtypes a folder's weights can be written in, and for the integer and boolean tensors
# written as stored (DeepSeek V4's token-to-expert tables).
WEIGHT_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
SAFETENSORS_DTYPES = {**WEIGHT_DTYPES, torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def weight_dtypes(model: nn.Module | None, stored: dict[str, torch.dtype], dtype: torch.dtype,
                  model_names: dict[str, str] | None = None) -> dict[str, torch.dtype]:
    """The dtype of each tensor of a folder of `dtype`, from its dtype `stored` in the source: an integer or boolean
    tensor as stored; fp32 for the weights the model keeps in fp32 (sharding.kept_in_fp32), as from_pretrained loads
    and save_pretrained writes them; `dtype` for the rest. `model_names` maps a name of the original layout to the
    model's own, which transformers matches the fp32 patterns against (DeepSeek V4's hc_attn_fn is attn_hc.fn)."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"cannot write {dtype} weights: use one of {', '.join(map(str, WEIGHT_DTYPES))}")
    kept = kept_in_fp32(model.module if isinstance(model, FSDP) else model, dtype)
    model_names = model_names or {}
    return {name: own if not own.is_floating_point
            else torch.float32 if kept and kept.search(model_names.get(name, name)) else dtype
            for name, own in stored.items()}


def write_hf_weights(
    out_dir: str,
    shapes: dict[str, torch.Size],
    dtypes: dict[str, torch.dtype],
    max_shard_size: str,
    load_tensor: Callable[[str], torch.Tensor],
) -> None:
    """Write the tensors named in `shapes`, each cast to its dtype in `dtypes` (weight_dtypes), as safetensors files
    of at most `max_shard_size` each.

    Each file's header is planned from the shapes alone, then `load_tensor(name)` is called once per tensor and its
    bytes are appended to the open file, cast a slice at a time: only one tensor (and a 4 MB cast slice) is held.
    """
    unwritable = set(dtypes.values()) - SAFETENSORS_DTYPES.keys()
    if unwritable:  # a source's own dtype (fp8) that weight_dtypes keeps
        raise ValueError(f"cannot write {', '.join(map(str, unwritable))} tensors: safetensors files here hold "
                         f"{', '.join(map(str, SAFETENSORS_DTYPES))}")
    if sys.byteorder != "little":  # safetensors stores little-endian bytes; the tensors' own bytes are written as is
        raise RuntimeError("writing safetensors files needs a little-endian machine")
    # Meta tensors: the split needs only sizes, so planning costs no memory.
    meta = {name: torch.empty(shape, dtype=dtypes[name], device="meta") for name, shape in shapes.items()}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=shard_size_in_bytes(max_shard_size))
    for filename, names in split.filename_to_tensors.items():
        with open(os.path.join(out_dir, filename), "wb") as f:
            f.write(_safetensors_header({name: (shapes[name], dtypes[name]) for name in names}))
            for name in names:
                # In a function of its own: no variable of this loop keeps the tensor (or a view of it) alive while
                # the next one loads.
                _append_tensor(f, name, load_tensor(name), shapes[name], dtypes[name])
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def _append_tensor(f, name: str, tensor: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    """Append `tensor`'s bytes in `dtype`, cast a slice at a time so that no cast copy of the whole tensor is held."""
    if tensor.shape != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    # A flat uint8 view (also of a 0-d tensor) exposes the bytes to write() without a copy.
    for piece in tensor.contiguous().reshape(-1).split(WRITE_CHUNK_ELEMENTS):
        f.write(piece.to(dtype).view(torch.uint8).numpy())


def _safetensors_header(tensors: dict[str, tuple[torch.Size, torch.dtype]]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding `tensors` (name: shape and dtype)
    contiguously, in order."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in tensors.items():
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # the format pads the header with spaces so that the tensor bytes start aligned
    return struct.pack("<Q", len(data)) + data


class WriteError(ConfigError):
    """An output that cannot be written (a full disk, a quota, a read-only folder); the message says what failed,
    the space left and what to do."""


# How a full disk (or a user's quota) fails a write.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
UNFINISHED_REMOVED = " (its unfinished folder removed)"


def space_left(path: str) -> str:
    """'1,234.5 MiB free on the file system of <path>', for an error about a write that failed; of the nearest
    folder above `path` that exists, where a full disk stopped its creation."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return f"{shutil.disk_usage(path).free / 2**20:,.1f} MiB free on the file system of {path}"


def write_failure(path: str, error: OSError, note: str = "") -> str:
    """The start of the error for a write of `path` that failed: what failed, the space left beside it (`note`
    after it, such as what was removed), and what to do (a permission or read-only error needs no room)."""
    parent = os.path.dirname(os.path.abspath(path))
    remedy = "make room" if error.errno in DISK_FULL else "fix what it names"
    return f"writing {path} failed ({type(error).__name__}: {error}), with {space_left(parent)}{note}: {remedy}"


def fsync(path: str) -> None:
    """Flush a file's contents, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        # Some file systems (SMB, some FUSE and Ceph mounts) cannot sync a folder; they keep its entries themselves.
        if not (os.path.isdir(path) and error.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Flush every file under `root` and every folder's entries to the disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync(os.path.join(folder, name))
        fsync(folder)


def replace_dir(tmp_dir: str, out_dir: str) -> None:
    """Move the finished `tmp_dir` to `out_dir`, replacing an older `out_dir` only once the new one is complete."""
    old_dir = out_dir.rstrip("/") + ".old"
    shutil.rmtree(old_dir, ignore_errors=True)  # left by a replace that was killed before its last line
    if os.path.exists(out_dir):
        os.replace(out_dir, old_dir)
    os.replace(tmp_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)


def write_model_files(model: PreTrainedModel, tokenizer, out_dir: str, dtype: torch.dtype) -> None:
    """config.json (recording `dtype`), generation_config.json, the tokenizer files, and the model's own code when it
    came with the checkpoint (trust_remote_code)."""
    unwrapped = model.module if isinstance(model, FSDP) else model
    # The folder records the dtype its files hold, not that of the master weights (fp32, or bf16 with pure_bf16).
    config = copy.deepcopy(model.config)
    set_config_dtype(config, dtype)
    # The class trained, as save_pretrained records it (vLLM picks its model class by this name); FSDP2 subclasses it.
    config.architectures = [next(c for c in type(unwrapped).__mro__ if not issubclass(c, FSDPModule)).__name__]
    set_use_cache(config, True)
    # config.json's own values of the settings the recipe config changed for training (model.load_model).
    config.update(getattr(unwrapped, "config_for_export", {}))
    config.save_pretrained(out_dir)  # with the config's own code, if any
    # The class that from_pretrained registered for its auto_map entry; FSDP2 subclasses it, FSDP1 wraps it.
    code_class = next((c for c in type(unwrapped).__mro__ if vars(c).get("_auto_class")), None)
    if code_class is not None:
        custom_object_save(code_class, out_dir)
    if model.generation_config is not None:
        generation_config = copy.deepcopy(model.generation_config)
        # Chat training ends each answer with the template's turn-closing token: generation must stop there too.
        closing = turn_closing_token_id(tokenizer)
        eos = generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if closing is not None and closing not in eos:
            generation_config.eos_token_id = eos + [closing]
        # As the checkpoint wrote it: save_pretrained would refuse settings from_pretrained accepted (a temperature
        # without do_sample), after the whole run.
        generation_config.to_json_file(os.path.join(out_dir, "generation_config.json"), use_diff=True)
    tokenizer.save_pretrained(out_dir)
    copy_processor_files(model.config.name_or_path, out_dir)


def set_config_dtype(config: PretrainedConfig, dtype: torch.dtype) -> None:
    """Record `dtype` in the config and in each of its sub-configs (a multimodal model's text_config, vision_config),
    which otherwise keep the dtype the model was loaded in."""
    config.dtype = dtype
    for key in config.sub_configs:
        sub_config = getattr(config, key, None)
        if isinstance(sub_config, PretrainedConfig):
            set_config_dtype(sub_config, dtype)


def copy_processor_files(source: str, out_dir: str) -> None:
    """Copy the processor files of the model folder (or hub id) the model was loaded from, where it has any.

    The files as they are rather than AutoProcessor's save: the processor's own tokenizer and chat template would
    overwrite the run's tokenizer files.
    """
    for path in processor_files(source):
        shutil.copy(path, out_dir)


@functools.cache  # looked up once per run, not at every checkpoint: a hub id costs a request per file
def processor_files(source: str) -> tuple[str, ...]:
    """Local paths of the processor files of a model folder or hub id (none for a model built from a config)."""
    if not source:
        return ()
    paths = (cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                         _raise_exceptions_for_connection_errors=False) for name in PROCESSOR_FILES)
    return tuple(path for path in paths if path is not None)


def save_hf_model(model: PreTrainedModel, tokenizer, out_dir: str, dtype: torch.dtype, max_shard_size="5GB") -> None:
    """Every rank takes part in the gather; rank 0 writes `out_dir` atomically.

    Tied weights are written once and reload tied. The folder is written under a temporary name and renamed when
    complete, so a crash never leaves a half-written model where a finished one is expected.
    """
    tmp_dir = out_dir.rstrip("/") + ".tmp"
    state_dict = gather_full_state_dict(model)

    def write():
        shutil.rmtree(tmp_dir, ignore_errors=True)
        try:
            write_gathered_weights(model, state_dict, tmp_dir, dtype, max_shard_size, original_layout=True)
            write_model_files(model, tokenizer, tmp_dir, dtype)
            # On disk before the rename: a node that crashes right after the run must not leave a folder of empty
            # files.
            fsync_tree(tmp_dir)
            replace_dir(tmp_dir, out_dir)
            fsync(os.path.dirname(os.path.abspath(out_dir)))
        except OSError as error:  # a full disk: the unfinished folder would keep the room the error asks for
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise WriteError(f"{write_failure(out_dir, error, UNFINISHED_REMOVED)}, then run again with "
                             f"--resume_from_checkpoint auto, which writes {os.path.basename(out_dir)}/ from the run's "
                             f"last checkpoint without training again (a run without --save_steps has none: it trains "
                             f"again)") from error

    run_on_rank0(write, f"to write {out_dir}")


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights (every rank calls this); on an accelerator they go to rank 0's CPU memory, one at a time."""
    # Decided by where the model computes, not where its parameters live: with CPU offload they are on the CPU, but
    # without cpu_offload every rank would gather the whole model onto its GPU. On a CPU-only run cpu_offload breaks
    # FSDP1 (a segfault, or "storage of size 0").
    on_accelerator = compute_device(model).type != "cpu"
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_accelerator))


def write_gathered_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: str, dtype: torch.dtype,
                           max_shard_size, original_layout: bool) -> None:
    """Rank 0 writes gather_full_state_dict's `state_dict` (emptied as it goes) into `out_dir`: in the original
    layout for an HF folder, in the model's own (what load_state_dict takes) for a training checkpoint. No
    collective."""
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        tied = tied_parameter_names(model)
        shapes = {name: t.shape for name, t in state_dict.items() if name not in tied}
        stored = {name: state_dict[name].dtype for name in shapes}
        load_tensor, model_names = state_dict.pop, None  # each tensor is freed once written

        def load_row(name: str, row: int) -> torch.Tensor:  # a source converted row by row: freed with its last row
            tensor = state_dict[name] if row + 1 < len(state_dict[name]) else state_dict.pop(name)
            return tensor[row:row + 1]

        if original_layout:
            layout = original_layout_of(model.module if isinstance(model, FSDP) else model, shapes)
            shapes, load_tensor, model_names = layout.shapes, layout.loader(load_tensor, load_row), layout.source
            stored = {name: stored[model_names[name]] for name in shapes}
        write_hf_weights(out_dir, shapes, weight_dtypes(model, stored, dtype, model_names), max_shard_size,
                         load_tensor)


class OriginalLayout:
    """Which tensors each of the model's tensors is saved as in its original layout, and a loader that converts
    one source tensor at a time (holding it and its converted copies only until they are written).

    A source converted row by row (a mixture of experts' fused experts, one row per expert: see converted_by_row)
    is read and converted one row at a time, its targets written row after row: one expert's matrices are held,
    not the fused tensor and all its copies."""

    def __init__(self, model: nn.Module, targets: dict[str, dict[str, torch.Size]],
                 by_row: dict[str, list[dict[str, str]]]):
        self.model, self.targets, self.by_row = model, targets, by_row
        # Grouped by source: a source's targets are written one after another, so it is loaded once.
        self.shapes = {name: shape for outputs in targets.values() for name, shape in outputs.items()}
        self.source = {name: source for source, outputs in targets.items() for name in outputs}
        self.row = {target: row for rows in by_row.values() for row, names in enumerate(rows)
                    for target in names.values()}

    def loader(self, load_source: Callable[[str], torch.Tensor],
               load_row: Callable[[str, int], torch.Tensor]) -> Callable[[str], torch.Tensor]:
        """`load_source(name)` gives a whole source tensor, `load_row(name, row)` its rows [row, row + 1)."""
        converted: dict[str, torch.Tensor] = {}

        def load(name: str) -> torch.Tensor:
            source = self.source[name]
            if list(self.targets[source]) == [source]:
                return load_source(source)
            if name not in converted:
                converted.clear()
                if source in self.by_row:
                    row = self.row[name]
                    names = self.by_row[source][row]
                    one_row = revert_weight_conversion(self.model, {source: load_row(source, row)})
                    converted.update({names[one]: tensor for one, tensor in one_row.items()})
                else:
                    converted.update(revert_weight_conversion(self.model, {source: load_source(source)}))
            return converted.pop(name)

        return load


def loaded_in_model_layout(model: nn.Module) -> bool:
    """Whether from_pretrained found the weights in transformers' own layout and converted none (as from a full
    checkpoint of this project, whose tensors are the model's): the export then keeps that layout, and a checkpoint
    records it for the converter, whose model built from the config would otherwise take transformers' defaults."""
    return getattr(model.module if isinstance(model, FSDP) else model, "_weight_conversions", None) == []


def original_layout_of(model: nn.Module, shapes: dict[str, torch.Size]) -> OriginalLayout:
    """transformers' reverse of the conversions it applies on load, planned on meta tensors one tensor at a time.
    A conversion that needs several tensors at once is not written converted: the model's own layout is kept."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    targets = {name: {target: t.shape for target, t in revert_weight_conversion(model, {name: tensor}).items()}
               for name, tensor in meta.items()}
    whole = {name: t.shape for name, t in revert_weight_conversion(model, meta).items()}
    if whole != {name: shape for outputs in targets.values() for name, shape in outputs.items()}:
        print(f"export: {type(model).__name__}'s original layout joins several tensors into one: its weights are "
              f"written in transformers' in-memory layout, which from_pretrained also loads", flush=True)
        return OriginalLayout(model, {name: {name: shape} for name, shape in shapes.items()}, {})
    by_row = {}
    for name, outputs in targets.items():
        rows = converted_by_row(model, name, meta[name], outputs) if list(outputs) != [name] else None
        if rows:
            by_row[name] = rows
            targets[name] = {target: outputs[target] for names in rows for target in names.values()}  # row by row
    return OriginalLayout(model, targets, by_row)


def converted_by_row(model: nn.Module, source: str, tensor: torch.Tensor, outputs: dict[str, torch.Size]
                     ) -> list[dict[str, str]] | None:
    """For each row of `source` (along its first dimension), which of `outputs` (its converted tensors) that row
    alone converts into: {name from a one-row conversion: name in outputs}. transformers splits a fused expert
    tensor into a module list, and names a one-row tensor's matrices as its first expert's (experts.0.gate_proj);
    row r's are the outputs named with that 0 replaced by r. None unless the rows' conversions make up exactly
    `outputs`, shapes included (a conversion that is not a split by rows: the source is converted whole)."""
    if tensor.dim() == 0 or len(tensor) < 2:
        return None
    one_row = {name: t.shape for name, t in revert_weight_conversion(model, {source: tensor[:1]}).items()}
    rows = []
    for row in range(len(tensor)):
        names = {}
        for name, shape in one_row.items():
            parts = name.split(".")
            found = {".".join([*parts[:i], str(row), *parts[i + 1:]]) for i, part in enumerate(parts) if part == "0"}
            found &= outputs.keys()
            if len(found) != 1 or outputs[next(iter(found))] != shape:
                return None
            names[name] = found.pop()
        rows.append(names)
    if sorted(target for names in rows for target in names.values()) != sorted(outputs):
        return None
    return rows
