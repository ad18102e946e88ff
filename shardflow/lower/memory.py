"""Peak memory of a rank's program: the live bytes of its buffers.

Lowering ends each buffer's life with a :class:`~shardflow.lower.program.Free` after its last reader, unless
it persists across steps (weights, optimizer state, the gradients the update used, the loss). Each rank holds
only its pieces, so its peak is the largest sum of live piece sizes while its program runs: the executors count it
as they run (:class:`Ledger`), and :func:`program_memory` replays a program the same way before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Mapping

import torch

from shardflow.graph.graph import TensorRole
from shardflow.lower.dynamic import DynamicGraph, ValueRole
from shardflow.lower.program import Buffer, Comm, Compute, Free, Program


class Ledger:
    """Live bytes of one rank's buffers, and their peak."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.total = 0
        self.peak = 0

    def write(self, vid: str, n: int) -> None:
        """Value ``vid`` now holds ``n`` bytes."""
        self.total += n - self.live.get(vid, 0)
        self.live[vid] = n
        self.peak = max(self.peak, self.total)

    def free(self, vid: str) -> None:
        self.total -= self.live.pop(vid, 0)

    def sync(self, buffers: dict[str, torch.Tensor]) -> None:
        """Recount from the buffers themselves (after renames or loads)."""
        self.live = {k: t.numel() * t.element_size() for k, t in buffers.items()}
        self.total = sum(self.live.values())
        self.peak = max(self.peak, self.total)


def peak(ledger: Ledger | None) -> int:
    """The ``ledger``'s peak (bytes). Raises RuntimeError when there is none: the executor was built without
    ``memory=True``."""
    if ledger is None:
        raise RuntimeError(
            "this executor does not count its buffers' bytes: build it with memory=True to read peak_bytes"
        )
    return ledger.peak


class MemoryKind(StrEnum):
    """What a rank's bytes hold."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer state"
    ACTIVATIONS = "activations"  # forward values kept for the backward, their gradients, the step's data and
    #                              constants, communication buffers


@dataclass(frozen=True, slots=True)
class ProgramMemory:
    """The peak of one rank's live buffers during a step (bytes), what they held at that moment, by kind, and
    ``at``: the index in the program's instructions whose write reached the peak (-1: before the first, its inputs
    and the values that outlive the step)."""

    peak: int
    by_kind: Mapping[MemoryKind, int]
    at: int = -1


def buffer_kind(dg: DynamicGraph, vid: str) -> MemoryKind:
    """The kind of value ``vid`` of the step (a buffer the lowering made, such as a gradient bucket: activations)."""
    v = dg.values.get(vid)
    if v is None:
        return MemoryKind.ACTIVATIONS
    if v.role == ValueRole.OPT:
        return MemoryKind.OPTIMIZER
    t = dg.pcg.tensors.get(v.tensor)
    if t is None or t.role != TensorRole.WEIGHT:
        return MemoryKind.ACTIVATIONS
    return MemoryKind.GRADIENTS if v.role in (ValueRole.GRAD, ValueRole.ACC) else MemoryKind.PARAMETERS


def program_memory(
    program: Program,
    dg: DynamicGraph,
    size: Callable[[Buffer], int] | None = None,
    curve: list[int] | None = None,
) -> ProgramMemory:
    """The peak of ``program``'s live buffers in a step after the first, replayed as the executors count them
    (:class:`Ledger`): its inputs (weights, optimizer state, the step's data and constants) and the values that
    outlive the step (written, never freed, replacing no other) are live from the start; each compute writes its
    outputs (:attr:`~shardflow.lower.program.Compute.allocates`: an optimizer update's are its inputs' tensors,
    updated in place), each communication its received piece; a :class:`~shardflow.lower.program.Free` releases. ``size``:
    the bytes of a buffer (default: its piece's); an estimate for other batch sizes passes its own. ``curve``: where
    given, receives the live bytes before each instruction and after the last (one more entry than instructions)."""
    size = size or (lambda b: b.type.nbytes)
    freed = {v for i in program.instrs if isinstance(i, Free) for v in i.values}
    written = program.written()
    ledger = _KindLedger(lambda vid: buffer_kind(dg, vid))
    for b in program.inputs:
        ledger.write(b.value, size(b))
    for vid, b in written.items():
        v = dg.values.get(vid)
        if vid not in freed and not (v is not None and v.replaces):
            ledger.write(vid, size(b))
    if curve is not None:
        curve.append(ledger.total)
    for k, i in enumerate(program.instrs):
        ledger.now = k
        if isinstance(i, Compute):
            for b in i.allocates:
                ledger.write(b.value, size(b))
        elif isinstance(i, Comm) and i.recv is not None:
            ledger.write(i.recv.value, size(i.recv))
        elif isinstance(i, Free):
            for vid in i.values:
                ledger.free(vid)
        if curve is not None:
            curve.append(ledger.total)
    return ProgramMemory(ledger.peak, dict(ledger.at_peak), ledger.peak_at)


class _KindLedger(Ledger):
    """A ledger that also keeps its live bytes by kind, and their split at the peak."""

    def __init__(self, kind: Callable[[str], MemoryKind]) -> None:
        super().__init__()
        self.kind = kind
        self.by_kind = dict.fromkeys(MemoryKind, 0)
        self.at_peak = dict(self.by_kind)
        self.now = self.peak_at = -1  # the instruction being replayed, and the one that reached the peak

    def write(self, vid: str, n: int) -> None:
        self.by_kind[self.kind(vid)] += n - self.live.get(vid, 0)
        super().write(vid, n)
        if self.total == self.peak:
            self.at_peak = dict(self.by_kind)
            self.peak_at = self.now

    def free(self, vid: str) -> None:
        self.by_kind[self.kind(vid)] -= self.live.get(vid, 0)
        super().free(vid)
