"""The simulator against published runs: torchtitan's Llama 3.1 on H100 (../shared's anchor, quoted in
docs/simulator.md#against-published-runs), predicted with the shipped ``h100`` machine spec.

Each published configuration is built as ``shardflow plan`` builds it — Llama 3.1 8B (32 layers, width 4096, 32
heads, 8 key/value heads, MLP 14336) or 70B (80 layers, 8192, 64, 8, 28672), vocabulary 128256, sequence 8192,
bf16 parameters with float32 reductions, AdamW — on the meta device, captured, planned on the published mesh and
predicted (:meth:`shardflow.pipeline.Pipeline.predict`). The published techniques are modelled as what they change
(:class:`shardflow.simulator.cost.Kernels`): torch.compile as fused elementwise kernels, Float8 as the linears'
matmuls at the float8 peak plus their operands' casts; torchtitan's *selective* activation checkpointing of the 8B
runs as ``--ac selective`` (docs/lowering.md#selective-checkpointing---ac-selective). What is not modelled is said in
the table: *async TP* (the tensor-parallel collectives decomposed to overlap the matmuls: predicted as plain 2-D). torchtitan's tensor parallelism is sequence-parallel (its norms and the loss
sharded on the sequence), so the 2-D rows plan ``fsdp,sp``.

Prints the table — published tokens/s per GPU, predicted, error — with the mean absolute error and whether each
table's published order is kept, and writes it to docs/benchmarks.md under "Simulator against published runs".

Usage::

    python benchmarks/anchors.py             # every row (~2 min: capturing the 70B dominates), writes the docs
    python benchmarks/anchors.py --no-write  # print only
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import write_section  # noqa: E402

from shardflow.capture import at_dtype, capture  # noqa: E402
from shardflow.parallel.mesh import Mesh  # noqa: E402
from shardflow.pipeline import Pipeline  # noqa: E402
from shardflow.runtime.materialize import materialize  # noqa: E402
from shardflow.simulator.cost import Kernels  # noqa: E402
from shardflow.simulator.estimate import cost_model  # noqa: E402
from shardflow.simulator.machine import MachineSpec  # noqa: E402
from shardflow.train.config import TrainConfig, optimizer_config, step_options  # noqa: E402
from shardflow.train.family import Feed  # noqa: E402
from shardflow.train.recipe import build_model  # noqa: E402

SIZES = {
    "8B": dict(layers=32, embd=4096, heads=32, kv_heads=8, mlp=14336),
    "70B": dict(layers=80, embd=8192, heads=64, kv_heads=8, mlp=28672),
}
EAGER, COMPILE, FLOAT8 = Kernels(), Kernels(fused_elementwise=True), Kernels(True, True)


@dataclass(frozen=True)
class Row:
    """One published row: its table, technique, model, mesh, global batch, activation checkpointing, the kernels
    that model its technique, what is not modelled, and the published tokens/s per GPU."""

    table: str
    technique: str
    model: str
    mesh: str
    batch: int
    ac: str
    kernels: Kernels
    unmodelled: str
    published: float


ROWS = (
    Row("1: 8B, 8 GPUs", "FSDP", "8B", "fsdp=8", 16, "selective", EAGER, "", 5762),
    Row("1: 8B, 8 GPUs", "FSDP + torch.compile", "8B", "fsdp=8", 16, "selective", COMPILE, "", 6667),
    Row("1: 8B, 8 GPUs", "FSDP + torch.compile + Float8", "8B", "fsdp=8", 16, "selective", FLOAT8, "", 8532),
    Row("3: 8B, 128 GPUs", "FSDP", "8B", "fsdp=128", 256, "selective", EAGER, "", 5605),
    Row("3: 8B, 128 GPUs", "FSDP + torch.compile", "8B", "fsdp=128", 256, "selective", COMPILE, "", 6514),
    Row("3: 8B, 128 GPUs", "FSDP + torch.compile + Float8", "8B", "fsdp=128", 256, "selective", FLOAT8, "", 8380),
    Row("4: 70B, 256 GPUs", "2-D (FSDP + TP)", "70B", "fsdp=32,tp=8", 512, "block", FLOAT8, "", 829),
    Row("4: 70B, 256 GPUs", "2-D + async TP", "70B", "fsdp=32,tp=8", 512, "block", FLOAT8, "async TP", 876),
)


def pipeline(model: str, mesh: Mesh, batch: int, ac: str, spec: MachineSpec) -> Pipeline:
    """The published configuration planned as ``shardflow plan --dtype bf16 --optimizer adamw`` plans it."""
    cfg = TrainConfig(
        **SIZES[model],
        vocab_size=128256,
        seq_len=8192,
        batch_size=batch,
        dtype="bf16",
        ac=ac,
        optimizer="adamw",
        strategy=",".join("sp" if a == "tp" else a for a in mesh.axis_names),  # torchtitan's TP: sequence-parallel
        mesh=str(mesh),
        nproc=mesh.size,
    )
    options = step_options(cfg, cost_model(spec, mesh))
    _, _, module = build_model(cfg, cfg.vocab_size, None)
    materialize(module, cfg.seed)
    ids = torch.zeros(batch, cfg.seq_len, dtype=torch.long)
    module, inputs, _ = at_dtype(module, Feed.CAUSAL_LM.inputs(ids, ids), torch.bfloat16)
    graph = capture(module, inputs)
    return Pipeline.planned(graph, mesh, options, optimizer_config(cfg), cfg.strategy)


def run() -> list[dict]:
    spec = MachineSpec.named("h100")
    built: dict[tuple, tuple[Pipeline, float]] = {}
    out = []
    for row in ROWS:
        mesh = Mesh.parse(row.mesh)
        key = (row.model, row.mesh, row.batch, row.ac)
        if key not in built:
            t0 = time.perf_counter()
            p = pipeline(row.model, mesh, row.batch, row.ac, spec)
            built[key] = (p, time.perf_counter() - t0)
            print(f"built {row.model} on {row.mesh} in {built[key][1]:.1f} s", flush=True)
        p = built[key][0]
        t0 = time.perf_counter()
        pred = p.predict(spec, row.batch * 8192, kernels=row.kernels)
        seconds = time.perf_counter() - t0
        tps = pred.tokens_per_second_per_device
        out.append(
            {
                "row": row,
                "predicted": tps,
                "error": (tps - row.published) / row.published,
                "mfu": pred.mfu,
                "peak_gib": max(pred.peak_bytes) / 2**30,
                "breakdown": vars(pred.timeline.breakdown[pred.slowest]),
                "step_s": pred.step_seconds,
                "predict_s": seconds,
            }
        )
        print(f"{row.table} | {row.technique}: published {row.published:,.0f}, predicted {tps:,.0f}", flush=True)
    return out


def timings() -> list[str]:
    """The simulator's own speed on this machine (seconds after capture: planning, then lowering one rank per
    class and replaying it): the 24-layer Llama of benchmarks/planning.py on 64 H100s (dp=8, tp=8; target ≤ 2 s)
    and an 80-layer 70B-shaped Llama on 512 (fsdp=64, tp=8; target ≤ 10 s)."""
    from llama import llama, tokens

    spec = MachineSpec.named("h100")
    small = Mesh.parse("dp=8,tp=8")
    big = pipeline("70B", Mesh.parse("fsdp=64,tp=8"), 1024, "block", spec)  # captured once, planned again below
    cases = [
        (
            "24-layer Llama (width 64) on dp=8,tp=8 (64 H100)",
            capture(llama(24, 64, heads=8, kv_heads=8, device="meta"), tokens(128, 64)),
            small,
            step_options(TrainConfig(), cost_model(spec, small)),
            "dp,tp",
            128 * 64,
        ),
        (
            "80-layer 70B-shaped Llama on fsdp=64,tp=8 (512 H100)",
            big.graph,
            big.pcg.mesh,
            big.options,
            "fsdp,sp",
            1024 * 8192,
        ),
    ]
    out = []
    for name, graph, mesh, options, strategy, n in cases:
        t0 = time.perf_counter()
        p = Pipeline.planned(graph, mesh, options, big.optimizer, strategy)
        t1 = time.perf_counter()
        p.predict(spec, n)
        t2 = time.perf_counter()
        out.append(f"{name}: plan {t1 - t0:.2f} s + lower and replay {t2 - t1:.2f} s = {t2 - t0:.2f} s after capture")
        print(out[-1], flush=True)
    return out


def section(results: list[dict]) -> str:
    lines = [
        f"`python benchmarks/anchors.py` ({datetime.date.today()}, torch {torch.__version__}): torchtitan's "
        "published Llama 3.1 runs on H100 (pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md`, "
        "docs/simulator.md#against-published-runs) against the simulator's prediction with the shipped `h100` "
        "spec. Step breakdown of the slowest rank, seconds.",
        "",
        "| table | technique | published TPS/GPU | predicted TPS/GPU | error | predicted MFU | step (s): compute / "
        "recompute / optimizer / exposed comm | predicted peak (GiB) | not modelled |",
        "|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in results:
        b, row = r["breakdown"], r["row"]
        lines.append(
            f"| {row.table} | {row.technique} | {row.published:,.0f} | {r['predicted']:,.0f} | {r['error']:+.0%} | "
            f"{r['mfu']:.1%} | {r['step_s']:.2f}: {b['compute']:.2f} / {b['recompute']:.2f} / {b['optimizer']:.3f} / "
            f"{b['exposed_comm']:.3f} | {r['peak_gib']:.0f} | {row.unmodelled or '—'} |"
        )
    mean = sum(abs(r["error"]) for r in results) / len(results)
    orders = []
    for table in dict.fromkeys(r["row"].table for r in results):
        rows = [r for r in results if r["row"].table == table]
        ranked = sorted(rows, key=lambda r: r["row"].published)  # kept: strictly faster where published faster
        kept = all(a["predicted"] < b["predicted"] for a, b in zip(ranked, ranked[1:]))
        orders.append(f"table {table}: {'kept' if kept else 'NOT kept'}")
    lines += [
        "",
        f"Mean absolute error {mean:.0%} (target ≤ 15 %); published order within each table — {'; '.join(orders)}. "
        f"Prediction time per row (planned once per configuration): "
        f"{max(r['predict_s'] for r in results):.1f} s at most.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    text = section(run()) + "\n\nThe simulator's own time on this machine (2 cores): " + "; ".join(timings()) + "."
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "benchmarks.md", "## Simulator against published runs\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
