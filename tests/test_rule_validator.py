"""The rule validator (shardflow.parallel.validate) over every op and every input placement.

CI runs a reduced set: every op case on ``tp=2`` and ``tp=4`` with all combinations, and on ``dp=2,tp=2``
a seeded sample of at most 2000 combinations per op (a few seconds). ``SHARDFLOW_LONG=1`` runs the full sweep
(~190 000 combinations, about 30 s; the same as ``python tools/validate_rules.py``).

Two things must hold: no combination the rules accept computes a wrong result (a rule bug), and each op
keeps accepting at least as many combinations as it does today (so a rule that becomes over-restrictive
fails here). The minimums are the counts measured when the validator was written, raised as rules learned to
accept more (relu, tanh and neg: Partial('max') pieces). The validator checks the rules themselves: it builds
with ``strict=True``, so a refusal is counted as one instead of being redistributed.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
from pathlib import Path

import pytest

from shardflow.graph import ops as O
from shardflow.parallel import rules
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import lift
from shardflow.parallel.simulate import simulate_outputs
from shardflow.parallel.validate import (
    CASES,
    case_graph,
    case_values,
    check_combination,
    combinations,
    combo_text,
    count_combinations,
    validate_rules,
)

LONG = os.environ.get("SHARDFLOW_LONG") == "1"
REDUCED = dict(max_combinations=2000, seed=0)
TOOL = Path(__file__).parents[1] / "tools" / "validate_rules.py"

# Accepted (and correct) combinations per case, summed over tp=2, tp=4 and dp=2,tp=2.
MIN_ACCEPTED_REDUCED = {
    "linear": 19,
    "linear(no bias)": 64,
    "embedding": 24,
    "layer_norm": 4,
    "dropout(p=0)": 15,
    "relu": 24,
    "gelu": 15,
    "tanh": 24,
    "neg": 42,
    "add": 157,
    "add(broadcast)": 109,
    "sub": 157,
    "mul": 123,
    "mul(broadcast)": 83,
    "div": 89,
    "scalar add": 33,
    "scalar rsub": 33,
    "scalar mul": 33,
    "scalar div": 33,
    "scalar rdiv": 15,
    "matmul": 64,
    "matmul(batched)": 73,
    "permute": 46,
    "reshape(split dim)": 33,
    "reshape(merge dims)": 33,
    "reshape(flatten)": 22,
    "split": 22,
    "softmax": 15,
    "sum(dim 1)": 31,
    "mean(dim 0, keepdim)": 31,
    "mean(all)": 29,
    "attention": 4,
    "cross_entropy(mean)": 8,
    "cross_entropy(sum)": 8,
    "max_pool": 24,
    "avg_pool(padded)": 33,
    "view_as_complex": 15,
    "view_as_real": 15,
    "topk": 8,
    "histc": 15,
    "full_like": 15,
    "scatter": 8,
    "experts": 2,  # a sample of 2000 of 10,584 per mesh: test_every_form_of_the_expert_layer_is_accepted_and_right
}
MIN_ACCEPTED_FULL = MIN_ACCEPTED_REDUCED | {"linear": 64, "layer_norm": 8, "matmul(batched)": 83, "attention": 8}


@pytest.fixture(scope="module")
def reduced():
    return validate_rules(**REDUCED)


def test_every_op_kind_has_a_case():
    assert {c.kind for c in CASES} == set(O.OPS)
    for c in CASES:  # degrees 2 and 4 must divide every input dim but broadcast (size-1) ones and complex pairs
        pair = isinstance(c.op, O.ComplexView) and c.op.to_complex  # the last dim: (real, imaginary), never cut
        assert all(n % 4 == 0 for s in c.inputs for n in s.shape[: len(s.shape) - pair] if n > 1), c.label


def test_no_accepted_combination_is_wrong(reduced):
    assert reduced.total("wrong") == 0, "\n".join(map(str, reduced.wrong))
    assert reduced.wrong == []


def test_rules_are_not_over_restrictive(reduced):
    got = reduced.by_op("accepted")
    low = {k: (got.get(k, 0), n) for k, n in MIN_ACCEPTED_REDUCED.items() if got.get(k, 0) < n}
    assert not low, f"ops now accepting fewer combinations (got, minimum): {low}"


def test_counts_add_up(reduced):
    for r in reduced.rows:
        assert r.tried == r.accepted + r.wrong + r.rejected + r.unrepresentable, r
        assert r.local_candidates <= r.candidates <= r.rejected, r
    assert len(reduced.candidates) == reduced.total("candidates")
    assert all("P(" not in f.placements for f in reduced.candidates)  # candidates: Shard/Replicate inputs only


def test_every_form_of_the_expert_layer_is_accepted_and_right():
    """The expert layer has 5 inputs (10,584 combinations per axis, so the reduced sweep samples them): on tp=2 and
    tp=4, all of them. Exactly three are accepted, and each computes the right pieces on every device: the tokens
    sharded (x, idx, w), the experts sharded (w1, w2: each device its experts, the output ``Partial(sum)``), or
    nothing sharded."""
    case = next(c for c in CASES if c.label == "experts")
    graph, values = case_graph(case), case_values(case)
    want = simulate_outputs(lift(graph), values)
    for text in ("tp=2", "tp=4"):
        mesh = Mesh.parse(text)
        outcomes: dict[str, list[str]] = {}
        for combo in combinations(case, mesh):
            outcome = check_combination(case, graph, mesh, combo, values, want, 0)[0]
            outcomes.setdefault(outcome, []).append(combo_text(case, combo))
        assert "wrong" not in outcomes, outcomes["wrong"][:3]
        assert sorted(outcomes["ok"]) == [
            "x=(R) idx=(R) w=(R) w1=(R) w2=(R)",
            "x=(R) idx=(R) w=(R) w1=(S(0)) w2=(S(0))",
            "x=(S(0)) idx=(S(0)) w=(S(0)) w1=(R) w2=(R)",
        ], text


def test_sampling_is_deterministic_and_covers_small_sets():
    case = next(c for c in CASES if c.label == "attention")
    mesh = Mesh.parse("dp=2,tp=2")
    assert count_combinations(case, mesh) == (7**2) ** 3
    a, b = list(combinations(case, mesh, 50, seed=3)), list(combinations(case, mesh, 50, seed=3))
    assert a == b and len(set(a)) == 50
    relu = next(c for c in CASES if c.label == "relu")
    assert len(list(combinations(relu, mesh, 50))) == 36  # fewer than the limit: all of them


def test_a_broken_rule_is_caught(monkeypatch):
    """The validator is not vacuous: a linear rule that forgets to split the bias over the partial pieces
    (row parallel), and a unary rule that lets any function run on any partial, are reported as WRONG exactly
    where the math breaks: relu of sum/avg pieces (relu is monotone, so it does commute with max), and neg of
    max pieces (neg turns a max into a min)."""

    def no_bias_scale(ctx):
        res = rules.rule_linear(ctx)
        return dataclasses.replace(res, local=dataclasses.replace(res.local, in_scale=(1.0,) * len(ctx.names)))

    def relu_on_partials(ctx):
        s = ctx.shardings[0]
        return rules.RuleResult((ctx.output(s.dims, s.partial, s.reduce_op),), ctx.local())

    monkeypatch.setitem(rules.RULES, O.Linear, no_bias_scale)
    monkeypatch.setitem(rules.RULES, O.Unary, relu_on_partials)
    report = validate_rules(["linear", "relu", "neg"], ["tp=2"])
    wrong = {(f.label, f.placements) for f in report.wrong}
    assert ("linear", "x=(S(1)) w=(S(1)) b=(R)") in wrong
    assert {p for label, p in wrong if label == "relu"} == {"x=(P(sum))", "x=(P(avg))"}
    assert {p for label, p in wrong if label == "neg"} == {"x=(P(max))"}
    assert "accepted-but-WRONG combinations: " in report.table()


def test_locally_computable_candidates_are_real():
    """The 'locally computable yet rejected' hint: a cumprod (an ATen op without a rule of its own) over dim 1 of
    an input sharded on dim 0 would need no communication, but the replicate-everything fallback refuses it."""
    report = validate_rules(["aten(cumprod)"], ["tp=2"])
    assert [f.placements for f in report.local_candidates] == ["x=(S(0))"]


def test_the_tool_prints_a_table(capsys):
    main = runpy.run_path(str(TOOL))["main"]  # tools/validate_rules.py, not run as __main__
    assert main(["--ops", "relu,scalar add", "--mesh", "tp=2", "--candidates"]) == 0
    out = capsys.readouterr().out
    assert "relu" in out and "TOTAL" in out and "accepted-but-WRONG combinations: 0" in out


@pytest.mark.skipif(not LONG, reason="full sweep (~30 s): set SHARDFLOW_LONG=1")
def test_full_sweep():
    report = validate_rules()
    assert report.wrong == [], "\n".join(map(str, report.wrong))
    got = report.by_op("accepted")
    low = {k: (got.get(k, 0), n) for k, n in MIN_ACCEPTED_FULL.items() if got.get(k, 0) < n}
    assert not low, f"ops now accepting fewer combinations (got, minimum): {low}"
