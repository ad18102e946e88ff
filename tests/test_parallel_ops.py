"""The four parallel operators: degree rules, axis rules, duality and redistribution
(docs/concepts.md#3-parallel-operators)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.graph.ops import TensorType
from shardflow.parallel import ops as P
from shardflow.parallel.mesh import Mesh, Partial, Replicate, Shard, SubMesh
from shardflow.parallel.ops import CombineOp, ReductionOp, RepartitionOp, redistribute
from shardflow.parallel.shape import DegreeError, ParallelTensorShape, ShardingError
from shardflow.parallel.sharding import Sharding

FAST = settings(max_examples=100, deadline=None)


def pts(shape, shard, sum_degree=1, replica=1, reduce_op="sum"):
    return ParallelTensorShape(tuple(shape), tuple(shard), sum_degree, replica, reduce_op)


def test_names_say_one_thing():
    """``Replicate`` is only the DTensor placement — exported from ``shardflow`` with ``Shard`` and ``Partial`` —
    and the parallel operators carry an ``Op`` suffix (issue #34): a plan reads ``Replicate()`` as a layout and
    ``ReplicateOp(2, "pp")`` as the broadcast that makes one."""
    import shardflow
    from shardflow.parallel import mesh

    assert (shardflow.Shard, shardflow.Replicate, shardflow.Partial) == (mesh.Shard, mesh.Replicate, mesh.Partial)
    assert {"Shard", "Replicate", "Partial"} <= set(shardflow.__all__)
    assert shardflow.Replicate() == Replicate() and not issubclass(shardflow.Replicate, P.ParallelOp)
    assert issubclass(P.ReplicateOp, P.ParallelOp) and P.ReplicateOp.__name__ == "ReplicateOp"
    assert {c.__name__ for c in P.PARALLEL_OPS.values()} == {"RepartitionOp", "CombineOp", "ReplicateOp", "ReductionOp"}
    assert not any(hasattr(P, old) for old in ("Repartition", "Combine", "Replicate", "Reduction"))
    assert P.ReplicateOp(2, "pp").describe() == "ReplicateOp(degree=2, axis=pp)"


# --- degree rules (apply_shape) ---------------------------------------------------------------------------
def test_repartition_degree_rule():
    out = RepartitionOp(1, 2, "tp").apply_shape(pts((8, 12), (2, 3), 2, 4))
    assert out == pts((8, 12), (2, 6), 2, 2)


def test_combine_degree_rule():
    out = CombineOp(1, 3, "tp").apply_shape(pts((8, 12), (2, 6), 2, 1))
    assert out == pts((8, 12), (2, 2), 2, 3)


def test_replicate_degree_rule():
    out = P.ReplicateOp(4, "pp").apply_shape(pts((8, 12), (2, 1), 2, 3, "avg"))
    assert out == pts((8, 12), (2, 1), 2, 12, "avg")


def test_reduction_degree_rule():
    out = ReductionOp(2, "tp").apply_shape(pts((8,), (2,), 4, 1, "avg"))
    assert out == pts((8,), (2,), 2, 2, "avg")
    # the last partial axis reduced: nothing partial remains, the reduce op goes back to sum
    out = ReductionOp(2, "dp").apply_shape(pts((8,), (2,), 2, 2, "max"))
    assert out == pts((8,), (2,), 1, 4, "sum")


def test_repartition_indivisible():
    """One axis may cut a dim into uneven blocks (DTensor's chunks, stored padded: 2, 2, 2, 0 of 6 on 4); a second
    axis on that dim may not (two axes' blocks nest in another layout than one axis of their product's)."""
    out = RepartitionOp(0, 4, "tp").apply_shape(pts((6,), (1,), 1, 4))
    assert out == pts((6,), (4,), 1, 1) and out.piece_shape == (2,) and out.uneven == (0,)
    with pytest.raises(DegreeError) as ei:
        RepartitionOp(0, 2, "tp").apply_shape(pts((6,), (2,), 1, 2))
    assert (ei.value.dim, ei.value.size, ei.value.degree) == (0, 6, 4)
    assert "Repartition" in str(ei.value)


def test_repartition_needs_replicas():
    with pytest.raises(ShardingError, match="replica degree divisible by 2") as ei:
        RepartitionOp(0, 2, "tp").apply_shape(pts((8,), (2,), 1, 1))
    assert not isinstance(ei.value, DegreeError)
    with pytest.raises(ShardingError, match="replica degree divisible by 2"):
        RepartitionOp(0, 2, "tp").apply_shape(pts((8,), (1,), 1, 3))


@pytest.mark.parametrize("pop", [RepartitionOp(2, 2, "tp"), CombineOp(2, 2, "tp"), RepartitionOp(-1, 2, "tp")])
def test_dim_out_of_range(pop):
    with pytest.raises(ShardingError, match="out of range") as ei:
        pop.apply_shape(pts((4, 4), (2, 2), 1, 2))
    assert not isinstance(ei.value, DegreeError)


def test_combine_of_unsharded_dim():
    with pytest.raises(ShardingError, match="shard degree 1, not a multiple of 2"):
        CombineOp(0, 2, "tp").apply_shape(pts((8, 8), (1, 2)))
    with pytest.raises(ShardingError, match="shard degree 2, not a multiple of 4"):
        CombineOp(1, 4, "tp").apply_shape(pts((8, 8), (1, 2)))


def test_reduction_without_sum_degree():
    with pytest.raises(ShardingError, match="sum degree 1 is not a multiple of 2"):
        ReductionOp(2, "tp").apply_shape(pts((8,), (1,), 1, 2))


# --- axis rules (apply) -----------------------------------------------------------------------------------
MESH = Mesh.parse("dp=2,tp=2")
G = SubMesh(MESH)


def test_axis_rules_exact():
    s = Sharding.from_placements((Replicate(), Shard(0)), G, 2)
    assert RepartitionOp(1, 2, "dp").apply(s, G) == (Sharding((("tp",), ("dp",))), G)
    assert RepartitionOp(0, 2, "dp").apply(s, G) == (Sharding((("tp", "dp"), ())), G)
    assert CombineOp(0, 2, "tp").apply(s, G) == (Sharding.replicated(2), G)
    sp = Sharding.from_placements((Partial("avg"), Partial("avg")), G, 1)
    assert ReductionOp(2, "tp").apply(sp, G) == (Sharding(((),), ("dp",), "avg"), G)
    assert ReductionOp(2, "dp").apply(Sharding(((),), ("dp",), "avg"), G) == (Sharding(((),)), G)


def test_axis_rule_errors():
    s = Sharding.from_placements((Shard(0), Replicate()), G, 2)
    with pytest.raises(ShardingError, match="must hold replicas"):
        RepartitionOp(1, 2, "dp").apply(s, G)
    with pytest.raises(ShardingError, match="has 2 devices, not 4"):
        RepartitionOp(1, 4, "tp").apply(s, G)
    with pytest.raises(ShardingError, match="minor axis sharding dim 1"):
        CombineOp(1, 2, "dp").apply(s, G)
    two = Sharding((("dp", "tp"), ()))
    with pytest.raises(ShardingError, match="minor axis"):
        CombineOp(0, 2, "dp").apply(two, G)  # only the minor axis can be combined
    assert CombineOp(0, 2, "tp").apply(two, G)[0] == Sharding((("dp",), ()))
    with pytest.raises(ShardingError, match="no partial pieces along axis 'tp'"):
        ReductionOp(2, "tp").apply(s, G)
    with pytest.raises(ShardingError, match="out of range"):
        RepartitionOp(2, 2, "tp").apply(s, G)


def test_partial_on_size_one_axis_is_not_partial_in_degrees():
    """Axis rule and degree rule agree when the last partial axis of size > 1 is reduced."""
    mesh = Mesh(("a", "b"), (1, 2))
    g = SubMesh(mesh)
    s = Sharding(((),), ("a", "b"), "max")
    assert s.parallel_shape(g, (4,)).reduce_op == "max"
    out, _ = ReductionOp(2, "b").apply(s, g)
    assert out == Sharding(((),), ("a",), "max")
    assert out.parallel_shape(g, (4,)) == ReductionOp(2, "b").apply_shape(s.parallel_shape(g, (4,)))
    assert out.parallel_shape(g, (4,)).reduce_op == "sum"


@st.composite
def op_cases(draw):
    """A random sharding on a random (sub-)mesh and a parallel op whose axis rule accepts it."""
    n_axes = draw(st.integers(1, 3))
    names = ("pp", "dp", "tp")[:n_axes]
    sizes = tuple(draw(st.integers(1, 4)) for _ in names)
    mesh = Mesh(names, sizes)
    fixed = tuple((a, draw(st.integers(0, s - 1))) for a, s in zip(names, sizes) if draw(st.booleans()))
    group = SubMesh(mesh, fixed)
    ndim = draw(st.integers(1, 3))
    op = draw(st.sampled_from(["sum", "avg", "max"]))
    choices = [Shard(d) for d in range(ndim)] + [Replicate(), Partial(op)]
    pl = [draw(st.sampled_from(choices)) for _ in group.free_axes]
    s = Sharding.from_placements(pl, group, ndim)
    # every dim a multiple of the whole mesh size: any sharding on these axes divides it
    shape = tuple(mesh.size * draw(st.integers(1, 2)) for _ in range(ndim))
    cands = []
    for a in group.free_axes:
        k = mesh.axis_size(a)
        if a not in s.used_axes:
            cands += [RepartitionOp(d, k, a) for d in range(ndim)]
        if a in s.partial:
            cands.append(ReductionOp(k, a))
    for d, axes in enumerate(s.dims):
        if axes:
            cands.append(CombineOp(d, mesh.axis_size(axes[-1]), axes[-1]))
    cands += [P.ReplicateOp(mesh.axis_size(a), a) for a, _ in group.fixed]
    # never empty: a free axis is unused (Repartition), partial (Reduction) or sharding (Combine), else fixed
    return mesh, group, s, shape, draw(st.sampled_from(cands))


@FAST
@given(op_cases())
def test_axis_rule_matches_degree_rule(case):
    mesh, group, s, shape, pop = case
    out, out_group = pop.apply(s, group)
    out.check(out_group, shape)
    assert out.parallel_shape(out_group, shape) == pop.apply_shape(s.parallel_shape(group, shape))


# --- duality ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "placements",
    [(Replicate(), Replicate()), (Shard(0), Replicate()), (Partial(), Replicate()), (Shard(1), Replicate())],
)
@pytest.mark.parametrize("dim", [0, 1])
def test_repartition_then_combine_is_identity(placements, dim):
    s = Sharding.from_placements(placements, G, 2)
    r, g = RepartitionOp(dim, 2, "tp").apply(s, G)
    assert r != s
    back, g2 = CombineOp(dim, 2, "tp").apply(r, g)
    assert (back, g2) == (s, G)
    p = s.parallel_shape(G, (4, 4))
    assert CombineOp(dim, 2, "tp").apply_shape(RepartitionOp(dim, 2, "tp").apply_shape(p)) == p


def test_replicate_grows_the_group():
    mesh = Mesh.parse("pp=2,dp=2")
    stage = SubMesh(mesh, (("pp", 1),))
    s = Sharding.from_placements((Shard(0),), stage, 2)
    out, g = P.ReplicateOp(2, "pp").apply(s, stage)
    assert out == s and g == SubMesh(mesh)
    assert out.placements(g) == (Replicate(), Shard(0))
    assert s.parallel_shape(stage, (4, 4)).replica_degree == 1
    assert out.parallel_shape(g, (4, 4)).replica_degree == 2
    with pytest.raises(ShardingError, match="already spans axis 'pp'"):
        P.ReplicateOp(2, "pp").apply(out, g)
    with pytest.raises(ShardingError, match="has 2 devices, not 4"):
        P.ReplicateOp(4, "pp").apply(s, stage)


# --- what each op does to real pieces, and what it costs -------------------------------------------------
# Each op's data movement written from its definition (a split, an all-gather, an all-reduce, a broadcast), run on
# the pieces a real tensor has on each device: the result must be the pieces of the op's output sharding, and the
# bytes the planner charges (redistribution_cost) those of the one collective it lowers to — fused pairs included.
M23 = Mesh.parse("dp=2,tp=3")
G23 = SubMesh(M23)
X = torch.arange(72, dtype=torch.float64).reshape(6, 12) / 7  # float64[6, 12]: 576 bytes


@dataclass(frozen=True)
class _On:
    """A tensor of X's type held as ``sharding`` on ``group`` (what simulate's scatter and gather take)."""

    sharding: Sharding
    group: SubMesh
    type: TensorType = TensorType((6, 12), "float64")


def _peers(group, device, axis):
    """The devices of ``group`` that differ from ``device`` only on ``axis``, in the order of their coordinate."""
    here = group.coords(device)
    return [group.device_of({**here, axis: i}) for i in range(group.mesh.axis_size(axis))]


def _move(op, pieces, group):
    """``op`` carried out on real pieces (device → piece) as its collective would: Repartition splits each piece
    locally, Combine concatenates the pieces of its axis (all-gather), Reduction sums them (all-reduce), Replicate
    copies each piece to the devices of the axis it adds (broadcast)."""
    if isinstance(op, RepartitionOp):
        return {d: x.chunk(op.degree, op.dim)[group.coords(d)[op.axis]] for d, x in pieces.items()}
    if isinstance(op, CombineOp):
        return {d: torch.cat([pieces[p] for p in _peers(group, d, op.axis)], op.dim) for d in pieces}
    if isinstance(op, ReductionOp):
        return {d: sum(pieces[p] for p in _peers(group, d, op.axis)) for d in pieces}
    assert isinstance(op, P.ReplicateOp)
    whole = group.without_fixed(op.axis)
    return {d: pieces[group.device_of(whole.coords(d))].clone() for d in whole.devices()}


@pytest.mark.parametrize(
    "group, src, ops, cost",
    [
        # a local split: no bytes
        (G23, (Shard(0), Replicate()), [RepartitionOp(1, 3, "tp")], (0, 0)),
        # all-gather of a float64[3, 4] piece (96 bytes) among 3: each device sends its piece to 2 others
        (G23, (Shard(0), Shard(1)), [CombineOp(1, 3, "tp")], (2 * 96, 1)),
        # all-reduce of a float64[3, 12] piece (288 bytes) among 3: 2·(3−1)/3 of it
        (G23, (Shard(0), Partial()), [ReductionOp(3, "tp")], (2 * 288 * 2 // 3, 1)),
        # Reduction then Repartition: one reduce-scatter, (3−1)/3 of the piece — half the all-reduce's bytes
        (G23, (Shard(0), Partial()), [ReductionOp(3, "tp"), RepartitionOp(1, 3, "tp")], (288 * 2 // 3, 1)),
        # Combine then Repartition of another dim: one all-to-all of a float64[2, 12] piece (192 bytes)
        (G23, (Replicate(), Shard(0)), [CombineOp(0, 3, "tp"), RepartitionOp(1, 3, "tp")], (192 * 2 // 3, 1)),
        # the last partial axis first: the pieces stay partial on dp
        (G23, (Partial(), Partial()), [ReductionOp(3, "tp")], (2 * 576 * 2 // 3, 1)),
        # Replicate: a pipeline stage's pieces (dp=1) copied to the other stage; the planner never redistributes by it
        (SubMesh(M23, (("dp", 1),)), (Shard(1),), [P.ReplicateOp(2, "dp")], None),
    ],
    ids=["split", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "partial_all_reduce", "broadcast"],
)
def test_each_parallel_op_moves_the_pieces_of_its_output_sharding_at_its_collectives_cost(group, src, ops, cost):
    from shardflow.parallel.collectives import redistribution_cost
    from shardflow.parallel.simulate import gather, scatter

    here = _On(Sharding.from_placements(src, group, 2), group)
    pieces = scatter(X, here)
    shape = here.sharding.parallel_shape(group, X.shape, "float64")
    for op in ops:
        pieces = _move(op, pieces, here.group)
        here = _On(*op.apply(here.sharding, here.group))
        shape = op.apply_shape(shape)
        assert set(pieces) == set(here.group.devices())
        assert {tuple(x.shape) for x in pieces.values()} == {shape.piece_shape}
    if here.sharding.partial:  # random pieces that add up to X
        torch.testing.assert_close(gather(pieces, here), X, rtol=0, atol=1e-12)
    else:  # the block of X each device holds under the output sharding (sums of random pieces: to rounding)
        want = scatter(X, here)
        for d in want:
            torch.testing.assert_close(pieces[d], want[d], rtol=0, atol=1e-12)
    if cost is not None:
        start = Sharding.from_placements(src, group, 2)
        assert redistribution_cost(ops, start, group, here.type) == cost


# --- redistribute -----------------------------------------------------------------------------------------
T = SubMesh(Mesh.parse("tp=4"))


def _s(*placements, g=T, ndim=2):
    return Sharding.from_placements(placements, g, ndim)


@pytest.mark.parametrize(
    "src,dst,want",
    [
        ((Partial(),), (Replicate(),), [ReductionOp(4, "tp")]),
        ((Partial(),), (Shard(1),), [ReductionOp(4, "tp"), RepartitionOp(1, 4, "tp")]),
        ((Shard(0),), (Replicate(),), [CombineOp(0, 4, "tp")]),
        ((Replicate(),), (Shard(1),), [RepartitionOp(1, 4, "tp")]),
        ((Shard(0),), (Shard(1),), [CombineOp(0, 4, "tp"), RepartitionOp(1, 4, "tp")]),
        ((Shard(0),), (Shard(0),), []),
        ((Partial("avg"),), (Partial("avg"),), []),
    ],
)
def test_redistribute_table(src, dst, want):
    assert redistribute(_s(*src), _s(*dst), T) == want


def test_redistribute_two_axes():
    g = SubMesh(Mesh.parse("dp=2,tp=3"))
    src = _s(Shard(0), Shard(0), g=g)  # dim 0 on dp (major) then tp
    assert redistribute(src, _s(Shard(0), Replicate(), g=g), g) == [CombineOp(0, 3, "tp")]
    # removing the major axis needs the minor one combined first
    assert redistribute(src, _s(Replicate(), Shard(0), g=g), g) == [
        CombineOp(0, 3, "tp"),
        CombineOp(0, 2, "dp"),
        RepartitionOp(0, 3, "tp"),
    ]
    assert redistribute(_s(Partial(), Shard(1), g=g), _s(Shard(1), Shard(0), g=g), g) == [
        ReductionOp(2, "dp"),
        CombineOp(1, 3, "tp"),
        RepartitionOp(0, 3, "tp"),
        RepartitionOp(1, 2, "dp"),
    ]


def test_redistribute_cuts_the_pieces_before_it_sums_them():
    """A partial axis that ends sharding a dim is reduce-scattered before the other partial axes are all-reduced (the
    all-reduce then moves the piece, not the whole: HSDP's gradient), and a local split comes before an all-reduce."""
    g = SubMesh(Mesh.parse("dp=2,fsdp=3"))
    assert redistribute(_s(Partial(), Partial(), g=g), _s(Replicate(), Shard(0), g=g), g) == [
        ReductionOp(3, "fsdp"),
        RepartitionOp(0, 3, "fsdp"),
        ReductionOp(2, "dp"),
    ]
    assert redistribute(_s(Partial(), Replicate(), g=g), _s(Replicate(), Shard(1), g=g), g) == [
        RepartitionOp(1, 3, "fsdp"),
        ReductionOp(2, "dp"),
    ]
    assert redistribute(_s(Partial(), Partial(), g=g), _s(Replicate(), Replicate(), g=g), g) == [
        ReductionOp(2, "dp"),
        ReductionOp(3, "fsdp"),
    ]
    # bytes one device sends for a float32[6, 4] (N = 96 bytes): the reduce-scatter's (F−1)/F·N = 64, then
    # 2(D−1)/D of the N/F piece = 32 (summing first would send N + 64 = 160)
    from shardflow.parallel.collectives import redistribution_cost

    src = _s(Partial(), Partial(), g=g)
    ops = redistribute(src, _s(Replicate(), Shard(0), g=g), g)
    assert redistribution_cost(ops, src, g, TensorType((6, 4), "float32")) == (64 + 32, 2)


def test_redistribute_errors():
    with pytest.raises(ShardingError, match="partial pieces are made by ops"):
        redistribute(_s(Replicate()), _s(Partial()), T)
    with pytest.raises(ShardingError, match="different number of dims"):
        redistribute(_s(Replicate()), _s(Replicate(), ndim=3), T)
    g = SubMesh(Mesh.parse("dp=2,tp=2"))
    with pytest.raises(ShardingError, match="different partial reduce ops"):
        redistribute(Sharding(((),), ("dp", "tp"), "sum"), Sharding(((),), ("dp",), "avg"), g)


@st.composite
def redistribute_cases(draw):
    names = ("dp", "tp")[: draw(st.integers(1, 2))]
    mesh = Mesh(names, tuple(draw(st.integers(1, 4)) for _ in names))
    g = SubMesh(mesh)
    ndim = draw(st.integers(1, 3))
    op = draw(st.sampled_from(["sum", "avg"]))
    src_pl = [draw(st.sampled_from([Shard(d) for d in range(ndim)] + [Replicate(), Partial(op)])) for _ in names]
    dst_pl = [
        draw(
            st.sampled_from(
                [Shard(d) for d in range(ndim)] + [Replicate()] + ([Partial(op)] if p == Partial(op) else [])
            )
        )
        for p in src_pl
    ]
    shape = tuple(mesh.size * draw(st.integers(1, 2)) for _ in range(ndim))
    return g, Sharding.from_placements(src_pl, g, ndim), Sharding.from_placements(dst_pl, g, ndim), shape


@FAST
@given(redistribute_cases())
def test_redistribute_reaches_target(case):
    g, src, dst, shape = case
    pops = redistribute(src, dst, g)
    cur, cur_g, p = src, g, src.parallel_shape(g, shape)
    for pop in pops:
        cur, cur_g = pop.apply(cur, cur_g)
        p = pop.apply_shape(p)
        assert cur.parallel_shape(cur_g, shape) == p
    assert (cur, cur_g) == (dst, g)
    assert p == dst.parallel_shape(g, shape)
    # each axis is moved at most twice (taken off, put on) and nothing is done when src == dst
    assert len(pops) <= 2 * len(g.free_axes)
    if src == dst:
        assert pops == []
