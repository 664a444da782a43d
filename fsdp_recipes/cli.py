"""Entry-point helper: a config mistake ends the run with one clear line, not a traceback."""

from __future__ import annotations

import sys
from typing import Callable

from .config import ConfigError


def run_main(main: Callable[[], None]) -> None:
    try:
        main()
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
