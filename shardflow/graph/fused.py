"""Fused linears: one weight computing several projections whose output the model splits (GPT-2's ``c_attn``
computes q|k|v with one weight ``[C, 3C]``).

Column parallelism must give each device a block of heads of q, of k and of v. On the fused weight that is no
block of its columns (a plain ``Shard(1)`` of ``[C, 3C]`` hands device 0 all of q and half of k) but a strided
shard (DTensor's ``_StridedShard``). Two graph rewrites make it an ordinary ``Shard``:

* at capture, :func:`store_by_parts` holds the weight (and bias) of a fused linear whose parts have equal sizes
  *by parts*: ``[C, 3C]`` as ``[C, 3, C]`` (the output-feature dim cut into parts × features per part; a bias
  ``[3C]`` as ``[3, C]``), merged back by a reshape (a view) before the linear. The graph records the module
  parameter's shape (``ComputationGraph.module_shapes``); both hold the same elements in the same row-major
  order. ``Shard`` of the features-per-part dim is then q, k and v each cut by heads, and the weight, its gradient
  and its optimizer state are divided like any sharded parameter;
* :func:`split_fused` (what tensor parallelism plans on) computes the linear part by part: the stored parameter
  is split on its parts dim, each part is an ordinary linear whose weight is sharded by heads.

Where a model's parameters meet the graph (initial weights, ``state_dict``, ``--init-from``, a reference module),
:func:`stored` and :func:`as_module` convert between the two shapes; checkpoints hold the graph's shape
(:meth:`~shardflow.train.checkpoint.dcp.Checkpoint.load` reads them into the module's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardflow.graph import ops as O
from shardflow.graph.graph import ComputationGraph, Node, Rewrite, TensorRole, TensorSpec


@dataclass(frozen=True, slots=True)
class FusedLinear:
    """A linear whose output the model splits along its output features.

    ``linear`` is the node, ``views`` the reshapes between it and ``split`` that keep the features as the last
    dim (Hugging Face's ``Conv1D`` flattens the tokens around its ``addmm``), ``split`` the node that cuts them,
    ``merges`` the reshapes that merge a weight or bias stored by parts back into the linear's input.
    """

    linear: Node
    views: tuple[Node, ...]
    split: Node
    merges: tuple[Node, ...] = ()

    @property
    def features(self) -> tuple[tuple[str, int], ...]:
        """(parameter, its output-feature dim in the module's shape) for the weight and, with a bias, the bias;
        a parameter stored by parts is named as the graph holds it."""
        lin = self.linear
        merged = {m.outputs[0]: m.inputs[0] for m in self.merges}
        params = ((lin.inputs[1], lin.op.out_dim),) + (((lin.inputs[2], 0),) if lin.op.bias else ())
        return tuple((merged.get(p, p), d) for p, d in params)


def parts_dim(module_shape: Sequence[int], stored_shape: Sequence[int]) -> int:
    """The dim p where a weight stored by parts cuts its module shape's dim p into (parts, features per part)."""
    return next(d for d, (a, b) in enumerate(zip(module_shape, stored_shape)) if a != b)


def stored_dim(graph: ComputationGraph, weight: str, dim: int) -> int:
    """Dim ``dim`` of ``weight``'s module parameter as a dim of the shape the graph holds it in: stored by parts,
    the module's dim p (cut into parts × features per part at p, p + 1) is the features per part, p + 1."""
    module = graph.module_shape(weight)
    dim %= len(module)
    if weight not in graph.module_shapes:
        return dim
    return dim + (dim >= parts_dim(module, graph.tensors[weight].shape))


def fused_linears(graph: ComputationGraph) -> list[FusedLinear]:
    """Every linear of ``graph`` with a weight parameter (or one stored by parts) whose output alone feeds, through
    reshapes that keep the last dim, one Split of that last dim into two or more parts, in node order."""
    consumers = graph.consumers()
    producer = graph.producer()
    weights = set(graph.weights)

    def merge(t: str) -> Node | None:
        node = producer.get(t)
        return (
            node
            if node is not None and isinstance(node.op, O.Reshape) and node.inputs[0] in graph.module_shapes
            else None
        )

    found = []
    for lin in graph.nodes:
        if not isinstance(lin.op, O.Linear) or (lin.inputs[1] not in weights and merge(lin.inputs[1]) is None):
            continue
        features = graph.tensors[lin.outputs[0]].shape[-1]
        views: list[Node] = []
        t = lin.outputs[0]
        while len(consumers[t]) == 1 and t not in graph.outputs:
            node = consumers[t][0][0]
            if isinstance(node.op, O.Reshape) and node.op.shape[-1:] == (features,):
                views.append(node)
                t = node.outputs[0]
                continue
            if (
                isinstance(node.op, O.Split)
                and node.op.dim == len(graph.tensors[t].shape) - 1
                and len(node.op.sizes) > 1
            ):
                merges = tuple(m for m in map(merge, lin.inputs[1:]) if m is not None)
                found.append(FusedLinear(lin, tuple(views), node, merges))
            break
    return found


def store_by_parts(graph: ComputationGraph) -> ComputationGraph:
    """``graph`` with the weight and bias of each fused linear whose parts have equal sizes (and which nothing else
    reads) stored by parts: the output-feature dim d of size k·m held as (k, m) at dims (d, d+1), merged back by a
    reshape ``<parameter>.whole`` read by the linear; ``module_shapes`` records the parameter's shape. The same
    values: a reshape of a contiguous tensor keeps every element's row-major index."""
    consumers = graph.consumers()
    names = Rewrite(graph)
    shapes = dict(graph.module_shapes)
    before: dict[str, list[Node]] = {}  # linear → the merges to insert before it
    inputs: dict[str, tuple[str, ...]] = {}  # linear → its new inputs
    for f in fused_linears(graph):
        lin, sizes = f.linear, f.split.op.sizes
        if len(set(sizes)) != 1 or any(len(consumers[p]) != 1 for p, _ in f.features):
            continue
        new = list(lin.inputs)
        for i, (p, d) in enumerate(f.features, start=1):
            spec = graph.tensors[p]
            module = spec.shape
            names.tensors[p] = TensorSpec(
                p, O.TensorType(module[:d] + (len(sizes), sizes[0]) + module[d + 1 :], spec.dtype), TensorRole.WEIGHT
            )
            shapes[p] = module
            before.setdefault(lin.name, []).append(names.add(f"{p}.whole", O.Reshape(module), (p,), None, lin.scope))
            new[i] = f"{p}.whole"
        inputs[lin.name] = tuple(new)
    if not inputs:
        return graph
    nodes = tuple(
        m
        for n in graph.nodes
        for m in (*before.get(n.name, ()), dataclasses.replace(n, inputs=inputs.get(n.name, n.inputs)))
    )
    return dataclasses.replace(graph, tensors=names.tensors, nodes=nodes, module_shapes=shapes)


def split_fused(graph: ComputationGraph, fused: Sequence[FusedLinear]) -> ComputationGraph:
    """``graph`` with each of ``fused`` computed part by part, the same values (each output element is the same
    dot product): the weight and bias are split along the output features into the split's sizes (nodes
    ``<linear>.weight`` and ``<linear>.bias``, in the linear's module; a parameter stored by parts is split on its
    parts dim and each part viewed without it, ``<linear>.weight.<k>.view``), one linear per part on the same input
    (``<linear>.part<k>``), the views per part, and part k's last node produces the split's output k, so every
    consumer reads what it read before. The parameters keep their one FQN each.

    Stored by parts (:func:`store_by_parts`), the parameter's features-per-part dim can be sharded like any dim:
    each part's weight is then cut by heads with no communication, and the parameter, its gradient and its
    optimizer state are divided. A fused linear with unequal parts (stored whole) is split locally from a
    replicated parameter instead (:func:`~shardflow.strategy.plan.resolve` places its parts)."""
    names = Rewrite(graph)
    replace: dict[str, list[Node]] = {}  # node name → the nodes that replace it (none: removed)
    for f in fused:
        lin, sizes, last = f.linear, f.split.op.sizes, f.split.outputs
        for t in [lin.outputs[0]] + [v.outputs[0] for v in f.views] + [m.outputs[0] for m in f.merges]:
            del names.tensors[t]
        params, per_part = [], []
        for kind, (p, d) in zip(("weight", "bias"), f.features):
            if p in graph.module_shapes:
                pd = parts_dim(graph.module_shapes[p], graph.tensors[p].shape)
                split = names.add(f"{lin.name}.{kind}", O.Split((1,) * len(sizes), pd), (p,), None, lin.scope)
                shape = graph.tensors[p].shape[:pd] + graph.tensors[p].shape[pd + 1 :]
                views = [names.add(f"{o}.view", O.Reshape(shape), (o,), None, lin.scope) for o in split.outputs]
                params += [split, *views]
                per_part.append([v.outputs[0] for v in views])
            else:
                split = names.add(f"{lin.name}.{kind}", O.Split(sizes, d), (p,), None, lin.scope)
                params.append(split)
                per_part.append(list(split.outputs))
        parts = [
            names.add(
                f"{lin.name}.part{k}",
                lin.op,
                (lin.inputs[0],) + tuple(pp[k] for pp in per_part),
                None if f.views else (last[k],),
                lin.scope,
            )
            for k in range(len(sizes))
        ]
        replace[lin.name] = params + parts
        for m in f.merges:
            replace[m.name] = []
        for i, v in enumerate(f.views):
            final = i == len(f.views) - 1
            parts = [
                names.add(
                    f"{v.name}.part{k}",
                    O.Reshape(v.op.shape[:-1] + (sizes[k],)),
                    part.outputs,
                    (last[k],) if final else None,
                    v.scope,
                )
                for k, part in enumerate(parts)
            ]
            replace[v.name] = parts
        replace[f.split.name] = []
    nodes = tuple(m for n in graph.nodes for m in replace.get(n.name, [n]))
    return dataclasses.replace(graph, tensors=names.tensors, nodes=nodes)


# --- where parameters meet the graph ------------------------------------------------------------------------


class ByParts:
    """A weight given in its module's shape (anything indexed by blocks, ``w[slices]``: a lazily read or replayed
    weight), indexed in the shape the graph stores it by parts: block ``[..., j0:j1, c0:c1, ...]`` of ``shape`` is
    blocks ``[..., j·m + c0 : j·m + c1, ...]`` of the module's tensor for each part j, stacked."""

    def __init__(self, value: Any, shape: tuple[int, ...], parts_at: int):
        self.value, self.shape, self.parts_at = value, shape, parts_at
        self.dtype = value.dtype

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        p, m = self.parts_at, self.shape[self.parts_at + 1]
        (j0, j1, _), (c0, c1, _) = (index[p].indices(self.shape[p]), index[p + 1].indices(m))
        return torch.stack(
            [self.value[index[:p] + (slice(j * m + c0, j * m + c1),) + index[p + 2 :]] for j in range(j0, j1)], dim=p
        )


def stored(graph: ComputationGraph, weights: Mapping[str, Any]) -> dict[str, Any]:
    """``weights`` (by graph name, in their module parameters' shapes) as the graph holds them: a weight stored by
    parts reshaped (a tensor) or indexed through :class:`ByParts` (anything else indexed by blocks)."""
    out = dict(weights)
    for w, module in graph.module_shapes.items():
        if w in out:
            shape = graph.tensors[w].shape
            v = out[w]
            out[w] = v.reshape(shape) if isinstance(v, torch.Tensor) else ByParts(v, shape, parts_dim(module, shape))
    return out


def as_module(graph: ComputationGraph, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors by graph weight name (``tensors``, as the graph holds them) in their module parameters'
    shapes."""
    return {w: t.reshape(graph.module_shapes[w]) if w in graph.module_shapes else t for w, t in tensors.items()}


def same_elements(module_shape: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether ``shape`` is ``module_shape`` with one dim cut in two (a weight stored by parts)."""
    return (
        len(shape) == len(module_shape) + 1
        and math.prod(shape) == math.prod(module_shape)
        and any(
            tuple(shape[:d]) + (shape[d] * shape[d + 1],) + tuple(shape[d + 2 :]) == tuple(module_shape)
            for d in range(len(module_shape))
        )
    )
