"""Hand-written backward of the ops that are cheap to differentiate: a table, op class → vjp.

The backward of an op is torch's own autograd unless a hand-written kernel is measurably faster
(docs/execution.md#executors). For ATen-sized ops it is: recording an op's autograd graph in the forward and calling
the autograd engine for it in the backward cost several times what the formulas below take, per op
(docs/benchmarks.md#hand-written-vjps-against-autograd); with one backward per op, a training step of a small ATen
graph spent most of its time there.

Each entry computes, from the op's inputs ``xs`` (the pieces this device holds, already multiplied by the local
op's input scales) and the gradients ``dys`` of its outputs (None for an output no gradient reaches), the
gradient of every input that ``need`` marks (None for the others). Only the op's inputs are available (the
forward's outputs are not kept for the backward): where a formula needs an output (softmax, tanh), it recomputes
it, one kernel — except on a large softmax, which autograd differentiates from its kept output
(:data:`RECOMPUTES_OUTPUT`). Formulas follow ATen's derivatives (``tools/autograd/derivatives.yaml``), using ATen's own
backward kernels where there is one (``threshold_backward``, ``gelu_backward``, ``convolution_backward``...), so the
gradients are autograd's to rounding; tests/test_vjp.py checks every entry against ``torch.func.vjp``.

Ops without an entry (attention, pooling, dropout, the generic Aten op, ...) go through autograd.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from shardflow.graph import ops as O

Grads = list[torch.Tensor | None]
HandVjp = Callable[[O.Op, Sequence[torch.Tensor], Sequence[torch.Tensor | None], Sequence[bool]], Grads]


FEW_SLICES = 8  # a broadcast dim at most this long is summed by adding its slices


def _to(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g`` summed over the dims ``x`` was broadcast along (broadcasting's backward). One broadcast dim of at most
    :data:`FEW_SLICES` (grouped-query attention's key/value heads repeated over the query heads of a group) is
    summed by adding its slices: ATen's reduction over a short dim in the middle of a tensor is strided and several
    times slower than one element-wise add (docs/benchmarks.md#hand-written-vjps-against-autograd)."""
    if g.shape == x.shape:
        return g
    lead = g.ndim - x.ndim
    dims = [d for d in range(g.ndim) if d < lead or (x.shape[d - lead] == 1 and g.shape[d] != 1)]
    if len(dims) == 1 and g.shape[dims[0]] <= FEW_SLICES:
        first, *rest = g.unbind(dims[0])
        out = first + rest[0] if rest else first.clone()
        for s in rest[1:]:
            out.add_(s)
        return out.reshape(x.shape)
    return g.sum_to_size(x.shape)


def _reshape(op, xs, dys, need) -> Grads:
    return [dys[0].reshape(xs[0].shape)]


def _permute(op: O.Permute, xs, dys, need) -> Grads:
    return [dys[0].permute(O.inverse(op.dims))]


def _expand(op, xs, dys, need) -> Grads:
    return [_to(dys[0], xs[0])]


def _slice(op: O.Slice, xs, dys, need) -> Grads:
    return [torch.ops.aten.slice_backward(dys[0], xs[0].shape, op.dim, op.start, op.end, op.step)]


def _cat(op: O.Cat, xs, dys, need) -> Grads:
    out, at = [], 0
    for x, n in zip(xs, need):
        size = x.shape[op.dim]
        out.append(dys[0].narrow(op.dim, at, size) if n else None)
        at += size
    return out


def _split(op: O.Split, xs, dys, need) -> Grads:
    """The gradients joined, zeros for a missing one (ATen's ``split_with_sizes_backward``, which wraps a negative
    dim first: ``Split(dim=-1)``'s zeros were shaped on the wrong dim)."""
    x, d = xs[0], op.dim % xs[0].ndim
    parts = [
        dy if dy is not None else x.new_zeros(x.shape[:d] + (s,) + x.shape[d + 1 :]) for dy, s in zip(dys, op.sizes)
    ]
    return [torch.cat(parts, d)]


def _pad(op: O.Pad, xs, dys, need) -> Grads:
    return [F.pad(dys[0], [-p for p in op.pad])]  # negative padding crops


def _cast(op, xs, dys, need) -> Grads:
    return [dys[0].to(xs[0].dtype)]


def _scalar(op: O.Scalar, xs, dys, need) -> Grads:
    x, dy, s = xs[0], dys[0], op.value
    if op.fn in ("add", "sub"):
        return [dy]
    if op.fn == "rsub":
        return [-dy]
    if op.fn == "mul":
        return [dy * s]
    if op.fn == "div":
        return [dy / s]
    if op.fn == "rdiv":  # s / x
        return [-dy * s / (x * x)]
    assert op.fn == "pow"
    return [dy * s * x.pow(s - 1) if s != 0 else torch.zeros_like(x)]


def _binary(op: O.Binary, xs, dys, need) -> Grads:
    a, b = xs
    dy = dys[0]
    if op.fn == "add":
        ga, gb = dy, dy
    elif op.fn == "sub":
        ga, gb = dy, (-dy if need[1] else None)
    elif op.fn == "mul":
        ga, gb = (dy * b if need[0] else None), (dy * a if need[1] else None)
    else:  # div
        ga, gb = (dy / b if need[0] else None), (-dy * a / (b * b) if need[1] else None)
    return [_to(ga, a) if need[0] else None, _to(gb, b) if need[1] else None]


def _unary(op: O.Unary, xs, dys, need) -> Grads:
    x, dy = xs[0], dys[0]
    return [UNARY_VJPS[op.fn](x, dy)]


UNARY_VJPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "neg": lambda x, dy: -dy,
    "relu": lambda x, dy: torch.ops.aten.threshold_backward(dy, x, 0),
    "gelu": lambda x, dy: torch.ops.aten.gelu_backward(dy, x),
    "gelu_tanh": lambda x, dy: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"),
    "silu": lambda x, dy: torch.ops.aten.silu_backward(dy, x),
    "sigmoid": lambda x, dy: torch.ops.aten.sigmoid_backward(dy, torch.sigmoid(x)),
    "tanh": lambda x, dy: torch.ops.aten.tanh_backward(dy, torch.tanh(x)),
    "exp": lambda x, dy: dy * torch.exp(x),
    "rsqrt": lambda x, dy: -0.5 * dy * torch.rsqrt(x).pow(3),
    "sqrt": lambda x, dy: dy / (2 * torch.sqrt(x)),
    "log": lambda x, dy: dy / x,
}


def _reduce(op: O.Reduce, xs, dys, need) -> Grads:
    x, dy = xs[0], dys[0]
    if not op.keepdim:
        for d in sorted(op.dims):
            dy = dy.unsqueeze(d)
    if op.fn == "mean":
        dy = dy / math.prod(x.shape[d] for d in op.dims)
    return [dy.expand(x.shape)]


def _softmax(op: O.Softmax, xs, dys, need) -> Grads:
    x, dy = xs[0], dys[0]
    if op.log:
        return [torch.ops.aten._log_softmax_backward_data(dy, torch.log_softmax(x, op.dim), op.dim, x.dtype)]
    return [torch.ops.aten._softmax_backward_data(dy, torch.softmax(x, op.dim), op.dim, x.dtype)]


def _linear(op: O.Linear, xs, dys, need) -> Grads:
    """In the order ``dy``'s rows are stored (:func:`~shardflow.graph.ops.row_order`; ``x`` is read in the same
    order, as the forward of a ring's fused linear laid it out): no copy to fold the leading dims, and ``dx`` comes
    out in that layout."""
    x, w = xs[0], xs[1]
    dy = dys[0]
    out = [None] * len(xs)
    order = None if dy.is_contiguous() else O.row_order(dy)
    if order is not None:
        dy, x = dy.permute(*order, -1), x.permute(*order, -1)
    if need[0]:
        dx = dy @ (w.t() if op.transposed else w)
        out[0] = dx if order is None else dx.permute(*O.inverse(order), -1)
    flat_dy = dy.reshape(-1, dy.shape[-1])
    if need[1]:
        flat_x = x.reshape(-1, x.shape[-1])
        out[1] = flat_x.t() @ flat_dy if op.transposed else flat_dy.t() @ flat_x
    if op.bias and need[2]:
        out[2] = flat_dy.sum(0)
    return out


PRODUCT = O.Linear(bias=False, transposed=True)  # a @ b for a matrix b: a linear by the weight [in, out] b


def _matmul(op, xs, dys, need) -> Grads:
    a, b = xs
    if b.ndim == 2:
        return _linear(PRODUCT, xs, dys, need)
    dy = dys[0]
    return [
        _to(dy @ b.transpose(-1, -2), a) if need[0] else None,
        _to(a.transpose(-1, -2) @ dy, b) if need[1] else None,
    ]


def _embedding(op: O.Embedding, xs, dys, need) -> Grads:
    idx, w = xs
    dy, rows = dys[0], w.shape[0]
    if op.start is not None:  # the rows this device holds (vocabulary parallelism): the others' gradients are not here
        idx, inside = O.in_block(idx, op.start, rows)
        dy = torch.where(inside.unsqueeze(-1), dy, 0.0)
    return [None, torch.ops.aten.embedding_dense_backward(dy, idx, rows, op.local_padding(rows), False)]


def _where(op, xs, dys, need) -> Grads:
    c, a, b = xs
    dy = dys[0]
    return [
        None,
        _to(torch.where(c, dy, 0.0), a) if need[1] else None,
        _to(torch.where(c, 0.0, dy), b) if need[2] else None,
    ]


def _gather(op: O.Gather, xs, dys, need) -> Grads:
    x, idx = xs
    dy = dys[0]
    if op.start is not None:  # x's block of the dim (vocabulary parallelism)
        idx, inside = O.in_block(idx, op.start, x.shape[op.dim])
        dy = torch.where(inside, dy, 0.0)
    return [torch.zeros_like(x).scatter_add_(op.dim, idx, dy), None]


def _layer_norm(op: O.LayerNorm, xs, dys, need) -> Grads:
    x, w, b = xs[0], (xs[1] if op.affine else None), (xs[2] if op.affine and op.bias else None)
    shape = x.shape[x.ndim - op.ndim :]
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, w, b, op.eps)
    mask = [need[0], op.affine and need[1], op.affine and op.bias and need[2]]
    gx, gw, gb = torch.ops.aten.native_layer_norm_backward(dys[0], x, shape, mean, rstd, w, b, mask)
    return [gx, gw, gb][: len(xs)]


def _conv(op: O.Conv, xs, dys, need) -> Grads:
    x, w = xs[0], xs[1]
    mask = [need[0], need[1], op.bias and need[2]]
    grads = torch.ops.aten.convolution_backward(
        dys[0],
        x,
        w,
        [w.shape[0]] if op.bias else None,
        list(op.stride),
        list(op.padding),
        list(op.dilation),
        False,
        [0] * len(op.stride),
        op.groups,
        mask,
    )
    return list(grads)[: len(xs)]


VJPS: dict[type[O.Op], HandVjp] = {
    O.Reshape: _reshape,
    O.Permute: _permute,
    O.Expand: _expand,
    O.Slice: _slice,
    O.Cat: _cat,
    O.Split: _split,
    O.Pad: _pad,
    O.Cast: _cast,
    O.Scalar: _scalar,
    O.Binary: _binary,
    O.Unary: _unary,
    O.Reduce: _reduce,
    O.Softmax: _softmax,
    O.Linear: _linear,
    O.Matmul: _matmul,
    O.Embedding: _embedding,
    O.Where: _where,
    O.Gather: _gather,
    O.LayerNorm: _layer_norm,
    O.Conv: _conv,
}
SCALAR_FNS = frozenset({"add", "sub", "rsub", "mul", "div", "rdiv", "pow"})
BINARY_FNS = frozenset({"add", "sub", "mul", "div"})
REDUCE_FNS = frozenset({"sum", "mean"})


# A hand vjp that recomputes its op's output (softmax: two passes over the piece) costs more than autograd's
# recording and engine call once the piece is large (docs/benchmarks.md#hand-written-vjps-against-autograd). From
# this many elements of its input such an op goes through autograd, which keeps the output from the forward, as eager
# PyTorch does.
RECOMPUTES_OUTPUT = (O.Softmax,)
AUTOGRAD_NUMEL = 2**16


def hand_vjp(op: O.Op, ins: Sequence[O.TensorType] = ()) -> HandVjp | None:
    """The hand-written vjp of ``op`` on input pieces of types ``ins`` (the first one's size decides
    :data:`RECOMPUTES_OUTPUT`), or None where autograd differentiates it: no entry, a random op, a function of its
    kind the table does not cover (``maximum``, ``amax``, ``erf``...), an op of :data:`RECOMPUTES_OUTPUT` on a piece
    of :data:`AUTOGRAD_NUMEL` elements or more, or a complex input. The formulas are written for real numbers; a
    complex vjp conjugates (the gradient of ``a * b`` by ``a`` is ``dy * conj(b)``: ATen's ``derivatives.yaml``),
    so complex ops (a rotary embedding written with ``view_as_complex``, as torchtitan's Llama 3) take autograd's."""
    fn = VJPS.get(type(op))
    numel = ins[0].numel if ins else 0
    if fn is None or op.random or (isinstance(op, RECOMPUTES_OUTPUT) and numel >= AUTOGRAD_NUMEL):
        return None
    if any(O.torch_dtype(t.dtype).is_complex for t in ins):
        return None
    if isinstance(op, O.Unary) and op.fn not in UNARY_VJPS:
        return None
    if (isinstance(op, O.Scalar) and op.fn not in SCALAR_FNS) or (isinstance(op, O.Binary) and op.fn not in BINARY_FNS):
        return None
    if isinstance(op, O.Reduce) and op.fn not in REDUCE_FNS:
        return None
    return fn
