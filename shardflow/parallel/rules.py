"""Sharding rules: from the input shardings of a compute op to its output shardings and the local kernel.

Each rule is "unparallel rule + degree rule": the op's own ``infer`` gives full shapes; the rule says which mesh axes
each output dim inherits (a table of input dim → output dim), which dims must not be sharded, and where partial sums
appear or pass through. Partial-sum linearity (PyTorch PR #157340, docs/concepts.md#4-sharding-rules-and-partial-sums):

* only ``Partial(sum|avg)`` is linear; ``max``/``min`` partials pass through monotone element-wise functions
  only (relu, tanh keep them; neg swaps max and min — DTensor's table) and must be reduced before any other op;
* additive ops (add, sub, neg, scalar add/sub, sum over a dim): Partial ± Partial → Partial;
  Partial ± Replicate → Partial, the replicated operand divided locally by the sum degree (not for ``avg``);
* multiplicative ops (mul/div by a replicated tensor or a scalar, linear, matmul): Partial · Replicate →
  Partial with no division; Partial · Partial is an error;
* nonlinear ops (relu, gelu, tanh, exp-like, softmax, layer_norm, attention, cross_entropy, dropout) on a
  Partial are errors that say which Reduction to insert;
* a contraction (linear's in-features, matmul's k, sum/mean over a dim, the batch of a mean loss) over a
  sharded dim yields ``Partial(sum)`` on that dim's axes; a mean divides by the *global* count.

Uneven blocks (docs/concepts.md#uneven-shards): a dim whose degree does not divide it is stored padded. Any op may
pass one on unchanged (a batch or heads dim); only the ops of :data:`UNEVEN_OPS` may reduce or contract one, and no
op may make a new one (:func:`_check_uneven`): elsewhere a DegreeError, which
:func:`~shardflow.parallel.pcg.build_pcg` mends by a redistribution. A device whose block is short masks it:
:attr:`LocalOp.valid`.

A rule returns a :class:`LocalOp`: what each device runs on its pieces (the op with local attributes and the
scale factors above). The executors run exactly that; nothing else knows about linearity. An op with no rule of
its own gets :func:`rule_replicated` (whole inputs only). Where a rule refuses,
:func:`~shardflow.parallel.pcg.build_pcg` redistributes the inputs to the cheapest placements it accepts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from shardflow.graph import ops as O
from shardflow.graph.layout import pad_dim
from shardflow.graph.ops import Op, TensorType, torch_dtype
from shardflow.graph.rng import DrawSite
from shardflow.parallel.mesh import ReduceOp, SubMesh
from shardflow.parallel.shape import DegreeError, ShardingError
from shardflow.parallel.sharding import Sharding


class RuleError(ShardingError):
    """A sharding rule rejects its inputs; the message names the node, module, tensor, dim, axes and the fix."""


@dataclass(frozen=True, slots=True)
class Valid:
    """On one device, input (or, with ``output``, output) ``index`` of a local op holds ``size`` indices of its dim
    ``dim``; the rest of its piece is padding (an uneven dim's short block: docs/concepts.md#uneven-shards)."""

    index: int
    dim: int
    size: int
    output: bool = False
    fill: float = 0  # what the padding holds (:func:`padding_fill`): 0, or what the op ignores

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with its padding set to :attr:`fill` (a new tensor: the gradient of the padding is dropped with
        it)."""
        fill: float | bool = self.fill
        if math.isinf(fill) and x.dtype == torch.bool:
            fill = fill > 0
        elif math.isinf(fill) and not x.is_floating_point():  # ±∞ of an integer max or min: its dtype's extreme
            fill = torch.iinfo(x.dtype).max if fill > 0 else torch.iinfo(x.dtype).min
        return pad_dim(x.narrow(self.dim, 0, self.size), self.dim, x.shape[self.dim], fill)

    def mask_gradient(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself where no gradient is recorded, else a view of it whose gradient has its padding dropped (an
        input whose padding already holds 0: what :meth:`mask` of a zero fill does to the backward, without the
        forward's copy)."""
        return _PaddingGradient.apply(x, self) if torch.is_grad_enabled() else x


class _PaddingGradient(torch.autograd.Function):
    """Forward: the input as it is (a view); backward: the gradient with the padding of :class:`Valid` ``v`` zero.
    Written for ``torch.func`` too (``setup_context``): the backward that recomputes a forward runs under it."""

    @staticmethod
    def forward(x: torch.Tensor, v: Valid) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        ctx.v = inputs[1]

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.v.mask(g), None


@dataclass(frozen=True, slots=True)
class LocalOp:
    """What every device runs for one compute op: ``op`` (local attributes) on inputs scaled by ``in_scale``,
    its outputs scaled by ``out_scale`` (a scale of 1.0 is skipped).

    ``block`` = (input i, dim d): the op holds one block of input i's dim d and must know where it starts (a
    vocabulary-parallel embedding or gather, a causal attention's block of queries; the op's ``start`` attribute
    says it): ``op`` is device 0's (start 0),
    :meth:`~shardflow.parallel.pcg.PCG.local_of` gives each device's.

    ``valid``: on a device holding a short block of an uneven dim, where its pieces end (:class:`Valid`); the outputs
    are masked after ``op``, so every piece an op makes has zero padding, and so the inputs are masked before it only
    where the op must see another fill (a max's −∞), their gradients' padding dropped (given by
    :meth:`~shardflow.parallel.pcg.PCG.local_of`; the rule's own op has none)."""

    op: Op
    in_scale: tuple[float, ...]
    out_scale: float = 1.0
    block: tuple[int, int] | None = None
    valid: tuple[Valid, ...] = ()

    def at_block(self, start: int) -> LocalOp:
        """This local op on the block of :attr:`block` that starts at index ``start`` (the op's ``start``)."""
        op: O.Embedding | O.Gather | O.Attention | O.Experts = self.op  # type: ignore[assignment]  # the ops with a block start
        return dataclasses.replace(self, op=dataclasses.replace(op, start=start))

    def compute(self, *xs: torch.Tensor, at: DrawSite | None = None) -> tuple[torch.Tensor, ...]:
        """The device's output pieces from its input pieces; ``at``: the draw site of a random op's piece."""
        xs = tuple(x if s == 1.0 else x * s for x, s in zip(xs, self.in_scale))
        if self.valid:  # an input's padding holds 0 already (every op's outputs are masked): only its gradient's
            ins = list(xs)
            for v in self.valid:
                if not v.output:
                    ins[v.index] = v.mask(ins[v.index]) if v.fill else v.mask_gradient(ins[v.index])
            xs = tuple(ins)
        outs = self.op.compute(*xs, at=at) if self.op.random else self.op.compute(*xs)
        outs = outs if self.out_scale == 1.0 else tuple(o * self.out_scale for o in outs)
        return self.masked(outs, output=True)

    def masked(self, xs: Sequence[torch.Tensor | None], output: bool) -> tuple:
        """``xs`` (the op's inputs, or with ``output`` its outputs, or their gradients; None where there is none) with
        the padding of each of :attr:`valid`'s masked."""
        if not self.valid:
            return tuple(xs)
        out = list(xs)
        for v in self.valid:
            if v.output == output and out[v.index] is not None:
                out[v.index] = v.mask(out[v.index])  # type: ignore[arg-type]
        return tuple(out)


@dataclass(frozen=True, slots=True)
class RuleResult:
    outputs: tuple[Sharding, ...]
    local: LocalOp


@dataclass(frozen=True)
class Ctx:
    """Everything a rule looks at: the op, its node name and module scope, inputs (names, types, shardings)."""

    op: Op
    node: str
    scope: str
    names: tuple[str, ...]
    types: tuple[TensorType, ...]
    shardings: tuple[Sharding, ...]
    group: SubMesh
    out_types: tuple[TensorType, ...]

    def error(self, msg: str, fix: str) -> RuleError:
        where = f"node {self.node!r} ({self.op.describe()}" + (f" in module {self.scope!r})" if self.scope else ")")
        return RuleError(f"{where}: {msg}. Fix: {fix}.")

    def degree(self, axes: Sequence[str]) -> int:
        return math.prod(self.group.mesh.axis_size(a) for a in axes)

    # --- checks shared by the rules -------------------------------------------------------------------
    def no_partial(self, *idx: int) -> None:
        for i in idx:
            s = self.shardings[i]
            if s.partial:
                axes = ", ".join(s.partial)
                raise self.error(
                    f"{self.op.kind} is not linear but input {self.names[i]!r} holds Partial({s.reduce_op!r}) "
                    f"pieces on mesh axes {axes}",
                    f"insert ReductionOp(axis={s.partial[0]}) before it (e.g. output=Replicate() on the module "
                    f"that produced {self.names[i]!r})",
                )

    def unsharded(self, i: int, dims: Sequence[int], why: str) -> None:
        s = self.shardings[i]
        for d in dims:
            if s.dims[d]:
                raise self.error(
                    f"dim {d} (size {self.types[i].shape[d]}) of {self.names[i]!r} is sharded on mesh axes "
                    f"{list(s.dims[d])}; {why}",
                    f"insert CombineOp(dim={d}, axis={s.dims[d][-1]}) first, or shard another dim",
                )

    def agree(self, pairs: Sequence[tuple[int, int]]) -> tuple[str, ...]:
        """Axes shared by input dims ``(input, dim)``; size-1 (broadcast) dims are ignored."""
        found: tuple[int, int, tuple[str, ...]] | None = None
        for i, d in pairs:
            if self.types[i].shape[d] == 1 and len(pairs) > 1:
                continue
            axes = self.shardings[i].dims[d]
            if found is None:
                found = (i, d, axes)
            elif axes != found[2]:
                fi, fd, fa = found
                raise self.error(
                    f"dim {fd} of {self.names[fi]!r} is sharded on {list(fa) or 'no axes'} but dim {d} of "
                    f"{self.names[i]!r} on {list(axes) or 'no axes'}",
                    "redistribute one operand so both dims have the same placement",
                )
        return found[2] if found else ()

    def partial_of(
        self, idx: Sequence[int], extra: Sequence[str] = (), extra_op: ReduceOp = ReduceOp.SUM
    ) -> tuple[tuple[str, ...], ReduceOp]:
        """Union of the partial axes of inputs ``idx`` plus new ``extra_op``-partial axes ``extra``, and the
        reduce op."""
        axes, reduce_ops = [], set()
        for i in idx:
            s = self.shardings[i]
            if s.partial:
                axes += s.partial
                reduce_ops.add(s.reduce_op)
        if extra:
            axes += extra
            reduce_ops.add(extra_op)
        if len(reduce_ops) > 1:
            raise self.error(
                f"partial pieces with different reduce ops {sorted(reduce_ops)} meet",
                "reduce one of them first (ReductionOp)",
            )
        return tuple(axes), reduce_ops.pop() if reduce_ops else ReduceOp.SUM

    def linear_partials(self, idx: Sequence[int]) -> None:
        for i in idx:
            if not self.shardings[i].is_linear_partial:
                s = self.shardings[i]
                raise self.error(
                    f"input {self.names[i]!r} holds Partial({s.reduce_op!r}) pieces, which no op is linear in",
                    f"insert ReductionOp(axis={s.partial[0]}) before it",
                )

    def output(
        self,
        dims: Sequence[tuple[str, ...]],
        partial: tuple[str, ...] = (),
        reduce_op: ReduceOp = ReduceOp.SUM,
        k: int = 0,
    ) -> Sharding:
        """Build output ``k``'s sharding, checking no axis is used twice and every degree divides its dim."""
        try:
            s = Sharding(tuple(dims), partial, reduce_op if partial else ReduceOp.SUM)
        except ShardingError:
            used = [a for ax in dims for a in ax] + list(partial)
            raise self.error(
                f"the output would use a mesh axis twice ({used})",
                "shard the operands on different axes, or combine one first",
            ) from None
        try:
            s.check(  # uneven blocks where the op may hold them: propagate's _check_uneven
                self.group, self.out_types[k].shape, self.node, self.node if k == 0 else f"{self.node}.{k}", True
            )
        except DegreeError as e:
            raise e.at(hint=f"in module {self.scope!r}" if self.scope else "") from None
        return s

    def local(
        self,
        op: Op | None = None,
        in_scale: Sequence[float] | None = None,
        out_scale: float = 1.0,
        block: tuple[int, int] | None = None,
    ) -> LocalOp:
        """The local op; with ``block``, device 0's (its block starts at 0: :attr:`LocalOp.block`). Raises RuleError
        where that block is in head-tail order (docs/concepts.md#the-load-balanced-layout) and the op is not one that
        reads its positions from the layout (a causal attention's queries)."""
        if block is not None and not (isinstance(op, O.Attention) and op.layout is not None):
            i, d = block
            if any(h.dim == d for h in self.shardings[i].head_tail(self.group, self.types[i].shape)):
                raise self.error(
                    f"dim {d} of {self.names[i]!r} is held in the load-balanced layout of context parallelism, whose "
                    f"blocks are not consecutive indices, and the op reads its block by its start",
                    f"insert CombineOp(dim={d}, axis={self.group.mesh.balanced.axis}) first",  # type: ignore[union-attr]
                )
        local = LocalOp(op or self.op, tuple(in_scale or (1.0,) * len(self.names)), out_scale, block)
        return local.at_block(0) if block else local


def _sum_scale(ctx: Ctx, partial: tuple[str, ...], reduce_op: ReduceOp) -> float:
    """What a replicated operand added to ``Partial(reduce_op)`` pieces on ``partial`` is multiplied by."""
    return 1.0 / ctx.degree(partial) if partial and reduce_op == ReduceOp.SUM else 1.0


# --- the rules -------------------------------------------------------------------------------------------
def _pointwise_dims(ctx: Ctx, idx: Sequence[int]) -> list[tuple[str, ...]]:
    """Output dims of a broadcasting element-wise op over inputs ``idx`` (dims aligned from the right)."""
    nd = ctx.out_types[0].ndim
    out = []
    for k in range(nd):
        pairs = [(i, ctx.types[i].ndim - nd + k) for i in idx if ctx.types[i].ndim - nd + k >= 0]
        out.append(ctx.agree(pairs))
    return out


def _is_float(t: TensorType) -> bool:
    return torch_dtype(t.dtype).is_floating_point


def rule_unary(ctx: Ctx) -> RuleResult:
    """Element-wise one-input ops (Unary, Dropout, Cast). Linear ones (neg, a cast to a float dtype) keep
    Partial(sum|avg); monotone ones keep Partial(max|min), a non-increasing one swapping max and min
    (``relu(P(max)) = P(max)``, ``neg(P(max)) = P(min)``, DTensor's table); the rest need whole values."""
    op, s = ctx.op, ctx.shardings[0]
    fn = op.fn if isinstance(op, O.Unary) else None
    reduce_op = s.reduce_op
    linear = fn in O.LINEAR_UNARY or (
        isinstance(op, O.Cast)
        and _is_float(ctx.out_types[0])  # int → float is exact, float → int truncates
        and (_is_float(ctx.types[0]) or s.reduce_op == ReduceOp.SUM)
    )  # an integer average is no integer
    monotone = fn in O.NON_DECREASING_UNARY | O.NON_INCREASING_UNARY
    if s.partial and reduce_op in (ReduceOp.MAX, ReduceOp.MIN) and monotone:
        if fn in O.NON_INCREASING_UNARY:
            reduce_op = ReduceOp.MIN if reduce_op == ReduceOp.MAX else ReduceOp.MAX
    elif linear:
        ctx.linear_partials([0])
    else:
        ctx.no_partial(0)
    return RuleResult((ctx.output(s.dims, s.partial, reduce_op),), ctx.local())


def rule_detach(ctx: Ctx) -> RuleResult:
    """Detach: the same values, so every placement passes through unchanged, partial pieces of any reduce op too."""
    s = ctx.shardings[0]
    return RuleResult((ctx.output(s.dims, s.partial, s.reduce_op),), ctx.local())


def rule_scalar(ctx: Ctx) -> RuleResult:
    op: O.Scalar = ctx.op  # type: ignore[assignment]
    s = ctx.shardings[0]
    local = op
    if op.fn not in O.ADDITIVE | O.MULTIPLICATIVE:  # s / x, x ** s, comparisons
        ctx.no_partial(0)
    elif s.partial:
        ctx.linear_partials([0])
        if op.fn in O.ADDITIVE:  # the scalar is split over the partial pieces
            local = dataclasses.replace(op, value=op.value * _sum_scale(ctx, s.partial, s.reduce_op))
    return RuleResult((ctx.output(s.dims, s.partial, s.reduce_op),), ctx.local(local))


def rule_binary(ctx: Ctx) -> RuleResult:
    op: O.Binary = ctx.op  # type: ignore[assignment]
    dims = _pointwise_dims(ctx, (0, 1))
    a, b = ctx.shardings
    ctx.linear_partials([0, 1])
    scale = [1.0, 1.0]
    if op.fn not in O.ADDITIVE | O.MULTIPLICATIVE:  # pow, maximum, comparisons, bitwise
        ctx.no_partial(0, 1)
        partial, reduce_op = (), ReduceOp.SUM
    elif op.fn in O.ADDITIVE:
        if a.partial and b.partial and (a.partial != b.partial or a.reduce_op != b.reduce_op):
            raise ctx.error(
                f"{op.fn} of partial pieces on different axes ({list(a.partial)} vs {list(b.partial)})",
                "reduce one operand first (ReductionOp)",
            )
        partial, reduce_op = (a.partial, a.reduce_op) if a.partial else (b.partial, b.reduce_op)
        if a.partial and not b.partial:
            scale[1] = _sum_scale(ctx, partial, reduce_op)
        if b.partial and not a.partial:
            scale[0] = _sum_scale(ctx, partial, reduce_op)
    else:
        if a.partial and b.partial:
            raise ctx.error(
                f"{op.fn} of two partial operands is not linear (Partial·Partial)",
                f"insert ReductionOp(axis={b.partial[0]}) on {ctx.names[1]!r}",
            )
        if op.fn == "div" and b.partial:
            raise ctx.error(
                f"division by a partial operand {ctx.names[1]!r} is not linear",
                f"insert ReductionOp(axis={b.partial[0]}) on {ctx.names[1]!r}",
            )
        partial, reduce_op = ctx.partial_of([0, 1])
    return RuleResult((ctx.output(dims, partial, reduce_op),), ctx.local(in_scale=scale))


def _contract(ctx: Ctx, x: int, w: int, x_dim: int, w_dim: int) -> tuple[tuple[str, ...], str]:
    """Partial axes of a product of inputs x and w contracting x_dim with w_dim."""
    ctx.linear_partials([x, w])
    if ctx.shardings[x].partial and ctx.shardings[w].partial:
        raise ctx.error(
            "both operands of the product hold partial pieces (Partial·Partial)",
            f"insert ReductionOp(axis={ctx.shardings[w].partial[0]}) on {ctx.names[w]!r}",
        )
    k_axes = ctx.agree([(x, x_dim), (w, w_dim)])
    return ctx.partial_of([x, w], k_axes)


def rule_linear(ctx: Ctx) -> RuleResult:
    op: O.Linear = ctx.op  # type: ignore[assignment]
    x, w = ctx.shardings[0], ctx.shardings[1]
    partial, reduce_op = _contract(ctx, 0, 1, ctx.types[0].ndim - 1, 1 - op.out_dim)
    out_axes = w.dims[op.out_dim]
    scale = [1.0, 1.0]
    if len(ctx.names) == 3:
        ctx.no_partial(2)
        ctx.agree([(1, op.out_dim), (2, 0)])
        scale.append(_sum_scale(ctx, partial, reduce_op))
    out = ctx.output(x.dims[:-1] + (out_axes,), partial, reduce_op)
    return RuleResult((out,), ctx.local(in_scale=scale))


def rule_matmul(ctx: Ctx) -> RuleResult:
    a, b = ctx.types
    partial, reduce_op = _contract(ctx, 0, 1, a.ndim - 1, b.ndim - 2)
    nd = ctx.out_types[0].ndim
    batch = []
    for k in range(nd - 2):
        pairs = [(i, t.ndim - nd + k) for i, t in enumerate(ctx.types) if t.ndim - nd + k >= 0]
        batch.append(ctx.agree(pairs))
    out = ctx.output(batch + [ctx.shardings[0].dims[-2], ctx.shardings[1].dims[-1]], partial, reduce_op)
    return RuleResult((out,), ctx.local())


def _vocabulary_parallel(ctx: Ctx, axes: tuple[str, ...], i: int, d: int) -> tuple[LocalOp, tuple[str, ...]]:
    """The local op of an embedding or gather whose input ``i`` holds one block of its dim ``d`` on mesh ``axes``
    (none: the whole dim) and the new partial axes of its output: each device reads the indices its block holds and
    zeros elsewhere (:func:`~shardflow.graph.ops.in_block`), so the pieces are ``Partial(sum)`` on ``axes``
    (Megatron-LM's vocabulary-parallel embedding; DTensor's ``MaskPartial``)."""
    return (ctx.local(block=(i, d)), axes) if axes else (ctx.local(), ())


def rule_embedding(ctx: Ctx) -> RuleResult:
    """Indices' dims pass to the output's leading dims, the table's feature dim to its last; a table whose rows
    (the vocabulary) are sharded gives ``Partial(sum)`` on their axes (:func:`_vocabulary_parallel`)."""
    ctx.no_partial(0, 1)
    idx, w = ctx.shardings
    local, partial = _vocabulary_parallel(ctx, w.dims[0], 1, 0)
    return RuleResult((ctx.output(idx.dims + (w.dims[1],), partial),), local)


def rule_layer_norm(ctx: Ctx) -> RuleResult:
    op: O.LayerNorm = ctx.op  # type: ignore[assignment]
    ctx.no_partial(*range(len(ctx.names)))
    nd = ctx.types[0].ndim
    ctx.unsharded(0, range(nd - op.ndim, nd), "layer_norm normalises over it")
    for i in range(1, len(ctx.names)):
        ctx.unsharded(i, range(ctx.types[i].ndim), "layer_norm parameters must be whole on every device")
    return RuleResult((ctx.output(ctx.shardings[0].dims),), ctx.local())


def rule_softmax(ctx: Ctx) -> RuleResult:
    op: O.Softmax = ctx.op  # type: ignore[assignment]
    ctx.no_partial(0)
    ctx.unsharded(0, [op.dim % ctx.types[0].ndim], "softmax normalises over it")
    return RuleResult((ctx.output(ctx.shardings[0].dims),), ctx.local())


def _values_and_indices(ctx: Ctx, dim: int, why: str) -> RuleResult:
    """An op giving values and their indices along ``dim`` of its one input (topk, sort): the other dims pass to
    both outputs, ``dim`` must be whole (``why``) and the input not partial."""
    ctx.no_partial(0)
    ctx.unsharded(0, [dim % ctx.types[0].ndim], why)
    dims = ctx.shardings[0].dims
    return RuleResult((ctx.output(dims), ctx.output(dims, k=1)), ctx.local())


def rule_topk(ctx: Ctx) -> RuleResult:
    """The other dims pass to both outputs (a router's token dims keep their sharding); the selected dim must be
    whole (the k largest of a block are not the k largest of the dim) and the input not partial (DTensor's topk
    strategy alike)."""
    op: O.TopK = ctx.op  # type: ignore[assignment]
    return _values_and_indices(ctx, op.dim, "topk selects over the whole dim")


def rule_sort(ctx: Ctx) -> RuleResult:
    """As :func:`rule_topk`: the other dims pass to both outputs (the pairs of a dispatcher's tokens keep their
    sharding), the sorted dim must be whole (the order of a block is not its place in the whole) and the input not
    partial."""
    op: O.Sort = ctx.op  # type: ignore[assignment]
    return _values_and_indices(ctx, op.dim, "sort orders the whole dim")


def rule_cumsum(ctx: Ctx) -> RuleResult:
    """The other dims pass; the summed dim must be whole (a block's running sums miss the blocks before it).
    Running sums are linear: ``Partial(sum)`` pieces pass (the offsets of a dispatcher's partial counts per expert,
    :func:`rule_histc`, are partial offsets); another partial is refused (an average of integers is none)."""
    op: O.Cumsum = ctx.op  # type: ignore[assignment]
    if ctx.shardings[0].reduce_op != ReduceOp.SUM:  # an average of integers is none
        ctx.no_partial(0)
    ctx.unsharded(0, [op.dim % ctx.types[0].ndim], "cumsum runs along the whole dim")
    s = ctx.shardings[0]
    return RuleResult((ctx.output(s.dims, s.partial, s.reduce_op),), ctx.local())


def rule_index_add(ctx: Ctx) -> RuleResult:
    """x and source agree on every dim but ``dim``, which passes; x's ``dim`` must be whole (an index names any
    position along it). The rows added — source's ``dim`` and the index, split alike — may be split: each device
    adds its rows, and the output is ``Partial(sum)`` on their axes, x divided by their degree so that it is counted
    once (partial-sum linearity, as ``Partial + Replicate``); a floating x only. No partial inputs."""
    op: O.IndexAdd = ctx.op  # type: ignore[assignment]
    ctx.no_partial(0, 1, 2)
    d = op.dim % ctx.types[0].ndim
    ctx.unsharded(0, [d], "index_add writes anywhere along it")
    rows = ctx.agree([(1, 0), (2, d)])
    if rows and not _is_float(ctx.types[0]):
        raise ctx.error(
            f"the rows added (index and dim {d} of {ctx.names[2]!r}) are split on {list(rows)}, which makes the output "
            f"a partial sum, but {ctx.names[0]!r} is {ctx.types[0].dtype}, which cannot be divided among the devices",
            f"insert CombineOp(dim={d}, axis={rows[-1]}) on {ctx.names[2]!r} and its index first",
        )
    dims = [ctx.shardings[0].dims[k] if k == d else ctx.agree([(0, k), (2, k)]) for k in range(ctx.types[0].ndim)]
    scale = 1.0 / ctx.degree(rows) if rows else 1.0
    return RuleResult((ctx.output(dims, rows),), ctx.local(in_scale=(scale, 1.0, 1.0)))


def rule_full_like(ctx: Ctx) -> RuleResult:
    """Every dim keeps its sharding (each device fills its piece); a partial input is refused (its pieces' shapes are
    the whole's, but the filled pieces would sum to degree × value)."""
    ctx.no_partial(0)
    return RuleResult((ctx.output(ctx.shardings[0].dims),), ctx.local())


def rule_scatter(ctx: Ctx) -> RuleResult:
    """x and index agree on every dim but ``dim`` (a router's token dim stays sharded), which must be whole in both
    (an index names any position along it); no partial inputs (the written value is not a partial sum)."""
    op: O.Scatter = ctx.op  # type: ignore[assignment]
    ctx.no_partial(0, 1)
    d = op.dim % ctx.types[0].ndim
    ctx.unsharded(0, [d], "scatter writes anywhere along it")
    ctx.unsharded(1, [d], "scatter writes anywhere along it")
    dims = [() if k == d else ctx.agree([(0, k), (1, k)]) for k in range(ctx.types[0].ndim)]
    return RuleResult((ctx.output(dims),), ctx.local())


def rule_histc(ctx: Ctx) -> RuleResult:
    """Counting is additive over a split: the counts of each device's elements sum to the whole's, so any sharded dim
    of x gives ``Partial(sum)`` counts on its axes (a mixture of experts' tokens per expert under dp); x must not be
    partial (the count of a sum is not the sum of the counts)."""
    ctx.no_partial(0)
    axes = tuple(a for d in ctx.shardings[0].dims for a in d)
    return RuleResult((ctx.output(((),), axes),), ctx.local())


def rule_experts(ctx: Ctx) -> RuleResult:
    """Tokens and experts are independent (docs/concepts.md#mixtures-of-experts): the token dim of x, idx and w
    (dim 0 of each, sharded alike) passes to the output's, every token computed where it is held (data, sequence
    or FSDP sharding of the tokens); the experts dim of w1 and w2 (dim 0 of both, sharded alike) gives
    ``Partial(sum)`` on its axes: each device computes its block of experts for the tokens it holds, a token's other
    experts contributing 0, as a vocabulary-parallel embedding's rows (expert parallelism with the tokens
    replicated on the expert axes, :attr:`~shardflow.graph.ops.Experts.start`). Features (H, K, I) must be whole;
    the routing weights enter linearly but are taken whole, like everything else here (no partial inputs)."""
    ctx.no_partial(*range(5))
    tokens = ctx.agree([(0, 0), (1, 0), (2, 0)])
    experts = ctx.agree([(3, 0), (4, 0)])
    for i, what in (
        (0, "features"),
        (1, "experts per token"),
        (2, "experts per token"),
        (3, "features"),
        (4, "features"),
    ):
        ctx.unsharded(i, range(1, ctx.types[i].ndim), f"each expert reads whole {what}")
    if set(tokens) & set(experts):
        raise ctx.error(
            f"the tokens and the experts are both sharded on mesh axes {sorted(set(tokens) & set(experts))}",
            "replicate the tokens on the expert axis (each device then computes its experts for every token)",
        )
    local, partial = _vocabulary_parallel(ctx, experts, 3, 0)
    if partial:  # a block of the layer's experts: the layer's count, for the pairs routed to the block
        op: O.Experts = local.op  # type: ignore[assignment]
        local = dataclasses.replace(local, op=dataclasses.replace(op, experts=ctx.types[3].shape[0]))
    return RuleResult((ctx.output((tokens, ()), partial),), local)


def rule_attention(ctx: Ctx) -> RuleResult:
    """Batch and head dims pass through (q, k, v and a mask agree on them; grouped-query heads too: with H and
    Hkv split into the same number of blocks, query block r reads key/value block r). Keys and values need whole
    sequences and q, k whole head dims (the scores contract over them); v's head dim passes to the output's.
    The query sequence may be sharded (a mask's T dim agreeing; context parallelism): each block of queries
    attends to every key, and under ``causal`` the block's rows of the causal mask are those of its positions
    (the local op is given its block's start: :attr:`LocalOp.block`; in the load-balanced layout of context
    parallelism, the positions its indices hold: :attr:`~shardflow.graph.ops.Attention.layout`)."""
    op: O.Attention = ctx.op  # type: ignore[assignment]
    n = len(ctx.names)
    ctx.no_partial(*range(n))
    nd = ctx.types[0].ndim
    ctx.unsharded(0, [nd - 1], "the scores contract over the head dim")
    ctx.unsharded(1, [nd - 2, nd - 1], "every query reads the whole key sequence and head dim")
    ctx.unsharded(2, [nd - 2], "every query reads the whole value sequence")
    m_nd = ctx.types[3].ndim if n == 4 else 0
    if n == 4:
        ctx.unsharded(3, [m_nd - 1], "every query reads the whole key sequence")

    def with_mask(pairs: list[tuple[int, int]], k: int) -> list[tuple[int, int]]:
        return pairs + [(3, m_nd - nd + k)] if n == 4 and m_nd - nd + k >= 0 else pairs

    dims = [ctx.agree(with_mask([(0, k), (1, k), (2, k)], k)) for k in range(nd - 2)]
    for k, axes in enumerate(dims):  # grouped-query heads in uneven blocks: query block r must read key block r
        h, hkv, deg = ctx.types[0].shape[k], ctx.types[1].shape[k], ctx.degree(axes)
        if axes and h != hkv and (h % deg or hkv % deg) and -(-h // deg) != h // hkv * -(-hkv // deg):
            raise DegreeError(
                k,
                hkv,
                deg,
                ctx.node,
                ctx.names[1],
                f"query heads {h} and key/value heads {hkv} in uneven blocks of {-(-h // deg)} and {-(-hkv // deg)}, "
                f"not {h // hkv} query heads per key/value head on each device (docs/concepts.md#uneven-shards)",
            )
    dims.append(ctx.agree(with_mask([(0, nd - 2)], nd - 2)))
    dims.append(ctx.shardings[2].dims[nd - 1])
    out = ctx.output(dims)
    # the query block's positions (a causal mask's rows): its start, and in the load-balanced layout the positions
    # its indices hold (also the key blocks' of a ring, whose mask columns are then taken by position)
    layout = next((h for h in ctx.shardings[0].head_tail(ctx.group, ctx.types[0].shape) if h.dim == nd - 2), None)
    if not (op.causal and dims[nd - 2] or layout):
        return RuleResult((out,), ctx.local())
    return RuleResult((out,), ctx.local(dataclasses.replace(op, layout=layout), block=(0, nd - 2)))


def rule_conv(ctx: Ctx) -> RuleResult:
    """Batch passes; input channels contracted with the weight's dim 1 give Partial(sum) (row parallel);
    the weight's output channels give a sharded channel dim (column parallel); spatial dims must be whole."""
    op: O.Conv = ctx.op  # type: ignore[assignment]
    x, w = ctx.shardings[0], ctx.shardings[1]
    nd = ctx.types[0].ndim
    ctx.unsharded(0, range(2, nd), "convolution windows cross shard borders")
    ctx.unsharded(1, range(2, nd), "the kernel must be whole")
    if op.groups > 1:
        ctx.unsharded(0, [1], "grouped convolution needs whole channels")
        ctx.unsharded(1, [0, 1], "grouped convolution needs whole channels")
    partial, reduce_op = _contract(ctx, 0, 1, 1, 1)
    scale = [1.0, 1.0]
    if len(ctx.names) == 3:
        ctx.no_partial(2)
        ctx.agree([(1, 0), (2, 0)])
        scale.append(_sum_scale(ctx, partial, reduce_op))
    out = ctx.output((x.dims[0], w.dims[0]) + ((),) * (nd - 2), partial, reduce_op)
    return RuleResult((out,), ctx.local(in_scale=scale))


def rule_pool(ctx: Ctx) -> RuleResult:
    """Leading dims (batch, channels) pass through; the pooled dims must be whole (windows cross shard borders).
    Average pooling is linear, so Partial(sum|avg) passes; max pooling keeps Partial(max), a max of maxima
    (``maxpool(max(a, b)) = max(maxpool(a), maxpool(b))``), and takes no other partial."""
    op: O.Pool = ctx.op  # type: ignore[assignment]
    s, nd = ctx.shardings[0], ctx.types[0].ndim
    ctx.unsharded(0, range(nd - len(op.kernel), nd), "pooling windows cross shard borders")
    if op.fn == "avg":
        ctx.linear_partials([0])
    elif s.reduce_op != ReduceOp.MAX:
        ctx.no_partial(0)
    return RuleResult((ctx.output(s.dims, s.partial, s.reduce_op),), ctx.local())


def rule_cross_entropy(ctx: Ctx) -> RuleResult:
    """Rows sharded: ``Partial(sum)`` of the blocks' losses, a mean divided by the degree — or, rows in uneven blocks
    (docs/concepts.md#uneven-shards), each block's sum divided by the whole N, its padded rows' targets the ignore
    index (:data:`IGNORE_INDEX`, :meth:`~shardflow.parallel.pcg.PCG.local_of`) so that they count nothing."""
    op: O.CrossEntropy = ctx.op  # type: ignore[assignment]
    ctx.no_partial(0, 1)
    ctx.unsharded(0, [1], "vocabulary-parallel cross-entropy is not supported")
    n_axes = ctx.agree([(0, 0), (1, 0)])
    out = ctx.output((), n_axes, ReduceOp.SUM)
    if ctx.shardings[1].uneven_dims(ctx.group, ctx.types[1].shape):
        n = ctx.types[1].shape[0]
        return RuleResult(
            (out,),
            ctx.local(dataclasses.replace(op, reduction="sum"), out_scale=1 / n if op.reduction == "mean" else 1.0),
        )
    out_scale = 1.0 / ctx.degree(n_axes) if op.reduction == "mean" else 1.0
    return RuleResult((out,), ctx.local(out_scale=out_scale))


def rule_reduce(ctx: Ctx) -> RuleResult:
    """A reduced dim that is sharded gives Partial: sum and mean → sum (a mean divides by the global count),
    amax → max, amin → min. Sums keep Partial(sum); amax keeps Partial(max) (and amin, min)."""
    op: O.Reduce = ctx.op  # type: ignore[assignment]
    s = ctx.shardings[0]
    kind = {"sum": ReduceOp.SUM, "mean": ReduceOp.SUM, "amax": ReduceOp.MAX, "amin": ReduceOp.MIN}[op.fn]
    if kind == ReduceOp.SUM:
        ctx.linear_partials([0])
    elif s.partial and s.reduce_op != kind:
        ctx.no_partial(0)
    reduced = [a for d in op.dims for a in s.dims[d]]
    partial, reduce_op = ctx.partial_of([0], reduced, kind)
    dims = [() if d in op.dims else ax for d, ax in enumerate(s.dims) if op.keepdim or d not in op.dims]
    uneven = [d for d in s.uneven_dims(ctx.group, ctx.types[0].shape) if d in op.dims]
    if uneven and op.fn == "mean":  # the blocks differ in size: each sums its own, divided by the global count
        count = math.prod(ctx.types[0].shape[d] for d in op.dims)
        return RuleResult(
            (ctx.output(dims, partial, reduce_op),),
            ctx.local(dataclasses.replace(op, fn="sum"), out_scale=1.0 / count),
        )
    out_scale = 1.0 / ctx.degree(reduced) if op.fn == "mean" else 1.0
    return RuleResult((ctx.output(dims, partial, reduce_op),), ctx.local(out_scale=out_scale))


def rule_permute(ctx: Ctx) -> RuleResult:
    op: O.Permute = ctx.op  # type: ignore[assignment]
    ctx.linear_partials([0])
    s = ctx.shardings[0]
    return RuleResult((ctx.output([s.dims[d] for d in op.dims], s.partial, s.reduce_op),), ctx.local())


def rule_complex_view(ctx: Ctx) -> RuleResult:
    """view_as_complex / view_as_real: every dim but the (real, imaginary) pair keeps its sharding; the pair is
    never cut. No partial sums: complex values are reduced as real ones, before the view (no collective of shardflow
    carries a complex dtype)."""
    op: O.ComplexView = ctx.op  # type: ignore[assignment]
    ctx.no_partial(0)
    s = ctx.shardings[0]
    if op.to_complex:
        ctx.unsharded(0, [len(s.dims) - 1], "it holds the (real, imaginary) pairs")
        return RuleResult((ctx.output(s.dims[:-1]),), ctx.local())
    return RuleResult((ctx.output(s.dims + ((),)),), ctx.local())


def rule_split(ctx: Ctx) -> RuleResult:
    op: O.Split = ctx.op  # type: ignore[assignment]
    ctx.linear_partials([0])
    ctx.unsharded(0, [op.dim], "split cuts along it")
    s = ctx.shardings[0]
    outs = tuple(ctx.output(s.dims, s.partial, s.reduce_op, k) for k in range(len(op.sizes)))
    return RuleResult(outs, ctx.local())


def rule_where(ctx: Ctx) -> RuleResult:
    """Element-wise over (cond, a, b) with broadcasting; not linear in any operand, except in a where b is zero
    (``Where.zero``), or in b where a is: ``where(c, Σ aᵢ, 0) = Σ where(c, aᵢ, 0)``, so partial sums pass through
    (a masked loss's target logits under vocabulary parallelism: docs/concepts.md#vocabulary-parallel-embedding-and-loss)."""
    op: O.Where = ctx.op  # type: ignore[assignment]
    live = () if op.zero is None else (3 - op.zero,)  # the operand the op is linear in
    ctx.no_partial(*(i for i in (0, 1, 2) if i not in live))
    ctx.linear_partials(live)
    partial, reduce_op = ctx.partial_of(live)
    return RuleResult((ctx.output(_pointwise_dims(ctx, (0, 1, 2)), partial, reduce_op),), ctx.local())


def rule_expand(ctx: Ctx) -> RuleResult:
    """Dims that keep their size pass through (an expanded dim had size 1: never sharded); linear."""
    op: O.Expand = ctx.op  # type: ignore[assignment]
    ctx.linear_partials([0])
    s = ctx.shardings[0]
    lead = len(op.shape) - ctx.types[0].ndim
    out = ctx.output([()] * lead + list(s.dims), s.partial, s.reduce_op)
    piece = out.parallel_shape(ctx.group, op.shape).piece_shape
    return RuleResult((out,), ctx.local(dataclasses.replace(op, shape=piece)))


def rule_slice(ctx: Ctx) -> RuleResult:
    """The sliced dim must be whole (unless the slice keeps all of it); linear."""
    op: O.Slice = ctx.op  # type: ignore[assignment]
    ctx.linear_partials([0])
    d = op.dim % ctx.types[0].ndim
    if (op.start, op.end, op.step) != (0, ctx.types[0].shape[d], 1):
        ctx.unsharded(0, [d], "slicing cuts along it")
    s = ctx.shardings[0]
    return RuleResult((ctx.output(s.dims, s.partial, s.reduce_op),), ctx.local())


def rule_cat(ctx: Ctx) -> RuleResult:
    """The cat dim must be whole in every input; the other dims agree; partial inputs must all be partial
    alike (cat is linear in the tuple of its inputs)."""
    op: O.Cat = ctx.op  # type: ignore[assignment]
    n, nd = len(ctx.names), ctx.types[0].ndim
    d = op.dim % nd
    ctx.linear_partials(range(n))
    for i in range(n):
        ctx.unsharded(i, [d], "cat joins along it")
    kinds = {(s.partial, s.reduce_op) for s in ctx.shardings}
    if len(kinds) > 1:
        raise ctx.error(
            "cat of inputs with different partial placements", "reduce the partial inputs first (ReductionOp)"
        )
    dims = [ctx.agree([(i, k) for i in range(n)]) for k in range(nd)]
    s = ctx.shardings[0]
    return RuleResult((ctx.output(dims, s.partial, s.reduce_op),), ctx.local())


def rule_gather(ctx: Ctx) -> RuleResult:
    """Every dim but the gathered one agrees between input and index where their sizes match (else both whole);
    the gathered dim takes the index's placement. An input sharded on the gathered dim (the classes of a
    vocabulary-parallel loss) gives ``Partial(sum)`` on its axes (:func:`_vocabulary_parallel`). Linear in the
    input."""
    op: O.Gather = ctx.op  # type: ignore[assignment]
    ctx.linear_partials([0])
    ctx.no_partial(1)
    x, idx = ctx.types
    d = op.dim % x.ndim
    local, block = _vocabulary_parallel(ctx, ctx.shardings[0].dims[d], 0, d)
    dims: list[tuple[str, ...]] = []
    for k in range(x.ndim):
        if k == d:
            dims.append(ctx.shardings[1].dims[k])
        elif x.shape[k] == idx.shape[k]:
            dims.append(ctx.agree([(0, k), (1, k)]))
        else:
            ctx.unsharded(0, [k], "the index covers only part of it")
            ctx.unsharded(1, [k], "the index covers only part of the input's dim")
            dims.append(())
    partial, reduce_op = ctx.partial_of([0], block)
    return RuleResult((ctx.output(dims, partial, reduce_op),), local)


def rule_pad(ctx: Ctx) -> RuleResult:
    """Padded dims must be whole; zero padding is linear, other values are not."""
    op: O.Pad = ctx.op  # type: ignore[assignment]
    nd = ctx.types[0].ndim
    ctx.unsharded(0, [nd - k for k, pair in op.padded_dims.items() if pair != (0, 0)], "padding extends it")
    if op.value == 0:
        ctx.linear_partials([0])
    else:
        ctx.no_partial(0)
    s = ctx.shardings[0]
    return RuleResult((ctx.output(s.dims, s.partial, s.reduce_op),), ctx.local())


def reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split two shapes of equal size into minimal groups of dims with equal products (in order)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            gi, pa, i = [i], a[i], i + 1
        if j < len(b):
            gj, pb, j = [j], b[j], j + 1
        while pa != pb:
            if pa < pb:
                gi.append(i)
                pa, i = pa * a[i], i + 1
            else:
                gj.append(j)
                pb, j = pb * b[j], j + 1
        groups.append((gi, gj))
    return groups


def rule_reshape(ctx: Ctx) -> RuleResult:
    """A group of input dims that becomes a group of output dims keeps a blocked layout when it is sharded on its
    leading (major) dim, and on a later dim only where every dim before it is split down to pieces of one (each
    device's elements of the group are then contiguous: ``[B, T]`` as ``[B·T]`` with B split into single rows by dp
    and T by cp, as context parallelism with one sequence per device has it); the axes move, in order, to the
    group's leading output dim."""
    op: O.Reshape = ctx.op  # type: ignore[assignment]
    ctx.linear_partials([0])
    s = ctx.shardings[0]
    src, dst = ctx.types[0].shape, op.shape
    dims: list[tuple[str, ...]] = [()] * len(dst)
    for gi, gj in reshape_groups(src, dst):
        big = [d for d in gi if src[d] > 1]
        rows = [d for k, d in enumerate(big) if all(ctx.degree(s.dims[e]) == src[e] for e in big[:k])]
        ctx.unsharded(
            0, [d for d in gi if d not in rows], f"viewing {list(src)} as {list(dst)} merges it into a preceding dim"
        )
        axes = tuple(a for d in rows for a in s.dims[d])
        if axes:
            lead_out = next(d for d in gj if dst[d] > 1)
            dims[lead_out] = axes
    out = ctx.output(dims, s.partial, s.reduce_op)
    if ctx.group.mesh.balanced is not None:
        for gi, gj in reshape_groups(src, dst):
            if not torch.equal(_stored_order(ctx, s, src, gi), _stored_order(ctx, out, dst, gj)):
                raise ctx.error(
                    f"viewing {list(src)} as {list(dst)} would change which elements the load-balanced layout of "
                    f"context parallelism puts on each device (the dims {list(gi)} and {list(gj)} would be held in "
                    f"different orders)",
                    f"insert CombineOp(axis={ctx.group.mesh.balanced.axis}) on the sharded dim first",
                )
    piece = out.parallel_shape(ctx.group, dst).piece_shape
    return RuleResult((out,), ctx.local(dataclasses.replace(op, shape=piece)))


def _stored_order(ctx: Ctx, s: Sharding, shape: tuple[int, ...], group: list[int]) -> torch.Tensor:
    """The elements of dims ``group`` of a tensor of ``shape`` held by ``s``, flattened, in the order the devices
    store them (the load-balanced layout's head-tail order where a dim is in it: docs/concepts.md#the-load-balanced-layout)."""
    idx = torch.arange(math.prod(shape[d] for d in group)).view([shape[d] for d in group])
    for h in s.head_tail(ctx.group, shape):
        if h.dim in group:
            idx = dataclasses.replace(h, dim=group.index(h.dim)).to_storage(idx)
    return idx.reshape(-1)


RULES: dict[type[Op], Callable[[Ctx], RuleResult]] = {
    O.Linear: rule_linear,
    O.Embedding: rule_embedding,
    O.LayerNorm: rule_layer_norm,
    O.Detach: rule_detach,
    O.Dropout: rule_unary,
    O.Unary: rule_unary,
    O.Scalar: rule_scalar,
    O.Binary: rule_binary,
    O.Matmul: rule_matmul,
    O.Permute: rule_permute,
    O.Reshape: rule_reshape,
    O.ComplexView: rule_complex_view,
    O.Split: rule_split,
    O.Softmax: rule_softmax,
    O.Cast: rule_unary,
    O.Where: rule_where,
    O.Expand: rule_expand,
    O.Slice: rule_slice,
    O.Cat: rule_cat,
    O.Gather: rule_gather,
    O.Pad: rule_pad,
    O.Conv: rule_conv,
    O.Pool: rule_pool,
    O.Reduce: rule_reduce,
    O.Attention: rule_attention,
    O.TopK: rule_topk,
    O.Sort: rule_sort,
    O.Cumsum: rule_cumsum,
    O.IndexAdd: rule_index_add,
    O.Histc: rule_histc,
    O.FullLike: rule_full_like,
    O.Scatter: rule_scatter,
    O.Experts: rule_experts,
    O.CrossEntropy: rule_cross_entropy,
}


# The ops whose rules may also reduce or contract an uneven dim (docs/concepts.md#uneven-shards): on pieces whose
# padding is zero, each gives the real indices of its outputs exactly (linear and matmul contract a padded dim's
# zeros; embedding's and a vocabulary-parallel gather's rows, which no index reaches; a sum over it, a mean dividing
# by the whole count; a max or min over it, its padding ∓∞: padding_fill; a cross-entropy's padded rows ignored).
# Any op passes an uneven dim on unchanged (the same axis and size on an output: a batch or head dim); what else an
# op would do with one, its rule refuses (:func:`_check_uneven`), and the planner redistributes the input.
UNEVEN_OPS: frozenset[type[Op]] = frozenset(
    {
        O.Unary,
        O.Detach,
        O.Cast,
        O.Scalar,
        O.Binary,
        O.Where,
        O.Linear,
        O.Matmul,
        O.Embedding,
        O.Gather,
        O.LayerNorm,
        O.Softmax,
        O.Reduce,
        O.Permute,
        O.Expand,
        O.CrossEntropy,
    }
)
# The target a padded row of a loss holds (torch's ``ignore_index``): it adds nothing to a sum.
IGNORE_INDEX = -100


def padding_fill(op: Op, index: int, dim: int) -> float:
    """What the padding of dim ``dim`` of input ``index`` holds when ``op`` runs on a short block
    (docs/concepts.md#uneven-shards): what the op ignores there — a cross-entropy's targets the ignore index, a max's
    input −∞ and a min's +∞ over a reduced dim — else 0, which a sum or a product ignores."""
    if isinstance(op, O.CrossEntropy) and index == 1:
        return IGNORE_INDEX
    if isinstance(op, O.Reduce) and op.fn in ("amax", "amin") and dim in op.dims:
        return -math.inf if op.fn == "amax" else math.inf
    return 0


def rule_replicated(ctx: Ctx) -> RuleResult:
    """The rule of an op that has none of its own (the generic :class:`~shardflow.graph.ops.Aten` op): it runs on
    whole (replicated) inputs, its outputs replicated."""
    for i, s in enumerate(ctx.shardings):
        if s.used_axes:
            raise ctx.error(
                f"{ctx.op.kind} has no sharding rule, so it runs on replicated inputs only, but input "
                f"{ctx.names[i]!r} is {s}",
                f"redistribute {ctx.names[i]!r} to Replicate() first",
            )
    return RuleResult(tuple(ctx.output(((),) * t.ndim, k=k) for k, t in enumerate(ctx.out_types)), ctx.local())


def rule_for(op: Op) -> Callable[[Ctx], RuleResult]:
    """The sharding rule of ``op``: its entry in :data:`RULES`, else :func:`rule_replicated`."""
    return RULES.get(type(op), rule_replicated)


def propagate(
    op: Op,
    names: Sequence[str],
    types: Sequence[TensorType],
    shardings: Sequence[Sharding],
    group: SubMesh,
    node: str = "",
    scope: str = "",
) -> RuleResult:
    """Output shardings and the local kernel of ``op`` for inputs with ``shardings`` on ``group``.

    Raises RuleError (or DegreeError) naming the node, module, tensor, dim, axes and the parallel op to insert.
    """
    ctx = Ctx(op, node or op.kind, scope, tuple(names), tuple(types), tuple(shardings), group, op.infer(tuple(types)))
    res = rule_for(op)(ctx)
    _check_uneven(ctx, res)
    return res


def _check_uneven(ctx: Ctx, res: RuleResult) -> None:
    """Raise DegreeError where ``res`` holds uneven blocks (docs/concepts.md#uneven-shards) its op cannot: an output
    dim in uneven blocks that is not an input's uneven dim passed on (the same axis, the same size: a new layout);
    or, for an op outside :data:`UNEVEN_OPS`, an uneven input dim not passed on to an output (reduced, contracted,
    resized: the zeros of its padding would count) or any uneven input of a random op (its draws follow the whole
    tensor's positions)."""

    def uneven(shardings: Sequence[Sharding], types: Sequence[TensorType]) -> list[tuple[int, int, str, int]]:
        return [
            (k, d, s.dims[d][0], t.shape[d])
            for k, (s, t) in enumerate(zip(shardings, types))
            for d in s.uneven_dims(ctx.group, t.shape)
        ]

    ins, outs = uneven(ctx.shardings, ctx.types), uneven(res.outputs, ctx.out_types)
    held, passed = ({(axis, size) for *_, axis, size in xs} for xs in (ins, outs))
    made = [x for x in outs if (x[2], x[3]) not in held]
    refused = [x for x in ins if (x[2], x[3]) not in passed or ctx.op.random] if type(ctx.op) not in UNEVEN_OPS else []
    module = f"in module {ctx.scope!r}" if ctx.scope else ""
    for k, d, axis, size in made:  # the same error as where uneven blocks are not allowed at all
        shape = ctx.out_types[k].shape
        where = f"shape {list(shape)}, mesh axes {axis} of {ctx.group.mesh}"
        raise DegreeError(d, size, ctx.degree((axis,)), ctx.node, ctx.node if k == 0 else f"{ctx.node}.{k}", where).at(
            hint=module
        )
    for k, d, axis, size in refused:
        why = f"{ctx.op.kind} has no rule for uneven blocks along that dim (docs/concepts.md#uneven-shards)"
        raise DegreeError(d, size, ctx.degree((axis,)), ctx.node, ctx.names[k], why).at(hint=module)


def align_operands(types: Sequence[TensorType], shardings: Sequence[Sharding], group: SubMesh) -> list[Sharding]:
    """For an element-wise op: shard replicated operands like their sharded partners (a free local split).

    Returns the sharding each operand should have; where an operand's dim holds replicas on an axis that
    shards the matching dim of another operand, that axis is added to it (Replicate → Shard needs no
    communication). Everything else is left to the rule.
    """
    nd = max(t.ndim for t in types)
    out = list(shardings)
    for k in range(nd):
        members = [
            (i, t.ndim - nd + k) for i, t in enumerate(types) if t.ndim - nd + k >= 0 and t.shape[t.ndim - nd + k] > 1
        ]
        target = max((shardings[i].dims[d] for i, d in members), key=len, default=())
        for i, d in members:
            s = out[i]
            if s.dims[d] == target[: len(s.dims[d])] and not (set(target[len(s.dims[d]) :]) & s.used_axes):
                out[i] = s.replace_dim(d, target)
    return out
