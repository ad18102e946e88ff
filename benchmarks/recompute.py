"""Activation checkpointing (``--ac block``, ``--ac selective``): memory held during a step and step time.

The model of ``shardflow train`` at its defaults (the Llama; AdamW; float32), one device and fsdp=4 (rank 0), with
``--ac none``, ``--ac selective`` and ``--ac block``:

* ledger peak — the largest sum of the rank's live buffers during a step (the local executor's ledger: state,
  gathered weights, activations, communication buffers; what the forward's autograd records keep inside an op
  beyond its inputs is not a buffer and not counted);
* process peak — one device only, each variant in a fresh process: the operating system's peak resident set
  (``VmHWM``, reset through ``/proc/self/clear_refs`` after a warm-up step and ``malloc_trim``) above the resident
  set before the measured steps: everything the step allocates, autograd's records included (Linux, glibc);
* step time — one device, the variants in one process, warmed up, then interleaved rounds (order rotating); the
  ratio to none is taken per round (median and range).

Then predicted (the shipped ``h100`` spec, ``Pipeline.predict``): a 3-block copy of the Llama 3 8B shape (width 4096,
32 heads, 8 key/value heads, MLP 14336, vocabulary 128256), 16 sequences of 8192, bf16 with float32 master weights,
AdamW, on fsdp=8 and tp=8 — the sizes the search meets (docs/search.md).

Usage::

    python benchmarks/recompute.py              # writes the section "Activation checkpointing" of docs/benchmarks.md
    python benchmarks/recompute.py --no-write   # prints it only
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from fsdp import main_job  # noqa: E402
from harness import Variant, interleave, machine, write_section  # noqa: E402

from shardflow.lower.dynamic import ActivationCheckpointing  # noqa: E402
from shardflow.lower.pass_expansion import checkpoint_blocks  # noqa: E402

MESHES = [("single", "d=1"), ("fsdp", "fsdp=4")]
MODES = tuple(map(str, ActivationCheckpointing))


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def process_peak(ac: str) -> int:
    """Peak resident bytes of two one-device steps above the resident set before them (run in a fresh process)."""
    ex, _, batch = main_job("single", "d=1", ac=ac)
    ex.step(batch)  # warm-up: the kernels' first-call work
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back to the OS: the resident set is what is live
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    for _ in range(2):
        ex.step(batch)
    return _status("VmHWM") - before


def predicted() -> list[tuple[str, str, float, float]]:
    """(mesh, mode, step seconds, peak bytes) of the 8B-shaped copy on the h100 spec (module docstring)."""
    import dataclasses

    from shardflow.capture import at_dtype, capture
    from shardflow.parallel.mesh import Mesh
    from shardflow.pipeline import Pipeline
    from shardflow.runtime.materialize import materialize
    from shardflow.simulator.estimate import cost_model
    from shardflow.simulator.machine import MachineSpec
    from shardflow.train.config import TrainConfig, optimizer_config, step_options
    from shardflow.train.family import Feed
    from shardflow.train.recipe import build_model

    spec = MachineSpec.named("h100")
    cfg = TrainConfig(
        layers=3, embd=4096, heads=32, kv_heads=8, mlp=14336, vocab_size=128256, seq_len=8192, batch_size=16,
        dtype="bf16", optimizer="adamw", nproc=8,
    )  # fmt: skip
    _, _, module = build_model(cfg, cfg.vocab_size, None)
    materialize(module, cfg.seed)
    ids = torch.zeros(cfg.batch_size, cfg.seq_len, dtype=torch.long)
    module, inputs, _ = at_dtype(module, Feed.CAUSAL_LM.inputs(ids, ids), torch.bfloat16)
    graph = capture(module, inputs)
    out = []
    for mesh, strategy in (("fsdp=8", "fsdp"), ("tp=8", "tp")):
        m = Mesh.parse(mesh)
        base = step_options(cfg, cost_model(spec, m))
        for ac in MODES:
            options = dataclasses.replace(base, ac=ActivationCheckpointing(ac))
            p = Pipeline.planned(graph, m, options, optimizer_config(cfg), strategy).predict(spec, ids.numel())
            out.append((mesh, ac, p.step_seconds, max(p.peak_bytes)))
            print(f"predicted {mesh} --ac {ac}: {p.step_seconds * 1e3:.2f} ms", file=sys.stderr)
    return out


def section(ledger: dict, rss: dict, times: dict, blocks: int, params: int, seconds: float, rounds: int, pred) -> str:
    m = machine()
    ratios = {ac: [x / n for x, n in zip(times[ac], times["none"])] for ac in ("selective", "block")}
    lines = [
        "## Activation checkpointing",
        "",
        f"`python benchmarks/recompute.py`: the main job's Llama at `shardflow train`'s defaults ({params:,} "
        f"parameters, {blocks} blocks, AdamW, float32), `--ac none` against `--ac selective` (each block's cheap ops "
        f"run again before its backward, its matmuls', attention's and communication's outputs kept) and `--ac "
        f"block` (each block's forward run again right before its backward). Ledger peak: the largest sum of rank "
        f"0's live buffers during a step (local executor). Process peak: one device, each variant in a fresh "
        f"process, the peak resident set of two steps above the resident set before them (everything the step "
        f"allocates, autograd's records inside an op included). Step time: one device, {rounds} interleaved "
        f"rounds, each mode ÷ none per round.",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, {m['date']}; {seconds:.0f} s.",
        "",
        "| mesh | ledger peak, none | selective | block | selective ÷ none | block ÷ none |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mesh, peaks in ledger.items():
        lines.append(
            f"| `{mesh}` | {peaks['none']:,} | {peaks['selective']:,} | {peaks['block']:,} | "
            f"**{peaks['selective'] / peaks['none']:.3f}** | **{peaks['block'] / peaks['none']:.3f}** |"
        )
    step = {ac: statistics.median(t) * 1e3 for ac, t in times.items()}
    lines += [
        "",
        f"One device, process peak above the resting set: none {rss['none']:,} B, selective {rss['selective']:,} B "
        f"(**{rss['selective'] / rss['none']:.3f}**), block {rss['block']:,} B (**{rss['block'] / rss['none']:.3f}**). "
        f"Step time: none {step['none']:.1f} ms, selective {step['selective']:.1f} ms, block {step['block']:.1f} ms; "
        + "; ".join(
            f"{ac} ÷ none **{statistics.median(r):.2f}** ({min(r):.2f}–{max(r):.2f})" for ac, r in ratios.items()
        )
        + ". Block runs a second forward of every block, about a third more compute where the backward costs twice "
        "the forward; selective runs again only the ops between the matmuls.",
        "",
        "Predicted on the shipped `h100` spec (`Pipeline.predict`): a 3-block copy of the Llama 3 8B shape, 16 "
        "sequences of 8192, bf16 with float32 master weights, AdamW — the sizes `--strategy auto` meets "
        "(docs/search.md).",
        "",
        "| mesh | `--ac` | step (ms) | peak (GiB) |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {mesh} | {ac} | {sec * 1e3:.2f} | {peak / 2**30:.2f} |" for mesh, ac, sec, peak in pred]
    per = {(mesh, ac): (sec, peak) for mesh, ac, sec, peak in pred}
    for mesh in dict.fromkeys(x[0] for x in pred):
        (tn, pn), (ts, ps), (tb, pb) = (per[mesh, ac] for ac in ("none", "selective", "block"))
        lines.append(
            f"\nOn {mesh}, per block: selective saves {(pn - ps) / 3 / 2**30:.2f} GiB for {(ts - tn) / 3 * 1e3:.1f} ms, "
            f"block {(pn - pb) / 3 / 2**30:.2f} GiB for {(tb - tn) / 3 * 1e3:.1f} ms."
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds (default 8)")
    p.add_argument("--process-peak", choices=MODES, help=argparse.SUPPRESS)  # internal: one fresh-process measurement
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.process_peak:
        print(json.dumps(process_peak(args.process_peak)))
        return 0
    t0 = time.monotonic()
    ledger: dict[str, dict[str, int]] = {}
    runs = {}
    for strategy, mesh in MESHES:
        for ac in MODES:
            ex, s, batch = main_job(strategy, mesh, ac=ac)
            ex.step(batch)
            ledger.setdefault(mesh, {})[ac] = ex.peak_bytes[0]
            if mesh == "d=1":
                runs[ac] = (ex, batch)
            print(f"{mesh} --ac {ac}: ledger peak {ex.peak_bytes[0]:,} B", file=sys.stderr)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rss = {
        ac: json.loads(
            subprocess.run(
                [sys.executable, __file__, "--process-peak", ac], check=True, text=True, stdout=subprocess.PIPE, env=env
            ).stdout
        )
        for ac in MODES
    }
    times = interleave(
        [Variant(ac, lambda ex=ex, b=b: ex.step(b)) for ac, (ex, b) in runs.items()], args.rounds, 2, warmup=2, rank=0
    )
    text = section(
        ledger,
        rss,
        times,
        len(set(checkpoint_blocks(s.pcg).values())),
        sum(p.numel() for p in s.model.parameters()),
        time.monotonic() - t0,
        args.rounds,
        predicted(),
    )
    print(text)
    if not args.no_write:
        write_section(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
