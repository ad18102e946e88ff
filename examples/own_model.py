"""Train your own nn.Module with your own strategy — the whole shardflow pipeline in one file.

Run every rank in this process (the local executor simulates the mesh):
    python examples/own_model.py
Run one process per device (2 processes, gloo):
    torchrun --standalone --nproc-per-node 2 examples/own_model.py
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

from shardflow.capture import capture
from shardflow.lower import lower_step
from shardflow.parallel.mesh import Mesh, Replicate, Shard
from shardflow.parallel.pcg import build_pcg
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.strategy import ModulePlan, Plan, resolve


class Classifier(nn.Module):
    """x [B, 32] → 128 → GELU → 10 classes; loss = cross-entropy against y [B]."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 128)
        self.act = nn.GELU()
        self.down = nn.Linear(128, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.down(self.act(self.up(x))), y)


def main():
    torch.manual_seed(0)
    model = Classifier()
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))

    # 1. Capture: the module becomes a computation graph (weights are graph inputs named like its parameters).
    graph = capture(model, {"x": x, "y": y})

    # 2. Strategy: a user plan in DTensor spelling — here Megatron tensor parallelism on axis "tp" and data
    #    parallelism on axis "dp": up is column-parallel, down is row-parallel, the batch is split over dp.
    mesh = Mesh.parse("dp=2,tp=2" if int(os.environ.get("WORLD_SIZE", "4")) == 4 else "tp=2")
    plan = Plan(
        inputs={"x": {"dp": Shard(0)}, "y": {"dp": Shard(0)}} if "dp" in mesh.axis_names else {},
        modules={
            "up": ModulePlan(params={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}),
            "down": ModulePlan(params={"weight": {"tp": Shard(1)}}, output={"tp": Replicate()}),
        })

    # 3. Plan: propagate shardings (errors name the op, tensor, dim and fix) and lower one training step.
    pcg = build_pcg(graph, mesh, resolve(plan, graph, mesh))
    opt = OptimizerConfig("sgd", lr=0.5, momentum=0.9)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}

    # 4. Run: every rank in this process, or one rank per process under torchrun.
    if "RANK" in os.environ:
        from shardflow.runtime.distributed import DistributedExecutor, init_from_env, shutdown
        rank, _ = init_from_env()
        ex = DistributedExecutor(lower_step(pcg, opt.slots, ranks=[rank]), opt)
    else:
        from shardflow.runtime.local import LocalExecutor
        rank = 0
        ex = LocalExecutor(lower_step(pcg, opt.slots), opt)  # lowering proves the programs agree
    ex.load(weights)
    for step in range(20):
        loss = ex.step({"x": x, "y": y})
        if rank == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {loss:.4f}", flush=True)
    trained = ex.weights()  # full tensors, loadable into the plain module
    if rank == 0:
        model.load_state_dict(trained)
        print(f"final loss of the plain module: {model(x, y).item():.4f}", flush=True)
    if "RANK" in os.environ:
        shutdown(0)


if __name__ == "__main__":
    main()
