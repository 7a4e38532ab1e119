"""Benchmark: the token loader against the step, opening shard sets, and prepare's scaling.

    .venv/bin/python scripts/bench_data.py [--shards 100] [--steps 100] [--prepare-mb 32]

One JSON line per part:

- ``loader``: this process's rows of a step read from ``--shards`` local shards (uint16,
  synthetic ids) for the quickstart shape (every row: one process) and the ``gpt-1.3b``
  shape (one host's rows: 64 of 512 rows of 2048), tokens/s per process, against the
  tokens/s the step consumes: the quickstart's measured step (the ``run`` part), the
  gpt-1.3b step the planner predicts on its topology (``plan``).
- ``run``: the quickstart model trained ``--steps`` steps from ``--shards`` shards of byte
  tokens (``data.prefetch`` 2): the median step, the mean seconds a step waited for its
  rows (``data_wait_s``) and their ratio (target < 1%).
- ``open``: seconds to list and check 10 and 1,000 shards by their sidecars (and by one
  index), and the host memory (RSS) of a process that opened them and read 20 batches,
  in a fresh process each (target: < 2 s for 1,000; memory within 10%).
- ``prepare``: ``python -m holmes_jax.data prepare`` on ``--prepare-mb`` MB of JSONL with a
  byte-level BPE trained here, with 1 worker and with one per core, interleaved, the
  median of ``--prepare-repeats``: tokens/s and the speed-up (target >= 1.7x on 2 cores);
  beside it the machine's ceiling, one 1-worker prepare per core at once, each on its
  share of the corpus (no coordination at all). ``--parts`` picks parts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from holmes_jax.runtime.data.loader import BatchSampler  # noqa: E402
from holmes_jax.runtime.data.shards import ShardSet, check_shards, list_shards  # noqa: E402

SHAPES = {"quickstart": (128, 32, 32, 256), "gpt-1.3b": (2048, 512, 64, 50304)}  # seq, B, rows, V


def write_set(root: str, shards: int, tokens: int, vocab: int, seed: int = 0) -> None:
    """``shards`` shards of ``tokens`` random ids below ``vocab``, with sidecars and an index."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(shards):
        ids = rng.integers(0, vocab, tokens, dtype=np.uint16)
        name = f"shard-{i:05d}.bin"
        ids.tofile(os.path.join(root, name))
        meta = {"tokens": tokens, "documents": 1, "max_id": int(ids.max())}
        with open(os.path.join(root, name + ".json"), "w") as f:
            json.dump({"dtype": "uint16", **meta}, f)
        entries.append({"path": name, **meta})
    with open(os.path.join(root, "index.json"), "w") as f:
        json.dump({"dtype": "uint16", "shards": entries}, f)


def loader_rate(root: str, shape: str, steps: int = 20) -> float:
    """Tokens/s of one process reading its rows of ``steps`` steps."""
    seq, batch, rows, vocab = SHAPES[shape]
    found = check_shards(list_shards(root, "uint16"), vocab)
    sampler = BatchSampler(ShardSet.of_shards(found, vocab, "bench"), seq, batch, seed=0)
    mine = np.arange(rows)
    sampler.rows(0, mine)  # first touch
    began = time.perf_counter()
    for step in range(1, steps + 1):
        sampler.rows(step, mine)
    return steps * rows * (seq + 1) / (time.perf_counter() - began)


def predicted_step(config: str) -> float:
    """The planner's predicted step of ``config`` (``python -m holmes_jax.plan``)."""
    out = subprocess.run(
        [sys.executable, "-m", "holmes_jax.plan", "--config", config],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return float(re.search(r"predicted step ([0-9.]+) s", out).group(1))


def quickstart_run(root: str, steps: int) -> dict:
    """The quickstart model trained ``steps`` steps from the shards in ``root``."""
    flags = [
        "data.source=tokens", f"data.path={root}", f"train.steps={steps}",
        "train.run_dir=null", "logging.progress=none", "logging.log_every=10",
        "train.eval_every=0",
    ]  # fmt: skip
    code = (
        "import json, sys; from holmes_jax.train import run; from holmes_jax.core.config import "
        "load_config; h = run(load_config('configs/quickstart.yaml', sys.argv[1:])); "
        "print('RECORDS', json.dumps(h))"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", code, *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    records = json.loads(out.split("RECORDS ", 1)[1])[1:]  # the first holds the compile
    step = float(np.median([r["step_time_s"] for r in records]))
    wait = float(np.mean([r["data_wait_s"] for r in records]))
    return {"steps": steps, "step_s": round(step, 4), "data_wait_s": round(wait, 6),
            "wait_share": round(wait / step, 5)}  # fmt: skip


OPEN = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from holmes_jax.runtime.data.loader import BatchSampler
from holmes_jax.runtime.data.shards import ShardSet, check_shards, list_shards
began = time.perf_counter()
found = check_shards(list_shards(sys.argv[1], "uint16"), 256)
opened = time.perf_counter() - began
sampler = BatchSampler(ShardSet.of_shards(found, 256, "bench"), 128, 32, seed=0)
for step in range(20):
    sampler.global_batch(step)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"open_s": opened, "rss_mb": rss}}))
"""


def open_cost(path: str) -> dict:
    code = OPEN.format(root=ROOT)
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return json.loads(out)


def prepare_rate(work: str, mb: int, repeats: int) -> dict:
    """prepare's tokens/s with 1 worker, with one per core, and the ceiling: one 1-worker
    prepare per core at once, each on its part of the corpus (median of ``repeats``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(1)
    words = [
        "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 9))) for _ in range(5000)
    ]
    lines, size = [], 0
    while size < mb * 1e6:
        text = " ".join(rng.choice(words, 200)) + "\n"
        lines.append(json.dumps({"text": text}) + "\n")
        size += len(text)
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w") as f:
        f.writelines(lines)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines[:200], trainers.BpeTrainer(vocab_size=4000, show_progress=False))
    tok.save(os.path.join(work, "tokenizer.json"))
    halves = []  # the corpus cut in one part per core, for the ceiling
    cores = len(os.sched_getaffinity(0))
    for i in range(cores):
        halves.append(os.path.join(work, f"part{i}.jsonl"))
        with open(halves[-1], "w") as f:
            f.writelines(lines[i * len(lines) // cores : (i + 1) * len(lines) // cores])
    out = {"mb": mb, "cores": cores, "repeats": repeats}
    runs = {"1": [], str(cores): [], "ceiling": []}
    for r in range(repeats):  # interleaved, so a burst of load hits every variant alike
        for workers in (1, cores):
            began = time.perf_counter()
            tokens = _prepare(work, [corpus], f"out{workers}-{r}", workers)
            runs[str(workers)].append(tokens / (time.perf_counter() - began))
        began = time.perf_counter()
        procs = [_prepare(work, [h], f"ceil{i}-{r}", 1, wait=False) for i, h in enumerate(halves)]
        if any(p.wait() for p in procs):
            raise SystemExit("bench_data: a ceiling prepare failed")
        runs["ceiling"].append(tokens / (time.perf_counter() - began))
    rate = {k: float(np.median(v)) for k, v in runs.items()}
    out.update({f"tokens_per_s_{k}": round(v) for k, v in rate.items()})
    out["spread"] = {
        k: [round(min(v) / rate[k], 2), round(max(v) / rate[k], 2)] for k, v in runs.items()
    }
    out["speedup"] = round(rate[str(cores)] / rate["1"], 2)
    out["ceiling_speedup"] = round(rate["ceiling"] / rate["1"], 2)
    return out


def _prepare(work: str, inputs: list[str], out: str, workers: int, wait: bool = True):
    """prepare's token count (``wait``), else its running process."""
    argv = [sys.executable, "-m", "holmes_jax.data", "prepare", "--tokenizer", work, "--quiet"]
    argv += ["--input", *inputs, "--out", os.path.join(work, out), "--workers", str(workers)]
    if not wait:
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL)
    said = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return int(re.search(r"wrote ([0-9,]+) tokens", said).group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prepare-mb", type=int, default=32)
    ap.add_argument("--prepare-repeats", type=int, default=3)
    ap.add_argument("--parts", default="run,loader,open,prepare", help="comma-separated")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        if parts & {"run", "loader"}:
            run_and_loader(work, args, load, "loader" in parts)
        if "open" in parts:
            for n in (10, 1000):
                print(json.dumps({"part": "open", "shards": n, **open_parts(work, n)}), flush=True)
        if "prepare" in parts:
            rate = prepare_rate(work, args.prepare_mb, args.prepare_repeats)
            print(json.dumps({"part": "prepare", **rate, "load": load}))


def run_and_loader(work: str, args, load: float, loader: bool) -> None:
    """The ``run`` part, then (``loader``) the ``loader`` part against its step."""
    byte_set = os.path.join(work, "bytes")
    write_set(byte_set, args.shards, 200_000, 256)
    run = quickstart_run(byte_set, args.steps)
    print(json.dumps({"part": "run", **run, "load": load}), flush=True)
    if not loader:
        return
    big_set = os.path.join(work, "big")
    write_set(big_set, args.shards, 1_000_000, 50304)
    seq, batch = SHAPES["quickstart"][:2]
    consumed = {
        "quickstart": batch * seq / run["step_s"],
        "gpt-1.3b": SHAPES["gpt-1.3b"][2] * 2048 / predicted_step("configs/gpt-1.3b.yaml"),
    }
    for shape, root in (("quickstart", byte_set), ("gpt-1.3b", big_set)):
        rate, need = loader_rate(root, shape), consumed[shape]
        row = {"part": "loader", "shape": shape, "shards": args.shards}
        row.update(tokens_per_s=round(rate), step_tokens_per_s=round(need))
        print(json.dumps({**row, "ahead": round(rate / need, 1)}), flush=True)


def open_parts(work: str, n: int) -> dict:
    """Opening ``n`` shards by their sidecars and by their index, and the memory after."""
    root = os.path.join(work, f"open{n}")
    write_set(root, n, 4096, 256)
    os.rename(os.path.join(root, "index.json"), os.path.join(root, "index.off"))
    by_sidecars = open_cost(root)
    os.rename(os.path.join(root, "index.off"), os.path.join(root, "index.json"))
    by_index = open_cost(root)
    row = {"sidecars_s": round(by_sidecars["open_s"], 3), "index_s": round(by_index["open_s"], 3)}
    return {**row, "rss_mb": round(by_sidecars["rss_mb"], 1)}


if __name__ == "__main__":
    main()
