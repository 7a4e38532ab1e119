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
