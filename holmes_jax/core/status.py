"""The status channel: what a training process tells the launcher that started it.

The launcher (:class:`holmes_jax.cluster.launcher.Launch`) gives each worker the write end
of a pipe and its number in ``HOLMES_STATUS_FD``. The main process writes one JSON object
per line to it; the launcher reads them beside the human-readable output, so what
restarts and fault injection act on does not depend on ``logging.progress`` or on the
wording of a progress line. Without ``HOLMES_STATUS_FD`` (a run not under the launcher),
or when it names no pipe, :func:`report` does nothing. The first report removes the
variable from the environment, so the processes this one starts never inherit it.

``HOLMES_STATUS_STEPS`` lists steps (``5,12``) the launcher must hear of whatever the
logging interval, its faults' steps: the run reports ``step`` after each of them once it
has finished (:func:`watched_steps`), logged or not.

The events, with the fields each must carry:

======== ======================================= =====================================
event    fields                                  when
======== ======================================= =====================================
started  (none)                                  the process runs ``main`` (imports done)
joined   (none)                                  it joined ``jax.distributed``
run_dir  ``path`` (str)                          the run directory is chosen
resumed  ``step`` (int >= 0)                     the state to train from is ready (0:
                                                 no checkpoint was restored)
compiled ``seconds`` (float >= 0), ``detail``    the first train step compiled
         (str: cache hits, or "")
step     ``step`` (int >= 1)                     a logged or watched step finished
measured ``excluded`` (list of str: the lost    a failure's survivors' candidate
         hosts), ``plans`` (list of str),        plans were timed (``--measure``), or
         ``step_s`` (numbers > 0, one per plan)  found timed (the full job's process 0)
======== ======================================= =====================================
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import IO, Any

STATUS_FD_VAR = "HOLMES_STATUS_FD"
STEPS_VAR = "HOLMES_STATUS_STEPS"  # steps reported whether logged or not (module doc)
# event -> {field: (the types it may hold, its least value or None)}
EVENTS: dict[str, dict[str, tuple[tuple[type, ...], int | None]]] = {
    "started": {},
    "joined": {},
    "run_dir": {"path": ((str,), None)},
    "resumed": {"step": ((int,), 0)},
    "compiled": {"seconds": ((int, float), 0), "detail": ((str,), None)},
    "step": {"step": ((int,), 1)},
    "measured": {"excluded": ((list,), None), "plans": ((list,), None), "step_s": ((list,), None)},
}
MAX_PLANS = 64  # the most candidate plans a measured event may carry
MAX_LINE = 64 * 1024  # a longer line is not a status line

_channel: IO[str] | None = None
_closed = False


def report(event: str, **fields: Any) -> None:
    """Write one event to the launcher's channel, if this process has one.

    Raises:
      ValueError: ``event`` or its fields do not match :data:`EVENTS` (a bug in the caller).
    """
    global _channel, _closed
    record = {"event": event, **fields}
    problem = check(record)
    if problem:
        raise ValueError(f"status event {record}: {problem}")
    if _closed:
        return
    if _channel is None:
        # Taken out of the environment: a process this one starts must not write to
        # whatever its own descriptor of that number is.
        fd = os.environ.pop(STATUS_FD_VAR, "")
        try:
            if not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
                raise ValueError(f"{STATUS_FD_VAR}={fd} is not a pipe")
            _channel = os.fdopen(int(fd), "w", buffering=1, closefd=True)
        except (OSError, ValueError):  # none, or not ours (a copied environment): silent
            _closed = True
            return
    try:
        _channel.write(json.dumps(record) + "\n")
    except OSError:  # the launcher is gone; the process goes on without it
        _closed = True


def watched_steps() -> frozenset[int]:
    """The steps of ``HOLMES_STATUS_STEPS`` (module doc); none when it is unset. An
    entry that is not a step number is ignored (the launcher writes this variable)."""
    raw = os.environ.get(STEPS_VAR, "")
    return frozenset(int(s) for s in raw.split(",") if s.strip().isdigit() and int(s) > 0)


def check(record: Any) -> str:
    """What is wrong with ``record`` as a status event, or "" when nothing is."""
    if not isinstance(record, dict):
        return f"must be a JSON object, not {type(record).__name__}"
    event = record.get("event")
    if event not in EVENTS:
        return f"event {event!r} is not one of {sorted(EVENTS)}"
    want = EVENTS[event]
    extra = set(record) - set(want) - {"event"}
    if extra:
        return f"unknown field(s) {sorted(extra)} for event {event!r}"
    for name, (types, least) in want.items():
        value = record.get(name)
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{event}.{name}={value!r}: must be {' or '.join(t.__name__ for t in types)}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{event}.{name}={value!r}: must be finite"
        if least is not None and value < least:
            return f"{event}.{name}={value!r}: must be >= {least}"
    return _check_measured(record) if event == "measured" else ""


def _check_measured(record: dict[str, Any]) -> str:
    """What is wrong with a ``measured`` event's lists, or ""."""
    plans, times, lost = record["plans"], record["step_s"], record["excluded"]
    if not 1 <= len(lost) <= MAX_PLANS or not all(isinstance(h, str) and h for h in lost):
        return f"measured.excluded={lost!r}: must be the lost hosts' names (1 to {MAX_PLANS})"
    if not 1 <= len(plans) <= MAX_PLANS or len(times) != len(plans):
        return (
            f"measured: {len(plans)} plans and {len(times)} step times: must be 1 to "
            f"{MAX_PLANS} plans, one time each"
        )
    if not all(isinstance(p, str) and p for p in plans):
        return f"measured.plans={plans!r}: must be plan descriptions (non-empty strings)"
    for t in times:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            return f"measured.step_s={times!r}: must be seconds, finite and > 0"
    return ""


def parse(line: str) -> tuple[dict[str, Any] | None, str]:
    """One line read from a channel -> (the event, "") or (None, what was wrong)."""
    if len(line) > MAX_LINE:
        return None, f"a line of {len(line)} characters (at most {MAX_LINE})"
    try:
        record = json.loads(line)
    except ValueError as e:
        return None, f"not JSON ({e})"
    problem = check(record)
    return (None, problem) if problem else (record, "")
