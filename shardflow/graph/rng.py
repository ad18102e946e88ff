"""Counter-based random numbers: every element's draw is a pure function of (seed, step, node, global index).

A random op on a sharded or replicated tensor must draw, for every element, what one device would draw for it,
whatever the strategy, the piece layout or the order the pieces run in. So no draw comes from a generator's
state (``F.dropout`` reads the process RNG: two replicas of one activation draw different masks, and a shard
draws what the whole tensor's first block would). Instead each element's number is computed from its key, as in
counter-based generators (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; JAX's threefry):

* the **stream key** (64 bits) is a hash (blake2b, stable across processes, unlike Python's ``hash``) of the run
  seed, the training step and the PCG node name: every node draws anew at every step;
* the **counter** is the element's linear index in the *full* tensor (row-major), so a piece computes the
  counters of the block it covers from its offset in the full tensor;
* the number is splitmix64's output for that counter (Steele, Lea, Flood, OOPSLA'14): the finaliser applied to
  ``key + (index + 1) · 0x9E3779B97F4A7C15`` mod 2^64, in torch int64 arithmetic — multiplications wrap modulo
  2^64 as unsigned ones do, and right shifts are made logical by masking off the sign bits an arithmetic shift
  copies in;
* the top 53 bits make a float64 uniform in [0, 1) with resolution 2^-53.

A :class:`DrawSite` carries the key and the piece's place in the full tensor; ops that draw take it as their
``at`` keyword (``Op.random``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio, odd)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _int64(u: int) -> int:
    """The int64 with the same 64 bits as unsigned ``u``."""
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` bits (0 < k < 64): torch's ``>>`` copies the sign bit in."""
    return (x >> k).bitwise_and_((1 << (64 - k)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on int64 ``z`` (each value read as its 64 bits); returns ``z``."""
    z ^= _srl(z, 30)
    z.mul_(_int64(_MIX1))
    z ^= _srl(z, 27)
    z.mul_(_int64(_MIX2))
    z ^= _srl(z, 31)
    return z


@dataclass(frozen=True, slots=True)
class DrawSite:
    """Where a random op draws: run ``seed``, training ``step`` (from 1), PCG ``node`` name, the ``shape`` of the
    full tensor, and ``start``, the index of the piece's first element along each dim (all 0: the whole tensor).

    Raises ValueError if ``start`` does not have one index per dim of ``shape``.
    """

    seed: int
    step: int
    node: str
    shape: tuple[int, ...]
    start: tuple[int, ...]

    def __post_init__(self):
        if len(self.start) != len(self.shape):
            raise ValueError(
                f"draw site of node {self.node!r}: start {list(self.start)} needs one index per dim of "
                f"the full shape {list(self.shape)}"
            )

    @classmethod
    def whole(cls, seed: int, step: int, node: str, shape: tuple[int, ...]) -> DrawSite:
        """The site of the whole tensor (one device)."""
        return cls(seed, step, node, tuple(shape), (0,) * len(shape))

    @property
    def key(self) -> int:
        """The 64-bit stream key of (seed, step, node), as an int64."""
        digest = hashlib.blake2b(repr((self.seed, self.step, self.node)).encode(), digest_size=8).digest()
        return _int64(int.from_bytes(digest, "little"))

    def indices(self, piece: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``piece``-shaped tensor on ``device``: each element's row-major linear index in the full tensor.

        Raises ValueError if the piece does not fit in the full shape at ``start``.
        """
        if len(piece) != len(self.shape) or any(s + n > full for s, n, full in zip(self.start, piece, self.shape)):
            raise ValueError(
                f"node {self.node!r}: a piece of shape {list(piece)} at {list(self.start)} does not fit "
                f"in the full tensor {list(self.shape)}"
            )
        idx = torch.zeros(piece, dtype=torch.int64, device=device)
        for d, (s, n) in enumerate(zip(self.start, piece)):
            stride = math.prod(self.shape[d + 1 :])
            idx += (torch.arange(s, s + n, dtype=torch.int64, device=device) * stride).view(
                (n,) + (1,) * (len(piece) - d - 1)
            )
        return idx

    def bits(self, piece: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``piece``-shaped numbers in [0, 2^53): element i of the full tensor gets the top 53 bits of
        splitmix64's output number i + 1 seeded with :attr:`key`."""
        z = self.indices(piece, device).add_(1).mul_(_int64(_GAMMA)).add_(self.key)
        return _srl(splitmix64(z), 11)

    def uniform(self, piece: tuple[int, ...]) -> torch.Tensor:
        """float64 ``piece``-shaped uniforms in [0, 1), multiples of 2^-53: :meth:`bits` · 2^-53."""
        return self.bits(piece).to(torch.float64).mul_(2.0**-53)

    def keep(self, piece: tuple[int, ...], p: float, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool ``piece``-shaped dropout mask: True where the element is kept (probability ``1 - p``), i.e. where
        :meth:`uniform` ≥ p — compared on the integers (p · 2^53 is exact in float64)."""
        return self.bits(piece, device) >= math.ceil(p * 2.0**53)


@dataclass(frozen=True, slots=True)
class PieceSite:
    """Where one device's piece of a random op's output lies, known at planning time: the PCG ``node`` name, the
    ``shape`` of the full tensor and ``start``, the index of the piece's first element along each dim. With the
    run's seed and the training step it is the piece's :class:`DrawSite` (:meth:`at`)."""

    node: str
    shape: tuple[int, ...]
    start: tuple[int, ...]

    def at(self, seed: int, step: int, micro: int = 0, micros: int = 1) -> DrawSite:
        """The draw site of this piece at training ``step`` (from 1) of a run seeded ``seed``. Under gradient
        accumulation the tensor is that of micro-batch ``micro`` of ``micros``, which stack along dim 0 into the
        whole batch's: the site is the piece's place in the whole batch's tensor (dim 0 ``micros`` times as long),
        so the micro-steps draw what one step on the whole batch draws where dim 0 is the batch's (as in the
        dropouts of token models), and numbers of their own wherever else."""
        site = self.within(micro, micros)
        return DrawSite(seed, step, self.node, site.shape, site.start)

    def within(self, micro: int, micros: int) -> PieceSite:
        """This piece, of micro-batch ``micro`` of ``micros``, as a piece of the whole batch's tensor: ``micros``
        micro-batches stack along dim 0 (a 0-d tensor, or one micro-batch, stays as it is). A step's
        microbatches (pipeline parallelism) fold in here at planning time, gradient accumulation's micro-steps in
        :meth:`at`: the two compose."""
        if micros == 1 or not self.shape:
            return self
        rows = self.shape[0]
        return PieceSite(self.node, (rows * micros, *self.shape[1:]), (micro * rows + self.start[0], *self.start[1:]))
