"""Single-device step: shardflow's executor against eager PyTorch on the main job's model and on a model that is
all overhead (issue #16's single-device targets).

Two models, float32, one intra-op thread, one step = forward + backward + update + reading the loss:

* *main job*: the Llama of ``shardflow train`` at its defaults (``TrainConfig()``: 950,912 parameters, batch
  16 × 64 tokens of the default corpus, AdamW). The main job computes the global gradient norm every step (it logs
  it), so eager does too (``torch.nn.utils.get_total_norm`` of the gradients, what a training loop logging it calls).
  shardflow: ``setup`` on one device (strategy ``single``), ``Setup.lower``, ``LocalExecutor``; eager: the same
  weights (``Setup.whole_model``) with ``torch.optim.AdamW``.
* *MLP 4×8*: ``shardflow.models.MLP(4, 4, 4, 8)`` (width 4, 8 linear layers, ReLU, cross-entropy) on a batch of 8,
  SGD lr 0.01: its torch ops take microseconds, so the step measures the per-instruction cost of each side.

Each tree is timed in a fresh process (a *session*): both variants warmed up, then interleaved rounds (order
rotating); the ratio is the median (min–max) of the per-round ratios shardflow ÷ eager. ``--compare NAME=DIR``
times the shardflow of another checkout (e.g. ``git archive`` of an older commit unpacked in DIR) in its own
session, for before/after figures.

Usage::

    python benchmarks/overhead.py                      # writes its section of docs/benchmarks.md
    python benchmarks/overhead.py --no-write --rounds 5
    python benchmarks/overhead.py --compare before=/tmp/old_tree
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Single-device step: main job and pure overhead"
TARGETS = {"main job": 1.02, "MLP 4×8": 1.2}  # shardflow ÷ eager, issue #16


def models():
    """name → (shardflow step, eager step, instructions); both start from the same weights."""
    import torch

    from shardflow.api import torch_optimizer
    from shardflow.capture import capture
    from shardflow.lower import lower_step
    from shardflow.models import MLP
    from shardflow.parallel.mesh import Mesh
    from shardflow.parallel.pcg import build_pcg
    from shardflow.reference import weights_of
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.runtime.local import LocalExecutor
    from shardflow.train.config import TrainConfig
    from shardflow.train.data import Split
    from shardflow.train.recipe import setup

    s = setup(TrainConfig(strategy="single", nproc=1), 1)
    lowered = s.lower()
    ex = LocalExecutor(lowered, s.optimizer)
    ex.load(s.initial_weights())
    llama = s.whole_model()
    opt = torch_optimizer(s.optimizer, llama.parameters())
    batch = s.batch(Split.TRAIN, 0)

    def llama_eager() -> float:
        opt.zero_grad()
        loss = llama(**batch).loss
        loss.backward()
        torch.nn.utils.get_total_norm([p.grad for p in llama.parameters()])
        opt.step()
        return loss.item()

    torch.manual_seed(0)
    mlp = MLP(4, 4, 4, 8)
    data = {"x": torch.randn(8, 4), "y": torch.randint(0, 4, (8,))}
    graph = capture(mlp, data)
    cfg = OptimizerConfig("sgd", 0.01)
    mesh = Mesh.parse("d=1")
    mlp_step = lower_step(build_pcg(graph, mesh), cfg.slots)
    mx = LocalExecutor(mlp_step, cfg)
    mx.load(weights_of(mlp, graph))
    mopt = torch.optim.SGD(mlp.parameters(), lr=0.01)

    def mlp_eager() -> float:
        mopt.zero_grad()
        loss = mlp(**data)
        loss.backward()
        mopt.step()
        return loss.item()

    return {
        "main job": (lambda: ex.step(batch), llama_eager, len(lowered.programs[0].instrs)),
        "MLP 4×8": (lambda: mx.step(data), mlp_eager, len(mlp_step.programs[0].instrs)),
    }


def session(tree: Path, rounds: int) -> dict:
    """Times every model's two variants with the shardflow of ``tree``, in this process."""
    sys.path[:0] = [str(tree), str(ROOT / "benchmarks")]
    import torch
    from harness import Variant, interleave, machine

    import shardflow

    assert Path(shardflow.__file__).resolve().is_relative_to(tree.resolve()), shardflow.__file__
    torch.set_num_threads(1)
    out = {"machine_start": machine(), "models": {}}
    for name, (sf, eager, instrs) in models().items():
        losses = {"eager": [eager(), eager()], "shardflow": [sf(), sf()]}
        iters = 3 if name == "main job" else 100
        samples = interleave([Variant("eager", eager), Variant("shardflow", sf)], rounds, iters, warmup=3, rank=0)
        out["models"][name] = {"samples": samples, "losses": losses, "instructions": instrs, "iters": iters}
        print(
            f"  {name}: eager {statistics.median(samples['eager']) * 1e3:.3f} ms, shardflow "
            f"{statistics.median(samples['shardflow']) * 1e3:.3f} ms",
            file=sys.stderr,
        )
    out["machine_end"] = machine()
    return out


def _ratios(m: dict) -> list[float]:
    return [s / e for s, e in zip(m["samples"]["shardflow"], m["samples"]["eager"])]


def _text(rs: list[float]) -> str:
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}–{max(rs):.2f})"


def section(results: dict[str, dict], rounds: int) -> str:
    now = results["this tree"]
    m0, m1 = now["machine_start"], now["machine_end"]
    lines = [
        HEADING,
        "",
        " ".join(__doc__.split("\n\n")[1].split()),
        "",
        *(f"* {' '.join(item.split())}" for item in __doc__.split("\n\n")[2].split("* ")[1:]),
        "",
        f"Machine: {m0['cores']} cores ({m0['cpu']}, {m0['arch']}), Python {m0['python']}, torch {m0['torch']}, "
        f"{m0['date'].replace('T', ' ')}; load average {m0['load']:.2f} at the start of the session, "
        f"{m1['load']:.2f} at the end. {rounds} interleaved rounds; a sample = the mean of "
        + ", ".join(f"{m['iters']} steps ({n})" for n, m in now["models"].items())
        + ".",
        "",
        "Reproduce: `python benchmarks/overhead.py`.",
        "",
        "| model | instructions | eager step median (ms) | shardflow step median (ms) | shardflow ÷ eager (per "
        "round) | target | first two losses (eager / shardflow) |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for name, m in now["models"].items():
        e, s = m["samples"]["eager"], m["samples"]["shardflow"]
        med = round(statistics.median(_ratios(m)), 2)
        losses = " / ".join(", ".join(f"{x:.5f}" for x in m["losses"][k]) for k in ("eager", "shardflow"))
        verdict = "**met**" if med <= TARGETS[name] else "**missed**"
        lines.append(
            f"| {name} | {m['instructions']} | {statistics.median(e) * 1e3:.3f} | "
            f"{statistics.median(s) * 1e3:.3f} | {_text(_ratios(m))} | ≤ {TARGETS[name]}: {verdict} | "
            f"{losses} |"
        )
    lines += [
        "",
        "The executor's own cost is what the MLP measures: its 95 instructions run as one compiled segment "
        "(issue #16), every update in one fused call. On the main job the two run the same ATen kernels: "
        "capture lifts the causal mask the traced Llama builds as a tensor to sdpa's causal flag, and the "
        "key/value heads its `repeat_kv` copies over the query heads to grouped-query attention on the "
        "unrepeated heads (`shardflow/capture/lift_table.py`), as the eager forward calls sdpa (before that "
        "lift, the masked attention on repeated heads cost their copies, the sum of their gradients and a "
        "slower flash-attention backward: +1.3 ms of 13 ms, 1.04 × eager). What is left is in the ATen ops: "
        "fresh buffers filled where autograd reuses them, the decomposed cross-entropy's small ops (`where`, "
        "`gather`), and page faults: the four [1024, 1024] buffers of the loss (logits, log-softmax, their "
        "gradients) come back from the kernel as fresh pages in some steps (200–1,000 minor faults per "
        "step, eager none: glibc returns the top of its heap when the step's frees leave it large); keeping "
        "the heap (`MALLOC_TRIM_THRESHOLD_` with a fixed `MALLOC_MMAP_THRESHOLD_`) cut them to 20 per step "
        "but moved the ratio by less than its noise, so shardflow leaves the allocator alone.",
    ]
    if len(results) > 1:
        lines += [
            "",
            "Before/after (shardflow ÷ eager per round, each tree in its own session):",
            "",
            "| tree | " + " | ".join(now["models"]) + " |",
            "|---" * (len(now["models"]) + 1) + "|",
        ]
        for name, res in results.items():
            lines.append(f"| {name} | " + " | ".join(_text(_ratios(m)) for m in res["models"].values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also time the shardflow of the checkout in DIR (a row NAME of the before/after table)",
    )
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--session", metavar="TREE", help=argparse.SUPPRESS)  # internal: one session, JSON on stdout
    args = p.parse_args(argv)
    if args.session:
        print(json.dumps(session(Path(args.session), args.rounds)))
        return 0
    results = {}
    for name, tree in {"this tree": ROOT, **dict(c.split("=", 1) for c in args.compare)}.items():
        print(f"session: {name} ({tree})", file=sys.stderr)
        cmd = [sys.executable, __file__, "--session", str(tree), "--rounds", str(args.rounds)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        results[name] = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout)
    text = section(results, args.rounds)
    print(text)
    if not args.no_write:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from harness import write_section

        write_section(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
