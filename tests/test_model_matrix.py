"""The model matrix: ``shardflow check`` on the tiny models of tests/zoo.py — 19 families nobody wrote for shardflow —
under dp, fsdp, tp, pp and sp (one process, the local executor, 1 SGD step against eager PyTorch on one device).

:data:`MATRIX` states the expected outcome of every cell: ``PASS`` (exit 0, every loss, gradient and weight within
the check's tolerance, 1e-9 in float64) or a refusal (exit 2, one paragraph on stderr holding the stated reason, no traceback). Anything
else — a traceback, a wrong number, a refusal where a pass is stated or the reverse — fails the cell.
docs/models.md's matrix is generated from this table (tests/test_docs.py: models_matrix).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardflow.cli import main

pytest.importorskip("transformers")

ZOO = Path(__file__).parent / "zoo.py"
STRATEGIES = ("dp", "fsdp", "tp", "pp", "sp")
PASS = "pass"
NO_PAIR = "tensor parallelism found no column-parallel/row-parallel pair of linears"

# family → strategy → PASS, or the reason a refusal must name (a substring of its one paragraph)
MATRIX: dict[str, dict[str, str]] = {
    **{f: dict.fromkeys(STRATEGIES, PASS) for f in (
        "torchtitan_llama3", "llama", "gpt2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "gpt_neox", "stablelm",
        "falcon", "mixtral", "qwen3_moe", "deepseek_v3", "roberta", "t5")},
    "mamba": {"dp": PASS, "fsdp": PASS, "tp": NO_PAIR, "pp": PASS, "sp": NO_PAIR},
    "mamba2": {"dp": PASS, "fsdp": PASS, "tp": NO_PAIR, "pp": PASS, "sp": NO_PAIR},
    "vit": {**dict.fromkeys(("dp", "fsdp", "tp", "pp"), PASS), "sp": "degree 2 does not divide dim 1 of size 17"},
}


def test_the_matrix_covers_every_family_of_the_zoo_under_every_strategy():
    from zoo import FAMILIES
    assert set(MATRIX) == set(FAMILIES) and len(FAMILIES) == 19
    assert all(set(row) == set(STRATEGIES) for row in MATRIX.values())


@pytest.mark.parametrize("family, strategy", [(f, s) for f in MATRIX for s in STRATEGIES],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_cell(capsys, family, strategy):
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
