"""The step simulator against measured steps on this machine (docs/simulator.md#validation-on-this-machine).

For each world size (2 and 4 gloo ranks):

1. ``shardflow calibrate --nproc N --backend gloo`` (the CLI itself, in a subprocess) writes the calibration file
   into a fresh ``SHARDFLOW_CALIBRATION_DIR``: the α–β of every communication kind and the compute section;
2. one session of N ranks (``shardflow.runtime.launch.launch``) builds every plan of that world size as
   ``shardflow train`` does (:class:`Builder`: the recipe's model and capture, the preset's plan, the options with the
   calibrated cost model choosing the ``auto`` forms), lowers its program, runs it on ``DistributedExecutor``s
   (``Pipeline.executors``: one per micro-step under ``--accumulate``) and times every plan in interleaved rounds
   (``harness.interleave``: a sample is the slowest rank's step); then each rank's peak of live buffers (executors
   built with ``memory=True`` on the same buffers, 2 steps) and :data:`TRACED` traced steps
   (``runtime.trace.Tracer``: every compute's and communication's measured time);
3. ``shardflow calibrate`` again, into another directory (how far the machine moved during the session);
4. this process builds the same pipelines with the first calibration, checks that every rank's program of every
   micro-step has the fingerprint of the program that ran (``programs_fingerprint``), and predicts each plan with
   ``Pipeline.predict(MachineSpec.this("gloo", processes=N), tokens, events=True)`` (and, the same programs, on
   the second calibration's ``this``).

The section "Simulator validation" of docs/benchmarks.md gets, per plan, the predicted and measured step time and
peak bytes, and per world size the mean absolute percentage error of the step time, Spearman's rank correlation,
the top-1 regret per model size (the measured time of the plan predicted fastest over the fastest measured) and the
worst memory error; then the per-op comparison of the median traced step against the replay's events, by kind of
instruction.

Usage::

    python benchmarks/simulator.py                # every plan (~10 minutes on 2 cores); updates docs/benchmarks.md
    python benchmarks/simulator.py --quick        # 6 plans, 3 rounds: a smoke test (prints; writes only with --out)
    python benchmarks/simulator.py --no-write     # print the section only
    python benchmarks/simulator.py --render-only  # rebuild the section from the last run's JSON (--run-dir)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from harness import Variant, interleave, machine, say, write_section  # noqa: E402

from shardflow.lower.calibration import ENV_DIR as CALIBRATION_DIR_ENV  # noqa: E402
from shardflow.lower.calibration import CalibrationWarning  # noqa: E402
from shardflow.lower.program import programs_fingerprint  # noqa: E402
from shardflow.parallel.mesh import Mesh  # noqa: E402
from shardflow.pipeline import Pipeline, machine_cost  # noqa: E402
from shardflow.simulator.machine import MachineSpecWarning  # noqa: E402
from shardflow.train.config import TrainConfig, optimizer_config, step_options  # noqa: E402
from shardflow.train.recipe import Setup, check_accumulation, setup  # noqa: E402

TIMEOUT_S = 300.0
TRACED = 3  # traced steps per plan; the per-op comparison takes the median one
SECTION = "## Simulator validation"
TARGETS = {"mape": 0.10, "spearman": 0.9, "regret": 0.05, "memory": 0.10}
AUTO_TARGET = 1.03  # --strategy auto's measured step over the best measured preset's (docs/search.md)
CALIBRATE = [sys.executable, "-m", "shardflow.cli", "calibrate", "--backend", "gloo", "--nproc"]


@dataclass(frozen=True)
class Model:
    """A size of the main job's Llama (``shardflow train``'s family and config; vocabulary 1024, sequence 64)."""

    layers: int
    embd: int
    heads: int
    kv_heads: int

    @property
    def name(self) -> str:
        return f"{self.layers}L×{self.embd}"


MODELS = {
    "S": Model(2, 128, 4, 2),  # shardflow train's defaults
    "M": Model(2, 256, 4, 2),
    "L": Model(4, 384, 6, 2),
}


@dataclass(frozen=True)
class Plan:
    """One plan: a model of :data:`MODELS`, a preset strategy on a mesh and the step's options (train's flags)."""

    model: str
    strategy: str
    mesh: str
    ac: str = "none"
    accumulate: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    ac_blocks: int | None = None

    @property
    def world(self) -> int:
        return Mesh.parse(self.mesh).size

    @property
    def name(self) -> str:
        parts = [f"{MODELS[self.model].name} {self.strategy} {self.mesh}"]
        if self.microbatches > 1:
            chunks = f" ×{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"{self.schedule}{chunks} mb{self.microbatches}")
        if self.ac != "none":
            parts.append(f"ac {self.ac}" + (f" of {self.ac_blocks}" if self.ac_blocks else ""))
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        return ", ".join(parts)

    def config(self) -> TrainConfig:
        """The ``shardflow train`` configuration of this plan (train's defaults otherwise: batch 16 × 64, AdamW)."""
        m = MODELS[self.model]
        return dataclasses.replace(
            TrainConfig(),
            strategy=self.strategy,
            mesh=self.mesh,
            nproc=self.world,
            layers=m.layers,
            embd=m.embd,
            heads=m.heads,
            kv_heads=m.kv_heads,
            ac=self.ac,
            ac_blocks=self.ac_blocks,
            accumulate=self.accumulate,
            microbatches=self.microbatches,
            schedule=self.schedule,
            stages_per_rank=self.stages_per_rank,
        )


def _plans() -> list[Plan]:
    pp = functools.partial(Plan, strategy="pp", microbatches=4)
    two = [
        *(
            Plan(m, s, f"{'tp' if s == 'sp' else s}=2")
            for m in "SML"
            for s in ("dp", "fsdp", "tp", "sp")
            if m != "L" or s != "sp"
        ),
        pp("S", mesh="pp=2"),
        pp("S", mesh="pp=2", schedule="gpipe"),
        pp("M", mesh="pp=2"),
        pp("L", mesh="pp=2"),
        pp("L", mesh="pp=2", schedule="gpipe"),
        pp("L", mesh="pp=2", schedule="interleaved", stages_per_rank=2),
        Plan("S", "tp", "tp=2", ac="block"),
        Plan("S", "dp", "dp=2", accumulate=2),
        Plan("M", "fsdp", "fsdp=2", ac="block"),
        Plan("L", "dp", "dp=2", ac="block"),
        Plan("L", "tp", "tp=2", accumulate=2),
    ]
    four = [
        *(
            Plan(m, s, mesh)
            for m in "SML"
            for s, mesh in (
                ("dp", "dp=4"),
                ("fsdp", "fsdp=4"),
                ("hsdp", "dp=2,fsdp=2"),
                ("dp,tp", "dp=2,tp=2"),
                ("fsdp,tp", "fsdp=2,tp=2"),
            )
        ),
        Plan("S", "dp,pp", "dp=2,pp=2", microbatches=4),
        pp("L", mesh="pp=4"),
        Plan("L", "fsdp", "fsdp=4", ac="block"),
    ]
    return two + four


PLANS = _plans()
QUICK = [
    Plan("S", "dp", "dp=2"),
    Plan("S", "tp", "tp=2"),
    Plan("S", "pp", "pp=2", microbatches=4),
    Plan("S", "dp", "dp=4"),
    Plan("S", "dp,tp", "dp=2,tp=2", ac="block"),
    Plan("S", "fsdp", "fsdp=4", accumulate=2),
]


class Builder:
    """The pipelines of plans as ``shardflow train`` builds them (:func:`shardflow.train.recipe.setup`), the model
    captured once per model size and micro-batch (the capture depends on nothing else) and planned per plan with
    the options of its flags, the cost model of this machine's calibration file choosing the ``auto`` forms
    (``machine_cost``, as train does)."""

    def __init__(self) -> None:
        self.setups: dict[tuple[str, int], Setup] = {}

    def build(self, plan: Plan) -> tuple[Setup, Pipeline]:
        cfg = plan.config()
        mesh = Mesh.parse(plan.mesh)
        check_accumulation(cfg, mesh)
        key = (plan.model, cfg.batch_size // (cfg.accumulate * cfg.microbatches))
        if key not in self.setups:
            self.setups[key] = setup(cfg, plan.world)
        s = self.setups[key]
        options = step_options(cfg, machine_cost(cfg.device, plan.world))
        pipe = Pipeline.planned(
            s.graph, mesh, options, optimizer_config(cfg), cfg.strategy, None, cfg.strict, cfg.clip_norm or None
        )
        return s, pipe


# --- what an instruction is, for the per-op comparison ------------------------------------------------------------

VIEWS = ("reshape", "permute", "slice", "cat", "transpose", "expand", "unsqueeze", "squeeze", "view", "select")
KINDS = ("linear", "attention", "view/copy", "elementwise", "update", "grad norm")


def op_kind(op: str, update: bool) -> str:
    """The kind of a compute of op name ``op`` (``linear(bias=False)``, ``vjp[mul]``, ``adamw_update``):
    ``update`` for an optimizer update, ``grad norm`` for the other update-time computes, ``linear`` and
    ``attention`` (forward or backward), ``view/copy`` (reshapes, permutes, slices, concatenations: a copy at most),
    and ``elementwise`` for the rest (pointwise ops, reductions, norms, softmax, embedding, local moves)."""
    if update:
        return "update" if op.endswith("_update") else "grad norm"
    base = op.removeprefix("vjp[").split("(")[0].rstrip("]")
    if base in ("linear", "matmul", "mm", "bmm", "addmm"):
        return "linear"
    if base == "attention":
        return "attention"
    if base in VIEWS:
        return "view/copy"
    return "elementwise"


# --- the ranks ------------------------------------------------------------------------------------------------------


def traced_by_kind(events: Sequence[dict]) -> dict[str, list[float]]:
    """A traced step's compute events (the tracer's, compute lane) summed by :func:`op_kind`: kind → [count, s]."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e["tid"] != 0:
            continue
        pass_, _, op = e["name"].partition(" ")
        k = op_kind(op, pass_ == "UPD")
        acc = out.setdefault(k, [0, 0.0])
        acc[0] += 1
        acc[1] += e["dur"] / 1e6
    return out


def _traced_step(executors: Sequence[Any], seconds: float) -> dict:
    """One traced step of ``executors`` (each run's tracer holding its events), ``seconds`` long on this rank: the
    computes by kind (:func:`traced_by_kind`), the communication lane by kind (kind → [calls, s]) and as events
    (executor, token, kind, wait?, start µs, duration µs: wall clock), the time held by it."""
    events = [ev for e in executors for ev in e.tracer.events]
    comm_kinds: dict[str, list[float]] = {}
    comm_events = []
    for x, e in enumerate(executors):
        kind_of = {str(c.token): str(c.kind) for c in e.program.comms}
        for ev in e.tracer.events:
            if ev["tid"] == 1:
                token, _, what = ev["name"].lstrip("#").partition(" ")
                acc = comm_kinds.setdefault(kind_of[token], [0, 0.0])
                acc[0] += what != "wait"
                acc[1] += ev["dur"] / 1e6
                comm_events.append((x, int(token), kind_of[token], what == "wait", ev["ts"], ev["dur"]))
    return {
        "by_kind": traced_by_kind(events),
        "comm_kinds": comm_kinds,
        "comm_events": comm_events,
        "blocked": sum(e["dur"] for e in events if e["tid"] == 1) / 1e6,
        "traced_s": seconds,
    }


def median_traced(plan: dict) -> list[dict]:
    """Every rank's record of the plan's median traced step (by its slowest rank's time)."""
    ranks = plan["ranks"]
    n = len(ranks[0]["traced"])
    order = sorted(range(n), key=lambda k: max(r["traced"][k]["traced_s"] for r in ranks))
    return [{**r, **r["traced"][order[n // 2]]} for r in ranks]


def auto_plan(model: str, world: int) -> tuple[Plan, float]:
    """``shardflow train --strategy auto --nproc world`` on model ``model``: the search's choice on this machine's
    calibration (``MachineSpec.this``; :func:`shardflow.train.recipe.auto_strategy`) as a plan, and the search's
    seconds."""
    from shardflow.train.recipe import auto_strategy

    m = MODELS[model]
    cfg = dataclasses.replace(
        TrainConfig(), strategy="auto", nproc=world, layers=m.layers, embd=m.embd, heads=m.heads, kv_heads=m.kv_heads
    )
    chosen, result = auto_strategy(cfg, world)
    assert chosen.mesh is not None and chosen.strategy is not None
    fields = ("ac", "accumulate", "microbatches", "schedule", "stages_per_rank", "ac_blocks")
    plan = Plan(model, chosen.strategy, chosen.mesh, **{f: getattr(chosen, f) for f in fields})
    return plan, result.seconds


def rank_main(out_dir: Path, params: dict) -> None:
    import torch.distributed as dist

    from shardflow.runtime import trace
    from shardflow.runtime.distributed import DistributedExecutor, init_from_env, shutdown
    from shardflow.train.data import Split

    rank, world = init_from_env(TIMEOUT_S)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    start = machine()
    plans = [Plan(**p) for p in params["plans"]]
    builder = Builder()
    runs = []
    for plan in plans:
        t0 = time.perf_counter()
        s, pipe = builder.build(plan)
        lowered = pipe.lower_micro_steps((rank,))
        make = functools.partial(DistributedExecutor, optimizer=pipe.optimizer, timeout_s=TIMEOUT_S)
        ex, micro = pipe.executors(lowered, make, s.initial_weights())
        prog = lowered[pipe.micro_steps[-1]].programs[rank]
        runs.append(
            {
                "plan": plan,
                "pipe": pipe,
                "lowered": lowered,
                "ex": ex,
                "micro": micro,
                "batch": s.batch(Split.TRAIN, 0),
                "fingerprints": [programs_fingerprint({rank: lowered[m].programs[rank]}) for m in pipe.micro_steps],
                "instrs": len(prog.instrs),
                "comms": len(prog.comms),
            }
        )
        say(rank, f"  built {plan.name} in {time.perf_counter() - t0:.1f} s")
    built_s = time.perf_counter() - t_start
    variants = [Variant(r["plan"].name, functools.partial(r["micro"].step, r["batch"])) for r in runs]
    t0 = time.perf_counter()
    samples = interleave(
        variants, params["rounds"], params["iters"], params["warmup"], rank, log=lambda x: say(rank, x)
    )
    timed_s = time.perf_counter() - t0
    mine = []
    for r in runs:
        pipe, ex = r["pipe"], r["ex"]
        # the peak of this rank's live buffers: executors that count them, on the timed executors' buffers
        counted = functools.partial(DistributedExecutor, optimizer=pipe.optimizer, timeout_s=TIMEOUT_S, memory=True)
        _, micro = pipe.executors(r["lowered"], lambda step, share=None: counted(step, share=share or ex))
        for _ in range(2):
            micro.step(r["batch"])
        peak = max(e.peak_bytes for e in micro.executors)
        # traced steps (after one that compiles the traced segments): each instruction's measured time
        executors = list(dict.fromkeys(r["micro"].executors))
        for e in executors:
            e.tracer = trace.Tracer(rank, e.device)
        r["micro"].step(r["batch"])
        steps = []
        for _ in range(TRACED):
            for e in executors:
                e.tracer.events.clear()
            dist.barrier()
            t0 = time.perf_counter()
            r["micro"].step(r["batch"])
            steps.append(_traced_step(executors, time.perf_counter() - t0))
        for e in executors:
            e.tracer = None
        mine.append(
            {
                "fingerprints": r["fingerprints"],
                "peak": peak,
                "instrs": r["instrs"],
                "comms": r["comms"],
                "traced": steps,
            }
        )
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {
            "world": world,
            "params": params,
            "machine_start": start,
            "machine_end": machine(),
            "session_s": time.perf_counter() - t_start,
            "built_s": built_s,
            "timed_s": timed_s,
            "plans": [
                {
                    "plan": dataclasses.asdict(r["plan"]),
                    "name": r["plan"].name,
                    "samples": samples[r["plan"].name],
                    "ranks": [everyone[q][i] for q in range(world)],
                }
                for i, r in enumerate(runs)
            ],
        }
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    shutdown(0)


# --- the driver -----------------------------------------------------------------------------------------------------


def calibrate(world: int, cal_dir: Path, log: Path) -> float:
    """``shardflow calibrate --nproc world --backend gloo`` into ``cal_dir``; its output in ``log``. Seconds taken."""
    cal_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{CALIBRATION_DIR_ENV: str(cal_dir)})
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run([*CALIBRATE, str(world)], env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"shardflow calibrate --nproc {world} failed ({p.returncode}); see {log}")
    return time.perf_counter() - t0


def compute_line(log: Path) -> str:
    """The compute line ``shardflow calibrate`` printed into ``log`` (``compute: matmul GFLOP/s ...``)."""
    return next((line for line in log.read_text().splitlines() if line.startswith("compute:")), "")


def predicted_by_kind(p: Any, rank: int) -> dict[str, list[float]]:
    """The replay's compute events of ``rank`` summed by :func:`op_kind` (kind → [count, seconds])."""
    out: dict[str, list[float]] = {}
    for e in p.timeline.events:
        if e.rank != rank or e.stream != "compute":
            continue
        k = op_kind(e.name.partition(" ")[2], e.category == "optimizer")  # the event's name: "<task> <op>"
        acc = out.setdefault(k, [0, 0.0])
        acc[0] += 1
        acc[1] += e.seconds
    return out


def predicted_comms(p: Any, rank: int) -> dict[str, list[float]]:
    """The replay's communications of ``rank`` by kind: kind → [count, seconds of α + bytes/β]."""
    out: dict[str, list[float]] = {}
    for e in p.timeline.events:
        if e.rank == rank and e.stream == "comm":  # the event's name: "#<token> <kind>", " (async)" when not waited
            acc = out.setdefault(e.name.split(" ")[1], [0, 0.0])
            acc[0] += 1
            acc[1] += e.seconds
    return out


def predict(world: int, cal_dir: Path, result: dict, after_dir: Path) -> dict:
    """Build every plan of ``result`` here with the calibration of ``cal_dir``, check its programs are the ones the
    ranks ran (their fingerprints, every rank and micro-step) and predict it on ``MachineSpec.this``; and, the same
    programs, on the ``this`` of the calibration taken again after the session (``after_dir``: how much the
    machine's drift during the session moves the prediction)."""
    from shardflow.simulator.machine import MachineSpec

    os.environ[CALIBRATION_DIR_ENV] = str(cal_dir)
    spec = MachineSpec.this("gloo", processes=world)
    after = MachineSpec.this("gloo", processes=world, env={CALIBRATION_DIR_ENV: str(after_dir)})
    builder = Builder()
    out: dict[str, Any] = {"spec": {"source": spec.source.replace(f"{ROOT}/", "")}, "plans": []}
    for entry in result["plans"]:
        plan = Plan(**entry["plan"])
        s, pipe = builder.build(plan)
        lowered = pipe.lower_micro_steps()
        for r in range(world):
            ours = [programs_fingerprint({r: lowered[m].programs[r]}) for m in pipe.micro_steps]
            if ours != entry["ranks"][r]["fingerprints"]:
                raise SystemExit(f"{plan.name}: rank {r}'s simulated programs are not the programs it ran")
        cfg = plan.config()
        p = pipe.predict(spec, cfg.batch_size * cfg.seq_len, events=True)
        out["plans"].append(
            {
                "name": plan.name,
                "step_s": p.step_seconds,
                "step_s_after": pipe.predict(after, cfg.batch_size * cfg.seq_len).step_seconds,
                "peak": list(p.peak_bytes),
                "breakdown": {str(r): vars(b).copy() for r, b in p.timeline.breakdown.items()},
                "by_kind": [predicted_by_kind(p, r) for r in range(world)],
                "comm_kinds": [predicted_comms(p, r) for r in range(world)],
                "slowest": p.slowest,
            }
        )
    out["instr_overhead_s"] = spec.instr_overhead_s
    return out


# --- statistics -----------------------------------------------------------------------------------------------------


def ranks_of(xs: Sequence[float]) -> list[float]:
    """1-based ranks of ``xs``, ties given the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged)."""
    ra, rb = ranks_of(a), ranks_of(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else float("nan")


def regret(pred: Sequence[float], meas: Sequence[float]) -> float:
    """Top-1 regret: the measured time of the plan predicted fastest over the fastest measured, less 1."""
    best = min(range(len(pred)), key=lambda i: pred[i])
    return meas[best] / min(meas) - 1


# --- the section ----------------------------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f} %"


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def rows_of(result: dict, pred: dict) -> list[dict]:
    """Per plan: measured and predicted step time and peaks, the errors."""
    rows = []
    for m, p in zip(result["plans"], pred["plans"]):
        meas_s = statistics.median(m["samples"])
        meas_peak = [r["peak"] for r in m["ranks"]]
        mem_err = [(q - x) / x for q, x in zip(p["peak"], meas_peak)]
        rows.append(
            {
                "name": m["name"],
                "model": m["plan"]["model"],
                "preset": m["plan"].get("ac_blocks") is None,  # a flag set a user writes (no partial checkpointing)
                "meas_s": meas_s,
                "spread": (min(m["samples"]), max(m["samples"])),
                "pred_s": p["step_s"],
                "err": (p["step_s"] - meas_s) / meas_s,
                "err_after": (p["step_s_after"] - meas_s) / meas_s,
                "meas_peak": meas_peak,
                "pred_peak": p["peak"],
                "mem_err": max(mem_err, key=abs),
            }
        )
    return rows


def summary(rows: list[dict]) -> dict:
    groups = collections.defaultdict(list)
    for r in rows:
        groups[r["model"]].append(r)
    return {
        "plans": len(rows),
        "mape": statistics.fmean(abs(r["err"]) for r in rows),
        "mape_after": statistics.fmean(abs(r["err_after"]) for r in rows),
        "bias": statistics.median(r["err"] for r in rows),
        "spearman": spearman([r["pred_s"] for r in rows], [r["meas_s"] for r in rows]),
        "regret": {
            g: (regret([r["pred_s"] for r in rs], [r["meas_s"] for r in rs]), len(rs)) for g, rs in groups.items()
        },
        "spearman_in": {
            g: spearman([r["pred_s"] for r in rs], [r["meas_s"] for r in rs]) for g, rs in groups.items() if len(rs) > 2
        },
        "memory": max((abs(r["mem_err"]) for r in rows), default=0.0),
        "memory_within": sum(abs(r["mem_err"]) <= TARGETS["memory"] for r in rows),
    }


def transfers(ranks: Sequence[dict]) -> dict[str, list[float]]:
    """The measured time of each communication itself, by kind (kind → [count, seconds], once per member as the
    replay's events count it), from the traced step's lane events of every rank (one wall clock: the ranks share
    the machine): from the last member's issue to the first member's end of it (the end of its blocking call, or of
    the wait of one issued without waiting). What a member was held beyond that is waiting for the other members,
    not the communication's own time."""
    issued: dict[tuple[int, int], list[tuple[str, float]]] = {}
    ended: dict[tuple[int, int], list[float]] = {}
    for rank in ranks:
        waited = {(x, t) for x, t, _, wait, _, _ in rank["comm_events"] if wait}  # issued without waiting
        for x, t, kind, wait, ts, dur in rank["comm_events"]:
            if not wait:
                issued.setdefault((x, t), []).append((kind, ts))
            if wait or (x, t) not in waited:
                ended.setdefault((x, t), []).append(ts + dur)
    out: dict[str, list[float]] = {}
    for key, members in issued.items():
        if key not in ended:
            continue
        seconds = max(0.0, min(ended[key]) - max(ts for _, ts in members)) / 1e6
        for kind, _ in members:
            acc = out.setdefault(kind, [0, 0.0])
            acc[0] += 1
            acc[1] += seconds
    return out


def comm_name(kind: str) -> str:
    """A communication kind as the per-op table groups it: a transfer between pipeline stages is one send on one
    member and one receive on the other (the replay names both after the first it meets)."""
    return "send/recv" if kind in ("send", "recv") else kind


BLOCKED = "blocked on communication"
HOST = "host, outside the instructions"


def per_op(result: dict, pred: dict) -> dict[str, list[float]]:
    """Measured (traced) against predicted seconds per kind of instruction, summed over plans and ranks: kind →
    [measured count, measured s, predicted count, predicted s]. Computes by :func:`op_kind`; communications by
    kind (:func:`comm_name`): ``held by K``, the tracer's communication lane (the blocking calls, and the waits of
    those issued without waiting: the time the rank was held, so waiting for the other members included), and
    ``K itself`` (:func:`transfers`), each against the replay's α + bytes/β of the same calls; :data:`BLOCKED`: all of the lane against the replay's exposed
    communication and bubble; :data:`HOST`: the rest of the traced step (less its computes and the lane: the
    executor's work between instructions and outside the program) against the replay's host overhead."""
    out: dict[str, list[float]] = {k: [0, 0.0, 0, 0.0] for k in KINDS}
    for m, p in zip(result["plans"], pred["plans"]):
        ranks = median_traced(m)
        for r, rank in enumerate(ranks):
            for k, (n, s) in rank["by_kind"].items():
                out[k][0] += n
                out[k][1] += s
            for k, (n, s) in p["by_kind"][r].items():
                out[k][2] += n
                out[k][3] += s
            for k, (n, s) in rank["comm_kinds"].items():
                acc = out.setdefault(f"held by {comm_name(k)}", [0, 0.0, 0, 0.0])
                acc[0] += n
                acc[1] += s
            for k, (n, s) in p["comm_kinds"][r].items():
                acc = out.setdefault(f"held by {comm_name(k)}", [0, 0.0, 0, 0.0])
                acc[2] += n
                acc[3] += s
                acc = out.setdefault(f"{comm_name(k)} itself", [0, 0.0, 0, 0.0])
                acc[2] += n
                acc[3] += s
        for k, (n, s) in transfers(ranks).items():
            acc = out.setdefault(f"{comm_name(k)} itself", [0, 0.0, 0, 0.0])
            acc[0] += n
            acc[1] += s
        for r, rank in enumerate(ranks):
            b = p["breakdown"][str(r)]
            acc = out.setdefault(BLOCKED, [0, 0.0, 0, 0.0])
            acc[1] += rank["blocked"]
            acc[3] += b["exposed_comm"] + b["bubble"]
            computed = sum(s for _, s in rank["by_kind"].values())
            acc = out.setdefault(HOST, [0, 0.0, 0, 0.0])
            acc[0] += rank["instrs"]
            acc[2] += rank["instrs"]
            acc[1] += max(0.0, rank["traced_s"] - computed - rank["blocked"])
            acc[3] += b["overhead"]
    return out


def machine_line(res: dict) -> str:
    m, e = res["machine_start"], res["machine_end"]
    return (
        f"{m['cores']} cores ({m['cpu']}, {m['arch']}), Python {m['python']}, torch {m['torch']}, "
        f"{m['date'].replace('T', ' ')}; {res['world']} gloo ranks × 1 intra-op thread; load average "
        f"{m['load']:.2f} at the start of the session, {e['load']:.2f} at the end; session {res['session_s']:.0f} s "
        f"({res['params']['rounds']} rounds × {res['params']['iters']} step per sample)"
    )


def auto_rows(rows: list[dict], autos: dict) -> list[dict]:
    """Per model size: the search's choice (``autos[model]``) measured against the fastest measured preset (the
    plans of that model without partial checkpointing, the choice itself where it is one)."""
    out = []
    for model, auto in autos.items():
        mine = [r for r in rows if r["model"] == model]
        chosen = next(r for r in mine if r["name"] == auto["name"])
        best = min((r for r in mine if r["preset"]), key=lambda r: r["meas_s"])
        out.append({"model": model, "auto": chosen, "best": best, "ratio": chosen["meas_s"] / best["meas_s"], **auto})
    return out


def render(
    results: dict[int, dict], preds: dict[int, dict], cal_s: dict[int, float], wall_s: float, autos: dict[int, dict]
) -> str:
    lines = [
        SECTION,
        "",
        "`python benchmarks/simulator.py`: the step simulator's prediction on the spec measured here "
        "(`MachineSpec.this`, from `shardflow calibrate --nproc N` run first into a fresh calibration directory) "
        "against the same plans run on this machine, each world size in one session of gloo ranks "
        "(docs/simulator.md#validation-on-this-machine). Plans: the main job's Llama (`shardflow train`'s family; "
        "vocabulary 1024, batch 16 × 64 tokens, AdamW, float32) at "
        + ", ".join(f"{m.name} ({m.heads} heads, {m.kv_heads} key/value)" for m in MODELS.values())
        + ", built as `shardflow train` builds them (the calibrated cost model choosing the `auto` forms); every "
        "rank's program of every micro-step simulated has the fingerprint of the one that ran. Measured: the "
        "median over interleaved rounds of the slowest rank's step (forward, backward, update, the loss read), "
        "and each rank's peak of live buffers (`DistributedExecutor(memory=True)`, 2 steps). Predicted: "
        "`Pipeline.predict` (step: the last rank's end; peak: the programs' buffers replayed).",
        "",
    ]
    all_rows = {}
    for world in sorted(results):
        res, pred = results[world], preds[world]
        rows = rows_of(res, pred)
        all_rows[world] = rows
        lines += [
            f"### {world} ranks",
            "",
            f"Machine: {machine_line(res)}. Calibration: {cal_s.get(world, float('nan')):.0f} s; "
            f"{pred['spec']['source']}; before the session `{pred['compute'][0]}`, again after it "
            f"`{pred['compute'][1]}`.",
            "",
            "| plan | measured step (ms) | min–max | predicted (ms) | error | measured peak (MiB, per rank) | "
            "predicted peak | worst memory error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['name']} | {_ms(r['meas_s'])} | {_ms(r['spread'][0])}–{_ms(r['spread'][1])} | "
                f"{_ms(r['pred_s'])} | {_pct(r['err'])} | {_mib(r['meas_peak'])} | {_mib(r['pred_peak'])} | "
                f"{_pct(r['mem_err'])} |"
            )
        lines.append("")
    lines += [
        "### Summary",
        "",
        "| ranks | plans | step time MAPE (target ≤ 10 %) | median error | MAPE on the calibration taken after "
        "the session | Spearman, all plans (≥ 0.9) | Spearman within a model size | top-1 regret per model size "
        "(≤ 5 %) | worst peak-memory error (±10 %) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sums = {w: summary(rs) for w, rs in all_rows.items()}
    for world, s in sums.items():
        reg = ", ".join(f"{MODELS[g].name} {v * 100:.1f} % ({n} plans)" for g, (v, n) in s["regret"].items())
        within = ", ".join(f"{MODELS[g].name} {v:.2f}" for g, v in s["spearman_in"].items())
        lines.append(
            f"| {world} | {s['plans']} | {s['mape'] * 100:.1f} % {_verdict(s['mape'] <= TARGETS['mape'])} | "
            f"{_pct(s['bias'])} | {s['mape_after'] * 100:.1f} % | "
            f"{s['spearman']:.3f} {_verdict(s['spearman'] >= TARGETS['spearman'])} | {within} | {reg} "
            f"{_verdict(all(v <= TARGETS['regret'] for v, _ in s['regret'].values()))} | "
            f"{s['memory'] * 100:.1f} % ({s['memory_within']} of {s['plans']} within) "
            f"{_verdict(s['memory'] <= TARGETS['memory'])} |"
        )
    lines += [
        "",
        "### `--strategy auto` against the presets, measured",
        "",
        "Per world size and model size, the plan `shardflow train --strategy auto` chooses "
        "(`shardflow.train.recipe.auto_strategy`: the search on the calibration taken before the session; presets, "
        "with partial checkpointing where it fits) run in the same session, interleaved with the presets of the table "
        "above; *best preset*: the fastest measured of that model's plans without `--ac-blocks` (the choice itself "
        f"where it is one). Target: auto's measured step ≤ {AUTO_TARGET} × the best measured preset's.",
        "",
        "| ranks | model | auto: its choice | search (s) | measured (ms) | best measured preset | measured (ms) | "
        "auto ÷ best | predicted: auto, best preset (ms) |",
        "|---|---|---|---:|---:|---|---:|---:|---|",
    ]
    met = []
    for world in sorted(results):
        for a in auto_rows(all_rows[world], autos.get(world, {})):
            met.append(a["ratio"] <= AUTO_TARGET)
            lines.append(
                f"| {world} | {MODELS[a['model']].name} | {a['name']} | {a['search_s']:.1f} | {_ms(a['auto']['meas_s'])} "
                f"| {a['best']['name']} | {_ms(a['best']['meas_s'])} | {a['ratio']:.3f} {_verdict(met[-1])} | "
                f"{_ms(a['auto']['pred_s'])}, {_ms(a['best']['pred_s'])} |"
            )
    lines += [
        "",
        f"Auto within {AUTO_TARGET} × the best measured preset in {sum(met)} of {len(met)} cases.",
        "",
        "The headline figures predict on the calibration taken right before each session (the protocol: "
        "calibrate, then run); the same programs predicted on a second calibration taken right after the session "
        "show how far the machine itself moved meanwhile (other processes share these 2 cores).",
        "",
        "### Where the predicted step goes wrong: per kind of instruction",
        "",
        f"The median of {TRACED} traced steps of every plan (by its slowest rank's time) on every rank "
        "(`runtime.trace.Tracer`: each instruction's start and end) "
        "against the replay's events of the same instructions (`Pipeline.predict(..., events=True)`), summed over "
        "plans and ranks, seconds. Computes by kind: *linear* (forward and backward), *attention*, *view/copy* "
        "(reshapes, permutes, slices, concatenations), *elementwise* (every other op: pointwise, reductions, norms, "
        "softmax, embedding), *update* (the optimizer; measured as one multi-tensor kernel per run of updates, "
        "predicted one per weight) and *grad norm*. *Host*: the traced step less its computes and the time it was "
        "held by communication (the executor's work between instructions, the input placement and loss read outside "
        "the program; the tracer adds about 2 µs per instruction) against the replay's host overhead. "
        "Communication, per kind: *held by* — the time the ranks were held by its calls (a blocking call, or the "
        "wait of one issued without waiting: the communication and the wait for the other members) against the "
        "replay's α + bytes/β of the same calls; *itself* — from the last member's issue to the first member's end "
        "(the wait for late members taken out; where every member came to its wait after the end, an upper bound) "
        "against α + bytes/β; *blocked on communication*: all of the held time against the replay's exposed "
        "communication and bubble. Ratios measured ÷ predicted.",
        "",
        "| ranks | kind | measured (count, s) | predicted (count, s) | measured ÷ predicted |",
        "|---|---|---|---|---|",
    ]
    for world in sorted(results):
        ops = per_op(results[world], preds[world])
        comms = sorted(
            (k for k in ops if k.startswith("held by ") or k.endswith(" itself")),
            key=lambda k: (k.removeprefix("held by ").removesuffix(" itself"), k.endswith(" itself")),
        )
        for k in [*KINDS, HOST, *comms, BLOCKED]:
            mn, ms, pn, ps = ops.get(k, (0, 0.0, 0, 0.0))
            if not (ms or ps):
                continue
            ratio = f"{ms / ps:.2f}" if ps and ms else "–"
            lines.append(f"| {world} | {k} | {int(mn)}, {ms:.3f} | {int(pn)}, {ps:.3f} | {ratio} |")
    lines += ["", f"Whole benchmark: {wall_s / 60:.1f} minutes.", ""]
    return "\n".join(lines)


def _mib(xs: Sequence[int]) -> str:
    vals = sorted({round(x / 2**20, 1) for x in xs})
    return " / ".join(f"{v:.1f}" for v in vals) if len(vals) <= 2 else f"{vals[0]:.1f}–{vals[-1]:.1f}"


def main(argv: list[str] | None = None) -> int:
    from shardflow.runtime.launch import describe_failure, launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="6 plans, 3 rounds: a smoke test (writes only with --out)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 25; 3 with --quick)")
    p.add_argument("--out", help="Markdown file to update (default docs/benchmarks.md, not with --quick)")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "simulator"), help="calibrations, rank logs, JSON")
    p.add_argument("--render-only", action="store_true", help="rebuild the section from --run-dir's JSON")
    p.add_argument("--worlds", default="2,4", help="world sizes to run (default 2,4)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    run_dir = Path(args.run_dir)
    plans = QUICK if args.quick else PLANS
    rounds = args.rounds or (3 if args.quick else 25)
    worlds = [int(w) for w in args.worlds.split(",")]
    t_all = time.perf_counter()
    results, preds, cal_s, autos_of = {}, {}, {}, {}
    for world in worlds:
        d = run_dir / f"world{world}"
        if args.render_only:
            results[world] = json.loads((d / "result.json").read_text())
            preds[world] = json.loads((d / "predicted.json").read_text())
            autos_of[world] = json.loads((d / "autos.json").read_text())
            cal_s = json.loads((run_dir / "times.json").read_text()).get("calibrate", {})
            cal_s = {int(k): v for k, v in cal_s.items()}
            continue
        d.mkdir(parents=True, exist_ok=True)
        (d / "result.json").unlink(missing_ok=True)
        cal_dir = d / "calibration"
        print(f"== {world} ranks: shardflow calibrate --nproc {world}", flush=True)
        cal_s[world] = calibrate(world, cal_dir, d / "calibrate.log")
        print((d / "calibrate.log").read_text().strip().splitlines()[-2], flush=True)
        mine = [q for q in plans if q.world == world]
        os.environ[CALIBRATION_DIR_ENV] = str(cal_dir)
        autos = {}  # model → the search's choice on this calibration, measured with the presets
        for model in dict.fromkeys(q.model for q in mine):
            chosen, seconds = auto_plan(model, world)
            autos[model] = {"plan": dataclasses.asdict(chosen), "name": chosen.name, "search_s": seconds}
            print(f"   --strategy auto on {MODELS[model].name}: {chosen.name} ({seconds:.1f} s)", flush=True)
            if chosen not in mine:
                mine.append(chosen)
        (d / "autos.json").write_text(json.dumps(autos, indent=1))
        autos_of[world] = autos
        params = {"plans": [dataclasses.asdict(q) for q in mine], "rounds": rounds, "iters": 1, "warmup": 2}
        print(f"== {world} ranks: {len(mine)} plans, {rounds} rounds", flush=True)
        t0 = time.perf_counter()
        res = launch([sys.executable, str(Path(__file__).resolve()), "--rank", str(d), json.dumps(params)], world, d)
        if not res.ok:
            print(describe_failure(res, d), file=sys.stderr)
            return 1
        results[world] = json.loads((d / "result.json").read_text())
        print(f"   session {time.perf_counter() - t0:.0f} s; calibrating again, predicting", flush=True)
        calibrate(world, d / "calibration-after", d / "calibrate-after.log")
        with warnings.catch_warnings():  # no default may stand in for a measurement
            warnings.simplefilter("error", category=MachineSpecWarning)
            warnings.simplefilter("error", category=CalibrationWarning)
            preds[world] = predict(world, cal_dir, results[world], d / "calibration-after")
        preds[world]["compute"] = [compute_line(d / log) for log in ("calibrate.log", "calibrate-after.log")]
        (d / "predicted.json").write_text(json.dumps(preds[world], indent=1))
    wall = time.perf_counter() - t_all
    if not args.render_only:
        (run_dir / "times.json").write_text(json.dumps({"calibrate": cal_s, "wall_s": wall}))
    else:
        wall = json.loads((run_dir / "times.json").read_text())["wall_s"]
    text = render(results, preds, cal_s, wall, autos_of)
    print(text)
    out = args.out or (None if args.quick else str(ROOT / "docs" / "benchmarks.md"))
    if out and not args.no_write:
        write_section(Path(out), text)
        print(f"wrote the section to {out}", file=sys.stderr)
    print(f"total {wall:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(Path(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        sys.exit(main())
