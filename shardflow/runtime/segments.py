"""Compiled segments: a run of a per-rank program's local instructions (the computes and frees between two
communications) as one generated Python function, built once per executor.

Interpreting a program costs per instruction: reading the inputs from the buffer dictionary, writing the outputs
back, a memory-ledger entry, a free's dictionary traffic. A segment does that work once, when it is generated:

* a value written and freed inside the segment lives in a local variable only (``del`` at its free, so its memory
  is released at the same point as before); a value read from outside is looked up once; only values that outlive
  the segment are written to the buffers;
* consecutive optimizer updates run as one kernel (``group``: :func:`~shardflow.runtime.kernels.update_kernel`,
  torch.optim's multi-tensor implementation over all of them at once);
* memory accounting (``ledger``) and the instruction timeline (``trace``) are generated only where asked for:
  the plain segment runs the kernels and nothing else.

The backward stays explicit in the program (the design's pass expansion gives each op its vjp instruction), so a
segment of backward instructions is compiled like a forward one; there is no autograd graph across instructions
to call backward on.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from shardflow.lower.memory import Ledger
from shardflow.lower.program import Compute, Free, Instr, Update
from shardflow.runtime import trace
from shardflow.runtime.kernels import Kernel

Segment = Callable[[dict[str, torch.Tensor], "trace.Tracer | None"], None]


def is_update(i: Instr) -> bool:
    """``i`` is an optimizer update (one of the computes a segment groups into one kernel)."""
    return isinstance(i, Compute) and isinstance(i.kernel, Update)


def runs(instrs: Sequence[Instr], boundary: tuple[type, ...]) -> list[tuple[int, int]]:
    """``instrs`` cut at the instructions of the ``boundary`` types: index ranges [start, stop), each a boundary
    instruction alone or a maximal run of other instructions, in order, covering ``instrs``."""
    out: list[tuple[int, int]] = []
    start = 0
    for k, i in enumerate(instrs):
        if isinstance(i, boundary):
            if k > start:
                out.append((start, k))
            out.append((k, k + 1))
            start = k + 1
    if start < len(instrs):
        out.append((start, len(instrs)))
    return out


def calls(instrs: Sequence[Instr]) -> list[list[Compute] | Free]:
    """``instrs`` (computes and frees; any other instruction is skipped: on the local executor a ``Wait`` does
    nothing) as the calls a segment makes: each compute alone, except consecutive updates, which form one call;
    frees as they are."""
    out: list[list[Compute] | Free] = []
    for i in instrs:
        if isinstance(i, Free):
            out.append(i)
        elif isinstance(i, Compute):
            if out and isinstance(out[-1], list) and is_update(i) and is_update(out[-1][0]):
                out[-1].append(i)
            else:
                out.append([i])
    return out


def compile_segment(
    instrs: Sequence[Instr],
    kernel: Callable[[Compute], Kernel],
    group: Callable[[Sequence[Compute]], Kernel],
    ledger: Ledger | None = None,
    traced: bool = False,
) -> Segment:
    """One function ``segment(buffers, tracer)`` that runs ``instrs`` (a run of computes and frees, in order) on
    ``buffers`` (value id → this rank's piece), reading and writing them as the instructions say.

    ``kernel(compute)``: the kernel of one compute; ``group(updates)``: one kernel for consecutive updates (inputs
    and outputs those of the updates, concatenated in order). ``ledger``: count every write of new memory
    (:attr:`~shardflow.lower.program.Compute.allocates`) and every free of a buffer there (bytes: the buffer's type); ``traced``: record each compute's start and end on the ``tracer`` argument
    (:meth:`~shardflow.runtime.trace.Tracer.record`, of the group's first compute for a group of updates).
    """
    freed = {v for i in instrs if isinstance(i, Free) for v in i.values}
    env: dict[str, object] = {"L": ledger}
    lines = ["def segment(b, T):"]
    local: dict[str, str] = {}  # value id → its local variable
    made: set[str] = set()  # values written here
    account = ledger is not None
    names = (f"v{n}" for n in itertools.count())

    def ref(v: str) -> str:
        if v not in local:
            local[v] = next(names)
            lines.append(f"    {local[v]} = b[{v!r}]")
        return local[v]

    for k, call in enumerate(calls(instrs)):
        if isinstance(call, Free):
            for v in call.values:
                if v in local:
                    lines.append(f"    del {local.pop(v)}")
                if v not in made:
                    lines.append(f"    b.pop({v!r}, None)")
                if account:
                    lines.append(f"    L.free({v!r})")
            continue
        env[f"K{k}"] = kernel(call[0]) if len(call) == 1 else group(call)
        args = [ref(x.value) for i in call for x in i.ins]
        outs = [x for i in call for x in i.outs]
        for x in outs:
            local[x.value] = next(names)
            made.add(x.value)
        if traced:
            env[f"I{k}"] = call[0]
            lines.append("    t0 = T.now()")
        lines.append(
            f"    {', '.join(local[x.value] for x in outs)}, = K{k}(({', '.join(args)}{',' if len(args) == 1 else ''}))"
        )
        for x in outs:
            if x.value not in freed:
                lines.append(f"    b[{x.value!r}] = {local[x.value]}")
        if account:  # an update's outputs are its inputs' tensors: no new bytes
            lines += [f"    L.write({x.value!r}, {x.type.nbytes})" for i in call for x in i.allocates]
        if traced:
            lines.append(f"    T.record(I{k}, t0, T.now())")
    lines.append("    return None")
    exec(compile("\n".join(lines), f"<segment of {len(instrs)} instructions>", "exec"), env)
    return env["segment"]
