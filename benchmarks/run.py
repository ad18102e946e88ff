"""shardflow against PyTorch on this machine: step time, tokens/s, collectives, memory, and a profile.

Runs the workloads below as rank scripts (``benchmarks/ranks.py``) started with shardflow's own launcher
(``shardflow.runtime.launch.launch``: torchrun's environment, 2 ranks × 1 intra-op thread unless stated), collects
each session's JSON result and writes one Markdown section per workload into ``docs/benchmarks.md`` (other
sections, e.g. "Planning time", stay as they are).

* a — Megatron MLP h → 4h → h (GELU), batch 64, forward + backward + SGD, h ∈ {1024, 4096}: shardflow tp=2,
      DTensor ``parallelize_module``, hand-written tensor parallelism, one process (2 threads; 1 thread too);
* b — the training job's default model (``TrainConfig`` defaults: the Llama) tp=2 and dp=2: shardflow, DTensor tp plan,
      DDP, one process; tokens/s;
* c — all-gather / reduce-scatter / all-reduce, 64 KiB … 64 MiB: each form shardflow issues vs gloo's
      built-ins, bus bandwidth against the loopback TCP bound (2 ranks; 4 ranks in the full run);
* d — a column-parallel linear fed by an all-gather of a sequence-sharded input (B=8, T=256, C=512): each form
      of the all-gather and of its backward reduce-scatter, through ``DistributedExecutor``;
* e — per-rank memory of the default model under tp=2 against one device;
* f — the memory a checkpoint save of the training job's default model under tp=2 allocates beyond each rank's
      state: the sharded save against a save of full tensors gathered first;
* g — the training job's default model (the Llama) under fsdp on 2 ranks: shardflow against PyTorch FSDP2
      (``fully_shard``); tokens/s;
* p — profile of one shardflow tp=2 step of (a), h=1024 (timers, cProfile, torch.profiler) on rank 0;
* q — pipeline parallelism, pp=2, 8 microbatches: shardflow 1F1B and GPipe against torch.distributed.pipelining's
      ``Schedule1F1B`` / ``ScheduleGPipe``; each stage's measured bubble and peak memory;
* t — a tensor-parallel forward all-reduce waited at once against the same cut in chunks that travel while the
      next chunk computes (async tensor parallelism's decomposition), at the main job's shape;
* v — the training job's default model under tp=2, vocabulary-parallel (the preset) against the embedding and head
      replicated: per-rank state, bytes per step, step time;
* m — a Mixtral-style mixture of experts on 2 and 4 ranks: shardflow ep and dp against expert parallelism written by
      hand (``all_to_all_single`` dispatch and combine); tokens/s and bytes per step;
* u — uneven shards: the training job's default model under dp=2 at a batch the degree divides and at batches it
      does not (blocks padded); step time, tokens/s, bytes per step, the first losses against one device;
* x — context parallelism on 2 and 4 ranks: the main job's model on one long sequence under ``--strategy cp``, each
      ``--cp-attention`` form (all-gather, all-to-all where cp divides the key/value heads, ring); step time, bytes
      and peak per rank.

Usage::

    python benchmarks/run.py                 # everything (< 15 min on 2 cores), updates docs/benchmarks.md
    python benchmarks/run.py --quick         # h=1024 only, fewer sizes and rounds (< 4 min)
    python benchmarks/run.py --only a,c      # some workloads
    python benchmarks/run.py --no-write      # print the sections only
    python benchmarks/run.py --render-only   # rebuild the sections from the last run's JSON (runs/bench/)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import verdict, write_section  # noqa: E402
from ranks import UPDATES  # noqa: E402

from shardflow.lower import LowerOptions  # noqa: E402
from shardflow.runtime.launch import describe_failure, launch  # noqa: E402

RANKS = Path(__file__).resolve().parent / "ranks.py"
KEYS = "abcdefgmpqtuvx"
KiB, MiB = 1 << 10, 1 << 20
# (m): Mixtral's layout at a small width: 8 experts of width 256, top 2, 2 layers of width 128
MOE_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
}
SP_FORMS = [
    ["collective", "collective"],
    ["ring", "collective"],
    ["broadcast_loop", "collective"],
    ["collective", "ring"],
    ["ring", "ring"],
    ["broadcast_loop", "ring"],
]


def sessions(keys: str, quick: bool) -> list[tuple[str, str, int, dict]]:
    """(label, workload, ranks, params) of every session to run, in order."""
    out = []
    if "a" in keys:
        sizes = [[1024, 4, 3]] if quick else [[1024, 21, 5], [4096, 7, 2]]
        out.append(("a", "mlp", 2, {"sizes": sizes, "batch": 64, "warmup": 1 if quick else 5}))
    if "b" in keys or "e" in keys:
        out.append(
            (
                "b+e" if "b" in keys else "e",
                "gpt",
                2,
                {
                    "timing": "b" in keys,
                    "rounds": 4 if quick else 61,
                    "iters": 2 if quick else 3,
                    "warmup": 1 if quick else 3,
                },
            )
        )
    if "c" in keys:
        sizes = [256 * KiB, 4 * MiB, 16 * MiB] if quick else [64 * KiB * 4**i for i in range(6)]
        out.append(
            (
                "c",
                "comm",
                2,
                {
                    "sizes": sizes,
                    "rounds": 3 if quick else 7,
                    "warmup": 1,
                    "max_iters": 20,
                    "bytes_per_sample": 32 * MiB,
                    "loopback": (16 if quick else 64) * MiB,
                },
            )
        )
        if not quick:
            out.append(
                (
                    "c4",
                    "comm",
                    4,
                    {
                        "sizes": [256 * KiB, 4 * MiB, 16 * MiB],
                        "rounds": 3,
                        "warmup": 1,
                        "max_iters": 10,
                        "bytes_per_sample": 16 * MiB,
                        "loopback": 0,
                    },
                )
            )
    if "d" in keys:
        shapes = [[8, 256, 512]] if quick else [[8, 256, 512], [8, 256, 128]]
        out.append(
            (
                "d",
                "sp",
                2,
                {
                    "shapes": shapes,
                    "forms": SP_FORMS,
                    "rounds": 3 if quick else 9,
                    "iters": 1 if quick else 2,
                    "warmup": 1,
                    "breakdown_steps": 2 if quick else 5,
                },
            )
        )
    if "f" in keys:
        out.append(("f", "ckpt", 2, {}))
    if "g" in keys:
        out.append(
            ("g", "fsdp", 2, {"rounds": 4 if quick else 25, "iters": 2 if quick else 3, "warmup": 1 if quick else 2})
        )
    if "q" in keys:
        out.append(
            (
                "q",
                "pipeline",
                2,
                {
                    "width": 1024,
                    "layers": 8,
                    "batch": 512,
                    "microbatches": 8,
                    "rounds": 3 if quick else 15,
                    "iters": 2,
                    "warmup": 1,
                    "traced_steps": 5,
                },
            )
        )
    if "t" in keys:
        out.append(
            (
                "t",
                "chunked",
                2,
                {
                    "tokens": 1024,
                    "k": 512,
                    "n": 128,
                    "m": 384,
                    "chunks": [2, 4],
                    "rounds": 5 if quick else 25,
                    "iters": 10,
                    "warmup": 5,
                },
            )
        )
    if "m" in keys:
        moe = {
            "config": MOE_CONFIG,
            "batch": 8,
            "seq": 64,
            "lr": 0.01,
            "rounds": 3 if quick else 15,
            "iters": 2,
            "warmup": 1 if quick else 2,
        }
        out += [("m2", "moe", 2, moe)] + ([] if quick else [("m4", "moe", 4, {**moe, "rounds": 9})])
    if "x" in keys:
        ctx = {"seq_len": 2048, "rounds": 3 if quick else 9, "iters": 1, "warmup": 1}
        out.append(
            ("x2", "context", 2, {**ctx, "forms": ["all_gather", "all_to_all", "ring", "ring:serial", "ring:balanced"]})
        )
        if not quick:
            out.append(("x4", "context", 4, {**ctx, "forms": ["all_gather", "ring", "ring:serial", "ring:balanced"]}))
    if "v" in keys:
        out.append(
            (
                "v",
                "vocab",
                2,
                {"vocab_sizes": [None, 8192, 8191], "rounds": 5 if quick else 15, "iters": 3, "warmup": 2},
            )
        )
    if "u" in keys:
        out.append(("u", "uneven", 2, {"batches": [16, 15, 13], "rounds": 5 if quick else 11, "iters": 2, "warmup": 2}))
    if "p" in keys:
        out.append(
            (
                "p",
                "profile",
                2,
                {
                    "h": 1024,
                    "tiny_h": 16,
                    "batch": 64,
                    "rounds": 3 if quick else 7,
                    "iters": 3 if quick else 5,
                    "warmup": 3,
                    "steps": 10 if quick else 30,
                },
            )
        )
    return out


# ------------------------------------------------------------------------------------------------------------
# numbers
# ------------------------------------------------------------------------------------------------------------
def med(xs) -> float:
    return statistics.median(xs)


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x * 1e3 >= 10 else f"{x * 1e3:.2f}"


def spread_ms(xs) -> str:
    return f"{ms(min(xs))}–{ms(max(xs))}"


def ratios(a, b) -> list[float]:
    """Per-round ratios a[i] / b[i] of two interleaved variants."""
    return [x / y for x, y in zip(a, b)]


def ratio_text(rs) -> str:
    return f"{med(rs):.2f} ({min(rs):.2f}–{max(rs):.2f})"


def gbps(n_bytes: float, seconds: float) -> float:
    return n_bytes / seconds / 1e9


def size_text(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def machine_line(res: dict, nproc: int, threads: str = "1 intra-op thread per rank") -> str:
    m0, m1 = res["machine_start"], res["machine_end"]
    return (
        f"Machine: {m0['cores']} cores ({m0['cpu']}, {m0['arch']}), Python {m0['python']}, torch {m0['torch']}, "
        f"{m0['date'].replace('T', ' ')}; {nproc} ranks × {threads} (gloo, `OMP_WAIT_POLICY="
        f"{m0.get('omp_wait_policy', os.environ.get('OMP_WAIT_POLICY', ''))}`); load average {m0['load']:.2f} at the start of the session, "
        f"{m1['load']:.2f} at the end; session {res['session_s']:.0f} s."
    )


TIMING_NOTE = (
    "Timing: every variant warmed up, then run in interleaved rounds (order rotating each round); a "
    "sample = mean step time of a few steps back to back, the largest over the ranks; the table gives "
    "the median and min–max of the samples, and ratios are the median (min–max) of the per-round ratios "
    "of two variants measured in the same round."
)


# ------------------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------------------
MLP_LABELS = {
    "shardflow": "shardflow tp=2 (`DistributedExecutor`)",
    "dtensor": "DTensor `parallelize_module` (Colwise fc1, Rowwise fc2) + `torch.optim.SGD`",
    "hand": "hand-written TP (plain tensors, one `dist.all_reduce`)",
    "one_process": "one process, 2 threads (eager + `torch.optim.SGD`)",
    "one_process_1t": "one process, 1 thread (reference)",
}


def section_a(res: dict, quick: bool) -> str:
    lines = [
        "## Megatron MLP step time (a)",
        "",
        "h → 4h → GELU → h with biases, mean cross-entropy against random class ids, batch 64 rows, float32; one "
        "step = forward + backward + SGD update (lr 1e-3, no momentum) + reading the loss. tp=2: fc1 "
        "column-parallel, fc2 row-parallel, one all-reduce of fc2's output (the input needs no gradient, so the "
        "backward has no communication). shardflow: the module captured with `shardflow.capture`, planned "
        'with `make_plan(graph, mesh, "tp")`, lowered for the rank and run by `DistributedExecutor`. All '
        "variants start from the same weights; their first two losses agree (checked below).",
        "",
        machine_line(res, 2) + " The one-process variants run on rank 0 while rank 1 waits in a barrier.",
        "",
        TIMING_NOTE,
        "",
        f"Reproduce: `python benchmarks/run.py --only a{' --quick' if quick else ''}`.",
        "",
        "| h | variant | step median (ms) | min–max (ms) | shardflow ÷ variant (per round) |",
        "|---|---|---|---|---|",
    ]
    targets = []
    for row in res["rows"]:
        s = row["samples"]
        for name, label in MLP_LABELS.items():
            if name not in s:
                continue
            r = ratio_text(ratios(s["shardflow"], s[name])) if name != "shardflow" else "1"
            lines.append(f"| {row['h']} | {label} | {ms(med(s[name]))} | {spread_ms(s[name])} | {r} |")
        hand = ratios(s["shardflow"], s["hand"])
        dt = ratios(s["shardflow"], s["dtensor"])
        if row["h"] == 1024:
            targets.append(
                f"h=1024: shardflow ÷ hand-written = {ratio_text(hand)}, target ≤ 1.05: "
                f"{verdict(med(hand) <= 1.05)}, issue #16's ≤ 1.0: {verdict(med(hand) <= 1.0)}; "
                f"shardflow ÷ DTensor = {ratio_text(dt)}, target ≤ 0.85: "
                f"{verdict(med(dt) <= 0.85)}."
            )
        elif row["h"] == 4096:
            targets.append(
                f"h=4096: shardflow ÷ hand-written = {ratio_text(hand)}, target ≤ 1.02: "
                f"{verdict(med(hand) <= 1.02)} (÷ DTensor: {ratio_text(dt)})."
            )
    lines.append("")
    for row in res["rows"]:
        lo = row["losses"]
        ref = lo.get("one_process")
        if ref:
            worst = max(abs(a - b) for k, v in lo.items() if k != "one_process_1t" for a, b in zip(v, ref))
            lines.append(
                f"h={row['h']}: first two losses {ref[0]:.5f}, {ref[1]:.5f}; largest difference between "
                f"variants {worst:.1e}. shardflow's rank program: {row['program']['instrs']} instructions, "
                f"{row['program']['comms']} communication. Rounds × steps per sample: {row['rounds']} × "
                f"{row['iters']}."
            )
    lines += ["", "Targets (medians of per-round ratios): " + " ".join(targets)] if targets else []
    lines += ["", "Where shardflow's time goes: see the profile section (p) below."]
    return "\n".join(lines) + "\n"


GPT_LABELS = {
    "shardflow_tp": "shardflow tp=2",
    "shardflow_tp_blocking": "shardflow tp=2 without overlap (`LowerOptions(overlap=False)`)",
    "dtensor_tp": "DTensor tp=2 (torchtitan-style plan) + AdamW",
    "megatron_tp": "hand-written Megatron tp=2 (local shards, f/g all-reduces; `benchmarks/ranks.py`) + AdamW",
    "shardflow_dp": "shardflow dp=2 (gradient buckets, 25 MiB)",
    "shardflow_dp_nobucket": "shardflow dp=2, one all-reduce per gradient (`bucket_bytes=0`)",
    "shardflow_dp_1mib": "shardflow dp=2, 1 MiB buckets (DDP's first bucket size)",
    "ddp": "DDP dp=2 + AdamW",
    "one_process": "one process, 2 threads (eager + AdamW)",
    "one_process_1t": "one process, 1 thread",
}


def section_b(res: dict, quick: bool) -> str:
    m = res["model"]
    s = res["samples"]
    tok = res["tokens_per_step"]
    lines = [
        "## Main job tokens/s (b)",
        "",
        f"The training job's default model (`TrainConfig` defaults): the Hugging Face Llama with {m['layers']} "
        f"layers, {m['heads']} heads ({m['kv_heads']} key/value heads), width {m['embd']}, context {m['seq_len']}, "
        f"vocabulary {m['vocab']} (byte-level BPE of the default corpus), {m['params']:,} parameters; global batch "
        f"{m['batch']} × {m['seq_len']} = {tok} tokens per step; AdamW lr {m['optimizer']['lr']}, no weight decay; "
        f"one step = forward + backward + update + reading the loss, on a fixed batch of the default corpus. "
        f"shardflow: `shardflow.train.recipe.setup` (capture, preset plan) → `lower_step` for the rank → "
        f"`DistributedExecutor`. DTensor: `parallelize_module` with q, k, v, gate and up `ColwiseParallel`, o and "
        f"down `RowwiseParallel`, the rest replicated (the model's attention views q, k, v with the local head "
        f"count). Hand-written Megatron: each rank's rows of q, k, v, gate and up and columns of o and down as "
        f"plain `nn.Linear` weights of the same model, Megatron-LM's f and g as autograd functions around attention "
        f"and MLP (`megatron_llama`). DDP: `DistributedDataParallel` on {m['batch'] // 2} sequences per rank.",
        "",
        machine_line(res, 2) + " The one-process variants run on rank 0 while rank 1 waits in a barrier.",
        "",
        TIMING_NOTE,
        "",
        f"Reproduce: `python benchmarks/run.py --only b{' --quick' if quick else ''}`.",
        "",
        "| variant | step median (ms) | min–max (ms) | tokens/s (median) | shardflow tp=2 tokens/s ÷ variant's "
        "(per round) | shardflow dp=2 tokens/s ÷ variant's (per round) |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in GPT_LABELS.items():
        if name not in s:
            continue
        rt = ratio_text(ratios(s[name], s["shardflow_tp"]))
        rd = ratio_text(ratios(s[name], s["shardflow_dp"]))
        lines.append(
            f"| {label} | {ms(med(s[name]))} | {spread_ms(s[name])} | {tok / med(s[name]):,.0f} | {rt} | {rd} |"
        )
    lo = res["losses"]
    ref = lo["one_process"]
    same = [k for k in lo if k not in ("ddp", "one_process_1t")]
    worst = max(abs(a - b) for k in same for a, b in zip(lo[k], ref))
    vs_dt = ratios(s["dtensor_tp"], s["shardflow_tp"])
    vs_meg = ratios(s["megatron_tp"], s["shardflow_tp"])
    vs_one = ratios(s["one_process"], s["shardflow_tp"])
    vs_one_dp = ratios(s["one_process"], s["shardflow_dp"])
    vs_ddp = ratios(s["ddp"], s["shardflow_dp"])
    lines += [
        "",
        f"First two losses {ref[0]:.5f}, {ref[1]:.5f} (one process); shardflow tp, dp and DTensor agree within "
        f"{worst:.1e} (DDP's rank 0 reports its half batch). shardflow programs per rank: tp "
        f"{res['program_tp']['instrs']} instructions / {res['program_tp']['comms']} communications, dp "
        f"{res['program_dp']['instrs']} / {res['program_dp']['comms']}. Rounds × steps per sample: "
        f"{res['rounds']} × {res['iters']}.",
        "",
        f"Targets of issue #16 (tokens/s ratios, per-round medians): shardflow tp=2 ÷ DTensor tp=2 = "
        f"{ratio_text(vs_dt)}, target ≥ 1.5: {verdict(med(vs_dt) >= 1.5)}; shardflow tp=2 ÷ the hand-written "
        f"Megatron version = {ratio_text(vs_meg)}, target ≥ 1.0: {verdict(med(vs_meg) >= 1.0)}; dp=2: shardflow ÷ DDP = "
        f"{ratio_text(vs_ddp)}, target ≥ 1.05: {verdict(med(vs_ddp) >= 1.05)}. For reference: shardflow tp=2 ÷ "
        f"one process (2 threads) = {ratio_text(vs_one)}; dp=2 ÷ one process = {ratio_text(vs_one_dp)}. "
        f"The overlap of the backward's all-reduces with the weight gradients: shardflow tp=2 ÷ the same "
        f"program with every all-reduce waited at once = "
        f"{ratio_text(ratios(s['shardflow_tp_blocking'], s['shardflow_tp']))} (tokens/s).",
        "",
        f"dp: shardflow packs the weight gradients into buckets (`LowerOptions.bucket_bytes`, 25 MiB like DDP's "
        f"`bucket_cap_mb`; this model's {4 * m['params'] / 1e6:.1f} MB of gradients fit in one) and all-reduces "
        f"each bucket with one call issued without waiting as soon as its last gradient is ready; the wait "
        f"sits right before the first update that reads it ({res['program_dp']['comms']} communications per "
        f"step in all). With one all-reduce per gradient (`bucket_bytes=0`: "
        f"{res['program_dp0']['comms']} communications, each waited before the next instruction) the step "
        f"takes {ratio_text(ratios(s['shardflow_dp_nobucket'], s['shardflow_dp']))} times as long: on gloo "
        f"every call costs a rendezvous of both ranks, about a millisecond here. Buckets of 1 MiB "
        f"({res['program_dp1']['comms']} communications, the first issued while most of the backward is "
        f"still to run, as DDP's first bucket) take "
        f"{ratio_text(ratios(s['shardflow_dp_1mib'], s['shardflow_dp']))} times as long as one bucket: "
        f"the overlap does not pay here, since gloo reduces on CPU threads that compete with the two ranks' "
        f"computes for this machine's 2 cores. Both sides run the same kernels (shardflow ÷ eager on one "
        f'device: the section "Single-device step" below) and all-reduce the same bytes'
        + (
            ", so the 5 % over DDP that the dp target asks for has no place to come from on this machine."
            if med(vs_ddp) < 1.05
            else "."
        ),
    ]
    share = res.get("comm_share")
    if share:
        tp, dp = share["tp"], share["dp"]
        lines += [
            "",
            f"Rank 0's executor tracer (5 steps after the timing): tp=2 spends {tp['comm_ms']:.1f} of "
            f"{tp['step_ms']:.1f} ms per step ({100 * tp['comm_ms'] / tp['step_ms']:.0f} %) in its "
            f"{res['program_tp']['comms']} communications (issue + wait, so including the wait for the other "
            f"rank; the backward's all-reduces are issued without waiting and waited after the weight "
            f"gradients, `LowerOptions.overlap`), against {dp['comm_ms']:.1f} of {dp['step_ms']:.1f} ms for "
            f"dp=2.",
        ]
        if "fwd_comm_ms" in tp:
            lines[-1] += (
                f" Of tp's, {tp['fwd_comm_ms']:.1f} ms are the forward's all-reduces (one after each "
                f"row-parallel linear), which wait at once: the next op reads their sum. The hand-written "
                f"Megatron version and DTensor wait on the same all-reduces"
            )
            lines[-1] += (
                ": shardflow tp runs at the hand-written version's speed, and the 1.5 × DTensor target "
                "asks it to beat that version by what DTensor's own overhead leaves; hiding the forward's "
                "all-reduces (the batch cut in chunks whose all-reduces travel while the next chunk "
                "computes, as async tensor parallelism does) is not built, and does not pay on gloo here "
                "(section (t))."
                if med(vs_dt) < 1.5
                else "."
            )
    return "\n".join(lines) + "\n"


AG_FORMS = [
    "ag:shardflow collective",
    "ag:shardflow ring",
    "ag:shardflow broadcast_loop",
    "ag:gloo all_gather_into_tensor",
]
RS_FORMS = ["rs:shardflow collective", "rs:shardflow ring", "rs:gloo reduce_scatter_single"]
AR_FORMS = ["ar:shardflow all_reduce", "ar:gloo all_reduce"]
SF_FORM = {
    "collective": "ag:shardflow collective",
    "ring": "ag:shardflow ring",
    "broadcast_loop": "ag:shardflow broadcast_loop",
}


def _bus(res: dict, name: str) -> list[float]:
    m = res["meta"][name]
    return [gbps(m["bound_bytes"], t) for t in res["samples"][name]]


def _cell(xs: list[float]) -> str:
    return f"{med(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def _auto(kind: str, n_bytes: int, d: int) -> str:
    opts = LowerOptions()
    chunk = n_bytes // d
    return opts.all_gather_form(chunk, d) if kind == "all_gather" else opts.reduce_scatter_form(chunk, d)


def section_c(res: dict, res4: dict | None, quick: bool) -> str:
    d = res["world"]
    lb = {
        k: [gbps(res["meta"][k]["bytes"], t) for t in res["samples"][k]]
        for k in ("loopback one_way", "loopback both_ways")
        if k in res["samples"]
    }
    bound = med(lb["loopback one_way"]) if lb else math.nan
    lines = [
        "## Collectives: bus bandwidth (c)",
        "",
        "Each shardflow form is timed as the exact torch.distributed calls `DistributedExecutor._communicate` "
        "issues for it (on dim 0, float32), including its local copies, each receiving into a buffer kept "
        "from call to call as the executor's receive slots do: all-gather *collective* = "
        "`all_gather_single` (gloo's built-in), *ring* = d−1 collective-permute steps "
        "(`batch_isend_irecv`) received into their blocks of the gathered buffer + the own chunk copied in, "
        "*broadcast loop* = d broadcasts + concat; reduce-scatter *collective* = `reduce_scatter_single`, "
        "*ring* = chunk + d−1 permute steps with local adds; "
        "all-reduce = copy + `all_reduce`. gloo's built-ins: `all_gather_into_tensor`, `reduce_scatter_single` "
        "(gloo supports it), `all_reduce` in place. Size = the full tensor N (all-gather output, "
        "reduce-scatter / all-reduce input). **Bus bandwidth** = bandwidth-optimal bytes each rank sends "
        "((d−1)/d·N for all-gather and reduce-scatter, 2(d−1)/d·N for all-reduce) ÷ time, GB/s = 1e9 B/s; "
        "cells: median (min–max) over rounds. The loopback bound: one 64 MiB buffer (16 MiB with --quick) sent "
        "with `socket.sendall` between ranks 0 and 1 over 127.0.0.1 and received with `recv_into`, timed "
        "in the same rounds.",
        "",
        machine_line(res, d),
        "",
        TIMING_NOTE,
        "",
        f"Reproduce: `python benchmarks/run.py --only c{' --quick' if quick else ''}`.",
        "",
    ]
    if lb:
        lines += [
            f"Loopback TCP, same session: one way {_cell(lb['loopback one_way'])} GB/s; both ways at once "
            f"{_cell(lb['loopback both_ways'])} GB/s per direction. The bound used below is the one-way "
            f"median, {bound:.2f} GB/s.",
            "",
        ]
    lines += [
        "Below 4 MiB a call takes about a millisecond and the cells are dominated by scheduling on the shared "
        "machine: a sample (the mean of up to 20 calls) is either near the per-call latency or several times "
        "it, depending on whether a rank lost its core during the sample, so small sizes vary widely between "
        "rounds and runs.",
        "",
    ]
    lines += _comm_tables(res, bound)
    if res4 is not None:
        lines += ["", "### 4 ranks (2 cores: oversubscribed, 4 processes on 2 cores)", "", machine_line(res4, 4), ""]
        lines += _comm_tables(res4, bound)
    lines += [
        "",
        "Targets at ≥ 4 MiB (2 ranks; the form shardflow's cost model picks with `LowerOptions()` "
        "(\"auto\"), and the best shardflow form; speed-up = gloo built-in's time ÷ shardflow's, per round):",
        "",
    ]
    both = med(lb["loopback both_ways"]) if lb else math.nan
    lines += [
        "| collective | size | auto form | auto ÷ gloo speed-up | best form | best speed-up | best bus GB/s | "
        "% of loopback (one way) | % of loopback both ways | target (× gloo) | target ≥ 50 % loopback |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, forms, gloo, want in (
        ("all_gather", AG_FORMS[:3], AG_FORMS[3], 1.0),
        ("reduce_scatter", RS_FORMS[:2], RS_FORMS[2], 2.0),
    ):
        for n in sorted({m["bytes"] for k, m in res["meta"].items() if "form" in m}):
            if n < 4 * MiB:
                continue
            auto = _auto(kind, n, d)
            auto_name = f"{forms[0].split(':')[0]}:shardflow {auto}@{n}"
            g = res["samples"][f"{gloo}@{n}"]
            speed = {f: ratios(g, res["samples"][f"{f}@{n}"]) for f in forms}
            best = max(forms, key=lambda f: med(speed[f]))
            bus = _bus(res, f"{best}@{n}")
            pct = 100 * med(bus) / bound
            lines.append(
                f"| {kind.replace('_', '-')} | {size_text(n)} | {auto} | {ratio_text(ratios(g, res['samples'][auto_name]))} "
                f"| {best.split('shardflow ')[1]} | {ratio_text(speed[best])} | {med(bus):.2f} | {pct:.0f} % | "
                f"{100 * med(bus) / both:.0f} % | ≥ {want:g}×: {verdict(med(speed[best]) >= want)} | "
                f"{verdict(pct >= 50)} |"
            )
    big = [n for n in sorted({m["bytes"] for m in res["meta"].values() if "form" in m}) if n >= 4 * MiB]
    if big:
        rs_ar = [med(ratios(res["samples"][f"{RS_FORMS[2]}@{n}"], res["samples"][f"{AR_FORMS[1]}@{n}"])) for n in big]
        ag_ring = [med(ratios(res["samples"][f"{AG_FORMS[3]}@{n}"], res["samples"][f"{AG_FORMS[1]}@{n}"])) for n in big]
        lines += [
            "",
            f"Why, at ≥ 4 MiB on 2 ranks: gloo's reduce-scatter takes {min(rs_ar):.2f}–{max(rs_ar):.2f}× the time "
            f"of gloo's all-reduce of the same tensor (it moves at least the all-reduce's bytes), so the ring, "
            f"which sends only the other rank's half, gains about 2×. gloo's all-gather sends the same bytes "
            f"as the ring, which takes {1 / max(ag_ring):.2f}–{1 / min(ag_ring):.2f}× its time; both are "
            f"limited by moving data through loopback TCP in both directions at once on 2 busy cores (the "
            f"both-ways loopback figure). The auto form is the one the cost model's gloo defaults pick; "
            f"`shardflow calibrate` measures the machine's own (execution.md).",
        ]
    chk = res.get("check", {})
    bad = [k for k, v in chk.items() if not v]
    lines += [
        "",
        f"Every form's result was checked on known data before timing: "
        f"{'all correct' if not bad else 'WRONG: ' + ', '.join(bad)}.",
    ]
    return "\n".join(lines) + "\n"


def _comm_tables(res: dict, bound: float) -> list[str]:
    d = res["world"]
    sizes = sorted({m["bytes"] for m in res["meta"].values() if "form" in m})
    out = []
    for title, forms in (("All-gather", AG_FORMS), ("Reduce-scatter", RS_FORMS), ("All-reduce", AR_FORMS)):
        kind = {"All-gather": "all_gather", "Reduce-scatter": "reduce_scatter", "All-reduce": "all_reduce"}[title]
        head = "| size | " + " | ".join(f.split(":")[1] for f in forms) + " |"
        extra = " auto form |" if kind != "all_reduce" else ""
        out += [
            f"{title}, {d} ranks: bus bandwidth GB/s (time per call, median)",
            "",
            head + extra,
            "|---" * (len(forms) + 1 + bool(extra)) + "|",
        ]
        for n in sizes:
            cells = []
            for f in forms:
                name = f"{f}@{n}"
                cells.append(f"{_cell(_bus(res, name))} [{ms(med(res['samples'][name]))} ms]")
            auto = f" {_auto(kind, n, d)} |" if extra else ""
            out.append(f"| {size_text(n)} | " + " | ".join(cells) + " |" + auto)
        out.append("")
    return out


def section_d(res: dict, quick: bool) -> str:
    lines = [
        "## Sequence-parallel column linear (d)",
        "",
        "x [B, T, C] sharded on T (a trainable leaf, so it has a gradient) → linear to 4C features with the "
        "weight [4C, C] and bias sharded on dim 0 (column parallel) → tanh → sum; tp=2, float32. The linear "
        "reads x replicated, so x is all-gathered forward and its gradient reduce-scattered backward. Built "
        "with `GraphBuilder` + `Annotations` + `build_pcg`, lowered with `LowerOptions(all_gather, "
        "reduce_scatter)` and run by `DistributedExecutor`; one step = forward + backward + SGD on x, W, b + "
        "reading the loss. With *ring* or *broadcast loop* the linear is fused into the loop (computed chunk by "
        "chunk while the next chunk travels), each output chunk written into its block of one buffer stored "
        "sequence-first, which the tanh, the linear's vjp and the reduce-scatter then read in that layout with "
        "no copy (docs/lowering.md, §10). *compute only*: each rank's local work of the same step with no "
        "communication (the whole x already present; torch autograd; no update of x), a floor.",
        "",
        machine_line(res, 2),
        "",
        TIMING_NOTE,
        "",
        f"Reproduce: `python benchmarks/run.py --only d{' --quick' if quick else ''}`.",
        "",
    ]
    for row in res["rows"]:
        B, T, C = row["shape"]
        s = row["samples"]
        base = s["collective / collective"]
        lines += [
            f"B={B}, T={T}, C={C}: x {B * T * C * 4 / MiB:g} MiB (a {B * T * C * 4 / MiB / 2:g} MiB piece per "
            f"rank), linear output {B * T * 4 * C * 4 / MiB / 2:g} MiB per rank.",
            "",
            "| all-gather / reduce-scatter form | step median (ms) | min–max (ms) | ÷ collective / collective "
            "(per round) | communications per step (kinds) | instructions | kernels / communication / other "
            "(ms per step, timers) |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, xs in s.items():
            prog = row["programs"].get(name)
            info = f"{prog['comms']} ({', '.join(prog['comm_kinds'])}) | {prog['instrs']}" if prog else "0 | –"
            b = row.get("breakdown", {}).get(name)
            if b:
                n = b["steps"]
                k = sum(v for key, v in b["sum_s"].items() if key.startswith("kernel")) / n
                c = sum(v for key, v in b["sum_s"].items() if key.startswith(("communication", "loss"))) / n
                split = f"{ms(k)} / {ms(c)} / {ms(b['total_s'] / n - k - c)}"
            else:
                split = "–"
            lines.append(
                f"| {name} | {ms(med(xs))} | {spread_ms(xs)} | {ratio_text(ratios(xs, base))} | {info} | {split} |"
            )
        auto = ", ".join(f"{p} {k}" for p, k in row["auto"])
        best = min((k for k in s if k != "compute only"), key=lambda k: med(s[k]))
        lines += [
            "",
            f'`LowerOptions()` ("auto", the cost model\'s choice) lowers this step to: {auto}. Fastest form '
            f"in this run: {best}. Rounds × steps per sample: {row['rounds']} × {row['iters']}.",
            "",
        ]
        bd = row.get("breakdown", {})
        if "collective / collective" in bd and "ring / collective" in bd:

            def kern(name, label):
                b = bd[name]
                return sum(v for key, v in b["sum_s"].items() if key.startswith(f"kernel: {label}")) / b["steps"]

            lines += [
                f"Backward linear kernel (`BWD vjp[linear]`, timers): {ms(kern('collective / collective', 'BWD vjp[linear'))} "
                f"ms with the plain all-gather, {ms(kern('ring / collective', 'BWD vjp[linear'))} ms after the "
                f"fused ring (forward chunks: {ms(kern('ring / collective', 'FWD linear'))} ms vs "
                f"{ms(kern('collective / collective', 'FWD linear'))} ms). Both run the hand-written linear "
                f"vjp (`runtime/vjp.py`: dx = dy·W, dW = dyᵀ·x, db = Σ dy), which reads the forward's inputs "
                f"and no autograd graph, so the chunked forward of the fused ring costs its backward no "
                f"recomputation (every op a ring fuses — linear, matmul — has one).",
                "",
            ]
    return "\n".join(lines)


def section_e(res: dict, quick: bool) -> str:
    mem = res["memory"]
    one, tp = mem["state_one"], mem["state_tp"]
    d = res["world"]
    lines = [
        "## Per-rank memory (e)",
        "",
        f"The default model of (b) (the Llama, {res['model']['params']:,} parameters, AdamW: two state tensors per weight), "
        f"float32. Parameters + gradients + optimizer state: this rank's pieces, from the plan (the executor keeps "
        f"the gradients the update read, so they are live between steps); the measured buffers agree "
        f"({mem['state_tp_measured']:,} B on rank 0). Peak: `DistributedExecutor.peak_bytes` (largest sum of "
        f"the rank's live buffers during a step: the above plus activations and communication buffers); one "
        f"device: `LocalExecutor` on a 1-device mesh.",
        "",
        machine_line(res, 2),
        "",
        "| bytes | one device | tp=2, per rank | per rank ÷ (one device / 2) |",
        "|---|---|---|---|",
    ]
    for k in ("params", "grads", "optimizer"):
        lines.append(f"| {k} | {one[k]:,} | {tp[k]:,} | {tp[k] / (one[k] / d):.3f} |")
    s1, st = sum(one.values()), sum(tp.values())
    lines.append(f"| **params + grads + optimizer** | {s1:,} | {st:,} | **{st / (s1 / d):.3f}** |")
    peak_tp = max(mem["peak_tp_per_rank"])
    lines.append(
        f"| peak (all live buffers) | {mem['peak_one']:,} | {peak_tp:,} (ranks: "
        f"{', '.join(f'{x:,}' for x in mem['peak_tp_per_rank'])}) | {peak_tp / (mem['peak_one'] / d):.3f} |"
    )
    if "peak_dp" in res:
        dp = res["state_dp"]
        lines.append(
            f"| dp=2 for comparison: params + grads + optimizer / peak | | {sum(dp.values()):,} / "
            f"{res['peak_dp']:,} | {sum(dp.values()) / (s1 / d):.3f} / {res['peak_dp'] / (mem['peak_one'] / d):.3f} |"
        )
    ratio = st / (s1 / d)
    rep = st - s1 / d
    lines += [
        "",
        f"Target: parameters + gradients + optimizer state per rank ≤ 1.1 × (one device / tp): {ratio:.3f} — "
        f"{verdict(ratio <= 1.1)}. The tp preset shards the embedding and the output head along the vocabulary "
        f"(docs/concepts.md#vocabulary-parallel-embedding-and-loss); what it leaves replicated (the norms' weights) "
        f"is on every rank: {rep:,.0f} B per rank above an even split.",
    ]
    return "\n".join(lines) + "\n"


def section_f(res: dict, quick: bool) -> str:
    ranks = res["ranks"]
    lines = [
        "## Checkpoint save memory (f)",
        "",
        f"The default model of `shardflow train` (`TrainConfig` defaults: {res['model_params']:,} parameters, "
        f"AdamW, float32) under tp=2 on 2 processes, "
        f"saved after 2 steps. *sharded*: `checkpoint.Saver`, as `shardflow train` saves — each rank hands DCP "
        f"replica 0 of the pieces it holds. *full*: the format before sharded checkpoints — every rank gathers "
        f"the full weights and optimizer state (the executor's collective `weights()` / `state()`) and hands "
        f"them to `dcp.save`. Each variant saved once to warm up, then measured on its second save: the peak of "
        f"the bytes torch's CPU allocator holds beyond those live before the save (torch.profiler's memory "
        f"events) and the peak of Python's heap (tracemalloc: DCP's plans and metadata); their sum bounds the "
        f"extra memory of the save from above. The rank's state: its pieces of the weights and optimizer state "
        f"(what a save writes at most).",
        "",
        machine_line(res, 2),
        "",
        "Reproduce: `python benchmarks/run.py --only f`.",
        "",
        "| rank | state (B) | save | tensors (B) | Python heap (B) | extra ÷ state | its .distcp file (B) |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for r, x in enumerate(ranks):
        state = x["state"]["params"] + x["state"]["optimizer"]
        for name in ("sharded", "full"):
            m = x[name]
            ratio = (m["tensors"] + m["python"]) / state
            if name == "sharded":
                worst = max(worst, ratio)
            size = x["files"][name].get(f"__{r}_0.distcp", 0)
            lines.append(f"| {r} | {state:,} | {name} | {m['tensors']:,} | {m['python']:,} | {ratio:.3f} | {size:,} |")
    lines += [
        "",
        f"Target: the extra memory of a save per rank ≤ 1.1 × the rank's state: {worst:.3f} at most — "
        f"{verdict(worst <= 1.1)}. The sharded save allocates no tensor of a piece's size: it writes the "
        f"executor's buffers as they are, and checks them for NaN and inf from each piece's minimum and maximum "
        f"(`isfinite` would make temporaries of 1.75 × the largest piece); what it allocates is DCP's own "
        f"bookkeeping (its plans, exchanged between the ranks as pickled tensors, and its metadata) and the "
        f"256 KiB buffer each file's sha256 is read through — per entry and per file, not per byte. The full "
        f"save holds every tensor whole on every rank (gathered by an all-reduce each).",
    ]
    return "\n".join(lines) + "\n"


def section_g(res: dict, quick: bool) -> str:
    st, n = res["samples"], res["tokens_per_step"]
    per_dev = {k: n / med(v) / res["world"] for k, v in st.items()}
    rs = ratios(st["fsdp2"], st["shardflow_fsdp"])  # FSDP2's step time ÷ shardflow's = shardflow's tokens/s ÷ FSDP2's
    losses = res["losses"]
    lines = [
        "## FSDP against PyTorch FSDP2 (g)",
        "",
        f"`python benchmarks/run.py --only g`: the training job's default model (the Llama, {res['params']:,} "
        f"parameters; `shardflow train`'s batch of {n:,} tokens per step, AdamW, float32) on 2 gloo ranks. "
        f"shardflow: `setup(--strategy fsdp)` → `lower_step` for the rank with the run's options (weights "
        f"`Shard(0)` on `fsdp`, gathered before each use, gathered again for the backward, gradients "
        f"reduce-scattered) → `DistributedExecutor` ({res['program']['instrs']} instructions, "
        f"{res['program']['comms']} communications per step on rank 0). FSDP2: the same model and weights, "
        f"`fully_shard` on each decoder layer and on the root (`reshard_after_forward=True`), "
        f"`torch.optim.AdamW`, each rank on its half of the batch. {res['rounds']} interleaved rounds of "
        f"{res['iters']} steps.",
        "",
        machine_line(res, 2),
        "",
        TIMING_NOTE,
        "",
        "| variant | step (ms, median) | range | tokens/s per device |",
        "|---|---|---|---|",
    ]
    for k, label in (("shardflow_fsdp", "shardflow fsdp=2"), ("fsdp2", "PyTorch FSDP2 (`fully_shard`)")):
        lines.append(f"| {label} | {ms(med(st[k]))} | {spread_ms(st[k])} | {per_dev[k]:,.0f} |")
    share = res["comm_share"]
    lines += [
        "",
        f"shardflow ÷ FSDP2 tokens/s, per round: {ratio_text(rs)}, target ≥ 1.0: {verdict(med(rs) >= 1.0)}. "
        f"Where shardflow's step goes (rank 0, its tracer, 5 steps): {share['comm_ms']:.1f} ms of "
        f"{share['step_ms']:.1f} ms in its {res['program']['comms']} communications (issue + wait, so "
        f"including the wait for the other rank); both gather and reduce-scatter one flat buffer per decoder "
        f"layer and one for the rest of the weights (shardflow: gather and scatter buckets per block). "
        f"First two losses (FSDP2: rank 0's half batch, so it differs): shardflow "
        f"{losses['shardflow_fsdp'][0]:.6f}/{losses['shardflow_fsdp'][1]:.6f}, FSDP2 "
        f"{losses['fsdp2'][0]:.6f}/{losses['fsdp2'][1]:.6f}.",
        "",
    ]
    return "\n".join(lines)


def section_m(runs: dict[int, dict], quick: bool) -> str:
    """(m) tokens/s per device of shardflow ep, hand-written ep and shardflow dp on 2 and 4 ranks; bytes per step."""
    first = next(iter(runs.values()))
    c = first["config"]
    lines = [
        "## Mixtures of experts: expert parallelism (m)",
        "",
        f"`python benchmarks/run.py --only m`: a Mixtral-style model (`transformers.MixtralForCausalLM` from a config: "
        f"{c['num_hidden_layers']} layers of width {c['hidden_size']}, {c['num_local_experts']} experts of width "
        f"{c['intermediate_size']}, top {c['num_experts_per_tok']}; {first['params']:,} parameters, random init, "
        f"float32, SGD) on a batch of {first['tokens_per_step']:,} tokens per step split over the ranks. shardflow: "
        f"`--strategy ep` with the all-to-all token dispatcher (the default) and with `--ep-dispatch all_gather` "
        f"(docs/concepts.md#expert-parallelism), and `--strategy dp`, "
        f"`DistributedExecutor`. By hand: each layer's experts replaced by expert parallelism as torchtitan writes "
        f"it — the token-expert pairs sorted by expert, the split sizes exchanged by an all-to-all of counts, the tokens "
        f"sent to their experts' ranks and the results back by `all_to_all_single` (autograd's), the same expert "
        f"MLPs, the dense weights' gradients all-reduced as DDP does. Interleaved rounds of {first['iters']} steps.",
        "",
        machine_line(first, first["world"]),
        "",
        TIMING_NOTE,
        "",
        "| ranks | variant | step (ms, median) | range | tokens/s per device | bytes sent per rank per step (bound) "
        "| measured |",
        "|---|---|---|---|---|---|---|",
    ]
    labels = {
        "shardflow_ep": "shardflow ep (all-to-all dispatcher)",
        "shardflow_ep_gather": "shardflow ep (all-gather dispatcher)",
        "hand_ep": "hand-written ep (all-to-all)",
        "shardflow_dp": "shardflow dp",
    }
    verdicts = []
    for world, res in runs.items():
        st, n = res["samples"], res["tokens_per_step"]
        for k, label in labels.items():
            lines.append(
                f"| {world} | {label} | {ms(med(st[k]))} | {spread_ms(st[k])} | {n / med(st[k]) / world:,.0f} "
                f"| {res['sent'][k]:,} | {res['measured'].get(k, res['sent'][k]):,} |"
            )
        rs = ratios(st["hand_ep"], st["shardflow_ep"])
        verdicts.append(
            f"{world} ranks: shardflow ep ÷ hand-written tokens/s per round {ratio_text(rs)}, target ≥ 0.9: "
            f"{verdict(med(rs) >= 0.9)}; against the all-gather dispatcher "
            f"{ratio_text(ratios(st['shardflow_ep_gather'], st['shardflow_ep']))}, against shardflow dp "
            f"{med(ratios(st['shardflow_dp'], st['shardflow_ep'])):.2f}. "
            f"First losses: shardflow ep {res['losses']['shardflow_ep'][0]:.6f}/{res['losses']['shardflow_ep'][1]:.6f}, "
            f"dp {res['losses']['shardflow_dp'][0]:.6f}/{res['losses']['shardflow_dp'][1]:.6f}, hand-written "
            f"{res['losses']['hand_ep'][0]:.6f}/{res['losses']['hand_ep'][1]:.6f}."
        )
    lines += (
        [""]
        + verdicts
        + [
            "",
            "Bytes: shardflow's are its program's (every collective, forward and backward, this rank's sends), the "
            "all-to-all dispatcher's all-to-alls at their bound (every row of the send buffer) and, measured, at what "
            "they sent in the second step (`Executor.sized_sent`; the rows to the other ranks); the hand-written "
            "step's are counted at its calls (the tokens sent to other ranks and the results sent back, twice for the "
            "backward, the counts and expert ids, and a ring all-reduce of the dense gradients).",
            "",
        ]
    )
    return "\n".join(lines)


def section_x(runs: dict[int, dict], quick: bool) -> str:
    """(x) step time, bytes and peak per rank of each --cp-attention form on 2 and 4 ranks."""
    first = next(iter(runs.values()))
    lines = [
        "## Context parallelism: the attention forms on processes (x)",
        "",
        f"`python benchmarks/run.py --only x`: the main job's Llama at `shardflow train`'s defaults (AdamW, float32) "
        f"on one sequence of {first['params']['seq_len']:,} tokens per step under `--strategy cp` over every rank, "
        f"each `--cp-attention` form in the contiguous layout, and the ring in the balanced one "
        f"(docs/concepts.md#context-parallelism; the ring: "
        f"docs/lowering.md#16-ring-attention---cp-attention-ring), `DistributedExecutor`, the same weights and "
        f"batch. Peak: this rank's live buffers over two steps (an executor that counts them). Interleaved rounds of "
        f"{first['params']['iters']} step.",
        "",
        machine_line(first, first["world"]),
        "",
        TIMING_NOTE,
        "",
        "| ranks | form | step (ms, median) | range | bytes sent per rank per step | peak rank 0 (B) | over cp |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for world, res in runs.items():
        st = res["samples"]
        for form, f in res["forms"].items():
            lines.append(
                f"| {world} | {form} | {ms(med(st[form]))} | {spread_ms(st[form])} | {f['comm_bytes']:,} "
                f"| {f['peak']:,} | {', '.join(f['kinds'])} |"
            )
        rs = ratios(st["ring"], st["all_gather"])
        ring, gathered = res["forms"]["ring"]["peak"], res["forms"]["all_gather"]["peak"]
        notes.append(
            f"{world} ranks: ring step ÷ all-gather step per round {ratio_text(rs)}, target ≤ 1.15: "
            f"{verdict(med(rs) <= 1.15)}; peak {ring / gathered:.3f} × the all-gather form's; the ring without overlap "
            f"(`ring:serial`: each permute waited where it is issued) ÷ with it "
            f"{ratio_text(ratios(st['ring:serial'], st['ring']))}; the ring in the load-balanced layout "
            f"(`ring:balanced`, docs/concepts.md#the-load-balanced-layout) ÷ contiguous "
            f"{ratio_text(ratios(st['ring:balanced'], st['ring']))}. First "
            "losses: " + ", ".join(f"{k} {v[0]:.6f}/{v[1]:.6f}" for k, v in res["losses"].items()) + "."
        )
    return "\n".join(lines + [""] + notes + [""])


def section_q(res: dict, quick: bool) -> str:
    st, m = res["samples"], res["model"]
    p, M = len(res["blocked"]), m["microbatches"]
    tokens = m["batch"]  # rows per step
    rs = ratios(
        st["torch_1f1b"], st["shardflow_1f1b"]
    )  # torch's step time ÷ shardflow's = shardflow's rows/s ÷ torch's
    rg = ratios(st["torch_gpipe"], st["shardflow_gpipe"])
    ri = ratios(st["torch_interleaved"], st["shardflow_interleaved"])
    ideal = (p - 1) / (M + p - 1)
    labels = {
        "shardflow_1f1b": "shardflow `--microbatches 8 --schedule 1f1b`",
        "shardflow_gpipe": "shardflow `--microbatches 8 --schedule gpipe`",
        "shardflow_interleaved": "shardflow `--microbatches 8 --schedule interleaved --stages-per-rank 2`",
        "torch_1f1b": "torch.distributed.pipelining `Schedule1F1B`",
        "torch_gpipe": "torch.distributed.pipelining `ScheduleGPipe`",
        "torch_interleaved": "torch.distributed.pipelining `ScheduleInterleaved1F1B` (2 chunks per rank)",
    }
    lines = [
        "## Pipeline schedules against torch.distributed.pipelining (q)",
        "",
        f"`python benchmarks/run.py --only q`: shardflow's MLP ({m['layers']} linear layers {m['width']} → "
        f"{m['width']}, ReLU between, cross-entropy; {res['params']:,} parameters) cut by the `pp` preset into "
        f"{p} stages of {m['layers'] // p} layers, a batch of {m['batch']} rows as {M} microbatches of "
        f"{m['batch'] // M}, SGD, float32, on {p} gloo ranks. shardflow: the plan lowered with "
        f"`LowerOptions(microbatches={M}, schedule=...)` → `DistributedExecutor` (1F1B: "
        f"{res['programs']['1f1b']['instrs']} instructions, {res['programs']['1f1b']['comms']} communications "
        f"on rank 0). PyTorch: the same stages (`nn.Sequential` of the same layers and weights) in "
        f"`PipelineStage`, the same loss, `torch.optim.SGD` per stage. {res['rounds']} interleaved rounds of "
        f"{res['iters']} steps.",
        "",
        machine_line(res, p),
        "",
        TIMING_NOTE,
        "",
        "| variant | step (ms, median) | range | rows/s |",
        "|---|---|---|---|",
    ]
    for k, label in labels.items():
        lines.append(f"| {label} | {ms(med(st[k]))} | {spread_ms(st[k])} | {tokens / med(st[k]):,.0f} |")
    lines += [
        "",
        f"shardflow ÷ PyTorch rows/s per round, 1F1B: {ratio_text(rs)} (target ≥ 1.0: "
        f"{verdict(med(rs) >= 1.0)}); GPipe: {ratio_text(rg)}; interleaved: {ratio_text(ri)}. First two losses: "
        + ", ".join(f"{k} {v[0]:.6f}/{v[1]:.6f}" for k, v in res["losses"].items())
        + ".",
        "",
        f"**Measured bubble.** Each shardflow stage's time blocked on the other stage (waits and blocking "
        f"communications, its tracer's communication lane) over {res['traced_steps']} traced steps, as a share "
        f"of the step, against the ideal (p−1)/(m+p−1) = {ideal:.3f} (forwards and backwards of equal length "
        f"on every stage):",
        "",
        "| schedule | stage | step (ms) | computing (ms) | blocked (ms) | blocked ÷ step |",
        "|---|---|---|---|---|---|",
    ]
    shares = {}
    for kind in ("1f1b", "gpipe", "interleaved"):
        for s, b in enumerate(res["blocked"]):
            x = b[kind]
            shares.setdefault(kind, []).append(x["blocked_s"] / x["step_s"])
            lines.append(
                f"| {kind} | {s} | {x['step_s'] * 1e3:.1f} | {x['compute_s'] * 1e3:.1f} | "
                f"{x['blocked_s'] * 1e3:.1f} | {shares[kind][-1]:.3f} |"
            )
    mean = sum(shares["1f1b"]) / p
    inter = sum(shares["interleaved"]) / p
    ideal_i = (p - 1) / (2 * M + p - 1)
    lines += [
        "",
        f"1F1B: mean blocked share over the stages {mean:.3f} against {ideal:.3f} "
        f"({(mean - ideal) / ideal:+.0%}; target within 20 %: {verdict(abs(mean - ideal) <= 0.2 * ideal)}); "
        f"interleaved (V = 2): {inter:.3f} against (p−1)/(V·m+p−1) = {ideal_i:.3f}. "
        f"The step is also longer than the computing and blocked time by the executor's own work between "
        f"kernels (traced steps record every compute, which adds to it). What moves the blocked share off the "
        f"formula, which counts whole forwards and backwards of equal length: upwards, the stages are not "
        f"equal — the last computes one more matmul per microbatch (the input gradient of its first layer, "
        f"which stage 0 skips for the data) and the loss, so stage 0 waits for it, which counts as blocked — "
        f"and each microbatch's forward and gradient cross between the stages on the critical path, two gloo "
        f"transfers whose latency the formula leaves out; downwards, a stage sends its gradient before it "
        f"computes its weight gradients (lowering.md §15), so the stage before waits for part of a backward, "
        f"not all of it. The interleaved schedule halves the ideal bubble but doubles the crossings; on this "
        f"machine that costs more than it saves, for PyTorch's schedule as for shardflow's.",
        "",
    ]
    if "peaks" in res:
        act = res["activation_bytes"]
        lines += [
            "**Activation memory per stage.** Each stage's peak of live buffers during a step (the local "
            "executor's ledger: weights, gradients, activations, communication buffers), MiB; one "
            f"microbatch's hidden activation is {act / 2**20:.2f} MiB:",
            "",
            "| stage | 1F1B peak | GPipe peak | GPipe − 1F1B (microbatch activations) |",
            "|---|---|---|---|",
        ]
        for s in sorted(res["peaks"]["1f1b"], key=int):
            a, g = res["peaks"]["1f1b"][s], res["peaks"]["gpipe"][s]
            lines.append(f"| {s} | {a / 2**20:.2f} | {g / 2**20:.2f} | {(g - a) / 2**20:.2f} ({(g - a) / act:.1f}) |")
        lines += [
            "",
            "1F1B ≤ GPipe on every stage: "
            + verdict(all(res["peaks"]["1f1b"][s] <= res["peaks"]["gpipe"][s] for s in res["peaks"]["1f1b"]))
            + ".",
            "",
        ]
    return "\n".join(lines)


def section_t(res: dict, quick: bool) -> str:
    p, s = res["params"], res["samples"]
    lines = [
        "## Chunked forward all-reduce (t)",
        "",
        f"The forward of a tensor-parallel block of the main job's Llama under tp=2 (batch 16 × 64 = "
        f"{p['tokens']} tokens): the row-parallel o_proj (each rank's {p['k'] // 2} of its {p['k']} input "
        f"features → {p['n']}), the all-reduce of its partial sum ({p['tokens'] * p['n'] * 4 // 1024} KiB), and "
        f"the gate projection that reads the sum ({p['n']} → {p['m']}), float32. *whole*: the all-reduce waited "
        f"at once, as shardflow's tp, the hand-written Megatron version and DTensor do (the next op reads the "
        f"sum). *chunks=c*: the tokens cut in c chunks, each chunk's all-reduce issued without waiting after its "
        f"matmul and waited before the gate projection reads it, so it travels while the later chunks compute "
        f"(the decomposition of async tensor parallelism). Not built in shardflow: this measures whether it "
        f"would pay on this machine. Largest difference from *whole*'s output: {res['worst']:.1e}.",
        "",
        machine_line(res, 2),
        "",
        "Reproduce: `python benchmarks/run.py --only t`.",
        "",
        "| variant | time per block (ms) | min–max (ms) | ÷ whole (per round) |",
        "|---|---|---|---|",
    ]
    for name, xs in s.items():
        r = ratio_text(ratios(xs, s["whole"])) if name != "whole" else "1"
        lines.append(f"| {name} | {ms(med(xs))} | {spread_ms(xs)} | {r} |")
    best = min((k for k in s if k != "whole"), key=lambda k: med(ratios(s[k], s["whole"])))
    lines += [
        "",
        f"Rounds × blocks per sample: {p['rounds']} × {p['iters']}. "
        + (
            "Cutting does not pay here: every extra gloo call costs its rendezvous of both ranks (about a "
            "millisecond, (c)), more than the compute it could hide, and gloo's reduction competes with the "
            "ranks' matmuls for the 2 cores. On NCCL the collective runs on its own stream and the trade "
            "differs (issue #15's GPU machine)."
            if med(ratios(s[best], s["whole"])) >= 1.0
            else f"The best cut, {best}, is faster than waiting at once: worth building into the lowering."
        ),
    ]
    return "\n".join(lines) + "\n"


def section_v(res: dict, quick: bool) -> str:
    d, sizes = res["world"], res["sizes"]
    first = next(iter(sizes.values()))
    lines = [
        "## Vocabulary parallelism",
        "",
        f"The main job's model at `shardflow train`'s defaults (the Llama, AdamW, float32; its default vocabulary "
        f"of {first['vocab']:,}, a larger one, and one {d} does not divide, held in uneven blocks: "
        f"docs/concepts.md#uneven-shards) under tp={d}: the preset, whose embedding, head and loss are "
        f"vocabulary-parallel (docs/concepts.md#vocabulary-parallel-embedding-and-loss), against the same Megatron "
        f"pairs with the embedding and the head replicated (`tensor_parallel(..., vocabulary=False)`), as the "
        f"preset planned them before. State = parameters + gradients + optimizer state of rank 0, from the plan, "
        f"÷ an even split of one device's; bytes = what rank 0's communications send in one step; step time: "
        f"interleaved rounds, each sample the slower rank's.",
        "",
        machine_line(res, d),
        "",
        "Reproduce: `python benchmarks/run.py --only v`.",
        "",
        "| vocabulary (parameters) | plan | state per rank (B) | ÷ even split | communications | bytes sent per step "
        "| step (ms) | min–max (ms) | ÷ replicated (per round) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for vocab, r in sizes.items():
        whole, s = sum(r["one_device_state"].values()), r["samples"]
        for name in ("vocabulary", "replicated"):
            st = sum(r[name]["state"].values())
            rt = ratio_text(ratios(s[name], s["replicated"])) if name != "replicated" else "1"
            lines.append(
                f"| {int(vocab):,} ({r['params']:,}) | {name} | {st:,} | **{st / (whole / d):.3f}** | "
                f"{r[name]['comms']} | {r[name]['comm_bytes']:,} | {ms(med(s[name]))} | {spread_ms(s[name])} | {rt} |"
            )
    on = first["vocabulary"]
    ratio = sum(on["state"].values()) / (sum(first["one_device_state"].values()) / d)
    losses = "; ".join(
        f"vocabulary {v}: " + ", ".join(f"{n} {r['losses'][n][0]:.6f}/{r['losses'][n][1]:.6f}" for n in r["losses"])
        for v, r in sizes.items()
    )
    lines += [
        "",
        f"First two losses of each plan from the same weights: {losses}. Rounds × steps per sample: "
        f"{res['params']['rounds']} × {res['params']['iters']}.",
        "",
        f"Target (issue #37): parameters + gradients + optimizer state per rank ≤ 1.1 × an even split under "
        f"tp={d} on the main job: {ratio:.3f} — {verdict(ratio <= 1.1)}. What stays whole on every rank is the "
        f"norms' weights. Vocabulary parallelism adds 5 communications per step (the embedding's all-reduce and "
        f"the head's input gradient, [N, C]; the loss's max, sum and the sum's gradient, all-reduces of [N, 1]; "
        f"its target logits stay partial through the masked sum to the loss, docs/concepts.md"
        f"#vocabulary-parallel-embedding-and-loss); on gloo each call costs a rendezvous of "
        f"both ranks (about a millisecond, (c)), so where the vocabulary is small next to the blocks the step "
        f"pays for them, and where it is large the halved head, logits and loss win.",
    ]
    uneven = [v for v in sizes if int(v) % d]
    if uneven:
        lines += [
            "",
            f"A vocabulary {d} does not divide ({', '.join(f'{int(v):,}' for v in uneven)}) keeps the state, the "
            f"bytes and the collectives of the even one next to it, and numbers equal the replicated plan's; its "
            f"step is slower: the rank holding the short block masks the padding of the ops on the logits — "
            f"[N, ⌈V/{d}⌉] copies of each uneven output forward and of each uneven gradient backward "
            f"(docs/concepts.md#uneven-shards: what it costs) — and the other rank waits for it at the loss's "
            f"reductions. Profiled on the local executor (both ranks in one process, 2026-12-01): 0.306 s per step "
            f"at 8,191 against 0.218 s at 8,192, of which the masks' copies (`torch.cat`, 38 per step) are 0.091 s "
            f"— the whole difference. Masking a fresh output's padding in place would remove most of it; not built.",
        ]
    return "\n".join(lines) + "\n"


def section_u(res: dict, quick: bool) -> str:
    d, batches = res["world"], res["batches"]
    even = next(b for b in batches if int(b) % d == 0)
    lines = [
        "## Uneven shards",
        "",
        f"The main job's model at `shardflow train`'s defaults (the Llama, AdamW, float32, 64 tokens per sequence) "
        f"under dp={d}, at global batches of {', '.join(batches)} sequences: {even} splits evenly; the others are "
        f"held in DTensor's uneven blocks, padded (docs/concepts.md#uneven-shards). Bytes: what rank 0's "
        f"communications send in one step; redistributed: the forward bytes of the redistributions the planner "
        f"inserted where a rule refused an uneven dim; step time: interleaved rounds, each sample the slower "
        f"rank's; tokens/s from the median step.",
        "",
        machine_line(res, d),
        "",
        "Reproduce: `python benchmarks/run.py --only u`.",
        "",
        "| batch | blocks per rank | communications | bytes sent per step | redistributed (B) | step (ms) "
        "| min–max (ms) | in communication (ms, rank 0) | tokens/s | ÷ even batch's tokens/s (per round) "
        "| first two losses (one device) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = batches[even]["samples"]
    for b, r in batches.items():
        n, s = int(b), r["samples"]
        c = -(-n // d)
        blocks = ", ".join(str(max(0, min(c, n - i * c))) for i in range(d))
        per_token = [r["tokens"] / x / (batches[even]["tokens"] / y) for x, y in zip(s, base)]
        losses = (
            ", ".join(f"{a:.5f}" for a in r["losses"])
            + " ("
            + ", ".join(f"{a:.5f}" for a in r["one_device_losses"])
            + ")"
        )
        lines.append(
            f"| {n} | {blocks} | {r['comms']} | {r['comm_bytes']:,} | {r['redistributed_bytes']:,} | "
            f"{ms(med(s))} | {spread_ms(s)} | {r['trace']['comm_ms']:.1f} of {r['trace']['step_ms']:.1f} | "
            f"{r['tokens'] / med(s):,.0f} | "
            f"{'1' if b == even else ratio_text(per_token)} | {losses} |"
        )
    lines += [
        "",
        f"Rounds × steps per sample: {res['params']['rounds']} × {res['params']['iters']}. Each rank computes its "
        f"block at the padded size, so a batch of B sequences costs what ⌈B/{d}⌉·{d} cost, plus the masking "
        f"copies on the rank with a short block; the one layer that cannot keep the uneven batch is the loss's "
        f"view of the logits [B, T, V] → [B·T, V] (a merge of the uneven dim with T, whose blocks are not DTensor's "
        f"chunks of B·T), where the planner moves the logits onto the vocabulary and back: the redistributed "
        f"bytes above, 4 more collectives per step. They are what the uneven batches pay: rank 0's time in "
        f"communication (its waits for rank 1 included) grows by about as much as the step. A layout for such a "
        f"merge (blocks of ⌈B/{d}⌉·T rows, not ⌈B·T/{d}⌉) would keep the logits where they are; it is not built. "
        f"Without uneven blocks these batches were a DegreeError.",
    ]
    return "\n".join(lines) + "\n"


def _outside(a: dict, instrs: int) -> tuple[float, float, float, float]:
    """(wall, ATen, communication, rest) seconds per step of a torch.profiler run of the executor."""
    n = a["steps"]
    wall = a["wall_s"] / n
    aten = sum(v["self_s"] for k, v in a["ops"].items() if k.startswith("aten::")) / n
    comm = sum(a["timers_s"].values()) / n
    return wall, aten, comm, wall - aten - comm


def section_p(res: dict, quick: bool) -> str:
    main, tiny = res["main"], next(v for k, v in res.items() if k.startswith("h") and isinstance(v, dict))
    h, th = main["h"], tiny["h"]
    instrs = main["program"]["instrs"]
    lines = [
        f"## Profile: one shardflow tp=2 step of (a), h={h} (p)",
        "",
        f"Rank 0 of the (a) MLP (batch {res['batch']}) under tp=2; the rank's program has {instrs} instructions "
        f"({main['program']['computes']} computes, {main['program']['comms']} communication). The same model at "
        f"h={th} shows the cost that does not depend on tensor sizes (its torch ops take microseconds).",
        "",
        machine_line(res, 2),
        "",
        f"Reproduce: `python benchmarks/run.py --only p{' --quick' if quick else ''}`.",
        "",
        "Step time, shardflow and hand-written interleaved in this session:",
        "",
        "| h | shardflow (ms) | hand-written (ms) | shardflow ÷ hand (per round) | difference per step (medians) |",
        "|---|---|---|---|---|",
    ]
    for r in (main, tiny):
        sf, hd = r["samples"]["shardflow"], r["samples"]["hand"]
        extra = med(sf) - med(hd)
        per = f" = {extra / instrs * 1e6:.0f} µs × {instrs} instructions" if r is tiny else ""
        lines.append(
            f"| {r['h']} | {ms(med(sf))} ({spread_ms(sf)}) | {ms(med(hd))} ({spread_ms(hd)}) | "
            f"{ratio_text(ratios(sf, hd))} | {ms(extra)} ms{per} |"
        )
    t, tt = main["timers"], tiny["timers"]
    total, ttotal = t["total_s"] / t["steps"], tt["total_s"] / tt["steps"]
    parts = {k: v / t["steps"] for k, v in t["sum_s"].items()}
    tparts = {k: v / tt["steps"] for k, v in tt["sum_s"].items()}
    loop, tloop = total - sum(parts.values()), ttotal - sum(tparts.values())
    lines += [
        "",
        f"**1. Timers**: `time.perf_counter` around each kernel call (by instruction), `_communicate`, `_put` and "
        f"`_get` of the executor ({t['steps']} steps at h={h}: {ms(total)} ms per step; {tt['steps']} at "
        f"h={th}: {ttotal * 1e6:.0f} µs per step). A collective's time includes waiting for the other rank to "
        f"reach it.",
        "",
        f"| part | h={h}: ms per step | share | h={th}: µs per step | calls per step |",
        "|---|---|---|---|---|",
    ]
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        lines.append(
            f"| {k} | {ms(v)} | {100 * v / total:.0f} % | {tparts.get(k, 0) * 1e6:.0f} | "
            f"{t['calls'][k] / t['steps']:g} |"
        )
    lines.append(
        f"| executor loop between instructions (remainder: frees, ledger, dict traffic, tensor deallocation) "
        f"| {ms(loop)} | {100 * loop / total:.0f} % | {tloop * 1e6:.0f} | – |"
    )
    sf, hd = main["aten"].get("shardflow"), main["aten"].get("hand")
    if sf and hd:
        wall, aten, comm, rest = _outside(sf, instrs)
        twall, taten, tcomm, trest = _outside(tiny["aten"]["shardflow"], instrs)
        lines += [
            "",
            f"**2. Outside torch ops**: torch.profiler (ATen ops' self CPU time) with timers on the "
            f"communication calls in the same run. h={h}: {ms(wall)} ms per step = {ms(aten)} ATen + {ms(comm)} "
            f"communication calls + {ms(rest)} other (Python: executor, kernel wrappers, autograd glue); "
            f"h={th}: {twall * 1e6:.0f} µs = {taten * 1e6:.0f} ATen + {tcomm * 1e6:.0f} communication + "
            f"{trest * 1e6:.0f} other, i.e. **≈ {trest / instrs * 1e6:.0f} µs per instruction outside torch ops** "
            f"({instrs} instructions; at h={h} {rest / instrs * 1e6:.0f} µs, which includes the profiler's own "
            f"cost and scheduling noise).",
            "",
            f"ATen ops at h={h} ({sf['steps']} steps each; single runs, not interleaved: compare calls and the "
            f"large differences):",
            "",
            "| ATen op | shardflow calls/step | shardflow ms/step | hand-written calls/step | hand-written ms/step |",
            "|---|---|---|---|---|",
        ]
        keys = [k for k in list(sf["ops"]) if k.startswith("aten::")][:12]
        keys += [k for k in list(hd["ops"]) if k.startswith("aten::") and k not in keys][:3]
        for k in keys:
            a, b = sf["ops"].get(k), hd["ops"].get(k)
            fa = f"{a['calls'] / sf['steps']:g} | {ms(a['self_s'] / sf['steps'])}" if a else "0 | –"
            fb = f"{b['calls'] / hd['steps']:g} | {ms(b['self_s'] / hd['steps'])}" if b else "0 | –"
            lines.append(f"| `{k}` | {fa} | {fb} |")
    cp = main.get("cprofile")
    if cp:
        c = cp["categories_s"]
        w = cp["wall_s"]
        lines += [
            "",
            f"**3. cProfile** of rank 0 ({cp['steps']} steps at h={h}, {ms(w / cp['steps'])} ms per step under "
            f"the profiler). tottime by kind: torch built-ins {100 * c['torch'] / w:.0f} %, communication "
            f"built-ins (`wait`, `allreduce`) {100 * c['comm'] / w:.0f} %, Python functions "
            f"{100 * c['python'] / w:.0f} %. cProfile does not see tensor operators (`w - lr * g` is counted in "
            f"the Python function that writes it, e.g. `kernels.update`).",
            "",
            "| function | tottime ms/step | cumtime ms/step | calls/step | kind |",
            "|---|---|---|---|---|",
        ]
        for tt_, ct, nc, cat, name in cp["top_tottime"][:14]:
            lines.append(
                f"| `{name}` | {ms(tt_ / cp['steps'])} | {ms(ct / cp['steps'])} | {nc / cp['steps']:g} | {cat} |"
            )
    if sf and hd:

        def op(a, name):
            return a["ops"].get(name, {"self_s": 0.0})["self_s"] / a["steps"]

        upd = parts.get(UPDATES, 0.0)
        back = parts.get("loss read-back (_get: an all-reduce)", 0.0)
        tback = tparts.get("loss read-back (_get: an all-reduce)", 0.0)
        lines += [
            "",
            "**Findings** (this run's numbers):",
            "",
            f"* SGD update: {ms(upd)} ms per step in one kernel for the 4 weights (timers: torch.optim's fused "
            f"SGD, `aten::_fused_sgd_` {ms(op(sf, 'aten::_fused_sgd_'))} ms), in place like the hand-written "
            f"`w.add_(g, alpha=-lr)` (`aten::add_` {ms(op(hd, 'aten::add_'))} ms).",
            f"* Reading the loss: {ms(back)} ms per step at h={h} and {tback * 1e6:.0f} µs at h={th} (the loss is "
            f"replicated under tp, so it is read locally; a partial loss, as under dp, takes one scalar all-reduce).",
            f"* Fixed cost: at h={th} shardflow's step is {ms(med(tiny['samples']['shardflow']) - med(tiny['samples']['hand']))} ms "
            f"longer than the hand-written one ({instrs} instructions); outside torch ops and communication "
            f"≈ {trest / instrs * 1e6:.0f} µs per instruction; input placement (`_put`, this rank's piece of each "
            f"input) {tparts.get('input placement (_put)', 0) * 1e6:.0f} µs per step; the executor loop between "
            f"instructions {tloop / instrs * 1e6:.0f} µs per instruction.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="h=1024 only, fewer sizes and rounds, no 4-rank run (< 4 min)")
    p.add_argument(
        "--only", default=",".join(KEYS), help=f"comma-separated workloads among {', '.join(KEYS)} (default: all)"
    )
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print the sections only")
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "bench"), help="rank logs and JSON results")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rebuild the sections from the JSON results an earlier run left in --run-dir",
    )
    args = p.parse_args(argv)
    keys = "".join(k.strip() for k in args.only.split(","))
    unknown = set(keys) - set(KEYS)
    if unknown or not keys:
        p.error(f"--only takes workloads among {', '.join(KEYS)}; got {args.only!r}")
    # One-process baselines with 2 threads: on a shared machine, OpenMP threads that spin while waiting lose
    # their core to other processes and make a 2-thread step several times slower; passive waiting avoids it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    run_dir = Path(args.run_dir)
    results: dict[str, dict] = {}
    t_all = time.perf_counter()
    for label, workload, nproc, params in sessions(keys, args.quick):
        d = run_dir / label
        if args.render_only:
            if (d / "result.json").exists():
                results[label] = json.loads((d / "result.json").read_text())
            continue
        d.mkdir(parents=True, exist_ok=True)
        (d / "result.json").unlink(missing_ok=True)
        print(f"== {label}: {workload} on {nproc} ranks", flush=True)
        t0 = time.perf_counter()
        res = launch([sys.executable, str(RANKS), workload, str(d), json.dumps(params)], nproc, d, grace_s=60)
        if not res.ok:
            print(describe_failure(res, d), file=sys.stderr)
            return 1
        results[label] = json.loads((d / "result.json").read_text())
        print(f"   {label} done in {time.perf_counter() - t0:.0f} s", flush=True)
    texts = []
    if "a" in results:
        texts.append(section_a(results["a"], args.quick))
    if "b+e" in results:
        texts.append(section_b(results["b+e"], args.quick))
    gpt = results.get("b+e") or results.get("e")
    if gpt and "e" in keys:
        texts.append(section_e(gpt, args.quick))
    if "c" in results:
        texts.append(section_c(results["c"], results.get("c4"), args.quick))
    if "d" in results:
        texts.append(section_d(results["d"], args.quick))
    if "f" in results:
        texts.append(section_f(results["f"], args.quick))
    if "g" in results:
        texts.append(section_g(results["g"], args.quick))
    if "p" in results:
        texts.append(section_p(results["p"], args.quick))
    moe = {int(label[1:]): results[label] for label in ("m2", "m4") if label in results}
    if moe:
        texts.append(section_m(moe, args.quick))
    if "q" in results:
        texts.append(section_q(results["q"], args.quick))
    if "t" in results:
        texts.append(section_t(results["t"], args.quick))
    if "v" in results:
        texts.append(section_v(results["v"], args.quick))
    if "u" in results:
        texts.append(section_u(results["u"], args.quick))
    context = {int(label[1:]): results[label] for label in ("x2", "x4") if label in results}
    if context:
        texts.append(section_x(context, args.quick))
    for t in texts:
        print(t)
    if not args.no_write:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        for t in texts:
            write_section(out, t)
        print(f"wrote {len(texts)} section(s) to {out}", file=sys.stderr)
    print(f"total {time.perf_counter() - t_all:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
