"""Typed configuration of ``shardflow train``: each field's ``help`` is its command-line help; and the checks of a
configuration that run before any process starts (:func:`check_config`, :func:`check_outputs`).

Precedence: built-in defaults < ``--config FILE.toml`` < command-line flags. The resolved configuration is
saved as ``config.toml`` in the run directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from shardflow.lower.cost import ALL_GATHER_FORMS, REDUCE_SCATTER_FORMS, CostModel, LowerOptions, MixedPrecision
from shardflow.lower.dynamic import ActivationCheckpointing, Optimizer
from shardflow.lower.schedule import ScheduleKind
from shardflow.runtime.device import DEVICES, check_device, local_processes
from shardflow.runtime.kernels import LRDecay, LRSchedule, OptimizerConfig
from shardflow.train.checkpoint.store import CheckpointError, check_writable

# the parent of the run directory each run gets without --run-dir (shardflow.train.rundir)
RUNS = Path("runs")
DEFAULT_STRATEGY = "tp"  # without --strategy and --plan


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


# --dtype → mixed precision: the dtype the model computes in, and the one its weights are held, reduced and updated
# in (None: float32, the model's own, nothing cast)
PRECISION: dict[str, MixedPrecision | None] = {"float32": None, "bf16": MixedPrecision(torch.bfloat16, torch.float32)}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on."""

    strategy: str | None = _f(
        None,
        f"single, dp, fsdp, hsdp (= dp,fsdp), tp, sp, pp, cp (context parallel), ep (expert parallel) or a combination such as dp,tp "
        f"or fsdp,tp, or auto: the fastest of them that fits this machine, chosen by the simulator before any "
        f"process starts (docs/search.md) (default {DEFAULT_STRATEGY}; not with --plan)",
    )
    plan: str | None = _f(
        None,
        "a user plan instead of --strategy: a JSON or TOML file of per-module placements, "
        "as shardflow plan --plan and shardflow check --plan take (docs/concepts.md)",
    )
    mesh: str | None = _f(None, "device mesh, e.g. dp=2,tp=2 (default: the strategy's axis with --nproc devices)")
    memory_budget: int | None = _f(
        None,
        "with --strategy auto: bytes each process may hold at its peak (default: 0.9 × this machine's memory "
        "per process)",
    )
    search_seconds: float | None = _f(
        None,
        "with --strategy auto: seconds after which the search tries no further candidate once one fits, answering "
        "with the best it tried (default: no limit, every candidate; docs/search.md#a-time-limit)",
    )
    search_all: bool = _f(
        False,
        "with --strategy auto: predict every candidate, not only those whose closed-form estimate could win "
        "(slower; docs/search.md#screening)",
    )
    nproc: int = _f(2, "local processes to start (one per device); under torchrun, WORLD_SIZE decides")
    steps: int = _f(600, "optimizer steps to train for")
    batch_size: int = _f(16, "sequences per step (global, split over data-parallel ranks)")
    accumulate: int = _f(
        1,
        "gradient accumulation: run each step as N micro-steps of --batch-size/N sequences, "
        "reducing the gradients once, after the last (the same step as the whole batch at once)",
    )
    microbatches: int = _f(
        1,
        "pipeline microbatches: run each step's batch as M microbatches of "
        "--batch-size/(M × --accumulate) sequences through the pipeline stages in the order of "
        "--schedule, summing their gradients (one update per step)",
    )
    schedule: str = _f(
        str(ScheduleKind.ONE_F_ONE_B),
        "pipeline schedule of the microbatches: 1f1b (each stage warms "
        "up with at most p-1 forwards, then alternates one forward and one backward: at most p "
        "microbatches' activations held), gpipe (every forward, then every backward) or interleaved "
        "(1F1B over --stages-per-rank chunks per stage; --microbatches a multiple of the stages)",
        choices=tuple(map(str, ScheduleKind)),
    )
    stages_per_rank: int = _f(
        1,
        "chunks of the model each pipeline stage holds (virtual stages; 2 or more with "
        "--schedule interleaved, whose bubble shrinks by that factor)",
    )
    cp_attention: str = _f(
        "auto",
        "under cp: how attention reads the split sequence: all_gather (the keys and values gathered, each device's "
        "queries kept), all_to_all (queries, keys and values moved onto heads and back: DeepSpeed-Ulysses; cp must "
        "divide the key/value heads), ring (planned as all_gather, the keys and values passed around a ring of "
        "collective-permutes block by block, outputs merged by log-sum-exp: each device holds one block at a time) "
        "or auto (the one of all_gather and all_to_all that sends fewer bytes)",
        choices=("auto", "all_gather", "all_to_all", "ring"),
    )
    cp_layout: str = _f(
        "auto",
        "under cp: how the split sequence is laid out: balanced (the head-tail order of 2·cp chunks, device r holding "
        "chunks r and 2·cp−1−r, so that every device of a causal model attends as many keys; --seq-len a multiple "
        "of 2·cp), contiguous (device r holds the r-th block) or auto (balanced where every attention is causal and "
        "--seq-len cuts into 2·cp chunks, else contiguous)",
        choices=("auto", "balanced", "contiguous"),
    )
    ep_dispatch: str = _f(
        "all_to_all",
        "under ep: how an expert layer's tokens reach their experts: all_to_all (each token sent only to the ranks of "
        "its experts and back, by all-to-alls of the routing's sizes, exchanged in the step; dropless) or all_gather "
        "(every token of the ep group gathered on every rank, the partial outputs reduce-scattered back)",
        choices=("all_to_all", "all_gather"),
    )
    capacity_factor: float | None = _f(
        None,
        "under ep's all-to-all dispatcher: each rank sends each expert at most capacity-factor × an even share of its "
        "token-expert pairs (⌈F·n·K/E⌉ rows, GShard's capacity), the rest dropped — all-to-alls of fixed size, "
        "numbers that differ from one device's where a token is dropped (default: none, dropless)",
    )
    seq_len: int = _f(64, "tokens per sequence (the model's context length)")
    model: str | None = _f(
        None,
        "llama (Hugging Face LlamaForCausalLM, built from a config: nothing is downloaded), "
        "gpt2, another Hugging Face causal-LM model type, or FILE.py:FACTORY (a function "
        "returning (module, batch), as shardflow check takes) (default: --model-config's "
        "model_type, else llama)",
    )
    model_config: str | None = _f(None, "a Hugging Face config.json that sizes the model (the flags below override it)")
    layers: int | None = _f(None, "transformer blocks (default 2)")
    heads: int | None = _f(None, "attention heads (default 4)")
    kv_heads: int | None = _f(None, "key/value heads of grouped-query attention (default 2; Llama-style models)")
    embd: int | None = _f(None, "hidden width (default 128)")
    mlp: int | None = _f(
        None,
        "MLP width, the config's intermediate_size (default: 8/3 of --embd rounded up to a multiple of 64 for "
        "SwiGLU models such as llama, 4× --embd for gpt2; --model-config's own)",
    )
    init_from: str | None = _f(
        None,
        "start from a Hugging Face model directory (as shardflow export writes): its "
        "config, weights (each rank reads only its pieces) and tokenizer",
    )
    dropout: float = _f(
        0.0,
        "dropout probability of the residual and embedding dropout (gpt2; Llama-style models have "
        "none outside attention, whose dropout shardflow does not support); 0 keeps a --model-config's own",
    )
    dtype: str = _f(
        "float32",
        "float32, or bf16: mixed precision — parameters and compute in bfloat16 (the model "
        "captured in bfloat16, with its own upcasts), float32 master weights, gradient "
        "reductions and optimizer state (as FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, "
        "reduce_dtype=float32)); checkpoints hold the float32 masters",
        choices=tuple(PRECISION),
    )
    device: str = _f(
        "auto",
        "where each rank keeps every buffer: auto (cuda:LOCAL_RANK, talking NCCL, when CUDA is "
        "available with a GPU for each local process; else the CPU, talking gloo), cpu, or cuda",
        choices=DEVICES,
    )
    lr: float = _f(3e-3, "learning rate (the peak, after --warmup-steps)")
    warmup_steps: int = _f(0, "linear learning-rate warm-up: step s of these N steps trains at --lr × s / (N + 1)")
    lr_schedule: str = _f(
        str(LRDecay.CONSTANT),
        "learning rate after the warm-up, as torchtitan's lr_scheduler: "
        "constant (--lr), cosine (half a cosine from --lr down to --lr-min-ratio × --lr at the last "
        "step) or linear (a straight line down to it)",
        choices=tuple(map(str, LRDecay)),
    )
    lr_min_ratio: float = _f(
        0.0, "the learning rate of the last step as a fraction of --lr (--lr-schedule cosine or linear)"
    )
    optimizer: str = _f(
        str(Optimizer.ADAMW),
        "sgd, adam (L2 weight decay added to the gradient, as torch.optim.Adam) or adamw",
        choices=tuple(map(str, Optimizer)),
    )
    momentum: float = _f(0.9, "SGD momentum")
    weight_decay: float = _f(0.0, "weight decay (decoupled for AdamW, added to the gradient for SGD and Adam)")
    seed: int = _f(0, "seed for the initial weights, the batches and the dropout masks")
    data: str | None = _f(
        None,
        "UTF-8 text to train on: a file, a directory (every file under it, sorted) or a glob "
        "such as 'books/**/*.txt' (default: the Python documentation of this CPython)",
    )
    tokenizer: str = _f(
        "bpe",
        "bpe (a byte-level BPE trained on the data), char (one token per character) or the path "
        "of a tokenizer.json to use as it is",
    )
    vocab_size: int = _f(1024, "tokens of the BPE that --tokenizer bpe trains, its 256 byte tokens included")
    cache_dir: str | None = _f(
        None,
        "where the tokenizer and the token file of the data are cached (default: "
        ".shardflow-cache next to --data; for the default corpus ~/.cache/shardflow)",
    )
    run_dir: str | None = _f(
        None,
        f"directory for logs, metrics, checkpoints and the resolved config (default: a new "
        f"directory {RUNS}/YYYYmmdd-HHMMSS per run, {RUNS}/latest pointing at the newest; "
        f"with --resume, the run {RUNS}/latest points at); one that holds an earlier run is "
        f"refused without --resume or --overwrite",
    )
    metrics: str | None = _f(None, "JSON-lines metrics file (default: RUN_DIR/metrics.jsonl)")
    checkpoint_dir: str | None = _f(None, "directory for checkpoints (default: RUN_DIR/checkpoints)")
    checkpoint_every: int = _f(
        100, "save a checkpoint every N steps (0: only the final one; the last step is always saved)"
    )
    keep_checkpoints: int = _f(
        0, "keep the newest N complete checkpoints of the run, removing older ones after each save (0: keep every one)"
    )
    resume: bool = _f(
        False,
        "continue from the newest complete checkpoint in the checkpoint directory (any "
        "strategy or mesh may have written it)",
    )
    allow_changed_settings: bool = _f(
        False,
        "with --resume: continue although a setting that changes the numbers (--seed, --optimizer and its settings, "
        "the learning-rate schedule, --clip-norm, --batch-size, --seq-len, --dropout, and --steps under a decaying "
        "--lr-schedule) differs from the checkpoint's; "
        "without it such a run is refused, since its losses would not match the uninterrupted run's",
    )
    overwrite: bool = _f(
        False,
        "replace the earlier run in --run-dir: its metrics and config at once, its checkpoints "
        "once this run has written its first complete one",
    )
    log_every: int = _f(10, "print a progress line every N steps")
    peak_tflops: float = _f(
        0.0,
        "peak TFLOP/s of one device, the denominator of MFU (0: measured at start-up by "
        "timing a float32 matmul on this device)",
    )
    tensorboard: bool = _f(
        False, "also write the metrics as TensorBoard scalars into RUN_DIR/tensorboard (needs the tensorboard package)"
    )
    eval_every: int = _f(100, "measure the validation loss every N steps (and at the end)")
    eval_batches: int = _f(4, "validation batches per measurement")
    clip_norm: float = _f(0.0, "clip gradients to this global norm (0 = off)")
    all_gather: str = _f(
        "auto",
        "all-gather form: auto (cost model), collective, ring or broadcast_loop",
        choices=("auto", *map(str, ALL_GATHER_FORMS)),
    )
    reduce_scatter: str = _f(
        "auto",
        "reduce-scatter form: auto (cost model), collective or ring",
        choices=("auto", *map(str, REDUCE_SCATTER_FORMS)),
    )
    bucket_mb: float = _f(
        25.0,
        "pack gradient all-reduces into buckets of this many MiB, each issued while the "
        "backward goes on (as DDP's bucket_cap_mb; 0 = one all-reduce per gradient)",
    )
    reshard_after_forward: bool = _f(
        True,
        "fsdp: free each gathered weight after its forward use and gather it again "
        "for the backward (FSDP2's default); --no-reshard-after-forward keeps it "
        "from the forward (more memory, half the all-gathers)",
    )
    regather_activations: bool = _f(
        False,
        "sp: free each all-gathered activation after its forward readers and gather it "
        "again for the backward (Megatron-LM's sequence parallelism: a piece per rank kept "
        "instead of the whole, one all-gather more each)",
    )
    ac: str = _f(
        str(ActivationCheckpointing.NONE),
        "activation checkpointing: none; block (each block — a module "
        "under an integer index such as model.layers.3 — runs its forward again right before its backward "
        "instead of keeping its activations: less memory, one more forward per step); or selective (as block, "
        "but the outputs of matmuls, attention and communication are kept and only the cheap ops between them "
        "run again: memory between none and block, a fraction of a forward)",
        choices=tuple(map(str, ActivationCheckpointing)),
    )
    ac_blocks: int | None = _f(
        None,
        "with --ac block: recompute only the first K blocks in forward order (model.layers.0 to "
        "model.layers.K-1; under a pipeline the first stages hold the most microbatches in flight), the others "
        "keeping their activations: memory between --ac none and every block recomputed (default: every block); "
        "with --ac selective: the first K blocks recompute whole, the others selectively (default: none whole)",
        metavar="K",
    )
    debug: bool = _f(False, "check before every communication that all its members are at the same token")
    trace: str | None = _f(
        None,
        "write a Chrome-trace timeline (Perfetto) of step 2 to this JSON file: per-rank "
        "compute and communication lanes, and the cost model's prediction beside them",
    )
    timeout: float = _f(120.0, "seconds any rank may wait on one communication before failing")
    check: bool = _f(
        False, "also run the same steps on one device and compare the loss and every replica of every parameter"
    )
    strict: bool = _f(
        False,
        "refuse the strategy where a sharding rule refuses its inputs (the error names the "
        "parallel op to insert) instead of inserting the cheapest redistribution",
    )

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        """Every field as a flag (:meth:`add_argument`), unset (None) where not given, and ``--config``."""
        p.add_argument("--config", help="TOML file of these settings (flags override it)")
        for f in fields(cls):
            cls.add_argument(p, f.name)

    @classmethod
    def add_argument(
        cls,
        p: argparse.ArgumentParser | argparse._ArgumentGroup,
        name: str,
        own_default: bool = False,
        default: Any = dataclasses.MISSING,
    ) -> None:
        """Field ``name`` as the flag ``--name`` (underscores as dashes) with the field's help, type and choices: the
        one definition of a setting that other commands share with ``shardflow train``. Parsed as None where not
        given (so that a ``--config`` file's value stands), or as the field's default with ``own_default``, or as
        ``default`` for a command whose default differs from train's (the help names it)."""
        f = {f.name: f for f in fields(cls)}[name]
        flag = "--" + f.name.replace("_", "-")
        value = f.default if default is dataclasses.MISSING else default
        unset = value if own_default or default is not dataclasses.MISSING else None
        if f.type == "bool":  # on by default: --no-<flag> turns it off
            action = argparse.BooleanOptionalAction if value else "store_true"
            p.add_argument(flag, action=action, default=unset, help=f.metadata["help"])
            return
        typ = {"int": int, "float": float}.get(f.type.removesuffix(" | None"), str)
        shown = f" (default {value})" if value is not None else ""  # None's help says what happens
        p.add_argument(
            flag,
            type=typ,
            default=unset,
            choices=f.metadata.get("choices"),
            metavar=f.metadata.get("metavar"),
            help=f"{f.metadata['help']}{shown}",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """Defaults, then the --config file, then the flags given. Raises ValueError for unknown keys."""
        values: dict[str, Any] = {}
        if getattr(args, "config", None):
            path = Path(args.config)
            try:
                values = tomllib.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise ValueError(
                    f"config file {path} does not exist; pass --config with a TOML file of these "
                    f"settings, or leave --config out"
                ) from None
            except IsADirectoryError:
                raise ValueError(
                    f"config file {path} is a directory; pass --config with a TOML file of these "
                    f"settings (such as {path / 'config.toml'}, which shardflow train writes into "
                    f"each run directory)"
                ) from None
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason}); TOML files "
                    f"are UTF-8: convert it, e.g. iconv -f latin1 -t utf-8 {path}"
                ) from None
            except OSError as e:
                raise ValueError(
                    f"config file {path} cannot be read ({e.strerror or e}); fix its permissions or "
                    f"pass another --config"
                ) from None
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"config file {path} is not valid TOML: {e}") from None
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ValueError(f"config file {path} has unknown settings {unknown}; known: {sorted(known)}")
        for f in fields(cls):
            v = getattr(args, f.name, None)
            if v is not None:
                values[f.name] = v
        return cls(**values)

    @property
    def placement(self) -> str:
        """What places the tensors: ``strategy S`` (the preset) or ``plan FILE``."""
        return placement(self.strategy, self.plan)

    @property
    def lr_scheduler(self) -> LRSchedule:
        """Each step's learning rate as a factor of ``--lr``: ``--lr-schedule`` after ``--warmup-steps`` (steps),
        down to ``--lr-min-ratio`` at the last of ``--steps``. Raises ValueError (a decay with no step after the
        warm-up) as :class:`~shardflow.runtime.kernels.LRSchedule` does."""
        return LRSchedule(LRDecay(self.lr_schedule), self.warmup_steps, self.steps, self.lr_min_ratio)

    @property
    def checkpoints(self) -> Path:
        """``--checkpoint-dir``, else ``RUN_DIR/checkpoints`` (once the run directory is resolved)."""
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.run_dir) / "checkpoints"

    def to_toml(self) -> str:
        lines = []
        for k, v in dataclasses.asdict(self).items():
            if v is None:
                continue
            lines.append(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, str) else v}")
        return "\n".join(lines) + "\n"

    def argv(self) -> list[str]:
        """Command-line flags that reproduce this configuration (for the ranks the launcher starts)."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or v is False:
                continue
            flag = "--" + f.name.replace("_", "-")
            out += [flag] if v is True else [flag, str(v)]
        return out


def step_options(settings: Any, cost: CostModel) -> LowerOptions:
    """The typed options of the step settings ``settings`` names as ``shardflow train`` does — a
    :class:`TrainConfig`, or ``shardflow plan``'s flags of the same names (``all_gather``, ``reduce_scatter``,
    ``bucket_mb``, ``reshard_after_forward``, ``regather_activations``, ``ac``, ``ac_blocks``, ``dtype``, ``microbatches``, ``schedule``, ``stages_per_rank``,
    ``accumulate``, ``cp_attention``, ``cp_layout``, ``ep_dispatch``, ``capacity_factor``) — with ``cost`` choosing the ``auto`` forms (:meth:`LowerOptions.parse`; raises ValueError as
    it does)."""
    return LowerOptions.parse(
        cost=cost,
        all_gather=settings.all_gather,
        reduce_scatter=settings.reduce_scatter,
        bucket_mb=settings.bucket_mb,
        reshard_after_forward=settings.reshard_after_forward,
        regather_activations=settings.regather_activations,
        ac=settings.ac,
        ac_blocks=settings.ac_blocks,
        precision=PRECISION[settings.dtype],
        microbatches=settings.microbatches,
        schedule=settings.schedule,
        stages_per_rank=settings.stages_per_rank,
        accumulate=settings.accumulate,
        cp_attention=settings.cp_attention,
        cp_layout=settings.cp_layout,
        ep_dispatch=settings.ep_dispatch,
        capacity_factor=settings.capacity_factor,
    )


# The optimizer settings optimizer_config reads; a command without one of them (plan: lr, weight_decay) gets
# train's default, which changes no program
OPTIMIZER_FLAGS = ("optimizer", "momentum", "lr", "weight_decay")


def optimizer_config(settings: Any, schedule: LRSchedule | None = None) -> OptimizerConfig:
    """The optimizer the settings ``settings`` name, mapped as ``shardflow train`` maps them — a
    :class:`TrainConfig`, or ``shardflow plan``'s and ``check``'s flags of the same names (:data:`OPTIMIZER_FLAGS`;
    train's default for one a command lacks): ``optimizer`` sgd, adam or adamw; SGD keeps ``momentum`` (a
    momentum slot unless it is 0), Adam and AdamW ignore it; at the learning-rate schedule ``schedule`` (default
    constant)."""
    given: dict[str, Any] = {
        f.name: getattr(settings, f.name, f.default) for f in fields(TrainConfig) if f.name in OPTIMIZER_FLAGS
    }
    name = Optimizer(given["optimizer"])
    return OptimizerConfig(
        name,
        given["lr"],
        given["momentum"] if name == Optimizer.SGD else 0.0,
        given["weight_decay"],
        schedule=LRSchedule() if schedule is None else schedule,
    )


def placement(strategy: str | None, plan: str | None) -> str:
    """``strategy S`` (the preset, :data:`DEFAULT_STRATEGY` when None) or ``plan FILE``: how a run (or the train
    settings a checkpoint records) places the tensors."""
    return f"plan {plan}" if plan else f"strategy {strategy or DEFAULT_STRATEGY}"


# --- checks of the configuration and the outputs (before any process starts) ---------------------------------


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric setting accepts: finite numbers from ``low`` to ``high`` (None: no bound), the ends
    excluded where ``low_open`` / ``high_open``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, v: float) -> bool:
        return (
            math.isfinite(v)
            and (self.low is None or (v > self.low if self.low_open else v >= self.low))
            and (self.high is None or (v < self.high if self.high_open else v <= self.high))
        )

    def __str__(self) -> str:
        """``≥ 1``, ``> 0``, ``in [0, 1)``."""
        low, high = (x if x is None or x != int(x) or abs(x) >= 1e15 else int(x) for x in (self.low, self.high))
        if low is not None and high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if high is not None:
            return f"{'<' if self.high_open else '≤'} {high}"
        return f"{'>' if self.low_open else '≥'} {low}" if low is not None else "finite"

    def check(self, flag: str, v: float, help_: str) -> None:
        """Raise ValueError (the flag, its value, the range, the flag's help) unless ``v`` is in the range."""
        if v not in self:
            what = "a value" if isinstance(v, int) else "a finite value"
            raise ValueError(f"{flag} {v} is out of range: give {what} {self}. {flag}: {help_}")
        if isinstance(v, int) and not -(2**63) <= v < 2**63:  # torch's sizes and counts are int64
            raise ValueError(
                f"{flag} {v} is out of range: give a value {self} that fits in 64 bits (at most {2**63 - 1}). "
                f"{flag}: {help_}"
            )


# the largest float32 (the optimizer holds lr and weight decay in float32 tensors) and the longest timeout that
# torch.distributed's C++ stores take (a C int of milliseconds, rounded down to a round number: 23 days)
_F32_MAX, _TIMEOUT_MAX = 3.4e38, 2e6
# the range of every numeric setting (a float must be finite even where it has no bound)
RANGES = {
    "nproc": Range(1),
    "steps": Range(1),
    "batch_size": Range(1),
    "accumulate": Range(1),
    "microbatches": Range(1),
    "stages_per_rank": Range(1),
    "ac_blocks": Range(1),
    "seq_len": Range(1),
    "layers": Range(1),
    "heads": Range(1),
    "kv_heads": Range(1),
    "embd": Range(1),
    "mlp": Range(1),
    "vocab_size": Range(256, 2**31 - 1),
    "dropout": Range(0, 1, high_open=True),
    "lr": Range(0, _F32_MAX),
    "warmup_steps": Range(0),
    "lr_min_ratio": Range(0, 1),
    "momentum": Range(0, 1, high_open=True),
    "weight_decay": Range(0, _F32_MAX),
    "seed": Range(0, 2**32, high_open=True),
    "checkpoint_every": Range(0),
    "keep_checkpoints": Range(0),
    "log_every": Range(1),
    "eval_every": Range(1),
    "eval_batches": Range(1),
    "clip_norm": Range(0),
    "bucket_mb": Range(0),
    "timeout": Range(0, _TIMEOUT_MAX, low_open=True),
    "peak_tflops": Range(0),
    "search_seconds": Range(0),
}
_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "None": (type(None),)}
_TYPE_WORDS = {
    "int": "a whole number",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "list": "a list",
    "dict": "a table",
}


def check_config(cfg: TrainConfig) -> None:
    """Raise ValueError (one paragraph: the setting, its value, the fix) for a setting of the wrong type (only a
    ``--config`` file can give one: flags are typed by the command line), outside its choices or its range
    (:data:`RANGES`), or an empty string."""
    for f in dataclasses.fields(cfg):
        v, flag, help_ = getattr(cfg, f.name), "--" + f.name.replace("_", "-"), f.metadata.get("help", "")
        names = [t.strip() for t in str(f.type).split("|")]
        if all(t in _TYPES for t in names):
            ok = any(isinstance(v, _TYPES[t]) and not (t in ("int", "float") and isinstance(v, bool)) for t in names)
            if not ok:
                want = " or ".join(_TYPE_WORDS[t] for t in names if t != "None")
                example = f" (e.g. {f.name} = {f.default!r})" if f.default is not None else ""
                got = _TYPE_WORDS.get(type(v).__name__, type(v).__name__)
                raise ValueError(
                    f"setting {f.name} = {v!r} is {got}, but {f.name} takes {want} ({help_}); fix "
                    f"it in the --config file{example}"
                )
        choices = f.metadata.get("choices")
        if choices and v not in choices:
            raise ValueError(
                f"setting {f.name} = {v!r} is not one of {', '.join(choices)} ({help_}); fix it in the --config file"
            )
        if isinstance(v, str) and not v.strip():
            default = f" (default {f.default})" if f.default is not None else ""
            raise ValueError(f"{flag} is empty; leave it out{default} or give a value ({help_})")
        if f.name in RANGES and v is not None:
            RANGES[f.name].check(flag, v, help_)
    try:
        cfg.lr_scheduler
    except ValueError as e:
        raise ValueError(
            f"{e} (--lr-schedule {cfg.lr_schedule}, --warmup-steps {cfg.warmup_steps}, --steps "
            f"{cfg.steps}): give fewer --warmup-steps than --steps, or --lr-schedule constant"
        ) from None
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard writes with it)
        except ImportError:
            raise ValueError(
                "--tensorboard writes with the tensorboard package, which is not installed here: "
                "pip install tensorboard (or pip install 'shardflow[tensorboard]'), or leave out "
                "--tensorboard (RUN_DIR/metrics.jsonl holds the same numbers)"
            ) from None


def check_processes(cfg: TrainConfig, env: Mapping[str, str]) -> None:
    """Raise ValueError where the environment ``env`` and the settings disagree on the processes: torchrun's
    variables that are not whole numbers, a stray ``RANK`` (``WORLD_SIZE`` 1 or unset) outside torchrun that would
    turn ``--nproc N`` into one process, ``--device cuda`` with fewer GPUs than local processes (DeviceError), and
    ``--trace`` on one process (it traces the ranks' communication)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if var in env and not env[var].strip().isdigit():
            raise ValueError(
                f"environment variable {var}={env[var]!r} is not a whole number; torchrun sets it for "
                f"each rank: unset it to let shardflow train start --nproc processes"
            )
    world = int(env.get("WORLD_SIZE", "1"))
    if "RANK" in env and world == 1 and cfg.nproc > 1 and "TORCHELASTIC_RUN_ID" not in env:
        raise ValueError(
            f"RANK={env['RANK']} and WORLD_SIZE={env.get('WORLD_SIZE', '(unset)')} in the environment "
            f"make this process the only rank, so --nproc {cfg.nproc} would start no process and run "
            f"every device here; unset them (env -u RANK -u WORLD_SIZE shardflow train ...) to start "
            f"{cfg.nproc} processes, or pass --nproc 1 to run in this one"
        )
    check_device(cfg.device, local_processes(env, cfg.nproc))
    if cfg.trace and world == 1 and cfg.nproc == 1:
        raise ValueError(
            f"--trace {cfg.trace}: the timeline is of the ranks' processes (compute and "
            f"communication lanes), and --nproc 1 runs every rank in this one; pass --nproc 2 or more, "
            f"or drop --trace"
        )


def check_outputs(cfg: TrainConfig) -> None:
    """Raise CheckpointError unless the run directory, the directories of the metrics and trace files and the
    checkpoint directory can be written (each is created if missing), and neither file is a directory."""
    fix = "pass --run-dir with a directory you can write, or fix its permissions"
    check_writable(Path(cfg.run_dir), "run directory", fix)
    for flag, file, example in (("--metrics", cfg.metrics, "metrics.jsonl"), ("--trace", cfg.trace, "trace.json")):
        if file:
            f = Path(file)
            if f.is_dir():
                raise CheckpointError(f"{flag} {f} is a directory; pass a file name such as {f / example}")
            check_writable(
                f.parent, f"directory of {flag}", f"pass {flag} with a file in a directory you can write, or omit it"
            )
    check_writable(cfg.checkpoints)
