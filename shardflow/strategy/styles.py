"""torch's tensor-parallel styles as a shardflow plan: a torchtitan ``parallelize_module`` plan, translated.

torchtitan writes tensor parallelism as a dict module pattern → style of ``torch.distributed.tensor.parallel``
(``{"layers.*.attention.wq": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(), ...}``) and applies it
to one mesh axis with ``parallelize_module``. :func:`plan_from_styles` turns such a dict into a :class:`Plan` on one
named axis, with the placements torch's styles give (torch 2.13, ``torch/distributed/tensor/parallel/style.py``):

=================================  ==========================  ==========  =====================  ==================
style                              parameters                  input       output (default)       modules
=================================  ==========================  ==========  =====================  ==================
``ColwiseParallel``                weight ``Shard(0)``,        Replicate   ``output_layouts``     ``nn.Linear``
                                   bias ``Shard(0)``                       (``Shard(-1)``)        (weight [out, in])
``ColwiseParallel``                weight ``Shard(1)``         Replicate   ``output_layouts``     ``nn.Embedding``
                                                                           (``Shard(-1)``)
``RowwiseParallel``                weight ``Shard(1)``,        Shard(-1)   ``output_layouts``     ``nn.Linear``
                                   bias replicated                         (``Replicate()``)
``RowwiseParallel``                weight ``Shard(0)``         Replicate   ``output_layouts``     ``nn.Embedding``
                                                                           (``Replicate()``)
``SequenceParallel(sequence_dim)`` replicated                  Shard(d)    ``Shard(d)``           any (norm, dropout)
=================================  ==========================  ==========  =====================  ==================

"input" is the layout every activation entering the module is redistributed to before its first op (the style's
``desired_input_layouts``): torch reads what it is handed as ``input_layouts`` and redistributes it to that
layout; shardflow knows the layout of every activation from planning, so ``input_layouts`` tells it nothing more,
and it redistributes from the layout the activation has. ``use_local_output`` says whether eager code after the
module sees the local piece or a DTensor; shardflow runs the captured model's ops on whole tensors whichever it is
(every strategy computes the single-device numbers), so it changes nothing here either.

Patterns match module paths atom by atom, as ``parallelize_module`` matches them: ``"layers.*.attention"`` — each
``*`` stands for one name between dots.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Mapping

from torch import nn

from shardflow.parallel.mesh import Placement, Replicate, Shard, from_dtensor
from shardflow.strategy.plan import ModulePlan, Plan, PlanError


def plan_from_styles(model: nn.Module, styles: Mapping[str, object], axis: str = "tp") -> Plan:
    """The :class:`Plan` of ``styles`` (module pattern → ``ColwiseParallel``, ``RowwiseParallel`` or
    ``SequenceParallel`` of ``torch.distributed.tensor.parallel``) on mesh axis ``axis``, one :class:`ModulePlan`
    per module of ``model`` a pattern matches (see the module docstring for each style's placements). Combine it
    with the plan of the other axes by :meth:`Plan.merge` (e.g. ``Plan(inputs={"idx": {"dp": Shard(0)}, ...})``).

    Raises:
        PlanError: a pattern that matches no module of ``model``; a module two patterns match; a style with no
            translation — ``PrepareModuleInput``/``PrepareModuleOutput``, a style of your own or a subclass of
            torch's (its ``_apply`` may do more than the placements above); ``ColwiseParallel`` or
            ``RowwiseParallel`` on a module that is neither an ``nn.Linear`` nor an ``nn.Embedding`` (torch raises
            NotImplementedError for it); a layout that is not ``Shard(d)``, ``Replicate()`` or ``Partial(op)``. Each
            message names the pattern, the module and the style.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    paths = {name: m for name, m in model.named_modules() if name}
    modules: dict[str, ModulePlan] = {}
    claimed: dict[str, str] = {}  # module path → the pattern that placed it
    for pattern, style in styles.items():
        matched = [p for p in paths if _matches(pattern, p)]
        if not matched:
            names = list(paths)
            raise PlanError(
                f"style pattern {pattern!r} ({type(style).__name__}) matches no module of the model; its modules "
                f"are: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''} (a '*' stands for one name "
                f"between dots, as in parallelize_module)"
            )
        for path in matched:
            if path in claimed:
                raise PlanError(
                    f"module {path!r} is matched by style patterns {claimed[path]!r} and {pattern!r}; give each "
                    f"module one style"
                )
            claimed[path] = pattern
            where = f"style {type(style).__name__} of module {path!r} (pattern {pattern!r})"
            exact = type(style) in (ColwiseParallel, RowwiseParallel, SequenceParallel)  # no subclass
            if exact and isinstance(style, SequenceParallel):
                seq = {axis: from_dtensor(style.sequence_sharding[0], where, PlanError)}
                modules[path] = ModulePlan(input=seq, output=seq)
            elif exact and isinstance(style, (ColwiseParallel, RowwiseParallel)):
                modules[path] = _linear_or_embedding(
                    paths[path],
                    type(style) is ColwiseParallel,
                    from_dtensor(style.output_layouts[0], where, PlanError),
                    axis,
                    where,
                )
            else:
                raise PlanError(f"{where}: {_untranslated(style)}")
    return Plan(modules, name="styles")


def _matches(pattern: str, path: str) -> bool:
    """``parallelize_module``'s rule: the pattern and the path have as many dot-separated names, each matching."""
    atoms, names = pattern.split("."), path.split(".")
    return len(atoms) == len(names) and all(fnmatchcase(n, a) for n, a in zip(names, atoms))


def _linear_or_embedding(module: nn.Module, colwise: bool, output: Placement, axis: str, where: str) -> ModulePlan:
    """The :class:`ModulePlan` of ``ColwiseParallel`` (``colwise``) or ``RowwiseParallel`` on ``module`` with output
    layout ``output``. Raises PlanError for a module that is neither an ``nn.Linear`` nor an ``nn.Embedding``."""
    if isinstance(module, nn.Linear):  # weight [out, in]: colwise cuts the output features, rowwise the input ones
        params = {"weight": {axis: Shard(0 if colwise else 1)}}
        if colwise and module.bias is not None:
            params["bias"] = {axis: Shard(0)}
        entering: Placement = Replicate() if colwise else Shard(-1)
    elif isinstance(module, nn.Embedding):  # weight [num, dim]: colwise cuts the embedding dim, rowwise the rows
        params, entering = {"weight": {axis: Shard(1 if colwise else 0)}}, Replicate()
    else:
        raise PlanError(
            f"{where}: the module is a {type(module).__name__}, and torch's column- and row-parallel styles "
            f"shard an nn.Linear or an nn.Embedding only; give it SequenceParallel() (a norm or dropout: "
            f"replicated parameters, the sequence sharded) or a ModulePlan of its own, merged in with Plan.merge"
        )
    return ModulePlan(params=params, input={axis: entering}, output={axis: output})


def _untranslated(style: object) -> str:
    """Why ``style`` has no translation, and what to write instead."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput

    if type(style) in (PrepareModuleInput, PrepareModuleOutput):
        return (
            "shardflow does not translate module-preparation styles; it redistributes whatever enters a "
            "ColwiseParallel or RowwiseParallel module to the layout its first op needs, so drop this entry, or "
            "say the layout with ModulePlan(input={axis: ...}) or ModulePlan(output={axis: ...}) merged in with "
            "Plan.merge"
        )
    return (
        f"shardflow translates torch's ColwiseParallel, RowwiseParallel and SequenceParallel only (the classes "
        f"themselves: a subclass's _apply may do more than their placements), and {type(style).__qualname__} is "
        f"none of them; write a ModulePlan for this module (params, input, output placements) and merge it in "
        f"with Plan.merge"
    )
