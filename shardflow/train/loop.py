"""The training loop of ``shardflow train`` on this process: every rank of the mesh (one process, the local
executor) or this one rank (launched, or under torchrun: the distributed executor).

Each step: the batch of (seed, step), one lowered training step, the metrics record (rank 0 writes it:
:mod:`shardflow.train.metrics`), a validation every ``--eval-every`` steps and at the end, a checkpoint every
``--checkpoint-every`` steps and after the last one (:mod:`shardflow.train.checkpoint`). ``--resume`` continues
from the newest complete checkpoint — written under any strategy and mesh — and reproduces the loss trajectory of
an uninterrupted run. ``--trace`` writes the timeline
of step 2; ``--check`` runs the same steps on one device alongside (:mod:`shardflow.train.check`).

A loss that is NaN or inf stops the run at that step on every rank (the loss is the same on every rank after a
step), and a save whose state holds NaN or inf is refused: :class:`Diverged`, one paragraph; the last complete
checkpoint stays the newest.
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path

import torch

from shardflow.graph.flops import training_flops
from shardflow.lower.schedule import schedule_of
from shardflow.pipeline import machine_spec
from shardflow.runtime import trace
from shardflow.runtime.accumulate import MicroSteps
from shardflow.runtime.device import rank_device
from shardflow.simulator.estimate import Prediction, chrome_events
from shardflow.simulator.replay import replay
from shardflow.train import checkpoint, hooks
from shardflow.train.check import Check
from shardflow.train.config import TrainConfig, check_outputs
from shardflow.train.console import Console
from shardflow.train.data import Split
from shardflow.train.memory import processes_here
from shardflow.train.metrics import TENSORBOARD_DIR, Meter, MetricsWriter, Peak
from shardflow.train.recipe import Setup, check_memory, setup
from shardflow.train.rundir import metrics_path


class Diverged(ValueError):
    """Training diverged: the loss, or the state a save would write, holds NaN or inf. Nothing non-finite was saved;
    the message names the step, what was not finite, the likely cause and the last complete checkpoint."""


def diverged(cfg: TrainConfig, step: int, what: str, newest: Path | None) -> Diverged:
    """The :class:`Diverged` of ``what`` (e.g. ``the loss is nan``) at ``step``; ``newest``: the newest complete
    checkpoint of the run (None: none)."""
    fix = (
        f"try a lower --lr (the gradients are already clipped to --clip-norm {cfg.clip_norm:g})"
        if cfg.clip_norm
        else "try --clip-norm 1.0 or a lower --lr"
    )
    kept = (
        f"the last complete checkpoint, {newest}, is kept (continue from it with --resume --allow-changed-settings and a lower --lr)"
        if newest
        else "no checkpoint had been saved before it"
    )
    return Diverged(
        f"{what} at step {step}: training diverged, most likely because the learning rate is too high "
        f"(--lr {cfg.lr:g}); {fix}. Nothing of step {step} was saved; {kept}"
    )


def train(cfg: TrainConfig, rank: int, world: int, s: Setup | None = None) -> int:
    """Train rank ``rank`` of ``world`` processes (``world`` 1: every rank of the mesh here) from the config, or
    from its already built recipe ``s``. Returns the exit status (``--check`` beyond its tolerance: 1). Raises
    Diverged at a non-finite loss or state (on every rank at the same step)."""
    here = processes_here(os.environ, cfg.nproc)  # 0 in a launched rank: the parent checked its memory
    s = s or setup(cfg, world, here)
    run_dir = Path(cfg.run_dir)
    opt = s.optimizer
    ranks = (rank,) if world > 1 else None
    lowered = s.pipeline.lower_micro_steps(ranks, verify=world == 1)  # launched ranks: the parent proved the plans
    train_step = lowered[s.pipeline.micro_steps[-1]]  # the step that reduces the gradients and updates
    check_memory(s, train_step, world, here)
    eval_step = s.lower(ranks, verify=world == 1, training=False)
    device = rank_device(cfg.device)  # where the executors keep every buffer
    if world > 1:
        from shardflow.runtime.distributed import DistributedExecutor

        make = functools.partial(
            DistributedExecutor, optimizer=opt, timeout_s=cfg.timeout, debug=cfg.debug, device=device, seed=cfg.seed
        )
    else:
        from shardflow.runtime.local import LocalExecutor

        make = functools.partial(LocalExecutor, optimizer=opt, device=device, seed=cfg.seed)
    # the run's weights, state and gradients: read on ex; --accumulate: one step, N micro-steps
    ex, micro = s.pipeline.executors(lowered, make)
    ev = make(eval_step, share=ex)
    evaluate = MicroSteps([ev] * cfg.accumulate)
    lead = rank == 0
    console = Console(lead, cfg.steps, cfg.log_every)
    check_outputs(cfg)
    hook = hooks.installed()
    start, resumed, newest = 0, None, None  # newest: the run's newest complete checkpoint
    if cfg.resume:
        resumed = s.resume_point()
        if console.nothing_to_do(resumed):
            return 0
        start, newest = resumed.step, resumed.path
        resumed.restore(ex, world)  # collective: each rank reads only the pieces it holds
        weights, state = _full_state(s, resumed) if cfg.check else (None, None)
    else:
        weights, state = s.initial_weights(), None
        ex.load(weights)
    check = Check(s, weights, state, start, device) if cfg.check else None
    saver = checkpoint.Saver(
        cfg.checkpoints,
        rank,
        world,
        s.checkpoint_meta(world),
        fresh=not cfg.resume,
        files=s.checkpoint_files(),
        keep=cfg.keep_checkpoints,
    )
    saver.on_written = functools.partial(hook.saved, rank)

    run_dir.mkdir(parents=True, exist_ok=True)
    precision = s.pipeline.options.precision  # the dtype the model computes in: MFU's peak
    meter = Meter(
        cfg.batch_size * cfg.seq_len,
        s.mesh.size,
        training_flops(s.graph) * cfg.accumulate * cfg.microbatches,
        Peak.of(cfg.peak_tflops, device, precision.param_dtype if precision else torch.float32) if lead else None,
        device,
    )
    metrics_file = metrics_path(cfg)
    board = run_dir / TENSORBOARD_DIR if cfg.tensorboard else None
    metrics = MetricsWriter(metrics_file, start, board) if lead else None
    baseline = s.corpus.unigram_loss()
    console.banner(s, [lowered[m] for m in s.pipeline.micro_steps], baseline, device)
    prediction = predict_step(s, world) if lead else None
    console.predicted(prediction)
    console.metrics(meter, [metrics_file] + ([board] if board else []))
    if resumed is not None:
        console.resumed(resumed, start)
        if metrics is not None and (gap := metrics.gap()):
            console.say(gap)

    def val_loss() -> float:
        return sum(evaluate.step(s.batch(Split.VAL, i)) for i in range(s.eval_batches)) / s.eval_batches

    step_times: list[float] = []  # seconds of each step's computation and communication (its data apart)
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        batch = s.batch(Split.TRAIN, step)
        data_s = time.perf_counter() - t0
        tracing = cfg.trace and world > 1 and step == min(start + 1, cfg.steps - 1)  # step 2: past warm-up
        if tracing:
            ex.tracer = trace.Tracer(rank, device)
        with hook.step(rank, step + 1):
            loss = micro.step(batch)
        if not math.isfinite(loss):  # the same loss on every rank: every rank stops here
            raise diverged(cfg, step + 1, f"the loss is {loss}", newest)
        dt = time.perf_counter() - t0
        step_times.append(dt - data_s)
        if tracing:
            _write_trace(s, ex, rank, world)
        if check is not None:
            check.step(batch, loss)
        record = meter.record(step + 1, loss, dt, data_s, ex.grad_norm, opt.lr_at(step + 1))
        last = step + 1 == cfg.steps
        if (step + 1) % cfg.eval_every == 0 or last:
            record["val_loss"] = val_loss()
        if console.logs(record, last):
            record |= meter.memory(ex) | meter.expert_load(ex)  # collective: every rank takes part
        if lead:
            metrics.write(record)
        console.step(record, last)
        if last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
            t0 = time.perf_counter()
            try:
                path, size = saver.save(ex, step + 1)  # collective: every rank takes part
            except checkpoint.NonFiniteState as e:
                raise diverged(
                    cfg, step + 1, f"the weights or optimizer state hold NaN or inf ({e.names[0]})", newest
                ) from None
            newest = path
            console.saved(path, size, time.perf_counter() - t0)
    if lead:
        console.done(record["val_loss"], baseline)
        console.versus(prediction, step_times)
        metrics.close()
    return 0 if check is None else check.finish(ex, console)  # collective: every rank takes part


def predicted_beside(s: Setup, measured: dict[int, list[dict]]) -> list[dict]:
    """The trace's predicted lanes (pid 1000 + rank): the step's programs replayed on this machine's spec with
    each compute taking its measured time, on the measured step's clock."""
    computes = {r: [e["dur"] / 1e6 for e in evs if e["tid"] == trace.LANES["compute"]] for r, evs in measured.items()}
    start = min((e["ts"] for evs in measured.values() for e in evs), default=0.0) / 1e6
    timeline = replay(
        [s.lower().programs], machine_spec(s.cfg.device, len(measured))[0], events=True, measured=computes
    )
    return chrome_events(timeline.events, pid=1000, start=start)


def predict_step(s: Setup, world: int) -> tuple[Prediction | None, str]:
    """The simulator's prediction of one step of this run on this machine (``MachineSpec.this``: what ``shardflow
    calibrate`` measured, else the defaults — the note says which), or None where one process runs every rank of
    a mesh (the simulator predicts one process per rank); and a note for the banner."""
    if world != s.mesh.size:
        return None, f"one process runs all {s.mesh.size} ranks of the mesh: no prediction (it models one per rank)"
    spec, calibrated = machine_spec(s.cfg.device, world)
    note = spec.source if calibrated else "uncalibrated defaults: run `shardflow calibrate` for a measured machine"
    return s.pipeline.predict(spec, s.cfg.batch_size * s.cfg.seq_len), note


def _full_state(s: Setup, ck: checkpoint.Checkpoint) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The full weights (by graph name) and optimizer state (by value id) of checkpoint ``ck``: what ``--check``'s
    one-device reference starts from when the run resumes."""
    t = ck.load(s.checkpoint_entries())
    weights = {w: t[f"model/{w}"] for w in s.graph.weights}
    return weights, {k.removeprefix("optim/"): v for k, v in t.items() if k.startswith("optim/")}


def _write_trace(s: Setup, ex, rank: int, world: int) -> None:
    """Gather every rank's measured timeline to rank 0, which adds the cost model's and writes the file."""
    import torch.distributed as dist

    everyone: list = [None] * world
    dist.all_gather_object(everyone, ex.tracer.events)
    ex.tracer = None
    if rank == 0:
        measured = dict(enumerate(everyone))
        path = trace.write(s.cfg.trace, measured, predicted_beside(s, measured))
        print(f"wrote the timeline of step 2 to {path} (open it in https://ui.perfetto.dev)", flush=True)
        ideal = ""
        if s.cfg.microbatches > 1:
            sched = schedule_of(ex.dg, s.pipeline.options.schedule)
            ideal = f"; the schedule's bubble (p-1)/(m+p-1) = {sched.bubble:.1%}"
        print(
            "time blocked on other ranks in step 2 (waits and blocking communications): "
            + ", ".join(
                f"rank {r} {b * 1e3:.1f} of {span * 1e3:.1f} ms ({b / span if span else 0.0:.1%})"
                for r, (b, span) in trace.blocked(measured).items()
            )
            + ideal,
            flush=True,
        )
