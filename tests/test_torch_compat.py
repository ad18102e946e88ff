"""Running on other torch versions: the collectives each version has (:mod:`shardflow.runtime.torch_compat`), a
meta-built model's capture, and the pieces of tools/compat.py that decide what it installs and how it reads pytest."""

import importlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardflow.capture import capture

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import compat  # noqa: E402  (tools/compat.py)


def test_collectives_fall_back_to_the_tensor_forms(monkeypatch):
    import shardflow.runtime.torch_compat as tc

    try:
        for name in ("all_gather_single", "reduce_scatter_single"):
            monkeypatch.delattr(dist, name, raising=False)
        importlib.reload(tc)
        assert tc.all_gather_single is dist.all_gather_into_tensor
        assert tc.reduce_scatter_single is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(tc)
    # where this torch has the _single forms (2.13), they are the ones used
    assert tc.all_gather_single is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert tc.reduce_scatter_single is getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, idx, labels):
        logits = self.head(self.wte(idx))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.to(logits.device).flatten())


def test_meta_model_captures_a_cpu_batch():
    """A model built on meta with its example batch on the CPU (what shardflow train captures: the parameters stay
    on meta, materialized piece by piece later) gives the graph of the same model built on the CPU; before torch 2.13
    a CPU index into a meta embedding was refused by export's fake tensors."""
    torch.manual_seed(0)
    idx = torch.randint(0, 16, (2, 4))
    real = capture(_Embed(), {"idx": idx, "labels": idx})
    with torch.device("meta"):
        meta_model = _Embed()
    assert capture(meta_model, {"idx": idx, "labels": idx}).listing() == real.listing()


def test_compat_constraints_pin_the_torch_under_test(tmp_path):
    text = compat.constraints_for("2.11.0", tmp_path / "c.txt").read_text()
    assert "torch==2.11.0" in text.splitlines() and "torch==2.13.0" not in text
    assert "transformers==" in text  # the other pins stay as they are


def test_compat_installs_no_torch_requirement():
    reqs = compat.other_requirements()
    assert not [r for r in reqs if r.split(">")[0].split("=")[0].split("[")[0].strip().lower() == "torch"]
    assert not [r for r in reqs if "[" in r and "torch" in r]  # safetensors[torch] → safetensors + numpy
    assert "numpy" in reqs and any(r.startswith("safetensors") for r in reqs)


def test_compat_reads_pytests_closing_line():
    assert compat.summary_counts("...\n3 failed, 1290 passed, 4 skipped, 650 deselected, 2 errors in 201.3s\n") == {
        "failed": 3,
        "passed": 1290,
        "skipped": 4,
        "deselected": 650,
        "error": 2,
    }


def test_the_gpu_run_runs_its_steps_and_keeps_what_they_measured(tmp_path):
    """tools/gpu_run.py, the prepared GPU run of issue #41, dry-run on the CPU (``--device cpu``) with its first
    steps and the block profile (benchmarks/block_profile.py, a small model on the CPU): each step's exit status and
    seconds in summary.json, its output in gpu_run.log, the calibration written where the later steps read it, the
    profile's kinds of instruction measured and predicted on both specs, its longest computes paired with their
    predictions; and what it reads off a training run's last lines and a test run's summary."""
    import json
    import subprocess

    import gpu_run  # tools/gpu_run.py

    argv = [sys.executable, "tools/gpu_run.py", "--out", str(tmp_path), "--device", "cpu"]
    res = subprocess.run(
        [*argv, "--only", "env,calibrate,block-profile"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cpu" and list(summary["steps"]) == ["env", "calibrate", "block-profile"]
    assert all(s["rc"] == 0 and s["seconds"] > 0 for s in summary["steps"].values())
    profile = json.loads((tmp_path / "block_profile.json").read_text())
    assert summary["steps"]["block-profile"]["measured_ms"] == round(profile["measured_step_s"] * 1e3, 1)
    kinds = {r["kind"]: r for r in profile["kinds"]}
    assert {"linear", "attention", "elementwise", "update"} <= set(kinds)
    assert kinds["linear"]["count"] == 30  # 2 blocks × 7 linears + the head, forward and backward
    assert all(r["measured_s"] > 0 and r["this_s"] > 0 and r["h100_s"] > 0 for r in kinds.values())
    assert len(profile["longest"]) == 10 and all(e["this"] and e["h100"] for e in profile["longest"])
    log = (tmp_path / "gpu_run.log").read_text()
    assert f"torch {torch.__version__}" in log and "===== calibrate: exit 0" in log
    assert (tmp_path / "cal" / "calibration-gloo.json").is_file()
    train = "done: ...\nstep time: predicted 82.9 ms, measured 71.61 ms (median of 28 steps, data loading apart): +16%"
    assert gpu_run.read_off("train-bf16", train) == {"predicted_ms": 82.9, "measured_ms": 71.61, "error": 0.1577}
    tests = "....F\n1 failed, 24 passed, 3 skipped in 43.56s\nwarnings"
    assert gpu_run.read_off("cuda-tests", tests) == {"failed": 1, "passed": 24, "skipped": 3}
