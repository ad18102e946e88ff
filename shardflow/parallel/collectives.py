"""Collectives: the kinds of communication, the bytes one rank sends in each, and the collective that carries each
step of a redistribution — a fact about parallel ops that planning (:mod:`shardflow.parallel.pcg`, pricing the
redistributions where a rule refuses its inputs) and lowering (:data:`~shardflow.lower.shard_expansion.LOWERING`)
both take from here, so they count bytes by one definition (docs/concepts.md#6-layers-who-may-import-whom).

Bytes: what one rank sends per call. The bandwidth-optimal bound (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009): (d−1)/d·N for all-gather (N = the gathered
bytes), reduce-scatter and all-to-all (N = the input piece), 2(d−1)/d·N for all-reduce; a send or one
collective-permute step moves its piece; a broadcast root sends N once; a reduce (d−1)/d·N. Each kind's
implementation (:mod:`shardflow.lower.comms`) meets the bound, so the wire bytes *are* the bound.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Sequence

from shardflow.graph.ops import TensorType
from shardflow.parallel.mesh import SubMesh
from shardflow.parallel.ops import Combine, ParallelOp, Reduction, Repartition
from shardflow.parallel.sharding import Sharding


class CommKind(StrEnum):
    """The kinds of :class:`~shardflow.lower.program.Comm`. ``send``/``recv`` are the two ends of one
    point-to-point transfer (family ``p2p``); ``permute`` is one step of a collective-permute ring."""

    SEND = "send"
    RECV = "recv"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    PERMUTE = "permute"


def bound_bytes(kind: str, piece_bytes: int, d: int, is_root: bool = False) -> int:
    """Bandwidth-optimal bytes one rank of a ``d``-member communication sends; ``piece_bytes``: the rank's
    send piece (for all-gather the piece it contributes)."""
    if d <= 1 and kind not in ("send", "permute"):
        return 0
    if kind == "all_gather":
        return (d - 1) * piece_bytes
    if kind in ("reduce_scatter", "all_to_all", "reduce"):
        return piece_bytes * (d - 1) // d
    if kind == "all_reduce":
        return 2 * piece_bytes * (d - 1) // d
    if kind in ("send", "permute"):
        return piece_bytes
    if kind == "broadcast":
        return piece_bytes if is_root else 0
    return 0  # recv: the sender counts the bytes


def wire_bytes(kind: str, piece_bytes: int, d: int, is_root: bool = False) -> int:
    """Bytes one rank puts on the wire with shardflow's implementation of ``kind``
    (:func:`~shardflow.lower.comms.issue`): every implementation is a ring-algorithm call, so this is
    :func:`bound_bytes`."""
    return bound_bytes(kind, piece_bytes, d, is_root)


class LocalKind(StrEnum):
    """Steps of parallel ops that move nothing between devices: a Repartition of replicas (``split``: each
    device keeps its block) and any parallel op along an axis of one device (``alias``: the same piece)."""

    SPLIT = "split"
    ALIAS = "alias"


# (parallel op kind[, fused Repartition's kind]) → the communication that carries a step of a redistribution
# (docs/lowering.md#4-communication-lowering). A Repartition alone is local (a split).
REDISTRIBUTION: dict[tuple[str, ...], CommKind | LocalKind] = {
    (Reduction.kind,): CommKind.ALL_REDUCE,
    (Reduction.kind, Repartition.kind): CommKind.REDUCE_SCATTER,
    (Combine.kind,): CommKind.ALL_GATHER,
    (Combine.kind, Repartition.kind): CommKind.ALL_TO_ALL,
    (Repartition.kind,): LocalKind.SPLIT,
}


def fuses(first: ParallelOp, second: ParallelOp) -> bool:
    """Whether ``second`` right after ``first`` (reading only its output) lowers as one communication: a Reduction
    or a Combine followed by a Repartition on the same axis — a reduce-scatter, an all-to-all (a Combine and a
    Repartition of the same dim are not fused)."""
    return (isinstance(first, (Reduction, Combine)) and isinstance(second, Repartition) and first.axis == second.axis
            and not (isinstance(first, Combine) and first.dim == second.dim))


def redistribution_cost(ops: Sequence[ParallelOp], src: Sharding, group: SubMesh, type_: TensorType) -> tuple[int, int]:
    """(bytes one device sends, communications) of running ``ops`` forward on a tensor of ``type_`` held as ``src``
    on ``group`` — the parallel ops of :func:`~shardflow.parallel.ops.redistribute` (never a Replicate), grouped
    into steps as :func:`~shardflow.lower.shard_expansion.steps` groups them (consecutive ops that :func:`fuses`
    are one step), each communication step costing :func:`wire_bytes` of the piece entering it. The planner
    prices redistributions with this, so planning and lowering count bytes by one definition."""
    nbytes = comms = 0
    i = 0
    while i < len(ops):
        step = tuple(ops[i:i + 2]) if i + 1 < len(ops) and fuses(ops[i], ops[i + 1]) else (ops[i],)
        kind = LocalKind.ALIAS if step[0].degree == 1 else REDISTRIBUTION[tuple(op.kind for op in step)]
        if isinstance(kind, CommKind):
            piece_bytes = TensorType(src.parallel_shape(group, type_.shape).piece_shape, type_.dtype).nbytes
            nbytes += wire_bytes(kind, piece_bytes, step[0].degree)
            comms += 1
        for op in step:
            src, group = op.apply(src, group)
        i += len(step)
    return nbytes, comms
