"""Bad inputs not tested elsewhere (the catalogue, docs/bad-inputs.md, points at the tests that cover the rest).

Each must end with one paragraph on stderr (what is wrong, where, how to fix it), exit status 2, no traceback,
and nothing half-written. The CLI runs in this process (``shardflow.cli.main``) where no process would start;
the torchrun-style rendezvous failures run as real processes, side by side, each bounded by a timeout."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import patience

from shardflow.cli import main as cli_main

PLAN = ["plan", "--model", "gpt", "--layers", "1", "--embd", "32", "--seq-len", "8", "--batch-size", "4"]


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def one_paragraph(code: int, out: str, err: str, command: str, *words: str) -> None:
    assert code == 2, (code, out, err)
    assert err.startswith(f"shardflow {command}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Traceback" not in out, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def train(capsys, tiny):
    """``train(run, data, *argv)``: ``shardflow train`` (tiny model, 2 steps) in this process; returns (exit status,
    stdout, stderr) and checks that the run directory holds no new file (nothing half-written: no config.toml,
    log, metrics or checkpoint)."""

    def run_train(run: Path, data, *argv: str):
        before = files(run)
        code = cli_main(["train", *tiny, "--steps", "2", "--data", str(data), "--run-dir", str(run), *argv])
        out, err = capsys.readouterr()
        assert files(run) == before, sorted(files(run) - before)
        return code, out, err

    return run_train


# --- configuration: flags and --config files ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--steps", "0"], ["--steps 0 is out of range", "≥ 1"]),
        (["--batch-size", "0"], ["--batch-size 0 is out of range"]),
        (["--seq-len", "0"], ["--seq-len 0 is out of range"]),
        (["--vocab-size", "100"], ["--vocab-size 100 is out of range", "in [256, 2147483647]", "its 256 byte tokens"]),
        (["--vocab-size", "100000000000000000000"], ["--vocab-size 100000000000000000000 is out of range"]),
        (["--eval-every", "0"], ["--eval-every 0 is out of range"]),
        (["--log-every", "0"], ["--log-every 0 is out of range"]),
        (["--eval-batches", "0"], ["--eval-batches 0 is out of range"]),
        (["--nproc", "0"], ["--nproc 0 is out of range"]),
        (["--bucket-mb", "-1"], ["--bucket-mb -1.0 is out of range", "≥ 0"]),
        (["--peak-tflops", "-1"], ["--peak-tflops -1.0 is out of range", "≥ 0"]),
        (
            ["--timeout", "0"],
            ["--timeout 0.0 is out of range: give a finite value in (0, 2000000]", "--timeout: seconds"],
        ),
        (["--checkpoint-every", "-1"], ["--checkpoint-every -1 is out of range: give a value ≥ 0"]),
        (["--keep-checkpoints", "-1"], ["--keep-checkpoints -1 is out of range: give a value ≥ 0"]),
        (["--dropout", "1.5"], ["--dropout 1.5 is out of range: give a finite value in [0, 1)"]),
        # numbers that were accepted (or crashed later): signs, ranges and non-finite floats
        (["--lr", "-1"], ["--lr -1.0 is out of range: give a finite value in [0, 3.4e+38]. --lr: learning rate"]),
        (["--lr", "1e39"], ["--lr 1e+39 is out of range: give a finite value in [0, 3.4e+38]"]),
        (["--lr", "nan"], ["--lr nan is out of range: give a finite value in [0, 3.4e+38]"]),
        (["--lr", "inf"], ["--lr inf is out of range"]),
        (["--momentum", "1"], ["--momentum 1.0 is out of range: give a finite value in [0, 1)"]),
        (["--momentum", "-0.5"], ["--momentum -0.5 is out of range"]),
        (["--weight-decay", "-1"], ["--weight-decay -1.0 is out of range: give a finite value in [0, 3.4e+38]"]),
        (["--weight-decay", "1e39"], ["--weight-decay 1e+39 is out of range"]),
        (["--timeout", "inf"], ["--timeout inf is out of range: give a finite value in (0, 2000000]"]),
        (["--timeout", "1e39"], ["--timeout 1e+39 is out of range: give a finite value in (0, 2000000]"]),
        (["--timeout", "nan"], ["--timeout nan is out of range"]),
        (["--bucket-mb", "nan"], ["--bucket-mb nan is out of range: give a finite value ≥ 0"]),
        (["--clip-norm", "nan"], ["--clip-norm nan is out of range: give a finite value ≥ 0"]),
        (["--dropout", "nan"], ["--dropout nan is out of range"]),
        (["--layers", "0"], ["--layers 0 is out of range: give a value ≥ 1. --layers: transformer blocks"]),
        (
            ["--accumulate", "0"],
            ["--accumulate 0 is out of range: give a value ≥ 1. --accumulate: gradient accumulation"],
        ),
        (
            ["--accumulate", "3"],
            [
                "--batch-size 8 does not split into --accumulate 3 micro-batches over data-parallel "
                "degree 1 (mesh tp=2)",
                "multiple of --accumulate × dp = 3",
                "give --batch-size 9",
                "an --accumulate of 2, 4, 8",
            ],
        ),
        (
            ["--strategy", "dp", "--accumulate", "8"],
            [
                "--batch-size 8 does not split into --accumulate 8 micro-batches "
                "over data-parallel degree 2 (mesh dp=2)",
                "give --batch-size 16",
                "or an --accumulate of 2, 4",
            ],
        ),
        (
            ["--strategy", "pp", "--layers", "4", "--microbatches", "4", "--stages-per-rank", "2"],
            [
                "--schedule 1f1b --microbatches 4 --stages-per-rank 2 on mesh pp=2",
                "give --schedule interleaved with --stages-per-rank ≥ 2, or neither",
            ],
        ),
        (
            [
                "--strategy",
                "pp",
                "--layers",
                "4",
                "--microbatches",
                "3",
                "--schedule",
                "interleaved",
                "--stages-per-rank",
                "2",
            ],
            [
                "the interleaved schedule runs microbatches in groups of one per stage: 3 microbatch(es) do not split over 2 "
                "stages; give a multiple of 2"
            ],
        ),
        (
            ["--strategy", "pp", "--microbatches", "3"],
            ["does not split into --microbatches 3 micro-batches", "or a --microbatches of 2, 4, 8"],
        ),
        (["--seed", "-1"], ["--seed -1 is out of range: give a value in [0, 4294967296)"]),
        (["--run-dir", ""], ["--run-dir is empty; leave it out or give a value"]),
        (["--strategy", " "], ["--strategy is empty; leave it out or give a value"]),
        (["--metrics", ""], ["--metrics is empty; leave it out or give a value"]),
        (["--heads", "3"], ["--embd 16 is not a multiple of --heads 3", "e.g. --heads 2"]),
        (["--strategy", "zp"], ["unknown strategy 'zp'", "dp,tp"]),
        (["--strategy", "tp,"], ["strategy 'tp,' has an empty part", "e.g. 'tp'"]),
        (["--strategy", "dp,dp"], ["strategy 'dp,dp' names dp twice", "e.g. 'dp'"]),
        (["--strategy", "single,dp", "--mesh", "dp=2"], ["single runs on one device and combines with nothing"]),
        (
            ["--strategy", "single", "--nproc", "2"],
            ["strategy 'single' runs on one device, but 2 are asked for", "pass --nproc 1"],
        ),
        (["--strategy", "tp", "--mesh", "dp=2"], ["mesh axis 'tp'", "--mesh tp=2"]),
        (
            ["--strategy", "tp", "--mesh", "tp=2,zz=1"],
            ["mesh tp=2,zz=1: axis 'zz' is none of the strategies' axes", "drop it (--mesh tp=2)"],
        ),
        (
            ["--strategy", "tp", "--mesh", "dp=2,tp=2", "--nproc", "4"],
            ["mesh axes ['dp'] of dp=2,tp=2 are used by no strategy in 'tp'"],
        ),
        (["--mesh", "dp2"], ["cannot read mesh 'dp2'", "dp=2,tp=2"]),
        (["--strategy", "pp", "--nproc", "4"], ["4 stages needs at least 4 repeated blocks", "more layers"]),
        (
            ["--trace", "t.json", "--nproc", "1", "--strategy", "single"],
            ["--trace t.json: the timeline is of the ranks'", "pass --nproc 2 or more, or drop --trace"],
        ),
    ],
)
def test_bad_settings(train, tmp_path, corpus, argv, words):
    run = tmp_path / "run"
    one_paragraph(*train(run, corpus, *argv), "train", *words)
    assert not run.exists()


def test_tensorboard_without_its_package(train, tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` meets where it is missing
    run = tmp_path / "run"
    one_paragraph(
        *train(run, corpus, "--tensorboard"), "train", "pip install tensorboard", "pip install 'shardflow[tensorboard]'"
    )
    assert not run.exists()


# a tiny Llama config.json; each case below changes (None: removes) some of its fields
_LLAMA = {
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"num_attention_heads": 0}, ["--model-config", "num_attention_heads 0 is not a size", "integer ≥ 1"]),
        ({"num_key_value_heads": 0}, ["num_key_value_heads 0 is not a size", "e.g. num_key_value_heads 1"]),
        ({"hidden_size": "16"}, ['hidden_size "16" is not a size', "without quotes"]),
        ({"hidden_size": -16}, ["hidden_size -16 is not a size"]),
        ({"intermediate_size": 32.5}, ["intermediate_size 32.5 is not a size"]),
        ({"num_hidden_layers": True}, ["num_hidden_layers true is not a size"]),
        ({"hidden_size": 18, "num_attention_heads": 4}, ["hidden_size 18 is not a multiple of num_attention_heads 4"]),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, ["num_attention_heads 4 is not a multiple of", "3"]),
        (
            {"model_type": "bert", "num_key_value_heads": None},
            ["model_type 'bert' is an encoder", '"is_decoder": true'],
        ),
        ({"model_type": "gpt2", "n_head": 0, "num_key_value_heads": None}, ["n_head 0 is not a size"]),
        ({"architectures": ["LlamaForSequenceClassification"]}, ["LlamaForSequenceClassification is not a causal"]),
        ({"model_type": "vit", "num_key_value_heads": None}, ["model_type 'vit' has no causal language model"]),
        ({"rope_scaling": {"rope_type": "bogus", "factor": 2.0}}, ['rope_type "bogus"', "yarn", "drop rope_scaling"]),
        (  # before: trained with attention dropout 0, without a word
            {"attention_dropout": 0.5},
            ["attention_dropout 0.5 asks for dropout inside attention", "set attention_dropout to 0 in it"],
        ),
        (
            {"model_type": "gpt2", "attn_pdrop": 0.1, "num_key_value_heads": None},
            ["attn_pdrop 0.1 asks for dropout inside attention", "--dropout for the resid_pdrop and embd_pdrop"],
        ),
    ],
)
def test_bad_model_config(train, tmp_path, corpus, change, words):
    """A --model-config file that makes no model (sizes of the wrong type or out of range, heads that do not divide,
    a model that is no causal LM, an unknown rope type): one paragraph naming the field, before anything starts
    (these were tracebacks; an encoder trained as a causal LM that sees the next token, exit 0)."""
    config = {k: v for k, v in {**_LLAMA, **change}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    run = tmp_path / "run"
    one_paragraph(*train(run, corpus, "--model-config", str(path)), "train", f"--model-config {path}: ", *words)
    assert not run.exists()


@pytest.mark.parametrize(
    "text, words",
    [
        ("steps = = 3\n", ["is not valid TOML", "line 1"]),
        ("stepz = 3\n", ["unknown settings ['stepz']", "known: "]),
        ('lr = "fast"\n', ["setting lr = 'fast' is a string, but lr takes a number", "e.g. lr = 0.003"]),
        ("steps = 2.5\n", ["setting steps = 2.5 is a number, but steps takes a whole number", "e.g. steps = 600"]),
        ('resume = "yes"\n', ["setting resume = 'yes' is a string, but resume takes true or false"]),
        ("mesh = 2\n", ["setting mesh = 2 is a whole number, but mesh takes a string"]),
        ('optimizer = "lion"\n', ["setting optimizer = 'lion' is not one of sgd, adam, adamw"]),
        (None, ["does not exist"]),
    ],
)
def test_bad_config_file(capsys, tmp_path, corpus, tiny, text, words):
    """Flags are typed and checked by the command line; a --config file can hold anything."""
    cfg = tmp_path / "cfg.toml"
    if text is not None:
        cfg.write_text(text)
    run = tmp_path / "run"
    given = {line.split("=")[0].strip().replace("_", "-") for line in (text or "").splitlines()}
    # flags override the file: leave out each flag (and its value) that the file sets
    flags = [a for i, a in enumerate(tiny) if not {a, tiny[i - 1]} & {f"--{k}" for k in given}]
    code = cli_main(["train", *flags, "--data", str(corpus), "--run-dir", str(run), "--config", str(cfg)])
    out, err = capsys.readouterr()
    one_paragraph(code, out, err, "train", *words)
    if text is None or "TOML" in words[0] or "unknown" in words[0]:
        assert f"config file {cfg}" in err
    else:
        assert "fix it in the --config file" in err
    assert not run.exists()


def test_config_file_that_cannot_be_read(train, tmp_path, corpus):
    """A directory given as --config, and a config file that is not UTF-8 (named, with the fix)."""
    one_paragraph(
        *train(tmp_path / "run", corpus, "--config", str(tmp_path)),
        "train",
        f"config file {tmp_path} is a directory",
        f"such as {tmp_path / 'config.toml'}",
    )
    latin = tmp_path / "latin.toml"
    latin.write_bytes("data = 'caf\u00e9.txt'\n".encode("latin-1"))
    one_paragraph(
        *train(tmp_path / "run", corpus, "--config", str(latin)),
        "train",
        f"config file {latin} is not UTF-8 text (byte 11: invalid continuation byte)",
        f"iconv -f latin1 -t utf-8 {latin}",
    )


@pytest.mark.parametrize(
    "env, argv, words",
    [
        (
            {"RANK": "0", "WORLD_SIZE": "1"},
            ["--nproc", "2"],
            [
                "RANK=0 and WORLD_SIZE=1 in the environment make this process the only rank",
                "--nproc 2 would start no process",
                "env -u RANK -u WORLD_SIZE",
                "or pass --nproc 1",
            ],
        ),
        ({"RANK": "0"}, ["--nproc", "2"], ["RANK=0 and WORLD_SIZE=(unset)"]),
        ({"RANK": "0", "WORLD_SIZE": "two"}, [], ["environment variable WORLD_SIZE='two' is not a whole number"]),
    ],
)
def test_stray_torchrun_variables(train, tmp_path, corpus, monkeypatch, env, argv, words):
    """Variables torchrun sets, left in the environment by hand: refused before anything runs (under torchrun,
    TORCHELASTIC_RUN_ID is set and WORLD_SIZE decides)."""
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    one_paragraph(*train(tmp_path / "run", corpus, *argv), "train", *words)


def test_corpus_of_one_token(train, tmp_path):
    same = tmp_path / "same.txt"
    same.write_text("a" * 9000)
    one_paragraph(
        *train(tmp_path / "run", same, "--tokenizer", "char"),
        "train",
        f"data from {same}: its training split (the first 90%, 8,100 tokens) is one token repeated, 'a'",
        "use a text with more than one distinct character",
    )


def test_data_too_short_for_the_context(train, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 3)
    one_paragraph(
        *train(tmp_path / "run", short, "--strategy", "dp"),
        "train",
        f"data from {short} has 31 characters, 2 tokens (BPE, 267 tokens)",
        "--seq-len 16",
        "needs more than 17 tokens",
        "use more text or a shorter --seq-len",
    )


# --- outputs: run directory and metrics file ------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, words",
    [
        ("run_is_file", ["run directory", "cannot be created: it or one of its parents is a file", "--run-dir"]),
        ("run_under_file", ["run directory", "cannot be created", "--run-dir"]),
        ("metrics_under_file", ["directory of --metrics", "is a file", "omit it"]),
        ("metrics_is_dir", ["is a directory", "metrics.jsonl"]),
        ("trace_under_file", ["directory of --trace", "is a file", "omit it"]),
        ("trace_is_dir", ["--trace", "is a directory", "trace.json"]),
    ],
)
def test_unwritable_outputs_fail_before_any_process(train, tmp_path, corpus, where, words):
    blocker = tmp_path / "file"
    blocker.write_text("")
    run, extra = tmp_path / "run", ["--checkpoint-dir", str(tmp_path / "ck")]
    if where == "run_is_file":
        run = blocker
    elif where == "run_under_file":
        run = blocker / "run"
    elif where == "metrics_under_file":
        extra += ["--metrics", str(blocker / "m.jsonl")]
    elif where == "metrics_is_dir":
        (tmp_path / "mdir").mkdir()
        extra += ["--metrics", str(tmp_path / "mdir")]
    elif where == "trace_under_file":
        extra += ["--trace", str(blocker / "t.json")]
    else:
        extra += ["--trace", str(tmp_path)]
    for nproc in ("2",) if "trace" in where else ("2", "1"):  # checked in the parent (before launch) and in one
        # process (--trace needs several)
        code, out, err = train(run, corpus, "--strategy", "single" if nproc == "1" else "tp", "--nproc", nproc, *extra)
        one_paragraph(code, out, err, "train", *words)
    assert blocker.read_text() == "" and files(tmp_path / "ck") == set()


# --- resume ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus, tiny):
    """A run of 2 steps (one process) with its checkpoint at step 2."""
    old = signal.getsignal(signal.SIGTERM)
    run = tmp_path_factory.mktemp("finished") / "run"
    try:
        assert (
            cli_main(
                [
                    "train",
                    *tiny,
                    "--steps",
                    "2",
                    "--data",
                    str(corpus),
                    "--run-dir",
                    str(run),
                    "--strategy",
                    "single",
                    "--nproc",
                    "1",
                ]
            )
            == 0
        )
    finally:
        signal.signal(signal.SIGTERM, old)
    return run


def test_resume_without_a_complete_checkpoint(train, tmp_path, corpus, finished):
    run = tmp_path / "run"
    one_paragraph(
        *train(run, corpus, "--resume", "--steps", "4"),
        "train",
        "--resume",
        "holds no complete checkpoint",
        "start a new run without --resume",
    )
    shutil.copytree(finished / "checkpoints" / "step_2", run / "checkpoints" / "step_4.tmp")  # a save cut short
    one_paragraph(*train(run, corpus, "--resume", "--steps", "4"), "train", "only incomplete saves: step_4.tmp")


def test_resume_from_a_step_directory(train, tmp_path, corpus, finished):
    """--checkpoint-dir names the directory of the step_N checkpoints; one of them given instead is named as such."""
    step = finished / "checkpoints" / "step_2"
    one_paragraph(
        *train(tmp_path / "run", corpus, "--resume", "--steps", "4", "--checkpoint-dir", str(step)),
        "train",
        f"--resume: {step} is one checkpoint, not a checkpoint directory",
        f"pass --checkpoint-dir {step.parent}",
    )


def test_resume_on_another_text_or_optimizer(train, tmp_path, corpus, finished):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    other = tmp_path / "other.txt"
    other.write_text("THE QUICK BROWN FOX, AND THE LAZY DOG! " * 200)
    step2 = run / "checkpoints" / "step_2"
    one_paragraph(
        *train(run, other, "--resume", "--steps", "4"),
        "train",
        str(step2),
        "was trained on another text",
        f"resume with the data it was trained on ({corpus})",
    )
    one_paragraph(
        *train(run, corpus, "--resume", "--steps", "4", "--optimizer", "sgd"),
        "train",
        str(step2),
        "holds the optimizer state of AdamW",
        "this run uses SGD with momentum",
        "resume with --optimizer adamw",
    )


def test_resume_with_another_seed_or_optimizer_setting(train, tmp_path, corpus, finished, tiny, capsys):
    """--resume with another --seed (or --lr, --optimizer adam from adamw, ...) continued silently, its losses no longer
    the uninterrupted run's: refused, listing each changed setting old → new, unless --allow-changed-settings."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    step2 = run / "checkpoints" / "step_2"
    one_paragraph(
        *train(run, corpus, "--resume", "--steps", "4", "--seed", "1"),
        "train",
        f"checkpoint {step2} was trained with other settings than this run's: --seed 0 → 1; its losses from here "
        f"would not match the uninterrupted run's: resume with the checkpoint's (--seed 0), pass "
        f"--allow-changed-settings to continue with this run's on purpose, or start a new run without --resume",
    )
    one_paragraph(
        *train(run, corpus, "--resume", "--steps", "4", "--lr", "0.02", "--optimizer", "adam", "--weight-decay", "0.1"),
        "train",
        "other settings than this run's: --optimizer adamw → adam, --lr 0.01 → 0.02, --weight-decay 0.0 → 0.1;",
        "resume with the checkpoint's (--optimizer adamw --lr 0.01 --weight-decay 0.0)",
    )
    # on purpose: accepted (one process, so that it runs here)
    code = cli_main(
        ["train", *tiny, "--steps", "3", "--data", str(corpus), "--run-dir", str(run), "--strategy", "single"]
        + ["--nproc", "1", "--resume", "--seed", "1", "--allow-changed-settings"]
    )
    out, err = capsys.readouterr()
    assert code == 0 and f"resumed from {step2}" in out, err


def test_unfit_checkpoint_in_ranks_started_like_torchrun(tmp_path, train_argv, finished):
    """Ranks given torchrun's environment (here by shardflow's launcher, without the parent's checks) meet a
    corrupt checkpoint after joining the group: each ends with one paragraph and status 2, no traceback."""
    from shardflow.runtime.launch import launch

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    data = run / "checkpoints" / "step_2" / "__0_0.distcp"
    data.write_bytes(os.urandom(data.stat().st_size))
    res = launch(
        train_argv(run, "--steps", "4", "--resume", "--strategy", "dp", "--nproc", "2"),
        2,
        tmp_path / "logs",
        grace_s=20,
        echo_rank0=False,
    )
    assert res.returncodes == (2, 2), res
    for r in (0, 1):
        log = (tmp_path / "logs" / f"rank{r}.log").read_text()
        assert log.startswith(
            f"shardflow train: error: rank {r}: checkpoint {data.parent} is corrupt: the contents "
            f"of __0_0.distcp differ from what was written (sha256 mismatch)"
        ), log
        assert log.count("\n") == 1 and "Traceback" not in log, log


# --- shardflow plan, export -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, words",
    [
        ("{not json", ["cannot read plan file", "JSONDecodeError", "JSON or TOML object"]),
        ("[modules\n", ["cannot read plan file", "TOMLDecodeError"]),
        ("[1, 2]", ["cannot read plan file", "JSON or TOML object"]),
        ('{"modules": {"lm_head": {"params": {"weight": ["Shard(x)"]}}}}', ["cannot read plan", "Shard(0)"]),
        ('{"modules": {"nope.*": {"stage": 0}}}', ["plan pattern 'nope.*' matches no module", "modules are: "]),
        # a dim the 2-dim weight does not have: it wrapped round to Shard(1), planned with exit 0 (a regression)
        (
            '{"modules": {"lm_head": {"params": {"weight": ["Shard(7)"]}}}}',
            [
                "plan for module 'lm_head' places parameter 'weight' (shape [",
                "2 dims) as tp: Shard(7), a dim it does not have",
                "give Shard(d) with d from 0 to 1 (or -2 to -1)",
            ],
        ),
        ('{"modules": {"lm_head": {"params": {"weight": ["Shard(-3)"]}}}}', ["Shard(-3), a dim it does not have"]),
    ],
)
def test_bad_plan_file(capsys, tmp_path, content, words):
    f = tmp_path / ("plan.toml" if content.startswith("[m") else "plan.json")
    f.write_text(content)
    code = cli_main([*PLAN, "--plan", str(f)])
    out, err = capsys.readouterr()
    one_paragraph(code, out, err, "plan", *words)
    if "cannot read plan" in words[0]:
        assert str(f) in err


def test_plan_arguments(capsys, tmp_path):
    code = cli_main([*PLAN, "--rank", "5"])
    one_paragraph(code, *capsys.readouterr(), "plan", "--rank 5", "ranks 0..1")
    out = tmp_path / "missing" / "p.dot"
    code = cli_main([*PLAN, "--format", "dot", "--out", str(out)])
    one_paragraph(code, *capsys.readouterr(), "plan", f"--out {out}", "does not exist")
    assert not out.parent.exists()


def _read_only(tmp_path: Path) -> list[Path]:
    """Places no file can be written: a path under a file; a read-only directory too where permissions bind (not
    as root)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    places = [blocker / "x"]
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        places.append(ro / "x")
    return places


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--layers", "0"], ["--layers 0 is out of range: give a value ≥ 1. --layers: transformer blocks"]),
        (["--nproc", "0"], ["--nproc 0 is out of range"]),
        (["--rank", "-1"], ["--rank -1 is out of range: give a value ≥ 0"]),
        (["--mesh", ""], ["--mesh is empty; give a value (device mesh"]),
        (["--strategy", "tp,"], ["strategy 'tp,' has an empty part"]),
        (["--strategy", "dp,dp"], ["strategy 'dp,dp' names dp twice"]),
        (["--strategy", "single", "--nproc", "2"], ["strategy 'single' runs on one device, but 2 are asked for"]),
        (["--mesh", "tp=2,zz=1"], ["axis 'zz' is none of the strategies' axes"]),
        (
            ["--plan", "p.toml", "--strategy", "dp"],
            ["--plan p.toml and --strategy dp both say how to split the model", "drop one of them"],
        ),
        (["--out", "x.dot"], ["--out x.dot is the file of --format dot, but --format is text", "> x.dot"]),
    ],
)
def test_plan_flags(capsys, argv, words):
    """Checked before the model is built (in one place, shardflow.cli.check_flags), or when the strategy is read."""
    one_paragraph(cli_main([*PLAN, *argv]), *capsys.readouterr(), "plan", *words)


def test_plan_out_that_cannot_be_written(capsys, tmp_path):
    one_paragraph(
        cli_main([*PLAN, "--format", "dot", "--out", str(tmp_path)]),
        *capsys.readouterr(),
        "plan",
        f"--out {tmp_path} is a directory; pass a file name such as {tmp_path / 'pcg.dot'}",
    )
    for place in _read_only(tmp_path):
        one_paragraph(
            cli_main([*PLAN, "--format", "dot", "--out", str(place)]), *capsys.readouterr(), "plan", f"--out {place}"
        )
        assert not place.exists()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lr", "nan"], ["--lr nan is out of range: give a finite value in [0, 3.4e+38]"]),
        (["--tol", "-1"], ["--tol -1.0 is out of range"]),
        (["--timeout", "inf"], ["--timeout inf is out of range: give a finite value in (0, 2000000]"]),
        (["--steps", "0"], ["--steps 0 is out of range: give a value ≥ 1"]),
        (["--plan", "p.toml", "--strategy", "tp"], ["--plan p.toml and --strategy tp both say how to split the model"]),
    ],
)
def test_check_flags(capsys, argv, words):
    one_paragraph(cli_main(["check", *PLAN[1:], *argv]), *capsys.readouterr(), "check", *words)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--temperature", "nan"], ["--temperature nan is out of range: give a finite value ≥ 0"]),
        (["--temperature", "-1"], ["--temperature -1.0 is out of range"]),
        (["--tokens", "-1"], ["--tokens -1 is out of range: give a value ≥ 0"]),
        (["--prompt", ""], ["--prompt is empty; give a value (text to continue"]),
    ],
)
def test_generate_flags(capsys, finished, argv, words):
    one_paragraph(
        cli_main(["generate", str(finished), "--prompt", "the", *argv]), *capsys.readouterr(), "generate", *words
    )


def test_export_where_nothing_can_be_written(capsys, tmp_path, finished):
    """Refused before the checkpoint is read."""
    for place in _read_only(tmp_path):
        one_paragraph(
            cli_main(["export", str(finished), "--out", str(place)]), *capsys.readouterr(), "export", f"{place.parent}"
        )
        assert not place.exists()


def test_export_onto_an_existing_directory(capsys, tmp_path, finished):
    (tmp_path / "keep.txt").write_text("mine")
    code = cli_main(["export", str(finished), "--out", str(tmp_path)])
    one_paragraph(code, *capsys.readouterr(), "export", f"--out {tmp_path} already exists", "overwrites nothing")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    data = finished / "checkpoints" / "step_2" / "__0_0.distcp"  # a file of the very checkpoint export reads
    before = data.read_bytes()
    code = cli_main(["export", str(finished), "--out", str(data)])
    one_paragraph(code, *capsys.readouterr(), "export", f"--out {data} already exists", "overwrites nothing")
    assert data.read_bytes() == before


# --- the Python API -------------------------------------------------------------------------------------------


def test_world_size_that_does_not_fit_the_mesh(corpus, monkeypatch):
    """Under torchrun the world size comes from the environment; the planner and the executor both refuse a mesh
    of another size, saying how to fix it."""
    import torch.distributed as dist

    from shardflow.lower import lower_step
    from shardflow.runtime.distributed import DistributedExecutor
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import setup

    cfg = TrainConfig(
        strategy="tp", mesh="tp=2", layers=1, heads=2, embd=16, seq_len=16, batch_size=8, data=str(corpus)
    )
    with pytest.raises(ValueError, match=r"mesh tp=2 has 2 devices but 4 processes run; make --nproc .* equal 2"):
        setup(cfg, 4)
    s = setup(cfg, 2)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(
            ValueError,
            match=r"the plan is for mesh tp=2 \(2 devices\) but the world has 1 "
            r"processes; start 2 processes or change --mesh",
        ):
            DistributedExecutor(lower_step(s.pcg, "adamw", ranks=[0]), OptimizerConfig("adamw", 0.01), 5.0)
    finally:
        dist.destroy_process_group()


# --- torchrun-style environment: rendezvous failures, as real processes -----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_style_rendezvous_failures(tmp_path, train_argv):
    """RANK/WORLD_SIZE/MASTER_* set by hand, as torchrun would: a port already in use on rank 0, a master nobody
    answers for rank 1 (within --timeout 1), a rank 0 the others never join (it says it waits), no MASTER_ADDR at
    all, a plan error and a world size the mesh does not fit inside a rank (both before it joins) — each one
    paragraph, exit status 2, no C++ or Python traceback, nothing written."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    nobody, alone = _free_port(), _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    cases = {
        "in use": (
            dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            [],
            [
                f"rank 0 of 2 could not join the process group at 127.0.0.1:{port}",
                "address already in use",
                f"port {port} is already in use on this machine",
                "choose a free MASTER_PORT",
            ],
        ),
        "nobody": (
            dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(nobody)),
            [],
            [
                f"rank 1 of 2 could not join the process group at 127.0.0.1:{nobody}",
                "timed out",
                "within --timeout 1 s: start rank 0",
                "or raise --timeout",
            ],
        ),
        "alone": (
            dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(alone)),
            ["--timeout", "3"],
            [
                f"rank 0 of 2 could not join the process group at 127.0.0.1:{alone}",
                "waiting for clients",
                "it reached the rendezvous",
                "start all 2 processes",
                "or raise --timeout",
            ],
        ),
        "unset": (
            dict(RANK="1", WORLD_SIZE="2"),
            [],
            ["MASTER_ADDR expected, but not set", "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"],
        ),
        "plan": (
            dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(nobody)),
            ["--strategy", "tp", "--heads", "3", "--kv-heads", "3", "--embd", "48"],
            ["degree 2 does not divide", "size 3"],
        ),
        "world": (
            dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(nobody)),
            ["--strategy", "tp", "--mesh", "tp=2"],
            ["mesh tp=2 has 2 devices but 4 processes run"],
        ),
    }
    procs = {}
    for name, (env, extra, _) in cases.items():
        argv = train_argv(tmp_path / name, "--steps", "2", "--timeout", "1", "--strategy", "dp", *extra)
        procs[name] = subprocess.Popen(
            argv, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=patience(120))
            one_paragraph(p.returncode, out, err, "train", *cases[name][2])
            if name == "alone":  # it said it was waiting, every --timeout / 3 seconds
                assert (
                    f"rank 0 of 2: waiting for the other processes to join the process group at 127.0.0.1:{alone}"
                    f" (1 s; --timeout 3 s)" in out
                ), out
            assert "frame #" not in err and "[W" not in err and "[E" not in err, err  # torch's C++ log held back
            assert files(tmp_path / name) == set(), name
    finally:
        busy.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()


# --- --model factories that exit, raise or return no module (train and check) -----------------------------------

QUITTING = """
import sys


def exits():
    sys.exit(0)


def raises():
    raise RuntimeError("no weights here")


def not_a_module():
    return "model", {"x": 1}
"""


@pytest.mark.parametrize("command", ["train", "check"])
@pytest.mark.parametrize(
    "spec, words",
    [
        (
            "quitting.py:exits",
            [
                "calling exits() exited (SystemExit: 0, at ",
                "quitting.py:6) instead of returning (module, batch); remove the exit from exits()",
            ],
        ),
        ("on_import.py:make", ["importing ", "on_import.py exited (SystemExit: 0, at ", "on_import.py:3)", "__main__"]),
        ("quitting.py:raises", ["calling raises() raised RuntimeError: no weights here (at "]),
        ("quitting.py:not_a_module", ["not_a_module() must return (module, batch)", "its first item is a str"]),
    ],
)
def test_a_factory_that_exits_raises_or_returns_no_module(capsys, monkeypatch, tmp_path, corpus, command, spec, words):
    """A factory that calls sys.exit(0) (or a module that does on import) made train and check exit 0 having done
    nothing: each of these is one paragraph naming the factory, status 2, before any process starts."""
    from shardflow.runtime import launch

    (tmp_path / "quitting.py").write_text(QUITTING)
    (tmp_path / "on_import.py").write_text("import sys\n\nsys.exit(0)\n\n\ndef make():\n    pass\n")
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process was started"))
    run = tmp_path / "run"
    spec = f"{tmp_path}/{spec}"
    argv = ["--data", str(corpus), "--run-dir", str(run), "--steps", "2"] if command == "train" else []
    code = cli_main([command, "--model", spec, "--nproc", "2", *argv])
    out, err = capsys.readouterr()
    one_paragraph(code, out, err, command, f"--model {spec}: ", *words)
    assert not run.exists()


# --- files cut short or poisoned: generate, --init-from, export (docs/bad-inputs.md §14) ----------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory, finished):
    """The Hugging Face directory ``shardflow export`` writes from :func:`finished` (kept whole: copy it to spoil)."""
    out = tmp_path_factory.mktemp("exported") / "hf"
    assert cli_main(["export", str(finished), "--out", str(out)]) == 0
    return out


def _spoiled(exported: Path, tmp_path: Path, how: str) -> Path:
    """A copy of ``exported`` whose model.safetensors is cut in half (``truncated``) or holds NaN in its first weight
    (``nan``)."""
    hf = tmp_path / "hf"
    shutil.copytree(exported, hf)
    weights = hf / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        tensors["model.embed_tokens.weight"][0] = float("nan")
        save_file(tensors, weights, metadata={"format": "pt"})
    return hf


def test_generate_from_a_truncated_model_safetensors(capsys, tmp_path, exported):
    hf = _spoiled(exported, tmp_path, "truncated")
    code = cli_main(["generate", str(hf), "--prompt", "the", "--tokens", "2"])
    one_paragraph(
        code, *capsys.readouterr(), "generate", f"{hf / 'model.safetensors'} is corrupt or truncated", "export"
    )


def test_generate_from_weights_that_hold_nan(capsys, tmp_path, exported):
    hf = _spoiled(exported, tmp_path, "nan")
    code = cli_main(["generate", str(hf), "--prompt", "the", "--tokens", "2"])
    out, err = capsys.readouterr()
    one_paragraph(code, out, err, "generate", f"{hf / 'model.safetensors'}", "holds NaN", "model.embed_tokens")
    assert "learning rate" not in err and not out


def test_init_from_a_truncated_model_safetensors(train, tmp_path, corpus, exported):
    """Refused before the run directory is claimed (nothing written), naming the file."""
    hf = _spoiled(exported, tmp_path, "truncated")
    code, out, err = train(tmp_path / "run", corpus, "--init-from", str(hf), "--nproc", "1")
    one_paragraph(code, out, err, "train", f"--init-from {hf}: {hf / 'model.safetensors'} is corrupt or truncated")


def test_init_from_weights_that_hold_nan(capsys, tmp_path, corpus, exported, tiny):
    """Found as the weights are read, before the first step (no checkpoint): the file is named, not --lr (before:
    "the loss is not finite ... lower --lr")."""
    hf = _spoiled(exported, tmp_path, "nan")
    run = tmp_path / "run"
    argv = ["train", *tiny, "--steps", "2", "--data", str(corpus), "--run-dir", str(run), "--nproc", "1"]
    old = signal.getsignal(signal.SIGTERM)
    try:
        code = cli_main([*argv, "--init-from", str(hf)])
    finally:
        signal.signal(signal.SIGTERM, old)
    out, err = capsys.readouterr()
    err = err.splitlines()[-1] + "\n"  # the paragraph ends stderr (rank logs are teed there)
    one_paragraph(code, "", err, "train", f"--init-from {hf}: {hf / 'model.safetensors'} holds NaN", "embed_tokens")
    assert "--lr" not in err and "learning rate" not in err
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_export_onto_a_full_disk(capsys, tmp_path, finished, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (not an OSError): one paragraph, and no partial
    directory is left."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    out = tmp_path / "hf"
    code = cli_main(["export", str(finished), "--out", str(out)])
    one_paragraph(code, *capsys.readouterr(), "export", f"cannot write --out {out}", "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_two_exports_into_one_directory_at_once(capsys, tmp_path, finished):
    """While one export holds ``.DIR.lock`` (here: this test, as another process would), a second into the same
    DIR is refused at once, naming the holder; nothing is written, and the lock file goes with the export that
    holds it."""
    from shardflow.train.rundir import exclusive

    out = tmp_path / "hf"
    at = tmp_path / ".hf.lock"
    fd = exclusive(at, RuntimeError)
    try:
        code = cli_main(["export", str(finished), "--out", str(out)])
        one_paragraph(
            code,
            *capsys.readouterr(),
            "export",
            f"--out {out} is being written by another shardflow export",
            f"PID {os.getpid()}",
        )
        assert not out.exists()
    finally:
        os.close(fd)
    assert cli_main(["export", str(finished), "--out", str(out)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # the export removed the lock file it held


def test_another_steps_under_a_decaying_learning_rate_is_a_changed_setting():
    """--steps sets every step's learning rate under --lr-schedule cosine or linear (it decays to the last step), so
    --resume with another --steps would match neither run: a changed setting (refused unless
    --allow-changed-settings); under a constant learning rate more steps just continue the run."""
    from shardflow.train.checkpoint.resume import changed_settings

    cosine = {"lr_schedule": "cosine", "steps": 2, "seed": 0}
    assert changed_settings(cosine, {**cosine, "steps": 4}) == [("--steps", 2, 4)]
    constant = {"lr_schedule": "constant", "steps": 2, "seed": 0}
    assert changed_settings(constant, {**constant, "steps": 4}) == []
