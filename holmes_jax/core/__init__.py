"""What every layer shares: the error type, mesh axis names, strict YAML, the run config
and the planner's view of it.

Plain Python (no jax). Imports nothing from the rest of the package.
"""
