"""What a compiled program sends point to point: bytes per (source, target) device per step.

Reads the optimized HLO text (``compiled.as_text()``): every ``collective-permute`` counts
its bytes once per execution, i.e. times the ``known_trip_count`` of each while loop around
it. The pipeline engine states its sends this way (static pairs per tick, periodic ticks in
scans), so the bytes that cross an island boundary are read off the program itself, not
assumed: ``scripts/bench_islands.py`` prints them beside measured step times and the tests
check each micro-batch crosses each boundary exactly once per direction.
"""

from __future__ import annotations

import re

import numpy as np


def _pairs(attr: str) -> list[tuple[int, int]]:
    """``{{0,1},{2,3}}`` -> [(0, 1), (2, 3)]."""
    return [
        tuple(int(v) for v in g.split(","))  # type: ignore[misc]
        for g in re.findall(r"\{(\d+,\d+)\}", attr)
    ]


_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLS = re.compile(
    r"(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TYPE = re.compile(r"= \(?(\w+)\[([\d,]*)\]")
_ITEMSIZE = {
    **{"f32": 4, "bf16": 2, "f16": 2, "u16": 2, "s32": 4, "u32": 4, "f64": 8, "pred": 1},
    **{"u8": 1, "s8": 1, "f8e4m3fn": 1},
}


def permute_traffic(text: str) -> dict[tuple[int, int], int]:
    """Bytes each ``collective-permute`` sends per step, by (source, target) HLO device.

    Every permute counts once per execution: its computation's multiplier is the product of
    the ``known_trip_count`` of the while loops around it (summed over call sites). A
    permute inside a loop without a known trip count (a data-dependent loop) is an error:
    its traffic could not be stated.
    """
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            name = m.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name is not None and line.startswith(" "):
            comps[name].append(line)
    calls: dict[str, list[tuple[str, int | None]]] = {c: [] for c in comps}  # callee <- caller
    for caller, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            for kind, callee in _CALLS.findall(line):
                factor = 1
                if kind == "body":
                    factor = int(trip.group(1)) if trip else None
                elif kind == "condition":
                    factor = 0  # conditions compute no traffic worth counting
                calls.setdefault(callee, []).append((caller, factor))

    memo: dict[str, int | None] = {}

    def mult(c: str):
        if c == entry:
            return 1
        if c not in memo:
            total = 0
            for caller, factor in calls.get(c, []):
                m = mult(caller)
                if factor == 0 or m == 0:
                    continue
                if factor is None or m is None:
                    return None
                total += m * factor
            memo[c] = total
        return memo[c]

    sent: dict[tuple[int, int], int] = {}
    for c, lines in comps.items():
        for line in lines:
            if not re.search(r" collective-permute(?:-start)?\(", line):
                continue
            m = mult(c)
            assert m is not None, f"permute in a loop of unknown trip count: {line[:160]}"
            dtype, dims = _TYPE.search(line).groups()
            size = _ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
            pairs = _pairs(re.search(r"source_target_pairs=(\{[\d,{}]*\})", line).group(1))
            for a, b in pairs:
                sent[(a, b)] = sent.get((a, b), 0) + m * size
    return sent


def cross_island_bytes(text: str, mesh, topology) -> int:
    """Point-to-point bytes per step whose source and target sit on different islands.

    HLO device n is ``mesh.devices.flat[n]``; islands from
    :func:`holmes_jax.runtime.engine.mesh.device_islands`.
    """
    from holmes_jax.runtime.engine.mesh import device_islands

    islands = device_islands(mesh, topology)
    position = [d.id for d in mesh.devices.flat]
    return sum(
        n
        for (a, b), n in permute_traffic(text).items()
        if islands[position[a]] != islands[position[b]]
    )
