"""Capture an ``nn.Module`` as a :class:`ComputationGraph` with ``torch.fx``.

:func:`capture` traces the module with ``torch.fx.symbolic_trace`` (torch.nn modules stay leaves) and
walks the fx nodes in order, evaluating each one with PyTorch at the same time, in one of two ways:

* a node that reads a graph tensor (a data input, a parameter, or something computed from them; every
  ``call_module`` node) is evaluated on the ``meta`` device: PyTorch computes its shapes and dtypes, no
  values, so capture costs the same for any batch size. It becomes graph nodes through
  :class:`GraphBuilder`, and each resulting tensor's shape and dtype are checked against what PyTorch
  gives for that fx node;
* a node whose arguments are all constants (ints, ``torch.Size``, buffers, ``torch.arange(T)``, ...) is
  folded: it runs eagerly on real values, and a folded tensor read by a graph op becomes a ``constant``
  tensor with that value.

Meta evaluation never reads the values of graph tensors, so a forward that needs them (``.item()``, a
data-dependent shape) is a :class:`CaptureError` naming the fx node. A graph tensor's ``.device`` reads as
the example inputs' device (CPU if they are meta), so ``torch.arange(T, device=idx.device)`` folds to a
real constant. Since no values are computed, a folded index tensor read by an embedding (positions
``arange(T)`` with ``T > block_size``) is range-checked when its graph node is built. Equal meta evaluations
(the same function or supported module on the same shapes, dtypes and strides: the blocks of a deep model)
run once.

Parameters become ``weight`` tensors named by their ``named_parameters()`` key (tied parameters: one
weight under the first name). Each graph node's scope is the module path it came from.
"""

from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from shardflow.graph import ComputationGraph, GraphBuilder, OpError
from shardflow.graph.ops import TensorType, dtype_name


class CaptureError(ValueError):
    """The module cannot be captured: an unsupported module, function or argument, or bad example inputs."""


@dataclass(frozen=True)
class _G:
    """A graph tensor (by its builder name) standing for an fx node's value."""

    name: str


def capture(module: nn.Module, example_inputs: Mapping[str, torch.Tensor], *, loss: bool = True) -> ComputationGraph:
    """Trace ``module`` with torch.fx and rebuild its forward as a :class:`ComputationGraph`.

    Args:
        module: the model; its ``forward`` args are the graph's data inputs.
        example_inputs: forward arg name → example tensor (e.g. ``idx [B, T]`` int64); the graph's input
            shapes and dtypes are these tensors'. Only their shapes and dtypes are read, so they may be
            ``meta`` tensors (``torch.empty(B, T, dtype=torch.long, device="meta")``): a huge batch is
            captured without allocating it.
        loss: if true, the forward's single scalar output (shape ``[]``) becomes the graph's ``loss``.

    Returns:
        The graph: inputs named by forward arg; one weight per ``module.named_parameters()`` entry, by that
        name (tied parameters once); constants for buffers and folded tensors; outputs as the forward returns.

    Raises:
        CaptureError: an example input is missing or extra, fx cannot trace the module, a module/function/
            argument is unsupported (the message names the module path and fx node, and lists what is
            supported), the module fails to run on the examples' shapes (including a forward that needs the
            values of its inputs or parameters), a captured shape differs from PyTorch's,
            the forward returns something other than tensors computed from the inputs, or ``loss`` is set
            and the outputs do not hold exactly one scalar.
    """
    try:
        gm = fx.symbolic_trace(module)
    except Exception as e:  # fx raises many kinds (TraceError, TypeError, NotImplementedError, ...)
        raise CaptureError(f"torch.fx cannot trace {type(module).__name__}: {e}") from e
    gm.graph.eliminate_dead_code()
    return _Capture(module, gm, example_inputs).run(loss)


class _Capture:
    def __init__(self, module: nn.Module, gm: fx.GraphModule, example_inputs: Mapping[str, torch.Tensor]):
        self.gm = gm
        self.b = GraphBuilder()
        # fx node -> its value: a meta tensor (no data) for a node that reads graph tensors, real if folded
        self.value: dict[fx.Node, Any] = {}
        self.on_meta: set[fx.Node] = set()  # fx nodes evaluated on the meta device
        self.graph: dict[fx.Node, _G | tuple[_G, ...]] = {}  # fx node -> graph tensor(s), if it has any
        self.consts: dict[fx.Node, _G] = {}  # folded fx node -> its graph constant, once an op reads it
        self.meta_consts: dict[fx.Node, Any] = {}  # folded fx node -> its value moved to meta, once one reads it
        self.meta_memo: dict[tuple, Any] = {}  # _meta_key of an evaluation -> its meta value

        placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        missing = [p for p in placeholders if p not in example_inputs]
        extra = [k for k in example_inputs if k not in placeholders]
        if missing or extra:
            raise CaptureError(
                f"example_inputs must give one tensor per forward arg {placeholders}; "
                f"missing {missing}, unexpected {extra}"
            )
        self.examples: dict[str, torch.Tensor] = {}  # forward arg -> its example on meta
        for name in placeholders:
            x = example_inputs[name]
            if not isinstance(x, torch.Tensor):
                raise CaptureError(f"example input {name!r} must be a tensor, got {type(x).__name__}")
            self.examples[name] = x.detach().to("meta")
            self.b.input(name, x.shape, dtype_name(x.dtype))
        # what a graph tensor's .device reads as: the examples' device (CPU when they are meta)
        self.device = next((x.device for x in example_inputs.values() if not x.is_meta), torch.device("cpu"))
        self.weights: dict[int, str] = {}  # id(parameter) -> weight name; tied parameters share one
        for name, p in module.named_parameters():
            self.weights[id(p)] = self.b.weight(name, p.shape, dtype_name(p.dtype))
        # id(real parameter or buffer) -> its meta stand-in for evaluation (the real object keeps the name)
        self.meta_state = {id(t): t.detach().to("meta") for t in (*module.parameters(), *module.buffers())}

    # --- the walk ---------------------------------------------------------------------------------------
    def run(self, loss: bool) -> ComputationGraph:
        *body, output = self.gm.graph.nodes  # an fx graph ends with its output node
        with torch.no_grad():
            for node in body:
                if not self._reads_graph(node):
                    self.value[node] = self._eval(node)  # constant folding: the real value stands
                    continue
                self.value[node] = self._eval_meta(node)
                self.on_meta.add(node)
                value = self._graph_value(node)
                if value is not None:
                    self._check(node, value)
                    self.graph[node] = value
        return self._build(output, loss)

    def _reads_graph(self, node: fx.Node) -> bool:
        """Whether ``node`` reads a graph tensor: a data input, a parameter, or a value computed from them."""
        if node.op in ("placeholder", "call_module"):
            return True
        if node.op == "get_attr":
            return isinstance(operator.attrgetter(node.target)(self.gm), nn.Parameter)
        return any(a in self.graph for a in node.all_input_nodes)

    def _eval(self, node: fx.Node) -> Any:
        """A folded node's real value, computed eagerly from its constant arguments."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: self.value[a])
        try:
            if node.op == "get_attr":
                return operator.attrgetter(node.target)(self.gm)
            if node.op == "call_function":
                return node.target(*args, **kwargs)
            return getattr(args[0], node.target)(*args[1:], **kwargs)  # call_method
        except Exception as e:  # whatever the model's own code raises
            raise CaptureError(f"{self._where(node)}: running it on its constant arguments failed: {e}") from e

    def _eval_meta(self, node: fx.Node) -> Any:
        """The value of a node that reads graph tensors, on the meta device: shapes and dtypes, no data.

        Results are memoised by what determines them (the function, or a supported module's type and
        settings, and the arguments' shapes, dtypes and strides): the blocks of a deep model evaluate once.
        """
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._meta_arg)
        if node.op == "placeholder":
            return self.examples[node.target]
        if node.op == "get_attr":
            return self.meta_state[id(operator.attrgetter(node.target)(self.gm))]
        mod = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        state = {} if mod is None else {name: self.meta_state[id(t)] for name, t in (
            *mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False))}
        if mod is None:
            key = _meta_key((node.op, node.target, args, kwargs))
        else:  # the supported modules' outputs depend on nothing else; other modules are not memoised
            key = _meta_key((type(mod), mod.extra_repr(), mod.training, state, args, kwargs)) \
                if type(mod) in _MODULES else None
        if key is not None and key in self.meta_memo:
            return self.meta_memo[key]
        try:
            if node.op == "call_function":
                out = node.target(*args, **kwargs)
            elif node.op == "call_method":
                out = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                out = torch.func.functional_call(mod, state, args, kwargs) if state else mod(*args, **kwargs)
        except Exception as e:  # whatever the model's own code raises, or an op that needs values
            hint = ""
            if isinstance(e, NotImplementedError) or "meta" in str(e):
                hint = (" (capture computes everything that reads the inputs or parameters on the meta device, "
                        "without values: a forward that needs those values, e.g. .item() or a data-dependent "
                        "shape, cannot be captured)")
            raise CaptureError(
                f"{self._where(node)}: running it on the example inputs' shapes and dtypes (meta tensors) "
                f"failed: {e}{hint}"
            ) from e
        if isinstance(out, torch.device) and out.type == "meta":
            out = self.device  # x.device: constants made on it (torch.arange(T, device=...)) must be real
        if key is not None and isinstance(out, (torch.Tensor, tuple, *_KEY_ATOMS)):  # shared, so nothing mutable
            self.meta_memo[key] = out
        return out

    def _meta_arg(self, a: fx.Node) -> Any:
        """An argument of a meta evaluation: a folded node's real tensors move to meta (values are not needed)."""
        if a in self.on_meta:
            return self.value[a]
        if a not in self.meta_consts:
            self.meta_consts[a] = _to_meta(self.value[a])
        return self.meta_consts[a]

    def _graph_value(self, node: fx.Node) -> _G | tuple[_G, ...] | None:
        """The graph tensor(s) for ``node`` (adding graph nodes), or None if its value is not a tensor."""
        if node.op == "placeholder":
            return _G(node.target)
        if node.op == "get_attr":
            return _G(self.weights[id(operator.attrgetter(node.target)(self.gm))])
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._arg)
        try:
            with self.b.scope(_scope(node)):
                if node.op == "call_module":
                    mod = self.gm.get_submodule(node.target)
                    if type(mod) not in _MODULES:
                        raise CaptureError(f"unsupported module type nn.{type(mod).__name__}; {_SUPPORTED}")
                    return _wrap(_MODULES[type(mod)](self, mod, *args, **kwargs))
                table = _FUNCTIONS if node.op == "call_function" else _METHODS
                if node.target not in table:
                    what = _fn_name(node.target) if node.op == "call_function" else f"tensor method .{node.target}()"
                    raise CaptureError(f"unsupported function {what}; {_SUPPORTED}")
                return _wrap(table[node.target](self, *args, **kwargs))
        except (CaptureError, OpError, TypeError) as e:
            raise CaptureError(f"{self._where(node)}: {e}") from e

    def _arg(self, a: fx.Node) -> Any:
        """An argument as a handler sees it: a graph tensor, or a constant (a folded tensor as a graph constant)."""
        if a in self.graph:
            return self.graph[a]
        value = self.value[a]
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_meta:
            raise CaptureError(
                f"{self._where(a)}: this tensor is a constant of the graph but has no value (it is on the meta "
                f"device); buffers and tensors made by the forward (torch.arange, ...) must be real"
            )
        if a not in self.consts:
            self.consts[a] = _G(self.b.constant(a.target if a.op == "get_attr" else a.name, value))
        return self.consts[a]

    def _check(self, node: fx.Node, value: _G | tuple[_G, ...]) -> None:
        """Each graph tensor must have the shape and dtype PyTorch gave the fx node."""
        torch_value = self.value[node]
        got = value if isinstance(value, tuple) else (value,)
        want = tuple(torch_value) if isinstance(torch_value, (tuple, list)) else (torch_value,)
        if len(got) != len(want) or not all(isinstance(w, torch.Tensor) for w in want):
            raise CaptureError(
                f"{self._where(node)}: PyTorch gives {type(torch_value).__name__}, the graph {len(got)} tensor(s)"
            )
        for g, w in zip(got, want):
            ty, wty = self.b.type_of(g.name), TensorType(tuple(w.shape), dtype_name(w.dtype))
            if ty != wty:
                raise CaptureError(
                    f"{self._where(node)}: graph tensor {g.name!r} is {ty.dtype}{list(ty.shape)} "
                    f"but PyTorch gives {wty.dtype}{list(wty.shape)}"
                )

    def _build(self, output: fx.Node, loss: bool) -> ComputationGraph:
        result = output.args[0]
        nodes = result if isinstance(result, (tuple, list)) else (result,)
        if not all(isinstance(n, fx.Node) and isinstance(self.graph.get(n), _G) for n in nodes):
            raise CaptureError(
                f"forward must return a tensor or a tuple of tensors computed from its inputs, got {result}"
            )
        outs = [self.graph[n].name for n in nodes]
        loss_name = None
        if loss:
            scalars = [o for o in outs if self.b.shape(o) == ()]
            if len(scalars) != 1:
                raise CaptureError(f"loss=True needs exactly one scalar output; outputs {outs} have {len(scalars)}")
            loss_name = scalars[0]
        return self.b.build(outs, loss_name)

    # --- helpers for the handlers -------------------------------------------------------------------------
    def name(self, x: Any) -> str:
        """Builder name of a tensor argument."""
        if not isinstance(x, _G):
            raise CaptureError(f"expected a tensor argument, got {x!r}")
        return x.name

    def operand(self, x: Any) -> str | float:
        """A tensor name or a Python number (an operand of add/sub/mul/div)."""
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return float(x)
        return self.name(x)

    def indices(self, idx: Any, n: int) -> str:
        """Builder name of an embedding's index tensor; a constant one (``torch.arange(T)``) must lie in ``[0, n)``.

        Meta evaluation does not look at values, so this is where a folded index out of range (a GPT run with
        ``T > block_size``) is caught.
        """
        name = self.name(idx)
        value = self.b.constants.get(name)
        if value is not None and value.numel() and not (0 <= int(value.min()) and int(value.max()) < n):
            raise CaptureError(
                f"constant indices {name!r} span [{int(value.min())}, {int(value.max())}] but the embedding "
                f"has {n} rows"
            )
        return name

    def param(self, p: torch.Tensor | None) -> str | None:
        """Weight name of a module's parameter (None stays None)."""
        return None if p is None else self.weights[id(p)]

    def _where(self, node: fx.Node) -> str:
        scope = _scope(node)
        return f"fx node {node.name!r} ({node.op} {_fn_name(node.target)}) in module {scope or '<root>'!r}"


def _scope(node: fx.Node) -> str:
    """The module path a node came from ('' for the root module's own forward)."""
    if node.op == "call_module":
        return node.target
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0] if stack else ""


def _to_meta(x: Any) -> Any:
    """``x`` with its tensors (also inside tuples and lists) moved to the meta device."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("meta")
    if type(x) in (tuple, list):  # plain ones; torch.Size and other tuple types stay as they are
        return type(x)(_to_meta(v) for v in x)
    return x


_KEY_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _meta_key(x: Any) -> tuple | None:
    """A hashable key that determines a meta evaluation's result, or None if ``x`` holds something else.

    A tensor is its shape, dtype, strides and offset; a number is its type and value (``x * 2`` and
    ``x * 2.0`` differ); functions and module types are themselves.
    """
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.stride(), x.storage_offset())
    if isinstance(x, (tuple, list)):
        parts = tuple(_meta_key(v) for v in x)
        return None if None in parts else (type(x), parts)
    if isinstance(x, dict):
        parts = tuple((k, _meta_key(v)) for k, v in x.items())
        return None if any(p is None for _, p in parts) else (dict, parts)
    if isinstance(x, _KEY_ATOMS) or callable(x) and hasattr(x, "__qualname__"):
        try:
            hash(x)
        except TypeError:  # e.g. a method bound to an unhashable object
            return None
        return (type(x), x)
    return None


def _wrap(result: Any) -> _G | tuple[_G, ...] | None:
    """Handler result (builder name(s), graph tensor(s) or None for a constant) as graph tensor(s)."""
    if isinstance(result, str):
        return _G(result)
    if isinstance(result, (tuple, list)):
        return tuple(_wrap(r) for r in result)
    return result


def _fn_name(f: Any) -> str:
    if isinstance(f, str):
        return f
    for prefix, mod in (("operator.", operator), ("torch.", torch), ("F.", F), ("", builtins)):
        if getattr(mod, getattr(f, "__name__", ""), None) is f:
            return prefix + f.__name__
    return repr(f)


def _reject(**bad: bool) -> None:
    """Raise naming the arguments whose flag is true."""
    if any(bad.values()):
        raise CaptureError(f"unsupported argument(s) {[k for k, v in bad.items() if v]}")


# --- handlers: (capture, *args, **kwargs) with the torch signature -> name(s), graph tensor(s) or None -----
def _arith(fn: str) -> Callable:
    def handler(c, a, b, *, alpha=1, rounding_mode=None):
        _reject(alpha=alpha != 1, rounding_mode=rounding_mode is not None)
        return getattr(c.b, fn)(c.operand(a), c.operand(b))
    return handler


def _unary(fn: str) -> Callable:
    def handler(c, x, *, inplace=False):
        _reject(inplace=inplace)
        return c.b.unary(fn, c.name(x))
    return handler


def _gelu(c, x, approximate="none"):
    return c.b.gelu(c.name(x), approximate)


def _dropout(c, x, p=0.5, training=True, inplace=False):
    _reject(inplace=inplace)
    return c.b.dropout(c.name(x), p if training else 0.0)


def _matmul(c, a, b):
    return c.b.matmul(c.name(a), c.name(b))


def _transpose(c, x, dim0, dim1):
    return c.b.transpose(c.name(x), dim0, dim1)


def _varargs(xs: tuple) -> tuple:
    """``f(1, 2)`` and ``f((1, 2))`` alike (view, reshape, permute)."""
    return tuple(xs[0]) if len(xs) == 1 and not isinstance(xs[0], int) else xs


def _permute(c, x, *dims):
    return c.b.permute(c.name(x), _varargs(dims))


def _reshape(c, x, *shape):
    return c.b.reshape(c.name(x), _varargs(shape))


def _split(c, x, sizes, dim=0):
    return c.b.split(c.name(x), sizes if isinstance(sizes, int) else tuple(sizes), dim)


def _chunk(c, x, chunks, dim=0):
    return c.b.chunk(c.name(x), chunks, dim)


def _softmax(c, x, dim=None, dtype=None, _stacklevel=3):
    _reject(implicit_dim=dim is None, dtype=dtype is not None)
    return c.b.softmax(c.name(x), dim)


def _reduce(fn: str) -> Callable:
    def handler(c, x, dim=None, keepdim=False, *, dtype=None):
        _reject(dtype=dtype is not None)
        return getattr(c.b, fn)(c.name(x), dim, keepdim)
    return handler


def _attention(c, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _reject(attn_mask=attn_mask is not None, dropout_p=dropout_p != 0.0, enable_gqa=enable_gqa)
    return c.b.attention(c.name(q), c.name(k), c.name(v), is_causal, scale)


def _cross_entropy(c, x, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    _reject(weight=weight is not None, size_average=size_average is not None, ignore_index=ignore_index != -100,
            reduce=reduce is not None, label_smoothing=label_smoothing != 0.0,
            reduction=reduction not in ("mean", "sum"))
    return c.b.cross_entropy(c.name(x), c.name(target), reduction)


def _layer_norm(c, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    _reject(bias_without_weight=weight is None and bias is not None)
    params = [c.name(p) if p is not None else None for p in (weight, bias)]
    return c.b.layer_norm(c.name(x), *params, eps=eps, ndim=len(normalized_shape))


def _linear(c, x, weight, bias=None):
    return c.b.linear(c.name(x), c.name(weight), c.name(bias) if bias is not None else None)


def _embedding(c, idx, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    _reject(padding_idx=padding_idx is not None, max_norm=max_norm is not None, scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse)
    return c.b.embedding(c.indices(idx, c.b.shape(c.name(weight))[0]), c.name(weight))


def _getitem(c, obj, index):
    if isinstance(obj, _G):
        raise CaptureError("indexing or slicing a tensor is not supported")
    return obj[index]  # one piece of a split/chunk


def _getattr(c, x, attr):
    if attr == "T":
        return c.b.permute(c.name(x), tuple(reversed(range(len(c.b.shape(c.name(x)))))))
    if attr in ("shape", "dtype", "device", "ndim"):
        return None
    raise CaptureError(f"tensor attribute .{attr} is not supported")


def _constant(c, x, *args, **kwargs):
    """size(), dim(): static, so the eager value stands."""
    return None


def _identity(c, x):
    return x


_FUNCTIONS: dict[Callable, Callable] = {
    operator.add: _arith("add"), torch.add: _arith("add"),
    operator.sub: _arith("sub"), torch.sub: _arith("sub"),
    operator.mul: _arith("mul"), torch.mul: _arith("mul"),
    operator.truediv: _arith("div"), torch.div: _arith("div"),
    operator.neg: _unary("neg"), torch.neg: _unary("neg"),
    torch.relu: _unary("relu"), F.relu: _unary("relu"), torch.tanh: _unary("tanh"), F.gelu: _gelu,
    F.dropout: _dropout,
    operator.matmul: _matmul, torch.matmul: _matmul, torch.bmm: _matmul,
    torch.transpose: _transpose, torch.permute: _permute, torch.reshape: _reshape,
    torch.split: _split, torch.chunk: _chunk,
    torch.softmax: _softmax, F.softmax: _softmax,
    torch.sum: _reduce("sum"), torch.mean: _reduce("mean"),
    F.scaled_dot_product_attention: _attention, F.cross_entropy: _cross_entropy,
    F.layer_norm: _layer_norm, F.linear: _linear, F.embedding: _embedding,
    operator.getitem: _getitem, getattr: _getattr,
}

_METHODS: dict[str, Callable] = {
    "add": _arith("add"), "sub": _arith("sub"), "mul": _arith("mul"), "div": _arith("div"),
    "neg": _unary("neg"), "relu": _unary("relu"), "tanh": _unary("tanh"),
    "matmul": _matmul, "bmm": _matmul, "transpose": _transpose, "permute": _permute,
    "view": _reshape, "reshape": _reshape, "split": _split, "chunk": _chunk, "softmax": _softmax,
    "sum": _reduce("sum"), "mean": _reduce("mean"),
    "contiguous": _identity, "size": _constant, "dim": _constant,
}


def _m_linear(c, m: nn.Linear, x):
    return c.b.linear(c.name(x), c.param(m.weight), c.param(m.bias))


def _m_embedding(c, m: nn.Embedding, idx):
    _reject(padding_idx=m.padding_idx is not None, max_norm=m.max_norm is not None,
            scale_grad_by_freq=m.scale_grad_by_freq, sparse=m.sparse)
    return c.b.embedding(c.indices(idx, m.num_embeddings), c.param(m.weight))


def _m_layer_norm(c, m: nn.LayerNorm, x):
    return c.b.layer_norm(c.name(x), c.param(m.weight), c.param(m.bias), m.eps, len(m.normalized_shape))


def _m_dropout(c, m: nn.Dropout, x):
    return _dropout(c, x, m.p, m.training, m.inplace)


def _m_unary(fn: str) -> Callable:
    def handler(c, m, x):
        return _unary(fn)(c, x, inplace=getattr(m, "inplace", False))
    return handler


_MODULES: dict[type[nn.Module], Callable] = {
    nn.Linear: _m_linear, nn.Embedding: _m_embedding, nn.LayerNorm: _m_layer_norm, nn.Dropout: _m_dropout,
    nn.GELU: lambda c, m, x: _gelu(c, x, m.approximate), nn.ReLU: _m_unary("relu"), nn.Tanh: _m_unary("tanh"),
    nn.Identity: lambda c, m, x: x,
}

_SUPPORTED = (
    f"supported modules: {sorted('nn.' + t.__name__ for t in _MODULES)}; "
    f"supported functions: {sorted({_fn_name(f) for f in _FUNCTIONS})}; "
    f"supported tensor methods: {sorted(_METHODS)}; anything on constants only is folded"
)
