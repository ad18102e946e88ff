"""The one executor interface: load full weights and optimizer state (or only the pieces held here, read in place:
:meth:`Executor.load_pieces`), run steps, read full results or the pieces held here (:meth:`Executor.held_pieces`).

:class:`~shardflow.runtime.local.LocalExecutor` (every rank in this process) and
:class:`~shardflow.runtime.distributed.DistributedExecutor` (this rank on torch.distributed) implement how a
value's pieces are put and gathered (``_put`` / ``_get``), which devices run here (``_here``), which pieces are held
here (``_pieces``) and how pieces are taken as buffers (``_place``), how a number is reduced over the ranks
(``_max_over_ranks``) or gathered from every process (:meth:`Executor.per_process`) and how a step runs; everything
else is here.

Both take the run's ``seed``: random ops (dropout) draw as a pure function of (seed, step, node, global element
index), so any strategy draws what one device draws (:mod:`shardflow.graph.rng`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from shardflow.graph.fused import as_module, stored
from shardflow.graph.ops import torch_dtype
from shardflow.lower.dynamic import DynamicGraph, NodeKind, ValueRole, forward_id
from shardflow.runtime.batch import split_batch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# a piece of a value and the offsets of its block in the full tensor (per dim, the index of its first element)
Block = tuple[tuple[int, ...], torch.Tensor]


class _Cast:
    """A full value ``src`` (a tensor, or anything indexed by blocks) whose blocks are read in ``dtype``."""

    def __init__(self, src, dtype: torch.dtype):
        self.src, self.dtype = src, dtype

    def __getitem__(self, index) -> torch.Tensor:
        return self.src[index].to(self.dtype)


class _Zeros:
    """A full value of zeros of ``shape`` (optimizer state loaded without a checkpoint) whose blocks are made as they
    are read: no tensor of the whole shape (a sharded weight's state is never whole on a device)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = tuple(shape), dtype

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        size = [len(range(*i.indices(n))) if isinstance(i, slice) else i.numel() for i, n in zip(index, self.shape)]
        return torch.zeros((*size, *self.shape[len(index) :]), dtype=self.dtype, device="cpu")


class Executor(ABC):
    """Base of both executors; its abstract methods are the interface each implements. ``dg`` is the lowered step's
    dynamic graph; ``steps_done`` counts steps; ``micro``: the micro-step the next step runs, (index, count), under
    gradient accumulation (its random ops draw as rows of the whole batch: :meth:`~shardflow.graph.rng.PieceSite.at`).
    """

    dg: DynamicGraph
    device: torch.device = torch.device("cpu")  # where every buffer lives (:mod:`shardflow.runtime.device`)
    steps_done: int = 0
    micro: tuple[int, int] = (0, 1)
    constants_placed: bool = False  # the graph's constants are placed at the first step and kept (they outlive it)
    # per rank run here: the bytes its all-to-alls of data-dependent sizes sent in the last step, measured (the
    # programs count their bound: docs/lowering.md#17-the-all-to-all-token-dispatcher---ep-dispatch-all_to_all)
    sized_sent: dict[int, int] = {}  # each step assigns its own

    def _index_updates(self) -> None:
        """After a step, each value that replaces another (an update's new weight and state, a micro-step's new
        sum of gradient contributions) takes its place (``renames``); the gradient each update used stays
        readable (``grad_values``)."""
        self.renames = [(new, v.replaces) for new, v in self.dg.values.items() if v.replaces]
        self.grad_values = {n.src: n.inputs[1] for n in self.dg.nodes if n.kind == NodeKind.UPDATE}

    @abstractmethod
    def _put(self, vid: str, full: torch.Tensor) -> None:
        """Place the pieces of value ``vid`` cut from its full tensor."""

    @abstractmethod
    def _get(self, vid: str) -> torch.Tensor:
        """The full tensor of value ``vid`` (on the distributed executor: collective, every rank calls it)."""

    def _get_many(self, vids: list[str]) -> list[torch.Tensor]:
        """The full tensors of ``vids``, in order (:meth:`_get` of each; the distributed executor packs them into one
        collective)."""
        return [self._get(v) for v in vids]

    @abstractmethod
    def _pieces(self, vid: str) -> dict[int, torch.Tensor]:
        """Device → its piece of value ``vid``, for every device of this executor that holds one."""

    @abstractmethod
    def _here(self) -> tuple[int, ...]:
        """The devices whose programs this executor runs."""

    @abstractmethod
    def _place(self, vid: str, pieces: Mapping[int, torch.Tensor]) -> None:
        """Hold ``pieces`` (device of this executor → its piece of value ``vid``) as the value's buffers."""

    @abstractmethod
    def _max_over_ranks(self, x: float) -> float:
        """The largest ``x`` over the ranks (on the distributed executor: collective, every rank calls it)."""

    @abstractmethod
    def per_process(self, x: float) -> list[float]:
        """Every process's ``x``, in rank order: one value on the local executor (every rank is this process);
        on the distributed executor one per rank (collective: every rank calls it, with the run's timeout)."""

    @abstractmethod
    def dtensors(self, values: Mapping[str, str]) -> dict[str, DTensor]:
        """The pieces of ``values`` (name → value id) held here as ``torch.distributed.tensor.DTensor`` objects (on
        the distributed executor: collective). Raises ValueError where they cannot be (the local executor: no process
        group)."""

    @abstractmethod
    def step(self, inputs: Mapping[str, torch.Tensor]) -> float:
        """One training step on full ``inputs`` (by graph input name); returns the loss."""

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
        """Place a step's data inputs (by graph input name; in a step of several microbatches each is cut along
        dim 0, microbatch m's part placed as its value of microbatch m) and, at the first step, the graph's
        constants (the programs never free them: :meth:`~shardflow.lower.dynamic.DynamicGraph.persistent`). Raises
        BatchSplitError for an input that does not split into the step's microbatches."""
        graph = self.dg.pcg.graph
        parts = split_batch({name: inputs[name] for name in graph.inputs}, self.dg.microbatches)
        for name in graph.inputs:
            for vid, part in zip(self.dg.per_microbatch(forward_id(name)), parts):
                self._put(vid, part[name])
        if not self.constants_placed:
            for name, value in graph.constants.items():
                self._put(forward_id(name), value)
            self.constants_placed = True

    def load(
        self, weights: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor] | None = None, steps_done: int = 0
    ) -> None:
        """Place the full weights (by graph name, in their module parameters' shapes: a weight the graph stores by
        parts is cut here, :func:`~shardflow.graph.fused.stored`) and optimizer ``state`` (full tensors by value
        id, as :meth:`state` returns them or in their weight's module shape; zero when None) after ``steps_done``
        steps, each in its value's dtype (a weight given in bfloat16 held in a float32 master: ``master_dtype`` of
        the lowering). Every rank passes the same. A weight may be anything indexed by blocks (``w[slices]``), as a
        lazily read or replayed one is."""
        weights = stored(self.dg.pcg.graph, weights)
        for vid in (*map(forward_id, self.dg.pcg.graph.weights), *self.dg.state_values()):
            v = self.dg.values[vid]
            dtype = torch_dtype(v.type.dtype)
            if v.role == ValueRole.FWD:
                full = weights[v.tensor]
            else:
                full = state[vid].reshape(v.type.shape) if state else _Zeros(v.type.shape, dtype)
            self._put(vid, full if getattr(full, "dtype", dtype) == dtype else _Cast(full, dtype))
        self.steps_done = steps_done

    def load_pieces(
        self, dtypes: Mapping[str, torch.dtype], read: Callable[[dict[str, list[Block]]], None], steps_done: int = 0
    ) -> None:
        """Load values without any full tensor: allocate the pieces this executor holds of each value of ``dtypes``
        (value id → dtype: weights by forward id, optimizer state by value id) — every replica held here, each at
        its piece's shape —, let ``read`` fill them in place (it gets value id → the pieces with the offsets of
        their blocks, as :meth:`held_pieces` lists them; e.g. a sharded checkpoint's load), then hold them as the
        values' buffers, after ``steps_done`` steps. If ``read`` raises, nothing is held. Raises ValueError for a
        partial value (as :meth:`held_pieces`)."""
        here = set(self._here())
        new: dict[str, dict[int, torch.Tensor]] = {}
        for vid, dtype in dtypes.items():
            v = self.dg.values[vid]
            p = v.sharding.parallel_shape(v.group, v.type.shape)
            alloc = torch.zeros if p.uneven else torch.empty  # the padding of a short block stays zero
            new[vid] = {
                d: alloc(p.piece_shape, dtype=dtype, device=self.device) for d in v.group.devices() if d in here
            }
        read({vid: self._blocks(vid, pieces, replica0_only=False) for vid, pieces in new.items()})
        for vid, pieces in new.items():
            self._place(vid, pieces)
        self.steps_done = steps_done

    def held_pieces(self, vid: str, replica0_only: bool) -> list[Block]:
        """The pieces of value ``vid`` held here, each with the offsets of its block in the full tensor (the block
        has the piece's shape: ``ParallelTensorShape.piece_slices``), in device order. ``replica0_only``: only
        replica 0 of each block — over every rank those tile the full tensor once (what a checkpoint writes); else
        every replica held here. The tensors are the executor's buffers, not copies. Raises ValueError for a
        partial value (sum degree > 1): its pieces are not blocks of the full tensor."""
        return self._blocks(vid, self._pieces(vid), replica0_only)

    def _blocks(self, vid: str, pieces: Mapping[int, torch.Tensor], replica0_only: bool) -> list[Block]:
        """``pieces`` (device → its piece of value ``vid``) with the offsets of their blocks, in device order; only
        replica 0's with ``replica0_only``."""
        v = self.dg.values[vid]
        p = v.sharding.parallel_shape(v.group, v.type.shape)
        if p.sum_degree > 1:
            raise ValueError(
                f"value {vid} is partial ({p}: each block is the {p.reduce_op} of {p.sum_degree} "
                f"pieces), so its pieces are not blocks of the full tensor; reduce it first"
            )
        if p.head_tail:
            raise ValueError(f"value {vid} ({p}) is stored in head-tail order, so its pieces are not blocks")
        out = []
        for d in sorted(pieces):
            c = v.sharding.coord_of(v.group, d)
            if c.replica == 0 or not replica0_only:  # a short block of an uneven dim: its part, a view
                out.append((tuple(s.start for s in p.piece_slices(c)), p.valid_of(pieces[d], c)))
        return out

    def weights(self) -> dict[str, torch.Tensor]:
        """Full weights by graph name (= the module's parameter names) in the module parameters' shapes, read from
        replica 0 of each block, on the CPU (as every full tensor an executor hands out: :meth:`state`,
        :meth:`grads`)."""
        graph = self.dg.pcg.graph
        return as_module(graph, {w: self._get(forward_id(w)) for w in graph.weights})

    def weight_error(self, reference: Mapping[str, torch.Tensor]) -> float:
        """The largest |piece − the same block of ``reference``| (in the weights' units) over every piece of every
        weight held here — every replica, not replica 0 alone as :meth:`weights` reads, so replicas that drifted
        apart show. ``reference``: full weights by graph name in the module parameters' shapes (e.g. the
        single-device run's).

        No weight is gathered: each rank compares its own pieces; on the distributed executor the maximum is
        all-reduced (collective: every rank calls it and gets the same number).
        """
        return self._piece_error({w: forward_id(w) for w in self.dg.pcg.graph.weights}, reference)

    def grad_error(self, reference: Mapping[str, torch.Tensor]) -> float:
        """As :meth:`weight_error`, for the gradients the last step's updates used: every piece of every replica
        against ``reference`` (full gradients by weight name, e.g. eager PyTorch's ``p.grad``). Collective on the
        distributed executor. A weight the step computes no gradient for (no update: as the plan sees it, nothing
        it feeds reaches the loss) counts its whole reference gradient, so a gradient eager PyTorch has and the plan
        lost is an error, not a weight left out of the comparison."""
        lost = max(
            (
                float(g.abs().max())
                for w, g in reference.items()
                if w in self.dg.pcg.graph.weights and w not in self.grad_values and g.numel()
            ),
            default=0.0,
        )
        return max(lost, self._piece_error(self.grad_values, reference))

    def _piece_error(self, values: Mapping[str, str], reference: Mapping[str, torch.Tensor]) -> float:
        """The largest |piece − its block of ``reference[name]``| over every piece held here of each value of
        ``values`` (name → value id), maximised over the ranks."""
        err = 0.0
        reference = stored(self.dg.pcg.graph, {name: reference[name].detach() for name in values})
        for name, vid in values.items():
            full = reference[name]
            for start, piece in self.held_pieces(vid, replica0_only=False):
                if piece.numel():
                    want = full[tuple(slice(s, s + n) for s, n in zip(start, piece.shape))].to(piece.device)
                    err = max(err, (piece - want).abs().max().item())
        return self._max_over_ranks(err)

    def statistics(self) -> dict[str, list[torch.Tensor]]:
        """The last step's batch statistics that buffer updates read (``BufferUpdate.stat`` → one full tensor per
        microbatch, in order; e.g. a batch norm's mean over the whole batch, however the batch is sharded). On the
        distributed executor: collective."""
        got = iter(self._get_many([v for vids in self.dg.buffer_stats.values() for v in vids]))
        return {stat: [next(got) for _ in vids] for stat, vids in self.dg.buffer_stats.items()}

    def expert_loads(self) -> dict[str, torch.Tensor]:
        """The last step's tokens routed to each expert, per expert layer (graph output → ``[E]`` counts summed
        over the step's microbatches and over the whole batch, however it is sharded); {} for a model without
        expert layers. On the distributed executor: collective."""
        loads = self.dg.expert_loads
        got = iter(self._get_many([v for vids in loads.values() for v in vids]))
        return {t: torch.stack([next(got) for _ in vids]).sum(0) for t, vids in loads.items()}

    def state(self) -> dict[str, torch.Tensor]:
        """Optimizer state as full tensors by value id (``opt:<slot>:<weight>``)."""
        return {vid: self._get(vid) for vid in self.dg.state_values()}

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients the last step's updates used, as full tensors by weight name (modules' shapes)."""
        return as_module(self.dg.pcg.graph, {w: self._get(g) for w, g in self.grad_values.items()})
