"""Running a model in float64 for a check: :func:`at_dtype` converts it, :func:`wide_floats` keeps it there.

Hugging Face models upcast the logits to float32 before their loss (``logits.float()``), so a float64 model
still computes its loss and the logits' gradient in float32, and two runs that differ only in summation order
(one device against a sharded plan) differ by ~1e-7. Inside ``wide_floats()`` a cast of a float64 tensor to a
narrower float dtype (``.float()``, ``.half()``, ``.bfloat16()``, ``.to(torch.float32)``, ``.type(torch.float32)``)
keeps it float64, and so does an op's explicit ``dtype=`` argument (Gemma 2's ``softmax(x, dtype=torch.float32)``);
a complex128 tensor likewise stays complex128. This holds in eager runs and in ``torch.export`` capture alike, so
both sides of a check run the same model and can hold to float64 tolerances (1e-9). Where torch has no float64
kernel for what such a model calls in eager mode, the mode computes it in float64 by definition:
``torch._grouped_mm`` (a mixture of experts' grouped product, Hugging Face's default on the CPU; what export
traces instead is the model's own loop of matrix products, its fallback).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from shardflow.graph.ops import dtype_name

_NARROWING = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)
# private and new (2.8); None where this torch has none (then no model calls it)
_TORCH_GROUPED_MM = getattr(torch, "_grouped_mm", None)
_WIDEST = {False: torch.float64, True: torch.complex128}  # by is_complex


def _wide(a, complex_: bool):
    """The widest dtype of ``a``'s kind (float64, complex128) for a float or complex dtype; anything else as is."""
    if isinstance(a, torch.dtype) and (a.is_floating_point or a.is_complex):
        return _WIDEST[a.is_complex or complex_]
    return a


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
    """Context manager: float64 (complex128) tensors are never cast to a narrower float (complex) dtype while it is
    active, by a cast or by an op's ``dtype=`` argument."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype in (torch.float64, torch.complex128):
            if func in _NARROWING and x.dtype == torch.float64:
                return x
            if (
                func is _TORCH_GROUPED_MM
                and x.ndim == 2
                and args[1].ndim == 3
                and kwargs.get("offs") is not None
                and kwargs.get("bias") is None
                and kwargs.get("out_dtype") in (None, torch.float64)
            ):
                return _grouped_mm(x, args[1], offs=kwargs["offs"])
            if func in (torch.Tensor.to, torch.Tensor.type):  # any float dtype, positional or keyword (Module.to
                # passes all three; DeepSeek-V3's router casts by .type(torch.float32))
                args = tuple(_wide(a, False) for a in args)
                kwargs = {k: _wide(v, False) for k, v in kwargs.items()}
            elif "dtype" in kwargs:  # softmax(x, dtype=torch.float32), sum(x, dtype=...), ...
                kwargs = {**kwargs, "dtype": _wide(kwargs["dtype"], x.is_complex())}
        return func(*args, **kwargs)


def at_dtype(
    model: nn.Module, batch: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, tuple[str, str]]]:
    """``model`` (converted in place) and ``batch`` with their floating parameters, buffers and tensors in ``dtype``,
    and what was converted: tensor name (``batch.<key>`` for the batch's) → (old dtype, new dtype).

    Complex parameters and buffers become complex128 where ``dtype`` is float64 (and stay as they are otherwise):
    ``Module.to(torch.float64)`` would cast them to float64, dropping their imaginary part — torchtitan's Llama 3
    keeps its rotary table ``freqs_cis`` as a complex64 buffer, and a check in float64 would then compare two runs
    of another model."""
    widest = dtype == torch.float64

    def target(t: torch.Tensor) -> torch.dtype:
        if t.is_complex():
            return torch.complex128 if widest else t.dtype
        return dtype if t.is_floating_point() else t.dtype

    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    changed = {name: (dtype_name(t.dtype), dtype_name(target(t))) for name, t in named.items() if target(t) != t.dtype}
    model._apply(lambda t: t.to(target(t)))  # Module.to's own walk (parameters, buffers, their gradients)
    new_batch = {k: v.to(target(v)) for k, v in batch.items()}
    changed.update(
        {f"batch.{k}": (dtype_name(v.dtype), dtype_name(target(v))) for k, v in batch.items() if target(v) != v.dtype}
    )
    return model, new_batch, changed
