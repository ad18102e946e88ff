"""Calibration of the α–β cost model: the file ``shardflow calibrate`` writes and the cost model reads.

A calibration holds, per group of ranks (a mesh axis, or :data:`WORLD` when no mesh was given) and per kind of call
the cost model prices (:data:`COST_KINDS`), α (seconds per call) and the bandwidth (bytes one rank sends per second),
fitted by least squares (:func:`fit`) to timings of ``shardflow.runtime.comms.issue`` at a few message sizes; and,
optionally (:class:`ComputeCost`, the file's ``compute`` section, absent from files written before it), what the
ranks' computation reaches with every rank computing at once: matmul FLOP/s per dtype, memory bandwidth, the
per-kernel launch floor, the executor's host seconds per instruction and the slowdown of compute while
communication runs (the machine spec ``this`` of :mod:`shardflow.simulator.machine` reads it).

Where it lives: ``$SHARDFLOW_CALIBRATION_DIR/calibration-<backend>.json``, by default in
``$XDG_CACHE_HOME/shardflow`` (``~/.cache/shardflow``) (:func:`calibration_path`). A file that cannot be read, of
another schema version or of another backend raises :class:`CalibrationError` (naming the file and the fix:
calibrate again, or delete it); one measured on another machine (host name) is ignored with a
:class:`CalibrationWarning`: the defaults apply.
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

SCHEMA = 1  # version of the file's layout; another is refused
ENV_DIR = "SHARDFLOW_CALIBRATION_DIR"  # the directory of the calibration files, overriding the default
WORLD = "world"  # the group key of a calibration taken over every rank (no mesh)
BACKENDS = ("gloo", "nccl")
# The kinds of call the cost model prices: ``p2p`` = one collective-permute step (send and recv at once, the ring's
# step), the others the collectives of the same names.
# A communication kind's is its entry's ``priced_as`` (:class:`~shardflow.parallel.collectives.CommSpec`).
PASSES = ("forward", "backward")  # the passes of an attention whose FLOP/s are measured (ComputeCost.attention_flops)
# The forward FLOPs of the one attention a file of before the measurements by size timed: (8, 8, 128, 64), causal
LEGACY_ATTENTION_FLOPS = 4 * 8 * 8 * 128 * 128 * 64
COST_KINDS = ("p2p", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce")


class CalibrationError(ValueError):
    """A calibration file that cannot be used (unreadable, malformed, another schema or backend); the message names
    the file and the fix."""


class CalibrationWarning(UserWarning):
    """A calibration file measured on another machine: ignored, the defaults apply."""


@dataclass(frozen=True, slots=True)
class KindCost:
    """One kind of call on one group: ``alpha_s`` seconds per call (≥ 0) and ``bandwidth`` bytes/s (> 0) of what one
    rank sends (:func:`~shardflow.parallel.collectives.wire_bytes`)."""

    alpha_s: float
    bandwidth: float

    def seconds(self, nbytes: int) -> float:
        """α + bytes / bandwidth, in seconds."""
        return self.alpha_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class ComputeCost:
    """What one rank's computation reaches while every rank of the calibration computes at once (the contention of
    N processes on one machine is in the figures; the slowest rank's, as for communication).

    ``matmul_flops``: dtype name (``float32``, ``bfloat16``: a :class:`torch.dtype`'s name) → FLOP/s of the fastest
    square matmul measured (2·n³ FLOP per ``n×n @ n×n``), > 0. ``memory_bandwidth``: bytes/s an elementwise add
    moves (two reads and one write), > 0. ``launch_s``: seconds per call of a one-element op (the per-kernel floor),
    ≥ 0. ``instr_overhead_s``: host seconds per program instruction of the executor beyond its kernels' launch
    floors, ≥ 0. ``contention``: compute time while a collective runs ÷ compute time alone (≥ 1 where gloo's
    threads share the cores; 1.0 where not measured), > 0.

    Optional (a file written before them has none; the simulator then prices every size at the figures above):
    ``matmul_by_size``: dtype name → ((FLOP per call, FLOP/s), ...), the rate of each square matmul measured, by
    its FLOPs, ascending. ``bandwidth_by_size``: ((bytes per tensor, bytes/s), ...) of the elementwise add at each
    tensor size measured, ascending. ``attention_flops``: dtype name → ``forward`` and ``backward`` → ((FLOP per
    call, FLOP/s), ...), ascending: a causal attention's forward and backward in that dtype by size (FLOPs as
    :mod:`shardflow.graph.flops` counts the forward, the backward 2.5 times it); a file written before the dtypes
    and sizes were measured apart holds one ``forward`` and one ``backward`` figure, read as float32's at
    :data:`LEGACY_ATTENTION_FLOPS`."""

    matmul_flops: Mapping[str, float]
    memory_bandwidth: float
    launch_s: float
    instr_overhead_s: float
    contention: float = 1.0
    matmul_by_size: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    bandwidth_by_size: tuple[tuple[float, float], ...] = ()
    attention_flops: Mapping[str, Mapping[str, tuple[tuple[float, float], ...]]] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        """The file's ``compute`` section (units as the fields'; the optional ones where measured)."""
        doc: dict[str, Any] = {
            "matmul_flops": dict(self.matmul_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "launch_s": self.launch_s,
            "instr_overhead_s": self.instr_overhead_s,
            "contention": self.contention,
        }
        if self.matmul_by_size:
            doc["matmul_by_size"] = {k: [list(p) for p in v] for k, v in self.matmul_by_size.items()}
        if self.bandwidth_by_size:
            doc["bandwidth_by_size"] = [list(p) for p in self.bandwidth_by_size]
        if self.attention_flops:
            doc["attention_flops"] = {
                name: {p: [list(x) for x in curve] for p, curve in rates.items()}
                for name, rates in self.attention_flops.items()
            }
        return doc

    @classmethod
    def from_doc(cls, doc: object) -> ComputeCost:
        """Parse a file's ``compute`` section. Raises ValueError (the key and what it needs; the caller names the
        file): not an object, a key missing or unknown, a dtype name that is no torch dtype, a number out of
        range."""
        if not isinstance(doc, dict):
            raise ValueError("'compute' is not an object")
        keys = ("matmul_flops", "memory_bandwidth", "launch_s", "instr_overhead_s", "contention")
        optional = ("matmul_by_size", "bandwidth_by_size", "attention_flops")
        if unknown := sorted(set(doc) - set(keys) - set(optional)):
            raise ValueError(f"'compute' has unknown keys {unknown}, expected {list(keys + optional)}")
        if missing := [k for k in keys if k not in doc]:
            raise ValueError(f"'compute' misses {missing}")
        flops = doc["matmul_flops"]
        if not isinstance(flops, dict) or not flops:
            raise ValueError("'compute.matmul_flops' must be an object of dtype name → FLOP/s")
        for name, v in flops.items():
            _dtype_name("compute.matmul_flops", name)
            _number(f"compute.matmul_flops.{name}", v, positive=True)
        by_size = doc.get("matmul_by_size", {})
        if not isinstance(by_size, dict):
            raise ValueError("'compute.matmul_by_size' must be an object of dtype name → [[FLOP, FLOP/s], ...]")
        for name in by_size:
            _dtype_name("compute.matmul_by_size", name)
        attention = doc.get("attention_flops", {})
        if isinstance(attention, dict) and attention and set(attention) <= set(PASSES):  # one float32 figure each
            attention = {"float32": {p: [[LEGACY_ATTENTION_FLOPS, v]] for p, v in attention.items()}}
        need = "'compute.attention_flops' must be an object of dtype name → forward, backward → [[FLOP, FLOP/s], ...]"
        if not isinstance(attention, dict):
            raise ValueError(need)
        for name, rates in attention.items():
            _dtype_name("compute.attention_flops", name)
            if not isinstance(rates, dict) or set(rates) - set(PASSES):
                raise ValueError(need)
        return cls(
            {k: float(v) for k, v in flops.items()},
            _number("compute.memory_bandwidth", doc["memory_bandwidth"], positive=True),
            _number("compute.launch_s", doc["launch_s"]),
            _number("compute.instr_overhead_s", doc["instr_overhead_s"]),
            _number("compute.contention", doc["contention"], positive=True),
            {k: _curve(f"compute.matmul_by_size.{k}", v) for k, v in by_size.items()},
            _curve("compute.bandwidth_by_size", doc.get("bandwidth_by_size", [])),
            {
                name: {p: _curve(f"compute.attention_flops.{name}.{p}", v) for p, v in rates.items()}
                for name, rates in attention.items()
            },
        )


def _dtype_name(key: str, name: str) -> None:
    """Raise ValueError naming ``key`` unless ``name`` is a torch dtype's name."""
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"'{key}': {name!r} is not a torch dtype (e.g. float32, bfloat16)")


def _curve(key: str, v: object) -> tuple[tuple[float, float], ...]:
    """``v`` as ((size, rate), ...): a list of pairs of numbers > 0, sizes ascending. Raises ValueError naming
    ``key``."""
    if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
        raise ValueError(f"'{key}' must be a list of [size, rate] pairs, got {v!r}")
    out = tuple((_number(key, a, positive=True), _number(key, b, positive=True)) for a, b in v)
    if any(a >= b for (a, _), (b, _) in zip(out, out[1:])):
        raise ValueError(f"'{key}': the sizes must ascend, got {[a for a, _ in out]}")
    return out


def _number(key: str, v: object, positive: bool = False) -> float:
    """``v`` as a float: finite, ≥ 0 (> 0 with ``positive``). Raises ValueError naming ``key``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{key!r} must be a finite number {'> 0' if positive else '≥ 0'}, got {v!r}")
    return float(v)


def fit(samples: Sequence[tuple[int, float]]) -> KindCost:
    """Least-squares line seconds = α + bytes / bandwidth through ``samples`` of (bytes sent by one rank, seconds).
    A negative intercept (noise at small sizes) is clamped to 0. Raises ValueError with fewer than two distinct
    sizes, or where the time does not grow with the size (slope ≤ 0: the sizes are too small to see the bandwidth)."""
    xs = [float(b) for b, _ in samples]
    if len(set(xs)) < 2:
        raise ValueError(f"fitting α and bandwidth needs at least two distinct message sizes, got {sorted(set(xs))}")
    n = len(samples)
    mx, my = sum(xs) / n, sum(t for _, t in samples) / n
    slope = sum((x - mx) * (t - my) for x, (_, t) in zip(xs, samples)) / sum((x - mx) ** 2 for x in xs)
    if not slope > 0:
        raise ValueError(
            f"time does not grow with the message size ({', '.join(f'{int(x)} B: {t:.3g} s' for x, (_, t) in zip(xs, samples))}); "
            f"measure larger sizes (--sizes)"
        )
    return KindCost(max(0.0, my - slope * mx), 1.0 / slope)


@dataclass(frozen=True)
class Calibration:
    """What ``shardflow calibrate`` measured: ``groups`` maps a mesh axis (or :data:`WORLD`) to each cost kind's
    :class:`KindCost`; ``backend``, ``world_size`` (ranks that took part), ``machine`` (host name), ``date`` (ISO
    8601), ``torch`` (version). ``compute``: what the ranks' computation reaches (:class:`ComputeCost`), None in a
    file written without it (before it existed). ``path``: the file it was read from ("" when made here)."""

    backend: str
    world_size: int
    machine: str
    date: str
    torch: str
    groups: Mapping[str, Mapping[str, KindCost]]
    path: str = field(default="", compare=False)
    compute: ComputeCost | None = None

    def to_json(self) -> str:
        """The file's text: ``version`` (:data:`SCHEMA`), the fields, ``groups`` → kind → ``alpha_s`` (s) and
        ``bandwidth`` (bytes/s), then ``compute`` (:meth:`ComputeCost.to_doc`) where measured."""
        compute = {} if self.compute is None else {"compute": self.compute.to_doc()}
        return (
            json.dumps(
                {
                    "version": SCHEMA,
                    "backend": self.backend,
                    "world_size": self.world_size,
                    "machine": self.machine,
                    "date": self.date,
                    "torch": self.torch,
                    "groups": {
                        g: {k: {"alpha_s": c.alpha_s, "bandwidth": c.bandwidth} for k, c in kinds.items()}
                        for g, kinds in self.groups.items()
                    },
                    **compute,
                },
                indent=1,
            )
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str, path: str = "") -> Calibration:
        """Parse and validate a file's text. Raises CalibrationError naming ``path`` and the fix."""
        fix = f"run `shardflow calibrate` again to rewrite it, or delete {path}"

        def bad(why: str) -> CalibrationError:
            return CalibrationError(f"calibration file {path}: {why}; {fix}")

        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise bad(f"not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise bad("not a JSON object")
        if doc.get("version") != SCHEMA:
            raise bad(f"version {doc.get('version')!r}, this shardflow reads version {SCHEMA}")
        if doc.get("backend") not in BACKENDS:
            raise bad(f"backend {doc.get('backend')!r}, expected one of {list(BACKENDS)}")
        for key, typ in (("world_size", int), ("machine", str), ("date", str), ("torch", str), ("groups", dict)):
            if not isinstance(doc.get(key), typ):
                raise bad(f"{key!r} missing or not a{'n' * (typ is int)} {typ.__name__}")
        groups: dict[str, dict[str, KindCost]] = {}
        for g, kinds in doc["groups"].items():
            if not isinstance(kinds, dict):
                raise bad(f"group {g!r} is not an object of kinds")
            groups[g] = {}
            for k, c in kinds.items():
                if k not in COST_KINDS:
                    raise bad(f"group {g!r}: unknown kind {k!r}, expected one of {list(COST_KINDS)}")
                a, b = (c.get("alpha_s"), c.get("bandwidth")) if isinstance(c, dict) else (None, None)
                if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)) or a < 0 or b <= 0:
                    raise bad(f"group {g!r}, kind {k!r}: need alpha_s ≥ 0 (s) and bandwidth > 0 (bytes/s), got {c!r}")
                groups[g][k] = KindCost(float(a), float(b))
        try:
            compute = None if "compute" not in doc else ComputeCost.from_doc(doc["compute"])
        except ValueError as e:
            raise bad(str(e)) from None
        return cls(doc["backend"], doc["world_size"], doc["machine"], doc["date"], doc["torch"], groups, path, compute)

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """Read and validate ``path``. Raises CalibrationError (unreadable or invalid, naming the file and the
        fix)."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CalibrationError(
                f"calibration file {path}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                f"run `shardflow calibrate` again, or delete it"
            ) from None
        return cls.from_json(text, str(path))

    def describe(self) -> str:
        """One line: where the numbers come from."""
        return (
            f"calibration {self.path or '(in memory)'} ({self.backend}, {self.world_size} ranks on "
            f"{self.machine}, {self.date})"
        )


def this_machine() -> str:
    """The host name a calibration is recorded for (and checked against)."""
    return platform.node()


def calibration_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$SHARDFLOW_CALIBRATION_DIR``, else ``$XDG_CACHE_HOME/shardflow``, else ``~/.cache/shardflow``."""
    if env.get(ENV_DIR):
        return Path(env[ENV_DIR])
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardflow"


def calibration_path(backend: str, env: Mapping[str, str] = os.environ) -> Path:
    """Where the calibration of ``backend`` is written and read: ``calibration-<backend>.json`` in
    :func:`calibration_dir`."""
    return calibration_dir(env) / f"calibration-{backend}.json"
