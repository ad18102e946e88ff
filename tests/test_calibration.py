"""Calibration of the cost model: the least-squares fit, the file (round trip, validation, where it is read), that
"auto" follows it, and one real ``shardflow calibrate --nproc 2`` run."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import patience
from test_lower import _sp_step

from shardflow.lower.calibration import (
    COST_KINDS,
    LEGACY_ATTENTION_FLOPS,
    WORLD,
    Calibration,
    CalibrationError,
    CalibrationWarning,
    ComputeCost,
    KindCost,
    calibration_path,
    fit,
    this_machine,
)
from shardflow.lower.cost import DEFAULT_BANDWIDTH, CostModel, LowerOptions
from shardflow.simulator.machine import MachineSpec

ROOT = Path(__file__).resolve().parent.parent


def _cal(groups, machine=None, backend="gloo") -> Calibration:
    return Calibration(backend, 2, machine or this_machine(), "2026-01-01T00:00:00+00:00", "2.13", groups)


def test_fit_recovers_alpha_and_bandwidth_exactly_from_synthetic_timings():
    alpha, bw = 3e-4, 1.5e9
    got = fit([(n, alpha + n / bw) for n in (2**16, 2**18, 2**20, 2**22)])
    assert got.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert got.bandwidth == pytest.approx(bw, rel=1e-9)


def test_fit_refuses_one_size_and_times_that_do_not_grow():
    with pytest.raises(ValueError, match="at least two distinct message sizes"):
        fit([(1024, 1e-3), (1024, 2e-3)])
    with pytest.raises(ValueError, match="does not grow with the message size"):
        fit([(1024, 2e-3), (2048, 1e-3)])


def test_the_file_round_trips_and_names_itself_and_the_fix_when_bad(tmp_path):
    cal = _cal({WORLD: {"p2p": KindCost(1e-4, 2e9)}, "tp": {"all_gather": KindCost(0.0, 5e8)}})
    path = tmp_path / "c.json"
    path.write_text(cal.to_json())
    back = Calibration.load(path)
    assert back == cal and back.path == str(path)
    doc = json.loads(cal.to_json())
    for change, why in [
        ({"version": 0}, "version 0"),
        ({"backend": "mpi"}, "backend 'mpi'"),
        ({"world_size": "2"}, "'world_size' missing"),
        ({"groups": {WORLD: {"ring": {"alpha_s": 0, "bandwidth": 1}}}}, "unknown kind 'ring'"),
        ({"groups": {WORLD: {"p2p": {"alpha_s": 0, "bandwidth": 0}}}}, "bandwidth > 0"),
    ]:
        path.write_text(json.dumps({**doc, **change}))
        with pytest.raises(CalibrationError, match=f"calibration file {path}: .*{why}.*shardflow calibrate"):
            Calibration.load(path)
    path.write_text("{")
    with pytest.raises(CalibrationError, match="not JSON"):
        Calibration.load(path)


COMPUTE = ComputeCost({"float32": 2e11, "bfloat16": 1.5e12}, 8e9, 9e-7, 5e-6, 1.02)


def test_the_compute_section_round_trips_and_is_optional(tmp_path):
    """A calibration with its compute section reads back equal; a file without one (written before it existed,
    schema 1 all the same) reads with compute None."""
    cal = dataclasses.replace(_cal({WORLD: {"p2p": KindCost(1e-4, 2e9)}}), compute=COMPUTE)
    path = tmp_path / "c.json"
    path.write_text(cal.to_json())
    back = Calibration.load(path)
    assert back == cal and back.compute == COMPUTE
    assert json.loads(cal.to_json())["compute"]["matmul_flops"] == {"float32": 2e11, "bfloat16": 1.5e12}
    old = json.loads(cal.to_json())
    del old["compute"]
    path.write_text(json.dumps(old))
    assert Calibration.load(path).compute is None and "compute" not in _cal(cal.groups).to_json()


@pytest.mark.parametrize(
    "change, why",
    [
        ({"contention": 0}, "'compute.contention' must be a finite number > 0, got 0"),
        ({"launch_s": -1e-6}, "'compute.launch_s' must be a finite number ≥ 0"),
        ({"memory_bandwidth": "fast"}, "'compute.memory_bandwidth' must be a finite number > 0"),
        ({"matmul_flops": {"float33": 1e9}}, "'compute.matmul_flops': 'float33' is not a torch dtype"),
        ({"matmul_flops": {}}, "'compute.matmul_flops' must be an object"),
        ({"speed": 1}, "'compute' has unknown keys \\['speed'\\]"),
        ({"launch_s": None}, "'compute' misses \\['launch_s'\\]"),  # None: the key removed
    ],
)
def test_a_bad_compute_section_names_its_key_and_the_fix(tmp_path, change, why):
    doc = json.loads(dataclasses.replace(_cal({}), compute=COMPUTE).to_json())
    doc["compute"].update(change)
    doc["compute"] = {k: v for k, v in doc["compute"].items() if v is not None}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=f"calibration file {path}: {why}.*shardflow calibrate"):
        Calibration.load(path)


def test_measure_compute_in_one_process_gives_positive_figures():
    """The compute measurement alone (no process group: the identity for the slowest rank, no contention): every
    figure in range, float32 and bfloat16 measured, a launch floor well under the tiny step's per-instruction time."""
    from shardflow.runtime.calibrate import BANDWIDTH_SIZES, MATMUL_DTYPES, measure_compute

    got = measure_compute(torch.device("cpu"))
    assert set(got.matmul_flops) == {str(d).removeprefix("torch.") for d in MATMUL_DTYPES}
    assert all(v > 1e8 for v in got.matmul_flops.values()) and got.memory_bandwidth > 1e8
    assert 0 < got.launch_s < 1e-3 and 0 <= got.instr_overhead_s < 1e-2 and got.contention == 1.0
    assert ComputeCost.from_doc(got.to_doc()) == got
    # by size: every matmul size tried (the best is matmul_flops), every tensor size of the add, the attention
    assert set(got.matmul_by_size) == set(got.matmul_flops)
    for name, curve in got.matmul_by_size.items():
        assert curve[0][0] == 2 * 128**3 and max(r for _, r in curve) == got.matmul_flops[name]
    assert [b for b, _ in got.bandwidth_by_size] == [float(b) for b in BANDWIDTH_SIZES]
    # (a unit slip is 1000× off: 1e7 B/s leaves room for a busy machine, where one size measured under 1e8)
    assert all(r > 1e7 for _, r in got.bandwidth_by_size) and set(got.attention_flops) == set(got.matmul_flops)
    for rates in got.attention_flops.values():  # by sequence length from 128: each step 16× the FLOPs
        assert set(rates) == {"forward", "backward"} and len(rates["forward"]) == len(rates["backward"]) >= 1
        assert rates["forward"][0][0] == 4 * 8 * 8 * 128 * 128 * 64
        assert all(r > 1e7 for c in rates.values() for _, r in c)
        assert [2.5 * f for f, _ in rates["forward"]] == [f for f, _ in rates["backward"]]


def test_the_measurements_by_size_are_optional_and_checked(tmp_path):
    """The compute section's curves round-trip, a section without them (written before them) reads with none, and
    a curve that is no list of [size, rate] pairs, or whose sizes do not ascend, is refused naming its key."""
    full = dataclasses.replace(
        COMPUTE,
        matmul_by_size={"float32": ((4e6, 1e11), (3.4e7, 2e11))},
        bandwidth_by_size=((2.0**20, 2e10), (2.0**26, 5e9)),
        attention_flops={
            "float32": {"forward": ((2.7e8, 5e10), (4.3e9, 8e10)), "backward": ((6.7e8, 4e10),)},
            "bfloat16": {"forward": ((2.7e8, 2e11),)},
        },
    )
    assert ComputeCost.from_doc(json.loads(json.dumps(full.to_doc()))) == full
    # a file written before the dtypes and sizes were measured apart: one float32 figure per pass, at its size
    legacy = {**full.to_doc(), "attention_flops": {"forward": 5e10, "backward": 4e10}}
    assert ComputeCost.from_doc(legacy).attention_flops == {
        "float32": {"forward": ((LEGACY_ATTENTION_FLOPS, 5e10),), "backward": ((LEGACY_ATTENTION_FLOPS, 4e10),)}
    }
    assert set(COMPUTE.to_doc()) == {"matmul_flops", "memory_bandwidth", "launch_s", "instr_overhead_s", "contention"}
    for key, bad, why in [
        ("bandwidth_by_size", [[2**26, 5e9], [2**20, 2e10]], "'compute.bandwidth_by_size': the sizes must ascend"),
        ("bandwidth_by_size", [2**20, 2e10], "'compute.bandwidth_by_size' must be a list of \\[size, rate\\] pairs"),
        ("matmul_by_size", {"float33": []}, "'compute.matmul_by_size': 'float33' is not a torch dtype"),
        ("attention_flops", {"sideways": 1e9}, "'compute.attention_flops': 'sideways' is not a torch dtype"),
        ("attention_flops", {"float32": {"sideways": 1e9}}, "'compute.attention_flops' must be an object of dtype"),
        ("attention_flops", {"float32": {"forward": [[1e9, -1]]}}, "'compute.attention_flops.float32.forward' must"),
        ("attention_flops", {"float32": {"forward": 1e9}}, "'compute.attention_flops.float32.forward' must be a list"),
    ]:
        doc = full.to_doc()
        doc[key] = bad
        with pytest.raises(ValueError, match=why):
            ComputeCost.from_doc(doc)


def test_the_cost_model_reads_the_file_of_its_backend_per_axis_and_falls_back(tmp_path):
    env = {"SHARDFLOW_CALIBRATION_DIR": str(tmp_path)}
    assert CostModel.for_backend("gloo", env).describe() == "gloo defaults (no calibration)"
    cal = _cal({WORLD: {"p2p": KindCost(1e-4, 2e9)}, "tp": {"p2p": KindCost(2e-4, 4e9)}})
    calibration_path("gloo", env).write_text(cal.to_json())
    cost = CostModel.for_backend("gloo", env)
    assert cost.calibration == cal and cost.describe().startswith(f"calibration {tmp_path}/calibration-gloo.json")
    assert (cost.bw("p2p", "tp"), cost.alpha("p2p", "tp")) == (4e9, 2e-4)  # the axis's own
    assert (cost.bw("p2p", "dp"), cost.alpha("p2p", "dp")) == (2e9, 1e-4)  # another axis: the world's
    assert cost.bw("all_gather", "tp") == DEFAULT_BANDWIDTH["gloo"]["all_gather"]  # not measured: the default
    assert CostModel("gloo", bandwidth={"p2p": 1.0}, calibration=cal).bw("p2p", "tp") == 1.0  # an override wins
    calibration_path("gloo", env).write_text(_cal(cal.groups, machine="elsewhere").to_json())
    with pytest.warns(CalibrationWarning, match="measured on elsewhere"):
        assert CostModel.for_backend("gloo", env).calibration is None
    calibration_path("gloo", env).write_text(_cal(cal.groups, backend="nccl").to_json())
    with pytest.raises(CalibrationError, match="measured on nccl, read for gloo"):
        CostModel.for_backend("gloo", env)


def _kinds(step):
    prog = step.programs[0]
    return {p: Counter(c.kind for c in prog.comms if c.task == p) for p in ("FWD", "BWD")}


@pytest.mark.parametrize("slow", ["ring", "collective"])
def test_auto_follows_the_calibration(slow):
    """tp=4 sequence-parallel linear: its forward all-gather and backward reduce-scatter along tp. A calibration whose
    ring steps (p2p) are 1000× slower than the collectives makes "auto" pick the collectives, and the other way
    round the rings (3 permute steps each)."""
    fast, crawl = KindCost(1e-5, 1e10), KindCost(1e-2, 1e6)
    ring, coll = (crawl, fast) if slow == "ring" else (fast, crawl)
    cal = _cal({"tp": {"p2p": ring, "all_gather": coll, "reduce_scatter": coll, "broadcast": crawl}})
    got = _kinds(_sp_step(LowerOptions(cost=CostModel("gloo", calibration=cal))))
    if slow == "ring":
        assert got["FWD"] == {"all_gather": 1} and got["BWD"]["reduce_scatter"] == 1 and not got["BWD"]["permute"]
    else:
        assert got["FWD"] == {"permute": 3} and got["BWD"]["permute"] == 3 and not got["BWD"]["reduce_scatter"]


def _cli(*argv, env=None):
    return subprocess.run(
        [sys.executable, "-m", "shardflow.cli", "calibrate", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=patience(120),
        env=env,
    )


def test_calibrate_nproc_2_writes_a_file_the_cost_model_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFLOW_CALIBRATION_DIR", str(tmp_path))
    res = _cli("--nproc", "2", "--sizes", "64K,1M", "--reps", "3")
    assert res.returncode == 0, res.stderr + res.stdout
    path = calibration_path("gloo")
    assert f"wrote {path}" in res.stdout and "group    kind" in res.stdout
    cal = Calibration.load(path)
    assert (cal.backend, cal.world_size, cal.machine, list(cal.groups)) == ("gloo", 2, this_machine(), [WORLD])
    fitted = set(cal.groups[WORLD])
    # A kind drowned in a busy machine's noise is left out, and said to be: with the suite's other worker beside it
    # on 2 cores, 3 of the 7 kinds were fitted in one CI-like run (4 or more alone), so only "some" is certain here.
    assert fitted <= set(COST_KINDS) and fitted
    for kind in set(COST_KINDS) - fitted:
        assert f"{kind} not fitted" in res.stdout
    assert CostModel.for_backend("gloo").calibration == cal
    assert cal.compute is not None and set(cal.compute.matmul_flops) == {"float32", "bfloat16"}
    assert "compute measured on 2 ranks at once in" in res.stdout and "compute: matmul GFLOP/s float32" in res.stdout


def test_calibrate_nproc_1_times_the_computation_alone(tmp_path, monkeypatch):
    """One process (one GPU, say): no communication to time, so the file has no groups (the cost model keeps its
    defaults) and the compute section of one device, which ``this`` then builds its device from."""
    monkeypatch.setenv("SHARDFLOW_CALIBRATION_DIR", str(tmp_path))
    res = _cli("--nproc", "1")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "no communication timed (1 process): the cost model keeps its gloo defaults" in res.stdout
    cal = Calibration.load(calibration_path("gloo"))
    assert (cal.world_size, dict(cal.groups)) == (1, {}) and cal.compute is not None
    assert set(cal.compute.attention_flops) == {"float32", "bfloat16"} and cal.compute.contention == 1.0
    assert CostModel.for_backend("gloo").bw("all_reduce") == DEFAULT_BANDWIDTH["gloo"]["all_reduce"]
    spec = MachineSpec.this("gloo", processes=1)
    assert spec.device.attention_flops[torch.bfloat16] == cal.compute.attention_flops["bfloat16"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "0"], "--nproc 0 is out of range: give a value ≥ 1"),
        (["--mesh", "dp=2,tp=2"], "mesh dp=2,tp=2 has 4 devices but --nproc 2 starts 2 processes"),
        (["--sizes", "1M"], "--sizes 1M: fitting α and the bandwidth needs at least two distinct sizes"),
        (["--sizes", "64K,lots"], "--sizes 64K,lots: cannot read 'lots' as a message size"),
        (["--reps", "0"], "--reps"),
        (["--out", "/nonexistent/dir/c.json"], "--out /nonexistent/dir/c.json: /nonexistent/dir does not exist"),
    ],
)
def test_calibrate_refuses_bad_inputs_before_any_process_starts(argv, message, capsys):
    from shardflow.cli import main

    assert main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardflow calibrate: error: ") and message in err and "rank" not in err.split(":")[2]
