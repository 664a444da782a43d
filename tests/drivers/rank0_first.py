"""on_rank0_first and run_on_rank0 wait, however long, on a group of their own: the training collectives' timeout
is short.

    torchrun --nproc_per_node 2 tests/drivers/rank0_first.py <seconds of slow work> <training group timeout>

Rank 1 builds slowly (as a node whose datasets cache is on its own disk tokenizes again); then rank 0 works alone
as long (as it downloads or writes a large model). After each, a barrier on a group with the short timeout must
pass: no rank may have gone on to it alone. Then rank 0's work fails: every rank must stop with its error. Last,
rank 1 dies in its own build (exiting 0, so that the launcher lets rank 0 run on): rank 0 must stop at once.
"""

import sys
import time
from datetime import timedelta

import torch.distributed as dist

from fsdp_recipes.data import on_rank0_first
from fsdp_recipes.distributed import FailedOnRank0, exit_process, run_on_rank0

slow_seconds, timeout_seconds = float(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo")  # the default timeout: the ranks start (import) at their own pace
training = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
rank = dist.get_rank()
built = on_rank0_first(lambda: time.sleep(slow_seconds if rank == 1 else 0) or f"built by rank {rank}")
dist.barrier(group=training)
print(f"rank {rank}: {built}, past the training group's barrier", flush=True)
written = run_on_rank0(lambda: time.sleep(slow_seconds) or "written", "to write")
dist.barrier(group=training)
print(f"rank {rank}: {written} by rank 0, past the training group's barrier", flush=True)
try:
    run_on_rank0(lambda: 1 / 0, "to divide")
except (ZeroDivisionError, FailedOnRank0) as error:
    print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
try:
    on_rank0_first(lambda: exit_process(0) if rank == 1 else "built")
except RuntimeError as error:
    print(f"rank {rank}: stopped when rank 1 died: {type(error).__name__}", flush=True)
exit_process(0)
