"""The README and docs/ are held to what they promise: their commands run, their links resolve.

- Every ``python -m holmes_jax.train`` command in a code block of README.md or docs/*.md
  (whose config ships with the repo) and in a shipped config's header parses and loads:
  its keys exist, its values pass the config's rules, its topology loads, and its degrees
  fit the devices.
- Every ``python -m holmes_jax.plan`` command there runs to exit code 0 (the planner has
  no jax, so this takes seconds).
- Every relative link in README.md and docs/*.md names a file that exists, and an
  ``#anchor`` names a heading of that file.
- The README stays a newcomer's page: at most 12,000 bytes.
- The quickstart's predicted step, where README.md and docs/planner.md quote it, is what
  ``plan --keep-degrees`` (and so the trainer) predicts now.

No other number is read out of prose: facts live in the code and the generated reference.
"""

import glob
import json
import os
import re
import shlex

import pytest

from holmes_jax import plan as plan_cli
from holmes_jax import train as train_cli
from holmes_jax.core.config import load_config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.grid import load_mesh_topology, resolve_shape
from tests.common import ROOT

README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
COMMAND = re.compile(r"(?:^|\s)\S*python3? -m holmes_jax\.(train|plan)\s(.*)$")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _joined(lines: list[str]) -> list[str]:
    """``lines`` with backslash continuations joined into one line each."""
    out, pending = [], ""
    for line in lines:
        line = line.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def block_commands(path: str) -> list[str]:
    """Command lines inside the fenced code blocks of the Markdown file ``path``."""
    blocks = re.findall(r"```[\w-]*\n(.*?)```", _read(path), flags=re.S)  # any language
    return [line for b in blocks for line in _joined(b.splitlines())]


def header_commands(path: str) -> list[str]:
    """Command lines in a config's leading comment block (``#   python -m ...``)."""
    header = []
    for line in _read(path).splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:])
    return _joined(header)


def holmes_commands() -> list[tuple[str, str, list[str]]]:
    """(where, program, argv) for every train/plan command the docs and configs show.

    Plan commands count in the README and the configs; train commands in docs/ too,
    unless their ``--config`` is a file a run writes (``runs/...``)."""
    found = [(README, c) for c in block_commands(README)]
    found += [(p, c) for p in DOCS for c in block_commands(p)]
    found += [(p, c) for p in CONFIGS for c in header_commands(p)]
    out = []
    for path, line in found:
        m = COMMAND.search(line.split(" #")[0].strip())
        if not m:
            continue
        argv = shlex.split(m.group(2))
        config = argv[argv.index("--config") + 1] if "--config" in argv else None
        if config is not None and not os.path.exists(os.path.join(ROOT, config)):
            continue
        if m.group(1) == "plan" and path in DOCS:
            continue
        out.append((os.path.relpath(path, ROOT), m.group(1), argv))
    return out


COMMANDS = holmes_commands()


def test_the_docs_show_train_and_plan_commands():
    """The parametrized checks below have something to check."""
    programs = {(where == "README.md", prog) for where, prog, _ in COMMANDS}
    assert (True, "train") in programs
    assert (False, "train") in programs and (False, "plan") in programs


@pytest.mark.parametrize(
    "where, argv",
    [(w, a) for w, p, a in COMMANDS if p == "train"],
    ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60],
)
def test_documented_train_command_loads(where, argv):
    """What ``holmes_jax.train.main`` checks before it starts jax, for this command line."""
    args = train_cli.parse_args(argv)
    overrides = train_cli.overrides_of(args)  # --set, --mesh and --profile
    cfg = load_config(os.path.join(ROOT, args.config) if args.config else None, overrides)
    req = plan_request(cfg)
    topo = load_mesh_topology(req)  # the degrees must fit the topology's placement rules
    resolve_shape(req, topo.num_devices if topo is not None else args.cpu_devices, topo)


@pytest.mark.parametrize(
    "where, argv",
    [(w, a) for w, p, a in COMMANDS if p == "plan"],
    ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60],
)
def test_documented_plan_command_runs(where, argv, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = [a for a in argv if not a.endswith(".png")]  # no drawing: --png's file is dropped
    argv = [a for i, a in enumerate(argv) if not (a == "--png" and i == len(argv) - 1)]
    assert plan_cli.main(argv) == 0, capsys.readouterr().err


def test_a_broken_documented_command_is_caught():
    """The train check fails on an unknown key, so the parametrized test can fail."""
    from holmes_jax.core.errors import ConfigError

    argv = ["--config", "configs/quickstart.yaml", "--set", "train.stepz=5"]
    with pytest.raises(ConfigError):
        test_documented_train_command_loads("here", argv)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def broken_links(path: str) -> list[str]:
    """Relative links in the Markdown file ``path`` whose file or anchor does not exist."""
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            out.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            out.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    return out


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: os.path.relpath(p, ROOT))
def test_links_resolve(path):
    assert broken_links(path) == []


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n[ok](#title) [bad](b.md) [anchor](#nope)\n")
    found = broken_links(str(tmp_path / "a.md"))
    assert [f.split(":")[0] for f in found] == ["b.md", "#nope"]


def test_readme_is_a_newcomers_page():
    assert os.path.getsize(README) <= 12_000


def test_quoted_quickstart_step_is_current(capsys):
    """Every predicted step the README quotes, and the full step of docs/planner.md's
    ``--failures`` printout, is the planner's prediction for configs/quickstart.yaml."""
    argv = ["--config", os.path.join(ROOT, "configs", "quickstart.yaml"), "--keep-degrees"]
    assert plan_cli.main([*argv, "--json"]) == 0
    step = f"{json.loads(capsys.readouterr().out)['predicted_step_s']:.3g}"
    quoted = re.findall(r"predicted (?:step )?([0-9.]+) s", _read(README))
    quoted += re.findall(
        r"the config as written: predicted step ([0-9.]+) s",
        _read(os.path.join(ROOT, "docs", "planner.md")),
    )
    assert quoted and set(quoted) == {step}, (quoted, step)


def test_readme_points_at_the_notebook():
    assert "`notebooks/quickstart.ipynb`" in _read(README)
    assert '"cells"' in _read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"))
