"""Buffer reuse (docs/execution.md#executors): what an executor may do with the buffers of one rank's program
(:class:`~shardflow.lower.program.Program`), from the program alone — which communications send their buffer
itself instead of a copy (:func:`shared_sends`), which gradient sums accumulate into their first input
(:func:`inplace_sums`), which receives go into slots kept from step to step (:func:`kept_receives`), and which
chunks are assembled in place in their concat's buffer (:func:`ring_regions`, :func:`in_place_product`);
:func:`buffer_reuse` answers all of them in one pass (:class:`Reuse`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Collection, Mapping

from shardflow.graph.ops import Linear, Matmul
from shardflow.lower.program import (
    Block,
    Comm,
    Compute,
    Convert,
    Forward,
    Free,
    Keep,
    Program,
    Sum,
    Update,
    Vjp,
    Wait,
    reads,
)
from shardflow.parallel.collectives import CommKind

# --- which communications may use their send buffer itself ------------------------------------------------------
# Communications that may hand their send buffer to the backend as it is: a reduction (all-reduce, reduce) then
# overwrites it with the result, a broadcast root only reads it (its result at the root is that buffer itself).
SHARING_KINDS = (CommKind.ALL_REDUCE, CommKind.REDUCE, CommKind.BROADCAST)


def _aliased(i: Compute) -> tuple[tuple[int, ...], ...]:
    """Per output of compute ``i``, the inputs whose storage its kernel may return it in: the input itself, a
    view of it, or the input updated in place (:mod:`shardflow.runtime.kernels`, :func:`local_move`). A table by
    kernel kind, conservative where a kernel may or may not copy: an op not known to be ``fresh`` may alias every
    input; a vjp's gradients are linear in the output gradients and, unless the op is known to have ``fresh_grads``,
    may be those (an add's, a view's backward), never a forward input."""
    every, none = tuple(range(len(i.ins))), ()
    spec = i.kernel
    if isinstance(spec, Forward):
        per = none if spec.local.op.fresh else every
    elif isinstance(spec, Vjp):
        per = none if spec.local.op.fresh_grads else tuple(range(len(spec.grad_mask), len(i.ins)))
    elif isinstance(spec, Update):  # new weight, new state slots: the old ones, updated in place
        return ((0,),) + tuple((2 + s,) for s in range(len(spec.slots)))
    elif isinstance(spec, Sum):
        per = every if len(i.ins) == 1 else none
    elif isinstance(spec, Convert):
        per = every if i.ins[0].type.dtype == i.outs[0].type.dtype else none
    elif isinstance(spec, (Keep, Block)) or (spec is None and i.op in ("chunk", "unpack")):
        per = every
    else:  # OnesLike, SumOfSquares; concat (a ring's shares the storage of its received chunks: _sharing), add,
        # pack, ungather: new tensors
        per = none
    return (per,) * len(i.outs)


def shared_sends(program: Program, recorded: Collection[tuple[str, int]]) -> frozenset[int]:
    """Tokens of the communications of ``program`` (kinds :data:`SHARING_KINDS`) that may use their send buffer
    itself instead of a copy: an all-reduce or reduce whose send buffer is dead after it (reduced in place), a
    broadcast root's buffer (sent as it is). ``recorded``: the (PCG node, microbatch) pairs whose forward kernel
    keeps its autograd graph, outputs included, until the backward of the node (the executor's choice:
    :func:`~shardflow.runtime.kernels.records_graph`).

    A buffer may be overwritten by a communication issued at instruction k when no buffer that may share its
    storage is read after k — by an instruction, by a forward's recorded autograd graph (read again by the
    backward of its node), or by an earlier communication still in flight —, outlives the step (never freed:
    weights, optimizer state, the gradients the updates read, the loss) or was placed by the executor (the
    program's inputs: the step's data may be the caller's tensors). Storage is shared along compute kernels
    that return inputs or views of them (:func:`_aliased`), optimizer updates (in place) and the communications
    chosen here (the result is the send buffer). A broadcast root that is not the last reader of its buffer
    sends it as it is too, and its result shares the buffer, unless an optimizer update later overwrites one of
    them while the other is still read (a received value must never alias a buffer updated in place); then every
    broadcast root whose buffer is read afterwards sends a copy.
    """
    return buffer_reuse(program, recorded).sends


def inplace_sums(program: Program, recorded: Collection[tuple[str, int]]) -> frozenset[str]:
    """The outputs of the gradient sums (:class:`Sum` computes of several inputs) of ``program`` that may be
    accumulated into their first input's buffer (``x0 += x1 + ...``, as autograd accumulates ``.grad``) instead of a
    new one: that buffer, and every buffer sharing its storage, is dead after the sum (under the same rules as
    :func:`shared_sends`: not read later, not kept by a recorded autograd graph, not in flight, not persistent, not a
    placed input), it has the output's type, and no other input of the sum shares its storage. The microbatches'
    running sums of weight gradients are such sums."""
    return buffer_reuse(program, recorded).sums


def ring_regions(program: Program) -> dict[str, tuple[int, int]]:
    """The chunks of ring all-gathers, and of the outputs of the linears fused into all-gather loops, that are
    assembled in place: value → (index of the ``concat`` compute that joins them, the chunk's place in it), for
    every input of such a concat that a collective-permute step with a ``dim`` receives (communication lowering's
    ring all-gather) or that a fused linear or product by a matrix computes (:func:`in_place_product`). An executor
    stores the concat's output with the gathered dim first, so each block is contiguous, allocated when the first
    chunk is received or computed; each chunk is received or computed straight into its block, and the concat only
    copies in the chunks that are not (the rank's own, for the gathered value) and returns the buffer with the dim
    back in place."""
    received = {c.recv.value for c in program.comms if c.kind == CommKind.PERMUTE and c.dim is not None}
    computed = {i.outs[0].value for i in program.instrs if isinstance(i, Compute) and in_place_product(i)}
    return {
        b.value: (k, j)
        for k, i in enumerate(program.instrs)
        if isinstance(i, Compute) and i.op == "concat" and not i.dnode
        for j, b in enumerate(i.ins)
        if b.value in received or b.value in computed
    }


def in_place_product(i: Compute) -> bool:
    """Whether compute ``i`` may write its output into a given buffer: the forward of a linear (``x @ W.T + b``) or
    of a product by a matrix (``x @ W``, ``W`` 2-D), with no input or output scale."""
    spec = i.kernel
    return (
        isinstance(spec, Forward)
        and spec.draw is None
        and (isinstance(spec.local.op, Linear) or (isinstance(spec.local.op, Matmul) and i.ins[1].type.ndim == 2))
        and spec.local.out_scale == 1.0
        and all(s == 1.0 for s in spec.local.in_scale)
    )


def kept_receives(program: Program, recorded: Collection[tuple[str, int]]) -> dict[int, int]:
    """Receive slots: token → slot, for the communications of ``program`` whose received buffer, and every buffer
    that may share its storage (under the rules of :func:`shared_sends`), is freed within the step. An executor
    receives those into buffers it keeps from step to step (one per slot, allocated once, as DDP keeps its buckets
    and a caching allocator its blocks) instead of new ones each step. Two communications share a slot only when
    their received values have the same number of elements and dtype and the first one's storage is no longer needed
    (read, kept by a recorded autograd graph, in flight, or held) when the second is issued: interval colouring in
    program order, so a program holds as many slots of a size as it has such receives live at once. The chunks of a
    ring all-gather received in place (:func:`ring_regions`) share the slot of the whole gathered value, taken when
    the first of them is issued.

    A communication whose result is its send buffer (:func:`shared_sends`) receives nothing; a received value that
    outlives the step (a gathered weight kept as the new weight, a gradient an update reads) or that an optimizer
    update overwrites in place gets no slot."""
    return buffer_reuse(program, recorded).kept


@dataclass(frozen=True)
class Reuse:
    """What an executor may do with its buffers (:func:`buffer_reuse`): ``sends``, the tokens of
    :func:`shared_sends`; ``sums``, the values of :func:`inplace_sums`; ``kept``, the receive slots of
    :func:`kept_receives`; ``regions``, the program's :func:`ring_regions`."""

    sends: frozenset[int]
    sums: frozenset[str]
    kept: Mapping[int, int]
    regions: Mapping[str, tuple[int, int]]


def buffer_reuse(program: Program, recorded: Collection[tuple[str, int]]) -> Reuse:
    """:func:`shared_sends`, :func:`inplace_sums` and :func:`kept_receives` of ``program`` in one pass (what an
    executor asks, once): broadcast roots send their buffer as it is unless an optimizer update would then
    overwrite storage another buffer still reads."""
    reuse, clash = _sharing(program, recorded, live_roots=True)
    return _sharing(program, recorded, live_roots=False)[0] if clash else reuse


def _sharing(program: Program, recorded: Collection[tuple[str, int]], live_roots: bool) -> tuple[Reuse, bool]:
    """The pass of :func:`buffer_reuse` over ``program``: what it chose, and whether an optimizer update overwrites a
    buffer whose storage another buffer still read shares. ``live_roots``: broadcast roots send their buffer as it
    is even when it is read afterwards."""
    instrs = program.instrs
    regions = ring_regions(program)
    joins = {k for k, _ in regions.values()}
    freed = {v for i in instrs if isinstance(i, Free) for v in i.values} - {b.value for b in program.inputs}
    last: dict[str, int] = {}  # value → the last instruction that reads it
    for k, i in enumerate(instrs):
        for b in reads(i):
            last[b.value] = k
    backward = {i.saved_as: k for k, i in enumerate(instrs) if isinstance(i, Compute) and isinstance(i.kernel, Vjp)}
    for i in instrs:  # a recorded forward's outputs live in its autograd graph until the backward of its node
        if (
            isinstance(i, Compute)
            and isinstance(i.kernel, Forward)
            and i.saved_as in recorded
            and i.saved_as in backward
        ):
            for b in i.outs:
                last[b.value] = max(last.get(b.value, -1), backward[i.saved_as])
    group: dict[str, list[str]] = {}  # value → the values that may share its storage (one list per class)

    def union(a: str, b: str) -> None:
        ga, gb = group.setdefault(a, [a]), group.setdefault(b, [b])
        if ga is not gb:
            ga.extend(gb)
            for u in gb:
                group[u] = ga

    def free_after(v: str, k: int, spare: str = "") -> bool:  # no buffer sharing v's storage is needed after k
        same = group.get(v, [v])
        return all(u not in same for u in in_flight.values()) and all(
            u == spare or (u in freed and last.get(u, -1) <= k) for u in same
        )

    in_flight: dict[int, str] = {}  # token → the send buffer of a communication issued, not waited
    chosen: set[int] = set()
    sums: set[str] = set()
    clash = False
    for k, i in enumerate(instrs):
        if isinstance(i, Wait):
            in_flight.pop(i.token, None)
        elif isinstance(i, Compute):
            if isinstance(i.kernel, Update):  # overwrites the weight and state slots it was given
                for j in (0, *range(2, 2 + len(i.kernel.slots))):
                    clash |= not free_after(i.ins[j].value, k, spare=i.ins[j].value)
            if isinstance(i.kernel, Sum) and len(i.ins) > 1 and i.ins[0].type == i.outs[0].type:
                first = group.get(i.ins[0].value, [i.ins[0].value])
                if free_after(i.ins[0].value, k) and not any(x.value in first for x in i.ins[1:]):
                    sums.add(i.outs[0].value)
                    union(i.outs[0].value, i.ins[0].value)
            for b, per in zip(i.outs, _aliased(i)):
                for j in per:
                    union(b.value, i.ins[j].value)
            for b in i.ins if k in joins else ():  # a ring's concat: assembled in the storage of its received chunks
                if b.value in regions:
                    union(i.outs[0].value, b.value)
        elif isinstance(i, Comm):
            if i.send is not None and i.kind in SHARING_KINDS:
                reads_only = i.kind == CommKind.BROADCAST and (live_roots or i.recv is None)
                if reads_only or free_after(i.send.value, k):
                    chosen.add(i.token)
                    if i.recv is not None:
                        union(i.recv.value, i.send.value)
            if i.send is not None and not i.wait:
                in_flight[i.token] = i.send.value
    slots = _slots(program, chosen, freed, last, group, regions)
    return Reuse(frozenset(chosen), frozenset(sums), slots, regions), clash


def _slots(
    program: Program,
    chosen: Collection[int],
    freed: Collection[str],
    last: Mapping[str, int],
    group: Mapping[str, list[str]],
    regions: Mapping[str, tuple[int, int]],
) -> dict[int, int]:
    """:func:`kept_receives` from :func:`_sharing`'s pass: its storage classes (``group``), the last reader of each
    value (``last``, recorded autograd graphs included), the values freed in the step and the ring chunks received
    in place (``regions``)."""
    instrs = program.instrs
    end = dict(last)  # value → the last instruction that needs its storage: a read, its free, the wait of its send
    waits = {i.token: k for k, i in enumerate(instrs) if isinstance(i, Wait)}
    for k, i in enumerate(instrs):
        for v in i.values if isinstance(i, Free) else ():
            end[v] = max(end.get(v, -1), k)
        if isinstance(i, Comm) and i.send is not None and not i.wait:
            end[i.send.value] = max(end.get(i.send.value, -1), waits.get(i.token, len(instrs)))
    slots: dict[int, int] = {}
    whole: dict[int, int] = {}  # a ring's concat → the slot its chunks are received in
    idle: dict[tuple[int, str], list[int]] = {}  # (elements, dtype) → slots free to take
    busy: list[tuple[int, int, tuple[int, str]]] = []  # heap of (the last instruction needing it, slot, its size)
    n = 0
    for k, i in enumerate(instrs):
        while busy and busy[0][0] < k:
            _, slot, size = heapq.heappop(busy)
            idle[size].append(slot)
        if not isinstance(i, Comm) or i.recv is None or i.token in chosen:
            continue
        same = group.get(i.recv.value, [i.recv.value])
        if i.recv.value in regions and regions[i.recv.value][0] in whole:
            slots[i.token] = whole[regions[i.recv.value][0]]
        elif all(u in freed for u in same):
            t = instrs[regions[i.recv.value][0]].outs[0].type if i.recv.value in regions else i.recv.type
            size = (t.numel, t.dtype)
            free = idle.setdefault(size, [])
            if free:
                slot = free.pop()
            else:
                slot, n = n, n + 1
            slots[i.token] = slot
            if i.recv.value in regions:
                whole[regions[i.recv.value][0]] = slot
            heapq.heappush(busy, (max(end.get(u, k) for u in same), slot, size))
    return slots
