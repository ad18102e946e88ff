"""`shardflow train` end to end: tiny model, few steps; losses equal the single-device run step by step;
bad input ends with a one-paragraph error, exit status 2 and no traceback, before any process starts."""

import json
import re
import shutil
import subprocess

import pytest
from conftest import patience

from shardflow.train import checkpoint

# `make train`'s flags (the Makefile's recipe: tests/test_docs.py checks that this line holds them)
MAKE_TRAIN = ["--strategy", "tp", "--nproc", "2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, run_here, read_metrics):
    r, run = run_here(tmp_path_factory.mktemp("single"), "single", "--strategy", "single", "--nproc", "1")
    assert r.returncode == 0, r.stderr
    return read_metrics(run)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, run_train):
    """One tp=2 run on 2 processes that several tests read (none changes it): with --tensorboard, a checkpoint every
    2 steps, the peak measured (--peak-tflops 0) and a Chrome trace (``trace.json`` beside the run directory)."""
    d = tmp_path_factory.mktemp("tp2")
    r, run = run_train(
        d,
        "tb",
        *MAKE_TRAIN,
        "--tensorboard",
        "--checkpoint-every",
        "2",
        "--peak-tflops",
        "0",
        "--trace",
        str(d / "trace.json"),
    )
    assert r.returncode == 0, r.stderr + r.stdout
    return r, run, d / "trace.json"


def _matches_single_device_step_by_step(r, run, want, read_metrics):
    """The run in ``run`` (``r``: its command's completed process) trained steps 1-4 with the losses of ``want`` (one
    device's metrics; 1e-4), printed its progress, and wrote config.toml and rank 0's and rank 1's logs."""
    assert r.returncode == 0, r.stderr + r.stdout
    got = read_metrics(run)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        # float32 on both sides; partial sums are added in another order → ~1e-6 relative.
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a, b)
        assert ("val_loss" in a) == ("val_loss" in b)
    assert "step     4/4" in r.stdout and "unigram baseline" in r.stdout
    assert (run / "rank0.log").exists() and (run / "rank1.log").exists() and (run / "config.toml").exists()


# shardflow train with the launcher's fork refused (as on more cores than ranks, or a GPU): new-process ranks
NO_FORK = (
    "import sys, shardflow.runtime.launch as launch; launch._can_fork = lambda threads: False; "
    "from shardflow.cli import main; sys.exit(main())"
)


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "pp", "--nproc", "2", "--layers", "2"],
        ["--strategy", "dp,tp", "--mesh", "dp=2,tp=2", "--nproc", "4"],
        ["--strategy", "fsdp", "--nproc", "2", "--ac", "block", NO_FORK],
    ],
)
def test_strategies_match_single_device_step_by_step(tmp_path, run_train, run_here, read_metrics, single, argv):
    """(tp: test_tp_matches_single_device_step_by_step, on the run other tests read too; dp on 2 processes:
    test_under_torchrun, against the same losses.) The fsdp run's launcher may not fork its ranks: each is a new
    process that captures and plans the model again (docs/execution.md#forked-ranks); the others' ranks are forked
    where the machine has a core per rank."""
    entry, argv = (("-c", NO_FORK), argv[:-1]) if argv[-1] == NO_FORK else (("-m", "shardflow.cli"), argv)
    r, run = run_train(tmp_path, "run", *argv, entry=entry)
    want = single
    if "--layers" in argv:  # a 2-layer model (one per stage): compare with one device running both layers
        r1, run1 = run_here(tmp_path, "ref", "--strategy", "single", "--nproc", "1", "--layers", "2")
        assert r1.returncode == 0, r1.stderr
        want = read_metrics(run1)
    _matches_single_device_step_by_step(r, run, want, read_metrics)


def test_strategy_auto_trains_its_choice_and_matches_single_device(tmp_path, run_train, single, read_metrics):
    """--strategy auto (docs/search.md): the parent prints the search's choice and runners-up, and the ranks train
    the chosen preset (config.toml holds it, not "auto") with the single device's losses."""
    import tomllib

    r, run = run_train(tmp_path, "run", "--strategy", "auto", "--nproc", "2")
    _matches_single_device_step_by_step(r, run, single, read_metrics)
    chosen = tomllib.loads((run / "config.toml").read_text())
    assert chosen["strategy"] in ("dp", "fsdp", "tp", "sp", "pp") and chosen["mesh"].endswith("=2")
    assert f"# --strategy auto on this: --strategy {chosen['strategy']} --mesh {chosen['mesh']}" in r.stdout
    assert "# runners-up (the best of each other strategy):" in r.stdout


def test_tp_matches_single_device_step_by_step(tp2, single, read_metrics):
    r, run, _ = tp2
    _matches_single_device_step_by_step(r, run, single, read_metrics)


def test_metrics_fields(single):
    """One device in one process, a line every step (so the memory every step), --peak-tflops 0.1 (conftest.TINY),
    batch 8 × 16 tokens: the rates and the MFU follow from the step time; the model FLOPs per step are constant."""
    every = {
        "step",
        "loss",
        "step_s",
        "data_s",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "tflops_per_device",
        "mfu_pct",
        "grad_norm",
        "lr",
        "mem_mib",
        "mem_mib_ranks",
    }
    assert set(single[0]) == every and set(single[1]) == every | {"val_loss"}
    flops = single[0]["tflops_per_device"] * single[0]["step_s"]
    for m in single:
        assert m["tokens_per_s"] == pytest.approx(8 * 16 / m["step_s"]) == m["tokens_per_s_per_device"]
        assert m["mfu_pct"] == pytest.approx(100 * m["tflops_per_device"] / 0.1)
        assert m["tflops_per_device"] * m["step_s"] == pytest.approx(flops)
        assert 0 < m["data_s"] < m["step_s"] and m["grad_norm"] > 0 and m["lr"] == 0.01  # --lr, constant
        assert len(m["mem_mib_ranks"]) == 1 and m["mem_mib"] == m["mem_mib_ranks"][0] > 10  # torch alone: > 100


def test_lr_schedule_reaches_the_metrics_and_the_console(tmp_path, run_here, read_metrics, single):
    """--warmup-steps 1 --lr-schedule cosine --lr-min-ratio 0.1 over 4 steps: metrics.jsonl's ``lr`` is torch's
    LambdaLR with torchtitan's formula at each step and the console prints it; the first step trains at half of
    --lr, so its loss is the constant-rate run's but the second's differs. A decay with no step after the warm-up
    is refused before any process starts."""
    from titan import titan_lambda

    r, run = run_here(
        tmp_path,
        "cosine",
        "--strategy",
        "single",
        "--nproc",
        "1",
        "--warmup-steps",
        "1",
        "--lr-schedule",
        "cosine",
        "--lr-min-ratio",
        "0.1",
    )
    assert r.returncode == 0, r.stderr
    got = read_metrics(run)
    factor = titan_lambda(1, 4, "cosine", 0.1)
    assert [m["lr"] for m in got] == pytest.approx([0.01 * factor(s) for s in range(4)], rel=1e-12)
    assert got[0]["lr"] == pytest.approx(0.005) and got[-1]["lr"] == pytest.approx(0.001)
    assert f"lr {got[1]['lr']:.3g}" in r.stdout and "1 warm-up steps, then cosine to 0.1×" in r.stdout
    assert got[0]["loss"] == single[0]["loss"] and abs(got[1]["loss"] - single[1]["loss"]) > 1e-6
    r, _ = run_here(tmp_path, "refused", "--lr-schedule", "linear", "--warmup-steps", "4")
    assert r.returncode != 0 and "give fewer --warmup-steps than --steps, or --lr-schedule constant" in r.stderr


def _board(run) -> dict[str, list[tuple[int, float]]]:
    """The scalars of ``run/tensorboard`` as TensorBoard reads them: tag → [(step, value)], purges applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_metrics_and_a_resumed_run_rewrites_the_steps_after_its_checkpoint(
    tmp_path, tp2, run_here, read_metrics
):
    """tp=2 on 2 processes with --tensorboard and the peak measured, then (a copy of it) resumed in one process
    from its checkpoint at step 2, the one at step 4 removed: TensorBoard's scalars are metrics.jsonl's — every key,
    every step, once (the first run's steps 3 and 4, with other step times, purged). Event files hold float32: rel
    1e-6. The resumed run has --check: its one-device reference starts from the checkpoint's full tensors, the run
    from its pieces."""
    r, first, _ = tp2
    assert re.search(r"measured at start-up: best of 3 float32 (\d+)×\1 matmuls on cpu", r.stdout)
    assert all(len(m["mem_mib_ranks"]) == 2 and m["mem_mib"] == max(m["mem_mib_ranks"]) for m in read_metrics(first))
    shutil.copytree(first, tmp_path / "tb")
    shutil.rmtree(tmp_path / "tb" / "checkpoints" / "step_4")
    r, run = run_here(
        tmp_path, "tb", "--strategy", "tp", "--mesh", "tp=2", "--nproc", "1", "--tensorboard", "--resume", "--check"
    )
    assert check_line(r).endswith(": OK")
    want: dict[str, list] = {}
    for m in read_metrics(run):
        for key, v in m.items():
            for tag, x in [(f"{key}/{k}", y) for k, y in enumerate(v)] if isinstance(v, list) else [(key, v)]:
                want.setdefault(tag, []).append((m["step"], pytest.approx(x, rel=1e-6)))
    want.pop("step")
    assert len(want["step_s"]) == 4 and len(want["mem_mib_ranks/1"]) == 2  # the resumed run has one process
    assert _board(run) == want


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--data", "/nonexistent.txt"], ["does not exist"]),
        (["--strategy", "tp", "--nproc", "3", "--heads", "2"], ["degree 3", "does not divide"]),
        (["--strategy", "tp", "--mesh", "tp=2", "--nproc", "4"], ["4 processes", "--nproc"]),
        (
            ["--strategy", "tp", "--nproc", "2", "--heads", "3", "--kv-heads", "3", "--embd", "48"],
            ["degree 2 does not divide", "size 3"],
        ),
    ],
)
def test_bad_input_fails_before_any_process_with_one_paragraph(tmp_path, run_here, argv, words):
    r, run = run_here(tmp_path, "bad", *argv)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("shardflow train: error: ") and "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    assert not (run / "rank0.log").exists()


def test_empty_and_non_utf8_data(tmp_path, run_here):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café ".encode("latin-1") * 100)
    for path, word in ((empty, "is empty"), (latin, "is not UTF-8")):
        r, _ = run_here(tmp_path, "bad", "--data", str(path), "--nproc", "1", "--strategy", "single")
        assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("argv", [["--strategy", "single", "--nproc", "1"], ["--strategy", "tp", "--nproc", "2"]])
def test_a_non_finite_loss_stops_every_rank_and_keeps_the_last_finite_checkpoint(
    tmp_path, run_train, run_here, read_metrics, argv
):
    """--lr 1e12: step 1's loss is finite and its update huge; step 2's loss is NaN. One process (the local executor,
    run in this one) and two (each rank sees the same loss, so both stop at step 2 with status 2, and nothing
    hangs)."""
    r, run = (run_train if argv[-1] == "2" else run_here)(
        tmp_path, "nan", *argv, "--lr", "1e12", "--checkpoint-every", "1"
    )
    assert r.returncode == 2, r.stderr + r.stdout
    rank = "rank 0: " if argv[-1] == "2" else ""  # the command prints rank 0's paragraph
    assert r.stderr == (
        f"shardflow train: error: {rank}the loss is nan at step 2: training diverged, most likely "
        f"because the learning rate is too high (--lr 1e+12); try --clip-norm 1.0 or a lower --lr. "
        f"Nothing of step 2 was saved; the last complete checkpoint, {run / 'checkpoints' / 'step_1'}, "
        f"is kept (continue from it with --resume --allow-changed-settings and a lower --lr)\n"
    ), r.stderr
    assert "Traceback" not in r.stdout
    assert [m["step"] for m in read_metrics(run)] == [1]
    root = run / "checkpoints"
    assert [n for n, _ in checkpoint.complete_steps(root)] == [1] and not list(root.glob("*.tmp"))
    ck = checkpoint.read(root / "step_1")
    assert all(t.isfinite().all() for t in ck.load(ck.entries).values())
    for log in run.glob("rank*.log"):  # every rank said it (status 2 from each: the command's 2 needs all of them)
        assert "the loss is nan at step 2" in log.read_text().splitlines()[-1], log


def check_line(r) -> str:
    assert r.returncode == 0, r.stderr + r.stdout
    return next(line for line in r.stdout.splitlines() if line.startswith("check against one device"))


def test_under_torchrun(tmp_path, train_argv, read_metrics, single):
    """Without --run-dir: rank 0 makes the new run directory (and config.toml) once the ranks have joined, and tells
    rank 1 its name — both write their files of the checkpoint there."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "shardflow.cli")
    argv = train_argv(tmp_path / "unused", "--steps", "4", "--strategy", "dp", entry=torchrun)
    at = argv.index("--run-dir")
    r = subprocess.run(argv[:at] + argv[at + 2 :], capture_output=True, text=True, timeout=patience(300), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "latest"
    assert run.is_symlink() and (run / "config.toml").exists()
    assert [p.name for p in (tmp_path / "runs").iterdir() if not p.is_symlink()] == [run.resolve().name]
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (run / "checkpoints" / "step_4").iterdir()}
    for a, b in zip(read_metrics(run), single):
        assert abs(a["loss"] - b["loss"]) < 1e-4


def test_trace_has_compute_and_communication_lanes_measured_and_predicted(tp2):
    """The Chrome trace of step 2: both ranks measured and predicted, compute and communication lanes; rank 0 prints
    each rank's time blocked on the other (its communication lane's total)."""
    _, _, out = tp2
    events = json.loads(out.read_text())["traceEvents"]
    lanes = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}
    assert lanes == {(0, 0), (0, 1), (1, 0), (1, 1), (1000, 0), (1000, 1), (1001, 0), (1001, 1)}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0 (measured)", "rank 1 (measured)", "rank 0 (predicted)", "rank 1 (predicted)"}
    measured = [e for e in events if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 1]
    r, _, _ = tp2
    blocked = sum(e["dur"] for e in measured) / 1e3  # ms rank 0 spent in its communication lane
    line = next(x for x in r.stdout.splitlines() if x.startswith("time blocked on other ranks in step 2"))
    assert f"rank 0 {blocked:.1f} of " in line and "rank 1 " in line
    kinds = [tuple(e["name"].split()[:2]) for e in measured]  # ("#token", kind); an overlapped one is waited later
    assert kinds and {k for _, k in kinds} == {"all_reduce", "wait"}
    assert {t for t, k in kinds if k == "wait"} <= {t for t, k in kinds if k == "all_reduce"}


def test_ac_blocks_recomputes_the_first_blocks_the_banner_counts_them_and_config_toml_keeps_it(tmp_path, run_here):
    """--ac block --ac-blocks 1 on 2 layers, one device: the banner counts the blocks actually recomputed (1, not
    2), and config.toml holds ac_blocks (a resumed run gets the same step)."""
    import tomllib

    r, run = run_here(
        tmp_path, "run", "--strategy", "single", "--nproc", "1", "--layers", "2", "--ac", "block", "--ac-blocks", "1"
    )
    assert r.returncode == 0, r.stderr
    assert "; 1 blocks recomputed in the backward (--ac block --ac-blocks 1)" in r.stdout
    assert tomllib.loads((run / "config.toml").read_text())["ac_blocks"] == 1


def test_selective_checkpointing_with_whole_first_blocks_trains_to_one_devices_numbers(tmp_path, run_here):
    """--ac selective --ac-blocks 1 on 2 layers under fsdp on one process: the banner says 1 block recomputed whole
    and 1 selectively, --check equals one device, and config.toml keeps both settings."""
    import tomllib

    r, run = run_here(
        tmp_path, "run", "--strategy", "fsdp", "--mesh", "fsdp=2", "--nproc", "1", "--layers", "2",
        "--ac", "selective", "--ac-blocks", "1", "--check",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "; 2 blocks recomputed in the backward, 1 whole and 1 selectively (--ac selective --ac-blocks 1)" in r.stdout
    saved = tomllib.loads((run / "config.toml").read_text())
    assert (saved["ac"], saved["ac_blocks"]) == ("selective", 1)
