"""Memory before launch: what each process of ``shardflow train`` will hold at its peak, estimated from the plan, and
what this machine has; a run that cannot fit is refused with the estimate broken down and the fix, before any
process starts (and, under torchrun, before a rank joins its group).

A process holds (:class:`Estimate`):

* its ranks' buffers at their peak in a step — pieces of the parameters, their gradients, the optimizer state
  (AdamW: two per parameter, SGD with momentum one) and the activations (forward values kept for the backward,
  their gradients, the step's data and constants, communication buffers) — replayed from the lowered programs
  (:func:`~shardflow.lower.memory.program_memory`, which counts as the executors do). One process of ``--nproc 1``
  runs every rank of the mesh: it holds them all;
* what it holds of the model whole: a built-in family's buffers (its parameters are built on the meta device and
  materialized piece by piece, :mod:`shardflow.runtime.materialize`: they are in the pieces above), or the whole
  module a ``--model FILE.py:FACTORY`` builds;
* the captured graph's folded constants, whole (e.g. a Hugging Face attention mask [B, 1, T, T]);
* the interpreter and its libraries: this process's resident size before it built the model.

Not counted: what an op keeps inside its own backward graph (an attention's probabilities [B, H, T, T] for its
vjp), the allocator's slack and the transient tensors of one kernel; measured on a small run, the estimate is
within a factor of 1.5 of the peak resident size (tests/test_memory.py).

Capturing a model at a large size allocates much by itself (the folded constants are real tensors). Where they could
be large (:data:`PROBE_ABOVE`), the plan is first built at three small sizes on the meta device — batch b and 2b,
sequence t and 2t — and every buffer's bytes are scaled to the run's batch and sequence by the powers of each it
grows with, read from those three plans (``[B, H, T, T]`` grows as B·T²), so a run that could not even be captured is
refused in seconds, with nothing allocated. A model whose parameters alone cannot fit is refused before that, from
its size on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from torch import nn

from shardflow.lower import LoweredStep
from shardflow.lower.memory import MemoryKind, program_memory
from shardflow.lower.program import Buffer
from shardflow.train.config import TrainConfig

GiB = 2**30
# elements of a [B, T, T] tensor (a folded attention mask) beyond which capturing at the run's size could itself take
# much memory (2**26 float32: 256 MiB): the estimate is then made from small plans, scaled
PROBE_ABOVE = 2**26
MODEL_PART = "the model's tensors it holds whole (buffers; a factory's module)"  # parts of an Estimate
CONSTANTS_PART = "folded constants"
RUNTIME_PART = "the interpreter and libraries"


class MemoryFitError(ValueError):
    """The run does not fit in this machine's memory; the message gives the estimate broken down and the fix."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """Bytes one process of a run holds at its peak: ``program`` its ranks' buffers at their peak by kind, ``model``
    what it holds of the model whole (buffers; a factory's module), ``constants`` the captured graph's folded constants, ``runtime`` the interpreter and
    libraries; ``basis`` how the program's bytes were found (the run's own plan, or small plans scaled)."""

    program: Mapping[MemoryKind, int]
    model: int
    constants: int
    runtime: int
    basis: str

    @property
    def total(self) -> int:
        return sum(self.program.values()) + self.model + self.constants + self.runtime

    def parts(self) -> list[tuple[str, int]]:
        """(what, bytes), largest first."""
        named = [
            *((str(k), n) for k, n in self.program.items()),
            (MODEL_PART, self.model),
            (CONSTANTS_PART, self.constants),
            (RUNTIME_PART, self.runtime),
        ]
        return sorted(named, key=lambda p: -p[1])


# What to change when a part dominates, by part (the fixes of the two largest parts, in order, without repeats)
_SMALLER_BATCH = "a smaller --batch-size or --seq-len (activations and attention masks grow with both)"
_SMALLER_MODEL = "a smaller model (--embd, --layers)"
_SPLIT_WEIGHTS = "more devices along tp or pp (they split the weights)"
FIXES = {
    str(MemoryKind.ACTIVATIONS): (_SMALLER_BATCH, "more devices along dp (the batch) or sp (the sequence)"),
    str(MemoryKind.PARAMETERS): (_SMALLER_MODEL, _SPLIT_WEIGHTS),
    str(MemoryKind.GRADIENTS): (_SMALLER_MODEL, _SPLIT_WEIGHTS),
    str(MemoryKind.OPTIMIZER): (
        "--optimizer sgd (one state per weight with momentum, none without; AdamW keeps two)",
        _SPLIT_WEIGHTS,
    ),
    MODEL_PART: (f"{_SMALLER_MODEL}: every process builds it whole", "fewer processes on this machine (--nproc)"),
    CONSTANTS_PART: (_SMALLER_BATCH,),
    RUNTIME_PART: ("fewer processes on this machine (--nproc)",),
}


def available_bytes() -> tuple[int, str] | None:
    """Bytes this machine can still give a run and where the number comes from: ``MemAvailable`` of /proc/meminfo,
    or less where this process's cgroup (v2) limit leaves less; None where neither can be read."""
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
        if found is None or left < found[0]:
            found = left, "the cgroup's memory.max less memory.current"
    except (OSError, ValueError):  # no cgroup v2 limit ("max")
        pass
    return found


def resident_bytes() -> int:
    """This process's resident size now (VmRSS of /proc/self/status; 0 where it cannot be read), in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def module_bytes(model: nn.Module, buffers_only: bool = False) -> int:
    """Bytes of a module's parameters and buffers, or of its buffers alone (on the meta device too: from their
    shapes)."""
    return sum(t.numel() * t.element_size() for t in [*([] if buffers_only else model.parameters()), *model.buffers()])


def processes_here(env: Mapping[str, str], nproc: int) -> int:
    """Processes of a run on this machine that this one estimates for: 0 in a rank shardflow's launcher started (the
    parent estimated for it), torchrun's ranks on this node (``LOCAL_WORLD_SIZE``) in a torchrun rank, else
    ``nproc`` (the parent that launches them, or the one process of ``--nproc 1``)."""
    if env.get("SHARDFLOW_LAUNCHED") == "1":
        return 0
    if "RANK" in env:
        return int(env.get("LOCAL_WORLD_SIZE", "1"))
    return nproc


def of_plan(
    step: LoweredStep,
    together: bool,
    model: int,
    constants: int,
    runtime: int,
    size: Callable[[Buffer], int] | None = None,
    basis: str = "the run's plan",
) -> Estimate:
    """The estimate of a process that runs ``step``'s programs: all of them (``together``: one process of
    ``--nproc 1`` runs every rank; their peaks summed) or one each (the rank of the highest peak), with the
    process's ``model``, ``constants`` and ``runtime`` bytes. ``size``: a buffer's bytes (default its piece's;
    :func:`scaling` scales them)."""
    peaks = [program_memory(p, step.dg, size).by_kind for p in step.programs.values()]
    program = (
        {k: sum(p[k] for p in peaks) for k in MemoryKind} if together else max(peaks, key=lambda p: sum(p.values()))
    )
    return Estimate(program, model, constants, runtime, basis)


def probe_sizes(devices: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(batch, sequence) of the three small plans: (b, t), (2b, t), (b, 2t), with b and t multiples of the mesh's
    ``devices`` (every degree divides them) and t ≥ 8."""
    b, t = devices, devices * -(-8 // devices)
    return (b, t), (2 * b, t), (b, 2 * t)


def needs_probe(cfg: TrainConfig) -> bool:
    """Whether capturing at the run's size could itself take much memory (:data:`PROBE_ABOVE`)."""
    return cfg.batch_size * cfg.seq_len**2 > PROBE_ABOVE


def scaling(cfg: TrainConfig, probes: Mapping[tuple[int, int], Mapping[str, int]]) -> Callable[[str, int], int]:
    """``grow(name, n)``: the bytes at ``cfg``'s batch and sequence of a buffer (or constant) ``name`` of ``n`` bytes
    in the first of the three ``probes`` ((batch, sequence) → name → bytes, in :func:`probe_sizes`' order): ``n`` ×
    (B / b)^i × (T / t)^j, where i and j are the powers of batch and sequence it grows with from the first probe to
    the second and to the third (a name missing from either keeps its size)."""
    ((b, t), first), (_, wide), (_, long) = probes.items()

    def power(name: str, other: Mapping[str, int]) -> int:
        before, after = first.get(name, 0), other.get(name, 0)
        return max(0, round(math.log2(after / before))) if before and after else 0

    def grow(name: str, n: int) -> int:
        return int(n * (cfg.batch_size / b) ** power(name, wide) * (cfg.seq_len / t) ** power(name, long))

    return grow


HOST_PARTS = (MODEL_PART, CONSTANTS_PART, RUNTIME_PART)  # on the CPU whatever --device (the constants on the GPU too)


def check(est: Estimate, processes: int, device_type: str = "cpu") -> None:
    """Raise MemoryFitError (one paragraph: the estimate per process broken down, the memory found, the fix) unless
    ``processes`` processes of ``est`` fit in this machine's memory: everything in its available memory with buffers
    on the CPU (``device_type`` "cpu"); with buffers on the GPUs ("cuda"), :data:`HOST_PARTS` in its available
    memory, and each process's buffers and constants on its own GPU (:func:`gpu_bytes`). Where a memory cannot be
    read, it is not checked."""
    parts = est.parts()
    if device_type == "cpu":
        _fit(parts, processes, available_bytes(), est.basis)
        return
    _fit([p for p in parts if p[0] in HOST_PARTS], processes, available_bytes(), est.basis)
    _fit(
        [p for p in parts if p[0] not in (MODEL_PART, RUNTIME_PART)],
        processes,
        gpu_bytes(processes),
        est.basis,
        gpu=True,
    )


def gpu_bytes(processes: int) -> tuple[int, str] | None:
    """The memory of the smallest GPU of local ranks 0 … ``processes`` − 1 (``total_memory`` of
    ``torch.cuda.get_device_properties``: the free memory would need a CUDA context in the process that checks, the
    launcher too) and what it is; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    gpus = range(max(1, min(processes, torch.cuda.device_count())))
    i, props = min(((i, torch.cuda.get_device_properties(i)) for i in gpus), key=lambda gpu: gpu[1].total_memory)
    return props.total_memory, f"the total memory of cuda:{i}, {props.name}"


def _fit(
    parts: list[tuple[str, int]], processes: int, found: tuple[int, str] | None, basis: str, gpu: bool = False
) -> None:
    """Raise MemoryFitError unless ``processes`` processes holding ``parts`` ((what, bytes), largest first) each fit
    in ``found`` (bytes, where from): this machine's memory, or (``gpu``) each its own GPU's."""
    total = sum(n for _, n in parts)
    need = total if gpu else total * processes
    if found is None or need <= found[0]:
        return
    avail, source = found
    each = "this process" if processes == 1 else f"each of the {processes} processes on this machine"
    fixes = list(dict.fromkeys(f for what, _ in parts[:2] for f in FIXES[what]))[:3]
    held = ", ".join(f"{what} {_size(n)}" for what, n in parts if n >= total / 100)
    if gpu:
        raise MemoryFitError(
            f"not enough GPU memory for this run: {each} would hold about {_size(total)} on its GPU at its peak — "
            f"{held} (estimated from {basis}) — but a GPU has {_size(avail)} ({source}); use " + ", or ".join(fixes)
        )
    raise MemoryFitError(
        f"not enough memory for this run: {each} would hold about {_size(total)} at its peak — {held} (estimated "
        f"from {basis}) — {_size(need)} in all, but this machine has {_size(avail)} available ({source}); use "
        + ", or ".join(fixes)
    )


def _size(n: int) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"
