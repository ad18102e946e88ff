"""The step simulator: per-rank programs replayed on a machine spec (docs/simulator.md). The machine specs:
:mod:`shardflow.simulator.machine`."""

from shardflow.simulator.machine import Device, Link, MachineSpec, MachineSpecError, MachineSpecWarning, resolve

__all__ = ["Device", "Link", "MachineSpec", "MachineSpecError", "MachineSpecWarning", "resolve"]
