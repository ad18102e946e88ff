"""Lowering: one training step of a PCG → verified per-rank programs.

The passes run in this order (``PASSES``), each checked before and after; :func:`lower_step` runs them all::

    pass_expansion → copy_insertion → shard expansion + communication lowering + ordering → verify
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from shardflow.lower.cost import CostModel, LowerOptions
from shardflow.lower.dynamic import DynamicGraph, copy_insertion, pass_expansion
from shardflow.lower.lowering import lower
from shardflow.lower.program import Program
from shardflow.parallel.pcg import PCG

PASSES = ("pass_expansion", "copy_insertion", "shard_expansion+comm_lowering+ordering", "verify")


@dataclass(frozen=True)
class LoweredStep:
    """The dynamic graph of one step and the programs of the requested ranks."""

    dg: DynamicGraph
    programs: Mapping[int, Program]


def lower_step(pcg: PCG, optimizer: str = "sgd", ranks: Iterable[int] | None = None,
               verify: bool = True, training: bool = True, options: LowerOptions | None = None,
               clip_norm: float | None = None) -> LoweredStep:
    """Lower one training step of ``pcg``. With ``ranks`` given, only those ranks' programs are built (each
    rank of a run builds its own); ``verify`` (all ranks only) proves the programs agree before any launch.

    ``training=False`` lowers the forward pass only (evaluation). ``options`` chooses the form of each
    all-gather and reduce-scatter (plain collective, collective-permute ring, broadcast loop; default: the
    plain collectives). ``clip_norm``: clip gradients to this global norm (one reduction over all devices).
    Raises PassError if a pass finds the graph inconsistent, PlanVerificationError if the proof fails.
    """
    dg = copy_insertion(pass_expansion(pcg, optimizer, training, clip_norm))
    programs = lower(dg, ranks, options)
    if verify and ranks is None:
        from shardflow.lower.verify import verify as prove
        prove(programs, pcg.mesh.size)
    return LoweredStep(dg, programs)


__all__ = ["PASSES", "CostModel", "LowerOptions", "LoweredStep", "lower_step"]
