"""Latency and compute speed in the emulation: the delaying wire and the CPU quotas.

The plans, commands, the wire's release order and the quota arithmetic run anywhere; three
root tests (skipped otherwise) check a real round trip, a real quota and the bursts
bench_emulation times under one.
"""

import os
import subprocess
import sys
import time

import pytest
import yaml

from holmes_jax import launch
from holmes_jax.cluster import cgroups, delay, netns
from holmes_jax.cluster.local_launch import _emulation_summary
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.plan_request import RunSpec
from holmes_jax.core.spec import ModelSpec
from holmes_jax.planner.profiles import profile_from_dict
from holmes_jax.planner.search import split_layers
from holmes_jax.planner.topology import load_topology, topology_from_dict
from tests.common import ROOT, load_script

MESHES = os.path.join(ROOT, "meshes")
SLOW = load_topology(os.path.join(MESHES, "emu-4host-2island-slow-compute.yaml"))
EVEN = load_topology(os.path.join(MESHES, "emu-4host-2island.yaml"))
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, cgroups)")


def _packet(src_island: int, dst_island: int, tag: int = 0) -> bytes:
    """A 20-byte IPv4 header 10.77.<src>.2 -> 10.77.<dst>.2 (tag in the id field)."""
    return bytes([0x45, 0, 0, 20, 0, tag, 0, 0, 64, 6, 0, 0, 10, 77, src_island, 2]) + bytes(
        [10, 77, dst_island, 2]
    )


# --------------------------------------------------------------------------- latency


def test_delays_are_one_way_per_island_pair_and_routed_through_the_wire():
    plan = netns.plan_network(EVEN, tag="5")
    assert plan.delays == {(0, 1): 100e-6, (1, 0): 100e-6}  # latency_us is one-way
    cmds = [" ".join(c) for c in plan.setup_commands()]
    assert "ip -n hj5-r tuntap add dev dly mode tun" in cmds
    assert "ip -n hj5-r route add 10.77.0.0/16 dev dly table 100" in cmds
    assert "ip -n hj5-r rule add pref 100 iif b0 lookup 100" in cmds
    assert "ip -n hj5-r rule add pref 100 iif b1 lookup 100" in cmds
    assert "ip netns exec hj5-r sysctl -q -w net.ipv4.conf.dly.rp_filter=0" in cmds
    assert not any(
        "dly" in c for c in cmds[: cmds.index("ip -n hj5-r tuntap add dev dly mode tun")]
    )
    command = delay.delayer_command(plan.router, plan.delays, python="py")
    assert command == "ip netns exec hj5-r py -m holmes_jax.cluster.delay --dev dly".split() + [
        "--delay", "0:1:100", "--delay", "1:0:100"
    ]  # fmt: skip
    assert delay.parse_delay("0:1:100") == ((0, 1), pytest.approx(100e-6))
    off = netns.plan_network(EVEN, tag="5", latency=False)
    assert off.delays == {} and not any("dly" in " ".join(c) for c in off.setup_commands())


@pytest.mark.parametrize("spec", ["0:1", "a:1:5", "0:1:-3"])
def test_bad_delay_is_a_one_line_error(spec):
    with pytest.raises(ConfigError, match=f"--delay={spec}: "):
        delay.parse_delay(spec)


def test_wire_releases_each_packet_after_its_pairs_delay_in_arrival_order():
    now = [0.0]
    inbox, out = [], []

    def read(fd, n):
        if not inbox:
            raise BlockingIOError
        return inbox.pop(0)

    wire = delay.Wire(
        3, {(0, 1): 0.010, (1, 0): 0.002}, clock=lambda: now[0], read=read,
        write=lambda fd, p: out.append(p[5]), wait=lambda fd, t: bool(inbox),
    )  # fmt: skip
    inbox += [_packet(0, 1, 1), _packet(1, 0, 2), _packet(0, 1, 3), b"\x60" + bytes(39)]
    wire.step()  # reads all four; the non-IPv4 one goes straight through
    assert out == [0] and len(wire.heap) == 3
    now[0] = 0.0019
    wire.step()
    assert out == [0]
    now[0] = 0.002
    wire.step()
    assert out == [0, 2]
    now[0] = 0.011
    wire.step()
    assert out == [0, 2, 1, 3]  # same pair, same delay: arrival order kept
    assert wire.dropped == 0


def test_network_starts_and_kills_the_wire_by_pid(tmp_path, monkeypatch):
    plan = netns.plan_network(EVEN, tag="9")
    monkeypatch.setattr(netns, "list_namespaces", lambda: plan.namespaces)
    started = []

    class Fake:
        def kill(self):
            started.append("killed")

        def wait(self):
            pass

    def spawn(cmd):
        started.append(cmd[:4])
        return Fake()

    with netns.EmulatedNetwork(plan, run=lambda c: None, etc=str(tmp_path), spawn=spawn) as net:
        assert started == [["ip", "netns", "exec", "hj9-r"]] and net.delayer is not None
    assert started[-1] == "killed" and net.delayer is None


# --------------------------------------------------------------------------- compute speed


def test_quota_is_a_fair_share_scaled_by_peak_tflops():
    # 2 cores, 4 hosts: a fair share is 0.5 core; roce has half ib's peak_tflops
    assert cgroups.shares(SLOW, cores=2) == {
        "ib-0": 0.5, "ib-1": 0.5, "roce-0": 0.25, "roce-1": 0.25
    }  # fmt: skip
    quotas = cgroups.plan_quotas(SLOW, "42", "auto", cores=2, root="/cg")
    q = {x.host: x for x in quotas}
    assert (q["ib-0"].quota_us, q["roce-1"].quota_us, q["roce-1"].period_us) == (5000, 2500, 10000)
    assert q["roce-1"].group == "/cg/hj42-roce-1"
    assert q["roce-1"].files() == [
        ("/cg/hj42-roce-1/cpu.cfs_period_us", "10000"),
        ("/cg/hj42-roce-1/cpu.cfs_quota_us", "2500"),
    ]
    assert cgroups.plan_quotas(EVEN, "42", "auto", cores=2) == []  # nothing to emulate
    assert len(cgroups.plan_quotas(EVEN, "42", "on", cores=2)) == 4
    assert cgroups.plan_quotas(SLOW, "42", "off", cores=2) == []
    tiny = cgroups.plan_quotas(SLOW, "42", "on", cores=0.01)
    assert min(x.quota_us for x in tiny) == cgroups.MIN_QUOTA_US
    with pytest.raises(ConfigError, match="--cpu-quota=half: must be one of auto, on, off"):
        cgroups.plan_quotas(SLOW, "42", "half", cores=2)


def test_own_share_reads_the_process_cpu_group(tmp_path, monkeypatch):
    """The quota of the process's cgroup v1 ``cpu`` group in cores; None without one; the
    launcher's variable first."""
    monkeypatch.delenv("HOLMES_JAX_CPU_QUOTA", raising=False)
    root = tmp_path / "cpu"
    group = root / "hj1-roce-0"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("2500\n")
    (group / "cpu.cfs_period_us").write_text("10000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n2:cpu,cpuacct:/hj1-roce-0\n0::/\n")
    assert cgroups.own_share(str(proc), str(root)) == 0.25
    (group / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroups.own_share(str(proc), str(root)) is None
    proc.write_text("2:cpu,cpuacct:/\n")  # the root group: no quota files here
    assert cgroups.own_share(str(proc), str(root)) is None
    assert cgroups.own_share(str(tmp_path / "absent"), str(root)) is None
    monkeypatch.setenv("HOLMES_JAX_CPU_QUOTA", "0.5")  # the launcher's, inside a namespace
    assert cgroups.own_share(str(tmp_path / "absent"), str(root)) == 0.5


def test_groups_are_written_entered_before_exec_and_removed(tmp_path):
    quotas = cgroups.plan_quotas(SLOW, "43", "auto", cores=2, root=str(tmp_path))
    import shutil

    with cgroups.CpuGroups(quotas, rmdir=shutil.rmtree) as groups:
        assert (tmp_path / "hj43-roce-0" / "cpu.cfs_quota_us").read_text() == "2500"
        prefix = groups.wrap(lambda host: ["ip", "netns", "exec", f"ns-{host}"])
        procs = str(tmp_path / "hj43-roce-0" / "cgroup.procs")
        assert prefix("roce-0") == ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs] + [
            "env", "HOLMES_JAX_CPU_QUOTA=0.25", "ip", "netns", "exec", "ns-roce-0"
        ]  # fmt: skip
        shell = ["sh", "-c", "echo $PPID $$ $HOLMES_JAX_CPU_QUOTA"]
        out = subprocess.run(prefix("roce-0")[:6] + shell, text=True,
                             capture_output=True, check=True).stdout  # fmt: skip
        assert open(procs).read().strip() == out.split()[1]  # the same process, after exec
        assert out.split()[2] == "0.25"  # its share, readable where /sys is not
        stat = "nr_periods 200\nnr_throttled 150\nthrottled_time 1250000000\n"
        (tmp_path / "hj43-roce-0" / "cpu.stat").write_text(stat)
        assert groups.throttling() == {"roce-0": cgroups.Throttling(200, 150, 1.25)}  # ib-0: none
        assert cgroups.format_throttling(groups.throttling()) == (
            "CPU quota throttled roce-0 75% of 200 periods (1.2 s)"
        )
    assert not any(tmp_path.iterdir())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"hj{dead.pid}-ib-0", f"hj{os.getpid()}-ib-0"):
        (tmp_path / name).mkdir()
    assert cgroups.remove_stale(str(tmp_path)) == [f"hj{dead.pid}-ib-0"]


def test_missing_controller_warns_on_auto_and_is_an_error_when_asked(tmp_path):
    said = []
    assert cgroups.resolve("auto", str(tmp_path), warn=said.append) == "off"
    assert len(said) == 1 and "no cgroup v1 cpu controller" in said[0]
    with pytest.raises(ConfigError, match=r"^--cpu-quota=on: no cgroup v1 cpu controller at "):
        cgroups.resolve("on", str(tmp_path))
    (tmp_path / "cpu.cfs_quota_us").write_text("-1")
    assert cgroups.resolve("on", str(tmp_path)) == "on"


def test_launch_flags_and_summary(capsys):
    mesh = os.path.join(MESHES, "emu-4host-2island-slow-compute.yaml")
    assert launch.main(["--mesh", mesh, "--cpu-quota", "off", "--", "--set", "a=1"]) == 2
    assert capsys.readouterr().err == "error: --cpu-quota=off: only used with --emulate\n"
    plan = netns.plan_network(SLOW, tag="1")
    quotas = cgroups.plan_quotas(SLOW, "1", "auto", cores=2)
    line = _emulation_summary(SLOW, 5, 1.0, plan.delays, quotas)
    assert "between islands 100 Mbit/s, round trip 0.2 ms" in line
    assert line.endswith("CPU quota (cores): ib-0 0.5, ib-1 0.5, roce-0 0.25, roce-1 0.25")


# Layer times the probe measured under `launch --emulate --program probe` on the slow-compute
# mesh with its default quotas (2026-11-26, 2 cores): roce's 2.03x ib's forward time.
MEASURED = {
    "version": 1,
    "measured_with": {"hidden_size": 128, "seq_len": 128, "num_heads": 4, "mlp_ratio": 4,
                      "microbatch_size": 2, "tensor": 1, "act_bytes": 4},
    "compute": {"ib": {"layer_fwd_s": 0.00229, "layer_bwd_s": 0.00813},
                "roce": {"layer_fwd_s": 0.00465, "layer_bwd_s": 0.01787}},
}  # fmt: skip


@pytest.mark.parametrize("measured", [False, True])
def test_the_slow_island_gets_fewer_layers(measured):
    topology, calibration = SLOW, None
    if measured:
        topology, calibration = profile_from_dict(MEASURED, SLOW)
    model = ModelSpec(num_layers=8, hidden_size=128, num_heads=4, seq_len=128, vocab_size=256)
    run = RunSpec(32, act_bytes=4, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    split = split_layers(topology, model, run, 2, 2, 1, 4, "1f1b", "optimal",
                         calibration=calibration)  # fmt: skip
    assert sum(split) == 8 and split[1] < split[0]  # stage 1 is island roce's
    even = split_layers(EVEN, model, run, 2, 2, 1, 4, "1f1b", "optimal")
    assert even[0] == even[1]


# --------------------------------------------------------------------------- root checks

PINGPONG = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5599))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ts = []
for _ in range(30):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); ts.append(time.perf_counter() - t)
print(min(ts))
"""
ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5599)); s.listen(1); print("up", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(1)):
    c.sendall(d)
"""


def _slow_links(intra_us: float, inter_us: float):
    raw = yaml.safe_load(open(os.path.join(MESHES, "emu-4host-2island.yaml")))
    raw["inter_island"]["default"]["latency_us"] = inter_us
    for island in raw["islands"]:
        island["link"]["latency_us"] = intra_us
    return topology_from_dict(raw)


def test_island_links_from_the_floor_up_are_delayed_through_the_router():
    plan = netns.plan_network(_slow_links(1000, 2500), tag="6")
    assert plan.delays == {(0, 0): 1e-3, (0, 1): 2.5e-3, (1, 0): 2.5e-3, (1, 1): 1e-3}
    cmds = [" ".join(c) for c in plan.setup_commands()]
    assert "ip -n hj6-0 addr add 10.77.0.2/32 dev eth0" in cmds  # no on-link /24
    assert "ip -n hj6-0 route add 10.77.0.1 dev eth0" in cmds
    below = netns.plan_network(_slow_links(delay.INTRA_FLOOR_US - 1, 2500), tag="6")
    assert set(below.delays) == {(0, 1), (1, 0)} and {h.prefix for h in below.hosts} == {24}


@root_only
def test_round_trips_are_twice_the_latency():
    netns.remove_stale()
    plan = netns.plan_network(_slow_links(1000, 2500), tag=str(os.getpid()))
    rtts = {}
    with netns.EmulatedNetwork(plan) as net:
        a = plan.host("ib-0")
        for b in (plan.host("ib-1"), plan.host("roce-0")):
            echo = net.exec_prefix(b.host) + [sys.executable, "-c", ECHO, b.address]
            server = subprocess.Popen(echo, stdout=subprocess.PIPE, text=True)
            assert server.stdout.readline().strip() == "up"
            ping = net.exec_prefix(a.host) + [sys.executable, "-c", PINGPONG, b.address]
            out = subprocess.run(ping, capture_output=True, text=True, check=True, timeout=30)
            server.wait(timeout=10)
            rtts[b.host] = float(out.stdout)
    # The fastest of 30 round trips: never under 2 x one-way (the delay is applied), and
    # well under twice that (applied once per direction, not at every hop). A loaded
    # machine only adds to a round trip, and the fastest one leaves that out.
    assert 0.002 <= rtts["ib-1"] < 1.5 * 0.002, rtts
    assert 0.005 <= rtts["roce-0"] < 1.5 * 0.005, rtts
    assert not any(ns.startswith(f"hj{os.getpid()}-") for ns in netns.list_namespaces())


BUSY = """
import time
t0, c0 = time.monotonic(), time.process_time()
while time.monotonic() - t0 < 1.0:
    pass
print((time.process_time() - c0) / (time.monotonic() - t0))
"""


@root_only
@pytest.mark.skipif(not cgroups.available(), reason="no cgroup v1 cpu controller")
def test_busy_loop_in_a_quota_group_runs_at_its_share():
    quotas = cgroups.plan_quotas(SLOW, str(os.getpid()), "on", cores=2)
    with cgroups.CpuGroups(quotas) as groups:
        run = groups.wrap(None)("roce-0") + [sys.executable, "-c", BUSY]
        start = time.monotonic()
        share = float(subprocess.run(run, capture_output=True, text=True, check=True).stdout)
        assert time.monotonic() - start < 5
        held = groups.throttling()["roce-0"]  # a busy loop spends its quota every period
        assert held.periods > 10 and held.throttled > 0.8 * held.periods and held.throttled_s > 0
    assert share == pytest.approx(0.25, abs=0.03)  # roce-0: 0.25 of a core
    assert not os.path.exists(quotas[0].group)


@root_only
@pytest.mark.skipif(not cgroups.available(), reason="no cgroup v1 cpu controller")
def test_bench_emulation_times_bursts_at_each_period_and_removes_its_groups():
    bench = load_script("bench_emulation")
    rows = bench.burst_rows([10_000, 2_000])
    assert [(r["host"], r["period_us"]) for r in rows] == [
        ("ib-0", 10_000), ("roce-0", 10_000), ("ib-0", 2_000), ("roce-0", 2_000)
    ]  # fmt: skip
    # roce-0's quarter core at 2 ms would be 500 µs: the kernel's floor of 1000 holds.
    assert [r["quota_us"] for r in rows] == [5_000, 2_500, 1_000, 1_000]
    for r in rows:
        assert r["at_share_ms"] == pytest.approx(bench.BURST_MS * r["period_us"] / r["quota_us"])
        # One thread's 10 ms of CPU takes 10 ms of wall time at least.
        assert bench.BURST_MS <= r["wall_ms_min"] <= r["wall_ms_median"] <= r["wall_ms_max"]
        # The quota is enforced: the kernel held the group back. A burst of 3 quotas or more
        # cannot run through unthrottled (it would touch at most 2 periods), so each of the 24
        # did. A loaded machine stretches wall time, so it has no ceiling here.
        assert r["throttled_periods"] >= (24 if r["quota_us"] * 3 <= 1e3 * bench.BURST_MS else 1)
    assert not any(n.startswith(f"hj{os.getpid()}-") for n in os.listdir(cgroups.CPU_ROOT))
