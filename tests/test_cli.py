"""`shardflow plan`: prints the PCG without starting processes; user errors exit 2 with one paragraph."""

import hashlib
import json
import subprocess
import sys

import pytest
from conftest import patience

from shardflow.cli import main


def run(capsys, *argv):
    code = main(
        ["plan", "--model", "gpt", "--layers", "1", "--embd", "32", "--seq-len", "8", "--batch-size", "4", *argv]
    )
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_tp_pcg(capsys):
    code, out, err = run(capsys, "--strategy", "tp", "--nproc", "2")
    assert code == 0 and not err
    assert out.splitlines()[0] == ("# strategy tp: mesh tp=2 (2 devices); 47 compute ops; parallel ops: reduction ×5")
    assert "weight   transformer.h.0.mlp.c_fc.weight: float32[128/2, 32] (S(0))" in out
    # the vocabulary of 65 characters in uneven blocks (33, 32 rows): docs/concepts.md#uneven-shards
    assert "weight   transformer.wte.weight: float32[65/2, 32] (S(0))" in out
    # the parallel ops: 2 Megatron all-reduces, the embedding's, the loss's max and sum
    assert sum(line.startswith("* ") for line in out.splitlines()) == 2 + 1 + 2


def test_plan_on_a_2d_mesh_and_the_graph_listing(capsys):
    code, out, _ = run(capsys, "--strategy", "dp,tp", "--mesh", "dp=2,tp=2")
    assert code == 0 and "input    idx: int64[4/2, 8] rep=2 (S(0),R)" in out
    code, out, _ = run(capsys, "--graph")
    assert code == 0 and out.startswith("input    idx: int64[4, 8]") and "attention(causal=True" in out


def test_plan_defaults_to_the_model_train_trains(capsys):
    """Without --model, plan captures what `shardflow train` trains by default: the same Hugging Face Llama, sized
    from the same defaults (one source: TrainConfig and DEFAULT_SIZES), with train's batch shape."""
    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import build_model

    cfg = TrainConfig()
    _, _, model = build_model(cfg, cfg.vocab_size, None)
    assert main(["plan", "--graph"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"input    input_ids: int64[{cfg.batch_size}, {cfg.seq_len}]\n")
    weights = [line for line in out.splitlines() if line.startswith("weight ")]
    assert weights == [f"weight   {n}: float32[{', '.join(map(str, p.shape))}]" for n, p in model.named_parameters()]
    code, out, err = run(capsys, "--kv-heads", "2")
    assert code == 2 and err == (
        "shardflow plan: error: --kv-heads 2: --model gpt has no grouped-query attention; "
        "drop --kv-heads, or plan --model llama\n"
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--strategy", "tp", "--nproc", "3"], ["degree 3", "does not divide"]),
        (["--strategy", "tp", "--mesh", "dp=2"], ["mesh axis 'tp'", "--mesh tp=2"]),
        (["--mesh", "dp2"], ["cannot read mesh", "dp=2,tp=2"]),
        (["--plan", "/nonexistent/plan.toml"], ["No such file"]),
    ],
)
def test_user_errors_exit_2_with_one_paragraph(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2 and not out
    assert err.startswith("shardflow plan: error: ") and "Traceback" not in err and err.count("\n") == 1
    for w in words:
        assert w in err


def test_output_cut_short_by_its_reader_is_no_traceback():
    """``shardflow plan ... | head -c 100``: the plan (about 180 KB, more than a pipe holds) stops quietly when head
    has read its 100 bytes, with status 141 (128 + SIGPIPE) as a writer killed by SIGPIPE shows in a shell."""
    r = subprocess.run(
        f"{sys.executable} -m shardflow.cli plan --model mlp --layers 8 --strategy dp --nproc 2 "
        f'--format json | head -c 100; echo " ${{PIPESTATUS[0]}}"',
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert r.stderr == "" and r.stdout.startswith("{") and r.stdout.endswith(" 141\n"), (r.stdout, r.stderr)


def test_console_entry_point_runs():
    r = subprocess.run(
        [sys.executable, "-m", "shardflow.cli", "plan", "--model", "mlp", "--strategy", "pp", "--mesh", "pp=2"],
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert r.returncode == 0, r.stderr
    assert "@mesh[pp=1]" in r.stdout and "@mesh[pp=0]" in r.stdout


def test_plan_text_shows_programs_bytes_and_proof(capsys):
    code, out, _ = run(capsys, "--strategy", "dp", "--nproc", "2", "--rank", "1")
    assert code == 0
    assert "rank 1: " in out and "rank 0: " not in out
    assert "all_reduce (async) group=[0, 1] axis=dp" in out  # the label count and the gradient bucket travel
    assert out.rstrip().splitlines()[-1].startswith("# verified: 2 ranks")


def test_plan_json_is_machine_readable(capsys):
    import json

    code, out, _ = run(capsys, "--strategy", "tp", "--nproc", "2", "--format", "json")
    doc = json.loads(out)
    # 4 of the Megatron pairs (2 forward, 2 backward), 5 of the vocabulary-parallel embedding, head and loss (the
    # embedding's output, the head's input gradient, the loss's max, sum and the sum's gradient) and the gradient
    # norm's, as shardflow train runs it (the loss's target logits stay partial to the loss)
    assert code == 0 and doc["verified"] and doc["collectives"] == {"all_reduce": 4 + 5 + 1}
    r0 = doc["ranks"][0]
    assert r0["rank"] == 0 and len(r0["fingerprint"]) == 64
    assert set(r0["bytes"]) == {"all_reduce"} and r0["bytes"]["all_reduce"]["tp"] > 0
    assert sum(i["type"] == "comm" for i in r0["instructions"]) == 10


def test_plan_lowers_with_train_s_communication_forms(capsys):
    """plan shows the programs `shardflow train` would run: its --all-gather / --reduce-scatter forms, "auto" by the
    cost model train uses on this machine (calibrated or default), and ring forms as collective-permutes."""
    from shardflow.lower.comm_lowering import lowering_summary
    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import setup

    sizes = {"layers": 1, "seq_len": 8, "batch_size": 4}  # the Llama train trains, small

    def kinds(*argv):
        flags = [x for k, v in sizes.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        assert main(["plan", *flags, "--strategy", "sp", "--mesh", "tp=2", "--format", "json", *argv]) == 0
        return json.loads(capsys.readouterr().out)["collectives"]

    collective = kinds("--all-gather", "collective", "--reduce-scatter", "collective")
    # per block 2 all-gathers and 2 reduce-scatters each way; the vocabulary-parallel embedding's reduce-scatter and
    # the head's all-gather, each way; all-reduces: the loss's max and sum, the gradient of the sum, the norms' weight
    # gradients and the gradient norm's (the loss's target logits stay partial to the loss)
    assert collective == {"all_gather": 6, "reduce_scatter": 6, "all_reduce": 5}
    # on 2 ranks a ring is one collective-permute step
    assert kinds("--all-gather", "ring", "--reduce-scatter", "ring") == {"permute": 6 + 6, "all_reduce": 5}
    # regathered: the block's 2 column groups' inputs and the head's gathered again in the backward
    regathered = kinds("--all-gather", "collective", "--reduce-scatter", "collective", "--regather-activations")
    assert regathered == {"all_gather": 6 + 3, "reduce_scatter": 6, "all_reduce": 5}
    cfg = TrainConfig(**sizes, strategy="sp", mesh="tp=2", nproc=2)
    train = lowering_summary(setup(cfg, 2).lower().programs)
    assert kinds() == train


def test_plan_dot_writes_the_pcg(capsys, tmp_path):
    out_file = tmp_path / "p.dot"
    code, out, _ = run(
        capsys, "--strategy", "pp", "--mesh", "pp=2", "--layers", "2", "--format", "dot", "--out", str(out_file)
    )
    text = out_file.read_text()
    assert code == 0 and out.startswith(f"wrote {out_file}")
    assert text.startswith("digraph pcg {") and "style=dashed color=red" in text  # a stage crossing


def test_plan_passes_lists_each_pass_with_its_time(capsys):
    code, out, _ = run(capsys, "--strategy", "tp", "--nproc", "2", "--passes")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["pass", "ms", "graph"]
    assert [line.split()[0] for line in lines[1:]] == [
        "pass_expansion",
        "copy_insertion",
        "schedule",
        "shard_expansion",
        "comm_lowering",
        "ordering",
        "verify",
    ]
    assert all(float(line.split()[1]) >= 0 for line in lines[1:])


def test_plan_dump_after_prints_the_graph_after_one_pass(capsys):
    code, out, _ = run(
        capsys,
        "--model",
        "mlp",
        "--layers",
        "2",
        "--strategy",
        "pp",
        "--mesh",
        "pp=2",
        "--dump-after",
        "copy_insertion",
    )
    assert code == 0 and out.startswith("dynamic graph: ") and "passes done: pass_expansion, copy_insertion" in out
    assert "FWD  copy     FWD copy fwd:relu mesh[pp=0]->mesh[pp=1]" in out
    code, out, _ = run(
        capsys, "--model", "mlp", "--layers", "2", "--strategy", "pp", "--mesh", "pp=2", "--dump-after", "ordering"
    )
    assert code == 0 and out.startswith("rank 0: ") and "recv" in out and "free " in out


def test_plan_draws_the_pipeline_schedule(capsys):
    """--microbatches 4 on pp=2: the schedule as a timeline per stage with its bubble, the per-rank programs of the
    whole step (4 activations sent by stage 0, issued without waiting), and the schedule in the JSON."""
    argv = ("--model", "mlp", "--layers", "4", "--strategy", "pp", "--mesh", "pp=2", "--microbatches", "4")
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "# pipeline schedule 1f1b: 2 stages, 4 microbatches, 10 ticks; bubble (p-1)/(m+p-1) = 0.200" in out
    assert "#   stage 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3   (at most 2 microbatch(es) in flight)" in out
    code, out, _ = run(capsys, *argv, "--schedule", "gpipe", "--format", "json")
    doc = json.loads(out)
    assert doc["schedule"] == {
        "kind": "gpipe",
        "stages": 2,
        "microbatches": 4,
        "bubble": 0.2,
        "actions": [["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]] * 2,
    }
    sends = [i for i in doc["ranks"][0]["instructions"] if i["type"] == "comm" and i["kind"] == "send"]
    assert len(sends) == 4 and not any(i["wait"] for i in sends)


@pytest.mark.parametrize("command", [[], ["plan"], ["check"], ["train"], ["export"], ["generate"]])
def test_help_is_plain_text_with_each_default_once(capsys, command):
    """No RST markup (the top-level description used to be the module docstring's first line, backticks and all)
    and no ``(default None)`` after a help that says what its absence means already."""
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: shardflow")
    assert "``" not in out and ":func:" not in out and ":mod:" not in out
    flat = " ".join(out.split())
    assert "(default None)" not in flat
    if command == ["train"]:
        assert "(default: a new directory runs/YYYYmmdd-HHMMSS per run" in flat and "(default 100)" in flat


def _rank0(out: str) -> list[str]:
    """Rank 0's program lines of a plan's text output."""
    lines = out.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("rank 0: "))
    end = next(k for k, line in enumerate(lines) if line.startswith("rank 1: "))
    return lines[start:end]


def test_plan_dtype_bf16_casts_each_float32_master_and_gathers_bfloat16(capsys):
    """--dtype bf16 (train's flag): the model captured in bfloat16, each weight a float32 master cast once per step,
    FSDP's all-gathers in bfloat16 and its gradient reduce-scatters in float32; --dtype float32 (the default) casts
    nothing and gathers float32."""
    code, out, err = run(capsys, "--strategy", "fsdp", "--nproc", "2", "--dtype", "bf16")
    assert code == 0 and not err
    weights = [line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("weight ")]
    assert "# --dtype bf16: each weight held, reduced and updated in float32 (the master, fwd:W)" in out
    prog = _rank0(out)
    casts = [line for line in prog if "= cast(bfloat16)(fwd:" in line and "@compute" in line]
    assert sorted(line.split()[1].split("@")[0].removeprefix("fwd:") for line in casts) == sorted(weights)
    assert all(line.split("(fwd:")[1].split(":")[1].startswith("float32[") for line in casts)  # read the master
    gathers = [line for line in prog if " all_gather " in line]
    scatters = [line for line in prog if " reduce_scatter " in line]
    assert gathers and all(" axis=fsdp bfloat16[" in line for line in gathers)
    assert scatters and all(" axis=fsdp float32[" in line for line in scatters)
    code, out, _ = run(capsys, "--strategy", "fsdp", "--nproc", "2")
    prog = _rank0(out)
    assert code == 0 and "# --dtype" not in out and not any("= cast(" in line and "@compute" in line for line in prog)
    assert all(" axis=fsdp float32[" in line for line in prog if " all_gather " in line)


def test_plan_accumulate_shows_the_last_micro_step_and_each_ones_communications(capsys):
    """--accumulate N (train's flag): the graph of a micro-batch (B/N rows), the programs of the last micro-step —
    which adds the earlier ones' gradient contributions (acc:) and reduces them once — and per micro-step its
    communications: the gradient all-reduce (one bucket under dp) only in the last."""
    argv = ["--model", "mlp", "--layers", "2", "--batch-size", "8", "--strategy", "dp", "--nproc", "2"]
    code, out, err = run(capsys, *argv, "--accumulate", "4")
    assert code == 0 and not err
    assert "input    x: float32[2/2, 32]" in out  # a micro-batch: 8 / 4 rows, split over dp
    lines = out.splitlines()
    k = lines.index(
        "# --accumulate 4: the programs below are those of the last of 4 micro-steps (it adds the earlier "
        "micro-steps' gradient contributions to its own, reduces them and updates); communications of "
        "rank 0 per micro-step:"
    )
    assert lines[k + 1 : k + 4] == [
        "#   first of 4 micro-steps: FWD all_reduce ×1",  # the loss's label count
        "#   middle of 4 micro-steps: FWD all_reduce ×1",
        "#   last of 4 micro-steps: FWD all_reduce ×1, BWD all_reduce ×1, UPD all_reduce ×1",
    ]  # and the gradient norm, as train computes it
    prog = _rank0(out)
    assert sum("= sum(" in line and ", acc:grad:" in line for line in prog) == 4  # each weight's earlier sum added
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "input    x: float32[8/2, 32]" in out and "# --accumulate" not in out
    assert not any("acc:" in line for line in _rank0(out))
    code, out, _ = run(capsys, *argv, "--accumulate", "4", "--dtype", "bf16", "--format", "json")
    import json

    doc = json.loads(out)
    assert code == 0 and (doc["micro_step"], doc["dtype"]) == ("last of 4 micro-steps", "bf16")
    code, out, err = run(capsys, *argv, "--accumulate", "3")
    assert (
        code == 2
        and not out
        and err
        == (
            "shardflow plan: error: input 'x' [8, 32] has 8 rows along dim 0, which "
            "do not split into 3 micro-batches of equal size; give a batch whose "
            "size is a multiple of 3\n"
        )
    )


def test_plan_shares_train_flags_help(capsys):
    """plan's --accumulate, --dtype, --ac, --ac-blocks and --[no-]reshard-after-forward are train's: the same help, choices and
    default, from TrainConfig's fields."""
    import argparse

    from shardflow.cli import build_parser
    from shardflow.train.config import TrainConfig

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {name: {o: a for a in sub.choices[name]._actions for o in a.option_strings} for name in ("plan", "train")}
    for flag in (
        "--accumulate",
        "--dtype",
        "--ac",
        "--ac-blocks",
        "--reshard-after-forward",
        "--optimizer",
        "--momentum",
    ):
        plan, train = flags["plan"][flag], flags["train"][flag]
        assert (plan.help, plan.choices, plan.type) == (train.help, train.choices, train.type), flag
        assert plan.default == getattr(TrainConfig(), plan.dest) and train.default is None, flag


def test_plan_and_check_map_the_optimizer_as_train_does(capsys):
    """plan's and check's --optimizer and --momentum are train's (sgd, adam, adamw; momentum 0.9), read by train's
    one mapping (optimizer_config): plan's default is train's AdamW, check's SGD (Adam's first steps magnify the
    rounding of near-zero gradients past float32's tolerance). The update carries the state slots they name: two per
    weight for AdamW, one for SGD with momentum, none with --momentum 0."""
    import re

    from shardflow.cli import build_parser
    from shardflow.lower.dynamic import Optimizer, UpdateRule
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.train.config import TrainConfig, optimizer_config

    parser = build_parser()
    assert optimizer_config(parser.parse_args(["plan"])) == optimizer_config(TrainConfig())
    assert optimizer_config(parser.parse_args(["check"])) == OptimizerConfig(Optimizer.SGD, 0.1, 0.9)
    flags = (["--optimizer", "sgd"], ["--optimizer", "sgd", "--momentum", "0"], ["--optimizer", "adam"])
    slots = [optimizer_config(parser.parse_args(["plan", *f])).slots for f in ([], *flags)]
    assert slots == [UpdateRule.ADAMW, UpdateRule.SGD_MOMENTUM, UpdateRule.SGD, UpdateRule.ADAMW]

    def values(*argv):
        code, out, _ = run(capsys, "--strategy", "tp", "--nproc", "2", "--passes", *argv)
        assert code == 0
        return int(re.search(r"^pass_expansion .* (\d+) values", out, re.M).group(1))

    plain = values("--optimizer", "sgd", "--momentum", "0")
    assert values() - plain == 2 * (values("--optimizer", "sgd") - plain) > 0


def test_every_entry_point_lowers_the_same_programs(capsys, monkeypatch, tmp_path):
    """One pipeline (shardflow.pipeline.Pipeline) behind all four entry points: one model (a factory's, which train
    builds whole as the others do) on one fsdp=2 mesh lowers to per-rank programs with the same fingerprint (every
    instruction of every rank) through parallelize, shardflow train, shardflow plan and shardflow check — the
    machine's cost model choosing the "auto" forms, FSDP resharding after the forward and the gradient norm in
    every one."""
    import shardflow.cli as cli
    from shardflow.api import parallelize
    from shardflow.lower.program import programs_fingerprint
    from shardflow.model_spec import load_model
    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import setup

    factory = tmp_path / "tiny.py"
    factory.write_text(
        "import torch\n"
        "from shardflow.models import GPT, GPTConfig\n\n\n"
        "def tiny():  # a vocabulary of 1024 holds any token of train's BPE\n"
        "    g = torch.Generator().manual_seed(1)\n"
        "    idx, targets = (torch.randint(0, 1024, (4, 8), generator=g) for _ in range(2))\n"
        "    return GPT(GPTConfig(1024, block_size=8, n_layer=1)), {'idx': idx, 'targets': targets}\n"
    )
    spec = f"{factory}:tiny"
    cfg = TrainConfig(model=spec, seq_len=8, batch_size=4, strategy="fsdp", mesh="fsdp=2", nproc=2)
    fingerprints = {"train": programs_fingerprint(setup(cfg, 2).lower().programs)}

    model, batch = load_model(spec)
    trainer = parallelize(model, batch, mesh="fsdp=2", strategy="fsdp", optimizer="adamw", lr=cfg.lr)
    fingerprints["parallelize"] = programs_fingerprint(trainer.plan.lowered.programs)

    flags = ["--model", spec, "--strategy", "fsdp", "--mesh", "fsdp=2", "--optimizer", "adamw"]
    assert main(["plan", *flags, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fingerprints["plan"] = hashlib.sha256(json.dumps({"ranks": doc["ranks"]}, indent=1).encode()).hexdigest()

    checked = []
    monkeypatch.setattr(cli, "parallelize", lambda *a, **kw: checked.append(parallelize(*a, **kw)) or checked[-1])
    assert main(["check", *flags, "--dtype", "float32", "--steps", "1", "--tol", "1"]) == 0  # the programs matter
    fingerprints["check"] = programs_fingerprint(checked[0].plan.lowered.programs)
    assert len(set(fingerprints.values())) == 1, fingerprints


# --- whatever reaches the top of a command: one paragraph, never a traceback ----------------------------------

COMMANDS = {
    "plan": ["plan", "--model", "mlp"],
    "check": ["check", "--model", "mlp"],
    "train": ["train"],
    "export": ["export", "runs/x", "--out", "out"],
    "generate": ["generate", "runs/x", "--prompt", "a"],
}


def _safetensors(text: str) -> Exception:
    from safetensors import SafetensorError

    return SafetensorError(text)


def _unpickling() -> Exception:
    import pickle

    return pickle.UnpicklingError("invalid load key, '\\x00'.")


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(
    "make, words",
    [
        (lambda f: OSError(28, "No space left on device", str(f)), ["no space left", "free space there"]),
        (
            lambda f: _safetensors('Error while serializing: IoError(Os { code: 28, message: "No space left" })'),
            ["no space left on the device while writing {f}", "write elsewhere"],
        ),
        (lambda f: PermissionError(13, "Permission denied", str(f)), ["permission denied on {f}", "chmod"]),
        (lambda f: OSError(1, "Operation not permitted", str(f)), ["permission denied on {f}"]),
        (
            lambda f: _safetensors("Error while deserializing header: invalid header length"),
            ["file {f} is corrupt or truncated", "SafetensorError", "write or copy it again"],
        ),
        (lambda f: __import__("json").loads(f.read_text()), ["file {f} is corrupt or truncated", "JSONDecodeError"]),
        (lambda f: _unpickling(), ["file {f} is corrupt or truncated", "UnpicklingError"]),
    ],
)
def test_known_failures_at_the_top_are_one_paragraph_naming_the_file(
    capsys, monkeypatch, tmp_path, command, make, words
):
    """A full disk, a refused permission, a corrupt file: exit status 2 and one paragraph that names the file (found
    in the exception, or in the frame that was reading or writing it) and the fix."""
    import shardflow.cli as cli

    f = tmp_path / "model.safetensors"
    f.write_text("{not json")

    def fails(args):
        path = f  # the file being written or read, as a library's frame holds it  # noqa: F841
        raise make(f)

    monkeypatch.setattr(cli, f"cmd_{command}", fails)
    code = main(COMMANDS[command])
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert err.startswith(f"shardflow {command}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err + out
    for w in words:
        assert w.format(f=f) in err, (w, err)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bug_is_one_paragraph_and_its_traceback_in_a_file(capsys, monkeypatch, tmp_path, command):
    """An exception shardflow does not expect: status 1, one paragraph calling it a bug, naming the file its full
    traceback went to (a temporary file: these commands have no run directory yet) and how to report it."""
    import shardflow.cli as cli

    def fails(args):
        return {}["no such key"]

    monkeypatch.setattr(cli, f"cmd_{command}", fails)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    code = main(COMMANDS[command])
    out, err = capsys.readouterr()
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err + out, err
    assert err.startswith(f"shardflow {command}: error: internal error, a bug in shardflow (KeyError: ")
    assert "report it" in err
    (written,) = tmp_path.glob(f"shardflow-{command}-traceback-*.txt")
    assert f"the full traceback is in {written}" in err
    text = written.read_text()
    assert "Traceback (most recent call last)" in text and "KeyError: 'no such key'" in text and "fails" in text


def test_ctrl_c_still_passes_the_top(monkeypatch):
    import shardflow.cli as cli

    def stopped(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_plan", stopped)
    with pytest.raises(KeyboardInterrupt):
        main(COMMANDS["plan"])
