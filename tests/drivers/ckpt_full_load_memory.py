"""Each rank's memory while the weights of a full checkpoint load into the sharded model, for FSDP1 and FSDP2.

    torchrun --nproc_per_node 2 tests/drivers/ckpt_full_load_memory.py <work_dir>

For each engine: a Llama of 8 equal decoder layers is sharded and its full checkpoint weights written (fp32
safetensors, as a full checkpoint holds them); the weights are then changed, the kernel's peak-RSS counter reset
(/proc/self/clear_refs), and the checkpoint loaded. Writes <work_dir>/rank_<r>.json: the model's bytes, and per
engine the peak RSS above the RSS before the load and whether every weight came back.
"""

import gc
import json
import os
import sys
import threading
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_recipes.checkpoint import load_model_weights
from fsdp_recipes.config import TrainConfig
from fsdp_recipes.convert import keep_tensors_in_their_own_mappings
from fsdp_recipes.distributed import distributed, exit_process
from fsdp_recipes.export import gather_full_state_dict, write_gathered_weights
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import shard_model


def anon_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


class PeakAnonymousMemory(threading.Thread):
    """The largest anonymous memory (RssAnon: tensors, not the file pages safetensors maps) polled every ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = anon_mb(), threading.Event()

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, anon_mb())
            time.sleep(0.001)

    def stop(self) -> float:
        self.done.set()
        self.join()
        return max(self.peak, anon_mb())


work_dir = sys.argv[1]
keep_tensors_in_their_own_mappings()  # a freed tensor leaves the RSS at once: each load's growth is its own
config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
full = StateDictOptions(full_state_dict=True)
result = {}
with distributed() as env:
    for fsdp_version in (1, 2):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        result["model_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        cfg = TrainConfig(model_name_or_path="m", dataset_name="d", mixed_precision="no", fsdp_version=fsdp_version)
        model = shard_model(model, resolve_plan(cfg), env.device)
        folder = os.path.join(work_dir, f"fsdp{fsdp_version}")
        # The model files of a checkpoint of each format, as save_checkpoint writes them.
        write_gathered_weights(model, gather_full_state_dict(model), folder, torch.float32, "5GB", original_layout=False)
        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(folder, "model"))
        saved = get_model_state_dict(model, options=full)
        for fmt in ("full", "sharded"):
            with torch.no_grad():
                for param in model.parameters():
                    param.zero_()
            gc.collect()
            torch.distributed.barrier()
            before = anon_mb()
            peak = PeakAnonymousMemory()
            peak.start()
            load_model_weights(folder, fmt, model)
            extra = peak.stop() - before
            loaded = get_model_state_dict(model, options=full)
            result[f"fsdp{fsdp_version} {fmt}"] = {"extra_mb": extra,
                                                   "equal": all(torch.equal(loaded[k], saved[k]) for k in saved)}
            del loaded
        del model, saved
        gc.collect()
    with open(os.path.join(work_dir, f"rank_{env.rank}.json"), "w") as f:
        json.dump(result, f)
exit_process(0)
