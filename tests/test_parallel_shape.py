"""Parallel tensor shapes, meshes, placements and shardings (docs/concepts.md#2-mesh-placements-parallel-shapes)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.parallel.mesh import Mesh, Partial, Replicate, Shard, SubMesh, parse_placement
from shardflow.parallel.shape import DegreeError, ParallelTensorShape, ShardCoord, ShardingError
from shardflow.parallel.sharding import Sharding, placements_for

FAST = settings(max_examples=100, deadline=None)


# --- ParallelTensorShape --------------------------------------------------------------------------------
def test_piece_shape_num_pieces_and_coords():
    p = ParallelTensorShape((8, 6, 5), (2, 3, 1), sum_degree=2, replica_degree=3)
    assert p.piece_shape == (4, 2, 5)
    assert p.piece_numel == 40
    assert p.num_pieces == 2 * 3 * 2 * 3
    coords = list(p.coords())
    assert len(coords) == 36
    assert len(set(coords)) == 36
    # sum index outermost, then replica, then shard indices row-major
    assert coords[0] == ShardCoord(0, 0, (0, 0, 0))
    assert coords[1] == ShardCoord(0, 0, (0, 1, 0))
    assert coords[6] == ShardCoord(0, 1, (0, 0, 0))
    assert coords[18] == ShardCoord(1, 0, (0, 0, 0))
    assert p.piece_slices(ShardCoord(1, 2, (1, 2, 0))) == (slice(4, 8), slice(4, 6), slice(0, 5))


def test_unparallel_is_one_piece():
    p = ParallelTensorShape.unparallel((3, 4))
    assert p.shard == (1, 1) and p.sum_degree == 1 and p.replica_degree == 1
    assert p.num_pieces == 1
    assert list(p.coords()) == [ShardCoord(0, 0, (0, 0))]
    assert p.piece_shape == (3, 4)


def test_scalar_shape_has_one_piece_per_sum_and_replica():
    p = ParallelTensorShape((), (), sum_degree=2, replica_degree=2)
    assert p.num_pieces == 4
    assert p.piece_shape == ()
    assert [c.shard for c in p.coords()] == [()] * 4


def test_uneven_dim_is_dtensor_s_chunk_layout_stored_padded():
    """6 on 4 devices: blocks of ⌈6/4⌉ = 2 — 2, 2, 2, 0 (torch.chunk's sizes, then DTensor's empty block) — each
    piece stored at 2, the empty one all padding; a piece cut from a tensor and its valid part round-trip."""
    p = ParallelTensorShape((8, 6), (1, 4))
    assert p.uneven == (1,) and p.piece_shape == (8, 2)
    coords = [c for c in p.coords()]
    want = [t.shape[0] for t in torch.arange(6).chunk(4)] + [0]
    assert [p.piece_valid(c)[1] for c in coords] == want == [2, 2, 2, 0]
    full = torch.arange(48.0).view(8, 6)
    for c in coords:
        piece = p.piece_of(full, c)
        assert piece.shape == (8, 2)
        assert torch.equal(p.valid_of(piece, c), full[p.piece_index(c)])
        assert not piece[:, p.piece_valid(c)[1] :].any()  # the padding is zero
    q = ParallelTensorShape((10,), (4,))
    assert [q.piece_valid(c)[0] for c in q.coords()] == [3, 3, 3, 1]
    assert ParallelTensorShape((8, 6), (2, 3)).uneven == ()


def test_degree_error_names_dim_size_degree():
    with pytest.raises(DegreeError) as ei:
        Sharding((("dp", "tp"), ())).check(SubMesh(Mesh.parse("dp=2,tp=2")), (6, 4), uneven=True)
    e = ei.value
    assert (e.dim, e.size, e.degree) == (0, 6, 4)
    assert "degree 4" in str(e) and "dim 0" in str(e) and "size 6" in str(e)
    with pytest.raises(DegreeError) as ei:
        Sharding(((), ("tp",))).check(SubMesh(Mesh.parse("tp=4")), (8, 6))
    e = ei.value
    assert (e.dim, e.size, e.degree) == (1, 6, 4)
    msg = str(e)
    assert "degree 4" in msg and "dim 1" in msg and "size 6" in msg
    assert isinstance(e, ShardingError)


def test_degree_error_at_adds_op_and_tensor():
    e = DegreeError(2, 10, 3)
    assert "op " not in str(e) and "tensor " not in str(e)
    e2 = e.at("fc1", "h")
    assert (e2.dim, e2.size, e2.degree, e2.op, e2.tensor) == (2, 10, 3, "fc1", "h")
    msg = str(e2)
    assert "op 'fc1'" in msg and "tensor 'h'" in msg
    assert "degree 3" in msg and "dim 2" in msg and "size 10" in msg
    # a later .at keeps what it does not override
    e3 = e2.at(hint="in module 'blk'")
    assert e3.op == "fc1" and e3.tensor == "h" and "in module 'blk'" in str(e3)


def test_wrong_length_shard_tuple():
    with pytest.raises(ShardingError, match="2 shard degrees for 3 dims"):
        ParallelTensorShape((4, 4, 4), (1, 2))
    with pytest.raises(ShardingError) as ei:
        ParallelTensorShape((4,), (1, 1))
    assert not isinstance(ei.value, DegreeError)


def test_bad_degrees_and_reduce_op():
    with pytest.raises(ShardingError, match="≥ 1"):
        ParallelTensorShape((4,), (0,))
    with pytest.raises(ShardingError, match="≥ 1"):
        ParallelTensorShape((4,), (1,), sum_degree=0)
    with pytest.raises(ShardingError, match="reduce_op"):
        ParallelTensorShape((4,), (1,), reduce_op="prod")


@st.composite
def parallel_shapes(draw):
    ndim = draw(st.integers(1, 3))
    shard = tuple(draw(st.integers(1, 3)) for _ in range(ndim))
    shape = tuple(d * draw(st.integers(1, 3)) for d in shard)  # a product: the degree divides
    return ParallelTensorShape(shape, shard, draw(st.integers(1, 3)), draw(st.integers(1, 3)))


@FAST
@given(parallel_shapes())
def test_pieces_tile_tensor_once_per_sum_and_replica(p):
    count = torch.zeros((p.sum_degree, p.replica_degree) + p.shape, dtype=torch.int64)
    n = 0
    for c in p.coords():
        sl = p.piece_slices(c)
        assert tuple(s.stop - s.start for s in sl) == p.piece_shape
        count[(c.sum, c.replica) + sl] += 1
        n += 1
    assert n == p.num_pieces
    assert bool((count == 1).all())


# --- Mesh -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["dp2", "", "dp=0", "dp=x", "dp=2,dp=2", "=2"])
def test_mesh_parse_errors(text):
    with pytest.raises(ValueError):
        Mesh.parse(text)


def test_mesh_parse_and_devices():
    m = Mesh.parse(" dp=2 , tp=3 ")
    assert m == Mesh(("dp", "tp"), (2, 3))
    assert str(m) == "dp=2,tp=3"
    assert m.size == 6 and m.ndim == 2
    assert m.coords(4) == (1, 1)  # row-major: device = dp*3 + tp
    assert m.device((1, 2)) == 5
    with pytest.raises(ValueError, match="no axis 'pp'"):
        m.axis_index("pp")


def test_mesh_coords_device_inverse():
    m = Mesh(("a", "b", "c"), (2, 3, 4))
    seen = set()
    for d in range(m.size):
        c = m.coords(d)
        assert all(0 <= x < s for x, s in zip(c, m.shape))
        assert m.device(c) == d
        seen.add(c)
    assert len(seen) == m.size


def test_submesh_devices_and_fix():
    m = Mesh(("pp", "dp"), (2, 3))
    g = SubMesh(m, (("pp", 1),))
    assert g.free_axes == ("dp",)
    assert list(g.devices()) == [3, 4, 5]
    assert g.size == 3
    assert str(g) == "mesh[pp=1]"
    assert g.without_fixed("pp") == SubMesh(m)
    assert SubMesh(m).with_fixed("pp", 1) == g
    with pytest.raises(ValueError, match="out of range"):
        SubMesh(m, (("pp", 2),))


@pytest.mark.parametrize("view", [None, (5, 1, 3)])
@pytest.mark.parametrize("coord", [3, -1])
def test_device_of_an_out_of_range_coordinate_names_axis_coordinate_size_and_sub_mesh(view, coord):
    """It used to wrap silently without a view (dp=3 on mesh[pp=1] gave device 3, the member at dp=0) and to
    raise a bare IndexError with one."""
    g = SubMesh(Mesh(("pp", "dp"), (2, 3)), (("pp", 1),), view)
    assert [g.device_of({"dp": i}) for i in range(3)] == list(g.devices())
    where = "mesh[pp=1]" + ("@[5, 1, 3]" if view else "")
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(where)} of mesh pp=2,dp=3: coordinate {coord} on axis 'dp', "
        r"which has 3 devices \(coordinates 0\.\.2\)",
    ):
        g.device_of({"dp": coord})
    with pytest.raises(ValueError, match="no coordinate on axis 'dp'"):
        g.device_of({"pp": 1})


def test_parse_placement():
    assert parse_placement("S(1)") == Shard(1)
    assert parse_placement("Shard(0)") == Shard(0)
    assert parse_placement("R") == Replicate()
    assert parse_placement("P") == Partial("sum")
    assert parse_placement("Partial('avg')") == Partial("avg")
    with pytest.raises(ValueError):
        parse_placement("Q(1)")
    with pytest.raises(ValueError):
        Partial("prod")


# --- Sharding ↔ placements ↔ parallel shapes -----------------------------------------------------------
@st.composite
def placed(draw):
    """A random (mesh, sub-mesh, placements, shape): 1-D or 2-D meshes with axis sizes 1-4."""
    ndim_mesh = draw(st.integers(1, 2))
    names = ("dp", "tp")[:ndim_mesh]
    sizes = tuple(draw(st.integers(1, 4)) for _ in names)
    mesh = Mesh(names, sizes)
    group = SubMesh(mesh)
    ndim = draw(st.integers(1, 3))
    op = draw(st.sampled_from(["sum", "avg", "max", "min"]))
    choices = [Shard(d) for d in range(ndim)] + [Replicate(), Partial(op)]
    pl = tuple(draw(st.sampled_from(choices)) for _ in names)
    shape = []
    for d in range(ndim):
        deg = math.prod(s for s, p in zip(sizes, pl) if p == Shard(d))
        shape.append(deg * draw(st.integers(1, 3)))
    return mesh, group, pl, tuple(shape)


@FAST
@given(placed())
def test_placements_round_trip(case):
    mesh, group, pl, shape = case
    s = Sharding.from_placements(pl, group, len(shape))
    assert s.placements(group) == pl
    s.check(group, shape)


@FAST
@given(placed())
def test_parallel_shape_round_trip(case):
    mesh, group, pl, shape = case
    s = Sharding.from_placements(pl, group, len(shape))
    p = s.parallel_shape(group, shape)
    back = Sharding.from_placements(placements_for(p, group), group, len(shape))
    assert back.parallel_shape(group, shape) == p


@FAST
@given(placed())
def test_device_map_is_bijection_onto_pieces(case):
    mesh, group, pl, shape = case
    s = Sharding.from_placements(pl, group, len(shape))
    p = s.parallel_shape(group, shape)
    dmap = s.device_map(group)
    assert sorted(dmap) == list(range(mesh.size))
    assert len(set(dmap.values())) == len(dmap) == p.num_pieces
    assert set(dmap.values()) == set(p.coords())


def test_placements_on_submesh_are_per_free_axis():
    mesh = Mesh(("pp", "dp", "tp"), (2, 2, 2))
    g = SubMesh(mesh, (("pp", 1),))
    s = Sharding.from_placements((Shard(1), Partial("avg")), g, 2)
    assert s == Sharding(((), ("dp",)), ("tp",), "avg")
    assert s.placements(g) == (Shard(1), Partial("avg"))
    p = s.parallel_shape(g, (4, 4))
    assert (p.shard, p.sum_degree, p.replica_degree, p.reduce_op) == ((1, 2), 2, 1, "avg")
    dmap = s.device_map(g)
    assert sorted(dmap) == [4, 5, 6, 7]
    assert dmap[6] == ShardCoord(0, 0, (0, 1))  # pp=1, dp=1, tp=0
    # a dict names only some axes; the rest replicate
    assert Sharding.from_placements({"tp": Shard(0)}, g, 2) == Sharding((("tp",), ()))
    with pytest.raises(ShardingError, match="not free axes"):
        Sharding.from_placements({"pp": Shard(0)}, g, 2)


def test_two_axes_shard_one_dim_major_first():
    mesh = Mesh.parse("dp=2,tp=2")
    g = SubMesh(mesh)
    s = Sharding.from_placements((Shard(0), Shard(0)), g, 1)
    assert s.dims == (("dp", "tp"),)
    p = s.parallel_shape(g, (8,))
    assert p.shard == (4,) and p.piece_shape == (2,)
    dmap = s.device_map(g)
    block = {d: dmap[d].shard[0] for d in dmap}
    assert block[mesh.device((0, 0))] == 0
    assert block[mesh.device((0, 1))] == 1
    assert block[mesh.device((1, 0))] == 2
    assert block[mesh.device((1, 1))] == 3
    assert p.piece_slices(dmap[mesh.device((1, 0))]) == (slice(4, 6),)
    # the same axes in the other order cannot be spelled as placements
    with pytest.raises(ShardingError, match="out of mesh order"):
        Sharding((("tp", "dp"),)).placements(g)


def test_from_placements_errors():
    g = SubMesh(Mesh.parse("dp=2,tp=2"))
    with pytest.raises(ShardingError, match="2 axes"):
        Sharding.from_placements((Shard(0),), g, 1)
    with pytest.raises(ShardingError, match="out of range"):
        Sharding.from_placements((Shard(1), Replicate()), g, 1)
    with pytest.raises(ShardingError, match="different ops"):
        Sharding.from_placements((Partial("sum"), Partial("avg")), g, 1)
    with pytest.raises(ShardingError, match="used twice"):
        Sharding((("dp",),), ("dp",))
    assert Sharding.from_placements((Shard(-1), Replicate()), g, 2) == Sharding(((), ("dp",)))


def test_check_reports_indivisible_dim_with_axes():
    g = SubMesh(Mesh.parse("dp=2,tp=3"))
    s = Sharding.from_placements((Replicate(), Shard(1)), g, 2)
    with pytest.raises(DegreeError) as ei:
        s.check(g, (4, 8), "fc", "h")
    e = ei.value
    assert (e.dim, e.size, e.degree, e.op, e.tensor) == (1, 8, 3, "fc", "h")
    assert "tp" in str(e)
    gp = SubMesh(Mesh.parse("dp=2,tp=3"), (("tp", 0),))
    with pytest.raises(ShardingError, match="not a free axis"):
        Sharding((("tp",), ())).check(gp, (3, 3))


def test_placements_for_impossible():
    g = SubMesh(Mesh.parse("dp=2"))
    with pytest.raises(ShardingError, match="cannot be placed"):
        placements_for(ParallelTensorShape((6,), (3,)), g)
