"""Activation checkpointing (``--ac block``) on the main job's model: memory held during a step and step time.

The model of ``shardflow train`` at its defaults (the Llama; AdamW; float32), one device and fsdp=4 (rank 0), with
``--ac none`` and ``--ac block``:

* ledger peak — the largest sum of the rank's live buffers during a step (the local executor's ledger: state,
  gathered weights, activations, communication buffers; what the forward's autograd records keep inside an op
  beyond its inputs is not a buffer and not counted);
* process peak — one device only, each variant in a fresh process: the operating system's peak resident set
  (``VmHWM``, reset through ``/proc/self/clear_refs`` after a warm-up step and ``malloc_trim``) above the resident
  set before the measured steps: everything the step allocates, autograd's records included (Linux, glibc);
* step time — one device, both variants in one process, warmed up, then interleaved rounds (order rotating); the
  ratio block ÷ none is taken per round (median and range).

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


def section(ledger: dict, rss: dict, times: dict, blocks: int, params: int, seconds: float, rounds: int) -> str:
    m = machine()
    ratios = [b / n for b, n in zip(times["block"], times["none"])]
    lines = [
        "## Activation checkpointing",
        "",
        f"`python benchmarks/recompute.py`: the main job's Llama at `shardflow train`'s defaults ({params:,} "
        f"parameters, {blocks} blocks, AdamW, float32), `--ac none` against `--ac block` (each block's forward "
        f"run again right before its backward). Ledger peak: the largest sum of rank 0's live buffers during a "
        f"step (local executor). Process peak: one device, each variant in a fresh process, the peak resident "
        f"set of two steps above the resident set before them (everything the step allocates, autograd's records "
        f"inside an op included). Step time: one device, {rounds} interleaved rounds, block ÷ none per round.",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, {m['date']}; {seconds:.0f} s.",
        "",
        "| mesh | ledger peak, none | ledger peak, block | block ÷ none |",
        "|---|---|---|---|",
    ]
    for mesh, peaks in ledger.items():
        lines.append(
            f"| `{mesh}` | {peaks['none']:,} | {peaks['block']:,} | **{peaks['block'] / peaks['none']:.3f}** |"
        )
    lines += [
        "",
        f"One device, process peak above the resting set: none {rss['none']:,} B, block {rss['block']:,} B "
        f"(**{rss['block'] / rss['none']:.3f}**). Step time: none {statistics.median(times['none']) * 1e3:.1f} "
        f"ms, block {statistics.median(times['block']) * 1e3:.1f} ms; block ÷ none "
        f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}–{max(ratios):.2f}) — a second forward of every "
        f"block, about a third more compute where the backward costs twice the forward.",
        "",
    ]
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
    )
    print(text)
    if not args.no_write:
        write_section(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
