"""One-line errors of the entry points a new user meets first (exit code 2)."""

import subprocess
import sys

from holmes_jax import launch
from tests.common import ROOT


def test_launch_without_train_arguments_asks_for_a_config(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    mesh = "meshes/cpu8-two-islands.yaml"
    for argv in (["--mesh", mesh], ["--mesh", mesh, "--"]):
        assert launch.main(argv) == 2
        err = capsys.readouterr().err
        assert err == (
            "error: --config=None: a config is required after '--' (python -m holmes_jax.launch "
            f"--mesh {mesh} -- --config configs/quickstart.yaml)\n"
        )


def test_launch_without_train_arguments_in_a_fresh_process():
    """The command as a new user types it: one line, exit 2, no process started."""
    done = subprocess.run(
        [sys.executable, "-m", "holmes_jax.launch", "--mesh", "meshes/cpu8-two-islands.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: --config=None: a config is required after '--'")
    assert done.stderr.count("\n") == 1
