"""Per-op placements (docs/search.md#per-op-placements): the placement program over the rule tables finds
Megatron's column→row pairs for wide weights and a small batch, data parallelism for a large batch, a mixed plan
where each op wins differently; its plans train to the same numbers as eager PyTorch (float64, every replica), and
their operand layouts round-trip through a plan file."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import shardflow
from shardflow.capture import capture, wide_floats
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh, Partial, Replicate, Shard
from shardflow.parallel.pcg import build_pcg
from shardflow.simulator.machine import MachineSpec
from shardflow.strategy.placements import Memory, PlacementError, placement, placements_plan, solve
from shardflow.strategy.plan import ModulePlan, Plan, PlanError, resolve

H100 = MachineSpec.named("h100")
# a device 10^7 times slower at computing, with no launch floor: even a tiny model's matmuls are worth splitting
SLOW = dataclasses.replace(
    H100,
    device=dataclasses.replace(
        H100.device,
        launch_s=0.0,
        peak_flops={k: v * 1e-7 for k, v in H100.device.peak_flops.items()},
        memory_bandwidth=H100.device.memory_bandwidth * 1e-7,
    ),
)
TOL = 1e-9
B, T = 4, 8


def gpt(vocab=16, width=32, layers=2, heads=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=T, n_layer=layers, n_head=heads, n_embd=width))


def tokens(vocab, batch, seq=T):
    gen = torch.Generator().manual_seed(1)
    return {
        "idx": torch.randint(0, vocab, (batch, seq), generator=gen),
        "targets": torch.randint(0, vocab, (batch, seq), generator=gen),
    }


def weights(graph, answer, suffix):
    """The placement on tp of every weight whose name ends with ``suffix``."""
    return {placement(s, "tp") for w, s in answer.leaves.items() if w.endswith(suffix)}


def test_wide_weights_and_a_small_batch_get_megatron_pairs():
    """Width 1024, 4 sequences of 16 on tp=4 of the h100 spec: q, k, v and c_fc column-parallel (Shard(0)), the
    projections row-parallel (Shard(1)) with a partial output, attention on the heads; the embedding and the loss
    (vocabulary 64) stay replicated — one all-reduce per attention and per MLP (Megatron-LM, Shoeybi et al. 2019)."""
    g = capture(gpt(vocab=64, width=1024, heads=8), tokens(64, 4, 16))
    answer = solve(g, "tp", 4, H100)
    for part in ("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.c_fc.weight"):
        assert weights(g, answer, part) == {Shard(0)}, part
    assert weights(g, answer, "attn.c_proj.weight") == weights(g, answer, "mlp.c_proj.weight") == {Shard(1)}
    assert weights(g, answer, "wte.weight") == weights(g, answer, "lm_head.weight") == {Replicate()}
    partial = [n.scope for n in g.nodes if answer.nodes[n.name].outputs and answer.nodes[n.name].outputs[0].partial]
    assert partial == [f"transformer.h.{i}.{m}.c_proj" for i in (0, 1) for m in ("attn", "mlp")]
    attention = [answer.nodes[n.name] for n in g.nodes if n.op.kind == "attention"]
    assert all(placement(c.inputs[0], "tp") == Shard(1) for c in attention)  # [B, heads, T, D] on the heads


def test_a_large_batch_gets_every_op_on_its_batch_shard():
    """Width 128, 256 sequences of 64 on tp=4: every matmul runs on its batch shard (Shard(0)) with the weights
    replicated — data parallelism, found op by op."""
    g = capture(gpt(vocab=64, width=128), tokens(64, 256, 64))
    answer = solve(g, "tp", 4, H100)
    matmuls = [answer.nodes[n.name] for n in g.nodes if n.op.kind in ("linear", "attention")]
    assert {placement(c.outputs[0], "tp") for c in matmuls} == {Shard(0)}
    assert {placement(s, "tp") for w, s in answer.leaves.items() if w in g.weights} == {Replicate()}


def test_a_mixed_plan_splits_attention_by_batch_and_the_mlp_by_features():
    """Width 1024, 32 sequences of 64 on tp=4 (AutoParallel's kind of finding): attention and its linears on batch
    shards (their weights stored sharded and gathered before use, FSDP-style), each MLP column→row with its partial
    output reduce-scattered onto the batch-sharded residual — a mix no preset makes."""
    g = capture(gpt(vocab=64, width=1024, heads=8), tokens(64, 32, 64))
    answer = solve(g, "tp", 4, H100)
    attention = [answer.nodes[n.name] for n in g.nodes if n.op.kind == "linear" and n.scope.endswith(".attn.q")]
    assert len(attention) == 2 and {placement(c.outputs[0], "tp") for c in attention} == {Shard(0)}
    assert {placement(c.inputs[1], "tp") for c in attention} == {Replicate()}  # read whole: gathered
    assert weights(g, answer, "mlp.c_fc.weight") == {Shard(0)} and weights(g, answer, "mlp.c_proj.weight") == {Shard(1)}
    residual = [answer.nodes[n.name] for n in g.nodes if n.op.kind == "binary" and n.scope.endswith(("h.0", "h.1"))]
    assert {placement(s, "tp") for c in residual for s in c.inputs} == {Shard(0)}


def test_placements_train_to_eager_numbers():
    """On a device slow enough that the program splits the tiny GPT's ops several ways (partial, replicated, sharded
    on three dims), two AdamW steps of the per-op plan on tp=4, dp=2×tp=2 and fsdp=2×tp=2 equal eager PyTorch's loss,
    gradients and weights on every replica of every piece (TOL, float64)."""
    for mesh in ("tp=4", "dp=2,tp=2", "fsdp=2,tp=2"):
        with wide_floats():
            model = gpt().double()
            batch = tokens(16, B)
            g = capture(model, batch)
            used = {placement(s, "tp") for c in solve(g, "tp", 2, SLOW).nodes.values() for s in c.outputs}
            assert used >= {Replicate(), Partial(), Shard(0), Shard(2)}, used
            trainer = shardflow.parallelize(
                model, batch, mesh=mesh, plan=placements_plan(g, Mesh.parse(mesh), SLOW), optimizer="adamw", lr=0.1
            )
            steps = list(trainer.compare_with_eager(model, batch, 2))
        assert all(s.dloss <= TOL and s.grad <= TOL and s.weight <= TOL for s in steps), (mesh, steps)


def test_operands_round_trip_and_name_nodes_only():
    """A per-op plan written as JSON and read back resolves to the same annotations, and plans the same PCG; operand
    layouts on a module, or of the wrong count, are PlanErrors naming the fix."""
    g = capture(gpt(vocab=64, width=1024, heads=8), tokens(64, 4, 16))
    mesh = Mesh.parse("tp=4")
    plan = placements_plan(g, mesh, H100)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert resolve(again, g, mesh) == resolve(plan, g, mesh)
    pcg = build_pcg(g, mesh, resolve(again, g, mesh))
    assert not pcg.redistributions  # every move is the plan's own
    linear = next(n for n in g.nodes if n.op.kind == "linear")
    with pytest.raises(
        PlanError, match="operands place the inputs of single nodes, but 'transformer.h.0.mlp' is a module"
    ):
        resolve(Plan({"transformer.h.0.mlp": ModulePlan(operands=({"tp": Replicate()},))}), g, mesh)
    with pytest.raises(PlanError, match="1 operand layouts for its 3 inputs .* give one per input"):
        resolve(Plan({linear.name: ModulePlan(operands=({"tp": Replicate()},))}), g, mesh)


def test_a_launch_bound_model_is_refused():
    """A model so small that splitting any matmul costs more than it saves: the program's answer would leave the
    axis's devices repeating each other, so it is refused (the search then keeps the presets)."""
    g = capture(gpt(vocab=16, width=32), tokens(16, 4))
    with pytest.raises(
        PlacementError, match="splits no matmul over 'tp': its 4 devices would repeat each other's work"
    ):
        solve(g, "tp", 4, H100)


def test_a_memory_cap_trades_seconds_for_bytes():
    """Memory levels 0 (uncapped), 0.5 and 1 (the fewest bytes any answer holds): the modeled bytes fall and the
    modeled seconds rise level by level, and at level 1 the weights are stored sharded where uncapped they are not."""
    g = capture(gpt(vocab=64, width=256), tokens(64, 512, 16))
    answers = [solve(g, "tp", 8, H100, memory=Memory(level=level)) for level in (0.0, 0.5, 1.0)]
    held = [a.memory_bytes for a in answers]
    seconds = [a.seconds for a in answers]
    assert held[0] > held[1] > held[2] and seconds[0] <= seconds[1] <= seconds[2], (held, seconds)
    sharded = [sum(placement(s, "tp") != Replicate() for w, s in a.leaves.items() if w in g.weights) for a in answers]
    assert sharded[0] < sharded[2], sharded
