"""jax's persistent compilation cache for a run (``train.compilation_cache``).

The cache directory, in order of precedence:

- ``train.compilation_cache: <path>``: that path;
- ``JAX_COMPILATION_CACHE_DIR`` in the environment: jax's own setting, left as it is;
- ``auto`` (the default): ``<train.run_dir>/compile_cache`` on GPUs and TPUs; none on
  CPU devices or without a run directory;
- ``null``: none.

``auto`` leaves CPU runs out because XLA:CPU in jaxlib 0.10.2 aborts the process when it
runs some executables read back from the cache (reproduced with test_diloco's resume test
and a cache directory set). A path set explicitly is used on any platform.

A run sets it in :func:`configure` before its first compile (never at import time). When
this module sets the directory it also caches every program, however fast its compile
(``jax_persistent_cache_min_compile_time_secs=0``; jax's default of 1 s leaves most CPU
programs out), unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` is set.

:class:`CacheHits` counts jax's cache events (``jax.monitoring``), so a run can say
whether its train step came from the cache.

jax writes cache entries from process 0 alone, and on CPU its cache key holds the
process's device assignment, so in a job of several CPU processes every process but 0
compiles again on every restart (and process 0 waits for them). :func:`load_or_compile`
keeps each such process's own executable of a program beside jax's entries
(``<cache>/executables/<program>-<hash>-p<process>.bin``, written whole: a temporary file
renamed), keyed by what the program is traced from (the package's code, the settings and
shapes the caller names, jax's version and tracing flags), its devices (ids and
processes, in the mesh's order), the process and the XLA flags, and loads it instead of
tracing, lowering and compiling (a pipelined step takes seconds to trace and lower, on
every process); :class:`Stored` does so for a jitted function (eval, the checkpoint
layout conversions). The files are the run's own, as trusted as
jax's cache entries (loading one runs code). It is on with ``train.executable_store``,
and then jax's own cache is off in that job: an executable that jax read back from its
cache and that was serialized again fails to run on XLA:CPU in jaxlib 0.10.2
(``NOT_FOUND: Function <name> not found``: reproduced on process 0, the only one jax's
cache serves), so every stored executable is a fresh compile's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
import threading
from collections.abc import Callable

from holmes_jax.core.config import Config
from holmes_jax.runtime.rundir.paths import AUTO, COMPILE_CACHE_NAME

STORE = "executables"  # load_or_compile's folder inside the cache directory
_STORE: str | None = None  # load_or_compile's cache directory, when the store is on
ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
ENV_MIN_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
HIT_EVENT = "/jax/compilation_cache/cache_hits"
REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"


def cache_dir(cfg: Config, platform: str, environ=None) -> str | None:
    """The directory this module sets for ``cfg`` (outputs resolved) on devices of
    ``platform`` (``cpu``, ``gpu``, ``tpu``), or None when it sets none: the cache is off,
    or ``JAX_COMPILATION_CACHE_DIR`` decides."""
    environ = os.environ if environ is None else environ
    value = cfg.train.compilation_cache
    if value is None or value != AUTO:
        return value
    if environ.get(ENV_DIR) or platform == "cpu":
        return None
    run_dir = cfg.train.run_dir
    return os.path.join(run_dir, COMPILE_CACHE_NAME) if run_dir else None


def configure(cfg: Config) -> str | None:
    """Point jax's persistent cache at ``cfg``'s directory (see the module doc); returns
    the directory in use (``JAX_COMPILATION_CACHE_DIR`` when that decides), or None.

    Several runs in one process each get their own setting: jax's cache is re-opened when
    the directory changes.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = cache_dir(cfg, jax.devices()[0].platform)
    if path is None:
        wanted = os.environ.get(ENV_DIR) or None  # jax's own setting
    else:
        wanted = os.path.abspath(path)
        os.makedirs(wanted, exist_ok=True)
        if not os.environ.get(ENV_MIN_TIME):
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    global _STORE
    several = jax.process_count() > 1 and jax.devices()[0].platform == "cpu"
    _STORE = wanted if cfg.train.executable_store and several else None
    jax_dir = None if _STORE else wanted  # the store alone: jax's read-backs are not stored
    if jax.config.jax_compilation_cache_dir != jax_dir:
        jax.config.update("jax_compilation_cache_dir", jax_dir)
        cc.reset_cache()  # jax opens its cache once; a new directory needs a new one
    return wanted


class CacheHits:
    """Counts jax's persistent-cache events from creation on (one listener per process).

    ``hits`` and ``requests`` are the numbers of compiles served from the cache and of
    compiles that asked it, since this object was made.
    """

    _lock = threading.Lock()
    _counts = {HIT_EVENT: 0, REQUEST_EVENT: 0}
    _listening = False

    def __init__(self):
        with CacheHits._lock:
            if not CacheHits._listening:
                import jax

                jax.monitoring.register_event_listener(CacheHits._on_event)
                CacheHits._listening = True
            self._start = dict(CacheHits._counts)

    @staticmethod
    def _on_event(event: str, **kwargs) -> None:
        if event in CacheHits._counts:
            with CacheHits._lock:
                CacheHits._counts[event] += 1

    @staticmethod
    def note(hit: bool) -> None:
        """One compile that asked :func:`load_or_compile`'s store, served or not."""
        CacheHits._on_event(REQUEST_EVENT)
        if hit:
            CacheHits._on_event(HIT_EVENT)

    @property
    def hits(self) -> int:
        return CacheHits._counts[HIT_EVENT] - self._start[HIT_EVENT]

    @property
    def requests(self) -> int:
        return CacheHits._counts[REQUEST_EVENT] - self._start[REQUEST_EVENT]

    def describe(self) -> str:
        """:func:`describe` of the compiles since this object was made."""
        return describe(self.hits, self.requests)


def describe(hits: int, requests: int) -> str:
    """``compilation cache: hit`` (every compile served), ``... N of M hit`` or
    ``... miss``; empty when no compile asked the cache."""
    if not requests:
        return ""
    if hits == requests:
        return "compilation cache: hit"
    if hits:
        return f"compilation cache: {hits} of {requests} hit"
    return "compilation cache: miss"


# jax settings that change what a traced function lowers to
TRACING_FLAGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_numpy_rank_promotion",
)


@functools.cache
def source_digest() -> str:
    """A digest of every Python file of the ``holmes_jax`` package (paths and bytes): a
    stored program is the code's that stored it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read() + b"\0")
    return h.hexdigest()


def identity(cfg: Config, mesh, batch, *extra) -> str:
    """What a program of ``cfg`` on ``mesh`` taking ``batch`` (or None) is traced from,
    besides the code (:func:`load_or_compile`): the settings that shape it (not the run's
    paths), the mesh's axes and shape, the batch's shape and dtype (the state follows from
    these) and ``extra``."""
    train = dataclasses.replace(
        cfg.train, run_dir=None, metrics_path=None, compilation_cache=None, executable_store=False
    )
    mesh_shape = (tuple(mesh.axis_names), mesh.devices.shape)
    parts = (cfg.model, cfg.parallel, cfg.optimizer, cfg.diloco, train, mesh_shape, extra)
    if batch is None:
        return repr(parts)
    return repr(parts + (tuple(batch.shape), str(batch.dtype)))


class Stored:
    """A jitted function whose executable is :func:`load_or_compile`'s: lowered (or loaded)
    for the arguments of its first call, or of :meth:`compile`, and run for every later
    call; arguments of other shapes or shardings go to the jitted function instead.

    Args:
      jitted: the :func:`jax.jit` function.
      name: the program's name in the store.
      devices: the mesh's devices, in its order.
      identity: as :func:`load_or_compile`'s (the same for every call of this function).
    """

    def __init__(self, jitted, name: str, devices, identity: str):
        self.jitted, self.name, self.identity = jitted, name, identity
        self.devices = list(devices)
        self._compiled = None

    @property
    def compiled(self):
        """The executable (a :class:`jax.stages.Compiled`), or None before the first call."""
        return self._compiled

    def compile(self, *args) -> None:
        """Lower (or load) the executable for ``args`` (arrays or shape structs) now."""
        if self._compiled is None:
            lower = lambda: self.jitted.lower(*args)  # noqa: E731
            self._compiled = load_or_compile(lower, self.name, self.devices, self.identity)

    def __call__(self, *args):
        self.compile(*args)
        try:
            return self._compiled(*args)
        except (TypeError, ValueError):  # other shapes or shardings: jit's own path
            return self.jitted(*args)


def load_or_compile(lower: Callable, name: str, devices, identity: str):
    """``lower().compile()``; with ``train.executable_store``, in a job of several CPU
    processes with a cache directory, this process's executable of the same program from
    the store when it holds one (neither traced nor lowered), else compiled and stored
    (module doc).

    Args:
      lower: () -> the program's :class:`jax.stages.Lowered`, called on a miss only.
      name: the program's name in the store's file names.
      devices: the mesh's devices, in its order.
      identity: what, besides the package's code (:func:`source_digest`), jax, the
        XLA flags and ``devices``, determines the program: the settings and argument
        shapes it is traced from. Two programs that differ must differ here.

    Returns a :class:`jax.stages.Compiled`.
    """
    import jax
    from jax.experimental import serialize_executable

    directory = _STORE
    if not (directory and jax.process_count() > 1):
        return lower().compile()
    devices = list(devices)  # an iterator (a mesh's .flat) is read twice below
    me = f"{jax.process_index()}/{jax.process_count()}"
    flags = os.environ.get("XLA_FLAGS", "")
    where = [(d.id, d.process_index) for d in devices]
    tracing = [getattr(jax.config, f, None) for f in TRACING_FLAGS]
    versions = f"{jax.__version__}/{jax.lib.__version__}"
    key = f"{versions}|{source_digest()}|{me}|{flags}|{tracing}|{where}|{identity}"
    key = hashlib.sha256(key.encode()).hexdigest()[:32]
    path = os.path.join(directory, STORE, f"{name}-{key}-p{jax.process_index()}.bin")
    if os.path.exists(path):
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        CacheHits.note(hit=True)
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=devices
        )
    compiled = lower().compile()
    CacheHits.note(hit=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.{os.getpid()}.part"
    with open(part, "wb") as f:
        pickle.dump(serialize_executable.serialize(compiled), f)
    os.replace(part, path)
    return compiled
