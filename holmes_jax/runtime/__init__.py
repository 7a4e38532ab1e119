"""The runtime: model, mesh, schedules, pipeline engine, ZeRO-1, optimizer, compiled
program, data, checkpoints, metrics, the training loop and the probe's measuring half.

The only layer that builds jax programs. Imports :mod:`holmes_jax.core`,
:mod:`holmes_jax.planner` and :mod:`holmes_jax.cluster`.
"""
