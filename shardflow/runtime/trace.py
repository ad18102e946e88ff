"""Chrome-trace timelines (open in Perfetto or chrome://tracing): one step, per rank, compute and communication
on separate lanes, with a prediction of the same step beside it.

Measured: every instruction's start and end on its rank (wall clock, microseconds). The prediction is the
simulator's replay of the same programs with each compute taking its measured time
(:func:`shardflow.simulator.replay.replay`'s ``measured``; ``shardflow train --trace`` adds it), so the two
timelines differ exactly where the machine spec's view of communication differs from the machine's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from shardflow.lower.program import Comm, Compute, Wait

LANES = {"compute": 0, "communication": 1}


@dataclass
class Tracer:
    """Collects (lane, name, start µs, duration µs, args) events of one rank. ``device``: where the rank computes;
    on a GPU :meth:`now` waits for the device first, so that an instruction's time is its kernels' and a wait's the
    communication's, not the time to queue them (the traced step runs without the CPU running ahead of the GPU)."""

    rank: int
    device: torch.device = torch.device("cpu")
    events: list[dict] = field(default_factory=list)

    def now(self) -> float:
        """Seconds (wall clock), once the work queued on the device has finished."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.time()

    def record(self, instr, start_s: float, end_s: float) -> None:
        lane = "communication" if isinstance(instr, (Comm, Wait)) else "compute"
        if isinstance(instr, Compute):
            name, args = f"{instr.task} {instr.op}", {"node": instr.node, "out": [b.value for b in instr.outs]}
        elif isinstance(instr, Comm):
            name = f"#{instr.token} {instr.kind}"
            args = {
                "members": list(instr.members),
                "bytes": instr.nbytes,
                "shape": list(instr.type.shape),
                "axis": instr.axis,
            }
        else:
            name, args = f"#{instr.token} wait", {}
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "pid": self.rank,
                "tid": LANES[lane],
                "ts": start_s * 1e6,
                "dur": max((end_s - start_s) * 1e6, 0.01),
                "args": args,
            }
        )


def blocked(measured: Mapping[int, list[dict]]) -> dict[int, tuple[float, float]]:
    """Per rank of a measured timeline: the seconds it spent blocked on other ranks (its communication lane: blocking
    communications and the waits of those issued without waiting) and the span of its step, seconds. Under a
    pipeline schedule the blocked share is the stage's measured bubble."""
    out = {}
    for r, events in measured.items():
        xs = [e for e in events if e["ph"] == "X"]
        span = (max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs)) / 1e6 if xs else 0.0
        out[r] = (sum(e["dur"] for e in xs if e["tid"] == LANES["communication"]) / 1e6, span)
    return out


def write(path: str | Path, measured: Mapping[int, list[dict]], predicted_events: list[dict] = ()) -> Path:
    """One Chrome-trace JSON file: measured ranks (pid = rank) and the prediction (pid = 1000 + rank)."""
    meta = []
    for r in measured:
        meta.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} (measured)"}})
        meta.append({"name": "process_name", "ph": "M", "pid": 1000 + r, "args": {"name": f"rank {r} (predicted)"}})
        for pid in (r, 1000 + r):
            for lane, tid in LANES.items():
                meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}})
    events = meta + [e for evs in measured.values() for e in evs] + list(predicted_events)
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
