"""Per-op placements on one mesh axis, chosen by an integer linear program over the rule tables
(docs/search.md#per-op-placements).

The presets place a whole model one way: every linear column- then row-parallel (tp), or every op on its batch
shard (dp). Here each op of the graph picks its own placements on one mesh axis of ``size`` devices, as
AutoParallel does over DTensor placements (meta-pytorch/autoparallel, after Alpa's intra-operator pass, Zheng et al.,
OSDI'22): for each node, every combination of input placements — each input ``Replicate()``, ``Shard(d)`` where
``size`` divides dim d, or ``Partial()`` for an activation — that its rule accepts (:func:`choices`) is one choice,
priced by its compute (forward and backward, on the machine spec's roofline) and, for a weight, its optimizer
update; each edge between a producer's output and a consumer's input is priced by the seconds of the communication
that moves it forward and of the one that brings its gradient back. One binary variable per choice, one pair
variable per edge and pair of placements that costs anything; the repeated blocks (transformer layers,
:func:`~shardflow.graph.blocks.repeated_blocks`) share their variables, so the problem grows with the ops of one
block. The solver is HiGHS, through ``scipy.optimize.milp``.

The program is a model of the step, not the step: memory is not priced (the search checks each plan's predicted
peak), and a gradient's communication is counted where the forward's placements make it (a replicated input of an op
whose work is split over the axis: its gradient comes back as partial sums). The answer is a :class:`Plan` of
per-node operand layouts (:attr:`~shardflow.strategy.plan.ModulePlan.operands`), planned, lowered and simulated
like any other; the search keeps it only where the simulator predicts it faster than the presets.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch

from shardflow.graph.blocks import block_nodes, repeated_blocks
from shardflow.graph.flops import op_flops
from shardflow.graph.fused import fused_linears
from shardflow.graph.graph import ComputationGraph, Node, TensorRole
from shardflow.graph.ops import (
    Attention,
    Expand,
    Linear,
    OpError,
    Permute,
    Reshape,
    Slice,
    TensorType,
    differentiable,
    torch_dtype,
)
from shardflow.graph.softmax import softmax_heads
from shardflow.parallel.collectives import KINDS, CommKind, redistribution_steps, wire_bytes
from shardflow.parallel.mesh import Mesh, Partial, Placement, Replicate, Shard, SubMesh
from shardflow.parallel.ops import redistribute
from shardflow.parallel.rules import RuleError, propagate
from shardflow.parallel.shape import ShardingError
from shardflow.parallel.sharding import Sharding
from shardflow.strategy.plan import ModulePlan, Plan, PlanError
from shardflow.strategy.presets import data_parallel, fully_sharded

# more input combinations than this for one node: only those placing every input alike are tried (with each input
# replicated, which every rule accepts)
MAX_COMBINATIONS = 4096
# seconds charged for a move no redistribution makes (Replicate or Shard → Partial): never chosen
IMPOSSIBLE = 1e6
# bytes an AdamW update reads and writes per byte of weight: the weight, its gradient and two slots, read and written
UPDATE_TRAFFIC = 8


class Machine(Protocol):
    """What the program prices with: a machine spec's roofline and links
    (:class:`~shardflow.simulator.machine.MachineSpec`, which the search passes; this layer does not import it)."""

    @property
    def name(self) -> str: ...

    def compute_seconds(
        self,
        flops: int,
        nbytes: int,
        dtype: torch.dtype,
        kernels: int = 1,
        largest: int | None = None,
        attention: str | None = None,
    ) -> float: ...

    def comm_seconds(self, kind: str, members: Sequence[int], nbytes: int) -> float: ...


@dataclass(frozen=True)
class Memory:
    """How the program models one device's memory (bytes) and how much of it an answer may hold.

    A trained weight placed ``s`` holds ``copies`` bytes per byte of its piece (the weight, its gradient, the
    optimizer's slots, a master copy under mixed precision), divided by ``fsdp`` (the fully-sharded degree beside
    the axis); a node holds its outputs' pieces that carry a gradient (saved for the backward; views excluded),
    divided by the data-parallel degree. The nodes and weights of the repeated blocks count ``blocks`` / (the blocks
    in the graph) times (the whole model's, where the search folds). ``level`` in (0, 1] caps the answer's bytes at
    that share of the way from the uncapped answer's bytes down to the fewest any answer holds (1: the fewest); the
    search raises it where a plan's predicted peak exceeds the budget."""

    level: float = 0.0
    copies: int = 4
    fsdp: int = 1
    blocks: int | None = None


@dataclass(frozen=True)
class WeightSync:
    """One collective every trained weight takes part in on the data-parallel axes beside the program's axis, per
    step: ``count`` calls of ``kind`` among ``members`` on a piece of 1/``divisor`` of the weight's piece on the
    axis — fsdp's all-gathers (forward, and again for the backward) and reduce-scatter, dp's all-reduce (of the
    1/fsdp piece under both: FSDP2's HSDP order). The program prices them by the weight's placement on its axis: a
    weight sharded there gathers and reduces less over the other axes."""

    kind: CommKind
    members: tuple[int, ...]
    count: int = 1
    divisor: int = 1


class PlacementError(ValueError):
    """The placement program has no answer (the solver's status names why)."""


@dataclass(frozen=True)
class Choice:
    """One way to run a node on the axis: the shardings of its ``inputs`` and ``outputs`` (one axis each),
    ``seconds`` of its computes (forward, and backward where it has one; its optimizer update for a weight's leaf),
    and ``split``: whether its work is divided over the axis (an output sharded or partial)."""

    inputs: tuple[Sharding, ...]
    outputs: tuple[Sharding, ...]
    seconds: float
    split: bool


@dataclass(frozen=True)
class Placements:
    """The program's answer on ``axis``: ``nodes`` (node name → its :class:`Choice`), ``leaves`` (weight, input or
    constant → its sharding), the predicted ``seconds`` (the objective: compute and communication of one step as the
    program models it), the solver's wall time ``solve_seconds``, the bytes one device holds as :class:`Memory`
    models them (``memory_bytes``) and the ``pricer`` it priced with."""

    axis: str
    nodes: Mapping[str, Choice]
    leaves: Mapping[str, Sharding]
    seconds: float
    solve_seconds: float
    memory_bytes: float
    pricer: _Pricer = field(repr=False, compare=False)

    def plan(self, graph: ComputationGraph) -> Plan:
        """The answer as a user plan on :attr:`axis`: each node's operand layouts, the weights' placements (by
        module and parameter name) and the data inputs' and constants' placements."""
        modules: dict[str, ModulePlan] = {}
        inputs = {}
        for name, s in self.leaves.items():
            if s.used_axes:
                role = graph.tensors[name].role
                if role == TensorRole.WEIGHT:
                    module, _, param = name.rpartition(".")
                    prev = modules.get(module, ModulePlan())
                    modules[module] = ModulePlan(params={**prev.params, param: {self.axis: placement(s, self.axis)}})
                else:
                    inputs[name] = {self.axis: placement(s, self.axis)}
        for node in graph.nodes:
            c = self.nodes[node.name]
            modules[node.name] = ModulePlan(operands=tuple({self.axis: placement(s, self.axis)} for s in c.inputs))
        return Plan(modules, inputs, name="placements")


def solve_on(
    graph: ComputationGraph, mesh: Mesh, spec: Machine, axis: str = "tp", memory: Memory = Memory()
) -> Placements:
    """:func:`solve` on ``mesh``'s ``axis``: priced for the ranks along it through rank 0, the activations' costs
    divided by the degree of the data-parallel axes beside it, the weights' states by its ``fsdp`` axis
    (``memory``'s ``fsdp`` is set from the mesh). Raises PlacementError, and PlanError for an axis other than dp
    and fsdp beside it."""
    others = [a for a in mesh.axis_names if a != axis]
    if set(others) - {"dp", "fsdp"}:
        raise PlanError(
            f"per-op placements on {axis!r} combine with dp and fsdp only, not {sorted(set(others) - {'dp', 'fsdp'})}"
        )
    step = mesh.axis_names.index(axis)
    members = tuple(k * math.prod(mesh.shape[step + 1 :]) for k in range(mesh.axis_size(axis)))
    fsdp = mesh.axis_size("fsdp") if "fsdp" in others else 1
    data = math.prod(mesh.axis_size(a) for a in others)

    def along(a: str) -> tuple[int, ...]:
        """The ranks along mesh axis ``a`` through rank 0."""
        k = mesh.axis_names.index(a)
        return tuple(j * math.prod(mesh.shape[k + 1 :]) for j in range(mesh.axis_size(a)))

    sync: list[WeightSync] = []
    if fsdp > 1:  # gathered for the forward and again for the backward (reshard after forward), reduce-scattered
        sync += [
            WeightSync(CommKind.ALL_GATHER, along("fsdp"), 2, fsdp),
            WeightSync(CommKind.REDUCE_SCATTER, along("fsdp")),
        ]
    if "dp" in others:
        sync.append(WeightSync(CommKind.ALL_REDUCE, along("dp"), 1, fsdp))
    memory = dataclasses.replace(memory, fsdp=fsdp)
    return solve(graph, axis, mesh.axis_size(axis), spec, members, data, memory, tuple(sync))


def placements_plan(
    graph: ComputationGraph, mesh: Mesh, spec: Machine, axis: str = "tp", memory: Memory = Memory()
) -> Plan:
    """The plan of ``graph`` on ``mesh``: per-op placements on ``axis`` (:func:`solve_on`, ``memory`` as it
    models and caps memory), with the presets of the
    mesh's data-parallel axes (``dp``: :func:`~shardflow.strategy.presets.data_parallel`; ``fsdp``:
    :func:`~shardflow.strategy.presets.fully_sharded` on the dims the placements leave whole). Raises
    PlacementError, and PlanError for another axis."""
    plan = solve_on(graph, mesh, spec, axis, memory).plan(graph)
    if "dp" in mesh.axis_names:
        plan = plan.merge(data_parallel(graph))
    if "fsdp" in mesh.axis_names:
        plan = plan.merge(fully_sharded(graph, mesh.axis_size("fsdp"), others=plan))
    return plan


def considered(
    graph: ComputationGraph, mesh: Mesh, spec: Machine, node: str, axis: str = "tp"
) -> list[tuple[Choice, float, bool]]:
    """``shardflow plan --explain NODE`` under per-op placements: each choice the program had for node ``node``, the
    seconds it would cost with every other node and leaf as the answer placed them (its compute, the moves of its
    inputs from their producers and of its outputs to their consumers, forward and gradient), and whether it is the
    answer's. Cheapest first; a choice no redistribution can feed (partial inputs from whole ones) is left out.
    Raises PlacementError as :func:`solve_on`, KeyError for a name of no node."""
    answer = solve_on(graph, mesh, spec, axis)
    pricer = answer.pricer
    grad = needs_grad(graph)
    by_name = {n.name: n for n in graph.nodes}
    target = by_name[node]
    consumers = graph.consumers()

    producer = graph.producer()

    def held(t: str) -> Sharding:
        """How the answer produces tensor ``t``."""
        p = producer.get(t)
        return answer.nodes[p.name].outputs[p.outputs.index(t)] if p else answer.leaves[t]

    rows = []
    for c in choices(graph, target, pricer, grad):
        seconds = c.seconds
        for i, t in enumerate(target.inputs):
            ttype = graph.tensors[t].type
            back = _gradient(c, i, ttype, axis) if t in grad else None
            seconds += pricer.edge(held(t), c.inputs[i], back, ttype, graph.tensors[t].role)
        for k, t in enumerate(target.outputs):
            ttype = graph.tensors[t].type
            for reader, i in consumers[t]:
                r = answer.nodes[reader.name]
                back = _gradient(r, i, ttype, axis) if t in grad else None
                seconds += pricer.edge(c.outputs[k], r.inputs[i], back, ttype, TensorRole.ACTIVATION)
        if seconds < IMPOSSIBLE:  # (partial sums made from whole or sharded inputs: no move does that)
            rows.append((c, seconds, c == answer.nodes[node]))
    return sorted(rows, key=lambda r: r[1])


def placement(s: Sharding, axis: str) -> Placement:
    """The placement of one-axis sharding ``s`` on ``axis``."""
    if axis in s.partial:
        return Partial(s.reduce_op)
    d = s.axis_dim(axis)
    return Replicate() if d is None else Shard(d)


def options(t: TensorType, axis: str, size: int, partial: bool, data: int = 1) -> list[Sharding]:
    """The shardings a tensor of type ``t`` may have on ``axis`` of ``size`` devices: replicated, sharded on each
    dim ``size`` divides (dim 0, which the data-parallel axes beside it may shard ``data`` ways already: ``size`` ×
    ``data``), and with ``partial``, partial sums."""
    out = [Sharding.replicated(t.ndim)]
    out += [
        Sharding.replicated(t.ndim).replace_dim(d, (axis,))
        for d, n in enumerate(t.shape)
        if n % (size * data if d == 0 else size) == 0
    ]
    if partial:
        out.append(Sharding(((),) * t.ndim, (axis,)))
    return out


def needs_grad(graph: ComputationGraph) -> set[str]:
    """Tensors of ``graph`` that carry a gradient: the trained weights and each output an op computes from them
    differentiably (:meth:`~shardflow.graph.ops.Op.grad_outputs`)."""
    need = {w for w in graph.weights if w not in graph.frozen}
    for n in graph.nodes:
        mask = tuple(t in need for t in n.inputs)
        if not any(mask):
            continue
        try:
            carried = n.op.grad_outputs(
                tuple(graph.tensors[t].type for t in n.inputs), tuple(graph.tensors[t].type for t in n.outputs), mask
            )
        except OpError:
            continue
        need.update(o for o, c in zip(n.outputs, carried) if c)
    return need


class _Pricer:
    """Seconds of computes and moves on one axis of ``size`` devices of ``spec`` (members ``members``), with the
    activations' costs divided by ``data`` (the data-parallel degree of the other axes)."""

    def __init__(
        self,
        axis: str,
        size: int,
        members: tuple[int, ...],
        spec: Machine,
        data: int,
        sync: tuple[WeightSync, ...] = (),
    ):
        self.axis, self.spec, self.members, self.data, self.sync = axis, spec, members, data, sync
        self.group = SubMesh(Mesh((axis,), (size,)))
        self.moves: dict[tuple[Sharding, Sharding, TensorType], float] = {}

    def local(self, s: Sharding, t: TensorType) -> TensorType:
        return TensorType(s.parallel_shape(self.group, t.shape).piece_shape, t.dtype)

    def move(self, src: Sharding, dst: Sharding, t: TensorType) -> float:
        """Seconds to redistribute a tensor of type ``t`` from ``src`` to ``dst`` (:data:`IMPOSSIBLE` where none
        does)."""
        if src == dst:
            return 0.0
        key = (src, dst, t)
        if key not in self.moves:
            try:
                steps = redistribution_steps(redistribute(src, dst, self.group), src, self.group, t)
                self.moves[key] = sum(self.spec.comm_seconds(KINDS[k].priced_as, self.members, b) for k, b in steps)
            except ShardingError:
                self.moves[key] = IMPOSSIBLE
        return self.moves[key]

    def edge(self, src: Sharding, want: Sharding, back: Sharding | None, t: TensorType, role: TensorRole) -> float:
        """Seconds of an edge carrying a tensor of type ``t`` (``role``) held as ``src`` to a reader that wants it as
        ``want`` and (``back``: None where it carries no gradient) gives its gradient back as ``back``: the forward
        move, and the gradient's move to ``src``'s placement (partial sums gathered where ``src`` is partial);
        an activation's divided by the data-parallel degree."""
        seconds = self.move(src, want, t)
        if back is not None:
            seconds += self.move(back, Sharding(src.dims), t)
        return seconds / self.data if role == TensorRole.ACTIVATION else seconds

    def compute(self, node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType], backward: bool) -> float:
        """Forward (and with ``backward``, twice that again) seconds of ``node`` on local types."""
        flops = op_flops(node.op, tuple(ins), tuple(outs))
        moved = sum(t.nbytes for t in (*ins, *outs))
        largest = max((t.nbytes for t in (*ins, *outs)), default=0)
        dtype = torch_dtype(outs[0].dtype) if outs else torch_dtype(ins[0].dtype)
        attention = isinstance(node.op, Attention)
        fwd = self.spec.compute_seconds(flops, moved, dtype, 1, largest, "forward" if attention else None)
        bwd = (
            self.spec.compute_seconds(2 * flops, 2 * moved, dtype, 2, largest, "backward" if attention else None)
            if backward
            else 0.0
        )
        return fwd + bwd

    def update(self, s: Sharding, t: TensorType) -> float:
        """Seconds of the optimizer update of a trained weight of type ``t`` held as ``s`` (memory-bound) and of its
        collectives on the axes beside (:class:`WeightSync`)."""
        local = self.local(s, t).nbytes
        seconds = self.spec.compute_seconds(0, UPDATE_TRAFFIC * local, torch_dtype(t.dtype), 1)
        for w in self.sync:
            sent = wire_bytes(w.kind, local // w.divisor, len(w.members))
            seconds += w.count * self.spec.comm_seconds(KINDS[w.kind].priced_as, w.members, sent)
        return seconds


def choices(graph: ComputationGraph, node: Node, pricer: _Pricer, grad: set[str]) -> list[Choice]:
    """Every :class:`Choice` of ``node`` whose input shardings (each of :func:`options`; partial sums for
    activations only) its rule accepts."""
    types = [graph.tensors[t].type for t in node.inputs]
    roles = [graph.tensors[t].role for t in node.inputs]
    axis, size = pricer.axis, pricer.group.mesh.axis_size(pricer.axis)
    opts = [
        options(
            t,
            axis,
            size,
            r == TensorRole.ACTIVATION and differentiable(t.dtype),
            1 if r == TensorRole.WEIGHT else pricer.data,
        )
        for t, r in zip(types, roles)
    ]
    if math.prod(len(o) for o in opts) <= MAX_COMBINATIONS:
        combos: list[tuple[Sharding, ...]] = list(itertools.product(*opts))
    else:  # every input alike: replicated, partial, or sharded on the same dim where it can be
        combos = [tuple(Sharding.replicated(t.ndim) for t in types)]
        for k in range(max(len(o) for o in opts)):
            combos.append(tuple(o[k] if k < len(o) else o[0] for o in opts))
    backward = any(o in grad for o in node.outputs)
    out, seen = [], set()
    for ins in combos:
        if ins in seen:
            continue
        seen.add(ins)
        try:
            res = propagate(node.op, node.inputs, types, ins, pricer.group, node.name, node.scope)
        except (RuleError, ShardingError):
            continue
        outs = [graph.tensors[t].type for t in node.outputs]
        seconds = pricer.compute(
            node,
            [pricer.local(s, t) for s, t in zip(ins, types)],
            [pricer.local(s, t) for s, t in zip(res.outputs, outs)],
            backward,
        )
        split = any(s.used_axes for s in res.outputs)
        out.append(Choice(tuple(ins), res.outputs, seconds / pricer.data, split))
    return out


def solve(
    graph: ComputationGraph,
    axis: str,
    size: int,
    spec: Machine,
    members: tuple[int, ...] | None = None,
    data: int = 1,
    memory: Memory = Memory(),
    sync: tuple[WeightSync, ...] = (),
    time_limit: float = 60.0,
) -> Placements:
    """The per-op placements of ``graph`` on mesh axis ``axis`` of ``size`` devices that the program (module
    docstring) prices cheapest on ``spec``; ``members``: the ranks of one group of the axis (default
    ``0..size-1``: the link they use); ``data``: the degree of the data-parallel axes beside it (activations'
    costs are divided by it); ``memory``: how memory is modeled and capped (:class:`Memory`); ``sync``: the
    collectives of each trained weight on those axes (:class:`WeightSync`). Raises PlacementError
    where the solver finds no answer within ``time_limit`` seconds, or none under the cap."""
    t0 = time.perf_counter()
    pricer = _Pricer(axis, size, members or tuple(range(size)), spec, data, sync)
    grad = needs_grad(graph)
    producer = graph.producer()

    # the repeated blocks share their variables: a node (or a weight) of block k is its block-0 twin's
    blocks = repeated_blocks(graph)
    per_block = block_nodes(graph, blocks) if len(blocks) > 1 else {}
    twin: dict[str, str] = {}
    if per_block:
        first = per_block[blocks[0]]
        for b in blocks[1:]:
            twins = per_block[b]
            if len(twins) != len(first) or any(_key(graph, n) != _key(graph, f) for n, f in zip(twins, first)):
                continue
            for n, f in zip(twins, first):
                twin[n.name] = f.name
                for t, ft in zip(n.inputs, f.inputs):
                    if graph.tensors[t].role == TensorRole.WEIGHT and graph.tensors[t].type == graph.tensors[ft].type:
                        twin.setdefault(t, ft)

    # variables: one binary per choice of each unit (a node or a leaf), the twins sharing theirs
    leaf_options: dict[str, list[Sharding]] = {}
    node_choices: dict[str, list[Choice]] = {}
    cache: dict[tuple, list[Choice]] = {}
    kept = _kept_whole(graph)
    for name, spec_ in graph.tensors.items():
        if spec_.role != TensorRole.ACTIVATION and name not in twin:
            leaf_options[name] = [
                s
                for s in options(spec_.type, axis, size, False, 1 if spec_.role == TensorRole.WEIGHT else data)
                if s.axis_dim(axis) not in kept.get(name, ())
            ]
    for n in graph.nodes:
        if n.name in twin:
            continue
        key = _key(graph, n)
        if key not in cache:
            cache[key] = choices(graph, n, pricer, grad)
        node_choices[n.name] = cache[key]
    offset: dict[str, int] = {}  # unit → its first variable
    costs: list[float] = []
    owner: list[str] = []  # variable → its unit
    alike = Counter(twin.values())  # unit → how many twins it stands for besides itself
    for name, opts in leaf_options.items():
        offset[name] = len(costs)
        leaf_type = graph.tensors[name].type
        trained = graph.tensors[name].role == TensorRole.WEIGHT and name in grad
        costs += [(1 + alike[name]) * pricer.update(s, leaf_type) if trained else 0.0 for s in opts]
        owner += [name] * len(opts)
    for name, cs in node_choices.items():
        if not cs:
            raise PlacementError(f"node {name!r}: its rule accepts no placement on {axis}")
        offset[name] = len(costs)
        costs += [(1 + alike[name]) * c.seconds for c in cs]
        owner += [name] * len(cs)
    n_binary = len(costs)

    def unit(name: str) -> str:
        return twin.get(name, name)

    # bytes each choice holds on one device (Memory), the block-0 units counting for every block of the model
    repeat = (memory.blocks or len(blocks)) / len(blocks) if blocks else 1.0
    in_block = {n.name for n in per_block.get(blocks[0], [])} if per_block else set()
    in_block |= {t for n in graph.nodes if n.name in in_block for t in n.inputs if t in leaf_options}
    held = [0.0] * n_binary
    for name, opts in leaf_options.items():
        if graph.tensors[name].role == TensorRole.WEIGHT and name in grad:
            for j, sh in enumerate(opts):
                local = pricer.local(sh, graph.tensors[name].type).nbytes
                held[offset[name] + j] = memory.copies * local / memory.fsdp
    by_name = {n.name: n for n in graph.nodes}
    for name, cs in node_choices.items():
        node = by_name[name]
        if isinstance(node.op, _VIEWS):
            continue
        for j, c in enumerate(cs):
            saved = [
                pricer.local(sh, graph.tensors[t].type).nbytes for sh, t in zip(c.outputs, node.outputs) if t in grad
            ]
            held[offset[name] + j] = sum(saved) / data
    held = [h * (1 + alike[owner[v]]) * (repeat if owner[v] in in_block else 1.0) for v, h in enumerate(held)]

    def out_options(tensor: str) -> list[tuple[int, Sharding]]:
        """(variable, sharding) of each way tensor ``tensor`` is produced."""
        if tensor in producer:
            p = producer[tensor]
            k = p.outputs.index(tensor)
            u = unit(p.name)
            return [(offset[u] + j, c.outputs[k]) for j, c in enumerate(node_choices[u])]
        u = unit(tensor)
        return [(offset[u] + j, s) for j, s in enumerate(leaf_options[u])]

    # each edge (producer unit's output k → consumer unit's input i; twins' edges are one, their seconds added) links
    # the producer's output shardings S with the consumer's (input, gradient) shardings W: a flow y[s, w] ≥ 0 with
    # Σ_w y[s, w] = Σ of the producer's choices giving s, Σ_s y[s, w] = Σ of the consumer's choices reading w —
    # the transport form of y = x_producer · x_consumer, whose relaxation is tight for one edge
    edges: dict[tuple[str, int, str, int], dict[tuple[Sharding, tuple[Sharding, Sharding | None]], float]] = {}
    sides: dict[tuple[str, int, str, int], tuple[dict, dict]] = {}
    for n in graph.nodes:
        u = unit(n.name)
        for i, t in enumerate(n.inputs):
            ttype = graph.tensors[t].type
            p = producer.get(t)
            key = (unit(p.name), p.outputs.index(t), u, i) if p else (unit(t), -1, u, i)
            if key not in sides:
                made: dict[Sharding, list[int]] = {}
                for v, sh in out_options(t):
                    made.setdefault(sh, []).append(v)
                read: dict[tuple[Sharding, Sharding | None], list[int]] = {}
                for j, c in enumerate(node_choices[u]):
                    read.setdefault((c.inputs[i], _gradient(c, i, ttype, axis) if t in grad else None), []).append(
                        offset[u] + j
                    )
                sides[key] = (made, read)
                edges[key] = {}
            made, read = sides[key]
            for src in made:
                for want, back in read:
                    pair = (src, (want, back))
                    seconds = pricer.edge(src, want, back, ttype, graph.tensors[t].role)
                    edges[key][pair] = edges[key].get(pair, 0.0) + seconds

    # objective Σ choice seconds + Σ flow seconds; constraints: one choice per unit, each edge's flow conserved
    flows = [(key, pair, sec) for key, pairs in edges.items() for pair, sec in pairs.items()]
    flow_var = {(key, pair): n_binary + k for k, (key, pair, _) in enumerate(flows)}
    n_vars = n_binary + len(flows)
    objective = np.array(costs + [sec for *_, sec in flows])
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    count = Counter(owner)
    r = 0
    for name, start in offset.items():
        rows += [r] * count[name]
        cols += range(start, start + count[name])
        vals += [1.0] * count[name]
        lo.append(1.0)
        r += 1
    for key, (made, read) in sides.items():
        # Σ_w y[src, w] = Σ x(src) for each producer placement, Σ_s y[s, w] = Σ x(w) for each consumer's
        balances = [([flow_var[key, (src, w)] for w in read], vs) for src, vs in made.items()]
        balances += [([flow_var[key, (src, w)] for src in made], vs) for w, vs in read.items()]
        for flow, vs in balances:
            rows += [r] * (len(flow) + len(vs))
            cols += flow + vs
            vals += [1.0] * len(flow) + [-1.0] * len(vs)
            lo.append(0.0)
            r += 1
    integrality = np.concatenate([np.ones(n_binary), np.zeros(len(flows))])

    def run(cap: float | None, least: bool = False) -> np.ndarray:
        """The program's answer (its variables), with the modeled bytes at most ``cap`` (None: uncapped); with
        ``least``, the answer of fewest modeled bytes instead of the fastest."""
        # imported here, not at the top: scipy takes a third of a second that every process start would pay
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        rr, cc, vv, bound = list(rows), list(cols), list(vals), list(lo)
        upper = list(lo)
        if cap is not None:
            rr += [r] * n_binary
            cc += range(n_binary)
            vv += held
            bound.append(0.0)
            upper.append(cap)
        matrix = coo_matrix((vv, (rr, cc)), shape=(r + (cap is not None), n_vars)).tocsr()
        res = milp(
            objective if cap is not None or not least else np.concatenate([held, np.zeros(len(flows))]),
            integrality=integrality,
            bounds=Bounds(np.zeros(n_vars), np.ones(n_vars)),
            constraints=LinearConstraint(matrix, np.array(bound), np.array(upper)),
            options={"time_limit": time_limit},
        )
        if res.x is None:
            raise PlacementError(
                f"the placement program on axis {axis!r} has no answer"
                + (f" holding at most {cap / 2**30:.3g} GiB per device (modeled)" if cap is not None else "")
                + f": {res.message}"
            )
        return res.x

    x = run(None)
    if memory.level > 0:
        most, fewest = float(np.dot(held, x[:n_binary])), float(np.dot(held, run(None, least=True)[:n_binary]))
        x = run(most - memory.level * (most - fewest) + 1e-6 * most)
    picked = {owner[v]: v - offset[owner[v]] for v in range(n_binary) if x[v] > 0.5}
    nodes = {n.name: node_choices[unit(n.name)][picked[unit(n.name)]] for n in graph.nodes}
    leaves = {
        name: leaf_options[unit(name)][picked[unit(name)]]
        for name, s in graph.tensors.items()
        if s.role != TensorRole.ACTIVATION
    }
    if not any(c.split for n, c in nodes.items() if op_flops(*_types(graph, by_name[n]))):
        raise PlacementError(
            f"the placement program splits no matmul over {axis!r}: its {size} devices would repeat each other's "
            f"work (a model this small is bound by kernel launches on {spec.name})"
        )
    modeled = float(np.dot(held, x[:n_binary]))
    return Placements(axis, nodes, leaves, float(np.dot(objective, x)), time.perf_counter() - t0, modeled, pricer)


_VIEWS = (Reshape, Permute, Expand, Slice)  # outputs that alias their input: no bytes of their own


def _kept_whole(graph: ComputationGraph) -> dict[str, set[int]]:
    """Weight → the dims a plan's placement must not shard, because a plan placing them so rewrites the graph the
    program's answer names (:func:`~shardflow.strategy.plan.resolve`): a softmax head's output features (its loss is
    then decomposed, vocabulary-parallel) and a fused linear's features (it is then split by parts). Readers may
    still read such a weight sharded (a local split of the stored weight). A weight of the root module (no module
    path to place it by) or stored in another shape than its module's stays replicated."""
    out: dict[str, set[int]] = {
        w: set(range(graph.tensors[w].type.ndim))
        for w in graph.weights
        if "." not in w
        or graph.module_shape(w) != graph.tensors[w].shape  # no module to place it by, or stored by parts
    }
    for head in softmax_heads(graph).values():
        lin: Linear = head.op  # type: ignore[assignment]
        out.setdefault(head.inputs[1], set()).add(lin.out_dim)
    for f in fused_linears(graph):
        for t, d in f.features:
            out.setdefault(t, set()).add(d)
    return out


def _gradient(c: Choice, i: int, t: TensorType, axis: str) -> Sharding:
    """The sharding input ``i`` (of type ``t``) of a node run as ``c`` gets its gradient in: partial sums where the
    input is replicated and the node's work split over the axis (each device's part of the work adds to all of it),
    replicated for partial sums (the gradient of a sum is the same for each term), else the input's own."""
    want = c.inputs[i]
    if c.split and not want.used_axes:
        return Sharding(((),) * t.ndim, (axis,))
    return Sharding(want.dims)


def _types(graph: ComputationGraph, n: Node) -> tuple:
    """``(op, input types, output types)`` of node ``n``: :func:`~shardflow.graph.flops.op_flops`'s arguments."""
    return n.op, tuple(graph.tensors[t].type for t in n.inputs), tuple(graph.tensors[t].type for t in n.outputs)


def _key(graph: ComputationGraph, n: Node) -> tuple:
    """What a node's choices depend on: its op and its inputs' types and roles."""
    return (n.op, tuple((graph.tensors[t].type, graph.tensors[t].role) for t in n.inputs))
