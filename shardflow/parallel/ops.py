"""The four parallel operators of FlexFlow/Unity, as PCG nodes, and redistribution between shardings.

Parallel operators move data; they compute nothing. The classes carry an ``Op`` suffix so that ``Replicate``
means only the DTensor placement (:class:`shardflow.parallel.mesh.Replicate`); the prose below uses FlexFlow's
names for what the ops do (the vocabulary: docs/concepts.md#8-vocabulary). On a mesh each one names the axis it
acts on:

=========================  ============================  ==========================  ============================
op (attrs)                 degree rule                   forward data movement       backward
=========================  ============================  ==========================  ============================
RepartitionOp(dim, d, a)   shard[dim] ×d, replica ÷d     split (keep own block)      gather (= Combine)
CombineOp(dim, d, a)       shard[dim] ÷d, replica ×d     gather (all-gather)         split (= Repartition)
ReplicateOp(d, a)          replica ×d (a joins group)    broadcast                   sum of the replica grads
ReductionOp(d, a)          sum ÷d, replica ×d            sum of the partials         broadcast
=========================  ============================  ==========================  ============================

Difference from FlexFlow, on purpose: a tensor's pieces are exactly the devices of its sub-mesh, so an op that
keeps its devices trades the degree it changes against the replica degree (FlexFlow's Repartition makes more
pieces for more devices; ours turns ``d`` replicas into ``d`` blocks, which needs no communication).
The Replicate op is the one that grows the device set: its axis goes from fixed (one index) to free.
Blocked layout: Repartition appends its axis as the *minor* axis of the dim, so output block ``c`` comes from
input block ``c // d``; Combine removes the minor axis of the dim. Duals: Replicate↔Reduction,
Repartition↔Combine.

Lowering names the communication of each movement in one table,
:data:`shardflow.lower.shard_expansion.LOWERING`, built on the collectives of a redistribution's steps
(:data:`shardflow.parallel.collectives.REDISTRIBUTION`). A backward is lowered as the parallel ops that bring the
gradient to its input's sharding (the dual op; a Reduction's broadcast moves nothing, every device already
holds the gradient), except Replicate's, whose sum of the replica gradients is a reduce to the root.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from shardflow.parallel.mesh import ReduceOp, SubMesh
from shardflow.parallel.shape import DegreeError, ParallelTensorShape, ShardingError
from shardflow.parallel.sharding import Sharding


@dataclass(frozen=True, slots=True)
class ParallelOp:
    """Base of the parallel operators. ``degree`` must equal the size of mesh axis ``axis``."""

    kind: ClassVar[str] = "parallel"

    # Every parallel op has a degree and an axis; each subclass holds them as dataclass fields in its own order
    # (RepartitionOp(dim, degree, axis)), which replace these.
    @property
    def degree(self) -> int:
        """How many devices the op spans: the size of mesh axis :attr:`axis`."""
        raise NotImplementedError

    @property
    def axis(self) -> str:
        """The mesh axis the op works along."""
        raise NotImplementedError

    def apply_shape(self, p: ParallelTensorShape) -> ParallelTensorShape:
        """Degree rule. Raises DegreeError / ShardingError when the degrees do not allow the op."""
        raise NotImplementedError

    def apply(self, s: Sharding, group: SubMesh) -> tuple[Sharding, SubMesh]:
        """Axis rule: the output sharding and sub-mesh. Raises ShardingError naming the axis and the fix."""
        raise NotImplementedError

    def _check_degree(self, group: SubMesh) -> None:
        size = group.mesh.axis_size(self.axis)
        if size != self.degree:
            raise ShardingError(f"{self.describe()}: axis {self.axis!r} has {size} devices, not {self.degree}")

    def describe(self) -> str:
        raise NotImplementedError


def _dim(dim: int, ndim: int, op: str) -> int:
    if not 0 <= dim < ndim:
        raise ShardingError(f"{op}: dim {dim} is out of range for a tensor with {ndim} dims")
    return dim


@dataclass(frozen=True, slots=True)
class RepartitionOp(ParallelOp):
    """Cut ``dim`` into ``degree`` more blocks along mesh ``axis`` (each replica keeps its own block)."""

    kind: ClassVar[str] = "repartition"
    dim: int
    degree: int
    axis: str = ""

    def apply_shape(self, p):
        d = _dim(self.dim, len(p.shape), self.describe())
        if p.replica_degree % self.degree:
            raise ShardingError(f"{self.describe()}: needs replica degree divisible by {self.degree}, got {p}")
        shard = list(p.shard)
        shard[d] *= self.degree
        if p.shape[d] % shard[d] and p.shard[d] > 1:  # uneven blocks of one axis only (docs/concepts.md#uneven-shards)
            raise DegreeError(d, p.shape[d], shard[d], self.describe())
        return replace(p, shard=tuple(shard), replica_degree=p.replica_degree // self.degree)

    def apply(self, s, group):
        _dim(self.dim, s.ndim, self.describe())
        self._check_degree(group)
        if self.axis in s.used_axes or self.axis not in group.free_axes:
            raise ShardingError(
                f"{self.describe()}: axis {self.axis!r} must hold replicas, but the tensor is {s} on {group}"
            )
        return s.replace_dim(self.dim, s.dims[self.dim] + (self.axis,)), group

    def describe(self):
        return f"RepartitionOp(dim={self.dim}, degree={self.degree}, axis={self.axis})"


@dataclass(frozen=True, slots=True)
class CombineOp(ParallelOp):
    """Gather the ``degree`` blocks of ``dim`` held along mesh ``axis`` (all-gather); the axis then replicates."""

    kind: ClassVar[str] = "combine"
    dim: int
    degree: int
    axis: str = ""

    def apply_shape(self, p):
        d = _dim(self.dim, len(p.shape), self.describe())
        if p.shard[d] % self.degree:
            raise ShardingError(
                f"{self.describe()}: dim {d} has shard degree {p.shard[d]}, not a multiple of {self.degree}"
            )
        shard = list(p.shard)
        shard[d] //= self.degree
        return replace(p, shard=tuple(shard), replica_degree=p.replica_degree * self.degree)

    def apply(self, s, group):
        _dim(self.dim, s.ndim, self.describe())
        self._check_degree(group)
        if not s.dims[self.dim] or s.dims[self.dim][-1] != self.axis:
            raise ShardingError(
                f"{self.describe()}: axis {self.axis!r} must be the minor axis sharding dim {self.dim}; the tensor is {s}"
            )
        return s.replace_dim(self.dim, s.dims[self.dim][:-1]), group

    def describe(self):
        return f"CombineOp(dim={self.dim}, degree={self.degree}, axis={self.axis})"


@dataclass(frozen=True, slots=True)
class ReplicateOp(ParallelOp):
    """Broadcast the tensor from its one index on mesh ``axis`` to all ``degree`` devices along it."""

    kind: ClassVar[str] = "replicate"
    degree: int
    axis: str = ""

    def apply_shape(self, p):
        return replace(p, replica_degree=p.replica_degree * self.degree)

    def apply(self, s, group):
        self._check_degree(group)
        if self.axis not in dict(group.fixed):
            raise ShardingError(
                f"{self.describe()}: the tensor already spans axis {self.axis!r} ({group}); ReplicateOp widens a tensor "
                f"that lives at one index of the axis"
            )
        return s, group.without_fixed(self.axis)

    def describe(self):
        return f"ReplicateOp(degree={self.degree}, axis={self.axis})"


@dataclass(frozen=True, slots=True)
class ReductionOp(ParallelOp):
    """Sum the ``degree`` partial pieces held along mesh ``axis`` (all-reduce); the axis then replicates."""

    kind: ClassVar[str] = "reduction"
    degree: int
    axis: str = ""

    def apply_shape(self, p):
        if p.sum_degree % self.degree:
            raise ShardingError(f"{self.describe()}: sum degree {p.sum_degree} is not a multiple of {self.degree}")
        sum_degree = p.sum_degree // self.degree
        return replace(
            p,
            sum_degree=sum_degree,
            replica_degree=p.replica_degree * self.degree,
            reduce_op=p.reduce_op if sum_degree > 1 else ReduceOp.SUM,
        )

    def apply(self, s, group):
        self._check_degree(group)
        if self.axis not in s.partial:
            raise ShardingError(f"{self.describe()}: the tensor {s} holds no partial pieces along axis {self.axis!r}")
        partial = tuple(a for a in s.partial if a != self.axis)
        return Sharding(s.dims, partial, s.reduce_op if partial else ReduceOp.SUM), group

    def describe(self):
        return f"ReductionOp(degree={self.degree}, axis={self.axis})"


PARALLEL_OPS: dict[str, type[ParallelOp]] = {c.kind: c for c in (RepartitionOp, CombineOp, ReplicateOp, ReductionOp)}


def redistribute(src: Sharding, dst: Sharding, group: SubMesh) -> list[ParallelOp]:
    """The parallel ops that turn sharding ``src`` into ``dst`` on ``group``, in order.

    One table covers every case (DTensor's redistribution, spelled as parallel ops):
    Partial→Replicate = Reduction (all-reduce); Partial→Shard = Reduction then Repartition (reduce-scatter);
    Shard→Replicate = Combine (all-gather); Replicate→Shard = Repartition (local split);
    Shard(i)→Shard(j) = Combine then Repartition (all-to-all). Axes sharding a dim are removed minor first.

    Order, the cheapest by bytes: every op's wire bytes are proportional to the piece entering it, and only a
    Repartition makes the piece smaller, so the pieces are cut first. Each dim that keeps its axes and gains more
    gains them first — a partial axis as a reduce-scatter, a replica axis as a local split — up to the first axis
    that still holds another dim's blocks (it is combined first). Then the remaining partial axes are all-reduced,
    on the cut pieces, then the gathers and the other splits. So Partial(dp, fsdp) → Shard(0) on fsdp is FSDP2's
    HSDP order: a reduce-scatter over fsdp, then an all-reduce over dp of a 1/F piece (not of the whole tensor
    before the reduce-scatter: 2(D−1)/D·N/F bytes instead of 2(D−1)/D·N).
    Raises ShardingError for Replicate/Shard→Partial (a strategy never needs to create partial sums).
    """
    if src.ndim != dst.ndim:
        raise ShardingError(f"cannot redistribute {src} to {dst}: different number of dims")
    if set(dst.partial) - set(src.partial):
        raise ShardingError(f"cannot redistribute {src} to {dst}: partial pieces are made by ops, not by moving data")
    if dst.partial and src.reduce_op != dst.reduce_op:
        raise ShardingError(f"cannot redistribute {src} to {dst}: different partial reduce ops")
    size = group.mesh.axis_size
    ops: list[ParallelOp] = []
    cur = src

    def add(op: ParallelOp) -> None:
        nonlocal cur
        ops.append(op)
        cur = op.apply(cur, group)[0]

    summed = [a for a in src.partial if a not in dst.partial]
    for d in range(src.ndim):  # cut first: the axes a dim gains while it keeps its own
        if cur.dims[d] != dst.dims[d][: len(cur.dims[d])]:
            continue
        for a in dst.dims[d][len(cur.dims[d]) :]:
            if a in summed:
                add(ReductionOp(size(a), a))
                summed.remove(a)
            elif a in cur.used_axes:
                break
            add(RepartitionOp(d, size(a), a))
    for a in summed:
        add(ReductionOp(size(a), a))
    for d in range(src.ndim):
        while cur.dims[d] != dst.dims[d][: len(cur.dims[d])]:
            add(CombineOp(d, size(cur.dims[d][-1]), cur.dims[d][-1]))
    for d in range(src.ndim):
        for a in dst.dims[d][len(cur.dims[d]) :]:
            add(RepartitionOp(d, size(a), a))
    return ops
