"""Context parallelism, the all-gather form (docs/concepts.md#context-parallelism): the sequence of the batch and of
every activation split over the ``cp`` axis, attention reading the keys and values gathered, each device's queries
with their block's rows of the causal mask.

Numbers: Hugging Face's Llama (tests/hf_worker.py) in float64 under cp alone and with dp, tp and fsdp on the local
executor — the loss and every gradient of 2 SGD steps and every weight replica after them equal eager PyTorch's
within 1e-9; the main job's model under ``shardflow train --strategy cp`` with its self-check. Structure: what
moves per attention, forward and backward, and that the logits stay split where each device holds one sequence.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import zoo  # noqa: E402
from hf_worker import SGD, compare, model_and_graph, plan_pcg  # noqa: E402

from shardflow.capture import capture, wide_floats  # noqa: E402
from shardflow.cli import main  # noqa: E402
from shardflow.graph import GraphBuilder  # noqa: E402
from shardflow.graph import ops as O  # noqa: E402
from shardflow.graph.layout import HeadTail  # noqa: E402
from shardflow.lower import lower_step  # noqa: E402
from shardflow.lower.cost import PLAIN, ActivationCheckpointing, CPAttention  # noqa: E402
from shardflow.lower.program import BlockVjp, Compute, Wait  # noqa: E402
from shardflow.parallel.mesh import Balance, Mesh  # noqa: E402
from shardflow.runtime.local import LocalExecutor  # noqa: E402
from shardflow.strategy import PlanError, make_plan  # noqa: E402
from shardflow.strategy.presets import cp_laid_out  # noqa: E402

TOL = 1e-9
LAYERS = 2


@pytest.fixture(scope="module")
def llama():
    return model_and_graph("llama")


@pytest.mark.parametrize(
    "mesh, strategy",
    [("cp=2", "cp"), ("cp=4", "cp"), ("dp=2,cp=2", "dp,cp"), ("cp=2,tp=2", "cp,tp"), ("fsdp=2,cp=2", "fsdp,cp")],
)
def test_context_parallel_equals_eager(llama, mesh, strategy):
    model, b, graph = llama
    pcg = plan_pcg(graph, mesh, strategy)
    assert pcg.tensors["input_ids"].sharding.dims[1] == ("cp",)
    diffs = compare(model, b, graph, LocalExecutor(lower_step(pcg, SGD.slots), SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def test_attention_gathers_keys_and_values_and_the_logits_stay_split(llama):
    """dp=2 × cp=2 on a batch of 2 sequences (one per dp rank): each attention's queries keep their sequence block
    and its keys and values are all-gathered over cp (forward), their gradients reduce-scattered back (backward);
    the [B, T, V] logits viewed as [B·T, V] keep their blocks (B split into single rows), so nothing of the vocabulary
    moves; the labels are gathered for Hugging Face's shift (a pad on the sequence) and the label count reduced."""
    _, _, graph = llama
    pcg = plan_pcg(graph, "dp=2,cp=2", "dp,cp")
    attention = [n for n in pcg.nodes if isinstance(n.op, O.Attention)]
    assert len(attention) == LAYERS
    for n in attention:
        q, k, v = (pcg.tensors[t] for t in n.inputs)
        assert q.sharding.dims[2] == ("cp",) and k.sharding.dims[2] == v.sharding.dims[2] == ()
    gathered = [r for r in pcg.redistributions if isinstance(r.op, O.Attention)]
    assert [[op.describe() for op in r.ops] for r in gathered] == [["CombineOp(dim=2, degree=2, axis=cp)"]] * (
        2 * LAYERS
    )
    vocab = pcg.tensors["lm_head.weight"].type.shape[0]
    assert all(vocab not in pcg.tensors[n.inputs[0]].type.shape for n in pcg.parallel_nodes)
    rest = [(r.node, [op.describe() for op in r.ops]) for r in pcg.redistributions if r not in gathered]
    assert rest == [
        ("constant_pad_nd", ["CombineOp(dim=1, degree=2, axis=cp)"]),
        ("gather", ["RepartitionOp(dim=0, degree=2, axis=cp)"]),
        ("div", ["ReductionOp(degree=2, axis=dp)"]),
    ]
    programs = lower_step(pcg, SGD.slots).programs
    kinds = Counter((c.task, c.family, c.axis) for c in programs[0].comms)
    assert kinds[("FWD", "all_gather", "cp")] == 2 * LAYERS + 1  # keys and values; the labels
    assert kinds[("BWD", "reduce_scatter", "cp")] == 2 * LAYERS  # their gradients


@pytest.mark.parametrize(
    "attention, strategy, mesh, more",
    [
        ("auto", "cp", "cp=2", ["--cp-layout", "contiguous"]),
        ("ring", "cp", "cp=2", ["--cp-layout", "contiguous"]),
        ("ring", "cp", "cp=2", []),
        ("ring", "pp,cp", "pp=2,cp=2", ["--layers", "2", "--microbatches", "2"]),
        ("all_gather", "cp", "cp=4", ["--cp-layout", "balanced"]),
    ],
)
def test_the_main_job_trains_under_cp_and_checks_against_one_device(
    capsys, corpus, tmp_path, attention, strategy, mesh, more
):
    """`shardflow train --strategy cp --check` in the contiguous layout and in the load-balanced one (the default for
    the causal main job), with a pipeline of 2 stages × cp = 2 and the ring (2 microbatches), on 2 and 4 devices:
    every step equal to one device's within the check's tolerance."""
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--run-dir", str(run), "--layers", "1", "--embd", "32", "--heads", "2"]
    argv += ["--seq-len", "16", "--batch-size", "4", "--steps", "2", "--eval-every", "2", "--eval-batches", "1"]
    argv += ["--cp-attention", attention, *more]
    assert main([*argv, "--strategy", strategy, "--nproc", "1", "--mesh", mesh, "--check"]) == 0
    out = capsys.readouterr().out
    assert "check against one device: " in out and out.rstrip().endswith("OK"), out


def test_cp_needs_a_sequence_dim():
    b = GraphBuilder()
    x = b.input("x", (8,))
    loss = b.sum(b.mul(x, x))
    graph = b.build([loss], loss)
    with pytest.raises(PlanError, match=r"no data input of the model has two dims \(its inputs: \['x'\]\)"):
        make_plan(graph, Mesh.parse("cp=2"), "cp")


# --- the all-to-all form (DeepSpeed-Ulysses) ------------------------------------------------------------------------


@pytest.mark.parametrize("mesh, strategy", [("cp=2", "cp"), ("dp=2,cp=2", "dp,cp")])
def test_all_to_all_attention_equals_eager(llama, mesh, strategy):
    """--cp-attention all_to_all on the Llama (4 query, 2 key/value heads): 2 SGD steps equal eager PyTorch's loss,
    gradients and every weight replica within TOL, float64."""
    model, b, graph = llama
    pcg = plan_pcg(graph, mesh, strategy, cp_attention="all_to_all")
    diffs = compare(model, b, graph, LocalExecutor(lower_step(pcg, SGD.slots), SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def test_all_to_all_moves_heads_and_back(llama):
    """Each attention reads q, k and v on its heads (an all-to-all each from the sequence) and gives its output back
    onto the sequence (one more): 4 all-to-alls over cp per layer more than the all-gather form in the forward and 4
    in the backward (the loss's moves are the same in both), and no key or value gathered."""
    _, _, graph = llama
    pcg = plan_pcg(graph, "cp=2", "cp", cp_attention="all_to_all")
    for n in (n for n in pcg.nodes if isinstance(n.op, O.Attention)):
        assert all(pcg.tensors[t].sharding.dims[1] == ("cp",) for t in n.inputs[:3])  # [B, H, T, D] on H
        assert all(pcg.tensors[t].sharding.dims[2] == () for t in n.inputs[:3])  # every position
    gathered = plan_pcg(graph, "cp=2", "cp", cp_attention="all_gather")
    a2a, ag = (
        Counter((c.task, c.family) for c in lower_step(p, SGD.slots).programs[0].comms if c.axis == "cp")
        for p in (pcg, gathered)
    )
    for task in ("FWD", "BWD"):
        assert a2a[(task, "all_to_all")] - ag[(task, "all_to_all")] == 4 * LAYERS
    assert ag[("FWD", "all_gather")] - a2a[("FWD", "all_gather")] == 2 * LAYERS  # the keys and values
    assert not [r for r in pcg.redistributions if isinstance(r.op, O.Attention)]


def test_auto_takes_the_form_that_sends_fewer_bytes():
    """Per attention, all-to-all sends 4 pieces of 1/cp, all-gather the rest of k and v: with as many key/value heads
    as query heads they tie at cp = 2 (all-gather kept) and all-to-all wins at cp = 4; heads cp does not divide keep
    the all-gather, and all_to_all asked for them is refused, naming the node, the heads and the fix."""
    b = GraphBuilder()
    q, k, v = (b.input(name, (2, 4, 16, 8)) for name in "qkv")
    (out,) = b.apply(O.Attention(causal=True), [q, k, v])
    graph = b.build([out])
    assert not make_plan(graph, Mesh.parse("cp=2"), "cp").modules  # a tie: all-gather
    assert list(make_plan(graph, Mesh.parse("cp=4"), "cp").modules) == [graph.nodes[0].name]
    gqa = GraphBuilder()
    q = gqa.input("q", (2, 4, 16, 8))
    k, v = (gqa.input(name, (2, 2, 16, 8)) for name in "kv")
    (out,) = gqa.apply(O.Attention(causal=True, gqa=True), [q, k, v])
    grouped = gqa.build([out])
    assert not make_plan(grouped, Mesh.parse("cp=4"), "cp").modules  # 2 key/value heads: cp=4 does not divide them
    with pytest.raises(
        PlanError, match=r"over cp=4, but it has 4 query and 2 key/value heads, which 4 does not divide"
    ):
        make_plan(grouped, Mesh.parse("cp=4"), "cp", cp_attention="all_to_all")


def test_cp_needs_attention():
    """A model whose data input has a sequence dim but no attention: nothing for cp to split, refused naming dp and
    fsdp."""
    b = GraphBuilder()
    x = b.input("x", (2, 8))
    loss = b.sum(b.mul(x, x))
    graph = b.build([loss], loss)
    with pytest.raises(
        PlanError, match=r"the model has no attention \(F.scaled_dot_product_attention\); split its batch"
    ):
        make_plan(graph, Mesh.parse("cp=2"), "cp")


# --- the ring form: keys and values around a ring of collective-permutes, outputs merged by log-sum-exp ------------

RING = dataclasses.replace(PLAIN, cp_attention=CPAttention.RING)


@pytest.mark.parametrize(
    "mesh, strategy, ac",
    [
        ("cp=2", "cp", "none"),
        ("cp=4", "cp", "none"),
        ("dp=2,cp=2", "dp,cp", "none"),
        ("cp=2,tp=2", "cp,tp", "none"),
        ("fsdp=2,cp=2", "fsdp,cp", "none"),
        ("cp=2", "cp", "block"),
        ("cp=2", "cp", "selective"),
    ],
)
def test_ring_attention_equals_eager(llama, mesh, strategy, ac):
    """--cp-attention ring: 2 SGD steps equal eager PyTorch's loss, gradients and every weight replica within TOL,
    float64, causal, alone and with dp, tp and fsdp, and under activation checkpointing (the backward a ring in
    every case: no key or value gradient reduce-scattered)."""
    model, b, graph = llama
    pcg = plan_pcg(graph, mesh, strategy, cp_attention="ring")
    options = dataclasses.replace(RING, ac=ActivationCheckpointing(ac))
    lowered = lower_step(pcg, SGD.slots, options=options)
    assert not [c for c in lowered.programs[0].comms if c.family == "reduce_scatter" and c.axis == "cp"]
    diffs = compare(model, b, graph, LocalExecutor(lowered, SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_passes_blocks_and_their_gradients_around(llama, cp):
    """Per layer and rank: the forward sends its key and value blocks to each other member (2·(cp − 1)
    collective-permutes of one block each) and attends cp key blocks, merging cp − 1 times; the backward sends them
    again and sends back the gradient shares of each block it received (4·(cp − 1)); no key or value is all-gathered
    and no gradient reduce-scattered over cp, and no rank holds the gathered keys or values. The verifier proves the
    ring's order (lower_step verifies)."""
    _, _, graph = llama
    pcg = plan_pcg(graph, f"cp={cp}", "cp", cp_attention="ring")
    gathered = plan_pcg(graph, f"cp={cp}", "cp", cp_attention="all_gather")
    ring, ag = (lower_step(p, SGD.slots, options=o).programs for p, o in ((pcg, RING), (gathered, PLAIN)))
    combines = {t for n in pcg.nodes if isinstance(n.op, O.Attention) for t in n.inputs[1:3]}  # k, v gathered
    block = pcg.tensors[next(iter(combines))].type.nbytes // cp
    for r in range(cp):
        kinds = Counter((c.task, c.family) for c in ring[r].comms if c.axis == "cp")
        before = Counter((c.task, c.family) for c in ag[r].comms if c.axis == "cp")
        assert kinds[("FWD", "permute")] == 2 * (cp - 1) * LAYERS
        assert kinds[("BWD", "permute")] == 4 * (cp - 1) * LAYERS
        assert before[("FWD", "all_gather")] - kinds[("FWD", "all_gather")] == 2 * LAYERS
        assert before[("BWD", "reduce_scatter")] - kinds[("BWD", "reduce_scatter")] == 2 * LAYERS
        assert {c.nbytes for c in ring[r].comms if c.family == "permute"} == {block}
        ops = Counter(i.op for i in ring[r].instrs if isinstance(i, Compute))
        assert ops["lse_merge"] == (cp - 1) * LAYERS
        assert sum(isinstance(i.kernel, BlockVjp) for i in ring[r].instrs if isinstance(i, Compute)) == cp * LAYERS
        held, held_ag = (
            {b.value for i in p[r].instrs if isinstance(i, Compute) for b in i.ins + i.outs} for p in (ring, ag)
        )
        whole = {f"fwd:{t}" for t in combines}
        assert whole <= held_ag and not held & whole, held & whole


def test_the_ring_without_overlap_waits_each_permute_where_it_is_issued(llama):
    """LowerOptions(overlap=False): the ring's collective-permutes, the same ones in the same order, each waited at
    its issue (nothing travels while a block computes); with overlap each is issued without waiting and waited once
    later, after a block's attention."""
    _, _, graph = llama
    pcg = plan_pcg(graph, "cp=2", "cp", cp_attention="ring")
    overlapped, serial = (
        lower_step(pcg, SGD.slots, options=dataclasses.replace(RING, overlap=o)).programs[0] for o in (True, False)
    )
    permutes = [[c for c in p.comms if c.family == "permute"] for p in (overlapped, serial)]
    assert [c.token for c in permutes[0]] == [c.token for c in permutes[1]] and permutes[0]
    assert not any(c.wait for c in permutes[0]) and all(c.wait for c in permutes[1])
    waits = {i.token for i in overlapped.instrs if isinstance(i, Wait)}
    assert {c.token for c in permutes[0]} <= waits
    assert not {c.token for c in permutes[1]} & {i.token for i in serial.instrs if isinstance(i, Wait)}


def _mistral_sliding():
    """Mistral with a sliding window of 4 over 8 tokens: its attention reads a mask of its own (no causal flag)."""
    import transformers

    cfg = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=4,
        use_cache=False,
    )
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    return transformers.MistralForCausalLM(cfg), {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("make, cp", [(zoo.qwen3, 2), (_mistral_sliding, 2), (_mistral_sliding, 4)])
def test_ring_attention_equals_eager_on_other_models_and_their_masks(make, cp):
    """Qwen3 (q/k norms, grouped-query) and Mistral's sliding window (a mask of the model's own, cut into each key
    block's columns) under --cp-attention ring: 2 SGD steps equal eager PyTorch's within TOL, float64."""
    torch.manual_seed(0)
    model, b = make()
    model = model.double()
    with wide_floats():
        graph = capture(model, b)
    pcg = plan_pcg(graph, f"cp={cp}", "cp", cp_attention="ring")
    diffs = compare(model, b, graph, LocalExecutor(lower_step(pcg, SGD.slots, options=RING), SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


# --- the load-balanced layout (--cp-layout balanced) ----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 8), chunk=st.integers(1, 6), segments=st.integers(1, 3))
def test_the_head_tail_order_gives_every_rank_equal_causal_work(cp, chunk, segments):
    """HeadTail: the storage order is a permutation of the positions; its runs are its consecutive positions; each
    rank's block (chunks r and 2·cp−1−r of every segment) holds positions whose causal work (keys attended: position
    + 1 each) is the same on every rank, where the last contiguous block's is (2·cp·b − b + 1)/(b + 1) times the
    first's for blocks of b positions (→ 2·cp − 1 for long blocks)."""
    h = HeadTail(0, 2 * cp, segments * 2 * cp * chunk, segments)
    order = h.order()
    assert sorted(order.tolist()) == list(range(h.length))
    for start in range(0, h.length, max(1, h.length // 7)):
        size = min(h.length - start, 3 * chunk + 1)
        runs = [torch.arange(pos, pos + n) for _, pos, n in h.runs(start, size)]
        assert torch.equal(torch.cat(runs), order[start : start + size])
    block = h.length // (segments * cp)
    within = order % (h.length // segments)  # the position within its sequence
    work = [int((within[r * block : (r + 1) * block] + 1).sum()) for r in range(segments * cp)]
    assert len(set(work)) == 1, work
    contiguous = [sum(range(r * block + 1, (r + 1) * block + 1)) for r in range(cp)]
    assert contiguous[-1] / contiguous[0] == (2 * cp * block - block + 1) / (block + 1)


@pytest.mark.parametrize("cp", [2, 4])
def test_under_the_balanced_layout_every_rank_makes_as_many_attention_calls(cp):
    """The all-gather form's attention of each rank's queries (chunks r and 2·cp−1−r, storage order) against the
    whole sequence's keys and values (gathered, in natural order), forward and backward, on the CPU's fused kernels: every rank calls the forward and the backward
    kernel as many times (cp + 2 and its backward: the keys before a chunk attended in pieces of two chunks,
    ops._key_parts) — before, rank 0's first chunk, with no key before it, made it one call short, 7 % faster than
    the others (docs/benchmarks.md#context-parallelism-the-load-balanced-layout). The output equals the causal
    attention's rows of those positions."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "flash_attention" in func.__name__:
                self.calls[func.__name__] += 1
            return func(*args, **(kwargs or {}))

    c, heads, d = 8, 2, 16
    layout = HeadTail(2, 2 * cp, 2 * cp * c)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, 2 * cp * c, d, dtype=torch.float64) for _ in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    stored = [layout.to_storage(x) for x in (q, whole)]
    counts = []
    for r in range(cp):
        mine = stored[0][..., 2 * r * c : 2 * (r + 1) * c, :].clone().requires_grad_()
        op = O.Attention(causal=True, start=2 * r * c, layout=layout)
        with Count() as counted:
            (out,) = op.compute(mine, k, v)
            out.sum().backward()
        torch.testing.assert_close(out, stored[1][..., 2 * r * c : 2 * (r + 1) * c, :])
        counts.append(dict(counted.calls))
    assert all(x == counts[0] for x in counts), counts
    assert sum(counts[0].values()) == 2 * (cp + 2), counts[0]


BALANCED = [
    ("cp=2", "cp", "all_gather", "none"),
    ("cp=4", "cp", "all_gather", "none"),
    ("cp=2", "cp", "ring", "none"),
    ("cp=4", "cp", "ring", "none"),
    ("dp=2,cp=2", "dp,cp", "all_gather", "none"),
    ("cp=2,tp=2", "cp,tp", "ring", "none"),
    ("fsdp=2,cp=2", "fsdp,cp", "ring", "none"),
    ("cp=2", "cp", "ring", "selective"),
    ("cp=2", "cp", "all_to_all", "none"),
    ("dp=2,cp=2", "dp,cp", "all_to_all", "none"),
]


@pytest.mark.parametrize("mesh, strategy, attention, ac", BALANCED)
def test_the_balanced_layout_equals_eager(llama, mesh, strategy, attention, ac):
    """--cp-layout balanced: 2 SGD steps equal eager PyTorch's loss, gradients and every weight replica within TOL
    (float64, causal), under the all-gather form, the ring and the all-to-all form (the heads keep contiguous blocks,
    the sequence reorders at each all-to-all), alone and with dp, tp, fsdp and selective checkpointing."""
    model, b, graph = llama
    pcg = plan_pcg(graph, mesh, strategy, cp_attention=attention, cp_layout="balanced")
    assert pcg.tensors["input_ids"].sharding.head_tail(pcg.tensors["input_ids"].group, (2, 8))
    options = dataclasses.replace(PLAIN, cp_attention=CPAttention(attention), ac=ActivationCheckpointing(ac))
    diffs = compare(model, b, graph, LocalExecutor(lower_step(pcg, SGD.slots, options=options), SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


@pytest.mark.parametrize(
    "make, cp, attention", [(zoo.qwen3, 2, "ring"), (_mistral_sliding, 2, "ring"), (_mistral_sliding, 4, "all_gather")]
)
def test_the_balanced_layout_equals_eager_on_other_models_and_their_masks(make, cp, attention):
    """Qwen3 and Mistral's sliding window (its own mask: the rows held in head-tail order, the columns read by
    position) under the balanced layout: 2 SGD steps equal eager PyTorch's within TOL, float64."""
    torch.manual_seed(0)
    model, b = make()
    model = model.double()
    with wide_floats():
        graph = capture(model, b)
    pcg = plan_pcg(graph, f"cp={cp}", "cp", cp_attention=attention, cp_layout="balanced")
    options = dataclasses.replace(PLAIN, cp_attention=CPAttention(attention))
    diffs = compare(model, b, graph, LocalExecutor(lower_step(pcg, SGD.slots, options=options), SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def test_the_balanced_layout_moves_what_the_contiguous_one_moves_and_reorders_where_the_sequence_is_whole(llama):
    """cp=2, all-gather form: the same communications in the same order with the same bytes as the contiguous
    layout; the keys' and values' all-gathers put the gathered sequence back in natural order (dim 2) and their
    gradients' reduce-scatters put it in head-tail order first; the loss's all-to-alls (labels and logits moved from
    the sequence onto the batch of 2 rows, which keeps contiguous blocks: 2 rows do not cut into 4 chunks) reorder
    the sequence they gather, and the gradient's the one it scatters; rank 0's queries are positions 0–1 and 6–7 of
    8 (chunks 0 and 3), rank 1's 2–5 (chunks 1 and 2)."""
    _, _, graph = llama
    balanced, contiguous = (
        lower_step(plan_pcg(graph, "cp=2", "cp", cp_attention="all_gather", cp_layout=x), SGD.slots).programs
        for x in ("balanced", "contiguous")
    )
    for r in (0, 1):
        assert [(c.kind, c.axis, c.nbytes) for c in balanced[r].comms] == [
            (c.kind, c.axis, c.nbytes) for c in contiguous[r].comms
        ]
        reorders = Counter(
            (c.task, c.kind, "natural" if c.to_natural else "head-tail", (c.to_natural or c.to_storage).dim)
            for c in balanced[r].comms
            if c.to_natural or c.to_storage
        )
        assert reorders == {
            ("FWD", "all_gather", "natural", 2): 2 * LAYERS,
            ("BWD", "reduce_scatter", "head-tail", 2): 2 * LAYERS,
            ("FWD", "all_to_all", "natural", 1): 2,  # the labels and the logits, onto the batch for the loss
            ("BWD", "all_to_all", "head-tail", 1): 1,  # the logits' gradient, back onto the sequence
        }, reorders
    pcg = plan_pcg(graph, "cp=2", "cp", cp_attention="all_gather", cp_layout="balanced")
    node = next(n for n in pcg.nodes if isinstance(n.op, O.Attention))
    runs = [pcg.local_of(node, r).op.runs(pcg.local_of(node, r).op.start, 4) for r in (0, 1)]
    assert runs == [[(0, 0, 2), (2, 6, 2)], [(0, 2, 2), (2, 4, 2)]]


def test_the_balanced_layout_refuses_a_sequence_it_cannot_cut(capsys):
    """A sequence length that 2·cp does not divide: one paragraph naming the input, the chunks and the fix, before
    any process starts."""
    argv = ["plan", "--model", "gpt", "--strategy", "cp", "--nproc", "4", "--seq-len", "12", "--cp-layout", "balanced"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "cuts the sequence into 2·cp = 8 chunks" in err and "has 12 positions along dim 1" in err, err
    assert "--cp-layout contiguous" in err and "Traceback" not in err, err


def test_the_layout_is_balanced_by_default_where_the_model_is_causal_and_the_sequence_cuts(llama, capsys):
    """--cp-layout auto (the default): balanced for a causal model whose sequence cuts into 2·cp chunks (the Llama's
    8 tokens at cp = 2 and 4), contiguous where it does not cut (cp = 8: 16 chunks) or an attention is not causal
    (Mistral's sliding window, a mask of its own); an explicit balanced layout refuses what auto leaves contiguous.
    `shardflow plan` says the layout on its first line."""
    assert main(["plan", "--model", "gpt", "--strategy", "cp", "--nproc", "2", "--seq-len", "16"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "mesh cp=2 (2 devices); sequences of 16 over cp in the load-balanced layout (4 chunks);" in first, first
    _, _, graph = llama
    for mesh, want in (("cp=2", Balance("cp", 8)), ("cp=4", Balance("cp", 8)), ("cp=8", None), ("dp=2", None)):
        assert cp_laid_out(Mesh.parse(mesh), "auto", graph).balanced == want, mesh
        assert cp_laid_out(Mesh.parse(mesh), "contiguous", graph).balanced is None
    with pytest.raises(PlanError, match="cuts the sequence into 2·cp = 16 chunks"):
        cp_laid_out(Mesh.parse("cp=8"), "balanced", graph)
    torch.manual_seed(0)
    model, b = _mistral_sliding()
    mistral = capture(model, b)
    assert cp_laid_out(Mesh.parse("cp=2"), "auto", mistral).balanced is None
    assert cp_laid_out(Mesh.parse("cp=2"), "balanced", mistral).balanced == Balance("cp", 8)
