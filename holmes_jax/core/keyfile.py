"""The shared key of independent DiLoCo islands (``diloco.sync_key_file``): one rule, read
where the config is checked and where the key is used."""

from __future__ import annotations

KEY_MIN_BYTES = 16


def read_key(path: str) -> bytes:
    """The key in ``path``: its bytes, surrounding whitespace stripped.

    Raises:
      OSError: the file cannot be read.
      ValueError: fewer than :data:`KEY_MIN_BYTES` bytes.
    """
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < KEY_MIN_BYTES:
        raise ValueError(f"holds {len(key)} bytes, a key needs at least {KEY_MIN_BYTES}")
    return key
