"""Which device a rank keeps its buffers on, and the communication backend that goes with it.

torchrun's convention: the process of local rank ``LOCAL_RANK`` owns GPU ``cuda:LOCAL_RANK``, binds it with
``torch.cuda.set_device`` before it joins the process group, and talks NCCL; without CUDA every buffer is on the
CPU and the backend is gloo. Every buffer an executor holds — weights, optimizer state, gradients, activations,
received pieces — is on that one device; full tensors handed out (``Executor.weights()``, ``state()``) are on the
CPU.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

DEVICES = ("auto", "cpu", "cuda")  # --device: auto = cuda:LOCAL_RANK when CUDA is available, else the CPU


class DeviceError(ValueError):
    """The device asked for is not there: ``--device cuda`` without CUDA, or more local ranks than GPUs."""


def check_device(choice: str, local_ranks: int = 1) -> None:
    """Refuse a ``choice`` of device that processes of local ranks 0 … ``local_ranks`` − 1 could not get, before
    any of them starts. Raises DeviceError for "cuda" without CUDA or with fewer GPUs than local ranks (cuda, or
    auto with CUDA), ValueError for a choice not in :data:`DEVICES`."""
    if choice not in DEVICES:
        raise ValueError(f"device {choice!r}: choose one of {list(DEVICES)}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return
    if not torch.cuda.is_available():
        raise DeviceError("--device cuda: this machine has no CUDA device torch can use (torch.cuda.is_available() "
                          "is False); use --device cpu (gloo), or install a CUDA build of torch")
    count = torch.cuda.device_count()
    if local_ranks > count:
        raise DeviceError(f"local rank {local_ranks - 1} has no GPU of its own: this machine has {count} CUDA "
                          f"device(s); start at most {count} processes per machine (--nproc {count}), or use "
                          f"--device cpu")


def rank_device(choice: str = "auto", env: Mapping[str, str] | None = None) -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` (made current with ``torch.cuda.set_device``) for
    ``choice`` "cuda", or "auto" when CUDA is available; else ``cpu``. ``env``: the environment to read
    LOCAL_RANK from (default ``os.environ``; 0 when unset, a process started by hand). Raises what
    :func:`check_device` raises for this local rank."""
    local = int((os.environ if env is None else env).get("LOCAL_RANK", "0"))
    check_device(choice, local + 1)
    if device_type(choice) == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def device_type(choice: str) -> str:
    """"cuda" or "cpu": the type of device a process gets for ``choice`` (:func:`rank_device` without binding one;
    for a plan made before any process starts)."""
    return "cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu"


def backend_for(device_type: str) -> str:
    """The torch.distributed backend for buffers on a device of type ``device_type``: NCCL for "cuda", gloo for
    "cpu"."""
    return "nccl" if device_type == "cuda" else "gloo"
