"""Run a recipe's own main(), and record what the sharded model holds just before it exports.

    torchrun --nproc_per_node 2 tests/drivers/recipe_check.py <recipe.py> <out_dir> <recipe args...>

The recipe runs unchanged; only its save_hf_model is wrapped to first write <out_dir>/sharded.pt (rank 0): every
parameter gathered with DTensor.full_tensor() (independent of the exporter's state-dict gather), this rank's
local shape of each parameter, and the sharded model's logits on fixed inputs (FSDP2 only); with FSDP1, each rank writes
<out_dir>/buffers_rank<r>.json, its one-element buffers' values (the export reads rank 0's alone). Its
log_sample_generations is wrapped to first write <out_dir>/at_generation.json (rank 0): how many FSDP2 modules and
FSDP1 flat parameters are still alive then.
"""

import gc
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._flat_param import FlatParameter
from torch.distributed.tensor import DTensor

from fsdp_recipes.sharding import state_dict_name

recipe_path, out_dir = sys.argv[1], sys.argv[2]
sys.argv = [recipe_path, *sys.argv[3:]]
spec = importlib.util.spec_from_file_location("recipe", recipe_path)
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)
export = recipe.save_hf_model
generate = recipe.log_sample_generations


def record_then_export(model, tokenizer, path, dtype, *args):
    if not isinstance(next(model.parameters()), DTensor):  # FSDP1: each rank's scalar buffers (Gemma 4's layer_scalar)
        scalars = {state_dict_name(name): b.item() for name, b in model.named_buffers() if b.numel() == 1}
        with open(os.path.join(out_dir, f"buffers_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(scalars, f)
        return export(model, tokenizer, path, dtype, *args)
    gathered = {name: param.full_tensor().clone() for name, param in model.named_parameters()}
    local_shapes = {name: tuple(param.to_local().shape) for name, param in model.named_parameters()}
    inputs = torch.randint(5, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    model.train()
    if dist.get_rank() == 0:
        torch.save({"gathered": gathered, "local_shapes": local_shapes, "inputs": inputs, "logits": logits},
                   os.path.join(out_dir, "sharded.pt"))
    export(model, tokenizer, path, dtype, *args)


def record_then_generate(*args):
    # gc.get_objects also lists objects in reference cycles that the collector has not freed yet.
    live = sum(isinstance(o, (FSDPModule, FlatParameter)) for o in gc.get_objects())
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "at_generation.json"), "w") as f:
            json.dump({"live_fsdp_objects": live}, f)
    generate(*args)


recipe.save_hf_model = record_then_export
recipe.log_sample_generations = record_then_generate
recipe.run_main(recipe.main)
