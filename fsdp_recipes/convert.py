"""Convert a sharded checkpoint to a Hugging Face folder, on CPU, without a process group:

    python -m fsdp_recipes.convert <output_dir>/checkpoint-<step> <out_dir> [--dtype bf16] [--max_shard_size 5GB]

It streams: each output file's safetensors header is planned from the DCP metadata alone, then its tensors are
loaded from the checkpoint one at a time, cast, and appended to the open file, so peak memory is about twice the
largest tensor (the tensor and the copy dcp.load reads it from), not one output file or the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint import STATE_NAME, CheckpointError, SafeFileSystemReader, read_dcp_metadata, validate_checkpoint
from .cli import run_main
from .export import replace_dir, write_hf_weights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def convert(checkpoint: str, out_dir: str, dtype: torch.dtype = torch.float32, max_shard_size="5GB") -> None:
    state = validate_checkpoint(checkpoint)
    if state["format"] != "sharded":
        raise CheckpointError(f"{checkpoint} is a full checkpoint: its folder already loads with from_pretrained")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} already exists and is not empty: choose a new output folder")
    model_dir = os.path.join(checkpoint, "model")
    metadata = read_dcp_metadata(model_dir)
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    tensors = {name: md for name, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    # The checkpoint holds a tied lm_head under both names; an HF folder holds it once and reloads it tied.
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)

    def load_tensor(name: str) -> torch.Tensor:
        # One dcp.load per tensor: it reads only that tensor's chunks, so memory holds one tensor (and its read copy).
        part = {name: torch.empty(tensors[name].size, dtype=tensors[name].properties.dtype)}
        dcp.load(part, storage_reader=SafeFileSystemReader(model_dir), no_dist=True)
        return part[name]

    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_hf_weights(tmp, {name: md.size for name, md in tensors.items()}, dtype, max_shard_size, load_tensor)
    # Tokenizer and generation config as saved with the checkpoint; config.json records the output dtype.
    for name in os.listdir(checkpoint):
        if os.path.isfile(os.path.join(checkpoint, name)) and name not in (STATE_NAME, "config.json"):
            shutil.copy(os.path.join(checkpoint, name), tmp)
    config.update(dtype=str(dtype).removeprefix("torch."), use_cache=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    replace_dir(tmp, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a sharded checkpoint-<step> folder")
    parser.add_argument("out_dir", help="the Hugging Face folder to write (must not exist yet)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the written weights")
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    args = parser.parse_args()
    convert(args.checkpoint, args.out_dir, DTYPES[args.dtype], args.max_shard_size)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    run_main(main)
