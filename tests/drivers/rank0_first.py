"""on_rank0_first waits for every rank's build, however long, on its own group: the training collectives' timeout
is short.

    torchrun --nproc_per_node 2 tests/drivers/rank0_first.py <seconds rank 1 builds> <training group timeout>

Rank 1 builds slowly (as a node whose datasets cache is on its own disk tokenizes again). After on_rank0_first,
a barrier on a group with the short timeout must pass: rank 0 must not have gone on to it alone.
"""

import sys
import time
from datetime import timedelta

import torch.distributed as dist

from fsdp_recipes.data import on_rank0_first
from fsdp_recipes.distributed import exit_process

slow_seconds, timeout_seconds = float(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo")  # the default timeout: the ranks start (import) at their own pace
training = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
rank = dist.get_rank()
built = on_rank0_first(lambda: time.sleep(slow_seconds if rank == 1 else 0) or f"built by rank {rank}")
dist.barrier(group=training)
print(f"rank {rank}: {built}, past the training group's barrier", flush=True)
dist.destroy_process_group()
exit_process(0)
