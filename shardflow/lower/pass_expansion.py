"""Pass expansion (docs/lowering.md#1-pass-expansion-shardflowlowerpass_expansion), the first lowering pass: a PCG →
the dynamic graph of one training step (:class:`~shardflow.lower.dynamic.DynamicGraph`).

:func:`pass_expansion` makes a FWD node per PCG node; a LOSS node seeding the loss gradient; a BWD node per PCG node
that has gradients to pass; gradient sums where a tensor has several consumers; and an UPD node per weight with its
optimizer-state slots. Under gradient accumulation (:class:`~shardflow.lower.dynamic.MicroStep`) each weight-gradient
contribution is first summed with the earlier micro-steps' (``acc`` values); only the last micro-step reduces and
updates. One microbatch's step is built by small emitters, one per part of the step, called in order by
:func:`_expand`: the casts of master weights, the forward, the loss seed, the backward (with the recomputation of
checkpointed blocks, the regathering of resharded weights, and the gradient sums), the gradient norm for clipping,
and the updates.

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
from collections import Counter
from typing import Iterable

import torch

from shardflow.graph import ops as O
from shardflow.graph.graph import TensorRole
from shardflow.graph.ops import OpError, TensorType, dtype_name, torch_dtype
from shardflow.lower.dynamic import (
    OPTIMIZER_SLOTS,
    ActivationCheckpointing,
    DNode,
    DynamicGraph,
    GraphBuilder,
    MicroStep,
    NodeKind,
    PassError,
    PassName,
    TaskType,
    UpdateRule,
    Value,
    ValueRole,
    accumulated_id,
    block_of,
    compute_id,
    forward_id,
    grad_id,
    microbatch_id,
    recomputed_id,
    regathered_id,
    state_id,
    update_id,
    with_accumulated_id,
)
from shardflow.parallel.mesh import ReduceOp, SubMesh
from shardflow.parallel.ops import CombineOp, ReplicateOp
from shardflow.parallel.pcg import PCG, PNode
from shardflow.parallel.sharding import Sharding

# --ac selective: the ops whose outputs a block's recomputation keeps from the forward instead of computing them
# again — the costly ones (torchtitan's selective op checkpointing keeps matmuls' and attention's outputs)
KEPT_UNDER_SELECTIVE = (O.Linear, O.Matmul, O.Attention, O.Conv, O.Experts)


def recomputed_blocks(
    pcg: PCG, ac: ActivationCheckpointing, ac_blocks: int | None = None
) -> tuple[dict[str, str], frozenset[str]]:
    """What ``--ac``/``--ac-blocks`` recompute: the nodes that run again with their block (:func:`checkpoint_blocks`;
    {} under ``none``) and the blocks among them recomputed selectively (``selective``: every block but the first
    ``ac_blocks``). Raises PassError as :func:`checkpoint_blocks` does."""
    if ac == ActivationCheckpointing.NONE:
        return {}, frozenset()
    if ac == ActivationCheckpointing.BLOCK:
        return checkpoint_blocks(pcg, ac_blocks), frozenset()
    blocks = checkpoint_blocks(pcg)
    whole = set(checkpoint_blocks(pcg, ac_blocks).values()) if ac_blocks is not None else set()
    return blocks, frozenset(set(blocks.values()) - whole)


def checkpoint_blocks(pcg: PCG, count: int | None = None) -> dict[str, str]:
    """PCG node → its block under ``--ac block`` (:func:`block_of`), for the nodes that recompute: compute nodes
    by their scope, and parallel ops on an activation of a block (a tensor-parallel all-reduce of a block's
    partial sums) with the block of the node that made it. Nodes on the weight side (an FSDP gather) are left
    out: the backward reads the gathered weight as it would without recomputation.

    ``count`` (``--ac-blocks K``): only the nodes of the first ``count`` blocks, in forward order (the order of the
    blocks' first nodes in ``pcg.nodes``: ``model.layers.0`` … ``model.layers.{K-1}``); None: every block. The first
    blocks are the ones worth recomputing under a pipeline: the first stages hold the most microbatches' activations
    in flight (1F1B's stage s holds p − s of them), so they reach the highest peak. A graph without blocks gives {}
    whatever ``count`` (the caller refuses it by name). Raises PassError if ``count`` is not between 1 and the
    number of blocks."""
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
    if count is None or not out:
        return out
    blocks = list(dict.fromkeys(out.values()))
    if not 1 <= count <= len(blocks):
        raise PassError(
            f"ac_blocks={count}: the graph has {len(blocks)} blocks ({blocks[0]} … {blocks[-1]}); give --ac-blocks "
            f"between 1 and {len(blocks)} (the first K blocks in forward order recompute), or leave it out to "
            f"recompute every block"
        )
    kept = set(blocks[:count])
    return {n: b for n, b in out.items() if b in kept}


def narrow_weights(pcg: PCG, master: torch.dtype | None) -> tuple[str, ...]:
    """The weights of ``pcg`` held in ``master`` (a floating dtype) instead of their dtype in the graph: the floating
    ones of fewer bits (none when ``master`` is None)."""
    if master is None:
        return ()
    return tuple(
        w
        for w in pcg.graph.weights
        if w in pcg.tensors
        and (d := torch_dtype(pcg.tensors[w].type.dtype)).is_floating_point
        and d.itemsize < master.itemsize
    )


def canonical_grad(s: Sharding) -> Sharding:
    """The sharding a tensor's gradient is used in: the forward's, with partial axes replicated."""
    return Sharding(s.dims)


def _needs_grad(pcg: PCG) -> set[str]:
    """PCG tensors whose gradient the step needs: weights (but the frozen ones, ``graph.frozen``: parameters with
    ``requires_grad=False``) and each output an op computes from them differentiably
    (:meth:`~shardflow.graph.ops.Op.grad_outputs`: a floating-point output, and not a constant of its inputs such
    as ``full_like``'s). The backward is planned from this set, so an op autograd cannot differentiate is refused
    here, before any step runs.

    Raises:
        PassError: an op on the gradient's path has no derivative; names the op, its module and source line.
    """
    need = {n for n, t in pcg.tensors.items() if t.role == TensorRole.WEIGHT and n not in pcg.graph.frozen}
    for n in pcg.nodes:
        mask = tuple(i in need for i in n.inputs)
        if not any(mask):
            continue
        if n.is_parallel:
            need.update(n.outputs)
            continue
        try:
            carried = n.op.grad_outputs(
                tuple(pcg.tensors[t].type for t in n.inputs), tuple(pcg.tensors[t].type for t in n.outputs), mask
            )
        except OpError as e:
            node = next((m for m in pcg.graph.nodes if m.name == n.name), None)
            source = f" at {node.source}" if node is not None and node.source else ""
            raise PassError(
                f"op {n.name!r} ({n.op.describe()}) in module {n.scope or '<root>'!r}{source} lies on the "
                f"gradient's path from the loss to the weights, but torch's autograd cannot differentiate it: {e}. "
                f"Write that line of the model with differentiable ops, or compute it under torch.no_grad() (or "
                f"from .detach()ed inputs) if no gradient should flow through it"
            ) from None
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


def pass_expansion(
    pcg: PCG,
    optimizer: UpdateRule = UpdateRule.SGD,
    training: bool = True,
    clip_norm: float | None = None,
    grad_norm: bool = False,
    micro: MicroStep = MicroStep(),
    reshard_after_forward: bool = True,
    ac: ActivationCheckpointing = ActivationCheckpointing.NONE,
    master_dtype: torch.dtype | None = None,
    microbatches: int = 1,
    ac_blocks: int | None = None,
    regather_activations: bool = False,
) -> DynamicGraph:
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
    ``regather_activations``: the same for an activation gathered by a Combine (sequence parallelism's all-gather
    before a column-parallel linear): freed after its last forward reader, gathered again from its pieces before its
    first backward reader (Megatron-LM's sequence parallelism, Korthikanti et al. 2022, §4.2.2) — in each
    microbatch, as the activation is; a block recomputed whole gathers it again in its recomputation anyway.

    ``ac``: activation checkpointing (:class:`ActivationCheckpointing`). Under ``block``, right before the first
    backward node of a block, FWD nodes (``recompute``) run the block's forward again (:func:`checkpoint_blocks`:
    its compute ops and the parallel ops on its activations, reading the block's input and its weights, a gathered
    weight gathered again under ``reshard_after_forward``); the block's backward nodes read those values, so the
    forward's activations inside a block die with their last forward reader. Under ``selective`` the same, but a
    block's recomputation leaves out its communication and the ops of :data:`KEPT_UNDER_SELECTIVE`, whose outputs
    the backward reads from the forward. ``ac_blocks`` (``--ac-blocks K``): only
    the first K blocks in forward order recompute, the others keep their activations as under ``none``
    (:func:`checkpoint_blocks`); None: every block. Read only under ``block`` and ``selective`` (a search's candidate
    without checkpointing keeps the run's ``ac_blocks``; :meth:`~shardflow.lower.cost.LowerOptions.parse` refuses
    the setting under ``--ac none``). Under ``selective`` every block recomputes, the first ``ac_blocks`` whole (as
    under ``block``) and the others selectively: memory between ``selective`` and ``block`` (the search's mix).

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
    loss, ``microbatches`` < 1, or under ``block`` the graph has no block or ``ac_blocks`` is not between 1 and its
    number of blocks.
    """
    if microbatches < 1:
        raise PassError(f"a step has at least one microbatch, not {microbatches}")
    again = (reshard_after_forward, regather_activations)
    if microbatches == 1:
        return _expand(pcg, optimizer, training, clip_norm, grad_norm, micro, again, ac, master_dtype, ac_blocks)
    parts = [
        _expand(pcg, optimizer, training, clip_norm, grad_norm, m, again, ac, master_dtype, ac_blocks)
        for m in _microbatch_steps(micro, microbatches)
    ]
    return _microbatched(pcg, parts)


def _microbatch_steps(micro: MicroStep, count: int) -> list[MicroStep]:
    """The micro-steps that ``count`` microbatches of micro-step ``micro`` are, among ``micro.count · count``: the
    first is first only in the first micro-step, the last is last only in the last one."""
    total = micro.count * count
    return [MicroStep(total, micro.first and m == 0, micro.last and m == count - 1) for m in range(count)]


def _microbatched(pcg: PCG, parts: list[DynamicGraph]) -> DynamicGraph:
    """One step of ``len(parts)`` microbatches from the graphs of its micro-steps (:func:`_microbatch_steps`):
    microbatch m's values get :func:`microbatch_id` ids except those every microbatch shares — the weights, the
    constants, optimizer state, the updates' new versions, a weight's cast and a weight moved by a parallel op (its
    all-gather, its regather for the backward: made once, in microbatch 0;
    docs/lowering.md#fsdp-under-a-pipeline) — and
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
        # what no microbatch changes: a weight's cast, and a weight moved by a parallel op (its all-gather, its
        # regather for the backward) — made once, in microbatch 0, and read by every microbatch
        once = {v for n in dg.nodes if n.kind == NodeKind.CAST for v in n.outputs}
        for n in dg.nodes:
            moved = n.kind == NodeKind.PARALLEL and n.task in (TaskType.FWD, TaskType.BWD)
            if moved and n.inputs and all(v in shared or v in once for v in n.inputs):
                once.update(n.outputs)
        ids: dict[str, str] = {}
        for vid, v in dg.values.items():
            if vid in shared or vid in once or v.role == ValueRole.OPT or (v.replaces and v.role != ValueRole.ACC):
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
            made_once = bool(n.outputs) and all(v in once for v in n.outputs)
            if made_once and m:
                continue
            shared_node = made_once or n.task == TaskType.UPD  # the casts and moved weights, the updates
            nodes.append(
                dataclasses.replace(
                    n,
                    name=n.name if shared_node else microbatch_id(n.name, m),
                    micro=0 if shared_node else m,
                    inputs=tuple(ids[v] for v in n.inputs),
                    outputs=tuple(ids[v] for v in n.outputs),
                )
            )
    norm = parts[-1].grad_norm_sq
    out = DynamicGraph(
        pcg,
        values,
        tuple(nodes),
        parts[0].optimizer,
        (PassName.PASS_EXPANSION,),
        microbatch_id(norm, last) if norm else "",
        len(parts),
    )
    return _checked(out)


def _expand(
    pcg: PCG,
    optimizer: UpdateRule,
    training: bool,
    clip_norm: float | None,
    grad_norm: bool,
    micro: MicroStep,
    again: tuple[bool, bool],
    ac: ActivationCheckpointing,
    master: torch.dtype | None,
    ac_blocks: int | None,
) -> DynamicGraph:
    """:func:`pass_expansion` of one microbatch: its emitters (:class:`_Expansion`), in the order of the step;
    ``again``: whether gathered weights, and gathered activations, are gathered again for the backward
    (``reshard_after_forward``, ``regather_activations``)."""
    if pcg.loss is None:
        raise PassError("pass expansion needs a loss: the graph has no scalar loss output")
    x = _Expansion(pcg, pcg.loss, micro, master)
    x.casts()
    x.forward()
    if not training:
        return _expanded(pcg, x.g, optimizer)
    x.needs_gradients()
    x.loss_seed()
    grads = x.backward(*again, ac, ac_blocks)
    norm2 = (x.squared_norm(grads),) if clip_norm and micro.last else ()  # the updates clip with it: before them
    x.updates(grads, optimizer, norm2, clip_norm)
    if grad_norm and not clip_norm and micro.last:  # read by nobody in the step: after the updates (not waited)
        norm2 = (x.squared_norm(grads),)
    return _expanded(pcg, x.g, optimizer, norm2[0] if norm2 else "")


class _Expansion:
    """One microbatch's step under construction: the graph so far (``g``, every PCG tensor's forward value from the
    start) and what the emitters share — which value a reader reads for a tensor, each tensor's gradient
    contributions so far. Each emitter appends the nodes of one part of the step; :func:`_expand` calls them."""

    def __init__(self, pcg: PCG, loss: str, micro: MicroStep, master: torch.dtype | None):
        self.pcg, self.loss, self.micro = pcg, loss, micro
        self.narrow = narrow_weights(pcg, master)
        self.master_dtype = "" if master is None else dtype_name(master)  # the graph's name of it
        self.g = GraphBuilder()
        for name, t in pcg.tensors.items():
            kept = TensorType(t.type.shape, self.master_dtype) if name in self.narrow else t.type
            self.g.value(forward_id(name), name, ValueRole.FWD, kept, t.sharding, t.group)
        self.used: dict[str, str] = {}  # weight held in master_dtype → its copy in the graph's dtype, what all read
        self.side = _weight_side(pcg)
        # The backward's, set by needs_gradients and backward:
        self.need: set[str] = set()
        self.contributions: dict[str, list[str]] = {}
        self.master_side: set[str] = set()
        self.accumulated: set[str] = set()  # tensors whose contributions are summed over the micro-steps
        self.summed: set[str] = set()  # contributions that hold every micro-step already (moved back from a summed one)
        self.gathers: dict[str, PNode] = {}
        self.again: dict[str, str] = {}
        self.blocks: dict[str, str] = {}
        # the blocks whose recomputation keeps the costly ops' outputs (--ac selective)
        self.selective: frozenset[str] = frozenset()
        self.recomputed: dict[str, str] = {}  # PCG tensor → its value computed again for its block's backward
        self.rerun: set[str] = set()  # the blocks recomputed so far
        self.pending: dict[str, int] = {}
        self.early: dict[str, str | None] = {}

    # --- casts and forward ------------------------------------------------------------------------------------------
    def casts(self) -> None:
        """A FWD ``cast`` per weight held in ``master_dtype``: its copy in the graph's dtype, which every reader
        reads."""
        for w in self.narrow:
            t = self.pcg.tensors[w]
            self.used[w] = self.g.value(compute_id(w), w, ValueRole.FWD, t.type, t.sharding, t.group)
            self.g.nodes.append(
                DNode(
                    f"FWD cast {w}",
                    TaskType.FWD,
                    NodeKind.CAST,
                    (forward_id(w),),
                    (self.used[w],),
                    t.group,
                    w,
                    label=f"cast({t.type.dtype})",
                )
            )

    def fwd(self, t: str) -> str:
        """The value a node reads for forward tensor ``t``."""
        return self.used.get(t) or forward_id(t)

    def forward(self) -> None:
        """A FWD node per PCG node, in the PCG's order, except that a parallel op on a weight (an FSDP gather) runs
        right before its output's first reader, not where the PCG lists it (right after the weight): the whole
        weight then lives from its first to its last use, block by block."""
        lazy = {n.outputs[0]: n for n in self.pcg.nodes if n.is_parallel and n.inputs[0] in self.side}

        def emit(n: PNode) -> None:
            for t in n.inputs:
                if t in lazy:
                    emit(lazy.pop(t))
            self.g.nodes.append(
                DNode(
                    f"FWD {n.name}",
                    TaskType.FWD,
                    NodeKind.PARALLEL if n.is_parallel else NodeKind.COMPUTE,
                    tuple(map(self.fwd, n.inputs)),
                    tuple(map(forward_id, n.outputs)),
                    n.group,
                    n.name,
                    n.op if n.is_parallel else None,
                    label=n.op.describe(),
                )
            )

        waiting = {n.name for n in lazy.values()}
        for n in self.pcg.nodes:
            if n.name not in waiting:
                emit(n)
        for n in list(lazy.values()):  # read by no forward node
            emit(n)

    # --- loss seed --------------------------------------------------------------------------------------------------
    def needs_gradients(self) -> None:
        """The tensors that get a gradient (:func:`_needs_grad`), each with no contribution yet. Raises PassError
        for one held in Partial pieces of another reduction than a sum."""
        pcg = self.pcg
        self.need = _needs_grad(pcg)
        for t in sorted(self.need):
            s = pcg.tensors[t].sharding
            if s.partial and s.reduce_op != ReduceOp.SUM:
                raise PassError(
                    f"tensor {t!r} needs a gradient but holds Partial({s.reduce_op!r}) pieces on mesh axes "
                    f"{list(s.partial)}: only Partial('sum') is differentiated piece by piece. Reduce it first "
                    f"(ReductionOp / output=Replicate()) or place its source Partial('sum')"
                )
        self.contributions = {t: [] for t in pcg.tensors}
        self.master_side = _weight_side(pcg, self.narrow)
        self.accumulated = self.side if self.micro.count > 1 else set()

    def grad_type(self, t: str) -> TensorType:
        """The type of tensor ``t``'s gradient values: ``master_dtype`` on a narrow weight's side, else t's."""
        tt = self.pcg.tensors[t].type
        return TensorType(tt.shape, self.master_dtype) if t in self.master_side else tt

    def loss_seed(self) -> None:
        """The LOSS node seeding the loss gradient with the micro-step's scale (:attr:`MicroStep.seed`)."""
        g, name = self.g, self.loss
        loss = self.pcg.tensors[name]
        seed = g.value(
            grad_id(name, "loss"), name, ValueRole.GRAD, loss.type, canonical_grad(loss.sharding), loss.group
        )
        g.nodes.append(
            DNode(
                "LOSS seed",
                TaskType.LOSS,
                NodeKind.SEED,
                (forward_id(name),),
                (seed,),
                loss.group,
                name,
                scale=self.micro.seed,
            )
        )
        self.contributions[name].append(seed)

    # --- gradient sums ----------------------------------------------------------------------------------------------
    def accumulate(self, part: str) -> str:
        """Contribution ``part`` summed with the same contribution of the earlier micro-steps (a SUM on its
        devices, no communication): the first micro-step keeps it, a middle one adds its sum to it and keeps that,
        the last adds and returns the sum for the reduction."""
        g, micro = self.g, self.micro
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

    def finalize(self, t: str, keep_axis: str = "", to: Sharding | None = None) -> str | None:
        """The gradient of PCG tensor t: contributions summed on t's sub-mesh, at its canonical sharding
        (except ``keep_axis``, left as it came), or at ``to`` — the backward of a parallel op moves the summed
        partial pieces straight to its input's sharding, so that :func:`~shardflow.parallel.ops.redistribute`
        orders the whole move (Partial(dp, fsdp) → Shard(0) on fsdp: a reduce-scatter, then an all-reduce of the
        piece), not first to t's replicated sharding. For a tensor on the weight side under accumulation, each
        contribution is first summed over the micro-steps; None (no gradient yet) before the last micro-step."""
        g = self.g
        parts = self.contributions[t]
        if not parts:
            return None
        if t in self.accumulated:
            parts = [p if p in self.summed else self.accumulate(p) for p in parts]
            if not self.micro.last:
                return None
        tt = self.pcg.tensors[t]
        want = canonical_grad(tt.sharding)
        if len({g.values[p].sharding for p in parts}) > 1:  # bring each to the canonical sharding first
            parts = [g.redistribute(p, want, TaskType.BWD, t) for p in parts]
        if len(parts) > 1:
            out = g.value(grad_id(t), t, ValueRole.GRAD, self.grad_type(t), g.values[parts[0]].sharding, tt.group)
            g.nodes.append(
                DNode(f"BWD sum {grad_id(t)}", TaskType.BWD, NodeKind.SUM, tuple(parts), (out,), tt.group, t)
            )
            parts = [out]
        cur = parts[0]
        if to is not None:
            want = to
        if keep_axis:
            have = g.values[cur].sharding
            want = Sharding(want.dims, tuple(a for a in have.partial if a == keep_axis))
        return g.redistribute(cur, want, TaskType.BWD, t)

    def contribute(self, t: str, part: str) -> None:
        """Adds ``part`` to tensor ``t``'s gradient contributions: the backward of a parallel op made it from a
        gradient already summed over the micro-steps, so where ``t``'s contributions are summed, it is not again."""
        self.contributions[t].append(part)
        if t in self.accumulated:
            self.summed.add(part)

    # --- recompute and the backward's reads -------------------------------------------------------------------------
    def for_backward(self, t: str) -> str:
        """The value a backward node reads for forward tensor ``t``: a gathered weight gathered again (once, before
        its first backward reader) under ``reshard_after_forward``, a gathered activation under
        ``regather_activations``, else the forward's."""
        if t not in self.gathers:
            return self.fwd(t)
        if t not in self.again:
            g = self.g
            n, v = self.gathers[t], g.values[forward_id(t)]
            self.again[t] = g.value(regathered_id(t), t, ValueRole.FWD, v.type, v.sharding, v.group)
            g.nodes.append(
                DNode(
                    f"BWD regather {n.name}",
                    TaskType.BWD,
                    NodeKind.PARALLEL,
                    (self.fwd(n.inputs[0]),),
                    (self.again[t],),
                    n.group,
                    n.name,
                    n.op,
                    label=n.op.describe(),
                )
            )
        return self.again[t]

    def read(self, t: str) -> str:
        """The value a backward node (or a recomputation) reads for forward tensor ``t``."""
        return self.recomputed.get(t) or self.for_backward(t)

    def recompute(self, block: str) -> None:
        """FWD nodes computing ``block``'s forward again, in forward order (``--ac block``); under ``--ac selective``
        only the nodes whose outputs the forward does not keep (neither communication nor :data:`KEPT_UNDER_SELECTIVE`:
        their readers read the forward's)."""
        g = self.g
        for m in self.pcg.nodes:
            if self.blocks.get(m.name) != block:
                continue
            if block in self.selective and (m.is_parallel or isinstance(m.op, KEPT_UNDER_SELECTIVE)):
                continue
            ins = tuple(map(self.read, m.inputs))
            for t in m.outputs:
                v = g.values[forward_id(t)]
                self.recomputed[t] = g.value(recomputed_id(t), t, ValueRole.FWD, v.type, v.sharding, v.group)
            g.nodes.append(
                DNode(
                    f"FWD recompute {m.name}",
                    TaskType.FWD,
                    NodeKind.PARALLEL if m.is_parallel else NodeKind.COMPUTE,
                    ins,
                    tuple(self.recomputed[t] for t in m.outputs),
                    m.group,
                    m.name,
                    m.op if m.is_parallel else None,
                    label=m.op.describe(),
                    recompute=True,
                )
            )

    # --- backward ---------------------------------------------------------------------------------------------------
    def backward(
        self,
        reshard_after_forward: bool,
        regather_activations: bool,
        ac: ActivationCheckpointing,
        ac_blocks: int | None = None,
    ) -> dict[str, str]:
        """The BWD nodes, PCG node by PCG node in reverse, each block recomputed before its first backward node
        under ``--ac block``, except that the backward of a parallel op on a weight (an FSDP gather: the reduce-scatter
        of its gradient) runs right after its output's last backward reader, as the forward runs the op right before
        its first reader (:meth:`forward`); returns each weight's gradient, in the PCG's backward order (none before the
        last micro-step). A weight's gradient is finalized (its synchronisation issued) as soon as its last
        consumer's backward has run, so that data parallelism's all-reduces and FSDP's reduce-scatters can overlap the
        rest of the backward. Under ``--ac-blocks K`` only the first K blocks recompute (:func:`checkpoint_blocks`).
        Raises PassError under ``--ac block`` if no op lies in a block, or K is not between 1 and the blocks."""
        pcg = self.pcg
        # gathered again for the backward: a weight's gathers under reshard_after_forward, an activation's under
        # regather_activations
        again = {TensorRole.WEIGHT: reshard_after_forward, TensorRole.ACTIVATION: regather_activations}
        self.gathers = {
            n.outputs[0]: n
            for n in pcg.nodes
            if n.is_parallel and isinstance(n.op, CombineOp) and again.get(pcg.tensors[n.inputs[0]].role, False)
        }
        self.blocks, self.selective = recomputed_blocks(pcg, ac, ac_blocks)
        if ac != ActivationCheckpointing.NONE and not self.blocks:
            raise PassError(
                f"activation checkpointing {str(ac)!r}: no op of the graph lies in a block (a module under an "
                "integer index, such as model.layers.0: a ModuleList's entry); this model has nothing to "
                "recompute by block; leave --ac out (ac='none')"
            )
        weights = [w for w, t in pcg.tensors.items() if t.role == TensorRole.WEIGHT and w in pcg.graph.tensors]
        readers = Counter(t for n in pcg.nodes for t in dict.fromkeys(n.inputs))
        self.pending = {w: readers[w] for w in weights}
        # the forward's lazy parallel ops on weights (an FSDP gather, :meth:`forward`), mirrored: each one's backward
        # (the reduce-scatter of the weight's gradient) runs right after its output's last backward reader, not where
        # the PCG lists it (right after the weight, so at the end of the backward)
        lazy = {n.outputs[0]: n for n in pcg.nodes if n.is_parallel and n.inputs[0] in self.side}
        waiting = {n.name for n in lazy.values()}
        left = {t: readers[t] for t in lazy}

        def run(n: PNode) -> None:
            if any(self.contributions[o] for o in n.outputs) and any(i in self.need for i in n.inputs):
                if (block := self.blocks.get(n.name)) and block not in self.rerun:
                    self.rerun.add(block)
                    self.recompute(block)
                if not n.is_parallel:
                    self.backward_compute(n)
                elif isinstance(n.op, ReplicateOp):
                    self.backward_replicate(n, n.op)
                else:
                    self.backward_parallel(n)
            self.consumed(n)
            for t in dict.fromkeys(n.inputs):
                if t in lazy:
                    left[t] -= 1
                    if left[t] == 0:
                        run(lazy.pop(t))

        for n in reversed(pcg.nodes):
            if n.name not in waiting:
                run(n)
        for n in reversed(list(lazy.values())):  # read by no node
            run(n)
        for w in weights:  # weights no node reads
            if w not in self.early:
                self.early[w] = self.finalize(w)
        # in the PCG's backward order (by each weight's first reader, last first; then the weights no node reads),
        # wherever the lazy ops' backward ran: the updates and the gradient-norm sum read them in that order
        first: dict[str, tuple[int, int]] = {}
        for k, n in enumerate(pcg.nodes):
            for j, t in enumerate(dict.fromkeys(n.inputs)):
                first.setdefault(t, (-k, j))
        last = len(pcg.nodes)
        at = {w: first.get(w, (last, k)) for k, w in enumerate(weights)}
        return {w: dw for w, dw in sorted(self.early.items(), key=lambda kv: at[kv[0]]) if dw is not None}

    def consumed(self, n: PNode) -> None:
        """Node ``n``'s backward has run: the gradient of each weight it was the last reader of is finalized."""
        for t in dict.fromkeys(n.inputs):
            if t in self.pending:
                self.pending[t] -= 1
                if self.pending[t] == 0:
                    self.early[t] = self.finalize(t)

    def backward_replicate(self, n: PNode, op: ReplicateOp) -> None:
        """Backward of broadcast ``op`` (node ``n``): the sum of the replicas' gradients on the input's devices (a
        reduce) when they are partial; the copies at the input's index of the axis when they are already replicated
        (a select on that sub-mesh without machine view; a copy takes them to a view)."""
        g = self.g
        (i,), (o,) = n.inputs, n.outputs
        dy = self.finalize(o, keep_axis=op.axis)
        if dy is None:  # a weight's, summed for a later micro-step
            return
        dyv, src = g.values[dy], self.pcg.tensors[i]
        kind = NodeKind.PARALLEL if op.axis in dyv.sharding.partial else NodeKind.SELECT
        at = src.group if kind == NodeKind.PARALLEL else dyv.group.with_fixed(op.axis, dict(src.group.fixed)[op.axis])
        out = g.value(
            grad_id(i, n.name),
            i,
            ValueRole.GRAD,
            self.grad_type(i),
            Sharding(dyv.sharding.dims, tuple(a for a in dyv.sharding.partial if a != op.axis)),
            at,
        )
        g.nodes.append(
            DNode(
                f"BWD {n.name}",
                TaskType.BWD,
                kind,
                (dy,),
                (out,),
                at,
                n.name,
                op if kind == NodeKind.PARALLEL else None,
            )
        )
        self.contribute(i, out)

    def backward_parallel(self, n: PNode) -> None:
        """Backward of any other parallel op: its output's gradient moved straight to its input's canonical
        gradient sharding (:meth:`finalize`)."""
        (i,), (o,) = n.inputs, n.outputs
        dy = self.finalize(o, to=canonical_grad(self.pcg.tensors[i].sharding))
        if dy is not None:  # None: a weight's, summed for a later micro-step
            self.contribute(i, dy)

    def backward_compute(self, n: PNode) -> None:
        """The vjp of compute node ``n``: a gradient contribution per input that needs one, at
        :func:`grad_sharding`."""
        g = self.g
        dys = [self.finalize(o) for o in n.outputs]
        mask = tuple(t in self.need for t in n.inputs)
        outs, unscale = [], []
        for k, t in enumerate(n.inputs):
            s, f = grad_sharding(self.pcg, n, k)
            unscale.append(f)
            if mask[k]:
                outs.append(g.value(grad_id(t, n.name), t, ValueRole.GRAD, self.grad_type(t), s, n.group))
                self.contributions[t].append(outs[-1])
        ins = tuple(map(self.read, n.inputs)) + tuple(d for d in dys if d is not None)
        g.nodes.append(
            DNode(
                f"BWD {n.name}",
                TaskType.BWD,
                NodeKind.COMPUTE,
                ins,
                tuple(outs),
                n.group,
                n.name,
                grad_mask=mask,
                unscale=tuple(unscale),
                dy_mask=tuple(d is not None for d in dys),
                label=f"vjp[{n.op.describe()}]",
            )
        )

    # --- clipping and updates ---------------------------------------------------------------------------------------
    def squared_norm(self, grads: dict[str, str]) -> str:
        """Squared global gradient norm: each device sums the squares of the gradient pieces it holds (replica
        0 only), a partial sum over every mesh axis; reducing it makes it whole on every device."""
        g, mesh = self.g, self.pcg.mesh
        axes = tuple(a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1)
        whole = SubMesh(mesh)
        dtype = self.master_dtype or self.pcg.tensors[self.loss].type.dtype
        part = g.value("grad_norm:sumsq", "grad_norm", ValueRole.GRAD, TensorType((), dtype), Sharding((), axes), whole)
        g.nodes.append(
            DNode("UPD grad-norm sumsq", TaskType.UPD, NodeKind.SUMSQ, tuple(grads.values()), (part,), whole)
        )
        return g.redistribute(part, Sharding(()), TaskType.UPD, "grad_norm")

    def updates(
        self, grads: dict[str, str], optimizer: UpdateRule, norm2: tuple[str, ...], clip_norm: float | None
    ) -> None:
        """An UPD node per weight with a gradient: its new version and its optimizer-state slots' (in the weight's
        kept dtype), clipped by the squared norm ``norm2`` when given."""
        g = self.g
        for w, dw in grads.items():
            t = self.pcg.tensors[w]
            kept = g.values[forward_id(w)].type  # master_dtype for a narrow weight
            slots = tuple(
                g.value(state_id(s, w), w, ValueRole.OPT, kept, t.sharding, t.group, slot=s)
                for s in OPTIMIZER_SLOTS[optimizer]
            )
            new = tuple(
                g.value(update_id(x), w, g.values[x].role, kept, t.sharding, t.group, slot=g.values[x].slot, replaces=x)
                for x in (forward_id(w),) + slots
            )
            g.nodes.append(
                DNode(
                    f"UPD {w}",
                    TaskType.UPD,
                    NodeKind.UPDATE,
                    (forward_id(w), dw) + slots + norm2,
                    new,
                    t.group,
                    w,
                    clip=clip_norm or 0.0,
                )
            )


def _expanded(pcg: PCG, g: GraphBuilder, optimizer: UpdateRule, grad_norm_sq: str = "") -> DynamicGraph:
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
    if len([n for n in dg.nodes if n.task == TaskType.FWD and n.src]) < len(pcg.nodes):
        raise PassError("pass expansion left PCG nodes without a FWD node")
    return dg
