"""``shardflow train``: a GPT trained on text across local processes with a chosen strategy.

The parent process checks the configuration and the plan (errors before any process starts), then starts
``--nproc`` ranks with the launcher; under torchrun (RANK/WORLD_SIZE set) each process is one rank. One process
with ``--nproc 1`` runs every rank of the mesh itself (the local executor). Rank 0 prints a banner and one
line every ``--log-every`` steps; every rank logs to ``RUN_DIR/rank{r}.log``; rank 0 writes the metrics.

Checkpoints (:mod:`shardflow.train.checkpoint`): every ``--checkpoint-every`` steps and after the last one, into
``--checkpoint-dir``; ``--resume`` continues from the newest complete one — written under any strategy and mesh —
and reproduces the loss trajectory of an uninterrupted run. Ctrl-C / SIGTERM stop every rank; a save that was
cut short leaves only a ``.tmp`` directory, and the command exits with status 130 and one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from shardflow.capture import capture
from shardflow.graph.graph import ComputationGraph
from shardflow.lower import CostModel, LowerOptions, lower_step
from shardflow.lower.dynamic import OPTIMIZER_SLOTS
from shardflow.lower.report import bytes_rows
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG, build_pcg, evaluation
from shardflow.runtime import trace
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.strategy import make_plan, resolve
from shardflow.strategy.presets import default_mesh
from shardflow.train import checkpoint
from shardflow.train.config import TrainConfig
from shardflow.train.data import Corpus


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
        ``verify`` proves them)."""
        return lower_step(self.pcg if training else evaluation(self.pcg), self.optimizer.slots, ranks=ranks,
                          verify=verify, training=training,
                          options=self.lower_options, clip_norm=self.cfg.clip_norm or None)

    @property
    def optimizer(self) -> OptimizerConfig:
        c = self.cfg
        return OptimizerConfig(c.optimizer, c.lr, c.momentum if c.optimizer == "sgd" else 0.0, c.weight_decay)


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.seq_len, n_layer=cfg.layers, n_head=cfg.heads,
                     n_embd=cfg.embd, dropout=cfg.dropout)


def setup(cfg: TrainConfig, world: int) -> Setup:
    """Data, model (seeded), captured graph and the PCG of the strategy. Raises the planner's errors (PlanError,
    DegreeError, ...) and DataError — the parent calls this before starting any process."""
    if cfg.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every {cfg.checkpoint_every}: give a number of steps, or 0 to save only "
                         f"after the last step")
    mesh = Mesh.parse(cfg.mesh) if cfg.mesh else default_mesh(cfg.strategy, world if world > 1 else cfg.nproc)
    if world > 1 and mesh.size != world:
        raise ValueError(f"mesh {mesh} has {mesh.size} devices but {world} processes run; make --nproc (or "
                         f"torchrun's --nproc-per-node × nodes) equal {mesh.size}, or change --mesh")
    corpus = Corpus.load(cfg.data, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg, corpus.tokenizer.vocab_size))
    example = corpus.batch("train", 0, cfg.batch_size, cfg.seq_len, cfg.seed)
    graph = capture(model, example)
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, cfg.strategy), graph, mesh))
    return Setup(cfg, corpus, model, graph, pcg, mesh)


def _weights(model: torch.nn.Module, graph: ComputationGraph) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {w: params[w].detach().clone() for w in graph.weights}


def _entries(s: Setup) -> checkpoint.Entries:
    """What a checkpoint of this run holds: every weight and its optimizer state."""
    return checkpoint.model_entries(s.model, s.graph.weights, OPTIMIZER_SLOTS[s.optimizer.slots])


def _resume_point(s: Setup) -> checkpoint.Checkpoint:
    """The checkpoint ``--resume`` continues from, checked against this run (raises CheckpointError)."""
    return checkpoint.for_resume(s.cfg.checkpoints, s.model.config, s.corpus.tokenizer.chars, s.optimizer.slots,
                                 _entries(s), s.cfg.data)


_signalled: list[str] = []


def _interrupt(signum, _frame):
    _signalled.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(signal.Signals(signum).name)


# --- checks of the configuration and the outputs (before any process starts) ---------------------------------

# smallest value of each numeric setting (the others are free, or checked where they are used)
_MINIMUM = {"nproc": 1, "steps": 1, "batch_size": 1, "seq_len": 1, "layers": 0, "heads": 1, "embd": 1,
            "log_every": 1, "eval_every": 1, "eval_batches": 1, "clip_norm": 0, "bucket_mb": 0}
_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "None": (type(None),)}
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "str": "a string", "bool": "true or false",
               "list": "a list", "dict": "a table"}


def check_config(cfg: TrainConfig) -> None:
    """Raise ValueError (one paragraph: the setting, its value, the fix) for a setting of the wrong type (only a
    ``--config`` file can give one: flags are typed by the command line), outside its choices or its range."""
    for f in dataclasses.fields(cfg):
        v, flag, help_ = getattr(cfg, f.name), "--" + f.name.replace("_", "-"), f.metadata.get("help", "")
        names = [t.strip() for t in str(f.type).split("|")]
        if all(t in _TYPES for t in names):
            ok = any(isinstance(v, _TYPES[t]) and not (t in ("int", "float") and isinstance(v, bool)) for t in names)
            if not ok:
                want = " or ".join(_TYPE_WORDS[t] for t in names if t != "None")
                example = f" (e.g. {f.name} = {f.default!r})" if f.default is not None else ""
                got = _TYPE_WORDS.get(type(v).__name__, type(v).__name__)
                raise ValueError(f"setting {f.name} = {v!r} is {got}, but {f.name} takes {want} ({help_}); fix "
                                 f"it in the --config file{example}")
        choices = f.metadata.get("choices")
        if choices and v not in choices:
            raise ValueError(f"setting {f.name} = {v!r} is not one of {', '.join(choices)} ({help_}); fix it in the "
                             f"--config file")
        if f.name in _MINIMUM and v < _MINIMUM[f.name]:
            raise ValueError(f"{flag} {v} is out of range: give a value ≥ {_MINIMUM[f.name]}. {flag}: {help_}")
    if cfg.timeout <= 0:
        raise ValueError(f"--timeout {cfg.timeout}: give the seconds a rank may wait on one communication, > 0 "
                         f"(e.g. 120; tests use 5-30)")
    if not 0 <= cfg.dropout < 1:
        raise ValueError(f"--dropout {cfg.dropout}: give a probability in [0, 1)")
    if cfg.embd % cfg.heads:
        fits = [h for h in range(1, cfg.heads + 1) if cfg.embd % h == 0][-1]
        raise ValueError(f"--embd {cfg.embd} is not a multiple of --heads {cfg.heads} (every head gets --embd / "
                         f"--heads features); change one of them, e.g. --heads {fits}")


def check_outputs(cfg: TrainConfig) -> None:
    """Raise CheckpointError unless the run directory and the metrics file's directory can be written."""
    fix = "pass --run-dir with a directory you can write, or fix its permissions"
    checkpoint.check_writable(Path(cfg.run_dir), "run directory", fix)
    if cfg.metrics:
        m = Path(cfg.metrics)
        if m.is_dir():
            raise checkpoint.CheckpointError(f"--metrics {m} is a directory; pass a file name such as "
                                             f"{m / 'metrics.jsonl'}")
        checkpoint.check_writable(m.parent, "directory of --metrics",
                                  "pass --metrics with a file in a directory you can write, or omit it")


class RendezvousError(ValueError):
    """This process could not join the process group its environment (torchrun's variables) describes."""


def _join(timeout_s: float) -> tuple[int, int]:
    """init_from_env, with torch's rendezvous failures turned into one paragraph that says how to fix them."""
    import tempfile

    from shardflow.runtime.distributed import init_from_env
    # torch logs each failed connection attempt on fd 2 with a C++ backtrace: hold that back; replay it on success
    sys.stderr.flush()
    saved, held = os.dup(2), tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)
    failure = None
    try:
        joined = init_from_env(timeout_s)
    except (RuntimeError, ValueError) as e:  # torch's DistNetworkError / DistStoreError, a missing variable
        failure = e
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        logged = held.read().decode(errors="replace")
        held.close()
    if failure is None:
        sys.stderr.write(logged)
        return joined
    env = os.environ
    where = f"{env.get('MASTER_ADDR', '(MASTER_ADDR unset)')}:{env.get('MASTER_PORT', '(MASTER_PORT unset)')}"
    text = str(failure).strip()
    first = text.splitlines()[0] if text else ""
    if "address already in use" in text.lower():
        fix = (f"port {env.get('MASTER_PORT')} is already in use on this machine: choose a free MASTER_PORT "
               f"(torchrun --master-port), use torchrun --standalone, or let shardflow train --nproc N start the "
               f"ranks (it picks a free port)")
    elif "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        fix = "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun does), or run shardflow train --nproc N"
    else:
        fix = (f"nothing let it in at {where} within --timeout {timeout_s:g} s: start rank 0 (it hosts the "
               f"rendezvous), give every rank the same MASTER_ADDR and MASTER_PORT, make that port reachable from "
               f"this machine, or raise --timeout")
    raise RendezvousError(f"rank {env.get('RANK', '?')} of {env.get('WORLD_SIZE', '?')} could not join the process "
                          f"group at {where} ({type(failure).__name__}: {first}); {fix}") from None


# --- fault injection: a test hook -----------------------------------------------------------------------------

FAULT_ENV = "SHARDFLOW_FAULT"


class Fault:
    """A fault a rank injects into itself, so tests can break a real ``shardflow train`` run. A test hook, read
    from the environment variable ``SHARDFLOW_FAULT`` (here and nowhere else; unset in normal use):

    * ``kill:rank=R:step=N`` — rank R kills itself with SIGKILL in the middle of training step N (half-way
      through the step's torch operations, counted during step N-1; at the start of the step when N is 1);
    * ``stall:rank=R:step=N:seconds=S`` — rank R sleeps S seconds before step N, outside any communication;
    * ``kill_in_save:rank=R[:step=N]`` — rank R kills itself with SIGKILL while saving the checkpoint of step N
      (default: the first save), once its files are in ``step_N.tmp/`` and before the checkpoint is committed.

    Steps count from 1 over the whole run. Every fault prints one line to the rank's log before it strikes.
    """

    KINDS = {"kill": ("rank", "step"), "stall": ("rank", "step", "seconds"), "kill_in_save": ("rank",)}

    def __init__(self, text: str):
        kind, *parts = text.split(":")
        fields = dict(p.split("=", 1) for p in parts if "=" in p)
        need = self.KINDS.get(kind)
        bad = [p for p in parts if "=" not in p] + sorted(set(fields) - {"rank", "step", "seconds"})
        if need is None or bad or not set(need) <= set(fields):
            raise ValueError(f"{FAULT_ENV}={text!r}: write kill:rank=R:step=N, stall:rank=R:step=N:seconds=S or "
                             f"kill_in_save:rank=R[:step=N] (a test hook; unset it for normal runs)")
        try:
            self.kind, self.rank = kind, int(fields["rank"])
            self.step = int(fields["step"]) if "step" in fields else None
            self.seconds = float(fields.get("seconds", 0))
        except ValueError:
            raise ValueError(f"{FAULT_ENV}={text!r}: rank and step are whole numbers, seconds a number") from None
        if self.step is not None and self.step < 1:
            raise ValueError(f"{FAULT_ENV}={text!r}: steps count from 1")
        self.ops = _OpCounter()

    @classmethod
    def from_env(cls) -> Fault | None:
        text = os.environ.get(FAULT_ENV)
        return cls(text) if text else None

    def _strike(self, rank: int, what: str) -> None:
        print(f"fault injection ({FAULT_ENV}): rank {rank} {what}", flush=True)
        if what.startswith("kills"):
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def step_context(self, rank: int, step: int):
        """What rank ``rank`` runs training step ``step`` (1-based) under."""
        if rank != self.rank or self.kind == "kill_in_save":
            return contextlib.nullcontext()
        if self.kind == "stall" and step == self.step:
            self._strike(rank, f"stalls for {self.seconds:g} s before step {step}")
            time.sleep(self.seconds)
        if self.kind == "kill" and step == self.step - 1:
            return self.ops  # count the torch operations of one step
        if self.kind == "kill" and step == self.step:
            half = self.ops.calls // 2
            if half == 0:
                self._strike(rank, f"kills itself (SIGKILL) at the start of step {step}")
            self.ops.calls, self.ops.at = 0, half
            self.ops.then = lambda: self._strike(rank, f"kills itself (SIGKILL) in the middle of step {step} "
                                                       f"(torch operation {half})")
            return self.ops
        return contextlib.nullcontext()

    def save_hook(self, rank: int):
        """The checkpoint saver's ``on_written`` hook of rank ``rank`` (None: no fault in saves)."""
        if self.kind != "kill_in_save" or rank != self.rank:
            return None

        def hook(step: int) -> None:
            if self.step is None or step == self.step:
                self._strike(rank, f"kills itself (SIGKILL) while saving the checkpoint of step {step}")
        return hook


class _OpCounter(TorchFunctionMode):
    """Counts torch operations; calls ``then`` at operation number ``at``."""

    def __init__(self):
        super().__init__()
        self.calls, self.at, self.then = 0, None, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.at:
            self.then()
        return func(*args, **(kwargs or {}))


def _nothing_to_do(ck: checkpoint.Checkpoint, cfg: TrainConfig) -> bool:
    if ck.step < cfg.steps:
        return False
    print(f"shardflow train: {ck.path} is at step {ck.step}, --steps is {cfg.steps}: nothing to train; raise "
          f"--steps to continue", flush=True)
    return True


CLEAR = "\r\x1b[K"  # back to the start of the terminal line and clear it


class _Tee:
    """Writes to the terminal and to the rank's log file (rank 0 launched on a terminal)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text.replace(CLEAR, ""))
        return self.stream.write(text)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def isatty(self):
        return self.stream.isatty()


def run_rank(cfg: TrainConfig) -> int:
    """Train on this process: every rank of the mesh (one process) or this rank (launched / torchrun)."""
    tee = os.environ.get("SHARDFLOW_TEE")
    if tee:
        log = open(tee, "w", buffering=1)
        sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # the launcher forwards Ctrl-C as SIGTERM: stop like Ctrl-C
    if world == 1:
        return _train(cfg, 0, 1)
    from shardflow.runtime.distributed import shutdown
    s = setup(cfg, world)  # configuration, data and plan errors: one paragraph (exit 2), before joining the group
    rank, world = _join(cfg.timeout)
    try:
        code = _train(cfg, rank, world, s)
    except BaseException as e:  # report, then leave without gloo's teardown (peers fail on their timeouts)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one report: a second signal must not cut it short
        # a peer stopped by the same Ctrl-C can make this rank's communication fail first
        interrupted = isinstance(e, (KeyboardInterrupt, SystemExit)) or bool(_signalled)
        unfit = isinstance(e, checkpoint.CheckpointError)  # e.g. --resume under torchrun: one paragraph, status 2
        if interrupted:
            print(f"rank {rank}: interrupted", flush=True)
        elif unfit:
            print(f"shardflow train: error: rank {rank}: {e}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED if interrupted else 2 if unfit else 1)
    shutdown(code)


def _train(cfg: TrainConfig, rank: int, world: int, s: Setup | None = None) -> int:
    s = s or setup(cfg, world)
    run_dir = Path(cfg.run_dir)
    opt = s.optimizer
    ranks = [rank] if world > 1 else None
    train_step = s.lower(ranks, verify=world == 1)  # launched ranks: the parent proved the plan already
    eval_step = s.lower(ranks, verify=world == 1, training=False)
    if world > 1:
        from shardflow.runtime.distributed import DistributedExecutor
        ex = DistributedExecutor(train_step, opt, cfg.timeout, debug=cfg.debug, seed=cfg.seed)
        ev = DistributedExecutor(eval_step, opt, cfg.timeout, share=ex, debug=cfg.debug)
    else:
        from shardflow.runtime.local import LocalExecutor
        ex = LocalExecutor(train_step, opt, seed=cfg.seed)
        ev = LocalExecutor(eval_step, opt, share=ex)
    lead = rank == 0
    bar = lead and sys.__stdout__.isatty()
    check_outputs(cfg)
    checkpoint.check_writable(cfg.checkpoints)
    fault = Fault.from_env()
    start, resumed = 0, None
    if cfg.resume:
        resumed = _resume_point(s)
        if _nothing_to_do(resumed, cfg) if lead else resumed.step >= cfg.steps:
            return 0
        start = resumed.step
        t = resumed.load(_entries(s))  # full tensors on every rank; the executor keeps its pieces
        weights = {w: t[f"model/{w}"] for w in s.graph.weights}
        state = {k.removeprefix("optim/"): v for k, v in t.items() if k.startswith("optim/")}
        ex.load(weights, state, steps_done=start)
    else:
        weights, state = _weights(s.model, s.graph), None
        ex.load(weights)
    ref = _reference(s, weights, state, start) if cfg.check else None
    max_dloss = 0.0
    saver = checkpoint.Saver(cfg.checkpoints, rank, world, {
        "model": dataclasses.asdict(s.model.config), "chars": s.corpus.tokenizer.chars,
        "train": dataclasses.asdict(cfg), "mesh": str(s.mesh), "processes": world}, fresh=not cfg.resume)
    saver.on_written = fault.save_hook(rank) if fault else None

    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = _open_metrics(Path(cfg.metrics or run_dir / "metrics.jsonl"), start) if lead else None
    baseline = s.corpus.unigram_loss()
    if lead:
        _banner(s, train_step, baseline)
        if resumed is not None:
            print(f"resumed from {resumed.path} (step {start}; written under {resumed.train.get('strategy')} "
                  f"on mesh {resumed.mesh})", flush=True)

    def val_loss() -> float:
        return sum(ev.step(s.corpus.batch("val", i, cfg.batch_size, cfg.seq_len, cfg.seed))
                   for i in range(cfg.eval_batches)) / cfg.eval_batches

    tokens = cfg.batch_size * cfg.seq_len
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        batch = s.corpus.batch("train", step, cfg.batch_size, cfg.seq_len, cfg.seed)
        tracing = cfg.trace and world > 1 and step == min(start + 1, cfg.steps - 1)  # step 2: past warm-up
        if tracing:
            ex.tracer = trace.Tracer(rank)
        with fault.step_context(rank, step + 1) if fault else contextlib.nullcontext():
            loss = ex.step(batch)
        dt = time.perf_counter() - t0
        if tracing:
            _write_trace(s, ex, rank, world)
        if ref is not None:
            max_dloss = max(max_dloss, abs(loss - ref.step(batch)))
        record = {"step": step + 1, "loss": loss, "tokens_per_s": tokens / dt, "step_s": dt}
        last = step + 1 == cfg.steps
        if (step + 1) % cfg.eval_every == 0 or last:
            record["val_loss"] = val_loss()
        if lead:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if (step + 1) % cfg.log_every == 0 or last or "val_loss" in record:
                val = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
                print(f"{CLEAR if bar else ''}step {step + 1:>5}/{cfg.steps}  loss {loss:.4f}{val}  "
                      f"{tokens / dt:,.0f} tok/s  {dt * 1000:.0f} ms/step", flush=True)
            elif bar:  # on a terminal: a progress bar between the plain lines
                done = (step + 1) * 30 // cfg.steps
                sys.__stdout__.write(f"{CLEAR}[{'#' * done}{'.' * (30 - done)}] step {step + 1}/{cfg.steps}  "
                                     f"loss {loss:.4f}  {tokens / dt:,.0f} tok/s")
                sys.__stdout__.flush()
        if last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
            t0 = time.perf_counter()
            path, size = saver.save(ex, step + 1)  # collective: every rank takes part
            if lead:
                print(f"checkpoint {path} ({size / 2**20:.2f} MiB, {time.perf_counter() - t0:.2f} s)", flush=True)
    if lead:
        final = record["val_loss"]
        verdict = "below" if final < baseline else "NOT below"
        print(f"done: validation loss {final:.4f} nats/char, {verdict} the unigram baseline {baseline:.4f}", flush=True)
        metrics.close()
    if ref is None:
        return 0
    max_dparam = ex.weight_error(ref.weights())  # every replica of every piece; collective: every rank takes part
    ok = max_dloss <= CHECK_TOL and max_dparam <= CHECK_TOL
    if lead:
        print(f"check against one device: max |Δloss| {max_dloss:.2e}, max |Δparameter| {max_dparam:.2e} over "
              f"every replica (tolerance {CHECK_TOL:g}): {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


# float32 on both sides; the sharded run adds partial sums in another order, and AdamW's division by sqrt(v)
# amplifies those rounding differences over many steps (seen: ~1e-6 after 20 steps, ~1e-4 after 600).
CHECK_TOL = 5e-3


def _reference(s: Setup, weights, state, steps_done: int):
    """The same model, optimizer and dropout masks on one device (local executor, unsharded plan), for ``--check``."""
    from shardflow.runtime.local import LocalExecutor
    one = build_pcg(s.graph, Mesh(("d",), (1,)))
    ref = LocalExecutor(lower_step(one, s.optimizer.slots), s.optimizer, seed=s.cfg.seed)
    ref.load(weights, state, steps_done)
    return ref


def _open_metrics(path: Path, start: int):
    """The metrics file: new, or on resume the records up to ``start`` kept (a run that went on past its last
    checkpoint wrote records that the resumed run writes again) and appended to."""
    if start == 0 or not path.exists():
        return open(path, "w")
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= start:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when the run was stopped
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
    return open(path, "a")


def _write_trace(s: Setup, ex, rank: int, world: int) -> None:
    """Gather every rank's measured timeline to rank 0, which adds the cost model's and writes the file."""
    import torch.distributed as dist
    everyone: list = [None] * world
    dist.all_gather_object(everyone, ex.tracer.events)
    ex.tracer = None
    if rank == 0:
        measured = dict(enumerate(everyone))
        model = trace.predicted(s.lower().programs, measured, s.lower_options.cost)
        path = trace.write(s.cfg.trace, measured, model)
        print(f"wrote the timeline of step 2 to {path} (open it in https://ui.perfetto.dev)", flush=True)


def _banner(s: Setup, step, baseline: float) -> None:
    n_params = sum(p.numel() for p in s.model.parameters())
    cfg = s.cfg
    print(f"shardflow train: {s.corpus.source}, {len(s.corpus.train):,} train / {len(s.corpus.val):,} val chars, "
          f"vocab {s.corpus.tokenizer.vocab_size}", flush=True)
    print(f"model: GPT {cfg.layers} layers, {cfg.heads} heads, width {cfg.embd}, context {cfg.seq_len}: "
          f"{n_params:,} parameters; optimizer {cfg.optimizer} lr {cfg.lr}", flush=True)
    print(f"strategy {cfg.strategy} on mesh {s.mesh} ({s.mesh.size} devices); batch {cfg.batch_size}×{cfg.seq_len}",
          flush=True)
    rows = bytes_rows(step.programs)
    per = {}
    for r, kind, axis, n, planned, _ in rows:
        if r == min(step.programs):
            per[f"{kind}/{axis or '-'}"] = (n, planned)
    comm = ", ".join(f"{k} ×{n} ({b / 2**20:.2f} MiB)" for k, (n, b) in per.items()) or "no communication"
    print(f"plan (rank {min(step.programs)}, per step): {comm}", flush=True)
    print(f"unigram baseline (validation): {baseline:.4f} nats/char", flush=True)


# exit status of a run stopped by Ctrl-C / SIGTERM (the shell's 128 + SIGINT)
INTERRUPTED = 130


def _stopped(cfg: TrainConfig, how: str) -> int:
    last = checkpoint.newest(cfg.checkpoints)
    where = f"newest complete checkpoint: {last} (continue with --resume)" if last else "no complete checkpoint"
    print(f"shardflow train: interrupted ({how}); every rank stopped; {where}", file=sys.stderr, flush=True)
    return INTERRUPTED


def main(cfg: TrainConfig) -> int:
    """Entry of ``shardflow train``: plan-check in this process, then launch ``--nproc`` ranks (or run here)."""
    try:
        return _main(cfg)
    except KeyboardInterrupt as e:  # Ctrl-C in this process (one process, or before the ranks start)
        return _stopped(cfg, str(e) or "SIGINT")


def _main(cfg: TrainConfig) -> int:
    run_dir = Path(cfg.run_dir)
    check_config(cfg)
    Fault.from_env()  # a malformed test hook fails here, before any process starts
    if "RANK" in os.environ or cfg.nproc == 1:
        return run_rank(cfg)
    s = setup(cfg, cfg.nproc)  # every configuration and planning error surfaces here, before any process starts
    s.lower(verify=True)  # prove every rank's program (and the evaluation's) before launch
    s.lower(verify=True, training=False)
    check_outputs(cfg)
    checkpoint.check_writable(cfg.checkpoints)
    if cfg.resume and _nothing_to_do(_resume_point(s), cfg):  # a missing, corrupt or unfit checkpoint: error here
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    from shardflow.runtime.launch import describe_failure, launch
    # The launcher forwards Ctrl-C / SIGTERM to the ranks from its own handler; a wakeup fd tells us one came.
    signals_r, signals_w = os.pipe()
    os.set_blocking(signals_r, False)
    os.set_blocking(signals_w, False)
    old_fd = signal.set_wakeup_fd(signals_w, warn_on_full_buffer=False) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        res = launch([sys.executable, "-m", "shardflow.cli", "train", *cfg.argv()], cfg.nproc, run_dir,
                     grace_s=cfg.timeout + 10)
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
        print(f"shardflow train: error: {describe_failure(res, run_dir)}", file=sys.stderr)
        return 1
    return 0
