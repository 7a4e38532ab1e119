"""Strict YAML: read a file, check every node, build frozen dataclasses from it.

The one YAML reader of the project (run configs, topologies, profiles). Every failure is a
one-line :class:`~holmes_jax.core.errors.ConfigError` naming the file, the key, the value
and the rule:

- :func:`read_yaml`: a file that must exist, be readable, be at most
  :data:`~holmes_jax.core.spec.FILE_BYTES` long and parse as YAML (any failure of the
  parser, deep nesting and impossible dates included, is a one-line error); YAML 1.1's
  base-60 numbers are read as text (``2:2`` is the string, as in YAML 1.2, not 122);
- :class:`StrictReader`: node by node checks (mapping with required and optional keys,
  non-empty one-line string, finite number, integer with a minimum, and bounds:
  :class:`~holmes_jax.core.spec.Bound`);
- :func:`build_dataclass`: a nested mapping into a tree of frozen dataclasses, type-checked
  against the fields' hints (unknown keys are errors; ints are accepted for floats and
  YAML 1.1's ``"1e-3"`` strings are read as numbers; floats must be finite, strings one
  printable line); :func:`plain` is the inverse;
- :func:`apply_override`: one ``--set section.key=value``, its value parsed as YAML; with a
  schema, an unknown section or key is an error naming the override;
- :func:`unknown_key`: the rule for an unknown key, with the nearest known name.

Values in messages are shortened (:func:`short`): a huge or deeply nested value (a YAML
alias bomb) prints as a bounded, one-line excerpt.

Plain Python; no jax import.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from holmes_jax.core.errors import ConfigError, one_line
from holmes_jax.core.spec import DEPTH, FILE_BYTES, Bound, not_one_of

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


def short(value: Any) -> str:
    """``repr(value)`` cut to one bounded line (deep or huge values: an excerpt)."""
    try:
        return _REPR.repr(value)
    except ValueError:  # holds an int past Python's 4300-digit str() limit
        return f"<{type(value).__name__} too long to print>"


def key_name(key: Any) -> str:
    """A mapping key as messages write it: itself when a short printable string."""
    if isinstance(key, str) and key.isprintable() and 0 < len(key) <= 80:
        return key
    return short(key)


# YAML 1.1's base-60 numbers (2:30 is 150, 1:30.5 is 90.5): YAML 1.2 dropped them, and in a
# config a plain 2:2 means the text (``logging.profile_steps``).
_BASE_60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_STR_TAG = "tag:yaml.org,2002:str"


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses nesting deeper than :data:`DEPTH` at once (the
    plain one recurses per level and fails seconds later with a RecursionError) and reads
    YAML 1.1's base-60 numbers as strings."""

    _depth = 0

    def resolve(self, kind, value, implicit):
        if kind is yaml.ScalarNode and implicit[0] and _BASE_60.match(value):
            return _STR_TAG
        return super().resolve(kind, value, implicit)

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > DEPTH.limit:
                raise yaml.YAMLError(f"nesting: must be <= {DEPTH.text} ({DEPTH.what})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def safe_load(text: Any) -> Any:
    """``yaml.safe_load`` with the nesting bound: the project's only YAML parser."""
    return yaml.load(text, Loader=_Loader)


def read_text(path: str | os.PathLike, what: str, parse: Any, kind: str = "YAML") -> Any:
    """``parse(open file)`` for a file that exists and is at most :data:`FILE_BYTES` long.

    Raises:
      ConfigError: the file does not exist, is too long, cannot be read or decoded, or
        ``parse`` fails in any way (named ``not valid <kind>``).
    """
    path = str(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{what} does not exist")
    try:
        FILE_BYTES.check(f"{path}: size", os.path.getsize(path))
        with open(path, encoding="utf-8") as f:
            return parse(f)
    except ConfigError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({one_line(e)})") from None
    except Exception as e:  # parsers raise many types: ValueError for a bad date, ...
        raise ConfigError(f"{path}: not valid {kind} ({type(e).__name__}: {one_line(e)})") from None


def read_yaml(path: str | os.PathLike, what: str) -> Any:
    """Parse a YAML file; None for an empty one.

    Args:
      path: the file.
      what: how error messages name it (``--config 'x.yaml': file``).

    Raises:
      ConfigError: the file does not exist, is too long or is not valid YAML.
    """
    return read_text(path, what, safe_load)


def apply_override(raw: dict[str, Any], item: str, schema: type | None = None) -> None:
    """Apply one ``section.key=value`` to nested plain data; the value is parsed as YAML
    (text YAML cannot read stays a string: the type check decides).

    Args:
      raw: the nested data, changed in place.
      item: the override.
      schema: a dataclass whose fields are the sections (dataclasses themselves); when
        given, the section and the key must be among their fields.

    Raises:
      ConfigError: not ``section.key=value``, an unknown section or key (with the nearest
        known name), or the section is not a mapping.
    """
    where = f"--set {key_name(item)}"
    if "=" not in item:
        raise ConfigError(f"{where}: must look like section.key=value")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{where}: key must be section.key (e.g. train.steps)")
    if schema is not None:
        sections = typing.get_type_hints(schema)
        if parts[0] not in sections:
            raise ConfigError(f"{where}: {unknown_key(parts[0], sections)}")
        names = [f.name for f in dataclasses.fields(sections[parts[0]])]
        if parts[1] not in names:
            raise ConfigError(f"{where}: {unknown_key(parts[1], names, parts[0])}")
    try:
        value = safe_load(text) if text.strip() else None
    except Exception:  # YAMLError, a bad date's ValueError, deep nesting ...
        value = text
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: section '{parts[0]}' is not a mapping")
    section[parts[1]] = value


def unknown_key(name: Any, allowed: typing.Iterable[str], section: str = "") -> str:
    """The rule broken by a key not in ``allowed``, with the nearest allowed name.

    ``unknown key 'stpes' in section train; did you mean 'steps'?``; without a section the
    key is a section itself; without a near name the rule lists the allowed ones.
    """
    allowed = sorted(allowed)
    if section:
        what = f"key '{key_name(name)}' in section {section}"
    else:
        what = f"section '{key_name(name)}'"
    near = difflib.get_close_matches(name, allowed, n=1) if isinstance(name, str) else []
    hint = f"did you mean '{near[0]}'?" if near else f"allowed: {_names(tuple(allowed))}"
    return f"unknown {what}; {hint}"


class StrictReader:
    """Strict readers for each YAML node; every failure names file, key, value and rule.

    Subclasses add readers for their own node types (:class:`holmes_jax.planner.topology.
    TopologyReader`: links and islands).
    """

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, value: Any, rule: str) -> None:
        raise ConfigError(f"{self.source}: {key}={short(value)}: {rule}")

    def mapping(self, raw: Any, key: str, required=(), optional=()) -> Mapping[str, Any]:
        where = key or "top level"
        if not isinstance(raw, dict):
            self.fail(where, raw, "must be a mapping")
        allowed = tuple(required) + tuple(optional)
        known = set(allowed)
        for k in raw:
            if k not in known:
                full = f"{key}.{key_name(k)}" if key else key_name(k)
                self.fail(full, raw[k], f"unknown key (allowed: {_names(allowed)})")
        for k in required:
            if k not in raw:
                self.fail(f"{key}.{k}" if key else k, None, "required key is missing")
        return raw

    def string(self, v: Any, key: str, allow_empty: bool = False, lines: bool = False) -> str:
        """A non-empty string on one printable line (``lines``: any text)."""
        if not isinstance(v, str) or (not allow_empty and not v.strip()):
            self.fail(key, v, "must be a non-empty string")
        if not lines and not v.isprintable():
            self.fail(key, v, "must be one line of printable characters")
        return v

    def number(
        self,
        v: Any,
        key: str,
        minimum: float = 0.0,
        strict: bool = True,
        bound: Bound | None = None,
    ) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            self.fail(key, v, "must be a number")
        if isinstance(v, int) and abs(v) > 1e300 or v != v or v in (math.inf, -math.inf):
            self.fail(key, v, "must be finite")
        if (strict and v <= minimum) or (not strict and v < minimum):
            self.fail(key, v, f"must be {'>' if strict else '>='} {minimum:g}")
        self._bound(bound, key, v)
        return float(v)

    def integer(self, v: Any, key: str, minimum: int, bound: Bound | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, v, "must be an integer")
        if v < minimum:
            self.fail(key, v, f"must be >= {minimum}")
        self._bound(bound, key, v)
        return v

    def _bound(self, bound: Bound | None, key: str, v: float) -> None:
        if bound is not None:
            try:
                bound.check(key, v)
            except ConfigError as e:
                raise ConfigError(f"{self.source}: {e}") from None


def _names(allowed: tuple[str, ...], most: int = 12) -> str:
    """Allowed keys for a message; a long list is cut (a profile of many islands)."""
    if len(allowed) <= most:
        return ", ".join(allowed)
    return f"{', '.join(allowed[:most])}, ... ({len(allowed)} in all)"


def build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: must be a mapping, got {short(raw)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names, key=str)
    if unknown:
        raise ConfigError(unknown_key(unknown[0], names, prefix.rstrip(".")))
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_dataclass(hint, value if value is not None else {}, key + ".")
        else:
            kwargs[name] = _coerce(value, hint, key)
    return cls(**kwargs)


class _ValueRule(ConfigError):
    """A value of the right type that breaks a rule (NaN for a float, a newline in a str)."""


def choices(cls: type, prefix: str = "") -> dict[str, tuple[Any, ...]]:
    """``{key: values}`` of every field of the dataclass ``cls`` (and its sections) whose
    type is a ``Literal`` (or a union holding one)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out.update(choices(hint, f"{prefix}{name}."))
            continue
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        for option in typing.get_args(hint) if union else (hint,):
            if typing.get_origin(option) is typing.Literal:
                out[prefix + name] = typing.get_args(option)
    return out


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a type hint; accept ints for floats and '1e-3' strings."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if any(type(value) is type(a) and value == a for a in allowed):
            return value
        if any(type(value) is type(a) for a in allowed):  # the right type, a wrong value
            raise _ValueRule(not_one_of(value, key, allowed))
        raise ConfigError(f"{key}={short(value)}: expected {_type_name(hint)}")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except _ValueRule:  # the right type, a wrong value: that is the message
                raise
            except ConfigError:
                continue
        names = " | ".join(_type_name(o) for o in options)
        raise ConfigError(f"{key}={short(value)}: expected {names}")
    if origin is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}={short(value)}: expected a list of {_type_name(item)}")
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):  # an entry of a list of mappings (data.mixture)
        if isinstance(value, hint):
            return value
        return build_dataclass(hint, value, key + ".")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value) if abs(value) <= 1e300 else math.inf  # no OverflowError
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise _ValueRule(f"{key}={short(value)}: must be a finite number")
            return number
    elif hint is str:
        if isinstance(value, str):
            if not value.isprintable():
                raise _ValueRule(f"{key}={short(value)}: must be one line of printable characters")
            return value
    raise ConfigError(f"{key}={short(value)}: expected {_type_name(hint)}")


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return "list"
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(sorted({type(a).__name__ for a in typing.get_args(hint)}))
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    return x
