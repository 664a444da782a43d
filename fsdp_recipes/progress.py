"""Progress on rank 0: tqdm bars in a terminal (tokenization, loading, training), plain log lines otherwise."""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import TextIO

import datasets
import torch.distributed as dist
import transformers
from tqdm.auto import tqdm

from .distributed import print_rank0


def use_progress_bars(is_main: bool, stderr: TextIO | None = None, stdout: TextIO | None = None) -> bool:
    """Bars only on rank 0 and only when its stdout and stderr (where tqdm draws) are a terminal, stderr one with a
    width: in a log file a bar is noise; with stdout alone sent to a file (`| tee train.log`, `> train.log`) the
    file would lack the step lines the bar stands for; and on a terminal of 0 columns (a pseudo-terminal nobody
    sized: `script`, `docker run -t` in a job) tqdm draws nothing at all, so the plain lines are the only progress
    shown."""
    stderr = sys.stderr if stderr is None else stderr
    stdout = sys.stdout if stdout is None else stdout
    return (is_main and stdout.isatty() and stderr.isatty()
            and os.get_terminal_size(stderr.fileno()).columns > 0)


def configure_progress_bars(is_main: bool) -> bool:
    """Turn off the datasets (tokenization) and transformers (loading) bars where use_progress_bars says no."""
    show = use_progress_bars(is_main)
    if not show:
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    return show


def print_line(line: str) -> None:
    """print_rank0 that keeps the bars intact where they are drawn: tqdm.write clears them, prints, redraws them."""
    if use_progress_bars(not dist.is_initialized() or dist.get_rank() == 0):
        tqdm.write(line)
    else:
        print_rank0(line)


class TrainingProgress:
    """A bar with step, loss, tokens/s and time left; or, without a terminal, one line per logged step."""

    def __init__(self, total_steps: int, start_step: int, show_bar: bool):
        self.total_steps, self.start_step = total_steps, start_step
        self.started = time.perf_counter()
        self.bar = tqdm(total=total_steps, initial=start_step, desc="training", unit="step",
                        dynamic_ncols=True) if show_bar else None

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def logged(self, metrics: dict) -> None:
        step = metrics["step"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tokens_per_s=f"{metrics['tokens_per_second']:.0f}")
            return
        # Time left from the average pace since this run started (evaluation and saves included).
        pace = (time.perf_counter() - self.started) / max(step - self.start_step, 1)
        left = datetime.timedelta(seconds=round(pace * (self.total_steps - step)))
        print_rank0(f"step {step}/{self.total_steps} loss {metrics['loss']:.4f} lr {metrics['learning_rate']:.2e} "
                    f"grad_norm {metrics['grad_norm']:.3f} tokens/s {metrics['tokens_per_second']:.0f} "
                    f"time left {left}")

    def write(self, line: str) -> None:
        """A log line that does not break the bar."""
        print_line(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
