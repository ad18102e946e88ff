"""Distributed executor: this rank's program on torch.distributed — NCCL with every buffer on the rank's GPU
(``cuda:LOCAL_RANK``), or gloo with every buffer on the CPU (:mod:`shardflow.runtime.device`).

Every rank builds the same plan deterministically and lowers only its own program; at start-up the ranks
compare the fingerprint of the plan (the dynamic graph of the step) and refuse to run on a mismatch. The kernels
are built from the program's instructions and its process groups from the program's group list
(:class:`ProcessGroups`), in one order on every rank. Every communication waits with a timeout; its failure names
the rank, the token, the operation and the peer or group it waited on, and whether a member stopped answering
(:class:`CommTimeout`) or left (:class:`PeerLost`).

On NCCL every communication is issued asynchronously (``async_op=True``): it runs on NCCL's own stream while the
compute stream goes on, and its wait makes the compute stream wait for it, so a communication issued ahead of its
wait (a bucket, a prefetched FSDP all-gather) overlaps the compute between them; the CPU does not stop at those
waits, and the step's end bounds them all (:class:`Waits`). All-gathers and
reduce-scatters go straight to ``all_gather_single``/``reduce_scatter_single`` on flat buffers (on a torch
without them, ``all_gather_into_tensor``/``reduce_scatter_tensor``: :mod:`shardflow.runtime.torch_compat`).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import time
from typing import Callable, Iterable, Mapping, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from shardflow.graph.ops import torch_dtype
from shardflow.lower import LoweredStep
from shardflow.lower.buffer_reuse import buffer_reuse
from shardflow.lower.comms import sized_bytes
from shardflow.lower.memory import Ledger, peak
from shardflow.lower.program import Comm, Compute, Group, Wait
from shardflow.lower.shard_expansion import uneven
from shardflow.lower.verify import check_fingerprints
from shardflow.parallel.collectives import KINDS, CommKind
from shardflow.parallel.mesh import Mesh, ReduceOp, Replicate, SubMesh, to_dtensor
from shardflow.parallel.shape import ShardingError
from shardflow.runtime import trace
from shardflow.runtime.buffers import Receives
from shardflow.runtime.comms import Issued, issue
from shardflow.runtime.device import backend_for
from shardflow.runtime.executor import Executor
from shardflow.runtime.kernels import (
    Kernel,
    OptimizerConfig,
    local_move,
    make_kernel,
    recorded_nodes,
    single_calls,
    update_kernel,
)
from shardflow.runtime.segments import Segment, compile_segment, runs
from shardflow.runtime.torch_compat import all_gather_single


class CommFailure(RuntimeError):
    """A communication of this rank failed because of another member: :class:`CommTimeout` or :class:`PeerLost`."""


class CommTimeout(CommFailure):
    """A communication did not complete within the timeout: a member stopped answering (stalled, stopped, or
    slower than the timeout)."""


class PeerLost(CommFailure):
    """A member of a communication closed its connection: it exited or was killed."""


# gloo's words for a member that closed or reset its connection; torch raises a plain RuntimeError for it as for a
# timeout, with gloo's message as its text (torch 2.13: "Connection closed by peer [addr]:port", "Read error
# [addr]:port: Connection reset by peer"); NCCL's (its ncclRemoteError: "remote process exited or there was a network
# error")
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")
TIMED_OUT = ("timed out", "timeout")  # lower case: "Operation timed out!", "Application timeout caused pair closure"


def comm_failure(e: BaseException, where: str) -> CommFailure | None:
    """torch's error ``e`` of a communication (or of a collective inside DCP, whose CheckpointException holds each
    rank's failure) as a :class:`PeerLost` or :class:`CommTimeout` whose message begins with ``where`` and says what
    to look at; None when ``e`` says neither."""
    texts = [str(e), *(str(f[0]) for f in getattr(e, "failures", {}).values())]
    first = next((t.strip().splitlines()[0] for t in texts if t.strip()), type(e).__name__)
    gone = next((t[t.index(w) :] for t in texts for w in PEER_GONE if w in t), None)
    if gone is not None:  # gloo's words up to the end of their sentence: "Connection closed by peer [addr]:port"
        return PeerLost(
            f"{where}: a member left ({gone.split('. ')[0]}); it exited or was killed, and its log says why"
        )
    if any(w in t.lower() for t in texts for w in TIMED_OUT):
        return CommTimeout(
            f"{where}: no answer within the timeout ({first}); a member stopped answering (stalled, "
            f"stopped, or slower than the timeout): its log shows where it is"
        )
    return None


class CommDivergence(RuntimeError):
    """Debug mode: the members of a communication are at different tokens (code outside the plan diverged)."""


class Waits:
    """How a rank waits for its communications: each handle once (gloo blocks on a second wait of a finished
    send), every wait bounded by ``timeout``, a failure raised as :class:`CommTimeout` or :class:`PeerLost` whose
    message begins with ``where(c)`` for the communication ``c`` (or the sentence) it was given.

    On the CPU (gloo) a wait blocks with the timeout. On a GPU (NCCL; ``on_stream``) a wait inside the step only makes
    the current (compute) stream wait for the communication, ``work.wait()``: given a timeout, NCCL's wait blocks
    the CPU thread until the communication has completed (torch 2.13, the docstring of
    ``torch.distributed.Work.wait``), so the CPU would stop queueing kernels at every wait while the GPU still
    has work ahead of it. Those waits are bounded together at the step's end (:meth:`settle`), before the CPU reads
    the loss.
    """

    POLL_S = 1e-4  # seconds between two looks at an unfinished communication in :meth:`settle`

    def __init__(self, timeout: datetime.timedelta, on_stream: bool, where: Callable[[Comm | str], str]):
        self.timeout, self.on_stream, self.where = timeout, on_stream, where
        self.streamed: list[tuple[dist.Work, Comm | str]] = []  # waited on the stream, not yet seen complete

    def wait(self, work: dist.Work, c: Comm | str, read: bool = False) -> None:
        """Wait for ``work``, a handle of communication ``c``. ``read``: the CPU reads the result next (a number
        gathered from the ranks, a debug token), so the wait blocks with the timeout on a GPU too. Raises
        CommTimeout or PeerLost naming ``c`` when it fails or does not complete within the timeout."""
        stream = self.on_stream and not read
        try:
            ok = work.wait() if stream else work.wait(self.timeout)
        except RuntimeError as e:
            raise comm_failure(e, self.where(c)) or CommTimeout(f"{self.where(c)}: {e}") from None
        if ok is False:
            raise CommTimeout(f"{self.where(c)}: no completion within {self.timeout.total_seconds():.0f} s")
        if stream:
            self.streamed.append((work, c))

    def settle(self) -> None:
        """Return once every communication waited on the stream since the last call has completed, in the order
        waited: a collective's handle waited with what is left of the timeout (a second wait of a finished
        collective returns at once; gloo's reduce-scatter never says ``is_completed``), a point-to-point one
        looked at every :attr:`POLL_S` seconds (gloo blocks on a second wait of a finished send). Raises
        CommTimeout naming the first one still unfinished ``timeout`` after this call began, PeerLost where a
        member left."""
        streamed, self.streamed = self.streamed, []
        deadline = time.monotonic() + self.timeout.total_seconds()

        def late(c: Comm | str) -> CommTimeout:
            return CommTimeout(
                f"{self.where(c)}: not complete {self.timeout.total_seconds():g} s after "
                f"the step's last instruction was queued; a member stopped answering "
                f"(stalled, stopped, or slower than the timeout): its log shows where it is"
            )

        for work, c in streamed:
            if not (isinstance(c, Comm) and KINDS[c.kind].point_to_point):
                left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.0))
                try:
                    ok = work.wait(left)
                except RuntimeError as e:
                    failure = comm_failure(e, self.where(c))
                    raise (late(c) if failure is None or isinstance(failure, CommTimeout) else failure) from None
                if ok is False:
                    raise late(c)
                continue
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise late(c)
                time.sleep(self.POLL_S)


def group_timeout(timeout: datetime.timedelta, device_type: str) -> datetime.timedelta:
    """The timeout every process group of a run whose waits take ``timeout`` is made with, for buffers on
    ``device_type``. On NCCL it is the watchdog's: NCCL aborts a communication that long after it was queued and
    ends the process (torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, 3 by default); it is twice the waits' timeout so
    that the executor's own bound (:meth:`Waits.settle`, counted from the step's end) names the communication first,
    with NCCL's abort left as the backstop. On gloo the waits' own (its waits are given it)."""
    return 2 * timeout if device_type == "cuda" else timeout


def mesh_groups(device_type: str, mesh: Mesh, timeout: datetime.timedelta) -> DeviceMesh:
    """The ``DeviceMesh`` of ``mesh`` for buffers on ``device_type`` (every rank calls it), its axis groups made with
    :func:`group_timeout` (``init_device_mesh`` gives them the backend's default, 10 minutes on NCCL: torch 2.13
    has no public way to pass one)."""
    dm = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)
    for axis in mesh.axis_names:
        dist.distributed_c10d._set_pg_timeout(group_timeout(timeout, device_type), dm.get_group(axis))
    return dm


def init_from_env(timeout_s: float = 300.0, device: torch.device | None = None) -> tuple[int, int]:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    with the backend of ``device`` (:func:`~shardflow.runtime.device.backend_for`: NCCL for ``cuda:LOCAL_RANK``,
    bound to this process — :func:`~shardflow.runtime.device.rank_device` — gloo for the CPU; default the CPU).
    A process group the program initialised before is kept, if its backend carries ``device``'s buffers
    (:func:`check_backend`). Returns (rank, world size)."""
    device = device or torch.device("cpu")
    if dist.is_initialized():
        check_backend(dist.get_backend(), device)
    else:
        if (
            os.environ.get("MASTER_ADDR", "127.0.0.1").startswith("127.")
            or os.environ.get("MASTER_ADDR") == "localhost"
        ):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        bound = {"device_id": device} if device.type == "cuda" else {}  # NCCL: communicators on this GPU
        dist.init_process_group(
            backend_for(device.type), **bound, timeout=group_timeout(datetime.timedelta(seconds=timeout_s), device.type)
        )
    return dist.get_rank(), dist.get_world_size()


def check_backend(backend: str, device: torch.device) -> None:
    """Raise ValueError unless a process group of ``backend`` (``dist.get_backend()``'s text: "gloo", "nccl",
    "cpu:gloo,cuda:nccl", ...) carries buffers on ``device`` (:func:`~shardflow.runtime.device.backend_for`)."""
    want = backend_for(device.type)
    if want not in backend.split(",") and f"{device.type}:{want}" not in backend.split(","):
        bind = ", device_id=torch.device('cuda', LOCAL_RANK)" if want == "nccl" else ""
        raise ValueError(
            f"the process group was initialised before shardflow joined it, with backend {backend!r}, "
            f"which cannot carry this rank's buffers on {device} ({want} does): initialise it with "
            f"init_process_group({want!r}{bind}), or leave it to shardflow (do not initialise it), or "
            f"keep the buffers where {backend} can (device='{'cuda' if want == 'gloo' else 'cpu'}')"
        )


def shutdown(code: int = 0) -> NoReturn:
    """Leave the process group in order (a barrier, then destroy it) and end the process with ``code``.

    The process ends with ``os._exit`` after flushing: gloo sub-groups still referenced at interpreter exit
    are torn down by destructors that can abort the process ("terminate called without an active
    exception"), turning a successful rank into a failed one.
    """
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ProcessGroups:
    """This rank's process groups, by members, created from programs' :class:`~shardflow.lower.program.Group`
    lists (:meth:`create`); :meth:`get` gives the group of a communication's members.

    A regular group — one of a mesh's axis groups — comes from a ``DeviceMesh`` of that mesh
    (``device_mesh.get_group(axis)``): the first regular group met creates the mesh's axis groups, every axis at
    once, as ``init_device_mesh`` does. Any other group is made by ``dist.new_group`` (with ``timeout``); a group
    of every rank is the world's. Every rank must call :meth:`create` with the same lists in the same order
    (torch.distributed needs every rank in every group's creation, member or not): then every rank creates the
    same groups in the same order. The DeviceMesh's device type is the buffers' (``device_type``: "cuda" or
    "cpu"). The executor's waits carry their own timeout, which also bounds a wait on a DeviceMesh group.
    """

    def __init__(self, timeout: datetime.timedelta, device_type: str = "cpu"):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout, self.device_type = timeout, device_type
        self.meshes: dict[Mesh, DeviceMesh] = {}
        self.subs: dict[SubMesh, DeviceMesh] = {}  # sub-meshes that DTensors were handed out on (:meth:`sub_mesh`)
        self.groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}  # those this rank is a member of
        self.made: set[tuple[int, ...]] = set()  # members of every group created, member or not

    def create(self, groups: Iterable[Group]) -> None:
        """Create the groups not created yet, in order."""
        for g in groups:
            if g.members in self.made:
                continue
            self.made.add(g.members)
            if g.mesh is not None:
                pg = self.device_mesh(g.mesh).get_group(g.axis)  # this rank's group along the axis: g's if a member
            else:
                pg = (
                    None
                    if len(g.members) == self.world
                    else dist.new_group(list(g.members), timeout=group_timeout(self.timeout, self.device_type))
                )
            if self.rank in g.members:
                self.groups[g.members] = pg

    def device_mesh(self, mesh: Mesh) -> DeviceMesh:
        """The ``DeviceMesh`` of ``mesh`` (:func:`mesh_groups`), made at its first use — every rank must ask for it
        then, as for :meth:`create`."""
        if mesh not in self.meshes:
            self.meshes[mesh] = mesh_groups(self.device_type, mesh, self.timeout)
        return self.meshes[mesh]

    def sub_mesh(self, group: SubMesh) -> DeviceMesh:
        """The ``DeviceMesh`` of ``group``'s devices over its free axes (row-major, a machine view's order), made at
        its first use (collective: every rank asks for it then, member or not). The whole mesh is :meth:`device_mesh`;
        a sub-mesh of one device (every axis fixed: a pipeline stage of a ``pp`` mesh) is a mesh of shape (1,) with
        no dim name."""
        if group == SubMesh(group.mesh):
            return self.device_mesh(group.mesh)
        if group not in self.subs:
            devices = torch.tensor(list(group.devices())).reshape(group.free_shape or (1,))
            self.subs[group] = DeviceMesh(self.device_type, devices, mesh_dim_names=group.free_axes or None)
        return self.subs[group]

    def get(self, members: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The group of ``members`` (None: the world). Raises KeyError if no group of those members with this
        rank among them was created."""
        try:
            return self.groups[members]
        except KeyError:
            raise KeyError(
                f"rank {self.rank} has no process group of members {list(members)}: it is not among the "
                f"groups of the programs it was created from"
            ) from None


class DistributedExecutor(Executor):
    """Runs this rank's program of a lowered step. Same interface as :class:`LocalExecutor`.

    ``step`` must hold this rank's program (``lower_step(pcg, ranks=[rank])``). Raises PlanMismatchError at
    construction if the ranks' plans differ, CommTimeout when a communication waits longer than ``timeout_s``.
    """

    def __init__(
        self,
        step: LoweredStep,
        optimizer: OptimizerConfig,
        timeout_s: float = 300.0,
        share: DistributedExecutor | None = None,
        debug: bool = False,
        seed: int = 0,
        device: torch.device | None = None,
        memory: bool = False,
    ):
        """``share``: another executor of the same PCG whose weights and process groups this one uses.
        ``debug``: before each communication, check that every member is at the same token.
        ``seed``: the run seed random ops (dropout) draw with (the same on every rank).
        ``device``: where every buffer lives, the device the process group's backend talks (default: ``share``'s,
        else the CPU). ``memory``: count the live bytes of the rank's buffers as the step runs (:attr:`peak_bytes`;
        off, the compiled segments do no accounting)."""
        self.debug = debug
        self.device = device or (share.device if share else torch.device("cpu"))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.dg = step.dg
        self.program = step.programs[self.rank]
        self.cfg = optimizer
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.steps_done = 0
        mesh = self.dg.pcg.mesh
        if mesh.size != self.world:
            raise ValueError(
                f"the plan is for mesh {mesh} ({mesh.size} devices) but the world has {self.world} "
                f"processes; start {mesh.size} processes or change --mesh"
            )
        self._check_fingerprints()
        self.groups = share.groups if share else ProcessGroups(self.timeout, self.device.type)
        self.groups.create(self.program.groups)  # same order on every rank
        self.saved: dict = {}  # forward autograd graphs, consumed by the backward
        # communications whose send buffer is theirs to use (reduced in place, or broadcast from as it is), the
        # gradient sums accumulated into their first input, and where each communication receives
        reuse = buffer_reuse(self.program, recorded_nodes(self.program))
        self.shared, into = reuse.sends, reuse.sums
        self.receives = Receives(self.program, reuse, self.device)  # receive slots, ring all-gathers in place
        once = single_calls(self.program)
        self.kernels = {
            i: make_kernel(
                i,
                optimizer,
                lambda: self.steps_done + 1,
                self.saved if i.dnode in once else None,
                seed,
                lambda: self.micro,
                self.device,
                i.outs[0].value in into,
            )
            for i in self.program.instrs
            if isinstance(i, Compute) and i.dnode
        }
        self.pending: dict[int, tuple[Issued, Comm]] = {}  # token → a communication issued, not waited
        self.waits = Waits(self.timeout, self.device.type == "cuda", self._where)
        self.ledger = Ledger() if memory else None
        self.tracer: trace.Tracer | None = None  # set to record the next steps' instruction timeline
        self.compiled: dict[bool, list[Segment | Comm | Wait]] = {}  # traced? → the program, compiled
        self.buffers: dict[str, torch.Tensor] = share.buffers if share else {}
        self.blocks: dict[
            str, tuple[slice | torch.Tensor, ...] | None
        ] = {}  # value placed here → this rank's block (None: no piece)
        self._index_updates()

    def _check_fingerprints(self) -> None:
        mine = self.dg.fingerprint()
        everyone: list[str | None] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        check_fingerprints(dict(enumerate(everyone)))  # raises PlanMismatchError naming the ranks that differ

    # --- data in and out ------------------------------------------------------------------------------
    def _put(self, vid: str, full: torch.Tensor) -> None:
        """This rank's piece of the full value (values put here are never partial; the block of a value placed
        every step, the data, worked out once)."""
        if vid not in self.blocks:
            v = self.dg.values[vid]
            p = v.sharding.parallel_shape(v.group, v.type.shape)
            self.blocks[vid] = (
                None if v.group.index(self.rank) is None else p.piece_index(v.sharding.coord_of(v.group, self.rank))
            )
        if self.blocks[vid] is not None:
            block, v = full[self.blocks[vid]], self.dg.values[vid]
            if uneven(v):  # a short block of an uneven dim: padded with zeros
                block = v.sharding.parallel_shape(v.group, v.type.shape).padded(block)
            self.buffers[vid] = block.to(self.device, copy=True)

    def _get(self, vid: str) -> torch.Tensor:
        """The full value on the CPU, assembled on every rank (an all-reduce over the world; for results, not the
        step)."""
        return self._get_many([vid])[0]

    def _get_many(self, vids: list[str]) -> list[torch.Tensor]:
        """The full values of ``vids`` on the CPU, assembled on every rank: each rank's replica-0 pieces placed in
        zeros, packed by dtype, one all-reduce over the world per dtype (in order of first appearance, the same on
        every rank)."""
        mine = [self._contribution(v) for v in vids]
        out = list(mine)
        for dtype in dict.fromkeys(t.dtype for t in mine):
            idx = [i for i, t in enumerate(mine) if t.dtype == dtype]
            flat = torch.cat([mine[i].reshape(-1) for i in idx])
            self.waits.wait(
                dist.all_reduce(flat, async_op=True),
                f"rank {self.rank} waited on the all-reduce assembling {len(idx)} value(s)",
                read=True,
            )
            for i, part in zip(idx, flat.split([mine[i].numel() for i in idx])):
                out[i] = part.view(mine[i].shape).cpu()
        return out

    def _contribution(self, vid: str) -> torch.Tensor:
        """Value ``vid``'s full shape in zeros, with this rank's piece in place where it holds replica 0 (a partial
        piece as it sums; an average's divided by its count): what the world's sum assembles."""
        v = self.dg.values[vid]
        p = v.sharding.parallel_shape(v.group, v.type.shape)
        dtype = self.buffers[vid].dtype if vid in self.buffers else torch_dtype(v.type.dtype)
        out = torch.zeros(v.type.shape, dtype=dtype, device=self.device)
        if vid in self.buffers:
            c = v.sharding.coord_of(v.group, self.rank)
            if c.replica == 0:
                piece = p.valid_of(self.buffers[vid], c)
                out[p.piece_index(c)] = piece / (p.sum_degree if p.reduce_op == ReduceOp.AVG else 1)
        return out

    def _pieces(self, vid: str) -> dict[int, torch.Tensor]:
        return {self.rank: self.buffers[vid]} if vid in self.buffers else {}

    def _here(self) -> tuple[int, ...]:
        return (self.rank,)

    def _place(self, vid: str, pieces: Mapping[int, torch.Tensor]) -> None:
        if self.rank in pieces:
            self.buffers[vid] = pieces[self.rank]

    def _max_over_ranks(self, x: float) -> float:
        t = torch.tensor(x, dtype=torch.float64, device=self.device)
        self.waits.wait(
            dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True),
            f"rank {self.rank} waited on the all-reduce of a maximum over the ranks",
            read=True,
        )
        return t.item()

    def per_process(self, x: float) -> list[float]:
        """Every rank's ``x`` (an all-gather on the default group). Raises CommTimeout past the run's timeout."""
        out = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in range(self.world)]
        self.waits.wait(
            dist.all_gather(out, torch.tensor(x, dtype=torch.float64, device=self.device), async_op=True),
            f"rank {self.rank} waited on the all-gather of a number from every rank",
            read=True,
        )
        return [t.item() for t in out]

    def dtensors(self, values: Mapping[str, str]) -> dict[str, DTensor]:
        """This rank's pieces of ``values`` (name → value id) as DTensors: ``DTensor.from_local(piece, device_mesh,
        placements)`` of each value this rank holds a piece of, with the value's placements on the ``DeviceMesh`` of
        its sub-mesh (:meth:`ProcessGroups.sub_mesh`: the whole mesh's, or a pipeline stage's). A value of a
        sub-mesh this rank is not in (another stage's) is left out. The local tensors are this executor's buffers,
        not copies. Collective: every rank calls it with the same ``values`` (a sub-mesh's DeviceMesh is made at its
        first use).

        Raises ValueError naming the value when two mesh axes shard one dim out of mesh order (DTensor cannot
        spell it), before any DeviceMesh is made.
        """
        placed = {}
        for name, vid in values.items():
            v = self.dg.values[vid]
            try:
                placed[name] = tuple(map(to_dtensor, v.sharding.placements(v.group))) or (to_dtensor(Replicate()),)
            except ShardingError as e:
                raise ValueError(
                    f"{name} ({vid}) is placed {v.sharding} on {v.group}: {e}; read it whole (state_dict(), "
                    f"grads()) instead"
                ) from None
        out = {}
        for name, vid in values.items():
            v = self.dg.values[vid]
            device_mesh = self.groups.sub_mesh(v.group)  # every rank, member or not
            if v.group.index(self.rank) is not None:
                full = torch.Size(v.type.shape)
                p = v.sharding.parallel_shape(v.group, v.type.shape)  # a short block: its part, DTensor's local shape
                out[name] = DTensor.from_local(
                    p.valid_of(self.buffers[vid], v.sharding.coord_of(v.group, self.rank)),
                    device_mesh,
                    placed[name],
                    run_check=False,
                    shape=full,
                    stride=torch.empty(full, device="meta").stride(),
                )
        return out

    # --- one step -------------------------------------------------------------------------------------
    def step(self, inputs: Mapping[str, torch.Tensor]) -> float:
        """Run one training step on the full ``inputs`` (every rank passes the same); returns the loss."""
        self._place_inputs(inputs)
        self.sized_sent = {self.rank: 0}
        self.rows: dict[str, list[int]] = {}  # count buffer → its row sums, read this step
        b, ledger, tracer = self.buffers, self.ledger, self.tracer
        if ledger:
            ledger.sync(b)
        for item in self._compiled(tracer is not None):
            if not isinstance(item, (Comm, Wait)):
                item(b, tracer)
                continue
            t0 = tracer.now() if tracer else 0.0
            if isinstance(item, Wait):
                issued, c = self.pending.pop(item.token)
                for h in issued.handles:
                    self.waits.wait(h, c)
                out = issued.result()
            else:
                c, out = item, self._communicate(item)
                if out is None and c.recv is not None and ledger:  # issued now, waited for later: its buffer is
                    ledger.write(c.recv.value, c.recv.type.nbytes)  # allocated now (the replay counts it so)
            if out is not None:
                b[c.recv.value] = out
                if ledger:
                    ledger.write(c.recv.value, c.recv.type.nbytes)
            if tracer:
                tracer.record(item, t0, tracer.now())
        self.waits.settle()
        loss = self._loss()
        for new, old in self.renames:
            if new in b:
                b[old] = b.pop(new)
        if ledger:
            ledger.sync(b)
        self.steps_done += 1
        return loss

    def _compiled(self, traced: bool) -> list[Segment | Comm | Wait]:
        """The program as compiled segments (:mod:`~shardflow.runtime.segments`) between its communications and
        waits, built at first use; ``traced``: segments that record each compute on the tracer."""
        if traced not in self.compiled:
            instrs = self.program.instrs
            self.compiled[traced] = [
                instrs[a]
                if isinstance(instrs[a], (Comm, Wait))
                else compile_segment(instrs[a:z], self._kernel, self._update_kernel, self.ledger, traced)
                for a, z in runs(instrs, (Comm, Wait))
            ]
        return self.compiled[traced]

    def _kernel(self, instr: Compute) -> Kernel:
        return self.receives.kernel(instr) or (
            self.kernels[instr] if instr.dnode else functools.partial(local_move, instr)
        )

    def _update_kernel(self, updates) -> Kernel:
        return update_kernel(updates, self.cfg, lambda: self.steps_done + 1)

    def _loss(self) -> float:
        """The loss (the mean over the step's microbatches): read locally when every rank holds it whole; else
        summed over the ranks (a scalar per microbatch)."""
        v = self.dg.values[self.dg.loss_values[0]]
        if not v.sharding.partial and v.group.size == self.world:
            losses = [self.buffers[vid].item() for vid in self.dg.loss_values]
        else:
            losses = [self._get(vid).item() for vid in self.dg.loss_values]
        return sum(losses) / len(losses)

    @property
    def peak_bytes(self) -> int:
        """Largest sum of this rank's live buffers so far (bytes): its pieces of weights, optimizer state,
        gradients and activations. Raises RuntimeError when the executor was built without ``memory=True``."""
        return peak(self.ledger)

    def _where(self, c: Comm | str) -> str:
        if isinstance(c, str):
            return c
        who = f"peer {c.peer}" if c.kind in (CommKind.SEND, CommKind.RECV) else f"group {list(c.members)}"
        return f"rank {self.rank} waited on token {c.token} ({c.kind} of {c.type.dtype}{list(c.type.shape)}, {who})"

    def _check_token(self, c: Comm) -> None:
        """Debug mode: exchange tokens with the other members of ``c``; raise CommDivergence on a mismatch."""
        mine = torch.tensor([c.token], dtype=torch.long, device=self.device)
        if KINDS[c.kind].point_to_point:
            to, frm = (c.peer, c.peer) if c.kind != CommKind.PERMUTE else (c.peer, c.peer_from)
            theirs = torch.empty(1, dtype=torch.long, device=self.device)
            for h in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, to), dist.P2POp(dist.irecv, theirs, frm)]):
                self.waits.wait(h, c, read=True)
            others = {frm: int(theirs)}
        else:
            got = torch.empty(len(c.members), dtype=torch.long, device=self.device)
            self.waits.wait(all_gather_single(got, mine, group=self.groups.get(c.members), async_op=True), c, read=True)
            others = dict(zip(c.members, got.tolist()))
        bad = {r: t for r, t in others.items() if t != c.token}
        if bad:
            raise CommDivergence(
                f"rank {self.rank} is at token {c.token} ({c.kind}, {c.note}) but "
                + ", ".join(f"rank {r} is at token {t}" for r, t in sorted(bad.items()))
                + "; something outside the plan ran a different sequence of communications"
            )

    def _communicate(self, c: Comm) -> torch.Tensor | None:
        """Issue communication ``c`` on this rank (:func:`~shardflow.runtime.comms.issue`); wait for it now
        (once, with the timeout) and return what it received, or leave it to the ``Wait`` of its token."""
        if self.debug:
            self._check_token(c)
        send = self.buffers[c.send.value] if c.send is not None else None
        group = None if KINDS[c.kind].point_to_point else self.groups.get(c.members)
        splits = None
        if c.splits is not None:  # data: read on the host once per step and count buffer (on a device: a sync)
            for b in c.splits:
                if b.value not in self.rows:
                    self.rows[b.value] = self.buffers[b.value].sum(1).tolist()
            sent, received = (self.rows[b.value] for b in c.splits)
            splits = (sent, received)
            self.sized_sent[self.rank] += sized_bytes(c, sent, c.members.index(self.rank))
        issued = issue(
            c,
            send,
            self.rank,
            group,
            in_place=c.token in self.shared,
            device=self.device,
            alloc=self.receives.alloc(c),
            splits=splits,
        )
        if not c.wait:
            self.pending[c.token] = (issued, c)
            return None
        for h in issued.handles:
            self.waits.wait(h, c)
        return issued.result()
