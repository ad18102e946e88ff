"""The kernel each compute instruction of a per-rank program runs — shared by every executor.

Forward runs the sharding rule's :class:`~shardflow.parallel.rules.LocalOp`; backward is its vjp
(``torch.func.vjp``, nothing written by hand), with the linearity scale undone where the gradient sharding
says so; the optimizer updates each shard where it lives (same formulas as ``torch.optim.SGD``/``AdamW``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from shardflow.graph.ops import torch_dtype
from shardflow.lower.dynamic import OPTIMIZER_SLOTS, DNode, DynamicGraph, NodeKind, Optimizer, TaskType, UpdateRule
from shardflow.lower.program import LOCAL_MOVES, Compute
from shardflow.parallel.pcg import PCG, PNode

Kernel = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


@dataclass(frozen=True)
class OptimizerConfig:
    """``name``: an :class:`~shardflow.lower.dynamic.Optimizer` or its name (sgd, adamw). SGD: ``lr``,
    ``momentum``, ``weight_decay``; AdamW: ``lr``, ``betas``, ``eps``, ``weight_decay`` (decoupled). Defaults
    follow torch.optim."""

    name: Optimizer | str = Optimizer.SGD
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @property
    def slots(self) -> UpdateRule:
        """The update (a key of :data:`OPTIMIZER_SLOTS`) whose state this optimizer keeps. Raises ValueError for
        an unknown optimizer."""
        return UpdateRule.of(self.name, self.momentum)


def update(cfg: OptimizerConfig, step: int, w: torch.Tensor, g: torch.Tensor, *state: torch.Tensor) -> list[torch.Tensor]:
    """One optimizer step on one shard, in place (the weight and state buffers are updated and returned;
    fresh weight-sized allocations every step cost more than the arithmetic). ``step`` counts from 1."""
    if cfg.name == Optimizer.SGD:
        if cfg.weight_decay:
            g = g.add(w, alpha=cfg.weight_decay)
        if cfg.momentum:
            (buf,) = state
            buf.mul_(cfg.momentum).add_(g)
            return [w.sub_(buf, alpha=cfg.lr), buf]
        return [w.sub_(g, alpha=cfg.lr)]
    m, v = state
    b1, b2 = cfg.betas
    if cfg.weight_decay:
        w.mul_(1 - cfg.lr * cfg.weight_decay)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / (1 - b2 ** step) ** 0.5).add_(cfg.eps)
    return [w.addcdiv_(m, denom, value=-cfg.lr / (1 - b1 ** step)), m, v]


def make_kernel(dn: DNode, dg: DynamicGraph, rank: int, cfg: OptimizerConfig, step: Callable[[], int],
                saved: dict | None = None, seed: int = 0) -> Kernel:
    """The kernel of dynamic-graph node ``dn`` on ``rank``. ``step()`` gives the current step, counted from 1
    (for AdamW and for random ops); ``seed`` is the run's seed random ops draw with (see :func:`forward`).

    ``saved``: this rank's store of forward autograd graphs. When given, a forward whose node has a backward
    records its graph there and the backward reuses it (no second forward); without it, or when the forward
    ran in chunks (a fused ring), the backward recomputes the forward under ``torch.func.vjp``.
    """
    if dn.kind == NodeKind.COMPUTE:
        pnode = next(p for p in dg.pcg.nodes if p.name == dn.src)
        fwd = forward(dg.pcg, pnode, rank, seed, step)
        if dn.pass_ == TaskType.FWD:
            bwd = dg.backward_node(dn.src)
            if saved is None or bwd is None:
                return lambda xs: list(fwd(*xs))
            return _recording_forward(fwd, bwd.grad_mask, dn.src, saved)
        return _vjp_kernel(fwd, len(pnode.inputs), dn, saved)
    if dn.kind == NodeKind.SEED:
        return lambda xs: [torch.ones_like(xs[0])]
    if dn.kind == NodeKind.SUM:
        return lambda xs: [sum(xs[1:], xs[0])]
    if dn.kind == NodeKind.UPDATE:
        slots = dn.inputs[2:len(dn.inputs) - (dn.clip > 0)]
        if OPTIMIZER_SLOTS[cfg.slots] != tuple(dg.values[v].slot for v in slots):
            raise ValueError(f"the plan was lowered for optimizer state {slots}, not for {cfg}")
        if dn.clip:  # torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), at most 1
            def clipped(xs):
                scale = (dn.clip / (xs[-1].sqrt() + 1e-6)).clamp(max=1.0)
                return update(cfg, step(), xs[0], xs[1] * scale, *xs[2:-1])
            return clipped
        return lambda xs: update(cfg, step(), *xs)
    if dn.kind == NodeKind.SUMSQ:
        dtype = torch_dtype(dg.values[dn.outputs[0]].type.dtype)
        return lambda xs: [sum((x.pow(2).sum() for x in xs), torch.zeros((), dtype=dtype))]
    # degree 1: nothing moves
    if dn.kind in (NodeKind.SELECT, NodeKind.COPY) or (dn.kind == NodeKind.PARALLEL and dn.op.degree == 1):
        return lambda xs: [xs[0]]
    if dn.kind == NodeKind.PARALLEL:  # a Repartition of replicas: keep this rank's block of the dim
        index = dn.group.coords(rank)[dn.op.axis]
        return lambda xs: [xs[0].chunk(dn.op.degree, dn.op.dim)[index].contiguous()]
    raise ValueError(f"no kernel for dynamic-graph node {dn.name!r} of kind {dn.kind!r}")


def forward(pcg: PCG, pnode: PNode, rank: int, seed: int, step: Callable[[], int]) -> Callable[..., tuple]:
    """The local forward of compute node ``pnode`` on ``rank``: pieces in, pieces out. A random op (dropout)
    draws at its piece's site for the current ``step()`` (:meth:`PCG.draw_site`): the same numbers as one
    device, on every replica, and again when the backward recomputes the forward."""
    local = pnode.local
    if not local.op.random:
        return local.compute
    return lambda *xs: local.compute(*xs, at=pcg.draw_site(pnode, rank, seed, step()))


def single_calls(program) -> set[str]:
    """Dynamic-graph nodes computed by exactly one instruction of ``program`` (not chunk by chunk)."""
    counts: dict[str, int] = {}
    for i in program.instrs:
        if isinstance(i, Compute) and i.dnode:
            counts[i.dnode] = counts.get(i.dnode, 0) + 1
    return {k for k, n in counts.items() if n == 1}


def local_move(instr: Compute, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The data-movement computes lowering adds around rings (:data:`LOCAL_MOVES`): chunk, concat, add."""
    if instr.op == "chunk":
        return [x.contiguous() for x in xs[0].chunk(len(instr.outs), instr.dim)]
    if instr.op == "concat":
        return [torch.cat(list(xs), instr.dim)]
    if instr.op == "add":
        return [xs[0] + xs[1]]
    if instr.op == "pack":
        return [torch.cat([x.reshape(-1) for x in xs])]
    if instr.op == "unpack":  # views into the flat buffer, no copy
        parts = xs[0].split([b.type.numel for b in instr.outs])
        return [x.view(b.type.shape) for x, b in zip(parts, instr.outs)]
    raise ValueError(f"no local kernel for {instr.op!r} (one of {LOCAL_MOVES})")


def _recording_forward(fwd: Callable, grad_mask: Sequence[bool], key: str, saved: dict) -> Kernel:
    def kernel(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        args = [x.detach().requires_grad_() if m else x for x, m in zip(xs, grad_mask)]
        with torch.enable_grad():
            outs = fwd(*args)
        saved[key] = ([a for a, m in zip(args, grad_mask) if m], outs)
        return [o.detach() for o in outs]

    return kernel


def _vjp_kernel(fwd: Callable, n_in: int, dn: DNode, saved: dict | None = None) -> Kernel:
    diff = [i for i, m in enumerate(dn.grad_mask) if m]

    def kernel(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        args, dys = list(xs[:n_in]), iter(xs[n_in:])
        recorded = saved.pop(dn.src, None) if saved is not None else None
        if recorded is not None:  # reuse the forward's autograd graph
            inputs, outs = recorded
            pairs = [(o, next(dys)) for o, m in zip(outs, dn.dy_mask) if m]
            grads = torch.autograd.grad([o for o, _ in pairs], inputs, [d for _, d in pairs], allow_unused=True)
            grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
        else:
            def f(*d):
                a = list(args)
                for i, t in zip(diff, d):
                    a[i] = t
                return fwd(*a)

            outs, vjp = torch.func.vjp(f, *(args[i] for i in diff))
            cot = tuple(next(dys) if m else torch.zeros_like(o) for o, m in zip(outs, dn.dy_mask))
            grads = vjp(cot)
        return [g * dn.unscale[i] if dn.unscale[i] != 1.0 else g for i, g in zip(diff, grads)]

    return kernel
