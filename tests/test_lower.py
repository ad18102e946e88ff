"""Lowering: exact plan structure — copies, collectives, bytes, tokens — for small plans (no processes)."""

import dataclasses
import gc
from dataclasses import replace

import pytest
import torch

from shardflow.api import optimizer_config
from shardflow.capture import capture
from shardflow.graph import GraphBuilder
from shardflow.lower import LowerOptions, lower_programs, lower_step
from shardflow.lower.calibration import COST_KINDS, KindCost
from shardflow.lower.comm_lowering import comm_lowering, decide
from shardflow.lower.copy_insertion import copy_insertion
from shardflow.lower.cost import DEFAULT_BUCKET_BYTES
from shardflow.lower.dynamic import (
    OPTIMIZER_SLOTS,
    NodeKind,
    PassError,
    PassName,
    TaskType,
    UpdateRule,
    ValueRole,
    forward_id,
    grad_id,
    state_id,
)
from shardflow.lower.ordering import ordering
from shardflow.lower.pass_expansion import pass_expansion
from shardflow.lower.passes import PASSES, LowerContext, collector_paused, run_passes
from shardflow.lower.program import Comm, Compute, Free, Wait
from shardflow.lower.shard_expansion import axis_group_index, axis_members, shard_expansion, steps
from shardflow.parallel.mesh import Mesh, Replicate, Shard, SubMesh
from shardflow.parallel.ops import ReductionOp, ReplicateOp
from shardflow.parallel.pcg import Annotations, build_pcg
from shardflow.parallel.sharding import Sharding
from shardflow.strategy import ModulePlan, Plan, data_parallel, make_plan, resolve


def mlp(pre: bool = False, B=8, D=16, H=64, dtype: str = "float32"):
    """x [B, D] → (optionally tanh(x·2) so x's consumer needs a gradient) → fc1 [H] → gelu → fc2 [D] → loss; the
    input and every weight in ``dtype``."""
    b = GraphBuilder()
    x, y = b.input("x", (B, D), dtype), b.input("y", (B,), "int64")
    if pre:
        w = b.weight("scale", (D,), dtype)
        x = b.tanh(b.mul(x, w))
    h = b.gelu(b.dense(x, H, name="fc1"))
    loss = b.cross_entropy(b.dense(h, D, name="fc2"), y)
    return b.build([loss], loss)


MEGATRON = Plan(
    modules={
        "fc1": ModulePlan(params={"weight": [Shard(0)], "bias": [Shard(0)]}, input=[Replicate()]),
        "fc2": ModulePlan(params={"weight": [Shard(1)]}, output=[Replicate()]),
    }
)


def lowered(graph, mesh_text, plan, optimizer="sgd", options=None, verify=False):
    mesh = Mesh.parse(mesh_text)
    pcg = build_pcg(graph, mesh, resolve(plan, graph, mesh))
    return lower_step(pcg, optimizer, verify=verify, options=options)


def against_one_device(step, graph, steps=2, tol=1e-5):
    """Losses of ``steps`` SGD steps of ``step`` on the local executor, and every replica of every weight after them
    (``weight_error``), equal one device's (float32: partial sums are added in another order, ~1e-7 relative; a
    buffer overwritten while still read is off by O(1))."""
    import torch

    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.runtime.local import LocalExecutor

    gen = torch.Generator().manual_seed(0)
    weights = {w: torch.randn(graph.tensors[w].shape, generator=gen) for w in graph.weights}
    inputs = {
        n: torch.randint(0, 4, t.shape, generator=gen) if t.dtype == "int64" else torch.randn(t.shape, generator=gen)
        for n, t in ((n, graph.tensors[n]) for n in graph.inputs)
    }
    one = LocalExecutor(lower_step(build_pcg(graph, Mesh.parse("d=1")), "sgd"), OptimizerConfig("sgd", 0.1))
    many = LocalExecutor(step, OptimizerConfig("sgd", 0.1))
    one.load(weights)
    many.load(weights)
    for _ in range(steps):
        assert abs(one.step(inputs) - many.step(inputs)) < tol
    assert many.weight_error(one.weights()) < tol


def comms(programs, task=None):
    """Distinct communications (by token) as (pass, kind, members, shape)."""
    seen = {}
    for p in programs.values():
        for c in p.comms:
            if task is None or c.task == task:
                seen[c.token] = (c.task, c.family, c.members, c.type.shape)
    return [seen[t] for t in sorted(seen)]


def test_pipeline_mlp_has_exactly_four_copies():
    """Linear+ReLU on device 0, Linear on device 1, loss on device 0 (issue #3)."""
    b = GraphBuilder()
    x, y = b.input("x", (4, 6)), b.input("y", (4,), "int64")
    h = b.relu(b.dense(x, 8, name="fc1"))
    loss = b.cross_entropy(b.dense(h, 3, name="fc2"), y)
    graph = b.build([loss], loss)
    plan = Plan(
        modules={
            "fc1": ModulePlan(stage=0),
            "relu": ModulePlan(stage=0),
            "fc2": ModulePlan(stage=1),
            "loss": ModulePlan(stage=0),
        }
    )
    step = lowered(graph, "pp=2", plan)
    copies = [(n.task, n.inputs[0]) for n in step.dg.nodes if n.kind == "copy"]
    assert copies == [
        ("FWD", "fwd:relu"),
        ("FWD", "fwd:linear_1"),
        ("BWD", "grad:linear_1@loss"),
        ("BWD", "grad:relu@linear_1"),
    ]
    assert comms(step.programs) == [
        ("FWD", "p2p", (0, 1), (4, 8)),
        ("FWD", "p2p", (1, 0), (4, 3)),
        ("BWD", "p2p", (0, 1), (4, 3)),
        ("BWD", "p2p", (1, 0), (4, 8)),
    ]
    sends = {r: [(c.token, c.kind, c.peer, c.nbytes) for c in p.comms] for r, p in step.programs.items()}
    assert sends == {
        0: [(0, "send", 1, 128), (1, "recv", 1, 0), (2, "send", 1, 48), (3, "recv", 1, 0)],
        1: [(0, "recv", 0, 0), (1, "send", 0, 48), (2, "recv", 0, 0), (3, "send", 0, 128)],
    }


def test_megatron_mlp_input_without_gradient():
    step = lowered(mlp(pre=False), "tp=2", MEGATRON)
    # One all-reduce forward (fc2's partial output), none backward: x needs no gradient, the fc2 bias gradient
    # is replicated (its 1/2 scale undone), weight gradients are sharded like the weights.
    assert comms(step.programs) == [("FWD", "all_reduce", (0, 1), (8, 16))]


def test_megatron_mlp_input_with_gradient():
    step = lowered(mlp(pre=True), "tp=2", MEGATRON)
    # Backward adds exactly one all-reduce: the input gradient of the column-parallel fc1.
    assert comms(step.programs) == [("FWD", "all_reduce", (0, 1), (8, 16)), ("BWD", "all_reduce", (0, 1), (8, 16))]
    red = [n for n in step.dg.nodes if n.task == "BWD" and n.kind == "parallel"]
    assert [(n.op, n.inputs[0]) for n in red] == [(ReductionOp(2, "tp"), "grad:tanh@linear")]


@pytest.mark.parametrize("overlap", [True, False])
def test_backward_all_reduce_travels_while_the_weight_gradient_is_computed(overlap):
    """Megatron's overlap (LowerOptions.overlap, on by default): fc1's vjp (PCG node ``linear``) is split; its input
    gradient is computed, the all-reduce of it issued without waiting, and while it travels the backward computes
    what does not feed it — the weight and bias gradients of fc2 (``linear_1``) and of fc1, in that order —, then
    its Wait. The halves of fc1's vjp read the same inputs with complementary gradient masks. Off: one vjp per
    linear, a blocking all-reduce. Either way the step of one device (loss and every replica of every weight after
    2 SGD steps, float32: 1e-5)."""
    graph = mlp(pre=True)
    step = lowered(graph, "tp=2", MEGATRON, options=LowerOptions("collective", "collective", overlap=overlap))
    for p in step.programs.values():
        instrs = [i for i in p.instrs if not isinstance(i, Free)]
        (k,) = [j for j, i in enumerate(instrs) if isinstance(i, Comm) and i.task == "BWD"]
        comm = instrs[k]
        vjps = [
            (i.node, i.kernel.grad_mask) for i in instrs if isinstance(i, Compute) and i.op.startswith("vjp[linear")
        ]
        if not overlap:
            assert comm.wait and not any(isinstance(i, Wait) for i in instrs)
            assert vjps == [("linear_1", (True, True, True)), ("linear", (True, True, True))]
            continue
        w = instrs.index(Wait(comm.token))
        assert not comm.wait and [(i.node, i.kernel.grad_mask) for i in instrs[k + 1 : w]] == [
            ("linear_1", (False, True, True)),
            ("linear", (False, True, True)),
        ]
        dx, dw = instrs[k - 1], instrs[w - 1]
        assert (dx.node, dx.kernel.grad_mask) == ("linear", (True, False, False))
        assert dx.ins == dw.ins and [b.value for b in dx.outs] == [comm.send.value]
        assert [b.value for b in dw.outs] == ["grad:fc1.weight@linear", "grad:fc1.bias@linear"]
    against_one_device(step, graph)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "blocking"])
def test_forward_all_reduce_travels_while_the_forward_computes(overlap):
    """Cross-entropy's mean over the labels kept (``ignore_index``), captured, under dp=2: a partial sum of token
    losses divided by the count of kept labels, a partial sum (4 bytes) computed from the labels alone. With
    overlap the count is computed first, its all-reduce issued without waiting before the first linear, and waited
    right before the division; off, a blocking all-reduce right before it. One device's numbers either way."""
    import torch
    from torch import nn

    from shardflow.capture import capture

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)

    graph = capture(Net(), {"x": torch.randn(8, 16), "y": torch.randint(0, 4, (8,))})
    step = lowered(
        graph, "dp=2", data_parallel(graph), options=LowerOptions("collective", "collective", overlap=overlap)
    )
    for p in step.programs.values():
        instrs = [i for i in p.instrs if not isinstance(i, Free)]
        (k,) = [j for j, i in enumerate(instrs) if isinstance(i, Comm) and i.task == "FWD"]
        comm = instrs[k]
        assert comm.kind == "all_reduce" and comm.nbytes == 4
        ops = [i.op for i in instrs if isinstance(i, Compute)]
        end = instrs.index(Wait(comm.token)) if overlap else k
        assert instrs[end + 1].op == "div" and comm.recv.value in [b.value for b in instrs[end + 1].ins]
        first_linear = next(j for j, i in enumerate(instrs) if isinstance(i, Compute) and i.op.startswith("linear"))
        assert comm.wait is not overlap and (k < first_linear) is overlap, ops
    against_one_device(step, graph)


def test_predicted_timeline_draws_an_async_reduction_beside_the_computes():
    """--trace's predicted timeline of the overlapped Megatron MLP (the simulator's replay with measured computes):
    every compute measured at 1 ms, the all-reduce priced at 10 ms. The backward all-reduce starts when fc1's input
    gradient ends; the weight gradients start at that same moment, one after the other (beside it, not after it);
    the first compute after its Wait starts when it arrives."""
    from shardflow.simulator.estimate import chrome_events
    from shardflow.simulator.machine import Link, MachineSpec
    from shardflow.simulator.replay import replay

    step = lowered(mlp(pre=True), "tp=2", MEGATRON)
    link = Link("test", {k: KindCost(0.01, 1e15) for k in COST_KINDS})
    spec = dataclasses.replace(MachineSpec.named("h100"), intra=link, inter=link)
    computes = {r: [1e-3] * sum(isinstance(i, Compute) for i in p.instrs) for r, p in step.programs.items()}
    events = chrome_events(replay([step.programs], spec, events=True, measured=computes).events, pid=1000)
    for r in step.programs:
        mine = sorted((e for e in events if e["pid"] == 1000 + r), key=lambda e: (e["ts"], -e["tid"]))
        (k,) = [j for j, e in enumerate(mine) if "(async)" in e["name"]]
        comm, dw2, dw1, after = mine[k : k + 4]  # fc2's and fc1's weight gradients travel beside it (2 ms < 10 ms)
        assert mine[k - 1]["ts"] + mine[k - 1]["dur"] == pytest.approx(comm["ts"])
        assert comm["dur"] == pytest.approx(10_000, rel=1e-6)
        assert dw2["name"].startswith("BWD vjp[linear") and dw2["ts"] == pytest.approx(comm["ts"])
        assert dw1["ts"] == pytest.approx(comm["ts"] + 1000)
        assert after["tid"] == 0 and after["ts"] == pytest.approx(comm["ts"] + comm["dur"])


def test_data_parallel_syncs_each_weight_gradient_and_nothing_else():
    graph = mlp(pre=True)
    mesh = Mesh.parse("dp=4")
    step = lowered(graph, "dp=4", make_plan(graph, mesh, "dp"), options=LowerOptions(bucket_bytes=0))
    got = comms(step.programs)
    assert len(got) == len(graph.weights) == 5
    assert all(c[0] == "BWD" and c[1] == "all_reduce" and c[2] == (0, 1, 2, 3) for c in got)
    assert sorted(c[3] for c in got) == sorted(graph.tensors[w].shape for w in graph.weights)
    # Bytes per rank: 2(d-1)/d of each gradient, the all-reduce bound.
    p0 = step.programs[0]
    total = sum(graph.tensors[w].type.nbytes for w in graph.weights)
    assert p0.bytes_by_kind() == {("all_reduce", "dp"): 2 * total * 3 // 4}


def test_gradient_norm_without_clipping_is_one_scalar_all_reduce_after_the_updates():
    """``grad_norm=True`` without clipping (for metrics): the updates read no norm; after them each rank sums the
    squares of its gradient pieces and one scalar all-reduce over every device makes the norm whole; it outlives
    the step. Without it the step has neither."""
    graph = mlp(pre=True)
    mesh = Mesh.parse("dp=4")
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "dp"), graph, mesh))
    plain = lower_step(pcg, "sgd", options=LowerOptions(bucket_bytes=0))
    step = lower_step(pcg, "sgd", options=LowerOptions(bucket_bytes=0), grad_norm=True)
    assert plain.dg.grad_norm_sq == "" and step.dg.grad_norm_sq in step.dg.persistent()
    assert comms(step.programs) == comms(plain.programs) + [("UPD", "all_reduce", (0, 1, 2, 3), ())]
    assert all(len(n.inputs) == 2 for n in step.dg.nodes if n.kind == NodeKind.UPDATE)  # weight, gradient: no norm
    for p in step.programs.values():
        ops = [i.op for i in p.instrs if isinstance(i, Compute)]
        assert ops.index("sum_of_squares") > max(k for k, op in enumerate(ops) if op == "sgd_update")
        assert not any(isinstance(i, Free) and step.dg.grad_norm_sq in i.values for i in p.instrs)


def _bucket_plan(cap, optimizer="sgd"):
    graph = mlp(pre=True)
    mesh = Mesh.parse("dp=2")
    return graph, lowered(
        graph, "dp=2", make_plan(graph, mesh, "dp"), optimizer, options=LowerOptions(bucket_bytes=cap), verify=True
    )


def test_gradient_all_reduces_share_one_bucket():
    graph, step = _bucket_plan(LowerOptions().bucket_bytes)
    numel = sum(graph.tensors[w].type.numel for w in graph.weights)
    assert comms(step.programs) == [("BWD", "all_reduce", (0, 1), (numel,))]
    p0 = step.programs[0]
    (c,) = p0.comms
    assert not c.wait and p0.bytes_by_kind() == {("all_reduce", "dp"): 2 * 4 * numel // 2}
    instrs = [i for i in p0.instrs if not isinstance(i, Free)]
    ops = [i.op if isinstance(i, Compute) else type(i).__name__ for i in instrs]
    k = ops.index("Comm")
    # pack right before the all-reduce; its wait and the unpack right before the first update
    assert ops[k - 1 : k + 4] == ["pack", "Comm", "Wait", "unpack", "sgd_update"]
    assert {b.value for b in instrs[k + 2].outs} == {n.inputs[1] for n in step.dg.nodes if n.kind == "update"}


def test_gradient_buckets_close_at_the_cap_and_travel_during_the_backward():
    # backward order: fc2.weight (4096 B), fc2.bias (64 B), fc1.weight (4096 B), fc1.bias (256 B), scale (64 B)
    graph, step = _bucket_plan(4096 + 64)
    sizes = {w: graph.tensors[w].type.numel for w in graph.weights}
    # two full buckets; scale's gradient, alone in the last, is all-reduced as it is
    assert [c[3] for c in comms(step.programs)] == [
        (sizes["fc2.bias"] + sizes["fc2.weight"],),
        (sizes["fc1.bias"] + sizes["fc1.weight"],),
        (sizes["scale"],),
    ]
    p0 = step.programs[0]
    first = next(k for k, i in enumerate(p0.instrs) if isinstance(i, Comm))
    wait = next(k for k, i in enumerate(p0.instrs) if isinstance(i, Wait) and i.token == p0.instrs[first].token)
    between = [i for i in p0.instrs[first + 1 : wait] if isinstance(i, Compute) and i.task == "BWD" and i.dnode]
    # it travels while the next bucket's gradients are computed, and is waited for before that bucket is issued
    # (one bucket in flight: its packed gradients are freed at the wait,
    # docs/lowering.md#11-gradient-buckets-and-overlap-with-the-backward)
    assert [i.dnode for i in between] == ["BWD gelu", "BWD linear"]
    second = next(k for k, i in enumerate(p0.instrs) if isinstance(i, Comm) and k > first)
    assert wait < second and any(isinstance(i, Free) for i in p0.instrs[wait:second])


def test_gradient_buckets_give_the_same_step_as_one_all_reduce_per_gradient():
    import torch

    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.runtime.local import LocalExecutor

    graph = mlp(pre=True)
    torch.manual_seed(0)
    weights = {w: torch.randn(graph.tensors[w].shape) for w in graph.weights}
    inputs = {"x": torch.randn(8, 16), "y": torch.randint(0, 16, (8,))}
    results = []
    for cap in (0, 4096 + 64, LowerOptions().bucket_bytes):
        ex = LocalExecutor(_bucket_plan(cap, "adamw")[1], OptimizerConfig("adamw", lr=1e-2))
        ex.load(weights)
        losses = [ex.step(inputs) for _ in range(2)]
        results.append((losses, ex.weights()))
    for losses, w in results[1:]:
        assert losses == results[0][0]
        assert all(torch.equal(w[k], results[0][1][k]) for k in w)


@pytest.mark.parametrize(
    "src, dst, fwd, bwd",
    [
        (Shard(0), Replicate(), "all_gather", "split"),  # Combine: gather forward, split backward
        (Replicate(), Shard(0), "split", "all_gather"),  # Repartition: split forward, gather backward
        (Shard(0), Shard(1), "all_to_all", "all_to_all"),  # reshard between dims: all-to-all both ways
    ],
)
def test_parallel_ops_lower_per_table(src, dst, fwd, bwd):
    b = GraphBuilder()
    x = b.weight("x", (8, 4))
    loss = b.sum(b.tanh(x))
    g = b.build([loss], loss)
    mesh = Mesh.parse("tp=2")
    whole = SubMesh(mesh)
    ann = Annotations(leaves={"x": Sharding.from_placements([src], whole, 2)}, edges={("tanh", 0): {"tp": dst}})
    step = lower_step(build_pcg(g, mesh, ann), verify=False)
    kinds = {
        p: [s.kind for s in steps(step.dg) if s.nodes[0].task == p and s.nodes[0].kind == "parallel"]
        for p in ("FWD", "BWD")
    }
    assert kinds == {"FWD": [fwd], "BWD": [bwd]}


def test_reduction_lowers_to_all_reduce_or_fused_reduce_scatter():
    b = GraphBuilder()
    x, w = b.input("x", (8, 4)), b.weight("w", (6, 4))
    loss = b.sum(b.tanh(b.linear(x, w)))
    g = b.build([loss], loss)
    mesh = Mesh.parse("tp=2")
    for layout, kind in (([Replicate()], "all_reduce"), ([Shard(0)], "reduce_scatter")):
        # x and w sharded on the contracted dim → the linear's output is partial; tanh needs it whole.
        plan = Plan(inputs={"x": [Shard(1)]}, modules={"tanh": ModulePlan(input=layout)})
        ann = resolve(plan, g, mesh)
        ann = replace(ann, leaves={**ann.leaves, "w": Sharding(((), ("tp",)))})
        step = lower_step(build_pcg(g, mesh, ann), verify=False)
        fwd = [s.kind for s in steps(step.dg) if s.nodes[0].task == "FWD" and s.nodes[0].kind == "parallel"]
        assert fwd == [kind]
        # Backward of the Reduction: the gradient is replicated already → nothing to move.
        assert not [s for s in steps(step.dg) if s.nodes[0].task == "BWD" and s.kind == "all_reduce"]


def replicate_broadcast():
    """h = linear(x, w0) on stage 0, broadcast to both stages (Replicate on pp, root 0), consumed by a linear whose
    weight w1 is sharded on pp, then tanh and sum: (graph, its lowered step, unverified)."""
    b = GraphBuilder()
    x, w0, w1 = b.input("x", (4, 4)), b.weight("w0", (4, 4)), b.weight("w1", (6, 4))
    loss = b.sum(b.tanh(b.linear(b.linear(x, w0), w1)))
    g = b.build([loss], loss)
    mesh = Mesh.parse("pp=2")
    plan = Plan(
        modules={"linear": ModulePlan(stage=0), "linear_1": ModulePlan(stage=1)},
        ops={"linear": (ReplicateOp(2, "pp"),)},
    )
    ann = resolve(plan, g, mesh)
    whole = SubMesh(mesh)
    ann = replace(
        ann,
        groups={"linear": whole.with_fixed("pp", 0), "linear_1": whole, "tanh": whole, "sum": whole},
        leaves={**ann.leaves, "w1": Sharding((("pp",), ()))},
    )
    return g, lower_step(build_pcg(g, mesh, ann), verify=False)


def test_replicate_op_broadcasts_forward_and_reduces_backward():
    """h on stage 0, broadcast to both stages, consumed by a linear sharded on pp: the replicas' gradients are
    partial sums → reduce to the root. A replicated (redundant) consumer would need no reduce."""
    _, step = replicate_broadcast()
    got = comms(step.programs)
    assert [(c[0], c[1], c[2]) for c in got] == [("FWD", "broadcast", (0, 1)), ("BWD", "reduce", (0, 1))]
    bc = {r: next(c for c in p.comms if c.kind == "broadcast") for r, p in step.programs.items()}
    assert bc[0].root == 0 and bc[0].nbytes == 64 and bc[1].nbytes == 0


def test_identical_mappings_need_no_copy():
    graph = mlp()
    mesh = Mesh.parse("tp=2")
    pcg = build_pcg(graph, mesh, resolve(MEGATRON, graph, mesh))
    dg = copy_insertion(pass_expansion(pcg))
    assert not [n for n in dg.nodes if n.kind == "copy"]


def test_passes_check_their_order():
    graph = mlp()
    mesh = Mesh.parse("tp=2")
    pcg = build_pcg(graph, mesh, resolve(MEGATRON, graph, mesh))
    dg = copy_insertion(pass_expansion(pcg))
    with pytest.raises(PassError, match="already run"):
        copy_insertion(dg)


def test_every_pass_checks_its_preconditions():
    """Hole 3 of issue #11: lowering a pp=2 MLP without copy insertion gave programs in which rank 1 reads
    ``fwd:relu`` it never received; now every pass refuses a graph it cannot work on, naming what is missing."""
    import torch

    from shardflow.capture import capture
    from shardflow.models import MLP

    g = capture(
        MLP(d_in=8, hidden=8, d_out=4, n_layers=2), {"x": torch.zeros(4, 8), "y": torch.zeros(4, dtype=torch.long)}
    )
    mesh = Mesh.parse("pp=2")
    pcg = build_pcg(g, mesh, resolve(make_plan(g, mesh, "pp"), g, mesh))
    expanded = pass_expansion(pcg)
    with pytest.raises(PassError, match=r"pass 'schedule' needs \['copy_insertion'\] first"):
        lower_programs(expanded)
    with pytest.raises(PassError, match="reads 'fwd:relu', held by another sub-mesh; run copy insertion first"):
        shard_expansion(dataclasses.replace(expanded, done=expanded.done + (PassName.COPY_INSERTION,)))
    dg = copy_insertion(expanded)
    with pytest.raises(PassError, match=r"pass 'comm_lowering' needs \['shard_expansion'\] first"):
        comm_lowering(dg)
    sg = shard_expansion(dg)
    with pytest.raises(PassError, match="already run"):
        shard_expansion(sg)
    with pytest.raises(PassError, match=r"pass 'ordering' needs \['comm_lowering'\] first"):
        ordering(sg)
    with pytest.raises(PassError, match=r"pass 'verify' needs \['ordering'\] first"):
        PASSES[-1].run(comm_lowering(sg), LowerContext())
    partial = shard_expansion(dg, ranks=(1,))
    with pytest.raises(PassError, match="verify needs every rank's program"):
        PASSES[-1].run(ordering(comm_lowering(partial)), LowerContext())
    with pytest.raises(PassError, match=r"ranks \[2\] are not devices of mesh pp=2"):
        shard_expansion(dg, ranks=(2,))


def test_pass_log_names_every_pass_in_order_with_sizes():
    graph = mlp()
    mesh = Mesh.parse("tp=2")
    pcg = build_pcg(graph, mesh, resolve(MEGATRON, graph, mesh))
    step = lower_step(pcg)
    assert [r.name for r in step.passes] == [p.name for p in PASSES]
    assert all(r.seconds >= 0 for r in step.passes)
    assert step.passes[0].size == f"{len(step.dg.nodes)} nodes, {len(step.dg.values)} values"
    n = sum(len(p.instrs) - sum(isinstance(i, Free) for i in p.instrs) for p in step.programs.values())
    assert step.passes[-1].size.endswith(f"{n} instructions on 2 rank(s)")
    assert [r.name for r in lower_step(pcg, ranks=[0]).passes][-1] == PassName.ORDERING  # one rank: no proof


def test_axis_groups_arithmetic():
    mesh = Mesh.parse("dp=2,tp=3")
    g = SubMesh(mesh)
    assert axis_members(g, "tp", 4) == (3, 4, 5) and axis_members(g, "dp", 4) == (1, 4)
    assert [axis_group_index(g, "tp", d) for d in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [axis_group_index(g, "dp", d) for d in range(6)] == [0, 1, 2, 0, 1, 2]


def dp_tp_mlp_pcg():
    """The running example of docs/lowering.md: ``mlp(pre=True)`` with the batch on ``dp`` and Megatron on
    ``tp`` of a ``dp=2,tp=2`` mesh."""
    graph = mlp(pre=True)
    mesh = Mesh.parse("dp=2,tp=2")
    plan = data_parallel(graph).merge(
        Plan(
            modules={
                "fc1": ModulePlan(params={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}),
                "fc2": ModulePlan(params={"weight": {"tp": Shard(1)}}, output={"tp": Replicate()}),
            }
        )
    )
    return build_pcg(graph, mesh, resolve(plan, graph, mesh))


def test_per_rank_lowering_equals_the_global_one():
    dg = copy_insertion(pass_expansion(dp_tp_mlp_pcg()))
    everyone = lower_programs(dg)
    for r in range(4):
        assert lower_programs(dg, [r])[r] == everyone[r]
    # Tokens: dp all-reduces of the 2 replicated weights... each rank's tokens strictly increase.
    for p in everyone.values():
        tokens = [c.token for c in p.comms]
        assert tokens == sorted(set(tokens))


def test_golden_listing_of_a_small_program():
    step = lowered(mlp(B=2, D=4, H=8), "tp=2", MEGATRON)
    assert step.programs[1].listing().splitlines()[1:] == GOLDEN.strip("\n").splitlines()


GOLDEN = """
        FWD  fwd:linear:float32[2, 4] = linear(bias=True)(fwd:x:float32[2, 4], fwd:fc1.weight:float32[4, 4], fwd:fc1.bias:float32[4])
        FWD  fwd:gelu:float32[2, 4] = gelu(fwd:linear:float32[2, 4])
        FWD  fwd:linear_1:float32[2, 4] = linear(bias=True)(fwd:gelu:float32[2, 4], fwd:fc2.weight:float32[4, 4], fwd:fc2.bias:float32[4])
  #0    FWD  all_reduce group=[0, 1] axis=tp float32[2, 4] 32B send=fwd:linear_1:float32[2, 4] recv=fwd:linear_1.reduction:float32[2, 4]
        free fwd:linear_1
        FWD  fwd:loss:float32[] = cross_entropy(reduction='mean')(fwd:linear_1.reduction:float32[2, 4], fwd:y:int64[2])
        LOSS grad:loss@loss:float32[] = ones(fwd:loss:float32[])
        BWD  grad:linear_1.reduction@loss:float32[2, 4] = vjp[cross_entropy(reduction='mean')](fwd:linear_1.reduction:float32[2, 4], fwd:y:int64[2], grad:loss@loss:float32[])
        free fwd:linear_1.reduction, fwd:y, grad:loss@loss
        BWD  grad:gelu@linear_1:float32[2, 4], grad:fc2.weight@linear_1:float32[4, 4], grad:fc2.bias@linear_1:float32[4] = vjp[linear(bias=True)](fwd:gelu:float32[2, 4], fwd:fc2.weight:float32[4, 4], fwd:fc2.bias:float32[4], grad:linear_1.reduction@loss:float32[2, 4])
        free fwd:gelu, grad:linear_1.reduction@loss
        BWD  grad:linear@gelu:float32[2, 4] = vjp[gelu](fwd:linear:float32[2, 4], grad:gelu@linear_1:float32[2, 4])
        free fwd:linear, grad:gelu@linear_1
        BWD  grad:fc1.weight@linear:float32[4, 4], grad:fc1.bias@linear:float32[4] = vjp[linear(bias=True)](fwd:x:float32[2, 4], fwd:fc1.weight:float32[4, 4], fwd:fc1.bias:float32[4], grad:linear@gelu:float32[2, 4])
        free fwd:x, grad:linear@gelu
        UPD  upd:fwd:fc2.weight:float32[4, 4] = sgd_update(fwd:fc2.weight:float32[4, 4], grad:fc2.weight@linear_1:float32[4, 4])
        UPD  upd:fwd:fc2.bias:float32[4] = sgd_update(fwd:fc2.bias:float32[4], grad:fc2.bias@linear_1:float32[4])
        UPD  upd:fwd:fc1.weight:float32[4, 4] = sgd_update(fwd:fc1.weight:float32[4, 4], grad:fc1.weight@linear:float32[4, 4])
        UPD  upd:fwd:fc1.bias:float32[4] = sgd_update(fwd:fc1.bias:float32[4], grad:fc1.bias@linear:float32[4])
"""


# --- all-gather / reduce-scatter forms -------------------------------------------------------------------
def _sp_step(options, d=4, with_graph=False, matmul=False):
    """x [B=4, T=8, C=8] sharded on the sequence dim, all-gathered into a column-parallel linear (``matmul``: a
    product by the matrix w [8, 8] sharded on its columns) (and the graph, ``with_graph``)."""
    b = GraphBuilder()
    x = b.weight("x", (4, 8, 8))
    y = b.matmul(x, b.weight("w", (8, 8))) if matmul else b.dense(x, 8, name="fc")
    loss = b.sum(b.tanh(y))
    g = b.build([loss], loss)
    mesh = Mesh.parse(f"tp={d}")
    whole = SubMesh(mesh)
    weights = (
        {"w": Sharding.from_placements([Shard(1)], whole, 2)}
        if matmul
        else {
            "fc.weight": Sharding.from_placements([Shard(0)], whole, 2),
            "fc.bias": Sharding.from_placements([Shard(0)], whole, 1),
        }
    )
    ann = Annotations(
        leaves={"x": Sharding.from_placements([Shard(1)], whole, 3), **weights},
        edges={("matmul" if matmul else "linear", 0): {"tp": Replicate()}},
    )
    # x is a weight here: lowered as written, its gather kept for the backward (no resharding after the forward)
    step = lower_step(build_pcg(g, mesh, ann), options=replace(options, reshard_after_forward=False))  # verified
    return (step, g) if with_graph else step


def test_ring_all_gather_on_4_devices_has_3_steps_with_the_pinned_peers():
    from shardflow.lower import LowerOptions
    from shardflow.lower.buffer_reuse import in_place_product, ring_regions
    from shardflow.lower.comm_lowering import ring_peers
    from shardflow.lower.program import Compute
    from shardflow.runtime.vjp import hand_vjp

    step = _sp_step(LowerOptions("ring", "ring"))
    for r, prog in step.programs.items():
        fwd = [c for c in prog.comms if c.task == "FWD"]
        assert [c.kind for c in fwd] == ["permute"] * 3
        for i, c in enumerate(fwd, start=1):
            assert (c.peer, c.peer_from) == ((r - i) % 4, (r + i) % 4) == ring_peers(r, i, 4)
            assert c.send.value == "fwd:x" and c.recv.value == f"fwd:x.combine#{(r + i) % 4}"
        # The fused linear computes on its own chunk first, then on the chunk each step delivered, after
        # waiting for it — and the next step is already issued (overlap).
        fwd_instrs = [i for i in prog.instrs if getattr(i, "task", "FWD") == "FWD"]
        linears = [i for i in fwd_instrs if isinstance(i, Compute) and i.op.startswith("linear")]
        assert [i.ins[0].value for i in linears] == ["fwd:x"] + [f"fwd:x.combine#{(r + i) % 4}" for i in (1, 2, 3)]
        # each writes its output chunk into its block of one buffer (the executor's Receives), joined by no copy
        assert all(in_place_product(i) for i in linears)
        joined = {ring_regions(prog)[i.outs[0].value] for i in linears}
        assert {j for _, j in joined} == {0, 1, 2, 3} and len({k for k, _ in joined}) == 1
        kinds = [type(i).__name__ if not isinstance(i, Compute) else i.op.split("(")[0] for i in fwd_instrs]
        assert kinds[:9] == ["Comm", "linear", "Wait", "Comm", "linear", "Wait", "Comm", "linear", "Wait"]
        assert not any(isinstance(i, Comm) and i.wait for i in fwd_instrs[:7])
        # Its backward is the hand-written vjp on the assembled value (a linear's reads only its inputs): nothing
        # of the chunked forward is recomputed.
        vjps = [i for i in prog.instrs if isinstance(i, Compute) and i.task == "BWD" and i.op.startswith("vjp[linear")]
        assert vjps and all(
            hand_vjp(i.kernel.local.op, [b.type for b in i.ins]) is not None and i.ins[0].value == "fwd:x.combine"
            for i in vjps
        )


def test_ring_reduce_scatter_and_broadcast_loop_shapes():
    from shardflow.lower import LowerOptions

    step = _sp_step(LowerOptions("broadcast_loop", "ring"))
    p1 = step.programs[1]
    bcasts = [c for c in p1.comms if c.kind == "broadcast"]
    assert [c.root for c in bcasts] == [0, 1, 2, 3] and [c.nbytes > 0 for c in bcasts] == [False, True, False, False]
    # Backward of the all-gather: a reduce-scatter ring of 3 permute steps with local adds.
    bwd = [c for c in p1.comms if c.task == "BWD" and c.kind == "permute"]
    assert [(c.peer, c.peer_from) for c in bwd] == [(0, 2), (3, 3), (2, 0)]
    assert all(c.type.shape == (4, 2, 8) for c in bwd)


def test_ring_fuses_only_ops_that_contract_the_last_dim():
    """A ring all-gather fuses the readers of the gathered value that contract its last dim (linear, matmul:
    ``Op.contracts_last_dim``), chosen by the op's type, not its label; another reader (tanh) reads the
    concatenated value after the ring."""
    b = GraphBuilder()
    x = b.weight("x", (4, 8, 8))
    loss = b.add(b.sum(b.tanh(b.dense(x, 8, name="fc"))), b.sum(b.tanh(x)))
    mesh = Mesh.parse("tp=4")
    whole = SubMesh(mesh)
    ann = Annotations(
        leaves={
            "x": Sharding.from_placements([Shard(1)], whole, 3),
            "fc.weight": Sharding.from_placements([Shard(0)], whole, 2),
            "fc.bias": Sharding.from_placements([Shard(0)], whole, 1),
        },
        after={"x": {"tp": Replicate()}},
    )
    options = LowerOptions("ring", "ring", reshard_after_forward=False)  # x is a weight: its gather kept, as written
    sg, _ = run_passes(build_pcg(b.build([loss], loss), mesh, ann), LowerContext(options=options))
    ((gather, fused),) = decide(sg.dg, options, list(sg.steps)).fused.items()
    gathered = next(n for n in sg.dg.nodes if n.name == gather).outputs[0]
    readers = [n.name for n in sg.dg.nodes if gathered in n.inputs and n.task == TaskType.FWD]
    assert readers == ["FWD linear", "FWD tanh_1"] and [c.name for c in fused] == ["FWD linear"]


def test_value_ids_are_made_from_fields():
    """Value identity lives in the values' fields; lower/dynamic.py makes every id (nothing outside it formats
    or parses one): each PCG tensor's forward value, each weight's state slots and the updates' new versions."""
    dg = lowered(mlp(), "tp=2", MEGATRON, optimizer="adamw").dg
    for t in dg.pcg.tensors:
        v = dg.values[forward_id(t)]
        assert (v.tensor, v.role) == (t, ValueRole.FWD)
    w = "fc1.weight"
    state = [state_id(s, w) for s in OPTIMIZER_SLOTS[UpdateRule.ADAMW]]
    assert [(dg.values[s].role, dg.values[s].slot) for s in state] == [
        (ValueRole.OPT, "exp_avg"),
        (ValueRole.OPT, "exp_avg_sq"),
    ]
    assert set(state) <= set(dg.state_values())
    upd = next(n for n in dg.nodes if n.kind == NodeKind.UPDATE and n.src == w)
    assert [dg.values[o].replaces for o in upd.outputs] == [forward_id(w), *state]
    assert dg.backward_of["linear"].outputs == (grad_id("fc1.weight", "linear"), grad_id("fc1.bias", "linear"))
    assert dg.loss_values == (forward_id(dg.pcg.loss),) and dg.values[dg.loss_values[0]].tensor == dg.pcg.loss


def test_optimizer_update_rules():
    """(optimizer, momentum) → the update a step is lowered for, and so its state slots."""
    assert [UpdateRule.of(o, m) for o, m in (("sgd", 0.0), ("sgd", 0.9), ("adam", 0.0), ("adamw", 0.9))] == [
        UpdateRule.SGD,
        UpdateRule.SGD_MOMENTUM,
        UpdateRule.ADAMW,
        UpdateRule.ADAMW,
    ]  # Adam keeps AdamW's state
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'; use one of \['sgd', 'adam', 'adamw'\]"):
        optimizer_config("lion", None)  # refused where it is parsed: the lowering takes an UpdateRule


def test_cost_model_choices():
    """gloo (measured, docs/benchmarks.md (c)): its reduce-scatter moves all-reduce bytes, so the ring wins from a
    few hundred KiB; a ring step received into a kept buffer moves its chunk at ~1 GB/s against gloo's all-gather's
    ~0.6, so on 2 ranks (one step, one call either way) the ring wins too, while on 8 its 7 calls' latency loses at
    64 KiB. NCCL's collectives are the fast path."""
    from shardflow.lower import CostModel

    gloo = CostModel("gloo")
    assert gloo.choose_reduce_scatter(4 << 20, 4) == "ring" and gloo.choose_reduce_scatter(1 << 10, 4) == "collective"
    assert gloo.choose_all_gather(4 << 20, 2) == "ring" and gloo.choose_all_gather(64 << 10, 8) == "collective"
    assert CostModel("nccl").choose_all_gather(4 << 20, 8) == "collective"
    # Overridable: slower point-to-point keeps the collective.
    assert CostModel("gloo", bandwidth={"p2p": 0.5e9}).choose_all_gather(4 << 20, 2) == "collective"


def test_machine_view_override_moves_only_the_shard_that_changes_device():
    """relu on mesh[pp=0] (devices 0, 1 hold blocks 0, 1); tanh and sum use the view (0, 3): block 0 stays on
    device 0, block 1 moves 1 → 3 — one copy carrying only that block, forward and (gradient) backward."""
    import torch

    from shardflow.lower.program import Compute
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.runtime.local import LocalExecutor

    b = GraphBuilder()
    x = b.input("x", (4, 6), "float64")
    w = b.weight("w", (4, 6), "float64")
    loss = b.sum(b.tanh(b.relu(b.mul(x, w))))
    g = b.build([loss], loss)
    mesh = Mesh.parse("pp=2,tp=2")
    plan = Plan(
        inputs={"x": {"tp": Shard(0)}},
        modules={
            "mul": ModulePlan(stage=0),
            "relu": ModulePlan(stage=0),
            "tanh": ModulePlan(stage=0, devices=(0, 3)),
            "sum": ModulePlan(stage=0, devices=(0, 3)),
        },
    )
    pcg = build_pcg(g, mesh, resolve(plan, g, mesh))
    step = lower_step(pcg)  # verified
    copies = [n for n in step.dg.nodes if n.kind == "copy"]
    assert [(c.task, c.inputs[0]) for c in copies] == [("FWD", "fwd:relu"), ("BWD", "grad:relu@tanh")]
    sends = {r: [(c.kind, c.peer, c.type.shape) for c in p.comms if c.axis == "copy"] for r, p in step.programs.items()}
    # forward: block 1 goes 1 → 3; backward: its gradient comes back 3 → 1. Device 0 and 2 move nothing.
    assert sends == {
        0: [],
        1: [("send", 3, (2, 6)), ("recv", 3, (2, 6))],
        2: [],
        3: [("recv", 1, (2, 6)), ("send", 1, (2, 6))],
    }
    aliases = [i for i in step.programs[0].instrs if isinstance(i, Compute) and i.op == "alias"]
    assert len(aliases) == 2  # device 0 keeps block 0, forward and backward
    cfg = OptimizerConfig("sgd", 0.1)
    ex = LocalExecutor(step, cfg)
    torch.manual_seed(0)
    wv, xv = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    ex.load({"w": wv})
    loss_v = ex.step({"x": xv})
    wr = wv.clone().requires_grad_()
    want = torch.tanh(torch.relu(xv * wr)).sum()
    want.backward()
    assert abs(loss_v - want.item()) < 1e-12
    torch.testing.assert_close(ex.grads()["w"], wr.grad, atol=1e-12, rtol=0)


def test_parallel_ops_along_an_axis_of_one_device_communicate_nothing():
    graph = mlp(pre=True)
    tp2 = lowered(graph, "tp=2", MEGATRON)
    for mesh_text, plan in (("tp=1", MEGATRON), ("dp=1,tp=2", make_plan(graph, Mesh.parse("dp=1,tp=2"), "dp,tp"))):
        step = lowered(graph, mesh_text, plan, verify=True)
        ones = [c for c in comms(step.programs) if len(c[2]) == 1]
        assert ones == []
        aliases = [i for p in step.programs.values() for i in p.instrs if isinstance(i, Compute) and i.op == "alias"]
        assert aliases and all(
            step.dg.values[i.outs[0].value].type == step.dg.values[i.ins[0].value].type for i in aliases
        )
    assert comms(lowered(graph, "dp=1,tp=2", make_plan(graph, Mesh.parse("dp=1,tp=2"), "dp,tp")).programs) == comms(
        tp2.programs
    )


# --- self-contained programs: kernels and process groups -----------------------------------------------------
def test_computes_carry_their_kernels():
    """Every compute of a dynamic-graph node carries what its kernel needs — the rule's local op, the inputs a
    forward records gradients for, a backward's masks, an update's state slots and clip — and the data movements
    around communications carry none."""
    from shardflow.lower.program import Forward, OnesLike, SumOfSquares, Update, Vjp

    pcg = dp_tp_mlp_pcg()
    step = lower_step(pcg, "adamw", clip_norm=1.0)
    local = {n.name: n.local for n in pcg.nodes}
    for r, p in step.programs.items():
        computes = [i for i in p.instrs if isinstance(i, Compute)]
        assert {i.op for i in computes if i.kernel is None} == {"pack", "unpack"}  # the dp gradient buckets
        kernels = {i.dnode: i.kernel for i in computes if i.dnode}
        # x needs no gradient: mul(x, scale)'s forward records (and its backward makes) the gradient of scale only
        assert kernels["FWD mul"] == Forward(local["mul"], None, (False, True))
        assert kernels["BWD mul"] == Vjp(local["mul"], None, (False, True), (1.0, 1.0), (True,), ("float32",))
        assert kernels["FWD loss"] == Forward(local["loss"], None, (True, False))
        assert kernels["LOSS seed"] == OnesLike() and kernels["UPD grad-norm sumsq"] == SumOfSquares()
        assert {k: v for k, v in kernels.items() if k.startswith("UPD ") and k != "UPD grad-norm sumsq"} == {
            f"UPD {w}": Update(("exp_avg", "exp_avg_sq"), 1.0) for w in pcg.graph.weights
        }


def test_random_and_repartition_kernels_are_per_rank():
    """A Repartition of replicas keeps the rank's block; a dropout on the blocks draws at the rank's piece of the
    full tensor — the PCG's draw site — and its kernel, built from the instruction alone, draws those numbers."""
    import torch

    from shardflow.graph.rng import PieceSite
    from shardflow.lower.program import Block
    from shardflow.parallel.ops import RepartitionOp
    from shardflow.runtime.kernels import OptimizerConfig, make_kernel

    b = GraphBuilder()
    x, w = b.input("x", (4, 6), "float64"), b.weight("w", (4, 6), "float64")
    loss = b.sum(b.dropout(b.mul(x, w), 0.5))
    g = b.build([loss], loss)
    mesh = Mesh.parse("tp=2")
    pcg = build_pcg(g, mesh, resolve(Plan(ops={"mul": (RepartitionOp(0, 2, "tp"),)}), g, mesh))
    step = lower_step(pcg)
    node = next(n for n in pcg.nodes if not n.is_parallel and n.op.random)
    for r, p in step.programs.items():
        kernels = {i.op.split("(")[0]: i for i in p.instrs if isinstance(i, Compute) and i.task == "FWD"}
        assert kernels["RepartitionOp"].kernel == Block(0, 2, r)
        drop = kernels["dropout"]
        assert drop.kernel.draw == PieceSite(node.name, (4, 6), (2 * r, 0))
        assert drop.kernel.draw.at(7, 3) == pcg.draw_site(node, r, 7, 3)
        piece = torch.randn(2, 6, dtype=torch.float64)
        got = make_kernel(drop, OptimizerConfig(), lambda: 3, seed=7)([piece])
        torch.testing.assert_close(
            got[0], node.local.compute(piece, at=pcg.draw_site(node, r, 7, 3))[0], rtol=0, atol=0
        )


def test_programs_carry_their_process_groups():
    """Every program lists every group of the plan, in one first-use order: the mesh's axis groups (a pipeline
    stage's too) marked regular with their mesh and axis, any other member list (a machine view, a Replicate
    whose root a view puts outside its axis group) plain."""
    from dist_worker import replicate_outside_view

    from shardflow.lower.program import Group

    step = lower_step(dp_tp_mlp_pcg())
    mesh = step.dg.pcg.mesh
    want = (Group((0, 1), mesh, "tp"), Group((2, 3), mesh, "tp"), Group((0, 2), mesh, "dp"), Group((1, 3), mesh, "dp"))
    assert all(p.groups == want for p in step.programs.values())

    graph = mlp(pre=True)
    mesh = Mesh.parse("pp=2,tp=2")
    plan = Plan(
        modules={
            "fc1": ModulePlan(stage=0, params={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}),
            "gelu": ModulePlan(stage=0),
            "loss": ModulePlan(stage=1),
            "fc2": ModulePlan(stage=1, params={"weight": {"tp": Shard(1)}}, output={"tp": Replicate()}),
        }
    )
    stages = lower_step(build_pcg(graph, mesh, resolve(plan, graph, mesh)))
    assert stages.programs[0].groups == (Group((2, 3), mesh, "tp"), Group((0, 1), mesh, "tp"))

    _, pcg, _, _ = replicate_outside_view(partial=True)
    mesh = pcg.mesh
    groups = lower_step(pcg).programs[0].groups
    assert groups == (
        Group((3, 0, 2)),
        Group((1, 3), mesh, "pp"),
        Group((0, 1), mesh, "tp"),
        Group((2, 3), mesh, "tp"),
        Group((3, 1)),
    )
    assert lower_step(pcg, ranks=[2], verify=False).programs[2].groups == groups  # the same on every rank


class NoDerivative(torch.nn.Module):
    """A weight's product through an op torch's autograd cannot differentiate in its first input (the regularized
    incomplete gamma functions, which export keeps whole), in module ``step``."""

    def __init__(self, fn: str):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(4, 3, dtype=torch.float64) + 0.5)
        self.step = Step(fn)

    def forward(self, x):
        return self.step(x @ self.w).sum()


class Step(torch.nn.Module):
    def __init__(self, fn: str):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return getattr(torch, self.fn)(h, h)


@pytest.mark.parametrize("fn", ["igamma", "igammac"])
def test_an_op_without_derivative_is_refused_when_the_backward_is_planned(fn):
    """Refused while the backward is planned (lowering, before any step), in one paragraph naming the op, its
    module, the model's source line and the fix; at step 1 it was autograd's "the derivative for 'igamma: input' is
    not implemented" traceback. Without training nothing needs the derivative: the same graph lowers."""
    graph = capture(NoDerivative(fn), {"x": torch.rand(2, 4, dtype=torch.float64)})
    mesh = Mesh.parse("dp=2")
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "dp"), graph, mesh))
    where = rf"op '{fn}' \({fn}\) in module 'step' at .*/tests/test_lower\.py:\d+ \(return getattr\(torch, self\.fn\)"
    with pytest.raises(
        PassError,
        match=where + rf".*cannot differentiate it: the derivative for '{fn}: input' is not "
        r"implemented\. .*torch\.no_grad\(\)",
    ) as e:
        lower_step(pcg, "sgd")
    assert "\n" not in str(e.value)
    lower_step(pcg, "sgd", training=False)


@pytest.mark.parametrize("bucket_bytes", [DEFAULT_BUCKET_BYTES, 0])
def test_mesh_flatten_folds_two_all_reduces_into_one_over_both_axes(bucket_bytes):
    """dp,sp on dp=2 × tp=2 (docs/lowering.md#mesh-flatten): a norm weight's gradient and the squared gradient
    norm, Partial on dp and tp, are all-reduced once over the 4 devices (dp×tp) instead of over dp, then tp — the
    norm weights' in one bucket when bucketed — with 2(4−1)/4 of their bytes on the wire; the loss and every weight
    replica equal one device's (float64)."""
    from collections import Counter

    from conftest import tiny_hf_llama_float64

    from shardflow.parallel.collectives import CommKind, wire_bytes
    from shardflow.reference import weights_of
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.runtime.local import LocalExecutor

    model, batch, graph = tiny_hf_llama_float64()
    mesh = Mesh.parse("dp=2,tp=2")
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "dp,sp"), graph, mesh))
    options = LowerOptions(bucket_bytes=bucket_bytes)
    step = lower_step(pcg, "sgd", options=options, grad_norm=True, verify=True)
    norms = [w for w in graph.weights if w.endswith("norm.weight")]
    assert len(norms) == 5
    for r, prog in step.programs.items():
        flat = [c for c in prog.comms if c.axis == "dp×tp"]
        assert all(c.kind == CommKind.ALL_REDUCE and c.members == (0, 1, 2, 3) for c in flat)
        # per norm weight (or one bucket of the five) and the gradient norm's scalar
        assert len(flat) == (1 if bucket_bytes else len(norms)) + 1, (r, [c.note for c in flat])
        numel = sum(c.type.numel for c in flat)
        assert numel == sum(graph.tensors[w].type.numel for w in norms) + 1
        assert sum(c.nbytes for c in flat) == sum(wire_bytes(CommKind.ALL_REDUCE, c.type.nbytes, 4) for c in flat)
        # no norm weight's gradient is all-reduced over one axis alone any more
        kinds = Counter((c.axis, c.task) for c in prog.comms if c.kind == CommKind.ALL_REDUCE)
        assert ("tp", "UPD") not in kinds and ("dp", "UPD") not in kinds, kinds
    cfg = OptimizerConfig("sgd", 0.1)
    one = LocalExecutor(lower_step(build_pcg(graph, Mesh.parse("d=1")), "sgd", grad_norm=True), cfg)
    many = LocalExecutor(step, cfg)
    for ex in (one, many):
        ex.load(weights_of(model, graph))
    for _ in range(2):
        assert abs(one.step(batch) - many.step(batch)) < 1e-12
    assert abs(one.grad_norm - many.grad_norm) < 1e-12
    assert many.weight_error(one.weights()) < 1e-12


def test_the_collector_is_paused_within_a_lowering_and_resumed_after_also_on_an_error(monkeypatch):
    """:func:`collector_paused`: the cyclic collector is off inside (as each pass of a lowering sees it), on again
    after, also when the block raises; inside another such block it leaves the outer's pause alone."""
    from shardflow.lower import passes
    from shardflow.models import MLP

    seen = []
    spy = [dataclasses.replace(p, run=lambda g, c, run=p.run: seen.append(gc.isenabled()) or run(g, c)) for p in PASSES]
    monkeypatch.setattr(passes, "PASSES", tuple(spy))
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block does not resume what the outer paused
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("a pass failed")
    assert gc.isenabled()
    g = capture(
        MLP(d_in=8, hidden=8, d_out=4, n_layers=2), {"x": torch.zeros(4, 8), "y": torch.zeros(4, dtype=torch.long)}
    )
    mesh = Mesh.parse("dp=2")
    run_passes(build_pcg(g, mesh, resolve(make_plan(g, mesh, "dp"), g, mesh)), LowerContext())
    assert seen == [False] * len(PASSES) and gc.isenabled()
