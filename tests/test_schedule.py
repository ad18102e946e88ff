"""Pipeline schedules over microbatches (issue #17): the schedules' action orders, timelines and bubbles; the
lowered programs' exact transfer order per stage; equality with one device for GPipe and 1F1B, M ∈ {1, 2, 4, 8},
with dp and tp combined; activation memory of 1F1B against GPipe (local executor, no processes)."""

import functools

import pytest
import torch

from shardflow.capture import capture
from shardflow.graph.builder import GraphBuilder
from shardflow.lower import CostModel, LowerOptions, lower_step
from shardflow.lower.dynamic import NodeKind, PassError, TaskType, microbatch_id
from shardflow.lower.program import Comm, Compute, Vjp, Wait
from shardflow.lower.schedule import Action, Phase, Schedule, simulate
from shardflow.models import MLP
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import build_pcg
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.runtime.local import LocalExecutor
from shardflow.strategy import ModulePlan, Plan, make_plan, resolve

B = 8


def actions(text: str) -> tuple[Action, ...]:
    return tuple(Action(Phase(a[0]), int(a[1:])) for a in text.split())


def test_1f1b_warms_up_alternates_and_drains():
    """p=4, M=8: stage s runs p-1-s forwards, then one forward and one backward in turn, then the remaining
    backwards (PipeDream/Megatron-LM's 1F1B); GPipe runs every forward first."""
    s = Schedule("1f1b", 4, 8)
    assert s.actions(0) == actions("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7")
    assert s.actions(3) == actions("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7")
    assert Schedule("1f1b", 4, 2).actions(0) == actions("F0 F1 B0 B1")  # fewer microbatches than warm-up slots
    assert Schedule("gpipe", 4, 8).actions(2) == actions("F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7")
    assert [Schedule("1f1b", 4, 8).in_flight(s) for s in range(4)] == [4, 3, 2, 1]
    assert [Schedule("gpipe", 4, 8).in_flight(s) for s in range(4)] == [8] * 4


def test_interleaved_runs_chunks_in_groups_of_p_microbatches():
    """p=2, V=2, M=4 (Megatron-LM's interleaved 1F1B): forwards of chunk 0 for microbatches 0-1, chunk 1 for the
    same, then the next two; stage 0 warms up with (p-1-s)·2 + (V-1)·p = 4 forwards, stage 1 with 2; backwards visit
    the chunks in reverse."""
    s = Schedule("interleaved", 2, 4, 2)
    assert (
        " ".join(map(str, s.actions(0)))
        == "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    )
    assert (
        " ".join(map(str, s.actions(1)))
        == "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
    )
    assert s.virtual_stage(1, Action(Phase.F, 0, 1)) == 3 and s.bubble == pytest.approx(1 / 9)
    with pytest.raises(ValueError, match="do not split over 2 stages; give a multiple of 2"):
        Schedule("interleaved", 2, 3, 2)
    with pytest.raises(ValueError, match="give --schedule interleaved with --stages-per-rank ≥ 2, or neither"):
        Schedule("1f1b", 2, 4, 2)


@pytest.mark.parametrize("kind, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 8), (3, 6)])
def test_unit_time_bubble_is_the_formula(kind, v, p, m):
    """With every chunk's forward and backward one tick each, every schedule takes 2(V·m+p-1) ticks: each stage is
    idle 2(p-1) of them, the bubble (p-1)/(V·m+p-1) — V times smaller than 1F1B's under the interleaved
    schedule."""
    s = Schedule(kind, p, m, v)
    ticks = s.ticks()
    assert len(ticks) == 2 * (v * m + p - 1)
    for stage in range(p):
        idle = sum(stage not in t for t in ticks)
        assert idle / len(ticks) == pytest.approx(s.bubble) == pytest.approx((p - 1) / (v * m + p - 1))


def test_timeline_draws_each_stage():
    text = Schedule("1f1b", 2, 3).timeline()
    assert text.splitlines() == [
        "pipeline schedule 1f1b: 2 stages, 3 microbatches, 8 ticks; bubble (p-1)/(m+p-1) = 0.250",
        "  stage 0 | F0 F1 .  B0 F2 B1 .  B2   (at most 2 microbatch(es) in flight)",
        "  stage 1 | .  F0 B0 F1 B1 F2 B2 .   (at most 1 microbatch(es) in flight)",
    ]


def test_a_cycle_is_refused_naming_the_stuck_stages():
    f0, b0 = Action(Phase.F, 0), Action(Phase.B, 0)
    with pytest.raises(
        PassError,
        match=r"deadlocks: stage 0 at F0 waits for B0 of stage 1; stage 1 at B0 waits "
        r"for F0 of stage 0",
    ):
        simulate({0: [f0], 1: [b0]}, {(0, f0): [(1, b0)], (1, b0): [(0, f0)]})
    with pytest.raises(ValueError, match=r"schedule must be one of \['gpipe', '1f1b', 'interleaved'\], got 'zb'"):
        LowerOptions.parse(cost=CostModel(), schedule="zb")  # refused where it is parsed, before any Schedule


@functools.cache  # captured once per batch size; the tests read the model's weights and plan the graph, never change them
def model_and_graph(rows: int):
    torch.manual_seed(0)
    model = MLP(d_in=16, hidden=32, d_out=8, n_layers=4)
    batch = {"x": torch.zeros(rows, 16), "y": torch.zeros(rows, dtype=torch.long)}
    return model, capture(model, batch)


def lowered(mesh_text: str, strategy: str, m: int, kind: str = "1f1b", optimizer: str = "adamw", v: int = 1, **kw):
    """The MLP's step on a microbatch of B/m rows, m microbatches in ``kind``'s order (``v`` chunks per stage),
    lowered and proven."""
    _, graph = model_and_graph(B // m)
    mesh = Mesh.parse(mesh_text)
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy, v), graph, mesh))
    return lower_step(pcg, optimizer, options=LowerOptions(microbatches=m, schedule=kind), **kw)


def transfers(step, rank: int) -> list[tuple[str, str, str]]:
    return [(c.kind, str(c.task), c.value) for c in step.programs[rank].comms]


def test_1f1b_programs_transfer_in_the_schedules_order():
    """pp=2, M=4, 1F1B: stage 0 sends F0's and F1's activations (warm-up), then receives each backward's gradient
    between its forwards; stage 1 mirrors it. Every transfer is issued without waiting; each receive is waited
    right before its first reader, and stage 1 receives a microbatch's activation while it still computes the
    one before, and sends each backward's gradient before computing its weight gradients. The weights are updated
    once, after every microbatch."""
    plain = lowered("pp=2", "pp", 1)
    step = lowered("pp=2", "pp", 4)
    (act, _), (grad, _) = [(c.value, c.kind) for c in plain.programs[0].comms]
    want0 = [
        ("send", "FWD", 0),
        ("send", "FWD", 1),
        ("recv", "BWD", 0),
        ("send", "FWD", 2),
        ("recv", "BWD", 1),
        ("send", "FWD", 3),
        ("recv", "BWD", 2),
        ("recv", "BWD", 3),
    ]
    assert transfers(step, 0) == [(k, p, microbatch_id(act if p == "FWD" else grad, m)) for k, p, m in want0]
    flip = {"send": "recv", "recv": "send"}
    assert transfers(step, 1) == [(flip[k], p, v) for k, p, v in transfers(step, 0)]
    for r, prog in step.programs.items():
        instrs = list(prog.instrs)
        issued = {i.token: k for k, i in enumerate(instrs) if isinstance(i, Comm)}
        waited = {i.token: k for k, i in enumerate(instrs) if isinstance(i, Wait)}
        assert all(not c.wait for c in prog.comms) and set(waited) == set(issued)
        for c in prog.comms:
            if c.kind == "recv":
                reader = next(
                    k
                    for k, i in enumerate(instrs)
                    if isinstance(i, Compute) and c.recv.value in {b.value for b in i.ins}
                )
                assert waited[c.token] < reader and all(isinstance(i, Wait) for i in instrs[waited[c.token] : reader])
    rank1 = list(step.programs[1].instrs)
    recv_f1 = next(k for k, i in enumerate(rank1) if isinstance(i, Comm) and i.value == microbatch_id(act, 1))
    wait_f1 = next(k for k, i in enumerate(rank1) if isinstance(i, Wait) and i.token == rank1[recv_f1].token)
    assert any(isinstance(i, Compute) and i.micro == 0 for i in rank1[recv_f1:wait_f1])  # F1 travels during F0/B0
    send_b0 = next(k for k, i in enumerate(rank1) if isinstance(i, Comm) and i.value == microbatch_id(grad, 0))
    wait_b0 = next(k for k, i in enumerate(rank1) if isinstance(i, Wait) and i.token == rank1[send_b0].token)
    weight_grads = [i for i in rank1[send_b0:wait_b0] if isinstance(i, Compute) and isinstance(i.kernel, Vjp)]
    assert weight_grads and all(i.micro == 0 for i in weight_grads)  # B0's weight gradients after its send
    updates = [n for n in step.dg.nodes if n.kind == NodeKind.UPDATE]
    assert len(updates) == len(plain.dg.pcg.graph.weights) and step.dg.nodes[-len(updates) :] == tuple(updates)


def test_weight_gradients_are_reduced_once_per_step():
    """pp=2,dp=2, M=4: the data-parallel all-reduces of the weights' gradients are those of one step of one
    microbatch (same count, same bytes), issued in the last microbatch's backward; the 4 seeds are 1/4 each. (Each
    microbatch's loss, a mean over its rows, is all-reduced over dp in its forward.)"""
    plain, step = lowered("pp=2,dp=2", "pp,dp", 1), lowered("pp=2,dp=2", "pp,dp", 4)

    def reductions(s):
        return sorted(
            (c.kind, c.type.shape)
            for p in s.programs.values()
            for c in p.comms
            if c.kind == "all_reduce" and c.task == TaskType.BWD
        )

    assert reductions(step) == reductions(plain) and reductions(plain)
    seeds = [n for n in step.dg.nodes if n.kind == NodeKind.SEED]
    assert sorted(n.micro for n in seeds) == [0, 1, 2, 3] and {n.scale for n in seeds} == {0.25}
    grads = {n.name: n for n in step.dg.nodes if n.task == TaskType.BWD and n.kind == NodeKind.PARALLEL}
    assert grads and {n.micro for n in grads.values()} == {3}


def run_against_one_device(step, steps: int = 3, tol: float = 1e-5):
    """``steps`` AdamW steps of ``step`` (local executor) against one device on the whole batch of B: the loss of
    each step, the gradient norm, every piece of every gradient the updates used and, at the end, every replica of
    every weight piece."""
    model, whole = model_and_graph(B)
    opt = OptimizerConfig("adamw", lr=1e-2)
    weights = {w: p.detach().clone() for w, p in model.named_parameters()}
    ref = LocalExecutor(lower_step(build_pcg(whole, Mesh.parse("d=1")), "adamw", grad_norm=True), opt)
    ex = LocalExecutor(step, opt)
    ref.load(weights)
    ex.load(weights)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = {"x": torch.randn(B, 16, generator=gen), "y": torch.randint(0, 8, (B,), generator=gen)}
        assert ex.step(batch) == pytest.approx(ref.step(batch), abs=tol)
        assert ex.grad_norm == pytest.approx(ref.grad_norm, rel=tol)
        assert ex.grad_error(ref.grads()) < tol
    assert ex.weight_error(ref.weights()) < tol


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "mesh, strategy", [("pp=2", "pp"), ("pp=2,dp=2", "pp,dp"), ("pp=2,tp=2", "pp,tp"), ("pp=4", "pp")]
)
def test_every_schedule_equals_one_device(mesh, strategy, m, kind):
    """Every schedule, M ∈ {1, 2, 4, 8} (dp=2: at least one row per rank), with dp and tp: 3 AdamW steps equal
    one device on the whole batch of 8. float32 both sides, partial sums added in another order: ~1e-7; 1e-5
    still catches a lost microbatch or a missing 1/M (O(1) in the gradients)."""
    if "dp=2" in mesh and m == 8:
        pytest.skip("8 microbatches of 1 row do not split over dp=2")
    run_against_one_device(lowered(mesh, strategy, m, kind, grad_norm=True))


@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("mesh, strategy", [("pp=2", "pp"), ("pp=2,dp=2", "pp,dp"), ("pp=2,tp=2", "pp,tp")])
def test_interleaved_equals_one_device(mesh, strategy, m):
    """The interleaved schedule, 2 chunks of one layer per stage (layers 0 and 2 on stage 0, 1 and 3 on stage 1),
    M ∈ {2, 4, 8}: 3 AdamW steps equal one device (1e-5)."""
    if "dp=2" in mesh and m == 8:
        pytest.skip("8 microbatches of 1 row do not split over dp=2")
    step = lowered(mesh, strategy, m, "interleaved", v=2, grad_norm=True)
    stage = {
        n.src: dict(n.group.fixed)["pp"]
        for n in step.dg.nodes
        if n.kind == NodeKind.COMPUTE and step.dg.sources[n.src].scope.startswith("layers.")
    }
    assert {step.dg.sources[k].scope: v for k, v in stage.items()} == {
        "layers.0": 0,
        "layers.1": 1,
        "layers.2": 0,
        "layers.3": 1,
    }
    run_against_one_device(step)


@pytest.mark.parametrize(
    "mesh, strategy, m, kind",
    [
        ("pp=2,fsdp=2", "pp,fsdp", 2, "gpipe"),
        ("pp=2,dp=2,tp=2", "pp,dp,tp", 2, "1f1b"),
        ("pp=2,fsdp=2,tp=2", "pp,fsdp,tp", 4, "1f1b"),
    ],
)
def test_pipelines_on_two_and_three_dimensional_meshes_equal_one_device(mesh, strategy, m, kind):
    """pp with FSDP (the stage's weights gathered once for every microbatch, the summed gradients reduce-scattered
    after the last), and 3-D meshes pp × dp × tp and pp × fsdp × tp: 3 AdamW steps equal one device (1e-5)."""
    run_against_one_device(lowered(mesh, strategy, m, kind, grad_norm=True))


def test_under_fsdp_a_stage_gathers_its_weights_once_for_all_its_microbatches():
    """pp=2 × fsdp=2 under 1F1B: each weight is all-gathered once for the forwards of every microbatch and once again
    for their backwards (resharded after the forward, not between microbatches) — rank 0's all-gathers
    (calls and bytes) are the same for 2 and 4 microbatches (a regression: each microbatch gathered its own copy, the
    copies bucketed together, so 4 microbatches gathered 4 × the bytes and held 4 copies of the stage's weights from
    the first forward on; docs/lowering.md#fsdp-under-a-pipeline measures the peak)."""
    two, four = lowered("pp=2,fsdp=2", "pp,fsdp", 2), lowered("pp=2,fsdp=2", "pp,fsdp", 4)

    def gathered(step) -> tuple[int, int]:
        ags = [c for c in step.programs[0].comms if c.kind == "all_gather"]
        return len(ags), sum(c.nbytes for c in ags)

    assert gathered(two) == gathered(four) and gathered(two)[0] > 0


def test_1f1b_holds_fewer_activations_than_gpipe():
    """pp=2, M=8 on a wide MLP (activations dominate): stage 0's peak of live buffers under 1F1B (at most 2
    microbatches in flight) is below GPipe's (8 in flight) by at least 4 microbatches' hidden activations, and so is
    stage 1's (1 in flight against 8). Peaks from the executor's ledger (bytes)."""
    torch.manual_seed(0)
    model = MLP(d_in=64, hidden=512, d_out=8, n_layers=4)
    graph = capture(model, {"x": torch.zeros(32, 64), "y": torch.zeros(32, dtype=torch.long)})
    mesh = Mesh.parse("pp=2")
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "pp"), graph, mesh))
    weights = {w: p.detach().clone() for w, p in model.named_parameters()}
    batch = {"x": torch.randn(256, 64), "y": torch.randint(0, 8, (256,))}
    peaks = {}
    for kind in ("gpipe", "1f1b"):
        ex = LocalExecutor(
            lower_step(pcg, "sgd", options=LowerOptions(microbatches=8, schedule=kind)),
            OptimizerConfig("sgd", lr=0.1),
            memory=True,
        )
        ex.load(weights)
        ex.step(batch)
        peaks[kind] = ex.peak_bytes
    activation = 32 * 512 * 4  # one microbatch's hidden activation, bytes
    assert peaks["gpipe"][0] - peaks["1f1b"][0] >= 4 * activation
    assert peaks["gpipe"][1] - peaks["1f1b"][1] >= 4 * activation


def test_a_forward_that_comes_back_to_an_earlier_stage_is_refused():
    """test_lower's pipeline MLP puts the loss back on stage 0, after fc2 on stage 1: one microbatch lowers (the
    step is one forward, one backward), but microbatches cannot be scheduled stage by stage — refused, naming the
    node, the value and the fix."""
    b = GraphBuilder()
    x, y = b.input("x", (4, 6)), b.input("y", (4,), "int64")
    loss = b.cross_entropy(b.dense(b.relu(b.dense(x, 8, name="fc1")), 3, name="fc2"), y)
    graph = b.build([loss], loss)
    plan = Plan(
        modules={
            "fc1": ModulePlan(stage=0),
            "relu": ModulePlan(stage=0),
            "fc2": ModulePlan(stage=1),
            "loss": ModulePlan(stage=0),
        }
    )
    mesh = Mesh.parse("pp=2")
    pcg = build_pcg(graph, mesh, resolve(plan, graph, mesh))
    lower_step(pcg)
    with pytest.raises(
        PassError,
        match=r"schedule: 'FWD loss#0' on stage 0 reads 'fwd:linear_1#0@mesh\[pp=0\]' from "
        r"the F of stage 1: a microbatched pipeline's forward visits the stages once "
        r"each, in order",
    ):
        lower_step(pcg, options=LowerOptions(microbatches=2))
