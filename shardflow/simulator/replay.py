"""Replay per-rank programs as events on a machine spec: the predicted timeline of one training step
(docs/simulator.md#the-replay).

Each simulated rank runs its program in order on one **clock** (the host issues its instructions in order; a
compute runs on the rank's compute stream and the next instruction follows it) and owns two **communication
streams**:

* a :class:`~shardflow.lower.program.Compute` starts when the clock reaches it (after the spec's host overhead per
  instruction) and takes :func:`~shardflow.simulator.cost.compute_seconds` — longer by the spec's ``contention`` for
  the part of it that runs while a communication of its rank is in flight; on a spec without overlap it waits for
  both communication streams to drain first;
* a :class:`~shardflow.lower.program.Comm` is *issued* when the clock reaches it; it *starts* once every
  simulated member has issued it and every member's stream of its kind has finished the communications each
  issued before it on that stream, and takes :func:`~shardflow.simulator.cost.comm_seconds`; a blocking one
  (``wait``) holds the clock until it ends, an asynchronous one until its :class:`~shardflow.lower.program.Wait`.
  A rank has two streams, each in issue order (the token order): one for the collectives and one for the
  point-to-point kinds (sends, receives, collective-permute steps), as the executor issues those on the world group
  and the collectives on their members' groups — other communicators, so a send waiting for its receiver does not
  hold a collective issued after it (docs/simulator.md#the-replay);
* a :class:`~shardflow.lower.program.Free` takes no time.

Time a rank's clock spends held by a communication is **exposed communication**, or **pipeline bubble** when it
waits to receive a transfer from another pipeline stage. A step of several micro-steps (gradient accumulation) replays
their programs one after the other on the same clocks. Tokens are one global order that the verifier proved every
rank follows, so the replay cannot deadlock on verified programs; a program set that would (a hand-built one)
raises :class:`SimulationError` naming the ranks and what each waits for.

Ranks whose programs are the same up to the ranks they talk to need not all be replayed (:mod:`shardflow.simulator.
estimate` replays one per class): a member of a communication that is not simulated is taken to issue it when the
simulated members do.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from shardflow.lower.dynamic import NodeKind, TaskType
from shardflow.lower.program import Comm, Compute, Free, Program, Wait
from shardflow.parallel.collectives import KINDS, CommKind
from shardflow.simulator.cost import EAGER, Kernels, comm_seconds, compute_seconds, fusable

if TYPE_CHECKING:
    from shardflow.simulator.machine import MachineSpec


class SimulationError(RuntimeError):
    """The programs cannot be replayed to the end: some rank waits for a communication another never issues."""


@dataclass(frozen=True, slots=True)
class Event:
    """One interval of the predicted timeline: ``rank``, ``stream`` (``compute`` or ``comm``), ``name`` (the
    instruction: op or communication kind), ``category`` (a :class:`Breakdown` field), ``start`` and ``seconds``."""

    rank: int
    stream: str
    name: str
    category: str
    start: float
    seconds: float


@dataclass
class Breakdown:
    """Where one rank's step time goes, in seconds; the fields add up to the step's end on that rank.

    ``compute``: forward, loss and backward kernels (recomputation apart); ``recompute``: forwards run again before
    their block's backward (activation checkpointing); ``optimizer``: updates, gradient norms and the other
    update-time kernels; ``exposed_comm``: the clock held by a communication (its time not hidden behind compute);
    ``bubble``: the clock held by a receive from another pipeline stage (waiting for that stage);
    ``overhead``: the host's time per instruction (the spec's ``instr_overhead_s``)."""

    compute: float = 0.0
    recompute: float = 0.0
    optimizer: float = 0.0
    exposed_comm: float = 0.0
    bubble: float = 0.0
    overhead: float = 0.0

    def total(self) -> float:
        return self.compute + self.recompute + self.optimizer + self.exposed_comm + self.bubble + self.overhead


@dataclass(frozen=True)
class Timeline:
    """The predicted step: ``seconds`` (the last rank's end), each simulated rank's end and :class:`Breakdown`, and
    the ``events`` (empty unless asked for)."""

    seconds: float
    ends: Mapping[int, float]
    breakdown: Mapping[int, Breakdown]
    events: tuple[Event, ...] = ()


@dataclass
class _Comm:
    instr: Comm
    holders: frozenset[int]
    duration: float
    issued: dict[int, float] = field(default_factory=dict)
    end: float | None = None


@dataclass
class _Stream:
    free: float = 0.0  # when it has finished what was started on it
    queue: list[int] = field(default_factory=list)  # issued, not yet started tokens, in issue order


@dataclass
class _Rank:
    program: Program
    clock: float = 0.0
    collectives: _Stream = field(default_factory=_Stream)
    p2p: _Stream = field(default_factory=_Stream)  # sends, receives, collective-permute steps
    pos: int = 0
    mine: dict[int, Comm] = field(default_factory=dict)  # token → this rank's side of it
    breakdown: Breakdown = field(default_factory=Breakdown)
    fusing: bool = False  # its last instruction was a compute a fused kernel may go on from (Kernels)
    computes: int = 0  # computes run so far

    def stream(self, c: Comm) -> _Stream:
        """The stream ``c`` goes on."""
        return self.p2p if KINDS[c.kind].point_to_point else self.collectives


def _category(c: Compute, recomputed: Callable[[str], bool]) -> str:
    if c.task == TaskType.UPD:
        return "optimizer"
    return "recompute" if recomputed(c.dnode) else "compute"


def replay(
    steps: Sequence[Mapping[int, Program]],
    spec: MachineSpec,
    recomputed: Callable[[str], bool] = lambda dnode: False,
    events: bool = False,
    kernels: Kernels = EAGER,
    measured: Mapping[int, Sequence[float]] | None = None,
    clocks: Mapping[int, list[tuple[float, float]]] | None = None,
) -> Timeline:
    """Replay ``steps`` — the micro-steps of one optimizer step, each the programs of the same simulated ranks —
    on ``spec``, one after the other. ``recomputed(dnode)``: whether a compute's dynamic-graph node is a
    recomputation (its time counts as ``recompute``). ``events``: keep every interval (for a trace). ``kernels``:
    how the computes run (:class:`~shardflow.simulator.cost.Kernels`; default one eager kernel each).
    ``measured``: instead, each rank's computes take these seconds, in program order, 0 past the end (a
    measured step, whose trace times the optimizer's updates as one: the
    timeline then differs from the measured one exactly where the spec's communication does; ``shardflow train
    --trace``). ``clocks``: where given, each rank's list receives, per instruction replayed, its clock after it and
    the bubble so far (seconds; :mod:`~shardflow.simulator.compose` reads a pipeline's actions off them). Raises
    SimulationError where the programs cannot run to the end."""
    ranks = {r: _Rank(p) for r, p in (steps[0].items() if steps else ())}
    out: list[Event] = []
    for progs in steps:
        if set(progs) != set(ranks):
            raise SimulationError(f"micro-steps replay ranks {sorted(progs)}, the first {sorted(ranks)}")
        holders: dict[int, set[int]] = defaultdict(set)
        for r, p in progs.items():
            ranks[r].program, ranks[r].pos, ranks[r].mine = p, 0, {}
            for c in p.comms:
                holders[c.token].add(r)
        comms: dict[int, _Comm] = {}
        for r, p in progs.items():
            for c in p.comms:
                if c.token not in comms:
                    comms[c.token] = _Comm(c, frozenset(holders[c.token]), comm_seconds(c, spec))
        _run(ranks, comms, spec, recomputed, out if events else None, kernels, measured, clocks)
    ends = {r: s.clock for r, s in ranks.items()}
    return Timeline(max(ends.values(), default=0.0), ends, {r: s.breakdown for r, s in ranks.items()}, tuple(out))


def _run(
    ranks: dict[int, _Rank],
    comms: dict[int, _Comm],
    spec: MachineSpec,
    recomputed: Callable[[str], bool],
    out: list[Event] | None,
    kernels: Kernels,
    measured: Mapping[int, Sequence[float]] | None,
    clocks: Mapping[int, list[tuple[float, float]]] | None = None,
) -> None:
    def start_ready() -> None:
        """Start every issued communication that heads its stream's queue on each of its holders."""
        moved = True
        while moved:
            moved = False
            for s in ranks.values():
                for stream in (s.collectives, s.p2p):
                    if not stream.queue:
                        continue
                    st = comms[stream.queue[0]]
                    on = [ranks[h].stream(st.instr) for h in st.holders]
                    if len(st.issued) < len(st.holders) or any(o.queue[0] != st.instr.token for o in on):
                        continue
                    begin = max(max(st.issued.values()), max(o.free for o in on))
                    st.end = begin + st.duration
                    for h, o in zip(st.holders, on):
                        o.free = st.end
                        o.queue.pop(0)
                        if out is not None:
                            name = f"#{st.instr.token} {st.instr.kind}" + ("" if st.instr.wait else " (async)")
                            out.append(Event(h, "comm", name, "comm", begin, st.duration))
                    moved = True

    def hold(s: _Rank, st: _Comm, own: Comm) -> None:
        assert st.end is not None
        if st.end > s.clock:
            waited = st.end - s.clock
            if own.axis == NodeKind.COPY and own.kind == CommKind.RECV:
                s.breakdown.bubble += waited
            else:
                s.breakdown.exposed_comm += waited
            s.clock = st.end

    def step(r: int, s: _Rank) -> bool:
        """Run rank ``r``'s next instruction if it can; False when it must wait for another rank."""
        i = s.program.instrs[s.pos]
        if isinstance(i, Compute):
            busy = max(s.collectives.free, s.p2p.free)  # when its communications in flight end
            if not spec.overlap and busy > s.clock:
                s.breakdown.exposed_comm += busy - s.clock
                s.clock = busy
            s.clock += spec.instr_overhead_s
            s.breakdown.overhead += spec.instr_overhead_s
            if measured is not None:  # a measured step: contention and fusion are in its times already
                times = measured[r]
                seconds = times[s.computes] if s.computes < len(times) else 0.0
            else:
                joins = fusable(i, kernels)
                seconds = compute_seconds(i, spec, kernels, fused=s.fusing and joins)
                s.fusing = joins
                overlapped = max(0.0, min(s.clock + seconds, busy) - s.clock)
                seconds += overlapped * (spec.contention - 1.0)
            s.computes += 1
            category = _category(i, recomputed)
            setattr(s.breakdown, category, getattr(s.breakdown, category) + seconds)
            if out is not None:
                out.append(Event(r, "compute", f"{i.task} {i.op}", category, s.clock, seconds))
            s.clock += seconds
        elif isinstance(i, Comm):
            s.fusing = False
            st = comms[i.token]
            if r not in st.issued:
                s.clock += spec.instr_overhead_s
                s.breakdown.overhead += spec.instr_overhead_s
                st.issued[r] = s.clock
                s.stream(i).queue.append(i.token)
                s.mine[i.token] = i
                start_ready()
            if i.wait:
                if st.end is None:
                    return False
                hold(s, st, i)
        elif isinstance(i, Wait):
            st = comms[i.token]
            if st.end is None:
                return False
            hold(s, st, s.mine[i.token])
        elif not isinstance(i, Free):
            raise SimulationError(f"rank {r}: instruction {s.pos} ({i!r}) is of no kind the replay knows")
        s.pos += 1
        if clocks is not None:
            clocks[r].append((s.clock, s.breakdown.bubble))
        return True

    active = [r for r, s in ranks.items() if s.pos < len(s.program.instrs)]
    while active:
        progressed = False
        for r in active:
            s = ranks[r]
            while s.pos < len(s.program.instrs) and step(r, s):
                progressed = True
        active = [r for r in active if ranks[r].pos < len(ranks[r].program.instrs)]
        if active and not progressed:
            stuck = "; ".join(
                f"rank {r} at instruction {ranks[r].pos}: {ranks[r].program.instrs[ranks[r].pos]}" for r in active
            )
            raise SimulationError(f"the programs cannot run to the end (deadlock): {stuck}")
