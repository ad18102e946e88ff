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

Then the computation, in every rank at once so that the contention of the ranks sharing this machine is in the
figures (:func:`measure_compute`, the file's ``compute`` section: :class:`~shardflow.lower.calibration.ComputeCost`):
square matmuls per dtype of :data:`MATMUL_DTYPES` (128, 256, ... while the next size's call would stay under
:data:`MATMUL_BUDGET_S`; each size's rate kept), an elementwise add of :data:`ADD_BYTES` per tensor (memory
bandwidth) and at each tensor size of :data:`BANDWIDTH_SIZES`, a causal attention's forward and backward per dtype
by sequence length (:data:`ATTENTION_SEQS`), a one-element add (the per-kernel launch floor), a training step of a tiny 8-layer
network on the local executor (the host seconds per instruction) and, on the CPU, matmuls while a gloo all-reduce
runs (the contention of compute and communication). The matmuls, the adds by size and the attention run as a
step's kernels do: each call on the next of a pool of operands larger than a core's cache (:data:`POOL_BYTES`;
a step's kernels read tensors written long before), into a fresh output. A few seconds on 2 gloo ranks of 2 CPU
cores.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import math
import statistics
import time
from typing import Callable, Sequence

import torch

from shardflow.graph.ops import TensorType
from shardflow.lower.calibration import (
    COST_KINDS,
    PASSES,
    WORLD,
    Calibration,
    ComputeCost,
    KindCost,
    fit,
    this_machine,
)
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
    compute: bool = True,
) -> Calibration | None:
    """Time every cost kind on every group of this rank (each axis of ``mesh``, or the world) at ``sizes`` (bytes),
    ``reps`` calls each (median), and fit them. Every rank of the world calls it (it runs collectives over the
    world); rank 0 gets the :class:`Calibration` (the slowest rank's times), the others None. ``say``: progress
    lines (rank 0's); a kind whose times do not grow with the size (:func:`fit` refuses it: noise on a busy machine)
    is left out of the calibration, with a line saying so — the cost model keeps its default for it. ``timeout``:
    the run's (``--timeout``), which the mesh's axis groups are made with (:func:`~shardflow.runtime.distributed.mesh_groups`).
    ``compute``: then measure the computation of every rank at once (:func:`measure_compute`, the slowest rank's
    figures), the calibration's ``compute``; False leaves it None. One process (``world`` 1) times no
    communication: its calibration has no groups, the computation alone."""
    import torch.distributed as dist

    groups: list[tuple[str, tuple[int, ...], dist.ProcessGroup | None]]
    if world == 1:
        groups = []  # one process: nothing to communicate with, the computation alone
    elif mesh is None:
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
    computed = None
    if compute:
        dist.barrier()
        t0 = time.perf_counter()
        contend = _contender(device) if world > 1 else None
        computed = measure_compute(device, functools.partial(slowest_rank, device), contend, dist.barrier)
        say(f"  compute measured on {world} rank{'s' * (world > 1)} at once in {time.perf_counter() - t0:.1f} s")
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
        compute=computed,
    )


def table(cal: Calibration) -> str:
    """The fitted numbers: one row per group and kind, α in µs and the bandwidth in GB/s (a line saying so where
    nothing was timed: one process)."""
    if not cal.groups:
        return f"no communication timed ({cal.world_size} process): the cost model keeps its {cal.backend} defaults"
    rows = [f"{'group':<8} {'kind':<15} {'alpha (us)':>10} {'bandwidth (GB/s)':>17}"]
    rows += [
        f"{g:<8} {k:<15} {c.alpha_s * 1e6:>10.1f} {c.bandwidth / 1e9:>17.3f}"
        for g, kinds in cal.groups.items()
        for k, c in kinds.items()
    ]
    return "\n".join(rows)


MATMUL_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes whose matmul FLOP/s are measured
MATMUL_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)  # square sizes tried in turn, n×n @ n×n
MATMUL_BUDGET_S = 0.05  # the next size is tried only while its call would take less (8× the last call), seconds
ADD_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}  # bytes of each tensor of the bandwidth's add (above L2)
BANDWIDTH_SIZES = (2**18, 2**20, 2**22, 2**24, 2**26)  # bytes per tensor of the adds by size: 256 KiB ... 64 MiB
POOL_BYTES = 64 * 2**20  # operands one size's calls cycle through: more than a core's cache holds
ATTENTION_HEADS = (8, 8, 64)  # batch, heads, head dim of the causal attention timed (each dtype)
ATTENTION_SEQS = (128, 512, 2048, 8192)  # its sequence lengths tried in turn
# The calls of one timed run of the measurements by size, the launch floor and the tiny step: as many as take about
# this long (at least one), several of the scheduler's time slices, so that where the ranks outnumber the cores
# (4 gloo ranks on 2) each run sees its rank's share of a core, not a slice it happened to have alone.
CALL_S = 0.02
CYCLED_ROUNDS = 3  # timed runs of such a measurement (median), after one untimed
CONTENDED_N = 512  # the float32 matmul timed while an all-reduce runs (a few ms on a CPU core)
CONTENDING_BYTES = 32 * 2**20  # the all-reduce it runs beside, bytes (tens of ms on gloo over loopback)
ROUNDS = 3  # timed calls per measurement (median), after one untimed


def slowest_rank(device: torch.device, seconds: list[float]) -> list[float]:
    """Each of ``seconds`` (this rank's) as the slowest rank's: their maximum over the world (every rank calls it
    with the same number of values)."""
    import torch.distributed as dist

    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _contender(device: torch.device) -> Callable[[], object] | None:
    """On the CPU, a function that starts an all-reduce of :data:`CONTENDING_BYTES` over the world without waiting
    and returns its work handle (``is_completed``, ``wait``); None on a GPU (the contention is not measured)."""
    if device.type != "cpu":
        return None
    import torch.distributed as dist

    buf = torch.ones(CONTENDING_BYTES // 4)
    return lambda: dist.all_reduce(buf, async_op=True)


def _timed(
    fn: Callable[[], object], device: torch.device, rounds: int = ROUNDS, sync: Callable[[], object] | None = None
) -> float:
    """Median seconds of ``rounds`` calls of ``fn`` after one untimed (synchronising a GPU after each). ``sync``:
    called before each call (every rank's barrier: the ranks' calls run at the same time)."""
    times = []
    for k in range(1 + rounds):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cycled(
    fn: Callable[..., object],
    sets: Sequence[tuple],
    device: torch.device,
    rounds: int = CYCLED_ROUNDS,
    sync: Callable[[], object] | None = None,
) -> float:
    """Median seconds per call of ``fn(*operands)`` over ``rounds`` timed runs after one untimed (:func:`_timed`,
    ``sync`` before each), each call on the next operand set of ``sets`` in turn, a run making as many calls as take
    about :data:`CALL_S`."""
    turn = itertools.count()

    def one() -> None:
        fn(*sets[next(turn) % len(sets)])

    first = _timed(one, device, 1, sync)
    calls = max(1, min(100_000, int(CALL_S / max(first, 1e-7))))

    def run() -> None:
        for _ in range(calls):
            one()

    return _timed(run, device, rounds, sync) / calls


def _pool(make: Callable[[], tuple], nbytes: int) -> list[tuple]:
    """Operand sets of ``nbytes`` each made by ``make``: as many as fill :data:`POOL_BYTES`, at least two."""
    return [make() for _ in range(max(2, POOL_BYTES // max(1, nbytes)))]


def tiny_step(device: torch.device, layers: int = 8):
    """A training step of ``layers`` dense 4→4 layers with tanh on a batch of 2, lowered for one device and loaded
    on the local executor: ``(run one step, its program's instructions, its compute instructions)``. Its kernels
    are one-element-sized, so its time is the executor's host work."""
    from shardflow.graph import GraphBuilder
    from shardflow.lower import lower_step
    from shardflow.lower.dynamic import Optimizer
    from shardflow.lower.program import Compute
    from shardflow.parallel.mesh import Mesh
    from shardflow.parallel.pcg import build_pcg
    from shardflow.runtime.kernels import OptimizerConfig
    from shardflow.runtime.local import LocalExecutor

    b = GraphBuilder()
    h, y = b.input("x", (2, 4)), b.input("y", (2,), "int64")
    for i in range(layers):
        h = b.tanh(b.dense(h, 4, name=f"l{i}"))
    g = b.build([loss := b.cross_entropy(h, y)], loss)
    step = lower_step(build_pcg(g, Mesh.parse("d=1")), verify=False)
    ex = LocalExecutor(step, OptimizerConfig(Optimizer.SGD, 0.0), device=device)
    ex.load({w: torch.zeros(g.tensors[w].shape) for w in g.weights})
    inputs = {"x": torch.ones(2, 4, device=device), "y": torch.zeros(2, dtype=torch.int64, device=device)}
    instrs = step.programs[0].instrs
    return (lambda: ex.step(inputs)), len(instrs), sum(isinstance(i, Compute) for i in instrs)


def measure_compute(
    device: torch.device,
    agree: Callable[[list[float]], list[float]] = lambda xs: xs,
    contend: Callable[[], object] | None = None,
    sync: Callable[[], object] | None = None,
) -> ComputeCost:
    """What this rank's computation reaches on ``device``, every rank measuring at the same time. ``agree``: maps
    this rank's list of seconds to the slowest rank's (:func:`slowest_rank`; the identity in one process); every
    rank calls it at the same points, so the ranks take the same sizes and stay in step. ``contend``: starts a
    collective without waiting (:func:`_contender`); None leaves ``contention`` at 1.0. ``sync``: every rank's
    barrier, before each timed run of the measurements by size, the launch floor and the tiny step, so that every
    rank's runs overlap (a rank that went ahead would otherwise time its last runs alone, on a core it need not
    share); None in one process.

    Measures: per dtype of :data:`MATMUL_DTYPES`, ``n×n @ n×n`` (2·n³ FLOP) for n of :data:`MATMUL_SIZES` while the
    next call would stay under :data:`MATMUL_BUDGET_S`, each size's FLOP/s (``matmul_by_size``) and the best
    (``matmul_flops``); ``a + b`` at each tensor size of :data:`BANDWIDTH_SIZES` (``bandwidth_by_size``: 3× the size
    moved per call); per dtype of :data:`MATMUL_DTYPES`, a causal attention's forward and, apart, its backward by
    sequence length (``attention_flops``, :func:`_attention`); these on operand sets cycled through (:func:`_pool`, :func:`_cycled`: not in cache),
    into fresh outputs, as a step's kernels run. ``out = a + b`` of :data:`ADD_BYTES` float32 bytes per tensor
    (``memory_bandwidth``); one-element adds (seconds per call: the launch floor) and steps of :func:`tiny_step`
    (seconds per instruction, less a launch floor per compute instruction: the host overhead), each in runs of
    about :data:`CALL_S` (the step's median of 2·ROUNDS−1); and with ``contend``, the float32 matmul of
    :data:`CONTENDED_N` timed while a collective is in flight, over its time alone. Each a median of timed runs
    (:data:`ROUNDS`, :data:`CYCLED_ROUNDS`)."""
    gen = torch.Generator().manual_seed(0)
    flops: dict[str, float] = {}
    by_size: dict[str, tuple[tuple[float, float], ...]] = {}
    for dtype in MATMUL_DTYPES:
        curve: list[tuple[float, float]] = []
        for n in MATMUL_SIZES:
            size = 2 * n * n * dtype.itemsize
            sets = _pool(
                lambda: tuple(torch.randn(n, n, generator=gen).to(device=device, dtype=dtype) for _ in "ab"), size
            )
            (s,) = agree([_cycled(torch.mm, sets, device, sync=sync)])
            curve.append((2.0 * n**3, 2 * n**3 / s))
            del sets
            if 8 * s > MATMUL_BUDGET_S:
                break
        name = str(dtype).removeprefix("torch.")
        flops[name], by_size[name] = max(r for _, r in curve), tuple(curve)
    bandwidth: list[tuple[float, float]] = []
    for size in BANDWIDTH_SIZES:
        sets = _pool(lambda: (torch.ones(size // 4, device=device), torch.ones(size // 4, device=device)), 2 * size)
        (s,) = agree([_cycled(torch.add, sets, device, sync=sync)])
        bandwidth.append((float(size), 3 * size / s))
        del sets
    attention_flops = {
        str(dtype).removeprefix("torch."): _attention(device, dtype, gen, agree, sync) for dtype in MATMUL_DTYPES
    }
    n = ADD_BYTES.get(device.type, ADD_BYTES["cuda"]) // 4
    x, y, z = (torch.ones(n, device=device) for _ in range(3))
    add_s = _timed(lambda: torch.add(x, y, out=z), device)
    one = [torch.ones(1, device=device) for _ in range(3)]

    launch_s = _cycled(lambda: torch.add(one[0], one[1], out=one[2]), [()], device, sync=sync)
    run_step, instrs, computes = tiny_step(device)
    step_s = _cycled(run_step, [()], device, 2 * ROUNDS - 1, sync)
    contended, alone = 0.0, 0.0  # seconds of the contended matmul with a collective in flight, and alone
    if contend is not None:
        a, b = (torch.randn(CONTENDED_N, CONTENDED_N, generator=gen) for _ in range(2))
        out = torch.empty(CONTENDED_N, CONTENDED_N)
        alone = _timed(lambda: torch.mm(a, b, out=out), device)
        samples = []
        for _ in range(ROUNDS):
            work = contend()
            while not work.is_completed():  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                torch.mm(a, b, out=out)
                samples.append(time.perf_counter() - t0)
            work.wait()  # type: ignore[attr-defined]
        contended = statistics.median(samples) if samples else 0.0
    add_s, launch_s, step_s, contended, alone = agree([add_s, launch_s, step_s, contended, alone])
    return ComputeCost(
        flops,
        3 * 4 * n / add_s,
        launch_s,
        max(0.0, (step_s - computes * launch_s) / instrs),
        max(1.0, contended / alone) if contended and alone else 1.0,
        by_size,
        tuple(bandwidth),
        attention_flops,
    )


def _attention(
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    agree: Callable[[list[float]], list[float]],
    sync: Callable[[], object] | None,
) -> dict[str, tuple[tuple[float, float], ...]]:
    """``forward`` and ``backward`` → ((FLOP per call, FLOP/s), ...) of a causal attention in ``dtype`` of
    :data:`ATTENTION_HEADS` (batch, heads, head dim) at each sequence length of :data:`ATTENTION_SEQS` while the
    next length's calls (16× the FLOPs) would stay under :data:`MATMUL_BUDGET_S`: the forward timed as
    :func:`_cycled`, the backward the median of :data:`CYCLED_ROUNDS` timed backwards of one forward per operand
    set (after an untimed one), the slowest rank's (``agree``: every rank takes the same lengths). FLOPs as MFU
    counts them: the forward 2·B·H·T·S·(D + Dv) (causal not halved), the backward 2.5 times it."""
    batch, heads, dim = ATTENTION_HEADS
    curves: dict[str, list[tuple[float, float]]] = {p: [] for p in PASSES}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    for seq in ATTENTION_SEQS:
        shape = (batch, heads, seq, dim)
        sets = _pool(
            lambda: tuple(torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in "qkv"),
            3 * dtype.itemsize * math.prod(shape),
        )
        dy = torch.ones(shape, device=device, dtype=dtype)
        with torch.no_grad():
            forward_s = _cycled(attend, sets, device, sync=sync)
        backwards = [_backward(attend, sets, dy, device, sync) for _ in range(1 + CYCLED_ROUNDS)]
        forward_s, backward_s = agree([forward_s, statistics.median(backwards[1:])])
        del sets, dy
        flops = 4.0 * math.prod(shape) * seq
        curves["forward"].append((flops, flops / forward_s))
        curves["backward"].append((2.5 * flops, 2.5 * flops / backward_s))
        if 16 * max(forward_s, backward_s) > MATMUL_BUDGET_S:
            break
    return {p: tuple(c) for p, c in curves.items()}


def _backward(
    attend: Callable[..., torch.Tensor],
    sets: Sequence[tuple],
    dy: torch.Tensor,
    device: torch.device,
    sync: Callable[[], object] | None,
) -> float:
    """Seconds per backward of ``attend`` (``dy`` its output's gradient), one forward per operand set of ``sets``,
    the forwards untimed (``sync`` after them)."""
    outs = [attend(*qkv) for qkv in sets]
    if sync is not None:
        sync()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for o, qkv in zip(outs, sets):
        torch.autograd.grad(o, qkv, dy)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / len(sets)


def describe_compute(c: ComputeCost) -> str:
    """The compute figures in one line: GFLOP/s per dtype, GB/s, µs."""
    flops = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in c.matmul_flops.items())
    sizes = ", ".join(f"{_size(b)} {r / 1e9:.1f}" for b, r in c.bandwidth_by_size)
    attention = "; ".join(
        f"{name} " + ", ".join(f"{k} {max(r for _, r in curve) / 1e9:.1f}" for k, curve in rates.items())
        for name, rates in c.attention_flops.items()
    )
    return (
        f"compute: matmul GFLOP/s {flops}; memory {c.memory_bandwidth / 1e9:.1f} GB/s"
        + (f" (by tensor size: {sizes})" if sizes else "")
        + (f"; attention GFLOP/s at best {attention}" if attention else "")
        + f"; launch {c.launch_s * 1e6:.2f} us; executor {c.instr_overhead_s * 1e6:.2f} us per instruction; "
        f"contention {c.contention:.2f}x"
    )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"
