"""Mixtures of shard sets (exact shares, pure in (seed, step), any host count), named
evaluation sets, and the read-ahead feed; one tiny run that trains on a mixture."""

import threading

import fsspec
import numpy as np
import pytest

from holmes_jax.core.config import load_config
from holmes_jax.core.errors import ConfigError
from holmes_jax.runtime.data.feed import Feed
from holmes_jax.runtime.data.loader import BatchSampler, load_corpus, mixture_rows
from holmes_jax.runtime.data.shards import ShardSet
from tests.common import HANG_S, TINY_RUN
from tests.runtime.data.test_shards import write_shard

WEIGHTS = [(0.7, 0.2, 0.1), (1, 1, 1), (0.5, 0.3, 0.15, 0.05), (0.97, 0.03), (3, 0, 1)]


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("rows", [4, 8, 24])
def test_each_step_rounds_each_quota_and_the_shares_are_exact(weights, rows):
    w = np.asarray(weights, np.float64) / sum(weights)
    counts = np.array([mixture_rows(w, rows, step, seed=11) for step in range(1000)])
    assert (counts.sum(axis=1) == rows).all()
    quota = rows * w
    assert ((np.floor(quota) <= counts) & (counts <= np.ceil(quota))).all()  # per step
    off = counts.sum(axis=0) - 1000 * rows * w  # rows above or below each exact share
    assert np.abs(off).max() <= 3, off  # O(log steps) rows: within 1% of any share here


def sources(n=3, length=400):
    """``n`` in-memory sets: set i's ids are i*1000 + offset, so each id names its set."""
    return [
        ShardSet.of_array((i * 1000 + np.arange(length)).astype(np.uint16), f"s{i}")
        for i in range(n)
    ]


def test_a_mixture_batch_is_a_pure_function_of_the_step_at_any_host_count():
    kw = dict(seq_len=15, global_batch_size=16, seed=5, weights=[0.5, 0.3, 0.2])
    sampler = BatchSampler(sources(), **kw)
    for step in (0, 1, 7, 999):
        batch = sampler.global_batch(step)
        of = batch // 1000  # each row's set
        assert (of == of[:, :1]).all()  # a row is from one set
        assert np.array_equal(np.bincount(of[:, 0], minlength=3), sampler.source_rows(step))
        assert np.array_equal(sampler.source_rows(step), mixture_rows(sampler.weights, 16, step, 5))
        # a resumed run (a new sampler) and two processes each reading half of the rows
        again = BatchSampler(sources(), **kw)
        assert np.array_equal(again.global_batch(step), batch)
        halves = [again.rows(step, np.arange(8) + 8 * p) for p in range(2)]
        assert np.array_equal(np.concatenate(halves), batch)
        # two DiLoCo islands, 10 and 6 rows: each its window of the same batch
        islands = [BatchSampler(sources(), **kw, window=win) for win in ((0, 10), (10, 6))]
        assert np.array_equal(np.concatenate([s.global_batch(step) for s in islands]), batch)
    assert len({sampler.global_batch(s)[:, 0].tobytes() for s in range(5)}) == 5  # rows move


@pytest.mark.parametrize("window", [None, (3, 7)], ids=["batch", "island"])
def test_the_rows_before_a_step_sum_every_step_s(window):
    """A resume's source counts: closed form for the batch (in chunks), a loop for an
    island's window; both equal the per-step counts summed, and one draw gives the rows
    and the counts."""
    kw = dict(seq_len=15, global_batch_size=16, seed=5, weights=[0.45, 0.3, 0.2, 0.05])
    sampler = BatchSampler(sources(4), **kw, window=window)
    each = np.array([sampler.source_rows(s) for s in range(1000)])
    for step in (0, 1, 17, 1000):
        assert np.array_equal(sampler.source_rows_before(step), each[:step].sum(axis=0)), step
    rows, counts = sampler.rows_and_sources(9, np.arange(4))
    assert np.array_equal(rows, sampler.rows(9, np.arange(4)))
    assert np.array_equal(counts, sampler.source_rows(9))


def test_mixture_rows_sums_steps_in_chunks(monkeypatch):
    from holmes_jax.runtime.data import loader

    w = np.array([0.45, 0.3, 0.2, 0.05])
    each = sum(mixture_rows(w, 13, s, seed=3) for s in range(40, 140))
    monkeypatch.setattr(loader, "_STEPS_AT_ONCE", 7)  # 100 steps in 15 chunks
    assert np.array_equal(mixture_rows(w, 13, 40, seed=3, steps=100), each)


def test_an_island_s_window_holds_every_source():
    sampler = BatchSampler(sources(), 15, 16, seed=5, window=(0, 8), weights=[0.5, 0.3, 0.2])
    seen = sum(sampler.source_rows(step) for step in range(200))
    assert (seen > 0).all() and abs(seen[0] / seen.sum() - 0.5) < 0.05  # shuffled rows


def test_the_feed_reads_ahead_and_counts_waits_and_sources():
    asked, ready = [], threading.Event()

    def read(step):
        asked.append(step)
        if step == 3:
            ready.set()
        return np.full(2, step), np.array([step, 1])  # rows; rows of two sources

    before = lambda step: sum(read(s)[1] for s in range(step))  # noqa: E731
    feed = Feed(read, depth=3, last=6, before=before)
    assert feed.get(0).tolist() == [0, 0]
    assert ready.wait(HANG_S)  # steps 1..3 are read in the background
    assert feed.get(1).tolist() == [1, 1] and sorted(feed.ahead) == [2, 3, 4]  # 4 now asked
    for step in (2, 3, 4, 5):
        feed.get(step)
    assert sorted(asked) == [0, 1, 2, 3, 4, 5]  # never past ``last``
    assert feed.rows.tolist() == [15, 6] and feed.take_wait() > 0 and feed.take_wait() == 0
    resumed = Feed(read, depth=0, last=6, before=before)
    resumed.get(4)  # steps 0..3 count too
    resumed.get(4)  # got again (compiled with, then trained on): counted once
    assert resumed.rows.tolist() == [10, 5]
    feed.close()


def mixture_flags(root, weights: dict, evals=()) -> list[str]:
    """The --set flags of a mixture of ``root/<name>.bin`` by weight, and eval sets."""
    mix = ", ".join(f"{{name: {n}, path: {root}/{n}.bin, weight: {w}}}" for n, w in weights.items())
    flags = ["data.source=tokens", f"data.mixture=[{mix}]"]
    if evals:
        sets = ", ".join(f"{{name: {n}, path: {root}/{n}.bin}}" for n in evals)
        flags.append(f"data.eval=[{sets}]")
    return flags


def write_sets(root, ids: dict) -> None:
    for name, values in ids.items():
        write_shard(fsspec.filesystem("file"), str(root / f"{name}.bin"), values.astype(np.uint16))


def test_a_mixture_and_eval_sets_load_from_the_config(tmp_path):
    write_sets(
        tmp_path,
        {n: base + np.arange(2000) % 300 for n, base in (("web", 0), ("code", 300), ("wiki", 600))},
    )
    flags = mixture_flags(tmp_path, {"web": 3, "code": 1}, evals=["wiki"])
    corpus = load_corpus(load_config(None, flags).data, 1000)
    assert corpus.names == ("web", "code") and corpus.weights == (0.75, 0.25)
    assert list(corpus.evals) == ["web", "code", "wiki"] and corpus.eval is None
    assert corpus.evals["wiki"].tokens == 2000 and corpus.evals["web"].tokens == 100
    assert "web 75%" in corpus.description
    with pytest.raises(ConfigError, match="data.path=.*unset it with data.mixture"):
        load_config(None, [*flags, f"data.path={tmp_path}/web.bin"])
    with pytest.raises(ConfigError, match="data.mixture: needs data.source=tokens"):
        load_config(None, [*flags[1:], "data.source=stdlib"])


def test_a_run_on_a_mixture_resumes_on_the_same_batches_and_counts(tmp_path):
    """A mixture of shard sets, 4 steps, uninterrupted; then stopped after step 2 (a
    checkpoint) and resumed in a new run: every step's batch digest (its tokens, token for
    token) and source counts equal the uninterrupted run's, and the eval sets log by name."""
    from holmes_jax.runtime.loop import run

    rng = np.random.default_rng(0)
    write_sets(tmp_path, {n: rng.integers(0, 256, 20_000) for n in ("web", "code", "wiki")})
    flags = mixture_flags(tmp_path, {"web": 0.75, "code": 0.25}, evals=["wiki"])
    run_flags = ["train.steps=4", "train.eval_every=4", "train.eval_batches=1"]
    quiet = ["logging.progress=none", "logging.log_every=1", "model.vocab_size=256"]
    base = [*TINY_RUN, *flags, *run_flags, *quiet, "data.prefetch=3"]
    straight = run(load_config(None, [*base, "train.run_dir=null"]))
    stopped = load_config(None, [*base, f"train.run_dir={tmp_path / 'run'}", "data.prefetch=0"])
    history = run(stopped, stop_at_step=2) + run(stopped)
    keys = ("step", "data_digest", "tokens_web", "tokens_code")
    assert [[r[k] for k in keys] for r in history] == [[r[k] for k in keys] for r in straight]
    assert len({r["data_digest"] for r in straight}) == 4
    last = straight[-1]
    assert last["tokens_web"] + last["tokens_code"] == 4 * 8 * 32  # 4 steps of 8 rows of 32
    assert last["tokens_web"] == 3 * last["tokens_code"]
    assert all(r["data_wait_s"] >= 0 for r in history)
    losses = [last[f"eval/{n}/loss"] for n in ("web", "code", "wiki")]
    assert all(np.isfinite(losses))
    assert last["eval_loss"] == pytest.approx(0.75 * losses[0] + 0.25 * losses[1])
