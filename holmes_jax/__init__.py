"""holmes_jax: a JAX/XLA GPT trainer for clusters whose hosts sit on different networks.

Importing the package does no work: no device queries, no config changes. Entry points:
``python -m holmes_jax.train``, ``python -m holmes_jax.plan`` and the plain functions
they wrap (``holmes_jax.train.run``).
"""

__version__ = "0.1.0"
