"""Rule validator: every sharding rule against the full-tensor computation, for every input placement.

For each compute op (a small instance of every kind in :data:`shardflow.graph.ops.OPS`, all dims 4 or 8 so
that degrees 2 and 4 divide them) and each mesh (default ``tp=2``, ``tp=4``, ``dp=2,tp=2``), every
combination of input placements is tried: on each mesh axis each input is ``Shard(d)`` for every dim ``d``,
``Replicate()``, ``Partial('sum')``, ``Partial('avg')`` or ``Partial('max')``. A combination is

* **rejected** — :func:`~shardflow.parallel.pcg.build_pcg` with ``strict=True`` (the rules themselves, no
  redistribution) raises ``RuleError`` / ``DegreeError`` / ``ShardingError``; or
* **accepted and correct** — the sharded run (:func:`~shardflow.parallel.simulate.simulate`, random partial
  pieces so a wrong scale shows) gives, on *every* device, the piece that the output's sharding says it holds
  of the single-device result (``simulate_outputs(lift(graph))``), within 1e-9 in float64; or
* **accepted but WRONG** — anything else (wrong numbers, wrong piece shapes, an unexpected exception). These
  are bugs in a rule; there must be none.

Combinations that no :class:`~shardflow.parallel.sharding.Sharding` can hold (two different partial reduce
ops on one tensor) are counted as *unrepresentable* and not tried.

"Valid but rejected" **candidates**: rejected combinations whose inputs are all ``Shard``/``Replicate`` (no
partials) — the places where a rule might be stricter than it needs to be. They are only candidates: most
need communication (a softmax over a sharded dim) and are rightly refused. A stronger hint is computed for
each candidate: whether running the op *unchanged* on every device's pieces already yields some valid output
sharding (``Shard``/``Replicate``/``Partial('sum')`` per axis) — i.e. the combination was computable with no
communication at all. Those are listed as *locally computable* candidates.

Run ``python tools/validate_rules.py`` for the full sweep (prints a table); the test suite runs a reduced set
(``tests/test_rule_validator.py``).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from shardflow.graph import GraphBuilder
from shardflow.graph import ops as O
from shardflow.graph.graph import ComputationGraph
from shardflow.parallel.mesh import Mesh, Partial, Placement, Replicate, Shard, SubMesh
from shardflow.parallel.pcg import PCG, Annotations, build_pcg, lift
from shardflow.parallel.shape import ShardingError
from shardflow.parallel.sharding import Sharding
from shardflow.parallel.simulate import scatter, simulate, simulate_outputs

ATOL = 1e-9
DEFAULT_MESHES = ("tp=2", "tp=4", "dp=2,tp=2")
PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"))


# --- the op instances --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputSpec:
    """One input of a case: ``shape``, ``dtype``; ``high`` for integer inputs (values in [0, high)),
    ``positive`` for divisors (values in [1, 2])."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float64"
    high: int = 0
    positive: bool = False


@dataclass(frozen=True)
class Case:
    """A small representative instance of one op: ``label`` (for the report), the op and its inputs."""

    label: str
    op: O.Op
    inputs: tuple[InputSpec, ...]

    @property
    def kind(self) -> str:
        return self.op.kind


def _x(name: str, *shape: int, **kw) -> InputSpec:
    return InputSpec(name, tuple(shape), **kw)


CASES: tuple[Case, ...] = (
    Case("linear", O.Linear(bias=True), (_x("x", 4, 8), _x("w", 4, 8), _x("b", 4))),
    Case("linear(no bias)", O.Linear(bias=False), (_x("x", 4, 8), _x("w", 4, 8))),
    Case("embedding", O.Embedding(), (_x("idx", 4, 8, dtype="int64", high=8), _x("w", 8, 4))),
    Case("layer_norm", O.LayerNorm(1), (_x("x", 4, 8), _x("w", 8), _x("b", 8))),
    Case("dropout(p=0)", O.Dropout(0.0), (_x("x", 4, 8),)),
    Case("detach", O.Detach(), (_x("x", 4, 8),)),
    Case("relu", O.Unary("relu"), (_x("x", 4, 8),)),
    Case("gelu", O.Unary("gelu"), (_x("x", 4, 8),)),
    Case("tanh", O.Unary("tanh"), (_x("x", 4, 8),)),
    Case("neg", O.Unary("neg"), (_x("x", 4, 8),)),
    Case("add", O.Binary("add"), (_x("a", 4, 8), _x("b", 4, 8))),
    Case("add(broadcast)", O.Binary("add"), (_x("a", 4, 8), _x("b", 8))),
    Case("sub", O.Binary("sub"), (_x("a", 4, 8), _x("b", 4, 8))),
    Case("mul", O.Binary("mul"), (_x("a", 4, 8), _x("b", 4, 8))),
    Case("mul(broadcast)", O.Binary("mul"), (_x("a", 4, 8), _x("b", 8))),
    Case("div", O.Binary("div"), (_x("a", 4, 8), _x("b", 4, 8, positive=True))),
    Case("scalar add", O.Scalar("add", 1.5), (_x("x", 4, 8),)),
    Case("scalar rsub", O.Scalar("rsub", 1.5), (_x("x", 4, 8),)),
    Case("scalar mul", O.Scalar("mul", 1.5), (_x("x", 4, 8),)),
    Case("scalar div", O.Scalar("div", 4.0), (_x("x", 4, 8),)),
    Case("scalar rdiv", O.Scalar("rdiv", 2.0), (_x("x", 4, 8, positive=True),)),
    Case("matmul", O.Matmul(), (_x("a", 4, 8), _x("b", 8, 4))),
    Case("matmul(batched)", O.Matmul(), (_x("a", 4, 8, 4), _x("b", 4, 4, 8))),
    Case("permute", O.Permute((2, 0, 1)), (_x("x", 4, 8, 4),)),
    Case("reshape(split dim)", O.Reshape((4, 4, 4)), (_x("x", 4, 16),)),
    Case("reshape(merge dims)", O.Reshape((4, 16)), (_x("x", 4, 4, 4),)),
    Case("reshape(flatten)", O.Reshape((32,)), (_x("x", 4, 8),)),
    Case("view_as_complex", O.ComplexView(True), (_x("x", 4, 8, 2),)),
    Case("view_as_real", O.ComplexView(False), (_x("z", 4, 8, dtype="complex128"),)),
    Case("split", O.Split((4, 4), 1), (_x("x", 4, 8),)),
    Case("softmax", O.Softmax(1), (_x("x", 4, 8, 4),)),
    Case("sum(dim 1)", O.Reduce("sum", (1,)), (_x("x", 4, 8),)),
    Case("mean(dim 0, keepdim)", O.Reduce("mean", (0,), True), (_x("x", 4, 8),)),
    Case("mean(all)", O.Reduce("mean", (0, 1)), (_x("x", 4, 8),)),
    Case("attention", O.Attention(causal=True), (_x("q", 4, 8, 4), _x("k", 4, 8, 4), _x("v", 4, 8, 4))),
    Case("linear(transposed, addmm)", O.Linear(bias=True, transposed=True), (_x("x", 4, 8), _x("w", 8, 4), _x("b", 4))),
    Case("silu", O.Unary("silu"), (_x("x", 4, 8),)),
    Case("rsqrt", O.Unary("rsqrt"), (_x("x", 4, 8, positive=True),)),
    Case("exp", O.Unary("exp"), (_x("x", 4, 8),)),
    Case("maximum", O.Binary("maximum"), (_x("a", 4, 8), _x("b", 4, 8))),
    Case("eq", O.Binary("eq"), (_x("a", 4, 8, dtype="int64", high=3), _x("b", 8, dtype="int64", high=3))),
    Case("scalar pow", O.Scalar("pow", 2.0), (_x("x", 4, 8),)),
    Case("scalar ne", O.Scalar("ne", 1), (_x("x", 4, 8, dtype="int64", high=3),)),
    Case("where", O.Where(), (_x("c", 4, 8, dtype="bool"), _x("a", 4, 8), _x("b", 8))),
    Case("cast(float32 → float64)", O.Cast("float64"), (_x("x", 4, 8, dtype="float32"),)),
    Case("cast(int64 → float64)", O.Cast("float64"), (_x("x", 4, 8, dtype="int64", high=5),)),
    Case("expand", O.Expand((4, 4, 8)), (_x("x", 4, 1, 8),)),
    Case("slice", O.Slice(1, 2, 8, 2), (_x("x", 4, 8),)),
    Case("cat", O.Cat(1), (_x("a", 4, 8), _x("b", 4, 4))),
    Case("gather", O.Gather(1), (_x("x", 4, 8), _x("idx", 4, 4, dtype="int64", high=8))),
    Case("pad", O.Pad((1, 2)), (_x("x", 4, 8),)),
    Case("pad(value)", O.Pad((0, 0, 1, 0), 1.5), (_x("x", 4, 8),)),
    Case("log_softmax", O.Softmax(1, log=True), (_x("x", 4, 8, 4),)),
    Case("amax(dim 1)", O.Reduce("amax", (1,)), (_x("x", 4, 8),)),
    Case(
        "attention(mask, gqa)",
        O.Attention(causal=False, mask=True, gqa=True),
        (_x("q", 4, 8, 4, 4), _x("k", 4, 4, 4, 4), _x("v", 4, 4, 4, 4), _x("m", 4, 1, 4, 4, dtype="bool")),
    ),
    Case("conv", O.Conv((1, 1), (0, 0), (1, 1)), (_x("x", 4, 4, 4, 4), _x("w", 4, 4, 1, 1), _x("b", 4))),
    Case("max_pool", O.Pool("max", (2, 2), (2, 2)), (_x("x", 4, 4, 8, 8),)),
    Case("avg_pool(padded)", O.Pool("avg", (3, 3), (2, 2), (1, 1), count_include_pad=False), (_x("x", 4, 4, 8, 8),)),
    Case("aten(cumprod)", O.Aten("aten.cumprod.default", (O.Arg(0), 1)), (_x("x", 4, 8),)),
    Case("sort", O.Sort(1, stable=True), (_x("x", 4, 8),)),
    Case("sort(integer routing)", O.Sort(0, stable=True), (_x("idx", 16, dtype="int64", high=4),)),
    Case("cumsum", O.Cumsum(1), (_x("x", 4, 8),)),
    Case("cumsum(integer counts)", O.Cumsum(0), (_x("counts", 8, 4, dtype="int64", high=5),)),
    Case(
        "index_add",
        O.IndexAdd(0),
        (_x("x", 4, 8), _x("idx", 8, dtype="int64", high=4), _x("src", 8, 8)),
    ),
    Case(
        "index_add(integer)",
        O.IndexAdd(0),
        (
            _x("x", 4, 8, dtype="int64", high=3),
            _x("idx", 8, dtype="int64", high=4),
            _x("src", 8, 8, dtype="int64", high=3),
        ),
    ),
    Case("topk", O.TopK(2, 1), (_x("x", 4, 8),)),
    Case("histc", O.Histc(4, -1.0, 1.0), (_x("x", 4, 8),)),
    Case("full_like", O.FullLike(1.5), (_x("x", 4, 8),)),
    Case("scatter", O.Scatter(1, 2.5), (_x("x", 4, 8), _x("idx", 4, 4, dtype="int64", high=8))),
    Case(
        "experts",
        O.Experts("silu"),
        (
            _x("x", 8, 4),
            _x("idx", 8, 4, dtype="int64", high=4),
            _x("w", 8, 4),
            _x("w1", 4, 8, 4),
            _x("w2", 4, 4, 4),
        ),
    ),
    Case("cross_entropy(mean)", O.CrossEntropy("mean"), (_x("logits", 8, 4), _x("target", 8, dtype="int64", high=4))),
    Case("cross_entropy(sum)", O.CrossEntropy("sum"), (_x("logits", 8, 4), _x("target", 8, dtype="int64", high=4))),
)


def case_graph(case: Case) -> ComputationGraph:
    """The one-node graph of ``case``: its inputs (role ``input``) and every output of the op."""
    b = GraphBuilder()
    names = [b.input(s.name, s.shape, s.dtype) for s in case.inputs]
    outs = b.apply(case.op, names, name="op")
    return b.build(list(outs))


def case_values(case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full input values: float64 (complex128) normal, integers in [0, high), divisors in [1, 2]."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for s in case.inputs:
        if s.dtype == "bool":
            out[s.name] = torch.randint(0, 2, s.shape, generator=gen).bool()
        elif s.high:
            out[s.name] = torch.randint(0, s.high, s.shape, generator=gen)
        elif s.positive:
            out[s.name] = 1.0 + torch.rand(s.shape, generator=gen, dtype=torch.float64)
        elif s.dtype == "complex128":
            out[s.name] = torch.randn(s.shape, generator=gen, dtype=torch.complex128)
        else:
            out[s.name] = torch.randn(s.shape, generator=gen, dtype=torch.float64)
    return out


# --- combinations ------------------------------------------------------------------------------------------
def placement_choices(ndim: int) -> tuple[Placement, ...]:
    """What one input may hold on one mesh axis."""
    return tuple(Shard(d) for d in range(ndim)) + (Replicate(),) + PARTIALS


def _text(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return "R"


def combo_text(case: Case, combo: Sequence[Sequence[Placement]]) -> str:
    return " ".join(f"{s.name}=({','.join(_text(p) for p in pl)})" for s, pl in zip(case.inputs, combo))


def count_combinations(case: Case, mesh: Mesh) -> int:
    return math.prod(len(placement_choices(len(s.shape))) ** mesh.ndim for s in case.inputs)


def combinations(case: Case, mesh: Mesh, limit: int | None = None, seed: int = 0) -> Iterator[tuple]:
    """Every combination (one placement tuple per input, one placement per mesh axis), or ``limit`` of them
    drawn at random (deterministic for a seed) when there are more."""
    per_input = [list(itertools.product(placement_choices(len(s.shape)), repeat=mesh.ndim)) for s in case.inputs]
    total = math.prod(len(x) for x in per_input)
    if limit is None or total <= limit:
        yield from itertools.product(*per_input)
        return
    for index in sorted(random.Random(seed).sample(range(total), limit)):
        combo = []
        for options in reversed(per_input):  # mixed-radix decode, last input fastest (as itertools.product)
            index, k = divmod(index, len(options))
            combo.append(options[k])
        yield tuple(reversed(combo))


# --- checking one combination ------------------------------------------------------------------------------
def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, or complex128 for a complex ``t`` (its imaginary part compared too)."""
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def piece_error(pieces: dict[int, torch.Tensor], sharding: Sharding, group: SubMesh, full: torch.Tensor) -> str | None:
    """None if ``pieces`` (device → piece) are exactly what ``sharding`` says each device holds of ``full``:
    every device has a piece of the piece shape, and for *every* replica the partial pieces of each block
    reduce to that block within :data:`ATOL`. Otherwise a one-line reason."""
    p = sharding.parallel_shape(group, tuple(full.shape))
    dmap = sharding.device_map(group)
    if set(pieces) != set(dmap):
        return f"pieces on devices {sorted(pieces)}, expected {sorted(dmap)}"
    blocks: dict[tuple, list[torch.Tensor]] = {}
    for d, c in dmap.items():
        x = pieces[d]
        if tuple(x.shape) != p.piece_shape:
            return f"device {d} holds a piece of shape {list(x.shape)}, expected {list(p.piece_shape)}"
        blocks.setdefault((c.replica, c.shard), []).append(x)
    for (replica, shard), parts in blocks.items():
        want = full[p.piece_index(next(c for c in dmap.values() if c.shard == shard))]
        got = p.reduce_op.combine(_wide(torch.stack(parts))) if len(parts) > 1 else _wide(parts[0])
        err = (got - _wide(want)).abs().max().item() if want.numel() else 0.0
        if not err <= ATOL:  # also catches NaN
            return f"replica {replica} block {list(shard)} is off by {err:.3g}"
    return None


@dataclass(frozen=True)
class Finding:
    """One combination worth reporting: case label, mesh, placements and what happened."""

    label: str
    mesh: str
    placements: str
    detail: str

    def __str__(self) -> str:
        return f"{self.label} on {self.mesh}: {self.placements}: {self.detail}"


@dataclass
class Row:
    """Counts for one case on one mesh."""

    label: str
    kind: str
    mesh: str
    tried: int = 0
    accepted: int = 0
    wrong: int = 0
    rejected: int = 0
    unrepresentable: int = 0
    candidates: int = 0
    local_candidates: int = 0
    seconds: float = 0.0


@dataclass
class ValidationReport:
    """Result of :func:`validate_rules`: one :class:`Row` per (case, mesh), and the findings.

    ``wrong``: accepted-but-wrong combinations (bugs; must be empty). ``candidates``: rejected combinations
    with Shard/Replicate inputs only ("valid but rejected" *candidates*); ``local_candidates``: the subset whose
    op, run unchanged on each device's pieces, gave a valid output sharding.
    """

    rows: list[Row] = field(default_factory=list)
    wrong: list[Finding] = field(default_factory=list)
    candidates: list[Finding] = field(default_factory=list)
    local_candidates: list[Finding] = field(default_factory=list)

    def total(self, attr: str) -> int:
        return sum(getattr(r, attr) for r in self.rows)

    def by_op(self, attr: str = "accepted") -> dict[str, int]:
        """``attr`` summed per case label."""
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.label] = out.get(r.label, 0) + getattr(r, attr)
        return out

    def by_kind(self, attr: str = "accepted") -> dict[str, int]:
        """``attr`` summed per op kind (``OPS`` key)."""
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.kind] = out.get(r.kind, 0) + getattr(r, attr)
        return out

    def table(self) -> str:
        """A plain-text table: one line per case and mesh, then totals and the findings."""
        head = ("op", "mesh", "tried", "ok", "WRONG", "rejected", "unrepr.", "cand.", "local", "s")
        lines = [head]
        for r in self.rows:
            lines.append(
                (
                    r.label,
                    r.mesh,
                    str(r.tried),
                    str(r.accepted),
                    str(r.wrong),
                    str(r.rejected),
                    str(r.unrepresentable),
                    str(r.candidates),
                    str(r.local_candidates),
                    f"{r.seconds:.1f}",
                )
            )
        lines.append(
            (
                "TOTAL",
                "",
                *(
                    str(self.total(a))
                    for a in (
                        "tried",
                        "accepted",
                        "wrong",
                        "rejected",
                        "unrepresentable",
                        "candidates",
                        "local_candidates",
                    )
                ),
                f"{self.total('seconds'):.1f}",
            )
        )
        widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
        out = [
            "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines
        ]
        out.insert(1, "-" * len(out[0]))
        out.insert(len(out) - 1, "-" * len(out[0]))
        out.append("")
        out.append(
            "ok = accepted and equal to the single-device result on every device; WRONG = accepted but not "
            "(a rule bug); unrepr. = placements no Sharding can hold; cand. = rejected with Shard/Replicate "
            'inputs only ("valid but rejected" CANDIDATES, mostly rightly rejected); local = candidates '
            "the unchanged op computes with no communication."
        )
        out.append(f"accepted-but-WRONG combinations: {len(self.wrong)}")
        out += [f"  WRONG {f}" for f in self.wrong[:50]]
        if self.local_candidates:
            out.append(
                f"locally computable yet rejected (candidates for over-restrictive rules): {len(self.local_candidates)}"
            )
            out += [f"  {f}" for f in self.local_candidates[:50]]
            if len(self.local_candidates) > 50:
                out.append(f"  ... and {len(self.local_candidates) - 50} more")
        return "\n".join(out)


def _local_output(
    case: Case,
    graph: ComputationGraph,
    mesh: Mesh,
    shardings: Sequence[Sharding],
    values: dict[str, torch.Tensor],
    want: Sequence[torch.Tensor],
) -> str | None:
    """If the op run unchanged on every device's input pieces yields a valid sharding of every output,
    that sharding (as text); else None."""
    group = SubMesh(mesh)
    pieces = []
    for s, spec in zip(shardings, case.inputs):
        holder = _Holder(s, group, graph.tensors[spec.name].type)
        pieces.append(scatter(values[spec.name], holder))
    try:
        outs = {d: case.op.compute(*(p[d] for p in pieces)) for d in group.devices()}
    except (RuntimeError, ValueError, IndexError):
        return None
    found = []
    for k, full in enumerate(want):
        per_axis = tuple(Shard(d) for d in range(full.ndim)) + (Replicate(), Partial("sum"))
        for pl in itertools.product(per_axis, repeat=mesh.ndim):
            try:
                s = Sharding.from_placements(pl, group, full.ndim)
                s.check(group, tuple(full.shape))
            except ShardingError:
                continue
            if piece_error({d: o[k] for d, o in outs.items()}, s, group, full) is None:
                found.append("(" + ",".join(_text(p) for p in pl) + ")")
                break
        else:
            return None
    return " ".join(found)


@dataclass(frozen=True)
class _Holder:
    """What :func:`~shardflow.parallel.simulate.scatter` needs of a tensor."""

    sharding: Sharding
    group: SubMesh
    type: O.TensorType


def check_combination(
    case: Case,
    graph: ComputationGraph,
    mesh: Mesh,
    combo: Sequence[Sequence[Placement]],
    values: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    seed: int = 0,
) -> tuple[str, str, list[Sharding] | None]:
    """``(outcome, detail, input shardings)``; outcome one of ``unrepresentable``, ``rejected``, ``ok``, ``wrong``."""
    group = SubMesh(mesh)
    try:
        shardings = [Sharding.from_placements(pl, group, len(s.shape)) for s, pl in zip(case.inputs, combo)]
        for s, spec in zip(shardings, case.inputs):
            s.check(group, spec.shape, "input", spec.name)
    except ShardingError as e:
        return "unrepresentable", str(e), None
    try:
        pcg = build_pcg(
            graph, mesh, Annotations(leaves={s.name: sh for s, sh in zip(case.inputs, shardings)}), strict=True
        )
    except ShardingError as e:  # RuleError and DegreeError are ShardingErrors
        return "rejected", str(e), shardings
    except Exception as e:  # noqa: BLE001 - anything else is a bug in the rules
        return "wrong", f"build_pcg raised {type(e).__name__}: {e}", shardings
    err = _numbers_error(pcg, graph, values, want, seed)
    return ("ok", "", shardings) if err is None else ("wrong", err, shardings)


def _numbers_error(pcg: PCG, graph: ComputationGraph, values, want, seed: int) -> str | None:
    """None if every device holds the right piece of every output of the sharded run; else why not."""
    try:
        got = simulate(pcg, values, seed)
    except Exception as e:  # noqa: BLE001 - a crash of an accepted plan is a rule bug
        return f"simulate raised {type(e).__name__}: {e}"
    for name in graph.outputs:
        t = pcg.tensors[name]
        err = piece_error(got[name], t.sharding, t.group, want[name])
        if err is not None:
            try:
                placed = "(" + ",".join(_text(p) for p in t.placements) + ")"
            except ShardingError:
                placed = str(t.sharding)
            return f"output {name} placed {placed}: {err}"
    return None


def validate_rules(
    ops: Iterable[str] | None = None,
    meshes: Iterable[Mesh | str] | None = None,
    *,
    max_combinations: int | None = None,
    local_check: bool = True,
    seed: int = 0,
    progress=None,
) -> ValidationReport:
    """Validate the sharding rules (see the module docstring).

    Args:
        ops: op kinds (keys of ``OPS``) or case labels to include; default every case.
        meshes: meshes (or their text, ``"dp=2,tp=2"``); default ``tp=2``, ``tp=4``, ``dp=2,tp=2``.
        max_combinations: per case and mesh, try at most this many combinations (a seeded random sample)
            instead of all of them.
        local_check: for each candidate, test whether the unchanged op is locally computable (slower).
        seed: seeds the values, the random partial pieces and the sample.
        progress: optional callable receiving each finished :class:`Row`.
    """
    wanted = set(ops) if ops is not None else None
    cases = [c for c in CASES if wanted is None or c.kind in wanted or c.label in wanted]
    if wanted is not None:
        unknown = wanted - {c.kind for c in CASES} - {c.label for c in CASES}
        if unknown:
            raise ValueError(
                f"unknown ops {sorted(unknown)}; kinds: {sorted(O.OPS)}; labels: {[c.label for c in CASES]}"
            )
    mesh_list = [Mesh.parse(m) if isinstance(m, str) else m for m in (meshes or DEFAULT_MESHES)]
    report = ValidationReport()
    for case in cases:
        graph = case_graph(case)
        values = case_values(case, seed)
        want = simulate_outputs(lift(graph), values)
        for mesh in mesh_list:
            row = Row(case.label, case.kind, str(mesh))
            start = time.perf_counter()
            for combo in combinations(case, mesh, max_combinations, seed):
                row.tried += 1
                outcome, detail, shardings = check_combination(case, graph, mesh, combo, values, want, seed)
                if outcome == "unrepresentable":
                    row.unrepresentable += 1
                elif outcome == "ok":
                    row.accepted += 1
                elif outcome == "rejected":
                    row.rejected += 1
                    if all(not s.partial for s in shardings):
                        row.candidates += 1
                        finding = Finding(case.label, str(mesh), combo_text(case, combo), detail)
                        report.candidates.append(finding)
                        if local_check:
                            local = _local_output(
                                case, graph, mesh, shardings, values, [want[o] for o in graph.outputs]
                            )
                            if local is not None:
                                row.local_candidates += 1
                                report.local_candidates.append(
                                    Finding(
                                        case.label,
                                        str(mesh),
                                        combo_text(case, combo),
                                        f"unchanged op gives output {local}; rule said: {detail}",
                                    )
                                )
                else:
                    row.wrong += 1
                    report.wrong.append(Finding(case.label, str(mesh), combo_text(case, combo), detail))
            row.seconds = time.perf_counter() - start
            report.rows.append(row)
            if progress:
                progress(row)
    return report
