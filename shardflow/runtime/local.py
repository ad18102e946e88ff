"""Local executor: every rank's program in one process, interleaved in token order.

Communication is done as tensor operations on the members' buffers, so a plan can be run, debugged and
checked against the single-device run without any process group. It runs exactly the instructions the
distributed executor runs; only the communication differs.
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardflow.lower import LoweredStep
from shardflow.lower.dynamic import Value
from shardflow.lower.program import Comm, Compute, Wait
from shardflow.parallel.simulate import gather, scatter
from shardflow.runtime.executor import Executor
from shardflow.runtime.kernels import OptimizerConfig, local_move, make_kernel, single_calls
from shardflow.runtime.memory import Ledger, frees_after, persistent_values


REDUCE = {"sum": lambda x: x.sum(0), "avg": lambda x: x.mean(0), "max": lambda x: x.amax(0),
          "min": lambda x: x.amin(0)}


def collective(kind: str, members: list[Comm], sends: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """What each member receives, from what each sends (both in ``members`` order)."""
    c = members[0]
    d = len(members)
    if kind == "all_reduce":
        s = REDUCE[c.reduce_op](torch.stack(sends))
        return [s.clone() for _ in range(d)]
    if kind == "all_gather":
        s = torch.cat(sends, c.dim)
        return [s.clone() for _ in range(d)]
    if kind == "reduce_scatter":
        return [x.contiguous() for x in REDUCE[c.reduce_op](torch.stack(sends)).chunk(d, c.dim)]
    if kind == "all_to_all":
        chunks = [x.chunk(d, c.dim) for x in sends]
        return [torch.cat([chunks[i][j] for i in range(d)], c.dim2) for j in range(d)]
    if kind == "broadcast":
        root = next(x for x in sends if x is not None)
        return [root.clone() for _ in range(d)]
    if kind == "reduce":
        s = torch.stack(sends).sum(0)
        return [s if m.recv is not None else None for m in members]
    if kind == "permute":  # member i sends to its peer; each rank receives what was sent to it
        sent_to = {m.peer: x for m, x in zip(members, sends)}
        return [sent_to[r].clone() for r in c.members]
    if kind == "p2p":
        src = next(x for x in sends if x is not None)
        return [None if m.kind == "send" else src.clone() for m in members]
    raise ValueError(f"local executor cannot run communication kind {kind!r}")


class LocalExecutor(Executor):
    """Runs a lowered step on all ranks of its mesh in this process.

    Usage: ``ex = LocalExecutor(step, OptimizerConfig(...)); ex.load(weights); loss = ex.step(inputs)``;
    ``ex.weights()`` / ``ex.grads()`` assemble full tensors. Raises RuntimeError on a deadlock.
    """

    def __init__(self, step: LoweredStep, optimizer: OptimizerConfig, share: LocalExecutor | None = None):
        """``share``: another executor of the same PCG whose weights this one reads (e.g. evaluation)."""
        self.lowered, self.cfg = step, optimizer
        self.dg = step.dg
        self.steps_done = 0
        nodes = {n.name: n for n in self.dg.nodes}
        self.saved: dict[int, dict] = {r: {} for r in step.programs}  # forward autograd graphs per rank
        self.kernels = {}
        for r, p in step.programs.items():
            once = single_calls(p)
            for i in p.instrs:
                if isinstance(i, Compute) and i.dnode:
                    self.kernels[(r, i.dnode)] = make_kernel(nodes[i.dnode], self.dg, r, optimizer,
                                                             lambda: self.steps_done + 1,
                                                             self.saved[r] if i.dnode in once else None)
        self.buffers: dict[int, dict[str, torch.Tensor]] = share.buffers if share else {r: {} for r in step.programs}
        keep = persistent_values(self.dg)
        self.frees = {r: frees_after(p, keep) for r, p in step.programs.items()}
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
        pieces = {d: b[vid] for d, b in self.buffers.items() if vid in b}
        return gather(pieces, v)

    # --- one step -------------------------------------------------------------------------------------
    def step(self, inputs: Mapping[str, torch.Tensor]) -> float:
        """Run one training step on full ``inputs`` (by graph input name); returns the loss."""
        self._place_inputs(inputs)
        for r, bufs in self.buffers.items():
            self.ledgers[r].sync(bufs)
        progs = self.lowered.programs
        pos = {r: 0 for r in progs}
        while True:
            for r, p in progs.items():  # run computes up to the next communication
                while pos[r] < len(p.instrs) and not isinstance(p.instrs[pos[r]], Comm):
                    instr = p.instrs[pos[r]]
                    if not isinstance(instr, Wait):  # communications complete when all members issued them
                        xs = [self.buffers[r][b.value] for b in instr.ins]
                        outs = self.kernels[(r, instr.dnode)](xs) if instr.dnode else local_move(instr, xs)
                        for b, x in zip(instr.outs, outs):
                            self._write(r, b.value, x)
                    self._free(r, pos[r])
                    pos[r] += 1
            waiting = {r: p.instrs[pos[r]] for r, p in progs.items() if pos[r] < len(p.instrs)}
            if not waiting:
                break
            token = min(c.token for c in waiting.values())
            c0 = next(c for c in waiting.values() if c.token == token)
            members = [waiting.get(m) for m in c0.members]
            if any(m is None or m.token != token for m in members):
                raise RuntimeError(f"deadlock: token {token} ({c0.kind}) waits for ranks {list(c0.members)}, "
                                   f"which are at {[(m, getattr(waiting.get(m), 'token', None)) for m in c0.members]}")
            sends = [self.buffers[r][m.send.value] if m.send is not None else None for r, m in zip(c0.members, members)]
            for r, m, x in zip(c0.members, members, collective(c0.family, members, sends)):
                if m.recv is not None:
                    self._write(r, m.recv.value, x)
                self._free(r, pos[r])
                pos[r] += 1
        loss = self._get(f"fwd:{self.dg.pcg.loss}").item()
        for r, bufs in self.buffers.items():
            for new, old in self.renames:
                if new in bufs:
                    bufs[old] = bufs.pop(new)
            self.ledgers[r].sync(bufs)
        self.steps_done += 1
        return loss

    def _write(self, r: int, vid: str, x: torch.Tensor) -> None:
        self.buffers[r][vid] = x
        self.ledgers[r].write(vid, x)

    def _free(self, r: int, k: int) -> None:
        for v in self.frees[r][k]:
            self.buffers[r].pop(v, None)
            self.ledgers[r].free(v)

    @property
    def peak_bytes(self) -> dict[int, int]:
        """Per rank: the largest sum of its live buffers so far (bytes)."""
        return {r: ledger.peak for r, ledger in self.ledgers.items()}
