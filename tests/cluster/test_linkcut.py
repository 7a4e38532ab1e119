"""``launch --cut-islands``: the spec, the router rules, when the cut fires and heals.

Parsing, the commands and the cutter's timing run anywhere; one root test (skipped
otherwise) checks that a cut really blocks a TCP connect between islands and a restore
brings it back, while a connect inside an island works throughout, and that the launcher's
reachability probe (``EmulatedNetwork.unreachable``) sees the same.
"""

import os
import re
import subprocess
import sys
import time

import pytest

from holmes_jax import launch
from holmes_jax.cluster import linkcut, netns
from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import load_topology
from tests.common import ROOT

MESH = os.path.join(ROOT, "meshes", "emu-4host-2island-slow.yaml")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces)")


def test_cut_spec_parses_and_bad_specs_are_one_line_errors():
    assert linkcut.parse_cut("40:+30") == linkcut.Cut(40, 30.0, "40:+30")
    assert linkcut.parse_cut("1:+0.5").seconds == 0.5
    for spec, rule in [
        ("40", "must be STEP:+SECONDS"),
        ("40:30", "must be STEP:+SECONDS"),
        ("0:+30", "step 0 must be >= 1"),
        ("40:+0", "'0' must be a number of seconds > 0"),
        ("40:+inf", "'inf' must be a number of seconds > 0"),
        ("40:+x", "'x' must be a number of seconds > 0"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(rule)) as err:
            linkcut.parse_cut(spec)
        assert str(err.value).startswith(f"--cut-islands={spec}: ") and "\n" not in str(err.value)


def test_cut_is_a_blackhole_rule_per_ordered_island_pair_in_the_router():
    plan = netns.plan_network(load_topology(MESH), tag="7")
    cut = [" ".join(c) for c in plan.cut_commands()]
    assert cut == [
        "ip -n hj7-r rule add pref 50 from 10.77.0.0/24 to 10.77.1.0/24 blackhole",
        "ip -n hj7-r rule add pref 50 from 10.77.1.0/24 to 10.77.0.0/24 blackhole",
    ]
    restore = [" ".join(c) for c in plan.cut_commands(restore=True)]
    assert restore == [c.replace(" add ", " del ") for c in cut]
    assert int(netns.CUT_PREF) < int(netns.delay.RULE_PREF)  # before the delaying wire's rule
    ran = []
    net = netns.EmulatedNetwork(plan, run=ran.append)
    net.restore_islands()  # nothing built yet: nothing to undo
    net._created = True
    net.cut_islands()
    net.restore_islands()
    assert [" ".join(c) for c in ran] == cut + restore


def test_cutter_fires_once_at_the_step_and_restores_after_the_seconds():
    events, lines = [], []
    cutter = linkcut.IslandCutter(
        linkcut.parse_cut("5:+0.2"),
        lambda: events.append(("cut", time.monotonic())),
        lambda: events.append(("restore", time.monotonic())),
        lines.append,
    )
    for step in (3, 4, 6, 7):  # any job's steps; the first >= 5 fires
        cutter.on_step(step)
    assert [e for e, _ in events] == ["cut"]
    assert lines == ["--cut-islands 5:+0.2: links between islands cut at step 6 for 0.2 s"]
    time.sleep(0.5)
    assert [e for e, _ in events] == ["cut", "restore"]
    assert events[1][1] - events[0][1] == pytest.approx(0.2, abs=0.15)
    assert lines[1].startswith("--cut-islands 5:+0.2: links between islands restored after")
    cutter.restore()  # at the launcher's exit: already restored, nothing more
    cutter.on_step(9)
    assert len(events) == 2


def test_launch_refuses_a_cut_without_emulate(capsys):
    argv = ["--mesh", MESH, "--cut-islands", "3:+5", "--", "--set", "train.steps=2"]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --cut-islands=3:+5: only with --emulate (the cut is a rule in the emulated "
        "router)\n"
    )
    assert launch.main(["--mesh", MESH, "--cut-islands", "3", "--", "--set", "a=1"]) == 2
    assert "--cut-islands=3: must be STEP:+SECONDS" in capsys.readouterr().err


CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 5598), timeout=1.0).close(); print("ok")
except OSError as e:
    print(type(e).__name__)
"""
SERVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5598)); s.listen(8); print("up", flush=True)
while True:
    s.accept()[0].close()
"""


@root_only
def test_a_cut_blocks_connects_between_islands_only_and_a_restore_heals():
    netns.remove_stale()
    plan = netns.plan_network(load_topology(MESH), tag=str(os.getpid()), latency=False)
    with netns.EmulatedNetwork(plan) as net:
        servers = []
        for host in ("ib-1", "roce-0"):
            b = plan.host(host)
            cmd = net.exec_prefix(host) + [sys.executable, "-c", SERVE, b.address]
            servers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
            assert servers[-1].stdout.readline().strip() == "up"

        def connect(src: str, dst: str) -> str:
            cmd = net.exec_prefix(src) + [sys.executable, "-c", CONNECT, plan.host(dst).address]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()

        hosts = ["ib-0", "ib-1", "roce-0", "roce-1"]
        try:
            assert connect("ib-0", "roce-0") == "ok"
            assert net.unreachable(hosts, 5599) is None  # refused counts as reached
            net.cut_islands()
            assert connect("ib-0", "roce-0") == "TimeoutError"  # dropped silently, both ways
            assert connect("roce-1", "ib-1") == "TimeoutError"
            assert connect("ib-0", "ib-1") == "ok"  # inside an island: untouched
            # what a restart probes: ib-0 to roce-0 is the first pair across the cut, and
            # the roce hosts cannot reach ib-0 (process 0)
            assert net.unreachable(hosts, 5599, timeout_s=0.3) == netns.Unreachable(
                "ib-0 cannot reach roce-0", ("roce-0", "roce-1")
            )
            assert net.unreachable(["ib-0", "ib-1"], 5599) is None  # one island: no probe
            net.restore_islands()
            assert connect("ib-0", "roce-0") == "ok"
            assert connect("roce-1", "ib-1") == "ok"
            assert net.unreachable(hosts, 5598) is None  # accepted counts too
        finally:
            for s in servers:
                s.kill()
                s.wait()
    assert not any(ns.startswith(f"hj{os.getpid()}-") for ns in netns.list_namespaces())
