"""A layer's backward split in two: the input gradient now, the weight gradient later (ZB-H1).

The zero-bubble schedule (``parallel.schedule: zb``) runs a layer's backward as two ops:

- B: ``(w, saved, ct) -> (dx, stash)``, the input gradient (the pipeline's critical path);
- W: ``(w, saved, stash) -> dw``, the weight gradient, deferred into what would be bubbles.

``split_backward`` derives both from the one backward ``(w, saved, ct) -> (dw, dx)`` (the
layer's ``jax.vjp`` rebuilt from its residuals) by slicing its jaxpr:

1. B = the equations ``dx`` depends on (backward dead-code elimination from ``dx``);
2. W = the equations ``dw`` depends on that B does not already run;
3. stash = the values B computes that W reads (for a transformer layer: each matmul's output
   cotangent, and what the remat policy recomputes in the backward), plus ``ct`` itself if W
   reads it. W reads the residuals (``saved``) and weights directly.

No equation runs twice: B + W do exactly the work of the unsplit backward. The stash is
bounded by what the backward keeps live anyway; the engine buffers it per layer for the
micro-batches whose W is pending (``Schedule.stash_slots`` of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import Literal, Var


@dataclass(frozen=True)
class SplitBackward:
    """B and W of one layer, and the stash's shapes (``jax.ShapeDtypeStruct`` per value)."""

    input_grad: Any  # (w, saved, ct) -> (dx, [stash values])
    weight_grad: Any  # (w, saved, [stash values]) -> dw
    stash: list[jax.ShapeDtypeStruct]


def split_backward(backward, w, saved, ct) -> SplitBackward:
    """Split ``backward(w, saved, ct) -> (dw, dx)`` into B and W (module docstring).

    ``w`` (a pytree), ``saved`` (a list of arrays) and ``ct`` are example values or
    ``ShapeDtypeStruct``s; the returned functions take values of the same structure.
    """
    closed = jax.make_jaxpr(backward)(w, saved, ct)
    jaxpr, consts = closed.jaxpr, closed.consts
    w_leaves, w_def = jax.tree.flatten(w)
    n_w, n_saved = len(w_leaves), len(saved)
    in_w = jaxpr.invars[:n_w]
    in_saved = jaxpr.invars[n_w : n_w + n_saved]
    (in_ct,) = jaxpr.invars[n_w + n_saved :]
    outs = jaxpr.outvars
    dw_out, (dx_out,) = outs[:-1], outs[-1:]
    _, dw_def = jax.tree.flatten(jax.eval_shape(backward, w, saved, ct)[0])

    b_eqns = _needed(jaxpr.eqns, [dx_out])
    b_ids = {id(e) for e in b_eqns}
    w_eqns = [e for e in _needed(jaxpr.eqns, dw_out) if id(e) not in b_ids]
    b_defined = {v for e in b_eqns for v in e.outvars} | {in_ct}
    w_reads = [v for e in w_eqns for v in e.invars] + list(dw_out)
    stash: list[Var] = []
    for v in w_reads:
        if isinstance(v, Var) and v in b_defined and v not in stash:
            stash.append(v)

    def input_grad(w_, saved_, ct_):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(in_w, jax.tree.leaves(w_), strict=True))
        env.update(zip(in_saved, saved_, strict=True))
        env[in_ct] = ct_
        _run(b_eqns, env)
        return _read(env, dx_out), [_read(env, v) for v in stash]

    def weight_grad(w_, saved_, stash_):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(in_w, jax.tree.leaves(w_), strict=True))
        env.update(zip(in_saved, saved_, strict=True))
        env.update(zip(stash, stash_, strict=True))
        _run(w_eqns, env)
        return jax.tree.unflatten(dw_def, [_read(env, v) for v in dw_out])

    del w_def
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in stash]
    return SplitBackward(input_grad, weight_grad, shapes)


def _needed(eqns, outs) -> list:
    """The equations ``outs`` depend on, in program order."""
    live = {v for v in outs if isinstance(v, Var)}
    keep = []
    for e in reversed(eqns):
        if any(v in live for v in e.outvars if isinstance(v, Var)):
            keep.append(e)
            live.update(v for v in e.invars if isinstance(v, Var))
    return keep[::-1]


def _read(env, v):
    return v.val if isinstance(v, Literal) else env[v]


def _run(eqns, env) -> None:
    """Evaluate ``eqns`` in ``env`` (as ``jax.core.eval_jaxpr`` does), adding their outputs."""
    for e in eqns:
        params = e.primitive.get_bind_params(e.params)
        with e.ctx.manager:
            ans = e.primitive.bind(*[_read(env, v) for v in e.invars], **params)
        outs = ans if e.primitive.multiple_results else [ans]
        for v, x in zip(e.outvars, outs, strict=True):
            if isinstance(v, Var):
                env[v] = x
