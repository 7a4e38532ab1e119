"""Failures' survivors measured ahead, kept in the compilation cache (``measured/``).

``train --compile-only --measure`` (``launch --warm-failures``) times the candidate plans
of one failure's survivors (:mod:`holmes_jax.runtime.replan_trial`) and :func:`save`\\ s
them: ``<cache>/measured/<run>-<lost hosts>.json``, one JSON object
``{"excluded": [...], "plans": [...], "step_s": [...]}`` written whole (a temporary file
renamed). ``<run>`` (:func:`run_key`) is what the times hold for: the run's settings but
``parallel.exclude_hosts`` and its paths, its whole topology, the package's code and
jax's version, so the full job and each failure's survivors share it and a change of
any of these measures again.

Readers: a restart on those survivors trains the fastest measured plan without a trial
of its own (:func:`~holmes_jax.runtime.replan_trial.choose`), and process 0 of the full
job reports every case to the launcher (:func:`report_all`, a ``measured`` status event
each), which may then leave a damaged island's other hosts out
(:mod:`holmes_jax.cluster.warm`). Every file is checked as a status event is
(:func:`holmes_jax.core.status.check`) before it is used; one that is not a case of this
run's is ignored with one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from holmes_jax.core import status
from holmes_jax.core.config import Config

FOLDER = "measured"
MAX_BYTES = 1 << 20  # a larger file is not a measurement


def run_key(cfg: Config) -> str:
    """What a failure's times hold for (module doc), as 16 hex digits."""
    import jax

    from holmes_jax.core.plan_request import plan_request
    from holmes_jax.planner.grid import job_topology
    from holmes_jax.runtime.rundir.compile_cache import source_digest

    parallel = dataclasses.replace(cfg.parallel, exclude_hosts=())
    train = dataclasses.replace(
        cfg.train, run_dir=None, metrics_path=None, compilation_cache=None, executable_store=False
    )
    topology = job_topology(plan_request(cfg)) if cfg.parallel.mesh else None
    parts = (cfg.model, parallel, cfg.optimizer, cfg.diloco, train, topology)
    text = f"{jax.__version__}|{source_digest()}|{parts!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _path(directory: str, cfg: Config, excluded) -> str:
    lost = hashlib.sha256(",".join(sorted(excluded)).encode()).hexdigest()[:12]
    return os.path.join(directory, FOLDER, f"{run_key(cfg)}-{lost}.json")


def save(directory: str, cfg: Config, plans: list[str], step_s: list[float]) -> str:
    """Keep the times of ``cfg``'s survivors (``parallel.exclude_hosts``); returns the path."""
    record = {"excluded": list(cfg.parallel.exclude_hosts), "plans": plans, "step_s": step_s}
    problem = status.check({"event": "measured", **record})
    if problem:
        raise ValueError(f"measured times {record}: {problem}")  # a bug in the caller
    path = _path(directory, cfg, cfg.parallel.exclude_hosts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.{os.getpid()}.part"
    with open(part, "w") as f:
        json.dump(record, f)
    os.replace(part, path)
    return path


def load_all(directory: str | None, cfg: Config) -> tuple[list[dict], list[str]]:
    """Every case of ``cfg``'s run measured in ``directory`` (by its lost hosts, in file
    name order), and one line for each of its files that was ignored."""
    if not directory:
        return [], []
    folder = os.path.join(directory, FOLDER)
    prefix = f"{run_key(cfg)}-"  # and ".json": a ".part" is being written
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith(prefix))
    except FileNotFoundError:
        return [], []
    cases, ignored = [], []
    for name in (n for n in names if n.endswith(".json")):
        path = os.path.join(folder, name)
        record, problem = _read(path)
        if record is not None and path != _path(directory, cfg, record["excluded"]):
            record, problem = None, "its lost hosts are not those its name is for"
        if record is None:
            ignored.append(f"measured times ignored: {path}: {problem}")
        else:
            cases.append(record)
    return cases, ignored


def _read(path: str) -> tuple[dict | None, str]:
    try:
        if os.path.getsize(path) > MAX_BYTES:
            return None, f"over {MAX_BYTES} bytes"
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"unreadable ({e})"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    problem = status.check({**record, "event": "measured"})
    return (None, problem) if problem else (record, "")


def load(directory: str | None, cfg: Config) -> tuple[dict | None, list[str]]:
    """The case of ``cfg``'s own survivors (its ``parallel.exclude_hosts``), or None, and
    the lines of the files ignored."""
    cases, ignored = load_all(directory, cfg)
    mine = sorted(cfg.parallel.exclude_hosts)
    return next((c for c in cases if sorted(c["excluded"]) == mine), None), ignored


def report_all(directory: str | None, cfg: Config) -> list[str]:
    """Process 0 of the full job: every measured case of this run to the launcher (a
    ``measured`` status event each); returns the lines of the files ignored."""
    cases, ignored = load_all(directory, cfg)
    for case in cases:
        status.report("measured", **case)
    return ignored
