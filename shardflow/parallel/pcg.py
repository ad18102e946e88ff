"""The parallel computation graph (PCG) and sharding propagation.

:func:`build_pcg` lifts a :class:`ComputationGraph` onto a mesh: it walks the nodes in order, gives every
tensor a :class:`Sharding` (hence a :class:`ParallelTensorShape` and DTensor placements) and a sub-mesh, and
makes every change of sharding an explicit parallel-operator node (Repartition, Combine, Replicate,
Reduction). What to shard is decided by a strategy and handed over as :class:`Annotations`; the rules of
:mod:`shardflow.parallel.rules` decide everything else. Where a rule refuses its inputs, planning does not stop
(docs/concepts.md#4-sharding-rules-and-partial-sums): the inputs are redistributed to the cheapest placements the
rule accepts (bytes each device sends, as lowering will send them), at worst Replicate, and each such
:class:`Redistribution` is listed on the PCG.
``strict=True`` keeps the refusal instead.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from shardflow.graph.graph import ComputationGraph, Node, TensorRole
from shardflow.graph.ops import Binary, Dropout, Op, TensorType, Where
from shardflow.graph.rng import DrawSite, PieceSite
from shardflow.parallel.collectives import redistribution_cost
from shardflow.parallel.mesh import Mesh, Partial, Placement, Replicate, Shard, SubMesh
from shardflow.parallel.ops import ParallelOp, redistribute
from shardflow.parallel.rules import (
    LocalOp,
    RuleError,
    RuleResult,
    Valid,
    align_operands,
    padding_fill,
    propagate,
    rule_for,
    rule_replicated,
)
from shardflow.parallel.shape import DegreeError, ParallelTensorShape, ShardingError
from shardflow.parallel.sharding import Sharding

Layout = Mapping[str, Placement]  # mesh axis → placement, for the axes a strategy constrains


@dataclass(frozen=True, slots=True)
class PTensor:
    """A PCG tensor: full type, role, sharding and the sub-mesh whose devices hold its pieces."""

    name: str
    type: TensorType
    role: TensorRole
    sharding: Sharding
    group: SubMesh

    @property
    def pshape(self) -> ParallelTensorShape:
        return self.sharding.parallel_shape(self.group, self.type.shape, self.type.dtype)

    @property
    def placements(self):
        return self.sharding.placements(self.group)


@dataclass(frozen=True, slots=True)
class PNode:
    """A PCG node: a compute op (with the ``local`` kernel its rule chose) or a parallel op (``local`` None).

    ``why`` says, for a parallel op, what asked for it.
    """

    name: str
    op: Op | ParallelOp
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    group: SubMesh
    scope: str = ""
    local: LocalOp | None = None
    why: str = ""

    @property
    def is_parallel(self) -> bool:
        return isinstance(self.op, ParallelOp)


@dataclass(frozen=True)
class Annotations:
    """A strategy's decisions, on the names of one computation graph (everything unnamed is replicated).

    * ``leaves``: graph input / weight / constant → its sharding;
    * ``groups``: node name → the sub-mesh it runs on (default: the whole mesh);
    * ``edges``: (node name, input index) → the layout that input must have (module input layouts);
    * ``after``: tensor name → the layout it must have for all its consumers (module output layouts).
    A layout maps some mesh axes to placements; axes it does not name keep whatever they hold.
    * ``ops``: tensor name → parallel ops the user inserts right after it, in order.
    ``why`` gives, per edge/tensor, the reason printed beside inserted parallel ops.
    ``graph``: the graph these names refer to when the strategy rewrote the one it was resolved on (a fused
    linear computed part by part, :func:`shardflow.strategy.plan.split_fused`); :func:`build_pcg` plans it
    instead of its argument. None: the argument itself.
    """

    leaves: Mapping[str, Sharding] = field(default_factory=dict)
    groups: Mapping[str, SubMesh] = field(default_factory=dict)
    edges: Mapping[tuple[str, int], Layout] = field(default_factory=dict)
    after: Mapping[str, Layout] = field(default_factory=dict)
    ops: Mapping[str, tuple[ParallelOp, ...]] = field(default_factory=dict)
    why: Mapping[object, str] = field(default_factory=dict)
    graph: ComputationGraph | None = None


@dataclass(frozen=True, slots=True)
class Redistribution:
    """Parallel ops planning inserted because a rule refused its inputs: input ``index`` of node ``node`` (op
    ``op`` in module ``scope``), PCG tensor ``tensor``, moved from ``src`` to ``dst`` on ``group`` by ``ops``.

    ``nbytes``: bytes each device sends for it in the forward pass (as lowering sends them: an all-gather
    (d−1)·piece, an all-reduce 2(d−1)/d·piece, a reduce-scatter or all-to-all (d−1)/d·piece, a split 0);
    ``reason``: the first line of the rule's refusal.
    """

    node: str
    op: Op
    scope: str
    index: int
    tensor: str
    src: Sharding
    dst: Sharding
    group: SubMesh
    ops: tuple[ParallelOp, ...]
    nbytes: int
    reason: str

    def describe(self) -> str:
        """Two lines: node, module, input, placements from → to, the parallel ops and their bytes; the reason."""
        where = f"node {self.node!r} ({self.op.describe()}" + (f" in module {self.scope!r})" if self.scope else ")")
        ops = ", ".join(op.describe() for op in self.ops)
        return (
            f"{where}, input {self.index} {self.tensor!r}: {placements_text(self.src, self.group)} → "
            f"{placements_text(self.dst, self.group)} by {ops}, {self.nbytes:,} bytes per device\n"
            f"    reason: {self.reason}"
        )


@dataclass(frozen=True)
class PCG:
    """Parallel computation graph: PCG tensors and nodes (compute and parallel) in topological order.

    ``source`` maps each tensor of the original graph to the PCG tensor its consumers read after the
    strategy's output layouts (``after``) were applied. ``redistributions``: the parallel ops inserted where a
    rule refused its inputs, in node order.
    """

    mesh: Mesh
    graph: ComputationGraph
    tensors: Mapping[str, PTensor]
    nodes: tuple[PNode, ...]
    outputs: tuple[str, ...]
    loss: str | None
    redistributions: tuple[Redistribution, ...] = ()

    @property
    def parallel_nodes(self) -> tuple[PNode, ...]:
        return tuple(n for n in self.nodes if n.is_parallel)

    def listing(self) -> str:
        """One line per leaf tensor and per node: name, type, placements, parallel shape, op, scope."""
        lines = [f"PCG on mesh {self.mesh} ({self.mesh.size} devices)"]
        for name in self.graph.tensors:
            t = self.tensors.get(name)
            if t is not None and t.role != TensorRole.ACTIVATION:
                lines.append(f"{t.role:<8} {_tensor_text(t)}")
        for n in self.nodes:
            outs = ", ".join(_tensor_text(self.tensors[o]) for o in n.outputs)
            op = n.op.describe()
            note = f"   # {n.why}" if n.is_parallel and n.why else (f"   # {n.scope}" if n.scope else "")
            where = f" @{n.group}" if n.group.fixed else ""
            lines.append(f"{'*' if n.is_parallel else ' '} {outs} = {op}({', '.join(n.inputs)}){where}{note}")
        lines.append(f"outputs: {', '.join(_tensor_text(self.tensors[o]) for o in self.outputs)}")
        return "\n".join(lines)

    def redistribution_listing(self) -> str:
        """The inserted redistributions (:class:`Redistribution`), two lines each, under a heading with their total
        bytes; an empty string when there are none."""
        if not self.redistributions:
            return ""
        n, total = len(self.redistributions), sum(r.nbytes for r in self.redistributions)
        head = (
            f"# {n} redistribution{'s' * (n != 1)} inserted where a rule refused its inputs ({total:,} bytes "
            f"per device, forward)"
        )
        return "\n".join([head, *(r.describe() for r in self.redistributions)])

    def draw_site(self, node: PNode, device: int, seed: int, step: int) -> DrawSite:
        """Where random compute ``node`` draws on ``device`` (a member of its sub-mesh) at training ``step`` of a
        run seeded ``seed``: :meth:`piece_site` at that seed and step."""
        return self.piece_site(node, device).at(seed, step)

    def local_of(self, node: PNode, device: int) -> LocalOp:
        """What ``device`` runs for compute ``node``: the rule's local op, given the start of the device's block where
        the op holds one block of an input's dim (:attr:`LocalOp.block`: a vocabulary-parallel embedding or gather),
        and where its pieces of uneven dims end (:attr:`LocalOp.valid`: docs/concepts.md#uneven-shards)."""
        local = node.local
        if local is None:
            raise ValueError(f"node {node.name!r} is a parallel op: it runs no local op")
        valid = tuple(
            Valid(k, d, size, output, 0 if output else padding_fill(local.op, k, d))
            for output, names in ((False, node.inputs), (True, node.outputs))
            for k, name in enumerate(names)
            for d, size in self.short_dims(name, device)
        )
        if valid:
            local = dataclasses.replace(local, valid=valid)
        if local.block is None:
            return local
        i, d = local.block
        t = self.tensors[node.inputs[i]]
        return local.at_block(t.pshape.piece_slices(t.sharding.coord_of(t.group, device))[d].start)

    def short_dims(self, name: str, device: int) -> tuple[tuple[int, int], ...]:
        """(dim, indices held) for each dim of tensor ``name`` whose block on ``device`` is shorter than its piece (an
        uneven dim's last blocks, stored padded: docs/concepts.md#uneven-shards)."""
        t = self.tensors[name]
        if not t.sharding.uneven_dims(t.group, t.type.shape) or t.group.index(device) is None:
            return ()  # asked of every input and output of every node on every rank: the cached check first
        p = t.pshape
        held = p.piece_valid(t.sharding.coord_of(t.group, device))
        return tuple((d, held[d]) for d in p.uneven if held[d] < p.piece_shape[d])

    def piece_site(self, node: PNode, device: int) -> PieceSite:
        """Where ``device``'s piece of random compute ``node``'s output lies: the output's full shape and the
        start of the block the piece covers — the same block on every replica, so replicas draw alike and
        shards draw what one device draws there."""
        t = self.tensors[node.outputs[0]]
        if t.pshape.head_tail:
            raise ShardingError(
                f"random op {node.name!r} (in {node.scope or 'the model'}) draws on a sequence held in the "
                f"load-balanced layout of context parallelism, where its draws would not match one device's; "
                f"give --cp-layout contiguous, or drop the dropout"
            )
        block = t.pshape.piece_slices(t.sharding.coord_of(t.group, device))
        return PieceSite(node.name, t.type.shape, tuple(s.start for s in block))


def _placement_text(p) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    assert isinstance(p, Replicate)
    return "R"


def placements_text(sharding: Sharding, group: SubMesh) -> str:
    """``(S(0),R)``: the DTensor placements of ``sharding`` on ``group``, or the sharding itself where placements
    cannot say it (two axes sharding a dim out of mesh order)."""
    try:
        return "(" + ",".join(_placement_text(p) for p in sharding.placements(group)) + ")"
    except ShardingError:
        return f"({sharding})"


def _tensor_text(t: PTensor) -> str:
    return f"{t.name}: {t.type.dtype}{t.pshape} {placements_text(t.sharding, t.group)}"


MAX_TRIES = 256  # rule evaluations per refused node before its inputs are simply replicated


class _Builder:
    """State of one propagation: the PCG tensors and nodes made so far."""

    def __init__(self, graph: ComputationGraph, mesh: Mesh, ann: Annotations):
        self.graph, self.mesh, self.ann = graph, mesh, ann
        self.tensors: dict[str, PTensor] = {}
        self.nodes: list[PNode] = []
        self.redistributions: list[Redistribution] = []
        self.current: dict[str, str] = {}  # graph tensor → PCG tensor its consumers read
        self.cache: dict[tuple[str, Sharding, SubMesh], str] = {}
        self.names: set[str] = set(graph.tensors) | {n.name for n in graph.nodes}

    def fresh(self, base: str) -> str:
        i, name = 1, base
        while name in self.names:
            i, name = i + 1, f"{base}_{i}"
        self.names.add(name)
        return name

    def add_parallel(self, src: str, pops: list[ParallelOp] | tuple[ParallelOp, ...], why: str) -> str:
        for pop in pops:
            t = self.tensors[src]
            try:
                sharding, group = pop.apply(t.sharding, t.group)
                sharding.check(group, t.type.shape, pop.describe(), t.name, uneven=True)
            except ShardingError as e:
                raise ShardingError(f"{pop.describe()} on tensor {t.name!r} ({why or 'user'}): {e}") from None
            name = self.fresh(f"{t.name}.{pop.kind}")
            role = t.role if t.role != TensorRole.INPUT else TensorRole.ACTIVATION
            self.tensors[name] = PTensor(name, t.type, role, sharding, group)
            self.nodes.append(PNode(name, pop, (src,), (name,), group, why=why))
            src = name
        return src

    def to_layout(self, src: str, layout: Layout, why: str) -> str:
        t = self.tensors[src]
        return self.to_sharding(src, t.sharding.with_layout(layout, t.group), why)

    def to_sharding(self, src: str, want: Sharding, why: str) -> str:
        t = self.tensors[src]
        if t.sharding == want:
            return src
        key = (src, want, t.group)
        if key not in self.cache:
            self.cache[key] = self.add_parallel(src, redistribute(t.sharding, want, t.group), why)
        return self.cache[key]

    # --- where a rule refuses: the cheapest input shardings it accepts --------------------------------------
    def cost(self, src: str, want: Sharding) -> tuple[int, int]:
        """(bytes each device sends, communications) to give tensor ``src`` sharding ``want``; nothing where it has
        it already or the same redistribution was inserted before."""
        t = self.tensors[src]
        if t.sharding == want or (src, want, t.group) in self.cache:
            return 0, 0
        return redistribution_cost(redistribute(t.sharding, want, t.group), t.sharding, t.group, t.type)

    def candidates(self, src: str, replicated: bool) -> list[tuple[int, int, Sharding]]:
        """(bytes, communications, sharding) for each sharding tensor ``src`` could be given: its own, and each one
        that re-places some of its free axes (each as Replicate() or Shard(d)) — only Replicate where
        ``replicated``. Cheapest first; ties in enumeration order (an axis kept before an axis moved)."""
        t = self.tensors[src]
        axes = t.group.free_axes
        options = (Replicate(),) if replicated else (None, Replicate(), *(Shard(d) for d in range(t.type.ndim)))
        costs: dict[Sharding, tuple[int, int]] = {}
        for choice in itertools.product(options, repeat=len(axes)):
            try:
                s = t.sharding.with_layout({a: p for a, p in zip(axes, choice) if p is not None}, t.group)
                s.check(t.group, t.type.shape)
            except ShardingError:  # a degree that does not divide its dim
                continue
            if s not in costs:
                costs[s] = self.cost(src, s)
        return sorted(((*c, s) for s, c in costs.items()), key=lambda x: x[:2])

    def accepted(
        self, node: Node, ins: Sequence[str], group: SubMesh, refusal: ShardingError
    ) -> tuple[list[Sharding], RuleResult]:
        """The cheapest input shardings the rule of ``node`` accepts, and its result on them.

        Combinations of the inputs' :meth:`candidates` are tried cheapest first (total bytes, then communications,
        then changing later inputs before earlier ones, as DTensor follows its first argument) — at most
        :data:`MAX_TRIES`, then every input replicated, which every rule accepts. An op with no rule of its own
        gets replicated inputs at once. Raises ``refusal`` if even replicated inputs are refused.
        """
        types = [self.tensors[t].type for t in ins]
        options = [self.candidates(t, rule_for(node.op) is rule_replicated) for t in ins]

        def key(idx: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
            picked = [options[i][k] for i, k in enumerate(idx)]
            return sum(p[0] for p in picked), sum(p[1] for p in picked), idx

        start = (0,) * len(ins)
        heap, seen = [key(start)], {start}
        for _ in range(MAX_TRIES):
            if not heap:
                break
            *_, idx = heapq.heappop(heap)
            want = [options[i][k][2] for i, k in enumerate(idx)]
            try:
                return want, propagate(node.op, ins, types, want, group, node.name, node.scope)
            except (RuleError, DegreeError):
                pass
            for i in range(len(idx)):
                nxt = idx[:i] + (idx[i] + 1,) + idx[i + 1 :]
                if nxt[i] < len(options[i]) and nxt not in seen:
                    seen.add(nxt)
                    heapq.heappush(heap, key(nxt))
        want = [Sharding.replicated(t.ndim) for t in types]
        try:
            return want, propagate(node.op, ins, types, want, group, node.name, node.scope)
        except (RuleError, DegreeError):
            raise refusal from None

    def redistribute_input(self, node: Node, index: int, src: str, want: Sharding, refusal: ShardingError) -> str:
        """Tensor ``src`` with sharding ``want`` for input ``index`` of ``node``, whose rule refused it; the parallel
        ops inserted for it are recorded as a :class:`Redistribution`."""
        t = self.tensors[src]
        nbytes, _ = self.cost(src, want)
        start = len(self.nodes)
        out = self.to_sharding(src, want, f"redistributed: the rule of {node.name} refused input {index}")
        if len(self.nodes) > start:
            self.redistributions.append(
                Redistribution(
                    node.name,
                    node.op,
                    node.scope,
                    index,
                    src,
                    t.sharding,
                    want,
                    t.group,
                    tuple(n.op for n in self.nodes[start:]),
                    nbytes,
                    str(refusal).splitlines()[0],
                )
            )
        return out

    def define(
        self, name: str, type_: TensorType, role: TensorRole, sharding: Sharding, group: SubMesh, op: str
    ) -> None:
        sharding.check(group, type_.shape, op, name, uneven=True)
        if role == TensorRole.WEIGHT and sharding.partial:
            raise ShardingError(
                f"weight {name!r} is placed Partial({sharding.reduce_op!r}) on mesh axes {list(sharding.partial)}; "
                f"a weight must be Shard or Replicate on every axis (an optimizer step on partial pieces would "
                f"apply the whole gradient to each piece). Place it Replicate() or Shard(dim) instead"
            )
        self.tensors[name] = PTensor(name, type_, role, sharding, group)
        after = self.ann.after.get(name)
        cur = self.to_layout(name, after, self.ann.why.get(name, f"layout of {name}")) if after else name
        self.current[name] = self.add_parallel(cur, self.ann.ops.get(name, ()), f"user op after {name}")

    def node_group(self, name: str) -> SubMesh:
        return self.ann.groups.get(name, SubMesh(self.mesh))


def _group_fix(src: SubMesh, dst: SubMesh, tensor: str, node: str) -> str:
    """How to make tensor ``tensor`` on ``src`` readable by ``node`` on ``dst`` (their free axes differ)."""
    missing = [a for a in dst.free_axes if a not in src.free_axes]
    if missing:
        ops = ", ".join(f"ReplicateOp({dst.mesh.axis_size(a)}, {a!r})" for a in missing)
        return f"insert {ops} after {tensor!r} (Plan.ops) or place both on the same sub-mesh"
    extra = [a for a in src.free_axes if a not in dst.free_axes]
    return (
        f"the input spans axes {extra}, where {node!r} runs at one index: run {node!r} on every index of "
        f"those axes too (no stage= in its module plan) or place both on the same sub-mesh"
    )


def build_pcg(graph: ComputationGraph, mesh: Mesh, ann: Annotations | None = None, strict: bool = False) -> PCG:
    """Propagate shardings through ``graph`` (``ann.graph`` where the strategy rewrote it) on ``mesh`` following the
    strategy's annotations.

    Where a node's rule refuses its inputs (RuleError, or a DegreeError of its outputs), the inputs are
    redistributed to the cheapest shardings the rule accepts (:attr:`PCG.redistributions` lists them); with
    ``strict`` the refusal is raised instead. Raises ShardingError / RuleError / DegreeError naming the op,
    tensor, dim, size, axes and the fix for what no redistribution can mend (a leaf or layout that does not fit).
    """
    ann = ann or Annotations()
    graph = ann.graph if ann.graph is not None else graph
    b = _Builder(graph, mesh, ann)
    consumers = graph.consumers()
    for name, spec in graph.tensors.items():
        if spec.role == TensorRole.ACTIVATION:
            continue
        first = consumers[name][0][0].name if consumers[name] else None
        group = b.node_group(first) if first else SubMesh(mesh)
        sharding = ann.leaves.get(name, Sharding.replicated(len(spec.shape)))
        b.define(name, spec.type, spec.role, sharding, group, f"{spec.role} {name}")
    for node in graph.nodes:
        group = b.node_group(node.name)
        ins = []
        for i, t in enumerate(node.inputs):
            cur = b.current[t]
            src_group = b.tensors[cur].group
            if src_group.free_axes != group.free_axes:
                raise ShardingError(
                    f"node {node.name!r} (module {node.scope!r}) runs on {group} but its input {t!r} "
                    f"lives on {src_group}; {_group_fix(src_group, group, t, node.name)}"
                )
            want = ann.edges.get((node.name, i))
            if want is not None:
                cur = b.to_layout(cur, want, ann.why.get((node.name, i), f"input {i} of {node.name}"))
            ins.append(cur)
        types = [b.tensors[t].type for t in ins]
        shardings = [b.tensors[t].sharding for t in ins]
        if isinstance(node.op, (Binary, Where)):
            shardings = align_operands(types, shardings, group)
        try:
            res = propagate(node.op, ins, types, shardings, group, node.name, node.scope)
            ins = [b.to_sharding(t, s, f"align operands of {node.name}") for t, s in zip(ins, shardings)]
        except (RuleError, DegreeError) as refusal:
            if strict:
                raise
            shardings, res = b.accepted(node, ins, group, refusal)
            ins = [b.redistribute_input(node, i, t, s, refusal) for i, (t, s) in enumerate(zip(ins, shardings))]
        b.nodes.append(PNode(node.name, node.op, tuple(ins), node.outputs, group, node.scope, res.local))
        for o, s in zip(node.outputs, res.outputs):
            b.define(o, graph.tensors[o].type, TensorRole.ACTIVATION, s, group, node.name)
    outputs = tuple(b.current[o] for o in graph.outputs)
    loss = b.current[graph.loss] if graph.loss else None
    return PCG(mesh, graph, dict(b.tensors), tuple(b.nodes), outputs, loss, tuple(b.redistributions))


def lift(graph: ComputationGraph) -> PCG:
    """The PCG of ``graph`` on one device: every tensor unparallel (all degrees 1), no parallel ops."""
    return build_pcg(graph, Mesh(("d",), (1,)))


def evaluation(pcg: PCG) -> PCG:
    """``pcg`` as ``model.eval()`` runs it: every dropout an identity (p = 0). Tensors, shardings and node names
    are unchanged, so an evaluation step lowered from it reads the training step's weights (same value ids)."""

    def off(n: PNode) -> PNode:
        if not isinstance(n.op, Dropout):
            return n
        return dataclasses.replace(n, op=Dropout(0.0), local=dataclasses.replace(n.local, op=Dropout(0.0)))

    return dataclasses.replace(pcg, nodes=tuple(off(n) for n in pcg.nodes))
