"""A model built on the meta device, materialized piece by piece: no rank ever holds the whole model.

A model built under ``torch.device("meta")`` has shapes and no values. Its initialisation (Hugging Face's
``initialize_weights``, or ``reset_parameters`` of every module) is run once more on the meta tensors while a
dispatch mode records every in-place op that writes a parameter or buffer: ``normal_``, ``uniform_``, ``fill_``,
``zero_``, ``copy_`` (from a real tensor, e.g. a rotary frequency table), and the element-wise ops
``trunc_normal_`` and friends are made of (``mul_``, ``add_``, ``erfinv_``, ``clamp_`` ...), each with the block
of the tensor it wrote (a whole tensor, or a view such as an embedding's padding row). A :class:`TensorInit` is
that record for one tensor; indexing it with a piece's slices (``init[slices]``, what an executor's ``_put``
does for the pieces it holds) replays the ops on that block alone.

Random ops draw from the counter-based generator of :mod:`shardflow.graph.rng` keyed by (seed, tensor, op) and
each element's index in the *full* tensor, never from torch's generator state, so a piece holds exactly the
values the same block of the whole tensor holds, on any mesh and strategy: the single-device model is the
degenerate case (one piece, the whole tensor). ``normal_`` is the inverse normal CDF of one uniform
(``√2·erfinv(2u − 1)``, u at the midpoint of its 2^-53 cell, never 0 or 1); ``uniform_(a, b)`` is ``a + (b − a)·u``.
The values are those distributions, not the numbers torch's CPU generator would draw: shardflow's initial
model is defined by this replay, and every comparison (``--check``, the tests) starts from it.

Buffers (rotary tables, position ids, batch-norm statistics) are small and are materialized whole (the graph
folds them into constants at capture). An initialisation that writes a tensor in a way no replay can cut into
pieces (an op not in the tables, e.g. ``orthogonal_``'s QR, or a copy from a value computed on the meta
device) is refused with :class:`InitError` naming the tensor and the op.

Deferred initialisation is the idea of torchdistx's ``deferred_init`` (record the ops, replay per tensor);
counter-based draws are Salmon et al., SC'11.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardflow.graph.rng import DrawSite

aten = torch.ops.aten


class InitError(ValueError):
    """A model's initialisation cannot be replayed piece by piece (one paragraph naming the tensor and op)."""


def _normal(u: torch.Tensor, a: Mapping[str, float]) -> torch.Tensor:
    """Normal(mean, std) from float64 uniforms ``u`` in [0, 1) by the inverse CDF, u moved to its cell's midpoint."""
    z = torch.erfinv(u.add(2.0**-54).mul_(2.0).sub_(1.0)).mul_(math.sqrt(2.0))
    return z.mul_(a["std"]).add_(a["mean"])


# in-place ops an initialisation may apply, by kind; each takes the op's arguments by their schema names (``a``)
RANDOM: Mapping[object, Callable[..., torch.Tensor]] = {  # (float64 uniforms, a) → values
    aten.normal_.default: _normal,
    aten.uniform_.default: lambda u, a: u.mul(a["to"] - a["from"]).add_(a["from"]),
}
CONSTANT: Mapping[object, Callable[..., float]] = {  # (a) → the value written everywhere
    aten.fill_.Scalar: lambda a: a["value"],
    aten.fill_.Tensor: lambda a: a["value"],
    aten.zero_.default: lambda a: 0,
}
ELEMENTWISE: Mapping[object, Callable[..., torch.Tensor]] = {  # (current values, a) → new values
    aten.mul_.Scalar: lambda x, a: x * a["other"],
    aten.mul_.Tensor: lambda x, a: x * a["other"],
    aten.div_.Scalar: lambda x, a: x / a["other"],
    aten.div_.Tensor: lambda x, a: x / a["other"],
    aten.add_.Scalar: lambda x, a: x + a["alpha"] * a["other"],
    aten.add_.Tensor: lambda x, a: x + a["alpha"] * a["other"],
    aten.sub_.Scalar: lambda x, a: x - a["alpha"] * a["other"],
    aten.sub_.Tensor: lambda x, a: x - a["alpha"] * a["other"],
    aten.erfinv_.default: lambda x, a: torch.erfinv(x),
    aten.clamp_.default: lambda x, a: x.clamp(a["min"], a["max"]),
}
COPY = aten.copy_.default
_IGNORED = {"self", "generator", "non_blocking", "src"}  # arguments the replay does not take from the record


@dataclass(frozen=True)
class InitOp:
    """One recorded in-place op on a tensor: ``op`` (a key of :data:`RANDOM`, :data:`CONSTANT`, :data:`ELEMENTWISE`
    or :data:`COPY`), its ``args`` (schema name → number, defaults filled in; :attr:`named`), the ``region`` it wrote (None: the whole tensor; else the row-major
    indices of the written elements in the full tensor, int64 [n], in the view's order) and, for a copy, its real
    ``source`` (shaped like the region's view)."""

    op: object
    args: tuple[tuple[str, object], ...]
    region: torch.Tensor | None = None
    source: torch.Tensor | None = None

    @property
    def named(self) -> dict[str, object]:
        return dict(self.args)


@dataclass(frozen=True)
class TensorInit:
    """How one parameter or buffer of the model is initialised: its ``name`` (first FQN), full ``shape``, ``dtype``
    and ``ops`` in order; ``seed`` keys the draws. ``init[slices]`` (one slice per dim, a block of the full tensor)
    is that block's values, computed alone; ``init.full()`` the whole tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ops: tuple[InitOp, ...]
    seed: int

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        start = tuple(s.indices(n)[0] for s, n in zip(index, self.shape)) + (0,) * (len(self.shape) - len(index))
        size = tuple(len(range(*s.indices(n))) for s, n in zip(index, self.shape)) + self.shape[len(index) :]
        return self.block(start, size)

    def full(self) -> torch.Tensor:
        """The whole tensor (what one device holds)."""
        return self.block((0,) * len(self.shape), self.shape)

    def block(self, start: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        """The block of ``size`` at ``start`` of the full tensor, replaying every op on it alone: [*size], ``dtype``."""
        work = torch.float64 if self.dtype.is_floating_point else self.dtype
        out = torch.zeros(size, dtype=work)
        index = None  # the block's row-major indices in the full tensor, made when an op needs them
        for k, o in enumerate(self.ops):
            site = DrawSite(self.seed, 0, f"init:{self.name}:{k}", self.shape, start)
            if index is None and (o.region is not None or o.op in RANDOM):
                index = site.indices(size)
            where = None if o.region is None else torch.isin(index, o.region)
            if where is not None and not bool(where.any()):
                continue
            if o.op in RANDOM:
                new = RANDOM[o.op](site.uniform(size), o.named)
            elif o.op in CONSTANT:
                new = torch.full(size, CONSTANT[o.op](o.named), dtype=work)
            elif o.op in ELEMENTWISE:
                new = ELEMENTWISE[o.op](out, o.named)
            else:  # COPY: the source's element for each written index
                new = self._copied(o, start, size, index)
            out = new.to(work) if where is None else torch.where(where, new.to(work), out)
        return out.to(self.dtype)

    def _copied(self, o: InitOp, start, size, index) -> torch.Tensor:
        src = o.source.to(torch.float64 if self.dtype.is_floating_point else self.dtype)
        if o.region is None:
            block = tuple(slice(s, s + n) for s, n in zip(start, size))
            return src.reshape(self.shape)[block]
        at = torch.full((math.prod(self.shape),), -1, dtype=torch.int64)  # copies into views are of small buffers
        at[o.region] = torch.arange(o.region.numel())
        pos = at[index]
        return torch.where(pos >= 0, src.reshape(-1)[pos.clamp(min=0)], torch.zeros((), dtype=src.dtype))


class _Recorder(TorchDispatchMode):
    """Records every in-place op on a tensor whose storage is in ``watched`` (storage → its tensor)."""

    def __init__(self, watched: Mapping[int, torch.Tensor]):
        super().__init__()
        self.watched = watched
        self.log: dict[int, list[tuple[object, torch.Tensor, tuple, dict]]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and func._schema.is_mutable:
            key = args[0].untyped_storage()._cdata
            if key in self.watched:
                self.log[key].append((func, args[0], args[1:], kwargs))
        return func(*args, **kwargs)


def _region(view: torch.Tensor, whole: torch.Tensor) -> torch.Tensor | None:
    """The row-major indices in ``whole`` of ``view``'s elements (None when ``view`` is ``whole``)."""
    if view.storage_offset() == 0 and tuple(view.shape) == tuple(whole.shape) and view.stride() == whole.stride():
        return None
    return torch.as_strided(torch.arange(whole.numel()), view.shape, view.stride(), view.storage_offset()).reshape(-1)


def _op(name: str, func, view: torch.Tensor, whole: torch.Tensor, args: tuple, kwargs: dict) -> InitOp:
    """One recorded op as an :class:`InitOp`; raises InitError for one no replay can cut into pieces."""
    given = {
        **{s.name: s.default_value for s in func._schema.arguments if s.has_default_value()},
        **{s.name: v for s, v in zip(func._schema.arguments[1:], args)},
        **kwargs,
    }
    if func == COPY:
        src = given["src"]
        if src.device.type == "meta":
            raise InitError(
                f"the model's initialisation copies into {name} {list(whole.shape)} a value computed on the "
                f"meta device, which has no numbers; initialise it with an in-place op (normal_, "
                f"uniform_, fill_, zero_ ...) or from a real tensor"
            )
        return InitOp(func, (), _region(view, whole), src.detach().to("cpu").broadcast_to(view.shape).clone())
    named = {
        k: v.item() if isinstance(v, torch.Tensor) and v.ndim == 0 and v.device.type != "meta" else v
        for k, v in given.items()
        if k not in _IGNORED
    }
    if func not in {**RANDOM, **CONSTANT, **ELEMENTWISE} or any(isinstance(v, torch.Tensor) for v in named.values()):
        raise InitError(
            f"the model's initialisation applies {func} to {name} {list(whole.shape)}, which shardflow "
            f"cannot replay on one piece of it (it replays element-wise in-place ops with number "
            f"arguments — normal_, uniform_, fill_, zero_, mul_, add_, erfinv_, clamp_ ... — and copies "
            f"from real tensors); initialise {name} with those, or load the weights (--init-from)"
        )
    return InitOp(func, tuple(sorted(named.items())), _region(view, whole))


def record(model: nn.Module, seed: int, initialise: Callable[[], None] | None = None) -> dict[str, TensorInit]:
    """Run the initialisation of ``model`` (built on the meta device) on its meta tensors, recording the writes:
    the :class:`TensorInit` of every parameter and buffer by its first FQN (tied parameters once). ``initialise``
    defaults to :func:`default_initialise`. Raises InitError for a tensor the initialisation leaves without values
    (no op overwrites it whole before an element-wise op reads it) or writes in a way that cannot be replayed."""
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    watched: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in named.items():
        key = t.untyped_storage()._cdata
        if key not in watched:
            if t.storage_offset() != 0 or not t.is_contiguous():
                raise InitError(
                    f"{name} {list(t.shape)} is a view of another tensor; shardflow materializes "
                    f"contiguous parameters and buffers that own their storage"
                )
            watched[key] = (name, t)
    rec = _Recorder({k: t for k, (_, t) in watched.items()})
    with _untied(model), rec, torch.no_grad():
        (initialise or default_initialise(model))()
    out = {}
    for key, (name, whole) in watched.items():
        ops = tuple(_op(name, f, view, whole, a, kw) for f, view, a, kw in rec.log.get(key, ()))
        first = next((i for i, o in enumerate(ops) if o.region is None and o.op not in ELEMENTWISE), None)
        if first is None:
            raise InitError(
                f"the model's initialisation never sets all of {name} {list(whole.shape)} (recorded: "
                f"{[str(o.op) for o in ops] or 'nothing'}); on the meta device it would have no values (torch's "
                f"orthogonal_, dirac_ and sparse_, and since torch 2.12 trunc_normal_, do nothing there): initialise it in the "
                f"model's init (Hugging Face: _init_weights; torch: reset_parameters) with normal_, "
                f"uniform_, fill_, zero_ and element-wise ops, or load the weights (--init-from)"
            )
        out[name] = TensorInit(name, tuple(whole.shape), whole.dtype, ops[first:], seed)
    return out


@contextlib.contextmanager
def _untied(model: nn.Module):
    """While initialising, each tied parameter but the first of its group (``named_parameters``' name, e.g. the
    input embedding) is a separate meta tensor, as it is when a model initialises before it ties its weights
    (Hugging Face ties after ``initialize_weights``): the tied tensor keeps the first one's initialisation only."""
    seen, swapped = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        key = p.untyped_storage()._cdata
        if key in seen:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            swapped.append((module, leaf, p))
            module._parameters[leaf] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        seen.add(key)
    try:
        yield
    finally:
        for module, leaf, p in swapped:
            module._parameters[leaf] = p


def default_initialise(model: nn.Module) -> Callable[[], None]:
    """The initialisation a model built on the meta device skipped: a Hugging Face ``PreTrainedModel``'s
    ``initialize_weights`` (its ``_init_weights`` on every module), else ``reset_parameters()`` of every module
    that has one (torch's convention)."""
    if hasattr(model, "initialize_weights") and hasattr(model, "_init_weights"):
        return model.initialize_weights
    return lambda: [m.reset_parameters() for m in model.modules() if hasattr(m, "reset_parameters")]


def materialize_buffers(model: nn.Module, inits: Mapping[str, TensorInit]) -> None:
    """Give every buffer of ``model`` its values, whole, on the CPU (in place; parameters stay on meta).
    ``inits``: :func:`record`'s, by first FQN (a buffer registered in several modules gets one tensor)."""
    made: dict[int, torch.Tensor] = {}
    first = {b.untyped_storage()._cdata: n for n, b in model.named_buffers()}
    for module in model.modules():
        for leaf, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                key = b.untyped_storage()._cdata
                made.setdefault(key, inits[first[key]].full())
                module._buffers[leaf] = made[key]


def materialize(model: nn.Module, seed: int, initialise: Callable[[], None] | None = None) -> dict[str, TensorInit]:
    """Prepare ``model``, built on the meta device, to be materialized piece by piece: how every parameter and
    buffer is initialised (:func:`record`, draws seeded by ``seed``); its buffers get their values now, whole
    (:func:`materialize_buffers`), its parameters stay on meta. Raises InitError."""
    inits = record(model, seed, initialise)
    materialize_buffers(model, inits)
    return inits
