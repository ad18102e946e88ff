"""The GPU run of issue #41, in one process tree that fits a short lease of a GPU machine:

    python3 tools/gpu_run.py --out DIR [--device cuda] [--budget SECONDS]

runs, each with its own time limit, on the interpreter and torch it is started with (no install: the repository's
root goes on ``PYTHONPATH``):

1. ``env``: the interpreter, torch, its CUDA, the device's name (``nvidia-smi -L`` where there is one);
2. ``cuda-tests``: ``tests/test_device.py`` and ``tests/test_metrics.py`` (the tests that run on a GPU where torch
   sees one, and skip, saying so, where not);
3. ``calibrate``: ``shardflow calibrate --nproc 1`` (the computation of one device: matmul, attention and
   elementwise rates in float32 and bfloat16, the launch floor, the executor's overhead) into ``DIR/cal``;
4. ``train-check``: ``shardflow train --nproc 1 --device DEV --steps 50 --check`` (the main job's strategy, tp,
   on a mesh of the one device, checked against the single-device plan);
5. ``train-check-single``: the same check with the run's plan the reference's own (``--strategy single``): what
   the device's kernels alone make the two differ by (nothing, under ``--check``'s deterministic kernels);
6. ``train-single``: the main job's model on one device, 50 steps, its step time predicted from that calibration
   (``MachineSpec.this``) beside the measured one;
7. ``train-bf16``: a larger model (8 blocks × 1536, sequence 2048, batch 8) in bfloat16 on one device, 30 steps,
   predicted beside measured (a step the GPU's matmuls, not the executor, dominate);
8. ``step-bench``: ``benchmarks/step.py --device DEV --no-write``: the local executor against eager PyTorch;
9. ``block-profile``: ``benchmarks/block_profile.py``: a Llama 3 8B-shaped step (2 of its blocks, its vocabulary,
   sequence 8192, batch 2, bf16, selective checkpointing) on the device, per kind of instruction, measured against
   predicted on that calibration and on the shipped ``h100`` spec (``DIR/block_profile.json``; on the CPU a small
   model of the same kind).

Every step's output goes to ``DIR/gpu_run.log``; ``DIR/summary.json`` holds each step's exit status, seconds and
what was read off it (the predicted and measured step times, the tests' pass/skip counts). A step's limit is cut
to what is left of ``--budget`` (the lease), and a step is skipped with under :data:`MIN_LEFT` seconds left. ``--device cpu`` runs the same on the CPU (gloo): the
script's own check, not the GPU run. Exit status 0 when every step ran and passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "shardflow.cli"]
BF16_MODEL = ["--layers", "8", "--embd", "1536", "--heads", "12", "--kv-heads", "4", "--seq-len", "2048"]
SMALL_BLOCK = [
    "--embd",
    "256",
    "--mlp",
    "512",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--vocab",
    "1024",
    "--seq-len",
    "256",
]
PREDICTED = re.compile(r"step time: predicted ([\d.]+) ms, measured ([\d.]+) ms")
PROFILED = re.compile(r"step: measured ([\d.]+) ms .*; predicted on this ([\d.]+) ms, on h100 ([\d.]+) ms")
MIN_LEFT = 30  # seconds of the budget under which a step is not started
PYTEST = re.compile(r"(\d+) (passed|failed|skipped|error)")


def steps(device: str, tmp: Path, out: Path) -> list[tuple[str, list[str], int]]:
    """(name, argv, seconds allowed) of each step, in order (``out``: where a step writes its own figures)."""
    train = [*CLI, "train", "--nproc", "1", "--device", device, "--eval-every", "1000"]
    backend = "nccl" if device == "cuda" else "gloo"
    return [
        ("env", [sys.executable, "-c", ENV], 60),
        (
            "cuda-tests",
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-n", "4", "--dist", "loadfile"]
            + ["tests/test_device.py", "tests/test_metrics.py"],
            240,
        ),
        ("calibrate", [*CLI, "calibrate", "--nproc", "1", "--backend", backend], 150),
        ("train-check", [*train, "--steps", "50", "--check", "--run-dir", str(tmp / "check")], 300),
        (
            "train-check-single",
            [*train, "--strategy", "single", "--steps", "50", "--check", "--run-dir", str(tmp / "check-single")],
            200,
        ),
        ("train-single", [*train, "--strategy", "single", "--steps", "50", "--run-dir", str(tmp / "single")], 200),
        (
            "train-bf16",
            [*train, "--strategy", "single", "--steps", "30", "--dtype", "bf16", *BF16_MODEL, "--batch-size", "8"]
            + ["--run-dir", str(tmp / "bf16")],
            300,
        ),
        ("step-bench", [sys.executable, "benchmarks/step.py", "--device", device, "--no-write", "--rounds", "5"], 300),
        (
            "block-profile",
            [
                sys.executable,
                "benchmarks/block_profile.py",
                "--device",
                device,
                "--out",
                str(out / "block_profile.json"),
            ]
            + ([] if device == "cuda" else SMALL_BLOCK),
            300,
        ),
    ]


ENV = """
import platform, shutil, subprocess, sys, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
for name in ("transformers", "tokenizers", "safetensors", "scipy", "hypothesis", "xdist"):
    try:
        m = __import__(name)
        print(name, getattr(m, "__version__", "?"))
    except ImportError as e:
        print(name, "missing:", e)
"""


def read_off(name: str, text: str) -> dict:
    """What the summary keeps of a step's output: the predicted and measured step times (ms) of a training run, the
    counts of a test run."""
    got: dict = {}
    if m := PREDICTED.search(text):
        got["predicted_ms"], got["measured_ms"] = float(m[1]), float(m[2])
        got["error"] = round((got["predicted_ms"] - got["measured_ms"]) / got["measured_ms"], 4)
    if m := PROFILED.search(text):
        got["measured_ms"], got["this_ms"], got["h100_ms"] = float(m[1]), float(m[2]), float(m[3])
    if name == "cuda-tests":
        last = [line for line in text.splitlines() if PYTEST.search(line) and " in " in line][-1:]
        got.update({k: int(n) for n, k in PYTEST.findall(last[0] if last else "")})
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_run.log, summary.json and cal/")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default), or cpu: a dry run")
    p.add_argument("--budget", type=float, default=540.0, help="seconds all steps may take together (default 540)")
    p.add_argument("--only", help="comma-separated step names to run (default: all)")
    args = p.parse_args(argv)
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "shardflow-gpu-run"
    shutil.rmtree(tmp, ignore_errors=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "SHARDFLOW_CALIBRATION_DIR": str(out / "cal"),
    }
    summary: dict = {"device": args.device, "steps": {}}
    ok = True
    with open(out / "gpu_run.log", "w") as log:
        for name, cmd, limit in steps(args.device, tmp, out):
            if args.only and name not in args.only.split(","):
                continue
            left = args.budget - (time.monotonic() - start)
            if left < MIN_LEFT:
                summary["steps"][name] = {"skipped": f"{left:.0f} s left of the budget"}
                ok = False
                continue
            limit = int(min(limit, left))
            log.write(f"\n===== {name}: {' '.join(cmd)}\n")
            log.flush()
            t0 = time.monotonic()
            try:
                res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
                rc, text = res.returncode, res.stdout + res.stderr
            except subprocess.TimeoutExpired as e:
                rc = 124
                text = "".join(x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
            seconds = round(time.monotonic() - t0, 1)
            log.write(text + f"\n===== {name}: exit {rc} in {seconds} s\n")
            log.flush()
            got = read_off(name, text)
            summary["steps"][name] = {"rc": rc, "seconds": seconds, **got}
            ok = ok and rc == 0
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            print(f"{name}: exit {rc} in {seconds} s {got or ''}", flush=True)
    summary["seconds"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
