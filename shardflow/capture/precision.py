"""``wide_floats()``: run a model with every float computed in float64, as its parameters are.

Hugging Face models upcast the logits to float32 before their loss (``logits.float()``), so a float64 model
still computes its loss and the logits' gradient in float32, and two runs that differ only in summation order
(one device against a sharded plan) differ by ~1e-7. Inside ``wide_floats()`` a cast of a float64 tensor to a
narrower float dtype (``.float()``, ``.half()``, ``.bfloat16()``, ``.to(torch.float32)``,
``.type(torch.float32)``) keeps it float64, in eager runs and in ``torch.export`` capture alike, so checks can hold to float64 tolerances (1e-9). Where torch
has no float64 kernel for what such a model calls in eager mode, the mode computes it in float64 by definition:
``torch._grouped_mm`` (a mixture of experts' grouped product, Hugging Face's default on the CPU; what export
traces instead is the model's own loop of matrix products, its fallback).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_NARROWING = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)


def _wide(a):
    """float64 for a float dtype, anything else as it is."""
    return torch.float64 if isinstance(a, torch.dtype) and a.is_floating_point else a


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` of ``mat_a [S, K]`` by ``mat_b [E, K, N]`` with ``offs [E]`` (cumulative row counts,
    int32): rows ``offs[i-1]:offs[i]`` times ``mat_b[i]``; rows past ``offs[-1]`` are zero. Output ``[S, N]``."""
    out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[2])
    start = 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = mat_a[start:end] @ mat_b[i]
        start = end
    return out


class wide_floats(TorchFunctionMode):
    """Context manager: float64 tensors are never cast to a narrower float dtype while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            if func in _NARROWING:
                return x
            if func is torch._grouped_mm and x.ndim == 2 and args[1].ndim == 3 and kwargs.get("offs") is not None \
                    and kwargs.get("bias") is None and kwargs.get("out_dtype") in (None, torch.float64):
                return _grouped_mm(x, args[1], offs=kwargs["offs"])
            if func in (torch.Tensor.to, torch.Tensor.type):  # any float dtype, positional or keyword (Module.to
                # passes all three; DeepSeek-V3's router casts by .type(torch.float32))
                args = tuple(map(_wide, args))
                kwargs = {k: _wide(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
