"""Entry point of every recipe: a config mistake ends the run with one clear line, and every run exits cleanly."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn

from .config import ConfigError
from .distributed import exit_process


def run_main(main: Callable[[], None]) -> NoReturn:
    try:
        main()
    except ConfigError as error:
        # exit_process skips wandb's teardown: a W&B run already started would be left running, then crashed.
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            wandb.run.finish(exit_code=2)
        # One write per line: every rank reports the same error, and print's separate newline write interleaves.
        sys.stderr.write(f"error: {error}\n")
        exit_process(2)
    exit_process(0)
