"""Per-rank peak memory of the main job's model under context parallelism (cp = 1, 2, 4) at one sequence length.

The model of ``shardflow train`` at its defaults (the Llama; AdamW; float32) with one sequence of ``--seq-len``
tokens per step (``--batch-size 1``: the logits stay split over cp, docs/concepts.md#context-parallelism), planned
under ``--strategy cp`` (cp = 1: one device). For rank 0: the peak of all its live buffers during a step (the local
executor's ledger: weights, gradients, optimizer state, activations, the gathered keys and values, communication
buffers) and what of it is the state (parameters + gradients + optimizer state, replicated over cp). Every rank
runs in this one process (the local executor): memory is counted per rank by the ledger, not read from the
operating system.

Usage::

    python benchmarks/context.py              # writes the section "Context parallelism: memory per rank"
    python benchmarks/context.py --no-write   # prints it only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from fsdp import main_job  # noqa: E402
from harness import machine, verdict, write_section  # noqa: E402
from ranks import state_bytes  # noqa: E402

DEGREES = (1, 2, 4)


def measure(cp: int, seq_len: int, form: str = "auto") -> dict:
    strategy, mesh = ("single", "d=1") if cp == 1 else ("cp", f"cp={cp}")
    ex, s, batch = main_job(strategy, mesh, seq_len=seq_len, batch_size=1, cp_attention=form)
    t0 = time.perf_counter()
    ex.step(batch)
    comms = s.lower().programs[0].comms
    return {
        "cp": cp,
        "form": form,
        "peak": ex.peak_bytes[0],
        "state": sum(state_bytes(ex.dg, 0).values()),
        "seconds": time.perf_counter() - t0,
        "params": sum(p.numel() for p in s.model.parameters()),
        "sent": sum(c.nbytes for c in comms if c.axis == "cp"),
        "kinds": sorted({str(c.family) for c in comms if c.axis == "cp"}),
    }


def forms_section(rows: list[dict], seq_len: int) -> list[str]:
    """The attention forms side by side at each degree: rank 0's peak and the bytes it sends over cp per step."""
    lines = [
        "",
        f"**The attention forms** (`--cp-attention`, docs/concepts.md#context-parallelism), the same sequence of "
        f"{seq_len:,} tokens: rank 0's peak and the bytes it sends over cp in one step (forward and backward; every "
        f"rank sends as much).",
        "",
        "| cp | form | peak (B) | peak − state (B) | sent over cp (B) | collectives over cp |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cp']} | {r['form']} | {r['peak']:,} | {r['peak'] - r['state']:,} | {r['sent']:,} | "
            f"{', '.join(r['kinds'])} |"
        )
    pairs = [
        (a, b) for a in rows for b in rows if a["cp"] == b["cp"] and (a["form"], b["form"]) == ("all_gather", "ring")
    ]
    lines += [
        "",
        "The ring (docs/lowering.md#16-ring-attention---cp-attention-ring) keeps one block of keys and values at a "
        "time where the all-gather form keeps them whole until the backward: rank 0's peak − state is "
        + ", ".join(
            f"{(b['peak'] - b['state']) / (a['peak'] - a['state']):.3f} × the all-gather form's at cp = {a['cp']}"
            for a, b in pairs
        )
        + "; it sends more ("
        + ", ".join(f"{b['sent'] / a['sent']:.3f} ×" for a, b in pairs)
        + "): the backward passes the blocks around again instead of keeping them. The peak is the ledger of the "
        "program's buffers; what torch's autograd keeps inside a recorded attention (its attention weights) is not "
        "in it, and the ring records none (each block's backward recomputes it).",
    ]
    return lines


def section(rows: list[dict], seq_len: int, seconds: float) -> str:
    m = machine()
    one = rows[0]
    lines = [
        "## Context parallelism: memory per rank",
        "",
        f"`python benchmarks/context.py`: the main job's Llama at `shardflow train`'s defaults ({one['params']:,} "
        f"parameters, AdamW, float32) on one sequence of {seq_len:,} tokens per step, under `--strategy cp` "
        f"(docs/concepts.md#context-parallelism; cp = 1: one device), rank 0. Peak = the largest sum of the rank's "
        f"live buffers during a step (the local executor's ledger); state = parameters + gradients + optimizer "
        f"state (replicated over cp); the rest is activations, the gathered keys and values and communication "
        f"buffers. One process runs every rank.",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, {m['date']}; {seconds:.0f} s.",
        "",
        "| cp | peak (B) | state (B) | peak − state (B) | (peak − state) ÷ cp = 1's |",
        "|---|---|---|---|---|",
    ]
    base = one["peak"] - one["state"]
    for r in rows:
        rest = r["peak"] - r["state"]
        lines.append(f"| {r['cp']} | {r['peak']:,} | {r['state']:,} | {rest:,} | {rest / base:.3f} |")
    last = rows[-1]
    lines += [
        "",
        "Target (issue #38): activation memory per rank falls as 1/cp — measured "
        + ", ".join(f"{(r['peak'] - r['state']) / base:.3f} at cp = {r['cp']}" for r in rows[1:])
        + f" ({verdict(all((r['peak'] - r['state']) / base <= 1.05 / r['cp'] for r in rows[1:]))}, within 5 % of 1/cp). "
        f"Under the default form each device holds every key and value of one attention while it runs (all-gather; "
        f"`--cp-attention ring` holds one block at a time: below), small next to the rest at this width; the state "
        f"is replicated over cp ({last['state']:,} B on every rank; `fsdp,cp` shards it).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024, help="tokens of the one sequence per step")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    rows = []
    for cp in DEGREES:
        rows.append(measure(cp, args.seq_len))
        print(f"cp={cp}: peak {rows[-1]['peak']:,} B, state {rows[-1]['state']:,} B", file=sys.stderr)
    # all_to_all needs cp to divide the key/value heads (the main job's Llama has 2): cp = 2 only
    cases = [(2, "all_gather"), (2, "all_to_all"), (2, "ring"), (4, "all_gather"), (4, "ring")]
    forms = [measure(cp, args.seq_len, form) for cp, form in cases]
    text = section(rows, args.seq_len, time.monotonic() - t0) + "\n".join(forms_section(forms, args.seq_len)) + "\n"
    print(text)
    if not args.no_write:
        write_section(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
