"""Run the llama_sft recipe, and SIGKILL a rank at a chosen point, as a crash, a pre-emption or the OOM killer would.

    torchrun --nproc_per_node 2 tests/drivers/ckpt_kill.py <mode> <k> <recipe args...>

after_checkpoint: rank 1 dies right after its k-th checkpoint is complete.
during_save: rank 1 dies inside the k-th save, after writing its model shards and before the rename.
in_removal: rank 0 dies in the k-th removal of a sharded checkpoint (retention's, overwrite_output_dir's), once
    its model/ is removed.
in_samples: rank 0 dies while it writes the samples, their first bytes on disk (k is not used).
in_convert: runs the converter instead (`python -m fsdp_recipes.convert <args...>`), which dies once its weights are
    written, before its folder is renamed (k is not used).
"""

import os
import shutil
import signal
import sys

import torch.distributed as dist

import fsdp_recipes.checkpoint
import fsdp_recipes.convert
import fsdp_recipes.metrics
import fsdp_recipes.trainer

mode, k = sys.argv[1], int(sys.argv[2])
sys.argv = ["llama_sft.py", *sys.argv[3:]]
saves = {"count": 0}


def kill_rank(rank: int) -> None:
    if dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)


if mode == "after_checkpoint":
    save_checkpoint = fsdp_recipes.trainer.save_checkpoint

    def save_then_kill(*args, **kwargs):
        path = save_checkpoint(*args, **kwargs)
        saves["count"] += 1
        if saves["count"] == k:
            kill_rank(1)
        return path

    fsdp_recipes.trainer.save_checkpoint = save_then_kill
elif mode == "during_save":
    get_optimizer_state_dict = fsdp_recipes.checkpoint.get_optimizer_state_dict

    def kill_in_kth_save(*args, **kwargs):
        # Called once per save, after the model shards are written and before the optimizer's.
        saves["count"] += 1
        if saves["count"] == k:
            kill_rank(1)
        return get_optimizer_state_dict(*args, **kwargs)

    fsdp_recipes.checkpoint.get_optimizer_state_dict = kill_in_kth_save
elif mode == "in_removal":
    rmtree = shutil.rmtree

    def kill_in_kth_removal(path, *args, **kwargs):
        # A checkpoint's removal (in whatever form it is removed), half done.
        if os.path.isdir(os.path.join(path, "model")):
            saves["count"] += 1
            if saves["count"] == k:
                rmtree(os.path.join(path, "model"))
                kill_rank(0)
        return rmtree(path, *args, **kwargs)

    shutil.rmtree = kill_in_kth_removal
elif mode == "in_samples":
    def open_then_kill(file, open_mode="r", *args, **kwargs):
        f = open(file, open_mode, *args, **kwargs)
        if os.path.basename(file).startswith("samples.jsonl") and "w" in open_mode:
            f.write('{"prompt": ')
            f.flush()
            kill_rank(0)
        return f

    fsdp_recipes.metrics.open = open_then_kill  # the module's own open, before the builtin
elif mode == "in_convert":
    fsdp_recipes.convert.fsync_tree = lambda root: os.kill(os.getpid(), signal.SIGKILL)
    fsdp_recipes.convert.run_main(fsdp_recipes.convert.main)
else:
    sys.exit(f"unknown mode {mode}")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipes"))
from llama_sft import main  # noqa: E402
from fsdp_recipes.cli import run_main  # noqa: E402

run_main(main)
