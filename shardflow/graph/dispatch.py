"""The local pieces of an expert layer under the all-to-all token dispatcher
(docs/lowering.md#17-the-all-to-all-token-dispatcher---ep-dispatch-all_to_all): what each rank of an ``ep`` group
of ``d`` members computes around the two data-dependent all-to-alls that take its tokens to their experts' ranks
and the results back. Rank ``p`` of the group holds the experts ``[p·E_l, (p + 1)·E_l)`` (``E_l = E / d``).

* :class:`ExpertRoute`: the rank's token-expert pairs as rows sorted by expert id — so by destination rank, then
  by that rank's expert — and how many rows go to each expert of each rank;
* :class:`ExpertsLocal`: the rank's own experts on the rows it received, which arrive by source rank, then by
  expert (the counts it received say how many of each);
* :class:`ExpertCombine`: the rows come back in the order they were sent; each token's output is the sum of its
  rows weighted by its routing weights.

Composed with the all-to-alls they compute :class:`~shardflow.graph.ops.Experts` (numbers equal one device's:
``tests/test_moe.py``). With a ``capacity`` C (``--capacity-factor``), each rank sends each expert at most C rows of
its tokens, the first C routed to it in token order (GShard's and Switch Transformer's capacity, per device), the
others dropped — they add nothing to their token's output —, and every buffer has a fixed size: C rows per expert,
unused slots zero. Each is differentiable by autograd in its floating inputs; the executors record and
differentiate them as any op (their integer outputs carry no gradient). The rows a rank receives depend on the
routing: a buffer holding them is typed with its bound (every pair of every member's tokens that can reach this
rank), and the executors allocate the rows that arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from shardflow.graph.ops import Op, OpError, TensorType, _expect, expert_mlp


def _sorted_pairs(idx: torch.Tensor) -> torch.Tensor:
    """The token-expert pairs of ``idx [n, K]`` (flattened: pair j is token j // K's slot j % K), stably sorted by
    expert id: ``[n·K]`` int64, the pair of each row."""
    return torch.argsort(idx.reshape(-1), stable=True)


def _kept(idx: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Under ``capacity`` C: the sorted pairs (:func:`_sorted_pairs`) each expert keeps — its first C in token order
    — and the slot of each, ``expert · C + its place among the expert's pairs``."""
    pair = _sorted_pairs(idx)
    expert = idx.reshape(-1)[pair]
    first = torch.searchsorted(expert, expert)  # where each expert's run of pairs starts
    place = torch.arange(len(pair), device=idx.device) - first
    keep = place < capacity
    return pair[keep], (expert * capacity + place)[keep]


@dataclass(frozen=True, slots=True)
class ExpertRoute(Op):
    """Inputs x ``[n, H]`` (the rank's tokens) and idx ``[n, K]`` (each token's K expert ids, of
    ``E = ranks · local`` experts). Outputs the rows ``[n·K, H]``: each token once per expert it is routed to, sorted
    by expert id (stable); and the counts ``[ranks, local]`` (int64): the rows for expert e of member j at
    ``[j, e]`` — row sums are the all-to-all's send splits. With a ``capacity`` C: the rows ``[E·C, H]`` alone, slot
    ``e·C + c`` holding the c-th token routed to expert e (zeros where fewer are)."""

    kind: ClassVar[str] = "expert_route"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    ranks: int
    local: int
    capacity: int = 0

    def infer(self, ins):
        _expect(2, ins, self)
        x, idx = ins
        if x.ndim != 2 or idx.ndim != 2 or idx.shape[0] != x.shape[0] or not idx.dtype.startswith("int"):
            raise OpError(
                f"expert_route: x {list(x.shape)} and idx {list(idx.shape)} ({idx.dtype}) do not fit [n, H], [n, K]"
            )
        if self.capacity:
            return (TensorType((self.ranks * self.local * self.capacity, x.shape[1]), x.dtype),)
        return TensorType((idx.numel, x.shape[1]), x.dtype), TensorType((self.ranks, self.local), "int64")

    def compute(self, x, idx):
        k = idx.shape[1]
        if self.capacity:
            pair, slot = _kept(idx, self.capacity)
            rows = x.new_zeros((self.ranks * self.local * self.capacity, x.shape[1]))
            return (rows.index_copy(0, slot, x.index_select(0, pair // k)),)
        rows = x.index_select(0, _sorted_pairs(idx) // k)
        counts = torch.bincount(idx.reshape(-1), minlength=self.ranks * self.local).view(self.ranks, self.local)
        return rows, counts


@dataclass(frozen=True, slots=True)
class ExpertsLocal(Op):
    """The rank's ``E_l`` experts on the rows it received. Inputs: rows ``[R, H]`` (from each of the ``ranks``
    members in turn, each member's grouped by expert), counts ``[ranks, E_l]`` (int64: how many rows of each member
    for each expert), w1 ``[E_l, 2I, H]`` and w2 ``[E_l, H, I]`` (``transposed``: ``[E_l, H, 2I]``, ``[E_l, I, H]``) as
    :class:`~shardflow.graph.ops.Experts`. Output ``[R, H]``: each row through its expert. ``balanced``: the rows a
    rank receives when the routing is balanced (n·K), which :mod:`shardflow.graph.flops` counts — ``R`` is only
    known when the step runs. With a ``capacity`` C: no counts; the rows ``[ranks · E_l · C, H]``, C per expert of
    each member in turn (row r is expert (r // C) mod E_l's), every one computed."""

    kind: ClassVar[str] = "experts_local"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    act: str = "silu"
    transposed: bool = False
    balanced: int = 0
    capacity: int = 0

    def infer(self, ins):
        if self.capacity:
            _expect(3, ins, self)
            rows, w1, w2 = ins
            counts = TensorType((rows.shape[0] // (w1.shape[0] * self.capacity), w1.shape[0]), "int64")
        else:
            _expect(4, ins, self)
            rows, counts, w1, w2 = ins
        if rows.ndim != 2 or counts.ndim != 2 or counts.shape[1] != w1.shape[0] or w1.shape[0] != w2.shape[0]:
            raise OpError(
                f"experts_local: rows {list(rows.shape)}, counts {list(counts.shape)}, w1 {list(w1.shape)}, w2 "
                f"{list(w2.shape)} do not fit [R, H], [ranks, E_l], [E_l, 2I, H], [E_l, H, I]"
            )
        return (rows,)

    def compute(self, rows, *weights):
        counts, w1, w2 = (None, *weights) if self.capacity else weights
        if self.transposed:
            w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
        if counts is None:  # [members, E_l, C, H]: each expert on its C rows of every member
            slots = rows.view(-1, w1.shape[0], self.capacity, rows.shape[1])
            out = [expert_mlp(self.act, slots[:, e].reshape(-1, rows.shape[1]), w1[e], w2[e]) for e in range(len(w1))]
            return (torch.stack([y.view(slots[:, 0].shape) for y in out], 1).view(rows.shape).to(rows.dtype),)
        local = counts.shape[1]
        expert = torch.arange(local, device=rows.device).repeat(counts.shape[0])
        expert = expert.repeat_interleave(counts.reshape(-1), output_size=rows.shape[0])
        out = torch.zeros_like(rows)
        for e in range(local):
            at = torch.nonzero(expert == e).squeeze(1)
            out = out.index_copy(0, at, expert_mlp(self.act, rows[at], w1[e], w2[e]).to(rows.dtype))
        return (out,)


@dataclass(frozen=True, slots=True)
class ExpertCombine(Op):
    """Inputs: the rows ``[n·K, H]`` back from the experts, in :class:`ExpertRoute`'s order, idx ``[n, K]`` and the
    routing weights w ``[n, K]``. Output ``[n, H]``: ``out[t] = Σ_k w[t, k] · row(t, k)``, in the rows' dtype. With
    a ``capacity`` C: the rows ``[E·C, H]`` in the slots :class:`ExpertRoute` gave them, a dropped pair adding
    nothing."""

    kind: ClassVar[str] = "expert_combine"
    fresh: ClassVar[bool] = True
    fresh_grads: ClassVar[bool] = True
    capacity: int = 0

    def infer(self, ins):
        _expect(3, ins, self)
        rows, idx, w = ins
        if rows.ndim != 2 or idx.shape != w.shape or (rows.shape[0] != idx.numel and not self.capacity):
            raise OpError(
                f"expert_combine: rows {list(rows.shape)}, idx {list(idx.shape)}, w {list(w.shape)} do not fit "
                "[n·K, H], [n, K], [n, K]"
            )
        return (TensorType((idx.shape[0], rows.shape[1]), rows.dtype),)

    def compute(self, rows, idx, w):
        if self.capacity:
            pair, slot = _kept(idx, self.capacity)
            rows = rows.index_select(0, slot)
        else:
            pair = _sorted_pairs(idx)
        weighted = (rows * w.reshape(-1)[pair, None]).to(rows.dtype)
        out = rows.new_zeros((idx.shape[0], rows.shape[1]))
        return (out.index_add(0, pair // idx.shape[1], weighted),)
