"""The presets on models nobody here wrote: Hugging Face GPT-2 (q|k|v fused in ``c_attn``, ``Conv1D`` weights held
``[in, out]``) and Llama (grouped-query attention with 2 key/value heads, SwiGLU MLP), captured through
torch.export (tests/hf_worker.py builds them).

Numbers: dp=2, tp=2, sp on tp=2, dp=2×tp=2 and pp=2 on the local executor, tp=2 and dp=2 on 2 gloo processes —
the loss and every gradient of 2 SGD steps and every weight replica after them equal eager PyTorch. Tolerance
1e-9 at float64: a plan adds partial sums in another order than one device does (agreement to ~1e-15 relative),
while a misplaced block, a wrong scale or a head mixed up with another is an O(1) error.

Structure: what tp shards (q/k/v and the output projection, the MLP's pairs, the vocabulary of the embedding and the
head), the all-reduces per layer and those of the vocabulary-parallel loss, and that the presets need no
redistribution but the label count's under dp and the target logits' under tp.
"""

import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hf_worker import SGD, compare, model_and_graph, plan_pcg  # noqa: E402

from shardflow.capture import capture, wide_floats  # noqa: E402
from shardflow.graph import ops as O  # noqa: E402
from shardflow.lower import lower_step  # noqa: E402
from shardflow.parallel.mesh import Mesh, Replicate, Shard  # noqa: E402
from shardflow.parallel.pcg import build_pcg, lift  # noqa: E402
from shardflow.parallel.shape import DegreeError  # noqa: E402
from shardflow.parallel.simulate import simulate_outputs  # noqa: E402
from shardflow.reference import weights_of  # noqa: E402
from shardflow.runtime.launch import describe_failure, launch  # noqa: E402
from shardflow.runtime.local import LocalExecutor  # noqa: E402
from shardflow.strategy import ModulePlan, Plan, make_plan, resolve  # noqa: E402

TOL = 1e-9
LAYERS = 2


@pytest.fixture(scope="module")
def captured():
    """model name → (model, batch, graph), each captured once."""
    return {name: model_and_graph(name) for name in ("llama", "gpt2")}


def parallel_ops(pcg):
    return Counter(n.op.describe() for n in pcg.parallel_nodes)


# What vocabulary parallelism adds to tp (docs/concepts.md#vocabulary-parallel-embedding-and-loss), beyond the
# embedding's all-reduce: the loss's max and sum over the sharded classes (all-reduces of [N, 1]); its target logits,
# Partial(sum) pieces, pass the ignore mask as they are (`where(mask, x, 0)` is linear in x) and are summed with the
# loss, whose Partial value is reduced at the end: no redistribution.
LOSS_OPS = Counter({"ReductionOp(degree=2, axis=tp)": 2})
LOSS_REDISTRIBUTIONS: list = []


def redistributions(pcg):
    """(node, parallel ops) of each redistribution the rules asked for."""
    return [(r.node, [op.describe() for op in r.ops]) for r in pcg.redistributions]


@pytest.mark.parametrize(
    "mesh, strategy", [("dp=2", "dp"), ("tp=2", "tp"), ("tp=2", "sp"), ("dp=2,tp=2", "dp,tp"), ("pp=2", "pp")]
)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_strategies_equal_eager_pytorch(captured, name, mesh, strategy):
    model, b, graph = captured[name]
    ex = LocalExecutor(lower_step(plan_pcg(graph, mesh, strategy), SGD.slots), SGD)
    diffs = compare(model, b, graph, ex)
    assert all(d <= TOL for d in diffs.values()), diffs


def _layer(i):
    return f"model.layers.{i}"


def test_llama_tp_shards_attention_heads_and_the_swiglu_mlp(captured):
    _, _, graph = captured["llama"]
    pcg = plan_pcg(graph, "tp=2", "tp")
    t = pcg.tensors
    for i in range(LAYERS):
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert t[f"{_layer(i)}.{m}.weight"].placements == (Shard(0),), m  # column-parallel
        for m in ("self_attn.o_proj", "mlp.down_proj"):
            assert t[f"{_layer(i)}.{m}.weight"].placements == (Shard(1),), m  # row-parallel
        for m in ("input_layernorm", "post_attention_layernorm"):
            assert t[f"{_layer(i)}.{m}.weight"].placements == (Replicate(),)
    assert t["model.embed_tokens.weight"].placements == t["lm_head.weight"].placements == (Shard(0),)  # vocabulary
    # One all-reduce after each row-parallel linear (o_proj, down_proj): 2 per layer; the embedding's and the loss's.
    assert parallel_ops(pcg) == Counter({"ReductionOp(degree=2, axis=tp)": 2 * LAYERS + 1}) + LOSS_OPS
    assert redistributions(pcg) == LOSS_REDISTRIBUTIONS
    # Grouped-query attention: each device holds 1 of the 2 key/value heads and the 2 query heads that read it.
    attn = [n for n in pcg.nodes if isinstance(n.op, O.Attention)]
    assert len(attn) == LAYERS
    for n in attn:  # the key/value heads unrepeated (capture lifts Hugging Face's repeat_kv to GQA)
        assert n.op.gqa and n.op.causal and len(n.inputs) == 3
        q, k, v = (t[x] for x in n.inputs)
        assert q.type.shape == (2, 4, 8, 16) and k.type.shape == v.type.shape == (2, 2, 8, 16)
        assert q.pshape.shard == k.pshape.shard == v.pshape.shard == t[n.outputs[0]].pshape.shard == (1, 2, 1, 1)


@pytest.mark.parametrize("strategy", ["tp", "sp"])
def test_tp_splits_a_vocabulary_and_features_the_degree_does_not_divide(strategy):
    """Llama with a vocabulary of 97 tokens and an MLP of 91 features on tp=2: the presets place the
    vocabulary-parallel embedding and head and the column-/row-parallel MLP in uneven blocks (49 and 48 rows, 46 and
    45 features: DTensor's chunks, as its ``ColwiseParallel`` places them; docs/concepts.md#uneven-shards), the heads
    whole (4 query and 2 key/value heads divide); no redistribution beyond the loss's, and 2 SGD steps equal eager
    PyTorch over every replica."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=91,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, 97, (2, 8))
    b = {"input_ids": ids, "labels": ids}
    with wide_floats():
        graph = capture(model, b)
    pcg = plan_pcg(graph, "tp=2", strategy)
    t = pcg.tensors
    for w, piece in (
        ("model.embed_tokens.weight", (49, 32)),
        ("lm_head.weight", (49, 32)),
        ("model.layers.0.mlp.gate_proj.weight", (46, 32)),
        ("model.layers.0.mlp.down_proj.weight", (32, 46)),
    ):
        assert t[w].pshape.uneven and t[w].pshape.piece_shape == piece, (w, t[w].pshape)
    assert redistributions(pcg) == LOSS_REDISTRIBUTIONS
    diffs = compare(model, b, graph, LocalExecutor(lower_step(pcg, SGD.slots), SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def test_llama_tp_beyond_the_key_value_heads_is_an_error_naming_them(captured):
    _, _, graph = captured["llama"]
    with pytest.raises(
        DegreeError,
        match=r"degree 4 does not divide dim 2 of size 2.*model\.layers\.0\.self_attn.*"
        r"key/value heads",
    ):
        make_plan(graph, Mesh.parse("tp=4"), "tp")


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_tp_refuses_key_value_heads_it_cannot_split_rather_than_replicate_the_attention(family):
    """One key/value head on tp=2: the attention's heads cannot all split, and tp used to leave the attention
    replicated and split only the MLP, silently. Now a DegreeError names the attention, its key/value heads, the
    degree and the ways out (as docs/concepts.md promises); planned, no process started."""
    import torch
    import transformers

    from shardflow.capture import capture

    config = getattr(transformers, f"{family}Config")(
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=96,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    ids = torch.randint(0, 96, (2, 8))
    graph = capture(model, {"input_ids": ids, "labels": ids})
    with pytest.raises(DegreeError) as e:
        make_plan(graph, Mesh.parse("tp=2"), "tp")
    msg = str(e.value)
    for words in (
        "degree 2 does not divide dim 1 of size 1",
        "in module 'model.layers.0.self_attn'",
        "this one has 1 key/value head, which does not split 2 ways",
        "model.layers.0.self_attn.k_proj",
        "use tp=1 for this model",
        "a tp degree dividing its 1 key/value head",
    ):
        assert words in msg, (words, msg)


def test_gpt2_tp_shards_the_fused_qkv_by_heads(captured):
    _, _, graph = captured["gpt2"]
    pcg = plan_pcg(graph, "tp=2", "tp")
    t = pcg.tensors
    for i in range(LAYERS):
        h = f"transformer.h.{i}"
        # Conv1D holds its weight [in, out]: column-parallel shards dim 1, row-parallel dim 0.
        assert t[f"{h}.mlp.c_fc.weight"].placements == (Shard(1),)
        assert t[f"{h}.mlp.c_fc.bias"].placements == (Shard(0),)
        assert t[f"{h}.mlp.c_proj.weight"].placements == t[f"{h}.attn.c_proj.weight"].placements == (Shard(0),)
        assert t[f"{h}.attn.c_proj.bias"].placements == (Replicate(),)
        # c_attn [64, 192] = q|k|v (one FQN) is stored by parts, [64, 3, 64] and [3, 64], each part's features
        # sharded: q, k and v are each cut by heads, and every device holds half of the weight.
        w, b = f"{h}.attn.c_attn.weight", f"{h}.attn.c_attn.bias"
        assert graph.module_shapes[w] == (64, 192) and graph.module_shapes[b] == (192,)
        assert (
            t[w].type.shape == (64, 3, 64) and t[w].placements == (Shard(2),) and t[w].pshape.piece_shape == (64, 3, 32)
        )
        assert t[b].type.shape == (3, 64) and t[b].placements == (Shard(1),)
        parts = [n for n in pcg.nodes if isinstance(n.op, O.Linear) and n.scope == f"{h}.attn.c_attn"]
        assert len(parts) == 3
        for n in parts:
            assert t[n.inputs[0]].placements == (Replicate(),)
            assert t[n.inputs[1]].type.shape == (64, 64) and t[n.inputs[1]].placements == (Shard(1),)
            assert t[n.inputs[2]].placements == (Shard(0),)
            assert t[n.outputs[0]].placements == (Shard(1),)
    attn = [n for n in pcg.nodes if isinstance(n.op, O.Attention)]
    assert len(attn) == LAYERS
    assert all(t[x].pshape.shard == (1, 2, 1, 1) for n in attn for x in n.inputs[:3] + n.outputs)
    # 2 all-reduces per layer, the tied embedding's and the loss's: the parts of c_attn are split and viewed where
    # they are stored.
    assert t["transformer.wte.weight"].placements == (Shard(0),)
    assert parallel_ops(pcg) == Counter({"ReductionOp(degree=2, axis=tp)": 2 * LAYERS + 1}) + LOSS_OPS
    assert redistributions(pcg) == LOSS_REDISTRIBUTIONS


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tp_communicates_two_all_reduces_per_layer_each_way(captured, name):
    """Megatron's f and g per layer: forward, the row-parallel outputs; backward, the column groups' input gradients
    (GPT-2's c_attn, stored by parts, takes its q, k, v gradient parts where it holds them). Vocabulary parallelism
    adds, forward, the embedding's all-reduce and the loss's max and sum (all-reduces); backward, the head's input
    gradient and the gradient of the sum (all-reduces). The target logits stay Partial pieces up to the loss, whose
    value is all-reduced once the step ends (not a communication of the programs)."""
    _, _, graph = captured[name]
    programs = lower_step(plan_pcg(graph, "tp=2", "tp"), SGD.slots).programs
    kinds = Counter((c.task, c.family) for c in programs[0].comms)
    assert kinds == {("FWD", "all_reduce"): 2 * LAYERS + 3, ("BWD", "all_reduce"): 2 * LAYERS + 2}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sp_gathers_and_scatters_the_sequence_per_block(captured, name):
    _, _, graph = captured[name]
    ops = parallel_ops(plan_pcg(graph, "tp=2", "sp"))
    # Per layer 2 all-gathers (into attention and MLP) and 2 reduce-scatters (Reduction + Repartition); the
    # vocabulary-parallel embedding's output reduce-scattered onto the sequence (GPT-2's position embedding split
    # to match, locally), one Combine after the last block, and the loss's reductions.
    assert ops["CombineOp(dim=1, degree=2, axis=tp)"] == 2 * LAYERS + 1
    assert ops["ReductionOp(degree=2, axis=tp)"] == 2 * LAYERS + 1 + LOSS_OPS["ReductionOp(degree=2, axis=tp)"]
    assert ops["RepartitionOp(dim=1, degree=2, axis=tp)"] == 2 * LAYERS + 1 + (name == "gpt2")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("mesh, strategy", [("dp=2", "dp"), ("dp=2,tp=2", "dp,tp")])
def test_dp_needs_only_the_label_count(captured, name, mesh, strategy):
    """The loss is sum(token losses) / count(labels not ignored), both partial over the batch: the count (one
    scalar) is all-reduced. The causal mask the traced
    model builds is the attention's causal flag, no tensor."""
    _, _, graph = captured[name]
    pcg = plan_pcg(graph, mesh, strategy)
    *loss, r = pcg.redistributions
    assert [(x.node, [op.describe() for op in x.ops]) for x in loss] == (LOSS_REDISTRIBUTIONS if "tp" in mesh else [])
    assert r.node == pcg.graph.loss and pcg.tensors[r.tensor].type.shape == () and r.nbytes == 8
    assert all(n.op.causal and not n.op.mask for n in graph.nodes if isinstance(n.op, O.Attention))
    assert all(pcg.tensors[w].sharding.dims[0] != ("dp",) for w in graph.weights)


@pytest.mark.parametrize("name, prefix", [("llama", "model.layers"), ("gpt2", "transformer.h")])
def test_pp_puts_one_layer_on_each_stage(captured, name, prefix):
    _, _, graph = captured[name]
    pcg = plan_pcg(graph, "pp=2", "pp")
    stages = {}
    for n in pcg.nodes:
        if n.scope.startswith(prefix + "."):
            stages.setdefault(int(n.scope.split(".")[len(prefix.split("."))]), set()).add(dict(n.group.fixed)["pp"])
    assert stages == {0: {0}, 1: {1}}
    assert not pcg.parallel_nodes and pcg.redistributions == ()


# --- user plans naming modules by FQN, as parallelize_module does -------------------------------------------------
COLUMN = ModulePlan(params={"weight": {"tp": Shard(1)}, "bias": {"tp": Shard(0)}})  # Conv1D: weight [in, out]
ROW = ModulePlan(params={"weight": {"tp": Shard(0)}}, output={"tp": Replicate()})
GPT2_TP = Plan(
    modules={
        "transformer.wte": ModulePlan(params={"weight": {"tp": Shard(0)}}, output={"tp": Replicate()}),
        "transformer.h.*.attn.c_attn": COLUMN,
        "transformer.h.*.attn.c_proj": ROW,
        "transformer.h.*.mlp.c_fc": COLUMN,
        "transformer.h.*.mlp.c_proj": ROW,
    }
)


def test_user_plan_shards_the_fused_qkv_by_heads_as_the_preset_does(captured):
    """Column-parallel c_attn in a user plan places each of q, k and v by heads, not q|k|v cut in two blocks."""
    _, _, graph = captured["gpt2"]
    mesh = Mesh.parse("tp=2")
    mine = build_pcg(graph, mesh, resolve(GPT2_TP, graph, mesh))
    preset = plan_pcg(graph, "tp=2", "tp")
    assert {n: t.sharding for n, t in mine.tensors.items()} == {n: t.sharding for n, t in preset.tensors.items()}
    assert parallel_ops(mine) == parallel_ops(preset) and redistributions(mine) == LOSS_REDISTRIBUTIONS


def flat(graph):
    """``graph`` with no module scopes, as a graph built by hand without them."""
    return replace(graph, nodes=tuple(replace(n, scope="") for n in graph.nodes))


def test_user_plan_by_fqn_on_a_flat_graph(captured):
    """With no node scoped, a module is the nodes that read its parameters: the same plan places the same weights,
    reduces each row-parallel output once, and computes the single-device values."""
    model, b, graph = captured["gpt2"]
    g = flat(graph)
    mesh = Mesh.parse("tp=2")
    # Flat, the module transformer.wte is every node reading its tied weight, the head's linear too: its output
    # layout goes on the lookup by node name.
    plan = Plan(
        dict(GPT2_TP.modules)
        | {
            "transformer.wte": ModulePlan(params={"weight": {"tp": Shard(0)}}),
            "embedding": ModulePlan(output={"tp": Replicate()}),
        }
    )
    pcg = build_pcg(g, mesh, resolve(plan, g, mesh))
    preset = plan_pcg(graph, "tp=2", "tp")
    assert {w: pcg.tensors[w].sharding for w in g.weights} == {w: preset.tensors[w].sharding for w in g.weights}
    assert parallel_ops(pcg) == parallel_ops(preset) and redistributions(pcg) == LOSS_REDISTRIBUTIONS
    leaves = dict(weights_of(model, g), **b)
    want = simulate_outputs(lift(g), leaves)
    got = simulate_outputs(pcg, leaves)
    assert abs(got[g.loss].item() - want[g.loss].item()) <= TOL
    attn = [n for n in pcg.nodes if isinstance(n.op, O.Attention)]
    assert all(pcg.tensors[n.outputs[0]].pshape.shard == (1, 2, 1, 1) for n in attn)


def test_two_gloo_processes(tmp_path):
    """tp=2 and dp=2 of both models, one process per device."""
    cases = [f"{m}@{s}@{s}=2" for m in ("llama", "gpt2") for s in ("tp", "dp")]
    res = launch(
        [sys.executable, str(Path(__file__).with_name("hf_worker.py")), str(tmp_path), *cases],
        2,
        tmp_path / "logs",
        grace_s=30.0,
        echo_rank0=False,
    )
    assert res.ok, describe_failure(res, tmp_path / "logs")
    for r in range(2):
        results = json.loads((tmp_path / f"result{r}.json").read_text())
        assert sorted(results) == sorted(cases)
        for case, diffs in results.items():
            assert all(d <= TOL for d in diffs.values()), (r, case, diffs)


@pytest.fixture(scope="module")
def falcon():
    """Hugging Face Falcon (2 layers, hidden 64, 4 query heads and one key/value head: multi-query attention; its
    linears ``FalconLinear``, ``x @ W.T``), float64, its batch and its graph."""
    import torch
    import transformers
    from test_export_capture import batch

    from shardflow.capture import capture, wide_floats

    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(
        transformers.FalconConfig(
            vocab_size=96,
            hidden_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            multi_query=True,
            new_decoder_architecture=False,
            use_cache=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    ).double()
    b = batch()
    with wide_floats():
        return model, b, capture(model, b)


@pytest.mark.parametrize(
    "mesh, strategy", [("dp=2", "dp"), ("fsdp=2", "fsdp"), ("tp=2", "tp"), ("tp=2", "sp"), ("pp=2", "pp")]
)
def test_falcon_multi_query_equals_eager_pytorch(falcon, mesh, strategy):
    model, b, graph = falcon
    ex = LocalExecutor(lower_step(plan_pcg(graph, mesh, strategy), SGD.slots), SGD)
    diffs = compare(model, b, graph, ex)
    assert all(d <= TOL for d in diffs.values()), diffs


def test_falcon_tp_shards_its_x_at_w_transposed_mlp_like_llama(falcon):
    """``x @ W.T`` is a linear, so tp finds Falcon's MLP pair: dense_h_to_4h column-parallel, dense_4h_to_h
    row-parallel, one all-reduce per layer. The attention stays replicated: its q|k|v weight is one linear whose
    output is cut into 4 query heads and one key and one value head by a view and slices, not a Split (no part of
    it to shard by heads)."""
    _, _, graph = falcon
    pcg = plan_pcg(graph, "tp=2", "tp")
    t = pcg.tensors
    for i in range(LAYERS):
        layer = f"transformer.h.{i}"
        assert t[f"{layer}.mlp.dense_h_to_4h.weight"].placements == (Shard(0),)
        assert t[f"{layer}.mlp.dense_4h_to_h.weight"].placements == (Shard(1),)
        for m in ("self_attention.query_key_value", "self_attention.dense", "input_layernorm"):
            assert t[f"{layer}.{m}.weight"].placements == (Replicate(),), m
    assert parallel_ops(pcg) == Counter({"ReductionOp(degree=2, axis=tp)": LAYERS + 1}) + LOSS_OPS  # + the embedding's
    assert redistributions(pcg) == LOSS_REDISTRIBUTIONS
