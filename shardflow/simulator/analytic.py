"""A closed-form estimate of a plan's step time and peak memory, for ranking the search's candidates before any is
lowered (docs/search.md#screening).

The simulator replays a plan's per-rank programs (:mod:`shardflow.simulator.replay`): exact for those programs, but
each candidate must be planned and lowered first, a fraction of a second to minutes on a large world. This module
prices a candidate from totals of the model's graph instead — the compute of one repeated block and of the rest
(:class:`Part`, each op's roofline on the machine spec, :meth:`MachineSpec.compute_seconds`), their weights and the
activations their backward reads — and the textbook cost of each axis's communication (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, §3; FSDP's gathers and
reduce-scatters, Zhao et al. VLDB 2023), priced on the spec's links (:meth:`MachineSpec.comm_seconds`). It takes
microseconds per candidate and is not the simulator: its error against the replay is what the search calibrates
and states (:class:`Estimate`, docs/search.md#screening)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from shardflow.graph import ComputationGraph
from shardflow.graph.blocks import block_nodes, repeated_blocks
from shardflow.graph.flops import op_flops
from shardflow.graph.graph import Node, TensorRole
from shardflow.graph.ops import Attention, Experts, Linear, torch_dtype
from shardflow.lower.cost import CPAttention, LowerOptions
from shardflow.lower.dynamic import ActivationCheckpointing
from shardflow.lower.schedule import ScheduleKind
from shardflow.parallel.collectives import CommKind, wire_bytes
from shardflow.parallel.mesh import Mesh
from shardflow.simulator.cost import ATTENTION_BACKWARD
from shardflow.simulator.machine import MachineSpec

# a backward's memory-bound kernels against the forward's: each reads the forward's input and the output's
# gradient and writes the input's gradient (three tensors where the forward moves two)
BACKWARD_MEMORY = 1.5
# under sequence parallelism, the column-parallel groups of a block whose input is all-gathered over tp: a transformer
# block's attention (q, k, v) and MLP (gate, up) — kept whole for the backward unless regathered
# (docs/lowering.md#regathering-activations)
COLUMN_GROUPS = 2


@dataclass(frozen=True)
class Part:
    """Totals of one part of a model — one repeated block, or everything outside the blocks — for a step's whole
    batch on one device, nothing sharded.

    ``matmul_s``: seconds of the forward's matmul-like ops (those with FLOPs), each op's roofline without its launch
    floor; ``backward_s``: their backward's (:data:`~shardflow.simulator.cost.ATTENTION_BACKWARD` × for an
    attention, one product per input that gets a gradient for a linear); ``memory_s``: the forward's memory-bound
    ops' (their backward :data:`BACKWARD_MEMORY` ×), ``stream_s`` of them those on the residual stream (outputs
    shaped like the part's input: the norms and residual adds that tensor parallelism without sequence parallelism
    runs whole on every rank). ``kernels``: the forward's ops, ``matmuls`` of them matmul-like. ``weight_bytes``: the weights its ops read
    (``expert_bytes`` of them an expert layer's). ``saved_bytes``: every forward output (what its backward reads
    where nothing is recomputed), ``stream_bytes`` of them on the residual stream and ``kept_bytes`` the matmul-like
    ops' (what selective checkpointing keeps); ``input_bytes``: the activations it reads from outside (a block's
    hidden state); ``kv_bytes``: its attentions' keys and values."""

    matmul_s: float = 0.0
    backward_s: float = 0.0
    memory_s: float = 0.0
    stream_s: float = 0.0
    kernels: int = 0
    matmuls: int = 0
    weight_bytes: int = 0
    expert_bytes: int = 0
    saved_bytes: int = 0
    stream_bytes: int = 0
    kept_bytes: int = 0
    input_bytes: int = 0
    kv_bytes: int = 0

    @classmethod
    def of(cls, graph: ComputationGraph, nodes: list[Node], spec: MachineSpec, scale: int = 1) -> Part:
        """The totals of ``nodes`` of ``graph`` on one device of ``spec``, times ``scale`` (the graph holds one of
        that many equal parts of the batch; weights are not scaled)."""
        t = graph.tensors
        inside = {o for n in nodes for o in n.outputs}
        weights = set(graph.weights)
        entering = [
            i
            for i in dict.fromkeys(i for n in nodes for i in n.inputs)
            if i not in inside and i not in weights and t[i].role == TensorRole.ACTIVATION
        ]
        stream = {t[i].type.shape for i in entering}
        mm = back = mem = on_stream = 0.0
        saved = stream_bytes = kept = kv = wbytes = ebytes = matmuls = 0
        for n in nodes:
            ins = tuple(t[i].type for i in n.inputs)
            outs = tuple(t[o].type for o in n.outputs)
            both = ins + outs
            floating = [x for x in both if torch_dtype(x.dtype).is_floating_point]
            dtype = torch_dtype((floating or list(both))[0].dtype) if both else torch.float32
            moved = sum(x.nbytes for x in both)
            largest = max((x.nbytes for x in both), default=0)
            flops = op_flops(n.op, ins, outs)
            attention = isinstance(n.op, Attention)
            seconds = spec.compute_seconds(flops, moved, dtype, 0, largest, "forward" if attention else None)
            out_bytes = sum(x.nbytes for x in outs)
            saved += out_bytes
            if flops:
                mm += seconds
                matmuls += 1
                kept += out_bytes
                if attention:
                    back += spec.compute_seconds(int(ATTENTION_BACKWARD * flops), 2 * moved, dtype, 0, None, "backward")
                else:
                    back += (2 if isinstance(n.op, (Linear, Experts)) else 1) * seconds
            else:
                mem += seconds
                if any(x.shape in stream for x in outs):
                    on_stream += seconds
                    stream_bytes += out_bytes
            if attention:
                kv += sum(x.nbytes for x in ins[1:3])
            for i in n.inputs:
                if i in weights:
                    wbytes += t[i].type.nbytes
                    ebytes += t[i].type.nbytes if isinstance(n.op, Experts) else 0
                    weights.discard(i)
        return cls(
            mm * scale,
            back * scale,
            mem * scale,
            on_stream * scale,
            len(nodes),
            matmuls,
            wbytes,
            ebytes,
            saved * scale,
            stream_bytes * scale,
            kept * scale,
            sum(t[i].type.nbytes for i in entering) * scale,
            kv * scale,
        )


@dataclass(frozen=True)
class Profile:
    """A model as the estimate sees it: ``blocks`` repeated blocks alike to ``block``, and ``rest`` (embedding, final
    norm, head, loss), for a step's whole batch (:class:`Part`)."""

    blocks: int
    block: Part
    rest: Part

    @classmethod
    def of(cls, graph: ComputationGraph, blocks: int, spec: MachineSpec, scale: int = 1) -> Profile:
        """From ``graph`` (a copy of the model with at least one of its repeated blocks; its last block stands for
        every one of the model's ``blocks``), captured on one of ``scale`` equal parts of the step's batch."""
        names = repeated_blocks(graph)
        nodes = block_nodes(graph, names)
        inside = {n.name for ns in nodes.values() for n in ns}
        rest = [n for n in graph.nodes if n.name not in inside]
        last = nodes[names[-1]] if names else []
        return cls(blocks if names else 0, Part.of(graph, last, spec, scale), Part.of(graph, rest, spec, scale))


@dataclass(frozen=True)
class Estimate:
    """A candidate's estimated step (seconds) and peak bytes on its busiest rank."""

    step_seconds: float
    peak_bytes: int


@functools.lru_cache(maxsize=4096)
def _group(mesh: Mesh, axis: str) -> tuple[int, ...]:
    """Rank 0's group along ``axis`` of ``mesh`` (global ranks)."""
    i = mesh.axis_index(axis)
    return tuple(mesh.device(tuple(k if j == i else 0 for j in range(mesh.ndim))) for k in range(mesh.shape[i]))


def estimate(
    profile: Profile,
    mesh: Mesh,
    strategy: str,
    options: LowerOptions,
    slots: int,
    spec: MachineSpec,
) -> Estimate:
    """The estimated step time and peak of ``profile`` planned as preset ``strategy`` on ``mesh`` with ``options``
    (its checkpointing, schedule, microbatches, accumulation and precision), an optimizer of ``slots`` state slots
    per weight (AdamW: 2) on ``spec``.
    The head's activations are split over tp, as the presets' vocabulary-parallel loss splits them.

    Per rank: the forward and backward of its blocks (``blocks``/pp, their work split over every other axis; a
    memory-bound op not split by tp without sp) and of the rest, plus the recomputation ``ac`` asks for; the weights'
    collectives (fsdp: all-gather for the forward and again for the backward, reduce-scatter of the gradients;
    dp: all-reduce), which overlap the compute where ``spec.overlap``; the exposed collectives of the blocks (tp:
    two all-reduces per block and pass, or their reduce-scatter and all-gather under sp, and with
    ``regather_activations`` one all-gather more per column group in the backward; cp: the keys and values
    gathered; ep: the tokens gathered and their outputs reduce-scattered; pp: each microbatch's activations sent
    per chunk); a pipeline's bubble ((m + p − 1)/m, interleaved (m + (p − 1)/v)/m). Peak: the state (weights,
    gradients, optimizer slots and master weights in the reduce dtype, sharded as the weights are), the gathered
    weights of two blocks under fsdp (of the whole stage under a pipeline, twice with resharding after the forward
    but under GPipe: its gathers are made once per step, docs/lowering.md#fsdp-under-a-pipeline), the gradients
    summed over micro-steps or microbatches, whole over fsdp
    (docs/lowering.md#12-gradient-accumulation-micro-steps-microstep),
    and the activations of the microbatches in flight on the first stage (p under
    1F1B and interleaved, m under GPipe): all of a block's outputs, its matmuls' outputs under selective
    checkpointing, its input only under checkpointing per block, plus what one block recomputes while it does; under
    sp with ``regather_activations`` and selective checkpointing, the pieces of its :data:`COLUMN_GROUPS`' inputs
    that the regathers read. Without regathering, sp's whole gathers kept for the backward are counted as pieces
    (docs/search.md#screening: its peak is low by up to 2× under selective checkpointing)."""
    deg = dict(zip(mesh.axis_names, mesh.shape))
    pp, dp, fsdp, ep, cp, tp = (deg.get(a, 1) for a in ("pp", "dp", "fsdp", "ep", "cp", "tp"))
    sp = "sp" in strategy.split(",")
    m, a, v = options.microbatches, options.accumulate, options.stages_per_rank
    data = dp * fsdp * ep * cp
    shard = data * tp
    b, r = profile.block, profile.rest
    per_rank = profile.blocks / pp
    ac = options.ac
    whole = shard if sp or tp == 1 else data  # what splits the residual stream

    def memory(p: Part) -> float:
        return (p.memory_s - p.stream_s) / shard + p.stream_s / whole

    recompute = {
        ActivationCheckpointing.NONE: 0.0,
        ActivationCheckpointing.SELECTIVE: memory(b),
        ActivationCheckpointing.BLOCK: b.matmul_s / shard + memory(b),
    }[ac]

    def work(p: Part) -> float:
        return (p.matmul_s + p.backward_s) / shard + (1 + BACKWARD_MEMORY) * memory(p)

    again = {
        ActivationCheckpointing.NONE: 0,
        ActivationCheckpointing.SELECTIVE: b.kernels - b.matmuls,
        ActivationCheckpointing.BLOCK: b.kernels,
    }[ac]
    launches = (per_rank * (b.kernels * 3 + again) + r.kernels * 3) * m * a
    compute = per_rank * (work(b) + recompute) + work(r) + launches * (spec.device.launch_s + spec.instr_overhead_s)

    precision = options.precision
    ratio = precision.reduce_dtype.itemsize / precision.param_dtype.itemsize if precision else 1
    dense = (per_rank * (b.weight_bytes - b.expert_bytes) + r.weight_bytes) / tp
    experts = per_rank * b.expert_bytes / (tp * ep)
    weights = dense + experts  # this rank's before fsdp
    grads = weights * ratio

    def comm(kind: CommKind, axis: str, piece: float) -> float:
        d = deg.get(axis, 1)
        if d == 1 or piece <= 0:
            return 0.0
        return spec.comm_seconds(
            kind.value if kind != CommKind.SEND else "p2p", _group(mesh, axis), wire_bytes(kind, int(piece), d)
        )

    gathers = (2 if options.reshard_after_forward else 1) * comm(CommKind.ALL_GATHER, "fsdp", weights / fsdp)
    background = a * (
        gathers + comm(CommKind.REDUCE_SCATTER, "fsdp", grads / fsdp) + comm(CommKind.ALL_REDUCE, "dp", grads / fsdp)
    )
    first = background / max(per_rank, 1)  # the first block's gather and the last gradients' reduction wait
    hidden = b.input_bytes / (data * m * a)  # one microbatch's hidden state on a rank (whole over tp)
    passes = 2 + (1 if ac == ActivationCheckpointing.BLOCK else 0)
    # under sp, each column group's input (COLUMN_GROUPS per block) all-gathered whole over tp: kept from the forward
    # for the backward, or (regathered) gathered again before it where the block is not recomputed whole
    regather = sp and options.regather_activations and ac != ActivationCheckpointing.BLOCK
    if sp:
        tp_s = passes * 2 * (
            comm(CommKind.REDUCE_SCATTER, "tp", hidden / tp) + comm(CommKind.ALL_GATHER, "tp", hidden / tp)
        ) + (COLUMN_GROUPS * comm(CommKind.ALL_GATHER, "tp", hidden / tp) if regather else 0.0)
    else:
        tp_s = passes * 2 * comm(CommKind.ALL_REDUCE, "tp", hidden)
    kv = b.kv_bytes / (shard * m * a)
    if options.cp_attention == CPAttention.ALL_TO_ALL:
        cp_s = passes * 2 * comm(CommKind.ALL_TO_ALL, "cp", (b.kv_bytes + 2 * b.input_bytes) / (shard * m * a))
    else:
        cp_s = passes * (comm(CommKind.ALL_GATHER, "cp", kv) + comm(CommKind.REDUCE_SCATTER, "cp", kv))
    ep_s = (
        passes * (comm(CommKind.ALL_GATHER, "ep", hidden) + comm(CommKind.REDUCE_SCATTER, "ep", hidden))
        if b.expert_bytes
        else 0.0
    )
    pp_s = 2 * v * comm(CommKind.SEND, "pp", hidden / tp) if pp > 1 else 0.0
    exposed = m * a * (per_rank * (tp_s + cp_s + ep_s) + pp_s)
    core = (max(compute, background) + first if spec.overlap else compute + background) + exposed
    if pp > 1:
        core *= (m + (pp - 1) / v) / m if options.schedule == ScheduleKind.INTERLEAVED else (m + pp - 1) / m

    state = (dense / fsdp + experts / fsdp) * (1 + ratio * (1 + slots + (1 if precision else 0)))
    if fsdp == 1:
        gathered = 0.0
    elif m > 1:  # a pipeline gathers once per step for every microbatch: the stage's weights, for the forwards and
        # (resharded after them) again for the backwards, both live at once but under GPipe
        both = options.reshard_after_forward and options.schedule != ScheduleKind.GPIPE
        gathered = (2 if both else 1) * weights
    else:
        gathered = 2 * (b.weight_bytes / tp)  # two blocks' at a time
    # the gradients summed over micro-steps and microbatches before their one reduction: whole over fsdp, beside the
    # gradients the step reduces
    sums = grads if m * a > 1 else 0.0
    in_flight = m if options.schedule == ScheduleKind.GPIPE else min(m, pp)
    full = (b.saved_bytes - b.stream_bytes) / shard + b.stream_bytes / whole
    held = {
        ActivationCheckpointing.NONE: full,
        ActivationCheckpointing.SELECTIVE: b.kept_bytes / shard + b.input_bytes / whole,
        ActivationCheckpointing.BLOCK: b.input_bytes / whole,
    }[ac] / (m * a)
    if regather and ac == ActivationCheckpointing.SELECTIVE:  # the pieces the regathers read, kept
        held += COLUMN_GROUPS * hidden / tp
    # while a block recomputes: what it recomputes, live at once
    working = {
        ActivationCheckpointing.NONE: 0,
        ActivationCheckpointing.SELECTIVE: full - b.kept_bytes / shard,
        ActivationCheckpointing.BLOCK: full,
    }[ac] / (m * a)
    acts = per_rank * held * in_flight + working
    head = r.saved_bytes / (shard * m * a)
    peak = state + gathered + sums + acts + head
    return Estimate(core, int(math.ceil(peak)))
