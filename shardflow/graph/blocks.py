"""Repeated blocks of a graph (a transformer's layers) and folding them: the same graph with fewer of them.

A model's repeated blocks are the children of its first ``ModuleList`` (``model.layers.0``, ``model.layers.1``,
...), found from the nodes' module scopes (:func:`repeated_blocks`). :func:`keep_blocks` cuts a graph down to its
first K blocks — what follows the last block reads the K-th block's outputs instead — so that a cost that grows
with the blocks can be measured on two small graphs and drawn as a line to the whole model's (the search's
folding, docs/search.md#folding-repeated-blocks).
"""

from __future__ import annotations

import dataclasses
import re

from shardflow.graph.graph import ComputationGraph, Node, TensorRole

_INDEX = re.compile(r"^(.*?)(?:^|\.)(\d+)(?:\.|$)")


class FoldError(ValueError):
    """A graph's blocks cannot be folded: they differ in structure, or something outside them reads a block other
    than the last."""


def block_prefix(scope: str) -> tuple[str, str] | None:
    """``(list, block)`` for a module scope inside an indexed child: ``"model.layers.3.mlp"`` →
    ``("model.layers", "model.layers.3")``; None outside every indexed child."""
    m = _INDEX.match(scope)
    if not m:
        return None
    prefix = scope[: m.end(2)]
    return (prefix[: -len(m.group(2)) - 1] if "." in prefix else ""), prefix


def repeated_blocks(graph: ComputationGraph) -> list[str]:
    """Module paths of the repeated blocks: the children ``<list>.<i>`` of the first ModuleList, in order."""
    blocks: dict[str, None] = {}
    first: str | None = None
    for n in graph.nodes:
        found = block_prefix(n.scope)
        if found:
            first = found[0] if first is None else first
            if found[0] == first:
                blocks.setdefault(found[1])
    return list(blocks)


def block_nodes(graph: ComputationGraph, blocks: list[str]) -> dict[str, list[Node]]:
    """Each block of ``blocks`` → its nodes, in graph order."""
    out: dict[str, list[Node]] = {b: [] for b in blocks}
    for n in graph.nodes:
        found = block_prefix(n.scope)
        if found and found[1] in out:
            out[found[1]].append(n)
    return out


def keep_blocks(graph: ComputationGraph, keep: int) -> ComputationGraph:
    """``graph`` with only its first ``keep`` repeated blocks (1 ≤ ``keep``; the graph itself when it has no more):
    the nodes of the others are dropped with the weights and constants only they read, and every node after the
    blocks (a final norm, the head, the loss) reads the outputs of block ``keep`` − 1 where it read those of the
    last block (the blocks' nodes correspond one to one, in graph order). Raises FoldError where the blocks differ
    in their ops or where a node outside the blocks, or a graph output, reads a dropped block other than the
    last."""
    blocks = repeated_blocks(graph)
    if keep >= len(blocks):
        return graph
    if keep < 1:
        raise FoldError(f"keep {keep} blocks: at least one must be kept")
    nodes = block_nodes(graph, blocks)
    kinds = [tuple(n.op.kind for n in nodes[b]) for b in blocks]
    if any(k != kinds[0] for k in kinds):
        raise FoldError(f"the repeated blocks of {blocks[0].rpartition('.')[0]!r} differ in their ops: not foldable")
    dropped = {n.name for b in blocks[keep:] for n in nodes[b]}
    made = {t: b for b in blocks[keep:] for n in nodes[b] for t in n.outputs}
    rename = {t: k for m, n in zip(nodes[blocks[keep - 1]], nodes[blocks[-1]]) for k, t in zip(m.outputs, n.outputs)}
    kept_nodes = []
    for n in graph.nodes:
        if n.name in dropped:
            continue
        reads = [t for t in n.inputs if t in made]
        if any(made[t] != blocks[-1] for t in reads):
            raise FoldError(f"node {n.name!r} reads block {made[reads[0]]!r}, not the last: not foldable")
        kept_nodes.append(dataclasses.replace(n, inputs=tuple(rename.get(t, t) for t in n.inputs)))
    outputs = tuple(rename.get(t, t) for t in graph.outputs)
    if any(t in made for t in outputs):
        raise FoldError("a graph output is made in a dropped block other than the last: not foldable")
    used = {t for n in kept_nodes for t in (*n.inputs, *n.outputs)} | set(outputs)
    tensors = {k: v for k, v in graph.tensors.items() if k in used or (v.role == TensorRole.INPUT and k not in made)}
    return ComputationGraph(
        tensors=tensors,
        nodes=tuple(kept_nodes),
        outputs=outputs,
        loss=rename.get(graph.loss, graph.loss) if graph.loss else None,
        constants={k: v for k, v in graph.constants.items() if k in tensors},
        module_shapes={k: v for k, v in graph.module_shapes.items() if k in tensors},
        frozen=frozenset(w for w in graph.frozen if w in tensors),
        buffer_updates={
            k: u
            for k, u in graph.buffer_updates.items()
            if (k in tensors or k not in graph.tensors) and (u.stat is None or u.stat in outputs)
        },
    )
