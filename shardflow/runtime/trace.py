"""Chrome-trace timelines (open in Perfetto or chrome://tracing): one step, per rank, compute and communication
on separate lanes, with the cost model's prediction of the same step beside it.

Measured: every instruction's start and end on its rank (wall clock, microseconds). Predicted: the same
instruction stream replayed with each compute taking its measured time and each communication the α–β cost
model's time (:mod:`shardflow.lower.cost`), starting no earlier than its members are all ready — so the two
timelines differ exactly where the model's view of communication differs from the machine's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from shardflow.lower.cost import CostModel
from shardflow.lower.program import Comm, Compute, Program, Wait
from shardflow.lower.rendezvous import rendezvous
from shardflow.parallel.collectives import KINDS

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


def comm_seconds(c: Comm, cost: CostModel) -> float:
    """The cost model's time for one communication (what this rank sends, at its kind's bandwidth on its axis), in
    seconds."""
    return cost.call_s(KINDS[c.kind].priced_as, c.nbytes, c.axis)


def predicted(programs: Mapping[int, Program], measured: Mapping[int, list[dict]], cost: CostModel) -> list[dict]:
    """Events of the predicted timeline (pid = 1000 + rank): computes take their measured time, communications
    the model's, each communication starting when all its members reached it. A communication issued without
    waiting travels while its rank goes on computing; the rank waits for it at its ``Wait``."""
    comp = {r: [e["dur"] / 1e6 for e in evs if e["tid"] == LANES["compute"]] for r, evs in measured.items()}
    clock = {r: 0.0 for r in programs}
    ci = {r: 0 for r in programs}
    arrives: dict[tuple[int, int], float] = {}  # (rank, token) of an asynchronous communication → when it is done
    out: list[dict] = []
    t0 = min((e["ts"] for evs in measured.values() for e in evs), default=0.0) / 1e6

    def emit(r, name, lane, start, dur):
        out.append(
            {
                "name": name,
                "ph": "X",
                "pid": 1000 + r,
                "tid": lane,
                "ts": (t0 + start) * 1e6,
                "dur": max(dur * 1e6, 0.01),
            }
        )

    def local(r: int, start: int, stop: int) -> None:
        for i in programs[r].instrs[start:stop]:
            if isinstance(i, Compute):
                d = comp[r][ci[r]] if ci[r] < len(comp.get(r, [])) else 0.0
                emit(r, f"{i.task} {i.op}", LANES["compute"], clock[r], d)
                clock[r] += d
                ci[r] += 1
            elif isinstance(i, Wait):
                clock[r] = max(clock[r], arrives.pop((r, i.token)))

    def meet(holders: list[tuple[int, Comm]]) -> None:
        start = max(clock[m] for m, _ in holders)
        for m, c in holders:
            d = comm_seconds(c, cost)
            emit(m, f"#{c.token} {c.kind}{'' if c.wait else ' (async)'} (model)", LANES["communication"], start, d)
            if c.wait:
                clock[m] = start + d
            else:
                clock[m], arrives[m, c.token] = start, start + d

    rendezvous(programs, local, meet)
    return out


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
        meta.append({"name": "process_name", "ph": "M", "pid": 1000 + r, "args": {"name": f"rank {r} (cost model)"}})
        for pid in (r, 1000 + r):
            for lane, tid in LANES.items():
                meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}})
    events = meta + [e for evs in measured.values() for e in evs] + list(predicted_events)
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
