"""What one instruction of a per-rank program costs on a machine spec (docs/simulator.md#instruction-costs).

A :class:`~shardflow.lower.program.Compute` is priced as a roofline (Williams et al., "Roofline", CACM 2009): its
FLOPs at the device's matmul rate for its dtype against the bytes it reads and writes at the device's memory
bandwidth, whichever takes longer, plus a launch floor per kernel (:meth:`MachineSpec.compute_seconds`). Only the
matmul-like ops have FLOPs (:data:`~shardflow.graph.flops.FORWARD_FLOPS`, counted on this rank's pieces); every
other op is memory-bound, except the ops that return views of their input (:data:`VIEW_OPS`: permute, reshape,
expand, slice, split; and the backwards of :data:`VIEW_VJPS`), which move no bytes and cost their launch floor
only, as do the computes that hand their input on (``Keep``, a flat buffer's ``unpack``). A backward (:class:`~shardflow.lower.program.Vjp`) computes one product per input that
gets a gradient (the input's and the weight's gradients of a linear: 2× the forward when both), an attention's
backward (and a ring attention's backward of one key block, :class:`~shardflow.lower.program.BlockVjp`) 2.5× its forward (five matmuls against two, as FlashAttention-2 counts them: Dao 2023, §3.1); it reads
the forward's inputs and the output gradients and writes the input gradients. An optimizer update
(:class:`~shardflow.lower.program.Update`) of a float32 or float64 shard is torch.optim's fused kernel, as the
executors run it (:data:`FUSED_UPDATE_DTYPES`): one pass reading the weight, gradient and state and writing the
weight and state; of another dtype the multi-tensor (foreach) formulas, :data:`UPDATE_KERNELS` elementwise kernels
each reading and writing its tensors. A :class:`~shardflow.lower.program.Comm` costs α + bytes/β of its cost kind on
the link its members use (:meth:`MachineSpec.comm_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardflow.graph.flops import FORWARD_FLOPS
from shardflow.graph.ops import (
    Attention,
    Cat,
    Expand,
    Linear,
    Permute,
    Reshape,
    Slice,
    Split,
    TensorType,
    torch_dtype,
)
from shardflow.lower.dynamic import TaskType
from shardflow.lower.program import BlockVjp, Buffer, Comm, Compute, Forward, Keep, Update, Vjp
from shardflow.parallel.collectives import KINDS

if TYPE_CHECKING:
    from shardflow.simulator.machine import MachineSpec

# Elementwise kernels of one optimizer update over a shard (torch.optim's foreach formulas, as the executors run
# them: shardflow.runtime.kernels.update_kernel), each reading and writing the weight, gradient and state.
UPDATE_KERNELS = {0: 1, 1: 2, 2: 5}  # state slots → kernels: SGD (add), SGD momentum (mul-add, add), Adam(W)
# The dtypes whose updates the executors run as torch.optim's fused kernel, one pass over the shard
# (shardflow.runtime.kernels.FUSED_DTYPES; tests/test_simulator.py checks they agree).
FUSED_UPDATE_DTYPES = ("float32", "float64")
# Ops whose forward returns a view of its input (torch's permute, reshape, expand, slice, split: a reshape copies
# only where the strides do not allow a view), and ops whose backward returns views of the output gradient (the
# inverse permute or reshape; a concatenation's gradient is slices of it): they move no bytes.
VIEW_OPS = (Permute, Reshape, Expand, Slice, Split)
VIEW_VJPS = (Permute, Reshape, Cat)
# Local moves that hand views of their input on (shardflow.runtime.kernels.local_move): a flat buffer unpacked.
VIEW_MOVES = ("unpack",)
ATTENTION_BACKWARD = 2.5  # FlashAttention-2's backward/forward FLOPs ratio (5 matmuls against 2)


def _bytes(bufs: tuple[Buffer, ...]) -> int:
    return sum(b.type.nbytes for b in bufs)


def compute_flops(c: Compute) -> int:
    """FLOPs of compute ``c`` on this rank's pieces: a forward's matmul-like op as
    :data:`~shardflow.graph.flops.FORWARD_FLOPS` counts it, its backward one forward per input that gets a gradient
    (an attention's :data:`ATTENTION_BACKWARD` forwards); 0 for every other instruction."""
    k = c.kernel
    if isinstance(k, Forward):
        count = FORWARD_FLOPS.get(type(k.local.op))
        return count(k.local.op, tuple(b.type for b in c.ins), tuple(b.type for b in c.outs)) if count else 0
    if isinstance(k, Vjp):
        count = FORWARD_FLOPS.get(type(k.local.op))
        n = len(k.grad_mask)
        dys = c.ins[n:]
        if count is None or not dys or not any(k.grad_mask):
            return 0
        forward = count(k.local.op, tuple(b.type for b in c.ins[:n]), tuple(b.type for b in dys))
        if isinstance(k.local.op, Attention):
            return int(ATTENTION_BACKWARD * forward)
        return forward * sum(k.grad_mask[:2])
    if isinstance(k, BlockVjp):  # a ring attention's block: its forward recomputed and differentiated
        return int(ATTENTION_BACKWARD * FORWARD_FLOPS[Attention](k.local.op, tuple(b.type for b in c.ins[:3]), ()))
    return 0


def compute_dtype(c: Compute) -> torch.dtype:
    """The dtype compute ``c`` runs its arithmetic in: its first floating input's (else its first output's)."""
    types: list[TensorType] = [b.type for b in c.ins + c.outs]
    floating = [t for t in types if torch_dtype(t.dtype).is_floating_point]
    return torch_dtype((floating or types)[0].dtype) if types else torch.float32


@dataclass(frozen=True)
class Kernels:
    """How a step's kernels run beyond what its programs say — what a compiler or a low-precision recipe changes
    (docs/simulator.md#kernels-torchcompile-and-float8), for predicting runs of other systems such as torchtitan's.

    ``fused_elementwise`` (torch.compile): a run of memory-bound computes with no matmul or communication between
    them is one kernel: each compute after the first of a run writes its outputs but reads nothing from memory (its
    inputs come from the kernel before it) and pays no launch floor. ``float8_matmul`` (torchao's Float8 training
    with dynamic scaling): a linear's matmuls run at the device's float8 peak, and each casts its operands to
    float8 first (reading them in their dtype, writing one byte per element)."""

    fused_elementwise: bool = False
    float8_matmul: bool = False


EAGER = Kernels()  # one kernel per compute, in the program's dtypes: what shardflow's executors run


def fusable(c: Compute, kernels: Kernels) -> bool:
    """Whether ``c`` can join the fused kernel of the memory-bound compute before it (:class:`Kernels`)."""
    return kernels.fused_elementwise and c.task != TaskType.UPD and compute_flops(c) == 0


def is_view(c: Compute) -> bool:
    """Whether compute ``c`` only makes views of its inputs (moves no bytes): a forward of :data:`VIEW_OPS`, a
    backward of :data:`VIEW_VJPS`, a ``Keep`` (its input itself) or a local move of :data:`VIEW_MOVES`."""
    k = c.kernel
    if isinstance(k, Forward):
        return isinstance(k.local.op, VIEW_OPS)
    if isinstance(k, Vjp):
        return isinstance(k.local.op, VIEW_VJPS)
    return isinstance(k, Keep) or (k is None and c.op in VIEW_MOVES)


def compute_seconds(c: Compute, spec: MachineSpec, kernels: Kernels = EAGER, fused: bool = False) -> float:
    """Seconds compute ``c`` takes on one device of ``spec`` (the module's roofline; launch floors included).
    ``kernels``: how the computes run (:class:`Kernels`); ``fused``: ``c`` continues the fused kernel of the compute
    before it (:func:`fusable`: it writes only, no launch floor)."""
    if is_view(c):
        return spec.compute_seconds(0, 0, compute_dtype(c), 0 if fused else 1)
    flops, dtype = compute_flops(c), compute_dtype(c)
    moved = _bytes(c.outs) if fused else _bytes(c.ins) + _bytes(c.outs)
    largest = max((b.type.nbytes for b in c.ins + c.outs), default=0)
    count = 0 if fused else 1
    if isinstance(c.kernel, Update) and not all(b.type.dtype in FUSED_UPDATE_DTYPES for b in c.outs):
        count = UPDATE_KERNELS.get(len(c.kernel.slots), 1 + 2 * len(c.kernel.slots))
        moved *= count
    attention = None
    if isinstance(c.kernel, (Forward, Vjp, BlockVjp)) and isinstance(c.kernel.local.op, Attention):
        attention = "forward" if isinstance(c.kernel, Forward) else "backward"
    if (
        kernels.float8_matmul
        and flops
        and isinstance(c.kernel, (Forward, Vjp))
        and isinstance(c.kernel.local.op, Linear)
    ):
        dtype = torch.float8_e4m3fn
        operands = c.ins[: len(c.kernel.grad_mask)] if isinstance(c.kernel, Vjp) else c.ins
        moved += sum(b.type.numel * (torch_dtype(b.type.dtype).itemsize + 1) for b in operands)
        count += len(operands)
    return spec.compute_seconds(flops, moved, dtype, count, largest, attention)


def comm_seconds(c: Comm, spec: MachineSpec) -> float:
    """Seconds communication ``c`` takes once every member has issued it: α + bytes/β of its cost kind
    (:attr:`~shardflow.parallel.collectives.CommSpec.priced_as`) on the link its members use. An all-to-all of
    data-dependent sizes (:attr:`~shardflow.lower.program.Comm.splits`) is priced at a balanced routing's bytes, not
    its bound: the smaller of its send and receive buffers (one of them exact: the n·K rows a rank routes), (d − 1)/d
    of it to the other members."""
    return spec.comm_seconds(KINDS[c.kind].priced_as, c.members, balanced_bytes(c))


def balanced_bytes(c: Comm) -> int:
    """The bytes one rank of ``c`` sends: ``c.nbytes``, or for an all-to-all of data-dependent sizes those it sends
    when the routing is balanced (:func:`comm_seconds`)."""
    if c.splits is None or c.send is None or c.recv is None:
        return c.nbytes
    d = len(c.members)
    return min(c.send.type.nbytes, c.recv.type.nbytes) * (d - 1) // d
