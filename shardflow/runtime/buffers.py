"""Buffers an executor keeps between steps or assembles in place, instead of allocating new ones each step.

A new CPU tensor of some megabytes is fresh pages from the kernel each time (glibc returns large blocks to it when
they are freed), so every first write pays a page fault per 4 KiB: receiving a 16 MiB all-gather into a new buffer
took 16.7 ms against 8.8 ms into one kept from call to call (2 gloo ranks, this machine). DDP keeps its buckets
and the CUDA caching allocator its blocks for the same reason.

* :class:`Kept`: a receive slot of :func:`~shardflow.lower.program.kept_receives` — one buffer, allocated at
  first use, that every communication of the slot receives into, step after step;
* :class:`Receives`: where each communication of a rank's program receives — its slot, or, for a ring
  all-gather's chunks (:func:`~shardflow.lower.program.ring_regions`), straight into their blocks of the gathered
  buffer, so the ring's concat copies only the rank's own chunk.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch

from shardflow.graph.ops import torch_dtype
from shardflow.lower.program import Comm, Compute, Program, Reuse


class Kept:
    """One receive slot: a buffer on ``device`` allocated at first use and handed out again at every later one,
    viewed as the shape asked for (every communication of a slot receives as many elements of one dtype). Its
    bytes are reserved between the values it holds, as a caching allocator's are (:attr:`nbytes`); the memory
    ledger counts the values."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flat: torch.Tensor | None = None

    def __call__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        if self.flat is None or self.flat.numel() != n or self.flat.dtype != dtype:
            self.flat = torch.empty(n, dtype=dtype, device=self.device)
        return self.flat.view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes reserved (0 before the first use)."""
        return 0 if self.flat is None else self.flat.numel() * self.flat.element_size()


class Receives:
    """Where the communications of one rank's ``program`` receive, from its :class:`~shardflow.lower.program.Reuse`
    (``reuse``, :func:`~shardflow.lower.program.buffer_reuse`), on ``device``:

    * a communication with a receive slot (``reuse.kept``) receives into the slot's :class:`Kept` buffer (tokens of
      one slot share it);
    * a ring all-gather's chunks (``reuse.regions``) are received into their blocks of the gathered buffer,
      allocated with the gathered dim first (in its receive slot when it has one; else new each step) when the
      first of them is issued; the ring's concat (:meth:`kernel`) copies in the chunks that are not blocks of it
      (the rank's own) and returns the buffer with the dim back in its place;
    * any other communication receives into a new buffer (:meth:`alloc` gives None).
    """

    def __init__(self, program: Program, reuse: Reuse, device: torch.device):
        slots = [Kept(device) for _ in range(max(reuse.kept.values(), default=-1) + 1)]
        self.kept = {t: slots[k] for t, k in reuse.kept.items()}  # token → its receive slot
        self.regions = reuse.regions
        self.joins: dict[int, Compute] = {k: program.instrs[k] for k, _ in self.regions.values()}  # index → concat
        self.concats = {i: k for k, i in self.joins.items()}
        self.first: dict[int, int] = {}  # concat index → the token of the first communication receiving a chunk
        for c in program.comms:
            if c.recv is not None and c.recv.value in self.regions:
                self.first.setdefault(self.regions[c.recv.value][0], c.token)
        self.device = device
        self.gathered: dict[int, torch.Tensor] = {}  # concat index → this step's gathered buffer, dim first

    def alloc(self, c: Comm) -> Callable[[tuple[int, ...]], torch.Tensor] | None:
        """The buffer communication ``c`` receives into, as a function of its shape (the received value's with
        :func:`~shardflow.lower.comms.front_dim` first; what :func:`~shardflow.lower.comms.issue` takes as
        ``alloc``): a ring chunk's block of the gathered buffer (allocated here when ``c`` is the ring's first
        communication in the program: call once per issue of ``c``), else its slot; None for a new buffer."""
        if c.recv is not None and c.recv.value in self.regions:
            k, j = self.regions[c.recv.value]
            if self.first[k] == c.token:
                out = self.joins[k].outs[0].type
                shape = list(out.shape)
                shape.insert(0, shape.pop(c.dim))
                dtype = torch_dtype(out.dtype)
                self.gathered[k] = (self.kept[c.token](dtype, tuple(shape)) if c.token in self.kept else
                                    torch.empty(shape, dtype=dtype, device=self.device))
            gathered = self.gathered[k]
            return lambda shape: gathered[j * shape[0]:(j + 1) * shape[0]]
        if c.token in self.kept:
            return functools.partial(self.kept[c.token], torch_dtype(c.type.dtype))
        return None

    def kernel(self, concat: Compute) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None:
        """The kernel of ``concat`` when it joins a ring's chunks received in place; None for any other compute."""
        if concat not in self.concats:
            return None
        k, dim = self.concats[concat], concat.dim

        def assemble(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            gathered = self.gathered.pop(k)
            n = gathered.shape[0] // len(xs)
            for j, x in enumerate(xs):
                block = gathered[j * n:(j + 1) * n].movedim(0, dim)
                if x.data_ptr() != block.data_ptr() or x.stride() != block.stride():
                    block.copy_(x)
            return [gathered.movedim(0, dim)]

        return assemble
