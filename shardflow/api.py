"""Bring a model: one call from an ``nn.Module`` and an example batch to a trainer on a device mesh.

:func:`parallelize` captures ``module(**batch)`` (``torch.export``), plans it (a preset strategy or a user plan),
lowers one training step to verified per-rank programs and loads the module's weights into an executor — every
device of the mesh in this process, or this rank's device under torchrun — and returns a :class:`Trainer`::

    trainer = shardflow.parallelize(model, batch, mesh="dp=2,tp=2", optimizer=torch.optim.AdamW,
                                    optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1}, clip_norm=1.0,
                                    lr_schedule=LRSchedule("cosine", warmup_steps=10, steps=100))
    for _ in range(100):
        loss = trainer.step(batch)
    model.load_state_dict(trainer.state_dict())

:meth:`Trainer.compare_with_eager` runs eager PyTorch beside it (what ``shardflow check`` prints). Loading a model
that a ``--model`` spec names is :mod:`shardflow.model_spec`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import os
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardflow.graph import ComputationGraph, TensorRole
from shardflow.graph.fused import stored
from shardflow.lower import LoweredStep, LowerOptions, MixedPrecision
from shardflow.lower.dynamic import Optimizer, forward_id
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG
from shardflow.pipeline import Pipeline, machine_cost, machine_spec
from shardflow.reference import leaves, run_backward, weights_of
from shardflow.runtime.accumulate import MicroSteps, split_batch
from shardflow.runtime.device import rank_device
from shardflow.runtime.executor import Executor
from shardflow.runtime.kernels import LRSchedule, OptimizerConfig
from shardflow.runtime.materialize import materialize
from shardflow.search import search_model
from shardflow.strategy import Plan, PlanError, plan_from_styles

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# --- planning ---------------------------------------------------------------------------------------------------


def summary(pcg: PCG) -> str:
    """One line: devices, tensors, the parallel ops by kind, and the redistributions inserted where rules refused."""
    kinds = Counter(n.op.kind for n in pcg.parallel_nodes)
    ops = ", ".join(f"{k} ×{v}" for k, v in sorted(kinds.items())) or "none"
    n = len(pcg.redistributions)
    redistributed = (
        f"; {n} redistribution{'s' * (n != 1)} where a rule refused "
        f"({sum(r.nbytes for r in pcg.redistributions):,} bytes per device)"
        if n
        else ""
    )
    b = pcg.mesh.balanced
    layout = (
        f"; sequences of {b.length} over {b.axis} in the load-balanced layout ({2 * pcg.mesh.axis_size(b.axis)} chunks)"
        if b
        else ""
    )
    return (
        f"mesh {pcg.mesh} ({pcg.mesh.size} devices){layout}; {len(pcg.nodes) - len(pcg.parallel_nodes)} compute "
        f"ops; parallel ops: {ops}{redistributed}"
    )


@dataclass(frozen=True)
class ParallelPlan:
    """What :func:`parallelize` planned: the plan's ``name``, the ``pcg`` (every tensor's placements, the parallel
    ops, the redistributions) and the ``lowered`` step (the per-rank programs this process runs). ``str()`` gives
    the summary line, the PCG listing and the redistributions."""

    name: str
    pcg: PCG
    lowered: LoweredStep

    def __str__(self) -> str:
        text = f"# strategy {self.name}: {summary(self.pcg)}\n{self.pcg.listing()}"
        return text + (f"\n\n{self.pcg.redistribution_listing()}" if self.pcg.redistributions else "")


# --- the trainer ------------------------------------------------------------------------------------------------


class ExecutorKind(StrEnum):
    """Where :func:`parallelize` runs the mesh: ``local`` (every device in this process), ``distributed`` (this
    process is one rank of torch.distributed, joined from torchrun's environment), ``auto`` (distributed when the
    environment names a world of more than one process, else local)."""

    LOCAL = "local"
    DISTRIBUTED = "distributed"
    AUTO = "auto"

    def resolved(self) -> ExecutorKind:
        """``auto`` made concrete from the environment (``WORLD_SIZE``)."""
        if self != ExecutorKind.AUTO:
            return self
        return ExecutorKind.DISTRIBUTED if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ExecutorKind.LOCAL


# the torch.optim optimizers whose update shardflow's kernels compute (elementwise, per shard), by their Optimizer
TORCH_OPTIMIZERS: dict[Optimizer, type[torch.optim.Optimizer]] = {
    Optimizer.SGD: torch.optim.SGD,
    Optimizer.ADAM: torch.optim.Adam,
    Optimizer.ADAMW: torch.optim.AdamW,
}
# their options OptimizerConfig holds; every other option must keep torch.optim's default, but for how torch runs the
# update (no effect on its numbers): implementation choices
CONFIG_OPTIONS = ("lr", "momentum", "weight_decay", "betas", "eps")
HOW_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


def torch_optimizer(cfg: OptimizerConfig, params) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer whose update shardflow's ``cfg`` computes (SGD, Adam or AdamW, same settings;
    at the peak ``lr``: a LambdaLR of ``cfg.schedule.factor`` gives each step's)."""
    cls = TORCH_OPTIMIZERS[cfg.name]
    taken = inspect.signature(cls).parameters
    return cls(params, **{k: getattr(cfg, k) for k in CONFIG_OPTIONS if k in taken})


def from_torch_optim(
    optimizer: type[torch.optim.Optimizer] | functools.partial, kwargs: Mapping[str, Any]
) -> OptimizerConfig:
    """The :class:`OptimizerConfig` of ``torch.optim`` class ``optimizer`` (or a ``functools.partial`` of one) with
    options ``kwargs`` (over the partial's), torch.optim's defaults for the rest: ``torch.optim.SGD``, ``Adam``
    (``decoupled_weight_decay=True``: AdamW) or ``AdamW``, with the options ``lr``, ``momentum``, ``weight_decay``,
    ``betas``, ``eps`` and the implementation choices ``foreach``, ``fused``, ``capturable``, ``differentiable``.

    Raises:
        ValueError: another optimizer (its update is not one shardflow computes per shard), an option with another
            value than torch.optim's default (``amsgrad=True``, ``nesterov=True``, ``maximize=True``...), an
            unknown option or positional arguments in the partial; the message names the fix.
    """
    cls: Any = optimizer  # the class, once the partial is unwrapped
    given = dict(kwargs)
    if isinstance(optimizer, functools.partial):
        cls, given = optimizer.func, {**optimizer.keywords, **given}
        if optimizer.args:
            raise ValueError(
                f"optimizer=partial({cls.__name__}, {', '.join(map(repr, optimizer.args))}, ...): give "
                f"its options by name (functools.partial({cls.__name__}, lr=...)) or in optimizer_kwargs"
            )
    names = {c: n for n, c in TORCH_OPTIMIZERS.items()}
    if cls not in names:
        what = getattr(cls, "__qualname__", repr(cls))
        raise ValueError(
            f"optimizer={what}: shardflow updates each shard of a weight where it lies, so it computes "
            f"only optimizers whose update is elementwise, with its own kernels for "
            f"{', '.join(c.__name__ for c in names)} (torch.optim's classes themselves, not subclasses); "
            f"{what} is not one of them (LBFGS, for one, needs the whole model's gradient and a "
            f"closure). Pass torch.optim.SGD, torch.optim.Adam or torch.optim.AdamW with its options in "
            f"optimizer_kwargs, or an OptimizerConfig"
        )
    defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}
    if set(given) - set(defaults):
        raise ValueError(
            f"optimizer={cls.__name__}: no option {', '.join(sorted(set(given) - set(defaults)))}; "
            f"{cls.__name__} takes {', '.join(defaults)}"
        )
    settings = {**defaults, **given}
    name = names[cls]
    if name == Optimizer.ADAM and settings.pop("decoupled_weight_decay"):
        name = Optimizer.ADAMW  # torch.optim.Adam(decoupled_weight_decay=True) is AdamW
    other = {k: v for k, v in settings.items() if k not in (*CONFIG_OPTIONS, *HOW_OPTIONS) and v != defaults[k]}
    if other:
        given_text = ", ".join(f"{k}={v!r}" for k, v in other.items())
        raise ValueError(
            f"optimizer={cls.__name__} with {given_text}: shardflow computes {cls.__name__}'s update "
            f"with torch.optim's default for {', '.join(other)} only (its kernels take "
            f"{', '.join(k for k in CONFIG_OPTIONS if k in defaults)}); drop {given_text} from the "
            f"options, or train with eager torch.optim"
        )
    return OptimizerConfig(name, **{k: _number(settings[k]) for k in CONFIG_OPTIONS if k in settings})


def _number(value: Any) -> Any:
    """An option's value as OptimizerConfig holds it: floats (a 0-dim tensor's value), a pair of them for betas."""
    return tuple(map(float, value)) if isinstance(value, (tuple, list)) else float(value)


def require_eager_comparable(graph: ComputationGraph) -> None:
    """Eager PyTorch draws dropout masks from the process RNG, shardflow from (seed, step, node, element): the two
    runs of a model that draws random numbers cannot be compared. Raises ValueError naming where it draws."""
    drawing = sorted({n.scope or n.name for n in graph.nodes if n.op.random})
    if drawing:
        raise ValueError(
            f"the model draws random numbers (dropout) in {', '.join(map(repr, drawing))}: eager PyTorch "
            f"draws other masks than shardflow, so their runs differ; set the dropout probabilities to 0 "
            f"to compare them"
        )


@dataclass(frozen=True)
class StepDeviation:
    """One step of :meth:`Trainer.compare_with_eager`: shardflow's ``loss`` and eager PyTorch's, the largest
    |difference| of any gradient piece (``grad``) and of any weight piece after the update (``weight``) over every
    replica of every piece, and of any buffer the step updates (``buffer``: batch norm's running statistics), in the
    model's units."""

    step: int
    loss: float
    eager_loss: float
    grad: float
    weight: float
    buffer: float = 0.0

    @property
    def dloss(self) -> float:
        """|loss − eager loss|."""
        return abs(self.loss - self.eager_loss)


class Trainer:
    """A module parallelized by :func:`parallelize`.

    ``step(batch)`` trains one step and returns the loss; ``state_dict()`` gives full tensors keyed like the plain
    module's; ``plan`` shows what runs where (``print(trainer.plan)``); ``weight_error`` / ``grad_error`` compare
    every replica of every piece with full reference tensors. On the distributed executor every method but ``plan``
    is collective: every rank calls it, with the same arguments. ``lead``: whether this process reports (the local
    executor's process, or rank 0); ``optimizer``: the settings every update uses.
    """

    def __init__(
        self,
        plan: ParallelPlan,
        executor: Executor,
        optimizer: OptimizerConfig,
        lead: bool,
        names: Mapping[str, str],
        buffers: Mapping[str, torch.Tensor],
        micro: MicroSteps | None = None,
    ):
        """``names``: each parameter name of the module's state dict (tied parameters under all their names) → its
        graph weight; ``buffers``: the state dict's other entries (copies; the steps update batch norm's);
        ``micro``: the micro-steps of one step under gradient accumulation, the last on ``executor`` (default: one,
        ``executor``'s plain step)."""
        self.plan, self.executor, self.optimizer, self.lead = plan, executor, optimizer, lead
        self._names, self._buffers = dict(names), dict(buffers)
        self.micro = micro or MicroSteps([executor])

    @property
    def graph(self) -> ComputationGraph:
        """The captured graph (ATen ops, its inputs named by the batch's keys, weights by parameter name)."""
        return self.plan.pcg.graph

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (every step computes it, as ``shardflow train`` logs it; None
        before the first step)."""
        return self.executor.grad_norm

    @property
    def steps_done(self) -> int:
        """Training steps run so far."""
        return self.executor.steps_done

    def step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """One training step (forward, backward, optimizer update) on the full ``batch`` — the example batch's keys,
        shapes and dtypes; each device takes its pieces; under ``accumulate=N``, N micro-steps on its N equal parts
        along dim 0 (each cut again into ``microbatches``), the gradients reduced once. Returns the loss (the mean of
        the micro-batches' losses).

        Raises:
            KeyError: an input is missing or unknown (the message gives the expected shape and dtype).
            ValueError: an input has another shape or dtype than the example batch's (BatchSplitError: one that
                does not split into the micro-batches).
        """
        steps, microbatches = len(self.micro.executors), self.executor.dg.microbatches
        count = steps * microbatches
        of = (
            f" (one of the {count} micro-batches of accumulate={steps} × microbatches={microbatches})"
            if count > 1
            else ""
        )
        for part in split_batch(batch, count):
            try:
                leaves(self.graph, part, TensorRole.INPUT)
            except ValueError as e:
                raise ValueError(f"{e}{of}") from None
        return self.micro.step({name: batch[name] for name in self.graph.inputs}, after=self._update_buffers)

    def _update_buffers(self, ex: Executor) -> None:
        """Apply the buffer updates of the micro-step ``ex`` ran (:class:`~shardflow.graph.graph.BufferUpdate`):
        each microbatch's batch statistics blended into the running ones, in order, as eager PyTorch's forward
        calls would; counters advanced once per microbatch."""
        updates = self.graph.buffer_updates
        if not updates:
            return
        stats = ex.statistics()  # collective
        for name, u in updates.items():
            buf = self._buffers[name]
            if u.stat is None:
                buf.add_(torch.tensor(u.momentum * ex.dg.microbatches, device=buf.device).to(buf.dtype))
                continue
            for stat in stats[u.stat]:  # gathered on the CPU; the buffer is where the module keeps it
                buf.mul_(1 - u.momentum).add_(stat.to(buf.device, buf.dtype), alpha=u.momentum)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The plain module's state dict, trained: full tensors under the module's ``state_dict()`` keys, ready for
        ``module.load_state_dict``. Parameters are read from replica 0 of each piece (tied ones under every name);
        buffers as the steps left them (batch norm's running statistics and counters updated; others as the
        module had them)."""
        weights = self.executor.weights()
        return {
            k: weights[self._names[k]] if k in self._names else self._buffers[k].clone()
            for k in (*self._names, *self._buffers)
        }

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's gradients as full tensors, by graph weight name (= parameter name)."""
        return self.executor.grads()

    def dtensor_parameters(self) -> dict[str, DTensor]:
        """This rank's pieces of the weights as ``torch.distributed.tensor.DTensor`` objects on a ``DeviceMesh``, by
        graph weight name (= parameter name; a tied parameter once, under the name :meth:`grads` uses), for your own
        optimizer or metrics code: each is ``DTensor.from_local(piece, device_mesh, placements)`` with the weight's
        placements (``print(trainer.plan)``), so ``full_tensor()`` (collective over its mesh) is the
        :meth:`state_dict` entry.

        The mesh is the whole mesh's DeviceMesh (its dims named by the mesh's axes); a weight on a pipeline stage is
        on that stage's sub-mesh (the free axes; a stage of one device: a mesh of shape (1,), placement
        ``Replicate()``), and only the stage's ranks have it in their dict. A parameter the graph stores by parts
        (a fused q|k|v weight ``[C, 3C]`` held as ``[C, 3, C]``, docs/concepts.md) is in that shape, as checkpoints
        hold it. The local tensors are the trainer's pieces, not copies: the next step replaces (and may reuse)
        them, so call this again after each step (``.clone()`` what you keep).

        Collective on the distributed executor (every rank calls it; a stage's DeviceMesh is made at the first
        call). Raises ValueError on the local executor (every rank in this process: no DeviceMesh of processes;
        the message names the fix) and for a weight that two mesh axes shard on one dim out of mesh order.
        """
        return self.executor.dtensors({w: forward_id(w) for w in self.graph.weights})

    def dtensor_grads(self) -> dict[str, DTensor]:
        """As :meth:`dtensor_parameters`, for the gradients the last step's update used (their placements, e.g.
        ``Shard(0)`` on ``fsdp`` after the reduce-scatter, ``Replicate()`` on ``dp``): ``full_tensor()`` is the
        :meth:`grads` entry. A weight the step computes no gradient for is absent, as in :meth:`grads`.

        Raises ValueError before the first step (no gradient yet), and as :meth:`dtensor_parameters` does.
        """
        if not self.steps_done:
            raise ValueError("dtensor_grads(): no step has run yet, so there is no gradient; call trainer.step first")
        return self.executor.dtensors(self.executor.grad_values)

    def weight_error(self, reference: Mapping[str, torch.Tensor]) -> float:
        """The largest |weight piece − its block of ``reference``| over every piece of every replica.
        ``reference``: full tensors by parameter name (a module's ``state_dict()``)."""
        return self.executor.weight_error(self._by_weight(reference))

    def grad_error(self, reference: Mapping[str, torch.Tensor]) -> float:
        """As :meth:`weight_error`, for the last step's gradients (``reference``: e.g. ``p.grad`` by name)."""
        return self.executor.grad_error(self._by_weight(reference))

    def _by_weight(self, reference: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``reference`` by graph weight, whichever name of a tied parameter it uses."""
        return {w: reference[k] for k, w in self._names.items() if k in reference}

    def compare_with_eager(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], steps: int
    ) -> Iterator[StepDeviation]:
        """Train ``steps`` steps on ``batch`` here and with eager PyTorch on ``model`` (``torch.optim`` with this
        trainer's optimizer settings, on one device) side by side; the iterator yields each step's deviations as
        the steps run.

        ``model`` must be the module :func:`parallelize` was given, untouched since (the same weights); it is
        trained. Compare float64 models inside :func:`shardflow.capture.wide_floats` (in which the trainer was
        made too): Hugging Face models compute their loss in float32 otherwise.

        Raises (at once, before any step):
            ValueError: the model draws random numbers (:func:`require_eager_comparable`); ``model``'s parameters
                differ from the trainer's weights.
        """
        require_eager_comparable(self.graph)
        params = dict(model.named_parameters(remove_duplicate=False))
        start = self.weight_error({k: p.detach() for k, p in params.items()})
        if start:
            raise ValueError(
                f"the eager model's parameters differ from the trainer's weights by up to {start:.3g}; "
                f"pass the module parallelize was given, before either trains"
            )
        return self._side_by_side(model, params, batch, steps)

    def capture_error(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        """How far the captured graph, run on one device by shardflow's reference interpreter
        (:func:`shardflow.reference.run_backward`), is from eager PyTorch at ``model``'s current weights: the
        largest |Δloss| and |Δgradient| (every weight). Where a check fails, this tells the sides apart: ~0 means
        capture computes what eager does and the plan's run differs; beyond the tolerance, the model as captured (or
        the eager reference itself) differs, whatever the plan. Leaves ``model``'s gradients set."""
        model.zero_grad()
        out = model(**batch)
        eager = getattr(out, "loss", out)
        eager.backward()
        graph = self.graph
        tensors, grads = run_backward(graph, batch, weights_of(model, graph))
        want = stored(
            graph,
            self._by_weight(
                {
                    k: p.grad if p.grad is not None else torch.zeros_like(p)
                    for k, p in model.named_parameters(remove_duplicate=False)
                }
            ),
        )
        dgrad = max((float((grads[w] - g).abs().max()) for w, g in want.items() if g.numel()), default=0.0)
        return abs(float(tensors[graph.loss]) - eager.item()), dgrad

    def _side_by_side(
        self, model: nn.Module, params: Mapping[str, nn.Parameter], batch: Mapping[str, torch.Tensor], steps: int
    ) -> Iterator[StepDeviation]:
        opt, done = torch_optimizer(self.optimizer, model.parameters()), self.steps_done
        # the trainer's schedule as torch's LambdaLR (stepped after each update) from the trainer's next step on
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: self.optimizer.schedule.factor(done + i + 1))
        for i in range(1, steps + 1):
            loss = self.step(batch)
            opt.zero_grad()
            out = model(**batch)
            eager = getattr(out, "loss", out)  # the capture's contract: the loss, or an object with .loss
            eager.backward()
            grad = self.grad_error(
                {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in params.items()}
            )
            opt.step()
            sched.step()
            weight = self.weight_error({k: p.detach() for k, p in params.items()})
            eager_buffers = dict(model.named_buffers())
            buffer = max(
                (float((self._buffers[k] - eager_buffers[k]).abs().max()) for k in self.graph.buffer_updates),
                default=0.0,
            )
            yield StepDeviation(i, loss, eager.item(), grad, weight, buffer)


OptimizerSpec = OptimizerConfig | str | type[torch.optim.Optimizer] | functools.partial


def auto_pipeline(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    world: int,
    options: LowerOptions,
    optimizer: OptimizerConfig,
    device: str,
    budget: int | None,
    plan: Plan | str | Path | None,
    clip_norm: float | None,
    time_limit: float | None = None,
) -> Pipeline:
    """``strategy="auto"``: the pipeline of the fastest preset of ``world`` devices that fits this machine
    (:func:`~shardflow.search.search` on ``MachineSpec.this``, trying no further candidate after ``time_limit``
    seconds once one fits; docs/search.md). Raises ValueError with a ``plan`` (auto chooses it), SearchError where
    nothing fits."""
    if plan is not None:
        raise ValueError("strategy='auto' chooses the plan itself: drop plan=, or name a preset strategy")
    spec = machine_spec(device, world)[0]
    result = search_model(model, batch, world, options, optimizer, spec, budget, time_limit=time_limit)
    return dataclasses.replace(result.pipeline, clip_norm=clip_norm)


def parallelize(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    mesh: Mesh | str | DeviceMesh,
    strategy: str | None = None,
    plan: Plan | Mapping[str, object] | str | Path | None = None,
    optimizer: OptimizerSpec = "sgd",
    lr: float | None = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    lr_schedule: LRSchedule | None = None,
    clip_norm: float | None = None,
    strict: bool = False,
    executor: ExecutorKind | str = ExecutorKind.AUTO,
    seed: int = 0,
    timeout_s: float = 300.0,
    accumulate: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    cp_attention: str = "auto",
    cp_layout: str = "auto",
    ep_dispatch: str = "all_to_all",
    capacity_factor: float | None = None,
    reshard_after_forward: bool = True,
    regather_activations: bool = False,
    ac: str = "none",
    ac_blocks: int | None = None,
    mixed_precision: MixedPrecision | None = None,
    all_gather: str = "auto",
    reduce_scatter: str = "auto",
    bucket_mb: float = 25.0,
    device: str = "auto",
    memory_budget: int | None = None,
    search_seconds: float | None = None,
) -> Trainer:
    """Capture ``model(**batch)``, plan it on ``mesh``, lower one training step and load the model's weights
    (:class:`~shardflow.pipeline.Pipeline`, as ``shardflow train`` and ``plan`` do: the same programs).

    Args:
        model: any ``nn.Module`` whose ``model(**batch)`` returns the loss (or an object with ``.loss``). It is
            read, not changed: its parameters are copied in; :meth:`Trainer.state_dict` gives them back trained.
            A model built on the meta device (``with torch.device("meta"): model = ...``) is never materialized
            whole: its initialisation is replayed on each device's pieces alone, draws seeded by ``seed``
            (:mod:`shardflow.runtime.materialize`; its buffers get their values in place).
        batch: an example batch, input name → tensor; every step's batch has its keys, shapes and dtypes.
        mesh: the device mesh, a :class:`Mesh`, its text (``"dp=2,tp=2"``) or a ``torch.distributed`` ``DeviceMesh``
            with ``mesh_dim_names`` over ranks 0..n-1 in order (``init_device_mesh(device_type, (2, 2),
            mesh_dim_names=("dp", "tp"))``: the same mesh as ``"dp=2,tp=2"``; :func:`as_mesh`). Its axes compose
            as docs/concepts.md §7 says: the first the outermost. Where each rank keeps its buffers is still
            ``device``'s choice, not the DeviceMesh's ``device_type``.
        strategy: a preset — dp, fsdp, hsdp, tp, sp, pp, cp, ep or a combination (``"dp,tp"``, ``"fsdp,tp"``); default: the
            one the mesh's axes name. ``"auto"``: the fastest preset of ``mesh``'s number of devices that fits this
            machine, chosen by the simulator (docs/search.md; the mesh's shape is the search's, only its size
            counts), its predicted peak at most ``memory_budget`` bytes per device (default 90 % of the device's),
            the search trying no further candidate after ``search_seconds`` once one fits (default: no limit;
            docs/search.md#a-time-limit).
        plan: a user plan instead (a :class:`Plan` or a JSON/TOML file, see docs/concepts.md), or torchtitan's
            tensor-parallel plan: a dict module pattern → ``ColwiseParallel()``, ``RowwiseParallel()`` or
            ``SequenceParallel()`` of ``torch.distributed.tensor.parallel``, on the mesh's axis ``tp`` (a mesh of
            one axis: that axis) — :func:`~shardflow.strategy.styles.plan_from_styles` translates it (call it
            yourself for another axis, or to merge the plan of other axes in).
        optimizer: your ``torch.optim`` optimizer class — ``torch.optim.SGD``, ``Adam`` or ``AdamW`` — or a
            ``functools.partial`` of one, its options in ``optimizer_kwargs`` (``{"lr": 1e-3, "betas": (0.9,
            0.95), "weight_decay": 0.1}``; torch.optim's defaults for the rest; :func:`from_torch_optim`); or
            ``"sgd"``, ``"adam"``, ``"adamw"`` (with ``lr``, default 0.1); or an :class:`OptimizerConfig`
            (momentum, weight decay, betas...; then neither ``lr`` nor ``optimizer_kwargs``).
        lr: the learning rate (the peak one under ``lr_schedule``) of an optimizer given by name or class.
        optimizer_kwargs: the options of a ``torch.optim`` class given as ``optimizer``.
        lr_schedule: each step's learning rate as a factor of the peak (:class:`LRSchedule`: linear warm-up, then
            constant, cosine or linear decay to a minimum ratio, as torchtitan's ``lr_scheduler``); it replaces
            the schedule of an :class:`OptimizerConfig`. Default: the config's (a constant rate).
        clip_norm: clip the gradients to this global L2 norm before each update, as
            ``torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)`` (one scalar all-reduce per mesh axis
            a gradient is split over); None (default): no clipping.
        strict: refuse the plan where a sharding rule refuses its inputs, instead of redistributing them.
        executor: ``local`` (every device of the mesh in this process; every rank's program is built and proven to
            agree), ``distributed`` (this process is one rank: it joins the process group torchrun's environment
            describes and builds only its own program — the ranks compare their plans' fingerprints at start-up;
            the mesh must have one device per process), or ``auto`` (distributed when ``WORLD_SIZE`` > 1).
        seed: the run seed random ops (dropout) and a meta-device model's initialisation draw with.
        timeout_s: distributed executor: seconds any communication may wait.
        accumulate: gradient accumulation: each step runs as this many micro-steps, each on an equal part of the
            batch along dim 0 (the model is captured on one part), the weights' gradients summed where they lie
            and reduced once, after the last; with a loss that is a mean over the batch, the step equals one on
            the whole batch (each micro-step's loss gradient is seeded with 1/accumulate).
        microbatches: pipeline parallelism's microbatches: each step (each micro-step under ``accumulate``) runs as
            this many microbatches through the stages of a ``pp`` mesh, in ``schedule``'s order (``"1f1b"``,
            ``"gpipe"`` or ``"interleaved"`` with ``stages_per_rank`` ≥ 2 chunks of the model per stage); the model
            is captured on one microbatch, the weights are updated once per step (docs/lowering.md §15).
        cp_attention: under a ``cp`` axis, how attention reads the split sequence: ``"all_gather"``,
            ``"all_to_all"`` (DeepSpeed-Ulysses), ``"ring"`` (the key/value blocks passed around the cp axis, merged
            by log-sum-exp: docs/lowering.md §16) or ``"auto"`` (:class:`~shardflow.lower.cost.CPAttention`).
        cp_layout: under a ``cp`` axis, how the split sequence is laid out: ``"contiguous"`` (device r holds block
            r), ``"balanced"`` (the head-tail order of 2·cp chunks, so that each device of a causal model attends
            as many keys: docs/concepts.md#the-load-balanced-layout) or ``"auto"``: balanced where every attention
            is causal and the sequence cuts into 2·cp chunks (:class:`~shardflow.lower.cost.CPLayout`).
        ep_dispatch: under an ``ep`` axis, how an expert layer's tokens reach their experts: ``"all_to_all"`` (only
            to their experts' ranks and back, by all-to-alls of the routing's sizes) or ``"all_gather"`` (every
            token gathered on every rank of the group) (:class:`~shardflow.lower.cost.EPDispatch`).
        capacity_factor: under the all-to-all dispatcher, the rows each rank sends each expert at most, as a
            multiple of an even share of its token-expert pairs; the rest are dropped (None: dropless).
        reshard_after_forward: a weight gathered before use (fsdp) is freed after the forward and gathered again for
            the backward (FSDP2's default); False keeps the forward's gather.
        regather_activations: an activation all-gathered before use (sp's gather before a column-parallel linear)
            is freed after its forward readers and gathered again for the backward, as Megatron-LM's sequence
            parallelism: a piece per rank kept instead of the whole, one all-gather more each
            (docs/lowering.md#regathering-activations); False (default) keeps the forward's gather.
        ac: activation checkpointing, ``"none"``, ``"block"``: each block (a module under an integer index, such
            as ``model.layers.3``) runs its forward again right before its backward instead of keeping its
            activations, or ``"selective"``: as block, but the outputs of matmuls, attention and communication are
            kept and only the ops between them run again (:class:`~shardflow.lower.dynamic.ActivationCheckpointing`).
        ac_blocks: with ``ac="block"``, only the first this many blocks in forward order (``model.layers.0`` …)
            recompute, the others keep their activations; None (default): every block. With ``ac="selective"``,
            the first this many blocks recompute whole, the others selectively; None: none whole.
        mixed_precision: a :class:`~shardflow.lower.MixedPrecision` (FSDP2's ``MixedPrecisionPolicy``) for a model
            already in its ``param_dtype`` (``model.to(torch.bfloat16)``): its weights, gradient reductions and
            optimizer state are held in ``reduce_dtype`` (float32) and the weights cast to ``param_dtype`` for each
            step; :meth:`Trainer.state_dict` gives the ``reduce_dtype`` weights. None (default): every weight in
            its own dtype.
        all_gather, reduce_scatter: the form of each all-gather (``collective``, ``ring``, ``broadcast_loop``) and
            reduce-scatter (``collective``, ``ring``); ``"auto"`` (default): the cheapest by this machine's
            calibrated cost model (:func:`~shardflow.pipeline.machine_cost`), as in ``shardflow train``.
        bucket_mb: gradient all-reduces packed into buckets of this many MiB (DDP's ``bucket_cap_mb``; 0: none).
        device: where every buffer of the step lives, as torchrun's convention has it: ``"auto"`` (default):
            ``cuda:LOCAL_RANK`` when CUDA is available with a GPU for each of the machine's ``LOCAL_WORLD_SIZE``
            processes (the distributed executor then talks NCCL), else the CPU
            (gloo); ``"cpu"``; ``"cuda"``. The model itself may be on any device; full tensors handed back
            (:meth:`Trainer.state_dict`) are on the CPU.

    Raises:
        CaptureError: export cannot capture the model (the message names the model's source line).
        InitError (a ValueError): a meta-device model whose initialisation cannot be replayed piece by piece.
        PlanError, DegreeError, RuleError: the strategy or plan does not fit the model or the mesh.
        ValueError: an optimizer given both as a config and with ``lr`` or ``optimizer_kwargs``; a ``torch.optim``
            optimizer or option shardflow does not compute (:func:`from_torch_optim`); an unknown optimizer,
            executor, ``ac``,
            schedule or form; ``accumulate``, ``microbatches``, ``stages_per_rank`` or ``ac_blocks`` < 1, or
            ``ac_blocks`` with ``ac="none"``
            (:meth:`~shardflow.lower.LowerOptions.parse`), or a batch whose dim 0 they do not divide
            (BatchSplitError); a schedule that does not fit (:func:`~shardflow.lower.schedule.requested`);
            distributed: the world size is not the mesh's size, or the ranks' models have different weights; an
            unknown ``device``.
        PassError: ``ac="block"`` or ``"selective"`` for a model with no block, or ``ac_blocks`` above its number of
            blocks.
        DeviceError (a ValueError): ``device="cuda"`` without CUDA, or a local rank with no GPU of its own.
        CalibrationError: this machine's calibration file cannot be used.
    """
    mesh = as_mesh(mesh)
    opt = optimizer_config(optimizer, lr, optimizer_kwargs)
    if lr_schedule is not None:
        opt = dataclasses.replace(opt, schedule=lr_schedule)
    try:
        kind = ExecutorKind(executor).resolved()
    except ValueError:
        raise ValueError(f"executor={executor!r}: use one of {', '.join(map(str, ExecutorKind))}") from None
    options = mesh_options(
        mesh,
        device,
        all_gather=all_gather,
        reduce_scatter=reduce_scatter,
        bucket_mb=bucket_mb,
        reshard_after_forward=reshard_after_forward,
        regather_activations=regather_activations,
        ac=ac,
        ac_blocks=ac_blocks,
        precision=mixed_precision,
        microbatches=microbatches,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        accumulate=accumulate,
        cp_attention=cp_attention,
        cp_layout=cp_layout,
        ep_dispatch=ep_dispatch,
        capacity_factor=capacity_factor,
    )
    if isinstance(plan, Mapping):
        plan = plan_from_styles(model, plan, styles_axis(mesh))
    inits = materialize(model, seed) if any(p.is_meta for p in model.parameters()) else None
    if strategy == "auto":
        pipeline = auto_pipeline(
            model, batch, mesh.size, options, opt, device, memory_budget, plan, clip_norm, search_seconds
        )
        mesh = pipeline.pcg.mesh
    else:
        pipeline = Pipeline.capture(model, batch, mesh, options, opt, strategy, plan, strict, clip_norm)
    graph = pipeline.graph
    weights = {w: inits[w] for w in graph.weights} if inits else weights_of(model, graph)
    where = rank_device(device)
    if kind == ExecutorKind.DISTRIBUTED:
        from shardflow.runtime.distributed import DistributedExecutor, init_from_env

        rank, _ = init_from_env(timeout_s, where)
        lowered = pipeline.lower_micro_steps(ranks=(rank,))
        make = functools.partial(DistributedExecutor, optimizer=opt, timeout_s=timeout_s, seed=seed, device=where)
        if not inits:  # materialized pieces are the same everywhere by design
            _same_weights_everywhere(weights)
        lead = rank == 0
    else:
        from shardflow.runtime.local import LocalExecutor

        lowered = pipeline.lower_micro_steps(verify=True)  # every rank's programs, proven to agree
        make, lead = functools.partial(LocalExecutor, optimizer=opt, seed=seed, device=where), True
    # distributed: each executor checks the world size and that every rank has the same plan
    ex, micro = pipeline.executors(lowered, make, weights)
    tied: dict[int, str] = {id(p): n for n, p in model.named_parameters(remove_duplicate=False) if n in graph.weights}
    names = {n: tied[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in names}
    return Trainer(
        ParallelPlan(pipeline.plan.name, pipeline.pcg, lowered[pipeline.micro_steps[-1]]),
        ex,
        opt,
        lead,
        names,
        buffers,
        micro,
    )


def styles_axis(mesh: Mesh) -> str:
    """The axis :func:`parallelize` places a dict of tensor-parallel styles on: ``tp``, or the one axis of a mesh of
    one axis (torch's ``parallelize_module`` takes a one-dimensional mesh). Raises PlanError naming the fix for
    another mesh."""
    if "tp" in mesh.axis_names:
        return "tp"
    if mesh.ndim == 1:
        return mesh.axis_names[0]
    raise PlanError(
        f"plan= a dict of tensor-parallel styles on mesh {mesh}, which has no axis 'tp': name the axis they shard, "
        f"plan=plan_from_styles(model, styles, axis=...) (shardflow.plan_from_styles), or call the axis 'tp'"
    )


def mesh_options(mesh: Mesh, device: str = "auto", **settings) -> LowerOptions:
    """:func:`parallelize`'s step ``settings`` (keyword arguments of :meth:`LowerOptions.parse`) parsed, with the
    cost model of one process per device of ``mesh`` on ``device`` (:func:`~shardflow.pipeline.machine_cost`), which
    chooses the ``auto`` forms. Raises ValueError as :meth:`LowerOptions.parse` does, CalibrationError."""
    return LowerOptions.parse(cost=machine_cost(device, mesh.size), **settings)


def as_mesh(mesh: Mesh | str | DeviceMesh) -> Mesh:
    """``mesh`` as a :class:`Mesh`: parsed from its text, or a ``DeviceMesh``'s ``mesh_dim_names`` and sizes.
    Raises ValueError for a DeviceMesh without dim names or whose ranks are not 0..n-1 in row-major order (its
    axis i of size s_i must be the Mesh's: device id = rank), TypeError for anything else."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, str):
        return Mesh.parse(mesh)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh={mesh!r}: give a shardflow Mesh, its text such as 'dp=2,tp=2', or a DeviceMesh")
    names, ranks = mesh.mesh_dim_names, mesh.mesh.reshape(-1).tolist()
    if names is None:
        raise ValueError(
            f"mesh={mesh}: a DeviceMesh without mesh_dim_names; name its axes by the strategies they "
            f"carry (init_device_mesh(..., mesh_dim_names=('dp', 'tp')))"
        )
    if ranks != list(range(len(ranks))):
        raise ValueError(
            f"mesh={mesh}: its ranks {ranks} are not 0..{len(ranks) - 1} in order; shardflow's device "
            f"i of the mesh is rank i: build the DeviceMesh over the whole world (init_device_mesh)"
        )
    return Mesh(tuple(names), tuple(mesh.mesh.shape))


def optimizer_config(
    optimizer: OptimizerSpec, lr: float | None, kwargs: Mapping[str, Any] | None = None
) -> OptimizerConfig:
    """``optimizer`` as an :class:`OptimizerConfig`: given as one (then no ``lr``, no ``kwargs``), by name
    (``sgd``, ``adam``, ``adamw``) with ``lr`` (default 0.1), or as a ``torch.optim`` class with options
    ``kwargs`` and ``lr`` (:func:`from_torch_optim`). Raises ValueError for an unknown name, a config given with
    ``lr`` or ``kwargs``, ``lr`` both alone and in ``kwargs``, and what :func:`from_torch_optim` raises."""
    if isinstance(optimizer, OptimizerConfig):
        if lr is not None or kwargs:
            raise ValueError(
                f"lr={lr}, optimizer_kwargs={kwargs} with an OptimizerConfig (lr={optimizer.lr}): set "
                f"lr and the options in the config"
            )
        return optimizer
    options = dict(kwargs or {})
    if not isinstance(optimizer, str):
        if lr is not None and "lr" in options:
            raise ValueError(f"lr={lr} and optimizer_kwargs lr={options['lr']}: give the learning rate once")
        return from_torch_optim(optimizer, {**options, **({} if lr is None else {"lr": lr})})
    if options:
        raise ValueError(
            f"optimizer_kwargs with optimizer={optimizer!r}: options go with a torch.optim class "
            f"(optimizer=torch.optim.AdamW, optimizer_kwargs={{...}}) or in an OptimizerConfig"
        )
    try:
        name = Optimizer(optimizer)
    except ValueError:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {list(map(str, Optimizer))}") from None
    return OptimizerConfig(name, 0.1 if lr is None else lr)


def _same_weights_everywhere(weights: Mapping[str, torch.Tensor]) -> None:
    """Every rank must load the same weights (each keeps its pieces of them). Raises ValueError naming the ranks
    whose weights differ from rank 0's — a model initialised without a common seed. Collective."""
    import torch.distributed as dist

    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest.hexdigest())
    differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if differ:
        raise ValueError(
            f"ranks {differ} built other initial weights than rank 0: every rank must pass the same "
            f"model (call torch.manual_seed with the same seed before building it)"
        )
