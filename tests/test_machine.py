"""Machine specs of the step simulator (shardflow.simulator.machine, docs/simulator.md#machine-specs): the shipped
specs hold what their files say, a group's link follows its nodes, communication is α + bytes / bandwidth, compute a
roofline plus the launch floors, bad files are refused naming the key, and ``this`` is built from the calibration
file (or, without one, from the documented defaults with a warning)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
import torch

from shardflow.lower.calibration import (
    COST_KINDS,
    WORLD,
    Calibration,
    ComputeCost,
    KindCost,
    calibration_path,
    this_machine,
)
from shardflow.lower.cost import DEFAULT_ALPHA_S, DEFAULT_BANDWIDTH
from shardflow.simulator import MachineSpec, MachineSpecError, MachineSpecWarning, resolve
from shardflow.simulator.machine import CPU_DEFAULTS, DTYPES, shipped

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "shardflow" / "simulator" / "specs"


@pytest.mark.parametrize("name", ["h100", "a100"])
def test_a_shipped_spec_holds_what_its_file_says(name):
    doc = tomllib.loads((SPECS / f"{name}.toml").read_text())
    spec = MachineSpec.named(name)
    assert spec == MachineSpec.from_toml(SPECS / f"{name}.toml") == resolve(name)
    m, d = doc["machine"], doc["device"]
    assert (spec.name, spec.source, spec.devices_per_node, spec.overlap, spec.instr_overhead_s, spec.contention) == (
        name,
        m["source"],
        8,
        True,
        0.0,
        1.0,
    )
    dev = spec.device
    assert (dev.name, dev.memory_bytes, dev.memory_bandwidth, dev.launch_s, dev.matmul_efficiency) == (
        d["name"],
        d["memory_bytes"],
        d["memory_bandwidth"],
        d["launch_s"],
        d["matmul_efficiency"],
    )
    assert dev.peak_flops == {DTYPES[k]: v for k, v in d["peak_flops"].items()}
    for which in ("intra", "inter"):
        raw, link = doc["links"][which], getattr(spec, which)
        assert link.name == raw["name"] and set(link.kinds) == set(COST_KINDS)
        for kind, cost in link.kinds.items():
            own = raw.get(kind, {})
            assert cost == KindCost(own.get("alpha_s", raw["alpha_s"]), own.get("bandwidth", raw["bandwidth"]))


def test_the_shipped_constants_are_the_sources():
    """The headline numbers of the anchors (docs/simulator.md#shipped-specs)."""
    h100, a100 = MachineSpec.named("h100"), MachineSpec.named("a100")
    assert h100.device.peak_flops[torch.bfloat16] == 989e12 and h100.device.peak_flops[torch.float8_e4m3fn] == 1979e12
    assert h100.device.peak_flops[torch.float32] == 67e12 and h100.device.memory_bandwidth == 2.4e12
    assert h100.intra.kinds["all_gather"].bandwidth == 370e9 and h100.intra.kinds["all_reduce"].bandwidth == 480e9
    assert h100.inter.kinds["all_reduce"].bandwidth == 45e9 and h100.device.memory_bytes == 96 * 2**30
    assert a100.device.peak_flops[torch.bfloat16] == 312e12 and torch.float8_e4m3fn not in a100.device.peak_flops
    assert a100.device.memory_bandwidth == 2.039e12 and a100.inter.kinds["p2p"].bandwidth == 22.5e9
    assert shipped() == ["a100", "h100"]


def test_the_specs_are_package_data():
    """pyproject.toml ships specs/*.toml with the package (MachineSpec.named reads them through importlib)."""
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = doc["tool"]["setuptools"]["package-data"]["shardflow.simulator"]
    assert patterns == ["specs/*.toml"] and {p.name for p in SPECS.glob("*.toml")} == {"h100.toml", "a100.toml"}


def test_a_group_in_one_node_takes_the_intra_link_and_one_across_nodes_the_inter_link():
    spec = MachineSpec.named("h100")
    assert spec.link(range(8)) is spec.intra and spec.link(range(8, 16)) is spec.intra and spec.link([3]) is spec.intra
    assert spec.link((0, 8)) is spec.inter and spec.link(range(16)) is spec.inter and spec.link((7, 8)) is spec.inter
    with pytest.raises(ValueError, match="at least one member"):
        spec.link(())


def test_comm_seconds_is_alpha_plus_bytes_over_bandwidth():
    spec = MachineSpec.named("h100")
    n = 2**30
    assert spec.comm_seconds("all_gather", range(8), n) == pytest.approx(5e-6 + n / 370e9, rel=1e-12)
    assert spec.comm_seconds("all_reduce", range(8), n) == pytest.approx(5e-6 + n / 480e9, rel=1e-12)
    assert spec.comm_seconds("p2p", (0, 8), n) == pytest.approx(15e-6 + n / 45e9, rel=1e-12)
    assert spec.comm_seconds("broadcast", (0, 1), 0) == 5e-6
    with pytest.raises(ValueError, match="no cost kind 'permute'; one of"):
        spec.comm_seconds("permute", (0, 1), n)


def test_compute_seconds_is_a_roofline_plus_the_launch_floors():
    spec = MachineSpec.named("h100")
    flops_s = 989e12 * 0.7
    # compute-bound: a bf16 8192³ matmul (its 3 matrices are 384 MiB: 0.17 ms of memory, 1.6 ms of compute)
    f, b = 2 * 8192**3, 3 * 2 * 8192**2
    assert spec.compute_seconds(f, b, torch.bfloat16) == pytest.approx(f / flops_s + 4e-6, rel=1e-12)
    # memory-bound: an elementwise add of 2^28 bf16 (1 FLOP per element, 6 bytes moved), 3 kernels
    f, b = 2**28, 6 * 2**28
    assert spec.compute_seconds(f, b, torch.bfloat16, kernels=3) == pytest.approx(b / 2.4e12 + 3 * 4e-6, rel=1e-12)
    assert spec.compute_seconds(0, 0, torch.float32, kernels=0) == 0.0
    with pytest.raises(ValueError, match="counts ≥ 0"):
        spec.compute_seconds(-1, 0, torch.float32)


def test_a_device_measured_by_size_prices_each_kernel_at_its_size():
    """``this``'s curves: a matmul at the rate measured for its FLOPs and an elementwise kernel at the bandwidth of
    its largest tensor's size (log-log between the sizes measured, the nearest end's outside them), an attention at
    its own measured rate; without curves the roofline's single figures."""
    from shardflow.simulator.machine import Device, interpolate

    curve = ((1e6, 1e10), (1e8, 1e11))
    assert interpolate(curve, 1e5) == 1e10 and interpolate(curve, 1e9) == 1e11
    assert interpolate(curve, 1e7) == pytest.approx(10**10.5)  # halfway in log size: halfway in log rate
    plain = MachineSpec.named("h100")
    d = Device(
        "cpu",
        {torch.float32: 2e11},
        1.0,
        5e9,
        2**34,
        1e-6,
        matmul_by_size={torch.float32: curve},
        bandwidth_by_size=((2.0**20, 2e10), (2.0**26, 5e9)),
        attention_flops={
            torch.float32: {"forward": ((1e9, 4e10),), "backward": ((1e8, 1e10), (1e9, 2e10))},
            torch.bfloat16: {"forward": ((1e9, 1e11),)},
        },
    )
    spec = dataclasses.replace(plain, device=d)
    assert spec.compute_seconds(10**6, 0, torch.float32) == pytest.approx(1e6 / 1e10 + 1e-6)
    assert spec.compute_seconds(0, 3 * 2**20, torch.float32, largest=2**20) == pytest.approx(3 * 2**20 / 2e10 + 1e-6)
    assert spec.compute_seconds(0, 3 * 2**20, torch.float32) == pytest.approx(3 * 2**20 / 5e9 + 1e-6)  # no size
    assert spec.compute_seconds(10**9, 0, torch.float32, attention="backward") == pytest.approx(1e9 / 2e10 + 1e-6)
    assert spec.compute_seconds(10**9, 0, torch.float32, attention="forward") == pytest.approx(1e9 / 4e10 + 1e-6)
    # a dtype's own measured attention; where it has none (bfloat16's backward here), float32's scaled by the
    # matmul rates (no bfloat16 matmul curve: its rate falls back to float32's, so × 1)
    assert spec.device.attention_rate(torch.bfloat16, False, 1e9) == 1e11
    assert spec.device.attention_rate(torch.float16, False, 1e9) == 1e11  # float16 runs at bfloat16's
    assert spec.device.attention_rate(torch.bfloat16, True, 1e9) == pytest.approx(2e10)
    # by size: log-log between the sizes measured, the nearest end's outside them
    assert spec.device.attention_rate(torch.float32, True, 10**8.5) == pytest.approx((1e10 * 2e10) ** 0.5)
    assert spec.device.attention_rate(torch.float32, True, 1e12) == 2e10
    # the shipped specs have no curves: their roofline is unchanged by the size
    assert plain.compute_seconds(0, 2**20, torch.bfloat16, largest=2**10) == plain.compute_seconds(
        0, 2**20, torch.bfloat16
    )


@pytest.mark.parametrize(
    "name, dtype, runs_at",
    [
        ("h100", torch.float8_e4m3fn, torch.float8_e4m3fn),
        ("a100", torch.float8_e4m3fn, torch.bfloat16),  # no float8 on an A100: 16-bit tensor cores
        ("a100", torch.float8_e5m2, torch.bfloat16),
        ("h100", torch.float16, torch.float16),
        ("h100", torch.int64, torch.float32),
        ("h100", torch.float64, torch.float64),
    ],
)
def test_a_dtype_without_a_peak_falls_back_to_a_documented_one(name, dtype, runs_at):
    spec = MachineSpec.named(name)
    assert spec.device.peak_dtype(dtype) == runs_at
    f = 10**15
    want = f / (spec.device.peak_flops[runs_at] * spec.device.matmul_efficiency) + spec.device.launch_s
    assert spec.compute_seconds(f, 0, dtype) == pytest.approx(want, rel=1e-12)
    bf16_only = dataclasses.replace(spec.device, peak_flops={torch.float32: 1e12, torch.float16: 2e12})
    assert bf16_only.peak_dtype(torch.bfloat16) == torch.float16  # bfloat16 ↔ float16


GOOD = (SPECS / "a100.toml").read_text()


def _edit(pattern: str, repl: str) -> str:
    out, n = re.subn(pattern, repl, GOOD, count=1, flags=re.M)
    assert n == 1, pattern
    return out


@pytest.mark.parametrize(
    "text, key, why",
    [
        (_edit(r"^overlap = true", "overlap = true\nspeed = 3"), "machine.speed", "unknown key"),
        (_edit(r"^memory_bandwidth = .*$", ""), "device.memory_bandwidth", "missing"),
        (_edit(r"^bandwidth = 22.5e9.*$", "bandwidth = -1e9"), "links.inter.bandwidth", "-1000000000.0 is not > 0"),
        (_edit(r"^bandwidth = 240e9.*$", "bandwidth = 0"), "links.intra.bandwidth", "0 is not > 0"),
        (_edit(r"^alpha_s = 15e-6.*$", "alpha_s = -1e-6"), "links.inter.alpha_s", "-1e-06 is negative"),
        (_edit(r"^float16 = .*$", "float17 = 1e12"), "device.peak_flops.float17", "unknown dtype"),
        (_edit(r"^float32 = .*$", ""), "device.peak_flops.float32", "missing"),
        (
            _edit(r"^\[links.intra.all_reduce\]", "[links.intra.all_reduce_fast]"),
            "links.intra.all_reduce_fast",
            "unknown cost kind",
        ),
        (
            _edit(r"^\[links.intra.all_reduce\]", "[links.intra.all_reduce]\nlatency = 1"),
            "links.intra.all_reduce.latency",
            "unknown key",
        ),
        (_edit(r"^matmul_efficiency = .*$", "matmul_efficiency = 1.5"), "device.matmul_efficiency", "above 1"),
        (_edit(r"^memory_bytes = .*$", "memory_bytes = 85.5"), "device.memory_bytes", "is not a whole number"),
        (
            _edit(r"^devices_per_node = .*$", 'devices_per_node = "8"'),
            "machine.devices_per_node",
            "is not a finite number",
        ),
        (_edit(r"^overlap = .*$", "overlap = 1"), "machine.overlap", "is not a boolean"),
        (_edit(r"^\[links.inter\]", "[links.inter]\n[links.outer]"), "links.outer", "unknown key"),
        (_edit(r"^\[machine\]", "[cluster]\n[machine]"), "cluster", "unknown table"),
        (GOOD.replace("[links.inter]", "[linksinter]").split("[linksinter]")[0], "links.inter", "missing"),
        (_edit(r"^alpha_s = 5e-6.*$", ""), "links.intra.p2p.alpha_s", "missing"),
        ("[machine]\nname = 'x'\n[machine]\n", "", "not TOML"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None,
)
def test_a_bad_spec_file_is_refused_naming_the_file_and_the_key(tmp_path, text, key, why):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(MachineSpecError) as e:
        MachineSpec.from_toml(path)
    msg = str(e.value)
    assert msg.startswith(f"machine spec {path}: {key + ': ' if key else ''}") and why in msg, msg
    assert "; " in msg  # the fix follows


def test_unknown_names_list_the_shipped_ones(tmp_path):
    with pytest.raises(MachineSpecError, match="no shipped machine spec 'v100'; the shipped ones are a100, h100"):
        MachineSpec.named("v100")
    with pytest.raises(MachineSpecError, match="machine 'v100': give `this` .*a100, h100.* TOML machine spec"):
        resolve("v100")
    with pytest.raises(MachineSpecError, match=f"machine spec {tmp_path}/none.toml: cannot read it"):
        resolve(str(tmp_path / "none.toml"))
    (tmp_path / "mine.toml").write_text(GOOD.replace('name = "a100"', 'name = "mine"'))
    assert resolve(str(tmp_path / "mine.toml")).name == "mine"


def test_the_documented_example_is_a_valid_spec(tmp_path):
    """The TOML of docs/simulator.md#the-format parses, every kind priced from the link-wide numbers but the
    all-reduce's own bandwidth."""
    doc = (ROOT / "docs" / "simulator.md").read_text()
    (example,) = re.findall(r"```toml\n(.*?)```", doc, re.S)
    path = tmp_path / "example.toml"
    path.write_text(example)
    spec = MachineSpec.from_toml(path)
    assert spec.name == "my-cluster" and spec.intra.kinds["all_reduce"] == KindCost(6e-6, 130e9)
    assert spec.intra.kinds["p2p"] == KindCost(6e-6, 150e9) and spec.inter.kinds["reduce"] == KindCost(20e-6, 20e9)


def test_this_without_a_calibration_takes_the_defaults_and_says_to_calibrate():
    with pytest.warns(MachineSpecWarning, match=r"no calibration of gloo .*run `shardflow calibrate` to measure"):
        spec = resolve("this")
    assert spec.name == "this" and spec.intra is spec.inter and spec.devices_per_node == 2
    assert spec.intra.kinds["all_gather"] == KindCost(DEFAULT_ALPHA_S["gloo"], DEFAULT_BANDWIDTH["gloo"]["all_gather"])
    assert spec.device.peak_flops == {torch.float32: CPU_DEFAULTS.matmul_flops["float32"]}
    assert spec.device.matmul_efficiency == 1.0 and spec.instr_overhead_s == CPU_DEFAULTS.instr_overhead_s
    assert spec.device.peak_dtype(torch.bfloat16) == torch.float32 and spec.link((0, 5)) is spec.intra
    with pytest.warns(MachineSpecWarning, match="compute the a100 spec's device"):
        nccl = MachineSpec.this("nccl", processes=4)
    assert nccl.devices_per_node == 4 and nccl.intra.kinds["p2p"].bandwidth == DEFAULT_BANDWIDTH["nccl"]["p2p"]
    assert nccl.device.peak_flops == MachineSpec.named("a100").device.peak_flops
    with pytest.raises(MachineSpecError, match="backend 'mpi'; give gloo or nccl"):
        MachineSpec.this("mpi")


def test_this_reads_the_calibration_measured_here(tmp_path, recwarn):
    """A calibration written from a real in-process compute measurement: its communication per kind (the world
    group's, the defaults for a kind it lacks) and its compute figures make ``this``, without a warning; a file
    written before the compute section keeps its communication and warns about compute."""
    from shardflow.runtime.calibrate import measure_compute

    env = {"SHARDFLOW_CALIBRATION_DIR": str(tmp_path)}
    compute = measure_compute(torch.device("cpu"))
    groups = {WORLD: {"p2p": KindCost(1e-4, 2e9), "all_reduce": KindCost(3e-4, 1.5e9)}}
    cal = Calibration(
        "gloo", 3, this_machine(), "2026-01-01T00:00:00+00:00", torch.__version__, groups, compute=compute
    )
    calibration_path("gloo", env).write_text(cal.to_json())
    spec = MachineSpec.this("gloo", env=env)
    assert not [w for w in recwarn if issubclass(w.category, MachineSpecWarning)]
    assert spec.devices_per_node == 3 and spec.source.startswith(f"calibration {tmp_path}/calibration-gloo.json")
    assert spec.intra.kinds["p2p"] == KindCost(1e-4, 2e9) and spec.intra.kinds["all_reduce"] == KindCost(3e-4, 1.5e9)
    assert spec.intra.kinds["reduce"] == KindCost(DEFAULT_ALPHA_S["gloo"], DEFAULT_BANDWIDTH["gloo"]["reduce"])
    d = spec.device
    assert d.peak_flops == {
        torch.float32: compute.matmul_flops["float32"],
        torch.bfloat16: compute.matmul_flops["bfloat16"],
    }
    assert (d.memory_bandwidth, d.launch_s, d.matmul_efficiency) == (compute.memory_bandwidth, compute.launch_s, 1.0)
    assert (spec.instr_overhead_s, spec.contention) == (compute.instr_overhead_s, compute.contention)
    assert d.bandwidth_by_size == compute.bandwidth_by_size
    assert d.attention_flops == {getattr(torch, k): v for k, v in compute.attention_flops.items()}
    assert d.matmul_by_size == {getattr(torch, k): v for k, v in compute.matmul_by_size.items()}
    # the figures predict the measured matmul: n = 512 float32 in about the seconds it took (within noise)
    assert spec.compute_seconds(2 * 512**3, 3 * 4 * 512**2, torch.float32) > 0
    calibration_path("gloo", env).write_text(dataclasses.replace(cal, compute=None).to_json())
    with pytest.warns(MachineSpecWarning, match="a calibration without its compute section"):
        old = MachineSpec.this("gloo", processes=2, env=env)
    assert old.intra.kinds["p2p"] == KindCost(1e-4, 2e9) and old.device.peak_flops[torch.float32] == 1.5e11


def test_this_keeps_a_float32_peak_when_the_calibration_lacks_one(tmp_path):
    """A hand-edited compute section without float32 still gives ``this`` a float32 peak (the CPU default's), so
    every dtype has one to fall back to."""
    env = {"SHARDFLOW_CALIBRATION_DIR": str(tmp_path)}
    compute = ComputeCost({"bfloat16": 1e12}, 1e9, 1e-6, 1e-5)
    cal = Calibration("gloo", 2, this_machine(), "2026-01-01T00:00:00+00:00", torch.__version__, {}, compute=compute)
    calibration_path("gloo", env).write_text(cal.to_json())
    spec = MachineSpec.this("gloo", env=env)
    assert spec.device.peak_flops == {torch.float32: CPU_DEFAULTS.matmul_flops["float32"], torch.bfloat16: 1e12}
