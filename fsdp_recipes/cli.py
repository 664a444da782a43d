"""Entry point of every recipe: a config mistake ends the run with one clear line, an error on any rank is printed
at once, and every run exits cleanly."""

from __future__ import annotations

import sys
import traceback
from typing import Callable, NoReturn

import torch.distributed as dist

from .config import ConfigError
from .distributed import SIGTERM_EXIT_CODE, FailedOnRank0, RunComplete, StoppedBySigterm, exit_process


def run_main(main: Callable[[], None]) -> NoReturn:
    try:
        main()
    except ConfigError as error:
        # One write per line: every rank reports the same error, and print's separate newline write interleaves.
        sys.stderr.write(f"error: {error}\n")
        _finish_wandb(exit_code=2)
        exit_process(2)
    except RunComplete as done:
        if not dist.is_initialized() or dist.get_rank() == 0:
            sys.stdout.write(f"{done}\n")
        exit_process(0)
    except StoppedBySigterm as stop:  # every rank stopped after the same step; rank 0 says what was saved
        if not dist.is_initialized() or dist.get_rank() == 0:
            sys.stderr.write(f"{stop}\n")
        _finish_wandb(exit_code=SIGTERM_EXIT_CODE)
        if dist.is_initialized():
            # A rank's exit makes its launcher stop the others at once: rank 0's W&B upload would be cut off.
            dist.barrier()
        exit_process(SIGTERM_EXIT_CODE)
    except FailedOnRank0 as error:  # rank 0 prints the traceback
        sys.stderr.write(f"error: {error}\n")
        _finish_wandb(exit_code=1)
        exit_process(1)
    except Exception:
        # Printed before anything that could block (a collective, destroying an NCCL group another rank is stuck in).
        traceback.print_exc()
        _finish_wandb(exit_code=1)
        exit_process(1)
    exit_process(0)


def _finish_wandb(exit_code: int) -> None:
    """exit_process skips wandb's teardown: a W&B run already started would be left running, then crashed."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.run.finish(exit_code=exit_code)
