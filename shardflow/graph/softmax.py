"""A softmax over a dim that tensor parallelism shards, written as ops whose rules take that dim sharded
(docs/concepts.md#vocabulary-parallel-embedding-and-loss).

A language model's loss normalises its logits ``[N, V]`` over the vocabulary V. With the output projection
column-parallel the logits arrive ``Shard(1)``, and the softmax's rule needs the whole dim: it would all-gather
``N × V`` values onto every device. :func:`decompose_softmax` writes the (log-)softmax as

    m = amax(detach(x), dim, keepdim)   # the shift: it changes no value, so no gradient flows through it
    z = x - m
    s = sum(exp(z), dim, keepdim)
    out = z - log(s)                     # softmax: exp(z) / s

whose rules handle a sharded ``dim`` with partial values: the amax is ``Partial(max)`` and the sum ``Partial(sum)``,
each reduced where the next op needs it whole (an all-reduce of ``[N, 1]``), and the backward of the last
subtraction sums its gradient over the dim the same way. With the loss's gather of each row's target logit,
vocabulary-parallel there too (:func:`~shardflow.parallel.rules.rule_gather`), this is Megatron-LM's
vocabulary-parallel cross-entropy (Shoeybi et al. 2019, ``vocab_parallel_cross_entropy``) and DTensor's
``loss_parallel``: three all-reduces of ``N`` values forward, one backward, instead of gathering ``N × V``.
A narrower float input (bfloat16, float16) is computed in float32, as ATen's softmax kernels do.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from shardflow.graph import ops as O
from shardflow.graph.graph import ComputationGraph, Node, Rewrite
from shardflow.graph.ops import torch_dtype


def softmax_heads(graph: ComputationGraph) -> dict[str, Node]:
    """Softmax node name → the linear whose output features it normalises: a softmax over the last dim of what a
    :class:`~shardflow.graph.ops.Linear` computes, read through casts, scalar ops and views that keep that dim (a
    language model's head and its loss: ``lm_head`` → ``.float()`` → ``view(-1, V)`` → ``log_softmax``). A head
    made column-parallel gives its softmax the dim sharded (vocabulary parallelism)."""
    producer = graph.producer()
    heads: dict[str, Node] = {}
    for n in graph.nodes:
        if not isinstance(n.op, O.Softmax):
            continue
        shape = graph.tensors[n.inputs[0]].shape
        if n.op.dim % len(shape) != len(shape) - 1:
            continue
        p = producer.get(n.inputs[0])
        while p is not None and (
            isinstance(p.op, (O.Cast, O.Scalar))
            or isinstance(p.op, O.Reshape)
            and graph.tensors[p.inputs[0]].shape[-1:] == shape[-1:]
        ):
            p = producer.get(p.inputs[0])
        if p is not None and isinstance(p.op, O.Linear):
            heads[n.name] = p
    return heads


def decompose_softmax(
    graph: ComputationGraph, nodes: Iterable[Node]
) -> tuple[ComputationGraph, dict[str, tuple[str, str]]]:
    """``graph`` with each :class:`~shardflow.graph.ops.Softmax` node of ``nodes`` written as the ops of the module
    docstring, in its scope; the last one makes the softmax's output tensor, so its readers are unchanged. The same
    values to rounding, the same gradients (the shift is detached, as the softmax's own derivative ignores it).

    Also returns, per softmax node, the two tensors that a sharded dim leaves partial, ``(shift, sum)``
    (``Partial(max)`` and ``Partial(sum)``), for the plan to reduce right where they are made."""
    rw = Rewrite(graph)
    replace: dict[str, list[Node]] = {}
    partial: dict[str, tuple[str, str]] = {}
    for n in nodes:
        op: O.Softmax = n.op  # type: ignore[assignment]
        x, out = n.inputs[0], n.outputs[0]
        dtype = graph.tensors[x].dtype
        narrow = torch_dtype(dtype).itemsize < 4
        dim = op.dim % len(graph.tensors[x].shape)
        made: list[Node] = []

        def add(suffix: str, node_op: O.Op, *inputs: str, final: bool = False) -> str:
            node = rw.add(f"{n.name}.{suffix}", node_op, inputs, (out,) if final else None, n.scope)
            made.append(node)
            return node.outputs[0]

        if narrow:
            x = add("wide", O.Cast("float32"), x)
        shift = add("shift", O.Reduce("amax", (dim,), True), add("detach", O.Detach(), x))
        z = add("shifted", O.Binary("sub"), x, shift)
        e = add("exp", O.Unary("exp"), z)
        s = add("sum", O.Reduce("sum", (dim,), True), e)
        last = (O.Binary("sub"), z, add("log", O.Unary("log"), s)) if op.log else (O.Binary("div"), e, s)
        if narrow:
            add("narrow", O.Cast(dtype), add("out", *last), final=True)
        else:
            add("out", *last, final=True)
        replace[n.name] = made
        partial[n.name] = (shift, s)
    nodes_out = tuple(m for n in graph.nodes for m in replace.get(n.name, [n]))
    return dataclasses.replace(graph, tensors=rw.tensors, nodes=nodes_out), partial
