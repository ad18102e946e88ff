"""Per-rank programs: the instruction streams lowering produces and executors run.

A program is a tuple of instructions for one rank, in issue order. Two kinds:

* :class:`Compute` — run a local kernel on pieces held by this rank (forward, backward, loss seed, optimizer
  update, or a local data movement such as taking one's own block);
* :class:`Comm` — one communication, identified by its **token** (its position in the one global order of
  all communications). Every member of a communication holds a ``Comm`` with the same token, kind family,
  members, shape and dtype; each rank issues its communications in increasing token order.

A program is self-contained: each compute carries its kernel's description (:data:`KernelSpec`: the rule's
local op, a random op's piece site, the gradient masks, the optimizer's state slots), and the program carries
the process groups every rank creates (:class:`Group`), so an executor needs nothing else of the plan to run it.

Programs print as listings a person can read (Alpa-style instruction streams) and serialise to JSON.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass
from typing import Any, Collection, Mapping

from shardflow.graph.ops import Linear, Matmul, TensorType
from shardflow.graph.rng import PieceSite
from shardflow.lower.dynamic import TaskType
from shardflow.parallel.collectives import KINDS, CommKind
from shardflow.parallel.mesh import Mesh, ReduceOp
from shardflow.parallel.rules import LocalOp


@dataclass(frozen=True, slots=True)
class Buffer:
    """A piece held by one rank: ``value`` names the dynamic-graph value (``fwd:h``, ``grad:h``, ...)."""

    value: str
    type: TensorType

    def __str__(self) -> str:
        return f"{self.value}:{self.type.dtype}{list(self.type.shape)}"


# --- kernel descriptions: what a compute of a dynamic-graph node runs, with everything it needs ----------------
@dataclass(frozen=True, slots=True)
class Forward:
    """A compute op's forward: ``local`` (the rule's local op) on this rank's pieces. ``draw``: for a random op
    (dropout), where this rank's piece of the output lies. ``record``: when the op has a backward, which inputs
    get a gradient (the forward may record its autograd graph for them); empty otherwise."""

    local: LocalOp
    draw: PieceSite | None
    record: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class Vjp:
    """A compute op's backward: the vjp of ``local`` (``draw`` as in :class:`Forward`). Reads the op's inputs,
    then the gradients of its outputs where ``dy_mask[k]``; writes the gradient of input i where
    ``grad_mask[i]``, multiplied by ``unscale[i]`` (undoing a linearity scale), in ``dtypes`` (one per gradient
    written: its input's dtype, or a weight's master dtype under mixed precision)."""

    local: LocalOp
    draw: PieceSite | None
    grad_mask: tuple[bool, ...]
    unscale: tuple[float, ...]
    dy_mask: tuple[bool, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class OnesLike:
    """The loss seed: ``scale`` (1, or 1/N in each of N accumulated micro-steps) in the loss piece's shape."""

    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Sum:
    """Gradient accumulation: the element-wise sum of the inputs."""


@dataclass(frozen=True, slots=True)
class Update:
    """An optimizer step on one shard: reads the weight, its gradient, the state ``slots`` (names, in order) and,
    when ``clip`` > 0, the squared global gradient norm; writes the new weight and state."""

    slots: tuple[str, ...]
    clip: float


@dataclass(frozen=True, slots=True)
class SumOfSquares:
    """The sum of the squares of every input piece (a partial squared gradient norm), a scalar."""


@dataclass(frozen=True, slots=True)
class Keep:
    """The input piece itself: a copy whose piece is already here, Replicate's backward keeping the root's copy,
    a parallel op along an axis of one device."""


@dataclass(frozen=True, slots=True)
class Block:
    """A Repartition of replicas: this rank keeps block ``index`` of ``degree`` equal blocks along ``dim``."""

    dim: int
    degree: int
    index: int


@dataclass(frozen=True, slots=True)
class Convert:
    """A weight held in a master dtype converted to ``dtype``, its dtype in the graph (mixed precision)."""

    dtype: str


KernelSpec = Forward | Vjp | OnesLike | Sum | Update | SumOfSquares | Keep | Block | Convert


@dataclass(frozen=True, slots=True)
class Compute:
    """Run ``op`` on this rank: ``node`` is the PCG node, ``dnode`` the dynamic-graph node whose kernel runs,
    ``kernel`` that kernel's description (None for the data movements of :data:`LOCAL_MOVES`, which ``op`` and
    ``dim`` describe), ``micro`` the microbatch it works on (:attr:`DNode.micro`): a forward and the backward of
    its node in the same microbatch share a recorded autograd graph (:attr:`saved_as`)."""

    pass_: TaskType
    node: str
    op: str
    ins: tuple[Buffer, ...]
    outs: tuple[Buffer, ...]
    dnode: str = ""
    dim: int | None = None
    kernel: KernelSpec | None = None
    micro: int = 0

    @property
    def saved_as(self) -> tuple[str, int]:
        """The key of the autograd graph a forward records for its backward: (PCG node, microbatch)."""
        return self.node, self.micro

    def __str__(self) -> str:
        return f"      {self.pass_:<4} {', '.join(map(str, self.outs))} = {self.op}({', '.join(map(str, self.ins))})"


# Data-movement computes that have no dynamic-graph node: split a piece into chunks along ``dim``, concatenate
# chunks along ``dim``, add two buffers (the local adds of a reduce-scatter ring), pack pieces into one flat
# buffer (in the output's shape) and unpack it into views of the pieces' shapes (a gradient bucket), and ungather
# a weight bucket's gathered rows (one per rank: its packed pieces) into each member whole, its rows' pieces
# concatenated along ``dim``.
LOCAL_MOVES = ("chunk", "concat", "add", "pack", "unpack", "ungather")


@dataclass(frozen=True, slots=True)
class Comm:
    """One communication on this rank.

    ``members``: the ranks taking part, in group order (for send/recv: ``(src, dst)``; for ``permute`` the
    ring). ``peer``: the other rank of a send/recv; for a permute step the rank sent to, with ``peer_from``
    the rank received from. ``root``: the root rank of broadcast/reduce. ``send``/``recv``: this rank's
    buffers. ``nbytes``: bytes this rank sends. ``axis``: the mesh axis (or ``copy`` for a stage move).
    ``dim``: the tensor dim gathered (all-gather) or scattered (reduce-scatter); for all-to-all ``dim`` is
    the dim split into chunks and ``dim2`` the dim the received chunks are concatenated along.
    ``wait``: False when the communication is only issued here and completed by a later :class:`Wait`
    (a ring step that travels while the previous chunk is computed on). ``reduce_op``: how an all-reduce or
    reduce-scatter combines the pieces (sum, avg, max, min — the pieces' Partial op). ``value``: the
    dynamic-graph value the communication moves (its source value, or a gradient bucket), the same on every
    member; ``piece``: for a send/recv, the coordinate (sum, replica, shard per dim) of the piece moved.
    Together they are the buffer identity in the :meth:`signature`: two same-shape communications swapped
    with their tokens no longer look alike.
    """

    token: int
    kind: CommKind
    pass_: TaskType
    members: tuple[int, ...]
    type: TensorType
    nbytes: int
    axis: str = ""
    peer: int | None = None
    peer_from: int | None = None
    root: int | None = None
    send: Buffer | None = None
    recv: Buffer | None = None
    dim: int | None = None
    dim2: int | None = None
    note: str = ""
    wait: bool = True
    reduce_op: ReduceOp = ReduceOp.SUM
    value: str = ""
    piece: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        """What every member holds (:attr:`~shardflow.parallel.collectives.CommSpec.family`): send and recv are one
        communication seen from its two ends; an unknown kind (refused by the verifier) is its own."""
        spec = KINDS.get(self.kind)
        return spec.family if spec else self.kind

    def signature(self) -> tuple:
        """What every member must agree on: token, family, members, piece shape, dtype, reduce op, the
        dynamic-graph value moved and — for a send/recv, whose two ends move one piece — that piece."""
        return (self.token, self.family, self.members, self.type.shape, self.type.dtype, self.reduce_op,
                self.value, self.piece if self.kind in (CommKind.SEND, CommKind.RECV) else ())

    def __str__(self) -> str:
        who = (f"peer={self.peer}" if self.kind in (CommKind.SEND, CommKind.RECV) else
               f"to={self.peer} from={self.peer_from}" if self.kind == CommKind.PERMUTE else
               f"group={list(self.members)}" + (f" root={self.root}" if self.root is not None else ""))
        bufs = " ".join(f"{k}={b}" for k, b in (("send", self.send), ("recv", self.recv)) if b is not None)
        issue = " (async)" if not self.wait else ""
        return (f"#{self.token:<4} {self.pass_:<4} {self.kind}{issue} {who} axis={self.axis or '-'} "
                f"{self.type.dtype}{list(self.type.shape)} {self.nbytes}B {bufs}").rstrip()


@dataclass(frozen=True, slots=True)
class Wait:
    """Complete communication ``token`` issued earlier with ``wait=False``."""

    token: int

    def __str__(self) -> str:
        return f"#{self.token:<4} wait"


@dataclass(frozen=True, slots=True)
class Free:
    """Release this rank's buffers of ``values``: nothing reads them again in this step (Alpa's FREE)."""

    values: tuple[str, ...]

    def __str__(self) -> str:
        return f"      free {', '.join(self.values)}"


Instr = Compute | Comm | Wait | Free


@dataclass(frozen=True, slots=True)
class Group:
    """One process group of a plan: ``members``, the ranks in group order (the ``members`` of its communications).

    ``mesh`` and ``axis`` are set when the group is regular: its members are the devices along mesh axis ``axis``
    of ``mesh`` through one device, in coordinate order — one of the groups a ``DeviceMesh`` of ``mesh`` makes
    along that axis (a pipeline stage's axis groups are among them). Both are unset for any other set of ranks
    (a machine view's, a Replicate whose root joins from outside its axis group).
    """

    members: tuple[int, ...]
    mesh: Mesh | None = None
    axis: str = ""


@dataclass(frozen=True)
class Program:
    """The instructions of one rank, in issue order. ``inputs``: the pieces the rank holds before its first
    instruction (weights, optimizer state, the step's data and constants, placed by the executor) — with
    them the program is self-contained: every value it reads is an input, computed or received earlier.
    ``groups``: every process group of the plan, in the one order every rank creates them (torch.distributed
    needs every rank in the creation of every group, member or not)."""

    rank: int
    instrs: tuple[Instr, ...]
    inputs: tuple[Buffer, ...] = ()
    groups: tuple[Group, ...] = ()

    @property
    def comms(self) -> tuple[Comm, ...]:
        return tuple(i for i in self.instrs if isinstance(i, Comm))

    def written(self) -> dict[str, Buffer]:
        """Every buffer a compute of this program writes or a communication receives, by value."""
        out: dict[str, Buffer] = {}
        for i in self.instrs:
            if isinstance(i, Compute):
                out.update((b.value, b) for b in i.outs)
            elif isinstance(i, Comm) and i.recv is not None:
                out[i.recv.value] = i.recv
        return out

    def fingerprint(self) -> str:
        """sha256 of the ordered communications: token, kind, members/peer/root, shape, dtype, reduce op, the
        value and piece moved and this rank's send/recv buffers."""
        h = hashlib.sha256()
        for c in self.comms:
            h.update(repr((c.token, str(c.kind), c.members, c.peer, c.peer_from, c.root, c.type.shape, c.type.dtype,
                           str(c.reduce_op), c.value, c.piece, c.send, c.recv)).encode())
        return h.hexdigest()

    def bytes_by_kind(self) -> dict[tuple[str, str], int]:
        """Bytes this rank sends per step, by (communication kind, mesh axis)."""
        out: dict[tuple[str, str], int] = {}
        for c in self.comms:
            out[(c.kind, c.axis)] = out.get((c.kind, c.axis), 0) + c.nbytes
        return out

    def listing(self) -> str:
        lines = [f"rank {self.rank}: {len(self.instrs)} instructions, {len(self.comms)} communications, "
                 f"fingerprint {self.fingerprint()[:12]}"]
        lines += [f"  {i}" for i in self.instrs]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        def buf(b: Buffer | None):
            return None if b is None else {"value": b.value, "shape": list(b.type.shape), "dtype": b.type.dtype}

        instrs = []
        for i in self.instrs:
            if isinstance(i, Compute):
                instrs.append({"type": "compute", "pass": i.pass_, "node": i.node, "op": i.op,
                               "ins": [buf(b) for b in i.ins], "outs": [buf(b) for b in i.outs]})
            elif isinstance(i, Wait):
                instrs.append({"type": "wait", "token": i.token})
            elif isinstance(i, Free):
                instrs.append({"type": "free", "values": list(i.values)})
            else:
                instrs.append({"type": "comm", "token": i.token, "kind": i.kind, "pass": i.pass_,
                               "members": list(i.members), "shape": list(i.type.shape), "dtype": i.type.dtype,
                               "bytes": i.nbytes, "axis": i.axis, "peer": i.peer, "peer_from": i.peer_from,
                               "root": i.root, "send": buf(i.send), "recv": buf(i.recv), "wait": i.wait,
                               "reduce_op": i.reduce_op, "value": i.value, "piece": list(i.piece)})
        totals: dict[str, dict[str, int]] = {}
        for (kind, axis), n in self.bytes_by_kind().items():
            totals.setdefault(kind, {})[axis or "-"] = n
        groups = [{"members": list(g.members), "axis": g.axis} for g in self.groups]
        return {"rank": self.rank, "fingerprint": self.fingerprint(), "bytes": totals,
                "inputs": [buf(b) for b in self.inputs], "groups": groups, "instructions": instrs}


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
    return {b.value: (k, j) for k, i in enumerate(program.instrs)
            if isinstance(i, Compute) and i.op == "concat" and not i.dnode
            for j, b in enumerate(i.ins) if b.value in received or b.value in computed}


def in_place_product(i: Compute) -> bool:
    """Whether compute ``i`` may write its output into a given buffer: the forward of a linear (``x @ W.T + b``) or
    of a product by a matrix (``x @ W``, ``W`` 2-D), with no input or output scale."""
    spec = i.kernel
    return (isinstance(spec, Forward) and spec.draw is None
            and (isinstance(spec.local.op, Linear) or (isinstance(spec.local.op, Matmul) and i.ins[1].type.ndim == 2))
            and spec.local.out_scale == 1.0 and all(s == 1.0 for s in spec.local.in_scale))


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
        if isinstance(i, Compute) and isinstance(i.kernel, Forward) and i.saved_as in recorded and i.saved_as in backward:
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
        return (all(u not in same for u in in_flight.values())
                and all(u == spare or (u in freed and last.get(u, -1) <= k) for u in same))

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


def _slots(program: Program, chosen: Collection[int], freed: Collection[str], last: Mapping[str, int],
           group: Mapping[str, list[str]], regions: Mapping[str, tuple[int, int]]) -> dict[int, int]:
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


def reads(i: Instr) -> tuple[Buffer, ...]:
    """The buffers instruction ``i`` reads on its rank: a compute's inputs, a communication's send buffer."""
    if isinstance(i, Compute):
        return i.ins
    return (i.send,) if isinstance(i, Comm) and i.send is not None else ()


def writes(i: Instr) -> tuple[Buffer, ...]:
    """The buffers instruction ``i`` fills on its rank (an async receive: filled at its ``Wait``)."""
    if isinstance(i, Compute):
        return i.outs
    return (i.recv,) if isinstance(i, Comm) and i.recv is not None else ()


def programs_json(programs: Mapping[int, Program]) -> str:
    """The programs as JSON (``shardflow plan --format json``'s ``ranks``): each rank's :meth:`Program.to_json`, by
    rank."""
    return json.dumps({"ranks": [p.to_json() for _, p in sorted(programs.items())]}, indent=1)


def programs_fingerprint(programs: Mapping[int, Program]) -> str:
    """sha256 (hex) of :func:`programs_json`: every rank's inputs, instructions, frees, communications and process
    groups, in order. Two entry points that lower the same model on the same mesh with the same options give the
    same fingerprint (:class:`Program.fingerprint` hashes one rank's communications only)."""
    return hashlib.sha256(programs_json(programs).encode()).hexdigest()
