"""The cluster recipes (docs/multihost.md, "Surviving failures") do what they say.

- ``scripts/slurm/train_restarts.sbatch`` parses (``bash -n``) and, run with stand-ins for
  ``srun``, ``scontrol`` and the trainer, restarts on the exit codes that deserve it, stops
  on exit 2 (even where srun reports a peer's 3), passes the survivors' host list to the
  trainer, keeps the run directory and the compilation cache fixed, and gives up after
  ``MAX_RESTARTS``.
- ``scripts/k8s/jobset.yaml`` parses and holds the fields the docs rely on (maxRestarts,
  the exit-2 rule, the claim for the run directory); its container script, run for every
  pod with a stand-in trainer, numbers the survivors in the topology's order.
- Every ``--set key=value`` in both names a config key, and the command lines they produce
  load as configs whose survivors the planner can plan.

No jax, no cluster: bash and Python stand-ins only.
"""

import json
import os
import re
import stat
import subprocess
import sys

import pytest
import yaml

from holmes_jax.core.config import Config, load_config
from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.failures import replan
from holmes_jax.planner.grid import load_mesh_topology
from holmes_jax.planner.topology import load_topology
from tests.common import ROOT

SBATCH = os.path.join(ROOT, "scripts", "slurm", "train_restarts.sbatch")
JOBSET = os.path.join(ROOT, "scripts", "k8s", "jobset.yaml")
MESH = "meshes/paper-ib-roce-4x8.yaml"  # both recipes' topology
HOSTS = ["ib-0", "ib-1", "roce-0", "roce-1"]
NODES = ["n1", "n2", "n3", "n4"]

# The trainer: records its argument list and environment, exits as the test says. Anything
# else (the recipe's `python -c` that lists the topology's hosts) runs in real Python.
FAKE_PYTHON = """#!{python}
import json, os, sys
if sys.argv[1:3] != ["-m", "holmes_jax.train"]:
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])
env = os.environ
keys = ("HOLMES_HOST", "HOLMES_CONTINUE_RUN_DIR", "SLURM_PROCID", "FAKE_ATTEMPT", "HOSTNAME")
with open(env["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[3:], **{{k: env.get(k) for k in keys}}}}) + "\\n")
codes = env.get("FAKE_CODES", "0").split()
code = int(codes[int(env.get("FAKE_ATTEMPT", "0"))])
# process 0 exits with the attempt's code; its peers see it fail (3) or finish with it (0)
sys.exit(code if env.get("SLURM_PROCID", "0") == "0" or code == 0 else 3)
"""

# srun: a probe (`true` on one node) answers unless the node is in FAKE_DIR/dead; a step
# runs its command once per task, in order, with SLURM_PROCID, and returns the highest
# exit code (as srun does). After a failed first step, FAKE_KILL's node dies.
FAKE_SRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
opts = {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
fake = os.environ["FAKE_DIR"]
dead = os.path.join(fake, "dead")
dead_nodes = open(dead).read().split() if os.path.exists(dead) else []
if args == ["true"]:
    sys.exit(1 if opts["nodelist"] in dead_nodes else 0)
counter = os.path.join(fake, "steps")
attempt = len(open(counter).read()) if os.path.exists(counter) else 0
with open(counter, "a") as f:
    f.write("x")
with open(os.environ["SLURM_HOSTFILE"]) as f:
    nodes = f.read().split()
assert opts["distribution"] == "arbitrary" and len(nodes) == int(opts["ntasks"]), opts
codes = []
for i in range(int(opts["ntasks"])):
    env = dict(os.environ, SLURM_PROCID=str(i), FAKE_ATTEMPT=str(attempt), FAKE_NODE=nodes[i])
    codes.append(subprocess.run(args, env=env).returncode)
if attempt == 0 and max(codes) and os.environ.get("FAKE_KILL"):
    with open(dead, "a") as f:
        f.write(os.environ["FAKE_KILL"] + "\\n")
sys.exit(max(codes))
"""

FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\\n' $FAKE_NODES; exit 0; fi
echo "$*" >> "$FAKE_DIR/scontrol"
"""


def _script(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def fakes(tmp_path):
    """A folder of stand-ins (srun, scontrol, python) and the environment that uses them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = sys.executable
    fake_python = _script(bin_dir / "python", FAKE_PYTHON.format(python=python))
    _script(bin_dir / "srun", FAKE_SRUN.format(python=python))
    _script(bin_dir / "scontrol", FAKE_SCONTROL)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": ROOT,
        "PYTHON": fake_python,
        "FAKE_DIR": str(tmp_path),
        "FAKE_LOG": str(tmp_path / "train.jsonl"),
        "FAKE_NODES": " ".join(NODES),
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n[1-4]",
        "RUN_DIR": str(tmp_path / "run"),
        "CACHE": str(tmp_path / "cache"),
        "PROBE_S": "10",
    }
    return tmp_path, env


def _records(tmp_path):
    with open(tmp_path / "train.jsonl") as f:
        return [json.loads(line) for line in f]


def _sbatch(env, *args, **extra):
    res = subprocess.run(
        ["bash", SBATCH, *args],
        env={**env, **extra},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return res.returncode, res.stdout, res.stderr


def _sets(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def _config(argv):
    """The config a recorded trainer command line loads (``--mesh`` is parallel.mesh)."""
    mesh = os.path.join(ROOT, _value(argv, "--mesh"))
    return load_config(
        os.path.join(ROOT, _value(argv, "--config")), [*_sets(argv), f"parallel.mesh={mesh}"]
    )


def test_sbatch_parses_and_states_the_exit_code_rule():
    subprocess.run(["bash", "-n", SBATCH], check=True)
    text = open(SBATCH).read()
    assert text.startswith("#!/bin/bash\n# train_restarts.sbatch: ")
    assert "exit 2  a config or usage error" in text and "not retried" in text
    assert "#SBATCH --no-kill" in text and "HOLMES_CONTINUE_RUN_DIR" in text


def test_sbatch_restarts_on_the_survivors_of_a_lost_node(fakes):
    """Attempt 0 fails (exit 3) and node n4 (roce-1) dies: attempt 1 runs 3 processes in
    the topology's order with parallel.exclude_hosts=[roce-1] and finishes."""
    tmp_path, env = fakes
    extra = "data.path=/shared/data/train.bin"
    code, out, err = _sbatch(env, "--set", extra, FAKE_CODES="3 0", FAKE_KILL="n4")
    assert code == 0, out + err
    runs = _records(tmp_path)
    assert [r["FAKE_ATTEMPT"] for r in runs] == ["0"] * 4 + ["1"] * 3
    assert [r["HOLMES_HOST"] for r in runs] == HOSTS + HOSTS[:3]
    assert {r["HOLMES_CONTINUE_RUN_DIR"] for r in runs} == {env["RUN_DIR"]}
    first, second = _sets(runs[0]["argv"]), _sets(runs[4]["argv"])
    assert f"train.run_dir={env['RUN_DIR']}" in first and extra in first
    assert f"train.compilation_cache={env['CACHE']}" in first
    assert not any(s.startswith("parallel.exclude_hosts=") for s in first)
    assert second == [*first, "parallel.exclude_hosts=[roce-1]"]
    state = tmp_path / "run" / "slurm-77-0"
    assert (state / "attempt-1" / "hostfile").read_text().split() == NODES[:3]
    assert "no answer from roce-1" in out and "restart 1 of 3" in out and "done" in out
    # both command lines load, and the planner plans the survivors of the second
    whole, survivors = (_config(r["argv"]) for r in (runs[0], runs[4]))
    whole, survivors = plan_request(whole), plan_request(survivors)
    assert load_mesh_topology(whole).num_hosts == 4
    assert load_mesh_topology(survivors).num_hosts == 3
    full = load_topology(os.path.join(ROOT, MESH))
    assert replan(survivors, full, survivors.parallel.exclude_hosts).topology.num_hosts == 3


def test_sbatch_does_not_retry_a_config_error(fakes):
    """Process 0 exits 2, its peers 3: srun reports 3, the recorded 2 ends the job."""
    tmp_path, env = fakes
    code, out, err = _sbatch(env, FAKE_CODES="2 0")
    assert code == 2, out + err
    assert len(_records(tmp_path)) == 4 and "not retried" in out


def test_sbatch_gives_up_after_max_restarts(fakes):
    """Process 0 fails (1) every time, its peers exit 3: the job ends with srun's code."""
    tmp_path, env = fakes
    code, out, err = _sbatch(env, FAKE_CODES="1 1 1 1", MAX_RESTARTS="2")
    assert code == 3, out + err
    assert [r["FAKE_ATTEMPT"] for r in _records(tmp_path)] == ["0"] * 4 + ["1"] * 4 + ["2"] * 4
    assert "giving up after 2 restarts" in out


def test_sbatch_host_map_and_requeue(fakes):
    """HOST_MAP puts each node at its host; REQUEUE=1 asks for a full allocation instead
    of running on the survivors."""
    tmp_path, env = fakes
    host_map = tmp_path / "hosts.map"
    pairs = list(zip(reversed(NODES), HOSTS, strict=True))  # n4 runs ib-0, ...
    host_map.write_text("# node host\n" + "".join(f"{n} {h}\n" for n, h in pairs))
    code, out, err = _sbatch(env, HOST_MAP=str(host_map))
    assert code == 0, out + err
    hostfile = tmp_path / "run" / "slurm-77-0" / "attempt-0" / "hostfile"
    assert hostfile.read_text().split() == list(reversed(NODES))
    (tmp_path / "dead").write_text("n2\n")
    code, out, err = _sbatch(env, REQUEUE="1")
    assert code == 0, out + err
    assert (tmp_path / "scontrol").read_text() == "requeue 77\n"
    assert len(_records(tmp_path)) == 4  # only the first run's processes trained


def _jobset():
    with open(JOBSET) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def test_jobset_has_the_fields_the_docs_rely_on():
    text = open(JOBSET).read()
    assert text.startswith("# jobset.yaml: ")
    docs = _jobset()
    assert set(docs) == {"PersistentVolumeClaim", "ConfigMap", "JobSet"}
    pvc, hosts, js = docs["PersistentVolumeClaim"], docs["ConfigMap"], docs["JobSet"]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    (rule,) = policy["rules"]
    assert (rule["action"], rule["onJobFailureReasons"]) == ("FailJobSet", ["PodFailurePolicy"])
    topology = load_topology(os.path.join(ROOT, MESH))
    # one replicated Job per island, as many pods as its hosts, in the ConfigMap's order
    jobs = js["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == [isl.name for isl in topology.islands]
    assert hosts["data"]["HOSTS"].split() == [h for i in topology.islands for h in i.hosts]
    pods = []
    for job, island in zip(jobs, topology.islands, strict=True):
        spec = job["template"]["spec"]
        assert spec["completions"] == spec["parallelism"] == island.num_hosts
        assert job["replicas"] == 1 and spec["backoffLimit"] == 0
        (exit2,) = spec["podFailurePolicy"]["rules"]
        assert exit2["action"] == "FailJob"
        assert exit2["onExitCodes"] == {"containerName": "train", "operator": "In", "values": [2]}
        pod = spec["template"]["spec"]
        assert pod["restartPolicy"] == "Never"  # podFailurePolicy needs it
        assert pod["nodeSelector"] == {"holmes/island": island.name}
        (container,) = pod["containers"]
        assert container["name"] == "train"
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert claims == {"runs": pvc["metadata"]["name"]} and mounts == {"runs": "/runs"}
        env = {e["name"]: e["value"] for e in container["env"]}
        script = container["args"][0]
        run_dir = re.search(r"--set train\.run_dir=(\S+)", script)[1]
        assert env["HOLMES_CONTINUE_RUN_DIR"] == run_dir and run_dir.startswith("/runs/")
        assert re.search(r"--set train\.compilation_cache=/runs/", script)
        pods += [f"{js['metadata']['name']}-{job['name']}-0-{k}" for k in range(island.num_hosts)]
    assert hosts["data"]["PODS"].split() == pods
    assert hosts["data"]["EXCLUDE_HOSTS"] == ""


def _run_pods(tmp_path, exclude):
    """The container script of every pod, with a stand-in trainer; (exit codes, records)."""
    docs = _jobset()
    data = {**docs["ConfigMap"]["data"], "EXCLUDE_HOSTS": exclude}
    container = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    container = container["spec"]["containers"][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _script(bin_dir / "python", FAKE_PYTHON.format(python=sys.executable))
    log = tmp_path / f"pods-{exclude or 'none'}.jsonl"
    codes = []
    for pod in data["PODS"].split():
        env = {
            **data,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "HOSTNAME": pod,
            "FAKE_LOG": str(log),
        }
        res = subprocess.run(
            [*container["command"], container["args"][0]], env=env, capture_output=True, text=True
        )
        codes.append(res.returncode)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return codes, records


@pytest.mark.parametrize(
    "exclude, survivors",
    [("", HOSTS), ("roce-1", HOSTS[:3]), ("ib-0 ib-1", HOSTS[2:])],
)
def test_jobset_pods_number_the_survivors_in_topology_order(tmp_path, exclude, survivors):
    codes, records = _run_pods(tmp_path, exclude)
    assert codes == [0, 0, 0, 0]  # an excluded host's pod sits the run out
    assert [r["HOLMES_HOST"] for r in records] == survivors
    first = HOSTS.index(survivors[0])
    for pid, r in enumerate(records):
        argv = r["argv"]
        assert _value(argv, "--process-id") == str(pid)
        assert _value(argv, "--num-processes") == str(len(survivors))
        assert _value(argv, "--coordinator") == f"{_jobset_pods()[first]}.holmes:1234"
        assert f"parallel.exclude_hosts=[{exclude.replace(' ', ',')}]" in _sets(argv)
    cfg = plan_request(_config(records[0]["argv"]))
    assert [h for i in load_mesh_topology(cfg).islands for h in i.hosts] == survivors
    if exclude:
        full = load_topology(os.path.join(ROOT, MESH))
        assert replan(cfg, full, cfg.parallel.exclude_hosts).plan is not None


def _jobset_pods():
    return _jobset()["ConfigMap"]["data"]["PODS"].split()


@pytest.mark.parametrize("path", [SBATCH, JOBSET], ids=os.path.basename)
def test_every_set_names_a_config_key(path):
    keys = re.findall(r"--set\s+[\"']?([A-Za-z_]+\.[A-Za-z_]+)=", open(path).read())
    assert len(keys) >= 3
    for key in keys:
        section, name = key.split(".")
        assert hasattr(getattr(Config(), section, None), name), f"{path}: --set {key}"
