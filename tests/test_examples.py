"""The examples run as documented: the own-model example with every rank in one process and as 2 real processes,
and the Hugging Face example (shardflow.parallelize on a tiny Llama, dp=2,tp=2 in one process)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import patience

from shardflow.runtime.launch import describe_failure, launch

EXAMPLE = str(Path(__file__).parents[1] / "examples" / "own_model.py")
HF_LLAMA = str(Path(__file__).parents[1] / "examples" / "hf_llama.py")


def final_loss(text):
    return float(next(line for line in text.splitlines() if line.startswith("final loss")).split()[-1])


def test_own_model_example_in_one_process_and_two(tmp_path):
    r = subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True, timeout=patience(120))
    assert r.returncode == 0, r.stderr
    one = final_loss(r.stdout)
    assert one < 0.05  # it learns
    res = launch([sys.executable, EXAMPLE], 2, tmp_path, grace_s=30, echo_rank0=False)
    assert res.ok, describe_failure(res, tmp_path)
    log = (tmp_path / "rank0.log").read_text()
    two = final_loss(log)
    assert abs(two - one) < 1e-4  # tp=2 (torch's styles) over 2 processes ≡ dp=2,tp=2 in one process ≡ one device
    # the norm of the last step's gradients summed from the ranks' DTensors is the trainer's (float32 rounding)
    norm = next(line for line in log.splitlines() if line.startswith("gradient norm of the DTensors"))
    ours, theirs = map(float, re.findall(r"\d[\d.]*(?:e[-+]\d+)?", norm))
    assert abs(ours - theirs) <= 1e-5 * theirs, norm


def test_hugging_face_example_trains_and_gives_the_weights_back():
    """The loss falls every 5 steps, and the plain module with the trainer's state dict computes a loss below the
    last step's (which was measured before that step's update)."""
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, HF_LLAMA], capture_output=True, text=True, timeout=patience(300))
    assert r.returncode == 0, r.stderr
    losses = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 4 and losses == sorted(losses, reverse=True) and losses[0] < 4.6  # log(96) ≈ 4.56 at init
    assert final_loss(r.stdout) < losses[-1]
