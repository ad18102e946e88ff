"""The torch.distributed implementation of each communication kind: this rank's side, registered on the kind's
entry in :data:`shardflow.parallel.collectives.KINDS` (:func:`~shardflow.parallel.collectives.register_distributed`),
and :func:`issue`, which the distributed executor, the calibration and the benchmarks call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from shardflow.graph.ops import torch_dtype
from shardflow.lower.comms import front_dim
from shardflow.lower.program import Comm
from shardflow.parallel.collectives import KINDS, CommKind, register_distributed
from shardflow.parallel.mesh import ReduceOp
from shardflow.runtime.torch_compat import all_gather_single, reduce_scatter_single

# gloo has no average: sum, then divide by the group size (Call.scale)
_DIST_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


@dataclass(frozen=True)
class Issued:
    """A communication issued on torch.distributed: its ``handles`` (wait each exactly once — gloo blocks on
    a second wait of a finished send) and ``result()``, the received buffer once they completed."""

    handles: tuple
    result: Callable[[], torch.Tensor | None]


@dataclass(frozen=True)
class Call:
    """One call of :func:`issue`, as a kind's implementation sees it."""

    c: Comm
    send: torch.Tensor | None
    rank: int
    group: object
    in_place: bool
    alloc: Callable[[tuple[int, ...]], torch.Tensor]
    splits: tuple[list[int], list[int]] | None = None

    @property
    def d(self) -> int:
        return len(self.c.members)

    @property
    def op(self) -> dist.ReduceOp:
        return _DIST_OP[self.c.reduce_op]

    def scale(self, t: torch.Tensor) -> torch.Tensor:
        return t / self.d if self.c.reduce_op == ReduceOp.AVG else t

    def working(self, x: torch.Tensor) -> torch.Tensor:
        """The buffer the backend works on: ``x`` itself where it is the communication's to use."""
        return x if self.in_place and x.is_contiguous() else self.alloc(tuple(x.shape)).copy_(x)


def issue(
    c: Comm,
    send: torch.Tensor | None,
    rank: int,
    group=None,
    in_place: bool = False,
    device: torch.device | str = "cpu",
    alloc: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
    splits: tuple[list[int], list[int]] | None = None,
) -> Issued:
    """Issue this rank's side of ``c`` without waiting. ``send``: this rank's send buffer (shape
    ``c.send.type.shape``); ``group``: the process group of ``c.members`` (None = the world); ``in_place``: the
    send buffer is the communication's to use (:func:`~shardflow.lower.buffer_reuse.shared_sends`): an all-reduce or a
    reduce overwrites it with the result, a broadcast root sends it as it is and returns it (a non-contiguous one is
    copied all the same: the backends take contiguous buffers). An all-gather or reduce-scatter along a dim other
    than 0 copies its input once (that dim to the front) and returns a view of the received buffer, not a copy;
    so does a collective-permute step with a ``dim`` (a ring all-gather's, whose chunks are then blocks of the
    gathered buffer in that layout: :class:`~shardflow.runtime.buffers.Receives`;
    :func:`~shardflow.lower.comms.front_dim`); an all-to-all likewise (its result is a copy only where the chunks
    cannot be viewed in place: ``dim2`` ≠ 0). ``alloc(shape)``: the buffer the communication receives into (its
    result's storage, of the dtype of ``c``; e.g. one the caller keeps from step to step:
    :func:`~shardflow.lower.buffer_reuse.kept_receives`); default a new one. ``c.to_storage``/``c.to_natural``: the
    send put in head-tail order first, the result put back in natural order (a copy) once received. ``splits``:
    for an all-to-all of data-dependent sizes, the rows this rank sends to and receives from each member (the sums
    of the rows of ``c.splits``' buffers). Raises ValueError for an unknown kind."""
    spec = KINDS.get(c.kind)
    if spec is None or spec.distributed is None:
        raise ValueError(f"rank {rank}: no implementation of communication kind {c.kind!r} (token {c.token})")

    def empty(shape) -> torch.Tensor:
        return torch.empty(shape, dtype=torch_dtype(c.type.dtype), device=device)

    if c.to_storage is not None and send is not None:  # into the load-balanced layout: a copy, the backend's to use
        send, in_place = c.to_storage.to_storage(send), True
    issued = spec.distributed(Call(c, send, rank, group, in_place, alloc or empty, splits))
    if c.to_natural is None:
        return issued
    natural = c.to_natural.to_natural
    return Issued(issued.handles, lambda: natural(issued.result()))


@register_distributed(CommKind.SEND)
def _send(x: Call) -> Issued:
    return Issued((dist.isend(x.send.contiguous(), x.c.peer),), lambda: None)


@register_distributed(CommKind.RECV)
def _recv(x: Call) -> Issued:
    out = x.alloc(x.c.recv.type.shape)
    return Issued((dist.irecv(out, x.c.peer),), lambda: out)


@register_distributed(CommKind.ALL_REDUCE)
def _all_reduce(x: Call) -> Issued:
    out = x.working(x.send)
    return Issued((dist.all_reduce(out, op=x.op, group=x.group, async_op=True),), lambda: x.scale(out))


@register_distributed(CommKind.ALL_GATHER)
def _all_gather(x: Call) -> Issued:  # gathered dim to the front; the result is a view of the gathered buffer
    t = x.send.movedim(x.c.dim, 0).contiguous()
    out = x.alloc((x.d * t.shape[0],) + tuple(t.shape[1:]))
    return Issued((all_gather_single(out, t, group=x.group, async_op=True),), lambda: out.movedim(0, x.c.dim))


@register_distributed(CommKind.REDUCE_SCATTER)
def _reduce_scatter(x: Call) -> Issued:  # scattered dim to the front; the result is a view of the received buffer
    t = x.send.movedim(x.c.dim, 0).contiguous()
    out = x.alloc((t.shape[0] // x.d,) + tuple(t.shape[1:]))
    return Issued(
        (reduce_scatter_single(out, t, op=x.op, group=x.group, async_op=True),),
        lambda: x.scale(out.movedim(0, x.c.dim)),
    )


@register_distributed(CommKind.ALL_TO_ALL)
def _all_to_all(x: Call) -> Issued:  # t[j]: the chunk for member j; out[i]: the chunk from member i
    c = x.c
    t = x.send.unflatten(c.dim, (x.d, -1)).movedim(c.dim, 0).contiguous()
    out = x.alloc(tuple(t.shape))
    return Issued(
        (dist.all_to_all_single(out, t, group=x.group, async_op=True),),
        lambda: out.movedim(0, c.dim2).flatten(c.dim2, c.dim2 + 1),
    )


@register_distributed(CommKind.ALL_TO_ALL_V)
def _all_to_all_v(x: Call) -> Issued:  # rows along dim 0, as many to and from each member as x.splits say
    assert x.splits is not None and x.send is not None, x.c
    sent, received = x.splits
    t = x.send.contiguous()
    out = x.alloc((sum(received),) + tuple(t.shape[1:]))
    work = dist.all_to_all_single(out, t, received, sent, group=x.group, async_op=True)
    return Issued((work,), lambda: out)


@register_distributed(CommKind.BROADCAST)
def _broadcast(x: Call) -> Issued:
    c = x.c
    out = x.working(x.send) if x.rank == c.root else x.alloc(c.recv.type.shape)
    work = dist.broadcast(out, src=c.root, group=x.group, async_op=True)
    return Issued((work,), lambda: out if c.recv is not None else None)


@register_distributed(CommKind.REDUCE)
def _reduce(x: Call) -> Issued:  # a root outside the group (a machine view) adds zeros
    c = x.c
    out = x.alloc(c.type.shape).zero_() if x.send is None else x.working(x.send)
    work = dist.reduce(out, dst=c.root, group=x.group, async_op=True)
    return Issued((work,), lambda: out if x.rank == c.root else None)


@register_distributed(CommKind.PERMUTE)
def _permute(x: Call) -> Issued:  # one ring step, send and recv issued together; with a dim, moved with that dim first
    at = front_dim(x.c)
    t = x.send.movedim(at, 0).contiguous()
    out = x.alloc(tuple(t.shape))
    handles = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, x.c.peer), dist.P2POp(dist.irecv, out, x.c.peer_from)])
    return Issued(tuple(handles), lambda: out.movedim(0, at))
