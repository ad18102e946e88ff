"""``wide_floats()``: run a model with every float computed in float64, as its parameters are.

Hugging Face models upcast the logits to float32 before their loss (``logits.float()``), so a float64 model
still computes its loss and the logits' gradient in float32, and two runs that differ only in summation order
(one device against a sharded plan) differ by ~1e-7. Inside ``wide_floats()`` a cast of a float64 tensor to a
narrower float dtype (``.float()``, ``.half()``, ``.bfloat16()``, ``.to(torch.float32)``) keeps it float64, in
eager runs and in ``torch.export`` capture alike, so checks can hold to float64 tolerances (1e-9).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_NARROWING = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)


def _wide(a):
    """float64 for a float dtype, anything else as it is."""
    return torch.float64 if isinstance(a, torch.dtype) and a.is_floating_point else a


class wide_floats(TorchFunctionMode):
    """Context manager: float64 tensors are never cast to a narrower float dtype while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            if func in _NARROWING:
                return x
            if func is torch.Tensor.to:  # any float dtype, positional or keyword (Module.to passes all three)
                args = tuple(map(_wide, args))
                kwargs = {k: _wide(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
