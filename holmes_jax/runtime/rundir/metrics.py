"""Per-step metrics: terminal progress, JSON lines, TensorBoard and Weights & Biases.

For every logged step the record holds at least ``step``, ``loss``, ``step_time_s``,
``tokens_per_s``, ``tflops_per_device`` (model FLOPs: 6N + attention, no recompute),
``hw_tflops_per_device`` (what runs, recompute included), ``mfu`` (against
``logging.peak_tflops``, else the device kind's datasheet peak; left out for a kind
without one), ``peak_memory_gb`` (the most memory one of process 0's devices has held
since the run started, where the runtime reports it: GPUs and TPUs, not XLA:CPU) and
``eval_loss`` on steps that were evaluated. The first record of a run also holds
``compile_s``, the seconds the train step took to compile, which its ``step_time_s``
leaves out. Only the main process (``jax.process_index() == 0``) writes anything.

TensorBoard and Weights & Biases (``logging.wandb``: a project name) take the same scalars
under :func:`tag`: ``eval/loss`` for ``eval_loss``, ``train/<key>`` for the rest. wandb is
imported only when asked for (a missing package is a one-line ConfigError); it reads
``WANDB_MODE`` itself, so ``WANDB_MODE=offline`` writes under ``<run_dir>/wandb/``.

Terminal output: a tqdm bar with loss and tokens/s when stderr is a terminal (or
``logging.progress: bar``), plain log lines otherwise (``plain``), nothing for ``none``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from holmes_jax.core import status
from holmes_jax.core.config import Config
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.spec import FlopsPerToken
from holmes_jax.runtime.data.digest import DIGEST

EVAL_PREFIX = "eval_"  # record keys of evaluation (eval_loss): tagged eval/...


def tag(key: str) -> str:
    """The TensorBoard / wandb name of a record key: ``eval_loss`` -> ``eval/loss``,
    ``loss`` -> ``train/loss``."""
    if key.startswith(EVAL_PREFIX):
        return "eval/" + key[len(EVAL_PREFIX) :]
    if key.startswith("eval/"):  # eval/<name>/loss: an evaluation set of its own
        return key
    return f"train/{key}"


def import_wandb(project: str):
    """The ``wandb`` module, imported now (it is optional and slow to import).

    Raises:
      ConfigError: the package is not installed.
    """
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            f"logging.wandb={project}: needs the wandb package (pip install wandb)"
        ) from None
    return wandb


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    tflops_per_device: float
    hw_tflops_per_device: float
    mfu: float | None


def throughput(
    step_time_s: float,
    tokens_per_step: int,
    flops: FlopsPerToken,
    num_devices: int,
    peak_tflops: float | None,
) -> Throughput:
    """Tokens/s, achieved TFLOPS per device (model and hardware) and MFU for one step time."""
    tokens_per_s = tokens_per_step / step_time_s
    model_tflops = tokens_per_s * flops.model / num_devices / 1e12
    hw_tflops = tokens_per_s * flops.hardware / num_devices / 1e12
    mfu = model_tflops / peak_tflops if peak_tflops else None
    return Throughput(tokens_per_s, model_tflops, hw_tflops, mfu)


def _summary_writer():
    """tensorboardX's ``SummaryWriter``, imported without torch: tensorboardX imports torch
    when it is installed (1.2 of its 1.4 s on an idle core, paid at every start and
    restart) only to accept torch tensors, and we log Python floats."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX skips it
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsLogger:
    """Writes step records to the terminal, a JSON-lines file and TensorBoard.

    Three phases: messages work from construction; :meth:`open` opens the files (before
    the first record); :meth:`start_progress` starts the progress bar once the train step
    has compiled, so that the bar's rate and ETA count training steps only.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        flops: FlopsPerToken,
        num_devices: int,
        peak_tflops: float | None = None,
        is_main: bool = True,
    ):
        self.cfg = cfg
        self.peak_tflops = peak_tflops  # per device, for MFU; None: no MFU
        self.flops = flops
        self.num_devices = num_devices
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        self.is_main = is_main
        self._jsonl = None
        self._tb = None
        self._wandb_run = None
        self._bar = None
        # Every process checks, so a missing package stops the job the same way everywhere.
        self._wandb = import_wandb(cfg.logging.wandb) if cfg.logging.wandb else None
        mode = cfg.logging.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "plain"
        self.mode = mode

    def open(self, start_step: int, append: bool = False) -> None:
        """Open the metrics file (appended to when ``start_step`` > 0, a resumed run, or
        ``append``, a restart; else created or truncated), the TensorBoard writer and the
        wandb run (a new one each time a run starts or resumes). ``cfg``'s outputs are
        resolved paths (:func:`holmes_jax.runtime.rundir.paths.resolve_outputs`)."""
        if not self.is_main:
            return
        path = self.cfg.train.metrics_path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._jsonl = open(path, "a" if start_step > 0 or append else "w")  # noqa: SIM115
        if self.cfg.logging.tensorboard_dir:
            self._tb = _summary_writer()(self.cfg.logging.tensorboard_dir)
        if self._wandb is not None:
            run_dir = self.cfg.train.run_dir
            if run_dir:
                os.makedirs(run_dir, exist_ok=True)
            self._wandb_run = self._wandb.init(
                project=self.cfg.logging.wandb,
                name=os.path.basename(os.path.normpath(run_dir)) if run_dir else None,
                dir=run_dir,
                config=self.cfg.to_dict(),
            )

    def start_progress(self, step: int) -> None:
        """Start the progress bar at ``step`` (bar mode): its clock starts now."""
        if self.is_main and self.mode == "bar" and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.cfg.train.steps, initial=step, unit="step", dynamic_ncols=True
            )

    def record(self, step: int, values: dict[str, float], step_time_s: float) -> dict[str, Any]:
        """Build the record for ``step`` (1-based: steps completed) from fetched values."""
        tp = throughput(
            step_time_s,
            self.tokens_per_step,
            self.flops,
            self.num_devices,
            self.peak_tflops,
        )
        rec: dict[str, Any] = {"step": step}
        rec.update({k: v if isinstance(v, int) else float(v) for k, v in values.items()})
        rec.update(
            step_time_s=step_time_s,
            tokens_per_s=tp.tokens_per_s,
            tflops_per_device=tp.tflops_per_device,
            hw_tflops_per_device=tp.hw_tflops_per_device,
        )
        if tp.mfu is not None:
            rec["mfu"] = tp.mfu
        return rec

    def write(self, rec: dict[str, Any], advance: int = 0) -> None:
        """Emit one record (a step record, possibly with ``eval_loss``)."""
        if not self.is_main:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        scalars = {
            tag(key): value
            for key, value in rec.items()
            if key not in ("step", DIGEST) and isinstance(value, int | float)
        }
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, rec["step"])
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=rec["step"])
        if self._bar is not None:
            self._bar.update(advance)
            post = {"loss": f"{rec['loss']:.4f}"} if "loss" in rec else {}
            if "tokens_per_s" in rec:
                post["tok/s"] = f"{rec['tokens_per_s']:,.0f}"
            if "eval_loss" in rec:
                post["eval"] = f"{rec['eval_loss']:.4f}"
            self._bar.set_postfix(post)
        elif self.mode == "plain":
            print(format_record(rec), flush=True)
        self.report("step", step=rec["step"])

    def report(self, event: str, **fields) -> None:
        """One event on the launcher's status channel (:mod:`holmes_jax.core.status`)."""
        if self.is_main:
            status.report(event, **fields)

    def message(self, text: str) -> None:
        """A line for the user that does not break the progress bar."""
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(text)
        elif self.mode != "none":
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def format_record(rec: dict[str, Any]) -> str:
    """One human line: ``step 100 | loss 2.3140 | eval 2.4011 | 1.2 s | 5,432 tok/s | ...``."""
    parts = [f"step {rec['step']}"]
    if "loss" in rec:
        parts.append(f"loss {rec['loss']:.4f}")
    if "eval_loss" in rec:
        parts.append(f"eval {rec['eval_loss']:.4f}")
    if "step_time_s" in rec:
        parts.append(f"{rec['step_time_s'] * 1e3:.0f} ms/step")
        parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
        tflops = rec["tflops_per_device"]  # GFLOP/s below 1 TFLOP/s (CPUs), else TFLOP/s
        parts.append(
            f"{tflops:.1f} TFLOP/s/dev" if tflops >= 1 else f"{tflops * 1e3:.2f} GFLOP/s/dev"
        )
    if "mfu" in rec:
        parts.append(f"MFU {rec['mfu'] * 100:.1f}%")
    if "peak_memory_gb" in rec:
        parts.append(f"peak {rec['peak_memory_gb']:.2f} GB")
    return " | ".join(parts)
