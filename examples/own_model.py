"""Train your own nn.Module with your own strategy: a classifier, a user plan in DTensor spelling (or torch's
tensor-parallel styles), and ``shardflow.parallelize``.

Run every rank in this process (the local executor runs the dp=2,tp=2 mesh, the plan in DTensor spelling):
    python examples/own_model.py
Run one process per device (2 processes, gloo, tp=2, the same plan as torch's styles; each rank's gradients read
back as DTensors for a metric):
    torchrun --standalone --nproc-per-node 2 examples/own_model.py
``classifier`` is also a factory for ``shardflow check`` and ``shardflow plan``:
    shardflow check --model examples/own_model.py:classifier --plan classifier_plan.toml --mesh dp=2,tp=2
"""

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import shardflow
from shardflow import ModulePlan, Optimizer, OptimizerConfig, Plan
from shardflow.parallel.mesh import Replicate, Shard


class Classifier(nn.Module):
    """x [B, 32] → 128 → GELU → 10 classes; loss = cross-entropy against y [B]."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 128)
        self.act = nn.GELU()
        self.down = nn.Linear(128, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.down(self.act(self.up(x))), y)


def classifier():
    """The model (seeded) and a batch of 64 random rows with random classes."""
    torch.manual_seed(0)
    return Classifier(), {"x": torch.randn(64, 32), "y": torch.randint(0, 10, (64,))}


def classifier_plan(data_parallel: bool) -> Plan:
    """A user plan in DTensor spelling: Megatron tensor parallelism on axis "tp" — up column-parallel, down
    row-parallel (its output reduced to Replicate) — and, with ``data_parallel``, the batch split over axis "dp"."""
    return Plan(
        inputs={"x": {"dp": Shard(0)}, "y": {"dp": Shard(0)}} if data_parallel else {},
        modules={
            "up": ModulePlan(params={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}),
            "down": ModulePlan(params={"weight": {"tp": Shard(1)}}, output={"tp": Replicate()}),
        },
    )


def classifier_styles() -> dict:
    """The tensor parallelism of :func:`classifier_plan` as torchtitan writes it: ``parallelize_module``'s plan of
    torch's styles (placed on the mesh's axis tp)."""
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def main():
    model, batch = classifier()
    distributed = "RANK" in os.environ
    mesh = "tp=2" if distributed else "dp=2,tp=2"
    plan = classifier_styles() if distributed else classifier_plan(data_parallel=True)
    # Capture, plan (errors name the op, tensor, dim and fix), lower and load the weights. Under torchrun this
    # process is one rank (the executor defaults to "auto": distributed when WORLD_SIZE > 1).
    trainer = shardflow.parallelize(
        model, batch, mesh=mesh, plan=plan, optimizer=OptimizerConfig(Optimizer.SGD, lr=0.5, momentum=0.9)
    )
    for step in range(20):
        loss = trainer.step(batch)
        if trainer.lead and step % 5 == 4:
            print(f"step {step + 1}: loss {loss:.4f}", flush=True)
    if distributed:  # each rank's pieces of the last step's gradients, as DTensors on the tp mesh (collective)
        grads = trainer.dtensor_grads()
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g).full_tensor() for g in grads.values()])
        )
        if trainer.lead:
            print(f"gradient norm of the DTensors: {norm:.6g} (the trainer's: {trainer.grad_norm:.6g})", flush=True)
    trained = trainer.state_dict()  # full tensors (collective under torchrun: every rank calls it)
    if trainer.lead:
        model.load_state_dict(trained)
        print(f"final loss of the plain module: {model(**batch).item():.4f}", flush=True)
    if distributed:
        from shardflow.runtime.distributed import shutdown

        shutdown(0)


if __name__ == "__main__":
    main()
