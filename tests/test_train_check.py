"""`shardflow train --check` end to end: the run and its one-device reference side by side (tiny models, 2 steps),
every strategy on the default Llama, with --accumulate and with dropout; every replica of every parameter equals the
one-device run within --check's tolerance. (Split from test_train.py: the two files run on two workers.)"""

import pytest
from test_train import check_line


def test_check_compares_with_one_device(tmp_path, run_train):
    """Two processes, GPT-2 with dropout: each rank draws its pieces' masks, and --check compares every replica."""
    r, run = run_train(
        tmp_path,
        "check",
        "--model",
        "gpt2",
        "--strategy",
        "tp",
        "--nproc",
        "2",
        "--dropout",
        "0.1",
        "--steps",
        "2",
        "--check",
    )
    line = check_line(r)
    assert "over every replica" in line and line.endswith(": OK")


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "dp", "--mesh", "dp=2"],
        ["--strategy", "tp", "--mesh", "tp=2"],
        ["--strategy", "sp", "--mesh", "tp=2"],
        ["--strategy", "dp,tp", "--mesh", "dp=2,tp=2"],
        ["--strategy", "pp", "--mesh", "pp=2", "--layers", "2"],
        ["--strategy", "hsdp", "--mesh", "dp=2,fsdp=2", "--ac", "block"],
        ["--strategy", "fsdp,tp", "--mesh", "fsdp=2,tp=2", "--no-reshard-after-forward"],
        ["--strategy", "fsdp", "--mesh", "fsdp=2", "--dtype", "bf16"],
    ],
)
def test_check_passes_on_the_llama(tmp_path, run_here, argv):
    """--check on the default model (Llama: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention), every
    rank of the mesh in one process: the loss of each step and every replica of every parameter equal the
    one-device run within --check's tolerance (5e-3, float32 AdamW; 3e-2 under --dtype bf16, both sides bfloat16
    compute with float32 masters)."""
    r, run = run_here(tmp_path, "check", *argv, "--nproc", "1", "--steps", "2", "--check")
    assert "model: Llama (llama)" in r.stdout
    assert check_line(r).endswith(": OK")
    if "bf16" in argv:
        assert "bfloat16 parameters and compute, float32 master weights" in r.stdout
        assert "(tolerance 0.03)" in check_line(r)


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "dp", "--mesh", "dp=2", "--nproc", "1"],
        ["--strategy", "dp,tp", "--mesh", "dp=2,tp=2", "--nproc", "1"],
        ["--strategy", "dp", "--nproc", "2"],
        ["--strategy", "fsdp,tp", "--mesh", "fsdp=2,tp=2", "--nproc", "1", "--ac", "block"],
    ],
)
def test_check_passes_with_accumulation(tmp_path, run_train, run_here, argv):
    """--accumulate 4 on the Llama: each step as 4 micro-steps of 2 sequences (1 per data-parallel rank), the
    weights' gradients reduced once, after the last (under fsdp,tp with each block recomputed: --ac block);
    --check trains one device on the whole batch of 8 at once, and the mean loss of each step and every replica of
    every parameter equal it (5e-3, float32 AdamW; seen ~1e-6 and ~4e-5 — a missing 1/4 or a lost micro-step is
    O(lr) in the weights after the first step)."""
    r, run = (run_train if argv[-1] == "2" else run_here)(
        tmp_path, "check", *argv, "--steps", "2", "--check", "--accumulate", "4"
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "batch 8×16 in 4 micro-steps of 2 (gradients reduced after the last)" in r.stdout
    assert "plan (rank 0, per step, all micro-steps): " in r.stdout  # the 4 micro-steps' communications, summed
    assert check_line(r).endswith(": OK")


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "sp", "--mesh", "tp=2"],
        ["--strategy", "dp,tp", "--mesh", "dp=2,tp=2", "--ac", "block"],
        ["--strategy", "dp", "--mesh", "dp=2", "--accumulate", "4"],
    ],
)
def test_check_passes_with_dropout(tmp_path, run_here, argv):
    """GPT-2 with --dropout 0.1 --check, every rank of the mesh in one process: masks depend on (seed, step, node,
    element), so every replica of every parameter equals the one-device run (masks drawn from the process RNG:
    |Δloss| ~1e-2, |Δparameter| ~4e-2, FAILED). With --accumulate 4 each micro-step draws its rows of the whole
    batch's masks, as the one-device run on the whole batch does (each micro-batch drawing as a batch of its own:
    FAILED). Under --ac block each block's recomputed forward draws its forward's masks again."""
    r, run = run_here(
        tmp_path, "check", *argv, "--model", "gpt2", "--nproc", "1", "--steps", "2", "--dropout", "0.1", "--check"
    )
    assert check_line(r).endswith(": OK")


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "pp", "--mesh", "pp=2", "--nproc", "2", "--microbatches", "4", "--layers", "2"],
        [
            "--strategy",
            "pp,tp",
            "--mesh",
            "pp=2,tp=2",
            "--nproc",
            "1",
            "--microbatches",
            "4",
            "--accumulate",
            "2",
            "--layers",
            "2",
        ],
        [
            "--strategy",
            "pp",
            "--mesh",
            "pp=2",
            "--nproc",
            "1",
            "--microbatches",
            "4",
            "--schedule",
            "interleaved",
            "--stages-per-rank",
            "2",
            "--layers",
            "4",
        ],
    ],
)
def test_check_passes_with_pipeline_microbatches(tmp_path, run_train, run_here, argv):
    """Pipeline parallelism with microbatches on the Llama (issue #17): 1F1B over 4 microbatches on two processes,
    1F1B with tp under --accumulate 2 (8 microbatches of 1 sequence per optimizer step), the interleaved schedule
    with 2 chunks of one block per stage (GPipe and dp: test_schedule, test_api); --check
    trains one device on the whole batch of 8 at once and every replica of every parameter equals it (5e-3, float32
    AdamW; a lost microbatch or a missing 1/M is O(lr) in the weights)."""
    flags = dict(zip(argv[::2], argv[1::2]))
    run = run_train if flags["--nproc"] == "2" else run_here
    r, _ = run(tmp_path, "check", *argv, "--steps", "2", "--check")
    assert r.returncode == 0, r.stderr + r.stdout
    m, kind = int(flags["--microbatches"]), flags.get("--schedule", "1f1b")
    rows = 8 // (m * int(flags.get("--accumulate", 1)))
    assert f"{m} microbatches of {rows} per step, {kind} over 2 stage(s)" in r.stdout
    if kind == "interleaved":
        assert "(2 chunks per stage" in r.stdout
    assert check_line(r).endswith(": OK")
