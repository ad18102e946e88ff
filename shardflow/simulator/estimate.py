"""A plan's predicted step: time, throughput, MFU and peak memory per rank, from its lowered programs
(docs/simulator.md).

:func:`simulate` replays the programs of one optimizer step (:func:`~shardflow.simulator.replay.replay`) and
replays their buffers (:func:`~shardflow.lower.memory.program_memory`: the live bytes the executors count, the
instruction of the peak named). On a large world only one rank per class of alike ranks is lowered and replayed
(:func:`representatives`): under SPMD every rank of a pipeline stage runs the same program up to the ranks it
talks to, so the ranks whose coordinates off the stage axis are all 0 stand for the rest. :func:`cost_model` is
the spec's α-β per mesh axis as lowering's cost model, so the ``auto`` communication forms are chosen for the
machine predicted, not the one planning.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from shardflow.lower import CostModel, LoweredStep
from shardflow.lower.calibration import COST_KINDS, Calibration
from shardflow.lower.memory import ProgramMemory, program_memory
from shardflow.lower.program import Comm, Compute, Instr, Program
from shardflow.parallel.mesh import Mesh
from shardflow.simulator.cost import EAGER, Kernels
from shardflow.simulator.replay import Breakdown, Event, Timeline, replay

if TYPE_CHECKING:
    from shardflow.simulator.machine import MachineSpec

EXACT_WORLD = 16  # worlds up to this size are lowered and replayed rank by rank, larger ones one rank per class


def representatives(mesh: Mesh, stage_axis: str | None = None) -> dict[int, int]:
    """Every rank of ``mesh`` → the rank replayed for it: the rank with the same coordinate on ``stage_axis`` (the
    pipeline's; None: no pipeline) and 0 on every other axis."""
    keep = mesh.axis_names.index(stage_axis) if stage_axis in mesh.axis_names else None
    out = {}
    for r in range(mesh.size):
        coords = mesh.coords(r)
        out[r] = mesh.device(tuple(c if a == keep else 0 for a, c in enumerate(coords)))
    return out


def axis_members(mesh: Mesh, axis: str) -> tuple[int, ...]:
    """The ranks along mesh ``axis`` through rank 0 (its stride the product of the axes after it)."""
    i = mesh.axis_index(axis)
    stride = math.prod(mesh.shape[i + 1 :])
    return tuple(k * stride for k in range(mesh.shape[i]))


def cost_model(spec: MachineSpec, mesh: Mesh) -> CostModel:
    """Lowering's cost model for ``mesh`` on ``spec``: every cost kind on every mesh axis from the link the axis's
    groups use (:meth:`MachineSpec.link` of its members through rank 0)."""
    groups = {a: dict(spec.link(axis_members(mesh, a)).kinds) for a in mesh.axis_names}
    groups["world"] = dict(spec.link(tuple(range(mesh.size))).kinds)
    cal = Calibration(spec.backend, mesh.size, spec.name, "", torch.__version__, groups, f"machine spec {spec.name}")
    missing = [(a, k) for a, kinds in groups.items() for k in COST_KINDS if k not in kinds]
    if missing:
        raise ValueError(f"machine spec {spec.name}: no α-β for {missing}")
    return CostModel(spec.backend, calibration=cal)


@dataclass(frozen=True)
class Prediction:
    """One optimizer step predicted on machine ``machine`` (a spec's name) for ``world`` devices.

    ``step_seconds``: the last rank's end. ``tokens``: tokens one step trains on (the global batch × sequence).
    ``model_flops``: the step's model FLOPs (:func:`~shardflow.graph.flops.training_flops` of the whole batch, no
    recomputation). ``peak_flops``: one device's dense peak (FLOP/s) in the step's compute dtype, the denominator of
    MFU. ``peak_bytes``: each rank's peak live bytes (world ranks, a replayed rank's figure for the ranks it stands
    for); ``memory``: each replayed rank's :class:`~shardflow.lower.memory.ProgramMemory` and the instruction of
    its peak; ``timeline``: the replay (ends, breakdown and, where asked, events per replayed rank)."""

    machine: str
    world: int
    step_seconds: float
    tokens: int
    model_flops: int
    peak_flops: float
    peak_bytes: tuple[int, ...]
    memory: Mapping[int, tuple[ProgramMemory, str]]
    timeline: Timeline
    replayed: tuple[int, ...]

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens / self.step_seconds / self.world if self.step_seconds else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second per device ÷ the device's peak (PaLM, appendix B)."""
        return self.model_flops / self.step_seconds / self.world / self.peak_flops if self.step_seconds else 0.0

    @property
    def slowest(self) -> int:
        """The replayed rank that ends last."""
        return max(self.timeline.ends, key=lambda r: self.timeline.ends[r])

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``shardflow plan --estimate --format json``: ``step_seconds``,
        ``tokens_per_second_per_device``, ``mfu``, ``peak_bytes`` (one per rank), ``breakdown`` (seconds, the
        slowest rank's), ``breakdown_per_rank`` and ``memory`` (per replayed rank: peak, by kind, the instruction)."""
        bd = self.timeline.breakdown
        return {
            "machine": self.machine,
            "world": self.world,
            "step_seconds": self.step_seconds,
            "tokens_per_second_per_device": self.tokens_per_second_per_device,
            "mfu": self.mfu,
            "peak_bytes": list(self.peak_bytes),
            "breakdown": vars(bd[self.slowest]).copy(),
            "breakdown_per_rank": {str(r): vars(b).copy() for r, b in bd.items()},
            "memory": {
                str(r): {"peak": m.peak, "by_kind": {str(k): v for k, v in m.by_kind.items()}, "at": at}
                for r, (m, at) in self.memory.items()
            },
            "replayed_ranks": list(self.replayed),
        }

    def describe(self) -> str:
        """The prediction as a few lines of text (``shardflow plan --estimate``)."""
        b = self.timeline.breakdown[self.slowest]
        r, (mem, at) = max(self.memory.items(), key=lambda kv: kv[1][0].peak)
        parts = ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.3g} ms" for k, v in vars(b).items() if v)
        kinds = ", ".join(f"{k} {_gib(v)}" for k, v in mem.by_kind.items() if v)
        return "\n".join(
            [
                f"# predicted on {self.machine} ({self.world} devices): step {self.step_seconds * 1e3:.4g} ms, "
                f"{self.tokens_per_second_per_device:,.0f} tokens/s per device, MFU {self.mfu:.1%}",
                f"#   rank {self.slowest} (slowest): {parts}",
                f"#   peak memory {_gib(mem.peak)} on rank {r} ({kinds}) at: {at}",
            ]
        )

    def write_trace(self, path: Path) -> None:
        """Write the timeline's events as a Chrome trace (Perfetto opens it): one process per rank, a thread per
        stream, microseconds."""
        path.write_text(json.dumps({"traceEvents": chrome_events(self.timeline.events), "displayTimeUnit": "ms"}))


def extrapolate(a: Prediction, b: Prediction, ka: int, kb: int, k: int) -> Prediction:
    """The prediction for a model of ``k`` repeated blocks drawn as a line through ``a`` and ``b``, the same plan
    predicted on the model cut down to ``ka`` < ``kb`` of its blocks (:func:`shardflow.graph.blocks.keep_blocks`;
    docs/search.md#folding-repeated-blocks): every time (seconds), byte count and FLOP count grows by the same
    amount per block — each block adds the same computes, communications and buffers. The instruction of each
    rank's peak is ``b``'s. Raises ValueError unless ``ka`` < ``kb`` and the two replayed the same ranks."""
    if not ka < kb or a.replayed != b.replayed:
        raise ValueError(f"extrapolate from {ka} and {kb} blocks over ranks {a.replayed} and {b.replayed}")
    t = (k - ka) / (kb - ka)

    def line(x: float, y: float) -> float:
        return x + (y - x) * t

    def mem(r: int) -> tuple[ProgramMemory, str]:
        (ma, _), (mb, at) = a.memory[r], b.memory[r]
        kinds = {kind: round(line(ma.by_kind.get(kind, 0), v)) for kind, v in mb.by_kind.items()}
        return ProgramMemory(round(line(ma.peak, mb.peak)), kinds, mb.at), at

    ta, tb = a.timeline, b.timeline
    timeline = Timeline(
        line(ta.seconds, tb.seconds),
        {r: line(ta.ends[r], e) for r, e in tb.ends.items()},
        {
            r: Breakdown(**{f: line(getattr(ta.breakdown[r], f), v) for f, v in vars(bd).items()})
            for r, bd in tb.breakdown.items()
        },
    )
    return dataclasses.replace(
        b,
        step_seconds=line(a.step_seconds, b.step_seconds),
        model_flops=round(line(a.model_flops, b.model_flops)),
        peak_bytes=tuple(round(line(x, y)) for x, y in zip(a.peak_bytes, b.peak_bytes)),
        memory={r: mem(r) for r in b.memory},
        timeline=timeline,
    )


STREAM_TID = {"compute": 0, "comm": 1}  # the Chrome-trace thread of each stream (shardflow.runtime.trace's lanes)


def chrome_events(events: Sequence[Event], pid: int = 0, start: float = 0.0) -> list[dict[str, Any]]:
    """Chrome-trace complete events of a replay's ``events``: process ``pid`` + rank, a thread per stream
    (:data:`STREAM_TID`), microseconds from ``start`` (seconds)."""
    return [
        {
            "name": e.name,
            "cat": e.category,
            "ph": "X",
            "pid": pid + e.rank,
            "tid": STREAM_TID[e.stream],
            "ts": (start + e.start) * 1e6,
            "dur": max(e.seconds * 1e6, 0.01),
        }
        for e in events
    ]


def where(i: Instr) -> str:
    """An instruction in a few words: its task type, op or communication kind and the buffer it writes."""
    if isinstance(i, Compute):
        return f"{i.task} {i.op} writing {i.outs[0].value}" if i.outs else f"{i.task} {i.op}"
    if isinstance(i, Comm):
        return f"#{i.token} {i.task} {i.kind}" + (f" receiving {i.recv.value}" if i.recv else "")
    return str(i).strip()


def peak_site(program: Program, m: ProgramMemory) -> str:
    """Where ``program`` reaches its peak ``m``, in a few words (:func:`where`)."""
    return where(program.instrs[m.at]) if m.at >= 0 else "the step's start"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**26 else f"{n / 2**20:.3g} MiB"


def simulate(
    steps: Sequence[LoweredStep],
    spec: MachineSpec,
    rep_of: Mapping[int, int],
    tokens: int,
    model_flops: int,
    dtype: torch.dtype,
    events: bool = False,
    kernels: Kernels = EAGER,
) -> Prediction:
    """Predict one optimizer step whose micro-steps are ``steps`` (each lowered for the replayed ranks, the values
    of ``rep_of``) on ``spec``. ``tokens``, ``model_flops``: the step's (:class:`Prediction`); ``dtype``: the
    compute dtype MFU is measured against; ``kernels``: how the computes run (:class:`~shardflow.simulator.cost.
    Kernels`). Raises SimulationError (programs that cannot run to the end)."""
    replayed = tuple(sorted(set(rep_of.values())))
    recomputed = {n.name for s in steps for n in s.dg.nodes if n.recompute}
    timeline = replay(
        [{r: s.programs[r] for r in replayed} for s in steps],
        spec,
        recomputed=recomputed.__contains__,
        events=events,
        kernels=kernels,
    )
    memory: dict[int, tuple[ProgramMemory, str]] = {}
    for r in replayed:
        best: tuple[ProgramMemory, str] | None = None
        for s in steps:
            m = program_memory(s.programs[r], s.dg)
            if best is None or m.peak > best[0].peak:
                best = (m, peak_site(s.programs[r], m))
        assert best is not None
        memory[r] = best
    peak_bytes = tuple(memory[rep_of[r]][0].peak for r in range(len(rep_of)))
    return Prediction(
        spec.name,
        len(rep_of),
        timeline.seconds,
        tokens,
        model_flops,
        spec.peak(dtype),
        peak_bytes,
        memory,
        timeline,
        replayed,
    )
