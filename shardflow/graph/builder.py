"""Builder API: write a computation graph by hand, one op per call.

Example (a two-layer MLP with a loss)::

    b = GraphBuilder()
    x = b.input("x", (64, 32))                    # [B, in]
    y = b.input("y", (64,), "int64")              # [B]
    h = b.relu(b.dense(x, 128, name="fc1"))       # [B, hidden]
    logits = b.dense(h, 10, name="fc2")           # [B, classes]
    loss = b.cross_entropy(logits, y)
    graph = b.build(outputs=[loss], loss=loss)

Every method returns tensor names; shapes are inferred by each op's rule, so a mismatch fails at the call.
The torch.export capture (:mod:`shardflow.capture`) builds graphs through this same API.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch

from shardflow.graph import ops
from shardflow.graph.graph import ComputationGraph, Node, TensorRole, TensorSpec
from shardflow.graph.ops import Op, TensorType, dtype_name


class GraphBuilder:
    """Accumulates tensors and nodes; :meth:`build` returns the immutable :class:`ComputationGraph`."""

    def __init__(self) -> None:
        self.tensors: dict[str, TensorSpec] = {}
        self.nodes: list[Node] = []
        self.constants: dict[str, torch.Tensor] = {}
        self._scope: list[tuple[str, str]] = []  # (module path, source line)
        self._counts: dict[str, int] = {}
        self._names: set[str] = set()

    # --- names and scopes -----------------------------------------------------------------------------
    def _fresh(self, base: str) -> str:
        """``base``, or ``base_1``, ``base_2``, ... : unique among tensor and node names."""
        n = self._counts.get(base, 0)
        name = f"{base}_{n}" if n else base
        while name in self.tensors or name in self._names:
            n += 1
            name = f"{base}_{n}"
        self._counts[base] = n + 1
        self._names.add(name)
        return name

    @contextlib.contextmanager
    def scope(self, path: str, source: str = "") -> Iterator[None]:
        """Nodes created inside carry ``path`` as their module scope and ``source`` as their source line."""
        self._scope.append((path, source))
        try:
            yield
        finally:
            self._scope.pop()

    @property
    def current_scope(self) -> str:
        return self._scope[-1][0] if self._scope else ""

    @property
    def current_source(self) -> str:
        return self._scope[-1][1] if self._scope else ""

    def type_of(self, t: str) -> TensorType:
        return self.tensors[t].type

    def shape(self, t: str) -> tuple[int, ...]:
        return self.tensors[t].shape

    # --- leaves ---------------------------------------------------------------------------------------
    def _leaf(self, name: str, shape: Sequence[int], dtype: str, role: TensorRole) -> str:
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} is already defined")
        self.tensors[name] = TensorSpec(name, TensorType(tuple(int(s) for s in shape), dtype), role)
        return name

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> str:
        """A data input (e.g. a batch of tokens ``[B, T]``)."""
        return self._leaf(name, shape, dtype, TensorRole.INPUT)

    def weight(self, name: str, shape: Sequence[int], dtype: str = "float32") -> str:
        """A trainable parameter."""
        return self._leaf(name, shape, dtype, TensorRole.WEIGHT)

    def constant(self, name: str, value: torch.Tensor) -> str:
        """A tensor whose value is fixed when the graph is built (not trained)."""
        t = self._leaf(self._fresh(name), value.shape, dtype_name(value.dtype), TensorRole.CONSTANT)
        self.constants[t] = value.detach().clone()
        return t

    # --- the one way to add a node ----------------------------------------------------------------------
    def apply(self, op: Op, inputs: Sequence[str], name: str | None = None) -> tuple[str, ...]:
        """Add ``op(*inputs)``; returns its output tensor names. Raises :class:`OpError` on a shape mismatch."""
        for t in inputs:
            if t not in self.tensors:
                raise ValueError(f"{op.kind}: unknown tensor {t!r}")
        outs = op.infer(tuple(self.tensors[t].type for t in inputs))
        node_name = self._fresh(name or op.kind)
        out_names = [node_name] if len(outs) == 1 else [f"{node_name}.{i}" for i in range(len(outs))]
        for o, ty in zip(out_names, outs):
            self.tensors[o] = TensorSpec(o, ty, TensorRole.ACTIVATION)
        self.nodes.append(Node(node_name, op, tuple(inputs), tuple(out_names), self.current_scope, self.current_source))
        return tuple(out_names)

    def _one(self, op: Op, *inputs: str, name: str | None = None) -> str:
        return self.apply(op, inputs, name)[0]

    # --- layers with their own weights ----------------------------------------------------------------
    def dense(self, x: str, out_features: int, bias: bool = True, name: str = "dense") -> str:
        """A linear layer with fresh weights ``{name}.weight [out, in]`` and ``{name}.bias [out]``."""
        in_features = self.shape(x)[-1]
        w = self.weight(f"{name}.weight", (out_features, in_features), self.tensors[x].dtype)
        b = self.weight(f"{name}.bias", (out_features,), self.tensors[x].dtype) if bias else None
        with self.scope(name):
            return self.linear(x, w, b)

    # --- ops ------------------------------------------------------------------------------------------
    def linear(self, x: str, w: str, b: str | None = None) -> str:
        return self._one(ops.Linear(bias=b is not None), x, w, *([b] if b else []))

    def embedding(self, idx: str, w: str) -> str:
        return self._one(ops.Embedding(), idx, w)

    def layer_norm(self, x: str, w: str | None = None, b: str | None = None, eps: float = 1e-5, ndim: int = 1) -> str:
        params = [p for p in (w, b) if p is not None]
        return self._one(ops.LayerNorm(ndim, eps, affine=w is not None, bias=b is not None), x, *params)

    def dropout(self, x: str, p: float = 0.0) -> str:
        return self._one(ops.Dropout(p), x)

    def unary(self, fn: str, x: str) -> str:
        return self._one(ops.Unary(fn), x, name=fn)

    def relu(self, x: str) -> str:
        return self.unary("relu", x)

    def gelu(self, x: str, approximate: str = "none") -> str:
        return self.unary("gelu" if approximate == "none" else "gelu_tanh", x)

    def tanh(self, x: str) -> str:
        return self.unary("tanh", x)

    def neg(self, x: str) -> str:
        return self.unary("neg", x)

    def _arith(self, fn: str, a: str | float, b: str | float) -> str:
        if isinstance(a, str) and isinstance(b, str):
            return self._one(ops.Binary(fn), a, b, name=fn)
        if isinstance(a, str):
            return self._one(ops.Scalar(fn, float(b)), a, name=fn)
        if isinstance(b, str):
            rev = {"add": "add", "mul": "mul", "sub": "rsub", "div": "rdiv"}[fn]
            return self._one(ops.Scalar(rev, float(a)), b, name=fn)
        raise ValueError(f"{fn}: at least one operand must be a tensor")

    def add(self, a: str | float, b: str | float) -> str:
        return self._arith("add", a, b)

    def sub(self, a: str | float, b: str | float) -> str:
        return self._arith("sub", a, b)

    def mul(self, a: str | float, b: str | float) -> str:
        return self._arith("mul", a, b)

    def div(self, a: str | float, b: str | float) -> str:
        return self._arith("div", a, b)

    def matmul(self, a: str, b: str) -> str:
        return self._one(ops.Matmul(), a, b)

    def permute(self, x: str, dims: Sequence[int]) -> str:
        nd = len(self.shape(x))
        return self._one(ops.Permute(tuple(d % nd for d in dims)), x)

    def transpose(self, x: str, d0: int, d1: int) -> str:
        dims = list(range(len(self.shape(x))))
        d0, d1 = d0 % len(dims), d1 % len(dims)
        dims[d0], dims[d1] = dims[d1], dims[d0]
        return self.permute(x, dims)

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        shape = list(shape)
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = math.prod(self.shape(x)) // max(known, 1)
        return self._one(ops.Reshape(tuple(int(s) for s in shape)), x)

    def split(self, x: str, sizes: int | Sequence[int], dim: int = 0) -> tuple[str, ...]:
        """torch.split semantics: an int is the size of each piece (the last may be smaller)."""
        n = self.shape(x)[dim]
        if isinstance(sizes, int):
            sizes = [min(sizes, n - i) for i in range(0, n, sizes)]
        return self.apply(ops.Split(tuple(sizes), dim % len(self.shape(x))), [x])

    def chunk(self, x: str, chunks: int, dim: int = 0) -> tuple[str, ...]:
        n = self.shape(x)[dim]
        return self.split(x, -(-n // chunks), dim)

    def softmax(self, x: str, dim: int = -1) -> str:
        return self._one(ops.Softmax(dim % len(self.shape(x))), x)

    def _reduce(self, fn: str, x: str, dims: int | Sequence[int] | None, keepdim: bool) -> str:
        nd = len(self.shape(x))
        dims = range(nd) if dims is None else [dims] if isinstance(dims, int) else dims
        return self._one(ops.Reduce(fn, tuple(sorted(d % nd for d in dims)), keepdim), x, name=fn)

    def sum(self, x: str, dims: int | Sequence[int] | None = None, keepdim: bool = False) -> str:
        return self._reduce("sum", x, dims, keepdim)

    def mean(self, x: str, dims: int | Sequence[int] | None = None, keepdim: bool = False) -> str:
        return self._reduce("mean", x, dims, keepdim)

    def attention(self, q: str, k: str, v: str, causal: bool = True, scale: float | None = None) -> str:
        return self._one(ops.Attention(causal, scale), q, k, v)

    def cross_entropy(self, logits: str, target: str, reduction: str = "mean") -> str:
        return self._one(ops.CrossEntropy(reduction), logits, target, name="loss")

    # --- result ---------------------------------------------------------------------------------------
    def prune(self, outputs: Sequence[str]) -> None:
        """Drop the nodes none of whose outputs reaches ``outputs``, with their tensors and the constants only they
        read (the ops a rewrite at capture bypassed; inputs and weights stay, read or not)."""
        live = set(outputs)
        kept: list[Node] = []
        for n in reversed(self.nodes):
            if live.intersection(n.outputs):
                kept.append(n)
                live.update(n.inputs + n.outputs)
        self.nodes = kept[::-1]
        dead = [
            t
            for t, spec in self.tensors.items()
            if t not in live and spec.role in (TensorRole.ACTIVATION, TensorRole.CONSTANT)
        ]
        for t in dead:
            del self.tensors[t]
            self.constants.pop(t, None)

    def build(self, outputs: Sequence[str], loss: str | None = None) -> ComputationGraph:
        """The finished, validated graph."""
        return ComputationGraph(dict(self.tensors), tuple(self.nodes), tuple(outputs), loss, dict(self.constants))
