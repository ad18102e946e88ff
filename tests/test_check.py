"""``shardflow check``: a model named by ``--model`` trained under a strategy beside eager PyTorch; exit status 0
within the tolerance, 1 beyond it, 2 on bad input (before any process starts). ``shardflow plan --model`` takes the
same specs. Tolerance: the command's own (1e-9 at float64, 1e-4 at float32; see ``shardflow.cli.CHECK_TOL``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import shardflow.api
from shardflow.cli import main

pytest.importorskip("transformers")

ROOT = Path(__file__).parents[1]
LLAMA = f"{ROOT / 'examples' / 'hf_llama.py'}:tiny_llama"
VERDICT = re.compile(
    r"max \|Δloss\| (\S+), \|Δgrad\| (\S+), \|Δweight\| (\S+) over every replica "
    r"\(tolerance (\S+)\): (OK|FAILED)"
)


def check(capsys, *argv):
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def verdict(out: str) -> tuple[list[float], float, str]:
    *worst, tol, word = VERDICT.search(out).groups()
    return [float(x) for x in worst], float(tol), word


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", LLAMA, "--strategy", "tp"],
        ["--model", LLAMA, "--mesh", "dp=2,tp=2"],
        ["--model", "gpt", "--layers", "1", "--embd", "32", "--seq-len", "8", "--batch-size", "4", "--strategy", "dp"],
    ],
    ids=["llama-tp", "llama-dp,tp", "gpt-dp"],
)
def test_check_passes(capsys, argv):
    code, out, err = check(capsys, *argv, "--steps", "2")
    lines = out.splitlines()
    assert code == 0, out + err
    assert re.fullmatch(r"shardflow check: (LlamaForCausalLM|GPT), [\d,]+ parameters, float64; batch .*", lines[0])
    assert lines[1].startswith("converted to float64: ") and lines[1].endswith(
        "float32 → float64; casts down and dtype= arguments inside the model stay float64"
    )
    assert [line.split(":")[0] for line in lines[4:6]] == ["step 1", "step 2"]
    worst, tol, word = verdict(out)
    assert word == "OK" and tol == 1e-9 and max(worst) <= 1e-9


def test_check_shows_the_plan_it_runs(capsys):
    code, out, _ = check(capsys, "--model", LLAMA, "--strategy", "sp", "--steps", "1", "--dtype", "float32")
    assert code == 0
    assert out.splitlines()[1] == "converted to float32: nothing"
    assert out.splitlines()[2].startswith("strategy sp: mesh tp=2 (2 devices);")
    assert "combine ×" in out.splitlines()[2]  # sequence parallelism gathers the sequence before each block
    worst, tol, _ = verdict(out)
    assert tol == 1e-4 and max(worst) <= 1e-4


def test_beyond_the_tolerance_exits_1(capsys, monkeypatch):
    """float32 under dp: the gradients of the two batch halves are summed apart, so they differ from one device's
    by rounding — beyond --tol 0. And eager PyTorch stepping with twice the learning rate: far beyond 1e-9."""
    code, out, _ = check(
        capsys, "--model", LLAMA, "--strategy", "dp", "--steps", "1", "--dtype", "float32", "--tol", "0"
    )
    worst, tol, word = verdict(out)
    assert code == 1 and word == "FAILED" and tol == 0 and worst[1] > 0
    monkeypatch.setattr(shardflow.api, "torch_optimizer", lambda cfg, params: torch.optim.SGD(params, lr=2 * cfg.lr))
    code, out, _ = check(capsys, "--model", "mlp", "--layers", "2", "--strategy", "dp", "--steps", "2")
    worst, _, word = verdict(out)
    assert code == 1 and word == "FAILED" and worst[2] > 1e-3
    assert re.search(
        r"\|Δloss\| \S+, \|Δgrad\| \S+, within the tolerance: capture computes what eager does, so "
        r"the sharded run \(or its update\) is what differs$",
        out.rstrip(),
    ), out


BAD_FACTORIES = """
from torch import nn


def linear_only():
    return nn.Linear(2, 2)
"""


@pytest.mark.parametrize(
    "spec, words",
    [
        ("missing.py:make", ["--model missing.py:make: no file missing.py"]),
        ("{dir}/bad.py:nothing", ["has no 'nothing'; its functions: linear_only"]),
        ("{dir}/bad.py:linear_only", ["linear_only() must return (module, batch)", "it returned Linear"]),
        ("no_such_pkg.models:make", ["no module named 'no_such_pkg.models'"]),
        ("{dir}/bad.py", ["write FILE.py:FACTORY or package.module:FACTORY"]),
    ],
)
def test_a_bad_spec_exits_2_before_any_process(capsys, monkeypatch, tmp_path, spec, words):
    (tmp_path / "bad.py").write_text(BAD_FACTORIES)
    from shardflow.runtime import launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process was started"))
    code, out, err = check(capsys, "--model", spec.format(dir=tmp_path), "--nproc", "2")
    assert code == 2 and not out and err.startswith("shardflow check: error: --model ") and err.count("\n") == 1
    for w in words:
        assert w in err


def test_processes_that_do_not_fit_the_mesh_exit_2(capsys, monkeypatch):
    from shardflow.runtime import launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process was started"))
    code, out, err = check(capsys, "--model", "mlp", "--mesh", "dp=2,tp=2", "--nproc", "2")
    assert (
        code == 2
        and not out
        and err
        == (
            "shardflow check: error: mesh dp=2,tp=2 has 4 devices but --nproc 2 "
            "starts 2 processes; make --nproc 4, or change --mesh\n"
        )
    )


def test_a_model_with_dropout_exits_2(capsys, tmp_path):
    """Eager PyTorch draws other dropout masks than shardflow: no comparison is possible, and the error says so."""
    path = tmp_path / "drop.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc = nn.Linear(4, 4)\n        self.drop = nn.Dropout(0.1)\n"
        "\n    def forward(self, x):\n        return self.drop(self.fc(x)).sum()\n\n\n"
        "def make():\n    return M(), {'x': torch.randn(4, 4)}\n"
    )
    code, out, err = check(capsys, "--model", f"{path}:make", "--strategy", "dp")
    assert code == 2 and not out and err.count("\n") == 1
    assert "draws random numbers (dropout) in 'drop'" in err and "set the dropout probabilities to 0" in err


def test_a_user_plan(capsys, tmp_path):
    """--plan: Megatron on the Llama's MLPs only, written as a TOML plan; the attention stays replicated."""
    plan = tmp_path / "mlp_plan.toml"
    plan.write_text(
        '[modules."model.layers.*.mlp.gate_proj".params]\nweight = {tp = "Shard(0)"}\n'
        '[modules."model.layers.*.mlp.up_proj".params]\nweight = {tp = "Shard(0)"}\n'
        '[modules."model.layers.*.mlp.down_proj"]\nparams = {weight = {tp = "Shard(1)"}}\n'
        'output = {tp = "Replicate()"}\n'
    )
    code, out, _ = check(capsys, "--model", LLAMA, "--plan", str(plan), "--mesh", "tp=2", "--steps", "2")
    assert code == 0 and out.splitlines()[2].startswith("strategy user: mesh tp=2 (2 devices)")
    assert verdict(out)[2] == "OK"


@pytest.mark.parametrize("strategy", ["tp", "dp"])
def test_two_gloo_processes(capsys, strategy):
    """--nproc 2: the plan is proven here, then 2 processes run it with the distributed executor, each with the
    eager model beside it; rank 0 prints, every replica is compared (the maximum all-reduced)."""
    code, out, err = check(
        capsys, "--model", LLAMA, "--strategy", strategy, "--nproc", "2", "--steps", "2", "--timeout", "60"
    )
    assert code == 0, out + err
    assert out.splitlines()[2].startswith(f"strategy {strategy}: mesh {strategy}=2 (2 devices)")
    worst, tol, word = verdict(out)
    assert word == "OK" and max(worst) <= tol == 1e-9


def test_ranks_that_build_other_weights_are_refused(capsys, tmp_path):
    """A factory seeded by rank builds other weights on each process: every rank refuses to train (exit 2, named
    by the parent with the end of the log of the rank it saw exit first) instead of comparing pieces of different
    models."""
    path = tmp_path / "per_rank.py"
    path.write_text(
        "import os\nimport torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n        return self.fc(x).square().mean()\n\n\n"
        "def make():\n    torch.manual_seed(int(os.environ.get('RANK', '0')))\n"
        "    return M(), {'x': torch.ones(2, 4)}\n"
    )
    code, out, err = check(capsys, "--model", f"{path}:make", "--strategy", "dp", "--nproc", "2", "--timeout", "60")
    assert code == 2 and re.search(r"rank ([01]) exited with status 2 \(others: rank (?!\1)[01]: 2\)", err), err
    assert "ranks [1] built other initial weights than rank 0" in err


def test_plan_takes_a_factory(capsys):
    code = main(["plan", "--model", LLAMA, "--strategy", "tp", "--rank", "0"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("# strategy tp: mesh tp=2 (2 devices);")
    for line in (
        "weight   model.layers.1.self_attn.q_proj.weight: float32[64/2, 64] (S(0))",
        "weight   model.layers.1.self_attn.o_proj.weight: float32[64, 64/2] (S(1))",
        "weight   model.layers.1.mlp.down_proj.weight: float32[64, 128/2] (S(1))",
    ):
        assert line in out
    assert out.rstrip().splitlines()[-1].startswith("# verified: 2 ranks")


ZOO = ROOT / "tests" / "zoo.py"


@pytest.mark.parametrize(
    "dtype, tol, strategy", [("float64", 1e-9, "tp")] + [("float32", 1e-5, s) for s in ("dp", "fsdp", "tp", "pp", "sp")]
)
def test_torchtitans_llama3_checks_with_its_complex_rotary_table_kept(capsys, dtype, tol, strategy):
    """torchtitan's Llama 3 (tests/zoo.py): its rotary table ``freqs_cis`` is a complex64 buffer; in float64 it
    becomes complex128 (``model.to(float64)`` would have dropped its imaginary part: another model on both sides)
    and the check says so; every gradient agrees, through the complex rotation — in float32 within 1e-5 under every
    preset (float64 under every preset: tests/test_model_matrix.py)."""
    code, out, err = check(
        capsys,
        "--model",
        f"{ZOO}:torchtitan_llama3",
        "--strategy",
        strategy,
        "--steps",
        "2",
        "--dtype",
        dtype,
        "--tol",
        str(tol),
    )
    assert code == 0, out + err
    assert ("freqs_cis: imaginary parts kept" in out.splitlines()[1]) == (dtype == "float64")
    worst, _, word = verdict(out)
    assert word == "OK" and max(worst) <= tol


NO_FLOAT64 = '''
import torch
from torch import nn


class Float32Only(nn.Module):
    """A kernel without float64 (as torch._grouped_mm, Mixtral's experts in eager mode, had none), in small."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        if x.dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        return nn.functional.cross_entropy(self.fc(x), y)


def float32_only():
    torch.manual_seed(0)
    return Float32Only(), {"x": torch.randn(4, 4), "y": torch.tensor([0, 1, 2, 0])}
'''


EXPORT_DIFFERS = '''
import torch
from torch import nn


class Doubled(nn.Module):
    """A model that computes another loss when torch.export traces it than when it runs eagerly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        loss = nn.functional.cross_entropy(self.fc(x), y)
        return loss * 2 if torch.compiler.is_exporting() else loss


def doubled():
    torch.manual_seed(0)
    return Doubled(), {"x": torch.randn(4, 4), "y": torch.tensor([0, 1, 2, 0])}
'''


def test_a_failed_check_says_whether_capture_or_the_sharded_run_differs(capsys, tmp_path):
    """A model whose captured graph is not what eager PyTorch runs: the check fails, and its last line says the
    captured graph on one device already differs from eager (the reference interpreter against eager at the first
    step's weights), so the plan is not to blame. (The other side: test_beyond_the_tolerance_exits_1.)"""
    (tmp_path / "doubled.py").write_text(EXPORT_DIFFERS)
    code, out, err = check(capsys, "--model", f"{tmp_path / 'doubled.py'}:doubled", "--strategy", "dp", "--steps", "1")
    assert code == 1 and verdict(out)[2] == "FAILED", out + err
    assert re.search(
        r"at the first step's weights: \|Δloss\| [1-9]\S+, \|Δgrad\| \S+, beyond the tolerance: the "
        r"model as captured differs from eager PyTorch",
        out.splitlines()[-1],
    ), out


def test_a_model_without_float64_kernels_is_checked_in_its_own_dtype_and_says_so(capsys, tmp_path):
    """A model with a kernel that has no float64: the eager float64 forward fails, so the check runs the model as
    built (float32, tolerance 1e-4) and names the reason, instead of failing after planning."""
    (tmp_path / "no_float64.py").write_text(NO_FLOAT64)
    code, out, err = check(
        capsys, "--model", f"{tmp_path / 'no_float64.py'}:float32_only", "--strategy", "dp", "--steps", "1"
    )
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("shardflow check: Float32Only, 15 parameters, float32; batch ")
    assert lines[1] == (
        "float64: the eager model fails in float64 (Expected mat_a to be Float32, BFloat16 or Float16 "
        "matrix, got Double): a kernel of it has no float64; checking in the model's own float32 "
        "instead (tolerance 0.0001)"
    )
    worst, tol, word = verdict(out)
    assert word == "OK" and tol == 1e-4


def test_an_explicit_float32_softmax_is_widened_on_both_sides(capsys):
    """Gemma 2's attention computes ``softmax(..., dtype=torch.float32)``: widened in the eager reference as in the
    capture, the float64 check holds to 1e-9 (it failed by 8e-10 when only the eager side rounded)."""
    code, out, err = check(capsys, "--model", f"{ZOO}:gemma2", "--strategy", "dp", "--steps", "2")
    assert code == 0, out + err
    worst, tol, word = verdict(out)
    assert word == "OK" and max(worst) <= 1e-12
