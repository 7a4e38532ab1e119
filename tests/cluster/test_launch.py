"""Transport profiles, the launcher's arguments and commands, the emulated network plan."""

import os
import subprocess
import sys

import pytest

from holmes_jax import launch
from holmes_jax.cluster import cgroups, launcher, netns, transport
from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import load_topology, topology_from_dict
from tests.common import ROOT

MESHES = os.path.join(ROOT, "meshes")


def _topology(islands, inter=None):
    base = {"devices_per_host": 2, "device_kind": "gpu", "peak_tflops": 100, "memory_gb": 80}
    raw = {
        "name": "t",
        "intra_host": {"bandwidth_gbps": 100, "latency_us": 5},
        "islands": [{**base, **isl} for isl in islands],
    }
    if inter:
        raw["inter_island"] = {"default": {"bandwidth_gbps": inter, "latency_us": 100}}
    return topology_from_dict(raw)


THREE = _topology(
    [
        {
            "name": "ib",
            "nic": "infiniband",
            "link": {"bandwidth_gbps": 800, "latency_us": 5},
            "hosts": ["ib-0", "ib-1"],
            "hcas": ["mlx5_0", "mlx5_1"],
            "interface": "ib0",
        },
        {
            "name": "roce",
            "nic": "roce",
            "link": {"bandwidth_gbps": 400, "latency_us": 10},
            "hosts": 1,
            "hcas": ["mlx5_2"],
            "gid_index": 3,
        },
        {
            "name": "eth",
            "nic": "ethernet",
            "link": {"bandwidth_gbps": 25, "latency_us": 50},
            "hosts": ["e0"],
            "interface": "eth1",
        },
    ],
    inter=10,
)


# --------------------------------------------------------------------------- transport


def test_infiniband_profile():
    env = transport.host_environment(THREE, "ib-1")
    assert env == {
        "HOLMES_HOST": "ib-1",
        "HOLMES_ISLAND": "ib",
        "NCCL_NET": "IB",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "=mlx5_0,mlx5_1",  # exact names: mlx5_1 must not match mlx5_10
        "NCCL_SOCKET_IFNAME": "ib0",
    }


def test_roce_profile_sets_the_gid_index():
    env = transport.host_environment(THREE, "roce-0")
    assert env["NCCL_NET"] == "IB" and env["NCCL_IB_DISABLE"] == "0"
    assert env["NCCL_IB_HCA"] == "=mlx5_2"
    assert env["NCCL_IB_GID_INDEX"] == "3"
    assert "NCCL_SOCKET_IFNAME" not in env  # no interface named: NCCL chooses


def test_ethernet_profile_uses_sockets_on_the_named_interface():
    env = transport.host_environment(THREE, "e0")
    assert env["NCCL_NET"] == "Socket" and env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert not any(k.startswith("NCCL_IB_HCA") or k == "NCCL_IB_GID_INDEX" for k in env)


def test_shipped_paper_topology_profiles():
    topo = load_topology(os.path.join(MESHES, "paper-ib-roce-4x8.yaml"))
    assert transport.host_environment(topo, "roce-1")["NCCL_IB_GID_INDEX"] == "3"
    assert "NCCL_IB_GID_INDEX" not in transport.host_environment(topo, "ib-0")


def test_unknown_host_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"--host 'nope': not a host of topology 't'"):
        transport.host_environment(THREE, "nope")


def test_apply_keeps_what_the_site_set_and_exports_quote():
    environ = {"NCCL_IB_HCA": "mlx5_9"}
    changed = transport.apply(transport.host_environment(THREE, "ib-0"), environ)
    assert environ["NCCL_IB_HCA"] == "mlx5_9" and "NCCL_IB_HCA" not in changed
    assert environ["NCCL_NET"] == "IB"
    assert transport.format_exports({"A": "x y"}) == "export A='x y'"


def test_host_of_process_in_topology_order():
    assert [transport.host_of_process(THREE, p, 4) for p in range(4)] == [
        "ib-0",
        "ib-1",
        "roce-0",
        "e0",
    ]
    assert transport.host_of_process(THREE, 3, 8) == "ib-1"  # one process per device
    assert transport.host_of_process(THREE, 0, 3) is None


# --------------------------------------------------------------------------- launcher


def test_print_env_cli(capsys):
    mesh = os.path.join(MESHES, "paper-ib-roce-4x8.yaml")
    assert launch.main(["--print-env", "--mesh", mesh, "--host", "roce-0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "export HOLMES_HOST=roce-0" in out
    assert "export NCCL_IB_HCA==mlx5_0,mlx5_1,mlx5_2,mlx5_3" in out
    assert "export NCCL_IB_GID_INDEX=3" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--", "--set", "train.steps=1"], "--mesh=None: a topology file is required"),
        (["--print-env", "--mesh", "meshes/cpu8-two-islands.yaml"], "--host=None"),
        (["--mesh", "meshes/cpu8-two-islands.yaml", "--host", "ib-0"], "only used with"),
        (["--mesh", "meshes/nope.yaml"], "does not exist"),
        (["--mesh", "meshes/cpu8-two-islands.yaml", "--", "--process-id", "1"], "set by the"),
        (["--mesh", "meshes/cpu8-two-islands.yaml", "--", "--mesh=x.yaml"], "a different top"),
        (
            ["--mesh", "meshes/cpu8-two-islands.yaml", "--"]
            + ["--mesh", "meshes/cpu8-one-island.yaml"],
            "train argument '--mesh meshes/cpu8-one-island.yaml': the launcher runs --mesh "
            "meshes/cpu8-two-islands.yaml; a different topology after '--' is refused",
        ),
        (
            ["--mesh", "meshes/cpu8-two-islands.yaml", "--", "--set", "parallel.mesh=m.yaml"],
            "train argument '--set parallel.mesh=m.yaml': the launcher runs",
        ),
        (
            ["--mesh", "meshes/cpu8-two-islands.yaml", "--emulate", "--scale", "0"]
            + ["--", "--set", "train.steps=1"],
            "--scale=0",
        ),
    ],
)
def test_bad_launcher_arguments_are_one_line_errors(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    monkeypatch.setattr(netns, "remove_stale", lambda: [])
    monkeypatch.setattr(cgroups, "remove_stale", lambda: [])
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_emulate_needs_root(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    mesh = os.path.join(MESHES, "emu-4host-2island.yaml")
    assert launch.main(["--mesh", mesh, "--emulate", "--", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --emulate: needs root (network namespaces and tc); run as root or drop --emulate\n"
    )


def test_arguments_split_at_the_double_dash():
    args, train = launch.parse_args(["--mesh", "m.yaml", "--emulate", "--", "--set", "a.b=1"])
    assert args.mesh == "m.yaml" and args.emulate and args.scale == 1.0
    assert train == ["--set", "a.b=1"]


def test_one_worker_per_host_with_its_devices_and_profile():
    topo = load_topology(os.path.join(MESHES, "cpu8-two-islands.yaml"))
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1", "KEEP": "1"}
    workers = launcher.plan_workers(
        topo, "m.yaml", ["--set", "train.steps=2"], "127.0.0.1:1234", base_env=base, python="py"
    )
    assert [w.host for w in workers] == ["ib-0", "ib-1", "roce-0", "roce-1"]
    w = workers[2]
    assert w.command == [
        "py", "-m", "holmes_jax.train", "--mesh", "m.yaml",
        "--coordinator", "127.0.0.1:1234", "--num-processes", "4", "--process-id", "2",
        "--cpu-devices", "2", "--set", "train.steps=2",
    ]  # fmt: skip
    assert w.env["XLA_FLAGS"] == "--xla_foo=1"  # the inherited device count is dropped
    assert w.env["HOLMES_HOST"] == "roce-0" and w.env["HOLMES_ISLAND"] == "roce"
    assert w.env["NCCL_NET"] == "IB" and w.env["JAX_PLATFORMS"] == "cpu"
    assert w.env["KEEP"] == "1" and w.env["PYTHONUNBUFFERED"] == "1"
    emulated = launcher.plan_workers(
        topo, "m.yaml", [], "10.77.0.2:29500", base_env={}, prefix=lambda h: ["ns", h]
    )
    assert emulated[3].command[:2] == ["ns", "roce-1"]
    probes = launcher.plan_workers(topo, "m.yaml", [], "h:1", base_env={}, program="probe")
    assert probes[0].command[1:3] == ["-m", "holmes_jax.probe"]
    with pytest.raises(ConfigError, match="--program=bench: must be one of train, probe"):
        launcher.plan_workers(topo, "m.yaml", [], "h:1", base_env={}, program="bench")


def test_a_repeated_mesh_naming_the_same_file_is_dropped(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    topo = load_topology(os.path.join(MESHES, "cpu8-two-islands.yaml"))
    (tmp_path / "link.yaml").symlink_to(os.path.join(MESHES, "cpu8-two-islands.yaml"))
    same = [
        "--mesh", os.path.join(MESHES, "cpu8-two-islands.yaml"),  # absolute
        "--set", "train.steps=2",
        f"--mesh={tmp_path / 'link.yaml'}",  # a symlink to it
        "--set", "parallel.mesh=./meshes/../meshes/cpu8-two-islands.yaml",
    ]  # fmt: skip
    workers = launcher.plan_workers(
        topo, "meshes/cpu8-two-islands.yaml", same, "127.0.0.1:1", base_env={}, python="py"
    )
    command = workers[1].command
    assert command.count("--mesh") == 1
    assert command[3:5] == ["--mesh", "meshes/cpu8-two-islands.yaml"]
    assert command[-4:] == same[2:4] + same[5:7]
    other = ["--mesh=meshes/cpu8-one-island.yaml"]
    with pytest.raises(ConfigError, match=r"^train argument '--mesh=meshes/cpu8-one-island.yaml'"):
        launcher.plan_workers(topo, "meshes/cpu8-two-islands.yaml", other, "h:1", base_env={})


@pytest.mark.parametrize(
    "line, shown",
    [
        ("step 5 | loss 4.4818 | 3591 ms/step", "step 5 | loss 4.4818 | 3591 ms/step"),
        ("", ""),  # a blank line stays
        ("12", "12"),
        ("[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks "
         "is : 3", None),
        # two threads' reports interleaved mid-line, as seen from a 4-process launch
        ("[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected "
         "peer ranks is : 1", None),
        ("1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1", None),
        ("step 2 | loss 5.1[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
         "connected peer ranks is : 1", "step 2 | loss 5.1"),
        ("E1123 19:16:30.137854   23941 coordination_service_agent.cc:289] Polled an error from "
         "coordination service (this can be an error from this or another task).", None),
        # what jax's client logs as process 0 dies, before the watchdog's line
        ("W1123 19:54:20.509770   30177 preemption_sync_manager.cc:147] Failed to retrieve "
         "preemption notice from coordination service: UNAVAILABLE: Socket closed", None),
        ("Additional GRPC error information from remote target coordination_service while "
         "calling /xla.coordination.CoordinationService/GetKeyValue:", None),
        (':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}. '
         "This is only expected if one of the tasks is unhealthy.", None),
        ("E1123 19:54:20.509829   30177 preemption_sync_manager.cc:159] Failed to cancel "
         "preemption barrier: FAILED_PRECONDITION: Tried to cancel non-existent barrier", None),
        ("error: lost peer process 0 (host ib-0): the coordination service it held at h:1 is "
         "gone", "error: lost peer process 0 (host ib-0): the coordination service it held at "
         "h:1 is gone"),
    ],
)  # fmt: skip
def test_library_chatter_is_recognised(line, shown):
    assert launcher.quiet(line) == shown


def test_bare_digits_after_chatter_are_a_cut_gloo_tail():
    """Thread A's report is cut before its count by thread B's whole report: the count
    arrives alone on the next line (seen in CI from a 4-process launch)."""
    assert launcher.quiet("1", after_chatter=True) is None
    assert launcher.quiet("12", after_chatter=False) == "12"
    assert launcher.quiet("step 3 | loss 5.3", after_chatter=True) == "step 3 | loss 5.3"


def test_blank_line_after_chatter_is_a_reports_newline():
    """Two threads' reports on one line leave the second newline alone on the next line
    (seen in CI: an empty ``[ib-1]`` line in a 4-process launch); a blank line after the
    process's own output stays."""
    assert launcher.quiet("", after_chatter=True) is None
    assert launcher.quiet("", after_chatter=False) == ""


# The launcher forks (to arm PR_SET_PDEATHSIG); jax, loaded in this test process by other
# tests, warns about any fork. The launcher's own process never imports jax.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_first_failure_stops_the_rest_and_sets_the_exit_code(tmp_path):
    """A worker that fails ends the launch with its code; a hanging one is killed."""
    import io

    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    failer = [sys.executable, "-c", "import sys; print('bad'); sys.exit(7)"]
    workers = [
        launcher.Worker("a", 0, sleeper, dict(os.environ)),
        launcher.Worker("bb", 1, failer, dict(os.environ)),
    ]
    out = io.StringIO()
    code = launcher.Launch(workers, grace_s=0.5, out=out).run()
    text = out.getvalue()
    assert code == 7
    assert "[bb] bad" in text and "[a ] up" in text
    assert "launch: bb (process 1) exited with code 7; stopping the others" in text


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
@pytest.mark.parametrize("verbose", [False, True])
def test_chatter_is_hidden_unless_verbose(verbose):
    import io

    report = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
    report += "ranks is : 1"
    talker = [sys.executable, "-c", f"print({report!r}); print('step 1'); print({report!r})"]
    out = io.StringIO()
    worker = launcher.Worker("a", 0, talker, dict(os.environ))
    assert launcher.Launch([worker], out=out, verbose=verbose).run() == 0
    lines = out.getvalue().splitlines()
    if verbose:
        assert lines == [f"[a] {report}", "[a] step 1", f"[a] {report}"]
    else:
        hidden = "launch: 2 lines of library output hidden (--verbose shows them)"
        assert lines == ["[a] step 1", hidden]


# --------------------------------------------------------------------------- network plan


def test_network_plan_addresses_and_rates():
    topo = load_topology(os.path.join(MESHES, "emu-4host-2island.yaml"))
    plan = netns.plan_network(topo, tag="4242", scale=0.5)
    assert plan.namespaces == ["hj4242-r", "hj4242-0", "hj4242-1", "hj4242-2", "hj4242-3"]
    h = plan.host("roce-1")
    assert (h.address, h.gateway, h.island) == ("10.77.1.3", "10.77.1.1", 1)
    assert h.intra_mbit == 500 and h.inter_mbit == (("10.77.0.0/24", 50),)
    cmds = [" ".join(c) for c in plan.setup_commands()]
    assert "ip netns exec hj4242-r sysctl -q -w net.ipv4.ip_forward=1" in cmds
    veth = "ip link add eth0 netns hj4242-3 mtu 65520 type veth peer name h3 netns hj4242-r"
    assert veth + " mtu 65520" in cmds  # created inside the namespaces, never in the machine's
    shaping = [c for c in cmds if c.startswith("ip netns exec hj4242-3 tc")]
    assert any("classid 1:10 htb rate 500mbit ceil 500mbit" in c for c in shaping)
    assert any("classid 1:20 htb rate 50mbit ceil 50mbit" in c for c in shaping)
    assert any("match ip dst 10.77.0.0/24 flowid 1:20" in c for c in shaping)
    assert netns.hosts_file("10.77.1.3", "vm") == "127.0.0.1 localhost\n10.77.1.3 vm\n"


def test_network_is_removed_when_setup_fails_half_way(tmp_path, monkeypatch):
    topo = load_topology(os.path.join(MESHES, "emu-4host-2island.yaml"))
    plan = netns.plan_network(topo, tag="7")
    ran, created = [], set()

    def fake(cmd):
        ran.append(cmd)
        if cmd[:3] == ["ip", "netns", "add"]:
            created.add(cmd[3])
        if cmd[:3] == ["ip", "netns", "del"]:
            created.discard(cmd[3])
        if "tc" in cmd and "hj7-2" in cmd:
            raise RuntimeError("tc failed")

    monkeypatch.setattr(netns, "list_namespaces", lambda: sorted(created))
    with pytest.raises(RuntimeError, match="tc failed"):
        netns.EmulatedNetwork(plan, run=fake, etc=str(tmp_path)).create()
    assert created == set()  # every namespace made before the failure is gone


def test_network_context_writes_and_removes_hosts_files(tmp_path, monkeypatch):
    topo = load_topology(os.path.join(MESHES, "emu-4host-2island.yaml"))
    plan = netns.plan_network(topo, tag="8")
    monkeypatch.setattr(netns, "list_namespaces", lambda: plan.namespaces)
    deleted = []
    run = lambda cmd: deleted.append(cmd[3]) if cmd[:3] == ["ip", "netns", "del"] else None
    net = netns.EmulatedNetwork(plan, run=run, etc=str(tmp_path), spawn=lambda cmd: None)
    with net:
        hosts = (tmp_path / "hj8-1" / "hosts").read_text()
        assert "10.77.0.3" in hosts
        assert net.exec_prefix("ib-1") == ["ip", "netns", "exec", "hj8-1"]
    assert deleted == plan.namespaces
    assert not any(tmp_path.iterdir())


def test_stale_namespaces_of_dead_launchers_are_removed(monkeypatch, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f"hj{dead.pid}-r", f"hj{dead.pid}-0", f"hj{os.getpid()}-0", "other"]
    monkeypatch.setattr(netns, "list_namespaces", lambda: names)
    removed, asked = [], []
    run = lambda cmd: removed.append(cmd[3])
    pids = lambda ns: asked.append(ns) or []
    assert netns.remove_stale(run=run, etc=str(tmp_path), pids=pids) == [
        f"hj{dead.pid}-r",
        f"hj{dead.pid}-0",
    ]
    assert removed == asked == [f"hj{dead.pid}-r", f"hj{dead.pid}-0"]
