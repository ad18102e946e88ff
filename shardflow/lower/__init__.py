"""Lowering: one training step of a PCG → verified per-rank programs.

The passes (:data:`~shardflow.lower.passes.PASSES`) run in order, each checked before and after;
:func:`lower_step` runs them all::

    pass_expansion → copy_insertion → schedule → shard_expansion → comm_lowering → ordering → verify
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from shardflow.lower.cost import PLAIN, CostModel, LowerOptions, MixedPrecision
from shardflow.lower.dynamic import DynamicGraph, MicroStep, PassName, UpdateRule
from shardflow.lower.passes import PASSES, LowerContext, PassRecord, lower_programs, run_passes
from shardflow.lower.program import Program
from shardflow.parallel.pcg import PCG


@dataclass(frozen=True)
class LoweredStep:
    """The dynamic graph of one step, the programs of the requested ranks, and the pass log (name, seconds,
    graph size after each pass)."""

    dg: DynamicGraph
    programs: Mapping[int, Program]
    passes: tuple[PassRecord, ...] = ()


def lower_step(
    pcg: PCG,
    optimizer: UpdateRule = UpdateRule.SGD,
    ranks: Iterable[int] | None = None,
    verify: bool = True,
    training: bool = True,
    options: LowerOptions | None = None,
    clip_norm: float | None = None,
    grad_norm: bool = False,
    micro: MicroStep = MicroStep(),
) -> LoweredStep:
    """Lower one training step of ``pcg``. With ``ranks`` given, only those ranks' programs are built (each
    rank of a run builds its own); ``verify`` (all ranks only) proves the programs agree before any launch.

    ``training=False`` lowers the forward pass only (evaluation). ``options`` chooses the form of each
    all-gather and reduce-scatter (plain collective, collective-permute ring, broadcast loop), FSDP's resharding,
    activation checkpointing, mixed precision and the pipeline's microbatches (default :data:`PLAIN`: the plain
    collectives, a plan lowered as written; the entry points pass their run's :class:`LowerOptions`).
    ``clip_norm``: clip gradients to this global norm (one reduction over all devices).
    ``grad_norm``: compute that global gradient norm without clipping too (a scalar all-reduce per mesh axis,
    after the updates); either way the executors expose it after each step (``Executor.grad_norm``).
    ``micro``: the micro-step of an optimizer step under gradient accumulation (:class:`MicroStep`; default the
    plain step): only the last reduces the weights' gradients and updates.
    Raises PassError if a pass finds the graph inconsistent, PlanVerificationError if the proof fails.
    """
    options = options or PLAIN
    ctx = LowerContext(
        optimizer, training, clip_norm, options, None if ranks is None else tuple(ranks), grad_norm, micro
    )
    skip = () if verify and ranks is None else (PassName.VERIFY,)
    sg, records = run_passes(pcg, ctx, skip=skip)
    return LoweredStep(sg.dg, sg.programs, records)


__all__ = [
    "PASSES",
    "PLAIN",
    "CostModel",
    "LowerOptions",
    "LoweredStep",
    "MicroStep",
    "MixedPrecision",
    "lower_programs",
    "lower_step",
    "run_passes",
]
