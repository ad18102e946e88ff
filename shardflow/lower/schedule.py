"""Pipeline schedules (design §8): the order in which each stage runs the forwards and backwards of a step's
microbatches, and the pass that puts the dynamic graph's nodes in that order.

A step of M microbatches (``microbatches`` of :func:`~shardflow.lower.dynamic.pass_expansion`) on p stages (the
sub-meshes of the stage axis) is, per stage, a sequence of **actions**: ``F m`` (the stage's forward nodes of
microbatch m) and ``B m`` (its loss seed and backward nodes of microbatch m, activation recomputation included).

* **GPipe** (Huang et al., "GPipe", NeurIPS 2019): every forward, then every backward.
* **1F1B** (Narayanan et al., "PipeDream", SOSP 2019; the non-interleaved schedule of Megatron-LM, SC 2021,
  §2.2): stage s runs ``min(p − 1 − s, M)`` forwards to warm up, then alternates one forward and one backward,
  then drains the remaining backwards — at most p − s microbatches' activations live on stage s at a time.

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

from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping, Sequence

from shardflow.lower.dynamic import DNode, DynamicGraph, NodeKind, PassError, PassName, TaskType, require


class ScheduleKind(StrEnum):
    """The pipeline schedules (``--schedule``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class Phase(StrEnum):
    """What an action runs: the forward (F) or the backward (B) of one microbatch on one stage."""

    F = "F"
    B = "B"


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a stage: ``phase`` of microbatch ``micro`` (printed ``F3``, ``B0``)."""

    phase: Phase
    micro: int

    def __str__(self) -> str:
        return f"{self.phase}{self.micro}"


@dataclass(frozen=True, slots=True)
class Schedule:
    """A pipeline schedule: ``kind`` over ``stages`` stages and ``microbatches`` microbatches per step.
    Raises ValueError for an unknown kind or a count below 1."""

    kind: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B
    stages: int = 1
    microbatches: int = 1

    def __post_init__(self):
        if self.kind not in set(ScheduleKind):
            raise ValueError(f"unknown pipeline schedule {self.kind!r}; use one of {[str(k) for k in ScheduleKind]}")
        object.__setattr__(self, "kind", ScheduleKind(self.kind))
        if self.stages < 1 or self.microbatches < 1:
            raise ValueError(f"a pipeline schedule has at least one stage and one microbatch, not {self.stages} "
                             f"stage(s) and {self.microbatches} microbatch(es)")

    def actions(self, stage: int) -> tuple[Action, ...]:
        """Stage ``stage``'s actions in order (stage 0 is the first; see the module docstring)."""
        m = self.microbatches
        fwd = [Action(Phase.F, i) for i in range(m)]
        bwd = [Action(Phase.B, i) for i in range(m)]
        if self.kind == ScheduleKind.GPIPE:
            return (*fwd, *bwd)
        warmup = min(self.stages - 1 - stage, m)
        steady = [a for i in range(m - warmup) for a in (fwd[warmup + i], bwd[i])]
        return (*fwd[:warmup], *steady, *bwd[m - warmup:])

    @property
    def bubble(self) -> float:
        """The ideal idle fraction of each stage, (p − 1)/(m + p − 1), forwards and backwards of equal length."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)

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
        def needs(stage: int, a: Action) -> list[tuple[int, Action]]:
            if a.phase == Phase.F:
                return [(stage - 1, a)] if stage else []
            after = [(stage + 1, a)] if stage + 1 < self.stages else []
            return [(stage, Action(Phase.F, a.micro)), *after]

        order = {s: list(self.actions(s)) for s in range(self.stages)}
        return simulate(order, {(s, a): needs(s, a) for s, acts in order.items() for a in acts})

    def timeline(self) -> str:
        """The schedule drawn as text, one row per stage, one column per tick (``.`` idle), with the bubble."""
        ticks = self.ticks()
        lines = [f"pipeline schedule {self.kind}: {self.stages} stages, {self.microbatches} microbatches, "
                 f"{len(ticks)} ticks; bubble (p-1)/(m+p-1) = {self.bubble:.3f}"]
        width = max(len(str(a)) for t in ticks for a in t.values())
        for s in range(self.stages):
            cells = [str(t[s]) if s in t else "." for t in ticks]
            lines.append(f"  stage {s} | " + " ".join(c.ljust(width) for c in cells).rstrip()
                         + f"   (at most {self.in_flight(s)} microbatch(es) in flight)")
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
            stuck = [f"stage {s} at {acts[next_[s]]} waits for "
                     + ", ".join(f"{a} of stage {t}" for t, a in needs[(s, acts[next_[s]])] if (t, a) not in done)
                     for s, acts in order.items() if next_[s] < len(acts)]
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
        raise PassError(f"schedule: compute nodes run on sub-meshes fixing axes {sorted(axes)}; a pipeline has one "
                        f"stage axis")
    return next(iter(axes), "")


def stages_of(dg: DynamicGraph) -> tuple[int, ...]:
    """The stage indices along :func:`stage_axis` that nodes of ``dg`` run on, in the order the forward of the
    first microbatch reaches them (``(0,)`` for a graph of one stage)."""
    axis = stage_axis(dg)
    seen: dict[int, None] = {}
    for n in dg.nodes:
        if n.pass_ == TaskType.FWD and n.kind == NodeKind.COMPUTE:
            seen.setdefault(dict(n.group.fixed).get(axis, 0), None)
    return tuple(seen) or (0,)


def schedule(dg: DynamicGraph, kind: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B) -> DynamicGraph:
    """The nodes of ``dg`` in the order of pipeline schedule ``kind`` (see the module docstring): the weights'
    casts first, then each (stage, action)'s nodes tick by tick, then the updates. A step of one microbatch keeps
    the order pass expansion made (all forwards, then all backwards: what every schedule is for one microbatch).

    Raises PassError if copy insertion has not run or this pass has, if a forward or backward node runs on no
    single stage of a pipeline, if the schedule deadlocks on this graph, or (after) if the order reads a value
    before it is made."""
    require(dg.done, PassName.SCHEDULE, (PassName.COPY_INSERTION,))
    done = dg.done + (PassName.SCHEDULE,)
    if dg.microbatches == 1:
        return _replace(dg, dg.nodes, done)
    axis, stages = stage_axis(dg), stages_of(dg)
    plan = Schedule(kind, len(stages), dg.microbatches)
    position = {s: k for k, s in enumerate(stages)}
    made_by: dict[str, Key | None] = {}  # value → the action that makes it (None: the prologue)
    first: list[DNode] = []
    by_action: dict[Key, list[DNode]] = {}
    last: list[DNode] = []
    for n in dg.nodes:
        key = _action(n, dg, axis, position)
        if key == _PROLOGUE:
            first.append(n)
        elif key == _EPILOGUE:
            last.append(n)
        else:
            by_action.setdefault(key, []).append(n)
        for v in n.outputs:
            made_by[v] = key if key not in (_PROLOGUE, _EPILOGUE) else None
    needs: dict[Key, set[Key]] = {}
    for key, nodes in by_action.items():
        needs[key] = set()
        for n in nodes:
            for v in n.inputs:
                if (k := made_by.get(v)) is None or k == key:
                    continue
                if k[1].phase == key[1].phase and (k[0] > key[0]) == (key[1].phase == Phase.F) and k[0] != key[0]:
                    raise PassError(f"schedule: {n.name!r} on stage {stages[key[0]]} reads {v!r} from the "
                                    f"{key[1].phase} of stage {stages[k[0]]}: a microbatched pipeline's forward visits "
                                    f"the stages once each, in order (and its backward in reverse); put the module "
                                    f"that makes it on stage {stages[key[0]]} or earlier, or run one microbatch")
                needs[key].add(k)
    order = {s: [a for a in plan.actions(s) if (s, a) in by_action] for s in range(len(stages))}
    ticks = simulate(order, {k: sorted(v, key=str) for k, v in needs.items()})
    nodes = [*first, *(n for t in ticks for s in sorted(t) for n in by_action[(s, t[s])]), *last]
    return _replace(dg, tuple(nodes), done)


_PROLOGUE: Key = (-1, Action(Phase.F, -1))
_EPILOGUE: Key = (-2, Action(Phase.B, -1))


def _action(n: DNode, dg: DynamicGraph, axis: str, position: Mapping[int, int]) -> Key:
    """The (stage position, action) node ``n`` belongs to, or the prologue (a weight's cast) or the epilogue (the
    updates and the gradient norm). A copy belongs with what makes the value it moves (its sender's stage)."""
    if n.kind == NodeKind.CAST:
        return _PROLOGUE
    if n.pass_ == TaskType.UPD:
        return _EPILOGUE
    group = dg.values[n.inputs[0]].group if n.kind == NodeKind.COPY else n.group
    fixed = dict(group.fixed)
    if axis and axis not in fixed and len(position) > 1:
        raise PassError(f"schedule: {n.name!r} runs on {group}, which spans several pipeline stages (axis "
                        f"{axis!r}); a microbatched pipeline needs each forward and backward node on one stage")
    phase = Phase.F if n.pass_ == TaskType.FWD and not n.recompute else Phase.B
    return position[fixed.get(axis, next(iter(position)))], Action(phase, n.micro)


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
    return DynamicGraph(dg.pcg, dg.values, nodes, dg.optimizer, done, dg.grad_norm_sq, dg.microbatches)
