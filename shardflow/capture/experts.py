"""The expert layers of a mixture of experts, found in a captured graph and lifted to one
:class:`~shardflow.graph.ops.Experts` op each (docs/concepts.md#mixtures-of-experts).

An expert layer as Hugging Face writes it (``MixtralExperts``, ``Qwen3MoeExperts``, DeepSeek-V3's experts: the
weights stacked over experts, ``[E, 2I, H]`` and ``[E, H, I]``) exports to a routing program over all the tokens
at once: the token-expert pairs sorted by expert (``sort``), the tokens gathered in that order (``index`` with
an integer division), the pairs per expert counted (``histc``) and summed into offsets (``cumsum``), a grouped
product per projection, the inverse permutation written by ``index_put`` and the weighted results summed per
token. Op by op, most of it has no sharding rule that keeps the tokens sharded: the sort orders *every* token, so
under data parallelism it would need every token on every device. Yet the layer as a whole is computed token by
token, and expert by expert: that is :class:`~shardflow.graph.ops.Experts`' rule. :func:`fuse_experts` replaces
each such region by that op.

A region is the nodes of one module scope (and the scopes inside it) that read two weights of three dims. It is
lifted only where it is the op: the region reads exactly tokens ``[N, H]``, each token's expert indices and
routing weights ``[N, K]`` and the two weights (besides constants), gives one tensor that the rest of the graph
reads, and, run on a random routing, computes what :class:`~shardflow.graph.ops.Experts` computes (within
:data:`PROBE_RTOL` of the output's magnitude) for one of its forms (the activations the region applies, weights transposed
or not). Anything else stays as captured: correct, with its routing ops replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from shardflow.graph import ops as O
from shardflow.graph.graph import ComputationGraph, Node, TensorRole, TensorSpec
from shardflow.graph.ops import OpError, torch_dtype

PROBE_RTOL = 1e-4  # agreement of a region with the op on a random routing, relative to the output's magnitude


def fuse_experts(graph: ComputationGraph) -> ComputationGraph:
    """``graph`` with every expert-layer region lifted to one :class:`~shardflow.graph.ops.Experts` node, named
    after the region's last node and writing the region's output tensor; the region's other tensors and the
    constants only it read are dropped. A graph without one is returned as is."""
    for scope, region in _regions(graph):
        fused = _as_experts(graph, scope, region)
        if fused is not None:
            graph = _with_load(_replace(graph, region, fused), fused)
    return graph


def _regions(graph: ComputationGraph) -> Iterator[tuple[str, tuple[Node, ...]]]:
    """(scope, its nodes in graph order) for each scope whose nodes read a weight of three dims."""
    scopes = dict.fromkeys(
        n.scope
        for n in graph.nodes
        if n.scope
        and any(graph.tensors[t].role == TensorRole.WEIGHT and len(graph.tensors[t].shape) == 3 for t in n.inputs)
    )
    for scope in scopes:
        yield scope, tuple(n for n in graph.nodes if n.scope == scope or n.scope.startswith(scope + "."))


def _as_experts(graph: ComputationGraph, scope: str, region: tuple[Node, ...]) -> Node | None:
    """The Experts node computing ``region``, or None where the region is not one (module docstring)."""
    made = {o for n in region for o in n.outputs}
    reads = dict.fromkeys(t for n in region for t in n.inputs if t not in made)
    names = {n.name for n in region}
    read_after = {t for n in graph.nodes if n.name not in names for t in n.inputs} | set(graph.outputs)
    outputs = [t for t in made if t in read_after]
    spec = graph.tensors
    weights = [t for t in reads if spec[t].role == TensorRole.WEIGHT]
    acts = [t for t in reads if spec[t].role not in (TensorRole.WEIGHT, TensorRole.CONSTANT)]
    if len(outputs) != 1 or len(weights) != 2 or len(acts) != 3:
        return None
    tokens = [t for t in acts if len(spec[t].shape) == 2 and not spec[t].dtype.startswith("int")]
    idx = [t for t in acts if len(spec[t].shape) == 2 and spec[t].dtype.startswith("int")]
    x = [t for t in tokens if spec[t].shape == spec[outputs[0]].shape]
    w = [t for t in tokens if t not in x]
    if len(x) != 1 or len(w) != 1 or len(idx) != 1:
        return None
    inputs = (x[0], idx[0], w[0], *weights)
    activations = dict.fromkeys(n.op.fn for n in region if isinstance(n.op, O.Unary)) or {"silu": None}
    for act in activations:
        for transposed in (False, True):
            op = O.Experts(act, transposed)
            try:
                if op.infer(tuple(spec[t].type for t in inputs)) != (spec[outputs[0]].type,):
                    continue
            except OpError:
                continue
            if _computes(graph, region, inputs, outputs[0], op):
                last = region[-1]
                return Node(last.name, op, inputs, (outputs[0],), scope, last.source)
    return None


def _computes(graph: ComputationGraph, region: tuple[Node, ...], inputs: tuple[str, ...], out: str, op: O.Op) -> bool:
    """Whether ``region`` and ``op`` give the same output (within :data:`PROBE_RTOL` of its largest magnitude) on
    random tokens, routings and weights of the captured shapes and dtypes, the constants as captured."""
    spec = graph.tensors
    floats = (inputs[0], *inputs[3:])
    n_tokens, k = spec[inputs[1]].shape
    n_experts = spec[inputs[3]].shape[0]
    gen = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(spec[t].shape, generator=gen, dtype=torch_dtype(spec[t].dtype)) for t in floats)
    idx = torch.rand(n_tokens, n_experts, generator=gen).topk(k, dim=-1).indices.to(torch_dtype(spec[inputs[1]].dtype))
    w = (torch.rand(n_tokens, k, generator=gen) + 0.5).to(torch_dtype(spec[inputs[2]].dtype))
    env: dict[str, torch.Tensor] = dict(zip(inputs, (x, idx, w, w1 * 0.2, w2 * 0.2)))
    env.update({t: v for t, v in graph.constants.items()})
    try:
        for n in region:
            env.update(zip(n.outputs, n.op.compute(*(env[t] for t in n.inputs))))
        want = env[out].double()
        got = op.compute(*(env[t] for t in inputs))[0].double()
    except (RuntimeError, IndexError, TypeError, OpError):
        return False
    return want.shape == got.shape and bool((want - got).abs().max() <= PROBE_RTOL * want.abs().max().clamp(min=1.0))


def _with_load(graph: ComputationGraph, fused: Node) -> ComputationGraph:
    """``graph`` with the load of expert layer ``fused`` as a graph output: the tokens routed to each of its E
    experts, ``Histc(E, 0, E − 1)`` of its routing ``idx`` (each expert id in a bin of its own, as Hugging Face's
    experts count them), a node right before it, in the router's module (:attr:`~shardflow.graph.graph.ComputationGraph.expert_loads`)."""
    idx, n_experts = fused.inputs[1], graph.tensors[fused.inputs[3]].shape[0]
    op = O.Histc(n_experts, 0.0, float(n_experts - 1))
    out = f"{fused.outputs[0]}.load"
    router = next((n for n in graph.nodes if idx in n.outputs), fused)  # counted where the routing is made
    load = Node(f"{fused.name}.load", op, (idx,), (out,), router.scope, router.source)
    at = next(k for k, n in enumerate(graph.nodes) if n.name == fused.name)  # before it: the routing as it comes
    return dataclasses.replace(
        graph,
        nodes=graph.nodes[:at] + (load,) + graph.nodes[at:],
        tensors={**graph.tensors, out: TensorSpec(out, op.infer((graph.tensors[idx].type,))[0])},
        outputs=(*graph.outputs, out),
    )


def _replace(graph: ComputationGraph, region: tuple[Node, ...], fused: Node) -> ComputationGraph:
    """``graph`` with ``region``'s nodes replaced by ``fused`` (at the last one's place) and the tensors only they
    read or wrote dropped."""
    names = {n.name for n in region}
    nodes = tuple(
        fused if n.name == fused.name else n for n in graph.nodes if n.name == fused.name or n.name not in names
    )
    used = {t for n in nodes for t in (*n.inputs, *n.outputs)} | set(graph.outputs)
    dropped = {t for n in region for t in (*n.inputs, *n.outputs)} - used
    return dataclasses.replace(
        graph,
        nodes=nodes,
        tensors={t: s for t, s in graph.tensors.items() if t not in dropped},
        constants={t: v for t, v in graph.constants.items() if t not in dropped},
    )
