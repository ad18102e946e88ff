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
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from shardflow.graph.rng import DrawSite

Shape = tuple[int, ...]


class OpError(ValueError):
    """An operator was given inputs it cannot take (wrong rank, mismatched sizes, bad attribute)."""


@dataclass(frozen=True, slots=True)
class TensorType:
    """Full (unparallel) type of a tensor: ``shape`` in elements per dim and ``dtype`` as a torch name."""

    shape: Shape
    dtype: str = "float32"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * torch.empty((), dtype=torch_dtype(self.dtype)).element_size()


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``, ``"int64"``, ...)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise OpError(f"unknown dtype {name!r}; use a torch dtype name such as 'float32' or 'int64'")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _norm_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise OpError(f"{what}: dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


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

    def infer(self, ins: tuple[TensorType, ...]) -> tuple[TensorType, ...]:
        raise NotImplementedError

    def compute(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def describe(self) -> str:
        """``kind(attr=value, ...)`` for listings."""
        attrs = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{self.kind}({attrs})"


@dataclass(frozen=True, slots=True)
class Linear(Op):
    """``y = x @ weight.T (+ bias)``. Inputs: x ``[*, in]``, weight ``[out, in]``, bias ``[out]``."""

    kind: ClassVar[str] = "linear"
    contracts_last_dim: ClassVar[bool] = True
    bias: bool = True

    def infer(self, ins):
        _expect(3 if self.bias else 2, ins, self)
        x, w = ins[0], ins[1]
        if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
            raise OpError(f"linear: input {list(x.shape)} does not match weight [out, in] = {list(w.shape)}")
        if self.bias and ins[2].shape != (w.shape[0],):
            raise OpError(f"linear: bias {list(ins[2].shape)} must be [{w.shape[0]}]")
        return (TensorType(x.shape[:-1] + (w.shape[0],), x.dtype),)

    def compute(self, x, w, b=None):
        return (F.linear(x, w, b),)


@dataclass(frozen=True, slots=True)
class Embedding(Op):
    """Row lookup. Inputs: indices ``[*]`` (int64), weight ``[vocab, C]``. Output ``[*, C]``."""

    kind: ClassVar[str] = "embedding"

    def infer(self, ins):
        _expect(2, ins, self)
        idx, w = ins
        if w.ndim != 2:
            raise OpError(f"embedding: weight must be [vocab, C], got {list(w.shape)}")
        if not idx.dtype.startswith("int"):
            raise OpError(f"embedding: indices must be an integer tensor, got {idx.dtype}")
        return (TensorType(idx.shape + (w.shape[1],), w.dtype),)

    def compute(self, idx, w):
        return (F.embedding(idx, w),)


@dataclass(frozen=True, slots=True)
class LayerNorm(Op):
    """Layer norm over the last ``ndim`` dims. Inputs: x, then weight and bias (shape of those dims)."""

    kind: ClassVar[str] = "layer_norm"
    ndim: int = 1
    eps: float = 1e-5
    affine: bool = True
    bias: bool = True

    def infer(self, ins):
        _expect(1 + self.affine + (self.affine and self.bias), ins, self)
        x = ins[0]
        norm = x.shape[-self.ndim:] if self.ndim else ()
        if x.ndim < self.ndim:
            raise OpError(f"layer_norm: input {list(x.shape)} has fewer than {self.ndim} dims")
        for p in ins[1:]:
            if p.shape != norm:
                raise OpError(f"layer_norm: parameter {list(p.shape)} must be {list(norm)}")
        return (x,)

    def compute(self, x, w=None, b=None):
        return (F.layer_norm(x, x.shape[x.ndim - self.ndim:], w, b, self.eps),)


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
            raise OpError(f"dropout(p={self.p}) draws its mask from (seed, step, node, element index): pass "
                          f"at=DrawSite(...) for the piece it runs on")
        scale = at.keep(tuple(x.shape), self.p).to(x.dtype).mul_(1.0 / (1.0 - self.p))  # 0 or 1/(1-p)
        return (x * scale,)


UNARY_FNS = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "tanh": torch.tanh,
    "neg": torch.neg,
}
LINEAR_UNARY = frozenset({"neg"})
# Monotone functions commute with max and min: f(max(a, b)) = max(f(a), f(b)) for a non-decreasing f, and
# = min(f(a), f(b)) for a non-increasing one (DTensor's _NON_DECREASING_RULES and _NEG_RULES).
NON_DECREASING_UNARY = frozenset({"relu", "tanh"})
NON_INCREASING_UNARY = frozenset({"neg"})


@dataclass(frozen=True, slots=True)
class Unary(Op):
    """Element-wise function of one tensor: one of :data:`UNARY_FNS`."""

    kind: ClassVar[str] = "unary"
    fn: str = "relu"

    def infer(self, ins):
        _expect(1, ins, self)
        if self.fn not in UNARY_FNS:
            raise OpError(f"unary: unknown function {self.fn!r}; supported: {sorted(UNARY_FNS)}")
        return ins

    def compute(self, x):
        return (UNARY_FNS[self.fn](x),)

    def describe(self) -> str:
        return self.fn


BINARY_FNS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


@dataclass(frozen=True, slots=True)
class Binary(Op):
    """Element-wise ``a (fn) b`` of two tensors with broadcasting; fn in add, sub, mul, div."""

    kind: ClassVar[str] = "binary"
    fn: str = "add"

    def infer(self, ins):
        _expect(2, ins, self)
        if self.fn not in BINARY_FNS:
            raise OpError(f"binary: unknown function {self.fn!r}; supported: {sorted(BINARY_FNS)}")
        return (TensorType(broadcast_shapes(ins[0].shape, ins[1].shape, self.fn), ins[0].dtype),)

    def compute(self, a, b):
        return (BINARY_FNS[self.fn](a, b),)

    def describe(self) -> str:
        return self.fn


SCALAR_FNS = {
    "add": lambda x, s: x + s,
    "sub": lambda x, s: x - s,
    "rsub": lambda x, s: s - x,
    "mul": lambda x, s: x * s,
    "div": lambda x, s: x / s,
    "rdiv": lambda x, s: s / x,
}


@dataclass(frozen=True, slots=True)
class Scalar(Op):
    """Element-wise op of a tensor and a Python number: ``x+s, x-s, s-x, x*s, x/s, s/x``."""

    kind: ClassVar[str] = "scalar"
    fn: str = "mul"
    value: float = 1.0

    def infer(self, ins):
        _expect(1, ins, self)
        if self.fn not in SCALAR_FNS:
            raise OpError(f"scalar: unknown function {self.fn!r}; supported: {sorted(SCALAR_FNS)}")
        return ins

    def compute(self, x):
        return (SCALAR_FNS[self.fn](x, self.value),)

    def describe(self) -> str:
        return f"{self.fn}({self.value:g})"


@dataclass(frozen=True, slots=True)
class Matmul(Op):
    """Batched matrix product ``[*, n, k] @ [*, k, m] -> [*, n, m]`` (torch.matmul / bmm, both ≥ 2-D)."""

    kind: ClassVar[str] = "matmul"
    contracts_last_dim: ClassVar[bool] = True

    def infer(self, ins):
        _expect(2, ins, self)
        a, b = ins
        if a.ndim < 2 or b.ndim < 2:
            raise OpError(f"matmul: both operands need ≥ 2 dims, got {list(a.shape)} and {list(b.shape)}")
        if a.shape[-1] != b.shape[-2]:
            raise OpError(f"matmul: inner sizes differ: {list(a.shape)} @ {list(b.shape)}")
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], "matmul batch dims")
        return (TensorType(batch + (a.shape[-2], b.shape[-1]), a.dtype),)

    def compute(self, a, b):
        return (torch.matmul(a, b),)


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
    """View/reshape to ``shape`` (fully resolved: no -1)."""

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
        return tuple(TensorType(x.shape[:d] + (s,) + x.shape[d + 1:], x.dtype) for s in self.sizes)

    def compute(self, x):
        return tuple(torch.split(x, list(self.sizes), dim=self.dim))


@dataclass(frozen=True, slots=True)
class Softmax(Op):
    """Softmax along ``dim``."""

    kind: ClassVar[str] = "softmax"
    dim: int = -1

    def infer(self, ins):
        _expect(1, ins, self)
        _norm_dim(self.dim, ins[0].ndim, "softmax")
        return ins

    def compute(self, x):
        return (torch.softmax(x, self.dim),)


@dataclass(frozen=True, slots=True)
class Reduce(Op):
    """``sum`` or ``mean`` over ``dims`` (normalised, non-negative), optionally keeping them as size 1."""

    kind: ClassVar[str] = "reduce"
    fn: str = "sum"
    dims: tuple[int, ...] = ()
    keepdim: bool = False

    def infer(self, ins):
        _expect(1, ins, self)
        (x,) = ins
        if self.fn not in ("sum", "mean"):
            raise OpError(f"reduce: fn must be 'sum' or 'mean', got {self.fn!r}")
        dims = {_norm_dim(d, x.ndim, "reduce") for d in self.dims}
        shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape) if self.keepdim or i not in dims)
        return (TensorType(shape, x.dtype),)

    def compute(self, x):
        f = torch.sum if self.fn == "sum" else torch.mean
        return (f(x, dim=self.dims, keepdim=self.keepdim),)

    def describe(self) -> str:
        return f"{self.fn}(dims={list(self.dims)}{', keepdim' if self.keepdim else ''})"


@dataclass(frozen=True, slots=True)
class Attention(Op):
    """Scaled dot-product attention. Inputs q ``[B, H, T, D]``, k and v ``[B, H, S, D]``; output like q.

    ``scale`` defaults to ``1/sqrt(D)``; ``causal`` masks the upper triangle (torch's ``is_causal``).
    """

    kind: ClassVar[str] = "attention"
    causal: bool = True
    scale: float | None = None

    def infer(self, ins):
        _expect(3, ins, self)
        q, k, v = ins
        if q.ndim < 3 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
            raise OpError(
                f"attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be [*, T, D], [*, S, D]"
            )
        return (q,)

    def compute(self, q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale),)


@dataclass(frozen=True, slots=True)
class CrossEntropy(Op):
    """Cross-entropy of logits ``[N, C]`` against class indices ``[N]``: a scalar (mean or sum over N).

    The mean divides by N (every target counts; targets must lie in ``[0, C)``).
    """

    kind: ClassVar[str] = "cross_entropy"
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


OPS: dict[str, type[Op]] = {
    cls.kind: cls
    for cls in (Linear, Embedding, LayerNorm, Dropout, Unary, Binary, Scalar, Matmul, Permute, Reshape, Split,
                Softmax, Reduce, Attention, CrossEntropy)
}
