"""Strict YAML: read a file, check every node, build frozen dataclasses from it.

The one YAML reader of the project (run configs, topologies, profiles). Every failure is a
one-line :class:`~holmes_jax.core.errors.ConfigError` naming the file, the key, the value
and the rule:

- :func:`read_yaml`: a file that must exist, be readable and parse as YAML;
- :class:`StrictReader`: node by node checks (mapping with required and optional keys,
  non-empty string, finite number, integer with a minimum, and bounds);
- :func:`build_dataclass`: a nested mapping into a tree of frozen dataclasses, type-checked
  against the fields' hints (unknown keys are errors; ints are accepted for floats and
  YAML 1.1's ``"1e-3"`` strings are read as numbers); :func:`plain` is the inverse.

Plain Python; no jax import.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from holmes_jax.core.errors import ConfigError, one_line


def read_yaml(path: str | os.PathLike, what: str) -> Any:
    """Parse a YAML file; None for an empty one.

    Args:
      path: the file.
      what: how error messages name it (``--config 'x.yaml': file``).

    Raises:
      ConfigError: the file does not exist or is not valid YAML.
    """
    path = str(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{what} does not exist")
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({one_line(e)})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({one_line(e)})") from None


class StrictReader:
    """Strict readers for each YAML node; every failure names file, key, value and rule.

    Subclasses add readers for their own node types (:class:`holmes_jax.planner.topology.
    TopologyReader`: links and islands).
    """

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, value: Any, rule: str) -> None:
        raise ConfigError(f"{self.source}: {key}={value!r}: {rule}")

    def mapping(self, raw: Any, key: str, required=(), optional=()) -> Mapping[str, Any]:
        where = key or "top level"
        if not isinstance(raw, dict):
            self.fail(where, raw, "must be a mapping")
        allowed = tuple(required) + tuple(optional)
        for k in raw:
            if k not in allowed:
                full = f"{key}.{k}" if key else str(k)
                self.fail(full, raw[k], f"unknown key (allowed: {', '.join(allowed)})")
        for k in required:
            if k not in raw:
                self.fail(f"{key}.{k}" if key else k, None, "required key is missing")
        return raw

    def string(self, v: Any, key: str, allow_empty: bool = False) -> str:
        if not isinstance(v, str) or (not allow_empty and not v.strip()):
            self.fail(key, v, "must be a non-empty string")
        return v

    def number(self, v: Any, key: str, minimum: float = 0.0, strict: bool = True) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            self.fail(key, v, "must be a number")
        if v != v or v in (float("inf"), float("-inf")):
            self.fail(key, v, "must be finite")
        if (strict and v <= minimum) or (not strict and v < minimum):
            self.fail(key, v, f"must be {'>' if strict else '>='} {minimum:g}")
        return float(v)

    def integer(self, v: Any, key: str, minimum: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, v, "must be an integer")
        if v < minimum:
            self.fail(key, v, f"must be >= {minimum}")
        return v


def build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise ConfigError(f"unknown key '{key}' (allowed: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_dataclass(hint, value if value is not None else {}, key + ".")
        else:
            kwargs[name] = _coerce(value, hint, key)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a type hint; accept ints for floats and '1e-3' strings."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        names = " | ".join(_type_name(o) for o in options)
        raise ConfigError(f"{key}={value!r}: expected {names}")
    if origin is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}={value!r}: expected a list of {_type_name(item)}")
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                number = float(value)
            except ValueError:
                pass
            else:
                if math.isfinite(number):
                    return number
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}={value!r}: expected {_type_name(hint)}")


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return "list"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    return x
