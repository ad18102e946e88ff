"""α–β cost model of communication, used by lowering to choose how an all-gather or reduce-scatter runs.

time = α per call + bytes this rank sends / bandwidth of that kind of call (a "bus bandwidth": bytes per
rank per second). Defaults per backend; ``shardflow calibrate`` measures them on the machine, per mesh axis
(:mod:`shardflow.lower.calibration`; :meth:`CostModel.for_backend` reads its file); every number can be overridden.

gloo defaults are what these machines measured (docs/benchmarks.md#the-cost-models-gloo-defaults): gloo's
reduce-scatter is its slowest collective (it moves an all-reduce's bytes), so on gloo the ring reduce-scatter wins,
and the ring all-gather wins where its d−1 calls' latency is small against the bytes (always on 2 ranks, one call
either way). NCCL defaults are order-of-magnitude figures for one node (NVLink-class), where the built-in
collectives are the fast path.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping

from shardflow.lower.calibration import (WORLD, Calibration, CalibrationError, CalibrationWarning, KindCost,
                                         calibration_path, this_machine)
from shardflow.lower.dynamic import ActivationCheckpointing
from shardflow.lower.schedule import ScheduleKind

GB = 1e9

DEFAULT_BANDWIDTH: Mapping[str, Mapping[str, float]] = {
    "gloo": {"p2p": 1.0 * GB, "all_reduce": 0.9 * GB, "all_gather": 0.6 * GB, "reduce_scatter": 0.2 * GB,
             "broadcast": 0.9 * GB, "all_to_all": 0.35 * GB, "reduce": 0.9 * GB},
    "nccl": {"p2p": 20 * GB, "all_reduce": 100 * GB, "all_gather": 100 * GB, "reduce_scatter": 100 * GB,
             "broadcast": 100 * GB, "all_to_all": 50 * GB, "reduce": 100 * GB},
}
DEFAULT_ALPHA_S = {"gloo": 4e-4, "nccl": 2e-5}


class CommForm(StrEnum):
    """How lowering runs an all-gather or a reduce-scatter
    (docs/lowering.md#10-all-gather-and-reduce-scatter-forms-the-cost-model-machine-views): the plain collective, a ring
    of d−1 collective-permute steps (nvFuser PR #5963), or a loop of d broadcasts, root = step (all-gather only)."""

    COLLECTIVE = "collective"
    RING = "ring"
    BROADCAST_LOOP = "broadcast_loop"


ALL_GATHER_FORMS = (CommForm.COLLECTIVE, CommForm.RING, CommForm.BROADCAST_LOOP)
REDUCE_SCATTER_FORMS = (CommForm.COLLECTIVE, CommForm.RING)


@dataclass(frozen=True)
class CostModel:
    """``alpha_s``: seconds per communication call; ``bandwidth``: bytes/s per kind (``p2p`` for send/recv and
    collective-permute steps) — overrides, each beating ``calibration`` (what ``shardflow calibrate`` measured, per
    mesh axis; :mod:`shardflow.lower.calibration`), which beats the backend's defaults. A kind on an axis the
    calibration did not measure takes its :data:`~shardflow.lower.calibration.WORLD` group's numbers, else the
    defaults."""

    backend: str = "gloo"
    alpha_s: float | None = None
    bandwidth: Mapping[str, float] = field(default_factory=dict)
    calibration: Calibration | None = None

    @classmethod
    def for_backend(cls, backend: str, env: Mapping[str, str] = os.environ) -> CostModel:
        """The cost model of ``backend`` on this machine: its calibration file
        (:func:`~shardflow.lower.calibration.calibration_path`) where there is one, else the defaults. Raises
        CalibrationError for a file that cannot be used (naming it and the fix); a file of another machine is
        ignored with a CalibrationWarning."""
        path = calibration_path(backend, env)
        if not path.is_file():
            return cls(backend)
        cal = Calibration.load(path)
        if cal.backend != backend:
            raise CalibrationError(f"calibration file {path}: measured on {cal.backend}, read for {backend}; run "
                                   f"`shardflow calibrate --backend {backend}` again, or delete it")
        if cal.machine != this_machine():
            warnings.warn(f"calibration file {path} was measured on {cal.machine}, not on this machine "
                          f"({this_machine()}): ignored, the {backend} defaults apply; run `shardflow calibrate` "
                          f"here", CalibrationWarning, stacklevel=2)
            return cls(backend)
        return cls(backend, calibration=cal)

    def describe(self) -> str:
        """Where the numbers come from, in one line: the calibration file, or the backend's defaults."""
        return self.calibration.describe() if self.calibration else f"{self.backend} defaults (no calibration)"

    def _measured(self, kind: str, axis: str | None) -> KindCost | None:
        groups = self.calibration.groups if self.calibration else {}
        return next((groups[g][kind] for g in (axis, WORLD) if g in groups and kind in groups[g]), None)

    def bw(self, kind: str, axis: str | None = None) -> float:
        """Bytes/s of one rank's sends in a call of cost kind ``kind`` along mesh ``axis`` (None: any)."""
        if kind in self.bandwidth:
            return self.bandwidth[kind]
        m = self._measured(kind, axis)
        return DEFAULT_BANDWIDTH[self.backend][kind] if m is None else m.bandwidth

    def alpha(self, kind: str, axis: str | None = None) -> float:
        """Seconds per call of cost kind ``kind`` along mesh ``axis`` (None: any)."""
        if self.alpha_s is not None:
            return self.alpha_s
        m = self._measured(kind, axis)
        return DEFAULT_ALPHA_S[self.backend] if m is None else m.alpha_s

    def call_s(self, kind: str, nbytes: int, axis: str | None = None) -> float:
        """Seconds for one call of cost kind ``kind`` (:data:`~shardflow.lower.calibration.COST_KINDS`) in which
        this rank sends ``nbytes`` (:func:`~shardflow.parallel.collectives.wire_bytes`): α + bytes / bandwidth."""
        return self.alpha(kind, axis) + nbytes / self.bw(kind, axis)

    def all_gather_s(self, form: CommForm, chunk_bytes: int, d: int, axis: str | None = None) -> float:
        """Seconds for a ``d``-member all-gather of ``chunk_bytes`` per member along ``axis``, in ``form``."""
        if form == CommForm.COLLECTIVE:
            return self.call_s("all_gather", (d - 1) * chunk_bytes, axis)
        if form == CommForm.RING:  # d−1 collective-permute steps, each moving one chunk
            return (d - 1) * self.call_s("p2p", chunk_bytes, axis)
        if form == CommForm.BROADCAST_LOOP:  # d broadcasts, root = step
            return d * self.call_s("broadcast", chunk_bytes, axis)
        raise ValueError(f"unknown all-gather form {form!r}; one of {tuple(map(str, ALL_GATHER_FORMS))}")

    def reduce_scatter_s(self, form: CommForm, chunk_bytes: int, d: int, axis: str | None = None) -> float:
        """Seconds for a ``d``-member reduce-scatter along ``axis`` whose result is ``chunk_bytes`` per member."""
        if form == CommForm.COLLECTIVE:
            return self.call_s("reduce_scatter", (d - 1) * chunk_bytes, axis)
        if form == CommForm.RING:
            return (d - 1) * self.call_s("p2p", chunk_bytes, axis)
        raise ValueError(f"unknown reduce-scatter form {form!r}; one of {tuple(map(str, REDUCE_SCATTER_FORMS))}")

    def choose_all_gather(self, chunk_bytes: int, d: int, axis: str | None = None) -> CommForm:
        """The cheapest all-gather form (:meth:`all_gather_s`)."""
        return min(ALL_GATHER_FORMS, key=lambda f: self.all_gather_s(f, chunk_bytes, d, axis))

    def choose_reduce_scatter(self, chunk_bytes: int, d: int, axis: str | None = None) -> CommForm:
        """The cheapest reduce-scatter form (:meth:`reduce_scatter_s`)."""
        return min(REDUCE_SCATTER_FORMS, key=lambda f: self.reduce_scatter_s(f, chunk_bytes, d, axis))


MASTER_DTYPES = ("float32", "float64")  # what LowerOptions.master_dtype may hold weights in
DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's bucket_cap_mb=25


@dataclass(frozen=True)
class LowerOptions:
    """How lowering implements all-gathers and reduce-scatters: ``"auto"`` (cheapest by ``cost``) or a form
    of :data:`ALL_GATHER_FORMS` / :data:`REDUCE_SCATTER_FORMS`.

    ``bucket_bytes``: gradient all-reduces over the same group are packed into buckets of at least this many
    bytes (the last one may be smaller), each issued without waiting as soon as its last gradient is ready,
    so it travels while the backward goes on; 0 = one all-reduce per gradient. PyTorch DDP's gradient
    bucketing (Li et al., "PyTorch Distributed", VLDB 2020), default 25 MiB as DDP's ``bucket_cap_mb``.

    ``reshard_after_forward``: a weight gathered by a Combine (FSDP) is gathered again for the backward instead of
    kept from the forward (:func:`~shardflow.lower.dynamic.pass_expansion`; FSDP2's ``reshard_after_forward``).
    Off here, so a plan lowers as written; ``shardflow train``/``plan``/``check`` and ``parallelize`` turn it on by
    default, as FSDP2 does.

    ``ac``: activation checkpointing, ``none`` or ``block`` (:class:`~shardflow.lower.dynamic.ActivationCheckpointing`):
    each block's forward runs again before its backward instead of keeping its activations (``--ac``).

    ``overlap``: each backward all-reduce, reduce-scatter or send is issued without waiting and waited after the
    computes that do not feed it, a linear's weight gradient computed while its input gradient is reduced or sent
    (Megatron's overlap; :func:`~shardflow.lower.ordering.overlap_reductions`); a forward all-reduce or
    reduce-scatter likewise (dp's label count travels while the forward computes).

    ``master_dtype``: mixed precision — weights narrower than it (a model captured in bf16) are held, reduced and
    updated in it and cast to their own dtype for each step (``--dtype bf16``: float32;
    ``master_dtype`` of :func:`~shardflow.lower.dynamic.pass_expansion`); "" keeps every weight in its own dtype.

    ``microbatches``: the step's batch cut into this many microbatches (``--microbatches``; the graph is captured on
    one), run in the order of pipeline ``schedule`` (``--schedule``: :class:`~shardflow.lower.schedule.ScheduleKind`);
    the updates run once per step (:mod:`shardflow.lower.schedule`).
    """

    all_gather: CommForm | str = "auto"
    reduce_scatter: CommForm | str = "auto"
    cost: CostModel = field(default_factory=CostModel)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    reshard_after_forward: bool = False
    ac: ActivationCheckpointing | str = ActivationCheckpointing.NONE
    master_dtype: str = ""
    overlap: bool = True
    microbatches: int = 1
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B

    def __post_init__(self):
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.schedule not in set(ScheduleKind):
            raise ValueError(f"schedule must be one of {[str(k) for k in ScheduleKind]}, got {self.schedule!r}")
        if self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0 (0 = no bucketing), got {self.bucket_bytes}")
        if self.all_gather not in ("auto",) + ALL_GATHER_FORMS:
            raise ValueError(f"all_gather must be 'auto' or one of {tuple(map(str, ALL_GATHER_FORMS))}, got "
                             f"{self.all_gather!r}")
        if self.master_dtype and self.master_dtype not in MASTER_DTYPES:
            raise ValueError(f"master_dtype must be one of {MASTER_DTYPES} or '' (every weight in its own dtype), got "
                             f"{self.master_dtype!r}")
        if self.ac not in set(ActivationCheckpointing):
            raise ValueError(f"ac must be one of {[str(a) for a in ActivationCheckpointing]}, got {self.ac!r}")
        if self.reduce_scatter not in ("auto",) + REDUCE_SCATTER_FORMS:
            raise ValueError(f"reduce_scatter must be 'auto' or one of {tuple(map(str, REDUCE_SCATTER_FORMS))}, got "
                             f"{self.reduce_scatter!r}")

    def all_gather_form(self, chunk_bytes: int, d: int, axis: str | None = None) -> CommForm:
        """The form of a ``d``-member all-gather of ``chunk_bytes`` per member along mesh ``axis``."""
        if self.all_gather == "auto":
            return self.cost.choose_all_gather(chunk_bytes, d, axis)
        return CommForm(self.all_gather)

    def reduce_scatter_form(self, chunk_bytes: int, d: int, axis: str | None = None) -> CommForm:
        """The form of a ``d``-member reduce-scatter along mesh ``axis`` whose result is ``chunk_bytes`` per member."""
        if self.reduce_scatter == "auto":
            return self.cost.choose_reduce_scatter(chunk_bytes, d, axis)
        return CommForm(self.reduce_scatter)
