"""The ATen lifting table (docs/concepts.md#1-from-a-model-to-a-computation-graph): :data:`LIFT` maps an ATen
overload to its handler, which makes the ops of :mod:`shardflow.graph.ops` one ATen node stands for, through the
walk of :mod:`shardflow.capture.lift` (``c``: its ``apply``, ``tensor`` and ``shape``). A handler returns the
node's value (:class:`_T`, a tuple of them, or a batch norm's :class:`_RunningStat`), or None to fall back to the
generic :class:`~shardflow.graph.ops.Aten` op (arguments it does not model).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from shardflow.capture.export import CaptureError
from shardflow.graph import ops as O
from shardflow.graph.graph import TensorRole
from shardflow.graph.ops import dtype_name, torch_dtype

aten = torch.ops.aten


class _T:
    """A graph tensor (by builder name) standing for an fx node's value."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"_T({self.name!r})"


# --- the lifting table: ATen overload → handler(lift, node, *args, **kwargs) → _T | tuple | None ---------------
# A handler returns None to fall back to the generic Aten op (arguments it does not model).
def _dim(d: int, nd: int) -> int:
    return d % nd if nd else 0


def _unary(fn: str) -> Callable:
    return lambda c, node, x: c.apply(O.Unary(fn), [x], node)


def _gelu(c, node, x, approximate="none"):
    return c.apply(O.Unary("gelu" if approximate == "none" else "gelu_tanh"), [x], node)


def _binary(fn: str, scalar_fn: str | None = None, reverse_fn: str | None = None) -> Callable:
    def handler(c, node, a, b, *, alpha=1):
        if alpha != 1:
            return None
        if isinstance(b, (int, float, bool)) and scalar_fn:
            return c.apply(O.Scalar(scalar_fn, b), [a], node)
        if isinstance(a, (int, float, bool)) and reverse_fn:
            return c.apply(O.Scalar(reverse_fn, a), [b], node)
        return c.apply(O.Binary(fn), [a, b], node)

    return handler


def _scalar(fn: str) -> Callable:
    def handler(c, node, x, s, *, alpha=1):
        return c.apply(O.Scalar(fn, s), [x], node) if alpha == 1 else None

    return handler


def _view(c, node, x, *_, **__):
    return c.apply(O.Reshape(c.shape(node)), [x], node)


def _alias(c, node, x, *_, memory_format=None, **__):
    return x  # clone / alias / contiguous: the value itself (no node)


def _detach(c, node, x):
    return c.apply(O.Detach(), [x], node)


def _to_copy(
    c, node, x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None
):
    """A cast, or the value itself: a device move is none of the graph's business (the executors place every
    buffer on their rank's device; a model built on the meta device moves its labels to ``meta``)."""
    want = dtype_name(node.meta["val"].dtype)
    if isinstance(x, _T) and c.b.type_of(x.name).dtype == want:
        return x
    return c.apply(O.Cast(want), [x], node)


def _permute(c, node, x, dims):
    nd = len(dims)
    return c.apply(O.Permute(tuple(_dim(d, nd) for d in dims)), [x], node)


def _complex_view(to_complex: bool):
    def lift(c, node, x):
        return c.apply(O.ComplexView(to_complex), [x], node)

    return lift


def _transpose(c, node, x, d0=0, d1=1):
    nd = len(node.meta["val"].shape)
    dims = list(range(nd))
    if nd:
        a, b = _dim(d0, nd), _dim(d1, nd)
        dims[a], dims[b] = dims[b], dims[a]
    return c.apply(O.Permute(tuple(dims)), [x], node)


def _expand(c, node, x, sizes, *, implicit=False):
    return c.apply(O.Expand(c.shape(node)), [x], node)


def _slice(c, node, x, dim=0, start=None, end=None, step=1):
    size = node.args[0].meta["val"].shape
    d = _dim(dim, len(size))
    lo, hi, _ = slice(start, end, step).indices(int(size[d]))
    return c.apply(O.Slice(d, lo, max(lo, hi), step), [x], node)


def _copy(c, node, x, src, non_blocking=False):
    """``x.copy_(src)``, functional: ``src`` broadcast to ``x``'s shape in ``x``'s dtype (an expand and a cast, both
    differentiable; autograd has no derivative for ATen's ``copy``). ``x``'s values are not read: its gradient is
    zero, as in eager PyTorch."""
    shape, want = c.shape(node), dtype_name(node.meta["val"].dtype)
    if not isinstance(src, _T):  # a folded value (or a number) written into a graph tensor: a constant
        return torch.as_tensor(src).to(torch_dtype(want)).expand(shape).clone()
    steps = ([O.Expand(shape)] if c.b.shape(src.name) != shape else []) + (
        [O.Cast(want)] if c.b.type_of(src.name).dtype != want else []
    )
    for k, op in enumerate(steps):
        src = c.apply(op, [src], node, "" if k == len(steps) - 1 else f"_{op.kind}")
    return src


def _slice_scatter(c, node, x, src, dim=0, start=None, end=None, step=1):
    """``x`` with ``src`` written into its slice ``start:end`` of ``dim`` (``x[..., a:b].copy_(src)``, functional):
    what is left of ``x`` and ``src`` concatenated along ``dim`` (slices and a cat, which have rules; the generic
    ``slice_scatter`` would replicate its inputs). A value made so is remembered by parts (:attr:`_Lift.parts`),
    so writing every slice of an empty tensor in turn (DeepSeek-V3's key states: ``new_empty``, then ``copy_`` into
    ``[..., :n]`` and ``[..., n:]``) is the cat of the written values alone, the empty tensor read by nothing. A
    ``step`` other than 1 stays the generic op."""
    if step != 1:
        return None
    size = c.shape(node)
    d = _dim(dim, len(size))
    lo, hi, _ = slice(start, end).indices(size[d])
    hi = max(lo, hi)
    parts = [(lo, hi, src)] if hi > lo else []
    known = c.parts.get(x.name) if isinstance(x, _T) else None
    for a, b, v in known[1] if known and known[0] == d else ((0, size[d], x),):
        for p, q in ((a, min(b, lo)), (max(a, hi), b)):
            if p < q:
                parts.append((p, q, v if (p, q) == (a, b) else _narrow(c, node, v, d, p - a, q - a, len(parts))))
    parts.sort(key=lambda part: part[0])
    if len(parts) == 1:
        return parts[0][2]
    out = c.apply(O.Cat(d), [v for _, _, v in parts], node)
    c.parts[out.name] = (d, tuple(parts))
    return out


def _narrow(c, node, v, d: int, lo: int, hi: int, k: int):
    """``v[lo:hi]`` along dim ``d``: a Slice op of a graph tensor (named after ``node``, part ``k``), or the folded
    slice of a folded one."""
    if isinstance(v, _T):
        return c.apply(O.Slice(d, lo, hi), [v], node, f"_part{k}")
    return v.narrow(d, lo, hi - lo).clone()


def _select(c, node, x, dim, index):
    size = node.args[0].meta["val"].shape
    d = _dim(dim, len(size))
    i = index % int(size[d])
    sliced = c.apply(O.Slice(d, i, i + 1), [x], node, "_slice")
    return c.apply(O.Reshape(c.shape(node)), [sliced], node)


def _split_sizes(c, node, x, sizes, dim=0):
    nd = len(node.args[0].meta["val"].shape)
    outs = c.b.apply(O.Split(tuple(int(s) for s in sizes), _dim(dim, nd)), [c.tensor(x)], name=node.name)
    return tuple(_T(o) for o in outs)


def _split(c, node, x, size, dim=0):
    return _split_sizes(c, node, x, [int(v.shape[_dim(dim, v.ndim)]) for v in node.meta["val"]], dim)


def _cat(c, node, xs, dim=0):
    nd = len(node.meta["val"].shape)
    return c.apply(O.Cat(_dim(dim, nd)), list(xs), node)


def _reduce(fn: str) -> Callable:
    def handler(c, node, x, dims=None, keepdim=False, *, dtype=None):
        nd = len(node.args[0].meta["val"].shape)
        if dtype is not None:
            return None
        dims = range(nd) if dims is None or list(dims) == [] else dims
        return c.apply(O.Reduce(fn, tuple(sorted(_dim(d, nd) for d in dims)), keepdim), [x], node)

    return handler


def _reduce_all(fn: str) -> Callable:
    def handler(c, node, x, *, dtype=None):
        return None if dtype is not None else _reduce(fn)(c, node, x)

    return handler


def _moments(c, node, x, dims, correction: float, keepdim: bool, var_suffix: str = "") -> tuple[_T, _T]:
    """(variance, mean) of ``x`` over ``dims`` as mean, subtract, square, sum, divide: every step has a rule, so
    moments over a sharded dim (batch norm on a data-parallel batch) become partial sums and reductions of the
    statistics alone: synchronized batch norm. The mean is computed once and shared; the variance's op is named
    ``node.name + var_suffix``."""
    val = node.args[0].meta["val"]
    nd = val.ndim
    dims = tuple(sorted(_dim(d, nd) for d in (range(nd) if not dims else dims)))
    n = math.prod(int(val.shape[d]) for d in dims)
    mean = c.apply(O.Reduce("mean", dims, True), [x], node, "_mean")
    dev = c.apply(O.Binary("sub"), [x, mean], node, "_dev")
    sq = c.apply(O.Binary("mul"), [dev, dev], node, "_sq")
    ssum = c.apply(O.Reduce("sum", dims, keepdim), [sq], node, "_sum")
    var = c.apply(O.Scalar("div", float(max(n - correction, 0))), [ssum], node, var_suffix)
    if not keepdim:
        shape = tuple(int(s) for k, s in enumerate(val.shape) if k not in dims)
        mean = c.apply(O.Reshape(shape), [mean], node, "_m")
    return var, mean


def _var(c, node, x, dims=None, *, correction=None, keepdim=False):
    var, _ = _moments(c, node, x, dims, 1 if correction is None else correction, keepdim)
    return var


def _var_mean(c, node, x, dims=None, *, correction=None, keepdim=False):
    return _moments(c, node, x, dims, 1 if correction is None else correction, keepdim)


class _RunningStat:
    """What batch norm gives a running statistic of the step: the batch's ``stat`` [C] and the ``momentum``."""

    __slots__ = ("stat", "momentum")

    def __init__(self, stat: _T, momentum: float):
        self.stat, self.momentum = stat, momentum


def _batch_norm(c, node, x, w, b, running_mean, running_var, training, momentum, eps):
    """Batch norm (``_native_batch_norm_legit_functional``) over every dim but the channels (dim 1). Training:
    normalised by the batch's :func:`_moments` (biased variance); otherwise by the running statistics (folded
    constants). Outputs: the normalised tensor; the saved statistics (the backward's business) are no graph
    tensors; in training, the running statistics' updates (:class:`_RunningStat`: the batch's mean and unbiased
    variance per channel, ``_batch_mean`` and ``_batch_var``, become graph outputs; the step applies them,
    :class:`~shardflow.graph.graph.BufferUpdate`)."""
    val = node.args[0].meta["val"]
    nd = val.ndim
    stat_shape = (int(val.shape[1]),) + (1,) * (nd - 2)  # [C, 1, ...]: broadcasts against [N, C, *spatial]
    running: tuple[_RunningStat | None, ...] = (None, None)
    if training:
        var, mean = _moments(c, node, x, (0, *range(2, nd)), 0, True, "_var")
        rstd = c.apply(O.Unary("rsqrt"), [c.apply(O.Scalar("add", eps), [var], node, "_eps")], node, "_rstd")
        if running_mean is not None:
            n = val.numel() // stat_shape[0]  # elements per channel; the running variance is the unbiased one
            unbiased = c.apply(O.Scalar("mul", n / max(n - 1, 1)), [var], node, "_unbiased")
            running = (
                _RunningStat(c.apply(O.Reshape(stat_shape[:1]), [mean], node, "_batch_mean"), momentum),
                _RunningStat(c.apply(O.Reshape(stat_shape[:1]), [unbiased], node, "_batch_var"), momentum),
            )
    else:
        mean, rstd = running_mean.reshape(stat_shape), torch.rsqrt(running_var + eps).reshape(stat_shape)
    out = c.apply(
        O.Binary("mul"),
        [c.apply(O.Binary("sub"), [x, mean], node, "_centred"), rstd],
        node,
        "_normed" if w is not None or b is not None else "",
    )
    if w is not None:
        w = c.apply(O.Reshape(stat_shape), [w], node, "_w")
        out = c.apply(O.Binary("mul"), [out, w], node, "_scaled" if b is not None else "")
    if b is not None:
        b = c.apply(O.Reshape(stat_shape), [b], node, "_b")
        out = c.apply(O.Binary("add"), [out, b], node)
    return out, None, None, *running


def _batch_norm_eval(c, node, x, w, b, running_mean, running_var, momentum, eps):
    """``_native_batch_norm_legit_no_training`` (a model captured in eval mode): the running statistics."""
    return _batch_norm(c, node, x, w, b, running_mean, running_var, False, momentum, eps)[:3]


def _softmax(log: bool) -> Callable:
    def handler(c, node, x, dim, half_to_float=False):
        if half_to_float:
            return None
        return c.apply(O.Softmax(_dim(dim, len(c.shape(node))), log), [x], node)

    return handler


def _linear(c, node, x, w, b=None):
    return c.apply(O.Linear(bias=b is not None), [x, w] + ([b] if b is not None else []), node)


def _addmm(c, node, b, x, w, *, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        return None
    return c.apply(O.Linear(bias=True, transposed=True), [x, w, b], node)


def _matmul(c, node, a, b):
    w = _transposed_weight(c, node.args[1])
    if w is not None:  # x @ W.T (Falcon's FalconLinear): the linear it computes, which tensor parallelism plans
        return c.apply(O.Linear(bias=False), [a, w], node)
    return c.apply(O.Matmul(), [a, b], node)


def _transposed_weight(c, node: Any) -> _T | None:
    """The parameter W ``[out, in]`` when fx ``node`` is its transpose (``W.T``, ``W.t()``: ATen ``permute(W, [1, 0])``
    or ``t(W)``), else None."""
    if not isinstance(node, torch.fx.Node) or not (
        node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0])
    ):
        return None
    w = c.env.get(node.args[0])
    return w if isinstance(w, _T) and c.b.tensors[w.name].role == TensorRole.WEIGHT else None


def _embedding(c, node, w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        return None
    return c.apply(O.Embedding(padding_idx), [idx, w], node)


def _layer_norm(c, node, x, shape, w=None, b=None, eps=1e-5, cudnn_enable=True):
    ins = [x] + ([w] if w is not None else []) + ([b] if w is not None and b is not None else [])
    if w is None and b is not None:
        return None
    return c.apply(O.LayerNorm(len(shape), eps, w is not None, b is not None), ins, node)


def _dropout(c, node, x, p, train):
    if train is False or p == 0:
        out = x
    else:
        out = c.apply(O.Dropout(p), [x], node)
    return out, None  # the mask output: reading it is unsupported (None is no graph tensor)


def _sdpa(c, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    if dropout_p:
        raise CaptureError(
            f"ATen node {node.name!r}: attention dropout (p={dropout_p}) is not supported: its mask "
            f"is drawn inside the fused kernel. Set the model's attention dropout to 0 "
            f"(Hugging Face: attn_pdrop=0.0 / attention_dropout=0.0)"
        )
    if isinstance(attn_mask, torch.Tensor) and c.causal(
        attn_mask, c.shape(node.args[0])[-2], c.shape(node.args[1])[-2]
    ):
        attn_mask, is_causal = None, True
    sources = [_repeated_heads(n) for n in node.args[1:3]]
    if (
        attn_mask is None
        and not enable_gqa
        and None not in sources
        and c.shape(sources[0])[:-2] == c.shape(sources[1])[:-2]
    ):
        k, v, enable_gqa = c.env[sources[0]], c.env[sources[1]], True
    heads = [c.shape(a)[-3:-2] for a in node.args[:3]]  # (H,), (Hkv,), (Hkv,)
    if heads[1] == heads[2] == (1,) != heads[0]:
        enable_gqa = True  # one key/value head that sdpa broadcasts over the query heads: multi-query attention
    ins = [q, k, v] + ([attn_mask] if attn_mask is not None else [])
    return c.apply(O.Attention(bool(is_causal), scale, attn_mask is not None, bool(enable_gqa)), ins, node)


def _is_causal_mask(mask: torch.Tensor, t: int, s: int) -> bool:
    """``mask`` (a constant of the capture) is the causal mask of ``[T, S]`` scores, broadcast: True (bool) or 0
    (float) on and below the diagonal, False or −inf above — what ``is_causal`` applies without a mask (torch's
    top-left alignment). Hugging Face models build it as a tensor when traced; as the flag, attention skips the
    masked blocks (and may read grouped key/value heads unrepeated, :func:`_repeated_heads`)."""
    if mask.ndim < 2 or tuple(mask.shape[-2:]) != (t, s) or mask.device.type == "meta":
        return False
    mask = mask[tuple(slice(0, 1) if n == 0 else slice(None) for n in mask.stride()[:-2])]  # expanded dims: once
    lower = torch.ones(t, s, dtype=torch.bool, device=mask.device).tril()
    want = (
        lower
        if mask.dtype == torch.bool
        else torch.zeros(t, s, dtype=mask.dtype, device=mask.device).masked_fill(~lower, float("-inf"))
    )
    return torch.equal(mask, want.expand(mask.shape))


def _repeated_heads(node: Any) -> torch.fx.Node | None:
    """The key or value heads ``x`` ``[*, Hkv, S, D]`` when ``node`` repeats each head n times in place, as Hugging
    Face's ``repeat_kv`` writes it: ``x.unsqueeze(-3).expand(*, Hkv, n, S, D).reshape(*, Hkv·n, S, D)``. Attention
    with ``enable_gqa`` on ``x`` reads the same head for each query head (query head h: key/value head h // n),
    without the repeated copy or the sum of its gradient."""
    expanded = node
    while isinstance(expanded, torch.fx.Node) and expanded.target in _RESHAPES and expanded.args:
        expanded = expanded.args[0]  # reshape: a view, or a clone and a view
    one = expanded.args[0] if isinstance(expanded, torch.fx.Node) and expanded.target is aten.expand.default else None
    x = one.args[0] if isinstance(one, torch.fx.Node) and one.target in (aten.unsqueeze.default, *_RESHAPES) else None
    if not all(
        isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) for n in (node, expanded, one, x)
    ):
        return None
    xs, ones, es, os_ = (tuple(n.meta["val"].shape) for n in (x, one, expanded, node))
    return (
        x
        if len(xs) >= 3
        and ones == xs[:-2] + (1,) + xs[-2:]
        and es == xs[:-2] + (es[-3],) + xs[-2:]
        and os_ == xs[:-3] + (xs[-3] * es[-3],) + xs[-2:]
        else None
    )


_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default)


def _where(c, node, cond, a, b):
    zero = 2 if _zero(b) else 1 if _zero(a) else None
    return c.apply(O.Where(zero), [cond, a, b], node)


def _zero(v) -> bool:
    """Whether lifted argument ``v`` is zero everywhere and known at capture (a number, or a folded tensor)."""
    return not isinstance(v, _T) and not bool(torch.as_tensor(v).any())


def _gather(c, node, x, dim, index, *, sparse_grad=False):
    return c.apply(O.Gather(_dim(dim, len(c.shape(node)))), [x, index], node)


def _topk(c, node, x, k, dim=-1, largest=True, sorted=True):
    nd = len(node.args[0].meta["val"].shape)
    outs = c.b.apply(O.TopK(int(k), _dim(dim, nd), bool(largest), bool(sorted)), [c.tensor(x)], name=node.name)
    return tuple(_T(o) for o in outs)


def _sort(c, node, x, dim=-1, descending=False, *, stable=False):
    nd = len(node.args[0].meta["val"].shape)
    outs = c.b.apply(O.Sort(_dim(dim, nd), bool(descending), bool(stable)), [c.tensor(x)], name=node.name)
    return tuple(_T(o) for o in outs)


def _sort_stable(c, node, x, *, stable=None, dim=-1, descending=False):
    return _sort(c, node, x, dim, descending, stable=bool(stable))


def _cumsum(c, node, x, dim, *, dtype=None):
    return c.apply(O.Cumsum(_dim(dim, len(c.shape(node))), dtype_name(dtype) if dtype is not None else ""), [x], node)


def _index_add(c, node, x, dim, index, source, *, alpha=1):
    return c.apply(O.IndexAdd(_dim(dim, len(c.shape(node))), alpha), [x, index, source], node)


def _index_put(c, node, x, indices, values, accumulate=False):
    """``x.index_put_((index,), values, accumulate=True)`` with one 1-D index over dim 0 — what torch.export makes of
    ``index_add`` along dim 0 — is :class:`~shardflow.graph.ops.IndexAdd`; any other form stays the generic op."""
    shape = tuple(node.args[0].meta["val"].shape)
    if not accumulate or len(indices) != 1 or indices[0] is None:
        return None
    index, source = node.args[1][0].meta["val"], node.args[2].meta["val"]
    if index.ndim != 1 or index.dtype != torch.int64 or tuple(source.shape) != tuple(index.shape) + shape[1:]:
        return None
    return c.apply(O.IndexAdd(0), [x, indices[0], values], node)


def _full_like(c, node, x, value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return c.apply(O.FullLike(value, dtype_name(dtype) if dtype is not None else ""), [x], node)


def _scatter_value(c, node, x, dim, index, value):
    return c.apply(O.Scatter(_dim(dim, len(c.shape(node))), value), [x, index], node)


def _histc(c, node, x, bins=100, min=0, max=0):
    return c.apply(O.Histc(int(bins), float(min), float(max)), [x], node)


def _pad(c, node, x, pad, value=0):
    return c.apply(O.Pad(tuple(int(p) for p in pad), value), [x], node)


def _conv(c, node, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        return None
    ins = [x, w] + ([b] if b is not None else [])
    return c.apply(O.Conv(tuple(stride), tuple(padding), tuple(dilation), int(groups), b is not None), ins, node)


def _pool_dims(kernel, stride, padding, dilation=1) -> tuple[tuple[int, ...], ...]:
    """ATen's pooling sizes, each a list of 1 or n ints (an empty stride means the kernel), as n-tuples."""
    n = len(kernel)

    def full(v):
        v = [v] if isinstance(v, int) else list(v)
        return tuple(int(x) for x in (v * n if len(v) == 1 else v))

    return full(kernel), full(stride or kernel), full(padding), full(dilation)


def _max_pool(c, node, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    k, st, pad, dil = _pool_dims(kernel, stride, padding, dilation)
    return c.apply(O.Pool("max", k, st, pad, dil, bool(ceil_mode)), [x], node), None  # indices: backward only


def _avg_pool(c, node, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    k, st, pad, _ = _pool_dims(kernel, stride, padding)
    op = O.Pool("avg", k, st, pad, (1,) * len(k), bool(ceil_mode), bool(count_include_pad), divisor_override or 0)
    return c.apply(op, [x], node)


def _skip(c, node, *args, **kwargs):
    return ()


LIFT: dict[Any, Callable] = {
    aten.linear.default: _linear,
    aten.addmm.default: _addmm,
    aten.mm.default: _matmul,
    aten.bmm.default: _matmul,
    aten.matmul.default: _matmul,
    aten.embedding.default: _embedding,
    aten.layer_norm.default: _layer_norm,
    aten.native_dropout.default: _dropout,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.convolution.default: _conv,
    aten.max_pool2d_with_indices.default: _max_pool,
    aten.max_pool3d_with_indices.default: _max_pool,
    aten.avg_pool1d.default: _avg_pool,
    aten.avg_pool2d.default: _avg_pool,
    aten.avg_pool3d.default: _avg_pool,
    aten._softmax.default: _softmax(False),
    aten._log_softmax.default: _softmax(True),
    aten.where.self: _where,
    aten.gather.default: _gather,
    aten.topk.default: _topk,
    aten.histc.default: _histc,
    aten.sort.default: _sort,
    aten.sort.stable: _sort_stable,
    aten.cumsum.default: _cumsum,
    aten.index_add.default: _index_add,
    aten.index_put.default: _index_put,
    aten.full_like.default: _full_like,
    aten.scatter.value: _scatter_value,
    aten.constant_pad_nd.default: _pad,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _alias,
    aten.alias.default: _alias,
    aten.detach.default: _detach,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.squeeze.dims: _view,
    aten.squeeze.dim: _view,
    aten.squeeze.default: _view,
    aten.unsqueeze.default: _view,
    aten.permute.default: _permute,
    aten.t.default: _transpose,
    aten.view_as_complex.default: _complex_view(True),
    aten.view_as_real.default: _complex_view(False),
    aten.transpose.int: _transpose,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.slice_scatter.default: _slice_scatter,
    aten.copy.default: _copy,
    aten.select.int: _select,
    aten.split_with_sizes.default: _split_sizes,
    aten.split.Tensor: _split,
    aten.cat.default: _cat,
    aten.sum.dim_IntList: _reduce("sum"),
    aten.sum.default: _reduce_all("sum"),
    aten.mean.dim: _reduce("mean"),
    aten.mean.default: _reduce_all("mean"),
    aten.amax.default: _reduce("amax"),
    aten.amin.default: _reduce("amin"),
    aten.var.correction: _var,
    aten.var_mean.correction: _var_mean,
    aten._native_batch_norm_legit_functional.default: _batch_norm,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_eval,
    aten.add.Tensor: _binary("add", "add", "add"),
    aten.sub.Tensor: _binary("sub", "sub", "rsub"),
    aten.mul.Tensor: _binary("mul", "mul", "mul"),
    aten.div.Tensor: _binary("div", "div", "rdiv"),
    aten.pow.Tensor_Tensor: _binary("pow"),
    aten.maximum.default: _binary("maximum"),
    aten.minimum.default: _binary("minimum"),
    aten.add.Scalar: _scalar("add"),
    aten.sub.Scalar: _scalar("sub"),
    aten.rsub.Scalar: _scalar("rsub"),
    aten.mul.Scalar: _scalar("mul"),
    aten.div.Scalar: _scalar("div"),
    aten.pow.Tensor_Scalar: _scalar("pow"),
    aten._assert_tensor_metadata.default: _skip,
}
for _fn in ("eq", "ne", "lt", "le", "gt", "ge"):
    LIFT[getattr(aten, _fn).Tensor] = _binary(_fn, _fn)
    LIFT[getattr(aten, _fn).Scalar] = _scalar(_fn)
for _fn in ("bitwise_and", "bitwise_or"):
    LIFT[getattr(aten, _fn).Tensor] = _binary(_fn)
for _fn in (
    "relu",
    "tanh",
    "neg",
    "silu",
    "sigmoid",
    "rsqrt",
    "sqrt",
    "exp",
    "log",
    "cos",
    "sin",
    "abs",
    "erf",
    "logical_not",
    "bitwise_not",
):
    LIFT[getattr(aten, _fn).default] = _unary(_fn)
LIFT[aten.gelu.default] = _gelu
