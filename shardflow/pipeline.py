"""The pipeline of a training step, assembled once: capture → plan → lower (every micro-step) → executors → load
weights.

:func:`~shardflow.api.parallelize` (and so ``shardflow check``), ``shardflow train`` and ``shardflow plan`` each
parse their settings once into a :class:`~shardflow.lower.LowerOptions` (:meth:`~shardflow.lower.LowerOptions.parse`)
whose ``auto`` forms the machine's calibrated cost model chooses (:func:`machine_cost`), and build a
:class:`Pipeline` from it: the same model on the same mesh lowers to the same per-rank programs through every one
of them (:func:`~shardflow.lower.program.programs_fingerprint`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from shardflow.capture import capture
from shardflow.graph import ComputationGraph
from shardflow.graph.flops import training_flops
from shardflow.lower import CostModel, LoweredStep, LowerOptions, MicroStep, lower_step
from shardflow.lower.passes import LowerContext, PassRecord, collector_paused, run_passes
from shardflow.lower.schedule import Schedule, requested, schedule_of
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG, build_pcg, evaluation
from shardflow.runtime.accumulate import MicroSteps, split_batch
from shardflow.runtime.device import run_backend
from shardflow.runtime.executor import Executor
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.simulator.compose import compose
from shardflow.simulator.cost import EAGER, Kernels
from shardflow.simulator.estimate import EXACT_WORLD, Prediction, representatives, simulate
from shardflow.simulator.machine import MachineSpec, MachineSpecWarning
from shardflow.strategy import Plan, PlanError, make_plan, resolve
from shardflow.strategy.presets import AXIS_OF, cp_laid_out


def machine_cost(device: str, processes: int) -> CostModel:
    """The cost model that chooses the ``auto`` forms of every entry point: that of the torch.distributed backend
    ``processes`` processes use on this machine with ``device`` (``auto``, ``cpu``, ``cuda``:
    :func:`~shardflow.runtime.device.run_backend`), calibrated where ``shardflow calibrate`` wrote its file
    (:meth:`CostModel.for_backend`). Raises CalibrationError for a file that cannot be used."""
    return CostModel.for_backend(run_backend(device, processes))


def machine_spec(device: str, processes: int) -> tuple[MachineSpec, bool]:
    """This machine's spec for ``processes`` ranks on ``device`` (``MachineSpec.this`` over the backend they use,
    :func:`~shardflow.runtime.device.run_backend`) and whether ``shardflow calibrate`` measured it — False: its
    documented defaults, taken without the warning (the caller says so where it matters)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MachineSpecWarning)
        spec = MachineSpec.this(run_backend(device, processes), processes=processes)
    return spec, not any(issubclass(w.category, MachineSpecWarning) for w in caught)


@dataclass(frozen=True)
class Pipeline:
    """One training step from its captured ``graph`` to executors: the ``plan`` and its ``pcg``, the typed
    ``options``, the ``optimizer`` (its state slots shape the updates) and ``clip_norm`` (clip gradients to this
    global norm; None: off). Every training step computes the global gradient norm (executors expose it after
    each step: ``shardflow train``'s metric), so every entry point lowers the same programs."""

    graph: ComputationGraph
    plan: Plan
    pcg: PCG
    options: LowerOptions
    optimizer: OptimizerConfig
    clip_norm: float | None = None

    @staticmethod
    def example(batch: Mapping[str, torch.Tensor], options: LowerOptions) -> dict[str, torch.Tensor]:
        """The part of a step's ``batch`` a model is captured on: the first of ``accumulate × microbatches`` equal
        parts along dim 0. Raises BatchSplitError where dim 0 does not split."""
        return split_batch(batch, options.accumulate * options.microbatches)[0]

    @classmethod
    def capture(
        cls,
        model: nn.Module,
        batch: Mapping[str, torch.Tensor],
        mesh: Mesh,
        options: LowerOptions,
        optimizer: OptimizerConfig,
        strategy: str | None = None,
        plan: Plan | str | Path | None = None,
        strict: bool = False,
        clip_norm: float | None = None,
    ) -> Pipeline:
        """Check the pipeline schedule fits ``mesh`` (:func:`~shardflow.lower.schedule.requested`), capture
        ``model`` on the :meth:`example` of a step's ``batch`` and plan it (:meth:`planned`). Raises ValueError
        (schedule, batch split), CaptureError and what :meth:`planned` raises."""
        requested(mesh, options.schedule, options.microbatches, options.stages_per_rank)
        return cls.planned(
            capture(model, cls.example(batch, options)), mesh, options, optimizer, strategy, plan, strict, clip_norm
        )

    @classmethod
    def planned(
        cls,
        graph: ComputationGraph,
        mesh: Mesh,
        options: LowerOptions,
        optimizer: OptimizerConfig,
        strategy: str | None = None,
        plan: Plan | str | Path | None = None,
        strict: bool = False,
        clip_norm: float | None = None,
    ) -> Pipeline:
        """The pipeline of captured ``graph`` planned on ``mesh`` (:func:`plan_pcg`: ``plan``, else preset
        ``strategy``, else the mesh's; ``strict`` refuses where a rule refuses). Raises PlanError, DegreeError,
        RuleError."""
        mesh = cp_laid_out(mesh, str(options.cp_layout), graph)
        chosen, pcg = plan_pcg(graph, mesh, strategy, plan, strict, options.stages_per_rank, str(options.cp_attention))
        return cls(graph, chosen, pcg, options, optimizer, clip_norm)

    @property
    def micro_steps(self) -> tuple[MicroStep, ...]:
        """The micro-steps of one optimizer step (``accumulate``; one, the plain step, by default)."""
        return MicroStep.sequence(self.options.accumulate)

    def lower(
        self,
        ranks: tuple[int, ...] | None = None,
        verify: bool = False,
        training: bool = True,
        micro: MicroStep | None = None,
    ) -> LoweredStep:
        """One step lowered for ``ranks`` (default every rank; ``verify`` then proves they agree): a training
        step's micro-step ``micro`` (default the last, which reduces the gradients and updates), or with
        ``training=False`` an evaluation step (forward only, no dropout). Raises PassError,
        PlanVerificationError."""
        return lower_step(
            self.pcg if training else evaluation(self.pcg),
            self.optimizer.slots,
            ranks=ranks,
            verify=verify,
            training=training,
            options=self.options,
            clip_norm=self.clip_norm,
            grad_norm=True,
            micro=micro or self.micro_steps[-1],
        )

    def lower_micro_steps(
        self, ranks: tuple[int, ...] | None = None, verify: bool = False
    ) -> dict[MicroStep, LoweredStep]:
        """Each distinct micro-step of :attr:`micro_steps` lowered (first, middle, last; one without accumulation)
        for ``ranks`` (:meth:`lower`)."""
        return {m: self.lower(ranks, verify, micro=m) for m in dict.fromkeys(self.micro_steps)}

    def predict(
        self,
        spec: MachineSpec,
        tokens: int,
        exact: bool | None = None,
        events: bool = False,
        kernels: Kernels = EAGER,
        microbatches: int | None = None,
    ) -> Prediction:
        """One optimizer step of this pipeline predicted on machine ``spec`` (:mod:`shardflow.simulator`): its
        micro-steps lowered for every rank (``exact``; default on worlds up to
        :data:`~shardflow.simulator.estimate.EXACT_WORLD`) or for one rank per class of alike ranks
        (:func:`~shardflow.simulator.estimate.representatives`), and replayed. ``tokens``: tokens one step trains on
        (global batch × sequence). ``events``: keep the timeline (``Prediction.write_trace``). ``kernels``: how
        the computes run (:class:`~shardflow.simulator.cost.Kernels`: torch.compile's fusion, Float8 matmuls; default
        shardflow's eager kernels). ``microbatches``: the step of that many microbatches of this pipeline's size
        instead, composed from its own programs (:func:`~shardflow.simulator.compose.compose`; one micro-step, no
        ``events``). Raises PassError, SimulationError, ValueError (a composition asked of several micro-steps)."""
        with collector_paused():  # the programs' and the replay's objects: millions, alive until it returns
            return self._predict(spec, tokens, exact, events, kernels, microbatches)

    def _predict(
        self,
        spec: MachineSpec,
        tokens: int,
        exact: bool | None,
        events: bool,
        kernels: Kernels,
        microbatches: int | None,
    ) -> Prediction:
        mesh = self.pcg.mesh
        exact = mesh.size <= EXACT_WORLD if exact is None else exact
        rep_of = {r: r for r in range(mesh.size)} if exact else representatives(mesh, AXIS_OF["pp"])
        ranks = tuple(sorted(set(rep_of.values())))
        lowered = self.lower_micro_steps(ranks)
        parts = self.options.accumulate * self.options.microbatches  # the graph is captured on one of them
        dtype = self.options.precision.param_dtype if self.options.precision else torch.float32
        if microbatches is not None and microbatches != self.options.microbatches:
            if len(self.micro_steps) != 1 or events:
                raise ValueError("a pipeline's step is composed for one micro-step without its events only")
            step = lowered[self.micro_steps[0]]
            few = schedule_of(step.dg, self.options.schedule)
            many = Schedule(few.kind, few.stages, microbatches, few.virtual)
            flops = training_flops(self.graph) * microbatches
            return compose(step, spec, rep_of, few, many, tokens, flops, dtype, kernels)
        return simulate(
            [lowered[m] for m in self.micro_steps],
            spec,
            rep_of,
            tokens,
            training_flops(self.graph) * parts,
            dtype,
            events,
            kernels,
        )

    def passes(self, dump: Mapping[str, Callable[[Any], None]] | None = None) -> tuple[PassRecord, ...]:
        """Lower the last micro-step for every rank pass by pass (``shardflow plan --passes``), handing the graph
        after pass ``name`` to ``dump[name]``; the pass log."""
        ctx = LowerContext(self.optimizer.slots, True, self.clip_norm, self.options, None, True, self.micro_steps[-1])
        return run_passes(self.pcg, ctx, dump=dump)[1]

    def executors(
        self,
        lowered: Mapping[MicroStep, LoweredStep],
        make: Callable[..., Executor],
        weights: Mapping[str, Any] | None = None,
    ) -> tuple[Executor, MicroSteps]:
        """The executors of the :meth:`lower_micro_steps` ``lowered``: ``make(step)`` for the last micro-step's
        (whose weights, optimizer state and gradients the others share: ``make(step, share=it)``), loaded with
        ``weights`` (by graph weight name; None: loaded later, e.g. from a checkpoint). Returns it and the
        :class:`~shardflow.runtime.accumulate.MicroSteps` that run one optimizer step."""
        ex = make(lowered[self.micro_steps[-1]])
        others = {m: make(step, share=ex) for m, step in lowered.items() if not m.last}
        if weights is not None:
            ex.load(weights)
        return ex, MicroSteps([others.get(m, ex) for m in self.micro_steps])


# --- planning ---------------------------------------------------------------------------------------------------


def load_plan(path: str | Path) -> Plan:
    """``Plan.load`` with errors that name the file and say how to fix it (raises PlanError)."""
    p = Path(path)
    fix = (
        "write a JSON or TOML object with tables modules, inputs and ops (docs/concepts.md), or use --strategy "
        "instead of --plan"
    )
    if not p.is_file():
        raise PlanError(
            f"plan file {p}: No such file (or not a file); pass --plan with a JSON or TOML plan file, "
            f"or use --strategy instead"
        )
    try:
        return Plan.load(p)
    except PlanError as e:
        raise PlanError(f"plan file {p}: {e}") from None
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:  # bad JSON/TOML, not an object
        raise PlanError(f"cannot read plan file {p} ({type(e).__name__}: {e}); {fix}") from None


def mesh_strategy(mesh: Mesh) -> str:
    """The preset strategy named by the mesh's axes of more than one device (``dp=2,tp=2`` → ``dp,tp``; a mesh of
    one device → ``single``). Raises PlanError for an axis that names no strategy."""
    axes = [a for a, s in zip(mesh.axis_names, mesh.shape) if s > 1]
    other = [a for a in axes if a not in AXIS_OF.values()]
    if other:
        raise PlanError(
            f"mesh {mesh}: axis {other[0]!r} names no preset strategy (axes: dp, fsdp, tp, pp); name "
            f"the strategy (dp, fsdp, hsdp, tp, sp, pp or a combination) or give a plan"
        )
    return ",".join(axes) or "single"


def plan_pcg(
    graph: ComputationGraph,
    mesh: Mesh,
    strategy: str | None = None,
    plan: Plan | str | Path | None = None,
    strict: bool = False,
    stages_per_rank: int = 1,
    cp_attention: str = "auto",
) -> tuple[Plan, PCG]:
    """The plan — ``plan`` (a :class:`Plan` or a JSON/TOML file), else the preset ``strategy``, else the preset the
    mesh's axes name (:func:`mesh_strategy`) — and its PCG on ``mesh``. ``strict``: a rule's refusal is an error
    instead of a redistribution; ``stages_per_rank``: the chunks of the model each pipeline stage of a preset holds
    (the interleaved schedule's); ``cp_attention``: how a preset's attention reads a sequence split over cp
    (:class:`~shardflow.lower.cost.CPAttention`). Raises PlanError, DegreeError, RuleError (strict) as planning
    does."""
    if plan is not None and strategy is not None:
        raise PlanError("give a strategy or a plan, not both")
    if plan is None:
        plan = make_plan(graph, mesh, strategy or mesh_strategy(mesh), stages_per_rank, cp_attention)
    elif not isinstance(plan, Plan):
        plan = load_plan(plan)
    return plan, build_pcg(graph, mesh, resolve(plan, graph, mesh), strict=strict)
