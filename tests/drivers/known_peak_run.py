"""Run a recipe as on a GPU whose peak FLOP/s the project knows (H100, H200, A100, L40S), so that the trainer counts
the model's FLOPs and logs `mfu` on the CPU too: the path every such GPU run takes at its first logged step.

    python tests/drivers/known_peak_run.py <peak FLOP/s> <recipe> <recipe args...>
"""

import runpy
import sys

import fsdp_recipes.trainer

peak, recipe, sys.argv = float(sys.argv[1]), sys.argv[2], sys.argv[2:]
fsdp_recipes.trainer.peak_flops = lambda device: peak
runpy.run_path(recipe, run_name="__main__")  # the recipe's run_main exits the process
