"""What every layer shares: the error type, mesh axis names, strict YAML, the run config.

Plain Python (no jax). Imports nothing from the rest of the package.
"""
