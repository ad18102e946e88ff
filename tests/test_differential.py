"""Differential test (issue #33): the executors' backward kernels against torch autograd, for every op class of the
op table, every dtype a model trains in and every layout the executors hand a kernel.

Generated from the tables, so that a new op class cannot skip it: the cases are ``validate.CASES``, test_vjp's
``EXTRA`` and :data:`MORE` (the functions and ATen ops neither exercises: the complex views of a rotary embedding,
the copy and slice_scatter of an in-place slice write, ...). :func:`test_every_op_class_and_function_has_a_case`
fails when an op class of ``O.OPS``, or a function of a class's own table (``UNARY_FNS``, ``BINARY_FNS``,
``SCALAR_FNS``, ``REDUCE_FNS``, ``POOL_FNS``), has no case with a gradient, unless :data:`NO_GRADIENT` says why it
has none.

Per case and dtype — float64, float32, bfloat16, and complex128 / complex64 where the op's forward takes complex
inputs (found by running it; :data:`COMPLEX_CLASSES` must) — the backward kernel is built as the executor builds it
(test_vjp's ``_kernel``: ``make_kernel`` on a compute with a ``Vjp`` spec): the hand-written vjp where ``hand_vjp``
gives one, else autograd by both of its paths (recomputing the forward under ``torch.func.vjp``, and reusing the
graph the recording forward kernel saved). For an op of several outputs, also with the last output's gradient
missing. The gradients must equal ``torch.func.vjp`` of the op's ``compute`` on contiguous copies of the same inputs
and output gradients, and have their input's shape and dtype.

Layouts, applied to every input and output gradient at once: ``contiguous``; ``permuted`` (dims 0 and 1 swapped in
memory: a ring all-gather's block viewed with the gathered dim back in place, a transpose); ``sliced`` (a strided
view at an offset into a larger buffer: a slice, a split, an unpacked bucket); ``expanded`` (stride 0 along the
first dim longer than 1: what a broadcast's or a reduction's vjp hands on). :data:`LAYOUT_REFUSED` lists the
(ATen op, layout) pairs torch's own forward refuses, as eager would; the test checks that it still does.

Tolerances (``atol = rtol``, :data:`TOL`):

* float64, complex128: 1e-12. The same formulas or ATen backward kernels as autograd's, in another order or on
  another layout: rounding of ~1e-16 relative over at most a few dozen terms (largest seen: 1.1e-15, a broadcast
  batched matmul's weight gradient on permuted storage).
* float32, complex64: 1e-5, the same at float32's 6e-8 (largest seen: 1.2e-6, the same matmul).
* bfloat16: 1.6e-2, two units in bfloat16's last place at 1 (eps 7.8e-3; torch.testing's own bfloat16 rtol). A
  hand formula rounds each intermediate to bfloat16 where autograd's fused ATen kernel keeps float32, and ATen's
  kernels themselves accumulate in another order on another layout (largest seen: 7.5e-3, one unit, attention's
  gradient on a sliced view against contiguous copies, both by autograd).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from test_vjp import EXTRA, _kernel, _x

from shardflow.graph import ops as O
from shardflow.lower.dynamic import TaskType
from shardflow.lower.program import Buffer, Compute, Forward
from shardflow.parallel.rules import LocalOp
from shardflow.parallel.validate import CASES, Case, case_values
from shardflow.runtime.kernels import OptimizerConfig, make_kernel
from shardflow.runtime.vjp import UNARY_VJPS, hand_vjp

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.complex128, torch.complex64)
TOL = {
    torch.float64: 1e-12,
    torch.complex128: 1e-12,
    torch.float32: 1e-5,
    torch.complex64: 1e-5,
    torch.bfloat16: 1.6e-2,
}

# Functions whose result carries no gradient: nothing to compare (torch's autograd gives none either).
NO_GRADIENT = {
    **dict.fromkeys(("eq", "ne", "lt", "le", "gt", "ge"), "a comparison: its result is bool"),
    **dict.fromkeys(
        ("bitwise_and", "bitwise_or", "bitwise_not", "logical_not"),
        "defined on integers and bools only, which carry no gradient",
    ),
}
# ATen ops torch's autograd has no derivative for: the executors cannot differentiate them either (test below).
NO_AUTOGRAD = {
    "aten.copy.default": "export's functional copy_ (an in-place slice write, x[..., :k] = y): torch has no "
    "derivative for aten::copy; capture lifts it to an expand and a cast, and planning refuses "
    "a generic op without a derivative before step 1 (tests/test_lower.py)",
}
# The op classes whose forward must take complex inputs (a rotary embedding written with view_as_complex runs
# linears, element-wise ops, views and the generic ATen op on complex values); the probe may find more.
COMPLEX_CLASSES = {
    O.Linear,
    O.Matmul,
    O.Binary,
    O.Scalar,
    O.Unary,
    O.Reshape,
    O.Permute,
    O.Expand,
    O.Slice,
    O.Split,
    O.Cat,
    O.Pad,
    O.Cast,
    O.Reduce,
    O.Where,
    O.ComplexView,
    O.Aten,
}
# (ATen target, layout) that torch's forward refuses, as eager torch refuses the same view of its input.
LAYOUT_REFUSED = {
    ("aten.view_as_complex.default", "sliced"): "view_as_complex needs the last dim at stride 1",
}

MORE = (
    Case("pow(tensor exponent)", O.Binary("pow"), (_x("a", 4, 8, positive=True), _x("b", 8))),
    Case("minimum(broadcast)", O.Binary("minimum"), (_x("a", 4, 8), _x("b", 8))),
    Case("amin(dims 0, 2, keepdim)", O.Reduce("amin", (0, 2), True), (_x("x", 4, 8, 4),)),
    Case("split(dim -1)", O.Split((2, 6), -1), (_x("x", 4, 2, 8),)),
    Case("aten(view_as_complex)", O.Aten("aten.view_as_complex.default", (O.Arg(0),)), (_x("x", 4, 4, 2),)),
    Case("aten(view_as_real)", O.Aten("aten.view_as_real.default", (O.Arg(0),)), (_x("x", 4, 4),)),
    # x[..., :3] = y, as capture lifts it: the slice's copy of y, scattered back into x
    Case("aten(copy)", O.Aten("aten.copy.default", (O.Arg(0), O.Arg(1))), (_x("a", 4, 3), _x("b", 4, 3))),
    Case(
        "aten(slice_scatter)",
        O.Aten("aten.slice_scatter.default", (O.Arg(0), O.Arg(1), 1, 0, 3)),
        (_x("x", 4, 8), _x("src", 4, 3)),
    ),
) + tuple(
    Case(f"unary {fn}", O.Unary(fn), (_x("x", 4, 8),))
    for fn in sorted(set(O.UNARY_FNS) - set(UNARY_VJPS) - set(NO_GRADIENT))
)
ALL_CASES = CASES + EXTRA + MORE


def _inputs(case: Case, dtype: torch.dtype) -> list[torch.Tensor]:
    """The case's inputs (``validate.case_values``) in ``dtype``: floating ones cast, given an imaginary part (a
    standard normal) for a complex dtype; integer and bool ones as they are."""
    gen, values = torch.Generator().manual_seed(3), case_values(case, seed=1)
    out = []
    for s in case.inputs:
        x = values[s.name]
        if x.is_floating_point():
            x = torch.complex(x, torch.randn(x.shape, generator=gen, dtype=x.dtype)) if dtype.is_complex else x
            x = x.to(dtype)
        out.append(x)
    return out


def _types(xs) -> tuple[O.TensorType, ...]:
    return tuple(O.TensorType(tuple(x.shape), O.dtype_name(x.dtype)) for x in xs)


def _has_gradient(case: Case, dtype: torch.dtype) -> bool:
    """Whether torch's autograd differentiates ``case`` in ``dtype``: some input and every floating or complex output
    carry a gradient (an integer output, topk's indices, carries none), and torch has a forward and backward for the
    dtype (no softmax of complex numbers, no complex embedding)."""
    xs = _inputs(case, dtype)
    diff = [i for i, x in enumerate(xs) if x.is_floating_point() or x.is_complex()]
    try:
        types = _types(xs)
        if not any(case.op.grad_outputs(types, case.op.infer(types), tuple(i in diff for i in range(len(xs))))):
            return False  # detach: no gradient flows through it, so the executor runs no backward for it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a complex → real cast discards the imaginary part, and says so
            outs = case.op.compute(*xs)
            if diff and any(_carries(outs)):
                _autograd(case.op, xs, [torch.ones_like(o) if c else None for o, c in zip(outs, _carries(outs))], diff)
                return True
    except (RuntimeError, NotImplementedError, TypeError, O.OpError):  # TypeError: 2.15's view_as_complex of complex
        pass
    return False


# --- layouts ---------------------------------------------------------------------------------------------------
def _permuted(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(0, 1).contiguous().movedim(1, 0) if t.ndim >= 2 else t


def _sliced(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a view ``[1:, ..., 1::2]`` of a buffer one longer in each leading dim, twice in the last."""
    if t.ndim == 0:
        return t
    big = t.new_zeros(tuple(n + 1 for n in t.shape[:-1]) + (2 * t.shape[-1] + 1,))
    view = big[(slice(1, None),) * (t.ndim - 1) + (slice(1, None, 2),)]
    view.copy_(t)
    return view


def _expanded(t: torch.Tensor) -> torch.Tensor:
    """``t``'s first slice along its first dim longer than 1, expanded back over it (stride 0): other values."""
    d = next((d for d, n in enumerate(t.shape) if n > 1), None)
    return t if d is None else t.narrow(d, 0, 1).expand(t.shape)


LAYOUTS = {"contiguous": lambda t: t, "permuted": _permuted, "sliced": _sliced, "expanded": _expanded}


# --- the executor's kernels and autograd -----------------------------------------------------------------------
def _recording_forward(local: LocalOp, types, out_types, grad_mask, saved: dict):
    """The executor's forward kernel of the node ``_kernel`` builds the backward of, recording its autograd graph in
    ``saved`` (for an op without a hand-written vjp)."""
    ins = tuple(Buffer(f"x{i}", t) for i, t in enumerate(types))
    outs = tuple(Buffer(f"y{k}", t) for k, t in enumerate(out_types))
    instr = Compute(TaskType.FWD, "op", local.op.kind, ins, outs, "fwd:op", kernel=Forward(local, None, grad_mask))
    return make_kernel(instr, OptimizerConfig(), lambda: 1, saved)


def _carries(outs) -> tuple[bool, ...]:
    """Which of the tensors ``outs`` can carry a gradient: the floating and complex ones."""
    return tuple(o.is_floating_point() or o.is_complex() for o in outs)


def _autograd(op: O.Op, xs, dys, diff):
    """``torch.func.vjp`` of ``op.compute`` in the inputs ``diff``, on contiguous copies (None: a missing dy), through
    the outputs that can carry a gradient."""
    xs = [x.contiguous() for x in xs]

    def f(*d):
        a = list(xs)
        for i, t in zip(diff, d):
            a[i] = t
        outs = op.compute(*a)
        return tuple(o for o, c in zip(outs, _carries(outs)) if c)

    outs, vjp = torch.func.vjp(f, *(xs[i] for i in diff))
    dys = [d for d, t in zip(dys, op.infer(_types(xs))) if O.differentiable(t.dtype)]
    return vjp(tuple(torch.zeros_like(o) if d is None else d.contiguous() for d, o in zip(dys, outs)))


RUNS = [(c, dt) for c in ALL_CASES for dt in DTYPES if _has_gradient(c, dt)]


def _differentiable(case: Case) -> bool:
    """Whether ``case`` takes float64 inputs and some of them and every output carry a gradient (by the op's
    ``grad_outputs``: by dtype, and none through a detach)."""
    xs = _inputs(case, torch.float64)
    try:
        outs = case.op.infer(_types(xs))
    except O.OpError:  # a complex-only op (view_as_real)
        return False
    need = tuple(x.is_floating_point() for x in xs)
    try:
        carried = case.op.grad_outputs(_types(xs), outs, need)
    except O.OpError:  # no derivative (aten copy): NO_AUTOGRAD lists it
        carried = tuple(O.differentiable(t.dtype) for t in outs)
    return any(need) and all(carried)


def test_every_op_class_and_function_has_a_case():
    """Every op class has a case with a gradient in every real dtype, and in complex where COMPLEX_CLASSES says; every
    function of a class's table has one unless NO_GRADIENT says why not; a case whose dtypes carry a gradient runs in
    float64 unless torch's autograd has no derivative for its ATen op (NO_AUTOGRAD)."""
    for dt in DTYPES:
        classes = {type(c.op) for c, d in RUNS if d == dt}
        no_gradient = {O.Detach, O.Histc, O.FullLike}  # outputs that are constants of the inputs
        want = set(O.OPS.values()) - no_gradient if not dt.is_complex else COMPLEX_CLASSES
        assert want <= classes, f"{dt}: no case with a gradient for {sorted(k.kind for k in want - classes)}"
    tables = {
        O.Unary: O.UNARY_FNS,
        O.Binary: O.BINARY_FNS,
        O.Scalar: O.SCALAR_FNS,
        O.Reduce: O.REDUCE_FNS,
        O.Pool: O.POOL_FNS,
    }
    f64 = {c.label for c, d in RUNS if d == torch.float64}
    untested = [c for c in ALL_CASES if c.label not in f64 and _differentiable(c)]
    assert {getattr(c.op, "target", None) for c in untested} <= set(NO_AUTOGRAD), [c.label for c in untested]
    for cls, fns in tables.items():
        covered = {c.op.fn for c, _ in RUNS if type(c.op) is cls}
        assert set(fns) - covered <= set(NO_GRADIENT), (
            f"{cls.kind}: no case for {set(fns) - covered - set(NO_GRADIENT)}"
        )
        assert not covered & set(NO_GRADIENT), "NO_GRADIENT lists a function that has a gradient"


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
@pytest.mark.parametrize(
    "case, dtype", RUNS, ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v.label
)
def test_executor_gradients_equal_autograds(case, dtype):
    """Each layout on the inputs and output gradients together, on the inputs alone and on the gradients alone."""
    op = case.op
    local = LocalOp(op, (1.0,) * len(case.inputs))
    gen = torch.Generator().manual_seed(2)
    base = _inputs(case, dtype)
    out_types = op.infer(_types(base))
    base_dys = [  # an integer output's gradient is never given (dy_masks): zeros stand in for it
        torch.randn(t.shape, generator=gen, dtype=O.torch_dtype(t.dtype))
        if O.differentiable(t.dtype)
        else torch.zeros(t.shape, dtype=O.torch_dtype(t.dtype))
        for t in out_types
    ]
    grad_mask = tuple(x.dtype.is_floating_point or x.dtype.is_complex for x in base)
    diff = [i for i, m in enumerate(grad_mask) if m]
    carried = tuple(O.differentiable(t.dtype) for t in out_types)  # topk's indices: none
    last = max(k for k, c in enumerate(carried) if c)
    dy_masks = [carried] + ([tuple(c and k != last for k, c in enumerate(carried))] if sum(carried) > 1 else [])
    for (layout, lay), on in itertools.product(LAYOUTS.items(), ("inputs and dys", "inputs", "dys")):
        if layout == "contiguous" and on != "inputs and dys":
            continue
        xs = [lay(x) for x in base] if on != "dys" else base
        all_dys = [lay(d) for d in base_dys] if on != "inputs" else base_dys
        refused = LAYOUT_REFUSED.get((getattr(op, "target", None), layout))
        if refused and on != "dys":
            with pytest.raises(RuntimeError):
                op.compute(*xs)
            continue
        types = _types(xs)
        hand = hand_vjp(op, types + _types(all_dys)) is not None
        for dy_mask in dy_masks:
            dys = [d if m else None for d, m in zip(all_dys, dy_mask)]
            want = _autograd(op, xs, dys, diff)
            given = [d for d in dys if d is not None]
            runs = {
                "hand" if hand else "autograd": _kernel(local, types, out_types, grad_mask, dy_mask, (1.0,) * len(xs))(
                    xs + given
                )
            }
            if not hand:
                saved = {}
                _recording_forward(local, types, out_types, grad_mask, saved)(xs)
                assert set(saved) == {("op", 0)}
                runs["recorded graph"] = _kernel(local, types, out_types, grad_mask, dy_mask, (1.0,) * len(xs), saved)(
                    xs + given
                )
                assert not saved  # the backward took the recorded graph
            for path, got in runs.items():
                assert len(got) == len(want)
                for i, g, w in zip(diff, got, want):
                    where = f"{case.label}, {layout} {on}, {path}, dys {dy_mask}: input {i}"
                    assert g.shape == xs[i].shape and g.dtype == xs[i].dtype, where
                    torch.testing.assert_close(g, w, atol=TOL[dtype], rtol=TOL[dtype], msg=where)
