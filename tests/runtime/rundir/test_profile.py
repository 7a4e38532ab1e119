"""Day-two tools of the trainer: profiler traces (``--profile``), ``--print-config``, the
metrics' peak memory, TensorBoard's eval tags and optional wandb logging."""

import glob
import gzip
import json
import os
import subprocess
import sys
import types

import pytest

from holmes_jax import train
from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import flops_per_token
from holmes_jax.runtime.rundir.devices import peak_memory_gb
from holmes_jax.runtime.rundir.metrics import MetricsLogger
from holmes_jax.runtime.rundir.paths import resolve_outputs
from holmes_jax.runtime.rundir.profiling import trace_name
from tests.common import ROOT, TINY_RUN, as_flags

# Four steps of the tiny model as two DiLoCo replicas syncing and evaluating every second
# step, so the traced steps 3 and 4 hold an outer sync and an evaluation (both compiled at
# step 2, outside the trace). No checkpoints: orbax's first save compiles for ~10 s here.
TINY = [
    *TINY_RUN,
    "train.steps=4",
    "train.eval_every=2",
    "train.eval_batches=1",
    "logging.log_every=1",
    "logging.progress=plain",
    "checkpoint.dir=null",
    "parallel.replica=2",
    "diloco.enabled=true",
    "diloco.inner_steps=2",
]


def _traced_events(trace_dir: str) -> list[dict]:
    (path,) = glob.glob(
        os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")
    )
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def _yaml_body(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines() if not line.startswith("#"))


@pytest.mark.slow
def test_profile_2_2_traces_steps_3_and_4_and_print_config_is_config_yaml(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [*as_flags(TINY), "--set", f"train.run_dir={run_dir}", "--profile", "2:2"]

    # --print-config: YAML that loads, nothing written, nothing trained.
    assert train.main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert not run_dir.exists()
    (tmp_path / "printed.yaml").write_text(printed)
    resolved = load_config(tmp_path / "printed.yaml")
    assert resolved.logging.profile_steps == "2:2"
    assert resolved.logging.profile_dir == f"{run_dir}/profile"
    assert resolved.parallel.layers_per_stage == (2,)  # resolved: was unset

    assert train.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    # The run wrote the config it printed.
    written = (run_dir / "config.yaml").read_text()
    assert _yaml_body(written) == _yaml_body(printed)
    assert load_config(run_dir / "config.yaml") == resolved

    # One trace directory per process, named by host, holding the TensorBoard and Perfetto
    # files of steps 3 and 4 only (step 1 compiled; the trace stopped after step 4).
    trace_dir = run_dir / "profile" / trace_name(0, 1)
    assert os.listdir(run_dir / "profile") == [trace_name(0, 1)]
    assert glob.glob(str(trace_dir / "plugins" / "profile" / "*" / "*.xplane.pb"))
    events = _traced_events(str(trace_dir))
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train_step")
    assert steps == [3, 4]
    names = {e.get("name") for e in events}
    assert {"eval", "diloco_outer_sync", "metrics"} <= names
    assert f"profile: tracing steps 3-4 into {trace_dir}/" in out
    (done,) = [line for line in out if line.startswith("profile: steps 3-4 traced in ")]
    assert f" s to {trace_dir}/plugins/profile/" in done and "perfetto_trace" in done
    assert any(line.startswith("run dir ") and "profile/" in line for line in out)
    # XLA:CPU reports no memory stats: the records leave peak_memory_gb out.
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert not any("peak_memory_gb" in r for r in records)


@pytest.mark.parametrize(
    "value, rule",
    [
        ("0:2", "START must be >= 1 (step 1 compiles: it is never traced)"),
        ("2:0", "N must be >= 1"),
        ("2", "must be START:N"),
        ("2:x", "must be START:N"),
        ("-1:2", "must be START:N"),
        ("4:2", "START+N=6 must be <= train.steps=5"),
    ],
)
def test_bad_profile_values_are_one_line_errors(value, rule, capsys):
    argv = ["--set", "train.steps=5", "--set", "train.run_dir=r", f"--profile={value}"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: logging.profile_steps='{value}': {rule}")
    assert err.count("\n") == 1


def test_profile_needs_somewhere_to_write(capsys):
    assert train.main(["--set", "train.steps=5", "--profile", "1:1"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: logging.profile_steps='1:1': needs train.run_dir"
    )
    # In YAML and --set, a plain 2:2 is the text, not YAML 1.1's base-60 number 122.
    cfg = load_config(None, ["train.run_dir=r", "logging.profile_steps=2:2"])
    assert cfg.logging.profile_window == (2, 2)


def test_trace_names_are_hosts_and_processes():
    assert trace_name(0, 1, environ={"HOLMES_HOST": "ib-0"}) == "ib-0"
    assert trace_name(3, 4, environ={"HOLMES_HOST": "roce 1"}) == "process_3-roce_1"
    import socket

    assert trace_name(0, 1, environ={}) == socket.gethostname().replace("/", "_")


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_peak_memory_is_the_largest_device_peak_or_absent():
    gb = 1e9
    devices = [_Device({"peak_bytes_in_use": 2 * gb}), _Device({"peak_bytes_in_use": 3 * gb})]
    assert peak_memory_gb(devices) == 3.0
    assert peak_memory_gb([_Device(None)]) is None  # XLA:CPU
    assert peak_memory_gb([_Device({"bytes_in_use": 1})]) is None
    assert peak_memory_gb([_Device(RuntimeError("no stats"))]) is None
    assert peak_memory_gb([]) is None


# -------------------------------------------------------------------- TensorBoard and wandb


def _logger(tmp_path, *overrides):
    cfg = load_config(
        None,
        [
            f"train.run_dir={tmp_path}",
            "train.metrics_path=null",
            "logging.progress=none",
            *overrides,
        ],
    )
    flops = flops_per_token(cfg.model.spec, cfg.model.remat)
    return MetricsLogger(resolve_outputs(cfg), flops=flops, num_devices=8)


def test_wandb_without_the_package_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError) as err:
        _logger(tmp_path, "logging.wandb=holmes")
    assert str(err.value) == "logging.wandb=holmes: needs the wandb package (pip install wandb)"


def test_records_reach_tensorboard_and_wandb_under_train_and_eval(tmp_path, monkeypatch):
    calls = []

    class Sink:  # a SummaryWriter and a wandb run in one
        def __init__(self, *args, **kwargs):
            calls.append(("open", args, kwargs))

        def add_scalar(self, name, value, step):
            calls.append(("tb", name, value, step))

        def log(self, scalars, step):
            calls.append(("wandb", scalars, step))

        def close(self):
            calls.append(("tb closed",))

        def finish(self):
            calls.append(("wandb finished",))

    import tensorboardX

    monkeypatch.setattr(tensorboardX, "SummaryWriter", Sink)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=Sink))
    logger = _logger(tmp_path, "logging.wandb=holmes")
    logger.open(0)
    logger.write({"step": 1, "loss": 5.0, "lr": 0.1})
    logger.write({"step": 2, "loss": 4.0, "eval_loss": 4.5, "peak_memory_gb": 1.5})
    logger.close()

    assert ("open", (str(tmp_path / "tb"),), {}) in calls
    (init,) = [c[2] for c in calls if c[0] == "open" and c[2]]
    assert init["project"] == "holmes" and init["dir"] == str(tmp_path)
    assert init["config"]["logging"]["wandb"] == "holmes"
    tb = [c[1:] for c in calls if c[0] == "tb"]
    assert tb == [
        ("train/loss", 5.0, 1),
        ("train/lr", 0.1, 1),
        ("train/loss", 4.0, 2),
        ("eval/loss", 4.5, 2),
        ("train/peak_memory_gb", 1.5, 2),
    ]
    assert [c[1:] for c in calls if c[0] == "wandb"] == [
        ({"train/loss": 5.0, "train/lr": 0.1}, 1),
        ({"train/loss": 4.0, "eval/loss": 4.5, "train/peak_memory_gb": 1.5}, 2),
    ]
    assert calls[-2:] == [("tb closed",), ("wandb finished",)]


TB_WITHOUT_TORCH = """
import glob, importlib.util, sys
from holmes_jax.runtime.rundir.metrics import _summary_writer
writer = _summary_writer()(sys.argv[1])
writer.add_scalar("train/loss", 5.0, 1)
writer.close()
print("torch" in sys.modules, bool(glob.glob(sys.argv[1] + "/events.out.tfevents.*")))
if importlib.util.find_spec("torch") is not None:  # the block is lifted once imported
    import torch  # noqa: F401
print("ok")
"""


def test_tensorboard_records_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch when it is installed (a second of every start and
    restart); the writer is imported without it and still writes its events file."""
    done = subprocess.run(
        [sys.executable, "-c", TB_WITHOUT_TORCH, str(tmp_path / "tb")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "ok"], done.stdout
