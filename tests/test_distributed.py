"""Real processes on gloo: each strategy equals the single-device run; a rank that dies or plans differently
makes every rank exit non-zero within the communication timeout. Processes start once per launch (each torch
import costs seconds), and every wait has a timeout."""

import json
import sys
from pathlib import Path

from shardflow.runtime.launch import describe_failure, launch

WORKER = str(Path(__file__).with_name("dist_worker.py"))

# float64: partial sums are added in another order than on one device → agreement to rounding; 1e-10 catches
# any real error (O(1)). float32: 1e-4. bfloat16 (8 mantissa bits, ~4e-3 relative per rounding, compounded over
# 3 steps of a 2-layer model): 5e-2 — still far below the O(1) error of a wrong plan.
TOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 5e-2}


def run(tmp_path, nproc, cases, grace_s=30.0):
    res = launch(
        [sys.executable, WORKER, str(tmp_path), *cases], nproc, tmp_path / "logs", grace_s=grace_s, echo_rank0=False
    )
    results = [
        json.loads((tmp_path / f"result{r}.json").read_text()) if (tmp_path / f"result{r}.json").exists() else None
        for r in range(nproc)
    ]
    return res, results


def check(res, results, tmp_path):
    assert res.ok, describe_failure(res, tmp_path / "logs")
    for r, per_rank in enumerate(results):
        for case, diffs in per_rank.items():
            tol = TOL[case.split("@")[2]] if "@" in case else TOL["float64"]
            assert all(v <= tol for v in diffs.values()), (r, case, diffs)


def test_two_processes(tmp_path):
    cases = [
        "dp@dp=2@float64",
        "tp@tp=2@float64",
        "sp@tp=2@float64",
        "pp@pp=2@float64",
        "cp@cp=2@float64",
        "cp:all_to_all@cp=2@float64",
        "cp:ring@cp=2@float64",
        "cp:ring:balanced@cp=2@float64",
        "tp@tp=2@float32",
        "sp@tp=2@float64@ring@ring",
        "sp@tp=2@float64@broadcast_loop@collective",
        "tp@tp=2@bfloat16",
        "explicit",
        "memory",
        "dropout",
        "checkpoint",
        "devices",
        "comms",
        "dtensor",
    ]
    check(*run(tmp_path, 2, cases), tmp_path)
    for r in range(2):  # sp's all-gathers use torch's current API: no deprecation warning in any rank's log
        assert "deprecated" not in (tmp_path / "logs" / f"rank{r}.log").read_text()


def test_four_processes(tmp_path):
    cases = [
        "dp,tp@dp=2,tp=2@float64",
        "dp,sp@dp=2,tp=2@float64",
        "tp@tp=4@float64",
        "pp,tp@pp=2,tp=2@float64",
        "dp,cp@dp=2,cp=2@float64",
        "cp:ring@cp=4@float64",
        "dp,cp:all_gather:balanced@dp=2,cp=2@float64",
        "cp:ring:balanced@cp=4@float64",
        "sp@tp=4@float64@ring@ring",
        "dp,sp@dp=2,tp=2@float64@broadcast_loop@ring",
        "outside_view",
        "groups",
        "checkpoint",
        "uneven",
        "comms",
        "stream_waits",
        "dtensor",
    ]
    check(*run(tmp_path, 4, cases), tmp_path)


def test_different_plans_are_refused_at_start(tmp_path):
    res, results = run(tmp_path, 2, ["mismatch"])
    assert not res.ok and all(r is None for r in results)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "PlanMismatchError" in log and "rank 1" in log


def test_a_killed_rank_takes_everyone_down_within_the_timeout(tmp_path):
    res, results = run(tmp_path, 2, ["die"], grace_s=20.0)
    assert res.failed is not None and all(c != 0 for c in res.returncodes)
    assert res.returncodes[1] == -9  # SIGKILL
    # the survivor ended its own wait (its 5 s communication timeout, or the closed connection) and exited with an
    # error, before the launcher's grace of 20 s ran out (which would have killed it: a negative status)
    assert res.returncodes[0] > 0, res.returncodes
    assert all(r is None for r in results)
    assert "rank 1 was killed by signal 9" in describe_failure(res, tmp_path / "logs")


def test_debug_mode_names_diverging_tokens(tmp_path):
    res, results = run(tmp_path, 2, ["diverge"], grace_s=20.0)
    assert not res.ok and all(r is None for r in results)
    logs = "".join((tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2))
    assert "CommDivergence" in logs and "is at token 0" in logs and "is at token 1" in logs
