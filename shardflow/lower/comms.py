"""Communication kinds (:class:`~shardflow.parallel.collectives.CommKind`, their bytes on the wire:
:func:`~shardflow.parallel.collectives.wire_bytes`), each implemented once here: the verifier's view, the local
implementation and the torch.distributed implementation.

The verifier asks :data:`FIELDS` which of ``peer``/``peer_from``/``root`` a
:class:`~shardflow.lower.program.Comm` uses; the local executor runs :func:`run_local` (every member's buffers in one
process), the distributed executor and the benchmarks :func:`issue` (this rank's side on torch.distributed). Every
kind is implemented with a call whose ring algorithm meets the bandwidth-optimal bound, so the wire bytes *are* the
bound (gloo's reduce-scatter included: ``reduce_scatter_single``, not an all-reduce underneath).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Sequence

import torch

from shardflow.graph.ops import torch_dtype
from shardflow.lower.program import Comm


class ReduceOp(StrEnum):
    """How partial pieces combine (DTensor's ``Partial(reduce_op)``)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


# Which of peer / peer_from / root each family uses (each must name a member); the others stay None.
FIELDS: dict[str, tuple[str, ...]] = {"p2p": ("peer",), "permute": ("peer", "peer_from"), "broadcast": ("root",),
                                      "reduce": ("root",)}


# --- local implementation: every member's buffers in one process ---------------------------------------
_REDUCE = {"sum": lambda x: x.sum(0), "avg": lambda x: x.mean(0), "max": lambda x: x.amax(0),
           "min": lambda x: x.amin(0)}


def run_local(members: Sequence[Comm], sends: Sequence[torch.Tensor | None],
              shared: Sequence[bool]) -> list[torch.Tensor | None]:
    """What each member receives (``None``: nothing), from what each sends; all three in ``members[0].members``
    order. ``shared``: per member, whether its send buffer is the communication's to use
    (:func:`~shardflow.lower.program.shared_sends`): a reduction then writes its result there and a broadcast root
    keeps its buffer as its result, as :func:`issue` does — so the local executor runs the same buffer sharing as
    the distributed one. Raises ValueError for an unknown kind."""
    c = members[0]
    d = len(members)
    kind = c.family
    if kind == "all_reduce":
        s = _REDUCE[c.reduce_op](torch.stack(list(sends)))
        return [x.copy_(s) if own else s.clone() for x, own in zip(sends, shared)]
    if kind == "all_gather":
        s = torch.cat(list(sends), c.dim)
        return [s if j == 0 else s.clone() for j in range(d)]
    if kind == "reduce_scatter":
        return list(_REDUCE[c.reduce_op](torch.stack(list(sends))).chunk(d, c.dim))
    if kind == "all_to_all":
        chunks = [x.chunk(d, c.dim) for x in sends]
        return [torch.cat([chunks[i][j] for i in range(d)], c.dim2) for j in range(d)]
    if kind == "broadcast":
        k = c.members.index(c.root)
        root = sends[k] if shared[k] else sends[k].clone()
        return [None if m.recv is None else root if j == k else sends[k].clone() for j, m in enumerate(members)]
    if kind == "reduce":  # a root outside the group (a machine view) adds nothing
        s = torch.stack([x for x in sends if x is not None]).sum(0)
        return [None if m.recv is None else x.copy_(s) if own else s for m, x, own in zip(members, sends, shared)]
    if kind == "permute":  # each member sends to its peer; each receives what was sent to it
        sent_to = {m.peer: x for m, x in zip(members, sends)}
        return [sent_to[r].clone() for r in c.members]
    if kind == "p2p":
        src = next(x for x in sends if x is not None)
        return [None if m.kind == "send" else src.clone() for m in members]
    raise ValueError(f"no local implementation of communication kind {c.kind!r} (token {c.token})")


def front_dim(c: Comm) -> int:
    """The tensor dim that the buffer ``c`` receives into holds first (:func:`issue`): the gathered or scattered dim
    of an all-gather, a reduce-scatter or a ring step that carries one; else 0 (the received value's own layout)."""
    return c.dim if c.kind in ("all_gather", "reduce_scatter", "permute") and c.dim is not None else 0


# --- torch.distributed implementation: this rank's side ------------------------------------------------
@dataclass(frozen=True)
class Issued:
    """A communication issued on torch.distributed: its ``handles`` (wait each exactly once — gloo blocks on
    a second wait of a finished send) and ``result()``, the received buffer once they completed."""

    handles: tuple
    result: Callable[[], torch.Tensor | None]


def issue(c: Comm, send: torch.Tensor | None, rank: int, group=None, in_place: bool = False,
          device: torch.device | str = "cpu", alloc: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> Issued:
    """Issue this rank's side of ``c`` without waiting. ``send``: this rank's send buffer (shape
    ``c.send.type.shape``); ``group``: the process group of ``c.members`` (None = the world); ``in_place``: the
    send buffer is the communication's to use (:func:`~shardflow.lower.program.shared_sends`): an all-reduce or a
    reduce overwrites it with the result, a broadcast root sends it as it is and returns it (a non-contiguous one is
    copied all the same: the backends take contiguous buffers). An all-gather or reduce-scatter along a dim other
    than 0 copies its input once (that dim to the front) and returns a view of the received buffer, not a copy;
    so does a collective-permute step with a ``dim`` (a ring all-gather's, whose chunks are then blocks of the
    gathered buffer in that layout: :class:`~shardflow.runtime.buffers.Receives`; :func:`front_dim`); an
    all-to-all likewise (its result is a copy only where the chunks cannot be viewed in place: ``dim2`` ≠ 0).
    ``alloc(shape)``: the buffer the communication receives into (its result's storage, of the dtype of ``c``; e.g. one
    the caller keeps from step to step: :func:`~shardflow.lower.program.kept_receives`); default a new one. Raises
    ValueError for an unknown kind."""
    import torch.distributed as dist

    def empty(shape) -> torch.Tensor:
        return torch.empty(shape, dtype=torch_dtype(c.type.dtype), device=device)

    alloc = alloc or empty

    def working(x: torch.Tensor) -> torch.Tensor:  # the buffer the backend works on
        return x if in_place and x.is_contiguous() else alloc(tuple(x.shape)).copy_(x)

    d = len(c.members)
    op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
          "min": dist.ReduceOp.MIN}[c.reduce_op]  # gloo has no average: sum, then divide by the group size
    scale = (lambda t: t / d) if c.reduce_op == "avg" else (lambda t: t)
    kind = c.kind
    if kind == "send":
        return Issued((dist.isend(send.contiguous(), c.peer),), lambda: None)
    if kind == "recv":
        out = alloc(c.recv.type.shape)
        return Issued((dist.irecv(out, c.peer),), lambda: out)
    if kind == "all_reduce":
        out = working(send)
        return Issued((dist.all_reduce(out, op=op, group=group, async_op=True),), lambda: scale(out))
    if kind == "all_gather":  # gathered dim to the front; the result is a view of the gathered buffer
        x = send.movedim(c.dim, 0).contiguous()
        out = alloc((d * x.shape[0],) + tuple(x.shape[1:]))
        return Issued((dist.all_gather_single(out, x, group=group, async_op=True),), lambda: out.movedim(0, c.dim))
    if kind == "reduce_scatter":  # scattered dim to the front; the result is a view of the received buffer
        x = send.movedim(c.dim, 0).contiguous()
        out = alloc((x.shape[0] // d,) + tuple(x.shape[1:]))
        return Issued((dist.reduce_scatter_single(out, x, op=op, group=group, async_op=True),),
                      lambda: scale(out.movedim(0, c.dim)))
    if kind == "all_to_all":  # x[j]: the chunk for member j; out[i]: the chunk from member i
        x = send.unflatten(c.dim, (d, -1)).movedim(c.dim, 0).contiguous()
        out = alloc(tuple(x.shape))
        return Issued((dist.all_to_all_single(out, x, group=group, async_op=True),),
                      lambda: out.movedim(0, c.dim2).flatten(c.dim2, c.dim2 + 1))
    if kind == "broadcast":
        root = rank == c.root
        out = working(send) if root else alloc(c.recv.type.shape)
        work = dist.broadcast(out, src=c.root, group=group, async_op=True)
        return Issued((work,), lambda: out if c.recv is not None else None)
    if kind == "reduce":  # a root outside the group (a machine view) adds zeros
        out = alloc(c.type.shape).zero_() if send is None else working(send)
        work = dist.reduce(out, dst=c.root, group=group, async_op=True)
        return Issued((work,), lambda: out if rank == c.root else None)
    if kind == "permute":  # one ring step, send and recv issued together; with a dim, moved with that dim first
        at = front_dim(c)
        x = send.movedim(at, 0).contiguous()
        out = alloc(tuple(x.shape))
        handles = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, c.peer), dist.P2POp(dist.irecv, out, c.peer_from)])
        return Issued(tuple(handles), lambda: out.movedim(0, at))
    raise ValueError(f"rank {rank}: no implementation of communication kind {c.kind!r} (token {c.token})")
