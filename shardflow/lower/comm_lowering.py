"""Communication lowering (docs/lowering.md#4-communication-lowering): the communication steps of a sharded graph →
communications.

From the one table :data:`~shardflow.lower.shard_expansion.LOWERING`: along the mesh axis a parallel op acts
on, every group of devices that differ only in that axis runs one collective — Reduction → all-reduce;
Reduction then Repartition on the same axis → reduce-scatter; Combine → all-gather; Combine then Repartition
of another dim on the same axis → all-to-all; Replicate → broadcast from the root; Replicate's backward →
reduce to the root; copies → send/recv, one per piece, issued by the device that holds it (a piece whose
source and destination device coincide moves nowhere). All-gathers and reduce-scatters may instead run as
rings of collective-permutes (all-gathers also as broadcast loops), chosen by the cost model
(:class:`~shardflow.lower.cost.LowerOptions`); final gradient all-reduces are packed into buckets, and the
all-gathers of one block's weights (FSDP) into one all-gather per block and pass.
``nbytes`` is what one rank puts on the wire (:func:`~shardflow.parallel.collectives.wire_bytes`, the one byte
formula of every communication kind). Tokens are relative to their step here; ordering makes them global.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterator, Mapping, NamedTuple

from shardflow.graph.dispatch import ExpertCombine, ExpertRoute, ExpertsLocal
from shardflow.graph.graph import TensorRole
from shardflow.graph.layout import HeadTail, Padded
from shardflow.graph.ops import Attention, Experts, TensorType
from shardflow.lower.cost import PLAIN, CommForm, CPAttention, EPDispatch, LowerOptions
from shardflow.lower.dynamic import (
    DNode,
    DynamicGraph,
    NodeKind,
    PassError,
    PassName,
    TaskType,
    Value,
    block_of,
    forward_id,
    require,
)
from shardflow.lower.program import BlockVjp, Buffer, Comm, Compute, Forward, Group, Instr, Program, Vjp, Wait
from shardflow.lower.shard_expansion import (
    ShardedGraph,
    Step,
    axis_group_index,
    axis_members,
    device_index,
    in_group,
    kernel,
    layout_change,
    padding,
    piece,
    steps,
    uneven,
)
from shardflow.parallel.collectives import CommKind, padded_shape, wire_bytes
from shardflow.parallel.mesh import ReduceOp, SubMesh
from shardflow.parallel.ops import CombineOp, RepartitionOp
from shardflow.parallel.rules import LocalOp


@dataclass(frozen=True)
class AttentionRing:
    """A forward ``attention`` whose keys and values, all-gathered by ``k`` and ``v`` along the sequence, travel
    around a ring of collective-permutes instead (``--cp-attention ring``; docs/lowering.md#16-ring-attention---cp-attention-ring).
    ``backward``: the attention's backward, run as a ring too, in place of the reduce-scatters ``scatters`` of the
    key and value gradients (None where the backward reads the gathered keys and values as they are). ``joined``:
    whether the forward joins the gathered keys and values at the end, for readers other than the rings."""

    attention: DNode
    k: DNode
    v: DNode
    backward: DNode | None = None
    scatters: tuple[Step, Step] | None = None
    joined: bool = True


@dataclass(frozen=True)
class ExpertDispatch:
    """A forward expert layer ``experts`` whose tokens, routings and routing weights are all-gathered by ``gathers``
    over the ``ep`` axis that splits its experts, and whose output's partial sums are reduce-scattered back by
    ``scatter``: under ``--ep-dispatch all_to_all`` the tokens travel to their experts' ranks and back by two
    all-to-alls of the routing's sizes instead (docs/lowering.md#17-the-all-to-all-token-dispatcher---ep-dispatch-all_to_all).
    ``backward``: its backward, run the same way in place of the all-gather ``dout`` of the output's gradient and
    the reduce-scatters ``scatters`` of the gradients of the tokens (input 0) and routing weights (input 2, where
    they get one); None where the step has no backward for it (evaluation, a forward run again for the
    recomputation that the backward reads instead). ``capacity``: the rows each rank sends each expert at most
    (``--capacity-factor``: all-to-alls of fixed size), 0 for no capacity (dropless)."""

    experts: DNode
    gathers: tuple[DNode, DNode, DNode]
    scatter: Step
    backward: DNode | None = None
    dout: DNode | None = None
    scatters: Mapping[int, Step] = dataclasses.field(default_factory=dict)
    capacity: int = 0


@dataclass(frozen=True)
class Decisions:
    """Decisions lowering takes once for the whole graph (so every rank takes the same ones): the form of each
    all-gather / reduce-scatter step, and the consumer computes fused into a ring or broadcast loop."""

    dg: DynamicGraph
    forms: Mapping[str, CommForm]
    fused: Mapping[str, tuple[DNode, ...]]
    buckets: tuple[tuple[DNode, ...], ...] = ()
    gathers: tuple[tuple[DNode, ...], ...] = ()
    scatters: tuple[tuple[Step, ...], ...] = ()
    flat: Mapping[str, DNode] = dataclasses.field(default_factory=dict)
    rings: Mapping[str, AttentionRing] = dataclasses.field(default_factory=dict)
    overlap: bool = True
    # HSDP: gradient bucket → the reduce-scatter bucket at whose step it is issued (the next of its sub-mesh, after
    # the one whose pieces it all-reduces: that reduce-scatter travels while the next block's backward computes)
    later: Mapping[int, int] = dataclasses.field(default_factory=dict)
    # expert layer → its all-to-all token dispatch (--ep-dispatch all_to_all)
    dispatches: Mapping[str, ExpertDispatch] = dataclasses.field(default_factory=dict)

    @cached_property
    def issued_at(self) -> dict[int, int]:
        """Reduce-scatter bucket → the gradient bucket :attr:`later` issues at its step, before it."""
        return {k: b for b, k in self.later.items()}

    @cached_property
    def ring_steps(self) -> frozenset[str]:
        """The all-gathers and reduce-scatters (by their first node) :attr:`rings` run: they make no communication
        of their own."""
        gathers = {x.name for ring in self.rings.values() for x in (ring.k, ring.v)}
        return frozenset(gathers | {st.nodes[0].name for ring in self.rings.values() for st in ring.scatters or ()})

    @cached_property
    def ring_backwards(self) -> dict[str, AttentionRing]:
        """The backward node of each ring of :attr:`rings` that has one (:attr:`AttentionRing.backward`) → the ring."""
        return {ring.backward.name: ring for ring in self.rings.values() if ring.backward is not None}

    @cached_property
    def dispatch_backwards(self) -> dict[str, ExpertDispatch]:
        """The backward node of each dispatch of :attr:`dispatches` that has one → the dispatch."""
        return {x.backward.name: x for x in self.dispatches.values() if x.backward is not None}

    @cached_property
    def dispatch_steps(self) -> frozenset[str]:
        """The all-gathers and reduce-scatters (by their first node) that :attr:`dispatches` replace: they make no
        communication of their own."""
        steps = [st for x in self.dispatches.values() for st in (x.scatter, *x.scatters.values())]
        gathers = [g for x in self.dispatches.values() for g in (*x.gathers, x.dout) if g is not None]
        return frozenset({g.name for g in gathers} | {st.nodes[0].name for st in steps})

    @property
    def suppressed(self) -> set[str]:
        return {c.name for cs in self.fused.values() for c in cs}

    @cached_property
    def flat_first(self) -> frozenset[str]:
        """The all-reduces that :attr:`flat` folds into the next one: they make no communication of their own."""
        return frozenset(n.name for n in self.flat.values())

    def axes(self, n: DNode) -> tuple[str, ...]:
        """The mesh axes all-reduce ``n`` runs along: its own, and the one before it where :attr:`flat` folds
        the two into one all-reduce over both (a flattened axis, in mesh order)."""
        first = self.flat.get(n.name)
        if first is None:
            return (_axis(n),)
        return tuple(a for a in n.group.mesh.axis_names if a in (_axis(first), _axis(n)))

    def source(self, n: DNode) -> str:
        """The value all-reduce ``n`` reads: its input, or the input of the all-reduce :attr:`flat` folds into it."""
        return self.flat[n.name].inputs[0] if n.name in self.flat else n.inputs[0]

    @cached_property
    def bucket_of(self) -> dict[str, int]:
        """Node name → index of its gradient bucket."""
        return {n.name: k for k, b in enumerate(self.buckets) for n in b}

    @cached_property
    def gather_of(self) -> dict[str, int]:
        """Node name → index of its weight all-gather bucket."""
        return {n.name: k for k, b in enumerate(self.gathers) for n in b}

    @cached_property
    def gather_issue(self) -> dict[str, tuple[int, ...]]:
        """Node name → the weight all-gather buckets issued at its step, in order: each bucket one bucket ahead of
        its use (prefetch, as FSDP2's): bucket j + 1 of a pass and sub-mesh axis is issued where bucket j's first
        member is — while block j computes — and the first bucket at its own first member, with the second."""
        issue: dict[str, list[int]] = {}
        head: dict[tuple, DNode] = {}  # per (pass, sub-mesh, axis): the first member of the bucket issued last
        for k, b in enumerate(self.gathers):  # in the order of their first members
            key = (b[0].task, b[0].group, b[0].op.axis)
            issue.setdefault(head.get(key, b[0]).name, []).append(k)
            head[key] = b[0]
        return {name: tuple(ks) for name, ks in issue.items()}

    @cached_property
    def scatter_of(self) -> dict[str, int]:
        """Node name (a step's first) → index of its gradient reduce-scatter bucket."""
        return {st.nodes[0].name: k for k, b in enumerate(self.scatters) for st in b}


def decide(dg: DynamicGraph, options: LowerOptions, all_steps: list[Step]) -> Decisions:
    """The :class:`Decisions` communication lowering takes for the steps ``all_steps`` of ``dg`` under ``options``."""
    forms: dict[str, CommForm] = {}
    fused: dict[str, tuple[DNode, ...]] = {}
    leaves = {forward_id(n) for n, t in dg.pcg.tensors.items() if t.role != TensorRole.ACTIVATION}
    ops = {p.name: p.op for p in dg.pcg.nodes}
    readers: dict[str, list[DNode]] = {}
    for n in dg.nodes:
        for v in set(n.inputs):
            readers.setdefault(v, []).append(n)
    for st in all_steps:
        n = st.nodes[0]
        if st.kind not in (CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER):
            continue
        if uneven(dg.values[n.inputs[0]]) or uneven(dg.values[st.nodes[-1].outputs[0]]):
            # uneven blocks: one collective, padded (docs/concepts.md#uneven-shards)
            forms[n.name] = CommForm.COLLECTIVE
            continue
        reorders = any(layout_change(dg.values[n.inputs[0]], dg.values[st.nodes[-1].outputs[0]]))
        if st.kind == CommKind.ALL_GATHER:
            chunk = piece(dg.values[n.inputs[0]]).type.nbytes
            # out of the load-balanced layout: one collective, its result reordered (docs/concepts.md#the-load-balanced-layout)
            form = CommForm.COLLECTIVE if reorders else options.all_gather_form(chunk, n.op.degree, n.op.axis)
            forms[n.name] = form
            out = n.outputs[0]
            last_dim = len(dg.values[out].type.shape) - 1
            if form != CommForm.COLLECTIVE and n.op.dim != last_dim:
                fused[n.name] = tuple(
                    c
                    for c in readers.get(out, ())
                    if c.kind == NodeKind.COMPUTE
                    and c.task == TaskType.FWD
                    and ops[c.src].contracts_last_dim
                    and c.inputs[0] == out
                    and all(v in leaves for v in c.inputs[1:])
                    and len(dg.values[c.outputs[0]].type.shape) == last_dim + 1
                )
        elif st.kind == CommKind.REDUCE_SCATTER:
            chunk = piece(dg.values[st.nodes[-1].outputs[0]]).type.nbytes
            summed = dg.values[n.inputs[0]].sharding.reduce_op == ReduceOp.SUM  # the ring adds; others stay plain
            forms[n.name] = (
                options.reduce_scatter_form(chunk, n.op.degree, n.op.axis)
                if summed and not reorders
                else CommForm.COLLECTIVE
            )
    flat = _flattened(dg, options, all_steps, readers)
    rings = attention_rings(dg, all_steps) if options.cp_attention == CPAttention.RING else {}
    dispatches = (
        expert_dispatches(dg, all_steps, options.capacity_factor)
        if options.ep_dispatch == EPDispatch.ALL_TO_ALL
        else {}
    )
    if options.bucket_bytes <= 0:
        return Decisions(dg, forms, fused, flat=flat, rings=rings, overlap=options.overlap, dispatches=dispatches)
    final = _final_gradients(dg)
    then = _then_all_reduced(dg, all_steps, final)
    gathers, scatters = _gather_buckets(dg, all_steps), _scatter_buckets(dg, all_steps, final, then)
    # the all-reduces of a scatter bucket's pieces: one bucket (FSDP2's HSDP), issued where the next scatter bucket of
    # its sub-mesh is, before it: its reduce-scatter travels while the next block's backward computes, as FSDP2's
    # reduce-scatter stream does (docs/lowering.md#11-gradient-buckets-and-overlap-with-the-backward)
    reduced = [k for k, b in enumerate(scatters) if b[0].nodes[-1].outputs[0] in then]
    pieces = tuple(tuple(then[st.nodes[-1].outputs[0]] for st in scatters[k]) for k in reduced)
    packed = {n.name for b in gathers for n in b} | {st.nodes[0].name for b in scatters for st in b}
    forms.update(dict.fromkeys(packed, CommForm.COLLECTIVE))  # a bucket is one collective
    fused = {k: v for k, v in fused.items() if k not in packed}
    buckets = _buckets(dg, all_steps, options.bucket_bytes, final, {n.name for b in pieces for n in b}, flat)
    at = {id(st): i for i, st in enumerate(all_steps)}
    issued = sorted(range(len(scatters)), key=lambda m: at[id(scatters[m][-1])])  # in the order they are issued
    later = {}
    for j, k in enumerate(reduced):
        group = scatters[k][0].nodes[0].group
        after = issued[issued.index(k) + 1 :]
        nxt = next((m for m in after if scatters[m][0].nodes[0].group == group), None)
        if nxt is not None:
            later[len(buckets) + j] = nxt
    return Decisions(
        dg,
        forms,
        fused,
        buckets + pieces,
        gathers,
        scatters,
        flat,
        rings,
        options.overlap,
        later,
        dispatches=dispatches,
    )


def attention_rings(dg: DynamicGraph, all_steps: list[Step]) -> dict[str, AttentionRing]:
    """Ring attention (docs/lowering.md#16-ring-attention---cp-attention-ring): every forward attention whose keys and values are each
    all-gathered along their sequence dim, over one mesh axis of the attention's own sub-mesh → its
    :class:`AttentionRing`, by the attention's name. Its backward joins the ring where it reads the same keys,
    values and mask,
    gives the keys and values their gradients (not the mask), each reduce-scattered back along the sequence and read
    by nothing else, and has no linearity scale."""
    made, scattered, readers = _gathered_and_scattered(dg, all_steps)
    attention = [n for n in dg.nodes if n.kind == NodeKind.COMPUTE and isinstance(dg.sources[n.src].op, Attention)]
    # a backward by the keys, values and mask it reads (its queries may be recomputed: selective checkpointing)
    backward = {tuple(n.inputs[1 : len(n.grad_mask)]): n for n in attention if n.task == TaskType.BWD}
    out: dict[str, AttentionRing] = {}
    for n in (n for n in attention if n.task == TaskType.FWD):
        k, v = made.get(n.inputs[1]), made.get(n.inputs[2])
        seq = len(dg.values[n.inputs[1]].type.shape) - 2
        if not (k and v and _along(k) == _along(v) == (_axis(k), seq) and k.group == v.group == n.group):
            continue
        if any(uneven(dg.values[x]) for x in n.inputs):  # a padded key block would be attended: the all-gather form
            continue
        b: DNode | None = backward.get(tuple(n.inputs[1:]))
        scatters: tuple[Step, Step] | None = None
        if b is not None and b.grad_mask[1:3] == (True, True) and not any(b.grad_mask[3:]):
            grads = dict(zip((i for i, m in enumerate(b.grad_mask) if m), b.outputs))
            sk, sv = scattered.get(grads[1]), scattered.get(grads[2])
            if (
                sk is not None
                and sv is not None
                and all(u == 1.0 for u in b.unscale)
                and all(
                    _along(st.nodes[-1]) == (_axis(k), seq) and readers[st.nodes[0].inputs[0]] == {st.nodes[0].name}
                    for st in (sk, sv)
                )
            ):
                scatters = (sk, sv)
        if scatters is None:
            b = None
        ours = {n.name} | ({b.name} if b is not None else set())
        joined = bool((readers[k.outputs[0]] | readers[v.outputs[0]]) - ours)
        if joined and any(layout_change(dg.values[x.inputs[0]], dg.values[x.outputs[0]])[1] for x in (k, v)):
            continue  # the blocks in head-tail order would join out of order: the all-gather form, reordered
        out[n.name] = AttentionRing(n, k, v, b, scatters, joined)
    return out


def expert_dispatches(
    dg: DynamicGraph, all_steps: list[Step], capacity_factor: float | None = None
) -> dict[str, ExpertDispatch]:
    """The all-to-all token dispatcher (docs/lowering.md#17-the-all-to-all-token-dispatcher---ep-dispatch-all_to_all):
    every forward expert layer whose tokens, routings and routing weights are each all-gathered along dim 0 over
    the one mesh axis that splits its experts (a block of them on each member), whose output's partial sums over
    that axis are reduce-scattered back along dim 0 and read by nothing else, and whose gathered inputs nothing
    else reads → its :class:`ExpertDispatch`, by the expert layer's name. Its backward (the one reading the same
    gathered inputs) joins where it differentiates the tokens and not the routings, with no linearity scale, its
    output gradient all-gathered and the gradients of the tokens and routing weights each reduce-scattered back,
    read by nothing else. A forward whose backward does not join is left as it is, unless it keeps nothing for the
    backward (a forward the backward reads a recomputation of). ``capacity_factor`` F (``--capacity-factor``): each
    rank sends each expert at most ⌈F · n·K / E⌉ rows of its n tokens (GShard's capacity); then every expert
    layer of the step must be dispatched (PassError naming one that is not)."""
    made, scattered, readers = _gathered_and_scattered(dg, all_steps)
    layers = [n for n in dg.nodes if n.kind == NodeKind.COMPUTE and isinstance(dg.sources[n.src].op, Experts)]
    backward = {n.inputs[:5]: n for n in layers if n.task == TaskType.BWD}
    out: dict[str, ExpertDispatch] = {}
    for n in (n for n in layers if n.task == TaskType.FWD):
        gathers = tuple(g for g in (made.get(v) for v in n.inputs[:3]) if g is not None)
        experts = dg.values[n.inputs[3]].sharding.dims[0]
        axis = experts[0] if len(experts) == 1 else None
        if axis is None or len(gathers) < 3 or any(g.group != n.group or _along(g) != (axis, 0) for g in gathers):
            continue
        if any(uneven(dg.values[g.inputs[0]]) for g in gathers):  # padded tokens would be routed: all-gather form
            continue
        scatter = scattered.get(n.outputs[0])
        if (
            scatter is None
            or _along(scatter.nodes[-1]) != (axis, 0)
            or readers[n.outputs[0]] != {scatter.nodes[0].name}
        ):
            continue
        b = backward.get(n.inputs)
        dout, scatters = None, {}
        if b is not None:
            dout = made.get(b.inputs[5])
            grads = dict(zip((i for i, m in enumerate(b.grad_mask) if m), b.outputs))
            scatters = {i: scattered.get(grads[i]) for i in (0, 2) if i in grads}
            if (
                dout is None
                or _along(dout) != (axis, 0)
                or not b.grad_mask[0]
                or b.grad_mask[1]
                or any(u != 1.0 for u in b.unscale)
                or readers[dout.outputs[0]] != {b.name}
                or any(
                    st is None or _along(st.nodes[-1]) != (axis, 0) or readers[grads[i]] != {st.nodes[0].name}
                    for i, st in scatters.items()
                )
            ):
                continue
        elif dg.backward_of.get(n.src) is not None and (n.recompute or n.src not in dg.recomputed):
            continue  # it keeps its autograd graph for a backward that is not dispatched
        if any(readers[g.outputs[0]] - {n.name} - ({b.name} if b is not None else set()) for g in gathers):
            continue
        capacity = 0
        if capacity_factor is not None:
            count, k = piece(dg.values[gathers[1].inputs[0]]).type.shape
            capacity = math.ceil(capacity_factor * count * k / dg.values[n.inputs[3]].type.shape[0])
        out[n.name] = ExpertDispatch(n, gathers, scatter, b, dout, scatters, capacity)  # type: ignore[arg-type]
    missed = [n for n in layers if n.task == TaskType.FWD and n.name not in out]
    if capacity_factor is not None and missed:
        layer = dg.sources[missed[0].src].scope or missed[0].src
        raise PassError(
            f"--capacity-factor {capacity_factor} caps the rows the all-to-all token dispatcher sends each expert, but "
            f"expert layer {layer!r} is not dispatched by all-to-all (it needs --strategy ep, with ep after the "
            f"mesh's other axes that split the batch, e.g. --mesh fsdp=2,ep=2): leave --capacity-factor out, or "
            f"dispatch every expert layer by all-to-all"
        )
    return out


def _gathered_and_scattered(
    dg: DynamicGraph, all_steps: list[Step]
) -> tuple[dict[str, DNode], dict[str, Step], dict[str, set[str]]]:
    """What the rewrites of a compute and its all-gathers and reduce-scatters look up: each all-gathered value → the
    all-gather that makes it, each reduce-scattered value → its reduce-scatter step, each value → its readers."""
    made = {st.nodes[0].outputs[0]: st.nodes[0] for st in all_steps if st.kind == CommKind.ALL_GATHER}
    scattered = {st.nodes[0].inputs[0]: st for st in all_steps if st.kind == CommKind.REDUCE_SCATTER}
    readers: dict[str, set[str]] = {}
    for n in dg.nodes:
        for value in n.inputs:
            readers.setdefault(value, set()).add(n.name)
    return made, scattered, readers


def _along(n: DNode) -> tuple[str, int]:
    """The mesh axis and the tensor dim Combine or Repartition node ``n`` acts along."""
    assert isinstance(n.op, (CombineOp, RepartitionOp)), n.name
    return n.op.axis, n.op.dim


def _axis(n: DNode) -> str:
    """The mesh axis parallel node ``n`` acts along."""
    assert n.op is not None, n.name
    return n.op.axis


def _flattened(
    dg: DynamicGraph, options: LowerOptions, all_steps: list[Step], readers: Mapping[str, list[DNode]]
) -> dict[str, DNode]:
    """Mesh flatten (docs/lowering.md#mesh-flatten): all-reduce → the all-reduce that alone reads it, over
    another axis of the same sub-mesh with the same reduction (a value ``Partial`` on two axes brought to
    ``Replicate``, as :func:`~shardflow.parallel.ops.redistribute` makes it: one axis at a time), where the cost
    model prices one all-reduce over both axes at once — DTensor's flattened mesh dim — below the two: the second
    node's name → the first. A chain of three folds its first two only."""
    cost = options.cost
    made = {st.nodes[0].outputs[0]: st.nodes[0] for st in all_steps if st.kind == CommKind.ALL_REDUCE}
    flat: dict[str, DNode] = {}
    for st in all_steps:
        n = st.nodes[0]
        first = made.get(n.inputs[0]) if st.kind == CommKind.ALL_REDUCE and len(st.nodes) == 1 else None
        if (
            first is None
            or first.name in flat  # already folded into: a chain folds its first two
            or _axis(first) == _axis(n)
            or first.group != n.group
            or first.task != n.task
            or len(readers.get(n.inputs[0], ())) != 1
            or dg.values[first.inputs[0]].sharding.reduce_op != dg.values[n.inputs[0]].sharding.reduce_op
        ):
            continue
        nbytes = piece(dg.values[n.inputs[0]]).type.nbytes
        axes = (_axis(first), _axis(n))
        sizes = [n.group.mesh.axis_size(x) for x in axes]
        apart = sum(
            cost.call_s("all_reduce", wire_bytes(CommKind.ALL_REDUCE, nbytes, d), x) for d, x in zip(sizes, axes)
        )
        together = max(
            cost.call_s("all_reduce", wire_bytes(CommKind.ALL_REDUCE, nbytes, math.prod(sizes)), x) for x in axes
        )
        if together < apart:
            flat[n.name] = first
    return flat


def _final_gradients(dg: DynamicGraph) -> frozenset[str]:
    """The values only the updates (and the gradient-norm sum) read: the weights' final gradients."""
    final = {v for n in dg.nodes if n.kind in (NodeKind.UPDATE, NodeKind.SUMSQ) for v in n.inputs}
    elsewhere = {v for n in dg.nodes if n.kind not in (NodeKind.UPDATE, NodeKind.SUMSQ) for v in n.inputs}
    return frozenset(final - elsewhere)


def _final_sum(dg: DynamicGraph, st: Step, kind: CommKind, final: frozenset[str]) -> bool:
    """Whether step ``st`` is a ``kind`` of the backward that sums and whose result is a final gradient (``final``):
    what may wait in a bucket, read by nothing before the updates."""
    first, last = st.nodes[0], st.nodes[-1]
    return (
        st.kind == kind
        and first.task == TaskType.BWD
        and last.outputs[0] in final
        and dg.values[first.inputs[0]].sharding.reduce_op == ReduceOp.SUM
    )


def _then_all_reduced(dg: DynamicGraph, all_steps: list[Step], final: frozenset[str]) -> dict[str, DNode]:
    """Reduce-scatter result → the all-reduce over another axis that alone reads it, in the next step, and makes a
    final gradient (``final``): a gradient Partial on two axes brought to Shard on one of them
    (:func:`~shardflow.parallel.ops.redistribute` cuts first: HSDP's reduce-scatter over fsdp, then the all-reduce of
    the piece over dp)."""
    readers = Counter(v for n in dg.nodes for v in n.inputs)
    out: dict[str, DNode] = {}
    for st, nxt in zip(all_steps, all_steps[1:]):
        v = st.nodes[-1].outputs[0]
        if (
            st.kind == CommKind.REDUCE_SCATTER
            and _final_sum(dg, nxt, CommKind.ALL_REDUCE, final)
            and nxt.nodes[0].inputs[0] == v
            and readers[v] == 1
        ):
            out[v] = nxt.nodes[0]
    return out


def _scatter_buckets(
    dg: DynamicGraph, all_steps: list[Step], final: frozenset[str], then: Mapping[str, DNode]
) -> tuple[tuple[Step, ...], ...]:
    """Gradient reduce-scatters packed into buckets, as FSDP2 reduce-scatters one flat gradient per module: those
    of BWD, summing, whose result only the updates (and the gradient-norm sum) read, or only the all-reduce of
    ``then`` (:func:`_then_all_reduced`), grouped by (sub-mesh, axis, dim, dtype, the tensor's block:
    :func:`~shardflow.lower.dynamic.block_of` of its name, the axis of that all-reduce), in the order the backward
    makes them. A bucket is issued at its last member's step; its results are unpacked before their first reader.
    Buckets of one are left out."""
    open_: dict[tuple, list[Step]] = {}
    for st in all_steps:
        if not _final_sum(dg, st, CommKind.REDUCE_SCATTER, final | then.keys()) or uneven(
            dg.values[st.nodes[-1].outputs[0]]
        ):  # a bucket packs equal blocks; an uneven gradient's are padded, one collective of its own
            continue
        first, last = st.nodes[0], st.nodes[-1]
        vin = dg.values[first.inputs[0]]
        after = then.get(last.outputs[0])
        key = (
            first.group,
            last.op.axis,
            last.op.dim,
            vin.type.dtype,
            block_of(vin.tensor),
            after.op.axis if after else "",
        )
        open_.setdefault(key, []).append(st)
    return tuple(tuple(b) for b in open_.values() if len(b) > 1)


def _gather_buckets(dg: DynamicGraph, all_steps: list[Step]) -> tuple[tuple[DNode, ...], ...]:
    """All-gathers of weights packed into buckets, as FSDP2 gathers one flat parameter per module: the
    all-gathers of one pass whose input is a weight (or its copy cast for compute), grouped by (pass, sub-mesh,
    axis, dim, dtype, the weight's block: :func:`~shardflow.lower.dynamic.block_of` of its name, "" for the weights
    outside every block), in the order of their first members. Every member's input is held from the start of the
    step, so a bucket may be issued before its first member's step: one bucket ahead
    (:attr:`Decisions.gather_issue`); each member is unpacked before its first reader. Buckets of one are left
    out."""
    weights = set(dg.pcg.graph.weights)
    open_: dict[tuple, list[DNode]] = {}
    for st in all_steps:
        n = st.nodes[0]
        vin = dg.values[n.inputs[0]] if n.inputs else None
        if st.kind != CommKind.ALL_GATHER or len(st.nodes) > 1 or vin is None or vin.tensor not in weights:
            continue
        if uneven(vin):  # a bucket joins equal blocks; an uneven weight's are padded, one collective of its own
            continue
        key = (n.task, n.group, n.op.axis, n.op.dim, vin.type.dtype, block_of(vin.tensor))
        open_.setdefault(key, []).append(n)
    return tuple(tuple(b) for b in open_.values() if len(b) > 1)


def _buckets(
    dg: DynamicGraph,
    all_steps: list[Step],
    cap: int,
    final: frozenset[str],
    skip: set[str],
    flat: Mapping[str, DNode],
) -> tuple[tuple[DNode, ...], ...]:
    """Gradient all-reduces packed into buckets (see :class:`LowerOptions`): those of BWD, summing, whose
    result only the updates (and the gradient-norm sum) read, except the nodes named in ``skip`` (bucketed with
    their reduce-scatter bucket's); grouped by (sub-mesh, axis — both, for an all-reduce ``flat`` folds another
    into —, dtype) in the order the backward makes them, a bucket closed once it holds ``cap`` bytes. Buckets of
    one are left out."""
    open_: dict[tuple, tuple[list[DNode], int]] = {}
    out: list[tuple[DNode, ...]] = []
    for st in all_steps:
        if not _final_sum(dg, st, CommKind.ALL_REDUCE, final) or st.nodes[0].name in skip:
            continue
        n = st.nodes[0]
        vin = dg.values[n.inputs[0]]
        key = (n.group, n.op.axis, _axis(flat[n.name]) if n.name in flat else "", vin.type.dtype)
        members, size = open_.pop(key, ([], 0))
        members.append(n)
        size += piece(vin).type.nbytes
        if size >= cap:
            out.append(tuple(members))
        else:
            open_[key] = (members, size)
    out += [tuple(m) for m, _ in open_.values()]
    return tuple(b for b in out if len(b) > 1)


# a flattened axis's name in listings (``axis`` of a communication over several mesh axes at once): "dp×tp"
AXES_JOIN = "×"


def axes_members(group: SubMesh, axes: tuple[str, ...], device: int) -> tuple[int, ...]:
    """The devices of ``group`` that differ from ``device`` only in their coordinates on ``axes``, in order (one
    axis: :func:`~shardflow.lower.shard_expansion.axis_members`; several: the flattened axis, row-major over them
    as DTensor's ``_flatten`` orders it)."""
    members: tuple[int, ...] = (device,)
    for a in axes:
        members = tuple(m for d in members for m in axis_members(group, a, d))
    return tuple(sorted(members))


# The step kinds that lower to collectives along a mesh axis (one per axis group, or a ring / loop of them).
_COLLECTIVES = frozenset(
    {
        CommKind.ALL_REDUCE,
        CommKind.REDUCE_SCATTER,
        CommKind.ALL_GATHER,
        CommKind.ALL_TO_ALL,
        CommKind.BROADCAST,
        CommKind.REDUCE,
    }
)


def instances(st: Step, plan: Decisions) -> int:
    """How many communications (tokens) a step makes."""
    n = st.nodes[0]
    ring = plan.rings.get(n.name) or plan.ring_backwards.get(n.name)
    if ring is not None:  # each group's keys and values, d − 1 permutes each; in the backward their gradients too
        d = n.group.mesh.axis_size(_axis(ring.k))
        return (2 if n.task == TaskType.FWD else 4) * (d - 1) * (n.group.size // d)
    dispatch = plan.dispatches.get(n.name) or plan.dispatch_backwards.get(n.name)
    if dispatch is not None:  # per group: the counts, the rows there and back; in the backward the rows' gradients
        d = n.group.mesh.axis_size(_axis(dispatch.gathers[0]))
        exchanges = 2 if n.task == TaskType.BWD or dispatch.capacity else 3  # the counts' exchange without capacity
        return exchanges * (n.group.size // d)
    if n.name in plan.ring_steps or n.name in plan.dispatch_steps:
        return 0
    if st.kind == NodeKind.COPY:
        return n.group.size
    b = plan.bucket_of.get(n.name)
    if b is not None and (plan.buckets[b][-1] is not n or b in plan.later):
        return 0  # issued with the bucket, at its last member (or at a later scatter bucket's)
    if n.name in plan.gather_of:  # the buckets issued at this step (one collective per axis group each), or none
        d = n.group.mesh.axis_size(n.op.axis)
        return len(plan.gather_issue.get(n.name, ())) * (n.group.size // d)
    s = plan.scatter_of.get(n.name)
    if s is not None and plan.scatters[s][-1] is not st:
        return 0  # issued with the bucket, at its last member
    if st.kind not in _COLLECTIVES or n.name in plan.flat_first:
        return 0
    group = plan.dg.values[n.inputs[0]].group if st.kind == CommKind.REDUCE else n.group
    d = math.prod(n.group.mesh.axis_size(a) for a in plan.axes(n))
    groups = group.size // d
    form = plan.forms.get(n.name, CommForm.COLLECTIVE)
    count = groups * {CommForm.COLLECTIVE: 1, CommForm.RING: d - 1, CommForm.BROADCAST_LOOP: d}[form]
    if s is not None and s in plan.issued_at:  # and the gradient bucket issued before it (Decisions.later)
        count += _bucket_tokens(plan, plan.issued_at[s])
    return count


def comm_lowering(sg: ShardedGraph, options: LowerOptions | None = None) -> ShardedGraph:
    """Fill every communication step of ``sg`` with its communications on each lowered rank (tokens relative
    to the step); consumers fused into a ring are computed there, chunk by chunk, instead of on their own.
    ``options``: the forms of all-gathers and reduce-scatters and the gradient bucket size (default: plain
    collectives, default buckets). Raises PassError if shard expansion has not run or this pass has."""
    require(sg.done, PassName.COMM_LOWERING, (PassName.SHARD_EXPANSION,))
    plan = decide(sg.dg, options or PLAIN, list(sg.steps))
    suppressed = plan.suppressed
    instrs, deferred = {}, {}
    for r in sg.ranks:
        now, later = [], []
        for st, local in zip(sg.steps, sg.instrs[r]):
            after: list[Instr] = []
            name = st.nodes[0].name
            if name in plan.rings:
                mine = _overlapped(plan, _attention_ring(plan, plan.rings[name], r)) if local else []
            elif name in plan.ring_backwards:
                mine = _overlapped(plan, _attention_ring_backward(plan, plan.ring_backwards[name], r)) if local else []
            elif name in plan.dispatches:
                mine = _dispatch_forward(plan, plan.dispatches[name], r) if local else []
            elif name in plan.dispatch_backwards:
                mine = _dispatch_backward(plan, plan.dispatch_backwards[name], r) if local else []
            elif name in plan.ring_steps or name in plan.dispatch_steps:
                mine = []
            elif st.local:
                mine = [] if st.kind == NodeKind.COMPUTE and st.nodes[0].name in suppressed else list(local)
            else:
                b, g = plan.bucket_of.get(st.nodes[0].name), plan.gather_of.get(st.nodes[0].name)
                s = plan.scatter_of.get(st.nodes[0].name)
                if g is not None:
                    mine = []
                    for j, k in enumerate(plan.gather_issue.get(st.nodes[0].name, ())):
                        now_k, after_k = _gather_bucket(plan, k, r, j)
                        mine += now_k
                        after += after_k
                elif s is not None:
                    mine = []
                    if plan.scatters[s][-1] is st:  # issued at its last member, after the gradient bucket of later
                        chained = plan.issued_at.get(s)
                        mine, after = _bucket(plan, chained, r, 0) if chained is not None else ([], [])
                        now_s, after_s = _scatter_bucket(
                            plan, s, r, _bucket_tokens(plan, chained) if chained is not None else 0
                        )
                        mine, after = mine + now_s, after + after_s
                elif b is None:
                    mine = _expand_comm(st, plan, r, 0)
                elif plan.buckets[b][-1] is st.nodes[0] and b not in plan.later:
                    mine, after = _bucket(plan, b, r, 0)
                else:
                    mine = []  # issued with its bucket, at the bucket's last member
            now.append(tuple(mine))
            later.append(tuple(after))
        instrs[r], deferred[r] = tuple(now), tuple(later)
    tokens = tuple(instances(st, plan) for st in sg.steps)
    out = dataclasses.replace(
        sg,
        instrs=instrs,
        deferred=deferred,
        tokens=tokens,
        groups=tuple(process_groups(sg.dg, plan)),
        done=sg.done + (PassName.COMM_LOWERING,),
    )
    for r in sg.ranks:  # after: every token within its step's count
        for k, st in enumerate(sg.steps):
            n = tokens[k]
            bad = [i for i in instrs[r][k] + deferred[r][k] if isinstance(i, (Comm, Wait)) and not 0 <= i.token < n]
            if bad:
                raise PassError(
                    f"communication lowering: rank {r} step {k} ({st.kind}) has token {bad[0].token} "
                    f"outside its {n} communication(s)"
                )
    return out


def _bucket(plan: Decisions, k: int, r: int, token: int) -> tuple[list[Instr], list[Instr]]:
    """Bucket ``k`` on rank ``r``: what runs at its last gradient (pack the members' pieces into one flat
    buffer, issue one all-reduce without waiting) and what runs before the first read of a member's result
    (wait, unpack into views)."""
    dg = plan.dg
    members = plan.buckets[k]
    n0 = members[0]
    if not in_group(n0.group, r):
        return [], []
    ins = tuple(piece(dg.values[plan.source(n)]) for n in members)
    outs = tuple(piece(dg.values[n.outputs[0]]) for n in members)
    flat = TensorType((sum(b.type.numel for b in ins),), ins[0].type.dtype)
    axes = plan.axes(n0)
    label = AXES_JOIN.join(axes)
    packed, reduced = Buffer(f"bucket{k}:{label}", flat), Buffer(f"bucket{k}:{label}.reduced", flat)
    group_members = axes_members(n0.group, axes, r)
    d = len(group_members)
    t = token + axis_group_index(n0.group, axes, r)
    note = f"bucket {k}: " + ", ".join(n.name for n in members)
    comm = Comm(
        t,
        CommKind.ALL_REDUCE,
        TaskType.BWD,
        group_members,
        flat,
        wire_bytes(CommKind.ALL_REDUCE, flat.nbytes, d),
        label,
        send=packed,
        recv=reduced,
        note=note,
        wait=False,
        value=packed.value,
    )
    return (
        [Compute(TaskType.BWD, f"bucket{k}", "pack", ins, (packed,)), comm],
        [Wait(t), Compute(TaskType.BWD, f"bucket{k}", "unpack", (reduced,), outs)],
    )


def _gather_bucket(plan: Decisions, k: int, r: int, j: int) -> tuple[list[Instr], list[Instr]]:
    """Weight all-gather bucket ``k`` on rank ``r``, the ``j``-th issued at its step (:attr:`Decisions.gather_issue`):
    what runs there (pack the members' pieces into one flat buffer, issue one all-gather of it without waiting) and
    what runs before the first read of a member (wait; ``ungather``: each member's pieces, one per rank's row of
    the gathered buffer, concatenated along its dim)."""
    dg = plan.dg
    members = plan.gathers[k]
    n0 = members[0]
    if not in_group(n0.group, r):
        return [], []
    axis, dim = n0.op.axis, n0.op.dim
    ins = tuple(piece(dg.values[n.inputs[0]]) for n in members)
    outs = tuple(piece(dg.values[n.outputs[0]]) for n in members)
    group_members = axis_members(n0.group, axis, r)
    d = len(group_members)
    n_flat = sum(b.type.numel for b in ins)
    name = f"gather{k}:{axis}"
    packed = Buffer(name, TensorType((1, n_flat), ins[0].type.dtype))  # a row: gathered, one row per rank
    gathered = Buffer(f"{name}.gathered", TensorType((d, n_flat), ins[0].type.dtype))
    note = f"gather bucket {k}: " + ", ".join(n.name for n in members)
    t = j * (n0.group.size // d) + axis_group_index(n0.group, axis, r)
    comm = Comm(
        t,
        CommKind.ALL_GATHER,
        n0.task,
        group_members,
        packed.type,
        wire_bytes(CommKind.ALL_GATHER, packed.type.nbytes, d),
        axis,
        send=packed,
        recv=gathered,
        dim=0,
        note=note,
        wait=False,
        value=packed.value,
    )
    after: list[Instr] = [Wait(t), Compute(n0.task, name, "ungather", (gathered,), outs, dim=dim)]
    return [Compute(n0.task, name, "pack", ins, (packed,)), comm], after


def _bucket_tokens(plan: Decisions, k: int) -> int:
    """The communications (tokens) gradient bucket ``k`` makes: one per group of its axes."""
    n = plan.buckets[k][-1]
    return n.group.size // math.prod(n.group.mesh.axis_size(a) for a in plan.axes(n))


def _scatter_bucket(plan: Decisions, k: int, r: int, token: int = 0) -> tuple[list[Instr], list[Instr]]:
    """Gradient reduce-scatter bucket ``k`` on rank ``r`` (its tokens from ``token``): what runs at its last member (each member's gradient
    chunked along its dim, the chunks packed by destination rank into one flat buffer — rank j's chunks of every
    member, then rank j+1's —, one reduce-scatter of it issued without waiting) and what runs before the first read
    of a member's result (wait, unpack this rank's flat chunk into views of the members' pieces)."""
    dg = plan.dg
    members = plan.scatters[k]
    first = members[0].nodes[0]
    if not in_group(first.group, r):
        return [], []
    axis, dim = members[0].nodes[-1].op.axis, members[0].nodes[-1].op.dim
    ins = tuple(piece(dg.values[st.nodes[0].inputs[0]]) for st in members)
    outs = tuple(piece(dg.values[st.nodes[-1].outputs[0]]) for st in members)
    group_members = axis_members(first.group, axis, r)
    d = len(group_members)
    flat = TensorType((sum(b.type.numel for b in outs),), outs[0].type.dtype)
    name = f"scatter{k}:{axis}"
    chunks = [tuple(Buffer(f"{name}.{i}.to{j}", o.type) for j in range(d)) for i, o in enumerate(outs)]
    packed, mine = Buffer(name, TensorType((d * flat.numel,), flat.dtype)), Buffer(f"{name}.reduced", flat)
    note = f"scatter bucket {k}: " + ", ".join(st.nodes[0].name for st in members)
    t = token + axis_group_index(first.group, axis, r)
    comm = Comm(
        t,
        CommKind.REDUCE_SCATTER,
        TaskType.BWD,
        group_members,
        packed.type,
        wire_bytes(CommKind.REDUCE_SCATTER, packed.type.nbytes, d),
        axis,
        send=packed,
        recv=mine,
        dim=0,
        note=note,
        wait=False,
        value=packed.value,
    )
    now: list[Instr] = [Compute(TaskType.BWD, name, "chunk", (b,), chunks[i], dim=dim) for i, b in enumerate(ins)]
    now += [
        Compute(TaskType.BWD, name, "pack", tuple(chunks[i][j] for j in range(d) for i in range(len(ins))), (packed,)),
        comm,
    ]
    return now, [Wait(t), Compute(TaskType.BWD, name, "unpack", (mine,), outs)]


def _expand_comm(st: Step, plan: Decisions, r: int, base: int) -> list[Instr]:
    """The instructions of communication step ``st`` on rank ``r`` (token numbers from ``base``)."""
    dg = plan.dg
    first, last = st.nodes[0], st.nodes[-1]
    vin, vout = dg.values[first.inputs[0]], dg.values[last.outputs[0]]
    if st.kind == NodeKind.COPY:
        return _expand_copy(first, dg, r, base)
    if st.kind in (CommKind.BROADCAST, CommKind.REDUCE):
        return _replicate_comms(first, dg, r, base)
    op = first.op
    axis = op.axis
    group = first.group
    if not in_group(group, r) or first.name in plan.flat_first:
        return []
    if first.name in plan.flat:  # one all-reduce over both axes, of the value the folded one read
        axes = plan.axes(first)
        members, tin = axes_members(group, axes, r), piece(dg.values[plan.source(first)])
        return [
            Comm(
                base + axis_group_index(group, axes, r),
                CommKind.ALL_REDUCE,
                first.task,
                members,
                tin.type,
                wire_bytes(CommKind.ALL_REDUCE, tin.type.nbytes, len(members)),
                AXES_JOIN.join(axes),
                send=tin,
                recv=piece(vout),
                note=f"{plan.flat[first.name].name} + {first.name}",
                reduce_op=vin.sharding.reduce_op,
                value=dg.values[plan.source(first)].id,
            )
        ]
    form = plan.forms.get(first.name, CommForm.COLLECTIVE)
    if form != CommForm.COLLECTIVE:
        expand = _all_gather_steps if st.kind == CommKind.ALL_GATHER else _reduce_scatter_ring
        return expand(st, plan, r, base, form)
    members = axis_members(group, axis, r)
    d = len(members)
    tin, tout = piece(vin), piece(vout)
    to_storage: HeadTail | Padded | None
    to_natural: HeadTail | Padded | None
    to_storage, to_natural = layout_change(vin, vout)
    kind = st.kind
    assert isinstance(kind, CommKind), kind  # a collective step (sends, receives and local steps return above)
    # all-gather: Combine's dim; reduce-scatter: the Repartition's; all-to-all: split the Repartition's dim,
    # concatenate along the Combine's.
    dims = (
        (None, None)
        if st.kind == CommKind.ALL_REDUCE
        else (first.op.dim, None)
        if st.kind == CommKind.ALL_GATHER
        else (last.op.dim, None)
        if st.kind == CommKind.REDUCE_SCATTER
        else (last.op.dim, first.op.dim)
    )
    # an uneven dim (docs/concepts.md#uneven-shards): padded to equal blocks before it is cut, trimmed once joined
    if kind in (CommKind.REDUCE_SCATTER, CommKind.ALL_TO_ALL) and dims[0] is not None:
        to_storage = to_storage or padding(vin, dims[0], d)
    joined = dims[1] if kind == CommKind.ALL_TO_ALL else dims[0]
    if kind in (CommKind.ALL_GATHER, CommKind.ALL_TO_ALL) and joined is not None:
        to_natural = to_natural or padding(vout, joined, d)
    sent = tin.type
    if isinstance(to_storage, Padded):
        sent = TensorType(padded_shape(sent.shape, to_storage.dim, d), sent.dtype)
    nbytes = wire_bytes(kind, sent.nbytes, d)
    return [
        Comm(
            base + axis_group_index(group, axis, r),
            kind,
            first.task,
            members,
            tin.type,
            nbytes,
            axis,
            send=tin,
            recv=tout,
            dim=dims[0],
            dim2=dims[1],
            note=" + ".join(n.name for n in st.nodes),
            reduce_op=vin.sharding.reduce_op
            if st.kind in (CommKind.ALL_REDUCE, CommKind.REDUCE_SCATTER)
            else ReduceOp.SUM,
            value=vin.id,
            to_storage=to_storage,
            to_natural=to_natural,
        )
    ]


def _replicate_meshes(n: DNode, dg: DynamicGraph) -> tuple[SubMesh, SubMesh]:
    """(widened sub-mesh, sub-mesh at one index of the axis) of Replicate node ``n``, FWD or BWD."""
    vin, vout = dg.values[n.inputs[0]].group, dg.values[n.outputs[0]].group
    return (vout, vin) if n.task == TaskType.FWD else (vin, vout)


def replicate_group(n: DNode, dg: DynamicGraph, device: int) -> tuple[tuple[int, ...], int]:
    """Members and root of the broadcast (FWD) or reduce (BWD) of Replicate node ``n`` for the axis group of
    ``device``, a member of the widened sub-mesh. The root is the device of the input's sub-mesh (machine view
    included) that holds the group's piece; where a view puts it outside the group it joins the group as the
    root only: it sends the broadcast and receives the reduced sum, but receives no copy and adds nothing."""
    wide, narrow = _replicate_meshes(n, dg)
    members = axis_members(wide, n.op.axis, device)
    root = narrow.device_of(wide.coords(device))
    return (members if root in members else (root,) + members), root


def _replicate_comms(n: DNode, dg: DynamicGraph, r: int, base: int) -> list[Instr]:
    """Replicate node ``n`` on rank ``r``: a broadcast (FWD) or reduce (BWD) for each axis group it takes part
    in — its own as a member of the widened sub-mesh, and the one whose root it is (token = base + group)."""
    wide, narrow = _replicate_meshes(n, dg)
    axis, fwd = n.op.axis, n.task == TaskType.FWD
    reps: dict[int, int] = {}  # axis group index → a member of the widened sub-mesh in it; r first
    if in_group(wide, r):
        reps[axis_group_index(wide, axis, r)] = r
    if in_group(narrow, r):
        d = wide.device_of(narrow.coords(r) | {axis: dict(narrow.fixed)[axis]})
        reps.setdefault(axis_group_index(wide, axis, d), d)
    vin, vout = dg.values[n.inputs[0]], dg.values[n.outputs[0]]
    out: list[Instr] = []
    for g, d in sorted(reps.items()):
        members, root = replicate_group(n, dg, d)
        own = d == r  # r is a member of the widened sub-mesh in this group (not only its root)
        t = piece(vout if fwd else vin).type
        if fwd:  # the root sends its piece, the members receive
            kind, send, recv = CommKind.BROADCAST, piece(vin) if r == root else None, piece(vout) if own else None
        else:  # the members send their partial pieces, the root receives the sum
            kind, send, recv = CommKind.REDUCE, piece(vin) if own else None, piece(vout) if r == root else None
        out.append(
            Comm(
                base + g,
                kind,
                n.task,
                members,
                t,
                wire_bytes(kind, t.nbytes, len(members), r == root),
                axis,
                root=root,
                send=send,
                recv=recv,
                note=n.name,
                value=vin.id,
            )
        )
    return out


def ring_peers(p: int, i: int, d: int) -> tuple[int, int]:
    """Collective-permute ring convention (nvFuser's swizzle1d): at step ``i`` the member at index ``p`` sends
    to index ``(p - i) mod d`` and receives from ``(p + i) mod d`` — so at step i it holds chunk (p + i) mod d.
    The one place this convention is written."""
    return (p - i) % d, (p + i) % d


def _ring_group(n: DNode, r: int) -> tuple[tuple[int, ...], int, int, int]:
    """For rank ``r`` in a ring along ``n``'s axis: the members, r's index among them, the index of its group
    and the number of groups (tokens of step k of group g: base + k·groups + g)."""
    members = axis_members(n.group, n.op.axis, r)
    return members, members.index(r), axis_group_index(n.group, n.op.axis, r), n.group.size // len(members)


def _chunk(b: Buffer, j: int, d: int, dim: int, tag: str = "") -> Buffer:
    shape = list(b.type.shape)
    shape[dim] //= d
    return Buffer(f"{b.value}#{tag}{j}", TensorType(tuple(shape), b.type.dtype))


def _all_gather_steps(st: Step, plan: Decisions, r: int, base: int, form: CommForm) -> list[Instr]:
    """An all-gather as a ring of d−1 collective-permute steps or a loop of d broadcasts. Fused consumers
    (linear/matmul reading the gathered value) compute on each chunk as soon as it is present, while the next
    chunk travels (every step but the last is issued with ``wait=False`` before the compute)."""
    dg = plan.dg
    n = st.nodes[0]
    vin, vout = dg.values[n.inputs[0]], dg.values[n.outputs[0]]
    axis, dim = n.op.axis, n.op.dim
    members, p, g, groups = _ring_group(n, r)
    d = len(members)
    own, full = piece(vin), piece(vout)
    chunks = [_chunk(full, j, d, dim) for j in range(d)]
    chunks[p] = own
    consumers = plan.fused.get(n.name, ())
    kernels = [kernel(c, dg, r) for c in consumers]

    def token(k: int) -> int:  # token of this group's k-th communication of the step
        return base + k * groups + g

    def comm(step: int, wait: bool) -> Comm:
        if form == CommForm.RING:
            to, frm = ring_peers(p, step + 1, d)
            return Comm(
                token(step),
                CommKind.PERMUTE,
                n.task,
                members,
                own.type,
                wire_bytes(CommKind.PERMUTE, own.type.nbytes, d),
                axis,
                peer=members[to],
                peer_from=members[frm],
                send=own,
                recv=chunks[frm],
                dim=dim,
                wait=wait,
                note=n.name,
                value=vin.id,
            )
        root = members[step]
        return Comm(
            token(step),
            CommKind.BROADCAST,
            n.task,
            members,
            own.type,
            wire_bytes(CommKind.BROADCAST, own.type.nbytes, d, r == root),
            axis,
            root=root,
            send=own if r == root else None,
            recv=None if r == root else chunks[step],
            wait=wait,
            note=n.name,
            value=vin.id,
        )

    def compute_on(j: int) -> list[Instr]:
        out = []
        for c, k in zip(consumers, kernels):
            y = piece(dg.values[c.outputs[0]])
            ins = (chunks[j],) + tuple(piece(dg.values[v]) for v in c.inputs[1:])
            out.append(Compute(c.task, c.src, c.label, ins, (_chunk(y, j, d, dim),), c.name, kernel=k, micro=c.micro))
        return out

    n_comms = d - 1 if form == CommForm.RING else d
    instrs: list[Instr] = []
    if not consumers:
        instrs += [comm(k, wait=True) for k in range(n_comms)]
    elif form == CommForm.RING:  # own chunk first, then chunk (p + k) mod d after step k arrives
        instrs += [comm(0, wait=False), *compute_on(p)]
        for k in range(1, d):
            instrs.append(Wait(token(k - 1)))
            if k < n_comms:
                instrs.append(comm(k, wait=False))
            instrs += compute_on(ring_peers(p, k, d)[1])
    else:  # broadcast loop: chunk k arrives at step k
        instrs.append(comm(0, wait=False))
        for k in range(d):
            instrs.append(Wait(token(k)))
            if k + 1 < n_comms:
                instrs.append(comm(k + 1, wait=False))
            instrs += compute_on(k)
    instrs.append(Compute(n.task, n.src, "concat", tuple(chunks), (full,), dim=dim))
    for c in consumers:
        y = piece(dg.values[c.outputs[0]])
        instrs.append(Compute(c.task, c.src, "concat", tuple(_chunk(y, j, d, dim) for j in range(d)), (y,), dim=dim))
    return instrs


class _RingBlocks(NamedTuple):
    """What both rings of an :class:`AttentionRing` hold on one rank: the axis ``members``, the rank's index ``p``
    among them, its group ``g`` of ``groups``, the sequence ``dim``; ``own`` its key and value pieces, ``held[i][j]``
    the buffer of block j of the keys (i = 0) or values (1); ``masks[j]`` block j's mask operands and ``cut`` the
    instructions that make them; ``out`` the attention's output piece and ``lse`` its log-sum-exp."""

    members: tuple[int, ...]
    p: int
    g: int
    groups: int
    dim: int
    own: tuple[Buffer, ...]
    held: tuple[list[Buffer], ...]
    masks: list[tuple[Buffer, ...]]
    cut: list[Instr]
    out: Buffer
    lse: Buffer


def _ring_blocks(plan: Decisions, ring: AttentionRing, r: int, task: TaskType, tag: str) -> _RingBlocks:
    """:class:`_RingBlocks` of ``ring`` on rank ``r`` for the pass ``task`` (``tag`` keeps the backward's received
    blocks apart from the forward's)."""
    dg, a = plan.dg, ring.attention
    members, p, g, groups = _ring_group(ring.k, r)
    d, dim = len(members), _along(ring.k)[1]
    own = tuple(piece(dg.values[x.inputs[0]]) for x in (ring.k, ring.v))
    held = tuple(
        [own[i] if j == p else _chunk(piece(dg.values[x.outputs[0]]), j, d, dim, tag) for j in range(d)]
        for i, x in enumerate((ring.k, ring.v))
    )
    cut, masks = _mask_blocks(plan, a, d, tag, task)
    out = piece(dg.values[a.outputs[0]])
    lse = Buffer(f"{out.value}#lse", TensorType(out.type.shape[:-1], out.type.dtype))
    return _RingBlocks(members, p, g, groups, dim, own, held, masks, cut, out, lse)


def _attention_ring(plan: Decisions, ring: AttentionRing, r: int) -> list[Instr]:
    """Ring attention on rank ``r`` (docs/lowering.md#16-ring-attention---cp-attention-ring): the keys and values
    travel as an all-gather ring does, two collective-permutes per step (keys, then values; :func:`ring_peers`), and
    each block of them is attended by this rank's queries as soon as it is present — the rank's own first, while the
    next travels —, each block giving an output and its log-sum-exp
    (:attr:`~shardflow.graph.ops.Attention.keys_from`), merged into the running result (``lse_merge``), the last
    merge also keeping the log-sum-exp for the backward. Where other nodes read the gathered keys and values
    (:attr:`AttentionRing.joined`), they are joined at the end."""
    dg = plan.dg
    a, gk, gv = ring.attention, ring.k, ring.v
    members, p, g, groups, dim, own, held, masks, instrs, out, lse = _ring_blocks(plan, ring, r, a.task, "")
    d, block = len(members), own[0].type.shape[dim]
    spec = kernel(a, dg, r)
    assert isinstance(spec, Forward) and spec.draw is None, a.name
    assert spec.local.out_scale == 1.0 and all(x == 1.0 for x in spec.local.in_scale), a.name
    attention = spec.local.op
    assert isinstance(attention, Attention), a.name
    q = piece(dg.values[a.inputs[0]])

    def token(step: int, i: int) -> int:  # i: 0 the keys, 1 the values
        return (2 * step + i) * groups + g

    def comm(step: int, i: int) -> Comm:
        to, frm = ring_peers(p, step + 1, d)
        x = (gk, gv)[i]
        value = dg.values[x.inputs[0]].id
        return _permute(x, token(step, i), members, (members[to], members[frm]), own[i], held[i][frm], a.task, value)

    def attend(j: int) -> tuple[Compute, tuple[Buffer, Buffer]]:
        outs = (Buffer(f"{out.value}#{j}", out.type), Buffer(f"{lse.value}{j}", lse.type))
        op = dataclasses.replace(attention, keys_from=j * block)
        k = Forward(dataclasses.replace(spec.local, op=op), None, ())
        ins = (q, held[0][j], held[1][j], *masks[j])
        return Compute(a.task, a.src, a.label, ins, outs, a.name, kernel=k, micro=a.micro), outs

    first, acc = attend(p)
    instrs += [comm(0, 0), comm(0, 1), first]
    for s in range(1, d):
        instrs += [Wait(token(s - 1, 0)), Wait(token(s - 1, 1))]
        if s < d - 1:
            instrs += [comm(s, 0), comm(s, 1)]
        c, outs = attend(ring_peers(p, s, d)[1])
        merged = (
            (out, lse)
            if s == d - 1
            else (Buffer(f"{out.value}#acc{s}", out.type), Buffer(f"{lse.value}_acc{s}", lse.type))
        )
        instrs += [c, Compute(a.task, a.src, "lse_merge", (*acc, *outs), merged)]
        acc = merged
    if ring.joined:
        for x, chunks in zip((gk, gv), held):
            whole = piece(dg.values[x.outputs[0]])
            instrs.append(Compute(x.task, x.src, "concat", tuple(chunks), (whole,), dim=dim))
    return instrs


class _Dispatched(NamedTuple):
    """What both passes of an :class:`ExpertDispatch` hold on one rank: the ``ep`` group's ``members``, the rank's
    index ``p`` among them, its group ``g`` of ``groups``; its tokens, routings and routing weights (``x``, ``idx``,
    ``w``) and experts' weights (``w1``, ``w2``); the forward's buffers: ``rows`` (its tokens once per expert, by
    expert), ``counts`` (rows per expert of each member), ``rcounts`` (rows each member sends to each of its
    experts), ``recv`` (the rows received, typed with their bound), ``done`` (those rows through its experts),
    ``back`` (its rows back); the three local ops and the node names their autograd graphs are kept under; the
    ``capacity`` (:attr:`ExpertDispatch.capacity`: no counts, every buffer C rows per expert)."""

    members: tuple[int, ...]
    p: int
    g: int
    groups: int
    x: Buffer
    idx: Buffer
    w: Buffer
    w1: Buffer
    w2: Buffer
    rows: Buffer
    counts: Buffer
    rcounts: Buffer
    recv: Buffer
    done: Buffer
    back: Buffer
    ops: tuple[LocalOp, LocalOp, LocalOp]
    nodes: tuple[str, str, str]
    capacity: int

    @property
    def experts_ins(self) -> tuple[Buffer, ...]:
        """What the experts read: the rows received, their counts (without capacity), the weights."""
        return (self.recv,) + (() if self.capacity else (self.rcounts,)) + (self.w1, self.w2)

    def splits(self, out: bool) -> tuple[Buffer, Buffer] | None:
        """The count buffers an all-to-all of rows is sized by (:attr:`~shardflow.lower.program.Comm.splits`):
        to the experts' members (``out``) this rank's counts, then those it was sent; back, the other way round;
        None under a capacity (fixed sizes)."""
        if self.capacity:
            return None
        return (self.counts, self.rcounts) if out else (self.rcounts, self.counts)

    def masks(self, w: bool, w1: bool, w2: bool) -> tuple[tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]:
        """The gradient masks of the three local ops (route, experts, combine) where the routing weights, w1 and w2
        get gradients; the routings (integers) and the counts get none."""
        return (True, False), (True,) + (() if self.capacity else (False,)) + (w1, w2), (True, False, w)


def _dispatched(plan: Decisions, x: ExpertDispatch, r: int) -> _Dispatched:
    """:class:`_Dispatched` of ``x`` on rank ``r``."""
    dg, n = plan.dg, x.experts
    members, p, g, groups = _ring_group(x.gathers[0], r)
    d = len(members)
    spec = kernel(n, dg, r)
    assert isinstance(spec, Forward) and spec.draw is None, n.name
    assert spec.local.out_scale == 1.0 and all(s == 1.0 for s in spec.local.in_scale), n.name
    op = spec.local.op
    tokens, idx, w = (piece(dg.values[gather.inputs[0]]) for gather in x.gathers)
    w1, w2 = (piece(dg.values[v]) for v in n.inputs[3:5])
    local, (count, k) = w1.type.shape[0], idx.type.shape
    assert isinstance(op, Experts) and op.start == p * local, n.name
    base, hidden, dtype = dg.values[n.outputs[0]].id, tokens.type.shape[1], tokens.type.dtype
    c = x.capacity
    bound = TensorType((d * count * min(k, local), hidden), dtype)  # every pair of every member that can reach here
    sent = TensorType((count * k, hidden), dtype)
    if c:  # C rows per expert of every member, sent and received
        sent = bound = TensorType((d * local * c, hidden), dtype)
    counted = TensorType((d, local), "int64")
    ops = (
        LocalOp(ExpertRoute(d, local, c), (1.0, 1.0)),
        LocalOp(ExpertsLocal(op.act, op.transposed, d * local * c or count * k, c), (1.0,) * (3 if c else 4)),
        LocalOp(ExpertCombine(c), (1.0,) * 3),
    )
    return _Dispatched(
        members,
        p,
        g,
        groups,
        tokens,
        idx,
        w,
        w1,
        w2,
        Buffer(f"{base}#rows", sent),
        Buffer(f"{base}#counts", counted),
        Buffer(f"{base}#received_counts", counted),
        Buffer(f"{base}#received", bound),
        Buffer(f"{base}#computed", bound),
        Buffer(f"{base}#back", sent),
        ops,
        tuple(f"{n.src}/{o.op.kind}" for o in ops),  # type: ignore[arg-type]
        c,
    )


def _exchange(
    x: ExpertDispatch,
    at: _Dispatched,
    token: int,
    task: TaskType,
    send: Buffer,
    recv: Buffer,
    splits: tuple[Buffer, Buffer] | None,
) -> Comm:
    """One all-to-all in group ``at`` along dim 0 of ``send``: of the routing's sizes where ``splits`` names the count
    buffers that size it (:meth:`_Dispatched.splits`), else of fixed size (the counts themselves; the rows under a
    capacity, C per expert of each member)."""
    kind = CommKind.ALL_TO_ALL if splits is None else CommKind.ALL_TO_ALL_V
    fixed = 0 if splits is None else None
    return Comm(
        token * at.groups + at.g,
        kind,
        task,
        at.members,
        send.type,
        wire_bytes(kind, send.type.nbytes, len(at.members)),
        _axis(x.gathers[0]),
        send=send,
        recv=recv,
        dim=fixed,
        dim2=fixed,
        note=x.experts.name,
        value=send.value,
        splits=splits,
    )


def _dispatch_forward(plan: Decisions, x: ExpertDispatch, r: int) -> list[Instr]:
    """The all-to-all token dispatcher's forward on rank ``r``
    (docs/lowering.md#17-the-all-to-all-token-dispatcher---ep-dispatch-all_to_all): route the rank's tokens (its rows,
    one per token and expert, by expert, and how many go to each expert of each member), exchange the counts (an
    all-to-all of fixed size), send the rows to their experts' members (an all-to-all of those sizes), compute its
    experts on the rows received, send them back the same way, and combine each token's rows by its routing
    weights into the output's piece (what the reduce-scatter of the all-gather dispatcher gives)."""
    dg, n = plan.dg, x.experts
    at = _dispatched(plan, x, r)
    out = piece(dg.values[x.scatter.nodes[-1].outputs[0]])
    masks = at.masks(*(x.backward.grad_mask[2:5] if x.backward is not None else (False,) * 3))
    keep = x.backward is not None

    def compute(i: int, ins: tuple[Buffer, ...], outs: tuple[Buffer, ...]) -> Compute:
        spec = Forward(at.ops[i], None, masks[i] if keep else ())
        return Compute(n.task, at.nodes[i], at.ops[i].op.kind, ins, outs, f"{n.name}/{i}", kernel=spec, micro=n.micro)

    instrs: list[Instr]
    if at.capacity:  # fixed sizes: nothing to exchange first
        instrs = [compute(0, (at.x, at.idx), (at.rows,))]
    else:
        instrs = [
            compute(0, (at.x, at.idx), (at.rows, at.counts)),
            _exchange(x, at, 0, n.task, at.counts, at.rcounts, None),
        ]
    first = len(instrs) - 1  # the token of the rows' all-to-all: after the counts' exchange, if any
    return instrs + [
        _exchange(x, at, first, n.task, at.rows, at.recv, at.splits(True)),
        compute(1, at.experts_ins, (at.done,)),
        _exchange(x, at, first + 1, n.task, at.done, at.back, at.splits(False)),
        compute(2, (at.back, at.idx, at.w), (out,)),
    ]


def _dispatch_backward(plan: Decisions, x: ExpertDispatch, r: int) -> list[Instr]:
    """The all-to-all token dispatcher's backward on rank ``r``: the output gradient through the combine (the
    gradients of the rows back and of the routing weights), the rows' gradients sent to the experts' members as the
    rows were, each member's experts differentiated on the rows it received (its experts' weight gradients, whole:
    every token routed to them is here), the rows' input gradients sent back, and the tokens' gradient summed from
    their rows."""
    dg, b = plan.dg, x.backward
    assert b is not None and x.dout is not None, x.experts.name
    at = _dispatched(plan, x, r)
    grads = dict(zip((i for i, m in enumerate(b.grad_mask) if m), b.outputs))
    final = {i: piece(dg.values[st.nodes[-1].outputs[0]]) for i, st in x.scatters.items()}
    final |= {i: piece(dg.values[grads[i]]) for i in (3, 4) if i in grads}
    masks = at.masks(*(i in grads for i in (2, 3, 4)))
    dout = piece(dg.values[x.dout.inputs[0]])
    base = at.back.value
    d_back = Buffer(f"{base}#grad", at.back.type)
    d_recv = Buffer(f"{at.done.value}#grad", at.recv.type)
    d_rows = Buffer(f"{at.rows.value}#grad", at.rows.type)
    d_received = Buffer(f"{at.recv.value}#grad", at.recv.type)

    def vjp(i: int, ins: tuple[Buffer, ...], dys: tuple[Buffer, ...], outs: tuple[Buffer, ...]) -> Compute:
        dy_mask = (True, False) if i == 0 and not at.capacity else (True,)
        spec = Vjp(at.ops[i], None, masks[i], (1.0,) * len(masks[i]), dy_mask, tuple(o.type.dtype for o in outs))
        return Compute(
            b.task,
            at.nodes[i],
            f"vjp[{at.ops[i].op.kind}]",
            ins + dys,
            outs,
            f"{b.name}/{i}",
            kernel=spec,
            micro=b.micro,
        )

    return [
        vjp(2, (at.back, at.idx, at.w), (dout,), (d_back,) + ((final[2],) if 2 in final else ())),
        _exchange(x, at, 0, b.task, d_back, d_recv, at.splits(True)),
        vjp(
            1,
            at.experts_ins,
            (d_recv,),
            (d_received,) + tuple(final[i] for i in (3, 4) if i in final),
        ),
        _exchange(x, at, 1, b.task, d_received, d_rows, at.splits(False)),
        vjp(0, (at.x, at.idx), (d_rows,), (final[0],)),
    ]


def _overlapped(plan: Decisions, instrs: list[Instr]) -> list[Instr]:
    """A ring attention's instructions as they are, or without ``overlap`` (:class:`LowerOptions`) each of its
    collective-permutes waited where it is issued: the same order, nothing travelling while a block computes."""
    if plan.overlap:
        return instrs
    return [dataclasses.replace(i, wait=True) if isinstance(i, Comm) else i for i in instrs if not isinstance(i, Wait)]


def _mask_blocks(
    plan: Decisions, a: DNode, d: int, tag: str, task: TaskType
) -> tuple[list[Instr], list[tuple[Buffer, ...]]]:
    """The instructions of ``task`` that cut forward attention ``a``'s mask (if it has one) into the columns of each
    of the ``d`` key blocks of a ring, and each block's mask operands (none, the mask itself where it broadcasts
    along the keys, or its columns)."""
    if len(a.inputs) < 4:
        return [], [()] * d
    m = piece(plan.dg.values[a.inputs[3]])
    last = len(m.type.shape) - 1
    op = plan.dg.pcg.local_of(plan.dg.sources[a.src], 0).op
    if m.type.shape[last] == 1 or isinstance(op, Attention) and op.layout is not None:
        return [], [(m,)] * d  # broadcast along the keys, or read by position (Attention.layout): whole
    cols = tuple(_chunk(m, j, d, last, tag) for j in range(d))
    return [Compute(task, a.src, "chunk", (m,), cols, dim=last)], [(c,) for c in cols]


def _permute(
    x: DNode,
    token: int,
    members: tuple[int, ...],
    peers: tuple[int, int],
    send: Buffer,
    recv: Buffer,
    task: TaskType,
    value: str,
) -> Comm:
    """One collective-permute step of a ring attention along all-gather ``x``'s axis and sequence dim: ``send`` to
    ``peers[0]``, ``recv`` from ``peers[1]``, issued without waiting; ``value``: the dynamic-graph value it moves
    (the same on every member)."""
    return Comm(
        token,
        CommKind.PERMUTE,
        task,
        members,
        send.type,
        wire_bytes(CommKind.PERMUTE, send.type.nbytes, len(members)),
        _along(x)[0],
        peer=peers[0],
        peer_from=peers[1],
        send=send,
        recv=recv,
        dim=_along(x)[1],
        wait=False,
        note=x.name,
        value=value,
    )


def _attention_ring_backward(plan: Decisions, ring: AttentionRing, r: int) -> list[Instr]:
    """The backward of ring attention on rank ``r`` (docs/lowering.md#16-ring-attention---cp-attention-ring): the
    keys and values travel around the ring again, as in the forward; each block present is differentiated against
    this rank's queries (:class:`~shardflow.lower.program.BlockVjp`, from the forward's merged output and
    log-sum-exp), its share of the query gradient added here, and its shares of the key and value gradients sent
    back to the block's owner — the rank it came from — while the next block is computed; each rank adds the shares
    it receives into the gradients of its own block: the reduce-scatters of the all-gather form, done by the ring."""
    dg = plan.dg
    a, b, gk, gv = ring.attention, ring.backward, ring.k, ring.v
    assert b is not None and ring.scatters is not None, a.name
    members, p, g, groups, dim, own, held, masks, instrs, out, lse = _ring_blocks(plan, ring, r, b.task, "bwd")
    d, block = len(members), own[0].type.shape[dim]
    spec = kernel(b, dg, r)
    assert isinstance(spec, Vjp) and spec.draw is None, b.name
    attention = spec.local.op
    assert isinstance(attention, Attention), b.name
    n_in = len(b.grad_mask)
    q, dout = piece(dg.values[b.inputs[0]]), piece(dg.values[b.inputs[n_in]])
    grads = dict(zip((i for i, m in enumerate(b.grad_mask) if m), b.outputs))
    dq = piece(dg.values[grads[0]]) if 0 in grads else Buffer(f"{q.value}#grad", q.type)
    final = [piece(dg.values[st.nodes[-1].outputs[0]]) for st in ring.scatters]  # this rank's dk, dv pieces
    partials = [dg.values[st.nodes[0].inputs[0]].id for st in ring.scatters]  # what the all-gather form reduces
    dtypes = (dq.type.dtype, final[0].type.dtype, final[1].type.dtype)
    sources = [dg.values[x.inputs[0]].id for x in (gk, gv)]

    def index(s: int, grad: bool) -> int:
        """Issue position of step ``s``'s pair of permutes: the keys and values of step 0; then per step the next
        keys and values (all steps but the last) and the gradients of the block at hand."""
        return 0 if s == 0 else 4 * s - 2 + (2 if grad and s < d - 1 else 0)

    def token(s: int, grad: bool, i: int) -> int:
        return (index(s, grad) + i) * groups + g

    def fetch(s: int) -> list[Instr]:
        to, frm = ring_peers(p, s + 1, d)
        return [
            _permute(x, token(s, False, i), members, (members[to], members[frm]), own[i], held[i][frm], b.task, value)
            for i, (x, value) in enumerate(zip((gk, gv), sources))
        ]

    def differentiate(j: int) -> tuple[Compute, tuple[Buffer, ...]]:
        op = dataclasses.replace(attention, keys_from=j * block)
        k = BlockVjp(dataclasses.replace(spec.local, op=op), dtypes)
        outs = (Buffer(f"{dq.value}#{j}", dq.type), *(Buffer(f"{f.value}#from{p}of{j}", f.type) for f in final))
        ins = (q, held[0][j], held[1][j], *masks[j], out, lse, dout)
        return Compute(b.task, b.src, b.label, ins, outs, b.name, kernel=k, micro=b.micro), outs

    def add(x: Buffer, y: Buffer, into: Buffer) -> Compute:
        return Compute(b.task, b.src, "add", (x, y), (into,))

    c, (dq_acc, dk_acc, dv_acc) = differentiate(p)
    instrs += [*fetch(0), c]
    pending: tuple[int, list[Buffer]] | None = None  # the step whose shares for our block travel, where they land
    for s in range(1, d):
        last = s == d - 1
        instrs += [Wait(token(s - 1, False, 0)), Wait(token(s - 1, False, 1))]
        if not last:
            instrs += fetch(s)
        j = ring_peers(p, s, d)[1]
        c, (dq_j, dk_j, dv_j) = differentiate(j)
        summed = dq if last else Buffer(f"{dq.value}#acc{s}", dq.type)
        instrs += [c, add(dq_acc, dq_j, summed)]
        dq_acc = summed
        frm, back = ring_peers(p, s, d)  # the block's owner is where it came from; ours went to frm
        got = [Buffer(f"{f.value}#from{members[frm]}", f.type) for f in final]
        instrs += [
            _permute(x, token(s, True, i), members, (members[back], members[frm]), share, got[i], b.task, moved)
            for i, (x, share, moved) in enumerate(zip((gk, gv), (dk_j, dv_j), partials))
        ]
        if pending is not None:
            instrs += [Wait(token(pending[0], True, 0)), Wait(token(pending[0], True, 1))]
            nxt = [Buffer(f"{f.value}#acc{s}", f.type) for f in final]
            instrs += [add(dk_acc, pending[1][0], nxt[0]), add(dv_acc, pending[1][1], nxt[1])]
            dk_acc, dv_acc = nxt
        pending = (s, got)
    assert pending is not None
    instrs += [Wait(token(pending[0], True, 0)), Wait(token(pending[0], True, 1))]
    return instrs + [add(dk_acc, pending[1][0], final[0]), add(dv_acc, pending[1][1], final[1])]


def _reduce_scatter_ring(st: Step, plan: Decisions, r: int, base: int, form: CommForm) -> list[Instr]:
    """A reduce-scatter as d−1 collective-permute steps with local adds: at step i the member at index p sends
    its partial of chunk (p − i) mod d to that member and adds the partial of chunk p it receives."""
    dg = plan.dg
    n, m = st.nodes
    vin, vout = dg.values[n.inputs[0]], dg.values[m.outputs[0]]
    axis, dim = n.op.axis, m.op.dim
    members, p, g, groups = _ring_group(n, r)
    d = len(members)
    src, out = piece(vin), piece(vout)
    parts = [_chunk(src, j, d, dim) for j in range(d)]
    instrs: list[Instr] = [Compute(n.task, n.src, "chunk", (src,), tuple(parts), dim=dim)]
    acc = parts[p]
    for i in range(1, d):
        to, frm = ring_peers(p, i, d)
        tmp = _chunk(src, i, d, dim, tag="recv")
        instrs.append(
            Comm(
                base + (i - 1) * groups + g,
                CommKind.PERMUTE,
                n.task,
                members,
                parts[to].type,
                wire_bytes(CommKind.PERMUTE, parts[to].type.nbytes, d),
                axis,
                peer=members[to],
                peer_from=members[frm],
                send=parts[to],
                recv=tmp,
                note=f"{n.name} + {m.name}",
                value=vin.id,
            )
        )
        nxt = out if i == d - 1 else Buffer(f"{out.value}#acc{i}", out.type)
        instrs.append(Compute(n.task, n.src, "add", (acc, tmp), (nxt,)))
        acc = nxt
    return instrs


def _copy_source(src_v: Value, dst_v: Value, d: int) -> int:
    """The device that sends device ``d`` its piece of a copy: ``d`` itself when it already holds the same
    piece (a (shard, device) pair both sides share moves nowhere), else the holder in the source sub-mesh."""
    s = src_v.sharding
    want = s.coord_of(dst_v.group, d)
    if in_group(src_v.group, d):
        have = s.coord_of(src_v.group, d)
        if (have.sum, have.shard) == (want.sum, want.shard):
            return d
    return _holder(src_v, want)


def _expand_copy(n: DNode, dg: DynamicGraph, r: int, base: int) -> list[Instr]:
    """One send/recv per destination device that does not hold its piece already (token = destination index);
    a device that does aliases its own piece."""
    src_v, dst_v = dg.values[n.inputs[0]], dg.values[n.outputs[0]]
    out: list[Instr] = []
    if in_group(dst_v.group, r):  # r as destination
        src = _copy_source(src_v, dst_v, r)
        b = piece(dst_v)
        if src == r:
            out.append(Compute(n.task, n.src, "alias", (piece(src_v),), (b,), n.name, kernel=kernel(n, dg, r)))
        else:
            out.append(
                Comm(
                    base + device_index(dst_v.group, r),
                    CommKind.RECV,
                    n.task,
                    (src, r),
                    b.type,
                    wire_bytes(CommKind.RECV, b.type.nbytes, 2),
                    "copy",
                    peer=src,
                    recv=b,
                    note=n.name,
                    value=src_v.id,
                    piece=_piece_index(src_v, dst_v, r),
                )
            )
    if in_group(src_v.group, r):  # r as source of every destination it serves
        b = piece(src_v)
        for d in dst_v.group.devices():
            if d != r and _copy_source(src_v, dst_v, d) == r:
                out.append(
                    Comm(
                        base + device_index(dst_v.group, d),
                        CommKind.SEND,
                        n.task,
                        (r, d),
                        b.type,
                        wire_bytes(CommKind.SEND, b.type.nbytes, 2),
                        "copy",
                        peer=d,
                        send=b,
                        note=n.name,
                        value=src_v.id,
                        piece=_piece_index(src_v, dst_v, d),
                    )
                )
    out.sort(key=lambda i: i.token if isinstance(i, Comm) else -1)
    return out


def _piece_index(src_v: Value, dst_v: Value, d: int) -> tuple[int, ...]:
    """(sum index, shard index per dim) of the piece of a copy that destination device ``d`` receives."""
    c = src_v.sharding.coord_of(dst_v.group, d)
    return (c.sum, *c.shard)


def _holder(v: Value, coord) -> int:
    """The device of ``v``'s sub-mesh that holds the piece at ``coord``."""
    return v.sharding.device_of(v.group, coord)


def lowering_summary(programs: Mapping[int, Program]) -> dict[str, int]:
    """Communication count by kind over all ranks (each collective counted once per group)."""
    seen: dict[int, str] = {}
    for p in programs.values():
        for c in p.comms:
            seen[c.token] = c.family
    out: dict[str, int] = {}
    for k in seen.values():
        out[k] = out.get(k, 0) + 1
    return out


def _partition(group: SubMesh, members_of: Callable[[int], tuple[int, ...]]) -> Iterator[tuple[int, ...]]:
    """The groups ``members_of`` cuts ``group``'s devices into, in the order of their first device: each asked
    once (a device already in a group is not asked again)."""
    covered: set[int] = set()
    for d in group.devices():
        if d not in covered:
            members = members_of(d)
            covered.update(members)
            yield members


def process_groups(dg: DynamicGraph, plan: Decisions) -> list[Group]:
    """The process group of every collective, in first-use order: the groups every rank creates, in this one
    order (torch.distributed requires every rank to take part in creating every group). A group whose members
    are one of the mesh's own axis groups is marked regular (its mesh and axis); the flattened axes of ``plan``'s
    folded all-reduces (:attr:`Decisions.flat`) add theirs."""
    keys: dict[tuple, DNode] = {}  # in first-use order; nodes with one key give the same groups
    for st in steps(dg):
        n = st.nodes[0]
        if n.kind == NodeKind.PARALLEL and not st.local:
            group = dg.values[n.inputs[0]].group if st.kind == CommKind.REDUCE else n.group
            # a Replicate's groups depend on its input's view
            replicate = st.kind in (CommKind.BROADCAST, CommKind.REDUCE)
            keys.setdefault((group, n.op.axis, dg.values[n.inputs[0]].group if replicate else None, st.kind), n)
    seen: dict[tuple[int, ...], str] = {}  # members → the mesh axis their collectives run along
    for (group, axis, _, kind), n in keys.items():
        if kind in (CommKind.BROADCAST, CommKind.REDUCE):
            for d in group.devices():
                seen.setdefault(replicate_group(n, dg, d)[0], axis)
        else:
            for members in _partition(group, lambda d: axis_members(group, axis, d)):
                seen.setdefault(members, axis)
    flat = dict.fromkeys((n.group, plan.axes(n)) for n in dg.nodes if n.name in plan.flat)
    for group, axes in flat:
        for members in _partition(group, lambda d: axes_members(group, axes, d)):
            seen.setdefault(members, "")
    whole = SubMesh(dg.pcg.mesh)
    return [
        Group(m, whole.mesh, axis) if axis and m == axis_members(whole, axis, m[0]) else Group(m)
        for m, axis in seen.items()
    ]
