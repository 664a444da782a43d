"""on_rank0_first over 2 nodes of 2 processes (two torchrun launchers on this machine): rank 0 builds alone, then
the first process of the other node alone, then the other two. Each build writes when it started and ended.

    torchrun --nnodes 2 --node_rank N --nproc_per_node 2 ... tests/drivers/node_first.py <log file>
"""

import json
import os
import sys
import time

import torch.distributed as dist

from fsdp_recipes.data import on_rank0_first
from fsdp_recipes.distributed import exit_process


def build():
    start = time.time()
    time.sleep(1)
    with open(sys.argv[1], "a") as log:
        log.write(json.dumps({"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]), "start": start,
                              "end": time.time()}) + "\n")


dist.init_process_group("gloo")
on_rank0_first(build)
exit_process(0)
