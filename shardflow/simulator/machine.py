"""Machine specs: what a step simulator charges for each instruction of a per-rank program (docs/simulator.md).

A :class:`MachineSpec` is a device (:class:`Device`: per-dtype matmul peaks, memory bandwidth and capacity, the
per-kernel launch floor), how many devices share a node, and two links (:class:`Link`): the one of a group whose
members all sit in one node and the one of a group that spans nodes, each pricing every kind of call of the cost
model (:data:`~shardflow.lower.calibration.COST_KINDS`) as α + bytes / bandwidth — the α–β model of
:mod:`shardflow.lower.cost`, the bytes being what one rank sends
(:func:`~shardflow.parallel.collectives.wire_bytes`, a "bus bandwidth" in NCCL's terms).

Specs are data: TOML files (:meth:`MachineSpec.from_toml`; the format is docs/simulator.md#machine-specs). Shipped
ones (``h100``, ``a100``: :meth:`MachineSpec.named`) live in ``specs/`` beside this module and cite the source of
every constant; ``this`` (:meth:`MachineSpec.this`) is measured on this machine by ``shardflow calibrate``
(:mod:`shardflow.lower.calibration`). :func:`resolve` takes any of the three, as a ``--machine`` flag does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import torch

from shardflow.lower.calibration import BACKENDS, COST_KINDS, ComputeCost, KindCost, calibration_path
from shardflow.lower.cost import CostModel

V = TypeVar("V")

# The dtypes a spec may give a peak for, by the names a TOML file uses (torch's).
DTYPES: Mapping[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
# A dtype without a peak of its own takes the first of these that has one, else float32 (which every spec gives):
# float16 and bfloat16 run at the same tensor-core rate on the GPUs shipped here; a float8 GEMM on a device without
# float8 runs in 16 bits. Any other dtype (float64, integers) takes float32's.
FALLBACK: Mapping[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float16: (torch.bfloat16,),
    torch.bfloat16: (torch.float16,),
    torch.float8_e4m3fn: (torch.float8_e5m2, torch.bfloat16, torch.float16),
    torch.float8_e5m2: (torch.float8_e4m3fn, torch.bfloat16, torch.float16),
}
SPECS_DIR = "specs"  # the shipped specs' folder in this package: <name>.toml
THIS = "this"  # the name of the spec measured on this machine

# `this` without a calibration file (or one written before its compute section): the figures of the machines the
# gloo defaults of shardflow.lower.cost were measured on (2 gloo ranks sharing 2 Intel Xeon cores, one thread each,
# `shardflow calibrate`, 2026), rounded down. bfloat16 is left out (it falls back to float32): these Xeons multiply
# bfloat16 7× faster than float32 (AMX), most CPUs several times slower.
CPU_DEFAULTS = ComputeCost(
    matmul_flops={"float32": 1.5e11},  # measured 1.8–2.1e11 FLOP/s at n = 1024
    memory_bandwidth=5e9,  # measured 4.6–10.6 GB/s (64 MiB float32 add, both ranks at once)
    launch_s=1e-6,  # measured 0.86–0.89 µs per one-element add
    instr_overhead_s=1e-5,  # measured 4.5–15.6 µs per instruction of the tiny step
    contention=1.0,  # measured 1.00–1.02
)


class MachineSpecError(ValueError):
    """A machine spec that cannot be used: a TOML file that cannot be read or is not valid (the message names the
    file, the key and the fix), or a name that is no shipped spec (the message lists them)."""


class MachineSpecWarning(UserWarning):
    """``this`` built without (part of) a calibration: the documented defaults apply; the message says to run
    ``shardflow calibrate``."""


@dataclass(frozen=True)
class Link:
    """One kind of interconnect: ``name`` (``nvlink4``, ``infiniband-400g``, ``gloo-loopback``) and, for every cost
    kind of :data:`~shardflow.lower.calibration.COST_KINDS`, its :class:`~shardflow.lower.calibration.KindCost`:
    α in seconds per call and the bandwidth in bytes/s of what one rank sends, as
    :func:`~shardflow.parallel.collectives.wire_bytes` counts it (NCCL's "bus bandwidth")."""

    name: str
    kinds: Mapping[str, KindCost]

    def seconds(self, kind: str, nbytes: int) -> float:
        """Seconds of one call of cost kind ``kind`` in which one rank sends ``nbytes``: α + bytes / bandwidth.
        Raises ValueError for a kind not in COST_KINDS."""
        cost = self.kinds.get(kind)
        if cost is None:
            raise ValueError(f"link {self.name!r}: no cost kind {kind!r}; one of {list(COST_KINDS)}")
        return cost.seconds(nbytes)


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU process's share of a CPU).

    ``peak_flops``: dense matmul FLOP/s per dtype (always float32; a dtype without its own peak falls back as
    :meth:`peak_dtype` says). ``matmul_efficiency``: the fraction of the peak large matmuls reach, in (0, 1].
    ``memory_bandwidth``: bytes/s of memory-bound (elementwise) kernels. ``memory_bytes``: the device memory's
    capacity, bytes. ``launch_s``: the per-kernel floor, seconds.

    Measured by ``shardflow calibrate`` (``this``; a TOML spec has none): ``matmul_by_size``: per dtype,
    ((FLOP per call, FLOP/s), ...) ascending, the rates square matmuls reached by size (:meth:`matmul_rate`);
    ``bandwidth_by_size``: ((bytes per tensor, bytes/s), ...) ascending, an elementwise add's by tensor size
    (:meth:`bandwidth`); ``attention_flops``: per dtype, ``forward`` and ``backward`` → ((FLOP per call, FLOP/s),
    ...) ascending, the rates a causal attention reached by size (:meth:`attention_rate`)."""

    name: str
    peak_flops: Mapping[torch.dtype, float]
    matmul_efficiency: float
    memory_bandwidth: float
    memory_bytes: int
    launch_s: float
    matmul_by_size: Mapping[torch.dtype, tuple[tuple[float, float], ...]] = dataclasses.field(default_factory=dict)
    bandwidth_by_size: tuple[tuple[float, float], ...] = ()
    attention_flops: Mapping[torch.dtype, Mapping[str, tuple[tuple[float, float], ...]]] = dataclasses.field(
        default_factory=dict
    )

    def peak_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype whose peak a matmul in ``dtype`` runs at: its own where the spec gives one, else the first of
        :data:`FALLBACK` [``dtype``] the spec gives (float16 ↔ bfloat16; float8 → the other float8, bfloat16,
        float16), else float32."""
        return next((d for d in (dtype, *FALLBACK.get(dtype, ())) if d in self.peak_flops), torch.float32)

    def matmul_flops(self, dtype: torch.dtype) -> float:
        """FLOP/s a large matmul in ``dtype`` reaches: the peak of :meth:`peak_dtype` × ``matmul_efficiency``."""
        return self.peak_flops[self.peak_dtype(dtype)] * self.matmul_efficiency

    def matmul_rate(self, dtype: torch.dtype, flops: float) -> float:
        """FLOP/s a matmul of ``flops`` FLOP in ``dtype`` reaches: the ``matmul_by_size`` rate of
        :meth:`peak_dtype` at that size (log-log interpolation between the sizes measured, the nearest end's
        outside them), else :meth:`matmul_flops`."""
        curve = self.matmul_by_size.get(self.peak_dtype(dtype))
        return interpolate(curve, flops) if curve else self.matmul_flops(dtype)

    def bandwidth(self, largest: float | None = None) -> float:
        """Bytes/s of an elementwise kernel whose largest tensor holds ``largest`` bytes: the ``bandwidth_by_size``
        rate at that size (interpolated as :meth:`matmul_rate`), else (or without a size) ``memory_bandwidth``."""
        if largest is None or not self.bandwidth_by_size:
            return self.memory_bandwidth
        return interpolate(self.bandwidth_by_size, largest)

    def attention_rate(self, dtype: torch.dtype, backward: bool, flops: float) -> float:
        """FLOP/s of an attention's forward (or ``backward``) of ``flops`` FLOP in ``dtype``: the ``attention_flops``
        curve measured in that dtype, else in the first of :data:`FALLBACK` [``dtype``] measured (float16 ↔
        bfloat16), at ``flops`` (interpolated as :meth:`matmul_rate`); where only float32's was, that scaled by how
        much faster the dtype's matmuls run than float32's; without any, the matmul's (:meth:`matmul_rate`)."""
        which = "backward" if backward else "forward"
        kin = next((d for d in (dtype, *FALLBACK.get(dtype, ())) if d in self.attention_flops), None)
        own = self.attention_flops[kin].get(which) if kin is not None else None
        if own:
            return interpolate(own, flops)
        curve = self.attention_flops.get(torch.float32, {}).get(which)
        if not curve:
            return self.matmul_rate(dtype, flops)
        return interpolate(curve, flops) * self.matmul_rate(dtype, flops) / self.matmul_rate(torch.float32, flops)


@dataclass(frozen=True)
class MachineSpec:
    """A machine a step is simulated on.

    ``name``; ``source``: where the constants come from (datasheets, papers, a calibration file). ``device``: every
    rank's (:class:`Device`). ``devices_per_node``: ranks per node, rank r in node r // devices_per_node.
    ``intra``: the link of a group whose members all sit in one node; ``inter``: of a group spanning nodes.
    ``overlap``: whether communication overlaps compute (separate streams, or gloo's threads).
    ``instr_overhead_s``: host seconds per program instruction (the executor's Python), 0 for an idealised GPU
    spec. ``contention``: the multiplier on compute time while communication runs at the same time (measured on a
    CPU machine for ``this``; 1.0 elsewhere). ``backend``: the torch.distributed backend its collectives run on
    (``nccl``, or ``gloo``: the cost model's defaults for what a spec leaves out)."""

    name: str
    source: str
    device: Device
    devices_per_node: int
    intra: Link
    inter: Link
    overlap: bool
    instr_overhead_s: float
    contention: float = 1.0
    backend: str = "nccl"

    def peak(self, dtype: torch.dtype) -> float:
        """One device's dense matmul peak (FLOP/s) in ``dtype`` (:meth:`Device.peak_dtype`): MFU's denominator."""
        return self.device.peak_flops[self.device.peak_dtype(dtype)]

    def link(self, members: Sequence[int]) -> Link:
        """The link of a group of global ranks ``members``: :attr:`intra` when they all sit in one node
        (rank // devices_per_node), else :attr:`inter`. Raises ValueError for no members."""
        if not members:
            raise ValueError("a communication group needs at least one member")
        return self.intra if len({m // self.devices_per_node for m in members}) == 1 else self.inter

    def comm_seconds(self, kind: str, members: Sequence[int], nbytes: int) -> float:
        """Seconds of one call of cost kind ``kind`` (:data:`~shardflow.lower.calibration.COST_KINDS`; a
        communication kind's is its ``priced_as``) among ``members`` in which one rank sends ``nbytes``
        (:func:`~shardflow.parallel.collectives.wire_bytes`): α + bytes / bandwidth of :meth:`link`. Raises
        ValueError for an unknown kind or no members."""
        return self.link(members).seconds(kind, nbytes)

    def compute_seconds(
        self,
        flops: int,
        nbytes: int,
        dtype: torch.dtype,
        kernels: int = 1,
        largest: int | None = None,
        attention: str | None = None,
    ) -> float:
        """Seconds of computing ``flops`` FLOP that move ``nbytes`` bytes of memory in ``dtype`` as ``kernels``
        kernels — the roofline: max(flops / (peak × matmul_efficiency), nbytes / memory_bandwidth) +
        kernels × launch_s. The peak is the dtype's, else the one :meth:`Device.peak_dtype` falls back to
        (float16 ↔ bfloat16, float8 → bfloat16, anything else → float32). On a device measured by size (``this``)
        the matmul rate is :meth:`Device.matmul_rate` at the FLOPs of one kernel, the bandwidth
        :meth:`Device.bandwidth` at ``largest`` (the bytes of the kernel's largest tensor), and ``attention``
        (``forward`` or ``backward``: an attention's) takes :meth:`Device.attention_rate`. Raises ValueError for a
        negative count."""
        if flops < 0 or nbytes < 0 or kernels < 0:
            raise ValueError(f"compute_seconds needs counts ≥ 0, got flops={flops}, nbytes={nbytes}, kernels={kernels}")
        d = self.device
        per = flops / max(kernels, 1)
        if attention is not None:
            rate = d.attention_rate(dtype, attention == "backward", per)
        else:
            rate = d.matmul_rate(dtype, per)
        return max(flops / rate, nbytes / d.bandwidth(largest)) + kernels * d.launch_s

    # --- reading specs ------------------------------------------------------------------------------------------

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> MachineSpec:
        """The spec of the TOML file ``path`` (docs/simulator.md#machine-specs). Raises MachineSpecError naming
        the file, the key and the fix: the file cannot be read or is not TOML, a key unknown or missing, a number
        not a number or out of range (a bandwidth, peak or capacity ≤ 0, a time < 0, an efficiency outside
        (0, 1]), a cost kind not in COST_KINDS, a dtype that is none of :data:`DTYPES`."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MachineSpecError(
                f"machine spec {path}: cannot read it ({getattr(e, 'strerror', None) or e}); pass the path of a "
                f"TOML machine spec, `this`, or a shipped name ({', '.join(shipped())})"
            ) from None
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise MachineSpecError(f"machine spec {path}: not TOML ({e}); fix the syntax at that line") from None
        return _Reader(str(path)).spec(doc)

    @classmethod
    def named(cls, name: str) -> MachineSpec:
        """The shipped spec ``name`` (``specs/<name>.toml`` of this package: :func:`shipped`). Raises
        MachineSpecError listing the shipped names."""
        if name not in shipped():
            raise MachineSpecError(
                f"no shipped machine spec {name!r}; the shipped ones are {', '.join(shipped())} (or `this`, or the "
                f"path of a TOML file: docs/simulator.md#machine-specs)"
            )
        resource = resources.files(__package__).joinpath(SPECS_DIR, f"{name}.toml")
        with resources.as_file(resource) as path:
            return cls.from_toml(path)

    @classmethod
    def this(
        cls, backend: str = "gloo", processes: int | None = None, env: Mapping[str, str] = os.environ
    ) -> MachineSpec:
        """This machine as ``shardflow calibrate`` measured it, running ``processes`` ranks (default: as many as
        the calibration ran, else 2) in one node over ``backend``.

        Communication: the calibration file of ``backend``
        (:func:`~shardflow.lower.calibration.calibration_path`, read by
        :meth:`~shardflow.lower.cost.CostModel.for_backend`), every cost kind's α and bandwidth of the ``world``
        group, the cost model's defaults for a kind it did not fit; one link, ``intra`` and ``inter`` alike.
        Compute: the file's ``compute`` section (:class:`~shardflow.lower.calibration.ComputeCost`: measured rates,
        so ``matmul_efficiency`` is 1.0), the contention and the host overhead per instruction with it. Without a
        file (or one written before the compute section) the defaults apply — the cost model's for communication;
        for compute :data:`CPU_DEFAULTS` on gloo, the shipped ``a100``'s device on NCCL (with CPU_DEFAULTS' host
        seconds per instruction: the executor's Python is the same) — with a
        :class:`MachineSpecWarning` saying to run ``shardflow calibrate``. The figures hold for the number of ranks
        calibrated at once (their contention is in them). ``memory_bytes``: the GPU's memory on NCCL where CUDA is
        present, else this host's memory ÷ ``processes``.

        Raises CalibrationError for a file that cannot be used (naming it and the fix), MachineSpecError for a
        backend other than gloo and nccl or ``processes`` < 1; a file of another host is ignored with a
        CalibrationWarning."""
        if backend not in ("gloo", "nccl"):
            raise MachineSpecError(f"machine spec `this`: backend {backend!r}; give gloo or nccl")
        cost = CostModel.for_backend(backend, env)
        cal = cost.calibration
        n = processes if processes is not None else (cal.world_size if cal else 2)
        if n < 1:
            raise MachineSpecError(f"machine spec `this`: processes={n}; give 1 or more")
        path = calibration_path(backend, env)
        compute = cal.compute if cal else None
        if compute is None:
            what = "no calibration" if cal is None else "a calibration without its compute section (an older one)"
            defaults = "the CPU defaults" if backend == "gloo" else "the a100 spec's device"
            comm = "its figures" if cal else f"the cost model's {backend} defaults"
            warnings.warn(
                f"machine spec `this`: {what} of {backend} on this machine ({path}); communication takes "
                f"{comm}, compute {defaults} "
                f"(docs/simulator.md#this); run `shardflow calibrate{' --backend nccl' * (backend == 'nccl')}` to "
                f"measure them",
                MachineSpecWarning,
                stacklevel=2,
            )
        link = Link(
            "gloo-loopback" if backend == "gloo" else "nccl-local",
            {k: KindCost(cost.alpha(k), cost.bw(k)) for k in COST_KINDS},
        )
        if compute is None and backend == "nccl":
            device = dataclasses.replace(cls.named("a100").device, name="this (nccl): the a100 spec's device")
            instr_s, contention = CPU_DEFAULTS.instr_overhead_s, 1.0
        else:
            c = compute or CPU_DEFAULTS
            flops = {**CPU_DEFAULTS.matmul_flops, **c.matmul_flops}  # float32 always there
            device = Device(
                f"this ({backend}, {n} ranks)",
                _by_dtype(flops),
                1.0,
                c.memory_bandwidth,
                _host_memory() // n,
                c.launch_s,
                _by_dtype(c.matmul_by_size),
                c.bandwidth_by_size,
                _by_dtype(c.attention_flops),
            )
            instr_s, contention = c.instr_overhead_s, c.contention
        if backend == "nccl" and torch.cuda.is_available():
            device = dataclasses.replace(device, memory_bytes=torch.cuda.get_device_properties(0).total_memory)
        source = (cal.describe() if cal else f"{backend} defaults of shardflow.lower.cost (no calibration)") + (
            "" if compute else "; compute: documented defaults (docs/simulator.md#this)"
        )
        return cls(THIS, source, device, n, link, link, True, instr_s, contention, backend)


def _by_dtype(by_name: Mapping[str, V]) -> dict[torch.dtype, V]:
    """``by_name`` (a calibration's, keyed by dtype names: ``float32``, ``bfloat16``) keyed by the dtypes."""
    return {DTYPES.get(k) or getattr(torch, k): v for k, v in by_name.items()}


def interpolate(curve: Sequence[tuple[float, float]], x: float) -> float:
    """The rate of ``curve`` ((size, rate), ... sizes ascending, > 0) at size ``x``: log-log linear between the two
    sizes around it, the first's or the last's rate outside them."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return y0 * (y1 / y0) ** t
    return curve[-1][1]


def _host_memory() -> int:
    """This host's physical memory, bytes (16 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def shipped() -> list[str]:
    """The names of the shipped specs (``specs/*.toml`` of this package), sorted."""
    folder = resources.files(__package__).joinpath(SPECS_DIR)
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def resolve(machine: str, backend: str = "gloo", processes: int | None = None) -> MachineSpec:
    """What a ``--machine`` flag accepts: ``this`` (:meth:`MachineSpec.this` with ``backend`` and ``processes``),
    a shipped name (:meth:`MachineSpec.named`) or the path of a TOML file (:meth:`MachineSpec.from_toml`). Raises
    MachineSpecError for anything else (listing the choices) and what those raise."""
    if machine == THIS:
        return MachineSpec.this(backend, processes)
    if machine in shipped():
        return MachineSpec.named(machine)
    if machine.endswith(".toml") or os.sep in machine or Path(machine).is_file():
        return MachineSpec.from_toml(machine)
    raise MachineSpecError(
        f"machine {machine!r}: give `this` (measured here), a shipped spec ({', '.join(shipped())}) or the path of "
        f"a TOML machine spec (docs/simulator.md#machine-specs)"
    )


# --- the TOML reader -------------------------------------------------------------------------------------------

MACHINE_KEYS = {"name": str, "source": str, "devices_per_node": int, "overlap": bool, "instr_overhead_s": float}
OPTIONAL_MACHINE_KEYS = {"contention": float, "backend": str}
DEVICE_KEYS = {
    "name": str,
    "memory_bytes": int,
    "memory_bandwidth": float,
    "launch_s": float,
    "matmul_efficiency": float,
    "peak_flops": dict,
}
LINK_KEYS = ("name", "alpha_s", "bandwidth")  # plus one table per cost kind
KIND_KEYS = ("alpha_s", "bandwidth")
LINKS = ("intra", "inter")
# keys whose number must be > 0 (the others ≥ 0)
POSITIVE = {"devices_per_node", "contention", "memory_bytes", "memory_bandwidth", "matmul_efficiency", "bandwidth"}


class _Reader:
    """Reads one TOML document into a :class:`MachineSpec`, every error naming ``path`` and the key."""

    def __init__(self, path: str):
        self.path = path

    def bad(self, key: str, why: str, fix: str) -> MachineSpecError:
        return MachineSpecError(f"machine spec {self.path}: {key}: {why}; {fix} (docs/simulator.md#machine-specs)")

    def table(self, doc: Mapping[str, Any], key: str, where: str = "") -> Mapping[str, Any]:
        """``doc[key]``, the table ``where.key``. Raises MachineSpecError where it is missing or not a table."""
        full = f"{where}.{key}" if where else key
        if key not in doc:
            raise self.bad(full, "missing", f"add a [{full}] table")
        if not isinstance(doc[key], dict):
            raise self.bad(full, f"is a {type(doc[key]).__name__}, not a table", f"write it as [{full}]")
        return doc[key]

    def keys(self, where: str, table: Mapping[str, Any], allowed: Sequence[str], required: Sequence[str]) -> None:
        for k in table:
            if k not in allowed:
                raise self.bad(f"{where}.{k}", "unknown key", f"remove it; [{where}] takes {', '.join(allowed)}")
        for k in required:
            if k not in table:
                raise self.bad(f"{where}.{k}", "missing", f"add {k} to [{where}]")

    def value(self, key: str, v: Any, typ: type) -> Any:
        """``v`` checked against ``typ``: a string, a bool, an integer ≥ 1 (devices, bytes) or a finite number
        (> 0 for :data:`POSITIVE` keys, else ≥ 0; an efficiency at most 1)."""
        name = key.rsplit(".", 1)[-1]
        if typ is str:
            if not isinstance(v, str) or not v:
                raise self.bad(key, f"{v!r} is not a non-empty string", 'give a quoted string, e.g. name = "h100"')
            return v
        if typ is bool:
            if not isinstance(v, bool):
                raise self.bad(key, f"{v!r} is not a boolean", "give true or false")
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.bad(key, f"{v!r} is not a finite number", "give a number such as 2.4e12")
        if typ is int:
            if v != int(v):
                raise self.bad(key, f"{v!r} is not a whole number", "give an integer")
            v = int(v)
        positive = name in POSITIVE
        if v < 0 or (positive and v == 0):
            raise self.bad(
                key,
                f"{v!r} is {'not > 0' if positive else 'negative'}",
                f"give a number {'> 0' if positive else '≥ 0'}",
            )
        if name == "matmul_efficiency" and v > 1:
            raise self.bad(key, f"{v!r} is above 1", "give the fraction of the peak large matmuls reach, in (0, 1]")
        return v if typ is int else float(v)

    def spec(self, doc: Mapping[str, Any]) -> MachineSpec:
        for k in doc:
            if k not in ("machine", "device", "links"):
                raise self.bad(k, "unknown table", "remove it; a machine spec has [machine], [device] and [links.*]")
        m = self.table(doc, "machine")
        self.keys("machine", m, [*MACHINE_KEYS, *OPTIONAL_MACHINE_KEYS], list(MACHINE_KEYS))
        machine = {
            k: self.value(f"machine.{k}", m[k], t)
            for k, t in {**MACHINE_KEYS, **OPTIONAL_MACHINE_KEYS}.items()
            if k in m
        }
        d = self.table(doc, "device")
        self.keys("device", d, list(DEVICE_KEYS), list(DEVICE_KEYS))
        device = {k: self.value(f"device.{k}", d[k], t) for k, t in DEVICE_KEYS.items() if t is not dict}
        peaks = self.table(d, "peak_flops", "device")
        flops: dict[torch.dtype, float] = {}
        for name, v in peaks.items():
            if name not in DTYPES:
                raise self.bad(
                    f"device.peak_flops.{name}", "unknown dtype", f"use the names {', '.join(DTYPES)} (torch's)"
                )
            flops[DTYPES[name]] = self.value(f"device.peak_flops.{name}", v, float)
            if flops[DTYPES[name]] == 0:
                raise self.bad(f"device.peak_flops.{name}", "0 is not > 0", "give the dense matmul FLOP/s, > 0")
        if torch.float32 not in flops:
            raise self.bad("device.peak_flops.float32", "missing", "add float32 = its FLOP/s (every spec gives it)")
        links = self.table(doc, "links")
        self.keys("links", links, LINKS, LINKS)
        return MachineSpec(
            machine["name"],
            machine["source"],
            Device(
                device["name"],
                flops,
                device["matmul_efficiency"],
                device["memory_bandwidth"],
                device["memory_bytes"],
                device["launch_s"],
            ),
            machine["devices_per_node"],
            self.link(links, "intra"),
            self.link(links, "inter"),
            machine["overlap"],
            machine["instr_overhead_s"],
            machine.get("contention", 1.0),
            self.backend(machine.get("backend", "nccl")),
        )

    def backend(self, name: str) -> str:
        if name not in BACKENDS:
            raise self.bad("machine.backend", f"{name!r} is no backend", f"give one of {', '.join(BACKENDS)}")
        return name

    def link(self, links: Mapping[str, Any], which: str) -> Link:
        """``[links.<which>]``: ``name``, optional link-wide ``alpha_s`` and ``bandwidth``, and a table per cost
        kind overriding either; every kind must end with both."""
        where = f"links.{which}"
        t = self.table(links, which, "links")
        for k in t:
            if k not in LINK_KEYS and k not in COST_KINDS:
                raise self.bad(
                    f"{where}.{k}",
                    "unknown cost kind" if isinstance(t[k], dict) else "unknown key",
                    f"a link takes {', '.join(LINK_KEYS)} and a table per cost kind of {', '.join(COST_KINDS)}",
                )
        if "name" not in t:
            raise self.bad(f"{where}.name", "missing", f'add name = "..." to [{where}]')
        name = self.value(f"{where}.name", t["name"], str)
        base = {k: self.value(f"{where}.{k}", t[k], float) for k in KIND_KEYS if k in t}
        kinds = {}
        for kind in COST_KINDS:
            own = t.get(kind, {})
            if not isinstance(own, dict):
                raise self.bad(f"{where}.{kind}", "is not a table", f"write it as [{where}.{kind}]")
            self.keys(f"{where}.{kind}", own, KIND_KEYS, ())
            got = {**base, **{k: self.value(f"{where}.{kind}.{k}", v, float) for k, v in own.items()}}
            for k in KIND_KEYS:
                if k not in got:
                    raise self.bad(
                        f"{where}.{kind}.{k}",
                        "missing",
                        f"give {k} in [{where}.{kind}], or one for every kind in [{where}]",
                    )
            kinds[kind] = KindCost(got["alpha_s"], got["bandwidth"])
        return Link(name, kinds)
