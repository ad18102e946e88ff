"""Fault injection for tests/test_faults.py: ``shardflow`` with a fault installed through shardflow.train.hooks.

Usage: SHARDFLOW_FAULT=FAULT python tests/faults.py train ARGS...

The parent and every rank it launches (``Hooks.command`` names this file) read ``SHARDFLOW_FAULT`` — here and
nowhere else; the package does not know the variable:

* ``kill:rank=R:step=N`` — rank R kills itself with SIGKILL in the middle of training step N (half-way through the
  step's torch operations, counted during step N-1; at the start of the step when N is 1);
* ``stall:rank=R:step=N:seconds=S`` — rank R sleeps S seconds before step N, outside any communication;
* ``kill_in_save:rank=R[:step=N]`` — rank R kills itself with SIGKILL while saving the checkpoint of step N
  (default: the first save), once its files are in ``step_N.tmp/`` and before the checkpoint is committed.

Steps count from 1 over the whole run. Every fault prints one line to the rank's log before it strikes. A malformed
``SHARDFLOW_FAULT`` is one paragraph on stderr and exit status 2, before any process starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Sequence

from torch.overrides import TorchFunctionMode

FAULT_ENV = "SHARDFLOW_FAULT"


class Fault:
    """A fault a rank injects into itself, parsed from the text of ``SHARDFLOW_FAULT`` (see the module docstring)."""

    KINDS = {"kill": ("rank", "step"), "stall": ("rank", "step", "seconds"), "kill_in_save": ("rank",)}

    def __init__(self, text: str):
        kind, *parts = text.split(":")
        fields = dict(p.split("=", 1) for p in parts if "=" in p)
        need = self.KINDS.get(kind)
        bad = [p for p in parts if "=" not in p] + sorted(set(fields) - {"rank", "step", "seconds"})
        if need is None or bad or not set(need) <= set(fields):
            raise ValueError(
                f"{FAULT_ENV}={text!r}: write kill:rank=R:step=N, stall:rank=R:step=N:seconds=S or "
                f"kill_in_save:rank=R[:step=N] (a test hook; unset it for normal runs)"
            )
        try:
            self.kind, self.rank = kind, int(fields["rank"])
            self.step = int(fields["step"]) if "step" in fields else None
            self.seconds = float(fields.get("seconds", 0))
        except ValueError:
            raise ValueError(f"{FAULT_ENV}={text!r}: rank and step are whole numbers, seconds a number") from None
        if self.step is not None and self.step < 1:
            raise ValueError(f"{FAULT_ENV}={text!r}: steps count from 1")
        self.ops = _OpCounter()

    def _strike(self, rank: int, what: str) -> None:
        print(f"fault injection ({FAULT_ENV}): rank {rank} {what}", flush=True)
        if what.startswith("kills"):
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def step_context(self, rank: int, step: int):
        """What rank ``rank`` runs training step ``step`` (1-based) under (the ``step`` hook)."""
        if rank != self.rank or self.kind == "kill_in_save":
            return contextlib.nullcontext()
        if self.kind == "stall" and step == self.step:
            self._strike(rank, f"stalls for {self.seconds:g} s before step {step}")
            time.sleep(self.seconds)
        if self.kind == "kill" and step == self.step - 1:
            return self.ops  # count the torch operations of one step
        if self.kind == "kill" and step == self.step:
            half = self.ops.calls // 2
            if half == 0:
                self._strike(rank, f"kills itself (SIGKILL) at the start of step {step}")
            self.ops.calls, self.ops.at = 0, half
            self.ops.then = lambda: self._strike(
                rank, f"kills itself (SIGKILL) in the middle of step {step} (torch operation {half})"
            )
            return self.ops
        return contextlib.nullcontext()

    def saved(self, rank: int, step: int) -> None:
        """The ``saved`` hook: rank ``rank``'s files of the checkpoint of ``step`` are written, not yet committed."""
        if self.kind == "kill_in_save" and rank == self.rank and (self.step is None or step == self.step):
            self._strike(rank, f"kills itself (SIGKILL) while saving the checkpoint of step {step}")


class _OpCounter(TorchFunctionMode):
    """Counts torch operations; calls ``then`` at operation number ``at``."""

    def __init__(self):
        super().__init__()
        self.calls, self.at, self.then = 0, None, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.at:
            self.then()
        return func(*args, **(kwargs or {}))


def main(argv: Sequence[str] | None = None) -> int:
    """``shardflow`` (its CLI, ``argv``) with the fault of ``SHARDFLOW_FAULT`` installed, in this process and in
    every rank it launches."""
    from shardflow import cli
    from shardflow.train import hooks

    text = os.environ.get(FAULT_ENV)
    try:
        fault = Fault(text) if text else None
    except ValueError as e:
        print(f"shardflow train: error: {e}", file=sys.stderr)
        return 2
    command = (sys.executable, os.path.abspath(__file__))
    hooks.install(hooks.Hooks(fault.step_context, fault.saved, command) if fault else hooks.Hooks(command=command))
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
