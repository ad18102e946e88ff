"""Single-device reference interpreter: run a :class:`ComputationGraph` with each op's torch kernel.

This is the ground truth the parallel executors are compared against. Gradients come from torch
autograd over the ops' ``compute``; nothing is differentiated by hand.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from shardflow.graph import ComputationGraph, TensorRole
from shardflow.graph.fused import stored
from shardflow.graph.ops import dtype_name
from shardflow.graph.rng import DrawSite


def _shape(graph: ComputationGraph, name: str) -> tuple[int, ...]:
    """The shape a tensor is given in: a weight in its module parameter's (:meth:`ComputationGraph.module_shape`)."""
    return graph.module_shape(name) if graph.tensors[name].role == TensorRole.WEIGHT else graph.tensors[name].shape


def _describe(graph: ComputationGraph, name: str) -> str:
    return f"{graph.tensors[name].dtype}{list(_shape(graph, name))}"


def leaves(graph: ComputationGraph, given: Mapping[str, torch.Tensor], role: TensorRole) -> dict[str, torch.Tensor]:
    """The graph's tensors of ``role`` (e.g. the data inputs of a step) from ``given``, checked by name, shape and
    dtype.

    Raises:
        KeyError: a tensor of ``role`` is missing (the message gives its expected dtype and shape), or ``given`` has
            a name the graph has no ``role`` of.
        ValueError: a tensor has another shape or dtype than the graph's.
    """
    names = graph.by_role(role)
    missing = [n for n in names if n not in given]
    if missing:
        raise KeyError(f"missing {role}(s): " + ", ".join(f"{n!r} (expected {_describe(graph, n)})" for n in missing))
    extra = [n for n in given if n not in names]
    if extra:
        raise KeyError(f"unknown {role}(s) {extra}; the graph's {role}s are {list(names)}")
    for n in names:
        t = given[n]
        if tuple(t.shape) != _shape(graph, n) or dtype_name(t.dtype) != graph.tensors[n].dtype:
            raise ValueError(f"{role} {n!r} is {dtype_name(t.dtype)}{list(t.shape)}, expected {_describe(graph, n)}")
    return {n: given[n] for n in names}


def run_forward(
    graph: ComputationGraph,
    inputs: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor],
    seed: int = 0,
    step: int = 1,
) -> dict[str, torch.Tensor]:
    """Run every node in order; returns every tensor of the graph by name (inputs, weights, constants too).

    Args:
        inputs: one tensor per graph input (e.g. ``idx [B, T]``), with the graph's shape and dtype.
        weights: one tensor per graph weight (e.g. ``transformer.wte.weight [V, C]``) in its module parameter's
            shape; see :func:`weights_of`.
        seed, step: the run seed and the training step (from 1) random ops draw for: dropout drops what the
            executors' step ``step`` of a run with that seed drops (:mod:`shardflow.graph.rng`).

    Raises:
        KeyError: an input or weight is missing (the message gives its expected dtype and shape) or unknown.
        ValueError: an input or weight has the wrong shape or dtype.
    """
    env = {
        **leaves(graph, inputs, TensorRole.INPUT),
        **stored(graph, leaves(graph, weights, TensorRole.WEIGHT)),
        **graph.constants,
    }
    for node in graph.nodes:
        draw = (
            {"at": DrawSite.whole(seed, step, node.name, graph.tensors[node.outputs[0]].shape)}
            if node.op.random
            else {}
        )
        env.update(zip(node.outputs, node.op.compute(*(env[t] for t in node.inputs), **draw)))
    return env


def run_backward(
    graph: ComputationGraph,
    inputs: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor],
    seed: int = 0,
    step: int = 1,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Forward (``seed`` and ``step`` as in :func:`run_forward`), then ``d(loss)/d(weight)`` for every graph
    weight by torch autograd.

    Returns:
        ``(tensors, grads)``: every graph tensor by name as in :func:`run_forward` (detached), and one
        gradient per weight with that weight's shape (zeros for a weight the loss does not depend on).

    Raises:
        ValueError: the graph has no loss; or as :func:`run_forward`.
        KeyError: as :func:`run_forward`.
    """
    if graph.loss is None:
        raise ValueError("run_backward needs a graph with a loss")
    leaves = {n: w.detach().requires_grad_(True) for n, w in weights.items()}
    with torch.enable_grad():
        env = run_forward(graph, inputs, leaves, seed, step)
        names = list(graph.weights)
        grads = torch.autograd.grad(
            env[graph.loss], [leaves[n] for n in names], allow_unused=True, materialize_grads=True
        )
    return {n: t.detach() for n, t in env.items()}, dict(zip(names, grads))


def weights_of(module: nn.Module, graph: ComputationGraph) -> dict[str, torch.Tensor]:
    """The graph's weights taken from ``module``'s parameters (by ``named_parameters()`` name, tied parameters under
    any of their names), detached copies.

    Raises:
        KeyError: a graph weight has no parameter of that name (the message gives the expected shape).
        ValueError: a parameter's shape or dtype differs from the graph weight's.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    missing = [n for n in graph.weights if n not in params]
    if missing:
        raise KeyError(
            "module has no parameter(s) for graph weight(s): "
            + ", ".join(f"{n!r} (expected {_describe(graph, n)})" for n in missing)
        )
    return leaves(graph, {n: params[n].detach().clone() for n in graph.weights}, TensorRole.WEIGHT)
