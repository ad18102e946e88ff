"""What the device tests look for without a GPU: tensors made by shardflow without naming a device.

:class:`DevicelessFactories` is a torch function mode that records each factory call (``zeros``, ``empty``,
``tensor``, ``arange``, ...) made without ``device=`` from a source line of the shardflow package: on a GPU each of
them would put a tensor on the CPU next to the executor's CUDA buffers. Lines of :data:`EXEMPT` do not count: a
model is built, and captured, on the device its author chose (shardflow's own test models, export's fake
tensors); what the executors make from the captured graph on must follow the executor's device. Used by tests/test_device.py (local
executor) and tests/dist_worker.py's "devices" case (the distributed executor on gloo).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import shardflow

PACKAGE = str(Path(shardflow.__file__).resolve().parent) + "/"
EXEMPT = ("models/", "capture/")  # under PACKAGE
FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.tensor,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.scalar_tensor,
    torch.as_tensor,
    torch.linspace,
    torch.eye,
    torch.empty_strided,
}


class DevicelessFactories(TorchFunctionMode):
    """Records, in :attr:`sites`, each factory call made without ``device=`` whose innermost shardflow frame is
    ``path:line`` (relative to the package), with the factory's name."""

    def __init__(self):
        super().__init__()
        self.sites: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE)]
            if ours and not ours[-1].filename.removeprefix(PACKAGE).startswith(EXEMPT):
                self.sites.add(f"{ours[-1].filename.removeprefix(PACKAGE)}:{ours[-1].lineno} {func.__name__}")
        return func(*args, **kwargs)
