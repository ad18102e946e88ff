"""The dynamic graph of one training step, built from a PCG by pure passes (FlexFlow PR #1637, #1640).

Values are forward tensors (``fwd:t``), gradients (``grad:t``, and per-consumer contributions
``grad:t@node``) and optimizer state (``opt:slot:w``), each with a sharding and a sub-mesh. Nodes are
FWD / BWD / LOSS / UPD invocations of compute ops, parallel ops, copies, gradient sums and updates.

Passes, each a function ``DynamicGraph -> DynamicGraph`` that checks before that it has not run and after
that its work is done:

1. :func:`pass_expansion` — a FWD node per PCG node; a LOSS node seeding the loss gradient; a BWD node per
   PCG node that has gradients to pass; gradient sums where a tensor has several consumers; and an UPD node
   per weight with its optimizer-state slots. Under gradient accumulation (:class:`MicroStep`) each weight-
   gradient contribution is first summed with the earlier micro-steps' (``acc`` values); only the last
   micro-step reduces and updates.
2. :func:`copy_insertion` — a COPY wherever a node reads a value held by another sub-mesh (a pipeline stage
   boundary), in the pass of the value's role. Identical copies collapse; nothing goes in front of a
   Replicate, which moves its data itself.

Gradient placements follow from the forward ones (no per-op backward rule): for an input on an axis where it
is ``Shard(d)`` the gradient is ``Shard(d)``; where it is ``Partial`` the gradient is ``Replicate``; where it is
``Replicate`` the gradient is ``Partial(sum)`` if any input or output of the op is sharded or partial on that
axis (each device holds only its contribution), else ``Replicate``. An operand that the rule scaled by
1/(sum degree) for partial-sum linearity (a bias added to a partial sum) gets a ``Replicate`` gradient with the
scale undone. Before a gradient is used it is brought to its tensor's canonical gradient sharding (partial
axes of the forward become replicated): ``Partial → Replicate`` is an all-reduce — e.g. data parallelism's
gradient synchronisation, or Megatron's all-reduce of the input gradient of a column-parallel linear. The
gradient of a parallel op's output is the exception: its summed pieces go straight to the op's input's canonical
sharding, one redistribution (an FSDP gather's gradient, Partial on dp and fsdp, becomes Shard on fsdp by a
reduce-scatter and then an all-reduce of the piece, not by an all-reduce of the whole first).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Iterable, Mapping

import torch

from shardflow.graph.graph import TensorRole
from shardflow.graph.ops import OpError, TensorType, dtype_name, torch_dtype
from shardflow.parallel.mesh import ReduceOp, SubMesh
from shardflow.parallel.ops import Combine, ParallelOp, Replicate, redistribute
from shardflow.parallel.pcg import PCG, PNode
from shardflow.parallel.sharding import Sharding


class ValueRole(StrEnum):
    """What a value of the step is: a forward tensor, a gradient, optimizer state, or a weight-gradient
    contribution accumulated over the micro-steps of one optimizer step (:class:`MicroStep`)."""

    FWD = "fwd"
    GRAD = "grad"
    OPT = "opt"
    ACC = "acc"


class TaskType(StrEnum):
    """The part of the training step a node belongs to (FlexFlow's task type): forward, the loss gradient's
    seed, backward, optimizer update. A copy takes the task type of the role of the value it moves."""

    FWD = "FWD"
    LOSS = "LOSS"
    BWD = "BWD"
    UPD = "UPD"


# The task type of the nodes that make, move or copy a value of each role
# (docs/lowering.md#2-copy-insertion-copy_insertion).
ROLE_TASK = {ValueRole.FWD: TaskType.FWD, ValueRole.GRAD: TaskType.BWD, ValueRole.OPT: TaskType.UPD,
             ValueRole.ACC: TaskType.BWD}


@dataclass(frozen=True, slots=True)
class MicroStep:
    """Which micro-step of an optimizer step a lowered step is, under gradient accumulation (``--accumulate N``):
    one of ``count`` micro-steps, each on 1/count of the batch; ``first`` and ``last`` say where it stands.

    The default, one micro-step that is both first and last, is the plain step: gradients reduced, weights
    updated. Otherwise the weight-gradient contributions each device holds (partial sums, before any reduction)
    are summed over the micro-steps: the first keeps them (``acc:`` values), a middle one adds its own to them, the
    last adds them to its own and only then reduces — once, by partial-sum linearity — and updates. The loss
    gradient's seed is 1/count, so that with a loss that is a mean over its micro-batch the gradients are the
    whole batch's. Micro-steps between the first and the last lower to one and the same step.
    """

    count: int = 1
    first: bool = True
    last: bool = True

    def __post_init__(self):
        if self.count < 1 or (self.count == 1) != (self.first and self.last):
            raise ValueError(f"micro-step {self}: {self.count} micro-step(s) per optimizer step, first={self.first}, "
                             f"last={self.last}; one micro-step is both first and last, two or more have one first "
                             f"and one last")

    @classmethod
    def sequence(cls, count: int) -> tuple[MicroStep, ...]:
        """The micro-steps of one optimizer step of ``count`` micro-steps, in order (``count`` 1: the plain
        step). Raises ValueError if ``count`` < 1."""
        if count < 1:
            raise ValueError(f"an optimizer step has at least one micro-step, not {count}")
        return tuple(cls(count, i == 0, i == count - 1) for i in range(count))

    @property
    def seed(self) -> float:
        """The loss gradient's seed: 1/count (the loss is the mean over the micro-batch)."""
        return 1.0 / self.count

    def __str__(self) -> str:
        if self.count == 1:
            return "whole batch"
        where = "first" if self.first else "last" if self.last else "middle"
        return f"{where} of {self.count} micro-steps"


class ActivationCheckpointing(StrEnum):
    """Which forward activations the backward recomputes instead of keeping (``--ac``; activation checkpointing,
    Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016; torch.utils.checkpoint per block as
    torchtitan's ``--activation_checkpoint.mode full`` applies it).

    ``none``: every activation a backward reads is kept from the forward. ``block``: the forward of each block
    (:func:`block_of`) runs again right before the block's backward, and the block's backward reads the recomputed
    activations; the forward keeps only what crosses a block boundary (each block's input and output), at the
    cost of a second forward of every block, its communication included.
    """

    NONE = "none"
    BLOCK = "block"


def block_of(scope: str) -> str:
    """The block a node in module ``scope`` belongs to under ``--ac block``: the module path up to its first
    integer component — a module held in a ``ModuleList``/``ModuleDict``/``Sequential`` under an index
    (``model.layers.3.mlp.up_proj`` → ``model.layers.3``; GPT-2's ``transformer.h.0.attn`` →
    ``transformer.h.0``) — or "" for a node outside every block (embedding, final norm, loss)."""
    parts = scope.split(".") if scope else []
    first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return "" if first is None else ".".join(parts[:first + 1])


def checkpoint_blocks(pcg: PCG) -> dict[str, str]:
    """PCG node → its block under ``--ac block`` (:func:`block_of`), for the nodes that recompute: compute nodes
    by their scope, and parallel ops on an activation of a block (a tensor-parallel all-reduce of a block's
    partial sums) with the block of the node that made it. Nodes on the weight side (an FSDP gather) are left
    out: the backward reads the gathered weight as it would without recomputation."""
    weight_side = _weight_side(pcg)
    made_in: dict[str, str] = {}
    out: dict[str, str] = {}
    for n in pcg.nodes:
        if n.outputs[0] in weight_side:
            continue
        b = made_in.get(n.inputs[0], "") if n.is_parallel else block_of(n.scope)
        if b:
            out[n.name] = b
            made_in.update(dict.fromkeys(n.outputs, b))
    return out


def narrow_weights(pcg: PCG, master: torch.dtype | None) -> tuple[str, ...]:
    """The weights of ``pcg`` held in ``master`` (a floating dtype) instead of their dtype in the graph: the floating
    ones of fewer bits (none when ``master`` is None)."""
    if master is None:
        return ()
    return tuple(w for w in pcg.graph.weights if w in pcg.tensors
                 and (d := torch_dtype(pcg.tensors[w].type.dtype)).is_floating_point and d.itemsize < master.itemsize)


class NodeKind(StrEnum):
    """What a dynamic-graph node does (see :class:`DNode`)."""

    COMPUTE = "compute"
    PARALLEL = "parallel"
    COPY = "copy"
    SUM = "sum"
    SEED = "seed"
    UPDATE = "update"
    SELECT = "select"
    SUMSQ = "sumsq"
    CAST = "cast"


class Optimizer(StrEnum):
    """The optimizers a run trains with (``--optimizer``), with torch.optim.SGD's, Adam's and AdamW's formulas."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


class UpdateRule(StrEnum):
    """The optimizer update a step is lowered for; it fixes the state slots each weight carries
    (:data:`OPTIMIZER_SLOTS`). Plain SGD and SGD with momentum differ in their state."""

    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    ADAMW = "adamw"

    @classmethod
    def of(cls, optimizer: Optimizer, momentum: float = 0.0) -> UpdateRule:
        """The update of ``optimizer`` (SGD with a nonzero ``momentum`` keeps a momentum slot)."""
        if optimizer in (Optimizer.ADAM, Optimizer.ADAMW):  # the same state; Adam couples its weight decay
            return cls.ADAMW
        return cls.SGD_MOMENTUM if momentum else cls.SGD


OPTIMIZER_SLOTS: dict[UpdateRule, tuple[str, ...]] = {
    UpdateRule.SGD: (), UpdateRule.SGD_MOMENTUM: ("momentum",), UpdateRule.ADAMW: ("exp_avg", "exp_avg_sq")}


# --- value ids: names for listings and buffers, formatted here and nowhere else ------------------------------
def forward_id(tensor: str) -> str:
    """The id of PCG tensor ``tensor``'s forward value (``fwd:<tensor>``)."""
    return f"{ValueRole.FWD}:{tensor}"


def grad_id(tensor: str, consumer: str = "") -> str:
    """The id of the gradient of ``tensor`` (``grad:<tensor>``), or of the contribution node ``consumer`` makes
    to it (``grad:<tensor>@<consumer>``)."""
    return f"{ValueRole.GRAD}:{tensor}" + (f"@{consumer}" if consumer else "")


def state_id(slot: str, weight: str) -> str:
    """The id of optimizer-state ``slot`` of ``weight`` (``opt:<slot>:<weight>``; checkpoints key state by it)."""
    return f"{ValueRole.OPT}:{slot}:{weight}"


def regathered_id(tensor: str) -> str:
    """The id of PCG tensor ``tensor`` (a gathered weight) gathered again for the backward (``fwd:<tensor>@bwd``)."""
    return f"{forward_id(tensor)}@bwd"


def compute_id(weight: str) -> str:
    """The id of a weight held in a wider master dtype, cast to its dtype in the graph for the step's readers
    (``fwd:<weight>@compute``; see ``master_dtype`` of :func:`pass_expansion`)."""
    return f"{forward_id(weight)}@compute"


def recomputed_id(tensor: str) -> str:
    """The id of PCG tensor ``tensor`` computed again for its block's backward under ``--ac block``
    (``fwd:<tensor>@re``)."""
    return f"{forward_id(tensor)}@re"


def accumulated_id(part: str) -> str:
    """The id of the sum over the micro-steps so far of gradient contribution ``part`` (``acc:<part>``)."""
    return f"{ValueRole.ACC}:{part}"


def with_accumulated_id(part: str) -> str:
    """The id of gradient contribution ``part`` plus its sum over the earlier micro-steps (``<part>+acc``)."""
    return f"{part}+{ValueRole.ACC}"


def microbatch_id(vid: str, micro: int) -> str:
    """The id of value ``vid`` of a one-microbatch step in microbatch ``micro`` of a step of several
    (``<vid>#<micro>``; :attr:`DynamicGraph.microbatches`)."""
    return f"{vid}#{micro}"


def update_id(replaced: str) -> str:
    """The id of an update's new version of value ``replaced`` (``upd:<replaced>``)."""
    return f"upd:{replaced}"


@dataclass(frozen=True, slots=True)
class Value:
    """One value of the step: ``role`` fwd / grad / opt, of PCG ``tensor``, placed by ``sharding`` on ``group``.

    ``slot``: the optimizer-state slot (``momentum``, ``exp_avg``, ...) of an ``opt`` value. ``replaces``: for
    an optimizer update's output, the value it replaces once the step is done (the weight or the state slot); for
    a middle micro-step's new sum of a gradient contribution, the ``acc`` value it replaces.
    The ``id`` is a unique name for listings, made by this module's id functions (:func:`forward_id`, ...);
    nothing parses it: what a value is, its fields say.
    """

    id: str
    tensor: str
    role: ValueRole
    type: TensorType
    sharding: Sharding
    group: SubMesh
    slot: str = ""
    replaces: str = ""

    @property
    def pass_(self) -> TaskType:
        """The task type of the nodes that move this value (:data:`ROLE_TASK`)."""
        return ROLE_TASK[self.role]


@dataclass(frozen=True, slots=True)
class DNode:
    """One node of the dynamic graph.

    ``kind``: ``compute`` (a PCG compute op; FWD runs ``local``, BWD its vjp), ``parallel`` (a parallel op
    on a value), ``copy`` (same sharding, other sub-mesh), ``sum`` (gradient accumulation), ``seed`` (loss
    gradient), ``update`` (optimizer step), ``select`` (Replicate's backward when the gradient is replicated:
    the devices of the root sub-mesh keep their copy), ``cast`` (a weight held in a master dtype converted to its
    dtype in the graph: ``master_dtype`` of :func:`pass_expansion`). ``src`` is the PCG node it comes from (a
    cast's: its weight).
    For a BWD compute node, ``grad_mask[i]`` tells whether input i gets a gradient, ``unscale[i]`` undoes a
    linearity scale on it, and ``dy_mask[k]`` whether output k has a gradient (its ``dy`` is an input).
    An ``update`` with ``clip`` > 0 reads the squared global gradient norm as its last input; ``sumsq``
    sums the squares of the gradient pieces each device holds (see :attr:`DynamicGraph.grad_norm_sq`). A
    ``seed`` fills the loss gradient with ``scale`` (1, or 1/N in each of N micro-steps: :class:`MicroStep`).
    ``recompute``: a FWD node run again before its block's backward (:class:`ActivationCheckpointing`); the
    forward's own node of a recomputed op keeps nothing for the backward.
    """

    name: str
    pass_: TaskType
    kind: NodeKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    group: SubMesh
    src: str = ""
    op: ParallelOp | None = None
    grad_mask: tuple[bool, ...] = ()
    unscale: tuple[float, ...] = ()
    dy_mask: tuple[bool, ...] = ()
    label: str = ""
    clip: float = 0.0
    scale: float = 1.0
    recompute: bool = False
    micro: int = 0


@dataclass(frozen=True)
class DynamicGraph:
    """Values and nodes (in a valid execution order) of one training step, and the passes applied so far.

    ``grad_norm_sq``: the id of the squared global L2 norm of all gradients (a scalar whole on every device of
    the mesh, kept after the step), or "" when the step does not compute it (no clipping, no ``grad_norm``).
    ``microbatches``: how many microbatches the step's batch is cut into (``microbatches`` of
    :func:`pass_expansion`): each has its own data inputs, forward, loss and backward values
    (:func:`microbatch_id`), the PCG's shapes being one microbatch's.
    """

    pcg: PCG
    values: Mapping[str, Value]
    nodes: tuple[DNode, ...]
    optimizer: UpdateRule = UpdateRule.SGD
    done: tuple[str, ...] = ()
    grad_norm_sq: str = ""
    microbatches: int = 1

    def producers(self) -> dict[str, DNode]:
        return {v: n for n in self.nodes for v in n.outputs}

    @property
    def loss_values(self) -> tuple[str, ...]:
        """The ids of the loss's forward values, one per microbatch (the step's loss is their mean). Raises
        PassError if the PCG has no loss."""
        if self.pcg.loss is None:
            raise PassError("the graph has no scalar loss output")
        return self.per_microbatch(forward_id(self.pcg.loss))

    @cached_property
    def buffer_stats(self) -> dict[str, tuple[str, ...]]:
        """Each batch statistic a buffer update reads (graph output ``BufferUpdate.stat``: batch norm's mean and
        variance) → its forward values, one per microbatch, in order; built once per graph."""
        graph = self.pcg.graph
        pcg_name = dict(zip(graph.outputs, self.pcg.outputs))
        return {u.stat: self.per_microbatch(forward_id(pcg_name[u.stat]))
                for u in graph.buffer_updates.values() if u.stat is not None}

    def per_microbatch(self, vid: str) -> tuple[str, ...]:
        """The ids of value ``vid`` of a one-microbatch step in each microbatch of this one, in order (``vid``
        itself when the step has one)."""
        if self.microbatches == 1:
            return (vid,)
        return tuple(microbatch_id(vid, m) for m in range(self.microbatches))

    @cached_property
    def sources(self) -> dict[str, PNode]:
        """The PCG's nodes by name (what a node's ``src`` names), built once per graph."""
        return {n.name: n for n in self.pcg.nodes}

    @cached_property
    def backward_of(self) -> dict[str, DNode]:
        """PCG compute node name → its BWD compute node, for the nodes that have one; built once per graph."""
        return {n.src: n for n in self.nodes if n.kind == NodeKind.COMPUTE and n.pass_ == TaskType.BWD}

    @cached_property
    def recomputed(self) -> frozenset[str]:
        """PCG nodes whose forward runs again before their backward (``--ac block``); built once per graph."""
        return frozenset(n.src for n in self.nodes if n.recompute)

    def state_values(self) -> tuple[str, ...]:
        """Optimizer-state values a step starts from (not the updates' new versions)."""
        return tuple(vid for vid, v in self.values.items() if v.role == ValueRole.OPT and not v.replaces)

    def placed(self) -> tuple[str, ...]:
        """Values the executor places before a step: the weights, the optimizer state, the step's data
        inputs (each microbatch's: :meth:`per_microbatch`) and the graph's constants (each rank holds the pieces
        its sub-mesh gives it)."""
        graph = self.pcg.graph
        inputs = [v for t in graph.inputs for v in self.per_microbatch(forward_id(t))]
        leaves = (*map(forward_id, graph.weights), *inputs, *map(forward_id, graph.constants))
        return tuple(v for v in leaves if v in self.values) + self.state_values() + self.accumulated()[0]

    def accumulated(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The gradient contributions summed over earlier micro-steps that this step reads (the executor holds
        them from the micro-step before), and the sums it writes for the next micro-step (:class:`MicroStep`);
        both empty in a plain step."""
        written = {v for n in self.nodes for v in n.outputs}
        acc = [vid for vid, v in self.values.items() if v.role == ValueRole.ACC]
        return tuple(v for v in acc if v not in written), tuple(v for v in acc if v in written)

    def persistent(self) -> frozenset[str]:
        """Values that outlive one step: weights, optimizer state and the updates' new versions of both, the
        gradients the updates read (kept for inspection), the squared gradient norm, the loss, the batch statistics
        of buffer updates (:attr:`buffer_stats`), the sums of gradient contributions a micro-step leaves for the
        next (:meth:`accumulated`), and the graph's constants (placed once, not every step)."""
        keep = set(self.loss_values) if self.pcg.loss else set()
        keep.update(v for v in map(forward_id, self.pcg.graph.constants) if v in self.values)
        keep.update(v for vids in self.buffer_stats.values() for v in vids)
        keep.update(self.accumulated()[1])
        if self.grad_norm_sq:
            keep.add(self.grad_norm_sq)
        keep.update(forward_id(w) for w in self.pcg.graph.weights)
        keep.update(vid for vid, v in self.values.items() if v.role == ValueRole.OPT or v.replaces)
        keep.update(n.inputs[1] for n in self.nodes if n.kind == NodeKind.UPDATE)
        return frozenset(keep)

    def listing(self) -> str:
        """One line per node in execution order — pass, kind, name, inputs → outputs — and each value's
        sharding and sub-mesh at its first appearance (``--dump-after pass_expansion``)."""
        seen: set[str] = set()
        lines = [f"dynamic graph: {len(self.nodes)} nodes, {len(self.values)} values, passes done: "
                 f"{', '.join(map(str, self.done))}"]

        def show(vid: str) -> str:
            if vid in seen:
                return vid
            seen.add(vid)
            v = self.values[vid]
            return f"{vid}[{v.sharding}@{v.group}]"

        for n in self.nodes:
            ins = ", ".join(map(show, n.inputs))
            outs = ", ".join(map(show, n.outputs))
            lines.append(f"  {n.pass_:<4} {n.kind:<8} {n.name}: {ins} -> {outs}")
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """sha256 of the whole step (nodes, values with their shardings, every local kernel): equal on every
        rank that built the same plan, whatever its rank — what ranks compare at start-up."""
        local = tuple((n.name, n.local) for n in self.pcg.nodes)
        return hashlib.sha256(repr((self.nodes, sorted(self.values.items()), local, self.microbatches)).encode()
                              ).hexdigest()


class PassError(RuntimeError):
    """A pass found the graph in a state it cannot work on (run twice, run out of order, left work undone)."""


class PassName(StrEnum):
    """The lowering passes, in order (see :mod:`shardflow.lower.passes`)."""

    PASS_EXPANSION = "pass_expansion"
    COPY_INSERTION = "copy_insertion"
    SCHEDULE = "schedule"
    SHARD_EXPANSION = "shard_expansion"
    COMM_LOWERING = "comm_lowering"
    ORDERING = "ordering"
    VERIFY = "verify"


def require(done: Iterable[str], name: PassName, before: tuple[PassName, ...]) -> None:
    """The check every pass makes first: it has not run yet, and the passes ``before`` have. Raises
    PassError naming what is missing."""
    done = [str(p) for p in done]
    if name in done:
        raise PassError(f"pass {str(name)!r} has already run on this graph (passes done: {done})")
    missing = [str(p) for p in before if p not in done]
    if missing:
        raise PassError(f"pass {str(name)!r} needs {missing} first (passes done: {done})")


def canonical_grad(s: Sharding) -> Sharding:
    """The sharding a tensor's gradient is used in: the forward's, with partial axes replicated."""
    return Sharding(s.dims)


class _Graph:
    """Mutable accumulator used inside one pass; the pass returns an immutable DynamicGraph."""

    def __init__(self, values: Mapping[str, Value] | None = None):
        self.values: dict[str, Value] = dict(values or {})
        self.nodes: list[DNode] = []

    def value(self, id_: str, tensor: str, role: ValueRole, type_: TensorType, sharding: Sharding, group: SubMesh,
              slot: str = "", replaces: str = "") -> str:
        base, i = id_, 1
        while id_ in self.values:
            i += 1
            id_ = f"{base}~{i}"
        self.values[id_] = Value(id_, tensor, role, type_, sharding, group, slot, replaces)
        return id_

    def redistribute(self, vid: str, want: Sharding, pass_: TaskType, src: str) -> str:
        """Parallel-op nodes taking value ``vid`` to sharding ``want`` (same sub-mesh); returns the final id."""
        v = self.values[vid]
        for k, pop in enumerate(redistribute(v.sharding, want, v.group)):
            s, g = pop.apply(v.sharding, v.group)
            out = self.value(f"{v.id}.{pop.kind}", v.tensor, v.role, v.type, s, g)
            self.nodes.append(DNode(f"{pass_} {pop.describe()} {v.id}", pass_, NodeKind.PARALLEL, (v.id,), (out,), g,
                                    src, pop))
            v = self.values[out]
        return v.id


def _needs_grad(pcg: PCG) -> set[str]:
    """PCG tensors whose gradient the step needs: weights and each output an op computes from them differentiably
    (:meth:`~shardflow.graph.ops.Op.grad_outputs`: a floating-point output, and not a constant of its inputs such
    as ``full_like``'s). The backward is planned from this set, so an op autograd cannot differentiate is refused
    here, before any step runs.

    Raises:
        PassError: an op on the gradient's path has no derivative; names the op, its module and source line.
    """
    need = {n for n, t in pcg.tensors.items() if t.role == TensorRole.WEIGHT}
    for n in pcg.nodes:
        mask = tuple(i in need for i in n.inputs)
        if not any(mask):
            continue
        if n.is_parallel:
            need.update(n.outputs)
            continue
        try:
            carried = n.op.grad_outputs(tuple(pcg.tensors[t].type for t in n.inputs), mask)
        except OpError as e:
            node = next((m for m in pcg.graph.nodes if m.name == n.name), None)
            source = f" at {node.source}" if node is not None and node.source else ""
            raise PassError(
                f"op {n.name!r} ({n.op.describe()}) in module {n.scope or '<root>'!r}{source} lies on the "
                f"gradient's path from the loss to the weights, but torch's autograd cannot differentiate it: {e}. "
                f"Write that line of the model with differentiable ops, or compute it under torch.no_grad() (or "
                f"from .detach()ed inputs) if no gradient should flow through it") from None
        need.update(o for o, c in zip(n.outputs, carried) if c)
    return need


def grad_sharding(pcg: PCG, node: PNode, i: int) -> tuple[Sharding, float]:
    """Sharding of the gradient contribution node ``node`` makes for its input ``i``, and the factor that
    undoes a linearity scale (see the module docstring)."""
    ins = [pcg.tensors[t].sharding for t in node.inputs]
    outs = [pcg.tensors[t].sharding for t in node.outputs]
    s = ins[i]
    scale = node.local.in_scale[i] if node.local else 1.0
    out_partial = set(outs[0].partial)
    partial = []
    for a in node.group.free_axes:
        if a in s.used_axes:
            continue
        if scale != 1.0 and a in out_partial:
            continue
        if any(a in x.used_axes for x in ins + outs):
            partial.append(a)
    return Sharding(s.dims, tuple(partial)), (1.0 / scale if scale != 1.0 else 1.0)


def _weight_side(pcg: PCG, weights: Iterable[str] | None = None) -> set[str]:
    """The weights (or those of ``weights``) and the outputs of parallel ops applied to them (a weight gathered
    before use): the tensors whose gradient reaches only weights, and only through data movement — linear, so
    contributions to it may be summed over micro-steps and moved once (:class:`MicroStep`)."""
    side = {w for w, t in pcg.tensors.items() if t.role == TensorRole.WEIGHT} if weights is None else set(weights)
    for n in pcg.nodes:
        if n.is_parallel and n.inputs[0] in side:
            side.update(n.outputs)
    return side


def pass_expansion(pcg: PCG, optimizer: UpdateRule = UpdateRule.SGD, training: bool = True,
                   clip_norm: float | None = None, grad_norm: bool = False,
                   micro: MicroStep = MicroStep(), reshard_after_forward: bool = True,
                   ac: ActivationCheckpointing = ActivationCheckpointing.NONE,
                   master_dtype: torch.dtype | None = None, microbatches: int = 1) -> DynamicGraph:
    """FWD, LOSS, BWD and UPD nodes of one training step of ``pcg`` (see the module docstring); with
    ``training=False`` only the FWD nodes (evaluation). ``clip_norm``: clip gradients to this global norm
    (torch.nn.utils.clip_grad_norm_ semantics) — one reduction over all devices before the updates.
    ``grad_norm``: compute the global gradient norm even without clipping (for metrics), after the updates,
    which do not read it. Either way the graph names it (:attr:`DynamicGraph.grad_norm_sq`).

    ``micro``: which micro-step of an optimizer step this is under gradient accumulation (:class:`MicroStep`):
    every contribution to a weight's gradient (or to a parallel op's output on a weight) is summed with its
    ``acc`` value, a SUM node before any reduction; a micro-step that is not the last stops there — no gradient
    of a weight is reduced, no update, no gradient norm — and leaves the sums for the next one.

    ``reshard_after_forward``: a weight gathered by a Combine (FSDP's all-gather) is freed after its last forward
    use and gathered again, by a second Combine in the backward right before the first backward node that reads
    it (FSDP's ``reshard_after_forward=True``: the whole weight lives twice briefly instead of through the step);
    False keeps the forward's gather for the backward (ZeRO-2-like memory, half the all-gathers).

    ``ac``: activation checkpointing (:class:`ActivationCheckpointing`). Under ``block``, right before the first
    backward node of a block, FWD nodes (``recompute``) run the block's forward again (:func:`checkpoint_blocks`:
    its compute ops and the parallel ops on its activations, reading the block's input and its weights, a gathered
    weight gathered again under ``reshard_after_forward``); the block's backward nodes read those values, so the
    forward's activations inside a block die with their last forward reader.

    ``master_dtype``: mixed precision (FSDP2's ``MixedPrecisionPolicy(param_dtype=<the graph's>,
    reduce_dtype=master_dtype)``, Micikevicius et al., "Mixed Precision Training", 2018). A weight whose dtype in the
    graph is a narrower float (bfloat16 from a model captured in bf16) is held in ``master_dtype`` (``fwd:W`` — what
    the executor places, checkpoints and updates); a FWD ``cast`` node makes its copy in the graph's dtype
    (``fwd:W@compute``) at the start of the step, and every reader — a compute op, an FSDP gather (so it gathers the
    narrow copy) — reads that. The gradients of the weight side (the weight and its gathered copies) are
    ``master_dtype`` values: each backward writes its contribution in it, so every reduction of a weight's gradient
    (all-reduce, reduce-scatter, the micro-steps' sums), the gradient norm and the optimizer state are in
    ``master_dtype``. None (default): every weight in its own dtype (``reduce_dtype`` of
    :class:`~shardflow.lower.cost.MixedPrecision` otherwise).

    ``microbatches``: the step's batch is cut along dim 0 into this many microbatches, ``pcg`` being captured on
    one (pipeline parallelism's microbatches, Huang et al., "GPipe", 2019): each microbatch gets its own forward,
    loss seed and backward (:func:`microbatch_id` values, :attr:`DNode.micro`), its weight-gradient contributions
    summed with the earlier microbatches' as ``micro`` sums micro-steps — microbatch m is micro-step m of
    ``microbatches`` within this step's ``micro`` — so only the last microbatch reduces and the updates run once. The
    nodes come microbatch after microbatch; the schedule pass (:mod:`shardflow.lower.schedule`) interleaves them.

    ``optimizer``: the :class:`UpdateRule` (its state slots become UPD values). Raises PassError if the PCG has no
    loss or ``microbatches`` < 1.
    """
    if microbatches < 1:
        raise PassError(f"a step has at least one microbatch, not {microbatches}")
    if microbatches == 1:
        return _expand(pcg, optimizer, training, clip_norm, grad_norm, micro, reshard_after_forward, ac, master_dtype)
    parts = [_expand(pcg, optimizer, training, clip_norm, grad_norm, m, reshard_after_forward, ac, master_dtype)
             for m in _microbatch_steps(micro, microbatches)]
    return _microbatched(pcg, parts)


def _microbatch_steps(micro: MicroStep, count: int) -> list[MicroStep]:
    """The micro-steps that ``count`` microbatches of micro-step ``micro`` are, among ``micro.count · count``: the
    first is first only in the first micro-step, the last is last only in the last one."""
    total = micro.count * count
    return [MicroStep(total, micro.first and m == 0, micro.last and m == count - 1) for m in range(count)]


def _microbatched(pcg: PCG, parts: list[DynamicGraph]) -> DynamicGraph:
    """One step of ``len(parts)`` microbatches from the graphs of its micro-steps (:func:`_microbatch_steps`):
    microbatch m's values get :func:`microbatch_id` ids except those every microbatch shares — the weights, the
    constants, optimizer state, the updates' new versions, a weight's cast (made once, in microbatch 0) — and
    the gradient sums one microbatch hands the next: microbatch m + 1 reads microbatch m's sum (no longer an
    ``acc`` value of the step: it dies inside it), the first reads the step's ``acc`` input and the last writes the
    step's ``acc`` output, as one micro-step would."""
    graph = pcg.graph
    shared = {forward_id(t) for t in (*graph.weights, *graph.constants)}
    values: dict[str, Value] = {}
    nodes: list[DNode] = []
    handed: dict[str, str] = {}  # the sum a microbatch leaves for the next: the step's acc id → its id in the step
    last = len(parts) - 1
    for m, dg in enumerate(parts):
        written = {v for n in dg.nodes for v in n.outputs}
        cast = {v for n in dg.nodes if n.kind == NodeKind.CAST for v in n.outputs}
        ids: dict[str, str] = {}
        for vid, v in dg.values.items():
            if vid in shared or vid in cast or v.role == ValueRole.OPT or (v.replaces and v.role != ValueRole.ACC):
                ids[vid] = vid
            elif v.role == ValueRole.ACC and vid not in written:  # the sum the microbatch before left
                ids[vid] = handed.get(vid, vid) if m else vid
            elif v.role == ValueRole.ACC and m == last:  # the step's own sum, for its next micro-step
                ids[vid] = vid
            elif v.role == ValueRole.ACC:
                ids[vid] = microbatch_id(vid, m)
                handed[v.replaces or vid] = ids[vid]
                v = dataclasses.replace(v, role=ValueRole.GRAD, replaces="")
            else:
                ids[vid] = microbatch_id(vid, m)
            if ids[vid] not in values:
                values[ids[vid]] = dataclasses.replace(v, id=ids[vid])
        for n in dg.nodes:
            if n.kind == NodeKind.CAST and m:
                continue
            shared_node = n.kind == NodeKind.CAST or n.pass_ == TaskType.UPD  # the casts, the updates
            nodes.append(dataclasses.replace(
                n, name=n.name if shared_node else microbatch_id(n.name, m), micro=0 if shared_node else m,
                inputs=tuple(ids[v] for v in n.inputs), outputs=tuple(ids[v] for v in n.outputs)))
    norm = parts[-1].grad_norm_sq
    out = DynamicGraph(pcg, values, tuple(nodes), parts[0].optimizer, (PassName.PASS_EXPANSION,),
                       microbatch_id(norm, last) if norm else "", len(parts))
    return _checked(out)


def _expand(pcg: PCG, optimizer: UpdateRule, training: bool, clip_norm: float | None, grad_norm: bool,
            micro: MicroStep, reshard_after_forward: bool, ac: ActivationCheckpointing,
            master: torch.dtype | None) -> DynamicGraph:
    """:func:`pass_expansion` of one microbatch."""
    if pcg.loss is None:
        raise PassError("pass expansion needs a loss: the graph has no scalar loss output")
    narrow = narrow_weights(pcg, master)
    master_dtype = "" if master is None else dtype_name(master)  # the graph's name of it
    g = _Graph()
    for name, t in pcg.tensors.items():
        kept = TensorType(t.type.shape, master_dtype) if name in narrow else t.type
        g.value(forward_id(name), name, ValueRole.FWD, kept, t.sharding, t.group)
    used: dict[str, str] = {}  # weight held in master_dtype → its copy in the graph's dtype, what every reader reads
    for w in narrow:
        t = pcg.tensors[w]
        used[w] = g.value(compute_id(w), w, ValueRole.FWD, t.type, t.sharding, t.group)
        g.nodes.append(DNode(f"FWD cast {w}", TaskType.FWD, NodeKind.CAST, (forward_id(w),), (used[w],), t.group, w,
                             label=f"cast({t.type.dtype})"))

    def fwd(t: str) -> str:
        """The value a node reads for forward tensor ``t``."""
        return used.get(t) or forward_id(t)

    # A parallel op on a weight (an FSDP gather) runs right before its output's first reader, not where the PCG lists
    # it (right after the weight): the whole weight then lives from its first to its last use, block by block.
    side = _weight_side(pcg)
    lazy = {n.outputs[0]: n for n in pcg.nodes if n.is_parallel and n.inputs[0] in side}

    def emit(n: PNode) -> None:
        for t in n.inputs:
            if t in lazy:
                emit(lazy.pop(t))
        g.nodes.append(DNode(f"FWD {n.name}", TaskType.FWD, NodeKind.PARALLEL if n.is_parallel else NodeKind.COMPUTE,
                             tuple(map(fwd, n.inputs)), tuple(map(forward_id, n.outputs)), n.group,
                             n.name, n.op if n.is_parallel else None, label=n.op.describe()))

    waiting = {n.name for n in lazy.values()}
    for n in pcg.nodes:
        if n.name not in waiting:
            emit(n)
    for n in list(lazy.values()):  # read by no forward node
        emit(n)

    if not training:
        return _expanded(pcg, g, optimizer)
    need = _needs_grad(pcg)
    for t in sorted(need):
        s = pcg.tensors[t].sharding
        if s.partial and s.reduce_op != ReduceOp.SUM:
            raise PassError(
                f"tensor {t!r} needs a gradient but holds Partial({s.reduce_op!r}) pieces on mesh axes "
                f"{list(s.partial)}: only Partial('sum') is differentiated piece by piece. Reduce it first "
                f"(Reduction / output=Replicate()) or place its source Partial('sum')")
    contributions: dict[str, list[str]] = {t: [] for t in pcg.tensors}
    master_side = _weight_side(pcg, narrow)

    def grad_type(t: str) -> TensorType:
        """The type of tensor ``t``'s gradient values: ``master_dtype`` on a narrow weight's side, else t's."""
        tt = pcg.tensors[t].type
        return TensorType(tt.shape, master_dtype) if t in master_side else tt

    loss = pcg.tensors[pcg.loss]
    seed = g.value(grad_id(pcg.loss, "loss"), pcg.loss, ValueRole.GRAD, loss.type, canonical_grad(loss.sharding),
                   loss.group)
    g.nodes.append(DNode("LOSS seed", TaskType.LOSS, NodeKind.SEED, (forward_id(pcg.loss),), (seed,), loss.group,
                         pcg.loss, scale=micro.seed))
    contributions[pcg.loss].append(seed)
    accumulated = side if micro.count > 1 else set()
    summed: set[str] = set()  # contributions that hold every micro-step already (moved back from a summed one)

    def accumulate(part: str) -> str:
        """Contribution ``part`` summed with the same contribution of the earlier micro-steps (a SUM on its
        devices, no communication): the first micro-step keeps it, a middle one adds its sum to it and keeps that,
        the last adds and returns the sum for the reduction."""
        v = g.values[part]
        ins = (part,)
        if not micro.first:
            ins += (g.value(accumulated_id(part), v.tensor, ValueRole.ACC, v.type, v.sharding, v.group),)
        if micro.last:
            out = g.value(with_accumulated_id(part), v.tensor, ValueRole.GRAD, v.type, v.sharding, v.group)
        elif micro.first:
            out = g.value(accumulated_id(part), v.tensor, ValueRole.ACC, v.type, v.sharding, v.group)
        else:
            out = g.value(update_id(ins[1]), v.tensor, ValueRole.ACC, v.type, v.sharding, v.group, replaces=ins[1])
        g.nodes.append(DNode(f"BWD accumulate {part}", TaskType.BWD, NodeKind.SUM, ins, (out,), v.group, v.tensor))
        return out

    def finalize(t: str, keep_axis: str = "", to: Sharding | None = None) -> str | None:
        """The gradient of PCG tensor t: contributions summed on t's sub-mesh, at its canonical sharding
        (except ``keep_axis``, left as it came), or at ``to`` — the backward of a parallel op moves the summed
        partial pieces straight to its input's sharding, so that :func:`~shardflow.parallel.ops.redistribute`
        orders the whole move (Partial(dp, fsdp) → Shard(0) on fsdp: a reduce-scatter, then an all-reduce of the
        piece), not first to t's replicated sharding. For a tensor on the weight side under accumulation, each
        contribution is first summed over the micro-steps; None (no gradient yet) before the last micro-step."""
        parts = contributions[t]
        if not parts:
            return None
        if t in accumulated:
            parts = [p if p in summed else accumulate(p) for p in parts]
            if not micro.last:
                return None
        tt = pcg.tensors[t]
        want = canonical_grad(tt.sharding)
        if len({g.values[p].sharding for p in parts}) > 1:  # bring each to the canonical sharding first
            parts = [g.redistribute(p, want, TaskType.BWD, t) for p in parts]
        if len(parts) > 1:
            out = g.value(grad_id(t), t, ValueRole.GRAD, grad_type(t), g.values[parts[0]].sharding, tt.group)
            g.nodes.append(DNode(f"BWD sum {grad_id(t)}", TaskType.BWD, NodeKind.SUM, tuple(parts), (out,), tt.group,
                                 t))
            parts = [out]
        cur = parts[0]
        if to is not None:
            want = to
        if keep_axis:
            have = g.values[cur].sharding
            want = Sharding(want.dims, tuple(a for a in have.partial if a == keep_axis))
        return g.redistribute(cur, want, TaskType.BWD, t)

    gathers = {n.outputs[0]: n for n in pcg.nodes if reshard_after_forward and n.is_parallel
               and isinstance(n.op, Combine) and pcg.tensors[n.inputs[0]].role == TensorRole.WEIGHT}
    again: dict[str, str] = {}

    def for_backward(t: str) -> str:
        """The value a backward node reads for forward tensor ``t``: a gathered weight gathered again (once, before
        its first backward reader) under ``reshard_after_forward``, else the forward's."""
        if t not in gathers:
            return fwd(t)
        if t not in again:
            n, v = gathers[t], g.values[forward_id(t)]
            again[t] = g.value(regathered_id(t), t, ValueRole.FWD, v.type, v.sharding, v.group)
            g.nodes.append(DNode(f"BWD regather {n.name}", TaskType.BWD, NodeKind.PARALLEL, (fwd(n.inputs[0]),),
                                 (again[t],), n.group, n.name, n.op, label=n.op.describe()))
        return again[t]

    blocks = checkpoint_blocks(pcg) if ac == ActivationCheckpointing.BLOCK else {}
    if ac == ActivationCheckpointing.BLOCK and not blocks:
        raise PassError("activation checkpointing 'block': no op of the graph lies in a block (a module under an "
                        "integer index, such as model.layers.0: a ModuleList's entry); this model has nothing to "
                        "recompute by block; leave --ac out (ac='none')")
    recomputed: dict[str, str] = {}  # PCG tensor → its value computed again for its block's backward
    rerun: set[str] = set()  # the blocks recomputed so far

    def read(t: str) -> str:
        """The value a backward node (or a recomputation) reads for forward tensor ``t``."""
        return recomputed.get(t) or for_backward(t)

    def recompute(block: str) -> None:
        """FWD nodes computing ``block``'s forward again, in forward order (``--ac block``)."""
        for m in pcg.nodes:
            if blocks.get(m.name) != block:
                continue
            ins = tuple(map(read, m.inputs))
            for t in m.outputs:
                v = g.values[forward_id(t)]
                recomputed[t] = g.value(recomputed_id(t), t, ValueRole.FWD, v.type, v.sharding, v.group)
            g.nodes.append(DNode(f"FWD recompute {m.name}", TaskType.FWD,
                                 NodeKind.PARALLEL if m.is_parallel else NodeKind.COMPUTE, ins,
                                 tuple(recomputed[t] for t in m.outputs), m.group, m.name,
                                 m.op if m.is_parallel else None, label=m.op.describe(), recompute=True))

    # A weight's gradient is finalized (its synchronisation issued) as soon as its last consumer's backward
    # has run, so that data parallelism's all-reduces can overlap the rest of the backward.
    weights = [w for w, t in pcg.tensors.items() if t.role == TensorRole.WEIGHT and w in pcg.graph.tensors]
    readers = Counter(t for n in pcg.nodes for t in dict.fromkeys(n.inputs))
    pending = {w: readers[w] for w in weights}
    early: dict[str, str | None] = {}

    def consumed(n: PNode) -> None:
        for t in dict.fromkeys(n.inputs):
            if t in pending:
                pending[t] -= 1
                if pending[t] == 0:
                    early[t] = finalize(t)

    for n in reversed(pcg.nodes):
        if not any(contributions[o] for o in n.outputs) or not any(i in need for i in n.inputs):
            consumed(n)
            continue
        if (block := blocks.get(n.name)) and block not in rerun:
            rerun.add(block)
            recompute(block)
        if n.is_parallel:
            (i,), (o,) = n.inputs, n.outputs
            if isinstance(n.op, Replicate):
                # Backward of a broadcast: the sum of the replicas' gradients on the input's devices (a reduce)
                # when they are partial; the copies at the input's index of the axis when they are already
                # replicated (a select on that sub-mesh without machine view; a copy takes them to a view).
                dy = finalize(o, keep_axis=n.op.axis)
                if dy is None:  # a weight's, summed for a later micro-step
                    consumed(n)
                    continue
                dyv, src = g.values[dy], pcg.tensors[i]
                kind = NodeKind.PARALLEL if n.op.axis in dyv.sharding.partial else NodeKind.SELECT
                at = src.group if kind == NodeKind.PARALLEL else \
                    dyv.group.with_fixed(n.op.axis, dict(src.group.fixed)[n.op.axis])
                out = g.value(grad_id(i, n.name), i, ValueRole.GRAD, grad_type(i), Sharding(dyv.sharding.dims,
                              tuple(a for a in dyv.sharding.partial if a != n.op.axis)), at)
                g.nodes.append(DNode(f"BWD {n.name}", TaskType.BWD, kind, (dy,), (out,), at, n.name,
                                     n.op if kind == NodeKind.PARALLEL else None))
                contributions[i].append(out)
                if i in accumulated:
                    summed.add(out)
                consumed(n)
                continue
            dy = finalize(o, to=canonical_grad(pcg.tensors[i].sharding))
            if dy is not None:  # None: a weight's, summed for a later micro-step
                contributions[i].append(dy)
                if i in accumulated:
                    summed.add(dy)
            consumed(n)
            continue
        dys = [finalize(o) for o in n.outputs]
        mask = tuple(t in need for t in n.inputs)
        outs, unscale = [], []
        for k, t in enumerate(n.inputs):
            s, f = grad_sharding(pcg, n, k)
            unscale.append(f)
            if mask[k]:
                outs.append(g.value(grad_id(t, n.name), t, ValueRole.GRAD, grad_type(t), s, n.group))
                contributions[t].append(outs[-1])
        ins = tuple(map(read, n.inputs)) + tuple(d for d in dys if d is not None)
        g.nodes.append(DNode(f"BWD {n.name}", TaskType.BWD, NodeKind.COMPUTE, ins, tuple(outs), n.group, n.name,
                             grad_mask=mask, unscale=tuple(unscale), dy_mask=tuple(d is not None for d in dys),
                             label=f"vjp[{n.op.describe()}]"))
        consumed(n)

    for w in weights:  # weights no node reads
        if w not in early:
            early[w] = finalize(w)
    grads = {w: dw for w, dw in early.items() if dw is not None}  # in the order the backward made them

    def squared_norm() -> str:
        """Squared global gradient norm: each device sums the squares of the gradient pieces it holds (replica
        0 only), a partial sum over every mesh axis; reducing it makes it whole on every device."""
        mesh = pcg.mesh
        axes = tuple(a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1)
        whole = SubMesh(mesh)
        part = g.value("grad_norm:sumsq", "grad_norm", ValueRole.GRAD, TensorType((), master_dtype or loss.type.dtype),
                       Sharding((), axes), whole)
        g.nodes.append(DNode("UPD grad-norm sumsq", TaskType.UPD, NodeKind.SUMSQ, tuple(grads.values()), (part,),
                             whole))
        return g.redistribute(part, Sharding(()), TaskType.UPD, "grad_norm")

    norm2 = (squared_norm(),) if clip_norm and micro.last else ()  # the updates clip with it: computed before them
    for w, dw in grads.items():
        t = pcg.tensors[w]
        kept = g.values[forward_id(w)].type  # master_dtype for a narrow weight
        slots = tuple(g.value(state_id(s, w), w, ValueRole.OPT, kept, t.sharding, t.group, slot=s)
                      for s in OPTIMIZER_SLOTS[optimizer])
        new = tuple(g.value(update_id(x), w, g.values[x].role, kept, t.sharding, t.group,
                            slot=g.values[x].slot, replaces=x) for x in (forward_id(w),) + slots)
        g.nodes.append(DNode(f"UPD {w}", TaskType.UPD, NodeKind.UPDATE, (forward_id(w), dw) + slots + norm2, new,
                             t.group, w, clip=clip_norm or 0.0))
    if grad_norm and not clip_norm and micro.last:  # read by nobody in the step: after the updates (not waited)
        norm2 = (squared_norm(),)
    return _expanded(pcg, g, optimizer, norm2[0] if norm2 else "")


def _expanded(pcg: PCG, g: _Graph, optimizer: UpdateRule, grad_norm_sq: str = "") -> DynamicGraph:
    """The graph pass expansion returns, after its check: every PCG node has its FWD node, and every node
    reads only values made by an earlier node or placed by the executor (weights, state, inputs)."""
    return _checked(DynamicGraph(pcg, g.values, tuple(g.nodes), optimizer, (PassName.PASS_EXPANSION,), grad_norm_sq))


def _checked(dg: DynamicGraph) -> DynamicGraph:
    """``dg`` after pass expansion's check (see :func:`_expanded`)."""
    pcg = dg.pcg
    have = set(dg.placed())
    for n in dg.nodes:
        if missing := [v for v in n.inputs if v not in have]:
            raise PassError(f"pass expansion: {n.name!r} reads {missing}, made by no earlier node")
        have.update(n.outputs)
    if len([n for n in dg.nodes if n.pass_ == TaskType.FWD and n.src]) < len(pcg.nodes):
        raise PassError("pass expansion left PCG nodes without a FWD node")
    return dg


def _moves_between_submeshes(n: DNode) -> bool:
    """Copies, Replicate and its backward move data between sub-meshes themselves; the gradient-norm sum
    reads, on each device, whatever gradient pieces that device holds."""
    return n.kind in (NodeKind.COPY, NodeKind.SELECT, NodeKind.SUMSQ) or isinstance(n.op, Replicate)


def cross_submesh_reads(dg: DynamicGraph) -> list[tuple[str, str]]:
    """(node, value) for every read of a value held by another sub-mesh by a node that does not move data
    between sub-meshes itself: what copy insertion removes, and what every later pass refuses."""
    return [(n.name, v) for n in dg.nodes if not _moves_between_submeshes(n)
            for v in n.inputs if dg.values[v].group != n.group]


def copy_insertion(dg: DynamicGraph) -> DynamicGraph:
    """A COPY in front of every read of a value held by another sub-mesh (see the module docstring).
    Raises PassError if pass expansion has not run, this pass has, or (after) a cross-sub-mesh read is left."""
    require(dg.done, PassName.COPY_INSERTION, (PassName.PASS_EXPANSION,))
    g = _Graph(dg.values)
    copies: dict[tuple[str, SubMesh], str] = {}
    for n in dg.nodes:
        moves_itself = _moves_between_submeshes(n)
        ins = []
        for vid in n.inputs:
            v = g.values[vid]
            if v.group == n.group or moves_itself:
                ins.append(vid)
                continue
            key = (vid, n.group)
            if key not in copies:
                out = g.value(f"{vid}@{n.group}", v.tensor, v.role, v.type, v.sharding, n.group)
                g.nodes.append(DNode(f"{v.pass_} copy {vid} {v.group}->{n.group}", v.pass_, NodeKind.COPY, (vid,),
                                     (out,), n.group, n.src, micro=n.micro))
                copies[key] = out
            ins.append(copies[key])
        g.nodes.append(dataclasses.replace(n, inputs=tuple(ins)))
    out = dataclasses.replace(dg, values=g.values, nodes=tuple(g.nodes), done=dg.done + (PassName.COPY_INSERTION,))
    if bad := cross_submesh_reads(out):
        raise PassError(f"copy insertion left {bad[0][0]!r} reading {bad[0][1]!r} from another sub-mesh")
    return out
