"""Pipeline schedules (docs/lowering.md#15-pipeline-schedules-microbatches---microbatches---schedule): the order in
which each stage runs the forwards and backwards of a step's microbatches, and the pass that puts the dynamic graph's
nodes in that order.

A step of M microbatches (``microbatches`` of :func:`~shardflow.lower.pass_expansion.pass_expansion`) on p stages (the
sub-meshes of the stage axis) is, per stage, a sequence of **actions**: ``F m`` (the stage's forward nodes of
microbatch m) and ``B m`` (its loss seed and backward nodes of microbatch m, activation recomputation included);
under the interleaved schedule an action is also of one of the rank's chunks (``F3.1``: chunk 1, microbatch 3).

* **GPipe** (Huang et al., "GPipe", NeurIPS 2019): every forward, then every backward.
* **1F1B** (Narayanan et al., "PipeDream", SOSP 2019; the non-interleaved schedule of Megatron-LM, SC 2021,
  §2.2): stage s runs ``min(p − 1 − s, M)`` forwards to warm up, then alternates one forward and one backward,
  then drains the remaining backwards — at most p − s microbatches' activations live on stage s at a time.
* **Interleaved 1F1B** (Megatron-LM, SC 2021, §2.2.2): the model is cut into p·V chunks (virtual stages), chunk c
  on rank c mod p; each rank runs its V chunks' forwards in groups of p microbatches (chunk 0 of microbatches
  0..p−1, chunk 1 of the same, ..., then the next p), warms up with ``(p − 1 − s)·2 + (V − 1)·p`` of them, then
  alternates, the backwards visiting the chunks in reverse. The bubble shrinks V-fold: (p − 1)/(V·M + p − 1).
  M must be a multiple of p.

Both run the backwards of a stage in microbatch order, so the weight-gradient sums one microbatch hands the
next (pass expansion's) are read in the order they are made. The updates (and a gradient norm) come after
every action, once.

:func:`schedule` orders the nodes by simulating the schedule in ticks: at each tick every stage runs its next
action if every action it reads from finished in an earlier tick (dependencies taken from the graph itself, so
a skip connection across stages counts); the global order is tick by tick, stage by stage. Communication
tokens follow the node order (:mod:`~shardflow.lower.ordering`), so each rank issues its transfers in its own
schedule's order and the verifier's proof of one global order is the proof that the schedule cannot deadlock.
A copy between stages goes with the action that makes what it moves: the sender sends as soon as it can, and
the receiver, which issues its receives without waiting (:func:`~shardflow.lower.ordering.overlap_transfers`),
waits only where it reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping, Sequence

from shardflow.lower.dynamic import DNode, DynamicGraph, NodeKind, PassError, PassName, TaskType, require
from shardflow.parallel.mesh import Mesh


class ScheduleKind(StrEnum):
    """The pipeline schedules (``--schedule``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


class Phase(StrEnum):
    """What an action runs: the forward (F) or the backward (B) of one microbatch on one stage."""

    F = "F"
    B = "B"


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a stage: ``phase`` of microbatch ``micro`` (printed ``F3``, ``B0``), of the rank's chunk
    ``chunk`` under the interleaved schedule (printed ``F3.1``; None otherwise)."""

    phase: Phase
    micro: int
    chunk: int | None = None

    def __str__(self) -> str:
        return f"{self.phase}{self.micro}" + (f".{self.chunk}" if self.chunk is not None else "")


@dataclass(frozen=True, slots=True)
class Schedule:
    """A pipeline schedule: ``kind`` over ``stages`` stages (ranks along the stage axis) and ``microbatches``
    microbatches per step, each rank holding ``virtual`` chunks of the model (virtual stages; the interleaved
    schedule's V). Raises ValueError for a count below 1, V ≥ 2 without the interleaved schedule
    (or V = 1 with it), or an interleaved schedule whose microbatches are not a multiple of the stages."""

    kind: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    stages: int = 1
    microbatches: int = 1
    virtual: int = 1

    def __post_init__(self):
        if self.stages < 1 or self.microbatches < 1 or self.virtual < 1:
            raise ValueError(
                f"a pipeline schedule has at least one stage, one microbatch and one chunk per rank, not "
                f"{self.stages} stage(s), {self.microbatches} microbatch(es) and {self.virtual} chunk(s)"
            )
        interleaved = self.kind == ScheduleKind.INTERLEAVED
        if interleaved != (self.virtual > 1):
            raise ValueError(
                f"schedule {self.kind} with {self.virtual} stage(s) per rank: the interleaved schedule "
                f"runs 2 or more chunks of the model per rank (--stages-per-rank 2 or more), gpipe and "
                f"1f1b one; give --schedule interleaved with --stages-per-rank ≥ 2, or neither"
            )
        if interleaved and self.microbatches % self.stages:
            raise ValueError(
                f"the interleaved schedule runs microbatches in groups of one per stage: "
                f"{self.microbatches} microbatch(es) do not split over {self.stages} stages; give a "
                f"multiple of {self.stages}"
            )

    def actions(self, stage: int) -> tuple[Action, ...]:
        """Stage ``stage``'s actions in order (stage 0 is the first; see the module docstring)."""
        m, p = self.microbatches, self.stages
        if self.kind == ScheduleKind.INTERLEAVED:
            v, total = self.virtual, self.microbatches * self.virtual

            def nth(k: int, phase: Phase) -> Action:  # the k-th forward (backward) of the rank
                chunk = (k // p) % v
                return Action(phase, (k // (p * v)) * p + k % p, chunk if phase == Phase.F else v - 1 - chunk)

            fwd = [nth(k, Phase.F) for k in range(total)]
            bwd = [nth(k, Phase.B) for k in range(total)]
            warmup = total if m == p else min((p - 1 - stage) * 2 + (v - 1) * p, total)
        else:
            fwd = [Action(Phase.F, i) for i in range(m)]
            bwd = [Action(Phase.B, i) for i in range(m)]
            if self.kind == ScheduleKind.GPIPE:
                return (*fwd, *bwd)
            warmup = min(p - 1 - stage, m)
        n = len(fwd)
        steady = [a for i in range(n - warmup) for a in (fwd[warmup + i], bwd[i])]
        return (*fwd[:warmup], *steady, *bwd[n - warmup :])

    def virtual_stage(self, stage: int, a: Action) -> int:
        """The index along the model of the chunk that stage ``stage`` runs in action ``a``."""
        return stage if a.chunk is None else a.chunk * self.stages + stage

    @property
    def bubble(self) -> float:
        """The ideal idle fraction of each stage, (p − 1)/(V·m + p − 1), forwards and backwards of equal length."""
        return (self.stages - 1) / (self.virtual * self.microbatches + self.stages - 1)

    def in_flight(self, stage: int) -> int:
        """The most microbatches whose forward stage ``stage`` has run and whose backward it has not yet (the
        activations it keeps at once): M under GPipe, at most p − stage under 1F1B."""
        live = most = 0
        for a in self.actions(stage):
            live += 1 if a.phase == Phase.F else -1
            most = max(most, live)
        return most

    def ticks(self) -> list[dict[int, Action]]:
        """The schedule in unit-time ticks (forwards and backwards of equal length): per tick, stage → the action
        it runs (stages idle that tick are absent). A forward waits for the stage before's, a backward for the
        stage after's (and the last stage's backward for its own forward)."""
        p, last = self.stages, self.stages * self.virtual - 1

        def at(c: int, phase: Phase, micro: int) -> tuple[int, Action]:  # virtual stage c's action
            return c % p, Action(phase, micro, c // p if self.virtual > 1 else None)

        def needs(stage: int, a: Action) -> list[tuple[int, Action]]:
            c = self.virtual_stage(stage, a)
            if a.phase == Phase.F:
                return [at(c - 1, Phase.F, a.micro)] if c else []
            return [at(c, Phase.F, a.micro)] if c == last else [at(c + 1, Phase.B, a.micro)]

        order = {s: list(self.actions(s)) for s in range(self.stages)}
        return simulate(order, {(s, a): needs(s, a) for s, acts in order.items() for a in acts})

    def timeline(self) -> str:
        """The schedule drawn as text, one row per stage, one column per tick (``.`` idle), with the bubble."""
        ticks = self.ticks()
        chunks = f", {self.virtual} chunks per stage" if self.virtual > 1 else ""
        formula = "(p-1)/(V·m+p-1)" if self.virtual > 1 else "(p-1)/(m+p-1)"
        lines = [
            f"pipeline schedule {self.kind}: {self.stages} stages{chunks}, {self.microbatches} microbatches, "
            f"{len(ticks)} ticks; bubble {formula} = {self.bubble:.3f}"
        ]
        width = max(len(str(a)) for t in ticks for a in t.values())
        for s in range(self.stages):
            cells = [str(t[s]) if s in t else "." for t in ticks]
            unit = "microbatch(es)" if self.virtual == 1 else "chunk forwards"
            lines.append(
                f"  stage {s} | "
                + " ".join(c.ljust(width) for c in cells).rstrip()
                + f"   (at most {self.in_flight(s)} {unit} in flight)"
            )
        return "\n".join(lines)


Key = tuple[int, Action]


def simulate(order: Mapping[int, Sequence[Action]], needs: Mapping[Key, Sequence[Key]]) -> list[dict[int, Action]]:
    """Run each stage's actions ``order[stage]`` in unit ticks: at each tick, each stage runs its next action if
    every (stage, action) it ``needs`` finished in an earlier tick. Returns the ticks (stage → action run). Raises
    PassError naming each stuck stage and what it waits for when no stage can go on (the schedule deadlocks)."""
    next_ = {s: 0 for s in order}
    done: set[Key] = set()
    ticks: list[dict[int, Action]] = []
    while any(next_[s] < len(acts) for s, acts in order.items()):
        tick = {}
        for s, acts in order.items():
            if next_[s] < len(acts) and all(k in done for k in needs.get((s, acts[next_[s]]), ())):
                tick[s] = acts[next_[s]]
        if not tick:
            stuck = [
                f"stage {s} at {acts[next_[s]]} waits for "
                + ", ".join(f"{a} of stage {t}" for t, a in needs[(s, acts[next_[s]])] if (t, a) not in done)
                for s, acts in order.items()
                if next_[s] < len(acts)
            ]
            raise PassError("the pipeline schedule deadlocks: " + "; ".join(stuck))
        for s, a in tick.items():
            done.add((s, a))
            next_[s] += 1
        ticks.append(tick)
    return ticks


def stage_axis(dg: DynamicGraph) -> str:
    """The mesh axis whose index tells the pipeline stages apart: the one axis that compute nodes' sub-meshes
    fix ("" when none does: one stage). Raises PassError when compute nodes fix several."""
    axes = {a for n in dg.nodes if n.kind == NodeKind.COMPUTE for a, _ in n.group.fixed}
    if len(axes) > 1:
        raise PassError(
            f"schedule: compute nodes run on sub-meshes fixing axes {sorted(axes)}; a pipeline has one stage axis"
        )
    return next(iter(axes), "")


def stages_of(dg: DynamicGraph, axis: str) -> tuple[int, ...]:
    """The stage indices along ``axis`` (:func:`stage_axis`) that nodes of ``dg`` run on, in the order the forward
    of the first microbatch reaches them (``(0,)`` for a graph of one stage)."""
    seen: dict[int, None] = {}
    for n in dg.nodes:
        if n.task == TaskType.FWD and n.kind == NodeKind.COMPUTE:
            seen.setdefault(dict(n.group.fixed).get(axis, 0), None)
    return tuple(seen) or (0,)


def schedule(dg: DynamicGraph, kind: ScheduleKind = ScheduleKind.ONE_F_ONE_B) -> DynamicGraph:
    """The nodes of ``dg`` in the order of pipeline schedule ``kind`` (see the module docstring): the weights'
    casts (and copies of what is placed before the step) first, then each (stage, action)'s nodes tick by tick,
    then the updates. A step of one microbatch keeps the order pass expansion made (all forwards, then all
    backwards: what every schedule is for one microbatch). Under the interleaved schedule the chunks are found in
    the graph (:func:`chunks`).

    Raises PassError if copy insertion has not run or this pass has, if a forward or backward node runs on no
    single stage of a pipeline, if a forward comes back to an earlier stage (a backward to a later one), if the
    schedule does not fit the graph (its chunks, its microbatches) or deadlocks on it, or (after) if the order reads
    a value before it is made."""
    require(dg.done, PassName.SCHEDULE, (PassName.COPY_INSERTION,))
    done = dg.done + (PassName.SCHEDULE,)
    if dg.microbatches == 1:
        return _replace(dg, dg.nodes, done)
    plan, axis, stages, chunk_of = _fitted(dg, kind)
    position = {s: k for k, s in enumerate(stages)}
    made_by: dict[str, Key | None] = {}  # value → the action that makes it (None: the prologue or the epilogue)
    first: list[DNode] = []
    by_action: dict[Key, list[DNode]] = {}
    last: list[DNode] = []
    for n in dg.nodes:
        if n.kind == NodeKind.CAST or (
            n.kind == NodeKind.COPY and made_by.get(n.inputs[0]) is None and n.task != TaskType.UPD
        ):
            first.append(n)  # a weight's cast, a copy of a value placed before the step (or of a cast)
            key = None
        elif n.task == TaskType.UPD:
            last.append(n)
            key = None
        else:  # a copy goes with what makes the value it moves: its sender's action
            key = (
                made_by[n.inputs[0]]
                if n.kind == NodeKind.COPY
                else (position[stage_of(n, axis, position)], Action(phase_of(n), n.micro, chunk_of.get(n.name)))
            )
            by_action.setdefault(key, []).append(n)
        made_by.update(dict.fromkeys(n.outputs, key))
    needs: dict[Key, set[Key]] = {}
    for key, nodes in by_action.items():
        needs[key] = set()
        here = plan.virtual_stage(*key)
        for n in nodes:
            for v in n.inputs:
                if (k := made_by.get(v)) is None or k == key:
                    continue
                there = plan.virtual_stage(*k)
                if k[1].phase == key[1].phase and there != here and (there > here) == (key[1].phase == Phase.F):
                    raise PassError(
                        f"schedule: {n.name!r} on stage {stages[key[0]]} reads {v!r} from the "
                        f"{key[1].phase} of stage {stages[k[0]]}: a microbatched pipeline's forward visits "
                        f"the stages once each, in order (and its backward in reverse); put the module "
                        f"that makes it on stage {stages[key[0]]} or earlier, or run one microbatch"
                    )
                needs[key].add(k)
    order = {s: [a for a in plan.actions(s) if (s, a) in by_action] for s in range(len(stages))}
    ticks = simulate(order, {k: sorted(v, key=str) for k, v in needs.items()})
    nodes = [*first, *(n for t in ticks for s in sorted(t) for n in by_action[(s, t[s])]), *last]
    return _replace(dg, tuple(nodes), done)


def requested(mesh: Mesh, kind: ScheduleKind, microbatches: int, stages_per_rank: int, axis: str = "pp") -> Schedule:
    """The schedule a command's flags ask for on ``mesh`` (its ``axis`` size the stages; 1 without it), checked
    before anything is planned. Raises ValueError naming the flags and the fix (:class:`Schedule`'s rules)."""
    stages = mesh.axis_size(axis) if axis in mesh.axis_names else 1
    try:
        return Schedule(kind, stages, microbatches, stages_per_rank)
    except ValueError as e:
        raise ValueError(
            f"--schedule {kind} --microbatches {microbatches} --stages-per-rank {stages_per_rank} on mesh {mesh}: {e}"
        ) from None


def schedule_of(dg: DynamicGraph, kind: ScheduleKind) -> Schedule:
    """The schedule ``kind`` as it runs on ``dg`` (after copy insertion): its stages, microbatches and, under the
    interleaved schedule, its chunks per stage (:func:`chunks`). Raises PassError as :func:`schedule` does."""
    return _fitted(dg, kind)[0]


def _fitted(dg: DynamicGraph, kind: ScheduleKind) -> tuple[Schedule, str, tuple[int, ...], dict[str, int]]:
    """Schedule ``kind`` on ``dg``, with the stage axis, the stages in forward order and, under the interleaved
    schedule, each node's chunk on its stage (:func:`chunks`; empty otherwise)."""
    axis = stage_axis(dg)
    stages = stages_of(dg, axis)
    chunk_of, virtual = ({}, 1)
    if kind == ScheduleKind.INTERLEAVED and dg.microbatches > 1:
        chunk_of, virtual = chunks(dg, axis, {s: k for k, s in enumerate(stages)})
    try:
        return Schedule(kind, len(stages), dg.microbatches, virtual), axis, stages, chunk_of
    except ValueError as e:
        raise PassError(f"schedule: {e}") from None


def chunks(dg: DynamicGraph, axis: str, position: Mapping[int, int]) -> tuple[dict[str, int], int]:
    """Under the interleaved schedule: each forward and backward node's chunk on its stage (node name → chunk
    index on the stage) and V, the chunks per stage. The forward of a microbatch visits the chunks in order — its
    nodes, in pass expansion's order, form p·V runs on one stage each, run c on stage c mod p (what the ``pp``
    preset with ``--stages-per-rank V`` makes) — and the backward visits them in reverse. Copies are left out (they
    go with their sender). Raises PassError when the runs do not have that shape."""
    p = len(position)
    parts: dict[tuple[Phase, int], list[DNode]] = {}
    for n in dg.nodes:
        if n.kind not in (NodeKind.COPY, NodeKind.CAST) and n.task != TaskType.UPD:
            parts.setdefault((phase_of(n), n.micro), []).append(n)
    out: dict[str, int] = {}
    counts = set()
    for (phase, m), nodes in parts.items():
        runs: list[tuple[int, list[DNode]]] = []
        for n in nodes:
            at = position[stage_of(n, axis, position)]
            if not runs or runs[-1][0] != at:
                runs.append((at, []))
            runs[-1][1].append(n)
        counts.add(len(runs))
        for r, (at, ns) in enumerate(runs):
            c = r if phase == Phase.F else len(runs) - 1 - r
            if c % p != at:
                raise PassError(
                    f"schedule interleaved: part {r} of the {phase} of microbatch {m} ({ns[0].name!r}, ...) "
                    f"runs on stage {at}, but chunk {c} of the model belongs on stage {c % p}: the "
                    f"interleaved schedule needs chunk c on stage c mod p (the pp preset with "
                    f"--stages-per-rank cuts the model so)"
                )
            out.update(dict.fromkeys((n.name for n in ns), c // p))
    total = counts.pop() if len(counts) == 1 else 0
    if total < 2 * p or total % p:
        raise PassError(
            f"schedule interleaved: the forward and backward of the microbatches visit the {p} stages "
            f"in {sorted(counts | {total})} runs, not in 2 or more rounds of one run per stage; the "
            f"interleaved schedule needs the model in p·V chunks (--stages-per-rank V ≥ 2)"
        )
    return out, total // p


def phase_of(n: DNode) -> Phase:
    """The phase a forward or backward node runs in: a recomputation runs in the backward."""
    return Phase.F if n.task == TaskType.FWD and not n.recompute else Phase.B


def stage_of(n: DNode, axis: str, position: Mapping[int, int]) -> int:
    """The stage index of node ``n``. Raises PassError when its sub-mesh spans several stages."""
    fixed = dict(n.group.fixed)
    if axis and axis not in fixed and len(position) > 1:
        raise PassError(
            f"schedule: {n.name!r} runs on {n.group}, which spans several pipeline stages (axis "
            f"{axis!r}); a microbatched pipeline needs each forward and backward node on one stage"
        )
    return fixed.get(axis, next(iter(position)))


def _replace(dg: DynamicGraph, nodes: tuple[DNode, ...], done: tuple[str, ...]) -> DynamicGraph:
    """``dg`` with ``nodes`` (a reordering of its own), after the check that each node reads only values placed
    or made by an earlier node."""
    have = set(dg.placed())
    for n in nodes:
        if missing := [v for v in n.inputs if v not in have]:
            raise PassError(f"schedule: {n.name!r} reads {missing} before any node makes it")
        have.update(n.outputs)
    if sorted(n.name for n in nodes) != sorted(n.name for n in dg.nodes):
        raise PassError("schedule: the ordered nodes are not those of the graph")
    return dataclasses.replace(dg, nodes=nodes, done=done)
