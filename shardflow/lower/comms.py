"""The one-process implementation of each communication kind, registered on the kind's entry in
:data:`shardflow.parallel.collectives.KINDS` (:func:`~shardflow.parallel.collectives.register_local`) — the entry
that also holds its fields, its byte formula and, registered from :mod:`shardflow.runtime.comms`, its
torch.distributed implementation.

The local executor runs :func:`run_local` (every member's buffers in one process); both executors ask
:func:`front_dim` where a communication receives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from shardflow.parallel.collectives import KINDS, CommKind, register_local

if TYPE_CHECKING:
    from shardflow.lower.program import Comm


# Each implementation: what each member receives (None: nothing), from what each sends, all in
# ``members[0].members`` order; ``shared``: per member, whether its send buffer is the communication's to use
# (see run_local).
@register_local(CommKind.ALL_REDUCE)
def _all_reduce(members, sends, shared):
    s = members[0].reduce_op.combine(torch.stack(list(sends)))
    return [x.copy_(s) if own else s.clone() for x, own in zip(sends, shared)]


@register_local(CommKind.ALL_GATHER)
def _all_gather(members, sends, shared):
    s = torch.cat(list(sends), members[0].dim)
    return [s if j == 0 else s.clone() for j in range(len(members))]


@register_local(CommKind.REDUCE_SCATTER)
def _reduce_scatter(members, sends, shared):
    c = members[0]
    return list(c.reduce_op.combine(torch.stack(list(sends))).chunk(len(members), c.dim))


@register_local(CommKind.ALL_TO_ALL)
def _all_to_all(members, sends, shared):
    c, d = members[0], len(members)
    chunks = [x.chunk(d, c.dim) for x in sends]
    return [torch.cat([chunks[i][j] for i in range(d)], c.dim2) for j in range(d)]


@register_local(CommKind.ALL_TO_ALL_V)
def _all_to_all_v(members, sends, shared, splits):  # splits[i][j]: the rows member i sends to member j
    d = len(members)
    chunks = [x.split(s) for x, s in zip(sends, splits)]
    return [torch.cat([chunks[i][j] for i in range(d)]) for j in range(d)]


@register_local(CommKind.BROADCAST)
def _broadcast(members, sends, shared):
    c = members[0]
    k = c.members.index(c.root)
    root = sends[k] if shared[k] else sends[k].clone()
    return [None if m.recv is None else root if j == k else sends[k].clone() for j, m in enumerate(members)]


@register_local(CommKind.REDUCE)
def _reduce(members, sends, shared):  # a root outside the group (a machine view) adds nothing
    s = torch.stack([x for x in sends if x is not None]).sum(0)
    return [None if m.recv is None else x.copy_(s) if own else s for m, x, own in zip(members, sends, shared)]


@register_local(CommKind.PERMUTE)
def _permute(members, sends, shared):  # each member sends to its peer; each receives what was sent to it
    sent_to = {m.peer: x for m, x in zip(members, sends)}
    return [sent_to[r].clone() for r in members[0].members]


@register_local(CommKind.SEND)
@register_local(CommKind.RECV)
def _p2p(members, sends, shared):
    src = next(x for x in sends if x is not None)
    return [None if m.kind == CommKind.SEND else src.clone() for m in members]


def run_local(
    members: Sequence[Comm],
    sends: Sequence[torch.Tensor | None],
    shared: Sequence[bool],
    splits: Sequence[list[int]] = (),
) -> list[torch.Tensor | None]:
    """What each member receives (``None``: nothing), from what each sends; all four in ``members[0].members``
    order. ``splits``: for a kind whose sizes are data (``all_to_all_v``), per member the rows it sends to each.
    ``shared``: per member, whether its send buffer is the communication's to use
    (:func:`~shardflow.lower.buffer_reuse.shared_sends`): a reduction then writes its result there and a broadcast root
    keeps its buffer as its result, as :func:`shardflow.runtime.comms.issue` does — so the local executor runs the
    same buffer sharing as the distributed one; and the head-tail reorders of ``Comm.to_storage``/``to_natural``.
    Raises ValueError for an unknown kind."""
    c = members[0]
    if c.kind not in KINDS:
        raise ValueError(f"no local implementation of communication kind {c.kind!r} (token {c.token})")
    if c.to_storage is not None:  # into the load-balanced layout (Comm.to_storage): copies, the communication's
        sends, shared = [x if x is None else c.to_storage.to_storage(x) for x in sends], [True] * len(sends)
    spec = KINDS[c.kind]
    received = spec.local(members, sends, shared, splits) if spec.sized else spec.local(members, sends, shared)
    if c.to_natural is None:
        return received
    return [x if x is None else c.to_natural.to_natural(x) for x in received]


def sized_bytes(c: Comm, rows: Sequence[int], index: int) -> int:
    """Bytes member ``index`` of an all-to-all of data-dependent sizes (``c``) sends when it sends ``rows[j]`` rows
    to member j: the rows to the other members (its bound, ``c.nbytes``, is every row of the send buffer)."""
    row = c.type.nbytes // c.type.shape[0] if c.type.shape[0] else 0
    return row * (sum(rows) - rows[index])


def front_dim(c: Comm) -> int:
    """The tensor dim that the buffer ``c`` receives into holds first (:func:`shardflow.runtime.comms.issue`): the
    gathered or scattered dim of an all-gather, a reduce-scatter or a ring step that carries one; else 0 (the
    received value's own layout)."""
    return c.dim if KINDS[c.kind].dim_first and c.dim is not None else 0
