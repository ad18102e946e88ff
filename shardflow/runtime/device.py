"""Which device a rank keeps its buffers on, and the communication backend that goes with it.

torchrun's convention: the process of local rank ``LOCAL_RANK`` owns GPU ``cuda:LOCAL_RANK``, binds it with
``torch.cuda.set_device`` before it joins the process group, and talks NCCL; without CUDA (or, by default, with
fewer GPUs than processes on the machine) every buffer is on the CPU and the backend is gloo. Every buffer an executor holds — weights, optimizer state, gradients, activations,
received pieces — is on that one device; full tensors handed out (``Executor.weights()``, ``state()``) are on the
CPU.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

DEVICES = ("auto", "cpu", "cuda")  # --device; auto: the GPUs when there is one for each local process, else the CPU


class DeviceError(ValueError):
    """The device asked for is not there: ``--device cuda`` without CUDA, or more local ranks than GPUs."""


def local_processes(env: Mapping[str, str], nproc: int) -> int:
    """How many processes of the run share this machine: torchrun's (or shardflow's launcher's)
    ``LOCAL_WORLD_SIZE`` in a rank, else ``nproc`` (the processes this command will start)."""
    return int(env.get("LOCAL_WORLD_SIZE", "1")) if "RANK" in env else nproc


def device_type(choice: str, local_ranks: int = 1) -> str:
    """ "cuda" or "cpu": the type of device each of ``local_ranks`` processes on this machine gets for ``choice`` —
    "cuda" for ``cuda``, and for ``auto`` when CUDA is available with a GPU for each of them; else "cpu" (the
    same answer in every process of a run, before any of them binds a device)."""
    if choice == "cuda":
        return "cuda"
    return (
        "cuda" if choice == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "cpu"
    )


def check_device(choice: str, local_ranks: int = 1) -> None:
    """Refuse ``--device cuda`` where processes of local ranks 0 … ``local_ranks`` − 1 could not each get a GPU of
    their own, before any of them starts (``auto`` falls back to the CPU instead). Raises DeviceError for "cuda"
    without CUDA or with fewer GPUs than local ranks, ValueError for a choice not in :data:`DEVICES`."""
    if choice not in DEVICES:
        raise ValueError(f"device {choice!r}: choose one of {list(DEVICES)}")
    if choice != "cuda":
        return
    if not torch.cuda.is_available():
        raise DeviceError(
            "--device cuda: this machine has no CUDA device torch can use (torch.cuda.is_available() "
            "is False); use --device cpu (gloo), or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if local_ranks > count:
        raise DeviceError(
            f"local rank {local_ranks - 1} has no GPU of its own: this machine has {count} CUDA "
            f"device(s); start at most {count} processes per machine (--nproc {count}), or use "
            f"--device cpu"
        )


def rank_device(choice: str = "auto", env: Mapping[str, str] | None = None) -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` (made current with ``torch.cuda.set_device``) where
    :func:`device_type` says "cuda" for this machine's ``LOCAL_WORLD_SIZE`` processes; else ``cpu``. ``env``: the
    environment to read LOCAL_RANK and LOCAL_WORLD_SIZE from (default ``os.environ``; a process started by hand is
    local rank 0 of 1). Raises what :func:`check_device` raises for this local rank."""
    env = os.environ if env is None else env
    local = int(env.get("LOCAL_RANK", "0"))
    ranks = max(int(env.get("LOCAL_WORLD_SIZE", "1")), local + 1)
    check_device(choice, ranks)
    if device_type(choice, ranks) == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def run_backend(choice: str, nproc: int) -> str:
    """The torch.distributed backend a run of ``nproc`` processes on this machine uses with ``--device choice``
    (:func:`device_type`, :func:`backend_for`): what its cost model is calibrated for."""
    return backend_for(device_type(choice, local_processes(os.environ, nproc)))


def backend_for(device_type: str) -> str:
    """The torch.distributed backend for buffers on a device of type ``device_type``: NCCL for "cuda", gloo for
    "cpu"."""
    return "nccl" if device_type == "cuda" else "gloo"
