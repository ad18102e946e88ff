"""Sharding rules at planning level (docs/concepts.md#4-sharding-rules-and-partial-sums): graphs built with
GraphBuilder, sharded with build_pcg, checked for exact placements / inserted parallel ops / local scales, and for
numbers with simulate_outputs.

Numbers are compared in float64 with atol 1e-10: the sharded run adds the same terms in another order (and
partial pieces carry random offsets that cancel), so the only differences are float64 round-off, ~1e-15 on
values of order 1-10; a wrong rule (a missing or extra 1/degree scale, a wrong block) is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from shardflow.graph import GraphBuilder
from shardflow.graph import ops as O
from shardflow.graph.ops import Scalar
from shardflow.parallel import ops as P
from shardflow.parallel.mesh import Mesh, Partial, Replicate, Shard, SubMesh
from shardflow.parallel.ops import CombineOp, ReductionOp, RepartitionOp
from shardflow.parallel.pcg import Annotations, build_pcg, lift
from shardflow.parallel.rules import RuleError, reshape_groups
from shardflow.parallel.shape import DegreeError, ShardingError
from shardflow.parallel.sharding import Sharding
from shardflow.parallel.simulate import gather, simulate, simulate_outputs

F64 = "float64"
ATOL = 1e-10
R = Replicate()


def sh(mesh: Mesh, ndim: int, *placements, group: SubMesh | None = None) -> Sharding:
    return Sharding.from_placements(placements, group or SubMesh(mesh), ndim)


def leaf_values(graph, ints: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float64 values for every input and weight not given in ``ints``."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(ints or {})
    for name, t in graph.tensors.items():
        if t.role in ("input", "weight") and name not in out:
            out[name] = torch.randn(t.shape, dtype=torch.float64, generator=gen)
    return out


def check_numbers(graph, pcg, leaves) -> dict[str, torch.Tensor]:
    """Every graph tensor, and every graph output after its layout, equals the single-device value."""
    want = simulate_outputs(lift(graph), leaves)
    got = simulate_outputs(pcg, leaves)
    assert set(got) == set(want)
    for name in want:
        assert torch.allclose(got[name], want[name], atol=ATOL, rtol=0), name
    values = simulate(pcg, leaves)
    for g_out, p_out in zip(graph.outputs, pcg.outputs):
        full = gather(values[p_out], pcg.tensors[p_out])
        assert torch.allclose(full, want[g_out], atol=ATOL, rtol=0), p_out
    return want


def pops(pcg):
    """The inserted parallel ops, as (op, input tensor)."""
    return [(n.op, n.inputs[0]) for n in pcg.parallel_nodes]


def node(pcg, name):
    return next(n for n in pcg.nodes if n.name == name)


MESH = Mesh.parse("dp=2,tp=2")
TP4 = Mesh.parse("tp=4")


# --- linear ---------------------------------------------------------------------------------------------
def _mlp(x_shape=(4, 8), out=6):
    b = GraphBuilder()
    x = b.input("x", x_shape, F64)
    y = b.dense(x, out, name="fc")
    return b, x, y


def test_linear_batch_sharded():
    b, x, y = _mlp()
    graph = b.build([y])
    pcg = build_pcg(graph, MESH, Annotations(leaves={"x": sh(MESH, 2, Shard(0), R)}))
    assert pcg.tensors[y].placements == (Shard(0), R)
    assert pcg.tensors[y].pshape.shard == (2, 1) and pcg.tensors[y].pshape.replica_degree == 2
    assert pcg.parallel_nodes == ()
    assert node(pcg, y).local.in_scale == (1.0, 1.0, 1.0)
    check_numbers(graph, pcg, leaf_values(graph))


def test_linear_row_parallel_partial_then_reduction():
    b, x, y = _mlp()
    z = b.relu(y)
    graph = b.build([z])
    ann = Annotations(
        leaves={"x": sh(MESH, 2, R, Shard(1)), "fc.weight": sh(MESH, 2, R, Shard(1))}, after={y: {"tp": R}}
    )
    pcg = build_pcg(graph, MESH, ann)
    assert pcg.tensors[y].placements == (R, Partial("sum"))
    assert pcg.tensors[y].pshape.sum_degree == 2
    # the replicated bias is added once in total: each of the 2 partial pieces adds half of it
    assert node(pcg, y).local.in_scale == (1.0, 1.0, 0.5)
    assert pops(pcg) == [(ReductionOp(2, "tp"), y)]
    assert pcg.tensors[pcg.parallel_nodes[0].outputs[0]].placements == (R, R)
    assert node(pcg, z).inputs == (pcg.parallel_nodes[0].outputs[0],)
    assert pcg.tensors[z].placements == (R, R)
    check_numbers(graph, pcg, leaf_values(graph))


def test_linear_row_parallel_without_bias_has_no_scale():
    b = GraphBuilder()
    x = b.input("x", (4, 8), F64)
    y = b.dense(x, 6, bias=False, name="fc")
    graph = b.build([y])
    ann = Annotations(
        leaves={"x": sh(MESH, 2, Shard(0), Shard(1)), "fc.weight": sh(MESH, 2, R, Shard(1))}, after={y: {"tp": R}}
    )
    pcg = build_pcg(graph, MESH, ann)
    assert pcg.tensors[y].placements == (Shard(0), Partial("sum"))
    assert node(pcg, y).local.in_scale == (1.0, 1.0)
    assert pops(pcg) == [(ReductionOp(2, "tp"), y)]
    check_numbers(graph, pcg, leaf_values(graph))


def test_linear_column_parallel():
    b, x, y = _mlp((2, 3, 8), 6)
    graph = b.build([y])
    ann = Annotations(
        leaves={"fc.weight": sh(MESH, 2, R, Shard(0)), "fc.bias": sh(MESH, 1, R, Shard(0))}, after={y: {"tp": R}}
    )
    pcg = build_pcg(graph, MESH, ann)
    assert pcg.tensors[y].placements == (R, Shard(2))
    assert pcg.tensors[y].pshape.shard == (1, 1, 2)
    assert node(pcg, y).local.in_scale == (1.0, 1.0, 1.0)
    assert pops(pcg) == [(CombineOp(2, 2, "tp"), y)]
    check_numbers(graph, pcg, leaf_values(graph))


def test_linear_bias_must_follow_weight():
    b, x, y = _mlp()
    graph = b.build([y])
    with pytest.raises(RuleError, match="'fc.bias'"):
        build_pcg(graph, MESH, Annotations(leaves={"fc.weight": sh(MESH, 2, R, Shard(0))}), strict=True)


def test_linear_mismatched_in_features():
    b, x, y = _mlp()
    graph = b.build([y])
    with pytest.raises(RuleError, match="dim 1 of 'x' is sharded on \\['tp'\\] but dim 1 of 'fc.weight'"):
        build_pcg(graph, MESH, Annotations(leaves={"x": sh(MESH, 2, R, Shard(1))}), strict=True)


# --- element-wise linearity -----------------------------------------------------------------------------
P4 = Sharding(((), ()), ("tp",), "sum")  # Partial('sum') on the 4 devices of TP4
P4_AVG = Sharding(((), ()), ("tp",), "avg")
P4_MAX = Sharding(((), ()), ("tp",), "max")


def _binary(fn, x_sh, y_sh, y_shape=(4, 6), mesh=TP4, positive_y=False):
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    y = b.input("y", y_shape, F64)
    z = getattr(b, fn)(x, y)
    graph = b.build([z])
    leaves = {}
    if x_sh is not None:
        leaves["x"] = x_sh
    if y_sh is not None:
        leaves["y"] = y_sh
    values = leaf_values(graph)
    if positive_y:
        values["y"] = values["y"].abs() + 1.0
    return graph, z, Annotations(leaves=leaves, after={z: {a: R for a in mesh.axis_names}}), values


@pytest.mark.parametrize(
    "fn,x_sh,y_sh,want_partial,scale",
    [
        ("add", P4, P4, P4, (1.0, 1.0)),
        ("sub", P4, P4, P4, (1.0, 1.0)),
        ("add", P4, None, P4, (1.0, 0.25)),
        ("add", None, P4, P4, (0.25, 1.0)),
        ("sub", P4, None, P4, (1.0, 0.25)),
        ("sub", None, P4, P4, (0.25, 1.0)),
        ("add", P4_AVG, None, P4_AVG, (1.0, 1.0)),
        ("sub", None, P4_AVG, P4_AVG, (1.0, 1.0)),
        ("add", P4_AVG, P4_AVG, P4_AVG, (1.0, 1.0)),
        ("mul", P4, None, P4, (1.0, 1.0)),
        ("mul", None, P4, P4, (1.0, 1.0)),
        ("mul", P4_AVG, None, P4_AVG, (1.0, 1.0)),
        ("div", P4, None, P4, (1.0, 1.0)),
    ],
)
def test_elementwise_partial_rules(fn, x_sh, y_sh, want_partial, scale):
    graph, z, ann, values = _binary(fn, x_sh, y_sh, positive_y=(fn == "div"))
    pcg = build_pcg(graph, TP4, ann)
    assert pcg.tensors[z].sharding == want_partial
    assert pcg.tensors[z].placements == (Partial(want_partial.reduce_op),)
    assert node(pcg, z).local.in_scale == scale
    assert pops(pcg) == [(ReductionOp(4, "tp"), z)]
    check_numbers(graph, pcg, values)


def test_partial_plus_broadcast_replicated():
    graph, z, ann, values = _binary("add", P4, None, y_shape=(6,))
    pcg = build_pcg(graph, TP4, ann)
    assert pcg.tensors[z].placements == (Partial("sum"),)
    assert node(pcg, z).local.in_scale == (1.0, 0.25)
    check_numbers(graph, pcg, values)


def test_partial_plus_replicated_on_two_axes():
    """The replicated operand is divided by the whole sum degree (product of the partial axes)."""
    p = Sharding(((), ()), ("dp", "tp"), "sum")
    graph, z, ann, values = _binary("add", None, p, mesh=MESH)
    pcg = build_pcg(graph, MESH, ann)
    assert pcg.tensors[z].placements == (Partial("sum"), Partial("sum"))
    assert node(pcg, z).local.in_scale == (0.25, 1.0)
    assert pops(pcg) == [(ReductionOp(2, "dp"), z), (ReductionOp(2, "tp"), f"{z}.reduction")]
    check_numbers(graph, pcg, values)


@pytest.mark.parametrize(
    "fn,value,local_value",
    [
        ("add", 3.0, 0.75),
        ("sub", 3.0, 0.75),
        ("rsub", 2.0, 0.5),
        ("mul", 3.0, 3.0),
        ("div", 2.0, 2.0),
    ],
)
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_partial_and_scalar(fn, value, local_value, reduce_op):
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    z = b.sub(value, x) if fn == "rsub" else getattr(b, fn)(x, value)
    graph = b.build([z])
    s = Sharding(((), ()), ("tp",), reduce_op)
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": s}, after={z: {"tp": R}}))
    assert pcg.tensors[z].sharding == s
    if reduce_op == "avg":
        local_value = value  # avg pieces each carry the whole scalar
    assert node(pcg, z).local.op == Scalar(fn, local_value)
    assert node(pcg, z).local.in_scale == (1.0,)
    check_numbers(graph, pcg, leaf_values(graph))


def test_scalar_on_replicated_is_unchanged():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    z = b.add(x, 3.0)
    graph = b.build([z])
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": Sharding((("tp",), ()))}))
    assert node(pcg, z).local.op == Scalar("add", 3.0)
    assert pcg.tensors[z].placements == (Shard(0),)
    check_numbers(graph, pcg, leaf_values(graph))


def test_neg_of_partial():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    z = b.neg(x)
    graph = b.build([z])
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": P4}, after={z: {"tp": R}}))
    assert pcg.tensors[z].sharding == P4
    check_numbers(graph, pcg, leaf_values(graph))


@pytest.mark.parametrize("fn", ["mul", "div"])
def test_partial_times_partial_is_rejected(fn):
    graph, z, ann, _ = _binary(fn, P4, P4)
    with pytest.raises(RuleError, match="Reduction") as ei:
        build_pcg(graph, TP4, ann, strict=True)
    assert "'y'" in str(ei.value) and f"node {z!r}" in str(ei.value)


def test_division_by_partial_is_rejected():
    graph, z, ann, _ = _binary("div", None, P4)
    with pytest.raises(RuleError, match="division by a partial operand 'y'.*ReductionOp\\(axis=tp\\)"):
        build_pcg(graph, TP4, ann, strict=True)


def test_scalar_divided_by_partial_is_rejected():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    b.div(1.0, x)
    graph = b.build([])
    with pytest.raises(RuleError, match="'x'.*Reduction"):
        build_pcg(graph, TP4, Annotations(leaves={"x": P4}), strict=True)


def test_partials_on_different_axes_are_rejected():
    graph, z, ann, _ = _binary("add", Sharding(((), ()), ("dp",)), Sharding(((), ()), ("tp",)), mesh=MESH)
    with pytest.raises(RuleError, match="different axes.*Reduction"):
        build_pcg(graph, MESH, ann, strict=True)


@pytest.mark.parametrize("fn,other", [("add", None), ("add", "max"), ("mul", None), ("sub", None)])
def test_partial_max_is_not_linear(fn, other):
    graph, z, ann, _ = _binary(fn, P4_MAX, P4_MAX if other else None)
    with pytest.raises(RuleError, match="'x' holds Partial\\('max'\\).*ReductionOp\\(axis=tp\\)"):
        build_pcg(graph, TP4, ann, strict=True)


@pytest.mark.parametrize("build", [lambda b, x: b.mul(x, 2.0), lambda b, x: b.add(x, 1.0), lambda b, x: b.sum(x, 1)])
def test_partial_max_rejected_by_linear_ops(build):
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    build(b, x)
    graph = b.build([])
    with pytest.raises(RuleError, match="Partial\\('max'\\).*Reduction"):
        build_pcg(graph, TP4, Annotations(leaves={"x": P4_MAX}), strict=True)


@pytest.mark.parametrize(
    "fn,reduce_op,want",
    [
        ("relu", "max", "max"),
        ("tanh", "max", "max"),
        ("relu", "min", "min"),
        ("tanh", "min", "min"),
        ("neg", "max", "min"),
        ("neg", "min", "max"),
    ],
)
def test_monotone_functions_keep_partial_max_and_min(fn, reduce_op, want):
    """f(max(a, b)) = max(f(a), f(b)) for a non-decreasing f, min(f(a), f(b)) for a non-increasing one (DTensor's
    _NON_DECREASING_RULES and _NEG_RULES): the pieces pass through with no communication."""
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    z = b.unary(fn, x)
    graph = b.build([z])
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": Sharding(((), ()), ("tp",), reduce_op)}), strict=True)
    assert pcg.tensors[z].sharding == Sharding(((), ()), ("tp",), want)
    assert pcg.parallel_nodes == ()
    check_numbers(graph, pcg, leaf_values(graph))


def test_gelu_is_not_monotone():
    """gelu dips below 0 left of the origin, so max does not commute with it."""
    graph, _ = _nonlinear_graph("gelu")
    with pytest.raises(RuleError, match="not linear but input 'x' holds Partial\\('max'\\)"):
        build_pcg(graph, TP4, Annotations(leaves={"x": P4_MAX}), strict=True)


# --- nonlinear ops on partials --------------------------------------------------------------------------
def _nonlinear_graph(kind):
    b = GraphBuilder()
    if kind == "attention":
        x = b.input("x", (2, 2, 4, 4), F64)
        k = b.input("k", (2, 2, 4, 4), F64)
        b.attention(x, k, k)
    elif kind == "cross_entropy":
        x = b.input("x", (4, 6), F64)
        t = b.input("t", (4,), "int64")
        b.cross_entropy(x, t)
    elif kind == "layer_norm":
        x = b.input("x", (4, 6), F64)
        b.layer_norm(x)
    elif kind == "dropout":
        x = b.input("x", (4, 6), F64)
        b.dropout(x, 0.0)
    else:
        x = b.input("x", (4, 6), F64)
        getattr(b, kind)(x)
    return b.build([]), len(b.shape(x))


@pytest.mark.parametrize(
    "kind", ["relu", "gelu", "tanh", "softmax", "layer_norm", "attention", "cross_entropy", "dropout"]
)
def test_nonlinear_on_partial_is_rejected(kind):
    graph, ndim = _nonlinear_graph(kind)
    with pytest.raises(RuleError) as ei:
        build_pcg(graph, TP4, Annotations(leaves={"x": Sharding(((),) * ndim, ("tp",))}), strict=True)
    msg = str(ei.value)
    assert "not linear but input 'x' holds Partial('sum')" in msg
    assert "insert ReductionOp(axis=tp)" in msg


@pytest.mark.parametrize("zero", [2, 1, None])
def test_where_is_linear_in_the_operand_whose_other_is_zero(zero):
    """``where(mask, x, 0)`` (a masked loss's: ``Where(zero=2)``, as capture lifts it) is linear in x: the
    ``Partial(sum)`` pieces of a row-parallel linear's output pass through it, each device masking its piece, and are
    reduced once after; ``where(mask, 0, x)`` (``zero=1``) alike. Where neither operand is known to be zero, a partial
    x is refused (under ``strict``) and the planner reduces it first. Numbers equal one device (float64)."""
    b = GraphBuilder()
    x, m = b.input("x", (4, 8), F64), b.input("m", (4, 6), "bool")
    y = b.dense(x, 6, bias=False, name="fc")
    c = b.constant("const", torch.zeros((), dtype=torch.float64) if zero else torch.ones((), dtype=torch.float64))
    (out,) = b.apply(O.Where(zero), [m, c, y] if zero == 1 else [m, y, c])
    graph = b.build([out])
    ann = Annotations(leaves={"x": sh(TP4, 2, Shard(1)), "fc.weight": sh(TP4, 2, Shard(1))})
    if zero is None:
        with pytest.raises(RuleError, match=r"where is not linear but input 'linear' holds Partial\('sum'\)"):
            build_pcg(graph, TP4, ann, strict=True)
        pcg = build_pcg(graph, TP4, ann)
        assert (ReductionOp(4, "tp"), y) in pops(pcg) and not pcg.tensors[out].sharding.partial
    else:
        pcg = build_pcg(graph, TP4, ann, strict=True)
        assert pops(pcg) == [] and pcg.tensors[out].placements == (Partial("sum"),)
    leaves = leaf_values(graph, {"m": torch.rand(4, 6, generator=torch.Generator().manual_seed(3)) < 0.5})
    check_numbers(graph, pcg, leaves)


# --- reductions over dims -------------------------------------------------------------------------------
def test_softmax_over_sharded_dim_is_rejected():
    b = GraphBuilder()
    x = b.input("x", (4, 8), F64)
    b.softmax(x, -1)
    graph = b.build([])
    with pytest.raises(RuleError, match="dim 1 \\(size 8\\) of 'x' is sharded on mesh axes \\['tp'\\]"):
        build_pcg(graph, TP4, Annotations(leaves={"x": sh(TP4, 2, Shard(1))}), strict=True)


def test_softmax_over_other_dim():
    b = GraphBuilder()
    x = b.input("x", (4, 8), F64)
    y = b.softmax(x, -1)
    graph = b.build([y])
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": sh(TP4, 2, Shard(0))}))
    assert pcg.tensors[y].placements == (Shard(0),)
    check_numbers(graph, pcg, leaf_values(graph))


def test_layer_norm_over_sharded_last_dim_is_rejected():
    b = GraphBuilder()
    x = b.input("x", (2, 4, 8), F64)
    w = b.weight("w", (8,), F64)
    bb = b.weight("b", (8,), F64)
    b.layer_norm(x, w, bb)
    graph = b.build([])
    with pytest.raises(RuleError, match="dim 2 \\(size 8\\) of 'x' is sharded.*normalises"):
        build_pcg(graph, TP4, Annotations(leaves={"x": sh(TP4, 3, Shard(2))}), strict=True)
    # batch-sharded is fine
    g2 = GraphBuilder()
    x = g2.input("x", (4, 2, 8), F64)
    y = g2.layer_norm(x, g2.weight("w", (8,), F64), g2.weight("b", (8,), F64))
    graph = g2.build([y])
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": sh(TP4, 3, Shard(0))}))
    assert pcg.tensors[y].placements == (Shard(0),)
    check_numbers(graph, pcg, leaf_values(graph))


@pytest.mark.parametrize("fn,out_scale", [("sum", 1.0), ("mean", 0.25)])
def test_reduce_over_sharded_dim_is_partial(fn, out_scale):
    b = GraphBuilder()
    x = b.input("x", (3, 8), F64)
    y = getattr(b, fn)(x, 1)
    graph = b.build([y])
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": sh(TP4, 2, Shard(1))}, after={y: {"tp": R}}))
    assert pcg.tensors[y].placements == (Partial("sum"),)
    assert node(pcg, y).local.out_scale == out_scale
    assert pops(pcg) == [(ReductionOp(4, "tp"), y)]
    check_numbers(graph, pcg, leaf_values(graph))


def test_mean_over_all_dims_divides_by_global_count():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    y = b.mean(x)
    yk = b.mean(x, 1, keepdim=True)
    graph = b.build([y, yk])
    pcg = build_pcg(graph, MESH, Annotations(leaves={"x": sh(MESH, 2, Shard(0), Shard(1))}))
    assert pcg.tensors[y].placements == (Partial("sum"), Partial("sum"))
    assert node(pcg, y).local.out_scale == 0.25
    assert pcg.tensors[yk].placements == (Shard(0), Partial("sum"))
    assert pcg.tensors[yk].type.shape == (4, 1)
    assert node(pcg, yk).local.out_scale == 0.5
    check_numbers(graph, pcg, leaf_values(graph))


def test_reduce_of_unsharded_dim_keeps_partial():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    y = b.mean(x, 0)
    graph = b.build([y])
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": P4}))
    assert pcg.tensors[y].sharding == Sharding(((),), ("tp",))
    assert node(pcg, y).local.out_scale == 1.0
    check_numbers(graph, pcg, leaf_values(graph))


@pytest.mark.parametrize("reduction,out_scale", [("mean", 0.25), ("sum", 1.0)])
def test_cross_entropy_batch_sharded(reduction, out_scale):
    b = GraphBuilder()
    x = b.input("x", (8, 5), F64)
    t = b.input("t", (8,), "int64")
    loss = b.cross_entropy(x, t, reduction)
    graph = b.build([loss], loss=loss)
    mesh = Mesh.parse("dp=4")
    pcg = build_pcg(graph, mesh, Annotations(leaves={"x": sh(mesh, 2, Shard(0)), "t": sh(mesh, 1, Shard(0))}))
    assert pcg.tensors[loss].placements == (Partial("sum"),)
    assert pcg.tensors[loss].pshape.sum_degree == 4
    assert node(pcg, loss).local.out_scale == out_scale
    assert pcg.loss == loss and pcg.parallel_nodes == ()
    values = leaf_values(graph, {"t": torch.tensor([0, 4, 2, 1, 3, 3, 0, 2])})
    want = check_numbers(graph, pcg, values)
    ref = torch.nn.functional.cross_entropy(values["x"], values["t"], reduction=reduction)
    assert torch.allclose(want[loss], ref, atol=ATOL, rtol=0)


def test_cross_entropy_vocab_sharded_is_rejected():
    b = GraphBuilder()
    x = b.input("x", (8, 4), F64)
    t = b.input("t", (8,), "int64")
    b.cross_entropy(x, t)
    graph = b.build([])
    with pytest.raises(RuleError, match="dim 1 \\(size 4\\) of 'x' is sharded.*vocabulary-parallel"):
        build_pcg(graph, TP4, Annotations(leaves={"x": sh(TP4, 2, Shard(1))}), strict=True)


# --- reshape, permute, split, matmul, attention ---------------------------------------------------------
def test_reshape_heads_sharded():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 8), F64)
    y = b.reshape(x, (2, 3, 4, 2))
    graph = b.build([y])
    mesh = Mesh.parse("dp=2,tp=2")
    pcg = build_pcg(graph, mesh, Annotations(leaves={"x": sh(mesh, 3, Shard(0), Shard(2))}))
    assert pcg.tensors[y].placements == (Shard(0), Shard(2))
    assert pcg.tensors[y].pshape.piece_shape == (1, 3, 2, 2)
    assert node(pcg, y).local.op.shape == (1, 3, 2, 2)  # the local view is of the piece
    check_numbers(graph, pcg, leaf_values(graph))


def test_reshape_heads_not_divisible():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 8), F64)
    y = b.reshape(x, (2, 3, 2, 4))
    graph = b.build([y])
    with pytest.raises(DegreeError) as ei:
        build_pcg(graph, TP4, Annotations(leaves={"x": sh(TP4, 3, Shard(2))}), strict=True)
    e = ei.value
    assert (e.dim, e.size, e.degree, e.tensor) == (2, 2, 4, y)
    msg = str(e)
    assert f"tensor {y!r}" in msg and "degree 4" in msg and "dim 2" in msg and "size 2" in msg


def test_reshape_merge_of_sharded_minor_dim_is_rejected():
    b = GraphBuilder()
    x = b.input("x", (2, 4, 6), F64)
    b.reshape(x, (8, 6))
    graph = b.build([])
    with pytest.raises(RuleError, match="dim 1 \\(size 4\\) of 'x' is sharded.*merges"):
        tp2 = Mesh.parse("tp=2")
        build_pcg(graph, tp2, Annotations(leaves={"x": sh(tp2, 3, Shard(1))}), strict=True)


def test_reshape_merge_of_sharded_major_dim():
    b = GraphBuilder()
    x = b.input("x", (1, 4, 3, 6), F64)
    y = b.reshape(x, (12, 6))
    graph = b.build([y])
    mesh = Mesh.parse("tp=2")
    pcg = build_pcg(graph, mesh, Annotations(leaves={"x": sh(mesh, 4, Shard(1))}))  # size-1 dim 0 is skipped
    assert pcg.tensors[y].placements == (Shard(0),)
    check_numbers(graph, pcg, leaf_values(graph))


def test_reshape_of_partial_stays_partial():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    y = b.reshape(x, (2, 2, 6))
    graph = b.build([y])
    pcg = build_pcg(graph, TP4, Annotations(leaves={"x": P4}))
    assert pcg.tensors[y].sharding == Sharding(((), (), ()), ("tp",))
    check_numbers(graph, pcg, leaf_values(graph))


def test_permute_moves_sharding():
    b = GraphBuilder()
    x = b.input("x", (2, 4, 6), F64)
    y = b.permute(x, (2, 0, 1))
    graph = b.build([y])
    pcg = build_pcg(graph, MESH, Annotations(leaves={"x": sh(MESH, 3, Shard(0), Shard(1))}))
    assert pcg.tensors[y].placements == (Shard(1), Shard(2))
    check_numbers(graph, pcg, leaf_values(graph))


def test_split():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    outs = b.split(x, [2, 4], dim=1)
    graph = b.build(list(outs))
    pcg = build_pcg(graph, Mesh.parse("tp=2"), Annotations(leaves={"x": sh(Mesh.parse("tp=2"), 2, Shard(0))}))
    assert [pcg.tensors[o].placements for o in outs] == [(Shard(0),), (Shard(0),)]
    check_numbers(graph, pcg, leaf_values(graph))
    with pytest.raises(RuleError, match="dim 1 \\(size 6\\) of 'x' is sharded.*split cuts along it"):
        tp2 = Mesh.parse("tp=2")
        build_pcg(graph, tp2, Annotations(leaves={"x": sh(tp2, 2, Shard(1))}), strict=True)


def test_matmul_contraction_sharded_is_partial():
    b = GraphBuilder()
    a = b.input("a", (2, 4, 8), F64)
    w = b.input("w", (2, 8, 3), F64)
    y = b.matmul(a, w)
    graph = b.build([y])
    ann = Annotations(
        leaves={"a": sh(MESH, 3, Shard(0), Shard(2)), "w": sh(MESH, 3, Shard(0), Shard(1))}, after={y: {"tp": R}}
    )
    pcg = build_pcg(graph, MESH, ann)
    assert pcg.tensors[y].placements == (Shard(0), Partial("sum"))
    assert pops(pcg) == [(ReductionOp(2, "tp"), y)]
    check_numbers(graph, pcg, leaf_values(graph))


def test_matmul_output_dims():
    b = GraphBuilder()
    a = b.input("a", (4, 8), F64)
    w = b.input("w", (8, 6), F64)
    y = b.matmul(a, w)
    graph = b.build([y])
    pcg = build_pcg(graph, MESH, Annotations(leaves={"a": sh(MESH, 2, Shard(0), R), "w": sh(MESH, 2, R, Shard(1))}))
    assert pcg.tensors[y].placements == (Shard(0), Shard(1))
    check_numbers(graph, pcg, leaf_values(graph))


def test_attention_heads_sharded():
    b = GraphBuilder()
    q, k, v = (b.input(n, (2, 4, 5, 3), F64) for n in "qkv")
    y = b.attention(q, k, v)
    graph = b.build([y])
    s = sh(MESH, 4, Shard(0), Shard(1))
    pcg = build_pcg(graph, MESH, Annotations(leaves={"q": s, "k": s, "v": s}))
    assert pcg.tensors[y].placements == (Shard(0), Shard(1))
    assert pcg.parallel_nodes == ()
    check_numbers(graph, pcg, leaf_values(graph))


def test_attention_key_sequence_sharded_is_rejected():
    b = GraphBuilder()
    q, k, v = (b.input(n, (2, 4, 4, 3), F64) for n in "qkv")
    b.attention(q, k, v)
    graph = b.build([])
    s = sh(MESH, 4, R, Shard(2))
    with pytest.raises(RuleError, match="dim 2 \\(size 4\\) of 'k' is sharded.*every query reads the whole key"):
        build_pcg(graph, MESH, Annotations(leaves={"q": s, "k": s, "v": s}), strict=True)


@pytest.mark.parametrize("with_mask", [False, True])
def test_causal_attention_shards_queries_with_their_block_of_the_mask(with_mask):
    """Causal attention (context parallelism): q sharded on the sequence, k and v whole; each device's queries take
    their rows of the causal mask (the local op is given its block's start: device 0 start 0, device 1 start 2),
    together with a model's own mask. Numbers equal one device."""
    b = GraphBuilder()
    q, k, v = (b.input(n, (2, 4, 4, 3), F64) for n in "qkv")
    ins = [q, k, v] + ([b.input("m", (2, 1, 4, 4), "bool")] if with_mask else [])
    y = b.apply(O.Attention(causal=True, mask=with_mask), ins)[0]
    graph = b.build([y])
    seq = sh(MESH, 4, R, Shard(2))
    pcg = build_pcg(graph, MESH, Annotations(leaves={"q": seq} | ({"m": seq} if with_mask else {})), strict=True)
    assert pcg.tensors[y].placements == (Replicate(), Shard(2)) and pcg.parallel_nodes == ()
    node = next(n for n in pcg.nodes if isinstance(n.op, O.Attention))
    assert {pcg.local_of(node, d).op.start for d in range(4)} == {0, 2}
    values = leaf_values(graph)
    if with_mask:
        values["m"] = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(1)) > 0.3
        values["m"][..., 0] = True  # every query attends somewhere
    check_numbers(graph, pcg, values)


def test_attention_without_causal_mask_shards_queries():
    """Non-causal attention: each block of queries attends to every key, so q (and a mask's T dim) may be
    sharded on the sequence while k and v are whole; the output is sharded like q. Numbers equal one device."""
    b = GraphBuilder()
    q, k, v = (b.input(n, (2, 4, 4, 3), F64) for n in "qkv")
    m = b.input("m", (2, 1, 4, 4), "bool")
    y = b.apply(O.Attention(causal=False, mask=True), [q, k, v, m])[0]
    graph = b.build([y])
    seq = sh(MESH, 4, R, Shard(2))
    pcg = build_pcg(graph, MESH, Annotations(leaves={"q": seq, "m": seq}))
    assert pcg.tensors[y].placements == (Replicate(), Shard(2))
    assert pcg.parallel_nodes == ()
    values = leaf_values(graph)
    values["m"] = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(1)) > 0.3
    values["m"][..., 0] = True  # every query attends somewhere
    check_numbers(graph, pcg, values)


def test_transformer_heads_block_numbers():
    """Column-parallel qkv → reshape to heads (sharded on H) → attention → merge heads → row-parallel proj."""
    B, T, C, H = 2, 4, 8, 4
    b = GraphBuilder()
    x = b.input("x", (B, T, C), F64)
    qkv = [b.dense(x, C, name=n) for n in ("q", "k", "v")]
    heads = [b.transpose(b.reshape(t, (B, T, H, C // H)), 1, 2) for t in qkv]
    a = b.attention(*heads)
    merged = b.reshape(b.transpose(a, 1, 2), (B, T, C))
    y = b.dense(merged, C, name="proj")
    graph = b.build([y])
    col, row = sh(MESH, 2, R, Shard(0)), sh(MESH, 2, R, Shard(1))
    leaves = {"x": sh(MESH, 3, Shard(0), R), "proj.weight": row}
    for n in "qkv":
        leaves |= {f"{n}.weight": col, f"{n}.bias": sh(MESH, 1, R, Shard(0))}
    pcg = build_pcg(graph, MESH, Annotations(leaves=leaves, after={y: {"tp": R}}))
    assert pcg.tensors[a].placements == (Shard(0), Shard(1))
    assert pcg.tensors[merged].placements == (Shard(0), Shard(2))
    assert pcg.tensors[y].placements == (Shard(0), Partial("sum"))
    assert node(pcg, y).local.in_scale == (1.0, 1.0, 0.5)
    assert pops(pcg) == [(ReductionOp(2, "tp"), y)]
    check_numbers(graph, pcg, leaf_values(graph))


# --- reshape_groups -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "a,b,want",
    [
        ((2, 3, 8), (2, 3, 4, 2), [([0], [0]), ([1], [1]), ([2], [2, 3])]),
        ((2, 3, 4), (6, 4), [([0, 1], [0]), ([2], [1])]),
        ((2, 3), (3, 2), [([0, 1], [0, 1])]),
        ((1, 4), (4,), [([0, 1], [0])]),
        ((4, 1), (4,), [([0], [0]), ([1], [])]),
        ((4,), (1, 4), [([0], [0, 1])]),
        ((4,), (4, 1), [([0], [0]), ([], [1])]),
        ((6,), (2, 1, 3), [([0], [0, 1, 2])]),
        ((1, 1), (1,), [([0], [0]), ([1], [])]),
        ((), (), []),
        ((), (1,), [([], [0])]),
    ],
)
def test_reshape_groups(a, b, want):
    assert reshape_groups(a, b) == want


# --- alignment, sub-meshes, listings ----------------------------------------------------------------------
def test_binary_aligns_replicated_operand():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    y = b.input("y", (4, 6), F64)
    bias = b.input("bias", (6,), F64)
    z = b.add(x, y)
    z2 = b.mul(z, bias)
    graph = b.build([z2])
    pcg = build_pcg(graph, MESH, Annotations(leaves={"x": sh(MESH, 2, Shard(0), R)}))
    # y is split locally (Replicate → Shard needs no communication); the broadcast [6] operand is left alone
    assert pops(pcg) == [(RepartitionOp(0, 2, "dp"), "y")]
    rep = pcg.parallel_nodes[0].outputs[0]
    assert pcg.tensors[rep].placements == (Shard(0), R)
    assert node(pcg, z).inputs == ("x", rep)
    assert pcg.tensors[z].placements == (Shard(0), R)
    assert node(pcg, z2).inputs == (z, "bias")
    assert pcg.tensors[z2].placements == (Shard(0), R)
    check_numbers(graph, pcg, leaf_values(graph))


def test_binary_with_two_sharded_operands_on_different_axes_is_rejected():
    b = GraphBuilder()
    x = b.input("x", (4, 6), F64)
    y = b.input("y", (4, 6), F64)
    b.add(x, y)
    graph = b.build([])
    with pytest.raises(RuleError, match="dim 0 of 'x' is sharded on \\['dp'\\] but dim 0 of 'y' on \\['tp'\\]"):
        build_pcg(
            graph, MESH, Annotations(leaves={"x": sh(MESH, 2, Shard(0), R), "y": sh(MESH, 2, R, Shard(0))}), strict=True
        )


def _two_stage():
    b = GraphBuilder()
    x = b.input("x", (4, 8), F64)
    h = b.relu(b.dense(x, 8, name="s0"))
    y = b.dense(h, 6, name="s1")
    graph = b.build([y])
    mesh = Mesh.parse("pp=2,dp=2")
    first, relu, last = (n.name for n in graph.nodes)
    stages = {first: SubMesh(mesh, (("pp", 0),)), relu: SubMesh(mesh, (("pp", 0),)), last: SubMesh(mesh, (("pp", 1),))}
    return graph, mesh, stages, h, y


def test_pipeline_stages_on_submeshes():
    graph, mesh, stages, h, y = _two_stage()
    st0 = SubMesh(mesh, (("pp", 0),))
    pcg = build_pcg(graph, mesh, Annotations(leaves={"x": Sharding((("dp",), ()))}, groups=stages))
    assert [n.group for n in pcg.nodes] == [st0, st0, SubMesh(mesh, (("pp", 1),))]
    # leaves live on the sub-mesh of their first consumer, placements are per free axis
    assert pcg.tensors["x"].group == st0 and pcg.tensors["s1.weight"].group.fixed == (("pp", 1),)
    assert pcg.tensors[h].placements == (Shard(0),)
    assert pcg.tensors[h].pshape.replica_degree == 1
    assert sorted(pcg.tensors[y].sharding.device_map(pcg.tensors[y].group)) == [2, 3]
    assert pcg.parallel_nodes == ()
    listing = pcg.listing()
    assert "@mesh[pp=0]" in listing and "@mesh[pp=1]" in listing
    check_numbers(graph, pcg, leaf_values(graph))


def test_pipeline_stage_then_replicate_to_whole_mesh():
    b = GraphBuilder()
    x = b.input("x", (4, 8), F64)
    h = b.dense(x, 8, name="s0")
    y = b.relu(h)
    graph = b.build([y])
    mesh = Mesh.parse("pp=2,dp=2")
    st0 = SubMesh(mesh, (("pp", 0),))
    ann = Annotations(leaves={"x": Sharding((("dp",), ()))}, groups={h: st0}, ops={h: (P.ReplicateOp(2, "pp"),)})
    pcg = build_pcg(graph, mesh, ann)
    assert pops(pcg) == [(P.ReplicateOp(2, "pp"), h)]
    out = pcg.parallel_nodes[0].outputs[0]
    assert pcg.tensors[out].group == SubMesh(mesh)
    assert pcg.tensors[out].placements == (R, Shard(0))
    assert node(pcg, y).group == SubMesh(mesh) and pcg.tensors[y].placements == (R, Shard(0))
    check_numbers(graph, pcg, leaf_values(graph))


def test_consumer_on_other_free_axes_is_rejected():
    b = GraphBuilder()
    x = b.input("x", (4, 8), F64)
    h = b.dense(x, 8, name="s0")
    b.relu(h)
    graph = b.build([])
    mesh = Mesh.parse("pp=2,dp=2")
    st0 = SubMesh(mesh, (("pp", 0),))
    with pytest.raises(
        ShardingError,
        match=r"input 'linear' lives on mesh\[pp=0\]; insert ReplicateOp\(2, 'pp'\) "
        r"after 'linear' \(Plan.ops\)",
    ):
        build_pcg(graph, mesh, Annotations(groups={h: st0}))
    # The other way round: a Replicate spread h over pp, but relu runs on one stage.
    with pytest.raises(
        ShardingError,
        match=r"the input spans axes \['pp'\], where 'relu' runs at one index: "
        r"run 'relu' on every index of those axes too \(no stage=",
    ):
        build_pcg(graph, mesh, Annotations(groups={h: st0, "relu": st0}, ops={h: (P.ReplicateOp(2, "pp"),)}))


def test_listing_shows_inserted_parallel_ops():
    b, x, y = _mlp()
    z = b.relu(y)
    graph = b.build([z])
    ann = Annotations(
        leaves={"x": sh(MESH, 2, R, Shard(1)), "fc.weight": sh(MESH, 2, R, Shard(1))},
        after={y: {"tp": R}},
        edges={(z, 0): {"dp": Shard(0)}},
    )
    pcg = build_pcg(graph, MESH, ann)
    assert pops(pcg) == [(ReductionOp(2, "tp"), y), (RepartitionOp(0, 2, "dp"), f"{y}.reduction")]
    star = [line for line in pcg.listing().splitlines() if line.startswith("*")]
    assert star == [
        f"* {y}.reduction: float64[4, 6] rep=4 (R,R) = ReductionOp(degree=2, axis=tp)({y})   # layout of {y}",
        f"* {y}.reduction.repartition: float64[4/2, 6] rep=2 (S(0),R) = RepartitionOp(dim=0, degree=2, axis=dp)({y}.reduction)"
        f"   # input 0 of {z}",
    ]
    assert pcg.tensors[z].placements == (Shard(0), R)
    non_star = [line for line in pcg.listing().splitlines() if line.startswith("  ")]
    assert len(non_star) == len(graph.nodes)
    check_numbers(graph, pcg, leaf_values(graph))
