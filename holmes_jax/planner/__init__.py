"""The planner: topology, cost and memory models, placement, partition, plan search.

Pure Python + NumPy, no jax: a plan for a 1024-GPU cluster is computed on a laptop.
It reads a run as a :class:`~holmes_jax.core.plan_request.PlanRequest`, never its config.
Imports only :mod:`holmes_jax.core`; never :mod:`holmes_jax.cluster` or
:mod:`holmes_jax.runtime` (``tests/test_layers.py`` checks it).
"""
