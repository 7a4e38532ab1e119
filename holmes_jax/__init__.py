"""holmes_jax: a JAX/XLA GPT trainer for clusters whose hosts sit on different networks.

Four layers, imports flowing one way (``docs/design.md``)::

    core  <-  planner  <-  cluster  <-  runtime  <-  entry points

- :mod:`holmes_jax.core`: errors, axis names, strict YAML, the model/degree specs, config;
- :mod:`holmes_jax.planner`: topology, cost and memory models, placement, plan search
  (no jax);
- :mod:`holmes_jax.cluster`: joining multi-process jobs, watchdog, NIC profiles, launcher,
  emulated islands;
- :mod:`holmes_jax.runtime`: model, mesh, pipeline engine, ZeRO-1, program, data,
  checkpoints, metrics, the training loop.

Entry points: ``python -m holmes_jax.{train,plan,probe,launch}``; from a notebook,
``holmes_jax.train.run(config)``. Importing the package does no work: no device queries,
no config changes.
"""

__version__ = "0.1.0"
