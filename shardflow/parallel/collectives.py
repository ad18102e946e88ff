"""Collectives: the kinds of communication, each one entry, and the collective that carries each step of a
redistribution — a fact about parallel ops that planning (:mod:`shardflow.parallel.pcg`, pricing the
redistributions where a rule refuses its inputs) and lowering (:data:`~shardflow.lower.shard_expansion.LOWERING`)
both take from here, so they count bytes by one definition (docs/concepts.md#6-layers-who-may-import-whom).

:data:`KINDS` maps every :class:`CommKind` to its :class:`CommSpec` — its family, the fields the verifier checks,
its byte formula and the cost model's kind of call — and, registered from the layers that can run them, its two
implementations, as JAX registers one primitive per collective with its rules: the one-process one
(:func:`register_local`, from :mod:`shardflow.lower.comms`) and the torch.distributed one
(:func:`register_distributed`, from :mod:`shardflow.runtime.comms`, which needs a process group). This layer
imports neither. A new kind is one entry here and its two registered implementations, nothing else.

Bytes: what one rank sends per call. The bandwidth-optimal bound (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009): (d−1)/d·N for all-gather (N = the gathered
bytes), reduce-scatter and all-to-all (N = the input piece), 2(d−1)/d·N for all-reduce; a send or one
collective-permute step moves its piece; a broadcast root sends N once; a reduce (d−1)/d·N. Every kind is
implemented with a call whose ring algorithm meets the bound, so the wire bytes *are* the bound (gloo's
reduce-scatter included: ``reduce_scatter_single``, not an all-reduce underneath). An all-to-all of data-dependent
sizes counts its bound, the whole send buffer (its rows may all go to other members); the executors measure what
it sends (docs/lowering.md#17-the-all-to-all-token-dispatcher---ep-dispatch-all_to_all).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Sequence, TypeVar

from shardflow.graph.ops import TensorType
from shardflow.parallel.mesh import SubMesh
from shardflow.parallel.ops import CombineOp, ParallelOp, ReductionOp, RepartitionOp
from shardflow.parallel.sharding import Sharding


class CommKind(StrEnum):
    """The kinds of :class:`~shardflow.lower.program.Comm`. ``send``/``recv`` are the two ends of one
    point-to-point transfer (family ``p2p``); ``permute`` is one step of a collective-permute ring; ``all_to_all_v``
    an all-to-all whose chunk sizes are data, known when the step runs (the all-to-all token dispatcher's:
    :attr:`~shardflow.lower.program.Comm.splits`)."""

    SEND = "send"
    RECV = "recv"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    ALL_TO_ALL_V = "all_to_all_v"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    PERMUTE = "permute"


@dataclass(frozen=True)
class CommSpec:
    """Everything shardflow knows about one communication kind.

    ``family``: what the members of one communication hold (send and recv: ``p2p``, one transfer seen from its
    two ends). ``sent(piece_bytes, d, is_root)``: the bandwidth-optimal bytes one rank of a ``d``-member
    communication sends (``piece_bytes``: its send piece; for an all-gather the piece it contributes).
    ``fields``: which of ``peer``/``peer_from``/``root`` it uses (each must name a member); the others stay None.
    ``point_to_point``: issued between two ranks, without a process group. ``dim_first``: it receives with
    ``dim`` moved to the front (:func:`~shardflow.lower.comms.front_dim`). ``priced_as``: the cost model's kind
    of call (:data:`~shardflow.lower.calibration.COST_KINDS`): send, recv and a permute step are ``p2p``, an
    all-to-all of data-dependent sizes an ``all_to_all``, another collective its own. ``sized``: its chunk sizes
    are data (:attr:`~shardflow.lower.program.Comm.splits`), which both implementations take. ``local``: the
    one-process implementation, registered by :mod:`shardflow.lower.comms`
    (:func:`~shardflow.lower.comms.run_local`); ``distributed``: this rank's side on torch.distributed,
    registered by :mod:`shardflow.runtime.comms` (:func:`~shardflow.runtime.comms.issue`)."""

    kind: CommKind
    family: str
    sent: Callable[[int, int, bool], int]
    fields: tuple[str, ...] = ()
    point_to_point: bool = False
    dim_first: bool = False
    sized: bool = False
    local: Callable | None = None
    distributed: Callable | None = None

    @property
    def priced_as(self) -> str:
        if self.point_to_point:
            return "p2p"
        return CommKind.ALL_TO_ALL.value if self.sized else self.kind.value


def _ring(n: int, d: int) -> int:  # (d−1)/d of the piece
    return n * (d - 1) // d


KINDS: dict[CommKind, CommSpec] = {
    s.kind: s
    for s in (
        CommSpec(CommKind.SEND, "p2p", lambda n, d, root: n, ("peer",), point_to_point=True),
        CommSpec(CommKind.RECV, "p2p", lambda n, d, root: 0, ("peer",), point_to_point=True),  # the sender counts
        CommSpec(CommKind.ALL_REDUCE, "all_reduce", lambda n, d, root: 2 * _ring(n, d)),
        CommSpec(CommKind.ALL_GATHER, "all_gather", lambda n, d, root: (d - 1) * n, dim_first=True),
        CommSpec(CommKind.REDUCE_SCATTER, "reduce_scatter", lambda n, d, root: _ring(n, d), dim_first=True),
        CommSpec(CommKind.ALL_TO_ALL, "all_to_all", lambda n, d, root: _ring(n, d)),
        # its bound: every row of the send buffer to another member (what it sends is measured when it runs)
        CommSpec(CommKind.ALL_TO_ALL_V, "all_to_all_v", lambda n, d, root: n, sized=True),
        CommSpec(CommKind.BROADCAST, "broadcast", lambda n, d, root: n if root else 0, ("root",)),
        CommSpec(CommKind.REDUCE, "reduce", lambda n, d, root: _ring(n, d), ("root",)),
        CommSpec(
            CommKind.PERMUTE,
            "permute",
            lambda n, d, root: n,
            ("peer", "peer_from"),
            point_to_point=True,
            dim_first=True,
        ),
    )
}

F = TypeVar("F", bound=Callable)


def _register(side: str, kind: CommKind) -> Callable[[F], F]:
    def register(fn: F) -> F:
        KINDS[kind] = dataclasses.replace(KINDS[kind], **{side: fn})
        return fn

    return register


# Decorators: ``fn`` is ``kind``'s one-process implementation (:mod:`shardflow.lower.comms`), its torch.distributed
# one (:mod:`shardflow.runtime.comms`).
register_local = functools.partial(_register, "local")
register_distributed = functools.partial(_register, "distributed")


def bound_bytes(kind: CommKind, piece_bytes: int, d: int, is_root: bool = False) -> int:
    """Bandwidth-optimal bytes one rank of a ``d``-member communication sends; ``piece_bytes``: the rank's
    send piece (for all-gather the piece it contributes). A group of one moves nothing."""
    spec = KINDS[kind]
    return spec.sent(piece_bytes, d, is_root) if d > 1 or spec.point_to_point else 0


def wire_bytes(kind: CommKind, piece_bytes: int, d: int, is_root: bool = False) -> int:
    """Bytes one rank puts on the wire with shardflow's implementation of ``kind``
    (:func:`shardflow.runtime.comms.issue`): every implementation is a ring-algorithm call, so this is
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
    (ReductionOp.kind,): CommKind.ALL_REDUCE,
    (ReductionOp.kind, RepartitionOp.kind): CommKind.REDUCE_SCATTER,
    (CombineOp.kind,): CommKind.ALL_GATHER,
    (CombineOp.kind, RepartitionOp.kind): CommKind.ALL_TO_ALL,
    (RepartitionOp.kind,): LocalKind.SPLIT,
}


def fuses(first: ParallelOp, second: ParallelOp) -> bool:
    """Whether ``second`` right after ``first`` (reading only its output) lowers as one communication: a Reduction
    or a Combine followed by a Repartition on the same axis — a reduce-scatter, an all-to-all (a Combine and a
    Repartition of the same dim are not fused)."""
    return (
        isinstance(first, (ReductionOp, CombineOp))
        and isinstance(second, RepartitionOp)
        and first.axis == second.axis
        and not (isinstance(first, CombineOp) and first.dim == second.dim)
    )


def padded_shape(shape: tuple[int, ...], dim: int, degree: int) -> tuple[int, ...]:
    """``shape`` with dim ``dim`` rounded up to a multiple of ``degree``: what a member sends when it cuts that dim
    into ``degree`` equal blocks (a reduce-scatter's or all-to-all's send; an uneven dim padded with zeros,
    docs/concepts.md#uneven-shards)."""
    out = list(shape)
    out[dim] = degree * -(-out[dim] // degree)
    return tuple(out)


def redistribution_steps(
    ops: Sequence[ParallelOp], src: Sharding, group: SubMesh, type_: TensorType
) -> list[tuple[CommKind, int]]:
    """(communication kind, bytes one device sends) of each communication step of running ``ops`` forward on a
    tensor of ``type_`` held as ``src`` on ``group`` — the parallel ops of :func:`~shardflow.parallel.ops.redistribute`
    (never a Replicate), grouped into steps as :func:`~shardflow.lower.shard_expansion.steps` groups them
    (consecutive ops that :func:`fuses` are one step), each costing :func:`wire_bytes` of the piece entering it;
    local steps (splits, aliases) are left out."""
    out = []
    i = 0
    while i < len(ops):
        step = tuple(ops[i : i + 2]) if i + 1 < len(ops) and fuses(ops[i], ops[i + 1]) else (ops[i],)
        kind = LocalKind.ALIAS if step[0].degree == 1 else REDISTRIBUTION[tuple(op.kind for op in step)]
        if isinstance(kind, CommKind):
            shape = src.parallel_shape(group, type_.shape).piece_shape
            if kind in (CommKind.REDUCE_SCATTER, CommKind.ALL_TO_ALL):  # cut into equal blocks: an uneven dim padded
                shape = padded_shape(shape, step[-1].dim, step[0].degree)  # type: ignore[attr-defined]
            piece_bytes = TensorType(shape, type_.dtype).nbytes
            out.append((kind, wire_bytes(kind, piece_bytes, step[0].degree)))
        for op in step:
            src, group = op.apply(src, group)
        i += len(step)
    return out


def redistribution_cost(ops: Sequence[ParallelOp], src: Sharding, group: SubMesh, type_: TensorType) -> tuple[int, int]:
    """(bytes one device sends, communications) of running ``ops`` forward on a tensor of ``type_`` held as ``src``
    on ``group``: :func:`redistribution_steps` summed. The planner prices redistributions with this, so planning and
    lowering count bytes by one definition."""
    steps = redistribution_steps(ops, src, group, type_)
    return sum(b for _, b in steps), len(steps)
