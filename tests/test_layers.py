"""The package's layers and their one import direction (docs/design.md, "Layers").

    core <- planner <- cluster <- diloco <- runtime <- entry points (train, plan, probe, launch)

Every ``import`` of every module under ``holmes_jax/`` is read from the source (top-level
and function-level alike: a lazy import is still a dependency) and checked:

- no import cycle between modules;
- a layer imports only itself and the layers to its left; nothing imports an entry point;
- the planner and core import no jax, flax, optax or orbax, not even lazily;

and, in a fresh interpreter, importing every core and planner module leaves ``jax`` out of
``sys.modules``. The checker itself is tested on made-up graphs, so it can fail.
"""

import ast
import os
import subprocess
import sys

import pytest

from tests.common import ROOT

PACKAGE = "holmes_jax"
LAYERS = ("core", "planner", "cluster", "diloco", "runtime")  # left to right: who may import whom
ENTRY_POINTS = ("train", "plan", "probe", "launch", "hf", "data", "sample")
ACCELERATOR_LIBS = ("jax", "jaxlib", "flax", "optax", "orbax", "chex")


def package_modules() -> dict[str, str]:
    """{dotted module name: file path} of every module in the package."""
    out = {}
    base = os.path.join(ROOT, PACKAGE)
    for folder, _, files in os.walk(base):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(folder, f)
    return out


def imports_of(path: str, modules: set[str]) -> set[str]:
    """Every module (ours or external, top-level name for external) ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the project uses absolute ones)"
            found.add(node.module)
            # `from holmes_jax.cluster import distributed` imports a module
            found.update(f"{node.module}.{a.name}" for a in node.names)
    ours = {m for m in found if m in modules}
    external = {m.split(".")[0] for m in found if not m.startswith(PACKAGE)}
    return ours | external


def layer_of(module: str) -> str:
    """``core`` / ``planner`` / ``cluster`` / ``diloco`` / ``runtime``, ``entry`` or ``package``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in LAYERS:
        return parts[1]
    if parts[1] in ENTRY_POINTS:
        return "entry"
    raise AssertionError(f"{module}: outside the layers (add it to a subpackage)")


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every rule the import graph breaks (module docstring), one line each."""
    problems = []
    for mod, deps in sorted(graph.items()):
        layer = layer_of(mod)
        for dep in sorted(deps):
            if dep.startswith(PACKAGE + "."):
                target = layer_of(dep)
                if target == "entry":
                    problems.append(f"{mod} imports the entry point {dep}")
                elif layer in LAYERS and (
                    target not in LAYERS or LAYERS.index(target) > LAYERS.index(layer)
                ):
                    problems.append(f"{mod} ({layer}) imports {dep} ({target})")
            elif dep in ACCELERATOR_LIBS and layer in ("core", "planner", "package"):
                problems.append(f"{mod} ({layer}) imports {dep}")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (depth-first search)."""
    found, state = [], {}  # state: 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                found.append(path[path.index(d) :] + [d])
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: imports_of(p, set(modules)) - {m} for m, p in modules.items()}


def test_every_module_sits_in_a_layer(graph):
    assert {layer_of(m) for m in graph} == {"package", "entry", *LAYERS}


def test_imports_follow_the_layers(graph):
    assert violations(graph) == []


def test_checker_catches_cycles_upward_imports_and_jax():
    bad = {
        "holmes_jax.planner.a": {"holmes_jax.planner.b", "numpy"},
        "holmes_jax.planner.b": {"holmes_jax.planner.a"},
        "holmes_jax.planner.c": {"holmes_jax.runtime.x", "jax"},
        "holmes_jax.cluster.d": {"holmes_jax.runtime.x"},
        "holmes_jax.runtime.x": {"holmes_jax.train", "jax"},
        "holmes_jax.core.e": {"holmes_jax.planner.a"},
    }
    found = violations(bad)
    assert "holmes_jax.planner.c (planner) imports holmes_jax.runtime.x (runtime)" in found
    assert "holmes_jax.planner.c (planner) imports jax" in found
    assert "holmes_jax.cluster.d (cluster) imports holmes_jax.runtime.x (runtime)" in found
    assert "holmes_jax.runtime.x imports the entry point holmes_jax.train" in found
    assert "holmes_jax.core.e (core) imports holmes_jax.planner.a (planner)" in found
    assert any(f.startswith("import cycle: holmes_jax.planner.a -> ") for f in found)
    assert len(found) == 6  # and nothing else: runtime may import jax, numpy is fine


def test_planner_and_core_import_without_jax(graph):
    """Importing every core and planner module in a fresh interpreter loads no jax."""
    names = sorted(m for m in graph if layer_of(m) in ("core", "planner"))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{ACCELERATOR_LIBS!r})\n"
        "assert not heavy, heavy\n"
        "print(len(" + repr(names) + "))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) == len(names) > 10
