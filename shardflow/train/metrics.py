"""The metrics of ``shardflow train``: what each step measures (:class:`Meter`), and rank 0's outputs — one JSON
object per step in ``RUN_DIR/metrics.jsonl`` (``--metrics``) and, with ``--tensorboard``, the same numbers as
TensorBoard scalars in ``RUN_DIR/tensorboard`` (:class:`MetricsWriter`).

The keys of a record (and TensorBoard's tags, one per key; ``mem_mib_ranks`` is one tag per process,
``mem_mib_ranks/<rank>``):

=========================== =========== ===========================================================================
key                         unit        what
=========================== =========== ===========================================================================
``step``                    steps       optimizer steps done (the first step is 1); TensorBoard's global step
``loss``                    nats/token  training loss of the step's batch
``val_loss``                nats/token  validation loss; only at every ``--eval-every`` steps and the last
``step_s``                  s           wall time of the step: building the batch and the training step
                                        (validation and checkpoints excluded)
``data_s``                  s           of ``step_s``, the time spent building the batch (waiting for data)
``tokens_per_s``            tokens/s    tokens of the step (the global batch, ``--batch-size`` × ``--seq-len``) /
                                        ``step_s``
``tokens_per_s_per_device`` tokens/s    ``tokens_per_s`` / devices of the mesh
``tflops_per_device``       TFLOP/s     achieved model FLOP/s per device: model FLOPs of the step
                                        (:func:`~shardflow.graph.flops.training_flops`) / ``step_s`` / devices
``mfu_pct``                 %           model FLOPs utilisation: ``tflops_per_device`` / the peak TFLOP/s of one
                                        device (``--peak-tflops``, or measured: :class:`Peak`) × 100
``grad_norm``               —           global L2 norm of all gradients before clipping (``clip_grad_norm_``'s)
``lr``                      —           the learning rate the step's update used (``--lr`` × the ``--warmup-steps``
                                        / ``--lr-schedule`` factor of the step; the optimizer's units)
``mem_mib``                 MiB         at the steps the console prints: the largest peak memory of any process
``mem_mib_ranks``           MiB         at those steps: each process's peak memory, in rank order (one value
                                        when every rank runs in one process)
``expert_tokens_min``       tokens      at those steps, for a mixture of experts: the fewest tokens routed to one
                                        expert of one expert layer in the step's last micro-step
``expert_tokens_mean``      tokens      the same, on average over every expert of every layer (N·K/E)
``expert_tokens_max``       tokens      the same, the most
=========================== =========== ===========================================================================

Peak memory is the process's peak resident set size (``resource.getrusage``) on the CPU, where the executors
keep every buffer; ``torch.cuda.max_memory_allocated`` on a CUDA device (:func:`peak_memory_mib`).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from shardflow.graph.ops import dtype_name
from shardflow.runtime.executor import Executor

TENSORBOARD_DIR = "tensorboard"  # under the run directory


def open_metrics(path: Path, start: int) -> tuple[IO[str], int | None]:
    """The metrics file: new, or on resume the records up to ``start`` kept (a run that went on past its last
    checkpoint wrote records that the resumed run writes again) and appended to; and the step of the last record
    kept (None for a new file)."""
    if start == 0 or not path.exists():
        return open(path, "w"), None
    keep, last = [], 0
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
            if step <= start:
                keep.append(line + "\n")
                last = max(last, step)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when the run was stopped
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
    return open(path, "a"), last


# --- the denominators: peak FLOP/s and memory of one device -----------------------------------------------------

PEAK_MATMUL = 8192  # the largest side of the matmul timed to measure a device's peak (a GPU's needs it)
SMALLEST_MATMUL = 256  # the side it starts from
PEAK_REPEATS = 3  # timed repeats after one warm-up; the best counts
SLOW_MATMUL_S = 0.05  # a matmul that takes this long is large enough: the side stops growing


def measure_peak_tflops(
    device: torch.device, dtype: torch.dtype = torch.float32, slow_s: float = SLOW_MATMUL_S
) -> tuple[float, int]:
    """The FLOP/s of an n² matmul in ``dtype`` (the run's compute dtype: a GPU's bfloat16 peak is many times its
    float32 one) on ``device`` (TFLOP/s; 2 FLOPs per multiply-add), best of ``PEAK_REPEATS`` after a warm-up — what
    this device reaches on the kind of work model FLOPs count, with the threads this process has — and n. The side
    doubles from ``SMALLEST_MATMUL`` up to ``PEAK_MATMUL`` while one matmul takes less than ``slow_s`` seconds, so
    a dtype the device computes slowly (bfloat16 on a CPU without native bfloat16: minutes for a 2048² matmul) is
    measured in about a second too."""
    n = SMALLEST_MATMUL
    while True:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, generator=gen).to(dtype)
        b = torch.randn(n, n, device=device, generator=gen).to(dtype)
        best = math.inf
        for k in range(PEAK_REPEATS + 1):
            t0 = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if k:  # the first is the warm-up
                best = min(best, time.perf_counter() - t0)
        if n >= PEAK_MATMUL or best >= slow_s:
            return 2 * n**3 / best / 1e12, n
        n *= 2


@dataclass(frozen=True, slots=True)
class Peak:
    """The peak FLOP/s of one device, MFU's denominator: ``tflops`` (TFLOP/s) and where it came from
    (``source``, for the banner)."""

    tflops: float
    source: str

    @classmethod
    def of(cls, given_tflops: float, device: torch.device, dtype: torch.dtype = torch.float32) -> Peak:
        """``--peak-tflops`` when it is > 0, else measured on ``device`` in the run's compute ``dtype``
        (:func:`measure_peak_tflops`)."""
        if given_tflops > 0:
            return cls(given_tflops, "--peak-tflops")
        tflops, n = measure_peak_tflops(device, dtype)
        return cls(
            tflops, f"measured at start-up: best of {PEAK_REPEATS} {dtype_name(dtype)} {n}×{n} matmuls on {device}"
        )


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory so far (MiB): on the CPU its peak resident set size (``ru_maxrss``: KiB on
    Linux, bytes on macOS), on a CUDA device ``torch.cuda.max_memory_allocated``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def memory_source(device: torch.device) -> str:
    """What :func:`peak_memory_mib` reads on ``device``, for the banner."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated"
    return "peak RSS of each process (resource.getrusage)"


# --- one step's record ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Meter:
    """How the records of a run are computed. ``tokens``: tokens of one step (the global batch); ``devices``:
    devices of the mesh; ``flops``: model FLOPs of one training step (the whole batch); ``peak``: one device's peak
    (None on the ranks that write no metrics: nothing is measured there); ``device``: where the executors keep
    their buffers (whose memory counts)."""

    tokens: int
    devices: int
    flops: int
    peak: Peak | None
    device: torch.device

    def record(
        self, step: int, loss: float, step_s: float, data_s: float, grad_norm: float | None, lr: float
    ) -> dict[str, Any]:
        """The record of step ``step`` (counted from 1): ``loss`` (nats/token), the step's wall time ``step_s``
        and the part of it spent building the batch ``data_s`` (seconds), the gradient norm (None: not
        measured), the learning rate of its update ``lr``; the rates per device and the MFU follow (see the
        module docstring)."""
        tflops = self.flops / step_s / self.devices / 1e12
        rec: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "step_s": step_s,
            "data_s": data_s,
            "tokens_per_s": self.tokens / step_s,
            "tokens_per_s_per_device": self.tokens / step_s / self.devices,
            "tflops_per_device": tflops,
        }
        if self.peak is not None:
            rec["mfu_pct"] = 100 * tflops / self.peak.tflops
        if grad_norm is not None:
            rec["grad_norm"] = grad_norm
        rec["lr"] = lr
        return rec

    def expert_load(self, ex: Executor) -> dict[str, Any]:
        """``expert_tokens_min``, ``_mean`` and ``_max``: the tokens routed to one expert in the last micro-step of
        executor ``ex``'s step, over every expert of every expert layer (the router's balance: equal when each
        expert gets N·K/E); {} for a model without expert layers (collective on the distributed executor: every
        rank calls it)."""
        loads = list(ex.expert_loads().values())
        if not loads:
            return {}
        counts = torch.cat([c.double().flatten() for c in loads])
        return {
            "expert_tokens_min": int(counts.min()),
            "expert_tokens_mean": float(counts.mean()),
            "expert_tokens_max": int(counts.max()),
        }

    def memory(self, ex: Executor) -> dict[str, Any]:
        """``mem_mib`` and ``mem_mib_ranks``: every process's peak memory (MiB), gathered by executor ``ex``
        (collective on the distributed executor: every rank calls it)."""
        per = ex.per_process(peak_memory_mib(self.device))
        return {"mem_mib": max(per), "mem_mib_ranks": per}


class MetricsWriter:
    """Rank 0's metrics outputs: the JSON-lines file at ``path`` (:func:`open_metrics`: on resume from step
    ``start`` the records after it are dropped) and, with ``tensorboard`` (a directory), TensorBoard event files
    written by ``torch.utils.tensorboard.SummaryWriter``, whose ``purge_step`` makes TensorBoard drop what an
    earlier run wrote from step ``start + 1`` on (the steps this run writes again)."""

    def __init__(self, path: Path, start: int, tensorboard: Path | None = None):
        self.file, last = open_metrics(path, start)
        # the steps a resumed run's file has no records of: it was cut short (a full disk, an editor) before the
        # checkpoint it resumes from
        self.missing = (last + 1, start) if last is not None and last < start else None
        self.path = path
        self.board = None
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (checked up front)

            self.board = SummaryWriter(str(tensorboard), purge_step=start + 1, flush_secs=10)

    def gap(self) -> str | None:
        """The console's line about :attr:`missing`, or None."""
        if self.missing is None:
            return None
        first, last = self.missing
        steps = f"step {first}" if first == last else f"steps {first} to {last}"
        return (
            f"{self.path} holds no records of {steps}: it was cut short before the checkpoint this run resumes from "
            f"(a full disk, or an edit); the records go on from step {last + 1}, and those steps' losses are lost"
        )

    def write(self, record: dict[str, Any]) -> None:
        """One step's record: a line of the file (flushed), a scalar per key in TensorBoard."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is None:
            return
        step = record["step"]
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, list):
                for rank, v in enumerate(value):
                    self.board.add_scalar(f"{key}/{rank}", v, step)
            else:
                self.board.add_scalar(key, value, step)

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()
