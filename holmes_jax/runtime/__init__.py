"""The runtime: the training loop and its compiled program, and the packages they use.

- ``loop``, ``setup``, ``each_step``, ``program``, ``state``, ``nonfinite``: the loop, what
  it does before the first step and around each step, the jitted train step and the state
  it carries, non-finite steps.
- ``engine/``: the pipeline engine. ``model/``: the decoder and its optimizer.
- ``data/``: batches. ``rundir/``: checkpoints, metrics and everything else a run writes.
- ``hf/``: Hugging Face interop. ``probe/``: measurements on the real devices.
"""
