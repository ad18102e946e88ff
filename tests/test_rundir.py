"""Run directories of `shardflow train` (shardflow.train.rundir): a new directory per run with `runs/latest` pointing
at the newest, an earlier run refused unless --resume or --overwrite, the lock, --metrics / --trace kept off the run's
own files; and what rides along: a checkpoint every 100 steps by default, --eval-batches bounded by the validation
split, config.toml from one process, --plan. The tiny model on the local executor (--nproc 1), in this process."""

import argparse
import os
import stat
from pathlib import Path

import pytest
from test_bad_inputs import one_paragraph

from shardflow.cli import main as cli_main
from shardflow.train import checkpoint
from shardflow.train.config import TrainConfig
from shardflow.train.rundir import lock, output_lock


@pytest.fixture
def train(capsys, tiny, corpus, tmp_path, monkeypatch):
    """``train(*argv)``: ``shardflow train`` (tiny model, one process, 2 steps unless argv says otherwise) in this
    process, in the directory ``tmp_path``; returns (exit status, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)

    def run_train(*argv: str):
        code = cli_main(
            ["train", *tiny, "--steps", "2", "--data", str(corpus), "--strategy", "single", "--nproc", "1", *argv]
        )
        return (code, *capsys.readouterr())

    return run_train


def contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def steps(root: Path) -> list[int]:
    return [n for n, _ in checkpoint.complete_steps(root / "checkpoints")]


def test_each_run_gets_a_new_directory_and_runs_latest_points_at_the_newest(train, tmp_path, capsys):
    runs = tmp_path / "runs"
    # 101 steps: the default --checkpoint-every (100) saves at step 100, then the last step; --eval-batches far
    # beyond the 201-token validation split is bounded by it: ⌈201 / (8 × 16)⌉ = 2 batches
    code, out, err = train("--steps", "101", "--eval-every", "1000", "--eval-batches", "10000000")
    assert code == 0, err
    assert "validation: 2 batches per measurement, not --eval-batches 10000000: they hold the 201 tokens" in out
    first = runs / os.readlink(runs / "latest")
    assert first.parent == runs and f"run directory: runs/{first.name}" in out
    assert steps(first) == [100, 101]
    saved = TrainConfig.from_args(argparse.Namespace(config=str(first / "config.toml")))  # --nproc 1 wrote it
    assert (saved.run_dir, saved.steps, saved.checkpoint_every) == (f"runs/{first.name}", 101, 100)
    kept = contents(first)

    code, out, err = train()  # a second run: a directory of its own (a suffix when started within the same second)
    assert code == 0, err
    second = runs / os.readlink(runs / "latest")
    assert second != first and second.parent == runs and steps(second) == [2]
    assert contents(first) == kept  # the earlier run is untouched
    assert not [p for p in runs.iterdir() if p.name.startswith(".latest")]  # the symlink was renamed into place

    code, out, err = train("--steps", "4", "--resume")  # without --run-dir: the run runs/latest points at
    assert code == 0, err
    assert f"resumed from runs/{second.name}/checkpoints/step_2" in out
    assert steps(second) == [2, 4] and contents(first) == kept

    old = os.umask(0o027)  # what shardflow export writes gets the umask's mode (safetensors alone would give 0600)
    try:
        assert cli_main(["export", "runs/latest", "--out", "exported"]) == 0
    finally:
        os.umask(old)
    assert "the Hugging Face model of runs/latest/checkpoints/step_4" in capsys.readouterr().out
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "exported").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes


def test_an_earlier_run_is_refused_unless_resume_or_overwrite(train, tmp_path):
    run = tmp_path / "run"
    code, out, err = train("--run-dir", "run")
    assert code == 0, err
    kept = contents(run)
    one_paragraph(
        *train("--run-dir", "run", "--steps", "3"),
        "train",
        "run directory run holds an earlier run (run/config.toml, run/metrics.jsonl, 1 checkpoint in "
        "run/checkpoints, the newest step_2), which this run would overwrite: pass --resume to continue it, "
        "--overwrite to replace it, or another --run-dir",
    )
    one_paragraph(
        *train("--run-dir", "run", "--resume", "--overwrite"),
        "train",
        "--resume continues the earlier run in the run directory and --overwrite replaces it: give one",
    )
    assert contents(run) == kept

    code, out, err = train("--run-dir", "run", "--steps", "3", "--overwrite")
    assert code == 0, err
    assert steps(run) == [3]  # the earlier run's step_2 went once this run's first checkpoint was complete
    assert (run / "config.toml").read_text() != kept["config.toml"].decode()


def test_a_run_directory_in_use_is_refused_naming_the_process(train, tmp_path):
    """The lock as another run holds it (here this process: flock conflicts between open files, not processes).
    The fault tests run a real second run beside a running one (test_faults)."""
    run = tmp_path / "run"
    run.mkdir()
    fd = lock(run)
    try:
        one_paragraph(
            *train("--run-dir", "run"),
            "train",
            f"run directory run is in use by another shardflow train (PID {os.getpid()} on ",
            "holds run/.lock); wait for that run to end or stop it, or pass another --run-dir",
        )
    finally:
        os.close(fd)
    assert list(contents(run)) == [".lock"]  # no file written but the lock's
    code, out, err = train("--run-dir", "run")  # released: the directory is free again
    assert code == 0, err


@pytest.mark.parametrize(
    "flag, path, what",
    [
        ("--checkpoint-dir", "shared/ck", "checkpoint directory shared/ck"),
        ("--metrics", "shared/m.jsonl", "metrics file shared/m.jsonl"),
    ],
)
def test_a_checkpoint_directory_or_metrics_file_in_use_is_refused_naming_the_run(train, tmp_path, flag, path, what):
    """Two runs with their own run directories but one --checkpoint-dir (or --metrics): the second is refused while
    the first holds the path's lock (here this process, as above), naming the path and the first run."""
    output_lock(Path(path), flag).parent.mkdir(parents=True)
    fd = lock(Path("first"), Path(path), flag)
    lost = "checkpoints" if flag == "--checkpoint-dir" else "records"
    try:
        one_paragraph(
            *train("--run-dir", "second", flag, path),
            "train",
            f"{what} is in use by another shardflow train (PID {os.getpid()} on ",
            f", run directory first; it holds {output_lock(Path(path), flag)}), and two runs writing it at once "
            f"would keep only one's {lost}: wait for that run to end or stop it, or pass another {flag}",
        )
    finally:
        os.close(fd)
    assert not (tmp_path / "second" / "config.toml").exists() and steps(tmp_path / "second") == []
    code, out, err = train("--run-dir", "second", flag, path)  # released: the path is free again
    assert code == 0, err


def test_a_path_in_the_directory_of_a_live_run_is_refused(train, tmp_path):
    """--metrics (or --checkpoint-dir) naming a file of a running run's directory, e.g. its metrics file; and the
    other way round, a run whose own metrics file a running run names as its --metrics."""
    first = tmp_path / "first"
    first.mkdir()
    (first / "config.toml").write_text("steps = 2\n")
    fd = lock(Path("first"))
    try:
        one_paragraph(
            *train("--run-dir", "second", "--metrics", "first/metrics.jsonl"),
            "train",
            f"--metrics first/metrics.jsonl: the metrics file lies in the run directory {first} of another shardflow "
            f"train (PID {os.getpid()} on ",
            "pass another --metrics",
        )
    finally:
        os.close(fd)
    fd = lock(Path("first"), Path("second/metrics.jsonl"), "--metrics")
    try:
        one_paragraph(
            *train("--run-dir", "second"),
            "train",
            "metrics file second/metrics.jsonl is in use by another shardflow train (PID ",
            ", run directory first; it holds second/.metrics.jsonl.lock)",
        )
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--metrics", "run/config.toml"],
            "--metrics run/config.toml would overwrite the run's resolved configuration",
        ),
        (["--metrics", "run/rank0.log"], "--metrics run/rank0.log would overwrite the log of rank 0"),
        (["--metrics", "run/.lock"], "--metrics run/.lock would overwrite the run directory's lock"),
        (
            ["--metrics", "run/checkpoints/m.jsonl"],
            "would overwrite a file of the checkpoint directory run/checkpoints",
        ),
        # --trace is of the ranks' processes: 2 of them (refused before they start)
        (
            ["--trace", "run/metrics.jsonl", "--nproc", "2", "--strategy", "dp"],
            "--trace run/metrics.jsonl would overwrite the metrics file",
        ),
        (
            ["--metrics", "m.jsonl", "--trace", "m.jsonl", "--nproc", "2", "--strategy", "dp"],
            "--metrics m.jsonl would overwrite the --trace file",
        ),
    ],
)
def test_metrics_and_trace_stay_off_the_runs_own_files(train, tmp_path, argv, words):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("steps = 2\n")  # e.g. left by a run stopped before it trained
    one_paragraph(*train("--run-dir", "run", "--overwrite", *argv), "train", words, "which the run writes too")
    assert contents(tmp_path / "run") == {"config.toml": b"steps = 2\n"}


def test_runs_latest_missing_for_resume_or_a_directory_of_an_earlier_version(train, tmp_path):
    one_paragraph(
        *train("--resume"),
        "train",
        "--resume without --run-dir continues the newest run, runs/latest, "
        "which does not exist; pass --run-dir with the directory of the run to continue",
    )
    (tmp_path / "runs" / "latest").mkdir(parents=True)
    one_paragraph(
        *train(),
        "train",
        "runs/latest is a directory (a run of an earlier shardflow",
        "rename it (e.g. mv runs/latest runs/old)",
    )
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["latest"]


# The Llama's MLPs column- then row-parallel on tp (gate_proj and up_proj split by output features, down_proj by
# input features, its output replicated); everything else replicated.
LLAMA_PLAN = """\
[modules."model.layers.*.mlp.gate_proj".params]
weight = {tp = "Shard(0)"}

[modules."model.layers.*.mlp.up_proj".params]
weight = {tp = "Shard(0)"}

[modules."model.layers.*.mlp.down_proj"]
params = {weight = {tp = "Shard(1)"}}
output = {tp = "Replicate()"}
"""


def test_train_with_a_user_plan(train, tmp_path, tiny, corpus, capsys):
    (tmp_path / "plan.toml").write_text(LLAMA_PLAN)
    code = cli_main(
        [
            "train",
            *tiny,
            "--steps",
            "2",
            "--data",
            str(corpus),
            "--plan",
            "plan.toml",
            "--mesh",
            "tp=2",
            "--nproc",
            "1",
            "--check",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "plan plan.toml on mesh tp=2 (2 devices; buffers on cpu)" in out and "all_reduce/tp" in out
    assert next(line for line in out.splitlines() if line.startswith("check against one device")).endswith(": OK")
    one_paragraph(
        *train("--plan", "plan.toml", "--strategy", "tp"),
        "train",
        "--plan plan.toml and --strategy tp: the plan places every tensor itself; give one of them",
    )


def test_keep_checkpoints_removes_the_older_ones_of_the_run_only(train, tmp_path):
    """--keep-checkpoints 2: after each save only the two newest complete checkpoints stay, this run's (an earlier
    run's are removed by a fresh run anyway) and across a --resume; without it every checkpoint stays."""
    run, root = tmp_path / "k", tmp_path / "k" / "checkpoints"
    code, _, err = train("--run-dir", str(run), "--steps", "5", "--checkpoint-every", "1", "--keep-checkpoints", "2")
    assert code == 0, err
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_5"]
    assert checkpoint.read(root / "step_4").step == 4
    code, _, err = train("--run-dir", str(run), "--steps", "7", "--checkpoint-every", "1", "--resume")
    assert code == 0, err
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_5", "step_6", "step_7"]
    code, _, err = train(
        "--run-dir", str(run), "--steps", "8", "--checkpoint-every", "1", "--resume", "--keep-checkpoints", "1"
    )
    assert code == 0, err
    assert [p.name for p in root.iterdir()] == ["step_8"] and checkpoint.newest(root) == root / "step_8"
