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

import torch

from shardflow.lower.calibration import (
    WORLD,
    Calibration,
    CalibrationError,
    CalibrationWarning,
    KindCost,
    calibration_path,
    this_machine,
)
from shardflow.lower.dynamic import ActivationCheckpointing
from shardflow.lower.schedule import ScheduleKind

GB = 1e9

DEFAULT_BANDWIDTH: Mapping[str, Mapping[str, float]] = {
    "gloo": {
        "p2p": 1.0 * GB,
        "all_reduce": 0.9 * GB,
        "all_gather": 0.6 * GB,
        "reduce_scatter": 0.2 * GB,
        "broadcast": 0.9 * GB,
        "all_to_all": 0.35 * GB,
        "reduce": 0.9 * GB,
    },
    "nccl": {
        "p2p": 20 * GB,
        "all_reduce": 100 * GB,
        "all_gather": 100 * GB,
        "reduce_scatter": 100 * GB,
        "broadcast": 100 * GB,
        "all_to_all": 50 * GB,
        "reduce": 100 * GB,
    },
}
DEFAULT_ALPHA_S = {"gloo": 4e-4, "nccl": 2e-5}


class CPAttention(StrEnum):
    """How attention reads a sequence split over the ``cp`` axis (``--cp-attention``;
    docs/concepts.md#context-parallelism): ``all_gather`` the keys and values, each device's queries keeping their
    block; ``all_to_all`` the
    queries, keys and values onto heads (each device then holds every position of its heads: DeepSpeed-Ulysses) and
    the output back onto the sequence; ``ring`` plans as ``all_gather`` and lowers the gathers as a ring of
    collective-permutes, each step attending the key/value block at hand while the next travels, merged by
    log-sum-exp (:func:`~shardflow.lower.comm_lowering.attention_rings`); ``auto`` the one of ``all_gather`` and
    ``all_to_all`` that sends fewer bytes."""

    AUTO = "auto"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    RING = "ring"


class EPDispatch(StrEnum):
    """How an expert layer under ``ep`` moves its tokens to their experts' ranks and the results back
    (``--ep-dispatch``; docs/concepts.md#expert-parallelism): ``all_to_all`` sends each token only to the ranks of
    the experts it is routed to and back, by two all-to-alls whose sizes are the routing's, exchanged in the step
    (:func:`~shardflow.lower.comm_lowering.expert_dispatches`; dropless, as torchtitan's and Megatron-LM's
    all-to-all dispatchers); ``all_gather`` gathers every token of the axis on every rank and reduce-scatters the
    partial outputs back (Megatron-LM's all-gather dispatcher: fixed sizes, more bytes beyond ``ep`` = K)."""

    ALL_TO_ALL = "all_to_all"
    ALL_GATHER = "all_gather"


class CPLayout(StrEnum):
    """How a sequence split over the ``cp`` axis is laid out on its devices (``--cp-layout``;
    docs/concepts.md#the-load-balanced-layout): ``balanced``, the head-tail order of PyTorch's load balancer (2·cp
    chunks, device r holding chunks r and 2·cp−1−r, so that under a causal mask each attends as many keys);
    ``contiguous``, device r holding the r-th block (under a causal mask the last device then attends up to
    (2·cp−1)× the first's keys); ``auto`` (the default), balanced where every attention of the model is causal and
    the sequence cuts into 2·cp chunks, else contiguous."""

    AUTO = "auto"
    BALANCED = "balanced"
    CONTIGUOUS = "contiguous"


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
            raise CalibrationError(
                f"calibration file {path}: measured on {cal.backend}, read for {backend}; run "
                f"`shardflow calibrate --backend {backend}` again, or delete it"
            )
        if cal.machine != this_machine():
            warnings.warn(
                f"calibration file {path} was measured on {cal.machine}, not on this machine "
                f"({this_machine()}): ignored, the {backend} defaults apply; run `shardflow calibrate` "
                f"here",
                CalibrationWarning,
                stacklevel=2,
            )
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


DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's bucket_cap_mb=25


@dataclass(frozen=True)
class MixedPrecision:
    """Mixed precision, as FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``: the model computes in
    ``param_dtype`` (the entry points capture it in that dtype: ``shardflow train``/``plan --dtype bf16`` convert it,
    :func:`~shardflow.api.parallelize` takes a model already in it); every floating weight narrower than
    ``reduce_dtype`` is held, reduced (its gradients) and updated (its optimizer state) in ``reduce_dtype`` and cast
    to ``param_dtype`` at the start of each step (``master_dtype`` of
    :func:`~shardflow.lower.pass_expansion.pass_expansion`).
    Both must be floating dtypes (:meth:`LowerOptions.parse` checks)."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32


def _choice(name: str, value: str, choices: tuple[StrEnum, ...], auto: bool = False):
    """The member of ``choices`` named ``value`` (None for ``"auto"`` where ``auto``). Raises ValueError naming the
    setting ``name`` and its choices."""
    if auto and value == "auto":
        return None
    found = next((c for c in choices if c == value), None)
    if found is None:
        listed = [str(c) for c in choices]
        raise ValueError(f"{name} must be {'auto or ' if auto else ''}one of {listed}, got {value!r}")
    return found


@dataclass(frozen=True)
class LowerOptions:
    """How one optimizer step becomes per-rank programs: the one typed options object of a run. Every entry point
    (:func:`~shardflow.api.parallelize`, ``shardflow train``, ``plan`` and ``check``) parses its settings into it
    once, with :meth:`parse`; the planner and the passes read typed values and check nothing again.

    ``all_gather``, ``reduce_scatter``: the form of each all-gather / reduce-scatter, a form of
    :data:`ALL_GATHER_FORMS` / :data:`REDUCE_SCATTER_FORMS`, or None: the cheapest by ``cost`` (``auto``; the entry
    points pass the machine's calibrated cost model, :meth:`CostModel.for_backend`).

    ``bucket_bytes``: gradient all-reduces over the same group are packed into buckets of at least this many
    bytes (the last one may be smaller), each issued without waiting as soon as its last gradient is ready,
    so it travels while the backward goes on; 0 = one all-reduce per gradient. PyTorch DDP's gradient
    bucketing (Li et al., "PyTorch Distributed", VLDB 2020), default 25 MiB as DDP's ``bucket_cap_mb``.

    ``reshard_after_forward``: a weight gathered by a Combine (FSDP) is gathered again for the backward instead of
    kept from the forward (:func:`~shardflow.lower.pass_expansion.pass_expansion`; FSDP2's ``reshard_after_forward``, on
    by default as there and in every entry point); False keeps the forward's gather.

    ``regather_activations``: an activation gathered by a Combine (sequence parallelism's all-gather before a
    column-parallel linear, a context-parallel key/value all-gather, a redistribution the planner inserted) is freed
    after its last forward reader and gathered again from its pieces right before its first backward reader, instead
    of kept whole from the forward for the backward (Megatron-LM's sequence parallelism: Korthikanti et al.,
    "Reducing Activation Recomputation in Large Transformer Models", 2022, §4.2.2): a piece per rank lives through
    the step instead of the whole, for one all-gather more per such Combine in the backward (``--regather-activations``;
    docs/lowering.md#regathering-activations). Off by default (DTensor's ``SequenceParallel`` keeps the gather).

    ``ac``: activation checkpointing (:class:`~shardflow.lower.dynamic.ActivationCheckpointing`): under ``block``
    each block's forward runs again before its backward instead of keeping its activations, under ``selective``
    only its cheap ops (``--ac``).
    ``ac_blocks``: under ``block``, only the first this many blocks in forward order (``model.layers.0`` …) run
    their forward again, the others keep their activations (``--ac-blocks K``; under a pipeline the first stages
    hold the most microbatches in flight, so their blocks are the ones to recompute); None: every block. Under
    ``selective``, the first this many blocks recompute whole, the others selectively; None: none whole. Checked
    against the graph's number of blocks by :func:`~shardflow.lower.pass_expansion.checkpoint_blocks`.

    ``overlap``: each backward all-reduce, reduce-scatter or send is issued without waiting and waited after the
    computes that do not feed it, a linear's weight gradient computed while its input gradient is reduced or sent
    (Megatron's overlap; :func:`~shardflow.lower.ordering.overlap_reductions`); a forward all-reduce or
    reduce-scatter likewise (dp's label count travels while the forward computes). A ring attention's
    collective-permutes travel while the block before computes (without ``overlap``, each waits where it is issued).

    ``precision``: mixed precision (:class:`MixedPrecision`, ``--dtype bf16``); None keeps every weight in its own
    dtype.

    ``microbatches``: the step's batch cut into this many microbatches (``--microbatches``; the graph is captured on
    one), run in the order of pipeline ``schedule`` (``--schedule``: :class:`~shardflow.lower.schedule.ScheduleKind`);
    the updates run once per step (:mod:`shardflow.lower.schedule`). ``stages_per_rank``: the chunks of the model
    each pipeline stage of a preset holds (the interleaved schedule's). ``cp_attention``: how a preset's attention
    reads a sequence split over ``cp`` (:class:`CPAttention`), ``cp_layout`` how that sequence is laid out
    (:class:`CPLayout`).

    ``accumulate``: gradient accumulation, the micro-steps of one optimizer step (``--accumulate``;
    :class:`~shardflow.lower.dynamic.MicroStep`), each on an equal part of the batch.

    ``ep_dispatch``: how an expert layer under ``ep`` sends its tokens to their experts (:class:`EPDispatch`);
    ``capacity_factor``: under the all-to-all dispatcher, each rank sends each expert at most ⌈F · n·K / E⌉ rows of
    its n tokens, the rest dropped (``--capacity-factor``; GShard, Lepikhin et al. 2020; Switch Transformer, Fedus
    et al. 2022): all-to-alls of fixed size, and numbers that change where a token is dropped; None: dropless.
    """

    all_gather: CommForm | None = None
    reduce_scatter: CommForm | None = None
    cost: CostModel = field(default_factory=CostModel)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    reshard_after_forward: bool = True
    ac: ActivationCheckpointing = ActivationCheckpointing.NONE
    precision: MixedPrecision | None = None
    overlap: bool = True
    microbatches: int = 1
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    stages_per_rank: int = 1
    accumulate: int = 1
    ac_blocks: int | None = None
    cp_attention: CPAttention = CPAttention.AUTO
    cp_layout: CPLayout = CPLayout.AUTO
    ep_dispatch: EPDispatch = EPDispatch.ALL_TO_ALL
    capacity_factor: float | None = None
    regather_activations: bool = False

    @classmethod
    def parse(
        cls,
        *,
        cost: CostModel,
        all_gather: str = "auto",
        reduce_scatter: str = "auto",
        bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        reshard_after_forward: bool = True,
        ac: str = "none",
        ac_blocks: int | None = None,
        precision: MixedPrecision | None = None,
        microbatches: int = 1,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        accumulate: int = 1,
        cp_attention: str = "auto",
        cp_layout: str = "auto",
        ep_dispatch: str = "all_to_all",
        capacity_factor: float | None = None,
        regather_activations: bool = False,
    ) -> LowerOptions:
        """The options of an entry point's settings (command-line flags, ``config.toml``, :func:`parallelize`'s
        arguments), as those spell them: forms and kinds by name (``"auto"``: None), the bucket size in MiB.

        Raises:
            ValueError: a name that is none of its choices, a floating-point ``precision`` dtype that is not one,
                ``bucket_mb`` < 0, ``microbatches``, ``stages_per_rank``, ``accumulate`` or ``ac_blocks`` < 1, or
                ``ac_blocks`` with ``ac="none"`` (one paragraph naming the setting). ``ac_blocks`` above the
                graph's number of blocks is refused when the step is lowered (PassError).
        """
        for name, v, what in (
            ("accumulate", accumulate, "micro-steps per step, 1 (no accumulation)"),
            ("microbatches", microbatches, "microbatches per step, 1 (no pipelining)"),
            ("stages_per_rank", stages_per_rank, "chunks of the model per pipeline stage, 1"),
        ):
            if v < 1:
                raise ValueError(f"{name}={v}: give the {what} or more")
        if ac_blocks is not None and ac_blocks < 1:
            raise ValueError(
                f"ac_blocks={ac_blocks}: give the number of blocks to recompute, 1 or more (the first K in forward "
                f"order), or leave it out to recompute every block"
            )
        if ac_blocks is not None and ac == ActivationCheckpointing.NONE:
            raise ValueError(
                f"ac_blocks={ac_blocks} with ac={ac!r}: the number of blocks to recompute applies to activation "
                f"checkpointing by block; add --ac block or --ac selective, or leave --ac-blocks out"
            )
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb={bucket_mb}: give the MiB of a gradient bucket, 0 (no bucketing) or more")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={capacity_factor}: give the rows each expert takes of a rank's tokens as a multiple "
                f"of an even share, above 0 (GShard's 1.25; 2 drops fewer), or leave it out for no capacity (dropless)"
            )
        if capacity_factor is not None and ep_dispatch != EPDispatch.ALL_TO_ALL:
            raise ValueError(
                f"capacity_factor={capacity_factor} with ep_dispatch={ep_dispatch!r}: a capacity caps the rows the "
                f"all-to-all token dispatcher sends each expert; use ep_dispatch='all_to_all' or leave the capacity out"
            )
        if precision is not None and not (
            precision.param_dtype.is_floating_point and precision.reduce_dtype.is_floating_point
        ):
            raise ValueError(
                f"mixed precision {precision}: param_dtype and reduce_dtype must be floating dtypes "
                f"(e.g. MixedPrecision(torch.bfloat16, torch.float32))"
            )
        return cls(
            _choice("all_gather", all_gather, ALL_GATHER_FORMS, auto=True),
            _choice("reduce_scatter", reduce_scatter, REDUCE_SCATTER_FORMS, auto=True),
            cost,
            int(bucket_mb * 2**20),
            reshard_after_forward,
            _choice("ac", ac, tuple(ActivationCheckpointing)),
            precision,
            microbatches=microbatches,
            schedule=_choice("schedule", schedule, tuple(ScheduleKind)),
            stages_per_rank=stages_per_rank,
            accumulate=accumulate,
            ac_blocks=ac_blocks,
            cp_attention=_choice("cp_attention", cp_attention, tuple(CPAttention)),
            cp_layout=_choice("cp_layout", cp_layout, tuple(CPLayout)),
            ep_dispatch=_choice("ep_dispatch", ep_dispatch, tuple(EPDispatch)),
            capacity_factor=capacity_factor,
            regather_activations=regather_activations,
        )

    def all_gather_form(self, chunk_bytes: int, d: int, axis: str | None = None) -> CommForm:
        """The form of a ``d``-member all-gather of ``chunk_bytes`` per member along mesh ``axis``."""
        return self.all_gather or self.cost.choose_all_gather(chunk_bytes, d, axis)

    def reduce_scatter_form(self, chunk_bytes: int, d: int, axis: str | None = None) -> CommForm:
        """The form of a ``d``-member reduce-scatter along mesh ``axis`` whose result is ``chunk_bytes`` per member."""
        return self.reduce_scatter or self.cost.choose_reduce_scatter(chunk_bytes, d, axis)


# the options of lowering without a run's settings (lower_step alone): the plain collectives, no resharding of a
# gathered weight — a plan lowers as written
PLAIN = LowerOptions(CommForm.COLLECTIVE, CommForm.COLLECTIVE, reshard_after_forward=False)
