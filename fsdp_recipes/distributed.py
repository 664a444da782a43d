"""Process group set-up and a deterministic shutdown, for every launcher.

`accelerate launch`, `torchrun` and a plain `python` all end up here: the launchers set RANK, WORLD_SIZE and
LOCAL_RANK, a plain run gets a one-process group so that the same FSDP code runs in every case.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, NoReturn, Optional, TypeVar

import torch
import torch.distributed as dist

from .config import ConfigError
from .plan import TRUE

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistEnv:
    check_started_by_a_launcher()
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # `accelerate launch --cpu` (one process): the CPU even where there is a GPU. The *_cpu.yaml configs hide the
    # GPUs instead (gpu_ids ""), because accelerate's FSDP launcher does not pass use_cpu on.
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "false").strip().lower() in TRUE  # accelerate's truth values
    if torch.cuda.is_available() and not use_cpu:
        check_a_gpu_per_process(local_rank, torch.cuda.device_count())
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo beside nccl: CPU tensors (offloaded state, object collectives) need a CPU backend too.
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        if rank == 0:
            warn_if_gpus_are_missing(use_cpu)
    timeout = timedelta(minutes=30)  # for training collectives; long_wait_group's for waits of varying length
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        # No launcher: a one-process group in memory, so no port is taken.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    long_wait_group()
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def warn_if_gpus_are_missing(use_cpu: bool) -> None:
    """A CUDA build of torch that sees no GPU, though nothing hid them: on a GPU node (a driver that failed, a job
    given no GPU) the run would go on, ranks and all, on the CPU. The *_cpu.yaml configs and `--cpu` choose it."""
    if use_cpu or not torch.backends.cuda.is_built() or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return
    print(f"warning: torch is built with CUDA {torch.version.cuda} but sees no GPU: this run trains on the CPU "
          f"(gloo). On a GPU node, check that its GPUs are visible (nvidia-smi, CUDA_VISIBLE_DEVICES "
          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); to train on the CPU on purpose, launch a *_cpu.yaml "
          f"accelerate config or set CUDA_VISIBLE_DEVICES=\"\"", file=sys.stderr, flush=True)


def check_a_gpu_per_process(local_rank: int, gpus: int) -> None:
    """A node that starts more processes than it has GPUs: say which setting counts them, not 'invalid device
    ordinal' from CUDA."""
    if local_rank >= gpus:
        raise ConfigError(f"local rank {local_rank} has no GPU: this node shows {gpus} (CUDA_VISIBLE_DEVICES hides "
                          f"the others), and its launcher started more processes. Start one process per GPU: "
                          f"accelerate's num_processes counts every node's processes (num_machines x GPUs per node), "
                          f"torchrun's --nproc_per_node one node's")


def check_started_by_a_launcher() -> None:
    """One of several tasks that SLURM or MPI started without a launcher (`srun --ntasks-per-node 8 python
    recipe.py`) has no RANK: each would train alone, all into the same output_dir."""
    tasks = {"SLURM_STEP_NUM_TASKS": "SLURM job step", "OMPI_COMM_WORLD_SIZE": "MPI job", "PMI_SIZE": "MPI job"}
    for var, what in tasks.items():
        if "RANK" not in os.environ and int(os.environ.get(var, 1)) > 1:
            raise ConfigError(f"this process is one of the {os.environ[var]} tasks of a {what} ({var}), started "
                              f"without a launcher: each would train alone, into the same output_dir. Run one task "
                              f"per node that starts the node's processes with accelerate launch or torchrun "
                              f"(slurm/sft_multinode.sbatch runs slurm/launch_node.sh so)")


@contextlib.contextmanager
def distributed():
    """Yield a DistEnv; when the work succeeds, every rank leaves together and the process groups are destroyed.

    Without the final barrier and destroy, a gloo rank can abort at interpreter exit ("terminate called without an
    active exception") after all the work is done, and the launcher reports the whole run as failed.
    """
    env = init_distributed()
    # Only on success: after an error another rank may be stuck in a collective, and destroying an NCCL group then
    # can block before the error is printed (cli.run_main prints it and ends the process).
    yield env
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    dist.destroy_process_group()


_long_wait: tuple = (None, None)  # (the default group it was made in, the group)


def long_wait_group() -> dist.ProcessGroup:
    """A gloo group with a one-day timeout, for waits whose length varies by rank: the default group's 30 minutes are
    meant for training collectives. Made once, at init_distributed, while every rank is at the same place, then
    reused: a group made later would wait a day for a rank that died before joining it, where a rank that dies
    during a wait on this one closes its connections and the others stop at once."""
    global _long_wait
    if _long_wait[0] is not dist.group.WORLD:
        _long_wait = (dist.group.WORLD, dist.new_group(backend="gloo", timeout=timedelta(days=1)))
    return _long_wait[1]


class FailedOnRank0(Exception):
    """Raised on the other ranks when rank 0's run_on_rank0 work failed with an error other than a ConfigError: rank
    0 prints its traceback, they one line saying so, and every rank exits 1 (2 is a config error's)."""


def run_on_rank0(work: Callable[[], T], what: str) -> Optional[T]:
    """Rank 0 runs `work` alone (a download, writing a large folder, generating) while the other ranks wait for it
    on the long_wait_group; returns its result on rank 0, None elsewhere.

    Rank 0's work alone can outlast the default group's 30 minutes (a 70B model is 141 GB to download or to write).
    If rank 0 fails, every rank stops with its error instead of timing out in the next collective.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    group = long_wait_group()
    failure: list[Optional[tuple[bool, str]]] = [None]  # (a config error, its message)
    result = None
    if dist.get_rank() == 0:
        try:
            result = work()
        except Exception as error:
            config_error = isinstance(error, ConfigError)
            failure[0] = (config_error, str(error) if config_error else f"rank 0 failed {what}: {error!r}")
            dist.broadcast_object_list(failure, src=0, group=group)
            raise
    dist.broadcast_object_list(failure, src=0, group=group)
    if failure[0] is not None:
        config_error, message = failure[0]
        raise ConfigError(message) if config_error else FailedOnRank0(message)
    return result


# What a shell reports for a process that SIGTERM ended, and what SLURM requeue scripts test for a pre-empted job.
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class StoppedBySigterm(Exception):
    """Raised out of train() on every rank at the same step once a SIGTERM reached any rank; the message says what
    was saved. run_main prints it on rank 0 and exits SIGTERM_EXIT_CODE."""


class RunComplete(Exception):
    """Raised on every rank by a resume with `auto` that finds output_dir's run complete; run_main prints the message
    on rank 0 and exits 0: a job requeued after its run finished (a pre-emption during the W&B upload) must not fail."""


class SigtermNote:
    """A SIGTERM handler that only notes the signal: a handler cannot run collectives, so the training loop reads
    `received` and stops all ranks at a step boundary.

    SLURM signals every process of the job at once, the launcher (torchrun, accelerate launch) too, which forwards its
    own SIGTERM to each rank a moment later: a repeat within SAME_STOP_S of the first is that same stop. A later one
    ends the process, as without this handler.
    """

    SAME_STOP_S = 5.0

    def __init__(self) -> None:
        self.first_at: Optional[float] = None

    @property
    def received(self) -> bool:
        return self.first_at is not None

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        elif now - self.first_at > self.SAME_STOP_S:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def sigterm_noted() -> Iterator[SigtermNote]:
    """Note SIGTERM instead of dying of it inside the block; the previous handler is back after it."""
    note = SigtermNote()
    previous = signal.signal(signal.SIGTERM, note)
    try:
        yield note
    finally:
        # None: a handler installed outside Python, which signal.signal cannot reinstall.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def exit_process(code: int = 0) -> NoReturn:
    """End the process at once, once its work is done and the process group destroyed.

    This skips the interpreter's teardown, where gloo's worker threads can still abort a finished process
    ("terminate called without an active exception", exit -6) and fail the whole launch.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def print_rank0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def ranks(count: int) -> str:
    """'1 rank', '2 ranks': a one-process run reads as one in the messages."""
    return f"{count} rank{'s' if count != 1 else ''}"


def on_each_rank(count: int) -> str:
    """'on 1 rank', 'on each of 2 ranks'."""
    return f"on {'each of ' if count > 1 else ''}{ranks(count)}"
