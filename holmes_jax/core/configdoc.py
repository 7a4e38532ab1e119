"""``docs/configuration.md``, generated from the config dataclasses.

    python -m holmes_jax.core.configdoc > docs/configuration.md

One table per section of :class:`~holmes_jax.core.config.Config`, in field order, under the
section class's docstring. Each key's row holds:

- its type, from the field's type hint, and its default;
- what it may take: the values of :data:`~holmes_jax.core.config.CONFIG_CHOICES` or the
  bound of :data:`~holmes_jax.core.spec.CONFIG_LIMITS`;
- its meaning: the field's comment in the source, that is the comment lines directly above
  the field and the comment on its line, in that order.

A field without a comment is an error, so a new key cannot go undocumented. A test compares
the file with :func:`render`.

Plain Python; no jax import.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from typing import Any

from holmes_jax.core.config import CONFIG_CHOICES, Config
from holmes_jax.core.spec import CONFIG_LIMITS, Bound

COMMAND = "python -m holmes_jax.core.configdoc > docs/configuration.md"
PATH = "docs/configuration.md"

INTRO = """\
A run is one YAML file of sections. Every key is optional; an unset key takes its default.
`--set section.key=value` overrides one key after the file is read; the value is parsed
as YAML. Loading is strict: an unknown key, a wrong type or a value outside its rule stops
the run with one line naming the key, the value and the rule (exit code 2).

```yaml
model: {arch: llama, num_layers: 8}
train: {steps: 200, global_batch_size: 16}
```
"""


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the source of ``cls``: the ``#`` lines directly above the
    field, then the comment on its line, joined into one line."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    (node,) = ast.parse(source).body
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, row = [], stmt.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        parts = above + ([comments[stmt.lineno]] if stmt.lineno in comments else [])
        out[stmt.target.id] = " ".join(p for p in parts if p)
    return out


def type_text(hint: Any) -> str:
    """A type hint as YAML sees it: ``int``, ``str | null``, ``list[int]``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " \\| ".join(type_text(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return f"list[{type_text(item)}]"
    if typing.get_origin(hint) is typing.Literal:  # its values are in their own column
        kinds = dict.fromkeys(type(a) for a in typing.get_args(hint))
        return " \\| ".join(type_text(k) for k in kinds)
    return "null" if hint is type(None) else hint.__name__


def yaml_text(value: Any) -> str:
    """A value as YAML writes it: ``true``, ``null``, ``1e-05``, ``gpt2``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return f"[{', '.join(yaml_text(v) for v in value)}]"
    return str(value)


def bound_text(bound: Bound) -> str:
    least = f">= {bound.least:g}, " if bound.least is not None else ""
    return f"{least}<= {bound.text} ({bound.what})"


def rows(root: type = Config) -> list[tuple[str, str, list[tuple[str, ...]]]]:
    """``(section, its docstring, [(key, type, default, takes, meaning), ...])`` per section.

    Raises:
      ValueError: a field without a comment.
    """
    out = []
    for section in dataclasses.fields(root):
        cls = typing.get_type_hints(root)[section.name]
        hints, comments = typing.get_type_hints(cls), field_comments(cls)
        table = []
        for f in dataclasses.fields(cls):
            key = f"{section.name}.{f.name}"
            if not comments.get(f.name):
                raise ValueError(f"{key}: needs a comment saying what it means")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            takes = ""
            if key in CONFIG_CHOICES:
                takes = ", ".join(f"`{yaml_text(c)}`" for c in CONFIG_CHOICES[key])
            elif key in CONFIG_LIMITS:
                takes = bound_text(CONFIG_LIMITS[key])
            meaning = comments[f.name].replace("|", "\\|").replace("<", "&lt;")
            table.append((key, type_text(hints[f.name]), yaml_text(default), takes, meaning))
        out.append((section.name, inspect.cleandoc(cls.__doc__ or ""), table))
    return out


def render(root: type = Config) -> str:
    """The whole of ``docs/configuration.md``."""
    out = [
        f"<!-- generated by `{COMMAND}`; do not edit -->",
        "",
        "# Configuration reference",
        "",
        INTRO,
    ]
    for name, doc, table in rows(root):
        out += [f"## {name}", ""]
        out += [line for para in doc.split("\n\n") for line in (" ".join(para.split()), "")]
        out += ["| key | type | default | takes | meaning |", "|---|---|---|---|---|"]
        for key, hint, default, takes, meaning in table:
            out.append(f"| `{key}` | {hint} | `{default}` | {takes} | {meaning} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
