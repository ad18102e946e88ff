"""A pipeline's step for many microbatches predicted from its programs for few (docs/simulator.md#composing-a-pipeline).

Lowering a pipeline of M microbatches makes programs M times as long, and that lowering is most of what the search
pays for a pipeline candidate (docs/search.md#limits). Yet each stage repeats the same actions (``F m``, ``B m``:
:class:`~shardflow.lower.schedule.Action`) for every microbatch of a size; only their order changes with M
(:class:`~shardflow.lower.schedule.Schedule`). So :func:`compose` replays the programs lowered for few microbatches
(three under GPipe and 1F1B: a first, a middle and a last; two per stage under the interleaved schedule, which with
one per stage runs every forward first), reads off each replayed rank's timeline

* the **busy time of each action** — from its first compute to the next action's first compute, its own collectives
  and the sends after it included, the time the rank waited for another stage (the replay's ``bubble``) left out;
* the **head** (before the first action: the weights' casts) and the **tail** (after the last: the gradients'
  reductions, the update);
* each **transfer's latency** between stages — from the end of the action that makes an activation (a gradient) to
  the first compute of the action on the next stage that reads it, the least over the pairs seen;
* each action's **bytes**: how far the rank's live bytes rise above where they stood when it began, and where they
  end (a forward leaves its activations for its backward; the ledger of
  :func:`~shardflow.lower.memory.program_memory`),

then runs the schedule of M microbatches with those times — each action starts when its stage is free and the
actions it reads have ended, plus the transfer — and those bytes, action after action, for each rank's peak: so a
stage holds as many microbatches' activations as the schedule keeps in flight there
(:meth:`~shardflow.lower.schedule.Schedule.in_flight`), and whatever else each microbatch leaves until the step's
end. Microbatch m of many takes the times and bytes of microbatch 0 of few when it is the first, of the last of few
when it is the last, else of a middle one of few (:func:`_like` where few has none).

What it leaves out, against replaying the M-microbatch programs: a communication of one microbatch queued behind
another's on the same stream (the replay's point-to-point stream of each rank) beyond what few shows — so a step whose
transfers take more than :data:`TRANSFER_SHARE` of it is refused (:class:`ComposeError`). Its error against the exact
replay is measured in tests/test_compose.py and docs/simulator.md#composing-a-pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from shardflow.lower import LoweredStep
from shardflow.lower.dynamic import DNode, NodeKind, TaskType
from shardflow.lower.memory import MemoryKind, ProgramMemory, program_memory
from shardflow.lower.program import Compute
from shardflow.lower.schedule import Action, Phase, Schedule, chunks, phase_of, stage_axis, stage_of, stages_of
from shardflow.simulator.cost import EAGER, Kernels, comm_seconds
from shardflow.simulator.estimate import Prediction, peak_site
from shardflow.simulator.replay import Breakdown, Timeline, replay

if TYPE_CHECKING:
    from shardflow.simulator.machine import MachineSpec


# the most of a step a stage's transfers may take for it to be composed: beyond, their queueing on the stream, which
# the composition does not model, grows to errors of 10 % and more (measured: docs/simulator.md#composing-a-pipeline)
TRANSFER_SHARE = 0.1


class ComposeError(ValueError):
    """The step cannot be composed faithfully from few microbatches (:data:`TRANSFER_SHARE`): predict it whole."""


@dataclass(frozen=True)
class _Rank:
    """What one replayed rank's few-microbatch timeline says: its ``stage`` (position along the stage axis); the
    busy seconds of its ``head`` and ``tail``; per action its ``busy`` seconds, the busy seconds to its last
    compute's end (``span``), its first compute's ``start`` and last compute's ``end`` on the clock; per action how
    far the live bytes ``rise`` above their level when it begins and how much they change by its end (``net``); the
    live bytes when the first action begins (``live``), the most before it (``head_peak``), how far they rise in the
    tail (``tail_rise``); its ledger's :class:`~shardflow.lower.memory.ProgramMemory`; and the seconds of its
    transfers between stages (``transfers``, :func:`~shardflow.simulator.cost.comm_seconds` of each)."""

    stage: int
    head: float
    tail: float
    busy: Mapping[Action, float]
    span: Mapping[Action, float]
    start: Mapping[Action, float]
    end: Mapping[Action, float]
    rise: Mapping[Action, int]
    net: Mapping[Action, int]
    live: int
    head_peak: int
    tail_rise: int
    memory: ProgramMemory
    transfers: float


def compose(
    step: LoweredStep,
    spec: MachineSpec,
    rep_of: Mapping[int, int],
    few: Schedule,
    many: Schedule,
    tokens: int,
    model_flops: int,
    dtype: torch.dtype,
    kernels: Kernels = EAGER,
) -> Prediction:
    """One step of ``many`` microbatches predicted from ``step``, the same pipeline lowered for ``few`` (same kind,
    stages and chunks per stage; one micro-step) for the ranks ``rep_of`` maps to (module docstring). ``tokens``,
    ``model_flops``: the step of ``many``'s (:class:`~shardflow.simulator.estimate.Prediction`). Raises ValueError
    where the two schedules differ in more than their microbatches, ComposeError where a stage's transfers take
    more than :data:`TRANSFER_SHARE` of the step, SimulationError as the replay does."""
    if (few.kind, few.stages, few.virtual) != (many.kind, many.stages, many.virtual):
        raise ValueError(f"compose: {many} from {few}: only the microbatches may differ")
    replayed = tuple(sorted(set(rep_of.values())))
    clocks: dict[int, list[tuple[float, float]]] = {r: [] for r in replayed}
    recomputed = {n.name for n in step.dg.nodes if n.recompute}
    timeline = replay(
        [{r: step.programs[r] for r in replayed}],
        spec,
        recomputed=recomputed.__contains__,
        kernels=kernels,
        clocks=clocks,
    )
    dg = step.dg
    axis = stage_axis(dg)
    position = {s: k for k, s in enumerate(stages_of(dg, axis))}
    chunk_of = chunks(dg, axis, position)[0] if few.virtual > 1 else {}
    nodes = {n.name: n for n in dg.nodes}
    ranks = {r: _read(step, r, clocks[r], nodes, axis, position, chunk_of, spec) for r in replayed}
    latency = _latencies(ranks, few)

    def like(a: Action) -> Action:
        """The action of ``few`` whose times and bytes action ``a`` of ``many`` takes (:func:`_like`)."""
        return Action(a.phase, _like(a, few.microbatches, many.microbatches), a.chunk)

    stages = {rk.stage for rk in ranks.values()}
    at = {rk.stage: rk for rk in ranks.values()}
    ends: dict[tuple[int, int, Phase], float] = {}  # (virtual stage, micro, phase) → its last compute's end
    clock = {s: at[s].head for s in stages}
    live = {s: at[s].live for s in stages}
    peak = {s: at[s].head_peak for s in stages}
    todo = {s: list(many.actions(s)) for s in stages}
    last_virtual = many.stages * many.virtual - 1
    while any(todo.values()):
        moved = False
        for s, acts in todo.items():
            while acts:
                a = acts[0]
                c = many.virtual_stage(s, a)
                dep = _reads(a, c, last_virtual)
                ready = 0.0
                if dep is not None:
                    if dep not in ends:
                        break
                    ready = ends[dep]
                    if dep[0] % many.stages != s:  # a transfer from another stage
                        ready += latency.get((dep[0], dep[2]), 0.0)
                rk, b = at[s], like(a)
                begin = max(clock[s], ready)
                ends[(c, a.micro, a.phase)] = begin + rk.span[b]
                clock[s] = begin + rk.busy[b]
                peak[s] = max(peak[s], live[s] + rk.rise[b])
                live[s] += rk.net[b]
                acts.pop(0)
                moved = True
        if not moved:
            raise ValueError(f"compose: the schedule {many} does not run to its end on the times read")
    ends_of = {r: clock[rk.stage] + rk.tail for r, rk in ranks.items()}
    seconds = max(ends_of.values(), default=0.0)
    # each microbatch's transfers on a stage's stream: the few's, as many times over as the many have microbatches
    sending = {rk.stage: rk.transfers * many.microbatches / few.microbatches for rk in ranks.values()}
    busiest = max(sending, key=sending.__getitem__)
    if seconds and sending[busiest] > TRANSFER_SHARE * seconds:
        raise ComposeError(
            f"compose: stage {busiest}'s transfers take {sending[busiest] / seconds:.0%} of the step (more than "
            f"{TRANSFER_SHARE:.0%}): their queueing on its stream, which the composition does not see, would count; "
            "predict the pipeline whole"
        )
    memory = {}
    for r, rk in ranks.items():
        top = max(peak[rk.stage], live[rk.stage] + rk.tail_rise)
        kinds = dict(rk.memory.by_kind)  # what the few held at their peak, the difference put to activations
        kinds[MemoryKind.ACTIVATIONS] = kinds.get(MemoryKind.ACTIVATIONS, 0) + top - rk.memory.peak
        memory[r] = ProgramMemory(top, kinds, rk.memory.at), peak_site(step.programs[r], rk.memory)
    breakdown = {r: _breakdown(timeline.breakdown[r], ranks[r], many, like, ends_of[r]) for r in replayed}
    return Prediction(
        spec.name,
        len(rep_of),
        seconds,
        tokens,
        model_flops,
        spec.peak(dtype),
        tuple(memory[rep_of[r]][0].peak for r in range(len(rep_of))),
        memory,
        Timeline(seconds, ends_of, breakdown),
        replayed,
    )


def _reads(a: Action, c: int, last: int) -> tuple[int, int, Phase] | None:
    """(virtual stage, microbatch, phase) of the action that action ``a`` of virtual stage ``c`` reads from (of
    ``last`` + 1 virtual stages): a forward the previous stage's forward, a backward the next stage's backward, the
    last stage's backward its own forward; None for the first stage's forward."""
    if a.phase == Phase.F:
        return (c - 1, a.micro, Phase.F) if c > 0 else None
    return (c, a.micro, Phase.F) if c == last else (c + 1, a.micro, Phase.B)


def _read(
    step: LoweredStep,
    r: int,
    clocks: list[tuple[float, float]],
    nodes: Mapping[str, DNode],
    axis: str,
    position: Mapping[int, int],
    chunk_of: Mapping[str, int],
    spec: MachineSpec,
) -> _Rank:
    """Rank ``r``'s actions, head and tail read off its replayed ``clocks`` and its ledger (module docstring)."""
    program = step.programs[r]
    owner: list[Action | None] = []
    stage = 0
    for i in program.instrs:
        n = nodes.get(i.dnode) if isinstance(i, Compute) and i.task != TaskType.UPD else None
        if n is None:
            owner.append(None)
            continue
        stage = position[stage_of(n, axis, position)]
        owner.append(Action(phase_of(n), n.micro, chunk_of.get(n.name)))
    computes = [k for k, a in enumerate(owner) if a is not None]
    first, last = computes[0], computes[-1]
    curve: list[int] = []  # live bytes before each instruction, and after the last
    memory = program_memory(program, step.dg, curve=curve)

    def at(k: int) -> tuple[float, float]:  # clock and bubble before instruction k
        return clocks[k - 1] if k else (0.0, 0.0)

    def busy(lo: int, hi: int) -> float:  # instructions lo..hi-1, the waits for another stage left out
        (c0, b0), (c1, b1) = at(lo), at(hi)
        return (c1 - c0) - (b1 - b0)

    # a piece: a run of one action's computes (by their index in ``computes``) and what follows them
    runs = [j for j, k in enumerate(computes) if j == 0 or owner[k] != owner[computes[j - 1]]]
    busy_of: dict[Action, float] = {}
    span: dict[Action, float] = {}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    rise: dict[Action, int] = {}
    net: dict[Action, int] = {}
    for j, lo in enumerate(runs):
        hi = runs[j + 1] if j + 1 < len(runs) else len(computes)
        k, final = computes[lo], computes[hi - 1]
        nxt = computes[hi] if hi < len(computes) else last + 1
        a = owner[k]
        assert a is not None
        earlier = busy_of.get(a, 0.0)  # an action run in pieces (a pass moved some of its nodes) adds them up
        span[a] = earlier + busy(k, final + 1)
        busy_of[a] = earlier + busy(k, nxt)
        start.setdefault(a, at(k)[0])
        end[a] = clocks[final][0]
        rise[a] = max(rise.get(a, 0), net.get(a, 0) + max(curve[k : nxt + 1]) - curve[k])
        net[a] = net.get(a, 0) + curve[nxt] - curve[k]
    return _Rank(
        stage,
        busy(0, first),
        busy(last + 1, len(program.instrs)),
        busy_of,
        span,
        start,
        end,
        rise,
        net,
        curve[first],
        max(curve[: first + 1]),
        max(curve[last + 1 :]) - curve[last + 1],
        memory,
        sum(comm_seconds(c, spec) for c in program.comms if c.axis == NodeKind.COPY),
    )


def _like(a: Action, few: int, many: int) -> int:
    """The microbatch of ``few`` whose action of ``a``'s phase and chunk gives its times and bytes to ``a``, of
    ``many``: the first as the first, the last as the last, and a middle one as a middle one of few — or where few
    has none, as the last's forward (the first's forward also makes what every later one reads: the weights'
    casts and copies) and the first's backward (the last's also reduces the gradients)."""
    if a.micro == 0 or a.micro == many - 1:
        return 0 if a.micro == 0 else few - 1
    if few >= 3:
        return min(a.micro, few - 2)
    return few - 1 if a.phase == Phase.F else 0


def _latencies(ranks: Mapping[int, _Rank], few: Schedule) -> dict[tuple[int, Phase], float]:
    """(virtual stage, phase) → the least seconds from the end of an action of that phase there to the start of the
    action on the next stage (the previous one for a backward) that reads what it made."""
    at = {rk.stage: rk for rk in ranks.values()}
    out: dict[tuple[int, Phase], float] = {}
    for s, rk in at.items():
        for a, t in rk.end.items():
            c = few.virtual_stage(s, a)
            nxt = c + 1 if a.phase == Phase.F else c - 1
            other = at.get(nxt % few.stages) if 0 <= nxt < few.stages * few.virtual else None
            b = Action(a.phase, a.micro, nxt // few.stages if few.virtual > 1 else None)
            if other is not None and b in other.start:
                gap = max(0.0, other.start[b] - t)
                out[(c, a.phase)] = min(out.get((c, a.phase), gap), gap)
    return out


def _breakdown(few: Breakdown, rk: _Rank, many: Schedule, like: Callable[[Action], Action], end: float) -> Breakdown:
    """The few-microbatch breakdown with every field but the bubble and the update scaled by the busy seconds of
    the many-microbatch actions over the few's, the bubble what is left of the rank's ``end``."""
    busy_few = sum(rk.busy.values())
    k = sum(rk.busy[like(a)] for a in many.actions(rk.stage)) / busy_few if busy_few else 1.0
    b = Breakdown(
        compute=few.compute * k,
        recompute=few.recompute * k,
        optimizer=few.optimizer,
        exposed_comm=few.exposed_comm * k,
        overhead=few.overhead * k,
    )
    b.bubble = max(0.0, end - b.total())
    return b
