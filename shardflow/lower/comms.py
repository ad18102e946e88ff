"""Communication kinds, each one entry: :data:`KINDS` maps every :class:`CommKind` to its :class:`CommSpec` —
the fields the verifier checks, the bytes on the wire, the one-process implementation and the torch.distributed
one — as JAX registers one primitive per collective with its rules.

The torch.distributed side needs a process group, so it lives in :mod:`shardflow.runtime.comms`, which registers
it on the entry (:func:`register_distributed`): lowering and the verifier never import the runtime. Lowering asks
:func:`wire_bytes` what a :class:`~shardflow.lower.program.Comm` costs; the verifier asks the entry which of
``peer``/``peer_from``/``root`` it uses; the local executor runs :func:`run_local` (every member's buffers in one
process), the distributed executor and the benchmarks :func:`shardflow.runtime.comms.issue` (this rank's side on
torch.distributed); the bytes report and the benchmarks use :func:`wire_bytes` and :func:`bound_bytes`. A new
kind is one entry here and its registered torch.distributed implementation, nothing else.

Bytes: what one rank sends per call. The bandwidth-optimal bound (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009): (d−1)/d·N for all-gather (N = the gathered
bytes), reduce-scatter and all-to-all (N = the input piece), 2(d−1)/d·N for all-reduce; a send or one
collective-permute step moves its piece; a broadcast root sends N once; a reduce (d−1)/d·N. Every kind
below is implemented with a call whose ring algorithm meets the bound, so the wire bytes *are* the bound
(gloo's reduce-scatter included: ``reduce_scatter_single``, not an all-reduce underneath).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from shardflow.lower.program import Comm


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


# What each member receives (None: nothing), from what each sends, all in ``members[0].members`` order; ``shared``:
# per member, whether its send buffer is the communication's to use (see run_local).
LocalImpl = Callable[[Sequence["Comm"], Sequence[torch.Tensor | None], Sequence[bool]], list[torch.Tensor | None]]


@dataclass(frozen=True)
class CommSpec:
    """Everything shardflow knows about one communication kind.

    ``family``: what the members of one communication hold (send and recv: ``p2p``, one transfer seen from its
    two ends). ``fields``: which of ``peer``/``peer_from``/``root`` it uses (each must name a member); the
    others stay None. ``point_to_point``: issued between two ranks, without a process group. ``dim_first``: it
    receives with ``dim`` moved to the front (:func:`front_dim`). ``sent(piece_bytes, d, is_root)``: the
    bandwidth-optimal bytes one rank of a ``d``-member communication sends (``piece_bytes``: its send piece;
    for an all-gather the piece it contributes). ``local``: the one-process implementation (:func:`run_local`).
    ``priced_as``: the cost model's kind of call (:data:`~shardflow.lower.calibration.COST_KINDS`): send, recv and
    a permute step are ``p2p``, a collective is its own.
    ``distributed``: this rank's side on torch.distributed, registered by :mod:`shardflow.runtime.comms`."""

    kind: CommKind
    family: str
    sent: Callable[[int, int, bool], int]
    local: LocalImpl
    fields: tuple[str, ...] = ()
    point_to_point: bool = False
    dim_first: bool = False
    distributed: Callable | None = None

    @property
    def priced_as(self) -> str:
        return "p2p" if self.point_to_point else self.kind.value


# --- local implementations: every member's buffers in one process -----------------------------------------
def _all_reduce(members, sends, shared):
    s = members[0].reduce_op.combine(torch.stack(list(sends)))
    return [x.copy_(s) if own else s.clone() for x, own in zip(sends, shared)]


def _all_gather(members, sends, shared):
    s = torch.cat(list(sends), members[0].dim)
    return [s if j == 0 else s.clone() for j in range(len(members))]


def _reduce_scatter(members, sends, shared):
    c = members[0]
    return list(c.reduce_op.combine(torch.stack(list(sends))).chunk(len(members), c.dim))


def _all_to_all(members, sends, shared):
    c, d = members[0], len(members)
    chunks = [x.chunk(d, c.dim) for x in sends]
    return [torch.cat([chunks[i][j] for i in range(d)], c.dim2) for j in range(d)]


def _broadcast(members, sends, shared):
    c = members[0]
    k = c.members.index(c.root)
    root = sends[k] if shared[k] else sends[k].clone()
    return [None if m.recv is None else root if j == k else sends[k].clone() for j, m in enumerate(members)]


def _reduce(members, sends, shared):  # a root outside the group (a machine view) adds nothing
    s = torch.stack([x for x in sends if x is not None]).sum(0)
    return [None if m.recv is None else x.copy_(s) if own else s for m, x, own in zip(members, sends, shared)]


def _permute(members, sends, shared):  # each member sends to its peer; each receives what was sent to it
    sent_to = {m.peer: x for m, x in zip(members, sends)}
    return [sent_to[r].clone() for r in members[0].members]


def _p2p(members, sends, shared):
    src = next(x for x in sends if x is not None)
    return [None if m.kind == CommKind.SEND else src.clone() for m in members]


def _ring(n: int, d: int) -> int:  # (d−1)/d of the piece
    return n * (d - 1) // d


KINDS: dict[CommKind, CommSpec] = {s.kind: s for s in (
    CommSpec(CommKind.SEND, "p2p", lambda n, d, root: n, _p2p, ("peer",), point_to_point=True),
    CommSpec(CommKind.RECV, "p2p", lambda n, d, root: 0, _p2p, ("peer",), point_to_point=True),  # the sender counts
    CommSpec(CommKind.ALL_REDUCE, "all_reduce", lambda n, d, root: 2 * _ring(n, d), _all_reduce),
    CommSpec(CommKind.ALL_GATHER, "all_gather", lambda n, d, root: (d - 1) * n, _all_gather, dim_first=True),
    CommSpec(CommKind.REDUCE_SCATTER, "reduce_scatter", lambda n, d, root: _ring(n, d), _reduce_scatter,
             dim_first=True),
    CommSpec(CommKind.ALL_TO_ALL, "all_to_all", lambda n, d, root: _ring(n, d), _all_to_all),
    CommSpec(CommKind.BROADCAST, "broadcast", lambda n, d, root: n if root else 0, _broadcast, ("root",)),
    CommSpec(CommKind.REDUCE, "reduce", lambda n, d, root: _ring(n, d), _reduce, ("root",)),
    CommSpec(CommKind.PERMUTE, "permute", lambda n, d, root: n, _permute, ("peer", "peer_from"), point_to_point=True,
             dim_first=True),
)}


def register_distributed(kind: CommKind) -> Callable[[Callable], Callable]:
    """Decorator: the torch.distributed implementation of ``kind`` (:mod:`shardflow.runtime.comms`)."""
    def register(fn: Callable) -> Callable:
        KINDS[kind] = dataclasses.replace(KINDS[kind], distributed=fn)
        return fn
    return register


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


def run_local(members: Sequence[Comm], sends: Sequence[torch.Tensor | None],
              shared: Sequence[bool]) -> list[torch.Tensor | None]:
    """What each member receives (``None``: nothing), from what each sends; all three in ``members[0].members``
    order. ``shared``: per member, whether its send buffer is the communication's to use
    (:func:`~shardflow.lower.program.shared_sends`): a reduction then writes its result there and a broadcast root
    keeps its buffer as its result, as :func:`shardflow.runtime.comms.issue` does — so the local executor runs the
    same buffer sharing as the distributed one. Raises ValueError for an unknown kind."""
    c = members[0]
    if c.kind not in KINDS:
        raise ValueError(f"no local implementation of communication kind {c.kind!r} (token {c.token})")
    return KINDS[c.kind].local(members, sends, shared)


def front_dim(c: Comm) -> int:
    """The tensor dim that the buffer ``c`` receives into holds first (:func:`shardflow.runtime.comms.issue`): the
    gathered or scattered dim of an all-gather, a reduce-scatter or a ring step that carries one; else 0 (the
    received value's own layout)."""
    return c.dim if KINDS[c.kind].dim_first and c.dim is not None else 0
