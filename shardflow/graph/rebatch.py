"""A captured graph at another batch size, drawn from two captures instead of capturing again
(docs/search.md#capturing-once-per-depth).

The search predicts each candidate on the graph of one of its micro-batches: ``parts`` of the step's batch for
every micro-batch count and accumulation it tries, one capture (``torch.export``, seconds each) per part size.
A transformer's graph at ``b`` sequences differs from its graph at another size only in integers that are affine
in ``b``: the batch dim of its activations' shapes and of its ops' attributes (a reshape to ``[b·T, C]``, an
expand to ``[b, H, T, T]``). Two captures at ``b₁`` and ``b₂`` sequences therefore give every such integer as a
line, and :func:`rebatch` evaluates the line at any ``b``.

It is exact or it refuses: the two graphs must have the same nodes, names, ops, constants and every other value
alike; each integer that differs must land on an integer at ``b``, non-negative; and the graph built is checked by
:meth:`~shardflow.graph.graph.ComputationGraph.validate`, which infers every node's output shape from its inputs
through the op's own rule. Where any of that fails (a model whose graph changes with the batch size: a Python
branch on it, a specialization torch.export makes at size 1), :class:`RebatchError` says where, and the caller
captures.
"""

from __future__ import annotations

from typing import Any

import torch

from shardflow.graph.graph import ComputationGraph


class RebatchError(ValueError):
    """The two captures do not differ only by integers affine in the batch size (the message names where)."""


def rebatch(a: ComputationGraph, size_a: int, b: ComputationGraph, size_b: int, size: int) -> ComputationGraph:
    """The graph of the model whose graph at ``size_a`` sequences is ``a`` and at ``size_b`` (≠ ``size_a``) is
    ``b``, at ``size`` sequences: each integer of the graphs (shapes, op attributes) that differs between the two,
    drawn as a line through them and read at ``size``. Raises RebatchError where the graphs differ otherwise,
    where a line does not land on a non-negative integer, or where the graph built is not valid."""
    if size_a == size_b:
        raise RebatchError(f"two captures at the same batch size {size_a}")
    if a.constants.keys() != b.constants.keys() or any(
        v.dtype != b.constants[k].dtype or v.shape != b.constants[k].shape or not torch.equal(v, b.constants[k])
        for k, v in a.constants.items()
    ):
        raise RebatchError("the constants differ between the two captures")
    line = _line(a.to_json(constants=False), b.to_json(constants=False), size_a, size_b, size, "graph")
    try:
        return ComputationGraph.from_json(line, a.constants)
    except (ValueError, TypeError) as e:
        raise RebatchError(f"the graph drawn at batch size {size} is not valid: {e}") from None


def _line(x: Any, y: Any, sx: int, sy: int, s: int, where: str) -> Any:
    """``x`` (at batch size ``sx``) and ``y`` (at ``sy``) read at ``s``: equal values as they are, differing
    integers on their line."""
    if type(x) is not type(y):
        raise RebatchError(f"{where}: {x!r} at batch size {sx} but {y!r} at {sy}")
    if isinstance(x, dict):
        if x.keys() != y.keys():
            raise RebatchError(f"{where}: keys {sorted(x)} at batch size {sx} but {sorted(y)} at {sy}")
        return {k: _line(x[k], y[k], sx, sy, s, f"{where}.{k}") for k in x}
    if isinstance(x, list):
        if len(x) != len(y):
            raise RebatchError(f"{where}: {len(x)} entries at batch size {sx} but {len(y)} at {sy}")
        return [_line(u, v, sx, sy, s, f"{where}[{i}]") for i, (u, v) in enumerate(zip(x, y))]
    if x == y:
        return x
    if type(x) is not int:  # a float, string or bool that changes with the batch: not a line in it
        raise RebatchError(f"{where}: {x!r} at batch size {sx} but {y!r} at {sy}")
    rise = (y - x) * (s - sx)
    if rise % (sy - sx) or x + rise // (sy - sx) < 0:
        raise RebatchError(f"{where}: {x} at batch size {sx} and {y} at {sy} give no whole size at {s}")
    return x + rise // (sy - sx)
