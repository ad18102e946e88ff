"""The kernel each compute instruction of a per-rank program runs — shared by every executor, built from the
instruction's kernel description alone (:data:`~shardflow.lower.program.KernelSpec`).

Forward runs the sharding rule's :class:`~shardflow.parallel.rules.LocalOp`; backward is its vjp — the
hand-written one of :mod:`shardflow.runtime.vjp` for the ops that table covers (measurably faster at ATen sizes),
else torch autograd (the forward's recorded graph, or ``torch.func.vjp``) — with the linearity scale undone where
the gradient sharding says so; the optimizer updates each shard where it lives, every shard of a run of updates at
once (:func:`update_kernel`: torch.optim's fused SGD/Adam/AdamW, at the step's learning rate: :class:`LRSchedule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Sequence

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from shardflow.graph.ops import Attention, key_block_vjp, lse_merge, torch_dtype
from shardflow.graph.rng import PieceSite
from shardflow.lower.dynamic import OPTIMIZER_SLOTS, Optimizer, UpdateRule
from shardflow.lower.program import (
    LOCAL_MOVES,
    Block,
    BlockVjp,
    Compute,
    Convert,
    Forward,
    Keep,
    OnesLike,
    Sum,
    SumOfSquares,
    Update,
    Vjp,
)
from shardflow.parallel.rules import LocalOp
from shardflow.runtime.vjp import HandVjp, hand_vjp

Kernel = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


class LRDecay(StrEnum):
    """How the learning rate falls after the warm-up (``--lr-schedule``): not at all (``constant``), along half a
    cosine (``cosine``) or a straight line (``linear``) to ``min_lr_ratio`` × the peak at the last step."""

    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of each step as a factor of the peak ``lr`` (torchtitan's ``lr_scheduler``, its
    ``linear_warmup_stable_decay`` with no stable phase, as a ``torch.optim.lr_scheduler.LambdaLR`` stepped after
    each optimizer step): step ``s`` (counted from 1) of ``warmup_steps`` (steps) warm-up takes
    ``s / (warmup_steps + 1)``; after it, with ``p = (s − warmup_steps) / (steps − warmup_steps)`` the fraction of
    the decay done, ``decay`` takes 1 (``constant``), ``0.5 (1 + cos πp)`` (``cosine``) or ``1 − p`` (``linear``),
    lifted to ``min_lr_ratio + (1 − min_lr_ratio) ×`` that, so the last of ``steps`` (the run's steps) ends at
    ``min_lr_ratio`` (a ratio, 0 to 1). The default is a constant rate. Raises ValueError for a negative
    ``warmup_steps``, a ``min_lr_ratio`` outside [0, 1], or a decay with ``steps`` ≤ ``warmup_steps``."""

    decay: LRDecay = LRDecay.CONSTANT  # its text ("cosine") is parsed on construction
    warmup_steps: int = 0
    steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        try:
            object.__setattr__(self, "decay", LRDecay(self.decay))  # its text parsed here, once
        except ValueError:
            raise ValueError(f"lr schedule {self.decay!r}: use one of {', '.join(LRDecay)}") from None
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"lr schedule: warmup_steps={self.warmup_steps} must be ≥ 0 and min_lr_ratio="
                f"{self.min_lr_ratio} in [0, 1]"
            )
        if self.decay != LRDecay.CONSTANT and self.steps <= self.warmup_steps:
            raise ValueError(
                f"lr schedule {self.decay}: decays over steps={self.steps} (the run's steps) after "
                f"warmup_steps={self.warmup_steps}; give steps > warmup_steps"
            )

    def factor(self, step: int) -> float:
        """The learning rate of step ``step`` (counted from 1) / the peak learning rate."""
        if step <= self.warmup_steps:
            return step / (self.warmup_steps + 1)
        if self.decay == LRDecay.CONSTANT:
            return 1.0
        done = (step - self.warmup_steps) / (self.steps - self.warmup_steps)
        left = 0.5 * (1.0 + math.cos(math.pi * done)) if self.decay == LRDecay.COSINE else 1.0 - done
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * left


@dataclass(frozen=True)
class OptimizerConfig:
    """``name``: the :class:`~shardflow.lower.dynamic.Optimizer` (sgd, adam, adamw). SGD: ``lr``,
    ``momentum``, ``weight_decay``; Adam and AdamW: ``lr``, ``betas``, ``eps``, ``weight_decay`` (added to the
    gradient, L2, for Adam; decoupled for AdamW). Defaults follow torch.optim. ``lr`` is the peak learning rate;
    ``schedule`` gives each step's (:meth:`lr_at`)."""

    name: Optimizer = Optimizer.SGD
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: LRSchedule = field(default_factory=LRSchedule)

    @property
    def slots(self) -> UpdateRule:
        """The update (a key of :data:`OPTIMIZER_SLOTS`) whose state this optimizer keeps."""
        return UpdateRule.of(self.name, self.momentum)

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (counted from 1): ``lr`` × the schedule's factor."""
        return self.lr * self.schedule.factor(step)


FUSED_DTYPES = ("float32", "float64")  # shards torch.optim's fused kernels update as eager torch.optim does


def update_kernel(updates: Sequence[Compute], cfg: OptimizerConfig, step: Callable[[], int]) -> Kernel:
    """One kernel for the optimizer updates ``updates`` (computes of :class:`Update` kernels, one shard each): its
    inputs are each update's (weight, gradient, state slots in order, and the squared global gradient norm when
    clipping), concatenated; its outputs each update's (weight, state), the same tensors updated in place.
    ``step()`` counts from 1; each call updates at that step's learning rate (:meth:`OptimizerConfig.lr_at`), a
    value of the run, not of the lowered programs.

    The update is torch.optim's own functional SGD / Adam over every shard at once (grouped by device and dtype),
    the formulas of ``torch.optim.SGD``/``Adam``/``AdamW`` (AdamW: Adam with decoupled weight decay):
    ``fused=True`` (one kernel per group) for float32 and float64 shards, else ``foreach=True`` (torch 2.13's fused
    CPU kernels compute reduced precision in float32 and round once, so bfloat16 weights would drift from eager's
    ``torch.optim`` step; its fused SGD's momentum is wrong in bfloat16 outright). Clipping scales the
    gradients by max_norm / (norm + 1e-6), at most 1, as ``torch.nn.utils.clip_grad_norm_``. Raises ValueError when
    the updates were lowered for other optimizer state than ``cfg`` keeps, or differ in their state or clipping.
    """
    spec = updates[0].kernel
    assert isinstance(spec, Update), updates[0]
    if any(u.kernel != spec for u in updates):
        raise ValueError(f"updates of one kernel must keep the same state and clipping: {[u.kernel for u in updates]}")
    if OPTIMIZER_SLOTS[cfg.slots] != spec.slots:
        raise ValueError(f"the plan was lowered for optimizer state {list(spec.slots)}, not for {cfg}")
    n_in, n, k = 2 + len(spec.slots) + (1 if spec.clip else 0), len(updates), len(spec.slots)
    steps: list[torch.Tensor] = []  # Adam's step count per shard (torch.optim increments it: reset every call)
    fast = {"fused": True} if all(x.type.dtype in FUSED_DTYPES for u in updates for x in u.outs) else {"foreach": True}

    def kernel(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # a gradient may be a view (a broadcast's vjp expands a scalar: stride 0), which torch's multi-tensor kernels
        # read as if it were dense: each gradient contiguous first (itself when it already is)
        ws, gs = list(xs[0::n_in]), [g.contiguous() for g in xs[1::n_in]]
        state = [list(xs[2 + j :: n_in]) for j in range(k)]
        if spec.clip:
            scale = (spec.clip / (xs[n_in - 1].sqrt() + 1e-6)).clamp(max=1.0)
            gs = torch._foreach_mul(gs, scale)
        lr = cfg.lr_at(step())
        if cfg.name == Optimizer.SGD:
            sgd(
                ws,
                gs,
                state[0] if k else [None] * n,
                **fast,
                weight_decay=cfg.weight_decay,
                momentum=cfg.momentum,
                lr=lr,
                dampening=0.0,
                nesterov=False,
                maximize=False,
            )
        else:
            if not steps:
                steps.extend(torch.zeros((), dtype=torch.float32, device=w.device) for w in ws)
            for t in steps:
                t.fill_(step() - 1)
            adam(
                ws,
                gs,
                state[0],
                state[1],
                [],
                steps,
                **fast,
                decoupled_weight_decay=cfg.name == Optimizer.ADAMW,
                amsgrad=False,
                beta1=cfg.betas[0],
                beta2=cfg.betas[1],
                lr=lr,
                weight_decay=cfg.weight_decay,
                eps=cfg.eps,
                maximize=False,
            )
        return [t for i in range(n) for t in (ws[i], *(s[i] for s in state))]

    return kernel


def make_kernel(
    instr: Compute,
    cfg: OptimizerConfig,
    step: Callable[[], int],
    saved: dict | None = None,
    seed: int = 0,
    micro: Callable[[], tuple[int, int]] = lambda: (0, 1),
    device: torch.device | None = None,
    in_place: bool = False,
) -> Kernel:
    """The kernel of compute ``instr``, built from its description (``instr.kernel``) alone. ``step()`` gives
    the current step, counted from 1 (for the learning rate, Adam and random ops); ``seed`` is the run's seed random ops draw
    with and ``micro()`` the micro-step running, (index, count) under gradient accumulation (see :func:`forward`);
    ``device``: the executor's, where a kernel with no input makes its output (a sum of squares of no piece).
    ``in_place``: a gradient sum accumulates into its first input (:func:`~shardflow.lower.buffer_reuse.inplace_sums`).

    ``saved``: this rank's store of forward autograd graphs, by (PCG node, microbatch). When given, a forward whose
    node has a backward records its graph there and the backward reuses it (no second forward); without it, the
    backward of an op with no hand-written vjp recomputes the forward under ``torch.func.vjp`` (the consumers a ring
    fuses, linear and matmul, have one: they recompute nothing).
    Raises ValueError for a compute without a kernel description, or an update lowered for other optimizer state
    than ``cfg`` keeps.
    """
    spec = instr.kernel
    if isinstance(spec, Forward):
        fwd = forward(spec.local, spec.draw, seed, step, micro)
        if saved is None or not records_graph(instr):
            return lambda xs: fwd(*xs)
        return _recording_forward(fwd, spec.record, instr.saved_as, saved)
    if isinstance(spec, Vjp):
        hand = hand_vjp(spec.local.op, [b.type for b in instr.ins])
        if hand is not None:
            return _hand_vjp_kernel(hand, spec)
        return _vjp_kernel(forward(spec.local, spec.draw, seed, step, micro), spec, instr.saved_as, saved)
    if isinstance(spec, BlockVjp):
        return _key_block_vjp_kernel(spec)
    if isinstance(spec, OnesLike):
        return lambda xs: [torch.full_like(xs[0], spec.scale)]
    if isinstance(spec, Sum):
        return _sum_into_first if in_place else lambda xs: [sum(xs[1:], xs[0])]
    if isinstance(spec, Update):
        return update_kernel([instr], cfg, step)
    if isinstance(spec, SumOfSquares):
        dtype = torch_dtype(instr.outs[0].type.dtype)
        return lambda xs: [
            torch.stack(torch._foreach_norm(xs, dtype=dtype)).square().sum()
            if xs
            else torch.zeros((), dtype=dtype, device=device)
        ]  # a sum of no piece: fresh, may be reduced in place
    if isinstance(spec, Keep):
        return lambda xs: [xs[0]]
    if isinstance(spec, Block):
        whole = spec.layout.to_storage if spec.layout else (lambda x: x)
        return lambda xs: [whole(xs[0]).chunk(spec.degree, spec.dim)[spec.index].contiguous()]
    if isinstance(spec, Convert):
        dtype = torch_dtype(spec.dtype)
        return lambda xs: [xs[0].to(dtype)]
    raise ValueError(f"compute {instr.op!r} of {instr.dnode!r} carries no kernel description")


def forward(
    local: LocalOp,
    draw: PieceSite | None,
    seed: int,
    step: Callable[[], int],
    micro: Callable[[], tuple[int, int]] = lambda: (0, 1),
) -> Callable[..., tuple]:
    """The local forward ``local`` of a compute op: pieces in, pieces out. A random op (dropout) draws at its
    piece's site ``draw`` for the current ``step()`` and micro-step ``micro()`` (:meth:`PieceSite.at`): the same
    numbers as one device on the whole batch, on every replica, and again when the backward recomputes the
    forward."""
    if draw is None:
        plain = local.out_scale == 1.0 and all(s == 1.0 for s in local.in_scale) and not local.valid
        return local.op.compute if plain else local.compute  # the op's own compute: no scale checks per call
    return lambda *xs: local.compute(*xs, at=draw.at(seed, step(), *micro()))


def records_graph(instr: Compute) -> bool:
    """Whether forward ``instr``, computed by one instruction, records its autograd graph (its outputs included)
    for the backward: its op has a backward and no hand-written vjp on pieces of its input's size (the backward
    reads the same input piece, so both decide alike)."""
    spec = instr.kernel
    assert isinstance(spec, Forward), instr
    return bool(spec.record) and hand_vjp(spec.local.op, [b.type for b in instr.ins]) is None


def recorded_nodes(program) -> frozenset[str]:
    """The (PCG node, microbatch) whose forward records its autograd graph in ``program`` (:func:`records_graph`),
    kept until their backward (:attr:`~shardflow.lower.program.Compute.saved_as`)."""
    once = single_calls(program)
    return frozenset(
        i.saved_as
        for i in program.instrs
        if isinstance(i, Compute) and isinstance(i.kernel, Forward) and i.dnode in once and records_graph(i)
    )


def _sum_into_first(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The sum of ``xs``, accumulated into ``xs[0]``'s buffer when it is dense (a broadcast's vjp may hand an
    expanded view, one element stored for many: then a new tensor)."""
    acc = xs[0]
    if not acc.is_contiguous():
        return [sum(xs[1:], acc)]
    for x in xs[1:]:
        acc.add_(x)
    return [acc]


def single_calls(program) -> set[str]:
    """Dynamic-graph nodes computed by exactly one instruction of ``program`` (not chunk by chunk)."""
    counts: dict[str, int] = {}
    for i in program.instrs:
        if isinstance(i, Compute) and i.dnode:
            counts[i.dnode] = counts.get(i.dnode, 0) + 1
    return {k for k, n in counts.items() if n == 1}


def local_move(instr: Compute, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The data-movement computes lowering adds around rings and buckets (:data:`LOCAL_MOVES`)."""
    if instr.op == "chunk":
        return [x.contiguous() for x in xs[0].chunk(len(instr.outs), instr.dim)]
    if instr.op == "concat":
        return [torch.cat(list(xs), instr.dim)]
    if instr.op == "add":
        return [xs[0] + xs[1]]
    if instr.op == "lse_merge":
        return list(lse_merge(*xs))
    if instr.op == "pack":
        return [torch.cat([x.reshape(-1) for x in xs]).view(instr.outs[0].type.shape)]
    if instr.op == "unpack":  # views into the flat buffer, no copy
        parts = xs[0].split([b.type.numel for b in instr.outs])
        return [x.view(b.type.shape) for x, b in zip(parts, instr.outs)]
    if instr.op == "ungather":  # rows [d, n]: row j = rank j's pieces, packed; each member = its d pieces joined
        rows, out = xs[0], []
        d, at = rows.shape[0], 0
        for b in instr.outs:
            shape = list(b.type.shape)
            shape[instr.dim] //= d
            n = b.type.numel // d
            out.append(torch.cat([rows[j, at : at + n].view(shape) for j in range(d)], instr.dim))
            at += n
        return out
    raise ValueError(f"no local kernel for {instr.op!r} (one of {LOCAL_MOVES})")


def _key_block_vjp_kernel(spec: BlockVjp) -> Kernel:
    """A ring attention's backward on one key/value block (:class:`~shardflow.lower.program.BlockVjp`): inputs q,
    k, v, [mask], the merged output, its lse, the output gradient."""
    dtypes = [torch_dtype(d) for d in spec.dtypes]
    block = spec.local.op
    assert isinstance(block, Attention), block

    def kernel(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        q, k, v, *mask, out, lse, dout = xs
        grads = key_block_vjp(block, q, k, v, mask[0] if mask else None, out, lse, dout)
        return [g if g.dtype == d else g.to(d) for g, d in zip(grads, dtypes)]

    return kernel


def _recording_forward(fwd: Callable, grad_mask: Sequence[bool], key: tuple[str, int], saved: dict) -> Kernel:
    def kernel(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        args = [x.detach().requires_grad_() if m else x for x, m in zip(xs, grad_mask)]
        with torch.enable_grad():
            outs = fwd(*args)
        saved[key] = ([a for a, m in zip(args, grad_mask) if m], outs)
        return [o.detach() for o in outs]

    return kernel


_ENGINE = torch.autograd.Variable._execution_engine


def _hand_vjp_kernel(vjp: HandVjp, spec: Vjp) -> Kernel:
    """The backward of ``spec.local`` by its hand-written ``vjp`` (:mod:`shardflow.runtime.vjp`): the local op's
    input and output scales applied by the chain rule, then ``unscale``; each gradient in its dtype of ``spec``."""
    local, n_in, op, need = spec.local, len(spec.grad_mask), spec.local.op, spec.grad_mask
    diff = [i for i, m in enumerate(need) if m]
    dtypes = [torch_dtype(d) for d in spec.dtypes]
    scale = [local.in_scale[i] * spec.unscale[i] for i in range(n_in)]
    scaled_in = any(s != 1.0 for s in local.in_scale)
    every_dy = all(spec.dy_mask) and local.out_scale == 1.0  # the gradients given are the vjp's dys as they are

    def kernel(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ins = [x if s == 1.0 else x * s for x, s in zip(xs[:n_in], local.in_scale)] if scaled_in else xs[:n_in]
        if every_dy:
            dys = xs[n_in:]
        else:
            given = iter(xs[n_in:])
            dys = [(next(given) * local.out_scale) if m else None for m in spec.dy_mask]
        if not local.valid:
            grads = vjp(op, ins, dys, need)
        else:  # a short block of an uneven dim: the forward's masks, and their backward on the gradients
            masked = vjp(op, local.masked(ins, output=False), local.masked(dys, output=True), need)
            grads = list(local.masked(masked, output=False))
        out = []
        for i, dtype in zip(diff, dtypes):
            g = grads[i]
            assert g is not None, f"{op.kind}: the hand-written vjp gave no gradient of input {i}"
            if g.dtype != dtype:
                g = g.to(dtype)
            out.append(g if scale[i] == 1.0 else g * scale[i])
        return out

    return kernel


def _vjp_kernel(fwd: Callable, spec: Vjp, key: tuple[str, int], saved: dict | None = None) -> Kernel:
    n_in = len(spec.grad_mask)
    diff = [i for i, m in enumerate(spec.grad_mask) if m]
    dtypes = [torch_dtype(d) for d in spec.dtypes]

    def kernel(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        args, dys = list(xs[:n_in]), iter(xs[n_in:])
        recorded = saved.pop(key, None) if saved is not None else None
        if recorded is not None:  # reuse the forward's autograd graph
            inputs, outs = recorded
            pairs = [(o, next(dys)) for o, m in zip(outs, spec.dy_mask) if m]
            # torch.autograd.grad without its Python argument checks (half the cost of a small op's backward)
            grads = _ENGINE.run_backward(
                tuple(o for o, _ in pairs), tuple(d for _, d in pairs), False, False, tuple(inputs), True, False
            )
            grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
        else:  # recompute the forward under torch.func.vjp, through its outputs that can carry a gradient
            kept: list[bool] = []  # an integer output (topk's indices) carries none, and func.vjp refuses it

            def f(*d):
                a = list(args)
                for i, t in zip(diff, d):
                    a[i] = t
                outs = fwd(*a)
                kept[:] = [o.is_floating_point() or o.is_complex() for o in outs]
                return tuple(o for o, k in zip(outs, kept) if k)

            outs, vjp = torch.func.vjp(f, *(args[i] for i in diff))
            masks = [m for m, k in zip(spec.dy_mask, kept) if k]
            cot = tuple(next(dys) if m else torch.zeros_like(o) for o, m in zip(outs, masks))
            grads = vjp(cot)
        grads = [g if g.dtype == d else g.to(d) for g, d in zip(grads, dtypes)]
        return [g * spec.unscale[i] if spec.unscale[i] != 1.0 else g for i, g in zip(diff, grads)]

    return kernel
