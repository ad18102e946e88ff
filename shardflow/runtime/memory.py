"""Buffer lifetimes and peak memory of a rank's program.

A buffer is freed right after the last instruction that reads it, unless it persists across steps (weights,
optimizer state, the gradients the update used, the loss). Each rank holds only its pieces, so its peak is
the largest sum of live piece sizes while its program runs.
"""

from __future__ import annotations

from typing import Iterable

import torch

from shardflow.lower.dynamic import DynamicGraph
from shardflow.lower.program import Comm, Compute, Program, Wait


def persistent_values(dg: DynamicGraph) -> frozenset[str]:
    """Values that outlive one step: weights, optimizer state (and their updated versions), the gradients
    consumed by the updates (kept for inspection) and the loss."""
    keep = {f"fwd:{dg.pcg.loss}"} if dg.pcg.loss else set()
    for vid, v in dg.values.items():
        if v.role == "opt" or vid.startswith("upd:") or (v.role == "fwd" and dg.pcg.tensors.get(v.tensor) is not None
                                                          and dg.pcg.tensors[v.tensor].role == "weight"):
            keep.add(vid)
    for n in dg.nodes:
        if n.kind == "update":
            keep.add(n.inputs[1])
    return frozenset(keep)


def frees_after(program: Program, persistent: Iterable[str]) -> list[tuple[str, ...]]:
    """For each instruction index, the buffers to free after it (last read, or written and never read)."""
    keep = set(persistent)
    last: dict[str, int] = {}
    for k, instr in enumerate(program.instrs):
        reads = [b.value for b in instr.ins] if isinstance(instr, Compute) else \
            [instr.send.value] if isinstance(instr, Comm) and instr.send is not None else []
        writes = [b.value for b in instr.outs] if isinstance(instr, Compute) else \
            [instr.recv.value] if isinstance(instr, Comm) and instr.recv is not None else []
        for v in writes:
            last.setdefault(v, k)
        for v in reads:
            last[v] = k
    waits = {i.token: k for k, i in enumerate(program.instrs) if isinstance(i, Wait)}
    for k, instr in enumerate(program.instrs):  # a buffer sent asynchronously lives until its Wait
        if isinstance(instr, Comm) and not instr.wait and instr.send is not None:
            last[instr.send.value] = max(last[instr.send.value], waits[instr.token])
    out: list[list[str]] = [[] for _ in program.instrs]
    for v, k in last.items():
        if v not in keep:
            out[k].append(v)
    return [tuple(x) for x in out]


class Ledger:
    """Live bytes of one rank's buffers, and their peak."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.total = 0
        self.peak = 0

    def write(self, vid: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
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
