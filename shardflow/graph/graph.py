"""The computation graph: named tensors with full shapes, and operator nodes in topological order.

Weights are explicit graph inputs (role ``weight``), as are data inputs (role ``input``) and constants
captured from the model (role ``constant``, e.g. the ``arange`` of positions). Nothing here knows about
devices; :mod:`shardflow.parallel.pcg` lifts this graph to a parallel computation graph.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Mapping

import torch

from shardflow.graph.ops import OPS, Arg, Experts, Histc, Op, TensorType, dtype_name, torch_dtype


class TensorRole(StrEnum):
    """What a graph tensor is: a data input of each step, a trained weight, a constant captured from the model,
    or an activation some node computes. The value is the spelling in graph files and listings."""

    INPUT = "input"
    WEIGHT = "weight"
    CONSTANT = "constant"
    ACTIVATION = "activation"


@dataclass(frozen=True, slots=True)
class BufferUpdate:
    """How a training step changes a buffer of the module outside the gradient: batch norm's running statistics
    ``new = (1 − momentum)·old + momentum·stat`` for ``stat`` (a graph output: the batch's mean or unbiased variance
    per channel, one value per step), or, with no ``stat``, a counter ``new = old + momentum`` (its batches
    tracked). PyTorch's ``BatchNorm`` updates, as ``torch.export`` records them (buffer mutations)."""

    momentum: float
    stat: str | None = None


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A named tensor: full ``shape``, ``dtype`` name and ``role`` (a :class:`TensorRole` or its spelling,
    stored as the member; ValueError for any other)."""

    name: str
    type: TensorType
    role: TensorRole = TensorRole.ACTIVATION

    def __post_init__(self):
        if self.role not in set(TensorRole):
            raise ValueError(f"tensor {self.name!r}: role {self.role!r} is not one of {list(map(str, TensorRole))}")
        object.__setattr__(self, "role", TensorRole(self.role))

    @property
    def shape(self):
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype


@dataclass(frozen=True, slots=True)
class Node:
    """One operator application: ``outputs = op(*inputs)``; ``scope`` is the module path it came from and
    ``source`` the model's source line that made it, ``"file.py:123 (code)"`` (captured graphs; empty where unknown)."""

    name: str
    op: Op
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    scope: str = ""
    source: str = ""


@dataclass(frozen=True, eq=False)
class ComputationGraph:
    """A whole model: tensors by name, nodes in topological order, graph outputs and the loss.

    ``constants`` holds the values of role-``constant`` tensors. ``loss`` (if set) names a scalar output.
    ``module_shapes``: the weights held in another shape than their module parameter's, each with the parameter's
    shape (a fused linear's weight stored by parts, :mod:`shardflow.graph.fused`); the two hold the same
    elements in the same row-major order. ``buffer_updates``: the module's buffers a step changes, by FQN
    (:class:`BufferUpdate`). ``frozen``: the weights the model does not train (parameters with
    ``requires_grad=False``): they take no gradient, no optimizer state and no update, as in eager PyTorch. Treat
    it as immutable: passes build new graphs.
    """

    tensors: Mapping[str, TensorSpec]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    loss: str | None = None
    constants: Mapping[str, torch.Tensor] = field(default_factory=dict)
    module_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    buffer_updates: Mapping[str, BufferUpdate] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()

    def __post_init__(self):
        self.validate()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ComputationGraph):
            return NotImplemented
        return (
            (
                dict(self.tensors),
                self.nodes,
                self.outputs,
                self.loss,
                dict(self.module_shapes),
                dict(self.buffer_updates),
                self.frozen,
            )
            == (
                dict(other.tensors),
                other.nodes,
                other.outputs,
                other.loss,
                dict(other.module_shapes),
                dict(other.buffer_updates),
                other.frozen,
            )
            and self.constants.keys() == other.constants.keys()
            and all(
                v.dtype == other.constants[k].dtype and torch.equal(v, other.constants[k])
                for k, v in self.constants.items()
            )
        )

    # --- queries -------------------------------------------------------------------------------------
    @property
    def expert_loads(self) -> tuple[str, ...]:
        """The graph outputs that count the tokens routed to each expert of an expert layer, in graph order: a
        :class:`~shardflow.graph.ops.Histc` of an :class:`~shardflow.graph.ops.Experts` node's routing ``idx``
        ``[N, K]``, ``[E]`` (capture adds one per expert layer: docs/concepts.md#mixtures-of-experts)."""
        routing = {n.inputs[1] for n in self.nodes if isinstance(n.op, Experts)}
        return tuple(
            o
            for n in self.nodes
            if isinstance(n.op, Histc) and n.inputs[0] in routing
            for o in n.outputs
            if o in self.outputs
        )

    def by_role(self, role: TensorRole) -> tuple[str, ...]:
        """Names of the tensors with ``role``, in definition order."""
        return tuple(n for n, t in self.tensors.items() if t.role == role)

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.by_role(TensorRole.INPUT)

    @property
    def weights(self) -> tuple[str, ...]:
        return self.by_role(TensorRole.WEIGHT)

    def module_shape(self, weight: str) -> tuple[int, ...]:
        """The shape of ``weight``'s module parameter (its graph shape unless it is stored in another)."""
        return tuple(self.module_shapes.get(weight, self.tensors[weight].shape))

    def producer(self) -> dict[str, Node]:
        """Tensor name → the node that produces it (graph inputs have none)."""
        return {o: n for n in self.nodes for o in n.outputs}

    def consumers(self) -> dict[str, list[tuple[Node, int]]]:
        """Tensor name → list of (consumer node, input index)."""
        out: dict[str, list[tuple[Node, int]]] = {t: [] for t in self.tensors}
        for n in self.nodes:
            for i, t in enumerate(n.inputs):
                out[t].append((n, i))
        return out

    def validate(self) -> None:
        """Check names resolve, nodes are topologically ordered and shapes agree with each op's rule."""
        defined = {n for n, t in self.tensors.items() if t.role != TensorRole.ACTIVATION}
        seen_nodes = set()
        for node in self.nodes:
            if node.name in seen_nodes:
                raise ValueError(f"duplicate node name {node.name!r}")
            seen_nodes.add(node.name)
            for t in node.inputs:
                if t not in defined:
                    raise ValueError(f"node {node.name!r} reads {t!r} before it is defined")
            got = node.op.infer(tuple(self.tensors[t].type for t in node.inputs))
            want = tuple(self.tensors[t].type for t in node.outputs)
            if got != want:
                raise ValueError(f"node {node.name!r} ({node.op.describe()}): outputs {want} but the op gives {got}")
            for t in node.outputs:
                if t in defined:
                    raise ValueError(f"tensor {t!r} is defined twice (second time by node {node.name!r})")
                defined.add(t)
        for t in self.outputs:
            if t not in defined:
                raise ValueError(f"graph output {t!r} is never defined")
        if self.loss is not None and (self.loss not in self.outputs or self.tensors[self.loss].shape != ()):
            raise ValueError(f"loss {self.loss!r} must be a scalar graph output")
        for n in self.by_role(TensorRole.CONSTANT):
            if n not in self.constants:
                raise ValueError(f"constant {n!r} has no value")
        for n, shape in self.module_shapes.items():
            if (
                n not in self.tensors
                or self.tensors[n].role != TensorRole.WEIGHT
                or math.prod(shape) != self.tensors[n].type.numel
            ):
                raise ValueError(f"module shape {list(shape)} of {n!r}: not a weight of as many elements")
        for n, u in self.buffer_updates.items():
            if u.stat is not None and u.stat not in self.outputs:
                raise ValueError(f"buffer {n!r} is updated from {u.stat!r}, which is no graph output")
        if not_weights := sorted(
            n for n in self.frozen if n not in self.tensors or self.tensors[n].role != TensorRole.WEIGHT
        ):
            raise ValueError(f"frozen {not_weights}: not weights of the graph")

    # --- text and JSON --------------------------------------------------------------------------------
    def listing(self) -> str:
        """A readable listing: inputs, weights, then one line per node ``outs = op(ins)  # shapes``."""
        lines = []
        for role in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.CONSTANT):
            for n in self.by_role(role):
                t = self.tensors[n]
                lines.append(f"{role:<8} {n}: {t.dtype}{list(t.shape)}")
        for node in self.nodes:
            outs = ", ".join(f"{o}: {self.tensors[o].dtype}{list(self.tensors[o].shape)}" for o in node.outputs)
            scope = f"   # {node.scope}" if node.scope else ""
            lines.append(f"{outs} = {node.op.describe()}({', '.join(node.inputs)}){scope}")
        lines.append(f"outputs: {', '.join(self.outputs)}" + (f"   loss: {self.loss}" if self.loss else ""))
        return "\n".join(lines)

    def to_json(self, constants: bool = True) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_json` inverts it exactly (without ``constants``: their values left out,
        given to :meth:`from_json` apart)."""
        return {
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "role": t.role}
                for t in self.tensors.values()
            ],
            "nodes": [
                {
                    "name": n.name,
                    "op": n.op.kind,
                    "attrs": _attrs_to_json(n.op),
                    "inputs": list(n.inputs),
                    "outputs": list(n.outputs),
                    "scope": n.scope,
                    "source": n.source,
                }
                for n in self.nodes
            ],
            "outputs": list(self.outputs),
            "loss": self.loss,
            "constants": {
                k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "data": v.flatten().tolist()}
                for k, v in self.constants.items()
                if constants
            },
            "module_shapes": {k: list(v) for k, v in self.module_shapes.items()},
            "buffer_updates": {k: dataclasses.asdict(u) for k, u in self.buffer_updates.items()},
            "frozen": sorted(self.frozen),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], constants: Mapping[str, torch.Tensor] | None = None) -> ComputationGraph:
        """The graph of :meth:`to_json`'s dict ``d``; ``constants``: their values, where ``d`` leaves them out.
        Raises ValueError (:meth:`validate`)."""
        tensors = {
            t["name"]: TensorSpec(t["name"], TensorType(tuple(t["shape"]), t["dtype"]), t["role"]) for t in d["tensors"]
        }
        nodes = tuple(
            Node(
                n["name"],
                _op_from_json(n["op"], n["attrs"]),
                tuple(n["inputs"]),
                tuple(n["outputs"]),
                n["scope"],
                n.get("source", ""),
            )
            for n in d["nodes"]
        )
        if constants is None:
            constants = {
                k: torch.tensor(v["data"], dtype=torch_dtype(v["dtype"])).reshape(v["shape"])
                for k, v in d.get("constants", {}).items()
            }
        shapes = {k: tuple(v) for k, v in d.get("module_shapes", {}).items()}
        updates = {k: BufferUpdate(**u) for k, u in d.get("buffer_updates", {}).items()}
        frozen = frozenset(d.get("frozen", ()))
        return cls(tensors, nodes, tuple(d["outputs"]), d.get("loss"), constants, shapes, updates, frozen)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> ComputationGraph:
        return cls.from_json(json.loads(Path(path).read_text()))


class Rewrite:
    """A graph being rewritten: its tensors (new ones added) and the names taken, for a rewrite that adds nodes."""

    def __init__(self, graph: ComputationGraph):
        self.tensors = dict(graph.tensors)
        self.taken = set(self.tensors) | {n.name for n in graph.nodes}

    def add(self, name: str, op: Op, inputs: tuple[str, ...], outputs: tuple[str, ...] | None, scope: str) -> Node:
        """A new node; its outputs are named after it unless ``outputs`` (existing tensors it now produces)."""
        types = op.infer(tuple(self.tensors[t].type for t in inputs))
        made = (name,) if outputs or len(types) == 1 else tuple(f"{name}.{k}" for k in range(len(types)))
        clash = self.taken & {name, *made}
        if clash:
            raise ValueError(f"the graph already has a node or tensor called {sorted(clash)}")
        self.taken.update({name, *made})
        outputs = outputs or made
        for o, ty in zip(outputs, types):
            self.tensors[o] = TensorSpec(o, ty)
        return Node(name, op, inputs, outputs, scope)


def _encode(v: Any) -> Any:
    """An op attribute as JSON: tuples as lists, :class:`Arg` as ``{"arg": i}``, dtypes as ``{"dtype": name}``."""
    if isinstance(v, (tuple, list)):
        return [_encode(x) for x in v]
    if isinstance(v, Arg):
        return {"arg": v.index}
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_decode(x) for x in v)
    if isinstance(v, dict):
        if "arg" in v:
            return Arg(v["arg"])
        if "dtype" in v:
            return torch_dtype(v["dtype"])
        return torch.device(v["device"])
    return v


def _attrs_to_json(op: Op) -> dict[str, Any]:
    return {f.name: _encode(getattr(op, f.name)) for f in dataclasses.fields(op)}


def _op_from_json(kind: str, attrs: Mapping[str, Any]) -> Op:
    if kind not in OPS:
        raise ValueError(f"unknown op {kind!r} in graph file; known ops: {sorted(OPS)}")
    return OPS[kind](**{k: _decode(v) for k, v in attrs.items()})
