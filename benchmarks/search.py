"""``--strategy auto`` against the best preset, predicted: for each case the search's choice
(:func:`shardflow.search.search_model`) and the fastest plan among those a user can write by hand, both as the
simulator predicts them.

Cases: Llama 3 8B (32 layers, width 4096, 32 heads, 8 key/value heads, MLP 14336), 70B (80, 8192, 64, 8, 28672) and
405B (126, 16384, 128, 8, 53248) shapes, vocabulary 128256, sequence 8192, bf16 parameters with float32 reductions,
AdamW, on 8, 64, 256 and 512 H100s (the shipped ``h100`` machine spec). The global batch is 2 × world sequences of
8192 tokens for every model (2 sequences per device, as torchtitan's published 8B runs scale it; the same rule for
70B and 405B, for simplicity). Each model is built as benchmarks/anchors.py builds it (``build_model`` on the meta
device, ``materialize``, ``at_dtype``) but not planned: the module and its batch go to ``search_model``, with the
options ``step_options(cfg, cost_model(spec, dp=world))`` and ``optimizer_config(cfg)``. Plus the main job's Llama
(``TrainConfig()``'s defaults) on 2 and 4 ranks of this machine, searched as ``shardflow train --strategy auto`` does
(:func:`shardflow.train.recipe.auto_strategy`: ``MachineSpec.this``, the default corpus's first batch).

The best *preset* is the fastest outcome that fits whose candidate has no ``ac_blocks`` and no per-op placements
(docs/search.md#per-op-placements): every strategy, degree,
pipeline schedule and microbatch count with checkpointing of every block or none, and accumulation — what a user can
write by hand. The search picks the fastest fitting outcome, partial checkpointing (``--ac-blocks K``) included, so
auto ≤ best preset holds by construction; the section says where it does not.

Each case runs in its own process with a wall-clock limit (a timeout is recorded as such); its record is appended to
``--results`` (default benchmarks/results/search.jsonl, kept in the repository) as it ends, so a partial run
survives and a run of some cases keeps the other cases' rows: the section is rendered from the last record of each
case. A record carries its date and the machine's load (the 1-minute load average per core, the larger of its
start and end): a search time measured at a load above :data:`QUIET` per core is shown as void — the predicted
figures do not depend on the load, the seconds do.

Usage::

    python benchmarks/search.py                       # every case (small first), writes docs/benchmarks.md
    python benchmarks/search.py --cases main,8B       # some cases, in that order (by prefix: main, 8B, 70B/256, ...)
    python benchmarks/search.py --timeout 600         # per-case limit in seconds (default 600)
    python benchmarks/search.py --search-seconds 900  # the search's own time limit (docs/search.md#a-time-limit)
    python benchmarks/search.py --no-write            # print the section only
    python benchmarks/search.py --render-only         # rebuild the section from the last records
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import machine, write_section  # noqa: E402

SIZES = {
    "8B": dict(layers=32, embd=4096, heads=32, kv_heads=8, mlp=14336),
    "70B": dict(layers=80, embd=8192, heads=64, kv_heads=8, mlp=28672),
    "405B": dict(layers=126, embd=16384, heads=128, kv_heads=8, mlp=53248),
}
WORLDS = (8, 64, 256, 512)
CASES = [f"main/{w}" for w in (2, 4)] + [f"{m}/{w}" for m in SIZES for w in WORLDS]
HEADING = "## Search against the presets"
RESULTS = ROOT / "benchmarks" / "results" / "search.jsonl"
QUIET = 1.25  # load average per core up to which a search's seconds count (2 cores: the case and a little else)


def load_per_core() -> float:
    """This machine's 1-minute load average per core."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def is_preset(c) -> bool:
    """Whether candidate ``c`` is a plan a user writes by hand: no per-op placements, no partial checkpointing."""
    return c.ac_blocks is None and not c.placements


def in_doubt(result) -> int:
    """The presets screening left (docs/search.md#screening) whose promise is below the best preset ``result``
    predicted: where any, a preset it did not predict might be faster than that one."""
    fastest = min((o.prediction.step_seconds for o in result.outcomes if o.fits and is_preset(o.candidate)), default=0)
    return sum(is_preset(c) and p < fastest for c, p in result.left)


def summarize(result, model: str, world: int, batch: int, spec: str, wall: float, presets=None) -> dict:
    """The figures of one search: the choice, the best preset (``presets``' choice where given: a search for the
    fastest preset), the counts."""
    best = result.best
    fitting = [o for o in result.outcomes if o.fits and is_preset(o.candidate)]
    preset = presets.best if presets else min(fitting, key=lambda o: o.prediction.step_seconds, default=None)
    bounded = [o for o in result.outcomes if o.prediction is None and "bound" in o.refused]
    refused = [o for o in result.outcomes if o.prediction is None and "bound" not in o.refused]
    predicted = [o for o in result.outcomes if o.prediction is not None]

    def described(o) -> dict | None:
        if o is None:
            return None
        return {
            "flags": " ".join(o.candidate.flags()),
            "step_ms": o.prediction.step_seconds * 1e3,
            "peak_gib": max(o.prediction.peak_bytes) / 2**30,
        }

    return {
        "status": "ok",
        "model": model,
        "world": world,
        "batch": batch,
        "spec": spec,
        "budget_gib": result.budget / 2**30,
        "auto": described(best),
        "preset": described(preset),
        "ratio": best.prediction.step_seconds / preset.prediction.step_seconds if preset else None,
        "search_s": result.seconds,
        "wall_s": wall,
        "outcomes": len(result.outcomes),
        "predicted": len(predicted),
        "fit": sum(o.fits for o in predicted),
        "unsearched": result.unsearched,
        "screened": result.screened,
        # presets left by screening whose promise was below the best preset predicted: where any, a preset the
        # search did not predict might beat it (docs/search.md#screening)
        "presets_in_doubt": in_doubt(result),  # then the best preset is the preset search's (``presets``)
        "preset_search_s": presets.seconds if presets else None,
        "partial": sum(o.candidate.ac_blocks is not None for o in result.outcomes),
        "refused": len(refused),
        "bounded": len(bounded),
        "per_op": [  # every per-op candidate tried, capped ones included (docs/search.md#per-op-placements)
            {
                "flags": " ".join(o.candidate.flags()),
                "memory_level": o.candidate.memory_level,
                "step_ms": o.prediction.step_seconds * 1e3 if o.prediction else None,
                "peak_gib": max(o.prediction.peak_bytes) / 2**30 if o.prediction else None,
                "refused": o.refused,
            }
            for o in result.outcomes
            if o.candidate.placements
        ],
        "runners_up": [  # the best of each other strategy (SearchResult.alternatives), for the reading
            {**(described(o) if o.prediction else {"flags": " ".join(o.candidate.flags())}), "why": result.why(o)}
            for o in result.alternatives()
        ],
    }


def run_case(name: str, time_limit: float | None = None) -> dict:
    """One case, searched in this process (``time_limit``: the search's, docs/search.md#a-time-limit)."""
    import shardflow.search as searching
    from shardflow.search import SearchError

    seen: list = []  # every outcome as the search records it: why nothing fits, where nothing does
    inner = searching.search
    searching.search = lambda *a, **k: inner(*a, **{**k, "progress": seen.append})

    model, world = name.split("/")[0], int(name.split("/")[1])
    t0 = time.perf_counter()
    try:
        if model == "main":
            from shardflow.train.config import TrainConfig
            from shardflow.train.recipe import auto_strategy

            cfg = TrainConfig(strategy="auto", nproc=world, search_seconds=time_limit)
            _, result = auto_strategy(cfg, world, placements=True)
            return summarize(
                result, "main job's Llama", world, cfg.batch_size, result.spec.name, time.perf_counter() - t0
            )
        from shardflow.capture import at_dtype
        from shardflow.parallel.mesh import Mesh
        from shardflow.runtime.materialize import materialize
        from shardflow.search import search_model
        from shardflow.simulator.estimate import cost_model
        from shardflow.simulator.machine import MachineSpec
        from shardflow.train.config import TrainConfig, optimizer_config, step_options
        from shardflow.train.family import Feed
        from shardflow.train.recipe import build_model

        spec = MachineSpec.named("h100")
        batch = 2 * world
        cfg = TrainConfig(
            **SIZES[model],
            vocab_size=128256,
            seq_len=8192,
            batch_size=batch,
            dtype="bf16",
            optimizer="adamw",
            nproc=world,
        )
        options = step_options(cfg, cost_model(spec, Mesh.parse(f"dp={world}")))
        _, _, module = build_model(cfg, cfg.vocab_size, None)
        materialize(module, cfg.seed)
        ids = torch.zeros(batch, cfg.seq_len, dtype=torch.long)
        module, inputs, _ = at_dtype(module, Feed.CAUSAL_LM.inputs(ids, ids), torch.bfloat16)
        result = search_model(module, inputs, world, options, optimizer_config(cfg), spec, time_limit=time_limit)
        wall = time.perf_counter() - t0
        presets = (  # where screening left presets in doubt: the fastest preset, searched for as such
            search_model(
                module,
                inputs,
                world,
                options,
                optimizer_config(cfg),
                spec,
                placements=False,
                time_limit=time_limit,
                wanted=is_preset,
            )
            if in_doubt(result)
            else None
        )
        return summarize(result, model, world, batch, spec.name, wall, presets)
    except SearchError as e:
        reasons: dict[str, int] = {}
        for o in seen:  # the refusals, their numbers cut out so that alike ones count together
            why = re.sub(
                r"[0-9][0-9.,]*(e[+-]?[0-9]+)?",
                "N",
                o.refused.split(":")[0] if "alone need" not in o.refused else o.refused,
            )
            reasons[why] = reasons.get(why, 0) + 1
        return {
            "status": "no fit",
            "error": str(e),
            "wall_s": time.perf_counter() - t0,
            "outcomes": len(seen),
            "reasons": sorted(reasons.items(), key=lambda kv: -kv[1])[:4],
        }


def run(cases: list[str], timeout: float, out: Path, time_limit: float | None = None) -> None:
    """Each case in its own process, ``timeout`` seconds at most (the search's own ``time_limit``), appended to
    ``out`` as it ends."""
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in cases:
        print(f"{name}: searching (limit {timeout:.0f} s)", file=sys.stderr, flush=True)
        t0, load0 = time.perf_counter(), load_per_core()
        one = Path(tempfile.mkdtemp(prefix="search-case-")) / "case.json"
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--one", name, "--one-out", str(one)]
                + (["--search-seconds", str(time_limit)] if time_limit is not None else []),
                env=env,
                timeout=timeout,
                capture_output=True,
                text=True,
            )
            if proc.returncode == 0 and one.exists():
                rec = json.loads(one.read_text())
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
                rec = {"status": "error", "error": f"exit {proc.returncode}: {tail[0]}"}
        except subprocess.TimeoutExpired:
            rec = {"status": "timeout", "error": f"no answer within {timeout:.0f} s"}
        rec.update(
            case=name,
            elapsed_s=time.perf_counter() - t0,
            machine=machine(),  # with the date the case ended
            load=max(load0, load_per_core()),
            time_limit=time_limit,
        )
        shutil.rmtree(one.parent, ignore_errors=True)
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{name}: {rec['status']} in {rec['elapsed_s']:.0f} s", file=sys.stderr, flush=True)


def load(path: Path) -> dict[str, dict]:
    """The last record of each case."""
    recs: dict[str, dict] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.strip():
            r = json.loads(line)
            recs[r["case"]] = r
    return recs


def section(recs: dict[str, dict]) -> str:
    rows = [recs[c] for c in CASES if c in recs]
    m = rows[-1]["machine"] if rows else machine()
    lines = [
        f"`python benchmarks/search.py` ({m['cores']} cores, {m['cpu']}, Python "
        f"{m['python']}, torch {m['torch']}; each row's date in its first column): `--strategy auto` "
        "(`shardflow.search.search_model`) against the best "
        "preset, both predicted. Llama 3 8B / 70B / 405B shapes (vocabulary 128256, sequence 8192, bf16, AdamW) on "
        "the shipped `h100` spec, global batch 2 × world sequences; the main job's Llama (`TrainConfig()`) as "
        "`shardflow train --strategy auto` searches it on this machine (`MachineSpec.this`). *Best preset*: the "
        "fastest fitting outcome without `--ac-blocks` (every strategy, degree, schedule and microbatch count, with "
        "checkpointing of every block or none, and accumulation). Counts: candidates predicted (of which fit) / "
        "refused before predicting (state over budget, a planner refusal, …) / skipped by the pipeline bound; "
        "`K partial`: outcomes with partial checkpointing; `K screened`: candidates not predicted because their "
        "estimate could not win (docs/search.md#screening), and of them the presets whose estimate was below the best "
        "preset predicted (*in doubt*: one of them might be faster, so the best preset is then a second screened "
        "search's, for the fastest preset: `search_model(..., placements=False, wanted=...)`). Search: the search's own seconds (`SearchResult.seconds`; "
        "the case's wall time with building the model in brackets; *void* where the machine's load average was above "
        f"{QUIET} per core during the case — the predicted figures hold, the seconds do not); memory: the case "
        "process's peak resident memory (the model on the meta device, so the search's own).",
        "",
        "| case | batch | auto: flags | step (ms) | peak (GiB) | best preset: flags | step (ms) | auto ÷ preset | "
        "search (s) | memory (GiB) | predicted (fit) / refused / bounded |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    faster = cut = violated = done = 0
    for r in rows:
        name = r["case"].replace("main/", "main job, ") + f" ({r['machine']['date'][:10]})"
        busy = r.get("load", 0.0) > QUIET
        if r["status"] != "ok":
            what = {"timeout": "timed out", "no fit": "nothing fits", "error": "error"}[r["status"]]
            why = r["error"].removeprefix("--strategy auto: ").split("; add devices")[0]
            if r.get("reasons"):
                reasons: dict[str, int] = {}
                for w, n in r["reasons"]:
                    w = w.replace("Ne+N", "N")[:100].replace("|", "/")
                    reasons[w] = reasons.get(w, 0) + n
                why += f"; the {r['outcomes']} candidates refused: " + "; ".join(
                    f"{n} × {w}" for w, n in reasons.items()
                )
            wall = f"{r['elapsed_s']:.0f} (wall" + (f"; load {r['load']:.1f}/core)" if busy else ")")
            lines.append(f"| {name} | | {what}: {why} | | | | | | {wall} | | |")
            continue
        done += 1
        seconds = (
            f"void: load {r['load']:.1f}/core ({r['search_s']:.0f})"
            if busy
            else f"{r['search_s']:.0f} ({r['wall_s']:.0f})"
        )
        a, p = r["auto"], r["preset"]
        ratio, untried = r["ratio"], r.get("unsearched", 0)
        if ratio is not None:  # a search cut short by its time limit compares with the presets it tried only
            faster += ratio <= 0.95 and not untried
            cut += ratio <= 0.95 and bool(untried)
            violated += ratio > 1 + 1e-9
        lines.append(
            f"| {name} | {r['batch']} | `{a['flags']}` | {a['step_ms']:,.0f} | {a['peak_gib']:.3g} | "
            + (f"`{p['flags']}` | {p['step_ms']:,.0f} | {ratio:.3f} | " if p else "— | — | — | ")
            + f"{seconds} | "
            + (f"{r['rss_gib']:.2f}" if "rss_gib" in r else "—")
            + f" | {r['predicted']} ({r['fit']}) / {r['refused']} / "
            f"{r['bounded']}"
            + (f"; {r['partial']} partial" if r["partial"] else "")
            + (f"; {r['screened']} screened" if r.get("screened") else "")
            + (
                f" ({r['presets_in_doubt']} presets in doubt: best preset by its own search, "
                f"{r['preset_search_s']:.0f} s)"
                if r.get("presets_in_doubt")
                else ""
            )
            + (f"; **{untried} untried** (time limit {r['time_limit']:.0f} s)" if untried else "")
            + " |"
        )
    missing = [c for c in CASES if c not in recs]
    lines += [
        "",
        f"Cases searched: {done} of {len(CASES)}"
        + (f" (not run: {', '.join(missing)})" if missing else "")
        + f"; auto ≥ 5 % faster than the best preset in {faster}"
        + (f" (and in {cut} cut short by the time limit, against the presets they tried)" if cut else "")
        + "; auto ≤ best preset in every searched case: "
        + ("yes (by construction)." if not violated else f"**NO, in {violated}: a bug in the search's choice**."),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    ap.add_argument("--cases", default="", help="comma-separated case prefixes (main, 8B, 70B/256, ...)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per case")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the records, one JSON line per case run")
    ap.add_argument("--render-only", action="store_true", help="rebuild the section from the last results")
    ap.add_argument("--notes", type=Path, help="a Markdown file of reading notes appended to the section")
    ap.add_argument(
        "--search-seconds", type=float, help="the search's time limit per case (docs/search.md#a-time-limit)"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        rec = run_case(
            args.one, args.search_seconds
        )  # and the case process's peak resident memory (Linux: ru_maxrss in KiB)
        rec["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        args.one_out.write_text(json.dumps(rec))
        return 0
    results = args.results
    if not args.render_only:
        wanted = [p for p in args.cases.split(",") if p]
        cases = [c for p in wanted for c in CASES if c == p or c.startswith(p + "/")] if wanted else CASES
        cases = list(dict.fromkeys(cases))  # in the order asked
        run(cases, args.timeout, results, args.search_seconds)
    text = section(load(results))
    if args.notes:
        text += "\n\n" + args.notes.read_text().strip()
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "benchmarks.md", HEADING + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
