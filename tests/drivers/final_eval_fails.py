"""A recipe's run whose evaluation runs out of memory (simulated): the run fails after the step's checkpoint is
saved, before its export. The arguments are the recipe's, after the recipe's path.

    python tests/drivers/final_eval_fails.py recipes/llama_sft.py --config ... --eval_fraction 0.1
"""

import runpy
import sys

import torch

from fsdp_recipes import trainer


def out_of_memory(*args):
    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


if __name__ == "__main__":
    trainer.evaluate = out_of_memory
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
