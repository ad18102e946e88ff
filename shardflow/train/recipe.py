"""The recipe of ``shardflow train``: what every rank builds identically from the configuration — the corpus (tokens
and tokenizer, :mod:`shardflow.train.data`), the GPT (seeded), its captured graph, the strategy's PCG on the mesh, the optimizer and the lowering options — and what
the checkpoints need to know about the model (:data:`GPT_MODEL`). The parent builds it too, before any process
starts, so every configuration and planning error surfaces there."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from shardflow.capture import capture
from shardflow.graph.graph import ComputationGraph
from shardflow.lower import CostModel, LowerOptions, lower_step
from shardflow.lower.dynamic import OPTIMIZER_SLOTS, Optimizer
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG, build_pcg, evaluation
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.strategy import make_plan, resolve
from shardflow.strategy.presets import default_mesh
from shardflow.train import checkpoint
from shardflow.train.config import TrainConfig
from shardflow.train.data import Corpus, Split
from shardflow.train.tokenizer import TOKENIZER_FILE, TokenizerChoice

# GPT as checkpoints see it; the sizes a resumed run must share, with the flags that set them (vocab_size comes
# from the tokenizer, which a checkpoint holds; dropout may change)
GPT_MODEL = checkpoint.ModelAdapter("GPT", GPTConfig, GPT, {"block_size": "--seq-len", "n_layer": "--layers",
                                                            "n_head": "--heads", "n_embd": "--embd", "bias": "bias"})


@dataclass
class Setup:
    """What every rank builds identically from the config: data, model, graph, PCG."""

    cfg: TrainConfig
    corpus: Corpus
    model: GPT
    graph: ComputationGraph
    pcg: PCG
    mesh: Mesh

    @property
    def lower_options(self) -> LowerOptions:
        """The forms of all-gathers and reduce-scatters, chosen by the cost model of this machine's backend."""
        return LowerOptions(self.cfg.all_gather, self.cfg.reduce_scatter,
                            CostModel("nccl" if torch.cuda.is_available() else "gloo"),
                            bucket_bytes=int(self.cfg.bucket_mb * 2**20))

    def lower(self, ranks=None, verify: bool = False, training: bool = True):
        """Lower one step (training, or evaluation: forward only, no dropout) for ``ranks`` (default all;
        ``verify`` proves them); a training step computes the global gradient norm (a metric)."""
        return lower_step(self.pcg if training else evaluation(self.pcg), self.optimizer.slots, ranks=ranks,
                          verify=verify, training=training,
                          options=self.lower_options, clip_norm=self.cfg.clip_norm or None, grad_norm=True)

    @property
    def optimizer(self) -> OptimizerConfig:
        """The optimizer of the config (SGD keeps its momentum, AdamW ignores it)."""
        c = self.cfg
        return OptimizerConfig(c.optimizer, c.lr, c.momentum if c.optimizer == Optimizer.SGD else 0.0, c.weight_decay)

    def initial_weights(self) -> dict[str, torch.Tensor]:
        """The seeded model's weights by graph name (full tensors; each executor keeps its pieces)."""
        params = dict(self.model.named_parameters())
        return {w: params[w].detach().clone() for w in self.graph.weights}

    def checkpoint_entries(self) -> checkpoint.Entries:
        """What a checkpoint of this run holds: every weight and its optimizer state."""
        return checkpoint.model_entries(self.model, self.graph.weights, OPTIMIZER_SLOTS[self.optimizer.slots])

    def checkpoint_meta(self, world: int) -> dict[str, Any]:
        """What a checkpoint of this run records besides its tensors (``world``: processes of the run)."""
        return {"model": GPT_MODEL.to_json(self.model.config), "data": self.data_record(),
                "train": dataclasses.asdict(self.cfg), "mesh": str(self.mesh), "processes": world}

    def checkpoint_files(self) -> dict[str, str]:
        """The files a checkpoint of this run holds besides its tensors: the tokenizer (name → contents)."""
        return {TOKENIZER_FILE: self.corpus.tokenizer.to_json()}

    def data_record(self) -> dict[str, Any]:
        """The corpus as a checkpoint records it: source, sha256, characters, tokens, tokenizer."""
        c = self.corpus
        return {"source": c.source, "sha256": c.sha256, "chars": c.chars, "tokens": len(c.tokens),
                "tokenizer": c.tokenizer.describe()}

    def resume_point(self) -> checkpoint.Checkpoint:
        """The checkpoint ``--resume`` continues from, checked against this run (raises CheckpointError)."""
        c = self.cfg
        return checkpoint.for_resume(c.checkpoints, GPT_MODEL, self.model.config, self.data_record(),
                                     self.corpus.tokenizer, self.optimizer.slots, self.checkpoint_entries())


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    """The GPT's sizes from the config; the vocabulary is the tokenizer's."""
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.seq_len, n_layer=cfg.layers, n_head=cfg.heads,
                     n_embd=cfg.embd, dropout=cfg.dropout)


def setup(cfg: TrainConfig, world: int) -> Setup:
    """Data, model (seeded), captured graph and the PCG of the strategy. Raises the planner's errors (PlanError,
    DegreeError, ...) and DataError — the parent calls this before starting any process."""
    mesh = Mesh.parse(cfg.mesh) if cfg.mesh else default_mesh(cfg.strategy, world if world > 1 else cfg.nproc)
    if world > 1 and mesh.size != world:
        raise ValueError(f"mesh {mesh} has {mesh.size} devices but {world} processes run; make --nproc (or "
                         f"torchrun's --nproc-per-node × nodes) equal {mesh.size}, or change --mesh")
    corpus = Corpus.load(cfg.data, TokenizerChoice.of(cfg.tokenizer, cfg.vocab_size), cfg.seq_len, cfg.cache_dir)
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg, corpus.tokenizer.vocab_size))
    example = corpus.batch(Split.TRAIN, 0, cfg.batch_size, cfg.seq_len, cfg.seed)
    graph = capture(model, example)
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, cfg.strategy), graph, mesh), strict=cfg.strict)
    return Setup(cfg, corpus, model, graph, pcg, mesh)
