"""``shardflow train``: a model (Llama by default) trained on text across local processes with a chosen strategy — the processes.

The parent process checks the configuration and the plan (errors before any process starts), claims the run
directory (:mod:`shardflow.train.rundir`: a new one per run, its lock, ``config.toml``), then starts ``--nproc``
ranks with the launcher; they inherit the lock. Under torchrun (RANK/WORLD_SIZE set) each process is one rank and
rank 0 claims the run directory. One process with ``--nproc 1`` runs every rank of the mesh itself (the local
executor). Each rank runs :func:`shardflow.train.loop.train`; every rank logs to ``RUN_DIR/rank{r}.log``.

Ctrl-C / SIGTERM stop every rank; a save that was cut short leaves only a ``.tmp`` directory, and the command exits
with status 130 and one line. A rank that fails reports one paragraph — a checkpoint that does not fit or a
non-finite loss (exit status 2), a communication another rank stopped answering or left (3 or 4,
:class:`~shardflow.runtime.launch.Status`), a full disk or corrupt file (2) — or a bug: a paragraph naming the file its traceback
went to (status 1, :mod:`shardflow.failure`), and leaves without gloo's teardown: its
peers fail on their timeouts or at once on the closed connection. From the statuses the launcher names the rank at
the root of the failure; when every rank ended with one paragraph, the command prints rank 0's and exits with
status 2.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from shardflow import failure as failures
from shardflow.runtime.device import rank_device
from shardflow.runtime.launch import LAUNCHED, describe_failure, launch, stop_with_launcher, tail
from shardflow.train import checkpoint, hooks
from shardflow.train.config import TrainConfig, check_config, check_outputs, check_processes
from shardflow.train.console import Console, tee_to_log
from shardflow.train.loop import Diverged, train
from shardflow.train.memory import MemoryFitError, processes_here
from shardflow.train.recipe import Setup, auto_strategy, check_memory, setup
from shardflow.train.rundir import RunDir, RunDirError

# exit status of a run stopped by Ctrl-C / SIGTERM (the shell's 128 + SIGINT)
INTERRUPTED = 130
ERROR = "shardflow train: error: "  # how every one-paragraph error of the command begins

_signalled: list[str] = []
# how long a rank whose peer left waits for a signal of its own before it reports the peer (seconds): the launcher
# sends SIGTERM to every rank at once, so one that lands later than a peer's exit lands within milliseconds
SIGNAL_GRACE_S = 0.5


def _interrupt(signum, _frame):
    _signalled.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(cfg: TrainConfig) -> int:
    """Entry of ``shardflow train``: plan-check in this process, then launch ``--nproc`` ranks (or run here);
    ``--strategy auto`` is resolved first (:func:`~shardflow.train.recipe.auto_strategy`), the ranks get its
    choice."""
    check_config(cfg)
    if cfg.strategy == "auto":
        world = int(os.environ.get("WORLD_SIZE", cfg.nproc))
        cfg, result = auto_strategy(cfg, world)
        if int(os.environ.get("RANK", "0")) == 0:
            print(result.describe(), flush=True)
    check_processes(cfg, os.environ)
    launched = os.environ.get(LAUNCHED) == "1"
    with RunDir(cfg, owner=not launched and int(os.environ.get("RANK", "0")) == 0) as run:
        try:
            return _main(run, launched)
        except KeyboardInterrupt as e:  # Ctrl-C in this process (one process, or before the ranks start)
            return _stopped(run.cfg, str(e) or "SIGINT")


def _main(run: RunDir, launched: bool) -> int:
    cfg = run.cfg
    if launched:  # a rank of shardflow's launcher: its parent proved the plan and owns the run directory
        failures.set_run_dir(run.path)
        return run_rank(cfg, run)
    torchrun = "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1")) if torchrun else cfg.nproc
    # every configuration, planning and memory error surfaces here, before any process starts
    s = setup(cfg, world, processes_here(os.environ, cfg.nproc))
    if not torchrun and world > 1:
        # prove every rank's programs (each kind of micro-step's, and the evaluation's) before launch
        step = s.pipeline.lower_micro_steps(verify=True)[s.pipeline.micro_steps[-1]]
        s.lower(verify=True, training=False)
        check_memory(s, step, world, processes_here(os.environ, cfg.nproc))
    if run.owner and (world == 1 or not torchrun):  # torchrun's rank 0 claims it once every rank has joined
        check_outputs(cfg)
        if not torchrun and cfg.resume and Console(True, cfg.steps, cfg.log_every).nothing_to_do(s.resume_point()):
            return 0  # a missing, corrupt or unfit checkpoint was an error just now
        run.claim()
    if torchrun or world == 1:
        return run_rank(cfg, run, s)
    # a rank forked from this process starts from ``s``; the launcher lets go of it once the ranks have started
    rank_main = [functools.partial(_forked_rank, run.cfg, run, s)]
    del s
    return _launch(cfg, run, rank_main)


def _forked_rank(cfg: TrainConfig, run: RunDir, s: Setup) -> int:
    """A rank forked from the launcher (:func:`~shardflow.runtime.launch.launch`): :func:`run_rank` from the
    launcher's recipe, which a rank started as a new process would build again, identically; ``run``: the launcher's
    run directory, which the rank sees as its other ranks do (it does not own it)."""
    failures.set_run_dir(run.path)
    return run_rank(cfg, RunDir(cfg, owner=False), s)


def _launch(cfg: TrainConfig, run: RunDir, rank_main: list) -> int:
    """Start ``--nproc`` ranks (each inherits the locks of the run directory and its named outputs) and wait for
    them; ``rank_main``: what a forked rank runs (:func:`~shardflow.runtime.launch.launch`)."""
    # The launcher forwards Ctrl-C / SIGTERM to the ranks from its own handler; a wakeup fd tells us one came.
    signals_r, signals_w = os.pipe()
    os.set_blocking(signals_r, False)
    os.set_blocking(signals_w, False)
    old_fd = (
        signal.set_wakeup_fd(signals_w, warn_on_full_buffer=False)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        res = launch(
            [*hooks.installed().command, "train", *cfg.argv()],
            cfg.nproc,
            run.path,
            grace_s=cfg.timeout + 10,
            keep_fds=run.fds,
            rank_main=rank_main,
        )
    finally:
        if old_fd is not None:
            signal.set_wakeup_fd(old_fd)
        try:
            got = os.read(signals_r, 256)
        except BlockingIOError:
            got = b""
        os.close(signals_r)
        os.close(signals_w)
    stop = [signal.Signals(b).name for b in got if b in (signal.SIGINT, signal.SIGTERM)]
    if not res.ok:
        if stop:
            return _stopped(cfg, stop[0])
        said = _every_rank_said(res.returncodes, run.path)
        if said is not None:  # e.g. the same non-finite loss on every rank: rank 0's paragraph is the command's
            if not res.direct:  # rank 0 wrote it to our stderr itself when it ran on the terminal
                print(said, file=sys.stderr)
            return 2
        print(f"{ERROR}{describe_failure(res, run.path)}", file=sys.stderr)
        return 1
    return 0


def _every_rank_said(codes: tuple[int, ...], run_dir: Path) -> str | None:
    """Rank 0's one-paragraph error when every rank ended with one (exit status 2), else None."""
    if set(codes) != {2}:
        return None
    said = [line for line in tail(run_dir / "rank0.log").splitlines() if line.startswith(ERROR)]
    return said[-1] if said else None


def _stopped(cfg: TrainConfig, how: str) -> int:
    last = checkpoint.newest(cfg.checkpoints) if cfg.run_dir or cfg.checkpoint_dir else None
    where = f"newest complete checkpoint: {last} (continue with --resume)" if last else "no complete checkpoint"
    print(f"shardflow train: interrupted ({how}); every rank stopped; {where}", file=sys.stderr, flush=True)
    return INTERRUPTED


def run_rank(cfg: TrainConfig, run: RunDir, s: Setup | None = None) -> int:
    """Train on this process: every rank of the mesh (one process) or this rank (launched / torchrun), from the
    recipe ``s`` when it is built already. ``run``: the run directory (torchrun's rank 0 claims it after joining)."""
    tee_to_log()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # the launcher forwards Ctrl-C as SIGTERM: stop like Ctrl-C
        stop_with_launcher()  # and sends none if it is killed: then the kernel does
    if world == 1:
        return train(cfg, 0, 1, s)
    from shardflow.runtime.distributed import CommFailure, CommTimeout, comm_failure, shutdown
    from shardflow.runtime.launch import Status

    # configuration, data, plan and memory errors: one paragraph (exit 2), before joining the group
    s = s or setup(cfg, world, processes_here(os.environ, cfg.nproc))
    rank, world = _join(cfg.timeout, rank_device(cfg.device))
    try:
        cfg = _claimed_by_rank0(cfg, run)
        code = train(cfg, rank, world, dataclasses.replace(s, cfg=cfg))
    except BaseException as e:  # report, then leave without gloo's teardown (peers fail on their timeouts)
        if threading.current_thread() is threading.main_thread():  # one report: a later signal is noted, not raised
            signal.signal(signal.SIGTERM, lambda signum, _: _signalled.append(signal.Signals(signum).name))
        # one paragraph, status 2: e.g. --resume under torchrun from an unfit checkpoint, a non-finite loss, a step
        # that does not fit in memory (checked once lowered)
        said = isinstance(e, (checkpoint.CheckpointError, RunDirError, Diverged, MemoryFitError))
        # another rank left or stopped answering (also where torch raised it, outside the executor): one paragraph
        failure = (
            e
            if isinstance(e, CommFailure)
            else comm_failure(e, f"rank {rank}")
            if isinstance(e, RuntimeError)
            else None
        )
        if failure is not None and not _signalled:
            # a peer stopped by the same Ctrl-C or SIGTERM (the launcher forwards it to every rank at once) can make
            # this rank's communication fail before its own signal lands: give it that moment
            time.sleep(SIGNAL_GRACE_S)
        interrupted = isinstance(e, (KeyboardInterrupt, SystemExit)) or bool(_signalled)
        if interrupted:
            print(f"rank {rank}: interrupted", flush=True)
        elif said:
            print(f"{ERROR}rank {rank}: {e}", file=sys.stderr, flush=True)
        elif failure is not None:
            print(f"{ERROR}{failure}", file=sys.stderr, flush=True)
        else:  # a full disk, a refused permission, a corrupt file (status 2) or a bug (its traceback in a file)
            bug, text = failures.describe(e, "train", [f"(rank {rank})"])
            said = bug == failures.USER
            print(text, file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(
            INTERRUPTED
            if interrupted
            else Status.REFUSED
            if said
            else Status.WAITED_OUT
            if isinstance(failure, CommTimeout)
            else Status.PEER_LOST
            if failure is not None
            else Status.FAILED
        )
    shutdown(code)


def _claimed_by_rank0(cfg: TrainConfig, run: RunDir) -> TrainConfig:
    """``cfg`` with rank 0's run directory (collective, once the ranks have joined). Under torchrun rank 0 claims it
    now (the name of a new one is known to it alone), and its refusal is every rank's: RunDirError everywhere."""
    import torch.distributed as dist

    refused = None
    if run.owner:  # torchrun's rank 0
        try:
            check_outputs(cfg)
            run.claim()
        except (checkpoint.CheckpointError, RunDirError) as e:
            refused = str(e)
    got = [cfg.run_dir, refused]
    dist.broadcast_object_list(got, src=0)
    if got[1] is not None:
        raise RunDirError(got[1])
    return dataclasses.replace(cfg, run_dir=got[0])


class RendezvousError(ValueError):
    """This process could not join the process group its environment (torchrun's variables) describes."""


def _join(timeout_s: float, device: torch.device) -> tuple[int, int]:
    """init_from_env with ``device``'s backend, saying every :func:`_progress_every` seconds that it still waits for
    the other processes, with torch's rendezvous failures turned into one paragraph that says how to fix them."""
    import tempfile

    from shardflow.runtime.distributed import init_from_env

    env = os.environ
    where = f"{env.get('MASTER_ADDR', '(MASTER_ADDR unset)')}:{env.get('MASTER_PORT', '(MASTER_PORT unset)')}"
    who = f"rank {env.get('RANK', '?')} of {env.get('WORLD_SIZE', '?')}"
    joined_event = threading.Event()

    def progress() -> None:
        t0, every = time.monotonic(), _progress_every(timeout_s)
        while not joined_event.wait(every):
            print(
                f"{who}: waiting for the other processes to join the process group at {where} "
                f"({time.monotonic() - t0:.0f} s; --timeout {timeout_s:g} s)",
                flush=True,
            )

    # torch logs each failed connection attempt on fd 2 with a C++ backtrace: hold that back; replay it on success
    sys.stderr.flush()
    saved, held = os.dup(2), tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)
    failure = None
    threading.Thread(target=progress, daemon=True).start()
    try:
        joined = init_from_env(timeout_s, device)
    except (RuntimeError, ValueError) as e:  # torch's DistNetworkError / DistStoreError, a missing variable
        failure = e
    finally:
        joined_event.set()
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        logged = held.read().decode(errors="replace")
        held.close()
    if failure is None:
        sys.stderr.write(logged)
        return joined
    text = str(failure).strip()
    first = text.splitlines()[0] if text else ""
    if "address already in use" in text.lower():
        fix = (
            f"port {env.get('MASTER_PORT')} is already in use on this machine: choose a free MASTER_PORT "
            f"(torchrun --master-port), use torchrun --standalone, or let shardflow train --nproc N start the "
            f"ranks (it picks a free port)"
        )
    elif "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        fix = "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun does), or run shardflow train --nproc N"
    elif "waiting for clients" in text or "wait timeout" in text:  # this rank got in; the others did not come
        fix = (
            f"it reached the rendezvous at {where}, but not every other rank joined within --timeout "
            f"{timeout_s:g} s: start all {env.get('WORLD_SIZE', '?')} processes (torchrun on every node with the "
            f"same --nnodes, --master-addr and --master-port), make that port reachable from the other machines, "
            f"or raise --timeout"
        )
    else:
        fix = (
            f"nothing let it in at {where} within --timeout {timeout_s:g} s: start rank 0 (it hosts the "
            f"rendezvous), give every rank the same MASTER_ADDR and MASTER_PORT, make that port reachable from "
            f"this machine, or raise --timeout"
        )
    raise RendezvousError(
        f"{who} could not join the process group at {where} ({type(failure).__name__}: {first}); {fix}"
    ) from None


def _progress_every(timeout_s: float) -> float:
    """Seconds between two lines of a rank that waits to join: a third of ``--timeout``, between 1 and 30 s."""
    return min(30.0, max(1.0, timeout_s / 3))
