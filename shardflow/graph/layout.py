"""The load-balanced layout of a sequence split over context parallelism (docs/concepts.md#the-load-balanced-layout):
which position each index of a dim stored in head-tail order holds. A graph-level value, read by the ops that
depend on positions (a causal attention over a block of the sequence) and by the parallel shapes that store a
dim so (:class:`~shardflow.parallel.shape.ParallelTensorShape`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HeadTail:
    """The load-balanced layout of a sequence dim under context parallelism (PyTorch's head-tail load balancer;
    docs/concepts.md#the-load-balanced-layout): dim ``dim`` of ``length`` indices is ``segments`` equal segments
    (one per block of the mesh axes that shard the dim before the balanced one: a sequence per row where the rows
    of a ``[B·T]`` dim are split), each cut into ``chunks`` = 2·cp equal chunks stored in the order 0, chunks−1, 1,
    chunks−2, …, so that device r of the cp axis holds chunks r and chunks−1−r of its segment — under a causal mask,
    one early and one late chunk: as many attended keys as every other device. Storage index i holds position
    :meth:`order` [i].

    Raises ValueError when ``segments`` × ``chunks`` does not divide ``length``."""

    dim: int
    chunks: int
    length: int
    segments: int = 1

    def __post_init__(self):
        if self.length % (self.segments * self.chunks):
            raise ValueError(
                f"head-tail layout: {self.segments} segment(s) of {self.chunks} chunks do not divide dim {self.dim} "
                f"of {self.length}"
            )

    def order(self) -> torch.Tensor:
        """``[length]`` int64: the position each storage index holds."""
        return _head_tail_order(self.length, self.chunks, self.segments)

    def runs(self, start: int, size: int) -> list[tuple[int, int, int]]:
        """Storage indices ``start … start+size−1`` as runs of consecutive positions: (storage offset from
        ``start``, first position, length), in storage order (one run per chunk they touch)."""
        c = self.length // (self.segments * self.chunks)
        out, i = [], start
        while i < start + size:
            k, off = divmod(i, c)
            segment, k = divmod(k, self.chunks)
            chunk = k // 2 if k % 2 == 0 else self.chunks - 1 - k // 2
            n = min(c - off, start + size - i)
            out.append((i - start, (segment * self.chunks + chunk) * c + off, n))
            i += n
        return out

    def to_storage(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with dim :attr:`dim` in natural order → in storage order (a copy)."""
        return x.index_select(self.dim, self.order().to(x.device))

    def to_natural(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with dim :attr:`dim` in storage order → in natural order (a copy)."""
        return x.index_select(self.dim, torch.argsort(self.order()).to(x.device))


@functools.lru_cache(maxsize=64)
def _head_tail_order(length: int, chunks: int, segments: int) -> torch.Tensor:
    order = [k // 2 if k % 2 == 0 else chunks - 1 - k // 2 for k in range(chunks)]
    return torch.arange(length).view(segments, chunks, -1)[:, order].reshape(-1)


def pad_dim(x: torch.Tensor, dim: int, size: int, fill: float | bool = 0) -> torch.Tensor:
    """``x`` with dim ``dim`` extended to ``size`` indices, the new ones ``fill`` (a copy; ``x`` itself where it has
    ``size`` already): the padding of an uneven dim's short block (docs/concepts.md#uneven-shards)."""
    if x.shape[dim] == size:
        return x
    pad = list(x.shape)
    pad[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_full(pad, fill)], dim)


@dataclass(frozen=True, slots=True)
class Padded:
    """An uneven dim as a communication moves it (docs/concepts.md#uneven-shards): dim ``dim`` of ``length`` indices
    is sent and received as ``padded`` (the degree × the block size ⌈length / degree⌉), its tail zeros — what is cut
    into equal blocks (a reduce-scatter's or all-to-all's send) or joined from them (an all-gather's receive).
    The same two methods as :class:`HeadTail`, so a communication applies either alike."""

    dim: int
    length: int
    padded: int

    def to_storage(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with dim :attr:`dim` of :attr:`length` → of :attr:`padded`, the tail zeros (a copy)."""
        return pad_dim(x, self.dim, self.padded)

    def to_natural(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with dim :attr:`dim` of :attr:`padded` → its first :attr:`length` indices (a view)."""
        return x.narrow(self.dim, 0, self.length)
