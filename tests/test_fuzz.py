"""Seeded fuzzing of the loaders and the three CLIs: bad input is one line and exit code 2.

Each case mutates one shipped config (``configs/*.yaml``), one shipped topology
(``meshes/*.yaml``) or a valid profile (:func:`valid_profile`), either as data (wrong
types, missing and extra keys, huge, negative, NaN and infinite numbers, wrong nesting,
alias bombs, control characters) or as text (binary bytes, non-UTF-8, truncation, deep
nesting, empty files, YAML that no constructor accepts), and feeds the file through
``load_config`` / ``load_topology`` / ``load_profile`` and the CLIs' ``main(argv)``
in-process. A case passes when each step either succeeds or raises ``ConfigError`` (the
CLIs: returns 2 with exactly one non-empty ``error:`` line on stderr); any other exception,
a crash or a hang fails it. ``train.main`` and ``probe.main`` are called only on input the
loaders reject (valid input would train or measure); valid input goes through the device
and placement checks (``resolve_shape``) and ``python -m holmes_jax.plan`` instead.

Guard: the cases run in one fresh worker interpreter (``python -m tests.test_fuzz``: no
jax, one BLAS thread) that forks a child per case under ``RLIMIT_AS`` (its address space at
the fork + 1 GiB) and a 30 s alarm, so a missing bound fails its case (``MemoryError``,
killed by the alarm) instead of swapping or hanging the machine. Case ``n`` is a pure
function of ``BASE_SEED`` and ``n`` (its test id is ``seed<BASE_SEED>-<n>``); rerun one
with ``python -m tests.test_fuzz --case n``.
"""

import contextlib
import copy
import io
import json
import math
import os
import random
import reprlib
import resource
import signal
import subprocess
import sys
import time

import pytest
import yaml

from holmes_jax import plan, probe, train
from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.grid import load_mesh_topology, resolve_shape
from holmes_jax.planner.profiles import load_profile
from holmes_jax.planner.topology import load_topology
from tests.common import CONFIGS, MESHES, ROOT, config_path, mesh_path

BASE_SEED = 20240515
N_CASES = 330
GUARD_BYTES = 1 << 30
ALARM_S = 30
QUICK, TWO = config_path("quickstart.yaml"), mesh_path("cpu8-two-islands.yaml")
TARGETS = ("config", "mesh", "profile")


def valid_profile() -> dict:
    """A profile of ``cpu8-two-islands`` that loads: every key the schema has."""
    link = {"bandwidth_gbps": 20, "latency_us": 15}
    return {
        "version": 1,
        "topology": "cpu8-two-islands",
        "measured_with": {
            "hidden_size": 128, "seq_len": 128, "num_heads": 4, "mlp_ratio": 4,
            "microbatch_size": 1, "tensor": 1, "act_bytes": 4,
        },
        "compute": {
            "ib": {"layer_fwd_s": 0.004, "layer_bwd_s": 0.008},
            "roce": {"layer_fwd_s": 0.05, "layer_bwd_s": 0.1},
        },
        "links": {
            "tensor": {"bandwidth_gbps": 80, "latency_us": 8},
            "data:ib": link, "data:roce:all-gather": link, "data:*:reduce-scatter": link,
            "stage": link, "stage:ib:roce": link,
        },
    }  # fmt: skip


# --------------------------------------------------------------------------- mutations


def _bomb(depth: int = 12) -> list:
    """An alias bomb: 9**depth leaves as YAML text, a few hundred bytes on disk."""
    node: list = ["lol"] * 9
    for _ in range(depth):
        node = [node] * 9
    return node


# What a value may become. The alias bomb and bytes only go into YAML (JSON would expand
# the bomb and cannot hold bytes).
WEIRD = [
    0, -1, 1, 2, 3, 7, 10**9, 10**12, 2**63, 10**100, -(10**12), 0.5, -0.0, 1e-300, 1e308,
    math.nan, math.inf, -math.inf, True, False, None, "", " ", "x", "auto", "none",
    "1e-3", "1e400", "a\nb", "\t", "\x00", "é😀", "x" * 5000, "1000000000000",
    [], [1, 2], [[1]], ["a", {"b": 1}], {}, {"a": 1}, {"between": ["ib", "roce"]},
]  # fmt: skip
YAML_ONLY = [b"\x00\xff", "bomb", "deep"]
EXTRA_KEYS = ["extra", "", 1, None, True, 2.5, "a.b", "name\n", "x" * 300]
OPS = ("replace", "replace", "delete", "extra", "wrap", "flip", "scale", "repeat", "str")
FACTORS = (-1, 0, 2, 0.5, 10**9, 10**12, 1e300, math.nan)


def _weird(rng: random.Random, as_json: bool):
    value = rng.choice(WEIRD + ([] if as_json else YAML_ONLY))
    if value == "bomb":
        return _bomb()
    if value == "deep":
        return json.loads("[" * 60 + "1" + "]" * 60)
    return copy.deepcopy(value)


def _slots(node, out: list, seen: set) -> list:
    """Every (container, key) in the tree, each container once (aliases are shared)."""
    if id(node) in seen or not isinstance(node, dict | list):
        return out
    seen.add(id(node))
    for key in list(node) if isinstance(node, dict) else range(len(node)):
        out.append((node, key))
        if len(out) < 5000:
            _slots(node[key], out, seen)
    return out


def _mild(rng: random.Random, value):
    """A plausible value of the same type (what a user edits), often still valid."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice([value + 1, value * 2, max(value // 2, 1), 1, 0])
    if isinstance(value, float):
        return rng.choice([value * 2, value / 2, 0.0])
    if isinstance(value, list):
        return value[::-1]
    return rng.choice(["auto", "none", "1f1b", "x", None, value])


def _mutate(rng: random.Random, box: dict, as_json: bool, mild: bool = False) -> str:
    """One mutation of the tree in ``box["root"]``; returns what it did."""
    container, key = rng.choice(_slots(box, [], set()))
    value, op = container[key], "mild" if mild else rng.choice(OPS)
    where = f"{op} [{key!r}]"[:60]
    if op == "mild":
        container[key] = _mild(rng, value)
    elif op == "delete":
        if container is box:
            box["root"] = None
        elif isinstance(container, dict):
            del container[key]
        else:
            container.pop(key)
    elif op == "extra" and isinstance(container, dict):
        container[rng.choice(EXTRA_KEYS)] = _weird(rng, as_json)
    elif op == "extra":
        container.append(copy.deepcopy(rng.choice(container)))
    elif op == "wrap":
        container[key] = rng.choice([[value], {"x": value}])
    elif op == "flip":
        if isinstance(value, dict):
            container[key] = list(value.values())
        elif isinstance(value, list):
            container[key] = {f"k{i}": v for i, v in enumerate(value)}
        else:
            container[key] = [value]
    elif op == "scale" and isinstance(value, int | float) and not isinstance(value, bool):
        container[key] = value * rng.choice(FACTORS)
    elif op == "repeat" and isinstance(value, list) and value:
        container[key] = value * rng.choice([2, 300])
    elif op == "str":
        container[key] = reprlib.repr(value)  # str() of an alias bomb would never end
    else:
        container[key] = _weird(rng, as_json)
        where = f"replace [{key!r}]"[:60]
    return where


def _raw(rng: random.Random, text: str) -> tuple[bytes, str]:
    """A text-level mutation of a file: what the data mutations cannot express."""
    i = rng.randrange(len(text) + 1)
    choices = {
        "empty": b"",
        "binary": bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3000))),
        "non-utf8": text[:i].encode() + b"\xff\xfe" + text[i:].encode(),
        "truncated": text[:i].encode(),
        "char": (text[:i] + rng.choice(":[]{}-\t&*!|>%@`'\"#,?") + text[i + 1 :]).encode(),
        "no line": "\n".join(rng.sample(text.split("\n"), max(text.count("\n") - 1, 0))).encode(),
        "tab": text.replace("  ", "\t", 1).encode(),
        "scalar": b"42\n",
        "list": b"- a\n- b\n",
        "null": b"null\n",
        "deep": b"[" * 5000,
        "bad date": b"a: 2020-13-45\n",
        "big int": b"a: " + b"9" * 5000 + b"\n",
        "python tag": b"a: !!python/object/apply:os.system ['true']\n",
        "recursive": b"a: &x [*x, *x]\n",
        "duplicate keys": text.encode() + b"\n" + text.encode(),
    }
    what = rng.choice(sorted(choices))
    return choices[what], f"text: {what}"


def case_input(n: int) -> tuple[str, bytes, str]:
    """(target, file bytes, what was done) of case ``n``; a pure function of n."""
    rng = random.Random(f"{BASE_SEED}:{n}")
    target = TARGETS[n % len(TARGETS)]
    if target == "profile":
        source, text = "profile", json.dumps(valid_profile(), indent=1)
    else:
        source = rng.choice(CONFIGS if target == "config" else MESHES)
        with open(source) as f:
            text = f.read()
    kind = rng.random()  # 15% text, 35% one edit a user might make, 50% 1 to 3 wild ones
    if kind < 0.15:
        data, what = _raw(rng, text)
    else:
        as_json, mild = target == "profile", kind < 0.5
        box = {"root": json.loads(text) if as_json else yaml.safe_load(text)}
        count = 1 if mild else rng.randint(1, 3)
        what = "; ".join(_mutate(rng, box, as_json, mild) for _ in range(count))
        if as_json:
            data = json.dumps(box["root"]).encode()
        else:
            data = yaml.safe_dump(box["root"], sort_keys=False, allow_unicode=True).encode()
    return target, data, f"{os.path.basename(source)}: {what}"


# --------------------------------------------------------------------------- one case


class Failure(Exception):
    """A step broke the contract (not a success, not a one-line ConfigError)."""


def _load(fn, *args):
    """``fn(*args)``, or None when it raises ConfigError (one non-empty line)."""
    try:
        return fn(*args)
    except ConfigError as e:
        if not str(e).strip() or "\n" in str(e):
            raise Failure(f"{fn.__name__}: ConfigError not one line: {str(e)[:300]!r}") from None
        return None
    except Exception as e:
        raise Failure(f"{fn.__name__}: {type(e).__name__}: {str(e)[:300]}") from None


def _cli(main, argv: list[str], allowed=(0, 2)) -> int:
    """``main(argv)``; its exit code must be allowed, and 2 means one ``error:`` line."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as e:
        raise Failure(f"{main.__module__}.main: {type(e).__name__}: {str(e)[:300]}") from None
    text = err.getvalue()
    if code not in allowed:
        raise Failure(f"{main.__module__}.main returned {code}, wanted {allowed}: {text[:300]}")
    if code == 2 and not (
        text.startswith("error: ") and text.count("\n") == 1 and text[7:].strip()
    ):
        raise Failure(f"{main.__module__}.main: stderr is not one error line: {text[:300]!r}")
    if code == 0 and "--json" in argv and "--show-mesh" not in argv:
        json.loads(out.getvalue())
    return code


def run_case(n: int, folder: str) -> dict:
    """Case ``n`` end to end; the record says whether its input loaded and any failure."""
    target, data, what = case_input(n)
    path = os.path.join(folder, f"case{n}.{'json' if target == 'profile' else 'yaml'}")
    with open(path, "wb") as f:
        f.write(data)
    start, loaded = time.time(), False
    flags = random.Random(n).choice([[], ["--keep-degrees"], ["--show-mesh"]])
    try:
        if target == "config":
            cfg = _load(load_config, path)
            req = plan_request(cfg) if cfg else None
            topo = _load(load_mesh_topology, req) if req else None
            loaded = cfg is not None and (topo is not None or not cfg.parallel.mesh)
            if not loaded:  # would fail before jax: the config or its topology
                _cli(train.main, ["--config", path], (2,))
            if not loaded or not cfg.parallel.mesh:
                _cli(probe.main, ["--config", path], (2,))
            if loaded:
                _load(resolve_shape, req, topo.num_devices if topo else 8, topo)
            _cli(plan.main, ["--config", path, "--mesh", TWO, "--json", *flags])
        elif target == "mesh":
            topo = _load(load_topology, path)
            loaded = topo is not None
            if not loaded:
                _cli(train.main, ["--config", QUICK, "--mesh", path], (2,))
                _cli(probe.main, ["--mesh", path], (2,))
            else:
                req = plan_request(load_config(QUICK, [f"parallel.mesh={path}"]))
                _load(resolve_shape, req, topo.num_devices, topo)
            _cli(plan.main, ["--config", QUICK, "--mesh", path, "--json", *flags], (0, 2))
        else:
            loaded = _load(load_profile, path, load_topology(TWO)) is not None
            argv = ["--config", QUICK, "--mesh", TWO, "--profile", path, "--json"]
            _cli(plan.main, argv, (0, 2) if loaded else (2,))
        error = None
    except Failure as e:
        error = str(e)
    seconds = round(time.time() - start, 3)
    return dict(case=n, target=target, what=what, loaded=loaded, error=error, seconds=seconds)


# --------------------------------------------------------------------------- the worker


def _guarded_child(n: int, folder: str, write_fd: int) -> None:
    log = os.open(os.path.join(folder, f"case{n}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)  # what C code prints (an abort's stack) goes to the case's log
    os.dup2(log, 2)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (vm + GUARD_BYTES, hard))
    signal.alarm(ALARM_S)  # default action: the child dies
    try:
        record = run_case(n, folder)
    except BaseException as e:  # MemoryError while building the case, ...
        record = dict(case=n, error=f"worker: {type(e).__name__}: {str(e)[:300]}")
    with os.fdopen(write_fd, "w") as f:
        f.write(json.dumps(record))
    os._exit(0)


def _death(status: int, folder: str, n: int) -> str:
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status))
        why = f"{sig.name}{f' (the {ALARM_S} s alarm)' if sig == signal.SIGALRM else ''}"
    else:
        why = f"exit status {status}"
    with open(os.path.join(folder, f"case{n}.log"), errors="replace") as f:
        tail = " ".join(f.read()[-400:].split())
    return f"child died: {why}; log: {tail}"


def worker(folder: str, count: int) -> None:
    """Run cases 0..count-1, each in a guarded child; one JSON line each to results.jsonl."""
    with open(os.path.join(folder, "results.jsonl"), "w") as out:
        for n in range(count):
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _guarded_child(n, folder, write_fd)
            os.close(write_fd)
            with os.fdopen(read_fd) as f:
                text = f.read()
            _, status = os.waitpid(pid, 0)
            if not text:
                target, _, what = case_input(n)
                error = _death(status, folder, n)
                text = json.dumps(dict(case=n, target=target, what=what, error=error))
            out.write(text + "\n")
            out.flush()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_fuzz", str(folder), str(N_CASES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(folder / "results.jsonl") as f:
        records = {rec["case"]: rec for rec in map(json.loads, f)}
    print(f"fuzz: {len(records)} cases in {time.time() - start:.1f} s")
    return records


@pytest.mark.parametrize("case", range(N_CASES), ids=lambda n: f"seed{BASE_SEED}-{n}")
def test_fuzz_case(results, case):
    rec = results.get(case)
    assert rec is not None, f"case {case} never reported"
    assert rec["error"] is None, f"case {case} ({rec.get('what')}): {rec['error']}"


def test_fuzz_reaches_both_outcomes(results):
    """The mutations are neither all fatal nor all harmless, per target."""
    for target in TARGETS:
        recs = [r for r in results.values() if r.get("target") == target]
        loaded = sum(r.get("loaded", False) for r in recs)
        assert 0.05 * len(recs) < loaded < 0.95 * len(recs), (target, loaded, len(recs))


# --------------------------------------------------------------------------- regressions


def _cli_subprocess(*args: str) -> subprocess.CompletedProcess:
    """``python args`` under a memory guard (4 GiB of address space), for a real exit code."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))

    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=limit,
    )  # fmt: skip


def _mesh_file(tmp_path, edit) -> str:
    with open(TWO) as f:
        raw = yaml.safe_load(f)
    edit(raw)
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_huge_host_count_is_one_line_not_a_memory_error(tmp_path):
    path = _mesh_file(tmp_path, lambda r: r["islands"][0].update(hosts=10**12))
    res = _cli_subprocess("-m", "holmes_jax.plan", "--config", QUICK, "--mesh", path)
    assert res.returncode == 2 and res.stdout == "", res.stderr[-2000:]
    assert res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert "islands[0].hosts=1000000000000: must be <= 100000 (hosts per island)" in res.stderr


def test_mapping_in_between_is_one_line_not_a_type_error(tmp_path):
    override = {"between": [{"ib": 1}, "roce"], "bandwidth_gbps": 2, "latency_us": 9}
    path = _mesh_file(tmp_path, lambda r: r["inter_island"].update(overrides=[override]))
    res = _cli_subprocess("-m", "holmes_jax.probe", "--mesh", path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert "inter_island.overrides[0].between=[{'ib': 1}, 'roce']" in res.stderr


def test_train_rejects_a_huge_model_before_jax():
    code = (
        "import sys\n"
        "from holmes_jax.train import main\n"
        "code = main(['--set', 'model.num_layers=1000000000000'])\n"
        "assert 'jax' not in sys.modules, 'the error came after jax was imported'\n"
        "sys.exit(code)\n"
    )
    res = _cli_subprocess("-c", code)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert "model.num_layers=1000000000000: must be <= 4096 (layers)" in res.stderr


def test_case_inputs_are_reproducible():
    assert case_input(17) == case_input(17)
    assert len({case_input(n)[1] for n in range(30)}) > 25


if __name__ == "__main__":
    if sys.argv[1] == "--case":  # python -m tests.test_fuzz --case 17: one case, no guard
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(run_case(int(sys.argv[2]), folder)))
    else:
        worker(sys.argv[1], int(sys.argv[2]))
