"""Compute operators of the computation graph: attributes, shape inference and the torch kernel.

Every operator is a frozen dataclass of its attributes. Each one answers two questions:

* ``infer(inputs) -> outputs``: the output :class:`TensorType` s from the input ones (full, unparallel
  shapes), or an :class:`OpError` saying why the inputs do not fit;
* ``compute(*tensors) -> tuple[Tensor, ...]``: the forward math with torch. Backward is never written
  here: the reference interpreter and the executors differentiate ``compute`` with torch autograd /
  ``torch.func.vjp``. An op that draws random numbers (``random``, e.g. dropout) also takes ``at``, the
  :class:`~shardflow.graph.rng.DrawSite` of its piece: its draws are a pure function of (seed, step, node,
  global element index), so every strategy draws what one device draws.

Sharding rules (how parallel shapes propagate through an op) live in :mod:`shardflow.parallel.rules`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.nn.functional as F

from shardflow.graph.layout import HeadTail
from shardflow.graph.rng import DrawSite

Shape = tuple[int, ...]


class OpError(ValueError):
    """An operator was given inputs it cannot take (wrong rank, mismatched sizes, bad attribute)."""


@dataclass(frozen=True, slots=True)
class TensorType:
    """Full (unparallel) type of a tensor: ``shape`` in elements per dim and ``dtype`` as a torch name."""

    shape: Shape
    dtype: str = "float32"
    # the size in bytes, once asked (-1: not yet): every buffer's bytes are asked for again and again
    _nbytes: int = dataclasses.field(init=False, repr=False, compare=False, default=-1)

    def __reduce__(self):
        return TensorType, (self.shape, self.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        if self._nbytes < 0:
            object.__setattr__(self, "_nbytes", self.numel * torch_dtype(self.dtype).itemsize)
        return self._nbytes


@functools.lru_cache(maxsize=None)  # asked for every buffer's bytes: a few names, hundreds of thousands of times
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``, ``"int64"``, ...). Raises OpError for another name."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise OpError(f"unknown dtype {name!r}; use a torch dtype name such as 'float32' or 'int64'")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def differentiable(name: str) -> bool:
    """Whether a tensor of dtype ``name`` carries a gradient: floating point or complex (a rotary embedding written
    with ``view_as_complex``, as torchtitan's Llama 3, differentiates through complex values)."""
    dt = torch_dtype(name)
    return dt.is_floating_point or dt.is_complex


def row_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The order of ``t``'s leading dims (all but the last) in which they are laid out in memory, when ``t``
    permuted that way is contiguous (its rows [*lead, last] foldable into one matrix without a copy); None when no
    order is (a strided slice, an expanded view). A contiguous ``t`` gives ``(0, 1, ..., ndim - 2)``; a block of a
    ring all-gather's buffer stored with the gathered dim first, viewed with that dim back in place
    (:func:`~shardflow.runtime.comms.issue`), gives that dim first. Megatron-LM keeps activations [s, b, h] for
    the same reason: a matrix multiply folds the leading dims of whatever layout it is given."""
    order = tuple(sorted(range(t.ndim - 1), key=lambda d: -t.stride(d)))
    return order if t.permute(*order, t.ndim - 1).is_contiguous() else None


def by_rows(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], width: int) -> torch.Tensor:
    """``fn(x)`` for an ``fn`` that acts on the last dim of ``x`` alone (a linear, a product by a matrix) and gives
    rows of ``width`` elements. When they are no wider than ``x``'s, it runs on ``x``'s rows in the order they are
    stored (:func:`row_order`): no copy folds the leading dims of a permuted ``x``, and the result is laid out as
    ``x`` is. A wider result is computed on ``x`` copied to fold them, and is contiguous: an op after it that needs
    its rows in order (a reshape merging its leading dims: the logits before the loss) would otherwise copy the
    larger of the two."""
    order = None if x.is_contiguous() or width > x.shape[-1] else row_order(x)
    if order is None:
        return fn(x)
    return fn(x.permute(*order, -1)).permute(*inverse(order), -1)


def inverse(order: Sequence[int]) -> list[int]:
    """The permutation that undoes ``order`` (``t.permute(order).permute(inverse(order))`` is ``t``)."""
    out = [0] * len(order)
    for i, d in enumerate(order):
        out[d] = i
    return out


def _norm_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise OpError(f"{what}: dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def _index_fits(x: TensorType, idx: TensorType, dim: int, what: str) -> None:
    """Raise OpError unless ``idx`` indexes ``x`` along ``dim`` as gather and scatter take it: integers, as many dims,
    no larger than x on the others."""
    d = _norm_dim(dim, x.ndim, what)
    if (
        idx.ndim != x.ndim
        or not idx.dtype.startswith("int")
        or any(i > s for k, (i, s) in enumerate(zip(idx.shape, x.shape)) if k != d)
    ):
        raise OpError(f"{what}: index {list(idx.shape)} ({idx.dtype}) does not fit input {list(x.shape)} on dim {d}")


def _expect(n: int, ins: tuple[TensorType, ...], op: Op) -> None:
    if len(ins) != n:
        raise OpError(f"{op.kind} takes {n} inputs, got {len(ins)}")


def broadcast_shapes(a: Shape, b: Shape, what: str) -> Shape:
    """numpy/torch broadcasting of two shapes, aligned from the last dim."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            raise OpError(f"{what}: shapes {list(a)} and {list(b)} do not broadcast (dim -{i}: {x} vs {y})")
        out.append(max(x, y))
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Op:
    """Base of every compute operator."""

    kind: ClassVar[str] = "op"
    random: ClassVar[bool] = False  # compute draws random numbers: it takes the keyword ``at`` (a DrawSite)
    # Input 0's last dim is contracted with the other inputs (linear, matmul); its other dims carry over to the
    # output dims of the same index, so the op runs chunk by chunk along them (a ring all-gather fuses it).
    contracts_last_dim: ClassVar[bool] = False
    # compute returns new tensors only, never an input or a view of one (an executor may then overwrite an output
    # while the inputs live on: :func:`~shardflow.lower.buffer_reuse.shared_sends`); False where unsure
    fresh: ClassVar[bool] = False
    # likewise for its vjp: the input gradients are new tensors, never an output gradient or a view of one
    fresh_grads: ClassVar[bool] = False

    def infer(self, ins: tuple[TensorType, ...]) -> tuple[TensorType, ...]:
        raise NotImplementedError

    def compute(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def grad_outputs(
        self, ins: tuple[TensorType, ...], outs: tuple[TensorType, ...], need: tuple[bool, ...]
    ) -> tuple[bool, ...]:
        """Which of the outputs (types ``outs``) carry a gradient back when the inputs (types ``ins``) ``need`` marks
        need one: every floating-point or complex output as soon as one input does (the ops of this module are
        differentiable in every floating input: :mod:`shardflow.runtime.vjp` or autograd of their compute). Raises
        OpError where an output depends on a marked input through no derivative (:meth:`Aten.grad_outputs`)."""
        return tuple(any(need) and differentiable(t.dtype) for t in outs)

    def describe(self) -> str:
        """``kind(attr=value, ...)`` for listings; a :func:`quiet` attribute only when it is not its default."""
        attrs = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if not (f.metadata.get("quiet") and getattr(self, f.name) == f.default)
        )
        return f"{self.kind}({attrs})"


def quiet(default: Any) -> Any:
    """A dataclass field that listings show only when it differs from ``default``."""
    return dataclasses.field(default=default, metadata={"quiet": True})


@dataclass(frozen=True, slots=True)
class Linear(Op):
    """``y = x @ weight.T (+ bias)``. Inputs: x ``[*, in]``, weight ``[out, in]``, bias ``[out]``.

    ``transposed``: the weight is held ``[in, out]`` and ``y = x @ weight (+ bias)`` (ATen's ``addmm``, Hugging
    Face's ``Conv1D``).
    """

    kind: ClassVar[str] = "linear"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    contracts_last_dim: ClassVar[bool] = True
    bias: bool = True
    transposed: bool = quiet(False)

    @property
    def out_dim(self) -> int:
        """The weight dim that indexes output features."""
        return 1 if self.transposed else 0

    def infer(self, ins):
        _expect(3 if self.bias else 2, ins, self)
        x, w = ins[0], ins[1]
        layout = "[in, out]" if self.transposed else "[out, in]"
        if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1 - self.out_dim]:
            raise OpError(f"linear: input {list(x.shape)} does not match weight {layout} = {list(w.shape)}")
        out = w.shape[self.out_dim]
        if self.bias and ins[2].shape != (out,):
            raise OpError(f"linear: bias {list(ins[2].shape)} must be [{out}]")
        return (TensorType(x.shape[:-1] + (out,), _promote(x.dtype, w.dtype)),)

    def compute(self, x, w, b=None):
        w = w.t() if self.transposed else w
        return (by_rows(x, lambda rows: F.linear(rows, w, b), w.shape[0]),)


def in_block(idx: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``idx`` into a whole dim, read by a device that holds the block ``[start, start + size)`` of it: the
    indices into the block (clamped into it) and the mask of those the block holds. Vocabulary parallelism
    (Megatron-LM's ``VocabParallelEmbedding``, Shoeybi et al. 2019): a device looks up what its block holds and
    contributes zeros for the rest, so the devices' results sum to the whole lookup."""
    local = idx - start
    inside = (local >= 0) & (local < size)
    return local.clamp(0, size - 1), inside


@dataclass(frozen=True, slots=True)
class Embedding(Op):
    """Row lookup. Inputs: indices ``[*]`` (int64), weight ``[vocab, C]``. Output ``[*, C]``.

    ``start`` (vocabulary parallelism): None, the weight is the whole table; else the weight holds its rows
    ``[start, start + rows)`` and an index outside them looks up zeros (:func:`in_block`)."""

    kind: ClassVar[str] = "embedding"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    padding_idx: int = quiet(-1)  # ATen's spelling of "none": the row whose gradient stays zero
    start: int | None = quiet(None)

    def local_padding(self, rows: int) -> int:
        """The padding row as a row of the weight the op holds (``rows`` of them); -1 where it holds none."""
        p = self.padding_idx - (self.start or 0)
        return p if self.padding_idx >= 0 and 0 <= p < rows else -1

    def infer(self, ins):
        _expect(2, ins, self)
        idx, w = ins
        if w.ndim != 2:
            raise OpError(f"embedding: weight must be [vocab, C], got {list(w.shape)}")
        if not idx.dtype.startswith("int"):
            raise OpError(f"embedding: indices must be an integer tensor, got {idx.dtype}")
        return (TensorType(idx.shape + (w.shape[1],), w.dtype),)

    def compute(self, idx, w):
        pad = self.local_padding(w.shape[0])
        if self.start is None:
            return (F.embedding(idx, w, None if pad < 0 else pad),)
        local, inside = in_block(idx, self.start, w.shape[0])
        return (torch.where(inside.unsqueeze(-1), F.embedding(local, w, None if pad < 0 else pad), 0.0),)


@dataclass(frozen=True, slots=True)
class LayerNorm(Op):
    """Layer norm over the last ``ndim`` dims. Inputs: x, then weight and bias (shape of those dims)."""

    kind: ClassVar[str] = "layer_norm"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    ndim: int = 1
    eps: float = 1e-5
    affine: bool = True
    bias: bool = True

    def infer(self, ins):
        _expect(1 + self.affine + (self.affine and self.bias), ins, self)
        x = ins[0]
        norm = x.shape[-self.ndim :] if self.ndim else ()
        if x.ndim < self.ndim:
            raise OpError(f"layer_norm: input {list(x.shape)} has fewer than {self.ndim} dims")
        for p in ins[1:]:
            if p.shape != norm:
                raise OpError(f"layer_norm: parameter {list(p.shape)} must be {list(norm)}")
        return (x,)

    def compute(self, x, w=None, b=None):
        return (F.layer_norm(x, x.shape[x.ndim - self.ndim :], w, b, self.eps),)


class NoGradient(Op):
    """An op whose outputs carry no gradient, whatever its inputs need: they are constants of the inputs
    (``detach``, ``full_like``, ``histc``)."""

    def grad_outputs(self, ins, outs, need):
        return (False,) * len(outs)


@dataclass(frozen=True, slots=True)
class Detach(NoGradient):
    """``x.detach()``, and each output of a ``torch.no_grad()`` region: the same values, through which no gradient
    flows (the outputs carry none, whatever the input needs)."""

    kind: ClassVar[str] = "detach"

    def infer(self, ins):
        _expect(1, ins, self)
        return ins

    def compute(self, x):
        return (x.detach(),)


@dataclass(frozen=True, slots=True)
class Dropout(Op):
    """Zero elements with probability ``p`` and scale the rest by ``1/(1-p)``; identity when p == 0.

    Which elements drop is :meth:`DrawSite.keep <shardflow.graph.rng.DrawSite.keep>` of the piece's site: a pure
    function of (seed, step, node, global element index), the same on every device that holds the element and
    in every recomputation (a vjp that reruns the forward draws the same mask).
    """

    kind: ClassVar[str] = "dropout"
    random: ClassVar[bool] = True
    p: float = 0.0

    def infer(self, ins):
        _expect(1, ins, self)
        if not 0.0 <= self.p < 1.0:
            raise OpError(f"dropout: p must be in [0, 1), got {self.p}")
        return ins

    def compute(self, x, *, at: DrawSite | None = None):
        """``x``: this device's piece (any shape); ``at``: where the piece lies in the full tensor, and the key."""
        if self.p == 0:
            return (x,)
        if at is None:
            raise OpError(
                f"dropout(p={self.p}) draws its mask from (seed, step, node, element index): pass "
                f"at=DrawSite(...) for the piece it runs on"
            )
        scale = at.keep(tuple(x.shape), self.p, x.device).to(x.dtype).mul_(1.0 / (1.0 - self.p))  # 0 or 1/(1-p)
        return (x * scale,)


@functools.cache
def _result_dtype(fn: Callable, *operands: str | float | int | bool) -> str:
    """The dtype ``fn`` gives for operands given as dtype names (0-dim tensors) or Python numbers (scalars):
    PyTorch's own type promotion, run on the meta device."""
    xs = [torch.empty((), dtype=torch_dtype(o), device="meta") if isinstance(o, str) else o for o in operands]
    return dtype_name(fn(*xs).dtype)


def _promote(*dtypes: str) -> str:
    return dtype_name(functools.reduce(torch.promote_types, map(torch_dtype, dtypes)))


UNARY_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "tanh": torch.tanh,
    "neg": torch.neg,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "rsqrt": torch.rsqrt,
    "sqrt": torch.sqrt,
    "exp": torch.exp,
    "log": torch.log,
    "cos": torch.cos,
    "sin": torch.sin,
    "abs": torch.abs,
    "erf": torch.erf,
    "logical_not": torch.logical_not,
    "bitwise_not": torch.bitwise_not,
}
LINEAR_UNARY = frozenset({"neg"})
# Monotone functions commute with max and min: f(max(a, b)) = max(f(a), f(b)) for a non-decreasing f, and
# = min(f(a), f(b)) for a non-increasing one (DTensor's _NON_DECREASING_RULES and _NEG_RULES).
NON_DECREASING_UNARY = frozenset({"relu", "tanh", "sigmoid", "exp", "sqrt", "log", "erf"})
NON_INCREASING_UNARY = frozenset({"neg"})


@dataclass(frozen=True, slots=True)
class Unary(Op):
    """Element-wise function of one tensor: one of :data:`UNARY_FNS`."""

    kind: ClassVar[str] = "unary"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    fn: str = "relu"

    def infer(self, ins):
        _expect(1, ins, self)
        if self.fn not in UNARY_FNS:
            raise OpError(f"unary: unknown function {self.fn!r}; supported: {sorted(UNARY_FNS)}")
        return (TensorType(ins[0].shape, _result_dtype(UNARY_FNS[self.fn], ins[0].dtype)),)

    def compute(self, x):
        return (UNARY_FNS[self.fn](x),)

    def describe(self) -> str:
        return self.fn


BINARY_FNS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "pow": torch.pow,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "eq": torch.eq,
    "ne": torch.ne,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or,
}
ADDITIVE = frozenset({"add", "sub", "rsub"})  # f(a + a', b) = f(a, b) + f(a', 0): partial sums pass, scaled
MULTIPLICATIVE = frozenset({"mul", "div"})  # linear in the first operand (and in the second for mul)


@dataclass(frozen=True, slots=True)
class Binary(Op):
    """Element-wise ``a (fn) b`` of two tensors with broadcasting; ``fn`` one of :data:`BINARY_FNS`. The result
    dtype is PyTorch's promotion of the two (bool for comparisons)."""

    kind: ClassVar[str] = "binary"
    fresh: ClassVar[bool] = True
    fn: str = "add"

    def infer(self, ins):
        _expect(2, ins, self)
        if self.fn not in BINARY_FNS:
            raise OpError(f"binary: unknown function {self.fn!r}; supported: {sorted(BINARY_FNS)}")
        dtype = _result_dtype(BINARY_FNS[self.fn], ins[0].dtype, ins[1].dtype)
        return (TensorType(broadcast_shapes(ins[0].shape, ins[1].shape, self.fn), dtype),)

    def compute(self, a, b):
        return (BINARY_FNS[self.fn](a, b),)

    def describe(self) -> str:
        return self.fn


SCALAR_FNS: dict[str, Callable] = {
    "add": lambda x, s: x + s,
    "sub": lambda x, s: x - s,
    "rsub": lambda x, s: s - x,
    "mul": lambda x, s: x * s,
    "div": lambda x, s: x / s,
    "rdiv": lambda x, s: s / x,
    "pow": torch.pow,
    "eq": torch.eq,
    "ne": torch.ne,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
}


@dataclass(frozen=True, slots=True)
class Scalar(Op):
    """Element-wise op of a tensor and a Python number (``x+s, x-s, s-x, x*s, x/s, s/x, x**s``, comparisons);
    the number keeps its Python type, so PyTorch's promotion (``int_tensor * 2`` stays int) holds."""

    kind: ClassVar[str] = "scalar"
    fresh: ClassVar[bool] = True
    fn: str = "mul"
    value: float | int | bool = 1.0

    def infer(self, ins):
        _expect(1, ins, self)
        if self.fn not in SCALAR_FNS:
            raise OpError(f"scalar: unknown function {self.fn!r}; supported: {sorted(SCALAR_FNS)}")
        return (TensorType(ins[0].shape, _result_dtype(SCALAR_FNS[self.fn], ins[0].dtype, self.value)),)

    def compute(self, x):
        return (SCALAR_FNS[self.fn](x, self.value),)

    def describe(self) -> str:
        return f"{self.fn}({self.value:g})"


@dataclass(frozen=True, slots=True)
class Where(Op):
    """``torch.where(cond, a, b)`` with broadcasting of all three. Inputs: cond (bool), a, b. ``zero``: which of a (1)
    or b (2) is zero everywhere, known at capture (a masked loss's ``where(mask, x, 0)``): the op is then linear in
    the other (:func:`~shardflow.parallel.rules.rule_where`); None: neither is known to be."""

    kind: ClassVar[str] = "where"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    zero: int | None = None

    def infer(self, ins):
        _expect(3, ins, self)
        c, a, b = ins
        if c.dtype != "bool":
            raise OpError(f"where: the condition must be bool, got {c.dtype}")
        shape = broadcast_shapes(broadcast_shapes(c.shape, a.shape, "where"), b.shape, "where")
        return (TensorType(shape, _promote(a.dtype, b.dtype)),)

    def compute(self, c, a, b):
        return (torch.where(c, a, b),)


@dataclass(frozen=True, slots=True)
class Cast(Op):
    """Convert to ``dtype`` (a torch dtype name): ATen's ``_to_copy(dtype=...)``."""

    kind: ClassVar[str] = "cast"
    dtype: str = "float32"

    def infer(self, ins):
        _expect(1, ins, self)
        torch_dtype(self.dtype)
        return (TensorType(ins[0].shape, self.dtype),)

    def compute(self, x):
        return (x.to(torch_dtype(self.dtype)),)

    def describe(self) -> str:
        return f"cast({self.dtype})"


@dataclass(frozen=True, slots=True)
class Matmul(Op):
    """Batched matrix product ``[*, n, k] @ [*, k, m] -> [*, n, m]`` (torch.matmul / bmm, both ≥ 2-D)."""

    kind: ClassVar[str] = "matmul"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    contracts_last_dim: ClassVar[bool] = True

    def infer(self, ins):
        _expect(2, ins, self)
        a, b = ins
        if a.ndim < 2 or b.ndim < 2:
            raise OpError(f"matmul: both operands need ≥ 2 dims, got {list(a.shape)} and {list(b.shape)}")
        if a.shape[-1] != b.shape[-2]:
            raise OpError(f"matmul: inner sizes differ: {list(a.shape)} @ {list(b.shape)}")
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], "matmul batch dims")
        return (TensorType(batch + (a.shape[-2], b.shape[-1]), _promote(a.dtype, b.dtype)),)

    def compute(self, a, b):
        return (by_rows(a, lambda rows: torch.matmul(rows, b), b.shape[1]) if b.ndim == 2 else torch.matmul(a, b),)


@dataclass(frozen=True, slots=True)
class Permute(Op):
    """Reorder dims: output dim i is input dim ``dims[i]`` (transpose is a permute)."""

    kind: ClassVar[str] = "permute"
    dims: tuple[int, ...] = ()

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        if sorted(self.dims) != list(range(x.ndim)):
            raise OpError(f"permute: {list(self.dims)} is not a permutation of the {x.ndim} dims")
        return (TensorType(tuple(x.shape[d] for d in self.dims), x.dtype),)

    def compute(self, x):
        return (x.permute(self.dims),)


@dataclass(frozen=True, slots=True)
class Reshape(Op):
    """View/reshape to ``shape`` (fully resolved: no -1). Also squeeze, unsqueeze and flatten."""

    kind: ClassVar[str] = "reshape"
    shape: Shape = ()

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        if math.prod(self.shape) != x.numel:
            raise OpError(f"reshape: cannot view {list(x.shape)} as {list(self.shape)}")
        return (TensorType(self.shape, x.dtype),)

    def compute(self, x):
        return (x.reshape(self.shape),)


@dataclass(frozen=True, slots=True)
class ComplexView(Op):
    """``view_as_complex`` (``to_complex``): real ``[*, n, 2]`` (float32, float64) → complex ``[*, n]`` (complex64,
    complex128), each pair (real, imaginary) one number; or ``view_as_real``, the inverse. Rotary embeddings
    written with complex numbers (torchtitan's Llama 3) go through both; every dim but the pair's carries over."""

    kind: ClassVar[str] = "complex_view"
    to_complex: bool = True

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        dt = torch_dtype(x.dtype)
        if self.to_complex:
            if not dt.is_floating_point or x.ndim == 0 or x.shape[-1] != 2:
                raise OpError(f"view_as_complex: {x.dtype}{list(x.shape)} must be float [*, n, 2]")
            return (TensorType(x.shape[:-1], dtype_name(dt.to_complex())),)
        if not dt.is_complex:
            raise OpError(f"view_as_real: {x.dtype}{list(x.shape)} is not complex")
        return (TensorType(x.shape + (2,), dtype_name(dt.to_real())),)

    def compute(self, x):
        if self.to_complex:  # a piece cut from its tensor may have strides view_as_complex refuses
            return (torch.view_as_complex(x.contiguous()),)
        return (torch.view_as_real(x),)


@dataclass(frozen=True, slots=True)
class Expand(Op):
    """Broadcast size-1 dims (and new leading dims) to ``shape`` without copying (``Tensor.expand``)."""

    kind: ClassVar[str] = "expand"
    shape: Shape = ()

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        lead = len(self.shape) - x.ndim
        if lead < 0 or any(s not in (1, t) for s, t in zip(x.shape, self.shape[lead:])):
            raise OpError(f"expand: cannot expand {list(x.shape)} to {list(self.shape)}")
        return (TensorType(self.shape, x.dtype),)

    def compute(self, x):
        return (x.expand(self.shape),)


@dataclass(frozen=True, slots=True)
class Slice(Op):
    """``x[..., start:end:step, ...]`` along ``dim`` (normalised: ``0 <= start <= end <= size``, ``step >= 1``)."""

    kind: ClassVar[str] = "slice"
    dim: int = 0
    start: int = 0
    end: int = 0
    step: int = 1

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        d = _norm_dim(self.dim, x.ndim, "slice")
        if not (0 <= self.start <= self.end <= x.shape[d]) or self.step < 1:
            raise OpError(f"slice: [{self.start}:{self.end}:{self.step}] does not lie in dim {d} of {list(x.shape)}")
        n = -(-(self.end - self.start) // self.step)
        return (TensorType(x.shape[:d] + (n,) + x.shape[d + 1 :], x.dtype),)

    def compute(self, x):
        return (torch.ops.aten.slice.Tensor(x, self.dim, self.start, self.end, self.step),)


@dataclass(frozen=True, slots=True)
class Split(Op):
    """Split along ``dim`` into pieces of ``sizes`` (torch.split / chunk); one output per piece."""

    kind: ClassVar[str] = "split"
    sizes: tuple[int, ...] = ()
    dim: int = 0

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        d = _norm_dim(self.dim, x.ndim, "split")
        if sum(self.sizes) != x.shape[d]:
            raise OpError(f"split: sizes {list(self.sizes)} do not add up to dim {d} of {list(x.shape)}")
        return tuple(TensorType(x.shape[:d] + (s,) + x.shape[d + 1 :], x.dtype) for s in self.sizes)

    def compute(self, x):
        return tuple(torch.split(x, list(self.sizes), dim=self.dim))


@dataclass(frozen=True, slots=True)
class Cat(Op):
    """Concatenate the inputs along ``dim`` (all other sizes equal)."""

    kind: ClassVar[str] = "cat"
    dim: int = 0

    def infer(self, ins):
        if not ins:
            raise OpError("cat takes at least one input")
        d = _norm_dim(self.dim, ins[0].ndim, "cat")
        for t in ins:
            if t.ndim != ins[0].ndim or t.shape[:d] + t.shape[d + 1 :] != ins[0].shape[:d] + ins[0].shape[d + 1 :]:
                raise OpError(f"cat: {[list(t.shape) for t in ins]} differ outside dim {d}")
        size = sum(t.shape[d] for t in ins)
        return (TensorType(ins[0].shape[:d] + (size,) + ins[0].shape[d + 1 :], _promote(*(t.dtype for t in ins))),)

    def compute(self, *xs):
        return (torch.cat(xs, self.dim),)


@dataclass(frozen=True, slots=True)
class Gather(Op):
    """``torch.gather(x, dim, index)``: inputs x and index (int64, same number of dims); output like index.

    ``start`` (vocabulary parallelism): None, x holds the whole of ``dim``; else x holds its block
    ``[start, start + x.shape[dim])`` and an index outside it picks 0 (:func:`in_block`)."""

    kind: ClassVar[str] = "gather"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    dim: int = 0
    start: int | None = quiet(None)

    def infer(self, ins):
        _expect(2, ins, self)
        x, idx = ins
        _index_fits(x, idx, self.dim, "gather")
        return (TensorType(idx.shape, x.dtype),)

    def compute(self, x, idx):
        if self.start is None:
            return (torch.gather(x, self.dim, idx),)
        local, inside = in_block(idx, self.start, x.shape[self.dim])
        return (torch.where(inside, torch.gather(x, self.dim, local), 0.0),)


@dataclass(frozen=True, slots=True)
class Pad(Op):
    """Constant padding (``F.pad`` / ATen ``constant_pad_nd``): ``pad`` = (before, after) pairs from the last dim."""

    kind: ClassVar[str] = "pad"
    pad: tuple[int, ...] = ()
    value: float | int | bool = 0

    @property
    def padded_dims(self) -> dict[int, tuple[int, int]]:
        """Dim index from the end (1 = last) → (before, after)."""
        return {k // 2 + 1: (self.pad[k], self.pad[k + 1]) for k in range(0, len(self.pad), 2)}

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        if len(self.pad) % 2 or len(self.pad) // 2 > x.ndim:
            raise OpError(f"pad: {list(self.pad)} must be (before, after) pairs for at most {x.ndim} dims")
        shape = list(x.shape)
        for k, (lo, hi) in self.padded_dims.items():
            shape[-k] += lo + hi
            if shape[-k] < 0:
                raise OpError(f"pad: {list(self.pad)} leaves dim -{k} of {list(x.shape)} negative")
        return (TensorType(tuple(shape), x.dtype),)

    def compute(self, x):
        return (F.pad(x, list(self.pad), value=self.value),)


@dataclass(frozen=True, slots=True)
class Softmax(Op):
    """Softmax (``log``: log-softmax) along ``dim``."""

    kind: ClassVar[str] = "softmax"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    dim: int = -1
    log: bool = False

    def infer(self, ins):
        _expect(1, ins, self)
        _norm_dim(self.dim, ins[0].ndim, "softmax")
        return ins

    def compute(self, x):
        return ((torch.log_softmax if self.log else torch.softmax)(x, self.dim),)

    def describe(self) -> str:
        return f"{'log_' if self.log else ''}softmax(dim={self.dim})"


REDUCE_FNS = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin}


@dataclass(frozen=True, slots=True)
class Reduce(Op):
    """``sum``, ``mean``, ``amax`` or ``amin`` over ``dims`` (normalised, non-negative), optionally keeping them
    as size 1. A sum of integers or bools is int64, as in PyTorch."""

    kind: ClassVar[str] = "reduce"
    fresh: ClassVar[bool] = True
    fn: str = "sum"
    dims: tuple[int, ...] = ()
    keepdim: bool = False

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        if self.fn not in REDUCE_FNS:
            raise OpError(f"reduce: fn must be one of {sorted(REDUCE_FNS)}, got {self.fn!r}")
        dims = {_norm_dim(d, x.ndim, "reduce") for d in self.dims}
        shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape) if self.keepdim or i not in dims)
        integral = not torch_dtype(x.dtype).is_floating_point and not torch_dtype(x.dtype).is_complex
        return (TensorType(shape, "int64" if self.fn == "sum" and integral else x.dtype),)

    def compute(self, x):
        return (REDUCE_FNS[self.fn](x, dim=self.dims, keepdim=self.keepdim),)

    def describe(self) -> str:
        return f"{self.fn}(dims={list(self.dims)}{', keepdim' if self.keepdim else ''})"


@dataclass(frozen=True, slots=True)
class Attention(Op):
    """Scaled dot-product attention (``F.scaled_dot_product_attention``). Inputs q ``[*, H, T, D]``, k ``[*, Hkv, S, D]``,
    v ``[*, Hkv, S, Dv]`` and, with ``mask``, a mask broadcastable to ``[*, H, T, S]`` (bool: True = attend;
    float: added to the scores). Output ``[*, H, T, Dv]``.

    ``scale`` defaults to ``1/sqrt(D)``; ``causal`` masks the upper triangle (torch's ``is_causal``); ``gqa``:
    grouped-query attention, ``H`` a multiple of ``Hkv`` (query head h reads key/value head ``h // (H/Hkv)``).
    ``start`` (context parallelism): None, the queries are the whole sequence; else they are its block from
    position ``start`` on, against every key, so under ``causal`` query i attends the keys ``j ≤ start + i``.

    ``keys_from`` (the ring form of context parallelism, docs/concepts.md#the-log-sum-exp-combine): the keys and
    values are one block of the sequence, from position ``keys_from`` on (a mask's last dim that block's too), and
    the op returns the block's output and its log-sum-exp ``lse [*, H, T]`` (the log of each row's softmax
    denominator; −inf, with a zero output row, where the block holds no key the row attends). Only lowering makes
    it, for the blocks a ring passes around; :func:`lse_merge` combines the blocks' results.

    ``layout`` (the load-balanced layout, docs/concepts.md#the-load-balanced-layout): the sequence is stored in
    head-tail order, ``start`` and ``keys_from`` index that order, and the positions the causal mask compares are
    those the indices hold; each run of consecutive positions is attended as above and the runs joined (the query
    runs side by side, the key runs merged by :func:`lse_merge`).
    """

    kind: ClassVar[str] = "attention"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    causal: bool = True
    scale: float | None = None
    mask: bool = quiet(False)
    gqa: bool = quiet(False)
    start: int | None = quiet(None)
    keys_from: int | None = quiet(None)
    layout: HeadTail | None = quiet(None)

    def infer(self, ins):
        _expect(4 if self.mask else 3, ins, self)
        q, k, v = ins[:3]
        ok = (
            q.ndim >= 3
            and k.ndim == q.ndim == v.ndim
            and k.shape[:-1] == v.shape[:-1]
            and q.shape[:-3] == k.shape[:-3]
            and q.shape[-1] == k.shape[-1]
            and (q.shape[-3] % k.shape[-3] == 0 if self.gqa else q.shape[-3] == k.shape[-3])
        )
        if not ok:
            raise OpError(
                f"attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be [*, H, T, D], "
                f"[*, Hkv, S, D], [*, Hkv, S, Dv] with Hkv {'dividing' if self.gqa else 'equal to'} H"
            )
        out = q.shape[:-1] + (v.shape[-1],)
        if self.mask:
            broadcast_shapes(ins[3].shape, out[:-1] + (k.shape[-2],), "attention mask")
        if self.keys_from is not None:
            return TensorType(out, q.dtype), TensorType(out[:-1], q.dtype)
        return (TensorType(out, q.dtype),)

    def runs(self, start: int, size: int) -> list[tuple[int, int, int]]:
        """Indices ``start … start+size−1`` of the sequence as runs of consecutive positions (offset, first
        position, length): one run without a :attr:`layout`."""
        return self.layout.runs(start, size) if self.layout else [(0, start, size)]

    def compute(self, q, k, v, mask=None):
        if self.layout is not None:
            return self._by_runs(q, k, v, mask)
        if self.keys_from is not None:
            return self._key_block(q, k, v, mask)
        causal = self.causal
        if causal and self.start is not None and mask is None and q.device.type == "cpu":
            return (_QueryBlock.apply(self, q, k, v)[0],)
        if causal and self.start is not None:  # the query block's rows of the causal mask
            t, s = q.shape[-2], k.shape[-2]
            rows = torch.arange(self.start, self.start + t, device=q.device)
            block = torch.arange(s, device=q.device) <= rows[:, None]
            if mask is None:
                mask = block
            elif mask.dtype == torch.bool:
                mask = mask & block
            else:
                mask = mask.masked_fill(~block, float("-inf"))
            causal = False
        return (
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.gqa
            ),
        )

    def key_block_path(self, q, k, mask) -> str:
        """How :meth:`compute` attends one key block (:attr:`keys_from`) of ``k`` from queries ``q``: ``"masked"``
        where the causal mask hides every key from every query (a zero output, lse −inf, nothing computed);
        ``"flash"`` on CPU without a mask, for 4-d ``[B, H, T, D]`` inputs, where the causal mask hides nothing (every key before every query) or is
        the block's own diagonal (the same positions) — torch's fused CPU flash-attention kernel, which returns the
        log-sum-exp, and its backward, which takes the merged output and lse (as PyTorch's ``context_parallel`` calls
        it per block); ``"math"`` otherwise (the scores written out)."""
        t, s, first = q.shape[-2], k.shape[-2], self.start or 0
        if self.causal and self.keys_from > first + t - 1:
            return "masked"
        aligned = not self.causal or self.keys_from + s - 1 <= first or (self.keys_from == first and s == t)
        fused = mask is None and q.device.type == "cpu" and q.ndim == 4  # the kernel takes [B, H, T, D] only
        return "flash" if fused and aligned else "math"

    def _by_runs(self, q, k, v, mask):
        """:meth:`compute` under a :attr:`layout`: each run of consecutive query positions attends on its own (the
        outputs, and lse, joined in storage order); against a key block (:attr:`keys_from`), each of its runs of
        consecutive positions is one block, merged by :func:`lse_merge`. A mask's last dim is the whole sequence in
        natural order (its columns taken by position)."""
        outs = []
        for qo, qpos, n in self.runs(self.start or 0, q.shape[-2]):
            qr = q[..., qo : qo + n, :]
            rows = mask if mask is None or mask.shape[-2] == 1 else mask[..., qo : qo + n, :]
            if self.keys_from is None:
                outs.append(dataclasses.replace(self, layout=None, start=qpos).compute(qr, k, v, rows))
                continue
            res = None
            for ko, kpos, m in self.runs(self.keys_from, k.shape[-2]):
                block = dataclasses.replace(self, layout=None, start=qpos, keys_from=kpos)
                cols = rows if rows is None or rows.shape[-1] == 1 else rows[..., kpos : kpos + m]
                part = block.compute(qr, k[..., ko : ko + m, :], v[..., ko : ko + m, :], cols)
                res = part if res is None else lse_merge(*res, *part)
            outs.append(res)
        out = torch.cat([o[0] for o in outs], dim=-2)
        return (out,) if self.keys_from is None else (out, torch.cat([o[1] for o in outs], dim=-1))

    def heads(self, q, k, v):
        """k and v with each key/value head repeated over its group of query heads (grouped-query attention)."""
        if self.gqa and k.shape[-3] != q.shape[-3]:
            return tuple(x.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for x in (k, v))
        return k, v

    def _key_block(self, q, k, v, mask):
        """(output, lse) of the queries against one block of keys and values (:attr:`keys_from`): the scores
        masked as :meth:`compute` masks them — the causal rows at the query block's positions, the key columns at
        the key block's —, each row's log-sum-exp, and the softmax over the block times v (by
        :meth:`key_block_path`)."""
        path = self.key_block_path(q, k, mask)
        if path == "masked":
            lse = q.new_full(q.shape[:-1], float("-inf"))
            return q.new_zeros(q.shape[:-1] + (v.shape[-1],)), lse
        if path == "flash":
            k, v = self.heads(q, k, v)
            causal = self.causal and self.keys_from + k.shape[-2] - 1 > (self.start or 0)  # the diagonal block
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, scale=self.scale
            )[:2]
            return out, lse
        k, v = self.heads(q, k, v)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-2, -1)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if self.causal:
            t, s = q.shape[-2], k.shape[-2]
            rows = torch.arange(self.start or 0, (self.start or 0) + t, device=q.device)
            cols = torch.arange(self.keys_from, self.keys_from + s, device=q.device)
            scores = scores.masked_fill(cols > rows[:, None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
        return weights @ v, lse


def _key_parts(start: int, t: int) -> list[tuple[int, int]]:
    """The key ranges a causal query block of ``t`` queries from position ``start`` attends, each by one kernel
    call: its own diagonal, then the keys before it in pieces of ``2t``. So under the load-balanced layout every
    rank makes as many calls and merges (docs/concepts.md#the-load-balanced-layout): its chunks r and 2·cp − 1 − r
    have r and 2·cp − 1 − r chunks before them, one count even and the other odd, ⌈r/2⌉ + ⌈(2·cp − 1 − r)/2⌉ = cp
    pieces in all (one piece for all the keys before would make rank 0, whose first chunk has none, one call
    short: 7 % faster than the others at cp = 2)."""
    return [(start, start + t)] + [(a, min(a + 2 * t, start)) for a in range(0, start, 2 * t)]


class _QueryBlock(torch.autograd.Function):
    """A causal attention of one block of queries (``op.start``) against the whole key sequence, without a mask
    written out: the block's own diagonal and the keys before it (none masked; :func:`_key_parts`), each by torch's
    fused CPU flash-attention kernel (:meth:`Attention.key_block_path`), merged by :func:`lse_merge`; the keys after
    it are hidden from every query and not read. The backward is :func:`key_block_vjp` of each part, from the
    merged output and lse. Returns (output, lse); the lse carries no gradient."""

    @staticmethod
    def forward(op, q, k, v):
        res = None
        for a, b in _key_parts(op.start, q.shape[-2]):
            part = dataclasses.replace(op, keys_from=a).compute(q, k[..., a:b, :], v[..., a:b, :])
            res = part if res is None else lse_merge(*res, *part)
        assert res is not None
        return res

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, q, k, v = inputs
        ctx.op = op
        ctx.save_for_backward(q, k, v, *output)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dout, _dlse):
        op, (q, k, v, out, lse) = ctx.op, ctx.saved_tensors
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dq = None
        for a, b in _key_parts(op.start, q.shape[-2]):
            block = dataclasses.replace(op, keys_from=a)
            gq, dk[..., a:b, :], dv[..., a:b, :] = key_block_vjp(
                block, q, k[..., a:b, :], v[..., a:b, :], None, out, lse, dout
            )
            dq = gq if dq is None else dq + gq
        return None, dq, dk, dv


def lse_merge(o_a, lse_a, o_b, lse_b):
    """Two partial attention results over disjoint key blocks merged into the result over both: each output
    ``[*, H, T, Dv]`` weighted by its share of the softmax denominator, ``exp(lse_x − lse)``, with
    ``lse = log(exp(lse_a) + exp(lse_b))`` ``[*, H, T]`` (Milakov & Gimelshein 2018, "Online normalizer calculation
    for softmax"; the merge of Ring Attention, Liu et al. 2023, and of PyTorch's ``context_parallel``). Rows where
    both are −inf (no key attended yet) stay a zero output with lse −inf. Returns (output, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0)
    return torch.exp(lse_a - safe).unsqueeze(-1) * o_a + torch.exp(lse_b - safe).unsqueeze(-1) * o_b, lse


def key_block_vjp(block: Attention, q, k, v, mask, out, lse, dout):
    """The backward of one key block of an attention whose blocks were merged by :func:`lse_merge`: the gradients
    of q, of the block's k and of its v (``[*, H, T, D]``, ``[*, Hkv, S_block, D]``, ``[*, Hkv, S_block, Dv]``)
    given the merged output ``out``, its ``lse`` and the output gradient ``dout``. The merge's backward, defined
    once here: with the block's share ``w = exp(lse_block − lse)``, ``out = Σ w·out_block`` gives the block's
    output the gradient ``w·dout`` and its lse ``w·Σ_Dv dout·(out_block − out)``; the block's own backward (the
    vjp of ``block``, recomputed) takes it from there. On the fused path (:meth:`Attention.key_block_path`) torch's
    CPU flash-attention backward computes the same from the merged output and lse directly. Under a
    :attr:`~Attention.layout` each pair of a query run and a key run is such a block (the mask whole, its columns
    taken by position, as :meth:`Attention.compute` reads it)."""
    if block.layout is not None:  # each pair of runs of consecutive positions, a block of its own
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qo, qpos, n in block.runs(block.start or 0, q.shape[-2]):
            rows = mask if mask is None or mask.shape[-2] == 1 else mask[..., qo : qo + n, :]
            sel = (out[..., qo : qo + n, :], lse[..., qo : qo + n], dout[..., qo : qo + n, :])
            for ko, kpos, m in block.runs(block.keys_from or 0, k.shape[-2]):
                run = dataclasses.replace(block, layout=None, start=qpos, keys_from=kpos)
                cols = rows if rows is None or rows.shape[-1] == 1 else rows[..., kpos : kpos + m]
                kv = (k[..., ko : ko + m, :], v[..., ko : ko + m, :])
                gq, gk, gv = key_block_vjp(run, q[..., qo : qo + n, :], *kv, cols, *sel)
                dq[..., qo : qo + n, :] += gq
                dk[..., ko : ko + m, :] += gk
                dv[..., ko : ko + m, :] += gv
        return dq, dk, dv
    path = block.key_block_path(q, k, mask)
    if path == "masked":
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if path == "flash":
        kr, vr = block.heads(q, k, v)
        causal = block.causal and block.keys_from + k.shape[-2] - 1 > (block.start or 0)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, kr, vr, out.contiguous(), lse.contiguous(), 0.0, causal, scale=block.scale
        )
        if kr is not k:  # each key/value head's gradient: the sum over its group of query heads
            g = q.shape[-3] // k.shape[-3]
            dk, dv = (x.unflatten(-3, (k.shape[-3], g)).sum(-3) for x in (dk, dv))
        return dq, dk, dv
    (o_b, lse_b), vjp = torch.func.vjp(lambda q, k, v: block.compute(q, k, v, mask), q, k, v)  # type: ignore[misc]
    w = torch.exp(lse_b - lse)
    return vjp((w.unsqueeze(-1) * dout, w * (dout * (o_b - out)).sum(-1)))


@dataclass(frozen=True, slots=True)
class Conv(Op):
    """N-d convolution (ATen ``convolution``, not transposed). Inputs x ``[N, C, *spatial]``, weight
    ``[O, C/groups, *kernel]``, bias ``[O]``. Output ``[N, O, *spatial']``."""

    kind: ClassVar[str] = "conv"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    stride: tuple[int, ...] = (1, 1)
    padding: tuple[int, ...] = (0, 0)
    dilation: tuple[int, ...] = (1, 1)
    groups: int = 1
    bias: bool = True

    def _run(self, x, w, b=None):
        return torch.ops.aten.convolution(
            x,
            w,
            b,
            list(self.stride),
            list(self.padding),
            list(self.dilation),
            False,
            [0] * len(self.stride),
            self.groups,
        )

    def infer(self, ins):
        _expect(3 if self.bias else 2, ins, self)
        meta = [torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in ins]
        try:
            y = self._run(*meta)
        except RuntimeError as e:
            raise OpError(
                f"conv: inputs {[list(t.shape) for t in ins]} do not fit {self.describe()}: {str(e).splitlines()[0]}"
            ) from None
        return (TensorType(tuple(y.shape), dtype_name(y.dtype)),)

    def compute(self, x, w, b=None):
        return (self._run(x, w, b),)


POOL_FNS = ("max", "avg")


@dataclass(frozen=True, slots=True)
class Pool(Op):
    """Max or average pooling over the last ``len(kernel)`` dims (1 to 3): ATen's ``max_pool{n}d_with_indices``
    (the values; the indices are the backward's business) and ``avg_pool{n}d``. Input ``[*, *spatial]``, output
    ``[*, *spatial']``; every leading dim (batch, channels) is pooled independently.

    ``dilation`` applies to max pooling only; ``count_include_pad`` and ``divisor`` (ATen's ``divisor_override``,
    0 for none) to average pooling only.
    """

    kind: ClassVar[str] = "pool"
    fn: str = "max"
    kernel: tuple[int, ...] = (2, 2)
    stride: tuple[int, ...] = (2, 2)
    padding: tuple[int, ...] = (0, 0)
    dilation: tuple[int, ...] = quiet((1, 1))
    ceil_mode: bool = quiet(False)
    count_include_pad: bool = quiet(True)
    divisor: int = quiet(0)

    def _run(self, x):
        n = len(self.kernel)
        if self.fn == "max":
            return getattr(F, f"max_pool{n}d")(x, self.kernel, self.stride, self.padding, self.dilation, self.ceil_mode)
        return getattr(F, f"avg_pool{n}d")(
            x, self.kernel, self.stride, self.padding, self.ceil_mode, self.count_include_pad, self.divisor or None
        )

    def infer(self, ins):
        _expect(1, ins, self)
        if self.fn not in POOL_FNS or not 1 <= len(self.kernel) <= 3:
            raise OpError(
                f"pool: fn must be one of {POOL_FNS} over 1 to 3 dims, got {self.fn!r} over {len(self.kernel)}"
            )
        try:
            y = self._run(torch.empty(ins[0].shape, dtype=torch_dtype(ins[0].dtype), device="meta"))
        except RuntimeError as e:
            raise OpError(
                f"pool: input {list(ins[0].shape)} does not fit {self.describe()}: {str(e).splitlines()[0]}"
            ) from None
        return (TensorType(tuple(y.shape), ins[0].dtype),)

    def compute(self, x):
        return (self._run(x),)


@dataclass(frozen=True, slots=True)
class TopK(Op):
    """``torch.topk(x, k, dim)``: the ``k`` largest (``largest=False``: smallest) entries along ``dim`` and their
    indices. Input x ``[*]``; outputs values (x's dtype) and indices (int64), both x's shape with ``dim`` cut to
    ``k``. A mixture of experts' router picks each token's experts so (``[tokens, experts] → [tokens, k]``)."""

    kind: ClassVar[str] = "topk"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    k: int = 1
    dim: int = -1
    largest: bool = True
    sorted: bool = True

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        d = _norm_dim(self.dim, x.ndim, "topk")
        if not 0 <= self.k <= x.shape[d]:
            raise OpError(f"topk: k={self.k} is out of range for dim {d} of size {x.shape[d]}")
        shape = x.shape[:d] + (self.k,) + x.shape[d + 1 :]
        return (TensorType(shape, x.dtype), TensorType(shape, "int64"))

    def compute(self, x):
        values, indices = torch.topk(x, self.k, self.dim, self.largest, self.sorted)
        return (values, indices)

    def describe(self) -> str:
        return f"topk(k={self.k}, dim={self.dim})"


@dataclass(frozen=True, slots=True)
class Sort(Op):
    """``torch.sort(x, dim, descending, stable)``: x's entries along ``dim`` in order and their indices. Input x
    ``[*]``; outputs values (x's dtype) and indices (int64), both x's shape. A mixture of experts' dispatcher sorts
    its token-expert pairs by expert so (``[tokens · k]``)."""

    kind: ClassVar[str] = "sort"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    dim: int = -1
    descending: bool = False
    stable: bool = False

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        _norm_dim(self.dim, x.ndim, "sort")
        return (x, TensorType(x.shape, "int64"))

    def compute(self, x):
        values, indices = torch.sort(x, dim=self.dim, descending=self.descending, stable=self.stable)
        return (values, indices)


@dataclass(frozen=True, slots=True)
class Cumsum(Op):
    """``torch.cumsum(x, dim, dtype)``: running sums along ``dim``; x's shape, in ``dtype`` (empty: x's, int64 for
    an integer or bool x, as torch promotes). A mixture of experts' dispatcher turns its tokens per expert into
    offsets so."""

    kind: ClassVar[str] = "cumsum"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    dim: int = 0
    dtype: str = ""

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        _norm_dim(self.dim, x.ndim, "cumsum")
        integral = not (torch_dtype(x.dtype).is_floating_point or torch_dtype(x.dtype).is_complex)
        return (TensorType(x.shape, self.dtype or ("int64" if integral else x.dtype)),)

    def compute(self, x):
        return (torch.cumsum(x, self.dim, dtype=torch_dtype(self.dtype) if self.dtype else None),)


@dataclass(frozen=True, slots=True)
class IndexAdd(Op):
    """``torch.index_add(x, dim, index, source, alpha)``: x with ``alpha`` · source's slices along ``dim`` added at
    the positions ``index`` names. Inputs x ``[*]``, index ``[n]`` (int64), source x's shape with ``dim`` of size n;
    output x's shape and dtype. A mixture of experts' dispatcher adds its experts' rows back onto their tokens so."""

    kind: ClassVar[str] = "index_add"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    dim: int = 0
    alpha: float = 1

    def infer(self, ins):
        _expect(3, ins, self)
        x, index, source = ins
        d = _norm_dim(self.dim, x.ndim, "index_add")
        if (
            index.ndim != 1
            or source.ndim != x.ndim
            or source.shape[:d] + source.shape[d + 1 :] != x.shape[:d] + x.shape[d + 1 :]
            or source.shape[d] != index.shape[0]
        ):
            raise OpError(
                f"index_add: x {list(x.shape)}, index {list(index.shape)}, source {list(source.shape)} along dim {d} "
                "do not fit x [*], index [n], source x's shape with dim of size n"
            )
        return (x,)

    def compute(self, x, index, source):
        return (x.index_add(self.dim, index, source, alpha=self.alpha),)


@dataclass(frozen=True, slots=True)
class FullLike(NoGradient):
    """``torch.full_like(x, value)``: a tensor of x's shape filled with ``value`` (dtype ``dtype``, x's when empty).
    A constant of x's shape: no gradient. DeepSeek-V3's router starts its group mask so."""

    kind: ClassVar[str] = "full_like"
    fresh: ClassVar[bool] = True
    value: float | int | bool = 0
    dtype: str = ""

    def infer(self, ins):
        _expect(1, ins, self)
        return (TensorType(ins[0].shape, self.dtype or ins[0].dtype),)

    def compute(self, x):
        return (torch.full_like(x, self.value, dtype=torch_dtype(self.dtype) if self.dtype else None),)

    def describe(self) -> str:
        return f"full_like({self.value!r})"


@dataclass(frozen=True, slots=True)
class Scatter(Op):
    """``torch.scatter(x, dim, index, value)``: x with ``value`` written at ``index`` along ``dim``. Inputs x ``[*]`` and
    index (int64, as many dims, no larger than x's but along ``dim``); output like x. DeepSeek-V3's router marks each
    token's chosen groups so."""

    kind: ClassVar[str] = "scatter"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    dim: int = 0
    value: float | int | bool = 0

    def infer(self, ins):
        _expect(2, ins, self)
        x, idx = ins
        _index_fits(x, idx, self.dim, "scatter")
        return (x,)

    def compute(self, x, idx):
        return (torch.scatter(x, self.dim, idx, self.value),)


@dataclass(frozen=True, slots=True)
class Histc(NoGradient):
    """``torch.histc(x, bins, min, max)``: the count of x's elements in each of ``bins`` equal bins over
    ``[min, max]`` (elements outside are not counted). Input x ``[*]``; output ``[bins]``, x's dtype. A mixture of
    experts counts the tokens routed to each expert so (Hugging Face's experts count integer expert ids off the CPU,
    as captured on the meta device: an integer x is counted in float64, exact below 2^53). The counts are constants
    of x: no gradient."""

    kind: ClassVar[str] = "histc"
    fresh: ClassVar[bool] = True
    bins: int = 100
    min: float = 0.0
    max: float = 0.0

    def infer(self, ins):
        _expect(1, ins, self)
        if self.bins < 1 or ins[0].dtype in ("bool",) or ins[0].dtype.startswith("complex"):
            raise OpError(f"histc: {self.bins} bins of a {ins[0].dtype} tensor; give bins ≥ 1 and a real tensor")
        return (TensorType((self.bins,), ins[0].dtype),)

    def compute(self, x):
        if x.is_floating_point():
            return (torch.histc(x, self.bins, self.min, self.max),)
        return (torch.histc(x.double(), self.bins, self.min, self.max).to(x.dtype),)

    def describe(self) -> str:
        return f"histc(bins={self.bins}, min={self.min:g}, max={self.max:g})"


@dataclass(frozen=True, slots=True)
class Experts(Op):
    """The expert layer of a mixture of experts with token-choice top-k routing (Shazeer et al. 2017; FlexFlow's
    ``Experts`` op; no capacity: every routed token is computed). Inputs:

    * x ``[N, H]`` (N tokens), idx ``[N, K]`` (int64: each token's K experts), w ``[N, K]`` (their routing weights);
    * w1 ``[E, 2I, H]`` (each expert's gate and up projections stacked, gate first; ``transposed``: ``[E, H, 2I]``)
      and w2 ``[E, H, I]`` (the down projection; ``transposed``: ``[E, I, H]``), Hugging Face's experts layout.

    Output ``[N, H]``, x's dtype: ``out[n] = Σ_k w[n, k] · f_{idx[n, k]}(x[n])`` with
    ``f_e(h) = (act(h · gate_eᵀ) ⊙ h · up_eᵀ) · down_eᵀ`` (SwiGLU when ``act`` is silu).

    ``start`` (expert parallelism): None, w1 and w2 hold every expert; else they hold the experts
    ``[start, start + E_local)`` and a token's other experts contribute 0, so the devices' outputs sum to the whole
    (as a vocabulary-parallel embedding's, :func:`in_block`); ``experts``: then the layer's E, which
    :mod:`shardflow.graph.flops` reads (a block computes only the pairs routed to it). Computed expert by expert on
    the tokens routed to it (``nonzero`` of the routing, ``index_add`` of the weighted results): any float dtype,
    differentiable by autograd in x, w, w1 and w2."""

    kind: ClassVar[str] = "experts"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    act: str = "silu"
    transposed: bool = False
    start: int | None = quiet(None)
    experts: int = quiet(0)

    def infer(self, ins):
        _expect(5, ins, self)
        x, idx, w, w1, w2 = ins
        if self.act not in UNARY_FNS:
            raise OpError(f"experts: unknown activation {self.act!r}; supported: {sorted(UNARY_FNS)}")
        up, down = (w1.shape, w2.shape) if not self.transposed else (_swap_last(w1.shape), _swap_last(w2.shape))
        if (
            x.ndim != 2
            or idx.ndim != 2
            or not idx.dtype.startswith("int")
            or w.shape != idx.shape
            or idx.shape[0] != x.shape[0]
            or len(up) != 3
            or len(down) != 3
            or up[0] != down[0]
            or up[2] != x.shape[1]
            or down[1] != x.shape[1]
            or up[1] != 2 * down[2]
        ):
            raise OpError(
                f"experts: x {list(x.shape)}, idx {list(idx.shape)} ({idx.dtype}), w {list(w.shape)}, w1 "
                f"{list(w1.shape)}, w2 {list(w2.shape)} (transposed={self.transposed}) do not fit x [N, H], idx and "
                f"w [N, K], w1 [E, 2I, H], w2 [E, H, I]"
            )
        return (x,)

    def compute(self, x, idx, w, w1, w2):
        if self.transposed:
            w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
        start = self.start or 0
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):
            token, slot = torch.nonzero(idx == start + e, as_tuple=True)
            y = expert_mlp(self.act, x[token], w1[e], w2[e]) * w[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return (out,)

    def describe(self) -> str:
        return f"experts({self.act}{', transposed' if self.transposed else ''})"


def expert_mlp(act: str, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on its rows ``h [R, H]``: ``(act(h · gateᵀ) ⊙ h · upᵀ) · downᵀ`` with ``w1 [2I, H]`` (gate and up
    stacked, gate first) and ``w2 [H, I]``; ``[R, H]``."""
    gate, up = F.linear(h, w1).chunk(2, dim=-1)
    return F.linear(UNARY_FNS[act](gate) * up, w2)


def _swap_last(shape: Shape) -> Shape:
    return shape[:-2] + (shape[-1], shape[-2]) if len(shape) >= 2 else shape


@dataclass(frozen=True, slots=True)
class CrossEntropy(Op):
    """Cross-entropy of logits ``[N, C]`` against class indices ``[N]``: a scalar (mean or sum over N).

    The mean divides by N (every target counts; targets must lie in ``[0, C)``).
    """

    kind: ClassVar[str] = "cross_entropy"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    reduction: str = "mean"

    def infer(self, ins):
        _expect(2, ins, self)
        logits, target = ins
        if logits.ndim != 2 or target.shape != logits.shape[:1] or not target.dtype.startswith("int"):
            raise OpError(
                f"cross_entropy: logits {list(logits.shape)} must be [N, C] and target {list(target.shape)} "
                f"[N] of integers ({target.dtype})"
            )
        if self.reduction not in ("mean", "sum"):
            raise OpError(f"cross_entropy: reduction must be 'mean' or 'sum', got {self.reduction!r}")
        return (TensorType((), logits.dtype),)

    def compute(self, logits, target):
        # 'sum' then divide: the local kernel of a batch-sharded loss divides by the global N instead.
        return (F.cross_entropy(logits, target, reduction=self.reduction),)


@dataclass(frozen=True, slots=True)
class Arg:
    """Placeholder for the ``index``-th tensor input inside an :class:`Aten` op's argument template."""

    index: int


def _fill(template: Any, xs: Sequence[torch.Tensor]) -> Any:
    if isinstance(template, Arg):
        return xs[template.index]
    if isinstance(template, tuple):
        return [_fill(v, xs) for v in template]
    return template


@functools.cache
def aten_overload(target: str) -> torch._ops.OpOverload:
    """The ATen overload named ``target`` (``"aten.cumsum.default"``). Raises OpError if there is none."""
    ns, name, overload = target.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except AttributeError:
        raise OpError(f"no ATen operator {target!r}") from None


@dataclass(frozen=True, slots=True)
class Aten(Op):
    """Any ATen operator without a rule of its own: ``target`` (``"aten.cumsum.default"``) applied to ``args``
    and ``kwargs``, templates in which :class:`Arg` ``(i)`` stands for the i-th tensor input (lists are tuples).

    Shapes come from PyTorch's meta kernel of the operator. Its sharding rule replicates every input (correct,
    slower, and listed by ``shardflow plan``)."""

    kind: ClassVar[str] = "aten"
    target: str = ""
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def _call(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = aten_overload(self.target)(*_fill(self.args, xs), **{k: _fill(v, xs) for k, v in self.kwargs})
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def infer(self, ins):
        meta = [torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in ins]
        try:
            outs = self._call(meta)
        except (RuntimeError, TypeError, IndexError) as e:
            raise OpError(
                f"{self.target}: inputs {[list(t.shape) for t in ins]} do not fit: {str(e).splitlines()[0]}"
            ) from None
        return tuple(TensorType(tuple(o.shape), dtype_name(o.dtype)) for o in outs)

    def compute(self, *xs):
        return self._call(xs)

    def grad_outputs(self, ins, outs, need):
        """Autograd's answer, asked on the meta device (no data): an output carries a gradient where torch gives it
        a ``grad_fn`` (``full_like``'s, ``histc``'s, ``topk``'s indices have none: constants of the inputs), and
        the backward from those outputs to the marked inputs must exist. Raises OpError where it does not: autograd's
        reason (``copy``: "derivative for aten::copy is not implemented"; ``igamma``: "the derivative
        for 'igamma: input' is not implemented."); a backward op without a meta kernel is taken to exist (it runs
        on real tensors)."""
        xs = [
            torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta", requires_grad=m and differentiable(t.dtype))
            for t, m in zip(ins, need)
        ]
        with torch.enable_grad():
            outs = self._call(xs)
        carried = tuple(o.requires_grad for o in outs)
        wrt = [x for x in xs if x.requires_grad]
        if any(carried):
            try:
                torch.autograd.grad(
                    [o for o in outs if o.requires_grad],
                    wrt,
                    [torch.empty_like(o) for o in outs if o.requires_grad],
                    allow_unused=True,
                )
            except RuntimeError as e:  # NotImplementedError included
                reason = str(e).strip().splitlines()[0]
                if "derivative" in reason:  # not "Could not run ... 'Meta' backend": a kernel without a meta version
                    raise OpError(reason.rstrip(".")) from None
        return carried

    def describe(self) -> str:
        return self.target.removeprefix("aten.").removesuffix(".default")


OPS: dict[str, type[Op]] = {
    cls.kind: cls
    for cls in (
        Linear,
        Embedding,
        LayerNorm,
        Detach,
        Dropout,
        Unary,
        Binary,
        Scalar,
        Where,
        Cast,
        Matmul,
        Permute,
        Reshape,
        ComplexView,
        Expand,
        Slice,
        Split,
        Cat,
        Gather,
        Pad,
        Softmax,
        Reduce,
        Attention,
        TopK,
        Sort,
        Cumsum,
        IndexAdd,
        FullLike,
        Scatter,
        Histc,
        Experts,
        Conv,
        Pool,
        CrossEntropy,
        Aten,
    )
}
