"""Errors a user can cause: commands print them as one line and exit non-zero."""
from __future__ import annotations

import os
import sys
from typing import Callable


class SpecforkError(Exception):
    """Bad input or a missing resource; never a bug in specfork."""


def check_positive(**values: int | float) -> None:
    """Raise SpecforkError naming the first option whose value is not > 0."""
    for name, v in values.items():
        if not v > 0:
            raise SpecforkError(f"--{name.replace('_', '-')} must be > 0, got {v}")


def run_command(prog: str, body: Callable[[], int | None]) -> int:
    """Exit status of a command's body: a user error (bad input, a missing or unreadable file)
    is one line on stderr and status 2, never a traceback; a runtime failure (out of memory, a
    torch error) is one line and status 1; Ctrl-C is 130."""
    try:
        return body() or 0
    except (SpecforkError, OSError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as e:     # out of memory, a torch failure: one line too
        if os.environ.get("SPECFORK_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{prog}: error: {type(e).__name__}: {msg} (SPECFORK_DEBUG=1 shows the "
              "traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
