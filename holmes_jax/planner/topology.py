"""Physical topology of a cluster: islands of hosts, their NICs and the links between them.

An **island** is a group of hosts on one RDMA fabric (InfiniBand or RoCE) or plain
Ethernet. Inside a host, devices talk over the intra-host link (NVLink, or shared memory
for simulated CPU devices). Between islands only the inter-island link exists, usually
slow Ethernet.

Bandwidth conventions (what the cost model assumes):

- ``intra_host``: per-device bandwidth to the other devices of its host.
- ``islands[i].link``: per-host NIC bandwidth inside the island, all NICs of a host
  together (4 x 200 Gbit/s HDR = 800).
- ``inter_island``: per-host bandwidth of the path between two islands.

Devices are numbered island → host → device. :meth:`Topology.device_places` gives that
order, which the mesh builder and the planner both follow.

A topology is a YAML file in ``meshes/``, loaded strictly by :func:`load_topology`. An
unknown key, a wrong type or an impossible value is a one-line
:class:`~holmes_jax.core.errors.ConfigError` naming the file, the key, the value and the
rule. Counts and figures are bounded (one home: :mod:`holmes_jax.core.spec`) and checked
before anything is built from them. The schema and the bounds: docs/planner.md, "Topology
files". Plain Python: no jax import.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import (
    BANDWIDTH,
    DEVICES,
    DEVICES_PER_HOST,
    GID_INDEX,
    HOSTS,
    ISLANDS,
    LATENCY,
    MEMORY_GB,
    MEMORY_GBS,
    TFLOPS,
)
from holmes_jax.core.yamlio import StrictReader, read_yaml

NIC_TYPES = ("infiniband", "roce", "ethernet")
# Machine balance used when an island gives no memory bandwidth: GB/s per TFLOP/s.
DEFAULT_GBS_PER_TFLOPS = 5.0


@dataclass(frozen=True)
class Link:
    """A network link: bandwidth in Gbit/s and one-way latency in microseconds."""

    bandwidth_gbps: float
    latency_us: float

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth in bytes per second."""
        return self.bandwidth_gbps * 1e9 / 8.0

    @property
    def latency_s(self) -> float:
        """Latency in seconds."""
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class Island:
    """Hosts on one network fabric, all with the same devices."""

    name: str
    nic: str  # infiniband | roce | ethernet
    link: Link  # per-host NIC bandwidth and latency inside the island
    hosts: tuple[str, ...]
    devices_per_host: int
    device_kind: str
    peak_tflops: float  # per device
    memory_gb: float  # per device, 1e9 bytes
    memory_bandwidth_gbs: float | None = None  # per device, GB/s
    hcas: tuple[str, ...] = ()  # RDMA devices for NCCL_IB_HCA
    gid_index: int | None = None  # RoCE GID index for NCCL_IB_GID_INDEX
    interface: str | None = None  # socket interface for NCCL_SOCKET_IFNAME

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    @property
    def memory_bytes_per_s(self) -> float:
        """Device memory bandwidth in bytes/s (default: a machine balance rule)."""
        gbs = self.memory_bandwidth_gbs
        if gbs is None:
            gbs = self.peak_tflops * DEFAULT_GBS_PER_TFLOPS
        return gbs * 1e9


@dataclass(frozen=True)
class DevicePlace:
    """Where one device sits: global index (island → host → device order) and names."""

    index: int
    island: int
    island_name: str
    host: int  # global host index
    host_name: str
    local: int  # index within the host


@dataclass(frozen=True)
class Topology:
    """Islands, the intra-host link and the inter-island links of a cluster."""

    name: str
    islands: tuple[Island, ...]
    intra_host: Link
    inter_island_default: Link | None = None
    # ((island_a, island_b, link), ...) with island_a < island_b by name.
    inter_island_overrides: tuple[tuple[str, str, Link], ...] = ()
    description: str = ""

    def inter_island(self, a_name: str, b_name: str) -> Link:
        """The link between two islands: a per-pair override or the default.

        Raises:
          ConfigError: unknown island name, same island twice, or no inter-island link.
        """
        names = {island.name for island in self.islands}
        for n in (a_name, b_name):
            if n not in names:
                raise ConfigError(f"topology {self.name}: island '{n}' does not exist")
        if a_name == b_name:
            raise ConfigError(
                f"topology {self.name}: inter_island('{a_name}', '{b_name}'): needs two "
                f"different islands (inside one island use its NIC link)"
            )
        key = tuple(sorted((a_name, b_name)))
        for a, b, link in self.inter_island_overrides:
            if (a, b) == key:
                return link
        if self.inter_island_default is None:
            raise ConfigError(f"topology {self.name}: inter_island has no default link")
        return self.inter_island_default

    @property
    def num_devices(self) -> int:
        return sum(island.num_devices for island in self.islands)

    @property
    def num_hosts(self) -> int:
        return sum(island.num_hosts for island in self.islands)

    @property
    def island_offsets(self) -> tuple[int, ...]:
        """Global index of each island's first device."""
        offsets, total = [], 0
        for island in self.islands:
            offsets.append(total)
            total += island.num_devices
        return tuple(offsets)

    def device_places(self) -> list[DevicePlace]:
        """Every device in global order: island → host → device."""
        places, host_index = [], 0
        for i, island in enumerate(self.islands):
            for host_name in island.hosts:
                for local in range(island.devices_per_host):
                    places.append(
                        DevicePlace(len(places), i, island.name, host_index, host_name, local)
                    )
                host_index += 1
        return places


def without_hosts(topology: Topology, hosts: Sequence[str], key: str = "hosts") -> Topology:
    """``topology`` with ``hosts`` left out: the survivors of a failure.

    An island that loses every host is dropped with its links; the others keep theirs.
    The name says who is missing (``paper-2x2 without b0``).

    Raises:
      ConfigError: a host not in the topology, a host named twice, or no host left
        (``key`` names the setting in the message).
    """
    names = [h for isl in topology.islands for h in isl.hosts]
    gone = list(hosts)
    for h in gone:
        if h not in names:
            raise ConfigError(
                f"{key}={list(gone)}: '{h}' is not a host of topology '{topology.name}' "
                f"({', '.join(names)})"
            )
    if len(set(gone)) != len(gone):
        raise ConfigError(f"{key}={list(gone)}: names a host twice")
    islands = []
    for isl in topology.islands:
        kept = tuple(h for h in isl.hosts if h not in gone)
        if kept:
            islands.append(dataclasses.replace(isl, hosts=kept))
    if not islands:
        raise ConfigError(f"{key}={list(gone)}: leaves no host of topology '{topology.name}'")
    kept_names = {isl.name for isl in islands}
    overrides = tuple(o for o in topology.inter_island_overrides if {o[0], o[1]} <= kept_names)
    return dataclasses.replace(
        topology,
        name=f"{topology.name} without {','.join(gone)}",
        islands=tuple(islands),
        inter_island_default=topology.inter_island_default if len(islands) > 1 else None,
        inter_island_overrides=overrides,
    )


def single_host_topology(
    num_devices: int, peak_tflops: float = 0.0125, memory_gb: float = 2.0
) -> Topology:
    """One island holding one host of ``num_devices`` devices (no topology file named).

    The defaults describe one simulated CPU device of an 8-way-shared 2-core machine.
    """
    return topology_from_dict(
        {
            "name": f"single-host-{num_devices}",
            "intra_host": {"bandwidth_gbps": 100, "latency_us": 5},
            "islands": [
                {
                    "name": "local",
                    "nic": "ethernet",
                    "link": {"bandwidth_gbps": 10, "latency_us": 50},
                    "hosts": ["localhost"],
                    "devices_per_host": num_devices,
                    "device_kind": "cpu",
                    "peak_tflops": peak_tflops,
                    "memory_gb": memory_gb,
                }
            ],
        },
        source="<single host>",
    )


# --------------------------------------------------------------------------- loading


def load_topology(path: str | os.PathLike) -> Topology:
    """Load and validate a topology YAML file.

    Args:
      path: a ``meshes/*.yaml`` file.

    Returns:
      The validated :class:`Topology`.

    Raises:
      ConfigError: missing or unreadable file, bad YAML, unknown key, wrong type or
        impossible value; the message names the file, the key, the value and the rule.
    """
    path = str(path)
    raw = read_yaml(path, f"mesh '{path}': topology file")
    return topology_from_dict(raw, source=path)


def topology_from_dict(raw: Any, source: str = "<dict>") -> Topology:
    """Build a :class:`Topology` from plain data (a parsed YAML file).

    Args:
      raw: the mapping described in this module's docstring.
      source: file name used in error messages.

    Returns:
      The validated topology.

    Raises:
      ConfigError: as :func:`load_topology`.
    """
    r = TopologyReader(source)
    top = r.mapping(
        raw,
        "",
        required=("name", "intra_host", "islands"),
        optional=("description", "inter_island"),
    )
    name = r.string(top["name"], "name")
    islands_raw = top["islands"]
    if not isinstance(islands_raw, list) or not islands_raw:
        r.fail("islands", islands_raw, "must be a non-empty list of islands")
    r.integer(len(islands_raw), "len(islands)", 1, ISLANDS)
    islands, total = [], 0
    for i, item in enumerate(islands_raw):  # the running total stops a huge one early
        islands.append(r.island(item, f"islands[{i}]"))
        total += islands[-1].num_devices
        r.integer(total, f"devices of islands[0..{i}]", 1, DEVICES)
    _check_unique(r, [isl.name for isl in islands], "islands[{}].name")
    hosts = [h for isl in islands for h in isl.hosts]
    _check_unique(r, hosts, "host name {}", by_value=True)
    default, overrides = None, ()
    if "inter_island" in top:
        default, overrides = r.inter_island(top["inter_island"], {i.name for i in islands})
    elif len(islands) > 1:
        r.fail("inter_island", None, f"required with {len(islands)} islands")
    return Topology(
        name=name,
        islands=tuple(islands),
        intra_host=r.link(top["intra_host"], "intra_host"),
        inter_island_default=default,
        inter_island_overrides=overrides,
        description=r.string(top.get("description", ""), "description", True, lines=True),
    )


def _check_unique(r: TopologyReader, values: list[str], key: str, by_value: bool = False) -> None:
    seen: set[str] = set()
    for i, v in enumerate(values):
        if v in seen:
            r.fail(key.format(v if by_value else i), v, "must be unique")
        seen.add(v)


class TopologyReader(StrictReader):
    """Strict readers for a topology's links and islands (on top of the generic nodes)."""

    def link(self, raw: Any, key: str, extra: tuple[str, ...] = ()) -> Link:
        m = self.mapping(raw, key, required=("bandwidth_gbps", "latency_us"), optional=extra)
        return Link(
            bandwidth_gbps=self.number(
                m["bandwidth_gbps"], f"{key}.bandwidth_gbps", bound=BANDWIDTH
            ),
            latency_us=self.number(
                m["latency_us"], f"{key}.latency_us", strict=False, bound=LATENCY
            ),
        )

    def island(self, raw: Any, key: str) -> Island:
        m = self.mapping(
            raw,
            key,
            required=(
                "name",
                "nic",
                "link",
                "hosts",
                "devices_per_host",
                "device_kind",
                "peak_tflops",
                "memory_gb",
            ),
            optional=("memory_bandwidth_gbs", "hcas", "gid_index", "interface"),
        )
        name = self.string(m["name"], f"{key}.name")
        if any(c in name for c in ": \t"):
            self.fail(f"{key}.name", name, "must not contain ':' or whitespace")
        nic = m["nic"]
        if nic not in NIC_TYPES:
            self.fail(f"{key}.nic", nic, f"must be one of {', '.join(NIC_TYPES)}")
        per_host = self.integer(
            m["devices_per_host"], f"{key}.devices_per_host", 1, DEVICES_PER_HOST
        )
        hosts_raw = m["hosts"]  # bounded before a name is made: hosts: 10**12 is an error
        counted = isinstance(hosts_raw, int) and not isinstance(hosts_raw, bool)
        if counted:
            count = self.integer(hosts_raw, f"{key}.hosts", 1, HOSTS)
        elif isinstance(hosts_raw, list) and hosts_raw:
            count = self.integer(len(hosts_raw), f"len({key}.hosts)", 1, HOSTS)
        else:
            self.fail(f"{key}.hosts", hosts_raw, "must be a non-empty list of names or a count")
        self.integer(count * per_host, f"{key}: hosts x devices_per_host", 1, DEVICES)
        if counted:
            hosts = tuple(f"{name}-{i}" for i in range(count))
        else:
            hosts = tuple(self.string(h, f"{key}.hosts[{i}]") for i, h in enumerate(hosts_raw))
        hcas: tuple[str, ...] = ()
        if "hcas" in m:
            if nic == "ethernet":
                self.fail(f"{key}.hcas", m["hcas"], "only for nic infiniband or roce")
            if not isinstance(m["hcas"], list) or not m["hcas"]:
                self.fail(f"{key}.hcas", m["hcas"], "must be a non-empty list of names")
            hcas = tuple(self.string(h, f"{key}.hcas[{i}]") for i, h in enumerate(m["hcas"]))
        gid = None
        if "gid_index" in m:
            if nic != "roce":
                self.fail(f"{key}.gid_index", m["gid_index"], "only for nic roce")
            gid = self.integer(m["gid_index"], f"{key}.gid_index", 0, GID_INDEX)
        mem_bw = None
        if "memory_bandwidth_gbs" in m:
            mem_bw = self.number(
                m["memory_bandwidth_gbs"], f"{key}.memory_bandwidth_gbs", bound=MEMORY_GBS
            )
        interface = None
        if "interface" in m:
            interface = self.string(m["interface"], f"{key}.interface")
        return Island(
            name=name,
            nic=nic,
            link=self.link(m["link"], f"{key}.link"),
            hosts=hosts,
            devices_per_host=per_host,
            device_kind=self.string(m["device_kind"], f"{key}.device_kind"),
            peak_tflops=self.number(m["peak_tflops"], f"{key}.peak_tflops", bound=TFLOPS),
            memory_gb=self.number(m["memory_gb"], f"{key}.memory_gb", bound=MEMORY_GB),
            memory_bandwidth_gbs=mem_bw,
            hcas=hcas,
            gid_index=gid,
            interface=interface,
        )

    def inter_island(self, raw: Any, names: set[str]):
        m = self.mapping(raw, "inter_island", required=("default",), optional=("overrides",))
        default = self.link(m["default"], "inter_island.default")
        overrides, seen = [], set()
        items = m.get("overrides", [])
        if not isinstance(items, list):
            self.fail("inter_island.overrides", items, "must be a list")
        for i, item in enumerate(items):
            key = f"inter_island.overrides[{i}]"
            link = self.link(item, key, extra=("between",))
            pair = item.get("between")
            if not isinstance(pair, list) or len(pair) != 2:
                self.fail(f"{key}.between", pair, "must be a list of two island names")
            for n in pair:
                if not isinstance(n, str):  # not a name (a mapping is not even hashable)
                    self.fail(f"{key}.between", pair, "must be a list of two island names")
                if n not in names:
                    self.fail(f"{key}.between", pair, f"island '{n}' is not defined")
            if pair[0] == pair[1]:
                self.fail(f"{key}.between", pair, "must name two different islands")
            a, b = sorted(pair)
            if (a, b) in seen:
                self.fail(f"{key}.between", pair, "pair already has an override")
            seen.add((a, b))
            overrides.append((a, b, link))
        return default, tuple(overrides)
