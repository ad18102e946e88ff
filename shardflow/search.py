"""``--strategy auto``: the fastest plan that fits, chosen by the simulator (docs/search.md).

The search space is every preset a world of N devices can run (:func:`candidates`): each factorization of N into
a pipeline, data-parallel, fully-sharded, context-parallel and tensor-parallel axis (mesh order
``pp, dp, fsdp, cp, tp``: tensor parallelism innermost, on consecutive ranks of one node, a pipeline outermost; cp
where the batch runs out of sequences, with each of its attention forms), tensor parallelism with and without
sequence parallelism, and under a pipeline its microbatches (p, 2p, 4p) and schedule (1F1B, GPipe, interleaved over
two chunks per stage); activation checkpointing per block and gradient accumulation (2 or 4 micro-steps; not under a
pipeline: :func:`fallbacks`) are tried, in the order of :data:`FALLBACKS`, where a candidate does not fit without
them, and then checkpointing of
only the first K blocks (:func:`fewer_checkpointed`). Each candidate is planned, lowered and replayed on the
machine spec (:meth:`~shardflow.pipeline.Pipeline.predict`) — a model of many repeated blocks on two copies cut
down to 3 and 4 blocks per pipeline chunk, drawn as a line to its length (:data:`FOLD`,
:func:`~shardflow.simulator.estimate.extrapolate`), a pipeline of many microbatches composed from its programs for
few (:func:`few_microbatches`; the choice is predicted whole); the one with the smallest predicted step time whose
predicted peak fits the memory budget wins. Candidates are refused before any lowering where their degrees do not
divide the model or the batch (the planner's own errors, kept as the reason), where the parameters, gradients and optimizer
state alone exceed the budget (a lower bound on the peak), and where a lower bound on their step time is no better
than the best found (:func:`pipeline_bound`; docs/search.md#bounds).

Beyond the presets, each mesh without a pipeline that has a tp axis is tried with per-op placements on that axis:
the placement program over the rule tables (:mod:`shardflow.strategy.placements`, docs/search.md#per-op-placements),
whose answer is planned, lowered and replayed like a preset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from shardflow.capture import capture
from shardflow.graph import ComputationGraph
from shardflow.graph.blocks import FoldError, grow_blocks, keep_blocks, repeated_blocks
from shardflow.graph.graph import TensorRole
from shardflow.graph.ops import Experts, torch_dtype
from shardflow.graph.rebatch import RebatchError, rebatch
from shardflow.lower import LowerOptions
from shardflow.lower.cost import CPAttention
from shardflow.lower.dynamic import OPTIMIZER_SLOTS, ActivationCheckpointing
from shardflow.lower.passes import collector_paused
from shardflow.lower.program import Comm, Compute
from shardflow.lower.schedule import ScheduleKind, requested
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import placements_text
from shardflow.pipeline import Pipeline
from shardflow.runtime.accumulate import split_batch
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.simulator.analytic import Estimate, Profile, estimate
from shardflow.simulator.compose import ComposeError
from shardflow.simulator.cost import comm_seconds, compute_seconds
from shardflow.simulator.estimate import Prediction, cost_model, extrapolate
from shardflow.simulator.machine import MachineSpec
from shardflow.strategy.placements import Memory, considered, placement, placements_plan
from shardflow.strategy.plan import Plan

SEARCH_AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")  # the mesh's axes, outermost first (torchtitan's order)
# the axes expert parallelism is tried beside (the combinations the tests run: docs/concepts.md#expert-parallelism)
EP_WITH = ("fsdp", "ep", "tp")
# how attention reads a sequence split over cp, each tried as its own candidate (docs/search.md#context-parallelism)
CP_FORMS = (CPAttention.ALL_GATHER, CPAttention.RING, CPAttention.ALL_TO_ALL)
# what a candidate that does not fit tries next, in order: (activation checkpointing, × gradient accumulation)
FALLBACKS = (
    (ActivationCheckpointing.SELECTIVE, 1),
    (ActivationCheckpointing.BLOCK, 1),
    (ActivationCheckpointing.NONE, 2),
    (ActivationCheckpointing.BLOCK, 2),
    (ActivationCheckpointing.NONE, 4),
    (ActivationCheckpointing.BLOCK, 4),
)
MARGIN = 0.9  # the default memory budget: this share of the spec's device memory
# folding: a model of more than FOLD blocks per pipeline chunk is predicted from copies cut down to FOLD - 1 and
# FOLD blocks per chunk, drawn as a line to its whole length (docs/search.md#folding-repeated-blocks); not 2 and 3:
# a copy of 2 blocks has no middle block, whose backward under fsdp holds the next block's gathered weights and
# the last block's gradient bucket at once
FOLD = 4
# per-op placements whose predicted peak exceeds the budget: the program's memory is capped at these levels from the
# uncapped answer's bytes to the fewest (Memory.level): the fewest first, then halving the gap between the levels
# that fit and that do not (docs/search.md#per-op-placements)
SHRINKS = 3
# screening: a candidate is predicted while its estimate times the least ratio (prediction ÷ estimate) its family
# has shown, times this, is below the best step found — room for an error its family has not shown yet
# (docs/search.md#screening)
SLACK = 0.85
# screening: a pipeline's variants (itself, its fallbacks) whose estimated peak times its family's least ratio is
# over this many budgets are not predicted where a later one could fit (docs/search.md#screening)
FAR = 2.0
# what a per-op candidate's flags name its plan file: the one `shardflow plan --strategy auto --save-plan` writes
PLAN_FILE = "PLAN.json"


class SearchError(ValueError):
    """No candidate fits: the message names the smallest predicted peak and the budget."""


@dataclass(frozen=True)
class Candidate:
    """One plan the search tries: a preset ``strategy`` (``dp,tp``, ``fsdp,sp``, ...) on ``mesh``, with activation
    checkpointing ``ac`` (of the first ``ac_blocks`` blocks only where set), under a pipeline ``microbatches``, ``schedule`` and ``stages_per_rank``, and the step run
    as ``accumulate`` micro-steps (gradient accumulation). With ``placements``, the tp axis is placed op by op
    (:func:`~shardflow.strategy.placements.placements_plan`), its memory capped at ``memory_level`` (:class:`~shardflow.strategy.placements.Memory`).
    ``cp_attention``: how attention reads the sequence a cp axis splits (:class:`~shardflow.lower.cost.CPAttention`)."""

    mesh: Mesh
    strategy: str
    ac: ActivationCheckpointing = ActivationCheckpointing.NONE
    microbatches: int = 1
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    stages_per_rank: int = 1
    accumulate: int = 1
    ac_blocks: int | None = None
    placements: bool = False
    memory_level: float = 0.0
    cp_attention: CPAttention = CPAttention.AUTO

    @property
    def family(self) -> str:
        """The preset family the runners-up are grouped by: the strategy, or ``"<strategy> per-op"`` for per-op
        placements on its tp axis."""
        return f"{self.strategy} per-op" if self.placements else self.strategy

    def flags(self, plan_file: str = PLAN_FILE) -> list[str]:
        """The ``shardflow train``/``plan`` flags that run this candidate; per-op placements are the plan file
        ``plan_file`` (the one ``--save-plan`` writes)."""
        head = ["--plan", plan_file] if self.placements else ["--strategy", self.strategy]
        out = [*head, "--mesh", str(self.mesh)]
        if self.ac != ActivationCheckpointing.NONE:
            out += ["--ac", str(self.ac)]
        if self.ac_blocks is not None:
            out += ["--ac-blocks", str(self.ac_blocks)]
        if self.microbatches > 1:
            out += ["--microbatches", str(self.microbatches), "--schedule", str(self.schedule)]
        if self.stages_per_rank > 1:
            out += ["--stages-per-rank", str(self.stages_per_rank)]
        if self.accumulate > 1:
            out += ["--accumulate", str(self.accumulate)]
        if self.cp_attention != CPAttention.AUTO:
            out += ["--cp-attention", str(self.cp_attention)]
        return out

    def __str__(self) -> str:
        return " ".join(self.flags())

    def options(self, base: LowerOptions, spec: MachineSpec) -> LowerOptions:
        """``base`` with this candidate's checkpointing and schedule, its ``auto`` forms chosen on ``spec``."""
        return dataclasses.replace(self.step(base), cost=cost_model(spec, self.mesh))

    def step(self, base: LowerOptions) -> LowerOptions:
        """``base`` with this candidate's checkpointing, schedule and accumulation."""
        return dataclasses.replace(
            base,
            ac=self.ac,
            ac_blocks=self.ac_blocks,
            microbatches=self.microbatches,
            schedule=self.schedule,
            stages_per_rank=self.stages_per_rank,
            accumulate=self.accumulate,
            cp_attention=self.cp_attention,
        )


@dataclass(frozen=True)
class Outcome:
    """A candidate tried: its ``prediction`` (None where refused), ``refused``: why it was not predicted or does
    not fit ("" for a plan that fits), and ``composed``: the microbatches a pipeline's prediction was composed from
    (None: predicted whole; docs/search.md#composing-a-pipeline)."""

    candidate: Candidate
    prediction: Prediction | None = None
    refused: str = ""
    composed: int | None = None

    @property
    def fits(self) -> bool:
        return self.prediction is not None and not self.refused


def tokens_of(batch: Mapping[str, torch.Tensor]) -> int:
    """Tokens one step trains on: the elements of the batch's first integer tensor (token ids ``[B, T]``), else its
    rows (a batch of feature vectors)."""
    ids = next((t for t in batch.values() if not t.is_floating_point()), None)
    return ids.numel() if ids is not None else next(iter(batch.values())).shape[0]


def factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered ``parts``-tuple of positive integers whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, parts - 1):
                yield (d, *rest)


def candidates(
    world: int,
    blocks: int,
    batch: int,
    node: int | None = None,
    placements: bool = True,
    seq: int | None = None,
    experts: int | None = None,
) -> list[Candidate]:
    """Every preset candidate of ``world`` devices for a model of ``blocks`` repeated blocks and a step of ``batch``
    sequences of ``seq`` tokens (module docstring), without activation checkpointing (:func:`search` tries it where a
    candidate does not fit without): those whose data-parallel degree divides the batch, whose pipeline has no more
    stages than blocks, whose context-parallel degree divides the sequence (none where ``seq`` is None) and where the
    batch does not split over data-parallel axes of its degree in its place (cp then does what dp would — the same
    compute and activations per device, the same gradient all-reduce — and gathers keys and values besides:
    docs/search.md#context-parallelism), and whose tensor parallelism stays within a ``node`` of that many devices
    (None: any degree) — its
    collectives sit on the critical path of every block, and across nodes they run at the slower link (Megatron-LM's
    rule, Narayanan et al. 2021, §3.3). A mesh with a cp axis is tried with each way attention reads the split
    sequence (:data:`CP_FORMS`). An ep axis (expert parallelism: the batch split as over dp, each device storing its
    share of every expert layer's experts) is tried where the model has expert layers of ``experts`` experts (the
    count every layer's divides; None: no expert layer) and its degree divides them, beside the axes of
    :data:`EP_WITH` only. With ``placements``, each mesh without a pipeline, cp or ep axis that has a tp axis is
    also tried with per-op placements on it (:func:`~shardflow.strategy.placements.placements_plan`)."""
    out = []
    for sizes in factorizations(world, len(SEARCH_AXES)):
        axes = {a: s for a, s in zip(SEARCH_AXES, sizes) if s > 1}
        pp, cp, ep = axes.get("pp", 1), axes.get("cp", 1), axes.get("ep", 1)
        data = axes.get("dp", 1) * axes.get("fsdp", 1) * ep
        if batch % data or pp > max(blocks, 1) or (node is not None and axes.get("tp", 1) > node):
            continue
        if ep > 1 and (experts is None or experts % ep or set(axes) - set(EP_WITH)):
            continue
        if cp > 1 and (seq is None or seq % cp or batch % (data * cp) == 0):
            continue  # cp where the batch runs out of sequences: else dp in its place dominates it
        mesh = Mesh(tuple(axes), tuple(axes.values())) if axes else Mesh(("d",), (1,))
        names = [a for a in axes]
        variants = [names] + ([[("sp" if a == "tp" else a) for a in names]] if "tp" in axes else [])
        forms = CP_FORMS if cp > 1 else (CPAttention.AUTO,)
        for parts, form in itertools.product(variants, forms):
            strategy = ",".join(parts) or "single"
            plain = Candidate(mesh, strategy, cp_attention=form)
            if pp == 1:
                out.append(plain)
                if placements and parts == names and "tp" in axes and cp == ep == 1:  # each op's placements on tp
                    out.append(dataclasses.replace(plain, placements=True))
                continue
            for m in (pp, 2 * pp, 4 * pp):
                if (batch // data) % m:
                    continue
                schedules = [(ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.GPIPE, 1)]
                if blocks >= 2 * pp:
                    schedules.append((ScheduleKind.INTERLEAVED, 2))
                out += [
                    dataclasses.replace(plain, microbatches=m, schedule=kind, stages_per_rank=v)
                    for kind, v in schedules
                ]
    return out


def expert_count(graph: ComputationGraph) -> int | None:
    """The number of experts every expert layer of ``graph`` has a multiple of (their greatest common divisor: an ep
    degree must divide each layer's), None where it has no expert layer."""
    counts = [graph.tensors[n.inputs[3]].shape[0] for n in graph.nodes if isinstance(n.op, Experts)]
    return math.gcd(*counts) if counts else None


def _weight_bytes(graph: ComputationGraph) -> int:
    return sum(graph.tensors[w].type.nbytes for w in graph.weights)


def state_bytes(weights: int, candidate: Candidate, optimizer: OptimizerConfig, options: LowerOptions) -> int:
    """A lower bound on one rank's peak (bytes) for a model of ``weights`` bytes of weights: its share of the
    weights, their gradients, the optimizer's state slots and, under mixed precision, the master weights — sharded
    by every axis but the data-parallel and context-parallel ones (both replicate the weights); ep shards only the
    experts' weights, so dividing by it too keeps the bound below."""
    shards = math.prod(s for a, s in zip(candidate.mesh.axis_names, candidate.mesh.shape) if a not in ("dp", "cp"))
    return state_copies(optimizer, options) * weights // shards


def state_copies(optimizer: OptimizerConfig, options: LowerOptions) -> int:
    """Bytes of state a trained weight holds per byte of its own: itself, its gradient, the optimizer's slots and,
    under mixed precision, its master copy."""
    return 2 + len(OPTIMIZER_SLOTS[optimizer.slots]) + (1 if options.precision else 0)


@dataclass(frozen=True)
class SearchResult:
    """The search's answer: ``best`` (:attr:`pipeline`: planned on the whole model and ready to lower), every
    ``outcome`` tried or refused, the memory ``budget`` (bytes), the machine ``spec``, the search's wall time ``seconds``, the
    ``plan`` that plans a candidate on the whole model (for :func:`explain`; cached), ``unsearched``: the candidates
    not tried because the search's time limit ran out (:func:`search`'s ``time_limit``; 0: it searched them all), and
    ``left``: those not predicted because their estimate could not win, each with its promise (seconds; inf where
    it was estimated to fit in no variant; docs/search.md#screening)."""

    best: Outcome
    outcomes: tuple[Outcome, ...]
    budget: int
    spec: MachineSpec
    seconds: float
    plan: Callable[[Candidate], Pipeline] = dataclasses.field(repr=False, compare=False)
    unsearched: int = 0
    left: tuple[tuple[Candidate, float], ...] = ()

    @property
    def screened(self) -> int:
        """The candidates not predicted because their promise could not win (docs/search.md#screening)."""
        return len(self.left)

    @property
    def pipeline(self) -> Pipeline:
        """The choice planned on the whole model (its capture on the first ask, where the search folded)."""
        return self.plan(self.best.candidate)

    def alternatives(self) -> list[Outcome]:
        """The runner-up of each preset family (strategy): the fastest of its candidates that fits, else its
        smallest-peak one with why it does not, fastest first; then each family none of whose candidates was
        predicted, by its first refusal (a bound, its degrees, its state)."""
        best_of: dict[str, Outcome] = {}
        refused: dict[str, Outcome] = {}
        for o in self.outcomes:
            s = o.candidate.family
            if o is self.best:
                continue
            if o.prediction is None:
                refused.setdefault(s, o)
                continue
            cur = best_of.get(s)
            if cur is None or _rank(o) < _rank(cur):
                best_of[s] = o
        for c, promise in self.left:  # a family only screening left: its most promising candidate, and why
            if c.family not in refused:
                why = f"its estimate, {promise * 1e3:.4g} ms at best, could not beat the best step found"
                refused[c.family] = Outcome(c, None, why if promise < math.inf else "estimated to fit in no variant")
        unpredicted = [o for s, o in refused.items() if s not in best_of and s != self.best.candidate.family]
        return sorted(best_of.values(), key=_rank) + unpredicted

    def why(self, o: Outcome) -> str:
        """Why ``o`` lost to the best, in a few words."""
        if o.refused:
            return o.refused
        assert o.prediction is not None and self.best.prediction is not None
        slower = o.prediction.step_seconds / self.best.prediction.step_seconds - 1
        parts = _largest_part(o.prediction)
        return f"{slower:+.0%} step time (its largest part: {parts})"

    def to_json(self) -> dict[str, Any]:
        """``shardflow plan --strategy auto --format json``: ``mesh``, ``strategy``, ``flags``, ``predicted`` (the
        simulator's object), ``alternatives`` (each with its ``flags``, ``predicted``, ``composed_from``: the
        microbatches a pipeline's prediction was composed from or None, and ``why``), ``search_seconds``,
        ``budget_bytes``, ``tried``, ``refused``, ``unsearched`` (left at the time limit), ``screened`` (left by the
        estimate, docs/search.md#screening)."""
        assert self.best.prediction is not None
        return {
            "mesh": str(self.best.candidate.mesh),
            "strategy": self.best.candidate.family,
            "flags": self.best.candidate.flags(),
            "predicted": self.best.prediction.to_json(),
            "alternatives": [
                {
                    "strategy": o.candidate.family,
                    "flags": o.candidate.flags(),
                    "predicted": o.prediction.to_json() if o.prediction else None,
                    "composed_from": o.composed,
                    "why": self.why(o),
                }
                for o in self.alternatives()
            ],
            "search_seconds": self.seconds,
            "budget_bytes": self.budget,
            "tried": sum(o.prediction is not None for o in self.outcomes),
            "refused": sum(o.prediction is None for o in self.outcomes),
            "unsearched": self.unsearched,
            "screened": self.screened,
        }

    def describe(self) -> str:
        """The choice, its prediction and the runners-up, as text (``shardflow plan --strategy auto``)."""
        assert self.best.prediction is not None
        tried = sum(o.prediction is not None for o in self.outcomes)
        lines = [
            f"# --strategy auto on {self.spec.name}: {self.best.candidate} (searched {len(self.outcomes)} candidates, "
            f"{tried} predicted, in {self.seconds:.1f} s; memory budget {self.budget / 2**30:.3g} GiB per device)",
            *(
                [
                    f"# {self.screened} more candidates not searched: their estimates could not win "
                    "(docs/search.md#screening)"
                ]
                if self.screened
                else []
            ),
            *(
                [f"# the time limit ran out: {self.unsearched} candidates not tried (docs/search.md#a-time-limit)"]
                if self.unsearched
                else []
            ),
            self.best.prediction.describe(),
            "# runners-up (the best of each other strategy):",
        ]
        if self.best.candidate.placements:
            lines.insert(2, self.per_op())
        for o in self.alternatives():
            step = f"{o.prediction.step_seconds * 1e3:.4g} ms" if o.prediction else "-"
            if o.composed:
                step += f" (composed from {o.composed} microbatches)"
            lines.append(f"#   {o.candidate}: {step}; {self.why(o)}")
        return "\n".join(lines)

    def per_op(self) -> str:
        """One line: how many ops' outputs and weights the chosen per-op placements hold in each placement on tp."""
        pcg = self.pipeline.pcg
        ops = Counter(repr(placement(pcg.tensors[n.outputs[0]].sharding, "tp")) for n in pcg.nodes if not n.is_parallel)
        weights = Counter(
            repr(placement(t.sharding, "tp")) for t in pcg.tensors.values() if t.role == TensorRole.WEIGHT
        )
        text = ", ".join(f"{n} {p}" for p, n in ops.most_common())
        held = ", ".join(f"{n} {p}" for p, n in weights.most_common())
        return f"#   per-op placements on tp (docs/search.md#per-op-placements): ops {text}; weights {held}"


def _rank(o: Outcome) -> tuple:
    """Order of outcomes: those that fit by step time, then the others by peak."""
    assert o.prediction is not None
    return (not o.fits, o.prediction.step_seconds if o.fits else max(o.prediction.peak_bytes))


def _best(o: Outcome) -> tuple:
    """The search's choice among outcomes that fit: the fastest, then the fewest mesh axes, then no checkpointing."""
    return _rank(o), len(o.candidate.mesh.shape), o.candidate.ac != "none"


def _largest_part(p: Prediction) -> str:
    parts = vars(p.timeline.breakdown[p.slowest])
    name = max(parts, key=parts.__getitem__)
    return f"{name.replace('_', ' ')} {parts[name] * 1e3:.3g} ms"


def search(
    graph_for: Callable[[int, int | None], ComputationGraph],
    world: int,
    batch: int,
    tokens: int,
    base: LowerOptions,
    optimizer: OptimizerConfig,
    spec: MachineSpec,
    budget: int | None = None,
    blocks: int | None = None,
    fold: bool = True,
    progress: Callable[[Outcome], None] | None = None,
    placements: bool = True,
    time_limit: float | None = None,
    screen: bool = True,
    wanted: Callable[[Candidate], bool] | None = None,
) -> SearchResult:
    """The fastest preset of :func:`candidates` on ``world`` devices of ``spec`` whose predicted peak fits ``budget``
    bytes (default :data:`MARGIN` × the device's memory). ``graph_for(parts, keep)``: the model captured on one of
    ``parts`` equal parts of the step's ``batch`` sequences (``tokens`` in all) with only its first ``keep`` repeated
    blocks (None: all of them; :func:`~shardflow.graph.blocks.keep_blocks`); ``base``: the run's options (their
    checkpointing and schedule are the search's); ``blocks``: the model's repeated blocks (default: counted in the
    graph); ``progress``: called with each outcome as it is known; ``fold``: predict a model of many blocks from two cut-down copies (:data:`FOLD`; docs/search.md#folding-repeated-blocks);
    ``placements``: try per-op placements too (:func:`candidates`); ``time_limit``: seconds after which no further
    candidate is tried once one fits (None: try them all; docs/search.md#a-time-limit) — the answer is then the best
    of those tried, and :attr:`SearchResult.unsearched` counts the rest; ``screen``: try the candidates in the order
    of their estimates (:mod:`shardflow.simulator.analytic`) and stop where none left could win by them
    (docs/search.md#screening; False: every candidate, in the order above); ``wanted``: only the outcomes of candidates
    it holds for count, as the answer and as the best step found (None: all; ``benchmarks/search.py`` asks for the
    fastest preset so). Raises SearchError when nothing fits,
    ValueError for a time limit that is negative or not finite."""
    t0 = time.perf_counter()
    if time_limit is not None and not (math.isfinite(time_limit) and time_limit >= 0):
        raise ValueError(f"--search-seconds {time_limit}: give a finite number of seconds ≥ 0, or none for no limit")
    budget = budget if budget is not None else int(MARGIN * spec.device.memory_bytes)
    graphs: dict[tuple[int, int | None], ComputationGraph] = {}

    def graph(parts: int, keep: int | None = None) -> ComputationGraph:
        """The model captured on one of ``parts`` parts of the batch, cut down to ``keep`` blocks (None: all)."""
        if (parts, keep) not in graphs:
            graphs[parts, keep] = graph_for(parts, keep)
        return graphs[parts, keep]

    def weight_bytes(parts: int) -> int:
        """The whole model's weights (bytes), drawn through the cut-down copies where the search folds."""
        if not (fold and n_blocks > FOLD):
            return _weight_bytes(graph(parts))
        few, more = _weight_bytes(graph(parts, FOLD - 1)), _weight_bytes(graph(parts, FOLD))
        return few + (more - few) * (n_blocks - FOLD + 1)

    n_blocks = blocks if blocks is not None else len(repeated_blocks(graph(base.accumulate, None)))
    folded = min(n_blocks, FOLD) if fold and n_blocks else None  # the copy the search predicts through
    # the expert layers' experts, from that copy (where it folds, its first FOLD blocks)
    experts = expert_count(graph(base.accumulate, folded))
    outcomes: list[Outcome] = []
    planned: dict[Candidate, Pipeline] = {}
    # screening (docs/search.md#screening): each candidate's estimate, and per family the ratios (prediction ÷
    # estimate) of step and peak of every candidate predicted
    profile = Profile.of(graph(base.accumulate, folded), n_blocks, spec, base.accumulate) if screen else None
    estimates: dict[Candidate, Estimate] = {}
    ratios: dict[tuple, list[tuple[float, float]]] = {}

    def estimated(c: Candidate) -> Estimate:
        if c not in estimates:
            assert profile is not None
            # per-op placements on tp are estimated as sequence parallelism there: their program splits the rows too
            strategy = ",".join("sp" if a == "tp" else a for a in c.strategy.split(",")) if c.placements else c.strategy
            estimates[c] = estimate(
                profile, c.mesh, strategy, c.step(base), len(OPTIMIZER_SLOTS[optimizer.slots]), spec
            )
        return estimates[c]

    def calibration(family: tuple) -> tuple[float, float]:
        """The least ratios of step and peak seen in ``family``; before any, the least of every family's and 1."""
        seen = ratios.get(family) or [r for rs in ratios.values() for r in rs] + [(1.0, 1.0)]
        return min(r[0] for r in seen), min(r[1] for r in seen)

    chains: dict[Candidate, tuple[tuple[ActivationCheckpointing, Estimate], ...]] = {}

    def promise(c: Candidate, step: float, peak: float) -> float:
        """The least step (seconds) ``c`` could be predicted at, by the estimates of its chain of fallbacks
        (:func:`fallbacks`) times its family's least ratios ``step`` and ``peak``: the first that could fit the
        budget, or checkpointing the fewest blocks that could fit between the one before and it
        (:func:`fewer_checkpointed`); inf where none could fit."""
        if c not in chains:
            chains[c] = tuple(
                (ac, estimated(dataclasses.replace(c, ac=ac, accumulate=c.accumulate * times)))
                for ac, times in variants_of(c)
            )
        before = None
        for ac, e in chains[c]:
            if e.peak_bytes * peak <= budget:
                best = e.step_seconds
                if before is not None and ac == ActivationCheckpointing.BLOCK and before.peak_bytes > e.peak_bytes:
                    best = _on_the_line(before, e, budget / peak)
                return best * step * SLACK
            before = e
        return math.inf

    def needless(c: Candidate, peak: float) -> set[int]:
        """The indices of ``c``'s variants (``c`` itself, then its :func:`fallbacks`) not predicted: those whose
        estimated peak times its family's least peak ratio ``peak`` is over the budget — over :data:`FAR` budgets
        under a pipeline — while a later one's could fit; but one anchor of the line to every block recomputed
        (:func:`fewer_checkpointed`): of those before the first that could fit with its micro-steps, the one whose
        line could reach the budget at the least step (docs/search.md#screening)."""
        chain, variants = chains[c], variants_of(c)  # the chain: filled by promise()
        scaled = [e.peak_bytes * peak for _, e in chain]
        first = next((i for i, x in enumerate(scaled) if x <= budget), None)
        if first is None:
            return set()
        limit = FAR * budget if c.microbatches > 1 else budget
        skip = {i for i in range(first) if scaled[i] > limit}
        times = variants[first][1]
        every = next(
            (j for j in range(first, len(chain)) if variants[j] == (ActivationCheckpointing.BLOCK, times)), None
        )
        if c.microbatches == 1 and every is not None:
            fit = chain[every][1]
            anchors = [i for i in skip if variants[i][1] == times and chain[i][1].peak_bytes > fit.peak_bytes]
            skip -= set(sorted(anchors, key=lambda i: _on_the_line(chain[i][1], fit, budget / peak))[:1])
        return skip

    def record(o: Outcome) -> Outcome:
        outcomes.append(o)
        c = o.candidate
        if screen and o.prediction and c.ac_blocks is None and not c.memory_level:
            e = estimated(c)
            ratios.setdefault(screen_family(c), []).append(
                (o.prediction.step_seconds / e.step_seconds, max(o.prediction.peak_bytes) / e.peak_bytes)
            )
        if progress:
            progress(o)
        return o

    placed: dict[tuple[int, int | None, Mesh, Memory], Plan] = {}

    def solved(parts: int, keep: int | None, mesh: Mesh, memory: Memory) -> Plan:
        """The per-op placements of the model on one of ``parts`` parts of the batch, cut down to ``keep`` blocks, on
        ``mesh`` under ``memory``: solved once, shared by the candidates that differ in what the program does not
        model (checkpointing, the schedule)."""
        key = (parts, keep, mesh, memory)
        if key not in placed:
            new = placements_plan(graph(parts, keep), mesh, spec, memory=memory)
            # an answer equal to one under another memory cap is that one: its predictions are shared (:func:`on`)
            placed[key] = next((q for k, q in placed.items() if k[:3] == key[:3] and q == new), new)
        return placed[key]

    def placements_of(c: Candidate, keep: int | None) -> Plan | None:
        """``c``'s per-op placements on the model cut down to ``keep`` blocks (None: ``c`` has none)."""
        if not c.placements:
            return None
        memory = Memory(c.memory_level, state_copies(optimizer, base), blocks=n_blocks)
        return solved(c.accumulate * c.microbatches, keep, c.mesh, memory)

    def plan(c: Candidate, keep: int | None = None, few: int | None = None) -> Pipeline:
        """Candidate ``c`` planned on the model cut down to ``keep`` blocks (None: the whole model, kept); with
        ``few``, for that many of its microbatches (:func:`few_microbatches`)."""
        whole = keep is None and few is None
        if whole and c in planned:
            return planned[c]
        g = graph(c.accumulate * c.microbatches, keep)
        chosen = placements_of(c, keep)
        options = dataclasses.replace(c.options(base, spec), microbatches=few or c.microbatches)
        p = Pipeline.planned(g, c.mesh, options, optimizer, None if chosen else c.strategy, plan=chosen)
        if whole:
            planned[c] = p
        return p

    copies: dict[tuple[Candidate, int | None, int | None, int], tuple[Prediction, bool]] = {}  # see :func:`on`

    def predict(c: Candidate, compose: bool = True) -> tuple[Prediction, int | None]:
        """``c``'s prediction: on the whole model, or where it has more than FOLD blocks per pipeline chunk drawn
        through the model cut down to FOLD − 1 and FOLD blocks per chunk (:func:`extrapolate`); a pipeline's step
        composed from its programs for fewer microbatches where :func:`few_microbatches` says (and ``compose``).
        With it, the microbatches it was composed from (None: whole)."""
        chunks = c.stages_per_rank * math.prod(s for a, s in zip(c.mesh.axis_names, c.mesh.shape) if a == "pp")
        few = few_microbatches(c) if compose else None
        whole: list[int | None] = []  # the copies predicted whole where the composition refused

        def on(keep: int | None) -> Prediction:
            # a memory cap changes the prediction only through the placements it leads to
            key = (dataclasses.replace(c, memory_level=0.0), keep, few, id(placements_of(c, keep)))
            if key not in copies:
                copies[key] = predicted(keep)
            pred, was_whole = copies[key]
            if was_whole:
                whole.append(keep)
            return pred

        def predicted(keep: int | None) -> tuple[Prediction, bool]:
            if few:
                try:
                    return plan(c, keep, few).predict(spec, tokens, exact=False, microbatches=c.microbatches), False
                except ComposeError:  # its transfers would queue: predicted whole
                    pass
            return plan(c, keep).predict(spec, tokens, exact=False), True

        if not fold or n_blocks <= FOLD * chunks:
            pred = on(n_blocks if fold else None)  # all blocks; where the search folds, grown from the folded copy
        else:
            less, more = (on(k * chunks) for k in (FOLD - 1, FOLD))
            pred = extrapolate(less, more, (FOLD - 1) * chunks, FOLD * chunks, n_blocks)
        return pred, None if whole else few

    def attempt(c: Candidate, compose: bool = True) -> Outcome:
        with collector_paused():  # planning's and lowering's objects (lower/passes.py)
            return attempted(c, compose)

    def attempted(c: Candidate, compose: bool) -> Outcome:
        options = c.options(base, spec)
        data = math.prod(s for a, s in zip(c.mesh.axis_names, c.mesh.shape) if a in ("dp", "fsdp", "ep"))
        if batch % (c.accumulate * c.microbatches * data):
            return Outcome(c, None, f"the batch of {batch} does not split into its micro-batches")
        floor = state_bytes(weight_bytes(c.accumulate * c.microbatches), c, optimizer, options)
        if floor > budget:
            return Outcome(c, None, f"its weights, gradients and optimizer state alone need {_gib(floor)}")
        try:
            requested(c.mesh, c.schedule, c.microbatches, c.stages_per_rank)
            pred, composed = predict(c, compose)
        except ValueError as e:  # the planner's refusals (PlanError, DegreeError, RuleError, a schedule's)
            return Outcome(c, None, str(e).split("\n")[0])
        peak = max(pred.peak_bytes)
        fits = peak <= budget
        return Outcome(c, pred, "" if fits else f"peaks at {_gib(peak)} > budget {_gib(budget)}", composed)

    def fewest_exact(c: Candidate) -> Outcome:
        """Where the whole model is predicted anyway: ``c`` (checkpointing its first ``ac_blocks`` blocks, the count
        the line proposed) predicted exactly, and with fewer blocks checkpointed while that still fits."""
        assert c.ac_blocks is not None
        found = attempt(c)
        for k in range(c.ac_blocks - 1, 0, -1):
            o = attempt(dataclasses.replace(c, ac_blocks=k))
            if not o.fits:
                break
            found = o
        return found

    def counts(o: Outcome) -> bool:
        """Whether ``o`` fits and is of the plans asked for (``wanted``)."""
        return o.fits and (wanted is None or wanted(o.candidate))

    def fastest_fit() -> float:
        """The smallest predicted step (seconds) of the outcomes so far that fit and count (inf: none)."""
        return min((o.prediction.step_seconds for o in outcomes if counts(o) and o.prediction), default=math.inf)

    def capped(start: Outcome) -> list[Outcome]:
        """Per-op placements ``start`` that do not fit, with the program's memory capped (:data:`SHRINKS` tries):
        at the fewest bytes first (nothing fits if that does not), then bisecting the levels between the uncapped
        answer and the highest level known to fit, for the fastest that fits. None where ``start`` is already slower
        than the best that fits (a cap only adds communication)."""
        if start.prediction is None or start.prediction.step_seconds >= fastest_fit():
            return []
        tried, low, high = [], 0.0, 1.0
        for k in range(SHRINKS):
            level = 1.0 if k == 0 else (low + high) / 2
            o = attempt(dataclasses.replace(start.candidate, memory_level=level))
            tried.append(o)
            if k == 0 and not o.fits:
                break
            low, high = (low, level) if o.fits else (level, high)
        return tried

    # without a pipeline first, then pipelines by their microbatches and chunks (the cheapest to predict first); a pipeline is
    # predicted only where its bound is below the best step found (docs/search.md#bounds)
    order = sorted(
        candidates(
            world, n_blocks, batch // base.accumulate, spec.devices_per_node, placements, tokens // batch, experts
        ),
        key=lambda c: (c.microbatches > 1, c.microbatches, c.stages_per_rank, bubble(c)),
    )
    pending = [dataclasses.replace(c, accumulate=base.accumulate) for c in order]
    unsearched = 0
    left: list[tuple[Candidate, float]] = []
    while pending:
        over = time_limit is not None and time.perf_counter() - t0 >= time_limit
        if over and any(o.fits for o in outcomes):
            unsearched = len(pending)
            break
        # screened: those that could fit by their estimates first, then those without a pipeline (the cheaper to
        # predict), then the least promise; while nothing fits, every candidate is tried, by its plain estimate
        # where none could fit (docs/search.md#screening)
        if screen:
            calibrated = {f: calibration(f) for f in {screen_family(x) for x in pending}}
            promises = []
            for x in pending:
                hope = promise(x, *calibrated[screen_family(x)])
                promises.append((math.isinf(hope), x.microbatches > 1, hope, chains[x][0][1].step_seconds))
            found = fastest_fit()
            live = [i for i, p in enumerate(promises) if p[2] < found or found == math.inf]
            if over and found == math.inf and all(p[0] for p in promises):
                # past the limit with nothing fitting, none left could fit by its estimate: not tried
                # (docs/search.md#a-time-limit)
                unsearched = len(pending)
                break
            if not live:
                left = sorted(((x, p[2]) for x, p in zip(pending, promises)), key=lambda xp: xp[1])
                break
            c = pending.pop(min(live, key=promises.__getitem__))
        else:
            c = pending.pop(0)
        fastest = fastest_fit()
        if c.microbatches > 1 and (bound := pipeline_bound(c, outcomes)) >= fastest:
            record(Outcome(c, None, f"its bound {bound * 1e3:.4g} ms ≥ the best step found, {fastest * 1e3:.4g} ms"))
            continue
        # variants (itself, its fallbacks) whose estimated peaks are over the budget are left out where a later one
        # could fit, but for the anchor of the partial checkpointing line (docs/search.md#screening)
        skip = needless(c, calibration(screen_family(c))[1]) if screen else set()
        variants = [v for i, v in enumerate(variants_of(c)) if i not in skip]
        ac, times = variants[0]
        o = record(attempt(dataclasses.replace(c, ac=ac, accumulate=c.accumulate * times)))
        mine = [o]
        # where memory asks for it: recompute (a forward more), or accumulate (the weights' gathers and the update's
        # reduction once per micro-step), the fallbacks in that order until one fits
        # what the last candidate kept without checkpointing, or checkpointing selectively, peaked at: from it and
        # the same with every block recomputed, the first K blocks recomputed and the others as it has them
        kept: dict[ActivationCheckpointing, Outcome] = {}
        for ac, times in variants[1:]:
            # a fallback only adds work: none is tried for a candidate already slower than the best that fits; where
            # selective checkpointing fits, recomputing the first blocks whole and keeping the others' activations
            # may still be faster: every block recomputed is predicted too, for that line
            again = (
                o.fits and o.candidate.ac == ActivationCheckpointing.SELECTIVE and ac == ActivationCheckpointing.BLOCK
            )
            if not again and (
                o.prediction is None or any(x.fits for x in mine) or o.prediction.step_seconds >= fastest
            ):
                break
            kept[o.candidate.ac] = o
            o = record(attempt(dataclasses.replace(c, ac=ac, accumulate=c.accumulate * times)))
            mine.append(o)
            if o.fits and o.candidate.ac == ActivationCheckpointing.BLOCK:
                rests = (kept.get(ActivationCheckpointing.NONE), kept.get(ActivationCheckpointing.SELECTIVE))
                for rest in (r for r in rests if r is not None and not r.fits):
                    for partial in fewer_checkpointed(rest, o, n_blocks, budget):
                        record(partial if fold and n_blocks > FOLD else fewest_exact(partial.candidate))
        if c.placements:  # per-op placements that do not fit: cap the program's memory, as far as it pays
            for start in [x for x in mine if x.prediction and not x.fits and x.candidate.accumulate == c.accumulate]:
                # screened, not where its estimate (sequence parallelism's bytes: the fewest) could not fit either
                if screen and estimated(start.candidate).peak_bytes * calibration(screen_family(c))[1] > budget:
                    continue
                for o in capped(start):
                    record(o)
    # a composed prediction does not win: the best is predicted again whole until a whole prediction is the best
    while (top := min(filter(counts, outcomes), key=_best, default=None)) and top.composed is not None:
        outcomes[outcomes.index(top)] = whole = attempt(top.candidate, compose=False)
        if progress:
            progress(whole)
    fitting = [o for o in outcomes if counts(o)]
    if not fitting:
        predicted = [o for o in outcomes if o.prediction is not None]
        least = min(predicted, key=_rank) if predicted else None
        raise SearchError(
            f"--strategy auto: no plan of {world} devices fits the memory budget {_gib(budget)} per device "
            + (f"(the smallest peak: {least.candidate}, {least.refused}); " if least else "(none could be planned); ")
            + (
                f"the time limit left {unsearched} candidates untried, none of which could fit by its estimate; "
                if unsearched
                else ""
            )
            + "add devices, lower --batch-size, or raise --memory-budget"
        )
    best = min(fitting, key=_best)
    seconds = time.perf_counter() - t0
    return SearchResult(best, tuple(outcomes), budget, spec, seconds, plan, unsearched, tuple(left))


def fallbacks(c: Candidate) -> tuple[tuple[ActivationCheckpointing, int], ...]:
    """What candidate ``c`` tries where it does not fit as planned, in order: :data:`FALLBACKS`, without accumulation
    under a pipeline — its microbatches already split the batch, its siblings with more microbatches are candidates
    of their own, and a pipeline that accumulates is predicted whole, not composed from few microbatches
    (:func:`few_microbatches`): minutes on hundreds of devices (docs/search.md#the-search-space)."""
    if c.microbatches > 1:
        return tuple(f for f in FALLBACKS if f[1] == 1)
    return FALLBACKS


def variants_of(c: Candidate) -> tuple[tuple[ActivationCheckpointing, int], ...]:
    """Candidate ``c`` as planned, then its :func:`fallbacks`, in the order they are tried: (activation
    checkpointing, × gradient accumulation)."""
    return ((c.ac, 1), *fallbacks(c))


def screen_family(c: Candidate) -> tuple:
    """The candidates whose estimates err alike (docs/search.md#screening): those of one preset family
    (:attr:`Candidate.family`) and tensor-parallel degree without a pipeline, and every pipeline."""
    if c.microbatches > 1:
        return ("pipeline",)
    return c.family, math.prod(s for a, s in zip(c.mesh.axis_names, c.mesh.shape) if a == "tp")


def few_microbatches(c: Candidate) -> int | None:
    """The microbatches pipeline candidate ``c`` is lowered for where the search composes its step from them
    (:func:`~shardflow.simulator.compose.compose`, docs/search.md#composing-a-pipeline): 3 under 1F1B and GPipe (a
    first, a middle and a last microbatch), 2 per stage under the interleaved schedule (with one per stage it runs
    every forward first). None where ``c`` is predicted whole: no pipeline, no more microbatches than that, or
    gradient accumulation (docs/simulator.md#composing-a-pipeline)."""
    p = math.prod(s for a, s in zip(c.mesh.axis_names, c.mesh.shape) if a == "pp")
    if p == 1 or c.accumulate > 1:
        return None
    few = 2 * p if c.schedule == ScheduleKind.INTERLEAVED else 3
    return few if c.microbatches > few else None


def bubble(c: Candidate) -> float:
    """The factor a pipeline's bubble stretches a step by, at least: (m + p − 1)/m for m microbatches on p stages
    under 1F1B and GPipe, (m + (p − 1)/v)/m interleaved over v chunks per stage (Narayanan et al., SC'21, §2.2);
    1 without a pipeline."""
    p = math.prod(s for a, s in zip(c.mesh.axis_names, c.mesh.shape) if a == "pp")
    return (c.microbatches + (p - 1) / c.stages_per_rank) / c.microbatches


def pipeline_bound(c: Candidate, outcomes: Sequence[Outcome]) -> float:
    """A floor under pipeline ``c``'s step (seconds) from the ``outcomes`` predicted so far: the larger of the least
    forward-and-backward compute of any rank predicted (a pipeline over the same devices computes as much per
    device) and the step of a sibling pipeline (same mesh, strategy and schedule, fewer microbatches) without its
    bubble — each stretched by ``c``'s :func:`bubble`. Smaller microbatches only add to the rest: each computes
    less efficiently, sends its own activations and, under fsdp, gathers the weights again. Another schedule is no
    sibling: the interleaved one sends each microbatch's activations V times, so its step over its bubble is no
    floor under 1F1B's."""
    predicted = [o.prediction for o in outcomes if o.prediction is not None]
    floor = min((min(b.compute for b in p.timeline.breakdown.values()) for p in predicted), default=0.0)
    siblings = [
        o.prediction.step_seconds / bubble(o.candidate)
        for o in outcomes
        if o.prediction is not None
        and (o.candidate.mesh, o.candidate.strategy, o.candidate.accumulate) == (c.mesh, c.strategy, c.accumulate)
        and (o.candidate.ac, o.candidate.schedule, o.candidate.stages_per_rank) == (c.ac, c.schedule, c.stages_per_rank)
    ]
    return max([floor, *siblings]) * bubble(c)


def _on_the_line(kept: Estimate, every: Estimate, cap: float) -> float:
    """The estimated step (seconds) of recomputing whole the fewest blocks that bring ``kept``'s peak down to ``cap``
    bytes, each block taking the same share of the way to ``every`` (every block recomputed), as
    :func:`fewer_checkpointed` draws it from predictions."""
    share = (kept.peak_bytes - cap) / (kept.peak_bytes - every.peak_bytes)
    return kept.step_seconds + (every.step_seconds - kept.step_seconds) * min(max(share, 0.0), 1.0)


def fewer_checkpointed(kept: Outcome, every: Outcome, blocks: int, budget: int) -> list[Outcome]:
    """Recomputation of only the first K of ``blocks`` blocks whole (``--ac-blocks K``) for the fewest K whose peak
    fits ``budget`` bytes: ``every`` is a candidate that fits with every block recomputed whole (``--ac block``),
    ``kept`` the same one that does not fit without checkpointing — the others then keep their activations — or
    with every block checkpointed selectively (``--ac selective``: the others then recompute selectively; same
    micro-steps). Each block recomputed whole takes the same share of the difference in
    time and memory between the two (:func:`extrapolate` over the blocks checkpointed), which overstates the peak
    of a partial checkpointing — the last block's recomputation saves nothing, its backward following at once —
    so the K chosen fits. Not under a pipeline, whose first stages hold the first blocks (and the most
    microbatches): [] there, and where no K below ``blocks`` fits."""
    c = every.candidate if kept.candidate.ac == ActivationCheckpointing.NONE else kept.candidate
    if "pp" in c.mesh.axis_names or kept.candidate.accumulate != every.candidate.accumulate:
        return []
    assert kept.prediction is not None and every.prediction is not None
    for k in range(1, blocks):
        p = extrapolate(kept.prediction, every.prediction, 0, blocks, k)
        if max(p.peak_bytes) <= budget:
            return [Outcome(dataclasses.replace(c, ac_blocks=k), p)]
    return []


def search_model(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    world: int,
    base: LowerOptions,
    optimizer: OptimizerConfig,
    spec: MachineSpec,
    budget: int | None = None,
    progress: Callable[[Outcome], None] | None = None,
    placements: bool = True,
    time_limit: float | None = None,
    screen: bool = True,
    wanted: Callable[[Candidate], bool] | None = None,
) -> SearchResult:
    """:func:`search` for module ``model`` and a step's ``batch`` (its dim 0 the sequences, :func:`tokens_of` its
    tokens): the model is captured on one of the parts each candidate's micro-batches cut the batch into; a copy
    with fewer repeated blocks is captured with its first ``ModuleList`` cut short where its forward loops over that
    list (:func:`cut_blocks`), else cut from the whole model's graph (:func:`~shardflow.graph.blocks.keep_blocks`);
    a copy with more blocks than the folded one (a pipeline's) is grown from it
    (:func:`~shardflow.graph.blocks.grow_blocks`) where the list's modules are alike (:func:`_structure`), cut from the
    whole model's graph where they are not or growing refuses. Once a copy
    is captured at two part sizes, the others are drawn from those two (:func:`~shardflow.graph.rebatch.rebatch`;
    docs/search.md#capturing-once-per-depth), captured only where that refuses. The whole model is captured for the
    plan the search returns."""
    rows = next(iter(batch.values())).shape[0]
    # blocks captured (None: all) → sequences → the graph; the depths whose two sizes draw no line
    captured: dict[int | None, dict[int, ComputationGraph]] = {}
    no_line: set[int | None] = set()
    uncut: set[int] = set()  # depths the model's forward cannot be cut to (it does not loop over its list)
    first = _first_list(model)
    first_len = len(first[1]) if first else 0
    # blocks the folded copy grows into (until grow_blocks refuses them)
    alike = first is not None and len({_structure(m) for m in first[1]}) == 1

    def drawn(depth: int | None, size: int) -> ComputationGraph | None:
        """The copy of ``depth`` blocks at ``size`` sequences from the two sizes captured first (None: no line)."""
        have = captured[depth]
        if size in have:
            return have[size]
        if len(have) < 2 or depth in no_line:
            return None
        (s1, g1), (s2, g2) = list(have.items())[:2]
        try:
            return rebatch(g1, s1, g2, s2, size)
        except RebatchError:
            no_line.add(depth)
            return None

    def graph_for(parts: int, keep: int | None) -> ComputationGraph:
        nonlocal alike
        size = rows // parts if rows % parts == 0 else None
        # two depths at most, each captured at two sizes: the folded copies' (FOLD blocks), from which any copy of
        # fewer blocks is cut and any of more grown, and the whole model's (itself, and where the blocks do not grow)
        grows = keep is not None and (keep <= FOLD or alike)
        depth = FOLD if grows and FOLD < first_len and FOLD not in uncut else None
        g = next((g for d in dict.fromkeys((depth, None)) if d in captured and size and (g := drawn(d, size))), None)
        if g is None:
            inputs = split_batch(batch, parts)[0]
            if depth is not None:
                with cut_blocks(model, depth):
                    g = capture(model, inputs)
                if len(repeated_blocks(g)) != depth:  # the forward does not loop over the list: cut the graph
                    uncut.add(depth)
                    depth, g = None, capture(model, inputs)
            else:
                g = capture(model, inputs)
            if size is not None:
                captured.setdefault(depth, {})[size] = g
        if keep is None or keep <= len(repeated_blocks(g)):
            return g if keep is None else keep_blocks(g, keep)
        try:
            return grow_blocks(g, keep)
        except FoldError:  # blocks that do not grow: cut from the whole model
            alike = False
            return graph_for(parts, keep)

    return search(
        graph_for,
        world,
        rows,
        tokens_of(batch),
        base,
        optimizer,
        spec,
        budget,
        blocks=len(first[1]) if first else None,
        progress=progress,
        placements=placements,
        time_limit=time_limit,
        screen=screen,
        wanted=wanted,
    )


def _structure(block: nn.Module) -> tuple:
    """What makes two blocks alike for :func:`~shardflow.graph.blocks.grow_blocks`: the class of each module and
    the name and shape of each parameter (a dense layer and a mixture of experts differ; a sliding-window and a
    global attention layer of the same weights do not, and cost the same)."""
    return tuple((n, type(m)) for n, m in block.named_modules()), tuple(
        (n, p.shape) for n, p in block.named_parameters()
    )


def _first_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's first ``ModuleList`` of modules (its repeated blocks, :func:`~shardflow.graph.blocks.
    repeated_blocks`), with its path."""
    return next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)), None)


@contextlib.contextmanager
def cut_blocks(model: nn.Module, keep: int) -> Iterator[None]:
    """Within the block, ``model``'s first ``ModuleList`` holds only its first ``keep`` modules (the same module
    objects: nothing is copied); restored on the way out, also on an error."""
    first = _first_list(model)
    if first is None:
        yield
        return
    path, blocks = first
    parent, _, name = path.rpartition(".")
    owner = model.get_submodule(parent)
    setattr(owner, name, nn.ModuleList(list(blocks)[:keep]))
    try:
        yield
    finally:
        setattr(owner, name, blocks)


def explain(result: SearchResult, target: str, rank: int = 0) -> str:
    """``shardflow plan --strategy auto --explain TARGET``: for the op ``target`` (a node of the captured graph, or a
    module path: every op in it), under the chosen plan and the runner-up of each other strategy, on ``rank``: the
    placements of its inputs and outputs, the seconds of its computes by task type (forward, backward, recompute,
    update) and of the communications that move its inputs and outputs (with their bytes), and the bytes of its
    outputs' pieces — each from the instruction costs of the machine spec (:mod:`shardflow.simulator.cost`).
    Raises ValueError for a target that names no op."""
    shown = [result.best, *(o for o in result.alternatives() if o.prediction is not None)]
    lines: list[str] = []
    for o in shown:
        p = result.plan(o.candidate)
        nodes = [n for n in p.pcg.nodes if not n.is_parallel and (n.name == target or _within(n.scope, target))]
        if not nodes:
            raise ValueError(
                f"--explain {target}: no op of the captured graph has that name or runs in that module; give a node "
                f"name or a module path from `shardflow plan --graph` (e.g. {p.pcg.nodes[0].name!r})"
            )
        step = p.lower((rank,))
        prog, dg = step.programs[rank], step.dg
        names = {n.name for n in nodes}
        recomputed = {n.name for n in dg.nodes if n.recompute}
        near = {t for n in nodes for t in (*n.inputs, *n.outputs)}
        near |= {t for n in p.pcg.nodes if n.is_parallel and set(n.outputs) & near for t in n.inputs}
        compute: dict[str, float] = {}
        comm: dict[str, tuple[int, int, float]] = {}
        for i in prog.instrs:
            if isinstance(i, Compute) and i.node in names:
                task = "recompute" if i.dnode in recomputed else str(i.task)
                compute[task] = compute.get(task, 0.0) + compute_seconds(i, result.spec)
            elif isinstance(i, Comm) and i.value in dg.values and dg.values[i.value].tensor in near:
                n_, b, t = comm.get(str(i.kind), (0, 0, 0.0))
                comm[str(i.kind)] = (n_ + 1, b + i.nbytes, t + comm_seconds(i, result.spec))
        tensors = p.pcg.tensors
        out_bytes = sum(
            tensors[t].pshape.piece_numel * torch_dtype(tensors[t].type.dtype).itemsize
            for n in nodes
            for t in n.outputs
        )
        first = nodes[0]
        places = ", ".join(f"{t} {placements_text(tensors[t].sharding, tensors[t].group)}" for t in first.inputs)
        outs = ", ".join(placements_text(tensors[t].sharding, tensors[t].group) for t in first.outputs)
        label = "chosen" if o is result.best else "runner-up"
        step_s = f"{o.prediction.step_seconds * 1e3:.4g} ms" if o.prediction else "-"
        lines += [
            f"# {label}: {o.candidate} (step {step_s})",
            f"#   {first.name} ({first.op.kind} in {first.scope or 'the model'}"
            + (f", and {len(nodes) - 1} more ops" if len(nodes) > 1 else "")
            + f"): inputs {places} → output {outs}",
            "#   compute: " + (", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in compute.items()) or "none on this rank"),
            "#   communication: "
            + (
                ", ".join(f"{k} ×{n} ({b / 2**20:.3g} MiB, {t * 1e3:.3g} ms)" for k, (n, b, t) in comm.items())
                or "none"
            ),
            f"#   outputs held: {out_bytes / 2**20:.3g} MiB on rank {rank}",
        ]
        if o.candidate.placements and any(n.name == target for n in p.graph.nodes):
            lines += _considered(p.graph, o.candidate.mesh, result.spec, target)
    return "\n".join([f"# --explain {target} on {result.spec.name}, rank {rank}", *lines])


def _considered(graph: ComputationGraph, mesh: Mesh, spec: MachineSpec, node: str, most: int = 8) -> list[str]:
    """Lines of :func:`explain`: the placement program's choices for ``node`` (the ``most`` cheapest, and the one it
    took), as it priced them."""
    rows = considered(graph, mesh, spec, node)
    shown = [r for k, r in enumerate(rows) if k < most or r[2]]
    out = [f"#   the placement program's {len(rows)} choices for {node} on tp, as it prices them (compute and moves):"]
    for c, seconds, taken in shown:
        ins = ", ".join(repr(placement(x, "tp")) for x in c.inputs)
        outs = ", ".join(repr(placement(x, "tp")) for x in c.outputs)
        out.append(f"#     [{ins}] → [{outs}]: {seconds * 1e3:.4g} ms" + ("  ← chosen" if taken else ""))
    return out


def _within(scope: str, module: str) -> bool:
    return scope == module or scope.startswith(module + ".")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"
