"""The model matrix: ``shardflow check`` on the tiny models of tests/zoo.py — 19 families nobody wrote for
shardflow — under dp, fsdp, tp, pp and sp (one process, the local executor, 1 SGD step against eager PyTorch on one
device).

:data:`MATRIX` states the expected outcome of every cell: ``PASS`` (exit 0, every loss, gradient and weight within
the check's tolerance, 1e-9 in float64) or a refusal (exit 2, one paragraph on stderr holding the stated reason, no
traceback). Anything else — a traceback, a wrong number, a refusal where a pass is stated or the reverse — fails the cell.
docs/models.md's matrix is generated from this table (tests/test_docs.py: models_matrix). A family's cells share its
capture (:func:`_capture_once`: the same model, batch and dtype in each); every cell plans, lowers and runs its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from conftest import capture_once

from shardflow import pipeline
from shardflow.cli import main
from shardflow.train import checkpoint

pytest.importorskip("transformers")

ZOO = Path(__file__).parent / "zoo.py"
STRATEGIES = ("dp", "fsdp", "tp", "pp", "sp")
PASS = "pass"
NO_PAIR = "tensor parallelism found no column-parallel/row-parallel pair of linears"

# family → strategy → PASS, or the reason a refusal must name (a substring of its one paragraph)
MATRIX: dict[str, dict[str, str]] = {
    **{
        f: dict.fromkeys(STRATEGIES, PASS)
        for f in (
            "torchtitan_llama3",
            "llama",
            "gpt2",
            "qwen3",
            "gemma2",
            "gemma3",
            "phi3",
            "olmo2",
            "gpt_neox",
            "stablelm",
            "falcon",
            "mixtral",
            "qwen3_moe",
            "deepseek_v3",
            "roberta",
            "t5",
        )
    },
    "mamba": {"dp": PASS, "fsdp": PASS, "tp": NO_PAIR, "pp": PASS, "sp": NO_PAIR},
    "mamba2": {"dp": PASS, "fsdp": PASS, "tp": NO_PAIR, "pp": PASS, "sp": NO_PAIR},
    "vit": dict.fromkeys(STRATEGIES, PASS),  # sp: the 17 tokens (16 patches and CLS) in uneven blocks, 9 and 8
}


def test_the_matrix_covers_every_family_of_the_zoo_under_every_strategy():
    from zoo import FAMILIES

    assert set(MATRIX) == set(FAMILIES) and len(FAMILIES) == 19
    assert all(set(row) == set(STRATEGIES) for row in MATRIX.values())


# (family, parameter dtype) → its captured graph: every cell of a row captures the same model (the factory's seed 0),
# batch and dtype, so capture runs once per family and each cell plans, lowers and runs its strategy on that graph
_CAPTURED: dict[tuple[str, torch.dtype], object] = {}


def _capture_once(monkeypatch, family: str) -> None:
    def key(model, batch):
        return family, next(model.parameters()).dtype

    monkeypatch.setattr(pipeline, "capture", capture_once(_CAPTURED, key))


@pytest.mark.parametrize(
    "family, strategy", [(f, s) for f in MATRIX for s in STRATEGIES], ids=lambda x: x if isinstance(x, str) else None
)
def test_cell(capsys, monkeypatch, family, strategy):
    _capture_once(monkeypatch, family)
    code = main(["check", "--model", f"{ZOO}:{family}", "--strategy", strategy, "--steps", "1"])
    out, err = capsys.readouterr()
    want = MATRIX[family][strategy]
    if want == PASS:
        assert code == 0, out + err
        assert out.rstrip().endswith("over every replica (tolerance 1e-09): OK"), out
    else:
        assert code == 2, out + err
        assert err.startswith("shardflow check: error: ") and want in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err  # one paragraph


@pytest.mark.parametrize(
    "family, strategy", [("deepseek_v3", "tp"), ("mamba2", "pp"), ("falcon", "tp"), ("mixtral", "dp")]
)
def test_shardflow_train_trains_the_families_fixed_for_issue_33(capsys, corpus, tmp_path, family, strategy):
    """``shardflow train --model tests/zoo.py:FAMILY`` (the factory given the tokenizer's vocabulary) on a 2-device
    mesh in this process, 2 steps, with its self-check against one device (``--check``: the run's own tolerance,
    float32) — the families whose gradients or capture issue #33 fixed, each under a strategy that shards it."""
    code = main(
        [
            "train",
            "--model",
            f"{ZOO}:{family}",
            "--data",
            str(corpus),
            "--run-dir",
            str(tmp_path / "run"),
            "--steps",
            "2",
            "--nproc",
            "1",
            "--strategy",
            strategy,
            "--mesh",
            f"{strategy}=2",
            "--seq-len",
            "8",
            "--batch-size",
            "2",
            "--eval-every",
            "2",
            "--eval-batches",
            "1",
            "--check",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "check against one device: " in out and out.rstrip().endswith("OK"), out


@pytest.mark.parametrize("family", list(MATRIX))
def test_plan_proves_or_refuses_as_check_does(capsys, family):
    """``shardflow plan --model tests/zoo.py:FAMILY --strategy tp --nproc 2``: the per-rank programs, proven to agree
    (the listing's last line), where the tp cell of :data:`MATRIX` passes; the same one-paragraph refusal where it
    is refused — never a traceback."""
    code = main(["plan", "--model", f"{ZOO}:{family}", "--strategy", "tp", "--nproc", "2"])
    out, err = capsys.readouterr()
    want = MATRIX[family]["tp"]
    if want == PASS:
        assert code == 0 and out.rstrip().splitlines()[-1].startswith("# verified: 2 ranks"), out + err
    else:
        assert code == 2 and err.startswith("shardflow plan: error: ") and want in err, err


def test_a_factory_model_smaller_than_the_tokenizer_is_refused(capsys, corpus, tmp_path):
    """T5's factory (tests/zoo.py) takes no ``vocab_size``: its embedding has 96 rows, fewer than the corpus's
    tokenizer has tokens. ``shardflow train`` refuses it in one paragraph before any step (it was an IndexError
    traceback at step 1)."""
    code = main(
        [
            "train",
            "--model",
            f"{ZOO}:t5",
            "--data",
            str(corpus),
            "--run-dir",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--nproc",
            "1",
            "--seq-len",
            "8",
            "--batch-size",
            "2",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err, out + err
    assert re.search(
        r"^shardflow train: error: --model \S+zoo.py:t5: its input embedding has 96 rows but the "
        r"tokenizer has \d+ tokens, so a token id would index past it; make the factory take vocab_size",
        err,
    ), err


FROZEN = """
import sys
sys.path.insert(0, {zoo_dir!r})
import zoo


def llama_frozen_embeddings(vocab_size):
    model, batch = zoo.llama(vocab_size)
    model.get_input_embeddings().requires_grad_(False)
    return model, batch
"""


def test_a_frozen_embedding_trains_checkpoints_and_resumes_under_another_strategy(capsys, corpus, tmp_path):
    """``shardflow train --model FACTORY`` whose model freezes its input embedding (requires_grad=False): 2 steps under
    dp with the self-check against one device, a checkpoint without optimizer state for the frozen table, resumed
    under tp for a third step, which leaves the table as it was saved."""
    factory = tmp_path / "frozen.py"
    factory.write_text(FROZEN.format(zoo_dir=str(ZOO.parent)))
    run = tmp_path / "run"
    common = ["--model", f"{factory}:llama_frozen_embeddings", "--data", str(corpus), "--run-dir", str(run)]
    small = ["--seq-len", "8", "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--nproc", "1"]
    first = ["--steps", "2", "--strategy", "dp", "--mesh", "dp=2", "--checkpoint-every", "2", "--check"]
    assert main(["train", *common, *small, *first]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "check against one device: " in out and out.rstrip().endswith("OK"), out
    step2 = run / "checkpoints" / "step_2"
    more = ["--steps", "3", "--strategy", "tp", "--mesh", "tp=2", "--resume", "--allow-changed-settings"]
    assert main(["train", *common, *small, *more]) == 0, capsys.readouterr()
    done = [n for n, _ in checkpoint.complete_steps(run / "checkpoints")]
    assert done[0] == 2 and done[-1] == 3, done
    meta = torch.distributed.checkpoint.FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    table = "model/model.embed_tokens.weight"
    assert table in meta
    assert not any(k.startswith("optim/") and k.endswith(":model.embed_tokens.weight") for k in meta)

    def saved(step: int) -> torch.Tensor:
        out = {table: torch.empty(tuple(meta[table].size))}
        torch.distributed.checkpoint.load(out, checkpoint_id=str(run / "checkpoints" / f"step_{step}"), no_dist=True)
        return out[table]

    assert torch.equal(saved(2), saved(3))
