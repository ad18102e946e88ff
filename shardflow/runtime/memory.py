"""Peak memory of a rank's program: the live bytes of its buffers.

Lowering ends each buffer's life with a :class:`~shardflow.lower.program.Free` after its last reader, unless
it persists across steps (weights, optimizer state, the gradients the update used, the loss). Each rank holds
only its pieces, so its peak is the largest sum of live piece sizes while its program runs.
"""

from __future__ import annotations

import torch


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
