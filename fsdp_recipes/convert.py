"""Convert a checkpoint to a Hugging Face folder, on CPU, without a process group:

    python -m fsdp_recipes.convert <output_dir>/checkpoint-<step> <out_dir> [--dtype bf16] [--max_shard_size 5GB]

A sharded checkpoint (DCP), or a full one: its folder loads with from_pretrained as it is, but in transformers'
in-memory layout, in fp32; the converter writes the original (Hub) layout, as final/ is, in the dtype asked for.
It streams: each output file's safetensors header is planned from the checkpoint's metadata alone, then its
tensors are read from the checkpoint one at a time (each stored chunk straight into the output tensor), cast, and
appended to the open file, so peak memory is about the largest tensor, not one output file or the whole model. A
mixture of experts' fused expert tensor is written as the per-expert matrices of the original (Hub) layout, read
and split one expert at a time.

The folder is written under `<out_dir>.converting-<random>` next to it and renamed to out_dir (absent or empty)
when complete and on disk (fsynced); a failure removes that folder, and nothing else is ever removed (a kill leaves
it, which the next conversion into out_dir names).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import io
import json
import os
import pickle
import shutil
import struct
import tempfile
import zipfile
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from safetensors import safe_open
from transformers import AutoConfig

from .checkpoint import (STATE_NAME, CheckpointError, SafeFileSystemReader, read_dcp_metadata, safetensors_files,
                         validate_checkpoint)
from .cli import run_main
from .config import shard_size_in_bytes
from .export import (DISK_FULL, INDEX_NAME, SAFETENSORS_DTYPES, UNFINISHED_REMOVED, fsync, fsync_tree,
                     original_layout_of, tied_parameter_names, weight_dtypes, write_failure, write_hf_weights)
from .flops import build_meta_model

# What a checkpoint folder holds for the resume only (see checkpoint.py), and config.json, written with the dtype.
CHECKPOINT_STATE = {STATE_NAME, "config.json", "model", "optimizer", "rng"}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def convert(checkpoint: str, out_dir: str, dtype: torch.dtype = torch.float32, max_shard_size="5GB") -> None:
    shard_size_in_bytes(max_shard_size)
    if not out_dir:  # an unset shell variable: the current folder would be the output
        raise CheckpointError("the output folder is an empty string: give a new folder's path")
    # Absolute and without a trailing slash, as the last rename sees it ("link/" names the folder a link points to).
    out_dir = os.path.abspath(out_dir)
    state = validate_checkpoint(checkpoint, parts=())  # optimizer/ and rng/ may have been removed to save space
    if os.path.commonpath([os.path.realpath(out_dir), os.path.realpath(checkpoint)]) == os.path.realpath(checkpoint):
        # The checkpoint's extra files are copied into the output: an output inside it would be copied into itself.
        raise CheckpointError(f"{out_dir} is inside the checkpoint {checkpoint}: choose an output folder outside it")
    if os.path.islink(out_dir):  # the finished folder is renamed onto out_dir, which would fail at the very end
        raise CheckpointError(f"{out_dir} is a symbolic link: give the folder it points to, "
                              f"{os.path.realpath(out_dir)}, or a new output folder")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir} already exists and is a file, not a folder: choose a new output folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} already exists and is not empty: choose a new output folder")
    if os.path.ismount(out_dir):  # the finished folder is renamed onto out_dir, which a mount point cannot take
        raise CheckpointError(f"{out_dir} is a mount point: give a new folder inside it, such as {out_dir}/hf")
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    report_killed_conversions(out_dir)
    tmp = make_own_folder(out_dir)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's folder is private (0700); the output is an ordinary folder
        write_hf_folder(checkpoint, state, config, tmp, dtype, max_shard_size)
        # On disk before the rename, and the rename after it: the checkpoint may be removed once out_dir is there.
        fsync_tree(tmp)
        os.replace(tmp, out_dir)  # onto an absent or empty out_dir only: a folder with files in it stops the rename
        fsync(os.path.dirname(out_dir))
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        # A full disk: OSError's own message names neither the folder nor what to do (a read error stays as it is).
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            raise CheckpointError(f"{write_failure(out_dir, error, UNFINISHED_REMOVED)} and convert again, or give "
                                  f"an output folder on another file system") from error
        raise


def report_killed_conversions(out_dir: str) -> None:
    """Name the folders of earlier conversions into out_dir that were killed (a failure removes its own): they hold
    part of a model's weights, which nothing uses. Not removed: another conversion into out_dir may still be
    writing one."""
    parent = os.path.dirname(out_dir)
    prefix = f"{os.path.basename(out_dir)}.converting-"
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        if name.startswith(prefix) and os.path.isdir(os.path.join(parent, name)):
            print(f"note: {os.path.join(parent, name)} is left by a conversion into {out_dir} that was killed: "
                  f"nothing uses it; remove it once no other conversion into {out_dir} runs", flush=True)


def make_own_folder(out_dir: str) -> str:
    """A new folder of its own next to out_dir (the last rename stays on one filesystem): nothing of the user's is
    ever removed (an out_dir.tmp or out_dir.old included); a failure removes this folder, a kill leaves it."""
    parent = os.path.dirname(out_dir)
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):  # makedirs' own error names the file, not the problem
        raise CheckpointError(f"{out_dir} cannot be created: {existing} is a file, not a folder: choose another "
                              f"output folder")
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(dir=parent, prefix=f"{os.path.basename(out_dir)}.converting-")
    except OSError as error:  # a read-only file system, a folder of another user's
        raise CheckpointError(f"cannot write in {parent} ({error.strerror}): choose an output folder where you "
                              f"can write") from error


def write_hf_folder(checkpoint: str, state: dict, config: dict, out_dir: str, dtype: torch.dtype,
                    max_shard_size) -> None:
    """Write the checkpoint's weights, model files and config.json (recording `dtype`) into the empty `out_dir`."""
    with contextlib.ExitStack() as open_files:
        if state["format"] == "sharded":
            shapes, stored, load_tensor, load_row = sharded_checkpoint_tensors(checkpoint)
        else:  # its fp32 safetensors, in the layout the resume loads
            shapes, stored, load_tensor, load_row = full_checkpoint_tensors(checkpoint, open_files)
        # The original (Hub) layout and the weights kept in fp32, as final/ is written; a model with its own code
        # (auto_map) is not built here: its floating-point weights are all written in `dtype`, as they are.
        model = model_names = None
        if "auto_map" not in config:
            model = build_meta_model(AutoConfig.from_pretrained(checkpoint))
        # A sharded checkpoint holds a tied weight under both names; an HF folder holds it once and reloads it tied.
        # The model's own ties, as final/ drops them: the output weight is not always lm_head (BioGPT's
        # output_projection, ModernBERT decoder's decoder).
        tied = (tied_parameter_names(model) if model is not None
                else {"lm_head.weight"} if config.get("tie_word_embeddings") else set())
        for name in tied:
            shapes.pop(name, None)
            stored.pop(name, None)
        if model is not None:
            if state.get("loaded_in_model_layout"):  # as final/ keeps the layout of a source in transformers' own
                model._weight_conversions = []
            layout = original_layout_of(model, shapes)
            shapes, load_tensor, model_names = layout.shapes, layout.loader(load_tensor, load_row), layout.source
            stored = {name: stored[model_names[name]] for name in shapes}
        write_hf_weights(out_dir, shapes, weight_dtypes(model, stored, dtype, model_names), max_shard_size,
                         load_tensor)
    # The model files as saved with the checkpoint (tokenizer, named chat templates in additional_chat_templates/,
    # processor files, generation config, the model's own code); config.json records the output dtype.
    for name in os.listdir(checkpoint):
        path = os.path.join(checkpoint, name)
        weights = name.endswith(".safetensors") or name == INDEX_NAME
        if name in CHECKPOINT_STATE or weights:
            continue
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(out_dir, name))
        else:
            shutil.copy(path, out_dir)
    set_config_dtype_in_json(config, str(dtype).removeprefix("torch."))
    for part in (config, config.get("text_config") or {}):  # as export.write_model_files: a multimodal model's too
        part["use_cache"] = True
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")  # as save_pretrained writes it


def set_config_dtype_in_json(config: dict, dtype: str) -> None:
    """export.set_config_dtype on a config.json's dict: a sub-config is a dict with a model_type of its own."""
    config["dtype"] = dtype
    for value in config.values():
        if isinstance(value, dict) and "model_type" in value:
            set_config_dtype_in_json(value, dtype)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sharded_checkpoint_tensors(checkpoint: str) -> tuple[dict[str, torch.Size], dict[str, torch.dtype],
                                                          Callable[[str], torch.Tensor],
                                                          Callable[[str, int], torch.Tensor]]:
    """The shapes and dtypes of the model's tensors in a DCP checkpoint, from its metadata alone, a loader of one,
    and a loader of one of its rows (along dim 0)."""
    model_dir = os.path.join(checkpoint, "model")
    metadata = read_dcp_metadata(model_dir)
    tensors = {name: md for name, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    stored = {(index.fqn, tuple(index.offset)): info for index, info in metadata.storage_data.items()}
    chunks = {name: [(chunk, stored[name, tuple(chunk.offsets)]) for chunk in md.chunks]
              for name, md in tensors.items()}

    def load_tensor(name: str) -> torch.Tensor:
        tensor = torch.empty(tensors[name].size, dtype=tensors[name].properties.dtype)
        if not all(read_chunk_into(tensor, 0, chunk, info, model_dir) for chunk, info in chunks[name]):
            # A layout read_chunk_into does not handle: dcp.load reads this tensor alone (and holds a second copy).
            part = {name: tensor}
            dcp.load(part, storage_reader=SafeFileSystemReader(model_dir), no_dist=True)
        return tensor

    whole: dict[str, torch.Tensor] = {}

    def load_row(name: str, row: int) -> torch.Tensor:
        if name not in whole:
            tensor = torch.empty((1, *tensors[name].size[1:]), dtype=tensors[name].properties.dtype)
            holding = [(chunk, info) for chunk, info in chunks[name]
                       if chunk.offsets[0] <= row < chunk.offsets[0] + chunk.sizes[0]]
            if all(read_chunk_into(tensor, row, chunk, info, model_dir) for chunk, info in holding):
                return tensor
            whole[name] = load_tensor(name)  # a layout read_chunk_into does not handle: read once for all its rows
        tensor = whole[name] if row + 1 < len(whole[name]) else whole.pop(name)  # freed with its last row
        return tensor[row:row + 1]

    shapes = {name: md.size for name, md in tensors.items()}
    return shapes, {name: md.properties.dtype for name, md in tensors.items()}, load_tensor, load_row


def full_checkpoint_tensors(checkpoint: str, open_files: contextlib.ExitStack
                            ) -> tuple[dict[str, torch.Size], dict[str, torch.dtype], Callable[[str], torch.Tensor],
                                       Callable[[str, int], torch.Tensor]]:
    """The shapes and dtypes of a full checkpoint's tensors, from its safetensors headers, a loader of one and a
    loader of one of its rows (mmap)."""
    owner, shapes, stored = {}, {}, {}
    dtype_of = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
    for file in safetensors_files(checkpoint):
        handle = open_files.enter_context(safe_open(file, "pt"))
        for name in handle.keys():
            header = handle.get_slice(name)
            owner[name], shapes[name] = handle, torch.Size(header.get_shape())
            stored[name] = dtype_of[header.get_dtype()]
    return (shapes, stored, lambda name: owner[name].get_tensor(name),
            lambda name, row: owner[name].get_slice(name)[row:row + 1])


def read_chunk_into(tensor: torch.Tensor, first_row: int, chunk, info, model_dir: str) -> bool:
    """Read the rows of one stored chunk (`chunk`: a slice along dim 0 of a tensor) that fall in `tensor`, which
    holds the tensor's rows from `first_row` on (a 0-d tensor: all of it), straight into its bytes.

    DCP stores each chunk as a torch.save zip archive at `info.offset` of a data file; the chunk's storage is one
    uncompressed record in it. Reading that record into the destination directly, without rebuilding the tensor
    (its pickle is read for its strides alone), keeps one copy of the tensor in memory instead of two. Returns False
    (nothing read) for any other layout, a tensor stored with other strides (a transposed one) included.
    """
    if getattr(info, "transform_descriptors", None) or any(chunk.offsets[1:]) or chunk.sizes[1:] != tensor.shape[1:]:
        return False
    with open(os.path.join(model_dir, info.relative_path), "rb") as f:
        try:
            archive = zipfile.ZipFile(_FileSlice(f, info.offset, info.length))
            records = archive.infolist()
            # The storage's bytes are in the tensor's order only if it is stored contiguous.
            if not _stored_contiguous(archive.read(next(r for r in records if r.filename.endswith("/data.pkl")))):
                return False
        except (zipfile.BadZipFile, StopIteration):
            return False
        storage = [r for r in records if "/data/" in r.filename]
        if len(storage) != 1 or storage[0].compress_type != zipfile.ZIP_STORED:
            return False
        record = storage[0]
        rows = tensor.reshape(len(tensor) if tensor.dim() else 1, -1)
        start, count = (chunk.offsets[0], chunk.sizes[0]) if tensor.dim() else (0, 1)
        row_bytes = rows[0].numel() * tensor.element_size() if rows.numel() else 0
        if not row_bytes or record.file_size != count * row_bytes:
            return False
        first, end = max(start, first_row), min(start + count, first_row + len(rows))  # the rows read
        if end <= first:  # FSDP2 gives the ranks past a tensor's last row an empty shard: nothing to read
            return True
        # The record's data follows its 30-byte local header, file name and extra field.
        f.seek(info.offset + record.header_offset)
        header = f.read(30)
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        f.seek(info.offset + record.header_offset + 30 + name_length + extra_length + (first - start) * row_bytes)
        target = rows[first - first_row:end - first_row]
        return f.readinto(memoryview(target.view(torch.uint8).numpy()).cast("B")) == (end - first) * row_bytes


def _stored_contiguous(data_pkl: bytes) -> bool:
    """Whether a torch.save record's tensor (its data.pkl) starts its storage and is laid out row-major in it. Only
    its offset, shape and strides are read: nothing is rebuilt (any other content: False)."""
    try:
        offset, size, stride = _TensorLayout(io.BytesIO(data_pkl)).load()
    except (pickle.UnpicklingError, TypeError, ValueError):
        return False
    return offset == 0 and torch.empty_strided(size, stride, device="meta").is_contiguous()


class _TensorLayout(pickle.Unpickler):
    """Unpickles a plain tensor's data.pkl into (storage offset, shape, strides); any other class is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (offset, size, stride)
        if (module, name) == ("collections", "OrderedDict"):  # the tensor's (empty) backward hooks
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):  # the storage's type, in its persistent id
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return None  # the storage itself, which is read straight from its record instead


class _FileSlice(io.RawIOBase):
    """The bytes [start, start + length) of an open file, as a seekable file of their own (for zipfile)."""

    def __init__(self, file, start: int, length: int):
        self.file, self.start, self.length, self.position = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(base + position, 0), self.length)
        return self.position

    def readinto(self, buffer) -> int:
        size = min(len(buffer), self.length - self.position)
        self.file.seek(self.start + self.position)
        read = self.file.readinto(memoryview(buffer)[:size])
        self.position += read
        return read


def keep_tensors_in_their_own_mappings() -> None:
    """glibc raises its mmap threshold after each large free; tensors under the raised threshold then come from the
    heap, which keeps their memory after they are freed (tens of MB here). A fixed 1 MB threshold gives every
    tensor above it a mapping of its own, returned to the system when the tensor is freed. Not glibc: nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 20)  # -3: M_MMAP_THRESHOLD


def main() -> None:
    # Named as the README runs it: argparse alone would name the file, which no command runs.
    parser = argparse.ArgumentParser(f"python -m {__spec__.name}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint-<step> folder (sharded or full)")
    parser.add_argument("out_dir", help="the Hugging Face folder to write (absent or empty)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="dtype of the written weights (default fp32: the master weights exactly; bf16 halves "
                             "the folder)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB or 4GiB")
    args = parser.parse_args()
    keep_tensors_in_their_own_mappings()
    convert(args.checkpoint, args.out_dir, DTYPES[args.dtype], args.max_shard_size)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    run_main(main)
