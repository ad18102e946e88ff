"""Local executor: every rank's program in one process, run together by :func:`~shardflow.lower.rendezvous.rendezvous`.

Communication is done as tensor operations on the members' buffers, so a plan can be run, debugged and
checked against the single-device run without any process group. It runs exactly the instructions the
distributed executor runs; only the communication differs.
"""

from __future__ import annotations

import functools
from typing import Mapping

import torch

from shardflow.lower import LoweredStep
from shardflow.lower.buffer_reuse import buffer_reuse
from shardflow.lower.comms import front_dim, run_local, sized_bytes
from shardflow.lower.dynamic import Value
from shardflow.lower.memory import Ledger, peak
from shardflow.lower.program import Comm, Compute
from shardflow.lower.rendezvous import rendezvous
from shardflow.lower.shard_expansion import uneven
from shardflow.parallel.simulate import blocks, gather, scatter
from shardflow.runtime.buffers import Receives
from shardflow.runtime.executor import Executor
from shardflow.runtime.kernels import (
    Kernel,
    OptimizerConfig,
    local_move,
    make_kernel,
    recorded_nodes,
    single_calls,
    update_kernel,
)
from shardflow.runtime.segments import Segment, compile_segment, runs


class LocalExecutor(Executor):
    """Runs a lowered step on all ranks of its mesh in this process.

    Usage: ``ex = LocalExecutor(step, OptimizerConfig(...)); ex.load(weights); loss = ex.step(inputs)``;
    ``ex.weights()`` / ``ex.grads()`` assemble full tensors. Raises RuntimeError on a deadlock.
    """

    def __init__(
        self,
        step: LoweredStep,
        optimizer: OptimizerConfig,
        share: LocalExecutor | None = None,
        seed: int = 0,
        device: torch.device | None = None,
        memory: bool = False,
    ):
        """``share``: another executor of the same PCG whose weights this one reads (e.g. evaluation).
        ``seed``: the run seed random ops (dropout) draw with. ``device``: where every rank's buffers live
        (default: ``share``'s, else the CPU; ``cuda``: every rank of the mesh on this one GPU). ``memory``: count
        the live bytes of each rank's buffers as the step runs (:attr:`peak_bytes`; off, the compiled segments do no
        accounting)."""
        self.lowered, self.cfg = step, optimizer
        self.device = device or (share.device if share else torch.device("cpu"))
        self.dg = step.dg
        self.steps_done = 0
        self.saved: dict[int, dict] = {r: {} for r in step.programs}  # forward autograd graphs per rank
        self.kernels = {}
        # per rank, the communications whose send buffer is theirs to use and the sums accumulated in place, as the
        # distributed executor decides
        self.shared: dict[int, frozenset[int]] = {}
        self.receives: dict[int, Receives] = {}  # per rank: receive slots, ring all-gathers in place
        for r, p in step.programs.items():
            reuse = buffer_reuse(p, recorded_nodes(p))
            self.shared[r], into = reuse.sends, reuse.sums
            self.receives[r] = Receives(p, reuse, self.device)
            once = single_calls(p)
            for i in p.instrs:
                if isinstance(i, Compute) and i.dnode:
                    self.kernels[(r, i)] = make_kernel(
                        i,
                        optimizer,
                        lambda: self.steps_done + 1,
                        self.saved[r] if i.dnode in once else None,
                        seed,
                        lambda: self.micro,
                        self.device,
                        i.outs[0].value in into,
                    )
        self.buffers: dict[int, dict[str, torch.Tensor]] = share.buffers if share else {r: {} for r in step.programs}
        self.blocks: dict[
            str, dict[int, tuple[slice | torch.Tensor, ...]]
        ] = {}  # value → device → its block (values placed each step)
        self.ledgers = {r: Ledger() for r in step.programs} if memory else None
        self._index_updates()
        loss = self.dg.values[self.dg.loss_values[0]]  # the device whose piece is the loss (None: partial, assembled)
        self.loss_holder = (
            None
            if loss.sharding.partial
            else next(d for d, c in loss.sharding.device_map(loss.group).items() if c.replica == 0)
        )
        # per rank, its program's runs between communications (the local calls of the rendezvous), compiled
        self.compiled: dict[int, dict[tuple[int, int], Segment]] = {
            r: {
                (a, z): compile_segment(
                    p.instrs[a:z],
                    functools.partial(self._kernel, r),
                    self._update_kernel,
                    self.ledgers[r] if memory else None,
                )
                for a, z in runs(p.instrs, (Comm,))
                if not isinstance(p.instrs[a], Comm)
            }
            for r, p in step.programs.items()
        }

    # --- data in and out ------------------------------------------------------------------------------
    def _put(self, vid: str, full: torch.Tensor) -> None:
        v = self.dg.values[vid]
        if v.sharding.partial or uneven(v):  # random partial pieces; short blocks padded
            cut = scatter(full, v)
        else:  # the blocks of a value placed every step (data, constants) worked out once
            if vid not in self.blocks:
                self.blocks[vid] = blocks(v)
            cut = {d: full[b] for d, b in self.blocks[vid].items()}
        for d, x in cut.items():
            if d in self.buffers:
                self.buffers[d][vid] = x.to(self.device, copy=True)

    def _get(self, vid: str) -> torch.Tensor:
        v: Value = self.dg.values[vid]
        return gather(self._pieces(vid), v).cpu()

    def _pieces(self, vid: str) -> dict[int, torch.Tensor]:
        return {d: b[vid] for d, b in self.buffers.items() if vid in b}

    def _here(self) -> tuple[int, ...]:
        return tuple(self.buffers)  # every rank of the mesh

    def _place(self, vid: str, pieces: Mapping[int, torch.Tensor]) -> None:
        for d, x in pieces.items():
            self.buffers[d][vid] = x

    def _max_over_ranks(self, x: float) -> float:
        return x  # every rank is here

    def per_process(self, x: float) -> list[float]:
        return [x]  # one process

    # --- one step -------------------------------------------------------------------------------------
    def dtensors(self, values: Mapping[str, str]) -> dict:
        """Raises ValueError: every rank of the mesh runs in this process, and a DTensor is one process's piece on a
        ``DeviceMesh`` of processes."""
        raise ValueError(
            f"DTensors of {', '.join(list(values)[:3])}{' ...' if len(values) > 3 else ''}: the local executor runs "
            f"every rank of mesh {self.dg.pcg.mesh} in this one process, and a DTensor is one process's piece on a "
            f"DeviceMesh of processes; run one process per device (torchrun --nproc-per-node "
            f"{self.dg.pcg.mesh.size} with parallelize(..., executor='distributed' or 'auto')), or read full tensors "
            f"with state_dict() / grads()"
        )

    def step(self, inputs: Mapping[str, torch.Tensor]) -> float:
        """Run one training step on full ``inputs`` (by graph input name); returns the loss."""
        self._place_inputs(inputs)
        self.sized_sent = dict.fromkeys(self.lowered.programs, 0)
        self._sync_ledgers()
        blocked = rendezvous(self.lowered.programs, self._run, self._meet)
        if blocked:
            raise RuntimeError(
                "deadlock: " + ", ".join(f"rank {r} blocks at instruction {k}" for r, k in sorted(blocked.items()))
            )
        loss = self._loss()
        for bufs in self.buffers.values():
            for new, old in self.renames:
                if new in bufs:
                    bufs[old] = bufs.pop(new)
        self._sync_ledgers()
        self.steps_done += 1
        return loss

    def _loss(self) -> float:
        """The loss (a scalar; the mean over the step's microbatches): replica 0's piece when it is not partial,
        else assembled from its pieces."""
        losses = [
            self._get(v).item() if self.loss_holder is None else self.buffers[self.loss_holder][v].item()
            for v in self.dg.loss_values
        ]
        return sum(losses) / len(losses)

    def _sync_ledgers(self) -> None:
        if self.ledgers:
            for r, bufs in self.buffers.items():
                self.ledgers[r].sync(bufs)

    def _kernel(self, r: int, instr: Compute) -> Kernel:
        return self.receives[r].kernel(instr) or (
            self.kernels[(r, instr)] if instr.dnode else functools.partial(local_move, instr)
        )

    def _update_kernel(self, updates) -> Kernel:
        return update_kernel(updates, self.cfg, lambda: self.steps_done + 1)

    def _run(self, r: int, start: int, stop: int) -> None:
        """Instructions ``start`` to ``stop - 1`` of rank ``r``'s program, none a communication (a ``Wait`` does
        nothing here: communications complete when all their members issued them)."""
        self.compiled[r][start, stop](self.buffers[r], None)

    def _meet(self, holders: list[tuple[int, Comm]]) -> None:
        """A communication every member has reached: each receives what :func:`run_local` gives it."""
        sends = [self.buffers[r][c.send.value] if c.send is not None else None for r, c in holders]
        shared = [c.token in self.shared[r] for r, c in holders]
        splits = [self.buffers[r][c.splits[0].value].sum(1).tolist() for r, c in holders if c.splits is not None]
        for j, ((r, c), rows) in enumerate(zip(holders, splits)):
            self.sized_sent[r] += sized_bytes(c, rows, j)
        for (r, c), x in zip(holders, run_local([c for _, c in holders], sends, shared, splits)):
            alloc = self.receives[r].alloc(c)
            if alloc is not None:  # copied where the distributed executor receives it: its slot, its ring's block
                at = front_dim(c)  # in the layout the distributed executor receives in
                y = alloc(tuple(x.movedim(at, 0).shape) if at else tuple(x.shape))
                x = y.copy_(x.movedim(at, 0)).movedim(0, at) if at else y.copy_(x)
            if c.recv is not None:
                self.buffers[r][c.recv.value] = x
                if self.ledgers:
                    self.ledgers[r].write(c.recv.value, c.recv.type.nbytes)

    @property
    def peak_bytes(self) -> dict[int, int]:
        """Per rank: the largest sum of its live buffers so far (bytes). Raises RuntimeError when the executor was
        built without ``memory=True``."""
        return {r: peak(ledger) for r, ledger in (self.ledgers or {0: None}).items()}
