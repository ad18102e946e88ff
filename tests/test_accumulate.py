"""Gradient accumulation: an optimizer step as N micro-steps (``MicroStep``) — plan structure (weight-gradient
communication only in the last micro-step, as much of it as one step on the whole batch) and numbers (the micro-steps
of a sharded run equal one device on the whole batch), on the small MLP of test_lower (no processes)."""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from test_lower import comms, mlp

from shardflow.lower import LowerOptions, MicroStep, lower_step
from shardflow.lower.dynamic import NodeKind, TaskType, ValueRole
from shardflow.lower.program import Free
from shardflow.parallel.mesh import Mesh, Replicate, Shard, SubMesh
from shardflow.parallel.pcg import build_pcg
from shardflow.parallel.sharding import Sharding
from shardflow.runtime.accumulate import MicroSteps
from shardflow.runtime.batch import BatchSplitError, split_batch
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.runtime.local import LocalExecutor
from shardflow.strategy import make_plan, resolve

B = 8


def micro_steps(
    mesh_text: str,
    strategy: str,
    count: int,
    optimizer: str = "sgd",
    bucket_bytes: int | None = None,
    dtype: str = "float32",
    **kw,
):
    """Each distinct micro-step of ``count`` lowered (proven) for the MLP (in ``dtype``) on a micro-batch of B/count
    rows."""
    graph = mlp(pre=True, B=B // count, dtype=dtype)
    mesh = Mesh.parse(mesh_text)
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy), graph, mesh))
    options = LowerOptions() if bucket_bytes is None else LowerOptions(bucket_bytes=bucket_bytes)
    return graph, {
        m: lower_step(pcg, optimizer, options=options, micro=m, **kw) for m in dict.fromkeys(MicroStep.sequence(count))
    }


def comm_counts(step) -> Counter:
    """Per rank: (pass, kind, shape) of each communication of its program, counted."""
    return Counter((r, c.task, c.family, c.type.shape) for r, p in step.programs.items() for c in p.comms)


@pytest.mark.parametrize("bucket_bytes", [0, None], ids=["one-per-gradient", "bucketed"])
def test_weight_gradients_are_reduced_once_per_optimizer_step(bucket_bytes):
    """dp=2, --accumulate 4: the first and middle micro-steps communicate nothing (each device sums its own partial
    gradients) and update nothing; the last holds exactly the all-reduces — same count, same bytes per rank — of one
    step on the whole batch, and the only updates."""
    (plain,) = micro_steps("dp=2", "dp", 1, bucket_bytes=bucket_bytes)[1].values()
    _, steps = micro_steps("dp=2", "dp", 4, bucket_bytes=bucket_bytes)
    first, middle, last = steps.values()
    assert (first.programs[0].comms, middle.programs[0].comms) == ((), ())
    for step in (first, middle):
        assert not any(n.kind == NodeKind.UPDATE for n in step.dg.nodes)
    assert comm_counts(last) == comm_counts(plain) and comm_counts(last)
    assert all(last.programs[r].bytes_by_kind() == plain.programs[r].bytes_by_kind() for r in plain.programs)
    updates = Counter(n.src for n in last.dg.nodes if n.kind == NodeKind.UPDATE)
    assert updates == Counter(n.src for n in plain.dg.nodes if n.kind == NodeKind.UPDATE)


def test_sums_live_from_one_micro_step_to_the_next():
    """The first micro-step writes an ``acc`` value per weight-gradient contribution and keeps it; a middle one reads
    it (placed by the step before) and writes its replacement; the last reads it, adds it before the reduction and
    frees it. Each micro-step's loss gradient is seeded with 1/4."""
    graph, steps = micro_steps("dp=2", "dp", 4)
    first, middle, last = steps.values()
    n_weights = len(graph.weights)
    reads, writes = first.dg.accumulated()
    assert not reads and len(writes) == n_weights and set(writes) <= first.dg.persistent()
    reads, writes = middle.dg.accumulated()
    assert len(reads) == len(writes) == n_weights
    assert {middle.dg.values[w].replaces for w in writes} == set(reads) == set(first.dg.accumulated()[1])
    reads, writes = last.dg.accumulated()
    assert set(reads) == set(first.dg.accumulated()[1]) and not writes
    freed = {v for i in last.programs[0].instrs if isinstance(i, Free) for v in i.values}
    assert set(reads) <= freed and set(reads) <= {b.value for b in last.programs[0].inputs}
    for step in steps.values():
        (seed,) = [n for n in step.dg.nodes if n.kind == NodeKind.SEED]
        assert seed.scale == 0.25 and step.dg.values[seed.outputs[0]].role == ValueRole.GRAD
        sums = [
            n
            for n in step.dg.nodes
            if n.kind == NodeKind.SUM
            and n.task == TaskType.BWD
            and any(step.dg.values[v].role == ValueRole.ACC for v in n.inputs + n.outputs)
        ]
        assert len(sums) == n_weights


@pytest.mark.parametrize("mesh, strategy", [("dp=2", "dp"), ("dp=2,tp=2", "dp,tp")])
def test_micro_steps_equal_one_device_on_the_whole_batch(mesh, strategy):
    """3 optimizer steps of AdamW, each as 4 micro-steps of 2 rows on the sharded mesh, against one device on the
    whole batch of 8: the mean loss of each step, the gradients the updates used and every replica of every weight
    piece agree. float64 on both sides, partial sums added in another order: AdamW's first update of an element,
    lr·g/(|g| + eps), turns a rounding error δ of a near-zero gradient (tanh saturates: some are 1e-19) into up to
    lr·δ/eps = 1e6·δ — in float32 (δ ~ 1e-6) 8e-5 on this project's machine, so float64 (δ ~ 1e-17); 1e-9 still
    catches a missing 1/N (O(1) in the gradients) or a micro-step left out."""
    whole = mlp(pre=True, B=B, dtype="float64")
    _, steps = micro_steps(mesh, strategy, 4, "adamw", dtype="float64", grad_norm=True)
    opt = OptimizerConfig("adamw", lr=1e-2)
    torch.manual_seed(0)
    weights = {w: torch.randn(whole.tensors[w].shape, dtype=torch.float64) for w in whole.weights}
    ref = LocalExecutor(lower_step(build_pcg(whole, Mesh.parse("d=1")), "adamw", grad_norm=True), opt)
    ref.load(weights)
    *others, last = steps.values()
    last = LocalExecutor(last, opt)
    first, middle = (LocalExecutor(s, opt, share=last) for s in others)  # one set of buffers: the sums stay there
    run = MicroSteps([first, middle, middle, last])
    last.load(weights)
    for _ in range(3):
        batch = {"x": torch.randn(B, 16, dtype=torch.float64), "y": torch.randint(0, 16, (B,))}
        assert run.step(batch) == pytest.approx(ref.step(batch), abs=1e-9)
        assert last.grad_error(ref.grads()) < 1e-9
        assert last.grad_norm == pytest.approx(ref.grad_norm, rel=1e-9)
    assert last.steps_done == 3 and last.weight_error(ref.weights()) < 1e-9


def test_a_weight_gathered_before_use_sums_the_gathered_gradient():
    """fc1.weight held Shard(0) on dp and all-gathered before its use (ZeRO-like; a Combine on the weight): the
    gathered weight's gradient is summed over the micro-steps and only then reduced and scattered back. Each
    micro-step gathers the weight (forward); the last holds the communication of one step on the whole batch; SGD
    steps equal one device on the whole batch (float32: ~1e-6)."""
    mesh = Mesh.parse("dp=2")

    def pcg(graph):
        ann = resolve(make_plan(graph, mesh, "dp"), graph, mesh)
        return build_pcg(
            graph,
            mesh,
            replace(
                ann,
                leaves={**ann.leaves, "fc1.weight": Sharding.from_placements([Shard(0)], SubMesh(mesh), 2)},
                edges={**ann.edges, ("linear", 1): {"dp": Replicate()}},
            ),
        )

    whole, micro = mlp(pre=True, B=B), mlp(pre=True, B=B // 2)
    # the plain gather, whatever the cost model, kept for the backward (no resharding: one gather per micro-step)
    options = LowerOptions(all_gather="collective", bucket_bytes=0, reshard_after_forward=False)
    first, last = (lower_step(pcg(micro), "sgd", options=options, micro=m) for m in MicroStep.sequence(2))
    plain = lower_step(pcg(whole), "sgd", options=options)
    assert [c[:2] for c in comms(first.programs)] == [("FWD", "all_gather")]
    assert [c[:3] for c in comms(last.programs)] == [c[:3] for c in comms(plain.programs)]
    opt = OptimizerConfig("sgd", lr=0.1)
    torch.manual_seed(0)
    weights = {w: torch.randn(whole.tensors[w].shape) for w in whole.weights}
    ref = LocalExecutor(lower_step(build_pcg(whole, Mesh.parse("d=1")), "sgd"), opt)
    ref.load(weights)
    last = LocalExecutor(last, opt)
    run = MicroSteps([LocalExecutor(first, opt, share=last), last])
    last.load(weights)
    for _ in range(2):
        batch = {"x": torch.randn(B, 16), "y": torch.randint(0, 16, (B,))}
        assert run.step(batch) == pytest.approx(ref.step(batch), abs=1e-5)
    assert last.weight_error(ref.weights()) < 1e-5


def test_micro_step_and_batch_split_errors():
    assert MicroStep.sequence(1) == (MicroStep(),)
    assert [str(m) for m in MicroStep.sequence(3)] == [
        "first of 3 micro-steps",
        "middle of 3 micro-steps",
        "last of 3 micro-steps",
    ]
    with pytest.raises(ValueError, match="at least one micro-step, not 0"):
        MicroStep.sequence(0)
    with pytest.raises(ValueError, match="one micro-step is both first and last"):
        MicroStep(1, first=False)
    x = torch.arange(12).reshape(6, 2)
    assert [p["x"][:, 0].tolist() for p in split_batch({"x": x}, 3)] == [[0, 2], [4, 6], [8, 10]]
    with pytest.raises(BatchSplitError, match=r"input 'x' \[6, 2\] has 6 rows along dim 0, which do not split into 4"):
        split_batch({"x": x}, 4)
