"""A recipe's run whose W&B run takes 3 s to finish (an upload over a slow network); rank 0 writes
`<output_dir>/wandb_finished` once it has. W&B writes its offline files beside output_dir. The arguments are the
recipe's, after the recipe's path.

    torchrun --nproc_per_node 2 tests/drivers/slow_wandb_finish.py recipes/llama_sft.py --report_to wandb ...
"""

import os
import runpy
import sys
import time

from wandb.sdk.wandb_run import Run

finish = Run.finish


def slow_finish(run, *args, **kwargs):
    time.sleep(3)
    finish(run, *args, **kwargs)
    output_dir = sys.argv[sys.argv.index("--output_dir") + 1]
    with open(os.path.join(output_dir, "wandb_finished"), "w") as f:
        f.write(str(kwargs.get("exit_code")))


if __name__ == "__main__":
    Run.finish = slow_finish
    sys.argv = sys.argv[1:]
    os.environ["WANDB_DIR"] = os.path.dirname(os.path.abspath(sys.argv[sys.argv.index("--output_dir") + 1]))
    runpy.run_path(sys.argv[0], run_name="__main__")
