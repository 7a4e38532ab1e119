"""An island's outer state on disk, beside each checkpoint: ``outer/<step>.lane<l>.outer``
(global model, momentum and history, :mod:`~holmes_jax.diloco.wire`'s format) and with
``outer_dtype`` sparse ``outer/<step>.lane<l>.residual`` (the error-feedback buffer), each
written whole then renamed, and checked when read back.
"""

from __future__ import annotations

import numpy as np
from etils import epath

from holmes_jax.core.errors import ConfigError
from holmes_jax.diloco.messages import Expect, Refused, finite, parse_state
from holmes_jax.diloco.wire import WireError, pack, unpack

OUTER_DIR = "outer"  # beside the step directories of checkpoint.dir
OUTER_META = ("round", "tokens", "lineage", "parent", "fork_tokens")
Shards = dict[str, np.ndarray]


def save_lane(folder, step: int, lane: int, snapshot: bytes, residual: Shards | None) -> None:
    """A lane's outer state (and its buffer, when given) in ``folder``."""
    _write_whole(folder / _outer_name(step, lane), snapshot)
    if residual is not None:
        _write_whole(folder / _residual_name(step, lane), pack({"kind": "residual"}, residual))


def load_outer(directory: str, step: int, lane: int, expect: Expect):
    """:meth:`IslandSync.save_outer`'s ``((global, momentum), meta)`` of ``lane`` for
    ``step``, or None (none saved, or no ``directory``); ``meta["residual"]`` holds the
    error-feedback buffer when one was saved.

    Raises:
      ConfigError: the file is not a saved outer state of this lane's keys and shapes, or
        holds non-finite values; a saved buffer is not fp32 arrays of the lane's keys and
        shapes, finite.
    """
    if not directory:
        return None
    path = epath.Path(directory) / OUTER_DIR / _outer_name(step, lane)
    if not path.exists():
        return None
    try:
        meta, arrays = unpack(path.read_bytes())
        state = parse_state(meta, arrays, expect)
    except (WireError, Refused) as err:
        raise ConfigError(
            f"{path}: not this island's outer state ({err}); remove it to resume without it"
        ) from None
    meta = {k: getattr(state, k) for k in OUTER_META}
    residual = epath.Path(directory) / OUTER_DIR / _residual_name(step, lane)
    if residual.exists():
        meta["residual"] = _load_residual(residual, expect)
    return (state.glob, state.mom), meta


def _load_residual(path, expect: Expect) -> Shards:
    """A saved error-feedback buffer, checked against the lane's keys and shapes."""
    try:
        _, arrays = unpack(path.read_bytes())
    except WireError as err:
        raise ConfigError(f"{path}: not an error-feedback buffer ({err})") from None
    for k, a in arrays.items():
        want = expect.shapes.get(k)
        if want is None or a.shape != want or a.dtype != np.float32 or not finite(a):
            raise ConfigError(
                f"{path}: array {k[:60]} is not a finite fp32 buffer of one of the lane's "
                "keys and shapes; remove the file to resume with an empty buffer"
            )
    return {k: np.array(a) for k, a in arrays.items()}


def _write_whole(path, body: bytes) -> None:
    """``body`` to ``path``: written beside it, then renamed."""
    part = path.parent / f"{path.name}.partial"
    with part.open("wb") as f:
        f.write(body)
    part.rename(path)


def _residual_name(step: int, lane: int) -> str:
    return f"{step}.lane{lane}.residual"


def _outer_name(step: int, lane: int) -> str:
    return f"{step}.lane{lane}.outer"
