"""Reading compiled HLO in tests: collective replica groups and which islands they span.

Tests check *where* traffic goes by compiling the real train step on 8 simulated devices
and reading its HLO text: every reduction group must stay inside one island, and only
pipeline ``collective-permute`` pairs may cross (between adjacent stages).
"""

import re

import jax
import numpy as np

from holmes_jax.core.plan_request import plan_request
from holmes_jax.planner.grid import load_mesh_topology, resolve_shape
from holmes_jax.runtime.engine.mesh import build_mesh, device_islands
from holmes_jax.runtime.engine.traffic import permute_traffic  # noqa: F401  (tests read it here)
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
    req = plan_request(cfg)
    topology = load_mesh_topology(req)
    shape = resolve_shape(req, len(jax.devices()), topology)
    mesh = build_mesh(shape)
    text = Program(cfg, mesh).lower_train_step().compile().as_text()
    islands = device_islands(mesh, topology)
    position = [d.id for d in mesh.devices.flat]  # HLO device numbers index this order
    return text, shape, lambda n: islands[position[n]]
