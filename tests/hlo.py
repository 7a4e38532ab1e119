"""Reading compiled HLO in tests: collective replica groups and which islands they span.

Tests check *where* traffic goes by compiling the real train step on 8 simulated devices
and reading its HLO text: every reduction group must stay inside one island, and only
pipeline ``collective-permute`` pairs may cross (between adjacent stages).
"""

import re

import jax
import numpy as np

from holmes_jax.planner.grid import load_mesh_topology, resolve_shape
from holmes_jax.runtime.mesh import build_mesh, device_islands
from holmes_jax.runtime.program import Program

REDUCTIONS = r" (all-reduce|reduce-scatter|all-gather|all-to-all)(?:-start)?\("


def replica_groups(attr: str) -> list[list[int]]:
    """Parse replica_groups / source_target_pairs: explicit {{..},{..}}, iota
    ``[G,N]<=[dims]T(perm)``, or mesh form ``mesh['axis_0'=4,'axis_1'=2] {'axis_1'}``."""
    attr = attr.strip()
    if attr.startswith("mesh["):
        dims = [(n, int(v)) for n, v in re.findall(r"'(\w+)'=(\d+)", attr.split("]")[0])]
        varying = re.findall(r"'(\w+)'", attr.split("]", 1)[1])
        ids = np.arange(np.prod([v for _, v in dims])).reshape([v for _, v in dims])
        names = [n for n, _ in dims]
        order = [k for k, n in enumerate(names) if n not in varying]
        order += [names.index(n) for n in varying]
        size = int(np.prod([dict(dims)[n] for n in varying]))
        return ids.transpose(order).reshape(-1, size).tolist()
    if attr.startswith("{"):
        return [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", attr)]
    m = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attr)
    assert m, attr
    n_groups, size = int(m.group(1)), int(m.group(2))
    dims = [int(v) for v in m.group(3).split(",")]
    ids = np.arange(np.prod(dims)).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(v) for v in m.group(4).split(",")])
    return ids.reshape(n_groups, size).tolist()


def attr(line: str, name: str) -> str:
    """The value of ``name=`` in an HLO instruction line (handles the mesh form's space)."""
    rest = line.split(f"{name}=", 1)[1]
    if rest.startswith("mesh["):
        return rest[: rest.index("}") + 1]
    depth, out = 0, []
    for ch in rest:
        if ch == "," and depth == 0:
            break
        depth += ch in "{[("
        depth -= ch in "}])"
        out.append(ch)
    return "".join(out)


def compiled_train_step(cfg):
    """Compile ``cfg``'s train step on the visible devices.

    Returns:
      (HLO text, resolved degrees, ``island(n)``: the island index of HLO device n).
    """
    topology = load_mesh_topology(cfg)
    shape = resolve_shape(cfg, len(jax.devices()), topology)
    mesh = build_mesh(shape)
    text = Program(cfg, mesh).lower_train_step().compile().as_text()
    islands = device_islands(mesh, topology)
    position = [d.id for d in mesh.devices.flat]  # HLO device numbers index this order
    return text, shape, lambda n: islands[position[n]]


# --------------------------------------------------------------------------- traffic

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLS = re.compile(r"(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TYPE = re.compile(r"= \(?(\w+)\[([\d,]*)\]")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "u16": 2, "s32": 4, "u32": 4, "f64": 8, "pred": 1}


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
            pairs = replica_groups(re.search(r"source_target_pairs=(\{[\d,{}]*\})", line).group(1))
            for a, b in pairs:
                sent[(a, b)] = sent.get((a, b), 0) + m * size
    return sent
