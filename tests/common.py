"""Paths and shared constants for the tests (the fixtures are in ``conftest.py``).

Importable at collection time (parametrize lists need the file lists), so this module
holds plain values only; nothing here imports jax.
"""

import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
MESHES = sorted(glob.glob(os.path.join(ROOT, "meshes", "*.yaml")))


def config_path(name: str) -> str:
    """``configs/<name>`` in the repository."""
    return os.path.join(ROOT, "configs", name)


def mesh_path(name: str) -> str:
    """``meshes/<name>`` in the repository."""
    return os.path.join(ROOT, "meshes", name)


# The tiny model of the tests (2 layers, hidden 32, 4 heads, 32 tokens).
TINY_MODEL = (
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.seq_len=32",
)
# The tiny run training tests share: every feature that changes the math is on (untied
# head, weight decay, clipping), so a wrong gradient cannot hide; a small corpus slice.
TINY_RUN = (
    *TINY_MODEL,
    "model.tied_embeddings=false",
    "train.global_batch_size=8",
    "optimizer.learning_rate=1e-2",
    "optimizer.warmup_steps=1",
    "optimizer.grad_clip=0.5",
    "data.max_bytes=400000",
)


def as_flags(overrides) -> list[str]:
    """``["a=1", "b=2"]`` -> ``["--set", "a=1", "--set", "b=2"]`` for the CLIs."""
    return [arg for item in overrides for arg in ("--set", item)]
