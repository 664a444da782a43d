"""Run the llama_sft recipe, with rank 1's logits NaN in its k-th optimizer step only, as a bad batch or a
numerical blow-up on one rank would make them.

    torchrun --nproc_per_node 2 tests/drivers/nan_on_rank1.py <k> <recipe args...>
"""

import math
import runpy
import sys

import torch.distributed as dist

import fsdp_recipes.trainer

k = int(sys.argv[1])
sys.argv = ["llama_sft.py", *sys.argv[2:]]
steps = {"count": 0}
forward_backward = fsdp_recipes.trainer.forward_backward


def nan_logits_in_kth_step(model, *args, **kwargs):
    steps["count"] += 1
    if steps["count"] != k or dist.get_rank() != 1:
        return forward_backward(model, *args, **kwargs)
    hook = model.get_output_embeddings().register_forward_hook(lambda module, inputs, output: output * math.nan)
    try:
        return forward_backward(model, *args, **kwargs)
    finally:
        hook.remove()


fsdp_recipes.trainer.forward_backward = nan_logits_in_kth_step

runpy.run_path("recipes/llama_sft.py", run_name="__main__")
