"""Capture any ``nn.Module`` as a :class:`ComputationGraph` through ``torch.export`` (the ATen front end): the walk
over the exported program that lifts it.

:func:`capture` runs ``torch.export.export`` on the module called as ``module(**batch)``, decomposes the
exported program to core ATen (:func:`~shardflow.capture.export.export`; :data:`~shardflow.capture.export.KEEP`
lists the few ops kept whole, and why), and lifts it node by node:

* parameters become ``weight`` tensors named by their module FQN (``model.layers.0.self_attn.q_proj.weight``;
  tied parameters appear once, as ``torch.export`` lists them), data inputs are named by the batch's keys; a
  fused linear's weight and bias whose output the model splits into equal parts (GPT-2's ``c_attn``: q|k|v) are
  stored by parts, ``[C, 3C]`` as ``[C, 3, C]`` (:func:`~shardflow.graph.fused.store_by_parts`), so tensor
  parallelism can shard each part by heads;
* a node whose arguments hold no graph tensor (masks from ``arange``/``cumsum``/``eq``, position ids, rotary
  tables from buffers) is **folded**: evaluated once on real values; a folded tensor read by a graph op becomes a
  ``constant`` tensor. A large element-wise fold whose operands are the same along dim 0 (a Hugging Face
  model's attention mask [B, 1, T, T], built for each of B equal rows) is computed for one row and expanded
  (:func:`_fold`): the same values, without B·T² bytes per step of the mask's making;
* every other node becomes one op of :mod:`shardflow.graph.ops` through the table
  :data:`~shardflow.capture.lift_table.LIFT` (ATen overload → handler), and an ATen op with no entry becomes a
  generic :class:`~shardflow.graph.ops.Aten` op (its rule replicates the inputs; ``shardflow plan`` lists it).
  Each node keeps the module path it ran in (from ``nn_module_stack``) as its scope, and each lifted tensor is
  checked against the shape and dtype export recorded.

The model contract: ``module(**batch)`` returns a scalar loss, or an object with a ``.loss`` (the Hugging Face
convention: pass ``labels``). Buffer mutations are batch norm's: its running statistics and batch counter
(``ComputationGraph.buffer_updates``: the batch's statistics are graph outputs, and the step blends them into the
buffers as ``nn.BatchNorm`` does); a forward that changes a buffer any other way is refused.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from shardflow.capture.experts import fuse_experts
from shardflow.capture.export import CaptureError, _source, export
from shardflow.capture.lift_table import _T, LIFT, _is_causal_mask, _RunningStat
from shardflow.graph import ComputationGraph, GraphBuilder, OpError
from shardflow.graph import ops as O
from shardflow.graph.fused import store_by_parts
from shardflow.graph.graph import BufferUpdate
from shardflow.graph.ops import TensorType, dtype_name

aten = torch.ops.aten


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
        self.causal_masks: dict[tuple[int, int, int], bool] = {}  # (id(mask), T, S) → whether it is causal
        state = {**ep.state_dict, **ep.constants}
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        self.buffers: dict[torch.fx.Node, str] = {}  # placeholder → the buffer's FQN
        self.frozen: set[str] = set()  # the weights of parameters with requires_grad=False
        tied: dict[int, _T] = {}
        placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]  # data inputs first, then the state
        for node in sorted(placeholders, key=lambda n: specs[n.name].kind != InputKind.USER_INPUT):
            spec = specs[node.name]
            if spec.kind == InputKind.PARAMETER:  # tied parameters: one weight, under the first name
                p = state[spec.target]
                if id(p) not in tied:
                    tied[id(p)] = _T(self.b.weight(_fqn(spec.target), p.shape, dtype_name(p.dtype)))
                    if not p.requires_grad:
                        self.frozen.add(tied[id(p)].name)
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
            raise CaptureError(
                f"the forward's output has shape {list(self.b.shape(out))}, not a scalar loss: return "
                f"the loss (Hugging Face models: pass labels in the batch)"
            )
        updates = {
            _fqn(s.target): self._buffer_update(a, _fqn(s.target))
            for a, s in zip(out_node.args[0], specs)
            if s.kind == OutputKind.BUFFER_MUTATION
        }
        stats = [u.stat for u in updates.values() if u.stat is not None]
        self.b.prune([out, *stats])  # the repeated key/value heads an attention no longer reads (lift_table._sdpa)
        graph = self.b.build([out, *stats], out if loss else None)
        frozen = frozenset(w for w in self.frozen if w in graph.tensors)
        return store_by_parts(fuse_experts(dataclasses.replace(graph, buffer_updates=updates, frozen=frozen)))

    def _buffer_update(self, node: torch.fx.Node, name: str) -> BufferUpdate:
        """How the step changes buffer ``name`` to the value of ``node``: a running statistic of batch norm, or a
        counter (``buffer + k``). Raises CaptureError for any other change."""
        value = self.env.get(node)
        if isinstance(value, _RunningStat):
            return BufferUpdate(value.momentum, value.stat.name)
        if (
            node.target in (aten.add.Tensor, aten.add.Scalar)
            and len(node.args) == 2
            and self.buffers.get(node.args[0]) == name
            and isinstance(node.args[1], (int, float))
        ):
            return BufferUpdate(float(node.args[1]))
        raise CaptureError(
            f"the model's forward changes its buffer {name!r} (to a value of {node.target}, in module "
            f"{_scope(node) or '<root>'!r}); shardflow updates only batch norm's running statistics "
            f"and counters: keep the buffer constant in the forward, or update it outside the step"
        )

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
            self.env[node] = _fold(target, _real(args, meta), _real(kwargs, meta))
            return
        handler = LIFT.get(target)
        with self.b.scope(_scope(node), _source(node)):
            try:
                value = handler(self, node, *args, **kwargs) if handler else None
                if value is None:
                    value = self._generic(node, args, kwargs)
            except OpError as e:
                raise CaptureError(
                    f"ATen node {node.name!r} ({target}) in module {_scope(node) or '<root>'!r}: {e}"
                ) from None
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
                    raise CaptureError(
                        f"ATen node {node.name!r} ({node.target}) lifted to {got}, but export says "
                        f"{want}: a bug in shardflow's lifting of this op"
                    )

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

    def causal(self, mask: torch.Tensor, t: int, s: int) -> bool:
        """Whether folded ``mask`` is the causal mask of ``[T, S]`` scores (:func:`_is_causal_mask`), found once per
        mask (every layer of a Hugging Face model reads the same one)."""
        key = (id(mask), t, s)
        if key not in self.causal_masks:
            self.folded.append(mask)  # alive while the walk lasts, so its id stays its own
            self.causal_masks[key] = _is_causal_mask(mask, t, s)
        return self.causal_masks[key]

    def apply(self, op: O.Op, inputs: list, node: torch.fx.Node, suffix: str = "") -> _T:
        """The single output of ``op`` on ``inputs``, as the node called ``node.name + suffix`` (a handler that
        lifts one ATen node to several ops names the last one by the node and the others with a suffix)."""
        return _T(self.b.apply(op, [self.tensor(x) for x in inputs], name=node.name + suffix)[0])

    def shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        return tuple(int(s) for s in node.meta["val"].shape)


# element-wise ops (broadcasting their tensor operands) that :func:`_fold` may compute on one row of dim 0
_ELEMENTWISE = {
    *(getattr(aten, op).Tensor for op in ("eq", "ne", "le", "lt", "ge", "gt", "bitwise_and", "bitwise_or")),
    *(getattr(aten, op).Tensor for op in ("add", "sub", "mul", "div", "bitwise_xor")),
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_not.default,
    aten.bitwise_not.default,
    aten.where.self,
}
FOLD_BY_ROW_ABOVE = 2**20  # elements of a folded result beyond which a fold of equal rows is made of one row


def _fold(target: Any, args: tuple, kwargs: dict) -> Any:
    """``target(*args, **kwargs)`` on folded (real) values. An element-wise op (:data:`_ELEMENTWISE`) whose result
    has more than :data:`FOLD_BY_ROW_ABOVE` elements and whose tensor operands are each the same along the
    result's dim 0 (size 1 there, expanded, or equal rows) is computed on their first row and expanded to the
    result's shape (a view: dim 0's stride 0); the values are those of the whole computation. An op that refuses
    such a view (``view`` across its expanded dim) gets its operands whole."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if target not in _ELEMENTWISE or not tensors or kwargs or any(t.device.type == "meta" for t in tensors):
        return _whole(target, args, kwargs)
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    if len(shape) == 0 or shape[0] < 2 or shape.numel() <= FOLD_BY_ROW_ABOVE:
        return target(*args, **kwargs)
    rows = [_first_row(a, len(shape)) if isinstance(a, torch.Tensor) else a for a in args]
    if any(r is None for r in rows):
        return target(*args, **kwargs)
    return target(*rows).expand(shape)


def _whole(target: Any, args: tuple, kwargs: dict) -> Any:
    """``target(*args, **kwargs)``; where it raises on an operand :func:`_fold` expanded, again on it made whole."""
    try:
        return target(*args, **kwargs)
    except RuntimeError:
        if not any(isinstance(a, torch.Tensor) and 0 in a.stride() for a in args):
            raise
        return target(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)


def _first_row(t: torch.Tensor, ndim: int) -> torch.Tensor | None:
    """Operand ``t`` of a result of ``ndim`` dims, cut to the result's first row of dim 0 where it is the same along
    that dim (None where it is not)."""
    if t.ndim < ndim or t.shape[0] == 1:  # broadcast along the result's dim 0
        return t
    if t.stride(0) == 0 or torch.equal(t, t[:1].expand_as(t)):
        return t[:1]
    return None


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
