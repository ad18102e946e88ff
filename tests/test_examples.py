"""The own-model example runs as documented: every rank in one process, and as 2 real processes."""

import subprocess
import sys
from pathlib import Path

from shardflow.runtime.launch import describe_failure, launch

EXAMPLE = str(Path(__file__).parents[1] / "examples" / "own_model.py")


def final_loss(text):
    return float(next(l for l in text.splitlines() if l.startswith("final loss")).split()[-1])


def test_own_model_example_in_one_process_and_two(tmp_path):
    r = subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    one = final_loss(r.stdout)
    assert one < 0.05  # it learns
    res = launch([sys.executable, EXAMPLE], 2, tmp_path, grace_s=30, echo_rank0=False)
    assert res.ok, describe_failure(res, tmp_path)
    two = final_loss((tmp_path / "rank0.log").read_text())
    assert abs(two - one) < 1e-4  # tp=2 over 2 processes ≡ dp=2,tp=2 in one process ≡ one device
