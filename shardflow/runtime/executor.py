"""The one executor interface: load full weights and optimizer state, run steps, read full results.

:class:`~shardflow.runtime.local.LocalExecutor` (every rank in this process) and
:class:`~shardflow.runtime.distributed.DistributedExecutor` (this rank on torch.distributed) implement how a
value's pieces are put and gathered (``_put`` / ``_get``), which pieces are held here (``_pieces``), how a number
is reduced over the ranks (``_max_over_ranks``) or gathered from every process (:meth:`Executor.per_process`) and
how a step runs; everything else is here.

Both take the run's ``seed``: random ops (dropout) draw as a pure function of (seed, step, node, global element
index), so any strategy draws what one device draws (:mod:`shardflow.graph.rng`).
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardflow.lower.dynamic import DynamicGraph, NodeKind, forward_id


class Executor:
    """Base of both executors. ``dg`` is the lowered step's dynamic graph; ``steps_done`` counts steps;
    ``micro``: the micro-step the next step runs, (index, count), under gradient accumulation (its random ops
    draw as rows of the whole batch: :meth:`~shardflow.graph.rng.PieceSite.at`)."""

    dg: DynamicGraph
    steps_done: int = 0
    micro: tuple[int, int] = (0, 1)

    def _index_updates(self) -> None:
        """After a step, each value that replaces another (an update's new weight and state, a micro-step's new
        sum of gradient contributions) takes its place (``renames``); the gradient each update used stays
        readable (``grad_values``)."""
        self.renames = [(new, v.replaces) for new, v in self.dg.values.items() if v.replaces]
        self.grad_values = {n.src: n.inputs[1] for n in self.dg.nodes if n.kind == NodeKind.UPDATE}

    def _put(self, vid: str, full: torch.Tensor) -> None:
        """Place the pieces of value ``vid`` cut from its full tensor."""
        raise NotImplementedError

    def _get(self, vid: str) -> torch.Tensor:
        """The full tensor of value ``vid`` (on the distributed executor: collective, every rank calls it)."""
        raise NotImplementedError

    def _pieces(self, vid: str) -> dict[int, torch.Tensor]:
        """Device → its piece of value ``vid``, for every device of this executor that holds one."""
        raise NotImplementedError

    def _max_over_ranks(self, x: float) -> float:
        """The largest ``x`` over the ranks (on the distributed executor: collective, every rank calls it)."""
        raise NotImplementedError

    def per_process(self, x: float) -> list[float]:
        """Every process's ``x``, in rank order: one value on the local executor (every rank is this process);
        on the distributed executor one per rank (collective: every rank calls it, with the run's timeout)."""
        raise NotImplementedError

    def step(self, inputs: Mapping[str, torch.Tensor]) -> float:
        """One training step on full ``inputs`` (by graph input name); returns the loss."""
        raise NotImplementedError

    @property
    def grad_norm(self) -> float | None:
        """The global L2 norm of all gradients of the last step, before clipping (what
        ``torch.nn.utils.clip_grad_norm_`` returns; every piece counted once), read locally: every device holds
        it. None before the first step, or when the step was lowered without it (``lower_step(...,
        grad_norm=True)`` or ``clip_norm`` computes it)."""
        vid = self.dg.grad_norm_sq
        pieces = self._pieces(vid) if vid else {}
        return next(iter(pieces.values())).sqrt().item() if pieces else None

    def _place_inputs(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Place a step's data inputs (by graph input name) and the graph's constants."""
        graph = self.dg.pcg.graph
        for name in graph.inputs:
            self._put(forward_id(name), inputs[name])
        for name, value in graph.constants.items():
            self._put(forward_id(name), value)

    def load(self, weights: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor] | None = None,
             steps_done: int = 0) -> None:
        """Place the full weights (by graph name) and optimizer ``state`` (full tensors by value id, as
        :meth:`state` returns them; zero when None) after ``steps_done`` steps. Every rank passes the same."""
        for w in self.dg.pcg.graph.weights:
            self._put(forward_id(w), weights[w])
        for vid in self.dg.state_values():
            v = self.dg.values[vid]
            self._put(vid, state[vid] if state else torch.zeros(v.type.shape, dtype=weights[v.tensor].dtype))
        self.steps_done = steps_done

    def weights(self) -> dict[str, torch.Tensor]:
        """Full weights by graph name (= the module's parameter names), read from replica 0 of each block."""
        return {w: self._get(forward_id(w)) for w in self.dg.pcg.graph.weights}

    def weight_error(self, reference: Mapping[str, torch.Tensor]) -> float:
        """The largest |piece − the same block of ``reference``| (in the weights' units) over every piece of every
        weight held here — every replica, not replica 0 alone as :meth:`weights` reads, so replicas that drifted
        apart show. ``reference``: full weights by graph name (e.g. the single-device run's).

        No weight is gathered: each rank compares its own pieces; on the distributed executor the maximum is
        all-reduced (collective: every rank calls it and gets the same number).
        """
        return self._piece_error({w: forward_id(w) for w in self.dg.pcg.graph.weights}, reference)

    def grad_error(self, reference: Mapping[str, torch.Tensor]) -> float:
        """As :meth:`weight_error`, for the gradients the last step's updates used: every piece of every replica
        against ``reference`` (full gradients by weight name, e.g. eager PyTorch's ``p.grad``). Collective on the
        distributed executor."""
        return self._piece_error(self.grad_values, reference)

    def _piece_error(self, values: Mapping[str, str], reference: Mapping[str, torch.Tensor]) -> float:
        """The largest |piece − its block of ``reference[name]``| over every piece held here of each value of
        ``values`` (name → value id), maximised over the ranks."""
        err = 0.0
        for name, vid in values.items():
            v = self.dg.values[vid]
            p = v.sharding.parallel_shape(v.group, v.type.shape)
            full = reference[name].detach()
            for device, piece in self._pieces(vid).items():
                want = full[p.piece_slices(v.sharding.coord_of(v.group, device))]
                if piece.numel():
                    err = max(err, (piece - want).abs().max().item())
        return self._max_over_ranks(err)

    def state(self) -> dict[str, torch.Tensor]:
        """Optimizer state as full tensors by value id (``opt:<slot>:<weight>``)."""
        return {vid: self._get(vid) for vid in self.dg.state_values()}

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients the last step's updates used, as full tensors by weight name."""
        return {w: self._get(g) for w, g in self.grad_values.items()}
