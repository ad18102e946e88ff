"""The hand-written backward of shardflow.runtime.vjp against torch's autograd (``torch.func.vjp``) of the same local
op: every op and function the table covers, with broadcasting, partial-sum scales on inputs and output, missing
output gradients and gradients not needed. float64; tolerance 1e-12 (the same formulas in another order)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardflow.graph import ops as O
from shardflow.lower.dynamic import TaskType
from shardflow.lower.program import Buffer, Compute, Vjp
from shardflow.parallel.rules import LocalOp
from shardflow.parallel.validate import CASES, Case, InputSpec, case_values
from shardflow.runtime.kernels import OptimizerConfig, make_kernel
from shardflow.runtime.vjp import AUTOGRAD_NUMEL, BINARY_FNS, REDUCE_FNS, SCALAR_FNS, UNARY_VJPS, VJPS, hand_vjp


def _x(name, *shape, **kw):
    return InputSpec(name, tuple(shape), **kw)


EXTRA = (
    Case("linear(3-d input)", O.Linear(bias=True), (_x("x", 2, 4, 8), _x("w", 4, 8), _x("b", 4))),
    Case("linear(transposed, no bias)", O.Linear(bias=False, transposed=True), (_x("x", 2, 4, 8), _x("w", 8, 4))),
    Case("matmul(broadcast batch)", O.Matmul(), (_x("a", 2, 4, 8, 4), _x("b", 4, 8))),
    Case("sum(keepdim, two dims)", O.Reduce("sum", (0, 2), True), (_x("x", 4, 8, 4),)),
    Case("mean(dim 1)", O.Reduce("mean", (1,)), (_x("x", 4, 8, 4),)),
    Case("sub(broadcast)", O.Binary("sub"), (_x("a", 4, 1), _x("b", 8))),
    # one short broadcast dim (summed by adding its slices): in the middle, of 2 and 3, and a leading one
    Case("expand(grouped-query heads, 2)", O.Expand((2, 2, 2, 4, 8)), (_x("x", 2, 2, 1, 4, 8),)),
    Case("mul(short middle dim, 3)", O.Binary("mul"), (_x("a", 2, 3, 8), _x("b", 2, 1, 8))),
    Case("add(short leading dim)", O.Binary("add"), (_x("a", 2, 4, 8), _x("b", 4, 8))),
    Case("div(broadcast)", O.Binary("div"), (_x("a", 4, 8), _x("b", 8, positive=True))),
    Case("mul(int mask)", O.Binary("mul"), (_x("a", 4, 8), _x("m", 8, dtype="int64", high=2))),
    Case("scalar sub", O.Scalar("sub", 0.5), (_x("x", 4, 8),)),
    Case("scalar pow(0)", O.Scalar("pow", 0), (_x("x", 4, 8),)),
    Case("scalar pow(3)", O.Scalar("pow", 3), (_x("x", 4, 8),)),
    Case("cast(float64 → float32)", O.Cast("float32"), (_x("x", 4, 8),)),
    Case("layer_norm(no bias, 2 dims)", O.LayerNorm(2, 1e-5, True, False), (_x("x", 2, 4, 8), _x("w", 4, 8))),
    Case("layer_norm(no affine)", O.LayerNorm(1, 1e-5, False, False), (_x("x", 4, 8),)),
    Case(
        "conv(strided, no bias)", O.Conv((2, 2), (1, 1), (1, 1), 1, False), (_x("x", 2, 4, 8, 8), _x("w", 4, 4, 3, 3))
    ),
    Case(
        "conv(grouped)", O.Conv((1, 1), (1, 1), (1, 1), 2, True), (_x("x", 2, 4, 8, 8), _x("w", 4, 2, 3, 3), _x("b", 4))
    ),
    Case("cat(three)", O.Cat(0), (_x("a", 4, 8), _x("b", 8, 8), _x("c", 4, 8))),
    Case("split(three)", O.Split((2, 4, 2), 1), (_x("x", 4, 8),)),
    Case("slice(step)", O.Slice(0, 1, 4, 2), (_x("x", 4, 8),)),
    Case("embedding(padding)", O.Embedding(padding_idx=2), (_x("idx", 4, 8, dtype="int64", high=8), _x("w", 8, 4))),
) + tuple(
    Case(f"unary {fn}", O.Unary(fn), (_x("x", 4, 8, positive=fn in ("rsqrt", "sqrt", "log")),))
    for fn in sorted(UNARY_VJPS)
)
COVERED = [c for c in CASES + EXTRA if hand_vjp(c.op) is not None]


def test_every_table_entry_and_function_is_covered():
    assert {type(c.op) for c in COVERED} == set(VJPS)
    assert {c.op.fn for c in COVERED if isinstance(c.op, O.Binary)} == BINARY_FNS
    assert {c.op.fn for c in COVERED if isinstance(c.op, O.Scalar)} >= SCALAR_FNS
    assert {c.op.fn for c in COVERED if isinstance(c.op, O.Reduce)} == REDUCE_FNS
    assert hand_vjp(O.Dropout(0.1)) is None and hand_vjp(O.Reduce("amax", (1,))) is None


def _kernel(local: LocalOp, types, out_types, grad_mask, dy_mask, unscale, saved: dict | None = None):
    """The executor's backward kernel of ``local`` on inputs of ``types``: make_kernel on its Vjp compute. With
    ``saved`` (the executor's store of recorded forward graphs), an op autograd differentiates reuses the graph its
    forward recorded there (test_differential's ``_recording_forward``)."""
    ins = tuple(Buffer(f"x{i}", t) for i, t in enumerate(types))
    dys = tuple(Buffer(f"dy{k}", t) for k, t in enumerate(out_types) if dy_mask[k])
    outs = tuple(Buffer(f"g{i}", types[i]) for i, m in enumerate(grad_mask) if m)
    instr = Compute(
        TaskType.BWD,
        "op",
        local.op.kind,
        ins + dys,
        outs,
        "bwd:op",
        kernel=Vjp(local, None, grad_mask, unscale, dy_mask, tuple(b.type.dtype for b in outs)),
    )
    return make_kernel(instr, OptimizerConfig(), lambda: 1, saved)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize("case", COVERED, ids=lambda c: c.label)
def test_hand_vjp_equals_autograd(case, scaled):
    """Scaled: input scales 0.5, 2, ... and output scale 0.25 (a partial-sum local op), unscale 3 on input 0;
    the last output's gradient missing when the op has several."""
    values = case_values(case, seed=1)
    xs = [values[s.name] for s in case.inputs]
    types = tuple(O.TensorType(tuple(x.shape), O.dtype_name(x.dtype)) for x in xs)
    out_types = case.op.infer(types)
    grad_mask = tuple(x.dtype.is_floating_point for x in xs)
    in_scale = tuple((0.5 * (i + 1) if scaled else 1.0) if m else 1.0 for i, m in enumerate(grad_mask))
    local = LocalOp(case.op, in_scale, 0.25 if scaled else 1.0)
    dy_mask = tuple(not (scaled and len(out_types) > 1 and k == len(out_types) - 1) for k in range(len(out_types)))
    unscale = tuple(3.0 if scaled and i == 0 else 1.0 for i in range(len(xs)))
    gen = torch.Generator().manual_seed(2)
    dys = [torch.randn(t.shape, generator=gen, dtype=O.torch_dtype(t.dtype)) for t in out_types]
    got = _kernel(local, types, out_types, grad_mask, dy_mask, unscale)(xs + [d for d, m in zip(dys, dy_mask) if m])

    diff = [i for i, m in enumerate(grad_mask) if m]

    def f(*d):
        a = list(xs)
        for i, t in zip(diff, d):
            a[i] = t
        return local.compute(*a)

    outs, vjp = torch.func.vjp(f, *(xs[i] for i in diff))
    want = vjp(tuple(d if m else torch.zeros_like(o) for d, o, m in zip(dys, outs, dy_mask)))
    assert len(got) == len(want)
    for i, g, w in zip(diff, got, want):
        assert g.shape == w.shape and g.dtype == xs[i].dtype, case.label
        torch.testing.assert_close(g, w * unscale[i], atol=1e-12, rtol=0, msg=f"{case.label}: input {i}")


def test_every_op_a_ring_fuses_has_a_hand_written_vjp():
    """A fused ring computes its consumer's forward chunk by chunk, recording no autograd graph; its backward
    recomputes nothing only because every op a ring may fuse (``contracts_last_dim``) has a hand-written vjp, which
    reads the forward's inputs and no graph (issue #16: no recomputed forward for ring-fused linears)."""
    fusable = [cls for cls in O.OPS.values() if cls.contracts_last_dim]
    assert fusable and all(hand_vjp(cls()) is not None for cls in fusable)


def test_a_large_softmax_goes_through_autograd_which_keeps_its_output():
    """A hand vjp recomputes softmax from its input; from AUTOGRAD_NUMEL input elements autograd differentiates it
    from the output the forward kept (cheaper than recomputing: shardflow/runtime/vjp.py). The loss's log-softmax
    over the main job's vocabulary goes that way; a small one keeps its hand vjp."""
    op = O.Softmax(1, True)
    assert hand_vjp(op, [_piece(AUTOGRAD_NUMEL - 1)]) is not None and hand_vjp(op, [_piece(AUTOGRAD_NUMEL)]) is None
    assert hand_vjp(O.Binary("mul"), [_piece(10 * AUTOGRAD_NUMEL)] * 2) is not None  # only ops recomputing their output


def _piece(numel: int, dtype: str = "float32") -> O.TensorType:
    return O.TensorType((numel,), dtype)


@pytest.mark.parametrize(
    "op",
    [O.Linear(bias=True), O.Linear(bias=True, transposed=True), O.Matmul()],
    ids=["linear [out, in]", "linear [in, out]", "matmul by a matrix"],
)
def test_a_linear_works_in_the_order_its_rows_are_stored(op):
    """x [B=2, T=6, C=4] stored sequence-first (a ring all-gather's buffer, viewed with T back in place) and its
    output gradient likewise (what the elementwise ops after a ring-fused linear keep): the forward, and the hand
    vjp's dx, come out in that layout (no copy folds the leading dims) and equal autograd's on contiguous copies
    (float64, 1e-12). A gradient stored batch-first takes the plain path; a product to wider rows (8 features from 4)
    folds a copy of x and is contiguous."""
    x = torch.randn(6, 2, 4, dtype=torch.float64).movedim(0, 1)
    w = torch.randn(*((3, 4) if isinstance(op, O.Linear) and not op.transposed else (4, 3)), dtype=torch.float64)
    ins = (x, w, torch.randn(3, dtype=torch.float64)) if isinstance(op, O.Linear) else (x, w)
    assert O.row_order(x) == (1, 0) and O.row_order(x.contiguous()) == (0, 1) and O.row_order(x[:, ::2]) is None
    (y,) = op.compute(*ins)
    assert y.movedim(1, 0).is_contiguous()
    wider = (
        torch.randn(*((8, 4) if isinstance(op, O.Linear) and not op.transposed else (4, 8)), dtype=torch.float64),
        *((torch.randn(8, dtype=torch.float64),) if isinstance(op, O.Linear) else ()),
    )
    assert op.compute(x, *wider)[0].is_contiguous()
    torch.testing.assert_close(y, op.compute(x.contiguous(), *ins[1:])[0], atol=1e-12, rtol=0)
    for dy in (torch.randn(6, 2, 3, dtype=torch.float64).movedim(0, 1), torch.randn(2, 6, 3, dtype=torch.float64)):
        got = hand_vjp(op)(op, ins, (dy,), (True,) * len(ins))
        _, vjp = torch.func.vjp(lambda *a: op.compute(*a)[0], x.contiguous(), *ins[1:])
        for g, want in zip(got, vjp(dy.contiguous())):
            torch.testing.assert_close(g, want, atol=1e-12, rtol=0)
        assert got[0].movedim(1, 0).is_contiguous() == (not dy.is_contiguous())


def test_a_complex_op_takes_autograds_vjp_which_conjugates():
    """The hand formulas are written for real numbers (the gradient of a·b by a is dy·b); for complex values
    autograd's is dy·conj(b) (ATen's derivatives.yaml). A complex input routes an op to autograd: its kernel's
    gradients equal ``torch.func.vjp``'s (complex128, 1e-12), which the real formula's would not."""
    op = O.Binary("mul")
    gen = torch.Generator().manual_seed(0)
    a, b, dy = (torch.randn(4, 8, generator=gen, dtype=torch.complex128) for _ in range(3))
    types = (O.TensorType((4, 8), "complex128"),) * 2
    assert hand_vjp(op, types) is None and hand_vjp(op, (O.TensorType((4, 8), "float64"),) * 2) is not None
    got = _kernel(LocalOp(op, (1.0, 1.0), 1.0), types, types[:1], (True, True), (True,), (1.0, 1.0))([a, b, dy])
    _, vjp = torch.func.vjp(lambda x, y: x * y, a, b)
    for g, want in zip(got, vjp(dy)):
        torch.testing.assert_close(g, want, atol=1e-12, rtol=0)
    assert (got[0] - dy * b).abs().max() > 0.1  # what the real formula gives is another number


# --- the log-sum-exp combine of ring attention (docs/concepts.md#the-log-sum-exp-combine) --------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    d=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
    grouped=st.booleans(),
    mask=st.sampled_from([None, "bool", "float", "broadcast"]),
    seed=st.integers(0, 2**16),
)
def test_key_blocks_merged_by_lse_equal_attention_and_so_do_their_gradients(d, causal, grouped, mask, seed):
    """Any query block against the d key blocks of a sequence, attended one block at a time (Attention.keys_from)
    and merged by lse_merge in a ring's order (its own block first), equals attention over the whole sequence;
    key_block_vjp per block, its shares summed, equals autograd's gradients of q, k and v. float64, 1e-12."""
    g = torch.Generator().manual_seed(seed)
    b, h, t, dh = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, t, dh, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    if grouped:
        k, v = (torch.randn(b, 2, t, dh, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    m = None
    if mask == "bool":
        m = torch.rand(b, 1, t, t, generator=g) > 0.3
        m[..., 0] = True  # every row attends a key (a row with none is NaN in torch's attention too)
    elif mask == "float":
        m = torch.randn(b, 1, t, t, generator=g, dtype=torch.float64)
    elif mask == "broadcast":
        m = torch.randn(b, 1, t, 1, generator=g, dtype=torch.float64)
    op = O.Attention(causal=causal, gqa=grouped, mask=m is not None)
    n = t // d
    p = seed % d  # the query block
    rows = slice(p * n, (p + 1) * n)
    whole = op.compute(q, k, v, m)[0]
    dout = torch.randn(whole.shape, generator=g, dtype=torch.float64)
    dq, dk, dv = torch.autograd.grad(whole, (q, k, v), dout, retain_graph=True)
    mine = op if d == 1 else dataclasses.replace(op, start=p * n)
    qb, mb = q.detach()[..., rows, :], None if m is None else m[..., rows, :]

    def block(j):
        cols = slice(j * n, (j + 1) * n)
        cut = None if mb is None else mb if mb.shape[-1] == 1 else mb[..., cols]
        return dataclasses.replace(mine, keys_from=j * n), k.detach()[..., cols, :], v.detach()[..., cols, :], cut

    order = [(p + s) % d for s in range(d)]
    out = lse = None
    for j in order:
        bop, kj, vj, mj = block(j)
        o_j, lse_j = bop.compute(qb, kj, vj, mj)
        out, lse = (o_j, lse_j) if out is None else O.lse_merge(out, lse, o_j, lse_j)
    assert (out - whole[..., rows, :]).abs().max() <= 1e-12
    share_q = torch.zeros_like(qb)
    for j in order:
        bop, kj, vj, mj = block(j)
        gq, gk, gv = O.key_block_vjp(bop, qb, kj, vj, mj, out, lse, dout[..., rows, :])
        share_q += gq
        # this query block's share of block j's key and value gradients: autograd's with the other rows' dout zeroed
        only = torch.zeros_like(dout)
        only[..., rows, :] = dout[..., rows, :]
        wk, wv = torch.autograd.grad(whole, (k, v), only, retain_graph=True)
        cols = slice(j * n, (j + 1) * n)
        assert (gk - wk[..., cols, :]).abs().max() <= 1e-12 and (gv - wv[..., cols, :]).abs().max() <= 1e-12
    assert (share_q - dq[..., rows, :]).abs().max() <= 1e-12


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("start", [0, 8, 24])
def test_a_causal_query_block_equals_attention_with_its_rows_of_the_mask(grouped, start):
    """Attention(start=...) on CPU without a mask (the all-gather form of context parallelism): the keys before the
    block and its diagonal by the fused kernel, merged — its output and its gradients (autograd and torch.func.vjp,
    the executors' two ways) equal torch's attention with the block's rows of the causal mask written out. 1e-12."""
    g = torch.Generator().manual_seed(start)
    heads = 2 if grouped else 4
    q = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, heads, 32, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    op = O.Attention(causal=True, gqa=grouped, start=start)
    rows = torch.arange(start, start + 8)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.arange(32) <= rows[:, None], enable_gqa=grouped
    )
    got = op.compute(q, k, v)[0]
    dout = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    assert (got - want).abs().max() <= 1e-12
    for found in (
        torch.autograd.grad(got, (q, k, v), dout),
        torch.func.vjp(lambda q, k, v: op.compute(q, k, v)[0], q, k, v)[1](dout),
    ):
        assert all((a - b).abs().max() <= 1e-12 for a, b in zip(found, grads))
