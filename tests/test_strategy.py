"""Strategies: the plans they make for the GPT and MLP (exact parallel ops), their numbers on a simulated mesh
against the single-device graph, user plans in DTensor spelling, and the errors for plans that do not fit."""

from collections import Counter

import pytest
import torch

from shardflow.capture import capture
from shardflow.graph import GraphBuilder
from shardflow.graph.blocks import repeated_blocks
from shardflow.models import GPT, MLP, GPTConfig
from shardflow.parallel.mesh import Mesh, Replicate, Shard
from shardflow.parallel.ops import ReductionOp, ReplicateOp
from shardflow.parallel.pcg import build_pcg, lift
from shardflow.parallel.shape import DegreeError
from shardflow.parallel.simulate import simulate_outputs
from shardflow.reference import weights_of
from shardflow.strategy import ModulePlan, Plan, PlanError, make_plan, resolve
from shardflow.strategy.presets import block_costs, megatron_regions, stage_cuts

B, T = 4, 8


def gpt(n_layer=2, n_head=4, n_embd=32):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=n_embd)).double()
    idx = torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(2))
    graph = capture(model, {"idx": idx, "targets": tgt})
    return model, graph, dict(weights_of(model, graph), idx=idx, targets=tgt)


@pytest.fixture(scope="module")
def gpt2():
    return gpt()


def pcg_for(graph, mesh_text, strategy):
    mesh = Mesh.parse(mesh_text)
    return build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy), graph, mesh))


def parallel_ops(pcg):
    return Counter(n.op.describe() for n in pcg.parallel_nodes)


# Float64 throughout: the sharded run sums the same products in a different order (partial sums are added
# after the local matmuls), so results agree to rounding, ~1e-15 relative; 1e-10 leaves room and still
# catches any wrong scale or misplaced block (those are O(1) errors).
ATOL = 1e-10


@pytest.mark.parametrize(
    "mesh, strategy",
    [
        ("dp=2", "dp"),
        ("tp=2", "tp"),
        ("tp=4", "tp"),
        ("tp=2", "sp"),
        ("pp=2", "pp"),
        ("dp=2,tp=2", "dp,tp"),
        ("dp=2,tp=2", "dp,sp"),
        ("pp=2,tp=2", "pp,tp"),
        ("dp=2,pp=2", "dp,pp"),
    ],
)
def test_every_strategy_computes_the_single_device_values(gpt2, mesh, strategy):
    model, graph, leaves = gpt2
    want = simulate_outputs(lift(graph), leaves)
    got = simulate_outputs(pcg_for(graph, mesh, strategy), leaves)
    for name in graph.tensors:
        if want[name].is_floating_point():
            torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=0, msg=name)
    assert abs(got[graph.loss].item() - model(leaves["idx"], leaves["targets"]).item()) < ATOL


def test_megatron_finds_attention_and_mlp_pairs(gpt2):
    _, graph, _ = gpt2
    regions = megatron_regions(graph, 2)
    pairs = [(sorted(c.scope for c in cols), sorted(r.scope for r in rows)) for cols, rows in regions]
    assert pairs == [
        (
            ["transformer.h.0.attn.k", "transformer.h.0.attn.q", "transformer.h.0.attn.v"],
            ["transformer.h.0.attn.c_proj"],
        ),
        (["transformer.h.0.mlp.c_fc"], ["transformer.h.0.mlp.c_proj"]),
        (
            ["transformer.h.1.attn.k", "transformer.h.1.attn.q", "transformer.h.1.attn.v"],
            ["transformer.h.1.attn.c_proj"],
        ),
        (["transformer.h.1.mlp.c_fc"], ["transformer.h.1.mlp.c_proj"]),
    ]


def test_tp_plan_structure(gpt2):
    _, graph, _ = gpt2
    pcg = pcg_for(graph, "tp=2", "tp")
    # One all-reduce (Reduction) after each row-parallel linear (2 per block) and one after the vocabulary-parallel
    # embedding; the vocabulary-parallel loss reduces its max and its sum of exponentials; the target's logits stay
    # Partial pieces through the loss's ignore mask (where(mask, x, 0) is linear in x); nothing is redistributed.
    assert parallel_ops(pcg) == {"ReductionOp(degree=2, axis=tp)": 2 * 2 + 1 + 2}
    assert not pcg.redistributions
    t = pcg.tensors
    assert t["transformer.h.0.mlp.c_fc.weight"].placements == (Shard(0),)
    assert t["transformer.h.0.mlp.c_proj.weight"].placements == (Shard(1),)
    assert t["transformer.h.0.mlp.c_proj.bias"].placements == (Replicate(),)
    # the vocabulary (11 classes) in uneven blocks of 6 and 5 rows: embedding and head vocabulary-parallel
    for w in ("transformer.wte.weight", "lm_head.weight"):
        assert t[w].placements == (Shard(0),) and t[w].pshape.uneven
        assert t[w].pshape.piece_shape == (6, 32)
    # Heads are sharded through reshape/permute into attention: [B, H/2, T, D].
    attn = next(n for n in pcg.nodes if n.op.kind == "attention")
    assert t[attn.outputs[0]].pshape.shard == (1, 2, 1, 1)


def test_sp_plan_structure(gpt2):
    _, graph, _ = gpt2
    pcg = pcg_for(graph, "tp=2", "sp")
    ops = parallel_ops(pcg)
    # Per block: 2 all-gathers (before attention and MLP) and 2 reduce-scatters (Reduction + Repartition); the
    # vocabulary-parallel embedding's output is reduce-scattered onto the sequence (one more of each), and the head
    # all-gathers the sequence after the final norm (one Combine); the position embeddings [T, C] are split on their
    # sequence (a local Repartition); the loss reduces as under tp (its max and its sum).
    assert ops["CombineOp(dim=1, degree=2, axis=tp)"] == 2 * 2 + 1
    assert ops["ReductionOp(degree=2, axis=tp)"] == 2 * 2 + 1 + 2
    assert ops["RepartitionOp(dim=1, degree=2, axis=tp)"] == 2 * 2 + 1
    assert ops["RepartitionOp(dim=0, degree=2, axis=tp)"] == 1
    norms = [n for n in pcg.nodes if n.op.kind == "layer_norm" and n.scope.startswith("transformer.h.")]
    assert norms and all(pcg.tensors[n.outputs[0]].placements == (Shard(1),) for n in norms)


def test_dp_plan_shards_only_the_batch(gpt2):
    _, graph, _ = gpt2
    pcg = pcg_for(graph, "dp=4", "dp")
    # The loss is sum(token losses) / count(labels not ignored): both partial over the batch, and a division of
    # partials is not linear, so the count (one int64 scalar) is all-reduced; nothing else moves.
    count = [n for n in pcg.parallel_nodes]
    assert [n.op.describe() for n in count] == ["ReductionOp(degree=4, axis=dp)"]
    assert pcg.tensors[count[0].inputs[0]].type.shape == () and pcg.redistributions[0].node == pcg.graph.loss
    assert pcg.tensors["idx"].placements == (Shard(0),)
    assert all(pcg.tensors[w].placements == (Replicate(),) for w in graph.weights)
    from shardflow.parallel.mesh import Partial

    assert pcg.tensors[pcg.loss].placements == (Partial("sum"),)  # each rank's loss piece: sum/(global N)


def test_pp_puts_block_ranges_on_stages():
    _, graph, _ = gpt(n_layer=4)
    pcg = pcg_for(graph, "pp=2", "pp")
    stage = {n.name: dict(n.group.fixed)["pp"] for n in pcg.nodes}
    by_scope = {}
    for n in pcg.nodes:
        by_scope.setdefault(n.scope.split(".")[:3] and ".".join(n.scope.split(".")[:3]), set()).add(stage[n.name])
    assert by_scope["transformer.h.0"] == by_scope["transformer.h.1"] == {0}
    assert by_scope["transformer.h.2"] == by_scope["transformer.h.3"] == {1}
    assert by_scope["transformer.wte"] == {0} and by_scope["lm_head"] == {1}
    assert stage[graph.loss] == 1 and not pcg.parallel_nodes


def test_stage_cuts_minimise_the_largest_stage():
    """The linear partition: contiguous ranges of at least one block, the largest stage cost (the first stage also
    pays what runs before the blocks, the last what follows them) as small as it can be; the even split when it is
    as good."""
    assert stage_cuts([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert stage_cuts([1, 1, 1], 2) == [0, 0, 1]  # the even split, as good as [0, 1, 1]
    assert stage_cuts([1, 1, 1, 1], 2, after=3) == [0, 0, 0, 1]  # a heavy head: the last stage takes one block
    assert stage_cuts([5, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert stage_cuts([1, 1, 1, 1, 1, 1], 3, before=2) == [0, 1, 1, 2, 2, 2]  # loads 3, 2, 3 (even split: 4, 2, 2)
    with pytest.raises(PlanError, match="2 blocks cannot fill 3 stages"):
        stage_cuts([1, 1], 3)


def test_pp_balances_stages_by_flops():
    """An MLP whose last layer (16 → 4096) costs 256 times each of the three before it: the even split would give
    the last stage about 128 times the first's FLOPs; pp puts three layers on stage 0 and the wide one alone on
    stage 1."""
    torch.manual_seed(0)
    model = MLP(d_in=16, hidden=16, d_out=4096, n_layers=4)
    g = capture(model, {"x": torch.zeros(2, 16), "y": torch.zeros(2, dtype=torch.long)})
    costs, before, after = block_costs(g, repeated_blocks(g))
    # a step: 3 × the forward's 2·B·in·out FLOPs, plus 12 FLOPs of AdamW update per parameter (weight and bias)
    params = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    assert costs == [3 * 2 * 2 * 16 * n + 12 * p for n, p in zip([16, 16, 16, 4096], params)]
    assert before == after == 0
    pcg = pcg_for(g, "pp=2", "pp")
    stage = {n.scope: dict(n.group.fixed)["pp"] for n in pcg.nodes if n.scope.startswith("layers.")}
    assert stage == {"layers.0": 0, "layers.1": 0, "layers.2": 0, "layers.3": 1}


def test_repeated_blocks():
    _, graph, _ = gpt(n_layer=3)
    assert repeated_blocks(graph) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    torch.manual_seed(0)
    g = capture(
        MLP(d_in=4, hidden=8, d_out=3, n_layers=3), {"x": torch.zeros(2, 4), "y": torch.zeros(2, dtype=torch.long)}
    )
    assert repeated_blocks(g) == ["layers.0", "layers.1", "layers.2"]


def test_heads_not_divisible_by_tp_is_an_error_naming_module_dim_size_degree():
    _, graph, _ = gpt(n_head=3, n_embd=24)
    with pytest.raises(DegreeError) as e:
        pcg_for(graph, "tp=2", "tp")
    msg = str(e.value)
    assert "transformer.h.0.attn" in msg and "dim 2 of size 3" in msg and "degree 2" in msg


@pytest.mark.parametrize(
    "mesh, strategy, match",
    [
        ("dp=2", "tp", "mesh axis 'tp', which mesh dp=2 lacks"),
        ("dp=2,tp=2", "dp", r"axes \['tp'\].*used by no strategy"),
        ("pp=4", "pp", "needs at least 4 repeated blocks"),
        ("tp=2", "tp,sp", "sp already includes tp"),
        ("tp=2", "zp", "unknown strategy"),
    ],
)
def test_strategy_errors(gpt2, mesh, strategy, match):
    _, graph, _ = gpt2
    with pytest.raises(PlanError, match=match):
        pcg_for(graph, mesh, strategy)


def test_mlp_without_a_pair_has_no_tensor_parallelism():
    torch.manual_seed(0)
    g = capture(
        MLP(d_in=4, hidden=8, d_out=3, n_layers=1), {"x": torch.zeros(2, 4), "y": torch.zeros(2, dtype=torch.long)}
    )
    with pytest.raises(PlanError, match="no column-parallel/row-parallel pair"):
        make_plan(g, Mesh.parse("tp=2"), "tp")


# --- user plans in DTensor spelling ----------------------------------------------------------------------
def test_user_plan_equals_the_tp_preset(gpt2):
    _, graph, leaves = gpt2
    col = ModulePlan(params={"weight": [Shard(0)], "bias": [Shard(0)]})
    row = ModulePlan(params={"weight": [Shard(1)]}, output=[Replicate()])
    plan = Plan(
        modules={
            "transformer.h.*.attn.[qkv]": col,
            "transformer.h.*.attn.c_proj": row,
            "transformer.h.*.mlp.c_fc": col,
            "transformer.h.*.mlp.c_proj": row,
            # the vocabulary (11 rows, uneven on 2): a vocabulary-parallel embedding and head
            "transformer.wte": ModulePlan(params={"weight": [Shard(0)]}, output=[Replicate()]),
            "lm_head": ModulePlan(params={"weight": [Shard(0)]}, input=[Replicate()]),
        }
    )
    mesh = Mesh.parse("tp=2")
    mine = build_pcg(graph, mesh, resolve(plan, graph, mesh))
    preset = pcg_for(graph, "tp=2", "tp")
    assert {n: t.sharding for n, t in mine.tensors.items()} == {n: t.sharding for n, t in preset.tensors.items()}
    assert parallel_ops(mine) == parallel_ops(preset)


def test_user_plan_from_toml(tmp_path, gpt2):
    _, graph, leaves = gpt2
    f = tmp_path / "plan.toml"
    f.write_text("""
[inputs]
idx = {dp = "Shard(0)"}
targets = {dp = "Shard(0)"}
[modules."transformer.h.*.mlp.c_fc".params]
weight = {tp = "Shard(0)"}
bias = {tp = "Shard(0)"}
[modules."transformer.h.*.mlp.c_proj"]
params = {weight = {tp = "Shard(1)"}}
output = {tp = "R"}
""")
    mesh = Mesh.parse("dp=2,tp=2")
    pcg = build_pcg(graph, mesh, resolve(Plan.load(f), graph, mesh))
    # The MLPs' two all-reduces on tp, and the loss's label count on dp (see test_dp_plan_shards_only_the_batch).
    assert parallel_ops(pcg) == {"ReductionOp(degree=2, axis=tp)": 2, "ReductionOp(degree=2, axis=dp)": 1}
    assert pcg.tensors["transformer.h.1.mlp.c_fc.weight"].placements == (Replicate(), Shard(0))
    got = simulate_outputs(pcg, leaves)
    want = simulate_outputs(lift(graph), leaves)
    torch.testing.assert_close(got[graph.loss], want[graph.loss], atol=ATOL, rtol=0)


def test_user_plan_errors(gpt2):
    _, graph, _ = gpt2
    mesh = Mesh.parse("tp=2")
    with pytest.raises(PlanError, match="matches no module"):
        resolve(Plan(modules={"nope.*": ModulePlan(stage=0)}), graph, mesh)
    with pytest.raises(PlanError, match=r"does not have \(its parameters: \['weight'\]\)"):
        resolve(Plan(modules={"lm_head": ModulePlan(params={"bias": [Shard(0)]})}), graph, mesh)
    with pytest.raises(PlanError, match="not free axes"):
        resolve(Plan(modules={"lm_head": ModulePlan(params={"weight": {"dp": Shard(0)}})}), graph, mesh)
    with pytest.raises(PlanError, match="2 placements for the 1 axes"):
        resolve(Plan(modules={"lm_head": ModulePlan(params={"weight": [Shard(0), Shard(1)]})}), graph, mesh)
    with pytest.raises(PlanError, match="graph's inputs are"):
        resolve(Plan(inputs={"tokens": [Shard(0)]}), graph, mesh)


def test_user_pipeline_plan_with_node_names_and_explicit_parallel_ops():
    """Linear+ReLU on stage 0, Linear on stage 1, loss back on stage 0; then an explicit Replicate of the loss
    to both stages and an explicit Reduction, as a user may insert them."""
    b = GraphBuilder()
    x, y = b.input("x", (4, 6)), b.input("y", (4,), "int64")
    h = b.relu(b.dense(x, 8, name="fc1"))
    logits = b.dense(h, 3, name="fc2")
    loss = b.cross_entropy(logits, y)
    graph = b.build([loss], loss)
    mesh = Mesh.parse("pp=2")
    plan = Plan(
        modules={
            "fc1": ModulePlan(stage=0),
            "relu": ModulePlan(stage=0),
            "fc2": ModulePlan(stage=1),
            "loss": ModulePlan(stage=0),
        },
        ops={"loss": (ReplicateOp(2, "pp"),)},
    )
    pcg = build_pcg(graph, mesh, resolve(plan, graph, mesh))
    stage = {n.name: n.group.fixed for n in pcg.nodes if not n.is_parallel}
    assert stage == {"linear": (("pp", 0),), "relu": (("pp", 0),), "linear_1": (("pp", 1),), "loss": (("pp", 0),)}
    rep = pcg.parallel_nodes
    assert [n.op for n in rep] == [ReplicateOp(2, "pp")] and pcg.tensors[rep[0].outputs[0]].pshape.replica_degree == 2
    torch.manual_seed(0)
    leaves = {w: torch.randn(graph.tensors[w].shape, dtype=torch.float64) for w in graph.weights}
    leaves |= {"x": torch.randn(4, 6, dtype=torch.float64), "y": torch.tensor([0, 1, 2, 1])}
    got = simulate_outputs(pcg, leaves)
    torch.testing.assert_close(got["loss"], simulate_outputs(lift(graph), leaves)["loss"], atol=ATOL, rtol=0)

    # An explicit Reduction where nothing is partial is refused with the axis named.
    bad = Plan(ops={"linear": (ReductionOp(2, "tp"),)})
    with pytest.raises(Exception, match="no partial pieces along axis 'tp'"):
        m = Mesh.parse("tp=2")
        build_pcg(graph, m, resolve(bad, graph, m))
