"""The one executor interface: load full weights and optimizer state, run steps, read full results.

:class:`~shardflow.runtime.local.LocalExecutor` (every rank in this process) and
:class:`~shardflow.runtime.distributed.DistributedExecutor` (this rank on torch.distributed) implement how a
value's pieces are put and gathered (``_put`` / ``_get``) and how a step runs; everything else is here.
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardflow.lower.dynamic import DynamicGraph


class Executor:
    """Base of both executors. ``dg`` is the lowered step's dynamic graph; ``steps_done`` counts steps."""

    dg: DynamicGraph
    steps_done: int = 0

    def _index_updates(self) -> None:
        """After a step, each update's outputs replace the weight and state it read (``renames``); the
        gradient it used stays readable (``grad_values``)."""
        updates = [n for n in self.dg.nodes if n.kind == "update"]
        self.renames = [(new, old) for n in updates for new, old in zip(n.outputs, (n.inputs[0],) + n.inputs[2:])]
        self.grad_values = {n.src: n.inputs[1] for n in updates}

    def _put(self, vid: str, full: torch.Tensor) -> None:
        """Place the pieces of value ``vid`` cut from its full tensor."""
        raise NotImplementedError

    def _get(self, vid: str) -> torch.Tensor:
        """The full tensor of value ``vid`` (on the distributed executor: collective, every rank calls it)."""
        raise NotImplementedError

    def step(self, inputs: Mapping[str, torch.Tensor]) -> float:
        """One training step on full ``inputs`` (by graph input name); returns the loss."""
        raise NotImplementedError

    def _place_inputs(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Place a step's data inputs (by graph input name) and the graph's constants."""
        graph = self.dg.pcg.graph
        for name in graph.inputs:
            self._put(f"fwd:{name}", inputs[name])
        for name, value in graph.constants.items():
            self._put(f"fwd:{name}", value)

    def load(self, weights: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor] | None = None,
             steps_done: int = 0) -> None:
        """Place the full weights (by graph name) and optimizer ``state`` (full tensors by value id, as
        :meth:`state` returns them; zero when None) after ``steps_done`` steps. Every rank passes the same."""
        for w in self.dg.pcg.graph.weights:
            self._put(f"fwd:{w}", weights[w])
        for vid in self.dg.state_values():
            v = self.dg.values[vid]
            self._put(vid, state[vid] if state else torch.zeros(v.type.shape, dtype=weights[v.tensor].dtype))
        self.steps_done = steps_done

    def weights(self) -> dict[str, torch.Tensor]:
        """Full weights by graph name (= the module's parameter names)."""
        return {w: self._get(f"fwd:{w}") for w in self.dg.pcg.graph.weights}

    def state(self) -> dict[str, torch.Tensor]:
        """Optimizer state as full tensors by value id (``opt:<slot>:<weight>``)."""
        return {vid: self._get(vid) for vid in self.dg.state_values()}

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients the last step's updates used, as full tensors by weight name."""
        return {w: self._get(g) for w, g in self.grad_values.items()}
