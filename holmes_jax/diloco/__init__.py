"""DiLoCo across islands: everything between the inner steps of one island and the next.

Layer: ``core`` <- ``planner`` <- ``cluster`` <- ``diloco`` <- ``runtime``. The modules:

- ``codec``, ``sparse``: the one numeric contract of the outer step, for numpy and jax
  alike: the fp32 / bf16 / int8 encodings of a delta and the Nesterov step; the sparse
  format (top-k per chunk, a few bits a value) and its error feedback.
- ``schedule``: which round follows which step and carries which fragment (pure).
- ``outer_step``: ``diloco.mode: spmd``, the outer step inside one program (jax): the
  replicas' deltas all-gathered over ``replica``.
- ``islands``, ``scope``, ``lanes``: ``diloco.mode: independent``, one job per island:
  the job's side (device <-> host, overlap, heal at start, abstain, the outer state beside
  checkpoints), which island it is with its outputs and rows, and the lanes that split
  the host-side traffic over the island's processes (cut into fragments' pieces).
- ``outer_files``: an island's outer state and error-feedback buffer beside checkpoints.
- ``wire``, ``messages``: what crosses between independent islands: the framed body
  format and the typed, checked messages it carries (checked before any state changes).
- ``auth``: the shared-key HMAC on every request and reply between islands.
- ``rounds``: the protocol's state and pure round logic (membership, quorum, merge,
  lineage), no sockets and no threads.
- ``transport``: the HTTP server and client (authentication, size limits, TLS).
- ``sync``, ``leader``: one island's end of the protocol,
  :class:`~holmes_jax.diloco.sync.OuterSync`: rounds driven over the transport; ``leader``
  holds its leader's side (closing rounds, probing missing members) and its server.
"""
