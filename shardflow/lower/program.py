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

Programs print as listings a person can read (Alpa-style instruction streams) and serialise to JSON. What an
executor may do with a program's buffers (send a buffer as it is, sum in place, keep receive slots from step to
step) is an analysis of its own over these instructions: :mod:`shardflow.lower.buffer_reuse`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from shardflow.graph.layout import HeadTail, Padded
from shardflow.graph.ops import TensorType
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
class BlockVjp:
    """The backward of one key/value block of a ring attention (docs/lowering.md#16-ring-attention---cp-attention-ring): ``local`` is the
    block's op (:attr:`~shardflow.graph.ops.Attention.keys_from` set). Reads q, the block's keys and values (and
    its columns of the mask), the attention's merged output and log-sum-exp, and the output gradient; writes this
    rank's queries' share of the gradients of q, of the block's keys and of its values
    (:func:`~shardflow.graph.ops.key_block_vjp`), in ``dtypes``."""

    local: LocalOp
    dtypes: tuple[str, str, str]


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
    """A Repartition of replicas: this rank keeps block ``index`` of ``degree`` equal blocks along ``dim`` — of the
    dim in head-tail order where ``layout`` says so (a whole sequence cut into the load-balanced layout's pieces,
    docs/concepts.md#the-load-balanced-layout), or padded to a multiple of ``degree`` (:class:`Padded`: an uneven
    dim, docs/concepts.md#uneven-shards)."""

    dim: int
    degree: int
    index: int
    layout: HeadTail | Padded | None = None


@dataclass(frozen=True, slots=True)
class Convert:
    """A weight held in a master dtype converted to ``dtype``, its dtype in the graph (mixed precision)."""

    dtype: str


KernelSpec = Forward | Vjp | BlockVjp | OnesLike | Sum | Update | SumOfSquares | Keep | Block | Convert


def layout_text(h: HeadTail | Padded, to_storage: bool) -> str:
    """A communication's local move of its buffers as listings and the verifier show it: ``pad(dim 0, 10↔12)``,
    ``to_head_tail(dim 1, 4 chunks)``."""
    detail = f"{h.chunks} chunks" if isinstance(h, HeadTail) else f"{h.length}↔{h.padded}"
    return f"{layout_name(h, to_storage)}(dim {h.dim}, {detail})"


def layout_name(h: HeadTail | Padded, to_storage: bool) -> str:
    """How a listing names a communication's local move of its buffers: into or out of the load-balanced layout
    (``to_head_tail``, ``to_natural``), or an uneven dim padded before sending (``pad``) or trimmed after receiving
    (``trim``)."""
    if isinstance(h, HeadTail):
        return "to_head_tail" if to_storage else "to_natural"
    return "pad" if to_storage else "trim"


@dataclass(frozen=True, slots=True)
class Compute:
    """Run ``op`` on this rank: ``task`` is the part of the step it belongs to (:class:`TaskType`: FWD, LOSS, BWD,
    UPD — not a lowering pass), ``node`` the PCG node, ``dnode`` the dynamic-graph node whose kernel runs,
    ``kernel`` that kernel's description (None for the data movements of :data:`LOCAL_MOVES`, which ``op`` and
    ``dim`` describe), ``micro`` the microbatch it works on (:attr:`DNode.micro`): a forward and the backward of
    its node in the same microbatch share a recorded autograd graph (:attr:`saved_as`)."""

    task: TaskType
    node: str
    op: str
    ins: tuple[Buffer, ...]
    outs: tuple[Buffer, ...]
    dnode: str = ""
    dim: int | None = None
    kernel: KernelSpec | None = None
    micro: int = 0

    @property
    def allocates(self) -> tuple[Buffer, ...]:
        """The outputs that take new memory: every output, except an optimizer update's, which the executors write
        into its inputs' tensors (the weight and state shards, updated in place: :func:`~shardflow.runtime.kernels.
        update_kernel`)."""
        return () if isinstance(self.kernel, Update) else self.outs

    @property
    def saved_as(self) -> tuple[str, int]:
        """The key of the autograd graph a forward records for its backward: (PCG node, microbatch)."""
        return self.node, self.micro

    def __str__(self) -> str:
        return f"      {self.task:<4} {', '.join(map(str, self.outs))} = {self.op}({', '.join(map(str, self.ins))})"


# Data-movement computes that have no dynamic-graph node: split a piece into chunks along ``dim``, concatenate
# chunks along ``dim``, add two buffers (the local adds of a reduce-scatter ring), pack pieces into one flat
# buffer (in the output's shape) and unpack it into views of the pieces' shapes (a gradient bucket), and ungather
# a weight bucket's gathered rows (one per rank: its packed pieces) into each member whole, its rows' pieces
# concatenated along ``dim``; merge two partial attention results over disjoint key blocks by their log-sum-exp
# (ring attention: :func:`~shardflow.graph.ops.lse_merge`).
LOCAL_MOVES = ("chunk", "concat", "add", "pack", "unpack", "ungather", "lse_merge")


@dataclass(frozen=True, slots=True)
class Comm:
    """One communication on this rank.

    ``task``: the part of the step it belongs to (:class:`TaskType`). ``members``: the ranks taking part, in
    group order (for send/recv: ``(src, dst)``; for ``permute`` the ring). ``peer``: the other rank of a send/recv; for a permute step the rank sent to, with ``peer_from``
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
    with their tokens no longer look alike. ``to_storage``/``to_natural``: where the communication moves a
    sequence into or out of the load-balanced layout (docs/concepts.md#the-load-balanced-layout), the send buffer's
    dim put in head-tail order before it is sent (a reduce-scatter or all-to-all onto the layout's pieces), the
    received dim put back in natural order after (an all-gather or all-to-all out of them): local moves of the
    communication's own buffers. ``splits``: for an all-to-all of data-dependent sizes (``all_to_all_v``), the two
    count buffers ``[members, *]`` (int64) this rank holds: row j of the first sums to the rows of ``send`` (along
    dim 0) it sends to member j, row j of the second to the rows it receives from member j. ``send`` and ``recv``
    are then typed with their bounds, and the verifier proves the counts are held before it is issued.
    """

    token: int
    kind: CommKind
    task: TaskType
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
    to_storage: HeadTail | Padded | None = None
    to_natural: HeadTail | Padded | None = None
    splits: tuple[Buffer, Buffer] | None = None

    @property
    def family(self) -> str:
        """What every member holds (:attr:`~shardflow.parallel.collectives.CommSpec.family`): send and recv are one
        communication seen from its two ends; an unknown kind (refused by the verifier) is its own."""
        spec = KINDS.get(self.kind)
        return spec.family if spec else self.kind

    def signature(self) -> tuple:
        """What every member must agree on: token, family, members, piece shape, dtype, reduce op, the
        dynamic-graph value moved, how an uneven dim is padded and trimmed (:attr:`padded`) and — for a send/recv,
        whose two ends move one piece — that piece."""
        return (
            self.token,
            self.family,
            self.members,
            self.type.shape,
            self.type.dtype,
            self.reduce_op,
            self.value,
            self.padded,
            self.piece if self.kind in (CommKind.SEND, CommKind.RECV) else (),
        )

    @property
    def padded(self) -> tuple[Padded | None, Padded | None]:
        """The uneven dim this communication pads before sending and the one it trims after receiving
        (docs/concepts.md#uneven-shards): every member must cut and join alike."""
        return tuple(h if isinstance(h, Padded) else None for h in (self.to_storage, self.to_natural))  # type: ignore[return-value]

    def __str__(self) -> str:
        who = (
            f"peer={self.peer}"
            if self.kind in (CommKind.SEND, CommKind.RECV)
            else f"to={self.peer} from={self.peer_from}"
            if self.kind == CommKind.PERMUTE
            else f"group={list(self.members)}" + (f" root={self.root}" if self.root is not None else "")
        )
        bufs = " ".join(f"{k}={b}" for k, b in (("send", self.send), ("recv", self.recv)) if b is not None)
        if self.splits is not None:
            bufs += f" splits={self.splits[0].value},{self.splits[1].value}"
        issue = " (async)" if not self.wait else ""
        order = "".join(
            f" {layout_text(h, to)}" for to, h in ((True, self.to_storage), (False, self.to_natural)) if h is not None
        )
        return (
            f"#{self.token:<4} {self.task:<4} {self.kind}{issue} {who} axis={self.axis or '-'} "
            f"{self.type.dtype}{list(self.type.shape)} {self.nbytes}B {bufs}{order}"
        ).rstrip()


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
            h.update(
                repr(
                    (
                        c.token,
                        str(c.kind),
                        c.members,
                        c.peer,
                        c.peer_from,
                        c.root,
                        c.type.shape,
                        c.type.dtype,
                        str(c.reduce_op),
                        c.value,
                        c.piece,
                        c.send,
                        c.recv,
                    )
                ).encode()
            )
        return h.hexdigest()

    def bytes_by_kind(self) -> dict[tuple[str, str], int]:
        """Bytes this rank sends per step, by (communication kind, mesh axis)."""
        out: dict[tuple[str, str], int] = {}
        for c in self.comms:
            out[(c.kind, c.axis)] = out.get((c.kind, c.axis), 0) + c.nbytes
        return out

    def listing(self) -> str:
        lines = [
            f"rank {self.rank}: {len(self.instrs)} instructions, {len(self.comms)} communications, "
            f"fingerprint {self.fingerprint()[:12]}"
        ]
        lines += [f"  {i}" for i in self.instrs]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        def buf(b: Buffer | None):
            return None if b is None else {"value": b.value, "shape": list(b.type.shape), "dtype": b.type.dtype}

        instrs = []  # "pass": an instruction's task type (FWD/LOSS/BWD/UPD), the key kept so the JSON stays stable
        for i in self.instrs:
            if isinstance(i, Compute):
                instrs.append(
                    {
                        "type": "compute",
                        "pass": i.task,
                        "node": i.node,
                        "op": i.op,
                        "ins": [buf(b) for b in i.ins],
                        "outs": [buf(b) for b in i.outs],
                    }
                )
            elif isinstance(i, Wait):
                instrs.append({"type": "wait", "token": i.token})
            elif isinstance(i, Free):
                instrs.append({"type": "free", "values": list(i.values)})
            else:
                comm: dict[str, Any] = {
                    "type": "comm",
                    "token": i.token,
                    "kind": i.kind,
                    "pass": i.task,
                    "members": list(i.members),
                    "shape": list(i.type.shape),
                    "dtype": i.type.dtype,
                    "bytes": i.nbytes,
                    "axis": i.axis,
                    "peer": i.peer,
                    "peer_from": i.peer_from,
                    "root": i.root,
                    "send": buf(i.send),
                    "recv": buf(i.recv),
                    "wait": i.wait,
                    "reduce_op": i.reduce_op,
                    "value": i.value,
                    "piece": list(i.piece),
                }
                for to, h in ((True, i.to_storage), (False, i.to_natural)):
                    if isinstance(h, HeadTail):
                        comm[layout_name(h, to)] = {"dim": h.dim, "chunks": h.chunks, "length": h.length}
                    elif isinstance(h, Padded):
                        comm[layout_name(h, to)] = {"dim": h.dim, "length": h.length, "padded": h.padded}
                if i.splits is not None:
                    comm["splits"] = [buf(b) for b in i.splits]
                instrs.append(comm)
        totals: dict[str, dict[str, int]] = {}
        for (kind, axis), n in self.bytes_by_kind().items():
            totals.setdefault(kind, {})[axis or "-"] = n
        groups = [{"members": list(g.members), "axis": g.axis} for g in self.groups]
        return {
            "rank": self.rank,
            "fingerprint": self.fingerprint(),
            "bytes": totals,
            "inputs": [buf(b) for b in self.inputs],
            "groups": groups,
            "instructions": instrs,
        }


def reads(i: Instr) -> tuple[Buffer, ...]:
    """The buffers instruction ``i`` reads on its rank: a compute's inputs, a communication's send buffer and split
    counts."""
    if isinstance(i, Compute):
        return i.ins
    if not isinstance(i, Comm):
        return ()
    return ((i.send,) if i.send is not None else ()) + (i.splits or ())


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
