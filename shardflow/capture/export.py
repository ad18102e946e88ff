"""Capture any ``nn.Module`` as a :class:`ComputationGraph` through ``torch.export`` (the ATen front end).

:func:`capture` runs ``torch.export.export`` on the module called as ``module(**batch)``, decomposes the
exported program to core ATen (:data:`KEEP` lists the few ops kept whole, and why), and lifts it node by node:

* parameters become ``weight`` tensors named by their module FQN (``model.layers.0.self_attn.q_proj.weight``;
  tied parameters appear once, as ``torch.export`` lists them), data inputs are named by the batch's keys; a
  fused linear's weight and bias whose output the model splits into equal parts (GPT-2's ``c_attn``: q|k|v) are
  stored by parts, ``[C, 3C]`` as ``[C, 3, C]`` (:func:`~shardflow.graph.fused.store_by_parts`), so tensor
  parallelism can shard each part by heads;
* a node whose arguments hold no graph tensor (masks from ``arange``/``cumsum``/``eq``, position ids, rotary
  tables from buffers) is **folded**: evaluated once on real values; a folded tensor read by a graph op becomes a
  ``constant`` tensor;
* every other node becomes one op of :mod:`shardflow.graph.ops` through the table :data:`LIFT` (ATen overload →
  handler), and an ATen op with no entry becomes a generic :class:`~shardflow.graph.ops.Aten` op (its rule
  replicates the inputs; ``shardflow plan`` lists it). Each node keeps the module path it ran in (from
  ``nn_module_stack``) as its scope, and each lifted tensor is checked against the shape and dtype export recorded.

The model contract: ``module(**batch)`` returns a scalar loss, or an object with a ``.loss`` (the Hugging Face
convention: pass ``labels``). Buffer mutations are batch norm's: its running statistics and batch counter
(``ComputationGraph.buffer_updates``: the batch's statistics are graph outputs, and the step blends them into the
buffers as ``nn.BatchNorm`` does); a forward that changes a buffer any other way is refused.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import traceback
import warnings
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from shardflow.graph import ComputationGraph, GraphBuilder, OpError
from shardflow.graph import ops as O
from shardflow.graph.fused import store_by_parts
from shardflow.graph.graph import BufferUpdate, TensorRole
from shardflow.graph.ops import TensorType, dtype_name, torch_dtype

aten = torch.ops.aten


class CaptureError(ValueError):
    """The module cannot be captured: export fails (the message names the model's source line and the usual
    fix), the batch does not fit, or the forward returns no scalar loss."""


# Ops kept undecomposed, because their rule is better than their decomposition's:
# * sdpa: heads (and a mask's broadcast dims) shard as one op; its decomposition (matmul, softmax, matmul with a
#   materialised [T, S] score tensor) would need the same rule spread over five ops and costs memory;
# * linear: one rule sees weight, bias and the contraction together (row/column parallel, the bias scaled once
#   for a partial output); decomposed it is a transpose, a matmul and a broadcast add on a flattened view;
# * layer_norm: one normalisation over whole trailing dims instead of mean/var/rsqrt chains (same rule: the
#   normalised dims must be whole, so nothing is lost by keeping it);
# * silu: one element-wise kernel forward and ``silu_backward`` backward, instead of a sigmoid and a mul forward and,
#   backward, muls, the sigmoid again and its backward (same rule: element-wise, not linear); measured on the tiny
#   Llama's single-device step (benchmarks/step.py, 16 × 128): 1.14 → 1.11 × eager.
KEEP = (aten.scaled_dot_product_attention.default, aten.linear.default, aten.layer_norm.default, aten.silu.default)


class _LossOf(nn.Module):
    """``module(**batch)``, reduced to its loss (a tensor, or ``.loss`` of what it returns)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, **batch):
        out = self.inner(**batch)
        loss = getattr(out, "loss", out)
        if not isinstance(loss, torch.Tensor):
            raise CaptureError(f"{type(self.inner).__name__}(**batch) must return a scalar loss tensor or an object "
                               f"with .loss (Hugging Face models: pass labels), got {type(out).__name__}")
        return loss


def export(module: nn.Module, batch: Mapping[str, torch.Tensor]) -> ExportedProgram:
    """``torch.export`` of ``module(**batch)`` reduced to its loss, decomposed to core ATen but :data:`KEEP`.

    Raises:
        CaptureError: export cannot trace the model; the message gives export's reason, the model's source line
            it failed on, and the usual fix.
    """
    seen: set[int] = set()
    distinct = {}  # export would make one input of a tensor passed under two names (idx and targets alike)
    for k, v in batch.items():
        distinct[k] = v.clone() if id(v) in seen else v
        seen.add(id(v))
    try:
        with warnings.catch_warnings():  # torch's own deprecations inside export are no news to the user
            warnings.simplefilter("ignore", FutureWarning)
            ep = torch.export.export(_LossOf(module), (), distinct, strict=False)
    except CaptureError:
        raise
    except Exception as e:  # export raises many kinds (UserError, GuardOnDataDependentSymNode, TypeError, ...)
        raise CaptureError(_export_failure(module, e)) from e
    table = torch.export.default_decompositions()
    for op in KEEP:
        table.pop(op, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ep.run_decompositions(table)


def _export_failure(module: nn.Module, e: Exception) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    where = _model_line(_frames(e))
    where = f" at {where}" if where else ""
    fix = ("pass use_cache=False in a Hugging Face model's config (no KV cache in training), and make sure the "
           "forward does not branch on tensor values (.item(), data-dependent shapes)")
    return f"torch.export cannot capture {type(module).__name__}{where}: {type(e).__name__}: {first}. Usual fix: {fix}"


def _model_line(frames: list[traceback.FrameSummary]) -> str:
    """``"file.py:123 (code)"`` of the innermost frame of the model's own code (neither torch's nor shardflow's),
    or "" if none."""
    frames = [f for f in frames if "/torch/" not in f.filename and "shardflow" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""


def _source(node: torch.fx.Node) -> str:
    """The model's source line that made fx ``node`` (:func:`_model_line` of the stack export recorded)."""
    return _model_line(traceback.StackSummary.from_list(_FRAME.findall(node.meta.get("stack_trace") or "")))


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n +(.*)')  # one frame of a formatted stack


def _frames(e: BaseException) -> list[traceback.FrameSummary]:
    out: list[traceback.FrameSummary] = []
    while e is not None:
        out += traceback.extract_tb(e.__traceback__)
        e = e.__cause__ or e.__context__
    return out


def capture(module: nn.Module, batch: Mapping[str, torch.Tensor], *, loss: bool = True) -> ComputationGraph:
    """The computation graph of ``module(**batch)``: core ATen, lifted to shardflow's ops.

    Args:
        module: any ``torch.export``-able model (Hugging Face, torchtitan, your own). Its parameters' dtype and
            device are the graph's (call ``module.double()`` first for float64).
        batch: keyword arguments of the forward → example tensors (e.g. ``input_ids [B, T]`` and ``labels [B, T]``,
            int64); the graph's inputs have their names, shapes and dtypes.
        loss: the single output (shape ``[]``) is the graph's loss; with ``loss=False`` the output may have any
            shape (it is not trained).

    Returns:
        The graph: one input per batch key, one weight per parameter (module FQNs), constants for buffers and
        folded tensors, one output.

    Raises:
        CaptureError: export fails (see :func:`export`), an example is not a tensor, a lifted shape differs from
            export's, or ``loss`` is set and the output is not a scalar.
    """
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            raise CaptureError(f"batch[{k!r}] must be a tensor, got {type(v).__name__}")
    return lift_exported(export(module, batch), batch, loss=loss)


def lift_exported(ep: ExportedProgram, batch: Mapping[str, torch.Tensor], *, loss: bool = True) -> ComputationGraph:
    """The computation graph of an exported program (:func:`export`'s, for ``module(**batch)``): what
    :func:`capture` returns. Each graph node that an ATen node lifted to carries its fx name (a node lifted to
    several ops names the last one so), so the two can be compared node by node.

    Raises:
        CaptureError: a lifted shape differs from export's, or ``loss`` is set and the output is not a scalar.
    """
    return _Lift(ep, batch).run(loss)


_PREFIX = "inner."


def _fqn(target: str) -> str:
    return target.removeprefix(_PREFIX)


def _scope(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]
    return "" if path in ("", "inner") else path.removeprefix(_PREFIX)


class _Lift:
    """One walk over an exported program's graph."""

    def __init__(self, ep: ExportedProgram, batch: Mapping[str, torch.Tensor]):
        self.ep = ep
        self.b = GraphBuilder()
        self.env: dict[torch.fx.Node, Any] = {}  # fx node → graph tensor name (str wrapped in _T) or a real value
        self.const_names: dict[int, str] = {}  # id(folded tensor) → its graph constant
        self.folded: list[torch.Tensor] = []
        self.parts: dict[str, tuple] = {}  # graph tensor a slice_scatter made → (dim, its (start, end, value)s)
        state = {**ep.state_dict, **ep.constants}
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        self.buffers: dict[torch.fx.Node, str] = {}  # placeholder → the buffer's FQN
        tied: dict[int, _T] = {}
        placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]  # data inputs first, then the state
        for node in sorted(placeholders, key=lambda n: specs[n.name].kind != InputKind.USER_INPUT):
            spec = specs[node.name]
            if spec.kind == InputKind.PARAMETER:  # tied parameters: one weight, under the first name
                p = state[spec.target]
                if id(p) not in tied:
                    tied[id(p)] = _T(self.b.weight(_fqn(spec.target), p.shape, dtype_name(p.dtype)))
                self.env[node] = tied[id(p)]
            elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                self.env[node] = state[spec.target].detach()
                self.buffers[node] = _fqn(spec.target)
            elif spec.kind == InputKind.USER_INPUT:
                x = batch[node.name]
                self.env[node] = _T(self.b.input(node.name, x.shape, dtype_name(x.dtype)))
            else:
                raise CaptureError(f"unsupported exported input {spec}")

    def run(self, loss: bool) -> ComputationGraph:
        out_node = None
        with torch.no_grad():
            for node in self.ep.graph.nodes:
                if node.op == "call_function":
                    self._call(node)
                elif node.op == "output":
                    out_node = node
        specs = self.ep.graph_signature.output_specs
        users = [a for a, s in zip(out_node.args[0], specs) if s.kind == OutputKind.USER_OUTPUT]
        if len(users) != 1 or not isinstance(self.env.get(users[0]), _T):
            raise CaptureError("the forward must return one tensor computed from the batch and the parameters")
        out = self.env[users[0]].name
        if loss and self.b.shape(out) != ():
            raise CaptureError(f"the forward's output has shape {list(self.b.shape(out))}, not a scalar loss: return "
                               f"the loss (Hugging Face models: pass labels in the batch)")
        updates = {_fqn(s.target): self._buffer_update(a, _fqn(s.target)) for a, s in zip(out_node.args[0], specs)
                   if s.kind == OutputKind.BUFFER_MUTATION}
        stats = [u.stat for u in updates.values() if u.stat is not None]
        self.b.prune([out, *stats])  # the repeated key/value heads an attention no longer reads (_sdpa)
        graph = self.b.build([out, *stats], out if loss else None)
        return store_by_parts(dataclasses.replace(graph, buffer_updates=updates))

    def _buffer_update(self, node: torch.fx.Node, name: str) -> BufferUpdate:
        """How the step changes buffer ``name`` to the value of ``node``: a running statistic of batch norm, or a
        counter (``buffer + k``). Raises CaptureError for any other change."""
        value = self.env.get(node)
        if isinstance(value, _RunningStat):
            return BufferUpdate(value.momentum, value.stat.name)
        if node.target in (aten.add.Tensor, aten.add.Scalar) and len(node.args) == 2 and \
                self.buffers.get(node.args[0]) == name and isinstance(node.args[1], (int, float)):
            return BufferUpdate(float(node.args[1]))
        raise CaptureError(f"the model's forward changes its buffer {name!r} (to a value of {node.target}, in module "
                           f"{_scope(node) or '<root>'!r}); shardflow updates only batch norm's running statistics "
                           f"and counters: keep the buffer constant in the forward, or update it outside the step")

    # --- nodes ----------------------------------------------------------------------------------------------
    def _call(self, node: torch.fx.Node) -> None:
        target = node.target
        if target is operator.getitem:
            src, i = node.args
            self.env[node] = self.env[src][i]
            return
        args = torch.fx.node.map_arg(node.args, self.env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, self.env.__getitem__)
        if not _has_graph_tensor((args, kwargs)):  # constant folding
            meta = _on_meta((args, kwargs))
            self.env[node] = target(*_real(args, meta), **_real(kwargs, meta))
            return
        handler = LIFT.get(target)
        with self.b.scope(_scope(node), _source(node)):
            try:
                value = handler(self, node, *args, **kwargs) if handler else None
                if value is None:
                    value = self._generic(node, args, kwargs)
            except OpError as e:
                raise CaptureError(f"ATen node {node.name!r} ({target}) in module {_scope(node) or '<root>'!r}: {e}") \
                    from None
        self._check(node, value)
        self.env[node] = value

    def _generic(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        tensors: list[str] = []

        def template(v):
            if isinstance(v, _T) or isinstance(v, torch.Tensor):
                tensors.append(self.tensor(v))
                return O.Arg(len(tensors) - 1)
            if isinstance(v, (list, tuple)):
                return tuple(template(x) for x in v)
            return v

        op = O.Aten(target_name(node.target), template(args), tuple((k, template(v)) for k, v in kwargs.items()))
        outs = self.b.apply(op, tensors, name=node.name)
        val = node.meta.get("val")
        return tuple(_T(o) for o in outs) if isinstance(val, (tuple, list)) else _T(outs[0])

    def _check(self, node: torch.fx.Node, value: Any) -> None:
        vals = node.meta.get("val")
        pairs = zip(value, vals) if isinstance(value, tuple) and vals is not None else [(value, vals)]
        for v, m in pairs:
            if isinstance(v, _T) and isinstance(m, torch.Tensor):
                got, want = self.b.type_of(v.name), TensorType(tuple(m.shape), dtype_name(m.dtype))
                if got != want:
                    raise CaptureError(f"ATen node {node.name!r} ({node.target}) lifted to {got}, but export says "
                                       f"{want}: a bug in shardflow's lifting of this op")

    # --- helpers for the handlers ---------------------------------------------------------------------------
    def tensor(self, v: Any) -> str:
        """Graph name of a tensor argument; a folded tensor (or a Python number) becomes a constant."""
        if isinstance(v, _T):
            return v.name
        if not isinstance(v, torch.Tensor):
            v = torch.tensor(v)
        if id(v) not in self.const_names:
            self.const_names[id(v)] = self.b.constant("const", v)
            self.folded.append(v)  # alive while the walk lasts, so its id stays its own
        return self.const_names[id(v)]

    def apply(self, op: O.Op, inputs: list, node: torch.fx.Node, suffix: str = "") -> _T:
        """The single output of ``op`` on ``inputs``, as the node called ``node.name + suffix`` (a handler that
        lifts one ATen node to several ops names the last one by the node and the others with a suffix)."""
        return _T(self.b.apply(op, [self.tensor(x) for x in inputs], name=node.name + suffix)[0])

    def shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        return tuple(int(s) for s in node.meta["val"].shape)


class _T:
    """A graph tensor (by builder name) standing for an fx node's value."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"_T({self.name!r})"


def _has_graph_tensor(x: Any) -> bool:
    if isinstance(x, _T):
        return True
    if isinstance(x, (list, tuple)):
        return any(_has_graph_tensor(v) for v in x)
    if isinstance(x, dict):
        return any(_has_graph_tensor(v) for v in x.values())
    return False


def _on_meta(x: Any) -> bool:
    """Whether a tensor among the arguments ``x`` lies on the meta device (a buffer of a model built there)."""
    if isinstance(x, torch.Tensor):
        return x.device.type == "meta"
    if isinstance(x, (list, tuple)):
        return any(_on_meta(v) for v in x)
    if isinstance(x, dict):
        return any(_on_meta(v) for v in x.values())
    return False


def _real(x: Any, meta: bool) -> Any:
    """Folded arguments. Where no tensor argument is on the meta device (``meta`` False), a ``meta`` device becomes
    the CPU: a model built on meta still folds its index tables and masks to real values. Where one is (a buffer
    such as rotary frequencies, whose values do not exist), every tensor argument moves to meta: the result is a
    shape, enough to plan with."""
    if isinstance(x, torch.device) and x.type == "meta" and not meta:
        return torch.device("cpu")
    if isinstance(x, torch.Tensor) and meta:
        return x.to("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_real(v, meta) for v in x)
    if isinstance(x, dict):
        return {k: _real(v, meta) for k, v in x.items()}
    return x


def target_name(target: Any) -> str:
    """``"aten.cumsum.default"`` for ``torch.ops.aten.cumsum.default``."""
    return str(target)


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


def _to_copy(c, node, x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
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
    steps = ([O.Expand(shape)] if c.b.shape(src.name) != shape else []) + \
        ([O.Cast(want)] if c.b.type_of(src.name).dtype != want else [])
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
            running = (_RunningStat(c.apply(O.Reshape(stat_shape[:1]), [mean], node, "_batch_mean"), momentum),
                       _RunningStat(c.apply(O.Reshape(stat_shape[:1]), [unbiased], node, "_batch_var"), momentum))
    else:
        mean, rstd = running_mean.reshape(stat_shape), torch.rsqrt(running_var + eps).reshape(stat_shape)
    out = c.apply(O.Binary("mul"), [c.apply(O.Binary("sub"), [x, mean], node, "_centred"), rstd], node,
                  "_normed" if w is not None or b is not None else "")
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
    if not isinstance(node, torch.fx.Node) or not (node.target is aten.t.default or (
            node.target is aten.permute.default and list(node.args[1]) == [1, 0])):
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
        raise CaptureError(f"ATen node {node.name!r}: attention dropout (p={dropout_p}) is not supported: its mask "
                           f"is drawn inside the fused kernel. Set the model's attention dropout to 0 "
                           f"(Hugging Face: attn_pdrop=0.0 / attention_dropout=0.0)")
    if isinstance(attn_mask, torch.Tensor) and _is_causal_mask(attn_mask, c.shape(node.args[0])[-2],
                                                             c.shape(node.args[1])[-2]):
        attn_mask, is_causal = None, True
    sources = [_repeated_heads(n) for n in node.args[1:3]]
    if attn_mask is None and not enable_gqa and None not in sources and \
            c.shape(sources[0])[:-2] == c.shape(sources[1])[:-2]:
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
    lower = torch.ones(t, s, dtype=torch.bool, device=mask.device).tril()
    want = lower if mask.dtype == torch.bool else \
        torch.zeros(t, s, dtype=mask.dtype, device=mask.device).masked_fill(~lower, float("-inf"))
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
    if not all(isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)
               for n in (node, expanded, one, x)):
        return None
    xs, ones, es, os_ = (tuple(n.meta["val"].shape) for n in (x, one, expanded, node))
    return x if len(xs) >= 3 and ones == xs[:-2] + (1,) + xs[-2:] and es == xs[:-2] + (es[-3],) + xs[-2:] and \
        os_ == xs[:-3] + (xs[-3] * es[-3],) + xs[-2:] else None


_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default)


def _where(c, node, cond, a, b):
    return c.apply(O.Where(), [cond, a, b], node)


def _gather(c, node, x, dim, index, *, sparse_grad=False):
    return c.apply(O.Gather(_dim(dim, len(c.shape(node)))), [x, index], node)


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


def _avg_pool(c, node, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
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
    aten.constant_pad_nd.default: _pad,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _alias,
    aten.alias.default: _alias,
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
for _fn in ("relu", "tanh", "neg", "silu", "sigmoid", "rsqrt", "sqrt", "exp", "log", "cos", "sin", "abs", "erf",
            "logical_not", "bitwise_not"):
    LIFT[getattr(aten, _fn).default] = _unary(_fn)
LIFT[aten.gelu.default] = _gelu
