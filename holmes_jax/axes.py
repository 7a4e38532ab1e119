"""Mesh axis names: the one place they are spelled.

- ``STAGE``: pipeline stages; the only axis allowed to cross an island boundary.
- ``DATA``: data parallelism (ZeRO-1 optimizer sharding) inside one island.
- ``TENSOR``: tensor parallelism inside one host.
"""

STAGE = "stage"
DATA = "data"
TENSOR = "tensor"

# Order of the axes in every mesh: outermost (slowest links) first.
MESH_AXES = (STAGE, DATA, TENSOR)
