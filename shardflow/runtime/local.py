"""Local executor: every rank's program in one process, run together by :func:`~shardflow.lower.rendezvous.rendezvous`.

Communication is done as tensor operations on the members' buffers, so a plan can be run, debugged and
checked against the single-device run without any process group. It runs exactly the instructions the
distributed executor runs; only the communication differs.
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardflow.lower import LoweredStep
from shardflow.lower.dynamic import Value
from shardflow.lower.comms import run_local
from shardflow.lower.program import Comm, Compute, Free, Instr
from shardflow.lower.rendezvous import rendezvous
from shardflow.parallel.simulate import gather, scatter
from shardflow.runtime.executor import Executor
from shardflow.runtime.kernels import OptimizerConfig, local_move, make_kernel, single_calls
from shardflow.runtime.memory import Ledger


class LocalExecutor(Executor):
    """Runs a lowered step on all ranks of its mesh in this process.

    Usage: ``ex = LocalExecutor(step, OptimizerConfig(...)); ex.load(weights); loss = ex.step(inputs)``;
    ``ex.weights()`` / ``ex.grads()`` assemble full tensors. Raises RuntimeError on a deadlock.
    """

    def __init__(self, step: LoweredStep, optimizer: OptimizerConfig, share: LocalExecutor | None = None,
                 seed: int = 0):
        """``share``: another executor of the same PCG whose weights this one reads (e.g. evaluation).
        ``seed``: the run seed random ops (dropout) draw with."""
        self.lowered, self.cfg = step, optimizer
        self.dg = step.dg
        self.steps_done = 0
        self.saved: dict[int, dict] = {r: {} for r in step.programs}  # forward autograd graphs per rank
        self.kernels = {}
        for r, p in step.programs.items():
            once = single_calls(p)
            for i in p.instrs:
                if isinstance(i, Compute) and i.dnode:
                    self.kernels[(r, i.dnode)] = make_kernel(i, optimizer, lambda: self.steps_done + 1,
                                                             self.saved[r] if i.dnode in once else None, seed)
        self.buffers: dict[int, dict[str, torch.Tensor]] = share.buffers if share else {r: {} for r in step.programs}
        self.ledgers = {r: Ledger() for r in step.programs}
        self._index_updates()

    # --- data in and out ------------------------------------------------------------------------------
    def _put(self, vid: str, full: torch.Tensor) -> None:
        v = self.dg.values[vid]
        for d, x in scatter(full, v).items():
            if d in self.buffers:
                self.buffers[d][vid] = x

    def _get(self, vid: str) -> torch.Tensor:
        v: Value = self.dg.values[vid]
        return gather(self._pieces(vid), v)

    def _pieces(self, vid: str) -> dict[int, torch.Tensor]:
        return {d: b[vid] for d, b in self.buffers.items() if vid in b}

    def _max_over_ranks(self, x: float) -> float:
        return x  # every rank is here

    # --- one step -------------------------------------------------------------------------------------
    def step(self, inputs: Mapping[str, torch.Tensor]) -> float:
        """Run one training step on full ``inputs`` (by graph input name); returns the loss."""
        self._place_inputs(inputs)
        for r, bufs in self.buffers.items():
            self.ledgers[r].sync(bufs)
        blocked = rendezvous(self.lowered.programs, self._run, self._meet)
        if blocked:
            raise RuntimeError("deadlock: " + ", ".join(f"rank {r} blocks at instruction {k}"
                                                        for r, k in sorted(blocked.items())))
        loss = self._get(self.dg.loss_value).item()
        for r, bufs in self.buffers.items():
            for new, old in self.renames:
                if new in bufs:
                    bufs[old] = bufs.pop(new)
            self.ledgers[r].sync(bufs)
        self.steps_done += 1
        return loss

    def _run(self, r: int, instr: Instr) -> None:
        """One local instruction of rank ``r`` (communications complete when all their members issued them,
        so a ``Wait`` has nothing left to do)."""
        if isinstance(instr, Free):
            self._free(r, instr.values)
        elif isinstance(instr, Compute):
            xs = [self.buffers[r][b.value] for b in instr.ins]
            outs = self.kernels[(r, instr.dnode)](xs) if instr.dnode else local_move(instr, xs)
            for b, x in zip(instr.outs, outs):
                self._write(r, b.value, x)

    def _meet(self, holders: list[tuple[int, Comm]]) -> None:
        """A communication every member has reached: each receives what :func:`run_local` gives it."""
        sends = [self.buffers[r][c.send.value] if c.send is not None else None for r, c in holders]
        for (r, c), x in zip(holders, run_local([c for _, c in holders], sends)):
            if c.recv is not None:
                self._write(r, c.recv.value, x)

    def _write(self, r: int, vid: str, x: torch.Tensor) -> None:
        self.buffers[r][vid] = x
        self.ledgers[r].write(vid, x)

    def _free(self, r: int, values: tuple[str, ...]) -> None:
        for v in values:
            self.buffers[r].pop(v, None)
            self.ledgers[r].free(v)

    @property
    def peak_bytes(self) -> dict[int, int]:
        """Per rank: the largest sum of its live buffers so far (bytes)."""
        return {r: ledger.peak for r, ledger in self.ledgers.items()}
