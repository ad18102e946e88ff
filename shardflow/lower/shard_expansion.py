"""Shard expansion (docs/lowering.md#3-shard-expansion-shardflowlowershard_expansion): the dynamic graph → one
invocation per device of each local step.

The dynamic graph is grouped into lowering **steps**: one node, or a Reduction/Combine fused with the
Repartition after it on the same axis (a reduce-scatter, an all-to-all). A step is *local* — a compute op,
gradient sum, loss seed, update, gradient-norm sum, Replicate's backward keeping the root copy, a
Repartition of replicas (each device keeps its block), or any parallel op along an axis of one device (an
alias: nothing moves) — or a *communication*, named by the one table :data:`LOWERING` and left to
communication lowering. Each local step becomes one invocation per device of its sub-mesh, on that device's
pieces (every buffer at its piece size). Only the requested ranks are expanded, with mesh
arithmetic rather than enumeration, so a rank expands its own program at a cost that does not grow with
the world size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping

from shardflow.graph.layout import HeadTail, Padded
from shardflow.graph.ops import TensorType
from shardflow.lower.copy_insertion import cross_submesh_reads
from shardflow.lower.dynamic import DNode, DynamicGraph, NodeKind, PassError, PassName, TaskType, Value, require
from shardflow.lower.program import (
    Block,
    Buffer,
    Compute,
    Convert,
    Forward,
    Group,
    Instr,
    Keep,
    KernelSpec,
    OnesLike,
    Program,
    Sum,
    SumOfSquares,
    Update,
    Vjp,
)
from shardflow.parallel.collectives import REDISTRIBUTION, CommKind, LocalKind, fuses, padded_shape
from shardflow.parallel.mesh import SubMesh
from shardflow.parallel.ops import RepartitionOp, ReplicateOp
from shardflow.parallel.sharding import Sharding

# (parallel op kind[, fused Repartition's kind or the pass]) → the communication that carries it out
# (docs/lowering.md#4-communication-lowering): the one table from which every parallel op is lowered — a
# redistribution's steps as the planner prices them (REDISTRIBUTION), and a Replicate, forward and backward.
LOWERING: dict[tuple[str, ...], CommKind | LocalKind] = {
    **REDISTRIBUTION,
    (ReplicateOp.kind, TaskType.FWD): CommKind.BROADCAST,
    (ReplicateOp.kind, TaskType.BWD): CommKind.REDUCE,
}
# Steps each device runs on its own pieces; every other step (parallel ops by LOWERING, copies) communicates.
LOCAL_STEPS = frozenset(
    {
        LocalKind.SPLIT,
        LocalKind.ALIAS,
        NodeKind.SUMSQ,
        NodeKind.COMPUTE,
        NodeKind.SEED,
        NodeKind.SUM,
        NodeKind.UPDATE,
        NodeKind.SELECT,
        NodeKind.CAST,
    }
)


@functools.lru_cache(maxsize=1 << 16)
def piece(v: Value) -> Buffer:
    """The buffer one device holds of value ``v`` (its piece shape). Cached: lowering asks for the same
    value's piece many times (shard expansion clears the cache when a new lowering starts)."""
    return Buffer(v.id, TensorType(piece_shape(v.sharding, v.group, v.type.shape), v.type.dtype))


@functools.lru_cache(maxsize=1 << 12)  # the values of a step share few shardings and shapes (each microbatch's alike)
def piece_shape(sharding: Sharding, group: SubMesh, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one device's piece of a tensor of ``shape`` held by ``sharding`` on ``group``."""
    return sharding.parallel_shape(group, shape).piece_shape


@functools.lru_cache(maxsize=1 << 12)
def layout_change(vin: Value, vout: Value) -> tuple[HeadTail | None, HeadTail | None]:
    """(to storage, to natural): a step from ``vin`` to ``vout`` that puts a dim into the load-balanced layout
    (docs/concepts.md#the-load-balanced-layout) — each input piece, one segment of the layout in natural order,
    reordered to head-tail order before it is cut — and one that takes a dim out of it — each output piece put back
    in natural order; as a :class:`HeadTail` of the piece (None where the step does neither). Raises PassError
    where the natural side's piece is not one segment (the dim sharded there by axes other than those before the
    balanced one)."""
    layouts: list[HeadTail | None] = []
    for a, b in ((vin, vout), (vout, vin)):
        had = {h.dim for h in a.sharding.head_tail(a.group, a.type.shape)}
        gained = [h for h in b.sharding.head_tail(b.group, b.type.shape) if h.dim not in had]
        if not gained:
            layouts.append(None)
            continue
        (h,) = gained
        axes, axis = b.sharding.dims[h.dim], b.group.mesh.balanced.axis  # type: ignore[union-attr]
        if a.sharding.dims[h.dim] != axes[: axes.index(axis)]:
            raise PassError(
                f"value {a.id!r} {a.sharding} → {b.id!r} {b.sharding}: the load-balanced layout of dim {h.dim} "
                f"needs the mesh axes that shard it before {axis!r} to shard it on both sides; "
                f"give --cp-layout contiguous"
            )
        layouts.append(HeadTail(h.dim, h.chunks, h.length // h.segments))
    return layouts[0], layouts[1]


def padding(v: Value, dim: int, degree: int) -> Padded | None:
    """Dim ``dim`` of one device's piece of value ``v`` padded to ``degree`` equal blocks, where ``degree`` does not
    divide it (docs/concepts.md#uneven-shards): the whole side of a communication or split that cuts that dim into
    uneven blocks or joins it from them. None where it divides."""
    shape = piece(v).type.shape
    return Padded(dim, shape[dim], padded_shape(shape, dim, degree)[dim]) if shape[dim] % degree else None


def uneven(v: Value) -> bool:
    """Whether value ``v`` has an uneven dim (its pieces padded: docs/concepts.md#uneven-shards)."""
    return bool(v.sharding.uneven_dims(v.group, v.type.shape))


# --- mesh arithmetic: groups along an axis, without enumerating the mesh ---------------------------------
@functools.lru_cache(maxsize=1 << 16)  # asked for every communication of every rank: a pure function of its arguments
def axis_members(group: SubMesh, axis: str, device: int) -> tuple[int, ...]:
    """The devices of ``group`` that differ from ``device`` only in their coordinate on ``axis``, in order."""
    c = group.coords(device)
    return tuple(group.device_of(c | {axis: i}) for i in range(group.mesh.axis_size(axis)))


def axis_group_index(group: SubMesh, axis: str | tuple[str, ...], device: int) -> int:
    """Index of ``device``'s axis group among all groups of ``group`` along ``axis`` (row-major in the others); a
    tuple of axes: its group along all of them at once (a flattened axis)."""
    c = group.coords(device)
    along = (axis,) if isinstance(axis, str) else axis
    idx = 0
    for a, s in zip(group.free_axes, group.free_shape):
        if a not in along:
            idx = idx * s + c[a]
    return idx


def device_index(group: SubMesh, device: int) -> int:
    """Row-major index of ``device`` among the devices of ``group``."""
    return group.index(device)


def in_group(group: SubMesh, device: int) -> bool:
    return group.index(device) is not None


@dataclass(frozen=True)
class Step:
    """A unit of lowering: one dynamic-graph node, or a fused pair of parallel-op nodes. ``kind``: the node's
    kind, or for a parallel op its communication or local kind from :data:`LOWERING`."""

    nodes: tuple[DNode, ...]
    kind: NodeKind | CommKind | LocalKind

    @property
    def local(self) -> bool:
        """True for a step each device runs on its own pieces (no communication)."""
        return self.kind in LOCAL_STEPS


def steps(dg: DynamicGraph) -> list[Step]:
    """Group the nodes into lowering steps, fusing Reduction→Repartition and Combine→Repartition pairs on
    one axis when nothing else reads the intermediate value."""
    readers: dict[str, int] = {}
    for n in dg.nodes:
        for v in n.inputs:
            readers[v] = readers.get(v, 0) + 1
    out: list[Step] = []
    nodes = list(dg.nodes)
    i = 0
    while i < len(nodes):
        n = nodes[i]
        if n.kind == NodeKind.PARALLEL and n.op.degree == 1:  # an axis of one device: nothing moves
            out.append(Step((n,), LocalKind.ALIAS))
            i += 1
            continue
        if n.kind == NodeKind.PARALLEL and i + 1 < len(nodes):
            m = nodes[i + 1]
            if (
                m.kind == NodeKind.PARALLEL
                and fuses(n.op, m.op)
                and m.inputs == n.outputs
                and readers.get(n.outputs[0], 0) == 1
            ):
                out.append(Step((n, m), LOWERING[(n.op.kind, m.op.kind)]))
                i += 2
                continue
        if n.kind == NodeKind.PARALLEL:
            key = (n.op.kind, n.task) if isinstance(n.op, ReplicateOp) else (n.op.kind,)
            out.append(Step((n,), LOWERING[key]))
        else:
            out.append(Step((n,), n.kind))
        i += 1
    return out


@dataclass(frozen=True)
class ShardedGraph:
    """The step after shard expansion, for the lowered ``ranks``: the dynamic graph grouped into ``steps``,
    and per rank, per step, the instructions it runs (``instrs``). Communication lowering fills the
    communication steps — ``deferred``: per rank, per step, instructions that wait until something reads what
    they fill (a gradient bucket's Wait and unpack) — with tokens relative to the step, and ``tokens``: per step,
    how many communications (tokens) it makes, and ``groups``: the process group of every collective, in the one
    order every rank creates them; ordering numbers the tokens globally and makes the ``programs``.
    ``done``: the passes applied so far."""

    dg: DynamicGraph
    ranks: tuple[int, ...]
    steps: tuple[Step, ...]
    instrs: Mapping[int, tuple[tuple[Instr, ...], ...]]
    deferred: Mapping[int, tuple[tuple[Instr, ...], ...]] = field(default_factory=dict)
    tokens: tuple[int, ...] = ()
    groups: tuple[Group, ...] = ()
    programs: Mapping[int, Program] | None = None
    done: tuple[str, ...] = ()

    def size(self) -> str:
        """Instructions so far, summed over the lowered ranks (for the pass log)."""
        n = sum(len(x) for per in self.instrs.values() for x in per)
        return f"{len(self.steps)} steps, {n} instructions on {len(self.ranks)} rank(s)"

    def listing(self) -> str:
        """Per rank, per step: the step's kind and nodes, then its instructions (tokens relative to the step
        until ordering has run; then the programs' listings)."""
        if self.programs is not None:
            return "\n".join(p.listing() for _, p in sorted(self.programs.items()))
        lines = []
        for r in self.ranks:
            lines.append(f"rank {r}:")
            for k, st in enumerate(self.steps):
                instrs = self.instrs[r][k] + (self.deferred[r][k] if self.deferred else ())
                if instrs:
                    lines.append(f"  step {k} {st.kind}: {' + '.join(n.name for n in st.nodes)}")
                    lines += [f"    {i}" for i in instrs]
        return "\n".join(lines)


def shard_expansion(dg: DynamicGraph, ranks: tuple[int, ...] | None = None) -> ShardedGraph:
    """Group ``dg`` into steps and expand each local step on every rank of ``ranks`` (default: every device
    of the mesh). Raises PassError if copy insertion has not run (a node would read a value held by another
    sub-mesh) or the pass has run already."""
    require(dg.done, PassName.SHARD_EXPANSION, (PassName.PASS_EXPANSION, PassName.COPY_INSERTION))
    if bad := cross_submesh_reads(dg):
        n, v = bad[0]
        raise PassError(f"shard expansion: {n!r} reads {v!r}, held by another sub-mesh; run copy insertion first")
    ranks = tuple(range(dg.pcg.mesh.size)) if ranks is None else tuple(ranks)
    if bad := [r for r in ranks if not 0 <= r < dg.pcg.mesh.size]:
        raise PassError(
            f"shard expansion: ranks {bad} are not devices of mesh {dg.pcg.mesh} ({dg.pcg.mesh.size} devices)"
        )
    piece.cache_clear()  # one cache per lowering: pieces of this graph's values only
    all_steps = tuple(steps(dg))
    instrs = {r: tuple(tuple(_expand_local(st, dg, r)) if st.local else () for st in all_steps) for r in ranks}
    return ShardedGraph(dg, ranks, all_steps, instrs, done=dg.done + (PassName.SHARD_EXPANSION,))


def kernel(n: DNode, dg: DynamicGraph, r: int) -> KernelSpec:
    """The kernel rank ``r`` runs for local node ``n`` (a member of its sub-mesh), with everything it needs: the
    rule's local op on r's block (:meth:`~shardflow.parallel.pcg.PCG.local_of`) and, for a random op, where r's piece lies; the gradient masks of a backward; the state slots
    of an update; the block r keeps of a Repartition of replicas."""
    if n.kind == NodeKind.COMPUTE:
        src = dg.sources[n.src]
        draw = dg.pcg.piece_site(src, r).within(n.micro, dg.microbatches) if src.op.random else None
        local = dg.pcg.local_of(src, r)
        if n.task == TaskType.FWD:  # records for its backward unless the op is recomputed and this is the first run
            bwd = dg.backward_of.get(n.src)
            keeps = bwd is not None and (n.recompute or n.src not in dg.recomputed)
            return Forward(local, draw, bwd.grad_mask if keeps else ())
        dtypes = tuple(dg.values[v].type.dtype for v in n.outputs)  # a master dtype under mixed precision
        return Vjp(local, draw, n.grad_mask, n.unscale, n.dy_mask, dtypes)
    if n.kind == NodeKind.SEED:
        return OnesLike(n.scale)
    if n.kind == NodeKind.SUM:
        return Sum()
    if n.kind == NodeKind.UPDATE:
        return Update(tuple(dg.values[v].slot for v in n.inputs[2 : len(n.inputs) - (n.clip > 0)]), n.clip)
    if n.kind == NodeKind.SUMSQ:
        return SumOfSquares()
    if n.kind == NodeKind.CAST:
        return Convert(dg.values[n.outputs[0]].type.dtype)
    if n.kind == NodeKind.PARALLEL and n.op.degree > 1:  # a Repartition of replicas: r keeps its block of the dim
        op = n.op
        assert isinstance(op, RepartitionOp), n.name
        vin = dg.values[n.inputs[0]]
        layout = layout_change(vin, dg.values[n.outputs[0]])[0] or padding(vin, op.dim, op.degree)
        return Block(op.dim, op.degree, n.group.coords(r)[op.axis], layout)
    if n.kind in (
        NodeKind.SELECT,
        NodeKind.COPY,
        NodeKind.PARALLEL,
    ):  # the piece is already here; an axis of one device
        return Keep()
    raise PassError(f"shard expansion: no kernel for {n.name!r} of kind {n.kind!r}")


def _compute_op(n: DNode, dg: DynamicGraph) -> str:
    """The op a local node's instruction shows: a compute node's label, else what the node does."""
    if n.kind == NodeKind.COMPUTE:
        return n.label
    return {
        NodeKind.SEED: "ones",
        NodeKind.SUM: "sum",
        NodeKind.UPDATE: f"{dg.optimizer}_update",
        NodeKind.SELECT: "keep_root",
        NodeKind.CAST: n.label,
    }[n.kind]


def _expand_local(st: Step, dg: DynamicGraph, r: int) -> list[Instr]:
    """The invocations of local step ``st`` on rank ``r``, on its pieces."""
    first, last = st.nodes[0], st.nodes[-1]
    vin, vout = dg.values[first.inputs[0]] if first.inputs else None, dg.values[last.outputs[0]]
    # A Repartition of replicas: each device keeps its block, a local slice; any parallel op of degree 1: the
    # same piece.
    if st.kind in (LocalKind.SPLIT, LocalKind.ALIAS):
        if not in_group(first.group, r):
            return []
        op = first.op.describe() if st.kind == LocalKind.SPLIT else "alias"
        return [
            Compute(first.task, first.src, op, (piece(vin),), (piece(vout),), first.name, kernel=kernel(first, dg, r))
        ]
    if st.kind == NodeKind.SUMSQ:  # the gradient pieces this rank holds, one replica of each counted
        held = tuple(
            piece(dg.values[v])
            for v in first.inputs
            if in_group(dg.values[v].group, r) and dg.values[v].sharding.coord_of(dg.values[v].group, r).replica == 0
        )
        return [
            Compute(
                first.task,
                "grad_norm",
                "sum_of_squares",
                held,
                (piece(vout),),
                first.name,
                kernel=kernel(first, dg, r),
            )
        ]
    if st.kind in (NodeKind.COMPUTE, NodeKind.SEED, NodeKind.SUM, NodeKind.UPDATE, NodeKind.SELECT, NodeKind.CAST):
        if not in_group(first.group, r) or (st.kind == NodeKind.SELECT and not in_group(vout.group, r)):
            return []
        ins = tuple(piece(dg.values[v]) for v in first.inputs)
        outs = tuple(piece(dg.values[v]) for v in first.outputs)
        return [
            Compute(
                first.task,
                first.src,
                _compute_op(first, dg),
                ins,
                outs,
                first.name,
                kernel=kernel(first, dg, r),
                micro=first.micro,
            )
        ]
    raise PassError(f"shard expansion: step {st.kind!r} of {first.name!r} is not a local step")
