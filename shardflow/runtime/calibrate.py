"""``shardflow calibrate``'s measurement, in each rank: time every kind of call the cost model prices
(:data:`~shardflow.lower.calibration.COST_KINDS`) through :func:`shardflow.runtime.comms.issue` — the calls the
distributed executor makes — per mesh axis group (or over every rank), at a few message sizes, and fit α and the
bandwidth per kind (:func:`~shardflow.lower.calibration.fit`); rank 0 writes the file.

A kind's message size is the piece one rank holds (``size`` bytes of float32: the all-gather's contribution, the
reduction's input, the broadcast root's buffer, one ring step's chunk); the bytes fitted against are what the cost
model counts for it (:func:`~shardflow.parallel.collectives.wire_bytes`; ``p2p`` is one collective-permute step, the ring's).
Each call is timed alone, from its issue to the end of its waits, after a barrier of its group; a sample is the
median of ``reps`` calls, the slowest rank's (the call ends for the group when it ends on its last member). Each kind
and size receives into one buffer from call to call, as the executor's receive slots do
(:class:`~shardflow.runtime.buffers.Kept`).
"""

from __future__ import annotations

import datetime
import functools
import statistics
import time
from typing import Callable, Sequence

import torch

from shardflow.graph.ops import TensorType
from shardflow.lower.calibration import COST_KINDS, WORLD, Calibration, KindCost, fit, this_machine
from shardflow.lower.comm_lowering import ring_peers
from shardflow.lower.dynamic import TaskType
from shardflow.lower.program import Buffer, Comm
from shardflow.parallel.collectives import CommKind, wire_bytes
from shardflow.parallel.mesh import Mesh
from shardflow.runtime.buffers import Kept
from shardflow.runtime.comms import issue

WARMUP = 1  # untimed calls per kind and size (first-call set-up: connections, buffers)


def probe(kind: str, members: tuple[int, ...], rank: int, size: int) -> tuple[Comm, bool, int]:
    """The communication of cost kind ``kind`` among ``members`` (global ranks, group order) with a piece of about
    ``size`` bytes (float32 elements, a multiple of the group size, at least one per member), whether ``rank``
    sends a buffer in it, and the bytes the cost model counts for it on ``rank``'s side (what a broadcast or reduce
    root sends: the root's). Raises ValueError for a kind not in COST_KINDS."""
    d = len(members)
    n = max(1, size // 4 // d) * d
    t = TensorType((n,), "float32")
    i = members.index(rank)
    root = members[0]
    if kind == "p2p":  # one collective-permute step of the ring (step 1)
        to, frm = ring_peers(i, 1, d)
        c = Comm(
            0,
            CommKind.PERMUTE,
            TaskType.FWD,
            members,
            t,
            0,
            peer=members[to],
            peer_from=members[frm],
            recv=Buffer("x", t),
        )
        return c, True, wire_bytes(CommKind.PERMUTE, t.nbytes, d)
    if kind not in COST_KINDS:
        raise ValueError(f"no probe for cost kind {kind!r}; one of {list(COST_KINDS)}")
    comm = CommKind(kind)  # every other cost kind is the communication kind of that name
    if comm == CommKind.BROADCAST:
        c = Comm(0, comm, TaskType.FWD, members, t, 0, root=root, recv=None if rank == root else Buffer("x", t))
        return c, rank == root, wire_bytes(comm, t.nbytes, d, is_root=True)
    if comm == CommKind.REDUCE:
        return Comm(0, comm, TaskType.FWD, members, t, 0, root=root), True, wire_bytes(comm, t.nbytes, d)
    return Comm(0, comm, TaskType.FWD, members, t, 0, dim=0, dim2=0), True, wire_bytes(comm, t.nbytes, d)


def axis_members(mesh: Mesh, axis: str, rank: int) -> tuple[int, ...]:
    """The global ranks of ``rank``'s group along mesh ``axis`` (row-major devices), in axis order."""
    k = mesh.axis_index(axis)
    coords = list(mesh.coords(rank))
    return tuple(mesh.device(tuple(coords[:k] + [j] + coords[k + 1 :])) for j in range(mesh.shape[k]))


def measure(
    rank: int,
    world: int,
    mesh: Mesh | None,
    sizes: Sequence[int],
    reps: int,
    backend: str,
    device: torch.device,
    say: Callable[[str], None] = print,
    timeout: datetime.timedelta = datetime.timedelta(seconds=300),
) -> Calibration | None:
    """Time every cost kind on every group of this rank (each axis of ``mesh``, or the world) at ``sizes`` (bytes),
    ``reps`` calls each (median), and fit them. Every rank of the world calls it (it runs collectives over the
    world); rank 0 gets the :class:`Calibration` (the slowest rank's times), the others None. ``say``: progress
    lines (rank 0's); a kind whose times do not grow with the size (:func:`fit` refuses it: noise on a busy machine)
    is left out of the calibration, with a line saying so — the cost model keeps its default for it. ``timeout``:
    the run's (``--timeout``), which the mesh's axis groups are made with (:func:`~shardflow.runtime.distributed.mesh_groups`)."""
    import torch.distributed as dist

    if mesh is None:
        groups = [(WORLD, tuple(range(world)), None)]
    else:
        from shardflow.runtime.distributed import mesh_groups

        dm = mesh_groups(device.type, mesh, timeout)
        groups = [(a, axis_members(mesh, a, rank), dm.get_group(a)) for a in mesh.axis_names if mesh.axis_size(a) > 1]
    seconds: list[float] = []
    counted: list[tuple[str, str, int]] = []  # (group, kind, bytes) of each sample, rank 0's side
    for name, members, group in groups:
        for kind in COST_KINDS:
            for size in sizes:
                c, sends, nbytes = probe(kind, members, rank, size)
                send = torch.ones(c.type.shape, device=device) if sends else None
                kept = functools.partial(Kept(device), torch.float32)  # received into one buffer, as the executor does
                times = []
                for k in range(WARMUP + reps):
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    issued = issue(c, send, rank, group, device=device, alloc=kept)
                    for h in issued.handles:
                        h.wait()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if k >= WARMUP:
                        times.append(time.perf_counter() - t0)
                seconds.append(statistics.median(times))
                counted.append((name, kind, nbytes))
            say(f"  {name}: {kind} timed at {len(sizes)} sizes")
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank times the same list of samples
    if rank != 0:
        return None
    samples: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for (name, kind, nbytes), t in zip(counted, slowest.tolist()):
        samples.setdefault((name, kind), []).append((nbytes, t))
    fitted: dict[str, dict[str, KindCost]] = {}
    for (name, kind), xs in samples.items():
        try:
            fitted.setdefault(name, {})[kind] = fit(xs)
        except ValueError as e:  # noise larger than the sizes' difference: this kind keeps the default
            say(f"  {name}: {kind} not fitted, the cost model keeps its default: {e}")
    return Calibration(
        backend,
        world,
        this_machine(),
        datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        torch.__version__,
        fitted,
    )


def table(cal: Calibration) -> str:
    """The fitted numbers: one row per group and kind, α in µs and the bandwidth in GB/s."""
    rows = [f"{'group':<8} {'kind':<15} {'alpha (us)':>10} {'bandwidth (GB/s)':>17}"]
    rows += [
        f"{g:<8} {k:<15} {c.alpha_s * 1e6:>10.1f} {c.bandwidth / 1e9:>17.3f}"
        for g, kinds in cal.groups.items()
        for k, c in kinds.items()
    ]
    return "\n".join(rows)
