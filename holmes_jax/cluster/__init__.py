"""The cluster: joining a multi-process job, the watchdog, NIC transport profiles, XLA
flags, local launches and emulated islands (network namespaces).

Imports :mod:`holmes_jax.core` and :mod:`holmes_jax.planner` (the topology); never
:mod:`holmes_jax.runtime`.
"""
