"""Lowering as data: the ordered list of named passes from a PCG to verified per-rank programs
(docs/lowering.md#lowering-from-a-pcg-to-verified-per-rank-programs).

Each :class:`Pass` is a pure function ``(graph, context) -> graph``; each checks before that what it needs
has run and that it has not (and the structural precondition itself, e.g. shard expansion refuses a graph
in which a node reads a value held by another sub-mesh), and after that its work is done (FlexFlow's "none
done before, all done after"). :func:`run_passes` runs them in order, times each and can hand the graph
after any pass to a printer (``shardflow plan --passes`` / ``--dump-after NAME``)::

    pass_expansion → copy_insertion → schedule → shard_expansion → comm_lowering → ordering → verify
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from shardflow.lower import verify as proof
from shardflow.lower.comm_lowering import comm_lowering
from shardflow.lower.copy_insertion import copy_insertion
from shardflow.lower.cost import PLAIN, LowerOptions
from shardflow.lower.dynamic import DynamicGraph, MicroStep, PassError, PassName, UpdateRule
from shardflow.lower.ordering import ordering
from shardflow.lower.pass_expansion import pass_expansion
from shardflow.lower.program import Program
from shardflow.lower.schedule import schedule
from shardflow.lower.shard_expansion import ShardedGraph, shard_expansion
from shardflow.parallel.pcg import PCG


@dataclass(frozen=True, slots=True)
class LowerContext:
    """What the passes need besides the graph. ``optimizer``: the
    :class:`~shardflow.lower.dynamic.UpdateRule` the updates run; ``training``: False lowers the
    forward only;
    ``clip_norm``: clip gradients to this global norm; ``options``: forms of all-gathers/reduce-scatters and
    the bucket size; ``ranks``: the ranks whose programs are built (None: every device); ``grad_norm``: compute
    the global gradient norm even without clipping (the executors expose it after each step); ``micro``: which
    micro-step of an optimizer step under gradient accumulation (default: the plain step)."""

    optimizer: UpdateRule = UpdateRule.SGD
    training: bool = True
    clip_norm: float | None = None
    options: LowerOptions = PLAIN
    ranks: tuple[int, ...] | None = None
    grad_norm: bool = False
    micro: MicroStep = MicroStep()


@dataclass(frozen=True, slots=True)
class Pass:
    """A named lowering pass: ``run(graph, context) -> graph``, with its checks inside."""

    name: PassName
    run: Callable[[Any, LowerContext], Any]
    doc: str


def _verify(sg: ShardedGraph, ctx: LowerContext) -> ShardedGraph:
    if PassName.ORDERING not in sg.done:
        raise PassError(f"pass 'verify' needs ['ordering'] first (passes done: {[str(p) for p in sg.done]})")
    if set(sg.ranks) != set(range(sg.dg.pcg.mesh.size)):
        raise PassError(f"verify needs every rank's program; only ranks {list(sg.ranks)} were lowered")
    proof.verify(sg.programs, sg.dg.pcg.mesh.size)
    return sg


PASSES: tuple[Pass, ...] = (
    Pass(
        PassName.PASS_EXPANSION,
        lambda pcg, c: pass_expansion(
            pcg,
            c.optimizer,
            c.training,
            c.clip_norm,
            c.grad_norm,
            c.micro,
            c.options.reshard_after_forward,
            c.options.ac,
            c.options.precision and c.options.precision.reduce_dtype,
            c.options.microbatches,
            c.options.ac_blocks,
            c.options.regather_activations,
        ),
        "FWD node per op, LOSS seed, BWD node per op, UPD node per weight with optimizer state",
    ),
    Pass(
        PassName.COPY_INSERTION,
        lambda dg, c: copy_insertion(dg),
        "COPY wherever a node reads a value held by another sub-mesh",
    ),
    Pass(
        PassName.SCHEDULE,
        lambda dg, c: schedule(dg, c.options.schedule),
        "nodes in the pipeline schedule's order (GPipe, 1F1B) over the step's microbatches",
    ),
    Pass(
        PassName.SHARD_EXPANSION,
        lambda dg, c: shard_expansion(dg, c.ranks),
        "steps; one invocation per device of each local step, on its pieces",
    ),
    Pass(
        PassName.COMM_LOWERING,
        lambda sg, c: comm_lowering(sg, c.options),
        "parallel ops and copies → collectives, rings, buckets, send/recv",
    ),
    Pass(
        PassName.ORDERING,
        lambda sg, c: ordering(sg, c.options.overlap),
        "global token order; per-rank programs with inputs, frees and process groups",
    ),
    Pass(PassName.VERIFY, _verify, "matching communications, one order, no deadlock, per-rank dataflow"),
)


@dataclass(frozen=True, slots=True)
class PassRecord:
    """One pass of a run: its name, wall time (seconds) and the size of the graph it returned."""

    name: PassName
    seconds: float
    size: str


def size_of(graph: Any) -> str:
    """The size of a pass's graph, in words (nodes, values; or steps and instructions)."""
    if isinstance(graph, PCG):
        return f"{len(graph.nodes)} PCG nodes"
    if isinstance(graph, DynamicGraph):
        return f"{len(graph.nodes)} nodes, {len(graph.values)} values"
    return graph.size()


def run_passes(
    pcg: PCG, ctx: LowerContext, skip: Iterable[str] = (), dump: Mapping[str, Callable[[Any], None]] | None = None
) -> tuple[ShardedGraph, tuple[PassRecord, ...]]:
    """Run :data:`PASSES` on ``pcg`` in order, except those named in ``skip`` (e.g. ``verify`` when only
    some ranks are lowered); ``dump[name](graph)`` is called with the graph after pass ``name``.
    Returns the final graph and one :class:`PassRecord` per pass run. Raises PassError (a pass found the
    graph in a state it cannot work on) or PlanVerificationError (the proof failed)."""
    skip = set(skip)
    if unknown := skip - {str(p.name) for p in PASSES}:
        raise PassError(f"unknown pass(es) {sorted(unknown)}; the passes are {[str(p.name) for p in PASSES]}")
    graph: Any = pcg
    records = []
    with collector_paused():
        for p in PASSES:
            if p.name in skip:
                continue
            t0 = time.perf_counter()
            graph = p.run(graph, ctx)
            records.append(PassRecord(p.name, time.perf_counter() - t0, size_of(graph)))
            if dump and p.name in dump:
                dump[p.name](graph)
    return graph, tuple(records)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused within the block (reference counting still frees what the block
    drops), resumed on the way out, also on an error; a no-op inside another such block. A lowering builds millions
    of small frozen IR values that all stay alive until it returns, and while the collector runs it scans the
    growing heap again and again for cycles there are none of: paused, predicting a 16-microbatch interleaved
    pipeline took 0.45× the time and the 8B/8 search 0.70–0.73× (docs/search.md#search-time)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def lower_programs(
    dg: DynamicGraph, ranks: Iterable[int] | None = None, options: LowerOptions | None = None
) -> dict[int, Program]:
    """Per-rank programs of dynamic graph ``dg`` (after pass expansion and copy insertion) for ``ranks``
    (default: every device): shard expansion, communication lowering and ordering. Deterministic: every rank
    that lowers the same graph gets the same tokens. Raises PassError if copy insertion has not run."""
    if PassName.SCHEDULE not in dg.done:
        dg = schedule(dg, (options or PLAIN).schedule)
    sg = shard_expansion(dg, None if ranks is None else tuple(ranks))
    return dict(ordering(comm_lowering(sg, options)).programs)


def pass_table(records: Iterable[PassRecord]) -> str:
    """The pass log as a table: pass, what it does, time (ms), the graph it returned."""
    docs = {p.name: p.doc for p in PASSES}
    lines = [f"{'pass':<16}{'ms':>9}  {'graph after':<44}what it does"]
    for r in records:
        lines.append(f"{r.name:<16}{r.seconds * 1e3:>9.2f}  {r.size:<44}{docs[r.name]}")
    return "\n".join(lines)
