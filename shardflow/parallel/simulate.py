"""Run a PCG forward on every device of its mesh in one process — the numeric oracle for sharding rules.

Compute nodes run their rule's :class:`LocalOp` on each device's pieces; parallel ops are carried out by
assembling the full tensor and cutting it again for the output sharding, so only the *meaning* of each
sharding is exercised, not any communication schedule (that is the executors' job). Partial pieces are made
random (they add up — or average, or max — to the tensor), so a wrong linearity scale shows up as a wrong
number rather than hiding behind zeros.
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardflow.graph.fused import stored
from shardflow.graph.graph import TensorRole
from shardflow.parallel.mesh import ReduceOp
from shardflow.parallel.pcg import PCG, PTensor

Pieces = dict[int, torch.Tensor]  # device → piece


def _pshape(t):
    return t.sharding.parallel_shape(t.group, t.type.shape, t.type.dtype)


def blocks(t: PTensor) -> dict[int, tuple[slice | torch.Tensor, ...]]:
    """Device → the elements of the full tensor its piece of ``t`` holds (its index into the full tensor, ``t.type``'s
    shape: :meth:`~shardflow.parallel.shape.ParallelTensorShape.piece_index`), for every device of ``t``'s sub-mesh."""
    p = _pshape(t)
    return {d: p.piece_index(c) for d, c in t.sharding.device_map(t.group).items()}


def scatter(full: torch.Tensor, t: PTensor, gen: torch.Generator | None = None) -> Pieces:
    """Cut ``full`` into the pieces ``t``'s sharding gives each device of its sub-mesh (copies: a piece never
    shares the caller's storage).

    ``t``: anything with ``sharding``, ``group`` and ``type`` (a PCG tensor or a dynamic-graph value).
    Shape: ``full`` is ``t.type.shape``; each piece the parallel shape's piece shape (a short block of an uneven dim
    padded with zeros: docs/concepts.md#uneven-shards).
    """
    p = _pshape(t)
    if not t.sharding.partial:
        if p.uneven:
            return {d: p.piece_of(full, c).clone() for d, c in t.sharding.device_map(t.group).items()}
        return {d: full[b].clone() for d, b in blocks(t).items()}
    dmap = t.sharding.device_map(t.group)
    blocks_ = {d: full[p.piece_index(c)] for d, c in dmap.items()}
    gen = gen or torch.Generator().manual_seed(0)
    noise: dict[tuple, torch.Tensor] = {}
    out: Pieces = {}
    for d, c in dmap.items():
        key = (c.replica, c.shard)
        if key not in noise:
            r = torch.randn((p.sum_degree,) + blocks_[d].shape, generator=gen, dtype=torch.float64)
            noise[key] = r.to(full.dtype)
        r = noise[key]
        # integers: exact pieces summing to the block
        if p.reduce_op == ReduceOp.SUM and not full.dtype.is_floating_point:
            r = r.round()
            piece = blocks_[d] - r[1:].sum(0) if c.sum == 0 else r[c.sum]
        elif p.reduce_op == ReduceOp.SUM:
            piece = blocks_[d] / p.sum_degree + r[c.sum] - r.mean(0)
        elif p.reduce_op == ReduceOp.AVG:
            piece = blocks_[d] + r[c.sum] - r.mean(0)
        else:  # max / min: one piece holds the value, the others are beyond it on the losing side
            sign = -1 if p.reduce_op == ReduceOp.MAX else 1
            piece = blocks_[d] + (0 if c.sum == 0 else sign * (r[c.sum].abs() + 1))
        out[d] = p.padded(piece)
    return out


def gather(pieces: Mapping[int, torch.Tensor], t: PTensor) -> torch.Tensor:
    """Assemble the full tensor from the pieces (replica 0 of each block; partial pieces reduced)."""
    p = _pshape(t)
    dmap = t.sharding.device_map(t.group)
    first = next(iter(pieces.values()))
    full = torch.zeros(p.shape, dtype=first.dtype, device=first.device)
    by_block: dict[tuple, list[torch.Tensor]] = {}
    for d, c in dmap.items():
        if c.replica == 0:
            by_block.setdefault(c.shard, []).append(pieces[d])
    for shard, parts in by_block.items():
        coord = next(c for c in dmap.values() if c.shard == shard)
        full[p.piece_index(coord)] = p.valid_of(p.reduce_op.combine(torch.stack(parts)), coord)
    return full


def _moved(pieces: Pieces, t: PTensor, group) -> Pieces:
    """The same sharding on another sub-mesh (a pipeline stage boundary): each piece goes to the device of
    ``group`` that holds the same coordinate."""
    src = {c: d for d, c in t.sharding.device_map(t.group).items()}
    return {d: pieces[src[c]] for d, c in t.sharding.device_map(group).items()}


def simulate(pcg: PCG, leaves: Mapping[str, torch.Tensor], seed: int = 0, step: int = 1) -> dict[str, Pieces]:
    """Forward of ``pcg``: every tensor's pieces on every device, from full values of the leaf tensors.

    ``leaves`` holds inputs and weights by graph name, weights in their module parameters' shapes (constants come
    from the graph). ``seed`` seeds the random
    partial pieces and, with ``step``, the draws of random ops (dropout: the same as
    :func:`shardflow.reference.run_forward` with that seed and step). Raises KeyError naming a missing leaf.
    """
    gen = torch.Generator().manual_seed(seed)
    leaves = stored(pcg.graph, leaves)
    values: dict[str, Pieces] = {}
    for name, t in pcg.tensors.items():
        if t.role != TensorRole.ACTIVATION and name in pcg.graph.tensors:
            full = pcg.graph.constants[name] if t.role == TensorRole.CONSTANT else leaves.get(name)
            if full is None:
                raise KeyError(f"no value for {t.role} {name!r} of shape {list(t.type.shape)}")
            values[name] = scatter(full, t, gen)
    for node in pcg.nodes:
        if node.is_parallel:
            (src,) = node.inputs
            full = gather(values[src], pcg.tensors[src])
            values[node.outputs[0]] = scatter(full, pcg.tensors[node.outputs[0]], gen)
            continue
        ins = [
            values[i] if pcg.tensors[i].group == node.group else _moved(values[i], pcg.tensors[i], node.group)
            for i in node.inputs
        ]
        per_device: dict[int, tuple[torch.Tensor, ...]] = {}
        for d in node.group.devices():
            at = pcg.draw_site(node, d, seed, step) if node.op.random else None
            per_device[d] = pcg.local_of(node, d).compute(*(x[d] for x in ins), at=at)
        for k, o in enumerate(node.outputs):
            values[o] = {d: outs[k] for d, outs in per_device.items()}
    return values


def simulate_outputs(
    pcg: PCG, leaves: Mapping[str, torch.Tensor], seed: int = 0, step: int = 1
) -> dict[str, torch.Tensor]:
    """Full values of every tensor of the original graph, as the sharded run computes them (``seed`` and
    ``step`` as in :func:`simulate`)."""
    values = simulate(pcg, leaves, seed, step)
    return {name: gather(values[name], pcg.tensors[name]) for name in pcg.graph.tensors if name in values}
