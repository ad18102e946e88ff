"""Uneven shards (docs/concepts.md#uneven-shards): a degree that does not divide its dim gives DTensor's chunks, stored
padded with zeros. The layout against DTensor's own function; the cases of issue #37 that used to be a DegreeError
trained against one device (float64, 1e-9) with their plans' exact structure (redistributions, the padded
collectives and their bytes); a vocabulary-parallel embedding and head of 10 rows on 4 devices under AdamW with weight
decay against the same step on one device, its padding zero on every device after the steps; the verifier refusing
ranks that pad differently. The property test (tests/test_properties.py) draws sizes that do not divide, and
tests/dist_worker.py runs an uneven plan on gloo."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import check_trains_like_one_device, values

from shardflow.graph import GraphBuilder
from shardflow.graph.layout import Padded
from shardflow.graph.ops import Detach, Gather, Reduce, Softmax
from shardflow.graph.softmax import decompose_softmax
from shardflow.lower import lower_step
from shardflow.lower.dynamic import forward_id
from shardflow.lower.program import Comm, Program
from shardflow.lower.verify import PlanVerificationError, verify
from shardflow.parallel.collectives import CommKind, wire_bytes
from shardflow.parallel.mesh import Mesh, Replicate, Shard, SubMesh
from shardflow.parallel.ops import CombineOp, RepartitionOp
from shardflow.parallel.pcg import Annotations, build_pcg
from shardflow.parallel.shape import DegreeError
from shardflow.parallel.sharding import Sharding
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.runtime.local import LocalExecutor

F64 = "float64"


def placed(graph, mesh: Mesh, **placements) -> Annotations:
    """Annotations placing each named leaf as given (one placement per mesh axis)."""
    g = SubMesh(mesh)
    return Annotations(
        leaves={k: Sharding.from_placements(v, g, len(graph.tensors[k].shape)) for k, v in placements.items()}
    )


def trains_like_one_device(graph, mesh: Mesh, ann: Annotations, ints=None):
    """The PCG, after the loss, every gradient and every replica of every weight of 2 SGD steps (momentum 0.9) equal
    one device's (tests/test_properties.py)."""
    inputs, weights = values(graph, ints or {}, 0)
    pcg = check_trains_like_one_device(graph, mesh, ann, inputs, weights)
    assert not isinstance(pcg, Exception), pcg
    return pcg


# --- the layout ------------------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(1, 13), min_size=1, max_size=3),
    mesh_shape=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    data=st.data(),
)
def test_layout_is_dtensor_s(shape, mesh_shape, data):
    """For every placement shardflow accepts (uneven dims sharded by one axis), each device's block — its offsets
    and its size along every dim — is what DTensor's ``_compute_local_shape_and_global_offset`` gives that device."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    names = ("a", "b")[: len(mesh_shape)]
    mesh = Mesh(names, tuple(mesh_shape))
    group = SubMesh(mesh)
    placements = [data.draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(shape))])) for _ in names]
    s = Sharding.from_placements(placements, group, len(shape))
    try:
        s.check(group, tuple(shape), uneven=True)
    except DegreeError:  # two axes on a dim they do not divide: refused, as the next test says
        return
    p = s.parallel_shape(group, tuple(shape))
    torch_placements = [TShard(pl.dim) if isinstance(pl, Shard) else TReplicate() for pl in placements]
    for device, coord in s.device_map(group).items():
        at = [group.coords(device)[a] for a in names]
        size, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, at, torch_placements)
        assert p.piece_valid(coord) == tuple(size), (device, coord)
        held = [sl.start for sl, n in zip(p.piece_slices(coord), size) if n]
        assert held == [o for o, n in zip(offset, size) if n], (device, coord)
        assert all(v <= b for v, b in zip(p.piece_valid(coord), p.piece_shape))


def test_two_axes_on_an_uneven_dim_are_refused():
    """DTensor nests two axes' chunks (9 on 2 × 2: 5 | 4, then 3, 2 | 2, 2), which is not one axis's layout of 4
    (3, 3, 3, 0): such a dim must still divide, a DegreeError naming it."""
    mesh = Mesh.parse("dp=2,tp=2")
    s = Sharding.from_placements((Shard(0), Shard(0)), SubMesh(mesh), 1)
    with pytest.raises(DegreeError, match="degree 4 does not divide dim 0 of size 9"):
        s.check(SubMesh(mesh), (9,), uneven=True)


# --- the cases of issue #37 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_rows_sharded_unevenly_run_where_they_are(tp):
    """x [9, 5] Shard(0) on 2 (5, 4) and 4 devices (3, 3, 3, 0) → dense → tanh → mean: no redistribution; every
    activation keeps its uneven rows; the mean sums each block and divides by the 27 values of the whole."""
    b = GraphBuilder()
    x = b.input("x", (9, 5), F64)
    y = b.tanh(b.dense(x, 3, name="fc"))
    loss = b.mean(y)
    graph = b.build([loss], loss)
    mesh = Mesh.parse(f"tp={tp}")
    pcg = trains_like_one_device(graph, mesh, placed(graph, mesh, x=(Shard(0),)))
    assert not pcg.parallel_nodes[:-1] and not pcg.redistributions  # the loss's all-reduce only
    assert pcg.tensors[y].pshape.piece_shape == (-(-9 // tp), 3) and pcg.tensors[y].pshape.uneven == (0,)
    mean = next(n for n in pcg.nodes if n.name == loss)
    assert mean.local.op.fn == "sum" and mean.local.out_scale == pytest.approx(1 / 27)
    last = pcg.local_of(mean, tp - 1).valid  # the short (or empty) last block is masked
    assert last == ((dataclasses.replace(last[0], size=9 - (tp - 1) * -(-9 // tp))),)


def test_mean_of_six_rows_on_four():
    """mean(x · w) of [6, 4], both Shard(0) on 4 devices (2, 2, 2, 0): equal to one device."""
    b = GraphBuilder()
    x, w = b.input("x", (6, 4), F64), b.weight("w", (6, 4), F64)
    loss = b.mean(b.mul(x, w))
    graph = b.build([loss], loss)
    mesh = Mesh.parse("tp=4")
    trains_like_one_device(graph, mesh, placed(graph, mesh, x=(Shard(0),), w=(Shard(0),)))


def test_view_of_an_uneven_dim_is_redistributed():
    """view(48) of [8, 6] sharded on dim 1 over 4 (2, 2, 2, 0): the view has no rule for uneven blocks, so the planner
    moves the blocks onto dim 0 (an all-to-all, where 4 divides 8) and the view runs on whole rows."""
    b = GraphBuilder()
    x, w = b.input("x", (8, 6), F64), b.weight("w", (8, 6), F64)
    v = b.reshape(b.mul(x, w), (48,))
    loss = b.mean(b.tanh(v))
    graph = b.build([loss], loss)
    mesh = Mesh.parse("tp=4")
    pcg = trains_like_one_device(graph, mesh, placed(graph, mesh, x=(Shard(1),), w=(Shard(1),)))
    (r,) = pcg.redistributions
    assert r.ops == (CombineOp(1, 4, "tp"), RepartitionOp(0, 4, "tp"))
    assert "viewing [8, 6] as [48] merges it into a preceding dim" in r.reason


def _partial_rows(rows: int):
    """x [rows, 8] · wᵀ with in-features sharded on tp=4: a Partial(sum) [rows, 6], laid out Shard(0) (a
    reduce-scatter onto rows 4 does not divide) → tanh → mean."""
    b = GraphBuilder()
    x = b.input("x", (rows, 8), F64)
    y = b.dense(x, 6, name="fc", bias=False)
    loss = b.mean(b.tanh(y))
    graph = b.build([loss], loss)
    mesh = Mesh.parse("tp=4")
    ann = dataclasses.replace(
        placed(graph, mesh, x=(Shard(1),), **{"fc.weight": (Shard(1),)}), after={y: {"tp": Shard(0)}}
    )
    return graph, mesh, ann


def test_reduce_scatter_onto_an_uneven_dim_pads_and_counts_what_it_sends():
    """10 rows on 4 devices (3, 3, 3, 1): the forward's reduce-scatter pads its [10, 6] send to 12 rows and sends
    3/4 of them; the backward's all-gather joins 4 × 3 rows and trims to 10, sending its 3 rows to each of 3 peers —
    bytes as sent, padding included (DTensor pads alike). Numbers equal one device."""
    graph, mesh, ann = _partial_rows(10)
    pcg = trains_like_one_device(graph, mesh, ann)
    step = lower_step(pcg)
    for r, prog in step.programs.items():
        (rs,) = [c for c in prog.comms if c.kind == CommKind.REDUCE_SCATTER]
        assert rs.to_storage == Padded(0, 10, 12) and rs.to_natural is None
        assert rs.nbytes == wire_bytes(CommKind.REDUCE_SCATTER, 12 * 6 * 8, 4) == 432
        (ag,) = [c for c in prog.comms if c.kind == CommKind.ALL_GATHER]
        assert ag.to_natural == Padded(0, 10, 12) and ag.send.type.shape == (3, 6)
        assert ag.nbytes == 3 * 3 * 6 * 8
        assert "pad(dim 0, 10↔12)" in prog.listing() and "trim(dim 0, 10↔12)" in prog.listing()


def test_an_even_plan_pads_nothing():
    """12 rows on 4: the same plan with no padding anywhere (the collectives as before)."""
    graph, mesh, ann = _partial_rows(12)
    step = lower_step(trains_like_one_device(graph, mesh, ann))
    assert all(c.padded == (None, None) for p in step.programs.values() for c in p.comms)


def test_the_verifier_refuses_ranks_that_pad_differently():
    """Rank 2 joins the all-gather without trimming its padding: the members no longer agree, and the verifier says
    which token and ranks."""
    graph, mesh, ann = _partial_rows(10)
    step = lower_step(build_pcg(graph, mesh, ann))
    programs = dict(step.programs)
    prog = programs[2]
    instrs = [
        dataclasses.replace(i, to_natural=None) if isinstance(i, Comm) and i.kind == CommKind.ALL_GATHER else i
        for i in prog.instrs
    ]
    programs[2] = Program(2, tuple(instrs))
    with pytest.raises(PlanVerificationError, match="disagree|agree"):
        verify(programs, 4)


# --- an uneven weight under AdamW --------------------------------------------------------------------------------
def test_uneven_vocabulary_trains_with_adamw_and_keeps_its_padding_zero():
    """An embedding table and a head of 10 rows Shard(0) on tp=4 (3, 3, 3, 1: the last device holds one row and two of
    padding), AdamW with weight decay, 3 steps: the loss of each step, the weights and the optimizer state equal the
    same step on one device (1e-9); the padding of every weight, gradient-free as it is, is still zero."""
    b = GraphBuilder()
    idx = b.input("idx", (6,), "int64")
    table = b.weight("emb.weight", (10, 4), F64)
    h = b.tanh(b.embedding(idx, table))
    head = b.weight("head.weight", (10, 4), F64)
    logits = b.linear(h, head)
    target = b.input("target", (6,), "int64")
    loss = b.cross_entropy(logits, target)
    graph = b.build([loss], loss)
    mesh = Mesh.parse("tp=4")
    ann = placed(graph, mesh, **{"emb.weight": (Shard(0),), "head.weight": (Shard(0),)})
    cfg = OptimizerConfig("adamw", lr=0.05, weight_decay=0.1)
    inputs, weights = values(graph, {"idx": 10, "target": 10}, 3)
    one = LocalExecutor(lower_step(build_pcg(graph, Mesh.parse("d=1")), cfg.slots), cfg)
    ex = LocalExecutor(lower_step(build_pcg(graph, mesh, ann), cfg.slots), cfg)
    one.load(weights)
    ex.load(weights)
    for k in range(3):
        assert ex.step(inputs) == pytest.approx(one.step(inputs), abs=1e-9), f"step {k}"
    for name, want in one.state().items():
        torch.testing.assert_close(ex.state()[name], want, atol=1e-9, rtol=1e-9, msg=name)
    assert ex.weight_error(one.weights()) <= 1e-9
    for w in ("emb.weight", "head.weight"):
        v = ex.dg.values[forward_id(w)]
        assert v.sharding.parallel_shape(v.group, v.type.shape).piece_shape == (3, 4)
        assert not ex.buffers[3][v.id][1:].any(), w  # the last device's two rows of padding


def test_a_loss_over_uneven_rows_ignores_the_padding():
    """7 rows on 4 devices (2, 2, 2, 1) through dense, layer_norm and cross-entropy: no redistribution; the last
    device's padded row has the ignore index as its target, so the loss is the sum of the real rows ÷ 7."""
    b = GraphBuilder()
    x, target = b.input("x", (7, 4), F64), b.input("target", (7,), "int64")
    h = b.dense(x, 5, name="fc")
    h = b.layer_norm(h, b.weight("ln.weight", (5,), F64), b.weight("ln.bias", (5,), F64))
    loss = b.cross_entropy(h, target)
    graph = b.build([loss], loss)
    mesh = Mesh.parse("tp=4")
    pcg = trains_like_one_device(graph, mesh, placed(graph, mesh, x=(Shard(0),), target=(Shard(0),)), {"target": 5})
    assert not pcg.redistributions
    ce = next(n for n in pcg.nodes if n.name == loss)
    assert ce.local.op.reduction == "sum" and ce.local.out_scale == pytest.approx(1 / 7)
    fills = {(v.index, v.fill) for v in pcg.local_of(ce, 3).valid}
    assert fills == {(0, 0), (1, -100)}


def test_data_parallel_splits_a_batch_the_degree_does_not_divide(capsys):
    """``shardflow check --strategy dp --mesh dp=4 --batch-size 6`` (the main job's Llama, blocks of 2, 2, 2, 0
    sequences) equals eager PyTorch on one device over every replica; it used to be a DegreeError."""
    from shardflow.cli import main

    code = main(["check", "--strategy", "dp", "--mesh", "dp=4", "--batch-size", "6", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.rstrip().endswith("over every replica (tolerance 1e-09): OK"), out


def test_a_max_over_an_uneven_dim_fills_its_padding_with_minus_infinity():
    """amax over 9 rows on 4 devices (3, 3, 3, 0) of a tensor whose values are all negative (a softmax's shift,
    detached): the zeros of the padding would win; the padding is −∞ there (``padding_fill``), the devices' maxima are
    ``Partial(max)``, and the loss (which the shift changes) and the gradients equal one device."""
    b = GraphBuilder()
    x = b.input("x", (9, 5), F64)
    neg = b.sub(b.mul(b.tanh(b.dense(x, 4, name="fc")), 0.5), 2.0)  # every value in (-2.5, -1.5)
    m = b.apply(Reduce("amax", (0,), keepdim=True), [b.apply(Detach(), [neg])[0]])[0]  # a softmax's shift
    loss = b.mean(b.sub(neg, m))
    graph = b.build([loss], loss)
    mesh = Mesh.parse("tp=4")
    pcg = trains_like_one_device(graph, mesh, placed(graph, mesh, x=(Shard(0),)))
    assert pcg.tensors[m].sharding.partial == ("tp",) and pcg.tensors[m].sharding.reduce_op == "max"
    amax = next(n for n in pcg.nodes if n.name == m)
    (v,) = pcg.local_of(amax, 3).valid[:1]
    assert v.fill == float("-inf") and v.size == 0


def test_the_vocabulary_parallel_loss_runs_on_classes_in_uneven_blocks():
    """A head of 10 classes Shard(0) on tp=4 (3, 3, 3, 1) and the loss a captured model computes (log-softmax, the
    target's logit by gather), the log-softmax decomposed as the vocabulary-parallel plans decompose it: the logits
    never move; the max over the classes sees −∞ in the padding, the exponentials' padding is masked, the target's
    gather reads only real rows; 2 SGD steps equal one device."""
    b = GraphBuilder()
    x, target = b.input("x", (6, 4), F64), b.input("target", (6, 1), "int64")
    head = b.weight("head.weight", (10, 4), F64)
    logp = b.apply(Softmax(1, log=True), [b.linear(x, head)])[0]
    picked = b.apply(Gather(1), [logp, target])[0]
    loss = b.neg(b.mean(picked))
    graph = b.build([loss], loss)
    node = next(n for n in graph.nodes if isinstance(n.op, Softmax))
    split, partial = decompose_softmax(graph, [node])
    shift, total = partial[node.name]
    mesh = Mesh.parse("tp=4")
    ann = dataclasses.replace(
        placed(split, mesh, **{"head.weight": (Shard(0),)}),
        graph=split,
        after={shift: {"tp": Replicate()}, total: {"tp": Replicate()}},
    )
    pcg = trains_like_one_device(graph, mesh, ann, {"target": 10})
    vocab = [n for n in pcg.parallel_nodes if 10 in pcg.tensors[n.inputs[0]].type.shape]
    assert not vocab and not pcg.redistributions
