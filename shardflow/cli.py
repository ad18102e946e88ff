"""``shardflow`` command line. ``shardflow plan`` prints the PCG and per-rank programs of a model under a strategy,
proven deadlock-free; no process starts. ``shardflow check`` trains a model under a strategy beside eager PyTorch on
one device and prints how far apart they are. ``shardflow train`` trains a Llama (or any ``--model``) on text across
local processes (checkpoints, ``--resume``); ``shardflow export`` writes a checkpoint as a Hugging Face model
directory; ``shardflow generate`` samples text from a run or such a directory.

``plan`` and ``check`` take the model ``train`` trains, sized by train's own flags (``--model-config``,
``--layers`` ... ``--mlp``, ``--vocab-size``, ``--seq-len``, ``--batch-size``), shardflow's own small test models
(``--model gpt`` or ``mlp``) or the user's: ``--model FILE.py:FACTORY`` or ``package.module:FACTORY``, a function
returning ``(module, batch)`` (:func:`shardflow.model_spec.load_model`). ``plan`` builds a Hugging Face model on the
meta device, as ``train`` does (no weight is allocated: a 70B-shaped Llama plans on a laptop); ``check`` computes
with real weights.

Errors a user can fix (bad mesh, strategy that does not fit the model, unsupported op, ...) end with one
paragraph on stderr and exit status 2, never a traceback from inside the library.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch

from shardflow import failure
from shardflow.api import (
    ExecutorKind,
    LowerOptions,
    ParallelPlan,
    Pipeline,
    auto_pipeline,
    machine_cost,
    mesh_options,
    parallelize,
    require_eager_comparable,
    summary,
)
from shardflow.capture import CaptureError, at_dtype, capture, wide_floats
from shardflow.graph.ops import OpError, dtype_name
from shardflow.lower.comm_lowering import lowering_summary
from shardflow.lower.dynamic import Optimizer, PassError
from shardflow.lower.passes import PASSES, pass_table
from shardflow.lower.program import programs_json
from shardflow.lower.report import bytes_table, pcg_dot
from shardflow.lower.schedule import ScheduleKind, schedule_of
from shardflow.lower.verify import PlanVerificationError
from shardflow.model_spec import load_model
from shardflow.models import GPT, MLP, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG, placements_text
from shardflow.parallel.shape import ShardingError
from shardflow.search import MARGIN, Outcome, explain, search_model, tokens_of
from shardflow.simulator import MachineSpec
from shardflow.simulator import resolve as resolve_machine
from shardflow.simulator.estimate import cost_model
from shardflow.simulator.machine import shipped
from shardflow.strategy import PlanError
from shardflow.strategy.presets import default_mesh, parse_strategy
from shardflow.train.config import RANGES, Range, TrainConfig, optimizer_config, step_options
from shardflow.train.data import DataError
from shardflow.train.family import (
    DEFAULT_SIZES,
    Feed,
    ModelError,
    buildable,
    check_model_size,
    hf_family,
    is_factory,
    is_model_type,
)

USER_ERRORS = (
    PlanError,
    ShardingError,
    OpError,
    CaptureError,
    PassError,
    PlanVerificationError,
    DataError,
    ValueError,
    FileNotFoundError,
)


# shardflow's own small test models (sized by the flags, with their own defaults below); every other built-in name
# is a Hugging Face model type, built as `shardflow train` builds it (llama by default, with train's defaults)
OWN_MODELS = ("gpt", "mlp")
_OWN_DEFAULTS = {"layers": 2, "heads": 4, "embd": 64, "vocab_size": 65, "seq_len": 64, "batch_size": 8}
_TRAIN = TrainConfig()
_TRAIN_DEFAULTS = {
    **dataclasses.asdict(DEFAULT_SIZES),
    "vocab_size": _TRAIN.vocab_size,
    "seq_len": _TRAIN.seq_len,
    "batch_size": _TRAIN.batch_size,
}

# The range of each numeric flag of plan, check and generate, by its name (train's are TrainConfig's:
# shardflow.train.config.RANGES); checked with the flags' other rules by check_flags before a command runs.
FLAG_RANGES = {
    "layers": Range(1),
    "heads": Range(1),
    "kv_heads": Range(1),
    "embd": Range(1),
    "mlp": Range(1),
    "vocab_size": Range(1),
    "seq_len": Range(1),
    "batch_size": Range(1),
    "nproc": Range(1),
    "rank": Range(0),
    "steps": Range(1),
    "tol": Range(0),
    "lr": RANGES["lr"],
    "timeout": RANGES["timeout"],
    "tokens": Range(0),
    "temperature": Range(0),
    "reps": Range(1),
    "seed": Range(0, 2**63, high_open=True),
    "accumulate": RANGES["accumulate"],
    "microbatches": RANGES["microbatches"],
    "stages_per_rank": RANGES["stages_per_rank"],
    "ac_blocks": RANGES["ac_blocks"],
    "momentum": RANGES["momentum"],
    "search_seconds": RANGES["search_seconds"],
}


MEMORY_FLAGS = (
    "reshard_after_forward",
    "regather_activations",
    "ac",
    "ac_blocks",
)  # how a step trades memory for work, as shardflow train has them
# what one optimizer step is, as shardflow train has them (plan shows it)
STEP_FLAGS = ("accumulate", "microbatches", "schedule", "stages_per_rank", "dtype", "cp_attention", "cp_layout")
# how an expert layer's tokens reach their experts under ep, as shardflow train has them (check takes them too)
EXPERT_FLAGS = ("ep_dispatch", "capacity_factor")
# how a step communicates, as shardflow train has them: "auto" forms follow the machine's cost model
COMM_FLAGS = ("all_gather", "reduce_scatter", "bucket_mb")


def add_memory_args(p: argparse.ArgumentParser, more: tuple[str, ...] = ()) -> None:
    """``--[no-]reshard-after-forward``, ``--regather-activations``, ``--ac`` and ``--ac-blocks``, and the flags ``more`` names, as ``shardflow
    train`` has them (TrainConfig's fields)."""
    for name in MEMORY_FLAGS + more:
        TrainConfig.add_argument(p, name, own_default=True)


def add_step_args(p: argparse.ArgumentParser) -> None:
    """``--accumulate``, ``--microbatches``, ``--schedule``, ``--stages-per-rank``, ``--dtype``, ``--cp-attention`` and
    ``--cp-layout``, and the forms of
    communication ``--all-gather``, ``--reduce-scatter``, ``--bucket-mb``, as ``shardflow train`` has them
    (TrainConfig's fields)."""
    for name in STEP_FLAGS + COMM_FLAGS + EXPERT_FLAGS:
        TrainConfig.add_argument(p, name, own_default=True)


def add_optimizer_args(p: argparse.ArgumentParser, optimizer: Any = dataclasses.MISSING) -> None:
    """``--optimizer`` and ``--momentum``, as ``shardflow train`` has them (TrainConfig's fields and defaults; the
    default ``optimizer`` where a command has another), read by the one mapping train uses
    (:func:`~shardflow.train.config.optimizer_config`)."""
    TrainConfig.add_argument(p, "optimizer", own_default=True, default=optimizer)
    TrainConfig.add_argument(p, "momentum", own_default=True)


def check_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :data:`MEMORY_FLAGS` and :data:`EXPERT_FLAGS` given to ``shardflow check``, as keyword arguments of
    ``LowerOptions.parse`` and ``parallelize``."""
    return {k: getattr(args, k) for k in MEMORY_FLAGS + EXPERT_FLAGS}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` and the flags that size it: ``shardflow train``'s, with its names and defaults (``--model-config``,
    ``--layers``, ``--heads``, ``--kv-heads``, ``--embd``, ``--mlp``, ``--vocab-size``, ``--seq-len``,
    ``--batch-size``); shardflow's own gpt and mlp have their own defaults."""
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        metavar="MODEL",
        help="the model `shardflow train` trains: llama (Hugging Face LlamaForCausalLM built from a config, "
        "nothing downloaded; the default, or --model-config's model_type), gpt2 or another Hugging Face "
        "causal-LM model type, with train's default sizes; shardflow's own small test models gpt and mlp; or "
        "your own: FILE.py:FACTORY or package.module:FACTORY, a function returning (module, batch) such "
        "that module(**batch) returns the loss",
    )
    TrainConfig.add_argument(g, "model_config")
    sizes = (
        f"{_TRAIN_DEFAULTS[k]} for llama and gpt2 as in `shardflow train`, {_OWN_DEFAULTS[k]} for gpt and mlp"
        for k in ("layers", "heads", "embd", "vocab_size", "seq_len", "batch_size")
    )
    g.add_argument("--layers", type=int, help=f"transformer blocks, or linear layers (mlp) (default {next(sizes)})")
    g.add_argument("--heads", type=int, help=f"attention heads (default {next(sizes)})")
    g.add_argument(
        "--kv-heads",
        type=int,
        help=f"key/value heads of grouped-query attention (llama; default {_TRAIN_DEFAULTS['kv_heads']})",
    )
    g.add_argument("--embd", type=int, help=f"embedding width C, or input width (mlp) (default {next(sizes)})")
    g.add_argument(
        "--mlp",
        type=int,
        help="MLP width, the config's intermediate_size, or hidden width (mlp) (default: as `shardflow train`, 8/3 "
        "of --embd rounded up to a multiple of 64 for llama, 4× --embd for gpt2; --model-config's own; 4× --embd "
        "for mlp)",
    )
    g.add_argument("--vocab", type=int, dest="vocab_size", help=argparse.SUPPRESS)  # --vocab-size's earlier name
    g.add_argument("--vocab-size", type=int, help=f"vocabulary size V, or classes (mlp) (default {next(sizes)})")
    g.add_argument("--seq-len", type=int, help=f"tokens per sequence T (default {next(sizes)})")
    g.add_argument("--batch-size", type=int, help=f"sequences, or rows (mlp), per step B (default {next(sizes)})")


def check_flags(args: argparse.Namespace) -> None:
    """Raise ValueError (one paragraph) for a flag of ``plan``, ``check``, ``export`` or ``generate`` that is out of
    its range (:data:`FLAG_RANGES`), an empty string, or flags that exclude each other (``--plan`` and
    ``--strategy``; ``--out`` without ``--format dot``)."""
    for dest, (name, help_) in args.flags.items():
        v = getattr(args, dest)
        if isinstance(v, str) and not v.strip():
            raise ValueError(f"{name} is empty; give a value ({help_})")
        if dest in FLAG_RANGES and v is not None:
            FLAG_RANGES[dest].check(name, v, help_)
    if getattr(args, "plan", None) and getattr(args, "strategy", None):
        raise ValueError(
            f"--plan {args.plan} and --strategy {args.strategy} both say how to split the model: the "
            f"plan places every tensor itself and the strategy would be ignored; drop one of them"
        )
    if getattr(args, "out", None) and getattr(args, "format", "dot") != "dot":
        raise ValueError(
            f"--out {args.out} is the file of --format dot, but --format is {args.format} (printed "
            f"on the console); add --format dot, or redirect the output: > {args.out}"
        )


def train_settings(args: argparse.Namespace) -> TrainConfig:
    """The model flags of ``plan`` or ``check`` (a Hugging Face model) as ``shardflow train`` reads the same flags:
    its config, whose defaults fill what was not given."""
    given = {k: getattr(args, k) for k in ("model", "model_config", *_TRAIN_DEFAULTS)}
    return TrainConfig(**{k: v for k, v in given.items() if v is not None})


def model_and_batch(args: argparse.Namespace, meta: bool = False) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model of ``--model`` and its example batch: a built-in one built with a random batch of the flags'
    shapes, or what the user's factory returns. A Hugging Face model is the one ``shardflow train`` builds from the
    same flags (:func:`~shardflow.train.recipe.build_model`): with ``meta`` as train builds it (its parameters on the
    meta device, nothing allocated; its buffers given their values by
    :func:`~shardflow.runtime.materialize.materialize`, seed 0), else with real weights (seed 0). Raises
    ModelSpecError, ModelError (sizes a model cannot take; ``--model-config`` or ``--mlp`` for a model that sizes
    itself)."""
    own = args.model in OWN_MODELS
    hf = args.model is None or (not own and not is_factory(args.model) and is_model_type(args.model))
    for flag, v in (("--model-config", args.model_config), ("--mlp", args.mlp if args.model != "mlp" else None)):
        if v is not None and (own or is_factory(args.model)):
            raise ModelError(
                f"{flag} {v}: sizes the Hugging Face models (llama, gpt2, ...); --model {args.model} sizes its "
                f"own model: drop {flag}"
            )
    if not (own or hf):
        return load_model(args.model)
    cfg = train_settings(args)
    size = {k: getattr(cfg, k) for k in _TRAIN_DEFAULTS}
    if own:
        size = {k: getattr(args, k) if getattr(args, k) is not None else _OWN_DEFAULTS.get(k) for k in size}
    if own and args.kv_heads is not None:
        raise ModelError(
            f"--kv-heads {args.kv_heads}: --model {args.model} has no grouped-query attention; drop "
            f"--kv-heads, or plan --model llama"
        )
    what = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in size.items() if v is not None)
    with buildable(what):
        if args.model == "gpt":
            check_model_size(lambda k: _gpt(size, k), size["layers"], what, max(args.nproc, 1))
        elif own:
            check_model_size(lambda k: _mlp(args, size, k), size["layers"], what, max(args.nproc, 1))
        return _model_and_batch(args, cfg, size, own, hf, meta)


def _gpt(size: dict[str, Any], layers: int) -> GPT:
    """``plan --model gpt``'s model with ``layers`` blocks."""
    return GPT(
        GPTConfig(
            vocab_size=size["vocab_size"],
            block_size=size["seq_len"],
            n_layer=layers,
            n_head=size["heads"],
            n_embd=size["embd"],
        )
    )


def _mlp(args: argparse.Namespace, size: dict[str, Any], layers: int) -> MLP:
    """``plan --model mlp``'s model with ``layers`` layers."""
    return MLP(d_in=size["embd"], hidden=args.mlp or 4 * size["embd"], d_out=size["vocab_size"], n_layers=layers)


def _model_and_batch(args: argparse.Namespace, cfg: TrainConfig, size: dict[str, Any], own: bool, hf: bool, meta: bool):
    gen = torch.Generator().manual_seed(1)
    shape = (size["batch_size"], size["seq_len"])
    idx, targets = (torch.randint(0, size["vocab_size"], shape, generator=gen) for _ in range(2))
    if hf:
        from shardflow.runtime.materialize import materialize
        from shardflow.train.recipe import build_model

        _, config, model = build_model(cfg, cfg.vocab_size, None)  # on the meta device
        if meta:
            materialize(model, cfg.seed)  # its buffers: rotary tables, ... (the graph folds them)
        else:
            torch.manual_seed(0)
            model = hf_family(config.model_type).build(config)
        return model, Feed.CAUSAL_LM.inputs(idx, targets)
    torch.manual_seed(0)
    if args.model == "gpt":
        return _gpt(size, size["layers"]), {"idx": idx, "targets": targets}
    model = _mlp(args, size, size["layers"])
    return model, {
        "x": torch.randn(size["batch_size"], size["embd"], generator=gen),
        "y": torch.randint(0, size["vocab_size"], (size["batch_size"],), generator=gen),
    }


def write_out(out: Path, text: str) -> None:
    """Write ``text`` to the file of ``--out``; raises ValueError (one paragraph: the path, why, the fix) where it
    cannot be written (a missing directory, a directory in the way, no permission, a read-only file system)."""
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; pass a file name such as {out / 'pcg.dot'}")
    if not out.parent.is_dir():
        why = "is a file" if out.parent.exists() else "does not exist"
        raise ValueError(f"--out {out}: {out.parent} {why}; pass --out with a file in an existing directory")
    try:
        out.write_text(text)
    except OSError as e:
        raise ValueError(
            f"cannot write --out {out} ({e.strerror or e}); pass --out with a file in a directory you can write"
        ) from None


def redistributions_json(pcg: PCG) -> list[dict]:
    """The PCG's redistributions: node, op, module, input, tensor, placements from and to, parallel ops, bytes per
    device (forward), reason."""
    return [
        {
            "node": r.node,
            "op": r.op.describe(),
            "module": r.scope,
            "input": r.index,
            "tensor": r.tensor,
            "from": placements_text(r.src, r.group),
            "to": placements_text(r.dst, r.group),
            "ops": [op.describe() for op in r.ops],
            "bytes": r.nbytes,
            "reason": r.reason,
        }
        for r in pcg.redistributions
    ]


def plan_model(args: argparse.Namespace, options: LowerOptions) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``--model``'s module and batch as ``shardflow train`` captures them: a Hugging Face model built on the meta
    device (no weight allocated), in the ``param_dtype`` of ``options``'s mixed precision (``--dtype bf16``:
    bfloat16)."""
    model, batch = model_and_batch(args, meta=True)
    if options.precision:
        model, batch, _ = at_dtype(model, batch, options.precision.param_dtype)
    return model, batch


def print_estimate(args: argparse.Namespace, pipeline: Pipeline, spec: MachineSpec, batch) -> int:
    """``shardflow plan --estimate``: the predicted step (:meth:`Pipeline.predict`) as text or JSON (keys of
    :meth:`~shardflow.simulator.estimate.Prediction.to_json`, with ``strategy``, ``mesh``, ``fits`` and
    ``device_memory_bytes``), the timeline to ``--trace``; 1 when a rank's peak exceeds the device memory."""
    pred = pipeline.predict(spec, tokens_of(batch), events=bool(args.trace))
    capacity = spec.device.memory_bytes
    fits = max(pred.peak_bytes) <= capacity
    if args.trace:
        pred.write_trace(Path(args.trace))
    if args.format == "json":
        doc = pred.to_json() | {
            "strategy": pipeline.plan.name,
            "mesh": str(pipeline.pcg.mesh),
            "fits": fits,
            "device_memory_bytes": capacity,
        }
        print(json.dumps(doc, indent=1))
    else:
        print(f"# {pipeline.plan.name} on mesh {pipeline.pcg.mesh}, machine {spec.name}: {spec.source}")
        print(pred.describe())
        if args.trace:
            print(f"# predicted timeline → {args.trace}")
    if not fits:
        worst = max(range(len(pred.peak_bytes)), key=pred.peak_bytes.__getitem__)
        print(
            f"shardflow plan: does not fit: rank {worst} peaks at {pred.peak_bytes[worst] / 2**30:.3g} GiB, the "
            f"{spec.name} device holds {capacity / 2**30:.3g} GiB; shard more (fsdp, tp, pp), recompute (--ac "
            f"block), or lower --batch-size",
            file=sys.stderr,
        )
        return 1
    return 0


def micro_step_comms(pipeline: Pipeline, rank: int) -> list[str]:
    """One line per distinct micro-step of an optimizer step (``--accumulate``): its communications on ``rank``,
    by pass and kind (only the last reduces the weights' gradients)."""
    lines = []
    for m in dict.fromkeys(pipeline.micro_steps):
        prog = pipeline.lower((rank,), micro=m).programs[rank]
        kinds = Counter(f"{c.task} {c.kind}" for c in prog.comms)
        lines.append(f"#   {m}: " + (", ".join(f"{k} ×{n}" for k, n in kinds.items()) or "none"))
    return lines


def schedule_json(dg, kind: ScheduleKind) -> dict[str, Any]:
    """The pipeline schedule of lowered step ``dg`` for ``shardflow plan --format json``: kind, stages,
    microbatches, the ideal bubble fraction and each stage's actions in order."""
    sched = schedule_of(dg, kind)
    return {
        "kind": str(sched.kind),
        "stages": sched.stages,
        "microbatches": sched.microbatches,
        "bubble": sched.bubble,
        "actions": [[str(a) for a in sched.actions(s)] for s in range(sched.stages)],
    }


def memory_bytes(text: str) -> int:
    """``--memory-budget``: bytes, written as a number (``80e9``) or with a unit (``64GiB``, ``500MB``)."""
    units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}
    t = text.strip().lower()
    unit = next((u for u in units if t.endswith(u)), "b")
    try:
        n = float(t.removesuffix(unit) if t.endswith(unit) else t) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no size in bytes; write e.g. 80e9 or 64GiB") from None
    if not math.isfinite(n) or n < 1:  # inf and nan; a fraction of a byte would be a budget of 0
        raise argparse.ArgumentTypeError(f"{text!r}: a memory budget is a finite size of 1 byte or more, e.g. 64GiB")
    return int(n)


def search_progress(every: float = 2.0) -> Callable[[Outcome], None]:
    """A ``--strategy auto`` progress line on stderr at most every ``every`` seconds: candidates tried and refused,
    and the best step found so far."""
    start = last = time.perf_counter()
    tried = refused = 0
    best = math.inf

    def show(o: Outcome) -> None:
        nonlocal last, tried, refused, best
        tried += o.prediction is not None
        refused += o.prediction is None
        if o.fits and o.prediction is not None:
            best = min(best, o.prediction.step_seconds)
        now = time.perf_counter()
        if now - last >= every:
            last = now
            found = f"best step so far {best * 1e3:.4g} ms" if best < math.inf else "nothing fits yet"
            print(
                f"# searching: {tried} predicted, {refused} refused, {found} ({now - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    return show


def cmd_plan_auto(args: argparse.Namespace) -> int:
    """``shardflow plan --strategy auto``: the search (:func:`~shardflow.search.search`) on ``--nproc`` devices of
    ``--machine``, printed as text or JSON; ``--save-plan`` writes the chosen plan."""
    if args.mesh or args.plan:
        raise ValueError(
            f"--strategy auto chooses the mesh and the plan itself: drop {'--mesh' if args.mesh else '--plan'}, and "
            f"give the number of devices with --nproc"
        )
    spec = resolve_machine(args.machine, processes=args.nproc)
    options = step_options(args, machine_cost("auto", args.nproc))  # each candidate's forms: the spec's cost model
    model, batch = plan_model(args, options)
    result = search_model(
        model,
        batch,
        args.nproc,
        options,
        optimizer_config(args),
        spec,
        args.memory_budget,
        search_progress(),
        time_limit=args.search_seconds,
        screen=not args.search_all,
    )
    if args.format == "json":
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(result.describe())
    if args.explain:
        print(explain(result, args.explain))
    if args.save_plan:
        chosen = result.best.candidate
        doc = result.pipeline.plan.to_json() | {"mesh": str(chosen.mesh), "flags": chosen.flags(args.save_plan)}
        write_out(Path(args.save_plan), json.dumps(doc, indent=1) + "\n")
        again = chosen.flags()[2:]  # without its --strategy or --plan
        print(f"# wrote {args.save_plan}; plan it again with: shardflow plan --plan {args.save_plan} {' '.join(again)}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.strategy == "auto":
        return cmd_plan_auto(args)
    strategy = None if args.plan else args.strategy or "tp"
    mesh = Mesh.parse(args.mesh) if args.mesh else default_mesh(strategy or "tp", args.nproc)
    spec = resolve_machine(args.machine, processes=mesh.size) if args.estimate else None
    # train's cost model (its calibration file's auto forms), or the predicted machine's
    cost = cost_model(spec, mesh) if spec and args.machine != "this" else machine_cost("auto", mesh.size)
    options = step_options(args, cost)
    model, batch = plan_model(args, options)
    if args.graph:
        print(capture(model, Pipeline.example(batch, options)).listing())
        return 0
    pipeline = Pipeline.capture(model, batch, mesh, options, optimizer_config(args), strategy, args.plan, args.strict)
    plan, pcg = pipeline.plan, pipeline.pcg
    micro = pipeline.micro_steps[-1]  # the micro-step that reduces the gradients and updates
    if args.passes or args.dump_after:
        records = pipeline.passes({args.dump_after: lambda g: print(g.listing())} if args.dump_after else None)
        if args.passes:
            print(pass_table(records))
        return 0
    if spec is not None:
        return print_estimate(args, pipeline, spec, batch)
    step = pipeline.lower(verify=True)  # proves the programs agree
    if args.rank is not None and args.rank not in step.programs:
        raise ValueError(
            f"--rank {args.rank}: mesh {mesh} has ranks 0..{mesh.size - 1}; pass one of them, or omit "
            f"--rank to show every rank"
        )
    ranks = [args.rank] if args.rank is not None else sorted(step.programs)
    programs = {r: step.programs[r] for r in ranks}
    comms = sum(len(p.comms) for p in step.programs.values())
    proof = (
        f"verified: {mesh.size} ranks, {len(lowering_summary(step.programs))} communication kinds, "
        f"{comms} communication endpoints; every send has its recv, every collective agrees on members, "
        f"shape and dtype, every pair of ranks shares one order, no deadlock"
    )
    if args.format == "json":
        doc = json.loads(programs_json(programs))
        doc.update(
            strategy=plan.name,
            mesh=str(mesh),
            summary=summary(pcg),
            micro_step=str(micro),
            dtype=args.dtype,
            verified=True,
            collectives=lowering_summary(step.programs),
            redistributions=redistributions_json(pcg),
            schedule=schedule_json(step.dg, options.schedule),
        )
        print(json.dumps(doc, indent=1))
        return 0
    if args.format == "dot":
        out = Path(args.out or "pcg.dot")
        write_out(out, pcg_dot(pcg))
        msg = f"wrote {out}"
        if shutil.which("dot"):
            svg = out.with_suffix(".svg")
            done = subprocess.run(
                ["dot", "-Tsvg", str(out), "-o", str(svg)], capture_output=True, text=True, timeout=120
            )
            msg += (
                f" and {svg}"
                if done.returncode == 0
                else f"; Graphviz could not write {svg} ({done.stderr.strip() or f'status {done.returncode}'})"
            )
        print(msg)
        return 0
    print(ParallelPlan(plan.name, pcg, step))
    print()
    if options.precision:
        print(
            f"# --dtype {args.dtype}: each weight held, reduced and updated in "
            f"{dtype_name(options.precision.reduce_dtype)} (the "
            f"master, fwd:W), cast to its graph's dtype at the start of the step (fwd:W@compute) for every reader"
        )
    if args.microbatches > 1:
        print("# " + schedule_of(step.dg, options.schedule).timeline().replace("\n", "\n# "))
        print()
    if args.accumulate > 1:
        print(
            f"# --accumulate {args.accumulate}: the programs below are those of the {micro} (it adds the "
            f"earlier micro-steps' gradient contributions to its own, reduces them and updates); communications of "
            f"rank {ranks[0]} per micro-step:"
        )
        print("\n".join(micro_step_comms(pipeline, ranks[0])))
        print()
    for r in ranks:
        print(programs[r].listing())
        print()
    print("# bytes sent per rank per step (bound: bandwidth-optimal)")
    print(bytes_table(programs))
    print(f"# {proof}")
    return 0


# Default --tol of shardflow check per --dtype. float64: a sharded step adds partial sums in another order than one
# device does, so the two runs agree to rounding (~1e-15 relative; seen: ≤ 2e-15 on the tiny Llama of
# examples/hf_llama.py under dp, tp, sp, dp×tp and pp, 3 SGD steps); 1e-9 leaves room for more steps of a bigger
# model and still catches any wrong scale, misplaced block or missed reduction (O(1) errors, O(lr) in the weights).
# float32: rounding is ~1e-7 relative per operation and grows over steps; 1e-4 (seen: ≤ 5e-7 on the same runs).
CHECK_TOL = {"float64": 1e-9, "float32": 1e-4}
DEVIATES = 1  # exit status of a check beyond its tolerance


def check_mesh(args: argparse.Namespace) -> tuple[Mesh, str | None]:
    """The mesh and strategy of a check: ``--mesh`` with ``--strategy`` (default: the one the mesh's axes name), or
    the axis of ``--strategy`` (default tp) with one device per process (``--nproc``, torchrun's WORLD_SIZE), two
    when one process runs the mesh (``single``: one)."""
    if args.mesh:
        return Mesh.parse(args.mesh), args.strategy
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.strategy == "auto":  # the search's mesh, of this many devices (parallelize's strategy="auto")
        return Mesh(("d",), (world if world > 1 else max(args.nproc, 2),)), "auto"
    strategy = args.strategy or ("tp" if args.plan is None else None)
    one = not parse_strategy(strategy or "tp")  # single: one device
    devices = world if world > 1 else args.nproc if args.nproc > 1 or one else 2
    return default_mesh(strategy or "tp", devices), strategy


@dataclasses.dataclass(frozen=True)
class CheckModel:
    """What a check compares: ``model`` and ``batch`` in ``dtype`` (``--dtype``, or float32 where the model has a
    kernel with no float64), what :func:`~shardflow.capture.at_dtype` converted (``widened``: name → (old, new)
    dtype) and, where the check fell back from float64, why (``fallback``: the eager forward's error)."""

    model: torch.nn.Module
    batch: dict[str, torch.Tensor]
    dtype: str
    widened: dict[str, tuple[str, str]]
    fallback: str = ""

    def describe(self) -> str:
        """One line: what was converted and, after a fallback, why the check runs in the model's own dtype."""
        if self.fallback:
            return (
                f"float64: the eager model fails in float64 ({self.fallback}): a kernel of it has no float64; "
                f"checking in the model's own {self.dtype} instead (tolerance {CHECK_TOL[self.dtype]:g})"
            )
        kinds = Counter(f"{a} → {b}" for a, b in self.widened.values())
        text = ", ".join(f"{n} tensor{'s' * (n != 1)} {k}" for k, n in kinds.items()) or "nothing"
        complex_ = [k for k, (a, _) in self.widened.items() if a.startswith("complex")]
        return (
            f"converted to {self.dtype}: {text}"
            + (f" ({', '.join(complex_)}: imaginary parts kept)" if complex_ else "")
            + ("; casts down and dtype= arguments inside the model stay float64" if self.dtype == "float64" else "")
        )


def check_model(args: argparse.Namespace) -> CheckModel:
    """``--model``'s module and batch at ``--dtype`` (floating parameters, buffers and batch tensors converted;
    complex ones to complex128 under float64). Under float64, one eager forward (no gradient) inside
    :func:`wide_floats` first: where it fails (a kernel without float64), the model is built again and checked in its
    own dtype, as built, and :meth:`CheckModel.describe` says so."""
    model, batch = model_and_batch(args)
    wide, wide_batch, changed = at_dtype(model, batch, getattr(torch, args.dtype))
    checked = CheckModel(wide, wide_batch, args.dtype, changed)
    if args.dtype != "float64":
        return checked
    try:
        with torch.no_grad(), wide_floats():
            checked.model(**checked.batch)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        own, own_batch = model_and_batch(args)  # as built: a factory seeds itself, built-in models are seeded
        dtypes = {p.dtype for p in own.parameters() if p.is_floating_point()}
        if len(dtypes) != 1 or dtypes == {torch.float64}:
            raise
        return CheckModel(own, own_batch, dtype_name(dtypes.pop()), {}, first)
    return checked


def precision(dtype: str) -> contextlib.AbstractContextManager:
    """float64: every float stays float64, also where the model casts down (:func:`wide_floats`)."""
    return wide_floats() if dtype == "float64" else contextlib.nullcontext()


def compare(args: argparse.Namespace, executor: ExecutorKind) -> int:
    """``--steps`` steps of the plan on ``executor`` and of eager PyTorch on one device, side by side; the lead
    process prints each step and the verdict. Returns 0 within ``--tol``, :data:`DEVIATES` beyond."""
    checked = check_model(args)
    model, batch = checked.model, checked.batch
    mesh, strategy = check_mesh(args)
    tol = CHECK_TOL[checked.dtype] if args.tol is None else args.tol
    with precision(checked.dtype):
        trainer = parallelize(
            model,
            batch,
            mesh=mesh,
            strategy=strategy,
            plan=args.plan,
            optimizer=optimizer_config(args),
            strict=args.strict,
            executor=executor,
            timeout_s=args.timeout,
            **check_options(args),
        )
        steps = trainer.compare_with_eager(model, batch, args.steps)  # refuses a model with dropout, before a step
        first = {k: p.detach().clone() for k, p in model.named_parameters()}  # to tell the sides apart on a failure
        say = print if trainer.lead else (lambda *_, **__: None)
        n_params = sum(p.numel() for p in model.parameters())
        say(
            f"shardflow check: {type(model).__name__}, {n_params:,} parameters, {checked.dtype}; "
            f"batch " + ", ".join(f"{k} {dtype_name(v.dtype)}{list(v.shape)}" for k, v in batch.items())
        )
        say(checked.describe())
        say(f"strategy {trainer.plan.name}: {summary(trainer.plan.pcg)}")
        say(
            f"against eager PyTorch on one device (torch.optim): {args.optimizer} lr {args.lr:g}"
            + (f" momentum {trainer.optimizer.momentum:g}" if trainer.optimizer.momentum else "")
            + f", {args.steps} "
            f"step{'s' * (args.steps != 1)} on the batch"
        )
        buffers = bool(trainer.graph.buffer_updates)  # batch norm's running statistics: compared too
        worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0, "buffer": 0.0}
        for d in steps:
            say(
                f"step {d.step}: loss {d.loss:.6f} (eager {d.eager_loss:.6f}), |Δloss| {d.dloss:.1e}, "
                f"|Δgrad| {d.grad:.1e}, |Δweight| {d.weight:.1e}" + (f", |Δbuffer| {d.buffer:.1e}" if buffers else ""),
                flush=True,
            )
            worst = {
                "loss": max(worst["loss"], d.dloss),
                "grad": max(worst["grad"], d.grad),
                "weight": max(worst["weight"], d.weight),
                "buffer": max(worst["buffer"], d.buffer),
            }
        ok = max(worst.values()) <= tol
        say(
            f"max |Δloss| {worst['loss']:.1e}, |Δgrad| {worst['grad']:.1e}, |Δweight| {worst['weight']:.1e}"
            + (f", |Δbuffer| {worst['buffer']:.1e}" if buffers else "")
            + f" over every replica (tolerance {tol:g}): "
            f"{'OK' if ok else 'FAILED'}",
            flush=True,
        )
        if not ok and trainer.lead:
            say(which_side(trainer, model, batch, first, tol), flush=True)
    return 0 if ok else DEVIATES


def which_side(
    trainer, model: torch.nn.Module, batch: dict[str, torch.Tensor], first: dict[str, torch.Tensor], tol: float
) -> str:
    """After a failed check: the captured graph on one device (shardflow's reference interpreter) against eager
    PyTorch at the first step's weights ``first`` (:meth:`~shardflow.api.Trainer.capture_error`), and on which side
    the mismatch therefore lies. ``model`` gets those weights back."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(first[k])
    dloss, dgrad = trainer.capture_error(model, batch)
    where = (
        "within the tolerance: capture computes what eager does, so the sharded run (or its update) is what differs"
        if max(dloss, dgrad) <= tol
        else "beyond the tolerance: the model as captured differs from eager PyTorch (capture, or the eager reference "
        "itself: a kernel that rounds differently), whatever the plan"
    )
    return (
        f"the captured graph on one device (shardflow's reference interpreter) against eager PyTorch at the "
        f"first step's weights: |Δloss| {dloss:.1e}, |Δgrad| {dgrad:.1e}, {where}"
    )


def cmd_check(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: give at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        check_rank(args)
    if args.nproc > 1:
        return launch_check(args)
    return compare(args, ExecutorKind.LOCAL)


def launch_check(args: argparse.Namespace) -> int:
    """Check the inputs and prove the plan here (errors exit 2 before any process starts), then run the check on
    ``--nproc`` gloo processes, rank 0's output on the console. Returns its verdict; when the ranks failed, 2 if
    every one of them refused its input (e.g. the factory built other weights on each), else 1 — described with the
    end of the failed rank's log, which is kept."""
    from shardflow.runtime.launch import describe_failure, launch
    from shardflow.train import hooks

    checked = check_model(args)
    mesh, strategy = check_mesh(args)
    if mesh.size != args.nproc:
        raise ValueError(
            f"mesh {mesh} has {mesh.size} devices but --nproc {args.nproc} starts {args.nproc} "
            f"processes; make --nproc {mesh.size}, or change --mesh"
        )
    options = mesh_options(mesh, **check_options(args))  # what each rank's parallelize parses
    with precision(checked.dtype):
        if strategy == "auto":
            pipeline = auto_pipeline(
                checked.model, checked.batch, mesh.size, options, optimizer_config(args), "auto", None, args.plan, None
            )
        else:
            pipeline = Pipeline.capture(
                checked.model,
                checked.batch,
                mesh,
                options,
                optimizer_config(args),
                strategy,
                args.plan,
                args.strict,
            )
    require_eager_comparable(pipeline.graph)
    pipeline.lower(verify=True)  # every rank's program, proven to agree
    run_dir = Path(tempfile.mkdtemp(prefix="shardflow-check-"))
    # a forked rank runs check_rank as a new one would (docs/execution.md#forked-ranks), without the imports
    entry: list[Callable[[], int]] = [functools.partial(check_rank, args)]
    res = launch(
        [*hooks.installed().command, *args.argv], args.nproc, run_dir, grace_s=args.timeout + 10, rank_main=entry
    )
    codes = set(res.returncodes)
    if res.ok or codes == {DEVIATES}:  # rank 0 printed the verdict
        shutil.rmtree(run_dir, ignore_errors=True)
        return 0 if res.ok else DEVIATES
    print(f"shardflow check: error: {describe_failure(res, run_dir)}", file=sys.stderr)
    return 2 if codes == {2} else 1  # every rank refused the same input (one paragraph each), or a rank failed


def check_rank(args: argparse.Namespace) -> NoReturn:
    """One rank of a check (launched by ``--nproc`` or torchrun): the distributed executor; leaves the process
    group in order and exits with the verdict, or 2 after a user error (one paragraph), 1 after a traceback."""
    from shardflow.runtime.distributed import shutdown

    try:
        code = compare(args, ExecutorKind.DISTRIBUTED)
    except USER_ERRORS as e:
        print(f"shardflow check: error: rank {os.environ.get('RANK')}: {e}", file=sys.stderr, flush=True)
        os._exit(2)  # without gloo's teardown (peers fail on their timeouts)
    except Exception as e:  # a full disk, a corrupt file (status 2) or a bug: one paragraph, its traceback in a file
        code, said = failure.describe(e, "check", [f"(rank {os.environ.get('RANK')})"])
        print(said, file=sys.stderr, flush=True)
        os._exit(code)
    except BaseException:  # Ctrl-C, SIGTERM: as before
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    shutdown(code)


def cmd_train(args: argparse.Namespace) -> int:
    from shardflow.train.command import main as train_main

    return train_main(TrainConfig.from_args(args))


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
CALIBRATION_SIZES = "64K,256K,1M,4M"  # ~5 s on 2 gloo ranks of 2 CPU cores


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--sizes`` of calibrate: comma-separated byte counts with an optional K, M or G (KiB, MiB, GiB), e.g.
    ``64K,1M``, sorted. Raises ValueError (one paragraph) for a size it cannot read, one below 4 bytes (one float32)
    or fewer than two distinct sizes (a line needs two points)."""
    sizes = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        num, unit = (part[:-1], part[-1].upper()) if part[-1].upper() in _UNITS else (part, "")
        if not num.isdigit() or int(num) * _UNITS[unit] < 4:
            raise ValueError(
                f"--sizes {text}: cannot read {part!r} as a message size of at least 4 bytes; write "
                f"byte counts with an optional K, M or G, such as {CALIBRATION_SIZES}"
            )
        sizes.add(int(num) * _UNITS[unit])
    if len(sizes) < 2:
        raise ValueError(
            f"--sizes {text}: fitting α and the bandwidth needs at least two distinct sizes; give two "
            f"or more, such as {CALIBRATION_SIZES}"
        )
    return tuple(sorted(sizes))


def calibrate_plan(args: argparse.Namespace) -> tuple[Mesh | None, tuple[int, ...], str, Path]:
    """Check calibrate's flags before any process starts: the mesh (its size must be ``--nproc``), the sizes, the
    backend (``auto``: NCCL where every rank gets a GPU, else gloo; ``nccl`` needs them) and the file to write
    (``--out``, default :func:`~shardflow.lower.calibration.calibration_path` of the backend), whose directory is
    created. Returns (mesh or None, sizes in bytes, backend, file). Raises ValueError (one paragraph) or what
    :func:`~shardflow.runtime.device.check_device` raises."""
    from shardflow.lower.calibration import calibration_path
    from shardflow.runtime.device import backend_for, check_device, device_type

    mesh = Mesh.parse(args.mesh) if args.mesh else None
    if mesh is not None and mesh.size != args.nproc:
        raise ValueError(
            f"mesh {mesh} has {mesh.size} devices but --nproc {args.nproc} starts {args.nproc} "
            f"processes; make --nproc {mesh.size}, or change --mesh"
        )
    sizes = parse_sizes(args.sizes)
    choice = {"auto": "auto", "gloo": "cpu", "nccl": "cuda"}[args.backend]
    check_device(choice, args.nproc)
    backend = backend_for(device_type(choice, args.nproc))
    out = Path(args.out) if args.out else calibration_path(backend)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; pass a file name such as {out / f'calibration-{backend}.json'}")
    if args.out and not out.parent.is_dir():
        raise ValueError(f"--out {out}: {out.parent} does not exist; pass --out with a file in an existing directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    return mesh, sizes, backend, out


def cmd_calibrate(args: argparse.Namespace) -> int:
    if "RANK" in os.environ:
        return calibrate_rank(args)
    from shardflow.runtime.launch import describe_failure, launch
    from shardflow.train import hooks

    mesh, sizes, backend, out = calibrate_plan(args)
    print(
        f"shardflow calibrate: {backend}, {args.nproc} process{'es' * (args.nproc > 1)}, "
        + (
            "the computation of one device (one process: no communication to time)"
            if args.nproc == 1
            else f"{'mesh ' + str(mesh) if mesh else 'every rank'}; sizes {', '.join(map(str, sizes))} bytes, "
            f"{args.reps} calls each"
        ),
        flush=True,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="shardflow-calibrate-"))
    entry: list[Callable[[], int]] = [functools.partial(calibrate_rank, args)]  # what a rank runs, where it is forked
    res = launch(
        [*hooks.installed().command, *args.argv], args.nproc, run_dir, grace_s=args.timeout + 10, rank_main=entry
    )
    if res.ok:
        shutil.rmtree(run_dir, ignore_errors=True)
        return 0
    print(f"shardflow calibrate: error: {describe_failure(res, run_dir)}", file=sys.stderr)
    return 2 if set(res.returncodes) == {2} else 1


def calibrate_rank(args: argparse.Namespace) -> NoReturn:
    """One rank of ``shardflow calibrate``: time, fit (rank 0 writes the file and prints the table), leave the
    process group and exit 0; 2 after a user error (one paragraph), 1 after a traceback."""
    from shardflow.runtime.calibrate import describe_compute, measure, table
    from shardflow.runtime.device import rank_device
    from shardflow.runtime.distributed import init_from_env, shutdown

    try:
        mesh, sizes, backend, out = calibrate_plan(args)
        rank, world = init_from_env(args.timeout, rank_device("cuda" if backend == "nccl" else "cpu"))
        say = print if rank == 0 else (lambda *_, **__: None)
        cal = measure(
            rank,
            world,
            mesh,
            sizes,
            args.reps,
            backend,
            torch.device(f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"),
            lambda line: say(line, flush=True),
            datetime.timedelta(seconds=args.timeout),
        )
        if cal is not None:
            out.write_text(cal.to_json())
            say(table(cal))
            if cal.compute is not None:
                say(describe_compute(cal.compute))
            say(
                f"wrote {out}"
                + (
                    ""
                    if args.out
                    else "; shardflow train and plan read it for the " + backend + " backend's cost model"
                )
            )
    except USER_ERRORS as e:
        print(f"shardflow calibrate: error: rank {os.environ.get('RANK')}: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except Exception as e:  # a full disk, a corrupt file (status 2) or a bug: one paragraph, its traceback in a file
        code, said = failure.describe(e, "calibrate", [f"(rank {os.environ.get('RANK')})"])
        print(said, file=sys.stderr, flush=True)
        os._exit(code)
    except BaseException:  # Ctrl-C, SIGTERM: as before
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    shutdown(0)


def cmd_export(args: argparse.Namespace) -> int:
    """``shardflow export RUN --out DIR``, holding ``.DIR.lock`` beside DIR while it writes: a second export into the
    same DIR at once is refused up front, naming the first (the lock file goes with the export)."""
    from shardflow.train.checkpoint import export
    from shardflow.train.checkpoint.store import CheckpointError
    from shardflow.train.rundir import exclusive

    target = Path(args.out)
    at = target.parent / f".{target.name}.lock"

    def refuse(who: str) -> CheckpointError:
        return CheckpointError(
            f"--out {target} is being written by another shardflow export ({who}; it holds {at}): wait for it to "
            f"end, or pass another --out"
        )

    try:
        fd: int | None = exclusive(at, refuse)
    except OSError:  # a directory that cannot be written: export names it
        fd = None
    try:
        out, ck = export(args.run, args.out)
    finally:
        if fd is not None:
            at.unlink(missing_ok=True)
            os.close(fd)
    print(
        f"wrote {out}: the Hugging Face model of {ck.path} (step {ck.step}) with its tokenizer; load it with "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r}) and AutoTokenizer.from_pretrained({str(out)!r})"
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from shardflow.train.generate import main as generate_main

    return generate_main(args.source, args.prompt, args.tokens, args.temperature, args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardflow",
        description="Plan, check and train a model across devices "
        "from a parallel computation graph: plan (no processes), check (against eager "
        "PyTorch), train, export (a Hugging Face directory) and generate.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the parallel computation graph of a model under a strategy (no processes)")
    add_model_args(p)
    p.add_argument(
        "--strategy",
        help="single, dp, fsdp, hsdp, tp, sp, pp, cp, ep or a combination such as dp,tp, or auto: the fastest preset that "
        "fits the memory budget on --nproc devices of --machine, chosen by the simulator (docs/search.md) (default "
        "tp, or none with --plan)",
    )
    p.add_argument(
        "--mesh",
        help="device mesh as axis=size pairs, e.g. dp=2,tp=2 (default: the strategy's axis with --nproc devices)",
    )
    p.add_argument("--nproc", type=int, default=2, help="devices when --mesh is not given (default 2)")
    p.add_argument("--plan", help="a user plan (JSON or TOML: per-module placements) instead of --strategy")
    p.add_argument("--graph", action="store_true", help="print the captured computation graph instead")
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse the strategy where a sharding rule refuses its inputs (the error names the parallel "
        "op to insert) instead of inserting the cheapest redistribution",
    )
    add_memory_args(p)
    add_step_args(p)
    p.add_argument(
        "--format",
        choices=("text", "json", "dot"),
        default="text",
        help="text: PCG + per-rank programs + bytes + proof; json: the same, machine-readable; "
        "dot: the PCG as Graphviz (SVG too when Graphviz is installed)",
    )
    p.add_argument("--rank", type=int, help="show only this rank's program")
    p.add_argument(
        "--passes",
        action="store_true",
        help="list the lowering passes in order with their time and the size of the graph each returned",
    )
    p.add_argument(
        "--dump-after",
        metavar="PASS",
        choices=[str(x.name) for x in PASSES],
        help="print the graph after this lowering pass (" + ", ".join(str(x.name) for x in PASSES) + ")",
    )
    p.add_argument("--out", help="file for --format dot (default pcg.dot)")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="predict one step instead of listing the programs: step time, tokens/s per device, MFU, each "
        "rank's peak memory and where the time goes, on --machine (docs/simulator.md); a plan whose peak "
        "does not fit the machine's device memory is refused (exit status 1)",
    )
    p.add_argument(
        "--machine",
        default="this",
        help="with --estimate: this (measured by `shardflow calibrate`), a shipped spec ("
        + ", ".join(shipped())
        + ") or a machine spec TOML file (default this)",
    )
    p.add_argument("--trace", help="with --estimate: write the predicted timeline here (Chrome trace, Perfetto)")
    p.add_argument(
        "--memory-budget",
        type=memory_bytes,
        help="with --strategy auto: bytes each device may hold at its peak, e.g. 80e9 or 64GiB (default: "
        f"{MARGIN} × the --machine's device memory)",
    )
    TrainConfig.add_argument(p, "search_seconds", own_default=True)
    TrainConfig.add_argument(p, "search_all", own_default=True)
    p.add_argument(
        "--explain",
        metavar="OP",
        help="with --strategy auto: for one op (a node of --graph, or a module path: its ops), under the chosen plan "
        "and each runner-up: its placements, predicted compute and communication, and the memory of its outputs",
    )
    p.add_argument(
        "--save-plan",
        help="with --strategy auto: write the chosen plan to this JSON file (a user plan: --plan FILE with the "
        "flags it prints plans it again exactly)",
    )
    add_optimizer_args(p)  # the update step carries the optimizer's state slots
    p.set_defaults(func=cmd_plan)
    c = sub.add_parser(
        "check",
        help="train a model under a strategy beside eager PyTorch on one device and print the "
        "largest differences of loss, gradients and weights over every replica",
    )
    add_model_args(c)
    c.add_argument(
        "--strategy",
        help="single, dp, fsdp, hsdp, tp, sp, pp, cp, ep or a combination such as dp,tp (default: "
        "the one the --mesh axes name; tp without --mesh)",
    )
    c.add_argument(
        "--mesh",
        help="device mesh as axis=size pairs, e.g. dp=2,tp=2 (default: the strategy's axis "
        "with --nproc devices, 2 when --nproc is 1)",
    )
    c.add_argument("--plan", help="a user plan (JSON or TOML: per-module placements) instead of --strategy")
    c.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes: 1 (default) runs every device of the mesh in this process (the local executor); "
        "N > 1 starts N gloo processes, one per device (under torchrun, WORLD_SIZE decides)",
    )
    c.add_argument("--steps", type=int, default=3, help="optimizer steps on the batch (default 3)")
    c.add_argument(
        "--dtype",
        choices=tuple(CHECK_TOL),
        default="float64",
        help="dtype of the model's floating parameters and the batch's floating tensors (default float64: "
        "every float stays float64, also where the model casts down)",
    )
    c.add_argument(
        "--tol",
        type=float,
        help="largest difference accepted, in the model's units (default: "
        + ", ".join(f"{t:g} at {d}" for d, t in CHECK_TOL.items())
        + "); beyond it the exit status is 1",
    )
    # On both sides: torch.optim.SGD, Adam or AdamW with the same settings. SGD by default, not train's AdamW: Adam's
    # first steps move each weight by about lr·g/(|g| + eps), which turns the rounding of a gradient near zero into
    # up to lr/eps times as large a weight difference (float32's tolerance fails on the Llama of docs/own-model.md).
    add_optimizer_args(c, optimizer=str(Optimizer.SGD))
    c.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    c.add_argument(
        "--strict",
        action="store_true",
        help="refuse the strategy where a sharding rule refuses its inputs instead of redistributing them",
    )
    add_memory_args(c, EXPERT_FLAGS)
    c.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="--nproc: seconds any rank may wait on one communication (default 120)",
    )
    c.set_defaults(func=cmd_check)
    t = sub.add_parser("train", help="train a Llama (or --model) on text across local processes with a chosen strategy")
    TrainConfig.add_arguments(t)
    t.set_defaults(func=cmd_train)
    cal = sub.add_parser(
        "calibrate",
        help="time each kind of communication on this machine and write the cost "
        "model's α and bandwidths, which train and plan then use",
    )
    cal.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="processes to start, one per device (default 2; 1 times the computation of one device alone)",
    )
    cal.add_argument(
        "--mesh",
        help="device mesh as axis=size pairs, e.g. dp=2,tp=2: each axis's groups are timed "
        "(default: every rank as one group)",
    )
    cal.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto (default): nccl where every process gets a GPU, else gloo",
    )
    cal.add_argument(
        "--sizes",
        default=CALIBRATION_SIZES,
        help=f"message sizes, the piece one rank holds, in bytes with K, M or G (default {CALIBRATION_SIZES})",
    )
    cal.add_argument("--reps", type=int, default=5, help="timed calls per kind and size, their median kept (default 5)")
    cal.add_argument(
        "--out",
        help="the file to write (default calibration-BACKEND.json in $SHARDFLOW_CALIBRATION_DIR, "
        "else $XDG_CACHE_HOME/shardflow or ~/.cache/shardflow: where train and plan read it)",
    )
    cal.add_argument(
        "--timeout", type=float, default=60.0, help="seconds any rank may wait on one communication (default 60)"
    )
    cal.set_defaults(func=cmd_calibrate)
    ck_help = (
        "a checkpoint (RUN_DIR/checkpoints/step_N), a checkpoint directory or a run directory (its newest "
        "complete checkpoint)"
    )
    e = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face model directory (config, safetensors weights, tokenizer)"
    )
    e.add_argument("run", metavar="RUN", help=ck_help)
    e.add_argument("--out", required=True, help="the directory to write (new: nothing is overwritten)")
    e.set_defaults(func=cmd_export)
    g = sub.add_parser(
        "generate", help="sample text from a run of shardflow train or a Hugging Face model directory (one process)"
    )
    g.add_argument("source", metavar="RUN", help=f"{ck_help}, or a Hugging Face model directory (shardflow export's)")
    g.add_argument("--prompt", required=True, help="text to continue (encoded with the run's tokenizer)")
    g.add_argument("--tokens", type=int, default=200, help="tokens to sample (default 200)")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default 1.0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    g.set_defaults(func=cmd_generate)
    for command in (p, c, e, g, cal):  # what check_flags reads: each flag's name and help, by its destination
        command.set_defaults(
            flags={
                a.dest: (a.option_strings[-1] if a.option_strings else a.metavar, a.help)
                for a in command._actions
                if a.dest != "help"
            }
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # check --nproc starts its ranks with the same arguments
    failure.set_run_dir(None)  # a command that has a run directory names it once claimed
    try:
        if args.command != "train":  # train's settings are checked by TrainConfig, in one place with its config file
            check_flags(args)
        return args.func(args)
    except BrokenPipeError:  # the reader of the output left (`shardflow plan | head`): stop quietly, as a pipe's
        # writers do; later writes (the interpreter's flush at exit) go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as e:  # nothing reaches the user as a traceback (KeyboardInterrupt and SystemExit pass)
        if isinstance(e, USER_ERRORS) and failure.known(e, chain=False) is None:
            print(f"shardflow {args.command}: error: {e}", file=sys.stderr)
            return 2
        code, said = failure.describe(e, args.command, argv)
        print(said, file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
