"""Train a few steps with the recipe's machinery, export, and dump the gathered weights for the test to compare.

    torchrun --nproc_per_node 2 tests/drivers/export_check.py <out_dir> <recipe args...>

Writes <out_dir>/final_bf16 and <out_dir>/final_fp32 with save_hf_model, and <out_dir>/gathered.pt: every
parameter gathered with DTensor.full_tensor() (FSDP1: summon_full_params), a path independent of the exporter's
state-dict gather.
"""

import os
import sys

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fsdp_recipes.export import save_hf_model
from fsdp_recipes.config import parse_config
from fsdp_recipes.data import build_datasets
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.metrics import MetricsLogger
from fsdp_recipes.model import load_model, load_tokenizer
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import shard_model
from fsdp_recipes.trainer import train

out_dir, argv = sys.argv[1], sys.argv[2:]
cfg = parse_config(argv)
with distributed() as env:
    tokenizer = load_tokenizer(cfg)
    dataset = build_datasets(cfg, tokenizer)[0]
    model = load_model(cfg)
    model = shard_model(model, resolve_plan(cfg))
    train(cfg, env, model, tokenizer, dataset, MetricsLogger(cfg, env.is_main))
    if isinstance(model, FSDP):  # FSDP1: its own all-gather, also independent of the exporter's
        with FSDP.summon_full_params(model, writeback=False):
            gathered = {name.replace("_fsdp_wrapped_module.", ""): param.detach().clone()
                        for name, param in model.named_parameters()}
    else:
        gathered = {name: param.full_tensor().clone() for name, param in model.named_parameters()}
    save_hf_model(model, tokenizer, os.path.join(out_dir, "final_bf16"), torch.bfloat16)
    save_hf_model(model, tokenizer, os.path.join(out_dir, "final_fp32"), torch.float32)
    if env.is_main:
        torch.save(gathered, os.path.join(out_dir, "gathered.pt"))
exit_process(0)
