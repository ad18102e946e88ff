"""The two test tiers (``unit``, ``integration``: see :func:`pytest_collection_modifyitems`), and fixtures shared by
the tests that train: a small text, the tiny model's ``shardflow train`` command line, runs of it in a subprocess
(several processes) or in the test's process (one process: no interpreter start-up), and a reader of the metrics a
run writes; the tiny Hugging Face Llama the plan tests capture."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# --- tiers --------------------------------------------------------------------------------------------------------
# Every test is in one of two tiers (markers registered in pyproject.toml):
#   unit         planning, lowering, rules, kernels, executors in this process: seconds, no process started
#                (`make test-fast` = `pytest -m unit`);
#   integration  what starts processes (launch, subprocess, torchrun), the CLI, training runs, checkpoints, the docs'
#                commands and generated blocks, the model matrix.
# A test is integration when it is marked @pytest.mark.integration, its file is in INTEGRATION_FILES, it uses one of
# INTEGRATION_FIXTURES (they run `shardflow train`) or its name is in INTEGRATION_TESTS; every other test is unit.
# A new test that starts a process or trains: mark it, or list it (or its file) here.

INTEGRATION_FILES = {
    "test_api.py": "the public API end to end: parallelize's Trainer against eager PyTorch (a minute)",
    "test_bad_inputs.py": "the CLI on bad inputs; rendezvous failures in processes",
    "test_check.py": "shardflow check: eager vs shardflow, gloo processes",
    "test_checkpoint.py": "checkpoints, resume, export, generate",
    "test_cnn.py": "ResNet end to end against one device, also in 2 processes (45 s)",
    "test_cli.py": "the shardflow command, also in a subprocess",
    "test_distributed.py": "4 processes (tests/dist_worker.py)",
    "test_docs.py": "the documented commands and the generated blocks",
    "test_examples.py": "the examples, run as scripts",
    "test_faults.py": "processes that fail (tests/fault_worker.py)",
    "test_hf_models.py": "Hugging Face models end to end: captured, trained as eager, every op's rule (a minute)",
    "test_hf_strategies.py": "2 processes (tests/hf_worker.py)",
    "test_memory.py": "training runs in subprocesses",
    "test_reaper.py": "an orphaned, stopped process adopted and reaped",
    "test_model_matrix.py": "the model matrix: shardflow check on every family and strategy",
    "test_rundir.py": "training runs and their directories",
    "test_train.py": "shardflow train",
    "test_train_check.py": "shardflow train --check",
}
INTEGRATION_FIXTURES = {"run_train", "run_here", "train_here", "train_argv"}
INTEGRATION_TESTS = {  # file::test (all its parameters) in files otherwise unit; seconds are measured on 2 busy cores
    "test_calibration.py::test_calibrate_nproc_2_writes_a_file_the_cost_model_reads": "2 processes",
    "test_calibration.py::test_calibrate_refuses_bad_inputs_before_any_process_starts": "the CLI",
    "test_calibration.py::test_calibrate_nproc_1_times_the_computation_alone": "the CLI, 1 process",
    "test_captured_properties.py::test_a_captured_model_trains_like_eager": "random models captured and trained (18 s)",
    "test_data.py::test_bpe_training_is_deterministic_across_processes": "a subprocess",
    "test_data.py::test_char_run_saves_its_tokenizer_for_generate_and_resume": "shardflow train and generate",
    "test_device.py::test_no_tensor_of_a_step_load_save_or_restore_is_made_without_a_device": "checkpoints",
    "test_export_capture.py::test_hugging_face_models_capture_with_eager_numbers": "HF models against eager (12 s)",
    "test_fsdp.py::test_fsdp_on_hugging_face_mamba_shards_every_weight_and_moves_what_dp_moves": "HF Mamba2 (11 s)",
    "test_materialize.py::test_a_model_built_on_meta_captures_the_graph_of_the_model_built_whole": "25 s",
    "test_materialize.py::test_the_main_jobs_ranks_materialize_only_their_pieces": "the main job's model and data",
    "test_materialize.py::test_parallelize_takes_a_model_built_on_the_meta_device": "18 s",
    "test_plan_mutations.py::test_train_verifies_the_plan_before_launching": "shardflow train",
    "test_redistribution.py::test_bytes_match_or_beat_dtensor": "a subprocess (DTensor's process group)",
    "test_redistribution.py::test_plan_lists_redistributions_and_strict_refuses": "the CLI",
    "test_redistribution.py::test_train_strict_reaches_the_planner": "shardflow train",
    "test_rule_validator.py::test_no_accepted_combination_is_wrong": "the validator's reduced sweep (12 s)",
    "test_rule_validator.py::test_rules_are_not_over_restrictive": "the validator's reduced sweep",
    "test_rule_validator.py::test_counts_add_up": "the validator's reduced sweep",
    "test_torch_compat.py::test_the_gpu_run_runs_its_steps_and_keeps_what_they_measured": "tools/gpu_run.py: calibration and block profile (35 s)",
    "test_rule_validator.py::test_full_sweep": "the validator's full sweep (SHARDFLOW_LONG=1)",
}


def tier(item: pytest.Item) -> str:
    """``integration`` or ``unit``, by the rule above."""
    file, name = item.path.name, getattr(item, "originalname", item.name)  # originalname: without parameters
    if (
        item.get_closest_marker("integration")
        or file in INTEGRATION_FILES
        or f"{file}::{name}" in INTEGRATION_TESTS
        or INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))
    ):
        return "integration"
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(tier(item))


def shapes_of(model, batch) -> tuple:
    """A model's parameters and a batch by name, shape and dtype: what its captured graph depends on, for a seeded
    model."""
    return (
        tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()),
        tuple((k, tuple(v.shape), v.dtype) for k, v in batch.items()),
    )


def capture_once(graphs: dict, key=shapes_of):
    """A stand-in for ``shardflow.pipeline.capture`` (what plan, check and train capture through) for tests that run
    shardflow many times on the same seeded model and batch: it captures once per ``key(model, batch)`` and gives the
    graph kept in ``graphs`` after; each run still plans, lowers and runs its own."""
    from shardflow import pipeline

    real = pipeline.capture

    def capture(model, batch):
        k = key(model, batch)
        if k not in graphs:
            graphs[k] = real(model, batch)
        return graphs[k]

    return capture


def tiny_hf_llama():
    """The tiny Hugging Face Llama of the plan tests (2 layers, width 64, 4 heads over 2 key/value heads, MLP 128,
    vocabulary 96; float32, seeded) and its batch of 8 sequences of 8 tokens, the labels being the tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
            use_cache=False,
        )
    )
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


def lower_preset(graph, mesh_text: str, strategy: str, **options):
    """``graph`` planned as preset ``strategy`` on mesh ``mesh_text`` and lowered for AdamW with the plain
    collectives and ``options`` (:class:`~shardflow.lower.LowerOptions` fields): (its PCG, the lowered step)."""
    from shardflow.lower import LowerOptions, lower_step
    from shardflow.lower.cost import CommForm
    from shardflow.lower.dynamic import UpdateRule
    from shardflow.parallel.mesh import Mesh
    from shardflow.parallel.pcg import build_pcg
    from shardflow.strategy import resolve
    from shardflow.strategy.presets import make_plan

    mesh = Mesh.parse(mesh_text)
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy), graph, mesh))
    return pcg, lower_step(
        pcg, UpdateRule.ADAMW, options=LowerOptions(CommForm.COLLECTIVE, CommForm.COLLECTIVE, **options)
    )


def run_adamw(model, batch, graph, step, steps: int = 3):
    """``steps`` AdamW steps (lr 1e-2) of lowered ``step`` on the local executor from ``model``'s weights: (the
    losses, the executor)."""
    from shardflow.reference import weights_of
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.runtime.local import LocalExecutor

    ex = LocalExecutor(step, OptimizerConfig("adamw", 1e-2), seed=0)
    ex.load(weights_of(model, graph))
    return [ex.step(batch) for _ in range(steps)], ex


# A GPT of 1 layer, 2 heads, width 16 on 16-character sequences, batch 8: a step takes milliseconds; validation
# every 2 steps on 1 batch; a line every step; MFU against a given peak (measuring one takes a second per run).
# Later flags override these (argparse: the last one wins).
TINY = (
    "--layers",
    "1",
    "--heads",
    "2",
    "--embd",
    "16",
    "--seq-len",
    "16",
    "--batch-size",
    "8",
    "--eval-every",
    "2",
    "--eval-batches",
    "1",
    "--log-every",
    "1",
    "--lr",
    "0.01",
    "--timeout",
    "30",
    "--peak-tflops",
    "0.1",
)


# --- waits that only guard against a hang -------------------------------------------------------------------------
PATIENCE = "SHARDFLOW_TEST_PATIENCE"  # a factor for every such wait, e.g. 10 on a machine shared with other work


def patience(seconds: float) -> float:
    """How long a wait that only guards against a hang may last: ``seconds`` (enough on an idle machine) times
    ``SHARDFLOW_TEST_PATIENCE`` where set, else times this machine's 1-minute load average per core when above 1 —
    a suite run beside other work (10 busy loops on 2 cores: × 5 to × 10) waits longer rather than failing. Tests
    assert behaviour, never seconds (docs/bad-inputs.md#the-test-suite-on-a-busy-machine); such a wait running out
    is a hang."""
    factor = os.environ.get(PATIENCE)
    if factor is not None:
        return seconds * float(factor)
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


# --- every process a test starts is gone when its module ends --------------------------------------------------
PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


def adopt_orphans() -> None:
    """Make this process the parent of every orphan among its descendants (Linux's child subreaper, prctl(2)): a rank
    whose launcher died is then this process's child, not init's, and :func:`reap_children` finds it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def proc_state(pid: int) -> str | None:
    """Process ``pid``'s state letter from /proc (``T`` stopped, ``Z`` zombie, …); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


def reap_children() -> list[int]:
    """SIGKILL (which a stopped process gets too) and wait for every child of this process — with
    :func:`adopt_orphans`, every descendant left — until none is left; returns the ones still running, killed."""
    killed = []
    while kids := children_of(os.getpid()):
        for pid in kids:
            if proc_state(pid) not in ("Z", None):
                killed.append(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    return killed


def pytest_configure(config):
    """Every test process (pytest-xdist's controller too) adopts its descendants' orphans, and SIGTERM to it (a CI
    job's time limit, ``kill``) interrupts it as Ctrl-C does, so that :func:`pytest_sessionfinish` still reaps what
    its tests started."""
    adopt_orphans()
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@pytest.hookimpl(trylast=True)  # after pytest-xdist's controller has shut its workers down
def pytest_sessionfinish(session, exitstatus):
    """The end of every test process's session, also one cut short by Ctrl-C or SIGTERM (where the running module's
    :func:`reap_processes` teardown never runs): kill and reap every process its tests left."""
    reap_children()


@pytest.fixture(scope="module", autouse=True)
def reap_processes():
    """Whatever a module's tests do or fail to do, no process they started outlives the module: this process has
    adopted its descendants' orphans (:func:`pytest_configure`), and at the module's end (after its own fixtures'
    teardown: autouse fixtures are set up first) kills and reaps them all (tests/test_reaper.py)."""
    yield
    reap_children()


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
    """``run_train(tmp_path, name, *argv, entry=...)``: ``shardflow train`` of 4 steps (tiny model) in a subprocess
    (the runs of several processes, whose rank 0 prints to the command's stdout; ``entry``: as :func:`train_argv`'s);
    returns the completed process and the run directory ``tmp_path/name``."""

    def run_train(tmp_path, name, *argv, entry=("-m", "shardflow.cli")):
        run = tmp_path / name
        r = subprocess.run(
            train_argv(run, "--steps", "4", *argv, entry=entry), capture_output=True, text=True, timeout=patience(300)
        )
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
