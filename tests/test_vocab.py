"""Vocabulary parallelism (docs/concepts.md#vocabulary-parallel-embedding-and-loss): the embedding table and the
head sharded on the vocabulary, the loss computed on the sharded logits.

Numbers: Hugging Face's Llama (vocabulary 96, tests/hf_worker.py) in float64 under dp×sp, fsdp×tp and
pp×tp on the local executor: the loss and every gradient of 2 SGD steps and every weight replica after them equal
eager PyTorch's within 1e-9 (a plan adds partial sums in another order; a wrong block start or a missed mask is an
O(1) error); tp=2, sp and dp×tp are in tests/test_hf_strategies.py, on gloo processes too. Structure: what is
sharded, which tensors move (never the logits), the per-rank state, and where the loss is not rewritten. The
decomposed softmax against ATen's at float64 and bfloat16.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from hf_worker import SGD, compare, model_and_graph, plan_pcg  # noqa: E402

from shardflow.graph import GraphBuilder  # noqa: E402
from shardflow.graph import ops as O  # noqa: E402
from shardflow.graph.softmax import decompose_softmax, softmax_heads  # noqa: E402
from shardflow.lower import lower_step  # noqa: E402
from shardflow.parallel.mesh import Mesh, Replicate, Shard  # noqa: E402
from shardflow.reference import run_backward  # noqa: E402
from shardflow.runtime.local import LocalExecutor  # noqa: E402
from shardflow.strategy import ModulePlan, Plan, resolve  # noqa: E402
from shardflow.strategy.presets import vocabulary_parallel  # noqa: E402

TOL = 1e-9


@pytest.fixture(scope="module")
def llama():
    return model_and_graph("llama")


@pytest.mark.parametrize("mesh, strategy", [("dp=2,tp=2", "dp,sp"), ("fsdp=2,tp=2", "fsdp,tp"), ("pp=2,tp=2", "pp,tp")])
def test_vocabulary_parallel_plans_equal_eager(llama, mesh, strategy):
    model, b, graph = llama
    pcg = plan_pcg(graph, mesh, strategy)
    t = pcg.tensors
    assert t["model.embed_tokens.weight"].sharding.dims[0] == t["lm_head.weight"].sharding.dims[0] == ("tp",)
    diffs = compare(model, b, graph, LocalExecutor(lower_step(pcg, SGD.slots), SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def test_the_logits_never_move_and_the_state_splits_evenly(llama):
    """Under tp=2 no parallel op carries a tensor with the vocabulary in its shape: of the loss's tokens, only the
    max and the sum ([N, 1]) move; the target logits ([N]) stay Partial pieces through the ignore mask (``where(mask,
    x, 0)``, linear in x). Parameters per rank are within 1.1 × an even split (the norms stay whole)."""
    _, _, graph = llama
    pcg = plan_pcg(graph, "tp=2", "tp")
    vocab = pcg.tensors["lm_head.weight"].type.shape[0]
    tokens = math.prod(graph.tensors["input_ids"].shape)
    moved = [(n.op.describe(), pcg.tensors[n.inputs[0]].type.shape) for n in pcg.parallel_nodes]
    assert all(vocab not in shape for _, shape in moved)
    reduce = "ReductionOp(degree=2, axis=tp)"
    assert sorted(m for m in moved if math.prod(m[1]) == tokens) == [(reduce, (tokens, 1)), (reduce, (tokens, 1))]
    # capture lifts the loss's mask with its zero known, and nothing is redistributed
    assert any(isinstance(n.op, O.Where) and n.op.zero == 2 for n in graph.nodes) and not pcg.redistributions
    whole = sum(math.prod(pcg.tensors[w].type.shape) for w in graph.weights)
    per_rank = sum(math.prod(pcg.tensors[w].pshape.piece_shape) for w in graph.weights)
    assert per_rank / (whole / 2) <= 1.1


def test_softmax_heads_find_the_head_through_casts_and_views(llama):
    _, _, graph = llama
    ((softmax, head),) = softmax_heads(graph).items()
    assert head.scope == "lm_head" and next(n for n in graph.nodes if n.name == softmax).op.log


def small_lm(vocab: int):
    """An embedding and a head of ``vocab`` classes and the loss a captured model computes (log-softmax, gather)."""
    b = GraphBuilder()
    idx = b.input("idx", (4, 6), "int64")
    y = b.input("y", (24, 1), "int64")
    with b.scope("emb"):
        h = b.embedding(idx, b.weight("emb.weight", (vocab, 8)))
    with b.scope("head"):
        logits = b.linear(b.reshape(h, (24, 8)), b.weight("head.weight", (vocab, 8)))
    logp = b.apply(O.Softmax(1, log=True), [logits])[0]
    loss = b.neg(b.mean(b.apply(O.Gather(1), [logp, y])[0]))
    return b.build([loss], loss)


@pytest.mark.parametrize(
    "vocab, placement, rewritten",
    [(96, Shard(0), True), (96, Replicate(), False), (95, Shard(0), True)],
    ids=["sharded", "replicated", "odd"],
)
def test_the_loss_is_rewritten_only_for_a_sharded_head(vocab, placement, rewritten):
    """A plan that shards the head's output features gets the decomposed softmax, its max and sum reduced where
    they are made; one that keeps the head whole keeps ATen's softmax. The preset shards a vocabulary the degree
    does not divide too, in uneven blocks (95 on 2: 48 and 47 rows; docs/concepts.md#uneven-shards)."""
    graph = small_lm(vocab)
    mesh = Mesh.parse("tp=2")
    ann = resolve(Plan({"head": ModulePlan(params={"weight": {"tp": placement}})}), graph, mesh)
    assert (ann.graph is not None) is rewritten
    if rewritten:
        softmax = next(n.name for n in graph.nodes if isinstance(n.op, O.Softmax))
        assert ann.after == {f"{softmax}.shift": {"tp": Replicate()}, f"{softmax}.sum": {"tp": Replicate()}}
        assert not any(isinstance(n.op, O.Softmax) for n in ann.graph.nodes)
    plan = vocabulary_parallel(graph, 2)
    assert plan.modules["head"].params == {"weight": {"tp": Shard(0)}}
    assert plan.modules["emb"].params == {"weight": {"tp": Shard(0)}}
    assert plan.modules["emb"].output == {"tp": Replicate()}


@pytest.mark.parametrize("log", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_decomposed_softmax_equals_aten(log, dtype):
    """Values and gradient of the decomposition against ATen's (log-)softmax, on logits up to about ±100 (a shift
    is needed): float64 to rounding; bfloat16, computed in float32 inside as ATen does, to bfloat16's rounding."""
    b = GraphBuilder()
    x = b.weight("x", (6, 10), dtype)  # a weight: run_backward differentiates weights
    w = b.input("w", (6, 10), dtype)
    out = b.apply(O.Softmax(1, log=log), [x])[0]
    loss = b.sum(b.mul(out, w))
    graph = b.build([loss, out], loss)
    node = next(n for n in graph.nodes if isinstance(n.op, O.Softmax))
    split, partial = decompose_softmax(graph, [node])
    assert partial == {node.name: (f"{node.name}.shift", f"{node.name}.sum")}
    assert not any(isinstance(n.op, O.Softmax) for n in split.nodes) and split.tensors[out].dtype == dtype
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    xv = (torch.randn(6, 10, generator=gen, dtype=torch.float64) * 30).to(dt)
    wv = torch.randn(6, 10, generator=gen, dtype=torch.float64).to(dt)
    ref = xv.to(torch.float64 if dtype == "float64" else torch.float32).requires_grad_(True)
    want = (torch.log_softmax if log else torch.softmax)(ref, 1)
    (want_grad,) = torch.autograd.grad((want * wv.to(ref.dtype)).sum(), ref)
    env, grads = run_backward(split, {"w": wv}, {"x": xv})
    atol = 1e-12 if dtype == "float64" else 0.5 if log else 1e-2  # bfloat16: 8 bits of mantissa, values to ~100
    torch.testing.assert_close(env[out].double(), want.to(dt).double(), atol=atol, rtol=0)
    torch.testing.assert_close(grads["x"].double(), want_grad.to(dt).double(), atol=atol, rtol=0)
