"""The one error type for bad user input (config, topology, data paths), and the one for a
run that stops because its steps stay non-finite.

Entry points catch :class:`ConfigError`, print its one-line message and exit with code 2;
library callers (notebooks) get an ordinary ``ValueError`` subclass. Messages name the key,
the value and the rule, e.g. ``model.num_heads=5: must divide model.hidden_size=128``.

:class:`NonFiniteError` ends a run whose loss or gradient norm stayed non-finite for more
than ``train.max_skipped_steps`` steps in a row: one line, exit code 4. The launcher's
supervisor retries neither code: a restart replays the same batches from the same
checkpoint and fails the same way.
"""

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

USAGE_EXIT = 2  # the exit code of every bad setting
NONFINITE_EXIT = 4  # the exit code of a run stopped by non-finite steps


class ConfigError(ValueError):
    """A user-supplied setting is unknown, mistyped or impossible."""


class NonFiniteError(RuntimeError):
    """More than ``train.max_skipped_steps`` consecutive steps had a non-finite loss or
    gradient norm; the message names the step, the key and the checkpoint to go back to."""


def one_line(e: BaseException) -> str:
    """An exception's message with its white space (newlines included) folded."""
    return " ".join(str(e).split())


def run_cli(run: Callable[[T], int], args: T) -> int:
    """``run(args)``, turning a :class:`ConfigError` into one stderr line and exit code 2."""
    try:
        return run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT
