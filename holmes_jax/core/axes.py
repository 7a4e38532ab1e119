"""Mesh axis names: the one place they are spelled.

- ``REPLICA``: whole-pipeline copies, one per island (data parallel across islands with
  hierarchical reduction); size 1 unless ``parallel.replica > 1``.
- ``STAGE``: pipeline stages; the only axis allowed to cross an island boundary.
- ``DATA``: data parallelism (ZeRO-1 optimizer sharding) inside one island.
- ``TENSOR``: tensor parallelism inside one host.
"""

REPLICA = "replica"
STAGE = "stage"
DATA = "data"
TENSOR = "tensor"

# Order of the axes in every mesh: outermost (slowest links) first.
MESH_AXES = (REPLICA, STAGE, DATA, TENSOR)
# The batch is split over these (replica-major).
BATCH_AXES = (REPLICA, DATA)
