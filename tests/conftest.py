"""Fixtures shared by the tests that train: a small text, the tiny model's ``shardflow train`` command line, runs of
it in a subprocess (several processes) or in the test's process (one process: no interpreter start-up), and a
reader of the metrics a run writes; the tiny Hugging Face Llama the plan tests capture."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

def tiny_hf_llama():
    """The tiny Hugging Face Llama of the plan tests (2 layers, width 64, 4 heads over 2 key/value heads, MLP 128,
    vocabulary 96; float32, seeded) and its batch of 8 sequences of 8 tokens, the labels being the tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                         use_cache=False))
    ids = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def tiny_hf_llama_float64():
    """:func:`tiny_hf_llama` in float64, its batch, and its graph captured keeping float64 (``wide_floats``: the
    loss too), for checks against one device at 1e-12."""
    from shardflow.capture import capture, wide_floats
    model, batch = tiny_hf_llama()
    model = model.double()
    with wide_floats():
        graph = capture(model, batch)
    return model, batch, graph


# A GPT of 1 layer, 2 heads, width 16 on 16-character sequences, batch 8: a step takes milliseconds; validation
# every 2 steps on 1 batch; a line every step; MFU against a given peak (measuring one takes a second per run).
# Later flags override these (argparse: the last one wins).
TINY = ("--layers", "1", "--heads", "2", "--embd", "16", "--seq-len", "16", "--batch-size", "8", "--eval-every", "2",
        "--eval-batches", "1", "--log-every", "1", "--lr", "0.01", "--timeout", "30", "--peak-tflops", "0.1")


@pytest.fixture(autouse=True)
def keep_sigterm_handler():
    """``train --nproc 1`` run in the test's process installs a SIGTERM handler; put pytest's back after each test.
    (A module-scoped fixture that trains is set up before this one, so it restores the handler itself.)"""
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """The default corpus's tokenizer and token file are cached in a directory of this session (``XDG_CACHE_HOME``,
    inherited by every process the tests start), never in the user's ~/.cache; no calibration file is read from
    there either (``SHARDFLOW_CALIBRATION_DIR``: an empty directory of this session, which no test writes — a test
    that calibrates writes to its own ``--out`` or directory), so every cost model is the defaults."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        mp.setenv("SHARDFLOW_CALIBRATION_DIR", str(tmp_path_factory.mktemp("no-calibration")))
        yield


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A text of 28 characters (the lowercase letters, space and full stop) repeated to 9,000: the data of every
    tiny run (its BPE, cached next to it, has a token per word)."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    return path


@pytest.fixture(scope="session")
def train_argv(corpus):
    """``train_argv(run, *flags, data=corpus, entry=("-m", "shardflow.cli"))``: the argv of ``shardflow train`` on
    the tiny model (:data:`TINY`) reading ``data`` and writing the run directory ``run``; ``flags`` go last."""
    def argv(run: Path, *flags: str, data: Path | str = corpus, entry: tuple[str, ...] = ("-m", "shardflow.cli")):
        return [sys.executable, *entry, "train", *TINY, "--data", str(data), "--run-dir", str(run), *flags]
    return argv


@pytest.fixture(scope="session")
def train_here(corpus):
    """``train_here(run, *flags, data=corpus)``: ``shardflow train`` on the tiny model (:data:`TINY`) run by
    ``shardflow.cli.main`` in this process (no interpreter or torch import to pay for: a one-process run, or one that
    fails before starting any), writing the run directory ``run``; returns what ``subprocess.run`` would:
    a ``CompletedProcess`` with the exit status and the printed stdout and stderr. SIGTERM's handler is put back."""
    from shardflow.cli import main

    def run_here(run: Path, *flags: str, data: Path | str = corpus) -> subprocess.CompletedProcess:
        argv = ["train", *TINY, "--data", str(data), "--run-dir", str(run), *flags]
        out, err, old = io.StringIO(), io.StringIO(), signal.getsignal(signal.SIGTERM)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        finally:
            signal.signal(signal.SIGTERM, old)
        return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    return run_here


@pytest.fixture(scope="session")
def run_train(train_argv):
    """``run_train(tmp_path, name, *argv)``: ``shardflow train`` of 4 steps (tiny model) in a subprocess (the runs of
    several processes, whose rank 0 prints to the command's stdout); returns the completed process and the run
    directory ``tmp_path/name``."""
    def run_train(tmp_path, name, *argv):
        run = tmp_path / name
        r = subprocess.run(train_argv(run, "--steps", "4", *argv), capture_output=True, text=True, timeout=300)
        return r, run
    return run_train


@pytest.fixture(scope="session")
def run_here(train_here):
    """``run_here(tmp_path, name, *argv)``: as :func:`run_train`, in this process (:func:`train_here`): the runs of
    one process (``--nproc 1``) and the ones refused before any process starts."""
    def run_here(tmp_path, name, *argv):
        run = tmp_path / name
        return train_here(run, "--steps", "4", *argv), run
    return run_here


@pytest.fixture(scope="session")
def tiny() -> tuple[str, ...]:
    """The tiny model's flags (:data:`TINY`), for ``shardflow.cli.main`` in this process."""
    return TINY


def _read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def read_metrics():
    """``read_metrics(run)``: the records of ``run/metrics.jsonl``, one dict per step."""
    return _read_metrics
