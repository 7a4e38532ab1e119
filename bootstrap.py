#!/usr/bin/env python3
"""Set up ``.venv`` and run the quickstart job or the tests. Needs only Python 3.11+.

    python3 bootstrap.py quickstart [--set train.steps=100 ...]   # train the embedded default
    python3 bootstrap.py test [pytest args ...]                     # the test suite (as CI runs it)

The virtual environment is (re)installed when pyproject.toml changes; otherwise reused.
``test`` runs pytest on one worker per core (pytest-xdist, at most 4 workers, none on a
one-core machine) and prints the 25 slowest tests. Arguments after ``test`` go to pytest:
``-n 0`` or ``-p no:xdist`` runs in one process, ``-n N`` picks the worker count.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(ROOT, ".venv")
PYTHON = os.path.join(VENV, "bin", "python")


def ensure_venv(extras: str) -> None:
    """Create .venv and install the package (editable) with ``extras`` if out of date."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        digest = hashlib.sha256(f.read() + extras.encode()).hexdigest()
    stamp = os.path.join(VENV, f".installed-{extras or 'base'}")
    if os.path.exists(stamp) and open(stamp).read() == digest:
        return
    if not os.path.exists(PYTHON):
        print(f"bootstrap: creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    target = f".[{extras}]" if extras else "."
    print(
        f"bootstrap: installing holmes_jax{f'[{extras}]' if extras else ''} into .venv", flush=True
    )
    subprocess.check_call([PYTHON, "-m", "pip", "install", "-q", "--upgrade", "pip"], cwd=ROOT)
    subprocess.check_call([PYTHON, "-m", "pip", "install", "-q", "-e", target], cwd=ROOT)
    with open(stamp, "w") as f:
        f.write(digest)


MAX_WORKERS = 4  # each worker holds its own jax and compiled programs (~1-2 GB)


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask, not the machine's total)."""
    if hasattr(os, "process_cpu_count"):  # Python 3.13+
        return os.process_cpu_count() or 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_args(rest: list[str]) -> list[str]:
    """pytest's arguments: the durations report, workers unless ``rest`` chose, then ``rest``.

    The workers run the tests in groups (``tests/conftest.py``), whatever ``--dist`` says.
    """
    args = ["-q", "--durations=25"]
    pairs = zip(rest, rest[1:], strict=False)
    no_xdist = "-pno:xdist" in rest or any(a == "-p" and b == "no:xdist" for a, b in pairs)
    chose = any(
        a in ("-n", "--numprocesses") or a.startswith(("-n", "--numprocesses=")) for a in rest
    )
    if not (no_xdist or chose):
        workers = min(cpu_count(), MAX_WORKERS)
        args += ["-n", str(workers) if workers > 1 else "0"]
    return args + rest


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("quickstart", "test"):
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if sys.version_info < (3, 11):  # noqa: UP036 (the check is for users on older Pythons)
        print("bootstrap: holmes_jax needs Python 3.11 or newer", file=sys.stderr)
        return 2
    if command == "quickstart":
        ensure_venv("")
        cmd = [PYTHON, "-m", "holmes_jax.train", "--config", "configs/quickstart.yaml", *rest]
    else:
        ensure_venv("dev")
        cmd = [PYTHON, "-m", "pytest", *pytest_args(rest)]
    print("bootstrap: " + " ".join(cmd[1:]), flush=True)
    # CPU runs: huge pages for malloc's large blocks (glibc reads this when a process starts)
    from holmes_jax.cluster.host_memory import with_huge_pages

    return subprocess.call(cmd, cwd=ROOT, env=with_huge_pages(os.environ))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
