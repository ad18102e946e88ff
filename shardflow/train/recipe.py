"""The recipe of ``shardflow train``: what every rank builds identically from the configuration — the corpus (tokens
and tokenizer, :mod:`shardflow.train.data`), the model of ``--model`` (:mod:`shardflow.train.family`; seeded, or
``--init-from`` a Hugging Face directory), its captured graph, the strategy's PCG on the mesh, the optimizer and the
lowering options — and what the checkpoints record about the model. The parent builds it too, before any process
starts, so every configuration and planning error surfaces there."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from shardflow.capture import capture
from shardflow.graph.graph import ComputationGraph
from shardflow.lower import LoweredStep, MicroStep
from shardflow.lower.dynamic import OPTIMIZER_SLOTS
from shardflow.lower.schedule import ScheduleKind, requested
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG
from shardflow.pipeline import Pipeline, machine_cost, machine_spec
from shardflow.runtime.device import device_type
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.runtime.materialize import TensorInit, materialize
from shardflow.search import Candidate, SearchResult, search_model
from shardflow.strategy import PlanError
from shardflow.strategy.presets import DATA_AXES, default_mesh
from shardflow.train import checkpoint, memory
from shardflow.train.checkpoint.export import Pretrained
from shardflow.train.config import DEFAULT_STRATEGY, TrainConfig, optimizer_config, step_options
from shardflow.train.data import Corpus, Split
from shardflow.train.family import (
    Family,
    ModelError,
    Sizes,
    buildable,
    check_model_size,
    factory_family,
    hf_config,
    hf_family,
    is_factory,
    layers_of,
    one_line,
)
from shardflow.train.tokenizer import TOKENIZER_FILE, TokenizerChoice


@dataclass
class Setup:
    """What every rank builds identically from the config: data, the model (its family and config; a built-in
    family's on the meta device, its buffers real), the :class:`~shardflow.pipeline.Pipeline` (graph, PCG, options,
    optimizer); ``pretrained``: the ``--init-from`` directory's
    weights; ``inits``: how each parameter is initialised, piece by piece (a built-in family's,
    :mod:`shardflow.runtime.materialize`; None for a factory's model, built whole); ``runtime_bytes``: see
    :func:`check_memory`."""

    cfg: TrainConfig
    corpus: Corpus
    family: Family
    config: Any
    model: nn.Module
    pipeline: Pipeline
    mesh: Mesh
    pretrained: Pretrained | None = None
    inits: Mapping[str, TensorInit] | None = None
    runtime_bytes: int = 0  # this process's resident size before it built the model (the memory estimate's runtime)

    def batch(self, split: Split, step: int) -> dict[str, torch.Tensor]:
        """The model's inputs for batch ``step`` of ``split`` ([batch_size, seq_len] token ids and next tokens): the
        whole batch of a step, which :class:`~shardflow.runtime.accumulate.MicroSteps` splits into micro-batches."""
        c = self.cfg
        return self.family.feed.inputs(**self.corpus.batch(split, step, c.batch_size, c.seq_len, c.seed))

    @property
    def eval_batches(self) -> int:
        """Validation batches per measurement: ``--eval-batches``, at most as many as hold the validation split's
        tokens (⌈N_val / (batch_size × seq_len)⌉, at least 1): more would read the same windows again and again."""
        c = self.cfg
        return min(c.eval_batches, max(1, math.ceil(len(self.corpus.val) / (c.batch_size * c.seq_len))))

    @property
    def graph(self) -> ComputationGraph:
        """The model captured on a micro-batch (the pipeline's graph)."""
        return self.pipeline.graph

    @property
    def pcg(self) -> PCG:
        """The strategy's PCG on the mesh (the pipeline's)."""
        return self.pipeline.pcg

    @property
    def optimizer(self) -> OptimizerConfig:
        """The optimizer of the config (the pipeline's)."""
        return self.pipeline.optimizer

    def lower(
        self,
        ranks: tuple[int, ...] | None = None,
        verify: bool = False,
        training: bool = True,
        micro: MicroStep | None = None,
    ) -> LoweredStep:
        """:meth:`Pipeline.lower <shardflow.pipeline.Pipeline.lower>`: one step (training, or evaluation) for
        ``ranks`` (default all; ``verify`` proves them), micro-step ``micro`` (default the last)."""
        return self.pipeline.lower(ranks, verify, training, micro)

    def whole_batch_graph(self) -> ComputationGraph:
        """The model captured on a whole batch (what ``--check``'s one device trains on): the run's graph, or under
        ``--accumulate`` or ``--microbatches`` (whose graph is a microbatch's) a second capture at ``--batch-size``."""
        if self.cfg.accumulate * self.cfg.microbatches == 1:
            return self.pipeline.graph
        return capture(self.model, self.batch(Split.TRAIN, 0))

    def initial_weights(self) -> Mapping[str, Any]:
        """The weights to start from by graph name, each indexed by the executors for the pieces they hold
        (``w[slices]``): the ``--init-from`` directory's (read lazily), the seeded initialisation of a built-in
        family (each piece computed alone: :class:`~shardflow.runtime.materialize.TensorInit`), or a factory's
        model's full tensors."""
        params = dict(self.model.named_parameters())
        if self.pretrained is not None:
            return self.pretrained.weights({w: params[w] for w in self.graph.weights})
        if self.inits is not None:
            return {w: self.inits[w] for w in self.graph.weights}
        return {w: params[w].detach().clone() for w in self.graph.weights}

    def whole_model(self) -> nn.Module:
        """The model with its initial weights, materialized whole on this process: for a one-device reference or a
        PyTorch baseline to compare with (a run's ranks never build it). Under ``--init-from`` the directory's
        weights, read whole."""
        if self.inits is None and self.pretrained is None:
            return self.model
        torch.manual_seed(self.cfg.seed)
        model = self.family.build(self.config)
        weights = self.initial_weights()
        full = {w: v[tuple(slice(None) for _ in v.shape)] for w, v in weights.items()}
        model.load_state_dict(full, strict=False)  # tied weights load under their first name
        return model

    def checkpoint_entries(self) -> checkpoint.Entries:
        """What a checkpoint of this run holds: every weight and the optimizer state of those it trains."""
        precision = self.pipeline.options.precision
        return checkpoint.model_entries(
            self.model,
            self.graph.weights,
            OPTIMIZER_SLOTS[self.optimizer.slots],
            precision and precision.reduce_dtype,
            self.graph.frozen,
        )

    def checkpoint_meta(self, world: int) -> dict[str, Any]:
        """What a checkpoint of this run records besides its tensors (``world``: processes of the run)."""
        return {
            "model": {"family": self.family.name, "config": self.family.to_json(self.config)},
            "data": self.data_record(),
            "train": dataclasses.asdict(self.cfg),
            "mesh": str(self.mesh),
            "processes": world,
        }

    def checkpoint_files(self) -> dict[str, str]:
        """The files a checkpoint of this run holds besides its tensors: the tokenizer (name → contents)."""
        return {TOKENIZER_FILE: self.corpus.tokenizer.to_json()}

    def data_record(self) -> dict[str, Any]:
        """The corpus as a checkpoint records it: source, sha256, characters, tokens, tokenizer."""
        c = self.corpus
        return {
            "source": c.source,
            "sha256": c.sha256,
            "chars": c.chars,
            "tokens": len(c.tokens),
            "tokenizer": c.tokenizer.describe(),
        }

    def resume_point(self) -> checkpoint.Checkpoint:
        """The checkpoint ``--resume`` continues from, checked against this run (raises CheckpointError)."""
        c = self.cfg
        return checkpoint.for_resume(
            c.checkpoints,
            self.family,
            self.config,
            self.data_record(),
            self.corpus.tokenizer,
            self.optimizer.slots,
            self.checkpoint_entries(),
            dataclasses.asdict(c),
        )


def build_model(cfg: TrainConfig, vocab_size: int, pretrained: Pretrained | None) -> tuple[Family, Any, nn.Module]:
    """The family, config and module of ``--model``, sized by ``--model-config`` (or the ``--init-from``
    directory's config) and the size flags: a built-in family's on the meta device (shapes only; see
    :func:`~shardflow.runtime.materialize.materialize`), a factory's as the factory builds it (seeded with ``--seed``). Raises ModelError,
    ModelSpecError."""
    sizes = Sizes.of(cfg)
    given = [f"--{k.replace('_', '-')} {v}" for k, v in dataclasses.asdict(sizes).items() if v is not None]
    if is_factory(cfg.model):
        if given or cfg.model_config or pretrained:
            what = ", ".join(given + ["--model-config"] * bool(cfg.model_config) + ["--init-from"] * bool(pretrained))
            raise ModelError(
                f"{what}: size the built-in models (llama, gpt2, ...); --model {cfg.model} sizes its own "
                f"model: drop {what}, or change the factory"
            )
        torch.manual_seed(cfg.seed)
        family, config = factory_family(cfg.model, vocab_size)
        torch.manual_seed(cfg.seed)
        return family, config, family.build(config)
    config_file = str(pretrained.config_file) if pretrained else cfg.model_config
    config = hf_config(
        cfg.model, config_file, sizes, vocab_size, cfg.seq_len, cfg.dropout, keep_vocab=pretrained is not None
    )
    if pretrained is not None:
        theirs = hf_config(cfg.model, config_file, Sizes(), vocab_size, cfg.seq_len, cfg.dropout, keep_vocab=True)
        changed = [
            f"{flag} {getattr(config, attr)} (the model has {getattr(theirs, attr)})"
            for attr, flag in hf_family(config.model_type).must_match
            if getattr(config, attr, None) != getattr(theirs, attr, None)
        ]
        if changed:
            raise ModelError(
                f"{', '.join(changed)}: --init-from {cfg.init_from} fixes the model's sizes; drop "
                f"those flags or give the model's values"
            )
    family = hf_family(config.model_type)
    what = ", ".join(given + [f"--model-config {config_file}"] * bool(config_file)) or "the default sizes"
    with buildable(what):
        check_model_size(layers_of(family, config), config.num_hidden_layers, what, max(cfg.nproc, 1))
    with buildable(what), torch.device("meta"):
        try:
            return family, config, family.build(config)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if not config_file or isinstance(e, ModelError):
                raise
            # a field transformers' config took but its model cannot use (an unknown hidden_act, a rope_theta
            # string, ...)
            raise ModelError(
                f"--model-config {config_file}: transformers cannot build a {config.model_type} model of it "
                f"({type(e).__name__}: {one_line(e)}); fix the field it names, or drop it to take the default"
            ) from None


def setup(cfg: TrainConfig, world: int, processes: int = 0) -> Setup:
    """Data, model (seeded), captured graph and the PCG of the strategy. Raises the planner's errors (PlanError,
    DegreeError, ...), DataError and ModelError — the parent calls this before starting any process. ``processes``:
    the processes of the run on this machine to check the memory for (0: none); where building or capturing the
    model could itself exhaust memory, the run is estimated and refused (MemoryFitError) before the model is built
    (:func:`check_memory` checks the lowered step)."""
    if cfg.plan and cfg.strategy:
        raise PlanError(
            f"--plan {cfg.plan} and --strategy {cfg.strategy}: the plan places every tensor itself; give "
            f"one of them (drop --strategy to train with the plan)"
        )
    mesh = (
        Mesh.parse(cfg.mesh)
        if cfg.mesh
        else default_mesh(cfg.strategy or DEFAULT_STRATEGY, world if world > 1 else cfg.nproc)
    )
    check_accumulation(cfg, mesh)
    if world > 1 and mesh.size != world:
        raise ValueError(
            f"mesh {mesh} has {mesh.size} devices but {world} processes run; make --nproc (or "
            f"torchrun's --nproc-per-node × nodes) equal {mesh.size}, or change --mesh"
        )
    pretrained = Pretrained.open(Path(cfg.init_from)) if cfg.init_from else None
    tokenizer = str(pretrained.tokenizer_file) if pretrained else cfg.tokenizer
    corpus = Corpus.load(cfg.data, TokenizerChoice.of(tokenizer, cfg.vocab_size), cfg.seq_len, cfg.cache_dir)
    runtime = memory.resident_bytes()
    if processes and not is_factory(cfg.model):  # a factory's model is known once the factory has built it
        _check_memory_before_build(cfg, world, mesh, corpus, pretrained, processes, runtime)
    return _build(cfg, mesh, corpus, pretrained, runtime=runtime)


def auto_strategy(cfg: TrainConfig, world: int, placements: bool = False) -> tuple[TrainConfig, SearchResult]:
    """``--strategy auto``: the settings of the fastest preset that fits this machine (:func:`~shardflow.search.search`
    on ``MachineSpec.this`` for ``world`` processes; docs/search.md) — ``cfg`` with its strategy, mesh, activation
    checkpointing and pipeline schedule replaced — and the search's result; ``placements``: try per-op placements
    too (the benchmark's reading; ``train`` runs presets only, a per-op choice being a plan file that
    ``shardflow plan --strategy auto --save-plan`` writes). The model is built on the meta device
    and captured on the corpus's first batch; nothing is materialized but its buffers. Raises SearchError where
    nothing fits, and what building the model raises."""
    if cfg.plan or cfg.mesh:
        raise PlanError(
            f"--strategy auto chooses the mesh and the plan itself: drop {'--plan' if cfg.plan else '--mesh'}, and "
            f"give the number of devices with --nproc"
        )
    corpus = Corpus.load(cfg.data, TokenizerChoice.of(cfg.tokenizer, cfg.vocab_size), cfg.seq_len, cfg.cache_dir)
    family, _, model = build_model(cfg, corpus.tokenizer.vocab_size, None)
    if not is_factory(cfg.model):
        materialize(model, cfg.seed)
    options = step_options(cfg, machine_cost(cfg.device, world))
    if options.precision:
        model.to(options.precision.param_dtype)
    batch = family.feed.inputs(**corpus.batch(Split.TRAIN, 0, cfg.batch_size, cfg.seq_len, cfg.seed))
    spec = machine_spec(cfg.device, world)[0]  # an uncalibrated machine: the banner says so
    result = search_model(
        model,
        batch,
        world,
        options,
        optimizer_config(cfg),
        spec,
        cfg.memory_budget,
        placements=placements,
        time_limit=cfg.search_seconds,
        screen=not cfg.search_all,
    )
    return settings_of(cfg, result.best.candidate), result


def settings_of(cfg: TrainConfig, c: Candidate) -> TrainConfig:
    """``cfg`` running the search's candidate ``c`` (a preset, :func:`auto_strategy`): its strategy, mesh,
    activation checkpointing (of its first ``ac_blocks`` blocks where it checkpoints only those), pipeline schedule,
    gradient accumulation and how attention reads a sequence split over cp — every setting the search predicted it with, so the run is the plan predicted."""
    return dataclasses.replace(
        cfg,
        strategy=c.strategy,
        mesh=str(c.mesh),
        ac=str(c.ac),
        ac_blocks=c.ac_blocks,
        microbatches=c.microbatches,
        schedule=str(c.schedule),
        stages_per_rank=c.stages_per_rank,
        accumulate=c.accumulate,
        cp_attention=str(c.cp_attention),
    )


def check_accumulation(cfg: TrainConfig, mesh: Mesh) -> None:
    """Raise ValueError (one paragraph) unless the pipeline schedule fits (:func:`~shardflow.lower.schedule.requested`:
    ``--stages-per-rank`` with ``--schedule interleaved``, its microbatches a multiple of the stages) and, under
    ``--accumulate N`` or ``--microbatches M`` (N·M > 1), ``--batch-size`` splits into N·M micro-batches of whole
    sequences that each split over the data-parallel degree (the mesh's ``dp`` and ``fsdp`` axes)."""
    requested(mesh, ScheduleKind(cfg.schedule), cfg.microbatches, cfg.stages_per_rank)
    n = cfg.accumulate * cfg.microbatches
    dp = math.prod(mesh.axis_size(a) for a in DATA_AXES if a in mesh.axis_names)
    if n > 1 and cfg.batch_size % (n * dp):
        flag = (
            "--microbatches"
            if cfg.accumulate == 1
            else "--accumulate"
            if cfg.microbatches == 1
            else "--accumulate × --microbatches"
        )
        fits = sorted({k for k in range(1, cfg.batch_size + 1) if cfg.batch_size % (k * dp) == 0} - {1})
        article = "a" if flag == "--microbatches" else "an"
        other = f"{article} {flag} of {', '.join(map(str, fits))}" if fits else f"{flag} 1"
        up = -(-cfg.batch_size // (n * dp)) * n * dp
        raise ValueError(
            f"--batch-size {cfg.batch_size} does not split into {flag} {n} micro-batches over "
            f"data-parallel degree {dp} (mesh {mesh}): each micro-batch is --batch-size / {n} whole "
            f"sequences, an equal number on each data-parallel rank, so --batch-size must be a multiple "
            f"of {flag} × dp = {n * dp}; give --batch-size {up} (or another multiple of {n * dp}), or "
            f"{other}"
        )


def _build(
    cfg: TrainConfig, mesh: Mesh, corpus: Corpus, pretrained: Pretrained | None, meta: bool = False, runtime: int = 0
) -> Setup:
    """The model of ``cfg`` (``meta``: shapes only, nothing materialized, not even buffers), captured on a
    micro-batch of the corpus (``--batch-size / (--accumulate × --microbatches)`` sequences: the whole batch without
    either), and its PCG on ``mesh``."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        family, config, model = build_model(cfg, corpus.tokenizer.vocab_size, pretrained)
    inits = None if meta or is_factory(cfg.model) else materialize(model, cfg.seed)
    options = step_options(cfg, machine_cost(cfg.device, cfg.nproc))
    if options.precision:  # captured in param_dtype (the model's own upcasts kept), started from its float32 weights
        if inits is None and not meta:
            inits = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.to(options.precision.param_dtype)
    micro = cfg.batch_size // (cfg.accumulate * cfg.microbatches)
    example = family.feed.inputs(**corpus.batch(Split.TRAIN, 0, micro, cfg.seq_len, cfg.seed))
    strategy = None if cfg.plan else cfg.strategy or DEFAULT_STRATEGY
    pipeline = Pipeline.planned(
        capture(model, example),
        mesh,
        options,
        optimizer_config(cfg, cfg.lr_scheduler),
        strategy,
        cfg.plan,
        cfg.strict,
        cfg.clip_norm or None,
    )
    return Setup(cfg, corpus, family, config, model, pipeline, mesh, pretrained, inits, runtime)


def _check_memory_before_build(
    cfg: TrainConfig,
    world: int,
    mesh: Mesh,
    corpus: Corpus,
    pretrained: Pretrained | None,
    processes: int,
    runtime: int,
) -> None:
    """Where capturing at the run's size could itself take much memory (:func:`memory.needs_probe`), refuse
    (MemoryFitError) a run whose estimate from small plans (:func:`probe_estimate`) cannot fit. (A built-in family's
    parameters are never whole on a process: they are in the plan's pieces, which :func:`check_memory` counts.)"""
    if memory.needs_probe(cfg):
        with torch.device("meta"):
            whole = memory.module_bytes(build_model(cfg, corpus.tokenizer.vocab_size, pretrained)[2], buffers_only=True)
        memory.check(
            probe_estimate(cfg, world, mesh, corpus, pretrained, whole, runtime),
            processes,
            device_type(cfg.device, processes),
        )


def probe_estimate(
    cfg: TrainConfig, world: int, mesh: Mesh, corpus: Corpus, pretrained: Pretrained | None, whole: int, runtime: int
) -> memory.Estimate:
    """The memory estimate of a process of the run (``world`` 1: one process runs every rank) from three small plans
    on the meta device (:func:`memory.probe_sizes`), each buffer and constant scaled to the run's batch and sequence
    (:func:`memory.scaling`); ``whole``: the bytes of the model each process builds, ``runtime``: of the rest of the
    process. Nothing of the run's size is allocated. Under ``--accumulate`` a step's buffers are a micro-step's:
    the estimate is of the run at the micro-batch's size; under ``--microbatches M`` each probe runs M microbatches
    (the schedule's activations in flight counted)."""
    cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // cfg.accumulate, accumulate=1)
    steps, probes = [], {}
    for b, t in memory.probe_sizes(mesh.size):
        b *= cfg.microbatches
        small = _build(dataclasses.replace(cfg, batch_size=b, seq_len=t), mesh, corpus, pretrained, meta=True)
        step = small.lower(verify=False)
        steps.append((small, step))
        probes[(b, t)] = {
            **{f"const:{k}": v.numel() * v.element_size() for k, v in small.graph.constants.items()},
            **{x.value: x.type.nbytes for p in step.programs.values() for x in (*p.inputs, *p.written().values())},
        }
    grow = memory.scaling(cfg, probes)
    (b, t), _, (_, t2) = probes
    small, step = steps[0]
    constants = sum(grow(f"const:{k}", v.numel() * v.element_size()) for k, v in small.graph.constants.items())
    basis = (
        f"plans at batch {b} and {2 * b}, sequence {t} and {t2}, scaled to --batch-size {cfg.batch_size} "
        f"--seq-len {cfg.seq_len}"
    )
    return memory.of_plan(step, world == 1, whole, constants, runtime, lambda x: grow(x.value, x.type.nbytes), basis)


def check_memory(s: Setup, step: LoweredStep, world: int, processes: int) -> None:
    """Raise MemoryFitError unless ``processes`` processes of the run fit in this machine's memory, each running
    one rank's program of ``step`` (``world`` > 1) or every rank's (``world`` 1: one process runs the mesh), with
    what it holds of the model whole (its buffers; a factory's module), the graph's constants and its runtime
    (nothing when ``processes`` is 0); the buffers in the GPUs' memory where ``--device`` puts them there
    (:func:`~shardflow.train.memory.check`)."""
    if processes:
        constants = sum(v.numel() * v.element_size() for v in s.graph.constants.values())
        memory.check(
            memory.of_plan(
                step,
                world == 1,
                memory.module_bytes(s.model, buffers_only=s.inits is not None),
                constants,
                s.runtime_bytes,
            ),
            processes,
            device_type(s.cfg.device, processes),
        )
