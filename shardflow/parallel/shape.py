"""Parallel tensor shapes (FlexFlow/Unity): how a tensor is cut into pieces, independent of devices.

A :class:`ParallelTensorShape` is the full logical shape plus

* a **shard degree** per dim: the dim is cut into that many consecutive blocks, in DTensor's chunk layout: each
  block ⌈size/degree⌉ indices, the last ones shorter or empty where the degree does not divide the size (9 on 4
  devices: 3, 3, 3, 0 — an **uneven** dim, docs/concepts.md#uneven-shards). Every piece is stored at the full block
  size, its tail past the dim's end zero (the padding), so every device runs the same program;
* a **sum degree**: the tensor is the element-wise reduction (``reduce_op``, normally sum) of that many
  partial pieces;
* a **replica degree**: that many identical copies (FlexFlow's discard-copy degree).

A piece is addressed by a :class:`ShardCoord` (sum index, replica index, shard index per dim); there are
``sum × replica × Π shard`` pieces, each stored at :meth:`ParallelTensorShape.piece_shape` and holding
:meth:`ParallelTensorShape.piece_valid` elements of the tensor.

A dim may be stored in the **head-tail order** of context parallelism's load-balanced layout
(:class:`HeadTail`; docs/concepts.md#the-load-balanced-layout): its blocks are then blocks of the dim permuted,
so that under a causal mask every device's block holds as many early positions as late ones.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from shardflow.graph.layout import HeadTail, pad_dim
from shardflow.parallel.mesh import ReduceOp


class ShardingError(ValueError):
    """A parallel shape, placement or sharding rule does not hold; the message says where and how to fix."""


class DegreeError(ShardingError):
    """A degree does not divide its dim. Carries ``dim``, ``size``, ``degree`` and the ``op``/``tensor`` names."""

    def __init__(self, dim: int, size: int, degree: int, op: str = "", tensor: str = "", hint: str = ""):
        self.dim, self.size, self.degree, self.op, self.tensor, self.hint = dim, size, degree, op, tensor, hint
        where = " ".join(x for x in (f"op {op!r}" if op else "", f"tensor {tensor!r}" if tensor else "") if x)
        super().__init__(
            f"{where + ': ' if where else ''}degree {degree} does not divide dim {dim} of size {size}"
            f"{'; ' + hint if hint else ''} (use a degree that divides {size})"
        )

    def at(self, op: str = "", tensor: str = "", hint: str = "") -> DegreeError:
        """The same error, naming the op and tensor where it happened."""
        hints = "; ".join(h for h in (self.hint, hint) if h)
        return DegreeError(self.dim, self.size, self.degree, op or self.op, tensor or self.tensor, hints)


@dataclass(frozen=True, slots=True)
class ShardCoord:
    """Address of one piece: ``sum`` index, ``replica`` index and the block index along each dim."""

    sum: int
    replica: int
    shard: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ParallelTensorShape:
    """Full ``shape`` with ``shard`` degrees per dim, ``sum_degree`` (of ``reduce_op``) and ``replica_degree``.

    A degree need not divide its dim (:attr:`uneven`): the blocks are DTensor's chunks, stored padded to
    :attr:`piece_shape`. Raises :class:`ShardingError` for malformed degrees (fewer than 1, one per dim missing),
    :class:`DegreeError` for an uneven dim stored in head-tail order.
    """

    shape: tuple[int, ...]
    shard: tuple[int, ...]
    sum_degree: int = 1
    replica_degree: int = 1
    reduce_op: ReduceOp = ReduceOp.SUM
    dtype: str = "float32"
    head_tail: tuple[HeadTail, ...] = ()  # the dims stored in head-tail order (the load-balanced layout)

    def __post_init__(self):
        if len(self.shard) != len(self.shape):
            raise ShardingError(f"parallel shape: {len(self.shard)} shard degrees for {len(self.shape)} dims")
        if min((*self.shard, self.sum_degree, self.replica_degree), default=1) < 1:
            raise ShardingError(f"parallel shape: degrees must be ≥ 1, got {self}")
        object.__setattr__(self, "reduce_op", ReduceOp.parse(self.reduce_op, "parallel shape", ShardingError))
        for h in self.head_tail:
            if self.shape[h.dim] % self.shard[h.dim]:
                raise DegreeError(h.dim, self.shape[h.dim], self.shard[h.dim], hint="a dim in head-tail order")

    @classmethod
    def unparallel(cls, shape: tuple[int, ...], dtype: str = "float32") -> ParallelTensorShape:
        """All degrees 1: one piece, the whole tensor."""
        return cls(tuple(shape), (1,) * len(shape), dtype=dtype)

    @property
    def num_pieces(self) -> int:
        return self.sum_degree * self.replica_degree * math.prod(self.shard)

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """Shape every piece is stored at: ``⌈shape[d] / shard[d]⌉`` (DTensor's chunk size)."""
        return tuple(-(-s // d) for s, d in zip(self.shape, self.shard))

    @property
    def uneven(self) -> tuple[int, ...]:
        """The dims whose degree does not divide their size: their last blocks are short or empty, stored padded."""
        return tuple(d for d, (s, k) in enumerate(zip(self.shape, self.shard)) if s % k)

    def piece_valid(self, coord: ShardCoord) -> tuple[int, ...]:
        """How many indices of each dim the piece at ``coord`` holds of the tensor (the rest of its
        :attr:`piece_shape` is padding): ``piece_shape`` where the degrees divide."""
        return tuple(sl.stop - sl.start for sl in self.piece_slices(coord))

    def piece_of(self, full: torch.Tensor, coord: ShardCoord) -> torch.Tensor:
        """The piece at ``coord`` of tensor ``full`` (of :attr:`shape`), at :attr:`piece_shape`: its block, padded with
        zeros where the block is short (a copy there, else an index of ``full``)."""
        return self.padded(full[self.piece_index(coord)])

    def padded(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` (a piece's block of the tensor) at :attr:`piece_shape`, zeros after its end where it is short (a
        copy there, else ``block`` itself)."""
        for d in self.uneven:
            block = pad_dim(block, d, self.piece_shape[d])
        return block

    def valid_of(self, piece: torch.Tensor, coord: ShardCoord) -> torch.Tensor:
        """The part of ``piece`` (at :attr:`piece_shape`, held at ``coord``) that is the tensor's: a view without the
        padding."""
        held = self.piece_valid(coord)
        for d in self.uneven:
            piece = piece.narrow(d, 0, held[d])
        return piece

    @property
    def piece_numel(self) -> int:
        return math.prod(self.piece_shape)

    def coords(self) -> Iterator[ShardCoord]:
        """Every piece coordinate, sum index outermost, then replica, then shard indices row-major."""
        for s, r in itertools.product(range(self.sum_degree), range(self.replica_degree)):
            for idx in itertools.product(*(range(d) for d in self.shard)):
                yield ShardCoord(s, r, idx)

    def piece_slices(self, coord: ShardCoord) -> tuple[slice, ...]:
        """The block the piece at ``coord`` covers (blocked layout; a short or empty one at the end of an uneven dim),
        in storage order: of the full tensor where no dim is in head-tail order (:meth:`piece_index` says which
        elements of the full tensor in any case)."""
        piece = self.piece_shape
        return tuple(slice(min(i * p, n), min((i + 1) * p, n)) for i, p, n in zip(coord.shard, piece, self.shape))

    def piece_index(self, coord: ShardCoord) -> tuple[slice | torch.Tensor, ...]:
        """The elements of the full tensor the piece at ``coord`` holds, an index of it (``full[index]`` reads the
        piece, ``full[index] = piece`` writes it): :meth:`piece_slices`, with a dim in head-tail order given as the
        positions its storage block holds (int64)."""
        index: list[slice | torch.Tensor] = list(self.piece_slices(coord))
        for h in self.head_tail:
            index[h.dim] = h.order()[index[h.dim]]
        return tuple(index)

    def __str__(self) -> str:
        dims = ", ".join(f"{s}/{d}" if d > 1 else f"{s}" for s, d in zip(self.shape, self.shard))
        extra = (
            f" sum={self.sum_degree}" + (f"({self.reduce_op})" if self.reduce_op != ReduceOp.SUM else "")
            if self.sum_degree > 1
            else ""
        )
        extra += f" rep={self.replica_degree}" if self.replica_degree > 1 else ""
        return f"[{dims}]{extra}"
