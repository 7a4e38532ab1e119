"""The README's quickstart paragraph and the quickstart YAML's header say what the config does.

Both texts state facts about ``configs/quickstart.yaml``: the parameter count, the layers,
the topology and its islands, the pipeline's degrees, schedule and micro-batches, who
splits the layers, the steps, where the outputs go and the planner's predicted step.
:func:`mismatches` reads each fact from the text with a pattern and compares it with the
config (and the topology and the planner it names), so a config change the text does not
follow fails here. Measured numbers (minutes, losses, the measured step) cannot be
derived from the config and are not checked.
"""

import re

import pytest

from holmes_jax.core.config import check_devices, load_config
from holmes_jax.planner.placement import stages_per_island
from holmes_jax.planner.plans import predict_config
from holmes_jax.planner.topology import load_topology
from holmes_jax.runtime.rundir import resolve_outputs
from tests.common import ROOT, config_path

QUICKSTART = config_path("quickstart.yaml")
WORDS = {"one": "1", "two": "2", "three": "3", "four": "4"}
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe"}


def _same(values) -> tuple:
    """The one value every island shares, or a marker no text states."""
    values = set(values)
    return next(iter(values)) if len(values) == 1 else ("(differs between islands)",)


def _facts(cfg):
    """(name, pattern, expected groups...) for every fact both texts state about ``cfg``."""
    topo = load_topology(cfg.parallel.mesh)
    shape = check_devices(cfg, topo.num_devices)
    per_island = _same(stages_per_island(topo, cfg.parallel.layout(shape)))
    hosts = _same((isl.num_hosts, isl.devices_per_host) for isl in topo.islands)
    link = topo.inter_island_default
    return [
        ("parameters", r"[Aa] ([\d.]+)M-parameter", f"{cfg.model.spec.num_params / 1e6:.2f}"),
        ("layers", r"(\d+)-layer byte-level GPT", cfg.model.num_layers),
        ("devices", r"on (\d+) simulated CPU devices", topo.num_devices),
        ("islands", r"laid out as (\w+) islands", len(topo.islands)),
        ("topology", r"\(`(meshes/[\w.-]+)`", cfg.parallel.mesh),
        ("hosts", r"(\d+) hosts x (\d+) devices each", *hosts),
        ("link", r"joined by ([\d.]+) Gbit/s", f"{link.bandwidth_gbps:g}" if link else "-"),
        ("stages", r"a (\d+)-stage pipeline", shape.stages),
        ("stages per island", r"(\w+) stages? per island \(", per_island),
        ("data", r"data parallel (\d+)", shape.data),
        (
            "zero1",
            r"data parallel \d+ (with|without) ZeRO-1",
            "with" if cfg.optimizer.zero1 else "without",
        ),
        ("schedule", r"(1F1B|GPipe) over", SCHEDULES[cfg.parallel.schedule]),
        ("micro-batches", r"over (\d+) micro-batches", cfg.parallel.microbatches),
        ("split", r"\(`parallel\.layers_per_stage: (\w+)`", cfg.parallel.layers_per_stage),
        ("steps", r"(\d+) steps take", cfg.train.steps),
    ]


def _readme_facts(cfg):
    """The README's extra facts: where the outputs go and the planner's predicted step."""
    predicted = predict_config(cfg, load_topology(cfg.parallel.mesh), sync_collectives=True)
    out = resolve_outputs(cfg)  # the paths the run writes to
    return [
        ("metrics", r"Metrics go to `([^`]+)`", out.train.metrics_path),
        ("tensorboard", r"TensorBoard events to `([^`]+)`", out.logging.tensorboard_dir),
        ("checkpoints", r"checkpoints to `([^`]+)`", out.checkpoint.dir),
        ("predicted step", r"against ([\d.]+) s predicted", f"{predicted.step_s:.3g}"),
    ]


def mismatches(text: str, facts) -> list[str]:
    """One message per fact that ``text`` does not state, or states differently."""
    text = " ".join(text.split())  # line breaks and comment markers aside
    out = []
    for name, pattern, *want in facts:
        m = re.search(pattern, text)
        if m is None:
            out.append(f"{name}: /{pattern}/ not found")
        elif [WORDS.get(g, g) for g in m.groups()] != [str(w) for w in want]:
            out.append(f"{name}: the text says {m.group(0)!r}, the config {want}")
    return out


def quickstart_paragraph() -> str:
    with open(f"{ROOT}/README.md") as f:
        section = f.read().split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return next(p for p in section.split("\n\n") if p.startswith("The first trains"))


def yaml_header() -> str:
    lines = []
    with open(QUICKSTART) as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line[1:])
    return "".join(lines)


@pytest.fixture(scope="module")
def cfg():
    return load_config(QUICKSTART)


def test_readme_quickstart_paragraph_matches_the_config(cfg):
    text = quickstart_paragraph()
    assert "`configs/quickstart.yaml`" in text
    assert mismatches(text, _facts(cfg) + _readme_facts(cfg)) == []


def test_quickstart_yaml_header_matches_the_config(cfg):
    header = yaml_header()
    assert header.startswith(" quickstart: ")
    assert "python -m holmes_jax.train --config configs/quickstart.yaml\n" in header
    assert mismatches(header, _facts(cfg)) == []


@pytest.mark.parametrize(
    "override, fact",
    [
        ("train.steps=300", "steps"),
        ("model.hidden_size=64", "parameters"),
        ("parallel.stages=4", "stages"),
        ("parallel.microbatches=4", "micro-batches"),
        ("parallel.schedule=gpipe", "schedule"),
        ("parallel.layers_per_stage=[3,5]", "split"),
        ("parallel.mesh=meshes/cpu8-one-island.yaml", "islands"),
        ("optimizer.zero1=false", "zero1"),
        ("train.metrics_path=elsewhere.jsonl", "metrics"),
    ],
)
def test_a_config_change_the_text_does_not_follow_is_caught(override, fact):
    changed = load_config(QUICKSTART, [override])
    found = mismatches(quickstart_paragraph(), _facts(changed) + _readme_facts(changed))
    assert any(m.startswith(f"{fact}:") for m in found), found


def test_readme_points_at_the_notebook():
    with open(f"{ROOT}/README.md") as f:
        assert "`notebooks/quickstart.ipynb`" in f.read()
    with open(f"{ROOT}/notebooks/quickstart.ipynb") as f:
        assert '"cells"' in f.read()
