"""Timing helpers of the benchmarks: interleaved timing across ranks (``benchmarks/run.py``) or in one process
(``benchmarks/step.py``), and JSON results.

Timing rules (the machine is shared and noisy):

* every variant is warmed up first, then the variants are run in **rounds**, each round running every variant
  once (``iters`` steps back to back, one sample = their mean), the order rotating by one each round
  (A B C, B C A, C A B, ...), so slow drifts of the machine load hit every variant alike;
* all ranks start each sample together (a barrier) and a sample is the **largest** of the ranks' times (a
  step is done when its slowest rank is done);
* a ``solo`` variant (the one-process baseline) runs on rank 0 alone with its own number of intra-op threads
  (``SOLO_THREADS`` = 2 unless given) while the other ranks wait in a barrier (a gloo barrier blocks in the
  kernel: it takes no CPU time), so it is interleaved with the distributed variants in the same session.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

SOLO_THREADS = 2


@dataclass
class Variant:
    """One thing to time: ``step()`` runs one step (it must leave no communication pending). ``solo``: rank 0
    alone, with ``threads`` intra-op threads."""

    name: str
    step: Callable[[], object]
    solo: bool = False
    threads: int = SOLO_THREADS


def _barrier() -> None:
    """Every rank together; nothing in a single process (no process group)."""
    if dist.is_initialized():
        dist.barrier()


def _sample(v: Variant, iters: int, rank: int) -> float:
    """Seconds per step of ``iters`` steps of ``v`` on this rank (NaN on a rank that sits out a solo variant)."""
    _barrier()
    if v.solo and rank != 0:
        _barrier()
        return math.nan
    if v.solo:
        torch.set_num_threads(v.threads)
    t0 = time.perf_counter()
    for _ in range(iters):
        v.step()
    dt = (time.perf_counter() - t0) / iters
    if v.solo:
        torch.set_num_threads(1)
        time.sleep(0.01)  # let the second OpenMP thread stop spinning before the others start
        _barrier()
    return dt


def interleave(
    variants: Sequence[Variant],
    rounds: int,
    iters: int,
    warmup: int,
    rank: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Per variant, ``rounds`` samples (seconds per step; each the largest over the ranks; rank 0's for a solo
    variant). Every rank must call this with the same variants in the same order; in a single process (no process
    group) it times that process alone."""
    for v in variants:
        if warmup:
            _sample(v, warmup, rank)
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        k = r % len(variants)
        for v in list(variants[k:]) + list(variants[:k]):
            samples[v.name].append(_sample(v, iters, rank))
        if log:
            log(
                f"  round {r + 1}/{rounds}: "
                + ", ".join(f"{n} {s[-1] * 1e3:.1f}" for n, s in samples.items() if not math.isnan(s[-1]))
                + " ms"
            )
    names = [v.name for v in variants]
    t = torch.tensor([[0.0 if math.isnan(x) else x for x in samples[n]] for n in names], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: t[i].tolist() for i, n in enumerate(names)}


def verdict(ok: bool) -> str:
    """A target's verdict, as the sections write it."""
    return "**met**" if ok else "**missed**"


def stats(xs: Sequence[float]) -> dict[str, float]:
    """median, min, max and count of the samples."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def machine() -> dict[str, object]:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "arch": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load": os.getloadavg()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "(unset)"),
    }


def write_result(out_dir: Path, rank: int, result: dict) -> None:
    """Rank 0 writes ``result.json`` (the driver reads it); every rank may add notes to its log."""
    if rank == 0:
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def write_section(path: Path, text: str) -> None:
    """Replace the section whose heading is ``text``'s first line (up to the next heading of level ≤ 2), or
    append it; the rest of the file stays as it is."""
    heading = text.splitlines()[0]
    old = (
        path.read_text()
        if path.exists()
        else ("# shardflow benchmarks\n\nResults of the scripts in `benchmarks/` (see `benchmarks/README.md`).\n")
    )
    m = re.search(rf"^{re.escape(heading)}[ \t]*$", old, flags=re.M)
    if m is None:
        path.write_text(old.rstrip("\n") + "\n\n" + text)
        return
    nxt = re.search(r"^#{1,2} ", old[m.end() :], flags=re.M)
    end = m.end() + nxt.start() if nxt else len(old)
    rest = old[end:]
    path.write_text(old[: m.start()] + text + ("\n" + rest if rest else ""))
