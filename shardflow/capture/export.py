"""The ``torch.export`` end of capture: :func:`export` runs ``torch.export.export`` on a module called as
``module(**batch)`` and reduced to its loss, and decomposes the exported program to core ATen (:data:`KEEP` lists
the few ops kept whole, and why). When export cannot trace the model, :class:`CaptureError` says why, at the
model's own source line (:func:`_source` finds that line for any fx node), and gives the usual fix.

Lifting the exported program to a :class:`~shardflow.graph.ComputationGraph` is :mod:`shardflow.capture.lift`
(the walk) with :mod:`shardflow.capture.lift_table` (the table of ATen ops).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import traceback
import warnings
from pathlib import Path
from typing import Iterator, Mapping

import torch
from torch import nn
from torch.export import ExportedProgram

aten = torch.ops.aten


class CaptureError(ValueError):
    """The module cannot be captured: export fails (the message names the model's source line and the usual
    fix), the batch does not fit, or the forward returns no scalar loss."""


# Ops kept undecomposed, because their rule is better than their decomposition's:
# * sdpa: heads (and a mask's broadcast dims) shard as one op; its decomposition (matmul, softmax, matmul with a
#   materialized [T, S] score tensor) would need the same rule spread over five ops and costs memory;
# * linear: one rule sees weight, bias and the contraction together (row/column parallel, the bias scaled once
#   for a partial output); decomposed it is a transpose, a matmul and a broadcast add on a flattened view;
# * layer_norm: one normalisation over whole trailing dims instead of mean/var/rsqrt chains (same rule: the
#   normalised dims must be whole, so nothing is lost by keeping it);
# * silu: one element-wise kernel forward and ``silu_backward`` backward, instead of a sigmoid and a mul forward and,
#   backward, muls, the sigmoid again and its backward (same rule: element-wise, not linear); measured on the tiny
#   Llama's single-device step (benchmarks/step.py, 16 × 128): 1.14 → 1.11 × eager.
# * detach: core ATen turns it into ``alias``, which drops what it means: no gradient flows through it
#   (:class:`~shardflow.graph.ops.Detach`).
KEEP = (
    aten.scaled_dot_product_attention.default,
    aten.linear.default,
    aten.layer_norm.default,
    aten.silu.default,
    aten.detach.default,
)


class _LossOf(nn.Module):
    """``module(**batch)``, reduced to its loss (a tensor, or ``.loss`` of what it returns)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, **batch):
        out = self.inner(**batch)
        loss = getattr(out, "loss", out)
        if not isinstance(loss, torch.Tensor):
            raise CaptureError(
                f"{type(self.inner).__name__}(**batch) must return a scalar loss tensor or an object "
                f"with .loss (Hugging Face models: pass labels), got {type(out).__name__}"
            )
        return loss


def export(module: nn.Module, batch: Mapping[str, torch.Tensor]) -> ExportedProgram:
    """``torch.export`` of ``module(**batch)`` reduced to its loss, decomposed to core ATen but :data:`KEEP`.

    Raises:
        CaptureError: export cannot trace the model; the message gives export's reason, the model's source line
            it failed on, and the usual fix. Also where the model calls a ``torch.autograd.Function`` of its own
            (:func:`_custom_functions`).
    """
    seen: set[int] = set()
    distinct = {}  # export would make one input of a tensor passed under two names (idx and targets alike)
    on_meta = _parameters_on_meta(module)
    for k, v in batch.items():
        x = v.to("meta") if on_meta else v  # a tensor already there is itself: cloned below like any other
        distinct[k] = x.clone() if id(v) in seen else x
        seen.add(id(v))
    try:
        with warnings.catch_warnings(), _custom_functions() as custom:  # torch's deprecations: no news to the user
            warnings.simplefilter("ignore", FutureWarning)
            ep = torch.export.export(_LossOf(module), (), distinct, strict=False)
    except CaptureError:
        raise
    except Exception as e:  # export raises many kinds (UserError, GuardOnDataDependentSymNode, TypeError, ...)
        raise CaptureError(_export_failure(module, e)) from e
    if custom:
        cls, where = custom[0]
        raise CaptureError(
            f"{type(module).__name__} calls the torch.autograd.Function {cls.__qualname__} (at {where or 'its forward'}): "
            f"export traces its forward only, so shardflow would differentiate the forward's ops and ignore "
            f"{cls.__qualname__}.backward, giving other gradients wherever that backward is not the forward's "
            f"derivative (a straight-through estimator, a gradient reversal). Write the gradient trick with .detach() "
            f"(straight-through: x + (f(x) - x).detach(); reversal by l: (1 + l) * x.detach() - l * x), or, if the "
            f"backward is the forward's own derivative (a fused kernel), call the forward's computation in place of "
            f"{cls.__qualname__}.apply"
        )
    _detach_no_grad_regions(ep)
    table = torch.export.default_decompositions()
    for op in KEEP:
        table.pop(op, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ep.run_decompositions(table)


@contextlib.contextmanager
def _custom_functions() -> Iterator[list[tuple[type, str]]]:
    """While in the block, record each ``torch.autograd.Function`` subclass applied that torch does not define
    (:meth:`Function.apply <torch.autograd.Function.apply>` wrapped), with the model's source line of the call.
    torch's own (``torch.utils.checkpoint``'s) differentiate their forward as their backward does."""
    seen: list[tuple[type, str]] = []
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch."):
            seen.append((cls, _model_line(traceback.extract_stack()[:-1])))
        return original.__func__(cls, *args, **kwargs)

    base.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield seen
    finally:
        base.apply = original  # type: ignore[method-assign]


def _detach_no_grad_regions(ep: ExportedProgram) -> None:
    """Detach each output of a ``torch.no_grad()`` region of ``ep`` (in place). Export records such a region as one
    ``wrap_with_set_grad_enabled(False, ...)`` call, which the decompositions inline: without a detach on what it
    returns, its ops would pass gradients that eager PyTorch does not."""
    graph = ep.graph_module.graph
    region = torch.ops.higher_order.wrap_with_set_grad_enabled
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not region or node.args[0] is not False:
            continue
        for out in list(node.users):  # the getitems of the region's results
            with graph.inserting_after(out):
                detached = graph.call_function(aten.detach.default, (out,))
            detached.meta = dict(out.meta)
            out.replace_all_uses_with(detached, delete_user_cb=lambda user: user is not detached)
    ep.graph_module.recompile()


def _parameters_on_meta(module: nn.Module) -> bool:
    """Whether ``module`` was built on the meta device (every parameter there: :mod:`shardflow.runtime.materialize`
    keeps them so). Its example inputs are traced on meta too, the parameters' device: a real (CPU) index into a
    meta embedding table mixes two devices, which torch's fake tensors reject before 2.13 ("Unhandled FakeTensor
    Device Propagation for aten.embedding.default") and accept since; only shapes and dtypes are traced, and the
    lift reads the batch's own tensors (:class:`shardflow.capture.lift._Lift`)."""
    params = list(module.parameters())
    return bool(params) and all(p.device.type == "meta" for p in params)


def _export_failure(module: nn.Module, e: Exception) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    where = _model_line(_frames(e))
    where = f" at {where}" if where else ""
    fix = (
        "pass use_cache=False in a Hugging Face model's config (no KV cache in training), and make sure the "
        "forward does not branch on tensor values (.item(), data-dependent shapes)"
    )
    if getattr(getattr(module, "config", None), "_experts_implementation", None) == "eager":
        fix = (
            "its experts run Hugging Face's eager loop over the experts a batch hits, which branches on the routing: "
            "keep the default experts implementation ('grouped_mm'), or call model.set_experts_implementation("
            "'batched_mm') (docs/concepts.md#mixtures-of-experts)"
        )
    return f"torch.export cannot capture {type(module).__name__}{where}: {type(e).__name__}: {first}. Usual fix: {fix}"


# the packages whose frames are not the model's: by their directories, so that a model (or a checkout) under a path
# that merely contains their names keeps its lines
_NOT_MODEL = tuple(
    str(p) + os.sep for p in (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parents[1])
)


def _model_line(frames: list[traceback.FrameSummary]) -> str:
    """``"file.py:123 (code)"`` of the innermost frame of the model's own code (neither torch's nor shardflow's
    package), or "" if none."""
    frames = [f for f in frames if _in_model(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""


@functools.lru_cache(maxsize=4096)  # asked of every frame of every node's stack: the path resolved once per file
def _in_model(filename: str) -> bool:
    return not str(Path(filename).resolve()).startswith(_NOT_MODEL)


def _source(node: torch.fx.Node) -> str:
    """The model's source line that made fx ``node`` (:func:`_model_line` of the stack export recorded)."""
    return _model_line(traceback.StackSummary.from_list(_FRAME.findall(node.meta.get("stack_trace") or "")))


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n +(.*)')  # one frame of a formatted stack


def _frames(e: BaseException) -> list[traceback.FrameSummary]:
    out: list[traceback.FrameSummary] = []
    while e is not None:
        out += traceback.extract_tb(e.__traceback__)
        e = e.__cause__ or e.__context__
    return out
