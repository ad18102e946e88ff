"""Shardings: a tensor's pieces bound to mesh axes — the bridge between parallel shapes and placements.

A :class:`Sharding` names, for each tensor dim, the mesh axes that cut it (major axis first) and the axes
that hold partial sums; every other free axis of the tensor's :class:`SubMesh` holds replicas. From it follow

* the :class:`ParallelTensorShape` (degrees only: shard degree of a dim = product of its axes' sizes, sum
  degree = product of the partial axes, replica degree = product of the remaining free axes), and
* the DTensor placements (one per free axis: ``Shard(dim)``, ``Partial(op)`` or ``Replicate()``), and
* the device of each piece: along the axes of a dim the block index is the mixed-radix number of the
  devices' coordinates on those axes, major axis first — so two axes sharding one dim in mesh order
  mean exactly DTensor's ``[Shard(d), Shard(d)]``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Mapping

from shardflow.graph.layout import HeadTail
from shardflow.parallel.mesh import Partial, Placement, ReduceOp, Replicate, Shard, SubMesh
from shardflow.parallel.shape import DegreeError, ParallelTensorShape, ShardCoord, ShardingError


@dataclass(frozen=True, slots=True)
class Sharding:
    """``dims[d]``: mesh axes sharding tensor dim d (major first); ``partial``: axes holding partial pieces."""

    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    reduce_op: ReduceOp = ReduceOp.SUM
    _used: frozenset[str] = field(init=False, repr=False, compare=False)  # every axis in dims and partial
    # the hash, once asked (0: not yet): shardings key the planner's and lowering's caches by the hundred thousand
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    @classmethod
    def replicated(cls, ndim: int) -> Sharding:
        return cls(((),) * ndim)

    def __post_init__(self):
        used = [a for axes in self.dims for a in axes] + list(self.partial)
        object.__setattr__(self, "_used", frozenset(used))
        if len(used) != len(self._used):
            raise ShardingError(f"sharding {self}: a mesh axis is used twice ({used})")
        object.__setattr__(self, "reduce_op", ReduceOp.parse(self.reduce_op, "sharding", ShardingError))

    def __hash__(self) -> int:
        if not self._hash:
            object.__setattr__(self, "_hash", hash((self.dims, self.partial, self.reduce_op)))
        return self._hash

    def __reduce__(self):  # pickled without the hash: a string's hash differs between processes
        return Sharding, (self.dims, self.partial, self.reduce_op)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def used_axes(self) -> frozenset[str]:
        """Every mesh axis that shards a dim or holds partial pieces (computed once, at construction)."""
        return self._used

    @property
    def is_partial(self) -> bool:
        return bool(self.partial)

    @property
    def is_linear_partial(self) -> bool:
        return not self.partial or self.reduce_op.linear

    def axis_dim(self, axis: str) -> int | None:
        """The tensor dim ``axis`` shards, or None."""
        return next((d for d, axes in enumerate(self.dims) if axis in axes), None)

    def replace_dim(self, d: int, axes: tuple[str, ...]) -> Sharding:
        dims = list(self.dims)
        dims[d] = axes
        return Sharding(tuple(dims), self.partial, self.reduce_op)

    def with_layout(self, layout: Mapping[str, Placement], group: SubMesh) -> Sharding:
        """This sharding with the axes named in ``layout`` re-placed as it says (other axes unchanged).

        An axis that joins a sharded dim is put in mesh order among the dim's axes (DTensor's order).
        """
        order = {a: i for i, a in enumerate(group.mesh.axis_names)}
        dims = [[a for a in axes if a not in layout] for axes in self.dims]
        partial = [a for a in self.partial if a not in layout]
        reduce_op = self.reduce_op
        for a, p in layout.items():
            if isinstance(p, Shard):
                if not -self.ndim <= p.dim < self.ndim:
                    raise ShardingError(f"layout {a}: {p} is out of range for a {self.ndim}-dim tensor")
                dims[p.dim % self.ndim] = sorted(dims[p.dim % self.ndim] + [a], key=order.__getitem__)
            elif isinstance(p, Partial):
                partial.append(a)
                reduce_op = p.reduce_op
        return Sharding(tuple(tuple(d) for d in dims), tuple(partial), reduce_op if partial else ReduceOp.SUM)

    # --- degrees --------------------------------------------------------------------------------------
    def shard_degree(self, group: SubMesh, d: int) -> int:
        axes = self.dims[d]
        return math.prod(group.mesh.axis_size(a) for a in axes) if axes else 1

    def sum_degree(self, group: SubMesh) -> int:
        return math.prod(group.mesh.axis_size(a) for a in self.partial)

    def replica_axes(self, group: SubMesh) -> tuple[str, ...]:
        return tuple(a for a in group.free_axes if a not in self.used_axes)

    def check(
        self, group: SubMesh, shape: tuple[int, ...], op: str = "", tensor: str = "", uneven: bool = False
    ) -> None:
        """Raise unless every axis is free in ``group`` and every dim's degree divides its size — or, with ``uneven``,
        a dim it does not divide is sharded by one mesh axis (DTensor's chunk layout:
        docs/concepts.md#uneven-shards; the blocks of two axes nest in another layout than one axis of their
        product's, so such a dim must divide) and not stored in head-tail order."""
        if len(shape) != self.ndim:
            raise ShardingError(f"op {op!r} tensor {tensor!r}: sharding {self} has {self.ndim} dims, shape {shape}")
        free = group.free_axes
        for a in self.used_axes:
            if a not in free:
                raise ShardingError(
                    f"op {op!r} tensor {tensor!r}: axis {a!r} is not a free axis of {group} "
                    f"(free: {list(group.free_axes)})"
                )
        for d, size in enumerate(shape):
            deg = self.shard_degree(group, d)
            if size % deg and not (uneven and self.uneven_ok(group, shape, d)):
                axes = "×".join(self.dims[d])
                hint = f"shape {list(shape)}, mesh axes {axes} of {group.mesh}"
                if uneven and len(self.dims[d]) > 1:
                    hint += "; several mesh axes split a dim in equal blocks only, one axis may split it unevenly"
                raise DegreeError(d, size, deg, op, tensor, hint)

    def uneven_ok(self, group: SubMesh, shape: tuple[int, ...], d: int) -> bool:
        """Whether dim ``d`` of a tensor of ``shape`` may be held unevenly (:meth:`check`): one axis shards it and it is
        not in head-tail order."""
        return len(self.dims[d]) == 1 and all(h.dim != d for h in self.head_tail(group, shape))

    def uneven_dims(self, group: SubMesh, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The dims of a tensor of ``shape`` whose degree on ``group`` does not divide them (asked of every input and
        output of every rule the planner tries: cached)."""
        return () if not self._used else _uneven_dims(self, group, tuple(shape))

    def parallel_shape(self, group: SubMesh, shape: tuple[int, ...], dtype: str = "float32") -> ParallelTensorShape:
        """Degrees of this sharding on ``group`` (replica = product of the unused free axes), and the dims stored in
        head-tail order (:meth:`head_tail`).

        With sum degree 1 (partial axes of size 1 only) the reduce op is ``sum``, as the degree rules give it.
        """
        sum_degree = self.sum_degree(group)
        return ParallelTensorShape(
            tuple(shape),
            tuple(self.shard_degree(group, d) for d in range(self.ndim)),
            sum_degree,
            math.prod(group.mesh.axis_size(a) for a in self.replica_axes(group)),
            self.reduce_op if sum_degree > 1 else ReduceOp.SUM,
            dtype,
            self.head_tail(group, shape),
        )

    def head_tail(self, group: SubMesh, shape: tuple[int, ...]) -> tuple[HeadTail, ...]:
        """The dims of a tensor of ``shape`` that this sharding stores in head-tail order
        (docs/concepts.md#the-load-balanced-layout): those sharded on the mesh's balanced axis whose segments — one
        per block of the axes sharding the dim before it — are sequences (of the :class:`~shardflow.parallel.mesh.Balance`'s
        length), each cut into 2 × the axis's size chunks. Any other dim the axis shards (the rows of a batch split
        for the loss, heads moved onto the axis) keeps its contiguous blocks."""
        balance, out = group.mesh.balanced, []
        if balance is None:
            return ()
        for d, axes in enumerate(self.dims):
            if balance.axis in axes:
                segments = math.prod(group.mesh.axis_size(b) for b in axes[: axes.index(balance.axis)])
                if shape[d] == segments * balance.length:
                    out.append(HeadTail(d, 2 * group.mesh.axis_size(balance.axis), shape[d], segments))
        return tuple(out)

    # --- placements -----------------------------------------------------------------------------------
    def placements(self, group: SubMesh) -> tuple[Placement, ...]:
        """DTensor placements, one per free axis of ``group``.

        Raises ShardingError if two axes shard one dim out of mesh order (DTensor cannot spell that).
        """
        order = {a: i for i, a in enumerate(group.free_axes)}
        for d, axes in enumerate(self.dims):
            if [order[a] for a in axes] != sorted(order[a] for a in axes):
                raise ShardingError(
                    f"dim {d} is sharded by axes {list(axes)} out of mesh order; placements cannot say so"
                )
        out: list[Placement] = []
        for a in group.free_axes:
            d = self.axis_dim(a)
            out.append(Shard(d) if d is not None else Partial(self.reduce_op) if a in self.partial else Replicate())
        return tuple(out)

    @classmethod
    def from_placements(cls, placements, group: SubMesh, ndim: int) -> Sharding:
        """Placements (a sequence, one per free axis, or a dict axis → placement; missing = Replicate)."""
        free = group.free_axes
        if isinstance(placements, dict):
            unknown = set(placements) - set(free)
            if unknown:
                raise ShardingError(
                    f"placements name axes {sorted(unknown)} that are not free axes of {group} {list(free)}"
                )
            placements = [placements.get(a, Replicate()) for a in free]
        placements = tuple(placements)
        if len(placements) != len(free):
            raise ShardingError(
                f"{len(placements)} placements {list(placements)} for the {len(free)} axes {list(free)} of {group}"
            )
        dims: list[list[str]] = [[] for _ in range(ndim)]
        partial, ops = [], set()
        for a, p in zip(free, placements):
            if isinstance(p, Shard):
                if not -ndim <= p.dim < ndim:
                    raise ShardingError(f"placement {p} on axis {a!r}: dim out of range for a {ndim}-dim tensor")
                dims[p.dim % ndim].append(a)
            elif isinstance(p, Partial):
                partial.append(a)
                ops.add(p.reduce_op)
            elif not isinstance(p, Replicate):
                raise ShardingError(f"not a placement: {p!r} on axis {a!r}")
        if len(ops) > 1:
            raise ShardingError(f"Partial placements with different ops {sorted(ops)} cannot be combined")
        return cls(tuple(tuple(x) for x in dims), tuple(partial), ops.pop() if ops else ReduceOp.SUM)

    # --- pieces on devices ----------------------------------------------------------------------------
    def coord_of(self, group: SubMesh, device: int) -> ShardCoord:
        """Which piece ``device`` (a member of ``group``) holds."""
        mesh = group.mesh
        c = group.coords(device)

        def radix(axes):
            v = 0
            for a in axes:
                v = v * mesh.axis_size(a) + c[a]
            return v

        return ShardCoord(radix(self.partial), radix(self.replica_axes(group)), tuple(radix(ax) for ax in self.dims))

    def device_of(self, group: SubMesh, coord: ShardCoord) -> int:
        """The member of ``group`` that holds the piece at ``coord`` (replica index taken modulo)."""
        mesh = group.mesh
        c: dict[str, int] = {}

        def put(axes, index):
            for a in reversed(axes):
                c[a] = index % mesh.axis_size(a)
                index //= mesh.axis_size(a)

        for axes, idx in zip(self.dims, coord.shard):
            put(axes, idx)
        put(self.partial, coord.sum)
        put(self.replica_axes(group), coord.replica)
        return group.device_of(c)

    def device_map(self, group: SubMesh) -> dict[int, ShardCoord]:
        """Device → piece coordinate for every device of ``group`` (a bijection onto the pieces)."""
        return {d: self.coord_of(group, d) for d in group.devices()}

    def __str__(self) -> str:
        dims = ",".join("+".join(a) if a else "·" for a in self.dims)
        part = f" partial({self.reduce_op})={'+'.join(self.partial)}" if self.partial else ""
        return f"<{dims}>{part}"


def placements_for(pshape: ParallelTensorShape, group: SubMesh) -> tuple[Placement, ...]:
    """Some placements on ``group`` whose parallel shape is ``pshape`` (free axes assigned in mesh order).

    Raises ShardingError if the degrees cannot be made from the free axes' sizes.
    """
    free = group.free_axes
    sizes = [group.mesh.axis_size(a) for a in free]
    choices = [Shard(d) for d in range(len(pshape.shape))] + [Partial(pshape.reduce_op), Replicate()]
    for combo in itertools.product(choices, repeat=len(free)):
        try:
            s = Sharding.from_placements(combo, group, len(pshape.shape))
        except ShardingError:
            continue
        if (
            all(s.shard_degree(group, d) == pshape.shard[d] for d in range(len(pshape.shape)))
            and s.sum_degree(group) == pshape.sum_degree
            and math.prod(sizes) == pshape.num_pieces
        ):
            return combo
    raise ShardingError(f"parallel shape {pshape} cannot be placed on {group} with axes {dict(zip(free, sizes))}")


@functools.lru_cache(maxsize=1 << 16)
def _uneven_dims(s: Sharding, group: SubMesh, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d, size in enumerate(shape) if size % s.shard_degree(group, d))
