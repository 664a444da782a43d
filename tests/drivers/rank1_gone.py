"""A rank gone before the ranks' first wait on the long-wait group (exited 0, so that a launcher would let the others
run on): rank 0's run_on_rank0 must stop at once, not wait for it the group's day.

    RANK=<0 or 1> WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> python tests/drivers/rank1_gone.py
"""

import time

from fsdp_recipes.distributed import distributed, exit_process, run_on_rank0

with distributed() as env:
    if env.rank == 1:
        exit_process(0)
    start = time.monotonic()
    try:
        run_on_rank0(lambda: "written", "to write")
    except RuntimeError as error:
        print(f"rank 0 stopped after {time.monotonic() - start:.0f} s: {type(error).__name__}", flush=True)
    exit_process(0)
