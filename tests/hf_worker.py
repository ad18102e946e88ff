"""Hugging Face GPT-2 and Llama under shardflow's presets against eager PyTorch at float64: the comparison shared by
tests/test_hf_strategies.py (local executor, in its process) and one rank of its gloo test.

The models are test_export_capture's tiny configs (2 layers, hidden 64, 4 heads; Llama with 2 key/value heads;
``use_cache=False``, dropouts 0), random init, batch B=2, T=8. Each is run for :data:`STEPS` SGD steps (lr 0.1,
momentum 0.9) by shardflow and by the eager module, both inside ``wide_floats()`` (Hugging Face upcasts the
logits to float32 otherwise).

Usage (under shardflow's launcher): python hf_worker.py OUT_DIR CASE [CASE ...], CASE = model@strategy@mesh, e.g.
``gpt2@tp@tp=2``; writes OUT_DIR/result<rank>.json: case → the largest |Δ| of the loss, of any gradient and of
any weight replica.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

import torch
from test_export_capture import batch, hf_gpt2, hf_llama

from shardflow.capture import capture, wide_floats
from shardflow.lower import lower_step
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG, build_pcg
from shardflow.reference import weights_of
from shardflow.runtime.executor import Executor
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.strategy import make_plan, resolve
from shardflow.strategy.presets import cp_laid_out

MODELS = {"llama": hf_llama, "gpt2": hf_gpt2}
SGD = OptimizerConfig("sgd", 0.1, 0.9)
STEPS = 2


@functools.cache
def model_and_graph(name: str):
    """The float64 model ``name`` (seed 0), its batch and its captured graph; built once per process (a capture
    costs seconds): callers copy the model before they train it (:func:`compare`)."""
    torch.manual_seed(0)
    model = MODELS[name]().double()
    b = batch()
    with wide_floats():
        graph = capture(model, b)
    return model, b, graph


def plan_pcg(graph, mesh_text: str, strategy: str, cp_attention: str = "auto", cp_layout: str = "contiguous") -> PCG:
    mesh = cp_laid_out(Mesh.parse(mesh_text), cp_layout, graph)
    return build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy, cp_attention=cp_attention), graph, mesh))


def compare(model: torch.nn.Module, b: dict, graph, ex: Executor) -> dict[str, float]:
    """:data:`STEPS` steps of ``ex`` (weights loaded here from a copy of ``model``) and of the eager copy with
    torch's SGD: the largest |Δ| of the loss, of every gradient and, after the last step, of every weight replica."""
    model = copy.deepcopy(model)
    ex.load(weights_of(model, graph))
    opt = torch.optim.SGD(model.parameters(), lr=SGD.lr, momentum=SGD.momentum)
    diffs = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    for _ in range(STEPS):
        loss = ex.step(b)
        opt.zero_grad()
        with wide_floats():
            want = model(**b).loss
            want.backward()
        diffs["loss"] = max(diffs["loss"], abs(loss - want.item()))
        grads = ex.grads()
        diffs["grad"] = max(
            [diffs["grad"]] + [(grads[k] - p.grad).abs().max().item() for k, p in model.named_parameters()]
        )
        opt.step()
    diffs["weight"] = ex.weight_error({k: p.detach() for k, p in model.named_parameters()})
    return diffs


def main(out_dir: str, *cases: str) -> None:
    from shardflow.runtime.distributed import DistributedExecutor, init_from_env, shutdown

    rank, _ = init_from_env()
    results = {}
    for case in cases:
        name, strategy, mesh_text = case.split("@")
        model, b, graph = model_and_graph(name)
        step = lower_step(plan_pcg(graph, mesh_text, strategy), SGD.slots, ranks=[rank])
        results[case] = compare(model, b, graph, DistributedExecutor(step, SGD, timeout_s=60))
    Path(out_dir, f"result{rank}.json").write_text(json.dumps(results))
    shutdown(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
