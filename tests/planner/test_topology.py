"""Topology files: every shipped mesh loads, device order, links, and strict one-line errors."""

import copy
import glob
import os

import pytest
import yaml

from holmes_jax.core.errors import ConfigError
from holmes_jax.planner.topology import (
    Link,
    load_topology,
    single_host_topology,
    topology_from_dict,
)
from tests.common import ROOT

MESHES = sorted(glob.glob(os.path.join(ROOT, "meshes", "*.yaml")))


def mesh(name):
    return os.path.join(ROOT, "meshes", name)


@pytest.mark.parametrize("path", MESHES, ids=os.path.basename)
def test_every_mesh_loads_and_documents_its_command(path):
    topo = load_topology(path)
    assert topo.num_devices == len(topo.device_places()) > 0
    with open(path) as f:
        text = f.read()
    assert text.startswith("# "), "first line must say what the file is"
    header = text.split("\nname:")[0]
    assert "python -m holmes_jax." in header, "header must give the command that uses it"


def test_required_meshes_are_shipped():
    names = {os.path.basename(p) for p in MESHES}
    for required in (
        "cpu8-one-island.yaml",
        "cpu8-two-islands.yaml",
        "cpu8-three-islands-uneven.yaml",
        "paper-ib-roce-8x8.yaml",
        "paper-ib-roce-4x8.yaml",
        "gpu1024-four-islands.yaml",
    ):
        assert required in names
    big = load_topology(mesh("gpu1024-four-islands.yaml"))
    assert (big.num_devices, len(big.islands)) == (1024, 4)
    paper = load_topology(mesh("paper-ib-roce-8x8.yaml"))
    assert [(i.nic, i.num_hosts, i.devices_per_host) for i in paper.islands] == [
        ("infiniband", 4, 8),
        ("roce", 4, 8),
    ]


def test_cpu8_two_islands_device_order():
    topo = load_topology(mesh("cpu8-two-islands.yaml"))
    assert (topo.num_devices, topo.num_hosts, len(topo.islands)) == (8, 4, 2)
    assert [i.nic for i in topo.islands] == ["infiniband", "roce"]
    places = topo.device_places()
    assert [p.index for p in places] == list(range(8))
    assert [p.island for p in places] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [p.host for p in places] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [p.local for p in places] == [0, 1] * 4
    assert places[5].island_name == "roce" and places[5].host_name == "roce-0"
    assert topo.island_offsets == (0, 4)


def test_uneven_islands_and_pair_override():
    topo = load_topology(mesh("cpu8-three-islands-uneven.yaml"))
    assert [i.num_devices for i in topo.islands] == [4, 2, 2]
    assert topo.inter_island("roce", "eth").bandwidth_gbps == 2
    assert topo.inter_island("eth", "roce") == topo.inter_island("roce", "eth")
    assert topo.inter_island("ib", "eth") == topo.inter_island_default
    with pytest.raises(ConfigError, match="does not exist"):
        topo.inter_island("ib", "nowhere")


def test_link_units():
    link = Link(bandwidth_gbps=8, latency_us=5)
    assert link.bytes_per_s == 1e9
    assert link.latency_s == pytest.approx(5e-6)


def test_host_count_shorthand_names_hosts():
    topo = load_topology(mesh("paper-ib-8x8.yaml"))
    assert topo.islands[0].hosts[:2] == ("ib-0", "ib-1")
    assert topo.num_hosts == 8


BASE = yaml.safe_load(open(mesh("cpu8-two-islands.yaml")))


def _edit(fn):
    raw = copy.deepcopy(BASE)
    fn(raw)
    return raw


BAD = {
    "unknown top key": (lambda r: r.update(colour="red"), "colour"),
    "unknown island key": (lambda r: r["islands"][0].update(gpus=2), "islands[0].gpus"),
    "bad nic": (lambda r: r["islands"][1].update(nic="rdma"), "islands[1].nic"),
    "wrong type": (
        lambda r: r["islands"][0].update(devices_per_host="two"),
        "islands[0].devices_per_host",
    ),
    "bool is not int": (
        lambda r: r["islands"][0].update(devices_per_host=True),
        "islands[0].devices_per_host",
    ),
    "zero devices": (
        lambda r: r["islands"][0].update(devices_per_host=0),
        "islands[0].devices_per_host",
    ),
    "negative bandwidth": (
        lambda r: r["intra_host"].update(bandwidth_gbps=-1),
        "intra_host.bandwidth_gbps",
    ),
    "negative latency": (
        lambda r: r["inter_island"]["default"].update(latency_us=-3),
        "inter_island.default.latency_us",
    ),
    "missing key": (lambda r: r["islands"][0].pop("memory_gb"), "islands[0].memory_gb"),
    "duplicate island": (lambda r: r["islands"][1].update(name="ib"), "islands[1].name"),
    "duplicate host": (lambda r: r["islands"][1].update(hosts=["ib-0", "x"]), "ib-0"),
    "no inter-island link": (lambda r: r.pop("inter_island"), "inter_island"),
    "override unknown island": (
        lambda r: r["inter_island"].update(
            overrides=[{"between": ["ib", "mars"], "bandwidth_gbps": 1, "latency_us": 1}]
        ),
        "mars",
    ),
    "gid_index on infiniband": (
        lambda r: r["islands"][0].update(gid_index=3),
        "islands[0].gid_index",
    ),
    "empty hosts": (lambda r: r["islands"][0].update(hosts=[]), "islands[0].hosts"),
    "colon in name": (lambda r: r["islands"][0].update(name="a:b"), "islands[0].name"),
    "islands not a list": (lambda r: r.update(islands={"a": 1}), "islands"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_topology_gives_one_line_error_naming_file_and_key(case):
    edit, key = BAD[case]
    with pytest.raises(ConfigError) as err:
        topology_from_dict(_edit(edit), source="meshes/bad.yaml")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("meshes/bad.yaml: ")
    assert key in msg


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_topology(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        load_topology(broken)
    assert "not valid YAML" in str(err.value) and "\n" not in str(err.value)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_topology(scalar)


def test_single_host_topology_for_runs_without_a_mesh():
    topo = single_host_topology(8)
    assert (topo.num_devices, topo.num_hosts, len(topo.islands)) == (8, 1, 1)
    assert {p.host for p in topo.device_places()} == {0}
    with pytest.raises(ConfigError, match="devices_per_host=0"):
        single_host_topology(0)


# --------------------------------------------------------------------------- bounds

BOUNDED = {  # edit -> the whole message after the file name
    "hosts count": (
        lambda r: r["islands"][0].update(hosts=10**12),
        "islands[0].hosts=1000000000000: must be <= 100000 (hosts per island)",
    ),
    "hosts list": (
        lambda r: r["islands"][0].update(hosts=[f"h{i}" for i in range(100_001)]),
        "len(islands[0].hosts)=100001: must be <= 100000 (hosts per island)",
    ),
    "devices per host": (
        lambda r: r["islands"][1].update(devices_per_host=10**9),
        "islands[1].devices_per_host=1000000000: must be <= 1024 (devices per host)",
    ),
    "one island's devices": (
        lambda r: r["islands"][0].update(hosts=100_000, devices_per_host=11),
        "islands[0]: hosts x devices_per_host=1100000: must be <= 1048576 (devices in all)",
    ),
    "devices in all": (
        lambda r: [i.update(hosts=1024, devices_per_host=1024) for i in r["islands"]],
        "devices of islands[0..1]=2097152: must be <= 1048576 (devices in all)",
    ),
    "islands": (
        lambda r: r.update(islands=[dict(r["islands"][0], name=f"i{k}") for k in range(257)]),
        "len(islands)=257: must be <= 256 (islands per topology)",
    ),
    "bandwidth": (
        lambda r: r["intra_host"].update(bandwidth_gbps=1e12),
        "intra_host.bandwidth_gbps=1000000000000.0: must be <= 1e+09 (Gbit/s per link)",
    ),
    "tiny bandwidth": (
        lambda r: r["intra_host"].update(bandwidth_gbps=1e-300),
        "intra_host.bandwidth_gbps=1e-300: must be >= 1e-06 (Gbit/s per link)",
    ),
    "nan": (
        lambda r: r["islands"][0].update(memory_gb=float("nan")),
        "memory_gb=nan: must be finite",
    ),
    "inf": (lambda r: r["islands"][0].update(peak_tflops=float("inf")), "=inf: must be finite"),
    "huge int": (lambda r: r["islands"][0].update(memory_gb=10**400), "must be finite"),
    "gid index": (
        lambda r: r["islands"][1].update(gid_index=2**40),
        "islands[1].gid_index=1099511627776: must be <= 65535 (RoCE GID table index)",
    ),
    # Found as a TypeError: unhashable type: 'dict' before the check.
    "mapping in between": (
        lambda r: r["inter_island"].update(
            overrides=[{"between": [{"ib": 1}, "roce"], "bandwidth_gbps": 1, "latency_us": 1}]
        ),
        "inter_island.overrides[0].between=[{'ib': 1}, 'roce']: must be a list of two island",
    ),
    "newline in a name": (
        lambda r: r["islands"][0].update(name="i\nb"),
        "islands[0].name='i\\nb': must be one line of printable characters",
    ),
    "non-string key": (lambda r: r.update({7: "x", None: 1}), "unknown key"),
}


@pytest.mark.parametrize("case", sorted(BOUNDED))
def test_counts_and_figures_are_bounded_before_anything_is_built(case):
    edit, message = BOUNDED[case]
    with pytest.raises(ConfigError) as err:
        topology_from_dict(_edit(edit), source="m.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith("m.yaml: ")
    assert message in str(err.value)


@pytest.mark.parametrize(
    "text, message",
    [
        (b"a: 2020-13-45\n", "not valid YAML (ValueError: month must be in 1..12)"),
        (b"a: " + b"9" * 5000, "not valid YAML (ValueError: Exceeds the limit"),
        (b"a: " + b"[" * 100_000, "nesting: must be <= 100 (levels of YAML nesting)"),
        (b"\xff\xfe\x00binary", "cannot be read ('utf-8' codec can't decode"),
        (b"a: !!timestamp 99999-01-01\n", "not valid YAML (AttributeError"),
        (b"x" * (16 * 2**20 + 1), "size=16777217: must be <= 16777216 (bytes per config"),
    ],
    ids=["bad date", "huge int", "deep", "not utf-8", "bad timestamp", "too long"],
)
def test_files_no_parser_accepts_are_one_line(tmp_path, text, message):
    path = tmp_path / "m.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as err:
        load_topology(path)
    assert "\n" not in str(err.value) and message in str(err.value)
