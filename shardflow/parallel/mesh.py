"""Device meshes and DTensor-style placements.

A :class:`Mesh` is abstract: axis names and sizes, devices numbered 0..size-1 in row-major order. No process
group is needed to build, print or verify a plan on it (JAX's AbstractMesh, DTensor's DeviceMesh shape).
A :class:`SubMesh` fixes some axes to one index: a pipeline stage is the mesh with ``pp`` fixed.

Placements say, per mesh axis, what the devices along that axis hold of a tensor (torch DTensor spelling):
``Shard(dim)`` — consecutive blocks of tensor dim ``dim``; ``Replicate()`` — identical copies;
``Partial(op)`` — pieces whose element-wise ``op`` (sum/avg/max/min) is the tensor.
Words: **axis** is a mesh axis, **dim** a tensor dim.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    import torch.distributed.tensor as dtensor


class ReduceOp(StrEnum):
    """How partial pieces combine into the tensor (DTensor's ``Partial(reduce_op)``): the one spelling of a
    reduce op, from placements to the communications that apply it. Its repr is the word a user writes
    (``Partial('avg')``, ``one of ('sum', 'avg', 'max', 'min')``)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def linear(self) -> bool:
        """Only ``sum`` and ``avg`` are linear (PyTorch PR #157340): linear ops may run on the pieces."""
        return self in (ReduceOp.SUM, ReduceOp.AVG)

    def combine(self, pieces: torch.Tensor) -> torch.Tensor:
        """The pieces stacked along dim 0, combined into one."""
        return _COMBINE[self](pieces, 0)

    @classmethod
    def parse(cls, value: str, where: str, error: type[ValueError] = ValueError) -> ReduceOp:
        """``value`` as a reduce op; raises ``error`` naming ``where`` when it is none."""
        if isinstance(value, cls):  # the planner's own: no lookup (Shardings are built by the thousand)
            return value
        try:
            return cls(value)
        except ValueError:
            raise error(f"{where}: reduce_op must be one of {tuple(cls)}, got {value!r}") from None


_COMBINE = {ReduceOp.SUM: torch.sum, ReduceOp.AVG: torch.mean, ReduceOp.MAX: torch.amax, ReduceOp.MIN: torch.amin}


@dataclass(frozen=True, slots=True)
class Shard:
    """The devices along the axis hold consecutive equal blocks of tensor dim ``dim``."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """The devices along the axis hold identical copies."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial:
    """The devices along the axis hold pieces whose element-wise ``reduce_op`` is the tensor.

    Only ``sum`` and ``avg`` are linear (:attr:`ReduceOp.linear`): linear ops may run on the pieces.
    """

    reduce_op: ReduceOp = ReduceOp.SUM

    def __post_init__(self):
        object.__setattr__(self, "reduce_op", ReduceOp.parse(self.reduce_op, "Partial"))

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})"


Placement = Shard | Replicate | Partial


def to_dtensor(p: Placement) -> dtensor.Placement:
    """``p`` as torch's own placement (``torch.distributed.tensor.Shard``, ``Replicate``, ``Partial``): what
    ``DTensor.from_local`` takes."""
    import torch.distributed.tensor as dtensor  # here: importing it costs half a second, and planning needs none

    if isinstance(p, Shard):
        return dtensor.Shard(p.dim)
    if isinstance(p, Partial):
        return dtensor.Partial(str(p.reduce_op))
    return dtensor.Replicate()


def from_dtensor(p: object, where: str, error: type[ValueError] = ValueError) -> Placement:
    """torch's placement ``p`` (``torch.distributed.tensor.Shard(d)``, ``Replicate()``, ``Partial(op)``) as shardflow's.

    Raises ``error`` naming ``where`` for anything else — torch's ``_StridedShard`` (a Shard whose blocks are
    strided, which a plan cannot ask for) or an object that is no placement."""
    import torch.distributed.tensor as dtensor

    if type(p) is dtensor.Shard:
        return Shard(p.dim)
    if type(p) is dtensor.Replicate:
        return Replicate()
    if type(p) is dtensor.Partial:
        return Partial(ReduceOp.parse(p.reduce_op, where, error))
    raise error(
        f"{where}: placement {p!r} has no shardflow spelling; give torch.distributed.tensor's Shard(d), Replicate() "
        f"or Partial('sum'|'avg'|'max'|'min')"
    )


def parse_placement(text: str) -> Placement:
    """``"S(0)"``/``"Shard(0)"``, ``"R"``/``"Replicate()"``, ``"P"``/``"Partial('avg')"`` → a placement."""
    t = text.strip().replace(" ", "").replace('"', "").replace("'", "")
    for prefix in ("Shard(", "S("):
        if t.startswith(prefix) and t.endswith(")"):
            dim = t[len(prefix) : -1]
            if not dim.lstrip("-").isdigit():
                raise ValueError(
                    f"cannot read placement {text!r}: Shard takes a tensor dim number, e.g. Shard(0) or Shard(-1)"
                )
            return Shard(int(dim))
    if t in ("R", "Replicate()", "Replicate"):
        return Replicate()
    for prefix in ("Partial(", "P("):
        if t.startswith(prefix) and t.endswith(")"):
            return Partial(t[len(prefix) : -1] or "sum")
    if t in ("P", "Partial()", "Partial"):
        return Partial()
    raise ValueError(f"cannot read placement {text!r}; write Shard(d), Replicate() or Partial('sum'|'avg'|'max'|'min')")


@dataclass(frozen=True, slots=True)
class Balance:
    """Context parallelism's load-balanced layout on a mesh (``--cp-layout balanced``;
    docs/concepts.md#the-load-balanced-layout): the sequences of ``length`` positions that mesh axis ``axis`` splits
    are stored in head-tail order (:class:`~shardflow.graph.layout.HeadTail`)."""

    axis: str
    length: int


@dataclass(frozen=True, slots=True)
class Mesh:
    """An n-dimensional mesh of devices: ``axis_names[i]`` has ``shape[i]`` devices; row-major device ids.
    ``balanced``: the load-balanced layout of the sequences one axis splits, if any (:class:`Balance`)."""

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    balanced: Balance | None = None

    def __post_init__(self):
        if len(self.axis_names) != len(self.shape):
            raise ValueError(f"mesh: {len(self.axis_names)} axis names for {len(self.shape)} sizes")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh: axis names must differ, got {list(self.axis_names)}")
        for n, s in zip(self.axis_names, self.shape):
            if not n.isidentifier() or s < 1:
                raise ValueError(f"mesh: axis {n!r} needs an identifier name and a size ≥ 1 (got {s})")
        if self.balanced is not None and self.balanced.axis not in self.axis_names:
            raise ValueError(f"mesh: balanced axis {self.balanced.axis!r} is none of {list(self.axis_names)}")

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """``"dp=2,tp=2"`` → Mesh(("dp", "tp"), (2, 2)). Raises ValueError with the expected form."""
        names, sizes = [], []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, size = part.partition("=")
            if not eq or not size.strip().isdigit():
                raise ValueError(f"cannot read mesh {text!r}: write axis=size pairs such as 'dp=2,tp=2'")
            names.append(name.strip())
            sizes.append(int(size))
        if not names:
            raise ValueError(f"cannot read mesh {text!r}: write axis=size pairs such as 'dp=2,tp=2'")
        return cls(tuple(names), tuple(sizes))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis_size(self, axis: str) -> int:
        return self.shape[self.axis_index(axis)]

    def axis_index(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise ValueError(f"mesh {self} has no axis {axis!r}; its axes are {list(self.axis_names)}") from None

    def coords(self, device: int) -> tuple[int, ...]:
        """Mesh coordinate of ``device`` (row-major)."""
        out = []
        for s in reversed(self.shape):
            out.append(device % s)
            device //= s
        return tuple(reversed(out))

    def device(self, coords: tuple[int, ...]) -> int:
        d = 0
        for c, s in zip(coords, self.shape):
            d = d * s + c
        return d

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))


@functools.lru_cache(maxsize=4096)
def _answers(mesh: Mesh, fixed: tuple[tuple[str, int], ...]) -> tuple[dict[int, int | None], dict[int, int]]:
    """The caches of :meth:`SubMesh.index` and :meth:`SubMesh.device_at` shared by the sub-meshes of ``mesh`` with
    coordinates ``fixed`` and no machine view."""
    return {}, {}


@dataclass(frozen=True, slots=True)
class SubMesh:
    """The devices of ``mesh`` whose coordinate on each axis in ``fixed`` equals the given index.

    ``fixed`` is sorted by mesh axis order. The free axes keep their mesh order; a tensor on a sub-mesh has
    one placement per free axis. ``view`` (a machine view) overrides which physical device sits at each
    coordinate of the free axes: ``view[i]`` is the device at the i-th coordinate in row-major order (default:
    the mesh's own device there). Every lookup of a device's coordinates goes through the sub-mesh.
    """

    mesh: Mesh
    fixed: tuple[tuple[str, int], ...] = ()
    view: tuple[int, ...] | None = None
    # derived once at construction (planning asks for them tens of thousands of times per rank)
    _free: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _free_shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _positions: dict[int, int | None] = field(init=False, repr=False, compare=False)  # index()'s answers so far
    _devices: dict[int, int] = field(init=False, repr=False, compare=False)  # device_at()'s answers so far

    def __post_init__(self):
        # the answers are the mesh's and the fixed coordinates': shared by equal sub-meshes (each PCG makes its own)
        positions, devices = _answers(self.mesh, self.fixed) if self.view is None else ({}, {})
        object.__setattr__(self, "_positions", positions)
        object.__setattr__(self, "_devices", devices)
        fixed = dict(self.fixed)
        object.__setattr__(self, "_free", tuple(a for a in self.mesh.axis_names if a not in fixed))
        object.__setattr__(self, "_free_shape", tuple(self.mesh.axis_size(a) for a in self._free))
        for axis, idx in self.fixed:
            if not 0 <= idx < self.mesh.axis_size(axis):
                raise ValueError(f"sub-mesh: index {idx} out of range for axis {axis!r} of mesh {self.mesh}")
        if self.view is not None:
            if (
                len(self.view) != self.size
                or len(set(self.view)) != len(self.view)
                or not all(0 <= d < self.mesh.size for d in self.view)
            ):
                raise ValueError(
                    f"machine view {list(self.view)}: needs {self.size} distinct devices of mesh "
                    f"{self.mesh} (0..{self.mesh.size - 1}), one per coordinate of axes "
                    f"{list(self.free_axes)}"
                )

    @property
    def free_axes(self) -> tuple[str, ...]:
        """The mesh axes not fixed, in mesh order."""
        return self._free

    @property
    def free_shape(self) -> tuple[int, ...]:
        """Sizes of :attr:`free_axes`."""
        return self._free_shape

    @property
    def size(self) -> int:
        return math.prod(self.free_shape)

    def _default_device(self, index: int) -> int:
        coords = dict(self.fixed)
        for a, s in zip(reversed(self.free_axes), reversed(self.free_shape)):
            coords[a] = index % s
            index //= s
        return self.mesh.device(tuple(coords[a] for a in self.mesh.axis_names))

    def device_at(self, index: int) -> int:
        """The device at row-major position ``index`` of the free-axis coordinates."""
        if self.view is not None:
            return self.view[index]
        if index not in self._devices:  # lowering walks the same sub-meshes' devices once per step
            self._devices[index] = self._default_device(index)
        return self._devices[index]

    def index(self, device: int) -> int | None:
        """Row-major position of ``device`` among the sub-mesh's coordinates, or None if it is not a member."""
        if device not in self._positions:  # lowering asks it of the same few devices again and again
            self._positions[device] = self._position(device)
        return self._positions[device]

    def _position(self, device: int) -> int | None:
        if self.view is not None:
            return self.view.index(device) if device in self.view else None
        c = self.mesh.coords(device)
        if any(c[self.mesh.axis_index(a)] != i for a, i in self.fixed):
            return None
        idx = 0
        for a, s in zip(self.free_axes, self.free_shape):
            idx = idx * s + c[self.mesh.axis_index(a)]
        return idx

    def coords(self, device: int) -> dict[str, int]:
        """Coordinate of member ``device`` on each free axis. Raises ValueError for a non-member."""
        idx = self.index(device)
        if idx is None:
            raise ValueError(f"device {device} is not in {self}")
        out = {}
        for a, s in zip(reversed(self.free_axes), reversed(self.free_shape)):
            out[a] = idx % s
            idx //= s
        return out

    def device_of(self, coords: dict[str, int]) -> int:
        """The member at ``coords`` (free axis → coordinate; other keys are ignored).

        Raises ValueError naming the axis, the coordinate, the axis size and the sub-mesh when a free axis has
        no coordinate or one outside ``0..size-1``.
        """
        idx = 0
        for a, s in zip(self.free_axes, self.free_shape):
            c = coords.get(a)
            if c is None or not 0 <= c < s:
                got = f"coordinate {c}" if c is not None else "no coordinate"
                raise ValueError(
                    f"{self} of mesh {self.mesh}: {got} on axis {a!r}, which has {s} devices "
                    f"(coordinates 0..{s - 1}); give each free axis {list(self.free_axes)} one in range"
                )
            idx = idx * s + c
        return self.device_at(idx)

    def devices(self) -> Iterator[int]:
        """Device ids in row-major order of the free axes."""
        return (self.device_at(i) for i in range(self.size))

    def with_fixed(self, axis: str, index: int) -> SubMesh:
        fixed = dict(self.fixed) | {axis: index}
        return SubMesh(self.mesh, tuple((a, fixed[a]) for a in self.mesh.axis_names if a in fixed))

    def without_fixed(self, axis: str) -> SubMesh:
        return SubMesh(self.mesh, tuple((a, i) for a, i in self.fixed if a != axis))

    def with_view(self, devices) -> SubMesh:
        """The same sub-mesh with ``devices`` (row-major over the free axes) as its machine view."""
        return SubMesh(self.mesh, self.fixed, tuple(devices))

    def __str__(self) -> str:
        text = "mesh" + ("[" + ",".join(f"{a}={i}" for a, i in self.fixed) + "]" if self.fixed else "")
        return text + (f"@{list(self.view)}" if self.view is not None else "")
