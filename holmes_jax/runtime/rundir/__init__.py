"""What a run reads and writes: its directory, checkpoints and their storage, metrics,
profiler traces, the compile cache, and the device peaks the metrics use.
"""
