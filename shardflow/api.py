"""Bring a model: one call from an ``nn.Module`` and an example batch to a trainer on a device mesh.

:func:`parallelize` captures ``module(**batch)`` (``torch.export``), plans it (a preset strategy or a user plan),
lowers one training step to verified per-rank programs and loads the module's weights into an executor — every
device of the mesh in this process, or this rank's device under torchrun — and returns a :class:`Trainer`::

    trainer = shardflow.parallelize(model, batch, mesh="dp=2,tp=2", lr=0.1)
    for _ in range(100):
        loss = trainer.step(batch)
    model.load_state_dict(trainer.state_dict())

:meth:`Trainer.compare_with_eager` runs eager PyTorch beside it (what ``shardflow check`` prints), and
:func:`load_model` calls the factory a ``FILE.py:FACTORY`` / ``package.module:FACTORY`` spec names (the
``--model`` of ``shardflow check`` and ``shardflow plan``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Iterator, Mapping

import torch
from torch import nn

from shardflow.graph import ComputationGraph, TensorRole
from shardflow.lower import LoweredStep, LowerOptions, MixedPrecision
from shardflow.lower.dynamic import Optimizer
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG
from shardflow.pipeline import Pipeline, machine_cost
from shardflow.graph.fused import stored
from shardflow.reference import leaves, run_backward, weights_of
from shardflow.runtime.device import rank_device
from shardflow.runtime.materialize import materialize
from shardflow.runtime.accumulate import MicroSteps, split_batch
from shardflow.runtime.executor import Executor
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.strategy import Plan


# --- models named on the command line --------------------------------------------------------------------------

class ModelSpecError(ValueError):
    """A ``--model`` spec that yields no ``(module, batch)``: not ``WHERE:NAME``, no such file or module, no such
    factory, a factory that raises, or one that returns something else."""


def load_model(spec: str, seed: int = 0, vocab_size: int | None = None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Call the factory that ``spec`` names and check what it returns.

    ``spec``: ``FILE.py:NAME`` (a Python file, imported as ``python FILE.py`` would: its directory first on
    ``sys.path``) or ``package.module:NAME`` (imported from ``sys.path``); ``NAME`` may be dotted
    (``Builder.tiny``). The factory takes no argument and returns ``(module, batch)``: an ``nn.Module`` and a dict
    of input name → tensor such that ``module(**batch)`` returns the loss (a scalar tensor, or an object with
    ``.loss`` as Hugging Face models do when given ``labels``). It is called after ``torch.manual_seed(seed)``, so
    every process that loads the spec builds the same weights. ``vocab_size`` (``shardflow train``: the
    tokenizer's) is passed to a factory whose signature takes ``vocab_size``.

    Raises:
        ModelSpecError: naming the spec and what to change.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ModelSpecError(f"--model {spec!r}: write FILE.py:FACTORY or package.module:FACTORY (a function that "
                             f"returns (module, batch)), or name a built-in model (llama, gpt2 or another Hugging Face "
                             f"causal-LM model type; gpt, mlp)")
    module = _import(spec, where)
    factory = module
    for part in name.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            found = sorted(n for n, f in vars(module).items() if inspect.isfunction(f) and not n.startswith("_")
                           and f.__module__ == module.__name__)
            raise ModelSpecError(f"--model {spec}: {where} has no {name!r}; its functions: "
                                 f"{', '.join(found) or 'none'}")
    if not callable(factory):
        raise ModelSpecError(f"--model {spec}: {name!r} ({type(factory).__name__}) is not a function returning "
                             f"(module, batch)")
    kwargs = {"vocab_size": vocab_size} if vocab_size is not None and _takes(factory, "vocab_size") else {}
    torch.manual_seed(seed)
    try:
        made = factory(**kwargs)
    except Exception as e:
        raise ModelSpecError(f"--model {spec}: calling {name}() raised {_raised(e)}") from None
    return _checked(spec, name, made)


def _takes(factory, name: str) -> bool:
    """Whether ``factory``'s signature has a parameter ``name``."""
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or a class without a readable signature
        return False


def _import(spec: str, where: str) -> ModuleType:
    """The module of a spec's ``WHERE``: a ``.py`` file (as ``python FILE.py`` imports it) or a dotted module."""
    try:
        if not where.endswith(".py"):
            return importlib.import_module(where)
        path = Path(where).resolve()
        if not path.is_file():
            raise ModelSpecError(f"--model {spec}: no file {where} (from {Path.cwd()}); give the path of a Python "
                                 f"file, or a module importable as package.module")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))  # its sibling modules import as they do under `python FILE.py`
        name = f"shardflow_model_{path.stem}"
        loader = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module  # dataclasses and pickling look their module up there
        loader.loader.exec_module(module)
        return module
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise ModelSpecError(f"--model {spec}: no module named {where!r} (a file needs its .py suffix)") from None
        raise ModelSpecError(f"--model {spec}: importing {where} raised {_raised(e)}") from None
    except ModelSpecError:
        raise
    except Exception as e:
        raise ModelSpecError(f"--model {spec}: importing {where} raised {_raised(e)}") from None


def _raised(e: BaseException) -> str:
    """``Type: message (at FILE:LINE)``, the line being the innermost frame of the traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{at}"


def _checked(spec: str, name: str, made: object) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``made`` as ``(module, batch)``, or a ModelSpecError saying what the factory returned instead."""
    fix = f"{name}() must return (module, batch): an nn.Module and a dict of input name → tensor"
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        got = f"a {type(made).__name__} of {len(made)}" if isinstance(made, (tuple, list)) else type(made).__name__
        raise ModelSpecError(f"--model {spec}: {fix}; it returned {got}")
    module, batch = made
    if not isinstance(module, nn.Module):
        raise ModelSpecError(f"--model {spec}: {fix}; its first item is a {type(module).__name__}")
    if not isinstance(batch, Mapping) or not batch:
        got = "an empty dict" if isinstance(batch, Mapping) else f"a {type(batch).__name__}"
        raise ModelSpecError(f"--model {spec}: {fix}; its second item is {got}")
    bad = [f"{k!r} ({type(v).__name__})" for k, v in batch.items() if not isinstance(k, str)
           or not isinstance(v, torch.Tensor)]
    if bad:
        raise ModelSpecError(f"--model {spec}: {fix}; the batch has non-tensor entries {', '.join(bad)} (settings "
                             f"such as use_cache=False belong in the model's config)")
    return module, dict(batch)


# --- planning ---------------------------------------------------------------------------------------------------

def summary(pcg: PCG) -> str:
    """One line: devices, tensors, the parallel ops by kind, and the redistributions inserted where rules refused."""
    kinds = Counter(n.op.kind for n in pcg.parallel_nodes)
    ops = ", ".join(f"{k} ×{v}" for k, v in sorted(kinds.items())) or "none"
    n = len(pcg.redistributions)
    redistributed = (f"; {n} redistribution{'s' * (n != 1)} where a rule refused "
                     f"({sum(r.nbytes for r in pcg.redistributions):,} bytes per device)" if n else "")
    return (f"mesh {pcg.mesh} ({pcg.mesh.size} devices); {len(pcg.nodes) - len(pcg.parallel_nodes)} compute ops; "
            f"parallel ops: {ops}{redistributed}")


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


def torch_optimizer(cfg: OptimizerConfig, params) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer whose update shardflow's ``cfg`` computes (SGD or AdamW, same settings)."""
    if cfg.name == Optimizer.SGD:
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def require_eager_comparable(graph: ComputationGraph) -> None:
    """Eager PyTorch draws dropout masks from the process RNG, shardflow from (seed, step, node, element): the two
    runs of a model that draws random numbers cannot be compared. Raises ValueError naming where it draws."""
    drawing = sorted({n.scope or n.name for n in graph.nodes if n.op.random})
    if drawing:
        raise ValueError(f"the model draws random numbers (dropout) in {', '.join(map(repr, drawing))}: eager PyTorch "
                         f"draws other masks than shardflow, so their runs differ; set the dropout probabilities to 0 "
                         f"to compare them")


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

    def __init__(self, plan: ParallelPlan, executor: Executor, optimizer: OptimizerConfig, lead: bool,
                 names: Mapping[str, str], buffers: Mapping[str, torch.Tensor], micro: MicroSteps | None = None):
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
        of = (f" (one of the {count} micro-batches of accumulate={steps} × microbatches={microbatches})"
              if count > 1 else "")
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
        return {k: weights[self._names[k]] if k in self._names else self._buffers[k].clone()
                for k in (*self._names, *self._buffers)}

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's gradients as full tensors, by graph weight name (= parameter name)."""
        return self.executor.grads()

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

    def compare_with_eager(self, model: nn.Module, batch: Mapping[str, torch.Tensor],
                           steps: int) -> Iterator[StepDeviation]:
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
            raise ValueError(f"the eager model's parameters differ from the trainer's weights by up to {start:.3g}; "
                             f"pass the module parallelize was given, before either trains")
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
        want = stored(graph, self._by_weight({k: p.grad if p.grad is not None else torch.zeros_like(p)
                                              for k, p in model.named_parameters(remove_duplicate=False)}))
        dgrad = max((float((grads[w] - g).abs().max()) for w, g in want.items() if g.numel()), default=0.0)
        return abs(float(tensors[graph.loss]) - eager.item()), dgrad

    def _side_by_side(self, model: nn.Module, params: Mapping[str, nn.Parameter], batch: Mapping[str, torch.Tensor],
                      steps: int) -> Iterator[StepDeviation]:
        opt = torch_optimizer(self.optimizer, model.parameters())
        for i in range(1, steps + 1):
            loss = self.step(batch)
            opt.zero_grad()
            out = model(**batch)
            eager = getattr(out, "loss", out)  # the capture's contract: the loss, or an object with .loss
            eager.backward()
            grad = self.grad_error({k: p.grad if p.grad is not None else torch.zeros_like(p)
                                    for k, p in params.items()})
            opt.step()
            weight = self.weight_error({k: p.detach() for k, p in params.items()})
            eager_buffers = dict(model.named_buffers())
            buffer = max((float((self._buffers[k] - eager_buffers[k]).abs().max()) for k in
                          self.graph.buffer_updates), default=0.0)
            yield StepDeviation(i, loss, eager.item(), grad, weight, buffer)


def parallelize(model: nn.Module, batch: Mapping[str, torch.Tensor], *, mesh: Mesh | str, strategy: str | None = None,
                plan: Plan | str | Path | None = None, optimizer: OptimizerConfig | str = "sgd",
                lr: float | None = None, strict: bool = False, executor: ExecutorKind | str = ExecutorKind.AUTO,
                seed: int = 0, timeout_s: float = 300.0, accumulate: int = 1, microbatches: int = 1,
                schedule: str = "1f1b", stages_per_rank: int = 1, reshard_after_forward: bool = True,
                ac: str = "none", mixed_precision: MixedPrecision | None = None, all_gather: str = "auto",
                reduce_scatter: str = "auto", bucket_mb: float = 25.0, device: str = "auto") -> Trainer:
    """Capture ``model(**batch)``, plan it on ``mesh``, lower one training step and load the model's weights
    (:class:`~shardflow.pipeline.Pipeline`, as ``shardflow train`` and ``plan`` do: the same programs).

    Args:
        model: any ``nn.Module`` whose ``model(**batch)`` returns the loss (or an object with ``.loss``). It is
            read, not changed: its parameters are copied in; :meth:`Trainer.state_dict` gives them back trained.
            A model built on the meta device (``with torch.device("meta"): model = ...``) is never materialised
            whole: its initialisation is replayed on each device's pieces alone, draws seeded by ``seed``
            (:mod:`shardflow.runtime.materialize`; its buffers get their values in place).
        batch: an example batch, input name → tensor; every step's batch has its keys, shapes and dtypes.
        mesh: the device mesh, a :class:`Mesh` or its text (``"dp=2,tp=2"``).
        strategy: a preset — dp, fsdp, hsdp, tp, sp, pp or a combination (``"dp,tp"``, ``"fsdp,tp"``); default: the
            one the mesh's axes name.
        plan: a user plan instead (a :class:`Plan` or a JSON/TOML file, see docs/concepts.md).
        optimizer: ``"sgd"``, ``"adamw"`` (with ``lr``, default 0.1), or an :class:`OptimizerConfig` (momentum,
            weight decay, betas...; then no ``lr``).
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
        reshard_after_forward: a weight gathered before use (fsdp) is freed after the forward and gathered again for
            the backward (FSDP2's default); False keeps the forward's gather.
        ac: activation checkpointing, ``"none"`` or ``"block"``: each block (a module under an integer index, such
            as ``model.layers.3``) runs its forward again right before its backward instead of keeping its
            activations (:class:`~shardflow.lower.dynamic.ActivationCheckpointing`).
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
        ValueError: an optimizer given both as a config and with ``lr``; an unknown optimizer, executor, ``ac``,
            schedule or form; ``accumulate``, ``microbatches`` or ``stages_per_rank`` < 1
            (:meth:`~shardflow.lower.LowerOptions.parse`), or a batch whose dim 0 they do not divide
            (BatchSplitError); a schedule that does not fit (:func:`~shardflow.lower.schedule.requested`);
            distributed: the world size is not the mesh's size, or the ranks' models have different weights; an
            unknown ``device``.
        DeviceError (a ValueError): ``device="cuda"`` without CUDA, or a local rank with no GPU of its own.
        CalibrationError: this machine's calibration file cannot be used.
    """
    mesh = Mesh.parse(mesh) if isinstance(mesh, str) else mesh
    opt = optimizer_config(optimizer, lr)
    try:
        kind = ExecutorKind(executor).resolved()
    except ValueError:
        raise ValueError(f"executor={executor!r}: use one of {', '.join(map(str, ExecutorKind))}") from None
    options = mesh_options(mesh, device, all_gather=all_gather, reduce_scatter=reduce_scatter, bucket_mb=bucket_mb,
                           reshard_after_forward=reshard_after_forward, ac=ac, precision=mixed_precision,
                           microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank,
                           accumulate=accumulate)
    inits = materialize(model, seed) if any(p.is_meta for p in model.parameters()) else None
    pipeline = Pipeline.capture(model, batch, mesh, options, opt, strategy, plan, strict)
    graph = pipeline.graph
    weights = {w: inits[w] for w in graph.weights} if inits else weights_of(model, graph)
    where = rank_device(device)
    if kind == ExecutorKind.DISTRIBUTED:
        from shardflow.runtime.distributed import DistributedExecutor, init_from_env
        rank, _ = init_from_env(timeout_s, where)
        lowered = pipeline.lower_micro_steps(ranks=(rank,))
        make = functools.partial(DistributedExecutor, optimizer=opt, timeout_s=timeout_s, seed=seed, device=where)
        if not inits:  # materialised pieces are the same everywhere by design
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
    return Trainer(ParallelPlan(pipeline.plan.name, pipeline.pcg, lowered[pipeline.micro_steps[-1]]), ex, opt, lead,
                   names, buffers, micro)


def mesh_options(mesh: Mesh, device: str = "auto", **settings) -> LowerOptions:
    """:func:`parallelize`'s step ``settings`` (keyword arguments of :meth:`LowerOptions.parse`) parsed, with the
    cost model of one process per device of ``mesh`` on ``device`` (:func:`~shardflow.pipeline.machine_cost`), which
    chooses the ``auto`` forms. Raises ValueError as :meth:`LowerOptions.parse` does, CalibrationError."""
    return LowerOptions.parse(cost=machine_cost(device, mesh.size), **settings)


def optimizer_config(optimizer: OptimizerConfig | str, lr: float | None) -> OptimizerConfig:
    """``optimizer`` as an :class:`OptimizerConfig`: given as one (then no ``lr``), or by name (``sgd``,
    ``adamw``) with ``lr`` (default 0.1). Raises ValueError for an unknown name, or a config given with ``lr``."""
    if isinstance(optimizer, OptimizerConfig):
        if lr is not None:
            raise ValueError(f"lr={lr} with an OptimizerConfig (lr={optimizer.lr}): set lr in the config")
        return optimizer
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
        raise ValueError(f"ranks {differ} built other initial weights than rank 0: every rank must pass the same "
                         f"model (call torch.manual_seed with the same seed before building it)")
