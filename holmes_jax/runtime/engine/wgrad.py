"""A layer's backward split in two: the input gradient now, the weight gradient later (ZB-H1).

The zero-bubble schedule (``parallel.schedule: zb``) runs a layer's backward as two ops:

- B: ``(w, saved, ct) -> (dx, stash)``, the input gradient (the pipeline's critical path);
- W: ``(w, saved, stash) -> dw``, the weight gradient, deferred into what would be bubbles.

``split_backward`` derives both from the one backward ``(w, saved, ct) -> (dw, dx)`` (the
layer's ``jax.vjp`` rebuilt from its residuals) by slicing its jaxpr:

1. B = the equations ``dx`` depends on (backward dead-code elimination from ``dx``);
2. W = the equations ``dw`` depends on that B does not already run;
3. stash = the values B computes that W reads: each matmul's output cotangent, and the
   matmul outputs the remat policy recomputes in the backward. W recomputes instead of
   stashing what is cheap: shape-only ops (a transposed copy of a stashed cotangent) and
   forward values without a matmul (norm outputs, activations: elementwise work on what
   the residuals hold). W reads the residuals (``saved``) and weights directly.

Matmuls never run twice: B + W do the unsplit backward's matmuls plus a few elementwise
ops. A cotangent cast to a narrower dtype (rotary's fp32 cotangents to bf16) is stashed
after the cast. ``w_reads`` names the residual leaves W reads; the others are dead once B
has run, and the engine writes the stash over them (``buffers.StashLayout``): with
``remat: none`` a GPT-2 layer's stash is 4h + (3h + f)/t wide, its B-only residuals about
three times that, so zb keeps 1F1B's activation memory. Under ``selective`` / ``full`` the
B-only residuals are small and most of the stash waits in its own buffer
(``Schedule.stash_slots`` micro-batches of it).
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
    w_reads: frozenset[int]  # indices of the ``saved`` leaves W reads (the rest: B only)


def split_backward(backward, w, saved, ct) -> SplitBackward:
    """Split ``backward(w, saved, ct) -> (dw, dx)`` into B and W (module docstring).

    ``w`` (a pytree), ``saved`` (a list of arrays) and ``ct`` are example values or
    ``ShapeDtypeStruct``s; the returned functions take values of the same structure.
    """
    # Inline nested calls (remat, jit, custom-derivative wrappers): the slicing below needs
    # primitive granularity, or one remat equation would compute dx and dw together.
    nested = jax.make_jaxpr(backward)(w, saved, ct)
    closed = jax.make_jaxpr(lambda *args: _eval_inlined(nested.jaxpr, nested.consts, args))(
        *jax.tree.leaves((w, saved, ct))
    )
    jaxpr, consts = closed.jaxpr, closed.consts
    w_leaves, w_def = jax.tree.flatten(w)
    n_w, n_saved = len(w_leaves), len(saved)
    in_w = jaxpr.invars[:n_w]
    in_saved = jaxpr.invars[n_w : n_w + n_saved]
    (in_ct,) = jaxpr.invars[n_w + n_saved :]
    outs = jaxpr.outvars
    dw_out, (dx_out,) = outs[:-1], outs[-1:]

    b_eqns = _needed(jaxpr.eqns, [dx_out])
    b_ids = {id(e) for e in b_eqns}
    w_eqns = [e for e in _needed(jaxpr.eqns, dw_out) if id(e) not in b_ids]
    producer = {v: e for e in b_eqns for v in e.outvars}
    order = {id(e): n for n, e in enumerate(jaxpr.eqns)}
    # Which of B's values depend on the cotangent (the rest are the forward recomputed).
    from_ct = {in_ct}
    for e in b_eqns:
        if any(v in from_ct for v in e.invars if isinstance(v, Var)):
            from_ct.update(e.outvars)

    def recompute(e, stashed) -> bool:
        """W recomputes e's output rather than B stashing it: shape-only ops, and forward
        values (no cotangent in them) that take no matmul. A cotangent cast to a narrower
        dtype is stashed (rotary's fp32 cotangents cast to bf16) unless its input is anyway."""
        x = e.invars[0] if e.invars else None
        if e.primitive.name == "convert_element_type" and _shrinks(e) and x in from_ct:
            return x in stashed
        if e.primitive.name in _CHEAP:
            return True
        if e.primitive.name in _COSTLY:
            return False
        return not any(v in from_ct for v in e.invars if isinstance(v, Var))

    while True:
        stash = _stash(w_eqns, dw_out, set(producer) | {in_ct})
        in_w_eqns = {id(e) for e in w_eqns}
        more = {
            id(producer[v]): producer[v]
            for v in stash
            if v in producer
            and id(producer[v]) not in in_w_eqns
            and recompute(producer[v], set(stash))
        }
        if not more:
            break
        w_eqns = sorted(w_eqns + list(more.values()), key=lambda e: order[id(e)])

    def env_of(w_, saved_, extra_vars, extra_vals):
        """Constants, weights, residuals and the op's own inputs, by jaxpr variable."""
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(in_w, jax.tree.leaves(w_), strict=True))
        env.update(zip(in_saved, saved_, strict=True))
        env.update(zip(extra_vars, extra_vals, strict=True))
        return env

    def input_grad(w_, saved_, ct_):
        env = env_of(w_, saved_, [in_ct], [ct_])
        _run(b_eqns, env)
        return _read(env, dx_out), [_read(env, v) for v in stash]

    def weight_grad(w_, saved_, stash_):
        env = env_of(w_, saved_, stash, stash_)
        _run(w_eqns, env)
        return jax.tree.unflatten(w_def, [_read(env, v) for v in dw_out])  # dw: w's tree

    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in stash]
    read = {v for e in w_eqns for v in e.invars if isinstance(v, Var)} | set(dw_out)
    w_reads = frozenset(n for n, v in enumerate(in_saved) if v in read)
    return SplitBackward(input_grad, weight_grad, shapes, w_reads)


def _inner(e):
    """``(jaxpr, consts)`` of a call-like equation (its body runs once, as is), else None."""
    name = e.primitive.name
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = e.params.get(key)
        if body is None or name in ("while", "cond", "scan", "custom_vjp_call"):
            continue
        if hasattr(body, "consts"):  # ClosedJaxpr
            return body.jaxpr, body.consts
        if hasattr(body, "eqns"):
            return body, ()
    return None


def _eval_inlined(jaxpr, consts, args):
    """Evaluate ``jaxpr``, running the bodies of call-like equations inline."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for e in jaxpr.eqns:
        vals = [_read(env, v) for v in e.invars]
        inner = _inner(e)
        outs = _bind(e, vals) if inner is None else _eval_inlined(inner[0], inner[1], vals)
        _write(env, e, outs)
    return [_read(env, v) for v in jaxpr.outvars]


# Shape-only or elementwise-cast primitives: W recomputes them from their input rather
# than B stashing their output beside it (a transposed copy of a cotangent, say).
_CHEAP = {
    "transpose",
    "reshape",
    "convert_element_type",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
}


# Work W should not redo: matmuls (a stashed matmul output costs memory, not FLOPs).
_COSTLY = {"dot_general", "conv_general_dilated"}


def _shrinks(e) -> bool:
    """A cast to a narrower dtype (fp32 -> bf16)."""
    (x,), (y,) = e.invars, e.outvars
    return y.aval.dtype.itemsize < x.aval.dtype.itemsize


def _stash(w_eqns, dw_out, b_defined) -> list:
    """Values W reads that B computes (or ``ct``), in first-read order."""
    own = {v for e in w_eqns for v in e.outvars}
    out: list = []
    for v in [v for e in w_eqns for v in e.invars] + list(dw_out):
        if isinstance(v, Var) and v in b_defined and v not in own and v not in out:
            out.append(v)
    return out


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


def _bind(e, vals) -> list:
    """Run equation ``e`` on ``vals`` (as ``jax.core.eval_jaxpr`` does); its outputs."""
    params = e.primitive.get_bind_params(e.params)
    with e.ctx.manager:
        ans = e.primitive.bind(*vals, **params)
    return ans if e.primitive.multiple_results else [ans]


def _write(env, e, outs) -> None:
    for v, x in zip(e.outvars, outs, strict=True):
        if isinstance(v, Var):
            env[v] = x


def _run(eqns, env) -> None:
    """Evaluate ``eqns`` in ``env``, adding their outputs."""
    for e in eqns:
        _write(env, e, _bind(e, [_read(env, v) for v in e.invars]))
