"""Mixed precision (``--dtype bf16``, ``LowerOptions(precision=MixedPrecision(torch.bfloat16, torch.float32))``): a Llama captured in bfloat16 trains
with float32 master weights — the exact plan (one cast per weight, every reader on the bfloat16 copy, all-gathers
in bfloat16, every reduction of a weight's gradient and the optimizer state in float32) — and the numbers of eager
PyTorch doing the same by hand (bfloat16 module, float32 masters, SGD), on one device and sharded."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from conftest import tiny_hf_llama  # noqa: E402

from shardflow.api import parallelize  # noqa: E402
from shardflow.capture import capture  # noqa: E402
from shardflow.lower import LowerOptions, MixedPrecision, lower_step  # noqa: E402
from shardflow.lower.cost import CommForm  # noqa: E402
from shardflow.lower.dynamic import NodeKind, TaskType, ValueRole, compute_id, forward_id  # noqa: E402
from shardflow.lower.program import Comm  # noqa: E402
from shardflow.parallel.mesh import Mesh  # noqa: E402
from shardflow.parallel.pcg import build_pcg  # noqa: E402
from shardflow.runtime.kernels import OptimizerConfig  # noqa: E402
from shardflow.runtime.local import LocalExecutor  # noqa: E402
from shardflow.strategy import resolve  # noqa: E402
from shardflow.strategy.presets import make_plan  # noqa: E402

LR, STEPS = 0.5, 3
# bfloat16 keeps 8 significant bits: shardflow's ATen kernels and eager PyTorch's, or a sharded run and one device,
# round partial results differently (seen: |Δweight| ≤ 4.2e-3, |Δloss| ≤ 1.1e-3 after 3 SGD steps that move the
# weights by 0.27; a gradient reduced in bfloat16, a lost master update or a missing reduction is ≥ 5e-2)
TOL_WEIGHT, TOL_LOSS = 1.5e-2, 5e-3


@pytest.fixture(scope="module")
def llama():
    """A float32 Llama's weights, its bfloat16 copy and that copy's graph."""
    model, batch = tiny_hf_llama()
    masters = {k: v.detach().clone() for k, v in model.named_parameters()}
    narrow = model.to(torch.bfloat16)
    return masters, narrow, batch, capture(narrow, batch)


def _lower(graph, mesh_text: str, strategy: str, master: torch.dtype | None = torch.float32, optimizer: str = "sgd"):
    mesh = Mesh.parse(mesh_text)
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy), graph, mesh))
    options = LowerOptions(
        CommForm.COLLECTIVE,
        CommForm.COLLECTIVE,
        reshard_after_forward=True,
        precision=master and MixedPrecision(torch.bfloat16, master),
    )
    return lower_step(pcg, optimizer, options=options)


@pytest.fixture(scope="module")
def eager(llama):
    """Mixed precision by hand in eager PyTorch: the bfloat16 module's parameters set from float32 masters, its
    bfloat16 gradients upcast and applied to the masters (SGD). Losses and the masters after each step."""
    masters, narrow, batch, _ = llama
    module, kept = copy.deepcopy(narrow), {k: v.clone() for k, v in masters.items()}
    params = dict(module.named_parameters())
    losses = []
    for _ in range(STEPS):
        for k, p in params.items():
            p.data.copy_(kept[k])
            p.grad = None
        loss = module(**batch).loss
        loss.backward()
        losses.append(loss.item())
        for k, p in params.items():
            kept[k] -= LR * p.grad.float()
    assert max((kept[k] - masters[k]).abs().max().item() for k in kept) > 0.1  # the steps move the weights
    return losses, kept


def test_weights_are_held_in_float32_and_every_reader_reads_their_bfloat16_copy(llama):
    _, _, _, graph = llama
    dg = _lower(graph, "fsdp=2", "fsdp", optimizer="adamw").dg
    weights = graph.weights
    assert {graph.tensors[w].type.dtype for w in weights} == {"bfloat16"}
    casts = [n for n in dg.nodes if n.kind == NodeKind.CAST]
    assert sorted(n.src for n in casts) == sorted(weights) and all(n.task == TaskType.FWD for n in casts)
    for w in weights:
        assert (dg.values[forward_id(w)].type.dtype, dg.values[compute_id(w)].type.dtype) == ("float32", "bfloat16")
        readers = [n for n in dg.nodes if forward_id(w) in n.inputs]
        assert {n.kind for n in readers} == {NodeKind.CAST, NodeKind.UPDATE}, (w, [n.name for n in readers])
    state = [v for v in dg.values.values() if v.role == ValueRole.OPT]
    assert state and {v.type.dtype for v in state} == {"float32"}
    update_grads = {dg.values[n.inputs[1]].type.dtype for n in dg.nodes if n.kind == NodeKind.UPDATE}
    assert update_grads == {"float32"}


@pytest.mark.parametrize(
    "mesh, strategy, want",
    [
        # fsdp: the weights gathered in bfloat16, one bucket per block (2 layers and the rest; twice: resharded for the
        # backward), their gradients reduce-scattered in float32, one bucket per block; the loss's label count (a
        # float32 scalar) all-reduced
        (
            "fsdp=2",
            "fsdp",
            lambda n: {
                ("all_gather", "bfloat16"): 2 * 3,
                ("reduce_scatter", "float32"): 3,
                ("all_reduce", "float32"): 1,
            },
        ),
        # dp: the weights' gradients in one float32 bucket, with the label count
        ("dp=2", "dp", lambda n: {("all_reduce", "float32"): 2}),
        # tp: activations stay bfloat16 — two forward and two backward all-reduces per block, the vocabulary-parallel
        # embedding's output and the head's input gradient; the loss runs on the float32 logits (Hugging Face's
        # .float()): its max, sum and the sum's gradient all-reduced (its target logits stay partial to the loss)
        ("tp=2", "tp", lambda n: {("all_reduce", "bfloat16"): 8 + 2, ("all_reduce", "float32"): 3}),
    ],
)
def test_collectives_move_bfloat16_weights_and_float32_gradients(llama, mesh, strategy, want):
    _, _, _, graph = llama
    step = _lower(graph, mesh, strategy)
    n = len(graph.weights)
    for r, prog in step.programs.items():
        got = Counter((str(c.kind), c.type.dtype) for c in prog.instrs if isinstance(c, Comm))
        assert got == want(n), (r, got)
    if strategy == "fsdp":  # a bfloat16 gather moves half the bytes of a float32 one
        gathered = sum(c.nbytes for c in step.programs[0].instrs if isinstance(c, Comm) and str(c.kind) == "all_gather")
        assert gathered == 2 * sum(graph.tensors[w].type.nbytes for w in graph.weights) // 2


@pytest.mark.parametrize("mesh, strategy", [("d=1", "single"), ("dp=2", "dp"), ("fsdp=2", "fsdp"), ("tp=2", "tp")])
def test_mixed_precision_equals_eager_with_float32_masters(llama, eager, mesh, strategy):
    masters, _, batch, graph = llama
    ex = LocalExecutor(_lower(graph, mesh, strategy), OptimizerConfig("sgd", LR))
    ex.load({w: masters[w] for w in graph.weights})
    losses = [ex.step(batch) for _ in range(STEPS)]
    ref_losses, ref = eager
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL_LOSS
    assert ex.weight_error(ref) < TOL_WEIGHT
    assert {t.dtype for t in ex.weights().values()} == {torch.float32}


def test_without_a_master_dtype_the_weights_stay_bfloat16(llama):
    _, _, _, graph = llama
    dg = _lower(graph, "dp=2", "dp", master=None).dg
    assert not any(n.kind == NodeKind.CAST for n in dg.nodes)
    assert {dg.values[forward_id(w)].type.dtype for w in graph.weights} == {"bfloat16"}


def test_parallelize_takes_the_precision_policy_and_refuses_an_integer_dtype(llama):
    masters, narrow, batch, _ = llama
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    trainer = parallelize(copy.deepcopy(narrow), batch, mesh="dp=2", lr=LR, mixed_precision=policy)
    trained = trainer.state_dict()
    assert {trained[k].dtype for k, _ in narrow.named_parameters()} == {torch.float32}
    with pytest.raises(ValueError, match=r"param_dtype and reduce_dtype must be floating dtypes"):
        parallelize(narrow, batch, mesh="dp=2", mixed_precision=MixedPrecision(torch.bfloat16, torch.int32))
