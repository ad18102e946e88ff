"""The step simulator's replay (docs/simulator.md#the-replay) on hand-built programs: exact event times, waits,
overlap, pipeline bubbles, the communication stream's order, deadlocks; then on lowered plans: ranks replayed one
per class predict what every rank replayed predicts, and the memory replay matches what the executors count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardflow.graph.ops import TensorType
from shardflow.lower.dynamic import NodeKind, TaskType
from shardflow.lower.program import Buffer, Comm, Compute, Program, Wait
from shardflow.parallel.collectives import CommKind
from shardflow.simulator.replay import SimulationError, replay


class Spec:
    """A machine where a compute takes its bytes / 1000 seconds and a communication its bytes / 1000 seconds (α = 0),
    so the expected times are read off the programs."""

    name = "hand"
    overlap = True
    instr_overhead_s = 0.0
    contention = 1.0

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def compute_seconds(self, flops, nbytes, dtype, kernels=1, largest=None, attention=None):
        return nbytes / 1000

    def comm_seconds(self, kind, members, nbytes):
        return nbytes / 1000


def work(seconds: float, name: str = "x") -> Compute:
    """A compute of ``seconds`` on :class:`Spec` (it writes 1000·seconds bytes)."""
    return Compute(TaskType.FWD, name, "work", (), (Buffer(f"fwd:{name}", TensorType((int(250 * seconds),))),))


def comm(token: int, kind: CommKind, members, seconds: float, wait: bool = True, axis: str = "dp", **kw) -> Comm:
    return Comm(
        token, kind, TaskType.FWD, tuple(members), TensorType((1,)), int(1000 * seconds), axis=axis, wait=wait, **kw
    )


def programs(**by_rank) -> dict[int, Program]:
    return {int(r[1:]): Program(int(r[1:]), tuple(instrs)) for r, instrs in by_rank.items()}


def test_a_collective_starts_when_its_last_member_issues_it():
    t = replay(
        [
            programs(
                r0=[work(1), comm(0, CommKind.ALL_REDUCE, (0, 1), 2)],
                r1=[work(3), comm(0, CommKind.ALL_REDUCE, (0, 1), 2)],
            )
        ],
        Spec(),
        events=True,
    )
    assert t.ends == {0: 5.0, 1: 5.0} and t.seconds == 5.0
    assert t.breakdown[0].exposed_comm == 4.0 and t.breakdown[1].exposed_comm == 2.0
    assert t.breakdown[0].compute == 1.0 and t.breakdown[1].compute == 3.0
    assert sorted((e.rank, e.stream, e.start, e.seconds) for e in t.events) == [
        (0, "comm", 3.0, 2.0),
        (0, "compute", 0.0, 1.0),
        (1, "comm", 3.0, 2.0),
        (1, "compute", 0.0, 3.0),
    ]


def test_an_asynchronous_communication_hides_behind_compute_until_its_wait():
    t = replay([programs(r0=[comm(0, CommKind.ALL_GATHER, (0,), 2, wait=False), work(3), Wait(0), work(1)])], Spec())
    assert t.seconds == 4.0 and t.breakdown[0].exposed_comm == 0.0
    t = replay([programs(r0=[comm(0, CommKind.ALL_GATHER, (0,), 5, wait=False), work(3), Wait(0), work(1)])], Spec())
    assert t.seconds == 6.0 and t.breakdown[0].exposed_comm == 2.0


def test_without_overlap_a_compute_waits_for_the_communication_stream():
    prog = [comm(0, CommKind.ALL_GATHER, (0,), 2, wait=False), work(3), Wait(0)]
    assert replay([programs(r0=prog)], Spec(overlap=False)).seconds == 5.0


def test_contention_slows_the_overlapped_part_of_a_compute():
    prog = [comm(0, CommKind.ALL_GATHER, (0,), 2, wait=False), work(3), Wait(0)]
    assert replay([programs(r0=prog)], Spec(contention=1.5)).seconds == pytest.approx(4.0)  # 2 s at 1.5×, 1 s alone


def test_a_transfer_between_stages_is_the_next_stages_bubble():
    t = replay(
        [
            programs(
                r0=[work(1), comm(0, CommKind.SEND, (0, 1), 1, peer=1, axis=NodeKind.COPY)],
                r1=[comm(0, CommKind.RECV, (0, 1), 1, wait=False, peer=0, axis=NodeKind.COPY), Wait(0), work(1)],
            )
        ],
        Spec(),
    )
    assert t.ends == {0: 2.0, 1: 3.0}
    assert t.breakdown[1].bubble == 2.0 and t.breakdown[1].exposed_comm == 0.0
    assert t.breakdown[0].exposed_comm == 1.0  # the blocking send


def test_a_rank_runs_its_communications_in_issue_order():
    # rank 0 issues #0 (with rank 1, who is late) then #1 (with rank 2, early): #1 waits for #0 on rank 0's stream
    t = replay(
        [
            programs(
                r0=[comm(0, CommKind.ALL_REDUCE, (0, 1), 1, wait=False), comm(1, CommKind.ALL_REDUCE, (0, 2), 1)],
                r1=[work(4), comm(0, CommKind.ALL_REDUCE, (0, 1), 1)],
                r2=[comm(1, CommKind.ALL_REDUCE, (0, 2), 1)],
            )
        ],
        Spec(),
    )
    assert t.ends == {0: 6.0, 1: 5.0, 2: 6.0}


def test_a_send_waiting_for_its_receiver_holds_later_transfers_not_collectives():
    # rank 0 sends #0 to rank 1, who receives it only after 4 s of work; then rank 0 all-reduces #1 with rank 2
    # and sends #2 to rank 2. The all-reduce goes on the collectives' stream, not behind the send; the second send
    # goes on the point-to-point stream, behind the first.
    send = dict(axis=NodeKind.COPY, wait=False)
    t = replay(
        [
            programs(
                r0=[
                    comm(0, CommKind.SEND, (0, 1), 1, peer=1, **send),
                    comm(1, CommKind.ALL_REDUCE, (0, 2), 1),
                    comm(2, CommKind.SEND, (0, 2), 1, peer=2, **send),
                    Wait(0),
                    Wait(2),
                ],
                r1=[work(4), comm(0, CommKind.RECV, (0, 1), 1, peer=0, axis=NodeKind.COPY)],
                r2=[
                    comm(1, CommKind.ALL_REDUCE, (0, 2), 1),
                    comm(2, CommKind.RECV, (0, 2), 1, peer=0, axis=NodeKind.COPY),
                ],
            )
        ],
        Spec(),
        events=True,
    )
    starts = {e.name: e.start for e in t.events if e.rank == 0 and e.stream == "comm"}
    assert starts == {"#0 send (async)": 4.0, "#1 all_reduce": 0.0, "#2 send (async)": 5.0}
    assert t.ends == {0: 6.0, 1: 5.0, 2: 6.0}
    assert t.breakdown[2].bubble == 5.0  # waiting for rank 0's second send, queued behind its first


def test_micro_steps_run_one_after_the_other_and_host_overhead_counts():
    step = programs(r0=[work(1), comm(0, CommKind.ALL_REDUCE, (0,), 1)])
    t = replay([step, step], Spec(instr_overhead_s=0.5))
    assert t.seconds == 6.0 and t.breakdown[0].overhead == 2.0 and t.breakdown[0].total() == 6.0


def test_programs_that_deadlock_are_refused_naming_the_ranks():
    with pytest.raises(SimulationError, match="rank 0 at instruction 0.*rank 1 at instruction 0"):
        replay(
            [
                programs(
                    r0=[comm(1, CommKind.ALL_REDUCE, (0, 1), 1), comm(0, CommKind.ALL_REDUCE, (0, 1), 1)],
                    r1=[comm(0, CommKind.ALL_REDUCE, (0, 1), 1), comm(1, CommKind.ALL_REDUCE, (0, 1), 1)],
                )
            ],
            Spec(),
        )


def test_compute_dtype_and_flops_of_a_linear():
    from shardflow.graph.ops import Linear
    from shardflow.lower.program import Forward, Vjp
    from shardflow.parallel.rules import LocalOp
    from shardflow.simulator.cost import compute_dtype, compute_flops

    x, w, y = (Buffer(n, TensorType(s, "bfloat16")) for n, s in (("x", (8, 16)), ("w", (32, 16)), ("y", (8, 32))))
    op = LocalOp(Linear(), (1.0, 1.0))
    fwd = Compute(TaskType.FWD, "l", "linear", (x, w), (y,), kernel=Forward(op, None, (True, True)))
    assert compute_flops(fwd) == 2 * 8 * 32 * 16 and compute_dtype(fwd) == torch.bfloat16
    vjp = Vjp(op, None, (True, True), (1.0, 1.0), (True,), ("bfloat16", "bfloat16"))
    bwd = Compute(TaskType.BWD, "l", "linear", (x, w, y), (x, w), kernel=vjp)
    assert compute_flops(bwd) == 2 * compute_flops(fwd)
    only_dx = Compute(
        TaskType.BWD,
        "l",
        "linear",
        (x, w, y),
        (x,),
        kernel=Vjp(op, None, (True, False), (1.0, 1.0), (True,), ("bfloat16",)),
    )
    assert compute_flops(only_dx) == compute_flops(fwd)


def test_views_cost_their_launch_and_a_float32_update_is_one_fused_pass():
    """A reshape (a view) moves no bytes; an AdamW update of a float32 shard is torch.optim's fused kernel, as the
    executors run it (one pass over weight, gradient and state: the dtypes agree with the runtime's), of a bfloat16
    shard the foreach formulas (5 kernels)."""
    from shardflow.graph.ops import Reshape
    from shardflow.lower.program import Forward, Update
    from shardflow.parallel.rules import LocalOp
    from shardflow.runtime.kernels import FUSED_DTYPES
    from shardflow.simulator.cost import FUSED_UPDATE_DTYPES, UPDATE_KERNELS, compute_seconds
    from shardflow.simulator.machine import MachineSpec

    assert FUSED_UPDATE_DTYPES == FUSED_DTYPES
    spec = MachineSpec.named("h100")
    launch, bw = spec.device.launch_s, spec.device.memory_bandwidth
    x, y = Buffer("x", TensorType((64, 32))), Buffer("y", TensorType((2048,)))
    view = Compute(
        TaskType.FWD, "r", "reshape", (x,), (y,), kernel=Forward(LocalOp(Reshape((2048,)), (1.0,)), None, ())
    )
    assert compute_seconds(view, spec) == launch
    for dtype, passes in (("float32", 1), ("bfloat16", UPDATE_KERNELS[2])):
        w, g, m, v = (Buffer(n, TensorType((1024,), dtype)) for n in "wgmv")
        up = Compute(TaskType.UPD, "u", "adamw_update", (w, g, m, v), (w, m, v), kernel=Update(("m", "v"), 0.0))
        assert compute_seconds(up, spec) == pytest.approx(passes * 7 * w.type.nbytes / bw + passes * launch)


# --- lowered plans --------------------------------------------------------------------------------------------


def _pipeline(mesh: str, strategy: str, **options):
    from shardflow.lower import LowerOptions
    from shardflow.lower.dynamic import Optimizer
    from shardflow.models import GPT, GPTConfig
    from shardflow.parallel.mesh import Mesh
    from shardflow.pipeline import Pipeline
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.simulator.estimate import cost_model
    from shardflow.simulator.machine import MachineSpec

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32))
    batch = {"idx": torch.randint(0, 64, (8, 16)), "targets": torch.randint(0, 64, (8, 16))}
    m = Mesh.parse(mesh)
    spec = MachineSpec.named("h100")
    opts = LowerOptions.parse(cost=cost_model(spec, m), **options)
    return Pipeline.capture(model, batch, m, opts, OptimizerConfig(Optimizer.ADAMW), strategy), batch, spec, model


@pytest.mark.parametrize(
    "mesh, strategy, options",
    [
        ("dp=2,pp=2", "dp,pp", {"microbatches": 2}),
        ("fsdp=2,tp=2", "fsdp,tp", {"ac": "block"}),
        ("dp=2,tp=2", "dp,tp", {"accumulate": 2}),
    ],
)
def test_one_rank_per_class_predicts_what_every_rank_predicts(mesh, strategy, options):
    p, _, spec, _ = _pipeline(mesh, strategy, **options)
    every, some = p.predict(spec, 128, exact=True), p.predict(spec, 128, exact=False)
    assert len(some.replayed) < len(every.replayed) == 4
    assert some.step_seconds == every.step_seconds > 0
    assert some.peak_bytes == every.peak_bytes
    assert vars(some.timeline.breakdown[0]) == vars(every.timeline.breakdown[0])
    for r, b in every.timeline.breakdown.items():  # a rank's parts add up to its end
        assert b.total() == pytest.approx(every.timeline.ends[r], rel=1e-9)


def test_the_memory_prediction_is_what_the_executors_count():
    from shardflow.reference import weights_of
    from shardflow.runtime.local import LocalExecutor

    p, batch, spec, model = _pipeline("dp=2,tp=2", "dp,tp", ac="block")
    ex = LocalExecutor(p.lower(), p.optimizer, memory=True)
    ex.load(weights_of(model, p.graph))
    for _ in range(2):
        ex.step(batch)
    assert p.predict(spec, 128).peak_bytes == tuple(ex.peak_bytes[r] for r in range(4))


@pytest.mark.integration
def test_plan_estimate_prints_the_prediction_and_refuses_what_does_not_fit(capsys, tmp_path):
    import json

    from shardflow.cli import main

    argv = ["plan", "--estimate", "--machine", "h100", "--strategy", "fsdp,tp", "--mesh", "fsdp=2,tp=2"]
    assert main([*argv, "--format", "json", "--trace", str(tmp_path / "t.json")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"step_seconds", "tokens_per_second_per_device", "mfu", "peak_bytes", "breakdown"} <= set(doc)
    assert len(doc["peak_bytes"]) == 4 and doc["fits"] and doc["mesh"] == "fsdp=2,tp=2"
    assert doc["tokens_per_second_per_device"] == pytest.approx(16 * 64 / doc["step_seconds"] / 4)
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1, 2, 3} and {e["tid"] for e in trace} == {0, 1}
    spec = tmp_path / "small.toml"
    text = (Path(__file__).parents[1] / "shardflow/simulator/specs/h100.toml").read_text()
    spec.write_text(text.replace("memory_bytes = 103079215104", "memory_bytes = 1048576"))
    assert main([*argv[:2], "--machine", str(spec), *argv[4:]]) == 1
    out = capsys.readouterr()
    assert "# predicted on h100 (4 devices)" in out.out and "does not fit: rank 0 peaks at" in out.err


def test_torch_compile_fuses_a_run_of_memory_bound_computes():
    from shardflow.simulator.cost import Kernels

    def ew(name: str, src: str) -> Compute:  # reads 1000 bytes, writes 1000 bytes: 2 s eager on Spec
        return Compute(
            TaskType.FWD, name, "add", (Buffer(src, TensorType((250,))),), (Buffer(name, TensorType((250,))),)
        )

    prog = [ew("a", "x"), ew("b", "a"), ew("c", "b"), comm(0, CommKind.ALL_REDUCE, (0,), 0), ew("d", "c")]
    assert replay([programs(r0=prog)], Spec()).seconds == 8.0
    # fused: the first of a run reads and writes (2 s), the next two only write (1 s each); a communication ends it
    assert replay([programs(r0=prog)], Spec(), kernels=Kernels(fused_elementwise=True)).seconds == 6.0
