"""Model FLOPs of a computation graph, counted from its ops' tensor shapes (model-agnostic): the numerator of MFU.

Only the matmul-like ops count, as in PaLM's MFU (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with
Pathways", appendix B) and torchtitan's ``get_num_flop_per_token`` (6·N + 12·L·H·Q·T per token for a
transformer): every other op (element-wise, norms, softmax, embedding lookups, the loss) is memory-bound and
left out. A multiply-add is 2 FLOPs. :data:`FORWARD_FLOPS` is the table, one formula per op class:

* **linear** ``[*, in] → [*, out]`` and **matmul** ``[*, n, k] @ [*, k, m]``: 2 · (output elements) · (contracted
  size). Biases are not counted.
* **attention** (sdpa) q ``[*, H, T, D]``, k ``[*, Hkv, S, D]``, v ``[*, Hkv, S, Dv]``: q·kᵀ and the weights·v,
  2 · (elements of ``[*, H, T]``) · S · (D + Dv) — 2·2·B·H·T·S·D when Dv = D. A **causal** mask is **not**
  halved: PaLM and torchtitan count the full T·S square, so our MFU compares with theirs (FlashAttention's
  benchmarks halve it; halving would lower a causal model's MFU by the attention share of its FLOPs).
* **conv** x ``[N, C, *spatial]``, weight ``[O, C/groups, *kernel]``: 2 · (output elements) · (C/groups) ·
  (kernel elements).
* **experts** (a mixture of experts' expert layer) x ``[N, H]``, idx ``[N, K]``, w1 and w2 ``[E, *]``: each of the
  N·K routed token-expert pairs multiplies by one expert's w1 and w2, 2 · N·K · (elements of w1 and w2) / E. The
  router's linear counts as a linear; experts no token was routed to count nothing. A device holding a block of E_l
  experts (expert parallelism's all-gather dispatcher, experts split over tp) counts its share of a balanced
  routing's pairs, N·K·E_l/E. Under the all-to-all token
  dispatcher, a rank's **experts_local** counts the rows it receives when the routing is balanced (its ``balanced``
  rows, n·K): the rows that arrive are only known when the step runs.

Training counts 3× the forward (:data:`TRAINING_FACTOR`): the backward computes two products per forward product
(the input's gradient and the weight's), as PaLM and torchtitan count it, whether or not an input needs a
gradient. Recomputation (activation checkpointing) is not model FLOPs and is never counted.
"""

from __future__ import annotations

import math
from typing import Callable

from shardflow.graph.dispatch import ExpertsLocal
from shardflow.graph.graph import ComputationGraph, Node
from shardflow.graph.ops import Attention, Conv, Experts, Linear, Matmul, Op, TensorType

# forward + backward (2 products per forward product): PaLM appendix B, torchtitan
TRAINING_FACTOR = 3


def _contracted(op: Op, ins: tuple[TensorType, ...], outs: tuple[TensorType, ...]) -> int:
    """linear / matmul: input 0's last dim is contracted into every output element."""
    return 2 * outs[0].numel * ins[0].shape[-1]


def _attention(op: Op, ins: tuple[TensorType, ...], outs: tuple[TensorType, ...]) -> int:
    """sdpa: scores q·kᵀ ([*, H, T, S], D each) and output weights·v ([*, H, T, Dv], S each); causal not halved."""
    q, k, v = ins[:3]
    return 2 * math.prod(q.shape[:-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _experts(op: Op, ins: tuple[TensorType, ...], outs: tuple[TensorType, ...]) -> int:
    """experts: one expert's w1 and w2 per routed token-expert pair (idx's elements); a device's block of E_l of the
    layer's E experts (``op.experts`` set) computes the pairs routed to it, E_l/E of them on a balanced routing."""
    assert isinstance(op, Experts), op
    idx, w1, w2 = ins[1], ins[3], ins[4]
    pairs = idx.numel * w1.shape[0] // op.experts if op.experts else idx.numel
    return 2 * pairs * (w1.numel + w2.numel) // w1.shape[0]


def _experts_local(op: Op, ins: tuple[TensorType, ...], outs: tuple[TensorType, ...]) -> int:
    """experts_local: one expert's w1 and w2 per row received under balanced routing (``op.balanced``)."""
    assert isinstance(op, ExpertsLocal), op
    w1, w2 = ins[2], ins[3]
    return 2 * op.balanced * (w1.numel + w2.numel) // w1.shape[0]


def _conv(op: Op, ins: tuple[TensorType, ...], outs: tuple[TensorType, ...]) -> int:
    """conv: every output element sums C/groups · kernel products (the weight's dims after the first)."""
    return 2 * outs[0].numel * math.prod(ins[1].shape[1:])


FORWARD_FLOPS: dict[type[Op], Callable[[Op, tuple[TensorType, ...], tuple[TensorType, ...]], int]] = {
    Linear: _contracted,
    Matmul: _contracted,
    Attention: _attention,
    Conv: _conv,
    Experts: _experts,
    ExpertsLocal: _experts_local,
}


def op_flops(op: Op, ins: tuple[TensorType, ...], outs: tuple[TensorType, ...]) -> int:
    """FLOPs of one forward of ``op`` on inputs of types ``ins`` giving ``outs`` (:data:`FORWARD_FLOPS`; 0 for any
    other op)."""
    count = FORWARD_FLOPS.get(type(op))
    return 0 if count is None else count(op, ins, outs)


def node_flops(graph: ComputationGraph, node: Node) -> int:
    """FLOPs of one forward of ``node`` of ``graph`` at its captured shapes (:func:`op_flops`)."""
    return op_flops(
        node.op, tuple(graph.tensors[t].type for t in node.inputs), tuple(graph.tensors[t].type for t in node.outputs)
    )


def forward_flops(graph: ComputationGraph) -> int:
    """FLOPs of one forward pass of ``graph`` at its captured shapes (the whole batch): :func:`node_flops` summed
    over its nodes."""
    return sum(node_flops(graph, n) for n in graph.nodes)


def training_flops(graph: ComputationGraph) -> int:
    """Model FLOPs of one training step of ``graph`` (forward and backward of the whole batch it was captured
    with): :data:`TRAINING_FACTOR` × :func:`forward_flops`. Divide by the batch's tokens for FLOPs per token."""
    return TRAINING_FACTOR * forward_flops(graph)
