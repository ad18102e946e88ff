"""Buffers an executor keeps between steps or assembles in place, instead of allocating new ones each step.

A new CPU tensor of some megabytes is fresh pages from the kernel each time (glibc returns large blocks to it when
they are freed), so every first write pays a page fault per 4 KiB: receiving a 16 MiB all-gather into a new buffer
took 16.7 ms against 8.8 ms into one kept from call to call (2 gloo ranks, this machine). DDP keeps its buckets
and the CUDA caching allocator its blocks for the same reason.

* :class:`Kept`: a receive slot of :func:`~shardflow.lower.buffer_reuse.kept_receives` — one buffer, allocated at
  first use, that every communication of the slot receives into, step after step;
* :class:`Receives`: where each communication of a rank's program receives — its slot, or, for a ring
  all-gather's chunks (:func:`~shardflow.lower.buffer_reuse.ring_regions`), straight into their blocks of the gathered
  buffer, so the ring's concat copies only the rank's own chunk; and where the linears fused into an all-gather
  loop (ring or broadcasts) write their output chunks: straight into their blocks of the whole output, so their
  concat copies nothing.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch

from shardflow.graph.ops import Linear, torch_dtype
from shardflow.lower.buffer_reuse import Reuse
from shardflow.lower.program import Comm, Compute, Forward, Program


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
    """Where the communications of one rank's ``program`` receive, from its :class:`~shardflow.lower.buffer_reuse.Reuse`
    (``reuse``, :func:`~shardflow.lower.buffer_reuse.buffer_reuse`), on ``device``:

    * a communication with a receive slot (``reuse.kept``) receives into the slot's :class:`Kept` buffer (tokens of
      one slot share it);
    * a ring all-gather's chunks (``reuse.regions``) are received into their blocks of the gathered buffer,
      allocated with the gathered dim first (in its receive slot when it has one; else new each step) when the
      first of them is issued; the ring's concat (:meth:`kernel`) copies in the chunks that are not blocks of it
      (the rank's own) and returns the buffer with the dim back in its place;
    * any other communication receives into a new buffer (:meth:`alloc` gives None);
    * a linear or a product by a matrix fused into an all-gather loop (a chunk of ``reuse.regions`` computed by
      :func:`~shardflow.lower.buffer_reuse.in_place_product`) writes its output chunk into its block of the output's
      buffer, laid out as the gathered one (allocated by the first such chunk), and the concat of its chunks returns
      that buffer: the output is left with the gathered dim first in memory (:meth:`kernel`).
    """

    def __init__(self, program: Program, reuse: Reuse, device: torch.device):
        slots = [Kept(device) for _ in range(max(reuse.kept.values(), default=-1) + 1)]
        self.kept = {t: slots[k] for t, k in reuse.kept.items()}  # token → its receive slot
        self.regions = reuse.regions
        self.joins: dict[int, Compute] = {k: program.instrs[k] for k, _ in self.regions.values()}  # index → concat
        self.concats = {i: k for k, i in self.joins.items()}
        self.computed = {
            i: self.regions[i.outs[0].value]
            for i in program.instrs
            if isinstance(i, Compute) and i.outs and i.outs[0].value in self.regions
        }
        self.first: dict[int, Comm | Compute] = {}  # concat index → the first instruction receiving or computing a
        for i in program.instrs:  # chunk of it (in program order): it allocates the buffer
            if isinstance(i, Comm) and i.recv is not None and i.recv.value in self.regions:
                self.first.setdefault(self.regions[i.recv.value][0], i)
            elif isinstance(i, Compute) and i in self.computed:
                self.first.setdefault(self.computed[i][0], i)
        readers: dict[str, list[Compute]] = {}  # a chunk of a gathered value → the fused products reading it
        for i in self.computed:
            readers.setdefault(i.ins[0].value, []).append(i)
        self.reads = {i: (v, i is group[0], i is group[-1]) for v, group in readers.items() for i in group}
        self.rows: dict[str, torch.Tensor] = {}  # a chunk not stored dim first → its rows, copied once per step
        self.device = device
        self.gathered: dict[int, torch.Tensor] = {}  # concat index → this step's gathered buffer, dim first

    def alloc(self, c: Comm) -> Callable[[tuple[int, ...]], torch.Tensor] | None:
        """The buffer communication ``c`` receives into, as a function of its shape (the received value's with
        :func:`~shardflow.lower.comms.front_dim` first; what :func:`~shardflow.runtime.comms.issue` takes as
        ``alloc``): a ring chunk's block of the gathered buffer (allocated here when ``c`` is the ring's first
        communication in the program: call once per issue of ``c``), else its slot; None for a new buffer."""
        if c.recv is not None and c.recv.value in self.regions:
            k, j = self.regions[c.recv.value]
            if self.first[k] == c:
                self.gathered[k] = self.kept[c.token](*self._layout(k)) if c.token in self.kept else self._buffer(k)
            gathered = self.gathered[k]
            return lambda shape: gathered[j * shape[0] : (j + 1) * shape[0]]
        if c.token in self.kept:
            return functools.partial(self.kept[c.token], torch_dtype(c.type.dtype))
        return None

    def _layout(self, k: int) -> tuple[torch.dtype, tuple[int, ...]]:
        """The dtype of concat ``k``'s output and its shape stored with the concatenated dim first."""
        out = self.joins[k].outs[0].type
        shape = list(out.shape)
        shape.insert(0, shape.pop(self.joins[k].dim))
        return torch_dtype(out.dtype), tuple(shape)

    def _buffer(self, k: int) -> torch.Tensor:
        """A new buffer for concat ``k``'s output, its dim stored first."""
        dtype, shape = self._layout(k)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def kernel(self, instr: Compute) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None:
        """The kernel of ``instr`` when it joins chunks assembled in place (a concat) or computes one of them (a
        fused linear or product by a matrix); None for any other compute."""
        if instr in self.computed:
            return self._product_into(instr)
        if instr not in self.concats:
            return None
        k, dim = self.concats[instr], instr.dim

        def assemble(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            gathered = self.gathered.pop(k)
            n = gathered.shape[0] // len(xs)
            for j, x in enumerate(xs):
                block = gathered[j * n : (j + 1) * n].movedim(0, dim)
                if x.data_ptr() != block.data_ptr() or x.stride() != block.stride():
                    block.copy_(x)
            return [gathered.movedim(0, dim)]

        return assemble

    def _product_into(self, instr: Compute) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
        """Linear ``instr`` (``x @ W.T + b``; ``x @ W + b`` for a transposed weight; ``x @ W`` for a product by a
        matrix) on its chunk ``x`` of the gathered value, written into its block of the output's buffer with
        ``torch.addmm``/``torch.mm(out=)``: the block is [chunk, *other dims, out features] with the gathered dim
        first, so ``x`` is read with that dim first: a chunk received in place already is (no copy); the rank's own
        chunk is copied so once, by the first product reading it, for all of them."""
        k, j = self.computed[instr]
        dim, first = self.joins[k].dim, self.first[k] is instr
        chunk, first_reader, last_reader = self.reads[instr]
        assert isinstance(instr.kernel, Forward), instr
        op = instr.kernel.local.op
        transpose = isinstance(op, Linear) and not op.transposed
        bias = isinstance(op, Linear) and op.bias

        def product(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            if first:
                self.gathered[k] = self._buffer(k)
            x, w = xs[0], xs[1]
            n = x.shape[dim]
            block = self.gathered[k][j * n : (j + 1) * n]
            rows = x.movedim(dim, 0)
            if rows.is_contiguous():
                rows = rows.view(-1, x.shape[-1])
            else:
                if first_reader:
                    self.rows[chunk] = rows.reshape(-1, x.shape[-1])
                rows = self.rows.pop(chunk) if last_reader else self.rows[chunk]
            flat = block.view(-1, block.shape[-1])
            w = w.t() if transpose else w
            if bias:
                torch.addmm(xs[2], rows, w, out=flat)
            else:
                torch.mm(rows, w, out=flat)
            return [block.movedim(0, dim)]

        return product
