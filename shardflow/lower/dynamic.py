"""The dynamic graph of one training step (FlexFlow PR #1637, #1640): the data every lowering pass reads and
returns (docs/lowering.md#1-pass-expansion-shardflowlowerpass_expansion).

Values are forward tensors (``fwd:t``), gradients (``grad:t``, and per-consumer contributions
``grad:t@node``) and optimizer state (``opt:slot:w``), each with a sharding and a sub-mesh (:class:`Value`;
their ids are made by this module's id functions and nowhere else). Nodes (:class:`DNode`) are
FWD / BWD / LOSS / UPD invocations of compute ops, parallel ops, copies, gradient sums and updates.
:class:`DynamicGraph` holds both, in execution order, with the passes applied so far; :class:`GraphBuilder` is
what a pass fills before it returns one. Besides: the step's options that the graph records (:class:`MicroStep`,
:class:`ActivationCheckpointing`, :class:`UpdateRule` and its :data:`OPTIMIZER_SLOTS`), the pass names
(:class:`PassName`), :class:`PassError`, and :func:`require`, the check every pass makes first.

The passes that build and rewrite it live in modules of their own: :mod:`shardflow.lower.pass_expansion`,
:mod:`shardflow.lower.copy_insertion`, then those of :mod:`shardflow.lower.passes`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Iterable, Mapping

from shardflow.graph.ops import TensorType
from shardflow.parallel.mesh import SubMesh
from shardflow.parallel.ops import ParallelOp, redistribute
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
# (docs/lowering.md#2-copy-insertion-shardflowlowercopy_insertion).
ROLE_TASK = {
    ValueRole.FWD: TaskType.FWD,
    ValueRole.GRAD: TaskType.BWD,
    ValueRole.OPT: TaskType.UPD,
    ValueRole.ACC: TaskType.BWD,
}


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
            raise ValueError(
                f"micro-step {self}: {self.count} micro-step(s) per optimizer step, first={self.first}, "
                f"last={self.last}; one micro-step is both first and last, two or more have one first "
                f"and one last"
            )

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
    cost of a second forward of every block, its communication included. ``selective``: as ``block``, but the
    recomputation keeps from the forward the outputs of the costly ops — matmuls, attention, convolutions, expert
    layers (:data:`~shardflow.lower.pass_expansion.KEPT_UNDER_SELECTIVE`) — and of every communication, and runs
    again only the cheap ones between them (norms, activations, rotary embeddings, casts, views): torchtitan's
    selective op checkpointing (``--activation_checkpoint.mode selective``), memory between ``none`` and
    ``block`` for a fraction of a forward. ``--ac-blocks K`` under ``block``: only the first K blocks recompute, the
    others keep their activations; under ``selective``: the first K blocks recompute whole, the others selectively.
    """

    NONE = "none"
    BLOCK = "block"
    SELECTIVE = "selective"


def block_of(scope: str) -> str:
    """The block a node in module ``scope`` belongs to under ``--ac block``: the module path up to its first
    integer component — a module held in a ``ModuleList``/``ModuleDict``/``Sequential`` under an index
    (``model.layers.3.mlp.up_proj`` → ``model.layers.3``; GPT-2's ``transformer.h.0.attn`` →
    ``transformer.h.0``) — or "" for a node outside every block (embedding, final norm, loss)."""
    parts = scope.split(".") if scope else []
    first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return "" if first is None else ".".join(parts[: first + 1])


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
    UpdateRule.SGD: (),
    UpdateRule.SGD_MOMENTUM: ("momentum",),
    UpdateRule.ADAMW: ("exp_avg", "exp_avg_sq"),
}


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
    (``fwd:<weight>@compute``; see ``master_dtype`` of :func:`~shardflow.lower.pass_expansion.pass_expansion`)."""
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


def copied_id(vid: str, group: SubMesh) -> str:
    """The id of value ``vid`` copied to sub-mesh ``group`` (``<vid>@<group>``;
    :func:`~shardflow.lower.copy_insertion.copy_insertion`)."""
    return f"{vid}@{group}"


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
    def task(self) -> TaskType:
        """The task type of the nodes that move this value (:data:`ROLE_TASK`)."""
        return ROLE_TASK[self.role]


@dataclass(frozen=True, slots=True)
class DNode:
    """One node of the dynamic graph.

    ``task``: the part of the step the node belongs to (:class:`TaskType`: FWD, LOSS, BWD, UPD — FlexFlow's task
    type; not one of the lowering passes, :class:`PassName`). ``kind``: ``compute`` (a PCG compute op; FWD runs ``local``, BWD its vjp), ``parallel`` (a parallel op
    on a value), ``copy`` (same sharding, other sub-mesh), ``sum`` (gradient accumulation), ``seed`` (loss
    gradient), ``update`` (optimizer step), ``select`` (Replicate's backward when the gradient is replicated:
    the devices of the root sub-mesh keep their copy), ``cast`` (a weight held in a master dtype converted to its
    dtype in the graph: ``master_dtype`` of :func:`~shardflow.lower.pass_expansion.pass_expansion`). ``src`` is the
    PCG node it comes from (a cast's: its weight).
    For a BWD compute node, ``grad_mask[i]`` tells whether input i gets a gradient, ``unscale[i]`` undoes a
    linearity scale on it, and ``dy_mask[k]`` whether output k has a gradient (its ``dy`` is an input).
    An ``update`` with ``clip`` > 0 reads the squared global gradient norm as its last input; ``sumsq``
    sums the squares of the gradient pieces each device holds (see :attr:`DynamicGraph.grad_norm_sq`). A
    ``seed`` fills the loss gradient with ``scale`` (1, or 1/N in each of N micro-steps: :class:`MicroStep`).
    ``recompute``: a FWD node run again before its block's backward (:class:`ActivationCheckpointing`); the
    forward's own node of a recomputed op keeps nothing for the backward.
    """

    name: str
    task: TaskType
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
    :func:`~shardflow.lower.pass_expansion.pass_expansion`): each has its own data inputs, forward, loss and
    backward values (:func:`microbatch_id`), the PCG's shapes being one microbatch's.
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
        return {
            u.stat: self.per_microbatch(forward_id(pcg_name[u.stat]))
            for u in graph.buffer_updates.values()
            if u.stat is not None
        }

    @cached_property
    def expert_loads(self) -> dict[str, tuple[str, ...]]:
        """Each expert layer's load (graph output :attr:`~shardflow.graph.graph.ComputationGraph.expert_loads`:
        tokens routed to each expert) → its forward values, one per microbatch, in order."""
        pcg_name = dict(zip(self.pcg.graph.outputs, self.pcg.outputs))
        return {t: self.per_microbatch(forward_id(pcg_name[t])) for t in self.pcg.graph.expert_loads}

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
        return {n.src: n for n in self.nodes if n.kind == NodeKind.COMPUTE and n.task == TaskType.BWD}

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
        of buffer updates (:attr:`buffer_stats`), the expert layers' loads (:attr:`expert_loads`), the sums of gradient contributions a micro-step leaves for the
        next (:meth:`accumulated`), and the graph's constants (placed once, not every step)."""
        keep = set(self.loss_values) if self.pcg.loss else set()
        keep.update(v for v in map(forward_id, self.pcg.graph.constants) if v in self.values)
        keep.update(v for vids in self.buffer_stats.values() for v in vids)
        keep.update(v for vids in self.expert_loads.values() for v in vids)
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
        lines = [
            f"dynamic graph: {len(self.nodes)} nodes, {len(self.values)} values, passes done: "
            f"{', '.join(map(str, self.done))}"
        ]

        def show(vid: str) -> str:
            if vid in seen:
                return vid
            seen.add(vid)
            v = self.values[vid]
            return f"{vid}[{v.sharding}@{v.group}]"

        for n in self.nodes:
            ins = ", ".join(map(show, n.inputs))
            outs = ", ".join(map(show, n.outputs))
            lines.append(f"  {n.task:<4} {n.kind:<8} {n.name}: {ins} -> {outs}")
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """sha256 of the whole step (nodes, values with their shardings, every local kernel): equal on every
        rank that built the same plan, whatever its rank — what ranks compare at start-up."""
        local = tuple((n.name, n.local) for n in self.pcg.nodes)
        return hashlib.sha256(
            repr((self.nodes, sorted(self.values.items()), local, self.microbatches)).encode()
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


class GraphBuilder:
    """Mutable accumulator used inside one pass; the pass returns an immutable DynamicGraph."""

    def __init__(self, values: Mapping[str, Value] | None = None):
        self.values: dict[str, Value] = dict(values or {})
        self.nodes: list[DNode] = []

    def value(
        self,
        id_: str,
        tensor: str,
        role: ValueRole,
        type_: TensorType,
        sharding: Sharding,
        group: SubMesh,
        slot: str = "",
        replaces: str = "",
    ) -> str:
        base, i = id_, 1
        while id_ in self.values:
            i += 1
            id_ = f"{base}~{i}"
        self.values[id_] = Value(id_, tensor, role, type_, sharding, group, slot, replaces)
        return id_

    def redistribute(self, vid: str, want: Sharding, task: TaskType, src: str) -> str:
        """Parallel-op nodes taking value ``vid`` to sharding ``want`` (same sub-mesh); returns the final id."""
        v = self.values[vid]
        for k, pop in enumerate(redistribute(v.sharding, want, v.group)):
            s, g = pop.apply(v.sharding, v.group)
            out = self.value(f"{v.id}.{pop.kind}", v.tensor, v.role, v.type, s, g)
            self.nodes.append(
                DNode(f"{task} {pop.describe()} {v.id}", task, NodeKind.PARALLEL, (v.id,), (out,), g, src, pop)
            )
            v = self.values[out]
        return v.id
