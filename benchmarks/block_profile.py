"""Where a Llama 3 8B-shaped step's time goes on one device, per kind of instruction: measured against predicted
(docs/simulator.md#against-published-runs: which term of the model the published runs' error is in).

The model: Llama 3.1 8B's block (width 4096, 32 heads, 8 key/value heads, MLP 14336) with ``--layers`` of them
(default 2: the 8B's 32 would not fit one device unsharded), vocabulary 128256, sequence 8192, ``--batch`` sequences
(default 2: torchtitan's local batch), bf16 parameters with float32 reductions, AdamW, ``--ac`` (default selective:
torchtitan's) — the anchor's configuration (benchmarks/anchors.py) on one device. It is built as ``shardflow plan``
builds it, planned ``single`` and run on ``DistributedExecutor`` (one rank): ``--steps`` timed steps (the median),
then one traced step (``runtime.trace.Tracer``; on a GPU each instruction waits for its kernels, so its time is
theirs). Predicted: ``Pipeline.predict(..., events=True)`` of the same program on this machine's calibration
(``MachineSpec.this``: run ``shardflow calibrate --nproc 1`` first) and on the shipped ``h100`` spec (the spec the
anchors are predicted with). Beside it, eager PyTorch's step of the same module (forward, loss, backward, AdamW
``foreach``) in bf16.

Prints a table per kind of instruction (benchmarks/simulator.py's kinds) — measured, predicted on ``this``, on
``h100``, the ratios — and the ten longest computes of the traced step with their predictions; writes it all as JSON
to ``--out``. Needs the memory of the step: about 60 GiB at the defaults (a GPU); ``--embd 256 --mlp 512 --heads 4
--kv-heads 2 --vocab 1024 --seq-len 256 --device cpu`` is the script's own check on a CPU.

Usage::

    python benchmarks/block_profile.py --device cuda --out profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from simulator import predicted_by_kind, traced_by_kind  # noqa: E402

from shardflow.capture import at_dtype, capture  # noqa: E402
from shardflow.parallel.mesh import Mesh  # noqa: E402
from shardflow.pipeline import Pipeline  # noqa: E402
from shardflow.runtime import trace  # noqa: E402
from shardflow.runtime.distributed import DistributedExecutor, init_from_env, shutdown  # noqa: E402
from shardflow.runtime.materialize import materialize  # noqa: E402
from shardflow.simulator.estimate import cost_model  # noqa: E402
from shardflow.simulator.machine import MachineSpec  # noqa: E402
from shardflow.train.config import TrainConfig, optimizer_config, step_options  # noqa: E402
from shardflow.train.family import Feed  # noqa: E402
from shardflow.train.recipe import build_model  # noqa: E402

TIMEOUT_S = 600.0


def eager_step_s(module: torch.nn.Module, inputs: dict, device: torch.device, steps: int) -> float:
    """Median seconds of eager PyTorch's step of ``module`` (parameters on meta, given random values on ``device``
    here; its buffers real) on ``device``: forward, the loss, backward, AdamW (``foreach``)."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    module = module.to_empty(device=device)
    for n, b in module.named_buffers():
        b.copy_(buffers[n])
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5, foreach=True)
    now = trace.Tracer(0, device).now  # seconds, once the device's queued work has finished
    inputs = {k: v.to(device) for k, v in inputs.items()}
    times = []
    for _ in range(steps + 1):
        t0 = now()
        module(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(now() - t0)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--mlp", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--ac", default="selective")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", help="JSON file of the figures")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # NCCL binds its communicators to an indexed device
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_from_env(TIMEOUT_S, device)
    cfg = TrainConfig(
        layers=args.layers,
        embd=args.embd,
        heads=args.heads,
        kv_heads=args.kv_heads,
        mlp=args.mlp,
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        batch_size=args.batch,
        dtype="bf16",
        ac=args.ac,
        optimizer="adamw",
        strategy="single",
        nproc=1,
    )
    this = MachineSpec.this("nccl" if device.type == "cuda" else "gloo", processes=1)
    h100 = MachineSpec.named("h100")
    mesh = Mesh.parse("dp=1")
    t0 = time.perf_counter()
    _, _, module = build_model(cfg, cfg.vocab_size, None)
    inits = materialize(module, cfg.seed)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    batch = Feed.CAUSAL_LM.inputs(ids, ids)
    module, inputs, _ = at_dtype(module, batch, torch.bfloat16)
    options = step_options(cfg, cost_model(this, mesh))
    pipe = Pipeline.planned(capture(module, inputs), mesh, options, optimizer_config(cfg), "single")
    lowered = pipe.lower_micro_steps()
    ex, micro = pipe.executors(
        lowered,
        lambda step, share=None: DistributedExecutor(
            step, pipe.optimizer, device=device, share=share, timeout_s=TIMEOUT_S
        ),
        {w: inits[w] for w in pipe.graph.weights},
    )
    built_s = time.perf_counter() - t0
    print(f"built in {built_s:.1f} s: {len(lowered[pipe.micro_steps[-1]].programs[0].instrs)} instructions", flush=True)
    now = trace.Tracer(0, device).now  # seconds, once the device's queued work has finished
    times = []
    for _ in range(args.steps + 1):
        t0 = now()
        micro.step(batch)
        times.append(now() - t0)
    measured_s = statistics.median(times[1:])
    ex.tracer = trace.Tracer(0, device)
    t0 = now()
    micro.step(batch)
    traced_s = now() - t0
    events = ex.tracer.events
    ex.tracer = None
    peak_alloc = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    tokens = cfg.batch_size * cfg.seq_len
    preds = {name: pipe.predict(spec, tokens, events=True) for name, spec in (("this", this), ("h100", h100))}
    del ex, micro
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _, _, eager_module = build_model(cfg, cfg.vocab_size, None)
    materialize(eager_module, cfg.seed)
    eager_s = eager_step_s(eager_module.to(torch.bfloat16), batch, device, args.steps)

    measured = traced_by_kind(events)
    predicted = {name: predicted_by_kind(pred, 0) for name, pred in preds.items()}
    rows = []
    for kind in sorted(set(measured) | set(predicted["this"]), key=lambda k: -measured.get(k, [0, 0])[1]):
        m = measured.get(kind, [0, 0.0])
        t, h = predicted["this"].get(kind, [0, 0.0]), predicted["h100"].get(kind, [0, 0.0])
        rows.append({"kind": kind, "count": m[0], "measured_s": m[1], "this_s": t[1], "h100_s": h[1]})
    # the same instructions in program order, the update's left out (traced as one multi-tensor kernel, replayed
    # one per weight)
    computes = [e for e in events if e["tid"] == trace.LANES["compute"] and not e["name"].startswith("UPD ")]
    replayed = {
        name: [
            ev.seconds
            for ev in pred.timeline.events
            if ev.rank == 0 and ev.stream == "compute" and ev.category != "optimizer"
        ]
        for name, pred in preds.items()
    }
    paired = all(len(v) == len(computes) for v in replayed.values())
    top = sorted(range(len(computes)), key=lambda i: -computes[i]["dur"])[:10]
    result = {
        "config": vars(args),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "built_s": built_s,
        "measured_step_s": measured_s,
        "traced_step_s": traced_s,
        "eager_step_s": eager_s,
        "peak_allocated_bytes": peak_alloc,
        "predicted": {
            name: {"step_s": pr.step_seconds, "mfu": pr.mfu, "peak_bytes": max(pr.peak_bytes)}
            for name, pr in preds.items()
        },
        "kinds": rows,
        "longest": [
            {
                "name": computes[i]["name"],
                "measured_s": computes[i]["dur"] / 1e6,
                **{k: v[i] if paired else None for k, v in replayed.items()},
            }
            for i in top
        ],
    }
    print(
        f"step: measured {measured_s * 1e3:.1f} ms (traced {traced_s * 1e3:.1f}), eager {eager_s * 1e3:.1f} ms; "
        f"predicted on this {preds['this'].step_seconds * 1e3:.1f} ms, on h100 {preds['h100'].step_seconds * 1e3:.1f} ms"
    )
    print(
        f"{'kind':14s} {'count':>6s} {'measured ms':>12s} {'this ms':>10s} {'h100 ms':>10s} {'m/this':>7s} {'m/h100':>7s}"
    )
    for r in rows:
        ratio = [r["measured_s"] / r[k] if r[k] else float("nan") for k in ("this_s", "h100_s")]
        print(
            f"{r['kind']:14s} {r['count']:6d} {r['measured_s'] * 1e3:12.2f} {r['this_s'] * 1e3:10.2f} "
            f"{r['h100_s'] * 1e3:10.2f} {ratio[0]:7.2f} {ratio[1]:7.2f}"
        )
    for e in result["longest"]:
        pred = "  ".join(f"{k} {e[k] * 1e3:.2f} ms" for k in preds if e[k] is not None)
        print(f"  {e['name'][:60]:60s} {e['measured_s'] * 1e3:8.2f} ms  {pred}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    shutdown(0)


if __name__ == "__main__":
    main()
