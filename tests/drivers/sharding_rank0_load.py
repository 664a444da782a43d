"""Rank-0 loading: how much memory each rank needs to load the model, and whether its shards equal the checkpoint.

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc_per_node 2 tests/drivers/sharding_rank0_load.py <out_dir> <args...>

Loads the model three times, each from a fresh start: FSDP2 and FSDP1 with fsdp_cpu_ram_efficient_loading, then
FSDP2 with every rank reading the weights (the contrast). For each it writes <out_dir>/<name>_rank<r>.json:
`peak_rss_increase` (bytes: the peak resident memory while loading, above the resident memory before it; the peak is
reset through /proc/self/clear_refs), `full_bytes` (the fp32 model) and `equal_to_checkpoint` (every parameter,
gathered from all ranks' shards, equals the checkpoint's tensor on this rank).
"""

import gc
import json
import os
import sys

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_recipes.config import parse_config
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.model import load_sharded_model
from fsdp_recipes.plan import resolve_plan


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


VARIANTS = {
    "fsdp2_rank0": ["--fsdp_version", "2", "--fsdp_cpu_ram_efficient_loading", "true"],
    "fsdp1_rank0": ["--fsdp_version", "1", "--fsdp_cpu_ram_efficient_loading", "true"],
    "fsdp2_every_rank": ["--fsdp_version", "2", "--fsdp_cpu_ram_efficient_loading", "false"],
}

out_dir, argv = sys.argv[1], sys.argv[2:]
with distributed() as env:
    checkpoint = None
    for name, flags in VARIANTS.items():
        cfg = parse_config(argv + flags + ["--mixed_precision", "no"])
        plan = resolve_plan(cfg)
        gc.collect()
        torch.distributed.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM) to the current one
        before = status_kib("VmRSS")
        model = load_sharded_model(cfg, plan, env.device)
        peak = status_kib("VmHWM")
        torch.distributed.barrier()

        if checkpoint is None:  # read after the measurements, for the comparison only
            checkpoint = {k: v.float() for k, v in load_file(os.path.join(cfg.model_name_or_path,
                                                                          "model.safetensors")).items()}
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # all-gathers the shards
        equal = set(full) == set(checkpoint) and all(torch.equal(full[k], checkpoint[k]) for k in checkpoint)
        record = {"peak_rss_increase": (peak - before) * 1024, "equal_to_checkpoint": equal,
                  "full_bytes": sum(t.numel() * 4 for t in checkpoint.values())}
        with open(os.path.join(out_dir, f"{name}_rank{env.rank}.json"), "w") as f:
            json.dump(record, f)
        del model, full
exit_process(0)
