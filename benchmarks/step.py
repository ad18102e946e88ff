"""Single-device training step of the tiny Hugging Face Llama: shardflow's local executor against eager PyTorch.

One step = forward + backward + SGD update (lr 1e-3, no momentum) + reading the loss, float32, one intra-op
thread. Eager: ``LlamaForCausalLM(**batch).loss.backward()`` and ``torch.optim.SGD``. shardflow: the model captured
(``shardflow.capture.capture``), planned on one device (``make_plan(graph, mesh "d=1", "single")``), lowered and run
by ``LocalExecutor``. Both start from the same weights; the first two losses are compared. With ATen-sized ops (the
tiny Llama's step is 442 instructions) the per-op overhead of the executor is what this measures.

Each measurement runs in a fresh process (a *session*) that warms both variants up and then times them in
interleaved rounds (``harness.interleave``, order rotating); the ratio shardflow ÷ eager is taken per round, so
both sides of a ratio saw the same machine load. ``--compare NAME=DIR`` runs the same session with the
shardflow of another checkout (e.g. ``git archive`` of an older commit unpacked in DIR) for before/after figures.

Usage::

    python benchmarks/step.py                          # writes the section of docs/benchmarks.md
    python benchmarks/step.py --no-write --rounds 5
    python benchmarks/step.py --compare before=/tmp/old_tree
    python benchmarks/step.py --device cuda              # on a GPU: its own section ("... on a GPU")
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
HEADING = {"cpu": "## Single-device step of the tiny Llama", "cuda": "## Single-device step of the tiny Llama on a GPU"}
SIZES = ((2, 8), (8, 64), (16, 128))  # (batch, sequence): the tests' batch, then larger ones
LR = 1e-3
TARGET = 1.1  # shardflow ÷ eager


def session(tree: Path, sizes, rounds: int, iters: int, device: str = "cpu") -> dict:
    """Times eager and shardflow (imported from ``tree``) in this process, both on ``device`` (cpu or cuda: the
    model, the batch and every buffer of the executor); per size: samples (s) and losses. Each step ends reading
    the loss (``.item()``), which waits for the GPU."""
    sys.path[:0] = [str(tree), str(ROOT / "benchmarks")]
    import torch
    from harness import Variant, interleave, machine
    from llama import llama, tokens

    import shardflow
    from shardflow.capture import capture
    from shardflow.lower import lower_step
    from shardflow.parallel.mesh import Mesh
    from shardflow.parallel.pcg import build_pcg
    from shardflow.reference import weights_of
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.runtime.local import LocalExecutor
    from shardflow.strategy import make_plan, resolve

    assert Path(shardflow.__file__).resolve().is_relative_to(tree.resolve()), shardflow.__file__
    torch.set_num_threads(1)
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    out = {"machine_start": machine(), "sizes": [], "device": device, "gpu": gpu}
    for batch_size, seq in sizes:
        model = llama().to(device)
        batch = {k: v.to(device) for k, v in tokens(batch_size, seq).items()}
        graph = capture(model, batch)
        mesh, cfg = Mesh.parse("d=1"), OptimizerConfig("sgd", LR)
        step = lower_step(build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "single"), graph, mesh)), cfg.slots)
        ex = LocalExecutor(step, cfg, device=torch.device(device))
        ex.load(weights_of(model, graph))
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def eager() -> float:
            opt.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            return loss.item()

        losses = {"eager": [eager(), eager()], "shardflow": [ex.step(batch), ex.step(batch)]}
        samples = interleave(
            [Variant("eager", eager), Variant("shardflow", lambda: ex.step(batch))], rounds, iters, warmup=3, rank=0
        )
        out["sizes"].append(
            {
                "batch": batch_size,
                "seq": seq,
                "samples": samples,
                "losses": losses,
                "instructions": len(step.programs[0].instrs),
                "ops": op_times({"eager": eager, "shardflow": lambda: ex.step(batch)}),
            }
        )
        print(
            f"  {batch_size}×{seq}: eager {statistics.median(samples['eager']) * 1e3:.2f} ms, shardflow "
            f"{statistics.median(samples['shardflow']) * 1e3:.2f} ms",
            file=sys.stderr,
        )
    out["machine_end"] = machine()
    return out


def op_times(variants: dict, steps: int = 5, rounds: int = 3) -> dict[str, dict[str, list[float]]]:
    """Per variant (name → one step), ATen op → [calls, self CPU time in ms] per step: ``torch.profiler`` over
    ``steps`` steps, in ``rounds`` rounds alternating the variants, each op's time the smallest of its rounds (the
    round least disturbed). On a GPU the CPU side only: where the time of launching goes."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    for _ in range(rounds):
        for name, step in variants.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step()
            for e in prof.key_averages():
                if e.key.startswith("aten::"):
                    ms = e.self_cpu_time_total / 1e3 / steps
                    have = out[name].get(e.key)
                    out[name][e.key] = [e.count / steps, ms if have is None else min(have[1], ms)]
    return out


def run_session(tree: Path, args) -> dict:
    """:func:`session` in a fresh process."""
    cmd = [
        sys.executable,
        __file__,
        "--session",
        str(tree),
        "--rounds",
        str(args.rounds),
        "--iters",
        str(args.iters),
        "--device",
        args.device,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout)


def _ratios(size: dict) -> list[float]:
    return [s / e for s, e in zip(size["samples"]["shardflow"], size["samples"]["eager"])]


def _text(rs: list[float]) -> str:
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}–{max(rs):.2f})"


def section(results: dict[str, dict], args) -> str:
    now = results["this tree"]
    m0, m1 = now["machine_start"], now["machine_end"]
    where = f", on {now['gpu']} (`--device cuda`)" if now.get("gpu") else ""
    lines = [
        HEADING[args.device],
        "",
        "The tiny Llama of the tests (`transformers.LlamaForCausalLM`: 2 layers, hidden 64, 4 heads, 2 key/value "
        "heads, MLP 128, vocabulary 96), float32, one intra-op thread; one step = forward + backward + SGD update "
        f"(lr {LR:g}) + reading the loss. Eager: the module and `torch.optim.SGD`. shardflow: the captured "
        f"graph planned on one device (`d=1`, strategy `single`), lowered, run by `LocalExecutor`{where}.",
        "",
        f"Machine: {m0['cores']} cores ({m0['cpu']}, {m0['arch']}), Python {m0['python']}, torch {m0['torch']}, "
        f"{m0['date'].replace('T', ' ')}; load average {m0['load']:.2f} at the start of the session, "
        f"{m1['load']:.2f} at the end.",
        "",
        f"Timing: each session is a fresh process; both variants warmed up, then {args.rounds} interleaved rounds "
        f"(order rotating), a sample = the mean of {args.iters} steps back to back; the ratio is the median "
        "(min–max) of the per-round ratios shardflow ÷ eager.",
        "",
        "Reproduce: `python benchmarks/step.py" + (" --device cuda" if where else "") + "`.",
        "",
        "| batch × sequence | instructions | eager step median (ms) | shardflow step median (ms) | "
        "shardflow ÷ eager (per round) | first two losses (eager / shardflow) |",
        "|---|---:|---:|---:|---|---|",
    ]
    for size in now["sizes"]:
        e, s = size["samples"]["eager"], size["samples"]["shardflow"]
        losses = " / ".join(", ".join(f"{x:.5f}" for x in size["losses"][k]) for k in ("eager", "shardflow"))
        lines.append(
            f"| {size['batch']} × {size['seq']} | {size['instructions']} | {statistics.median(e) * 1e3:.2f} | "
            f"{statistics.median(s) * 1e3:.2f} | {_text(_ratios(size))} | {losses} |"
        )
    medians = {(s["batch"], s["seq"]): round(statistics.median(_ratios(s)), 2) for s in now["sizes"]}
    verdicts = [f"{b} × {t}: {m:.2f}, {'**met**' if m <= TARGET else '**missed**'}" for (b, t), m in medians.items()]
    lines += ["", f"Target: shardflow ≤ {TARGET}× eager. " + "; ".join(verdicts) + "."]
    big = now["sizes"][-1]
    if "ops" in big:
        e, s_ = big["ops"]["eager"], big["ops"]["shardflow"]
        gap = {k: s_.get(k, [0, 0.0])[1] - e.get(k, [0, 0.0])[1] for k in set(e) | set(s_)}
        top = sorted(gap, key=lambda k: -abs(gap[k]))[:10]
        total = (sum(v[1] for v in s_.values()), sum(v[1] for v in e.values()))
        lines += [
            "",
            f"Where the time goes at {big['batch']} × {big['seq']} (torch.profiler: self CPU time of ATen ops "
            "per step, 5 steps in each of 3 rounds alternating the two, each op's smallest round; shardflow "
            f"{total[0]:.2f} ms, eager {total[1]:.2f} ms in ATen ops; the ten largest differences):",
            "",
            "| ATen op | eager calls | eager ms | shardflow calls | shardflow ms | shardflow − eager ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for k in top:
            ec, et = e.get(k, [0, 0.0])
            sc, st = s_.get(k, [0, 0.0])
            lines.append(f"| `{k}` | {ec:g} | {et:.2f} | {sc:g} | {st:.2f} | {gap[k]:+.2f} |")
        step_gap = (statistics.median(big["samples"]["shardflow"]) - statistics.median(big["samples"]["eager"])) * 1e3
        lines += [
            "",
            f"The step-time gap at this size is {step_gap:+.2f} ms (medians of the rounds above); the ATen "
            f"ops account for {total[0] - total[1]:+.2f} ms of it (profiled, so only roughly), the rest, "
            f"{step_gap - (total[0] - total[1]):+.2f} ms, lies outside them: the executor's Python for each of "
            f"its {big['instructions']} instructions (compiled segments calling hand-written vjps) against "
            "eager's autograd engine in C++.",
        ]
    if len(results) > 1:
        lines += [
            "",
            "Before/after (shardflow ÷ eager per round, each tree in its own session):",
            "",
            "| tree | " + " | ".join(f"{s['batch']} × {s['seq']}" for s in now["sizes"]) + " |",
            "|---" * (len(now["sizes"]) + 1) + "|",
        ]
        for name, res in results.items():
            lines.append(f"| {name} | " + " | ".join(_text(_ratios(s)) for s in res["sizes"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds per size (default 10)")
    p.add_argument("--iters", type=int, default=5, help="steps per sample (default 5)")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also time the shardflow of the checkout in DIR (a row NAME of the before/after table)",
    )
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both run (default cpu; cuda writes its own section)",
    )
    p.add_argument("--session", metavar="TREE", help=argparse.SUPPRESS)  # internal: one session, JSON on stdout
    args = p.parse_args(argv)
    if args.session:
        print(json.dumps(session(Path(args.session), SIZES, args.rounds, args.iters, args.device)))
        return 0
    trees = {"this tree": ROOT, **dict(c.split("=", 1) for c in args.compare)}
    results = {}
    for name, tree in trees.items():
        print(f"session: {name} ({tree})", file=sys.stderr)
        results[name] = run_session(Path(tree), args)
    text = section(results, args)
    print(text)
    if not args.no_write:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from harness import write_section

        write_section(Path(args.out), text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
