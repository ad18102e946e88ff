"""Repeated blocks of a graph (a transformer's layers) and folding them: the same graph with fewer of them.

A model's repeated blocks are the children of its first ``ModuleList`` (``model.layers.0``, ``model.layers.1``,
...), found from the nodes' module scopes (:func:`repeated_blocks`). :func:`keep_blocks` cuts a graph down to its
first K blocks — what follows the last block reads the K-th block's outputs instead — so that a cost that grows
with the blocks can be measured on two small graphs and drawn as a line to the whole model's (the search's
folding, docs/search.md#folding-repeated-blocks). :func:`grow_blocks` does the reverse: more blocks, each a copy of
the last, so that a graph of many blocks is built from a capture of few (docs/search.md#capturing-once-per-depth).
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


def alike_nodes(graph: ComputationGraph, blocks: list[str]) -> dict[str, list[Node]]:
    """:func:`block_nodes`, the blocks holding the same ops in the same order. Raises FoldError where they differ."""
    nodes = block_nodes(graph, blocks)
    kinds = [tuple(n.op.kind for n in nodes[b]) for b in blocks]
    if any(k != kinds[0] for k in kinds):
        raise FoldError(f"the repeated blocks of {blocks[0].rpartition('.')[0]!r} differ in their ops: not foldable")
    return nodes


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
    nodes = alike_nodes(graph, blocks)
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


def grow_blocks(graph: ComputationGraph, blocks: int) -> ComputationGraph:
    """``graph`` with ``blocks`` repeated blocks (the graph itself when it has as many or more): blocks K … blocks − 1
    appended after its last block K − 1, each a copy of block K − 1 — its nodes, the activations they make and the
    weights and constants under its module path, renamed to the new block's path (``model.layers.K``) and, for the
    nodes and activations, suffixed ``_l<index>`` — reading the block before where block K − 1 reads block K − 2,
    and everything else (outside the blocks: rotary tables, masks) as block K − 1 does; what follows the blocks reads
    the new last block's outputs where it read block K − 1's. The inverse of :func:`keep_blocks` up to names: the graph
    :mod:`torch.export` captures of the model with ``blocks`` blocks has the same ops, shapes and dataflow. Raises
    FoldError where the graph has fewer than 2 blocks, its blocks differ in their ops, block K − 1 reads a block
    other than K − 2 or what follows the blocks reads one other than K − 1, the last block's buffers change in a step
    (``buffer_updates``), or a new name is taken."""
    names = repeated_blocks(graph)
    if len(names) >= blocks:
        return graph
    if len(names) < 2:
        raise FoldError(f"grow to {blocks} blocks: the graph has {len(names)} repeated block(s), at least 2 are needed")
    nodes = alike_nodes(graph, names)
    last, before = nodes[names[-1]], nodes[names[-2]]
    made = {t: b for b in names for n in nodes[b] for t in n.outputs}
    if bad := [t for n in last for t in n.inputs if t in made and made[t] not in (names[-1], names[-2])]:
        raise FoldError(f"block {names[-1]!r} reads {bad[0]!r} of block {made[bad[0]]!r}, not the one before")
    own = names[-1] + "."
    if any(k.startswith(own) for k in graph.buffer_updates):
        raise FoldError(f"block {names[-1]!r} has buffers a step changes: not grown")
    # block K − 2's outputs ↔ block K − 1's, by position: what block K − 1 reads of the one before
    previous = {t: u for m, n in zip(before, last) for t, u in zip(m.outputs, n.outputs)}
    list_path, k = names[-1].rpartition(".")[0], len(names) - 1
    tensors, constants = dict(graph.tensors), dict(graph.constants)
    module_shapes, frozen = dict(graph.module_shapes), set(graph.frozen)
    grown: list[Node] = []
    at = {t: t for n in last for t in n.outputs}  # block K − 1's outputs → the latest copy's
    for j in range(k + 1, blocks):
        path = f"{list_path}.{j}"

        def renamed(t: str, j: int = j, path: str = path) -> str:
            """Tensor ``t`` as block j reads or writes it."""
            if t in at:  # made in block K − 1: block j's own
                return f"{t}_l{j}"
            if t in previous:  # made in the block before K − 1: block j − 1's
                return at[previous[t]]
            if t.startswith(own):  # a weight or constant of block K − 1: block j's
                return path + "." + t[len(own) :]
            return t

        for n in last:
            for t in (*n.inputs, *n.outputs):
                if not (t in at or t.startswith(own)) or (new := renamed(t)) in tensors and new not in graph.tensors:
                    continue  # outside the block or the block before, or added already
                if new in graph.tensors:
                    raise FoldError(f"grow to {blocks} blocks: block {path!r} would name {new!r}, which is taken")
                tensors[new] = dataclasses.replace(graph.tensors[t], name=new)
                if t in graph.constants:
                    constants[new] = graph.constants[t]
                if t in graph.module_shapes:
                    module_shapes[new] = graph.module_shapes[t]
                if t in graph.frozen:
                    frozen.add(new)
            scope = path + n.scope[len(names[-1]) :]
            grown.append(
                dataclasses.replace(
                    n,
                    name=f"{n.name}_l{j}",
                    inputs=tuple(renamed(t) for t in n.inputs),
                    outputs=tuple(renamed(t) for t in n.outputs),
                    scope=scope,
                )
            )
        at = {t: f"{t}_l{j}" for t in at}
    if taken := sorted({n.name for n in graph.nodes} & {n.name for n in grown}):
        raise FoldError(f"grow to {blocks} blocks: the node name {taken[0]!r} is taken")
    end = graph.nodes.index(last[-1]) + 1
    if bad := [t for n in graph.nodes[end:] for t in n.inputs if t in made and made[t] != names[-1]]:
        raise FoldError(f"{bad[0]!r} of block {made[bad[0]]!r} is read after the blocks: not grown")
    after = tuple(dataclasses.replace(n, inputs=tuple(at.get(t, t) for t in n.inputs)) for n in graph.nodes[end:])
    out = ComputationGraph(
        tensors=tensors,
        nodes=(*graph.nodes[:end], *grown, *after),
        outputs=tuple(at.get(t, t) for t in graph.outputs),
        loss=at.get(graph.loss, graph.loss) if graph.loss else None,
        constants=constants,
        module_shapes=module_shapes,
        frozen=frozenset(frozen),
        buffer_updates=graph.buffer_updates,
    )
    out.validate()
    return out
