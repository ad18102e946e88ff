"""``shardflow train --check``: the same steps on one device alongside the sharded run (local executor, unsharded
plan, same weights, optimizer state, batches and dropout masks; under ``--accumulate`` or ``--microbatches`` the
whole batch in one step,
the reference the micro-steps must equal); at the end the largest loss difference and the
largest parameter difference over every replica of every piece, against :data:`CHECK_TOL`."""

from __future__ import annotations

import dataclasses

import torch

from shardflow.lower import lower_step
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import build_pcg
from shardflow.train.console import Console

# Per --dtype. float32 on both sides: the sharded run adds partial sums in another order, and AdamW's division by
# sqrt(v) amplifies those rounding differences over many steps (seen: ~1e-6 after 20 steps, ~1e-4 after 600;
# the main job's Llama, tp on tp=1 at lr 3e-3: 2.1e-3 after 50 steps).
# bf16 (both sides bfloat16 compute, float32 masters): bfloat16 keeps 8 significant bits, so a partial sum added in
# another order differs by ~4e-3 of its size, and AdamW moves an element whose gradient sign that flips by up to
# 2 lr per step (seen: |Δloss| ~1e-3, |Δparameter| ~1e-2 after 2 steps at lr 3e-3).
# On a GPU both sides run on the run's device, and float32 differs more: its kernels round differently per layout
# (the plan's pieces are other shapes), and AdamW turns an element whose gradient is rounding noise into ±lr steps.
# Measured on an H200 (docs/benchmarks.md#the-gpu-run), the main job's tp on tp=1 against the single-device plan,
# 50 steps at lr 3e-3: |Δloss| 3.5e-4, |Δparameter| 9.4e-3 (the CPU: 3.2e-5, 2.1e-3); the single-device plan
# on both sides: 0, so it is the plan's rounding, not the kernels' nondeterminism.
CHECK_TOL = {("float32", "cpu"): 5e-3, ("float32", "cuda"): 2e-2, ("bf16", "cpu"): 3e-2, ("bf16", "cuda"): 3e-2}


class Check:
    """The one-device reference of a run. ``s``: the run's :class:`~shardflow.train.recipe.Setup`; ``weights``,
    ``state``, ``steps_done``: what the run's executor was loaded with; ``device``: where the run keeps its buffers,
    the reference's too (the same kernels: a CPU reference of a GPU run would differ by the kernels, not the plan)."""

    def __init__(self, s, weights, state, steps_done: int, device: torch.device):
        from shardflow.runtime.local import LocalExecutor

        # the whole batch at once, even under --accumulate or --microbatches
        one = build_pcg(s.whole_batch_graph(), Mesh(("d",), (1,)))
        options = dataclasses.replace(s.pipeline.options, microbatches=1)
        step = lower_step(one, s.optimizer.slots, options=options)
        self.ref = LocalExecutor(step, s.optimizer, seed=s.cfg.seed, device=device)
        self.tol = CHECK_TOL[s.cfg.dtype, device.type]
        self.ref.load(weights, state, steps_done)
        self.max_dloss = 0.0

    def step(self, batch, loss: float) -> None:
        """Run the reference on ``batch`` and compare its loss with the run's ``loss``."""
        self.max_dloss = max(self.max_dloss, abs(loss - self.ref.step(batch)))

    def finish(self, ex, console: Console) -> int:
        """Compare every replica of every piece of the run's executor ``ex`` (collective: every rank calls it) with
        the reference's weights; rank 0 prints the verdict. Returns the exit status: 0 within the tolerance, 1
        beyond."""
        max_dparam = ex.weight_error(self.ref.weights())
        ok = self.max_dloss <= self.tol and max_dparam <= self.tol
        console.say(
            f"check against one device: max |Δloss| {self.max_dloss:.2e}, max |Δparameter| {max_dparam:.2e} "
            f"over every replica (tolerance {self.tol:g}): {'OK' if ok else 'FAILED'}"
        )
        return 0 if ok else 1
