"""User plans: per-module placements in DTensor spelling, resolved onto one computation graph.

A :class:`Plan` says, for modules matched by path patterns (``fnmatch``, e.g. ``"transformer.h.*.mlp.c_fc"``;
a pattern may also match a node name), how their parameters are placed, what layout activations entering and
leaving them must have, and on which pipeline stage they run — the same vocabulary as torch's
``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` (``input_layouts``/``output_layouts``).
Placements are given per mesh axis, either as a sequence over the free axes (DTensor's spelling) or as a
dict ``{axis: placement}``; a layout names only the axes it constrains.

Example — Megatron MLP on axis ``tp``::

    Plan(modules={
        "mlp.c_fc":   ModulePlan(params={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}),
        "mlp.c_proj": ModulePlan(params={"weight": {"tp": Shard(1)}}, output={"tp": Replicate()}),
    })
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Mapping, Sequence

from shardflow.graph import ops as O
from shardflow.graph.fused import fused_linears, split_fused, stored_dim
from shardflow.graph.graph import ComputationGraph, Node, TensorRole
from shardflow.graph.softmax import decompose_softmax, softmax_heads
from shardflow.parallel.mesh import Mesh, Partial, Placement, Replicate, Shard, SubMesh, parse_placement
from shardflow.parallel.ops import PARALLEL_OPS, CombineOp, ParallelOp, ReplicateOp
from shardflow.parallel.pcg import Annotations, Layout
from shardflow.parallel.shape import DegreeError, ShardingError
from shardflow.parallel.sharding import Sharding

PlacementSpec = Sequence[Placement] | Mapping[str, Placement]


class PlanError(ValueError):
    """A plan does not fit the model or the mesh; the message names module, parameter, axis and the fix."""


@dataclass(frozen=True)
class ModulePlan:
    """How one module (or every module a pattern matches) is parallelised.

    ``params``: parameter name (``"weight"``, ``"bias"``) → placements; ``input``/``output``: layout of every
    activation entering/leaving the module; ``operands``: for a pattern naming nodes (not modules), the layout of
    each input of each node it names, by position (None: the input as it comes; a weight's layout here is how the
    node reads it, not how it is stored) — what the per-op placement search writes
    (:mod:`shardflow.strategy.placements`); ``stage``: pipeline stage index along the plan's stage axis;
    ``devices``: a machine view overriding which device runs each shard of the module's ops (one device per
    coordinate of the sub-mesh's free axes, row-major) — values moving between views are copied.
    """

    params: Mapping[str, PlacementSpec] = field(default_factory=dict)
    input: PlacementSpec | None = None
    output: PlacementSpec | None = None
    stage: int | None = None
    devices: tuple[int, ...] | None = None
    operands: tuple[PlacementSpec | None, ...] | None = None


@dataclass(frozen=True)
class Plan:
    """A whole strategy: module plans, placements of data inputs and constants, explicit parallel ops and the
    stage axis.

    ``inputs`` maps a data input (a batch key) or a constant (a mask folded at capture) to its placements;
    ``ops`` maps a tensor name to parallel ops inserted right after it (explicit ``ReplicateOp``/``ReductionOp``...).
    """

    modules: Mapping[str, ModulePlan] = field(default_factory=dict)
    inputs: Mapping[str, PlacementSpec] = field(default_factory=dict)
    ops: Mapping[str, tuple[ParallelOp, ...]] = field(default_factory=dict)
    stage_axis: str = "pp"
    name: str = "user"

    def merge(self, other: Plan) -> Plan:
        """Both plans at once (they must constrain different axes of anything they share)."""
        modules = dict(self.modules)
        for pat, mp in other.modules.items():
            modules[pat] = _merge_module(modules[pat], mp, pat) if pat in modules else mp
        inputs = dict(self.inputs)
        for name, spec in other.inputs.items():
            inputs[name] = _merge_layout(inputs[name], spec, f"input {name}") if name in inputs else spec
        ops = dict(self.ops) | dict(other.ops)
        return Plan(modules, inputs, ops, self.stage_axis, "+".join(n for n in (self.name, other.name) if n))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """Read a plan from JSON/TOML data: placements as strings (``"Shard(0)"``, ``"R"``, ``"Partial('sum')"``),
        parallel ops as ``{"op": "reduction", "degree": 2, "axis": "tp"}``. Raises PlanError."""
        unknown = sorted(set(data) - _PLAN_KEYS) if isinstance(data, Mapping) else []
        if unknown:
            raise PlanError(
                f"cannot read plan: unknown key(s) {unknown} at its top level; a plan has {', '.join(sorted(_PLAN_KEYS))}"
            )
        for pat, m in (data.get("modules") or {}).items() if isinstance(data.get("modules"), Mapping) else ():
            _check_module(pat, m)
        try:
            modules = {
                pat: ModulePlan(
                    params={k: _spec(v) for k, v in m.get("params", {}).items()},
                    input=_spec(m["input"]) if "input" in m else None,
                    output=_spec(m["output"]) if "output" in m else None,
                    stage=m.get("stage"),
                    devices=tuple(m["devices"]) if "devices" in m else None,
                    operands=tuple(None if v is None else _spec(v) for v in m["operands"]) if "operands" in m else None,
                )
                for pat, m in data.get("modules", {}).items()
            }
            inputs = {k: _spec(v) for k, v in data.get("inputs", {}).items()}
            ops = {
                t: tuple(PARALLEL_OPS[o.pop("op")](**o) for o in map(dict, lst))
                for t, lst in data.get("ops", {}).items()
            }
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"cannot read plan: {e}") from None
        return cls(modules, inputs, ops, data.get("stage_axis", "pp"), data.get("name", "user"))

    def to_json(self) -> dict[str, Any]:
        """The plan as :meth:`from_json` reads it — placements as the strings a user writes (``"Shard(0)"``), parallel
        ops as ``{"op": kind, field: value}`` — so that ``Plan.from_json(plan.to_json())`` resolves to the same
        annotations (``shardflow plan --save-plan``)."""

        def spec(v: PlacementSpec) -> Any:
            return {k: repr(p) for k, p in v.items()} if isinstance(v, Mapping) else [repr(p) for p in v]

        modules: dict[str, dict[str, Any]] = {}
        for pat, m in self.modules.items():
            d: dict[str, Any] = {}
            if m.params:
                d["params"] = {k: spec(v) for k, v in m.params.items()}
            for key, v in (("input", m.input), ("output", m.output)):
                if v is not None:
                    d[key] = spec(v)
            if m.stage is not None:
                d["stage"] = m.stage
            if m.devices is not None:
                d["devices"] = list(m.devices)
            if m.operands is not None:
                d["operands"] = [None if v is None else spec(v) for v in m.operands]
            modules[pat] = d
        return {
            "name": self.name,
            "stage_axis": self.stage_axis,
            "modules": modules,
            "inputs": {k: spec(v) for k, v in self.inputs.items()},
            "ops": {
                t: [{"op": o.kind, **{f.name: getattr(o, f.name) for f in dataclasses.fields(o)}} for o in ops]
                for t, ops in self.ops.items()
            },
        }

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib

            return cls.from_json(tomllib.loads(text))
        return cls.from_json(json.loads(text))


# the keys of a plan file (mesh and flags: what `shardflow plan --save-plan` writes beside the plan) and of each
# module's table
_PLAN_KEYS = frozenset({"name", "stage_axis", "modules", "inputs", "ops", "mesh", "flags"})
_MODULE_KEYS = frozenset({"params", "input", "output", "stage", "devices", "operands"})


def _check_module(pat: str, m: Any) -> None:
    """A plan file's table of module pattern ``pat``: its keys known, its stage a whole number ≥ 0. Raises PlanError
    (a key that would be ignored: the plan would run as something the user did not write)."""
    if not isinstance(m, Mapping):
        return  # from_json reports it
    unknown = sorted(set(m) - _MODULE_KEYS)
    if unknown:
        raise PlanError(
            f"cannot read plan: module {pat!r} has unknown key(s) {unknown}; a module takes "
            f"{', '.join(sorted(_MODULE_KEYS))}"
        )
    stage = m.get("stage")
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int) or stage < 0):
        raise PlanError(
            f"cannot read plan: module {pat!r} has stage {json.dumps(stage)}; give a whole number ≥ 0 (its pipeline "
            f"stage)"
        )


def _placement(p: Any) -> Placement:
    if isinstance(p, str):
        return parse_placement(p)
    if isinstance(p, (Shard, Replicate, Partial)):
        return p
    raise PlanError(
        f"cannot read plan: placement {json.dumps(p) if isinstance(p, (int, float, bool, type(None))) else p!r} is "
        f"not one; write Shard(d), Replicate() or Partial('sum'|'avg'|'max'|'min') as a string"
    )


def _spec(v: Any) -> PlacementSpec:
    if isinstance(v, Mapping):
        return {k: _placement(p) for k, p in v.items()}
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise PlanError(
            f"cannot read plan: placements {json.dumps(v) if not isinstance(v, bytes) else v!r} are not a list (one "
            f'per mesh axis) or a table (axis → placement); write e.g. ["Shard(0)"] or {{tp = "Shard(0)"}}'
        )
    return tuple(_placement(p) for p in v)


def _merge_layout(a: PlacementSpec, b: PlacementSpec, what: str) -> PlacementSpec:
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        raise PlanError(f"{what}: two plans both place it over every axis; name the axes (a dict) to combine plans")
    clash = {k for k in set(a) & set(b) if a[k] != b[k]}
    if clash:
        raise PlanError(f"{what}: plans disagree on axes {sorted(clash)}")
    return dict(a) | dict(b)


def _merge_module(a: ModulePlan, b: ModulePlan, pat: str) -> ModulePlan:
    params = dict(a.params)
    for k, v in b.params.items():
        params[k] = _merge_layout(params[k], v, f"{pat}.{k}") if k in params else v

    def one(x, y, what):
        return _merge_layout(x, y, f"{pat} {what}") if x is not None and y is not None else x if x is not None else y

    if a.stage is not None and b.stage is not None and a.stage != b.stage:
        raise PlanError(f"module {pat}: plans put it on stages {a.stage} and {b.stage}")
    operands = a.operands or b.operands
    if a.operands and b.operands:
        if len(a.operands) != len(b.operands):
            raise PlanError(f"node {pat}: plans give {len(a.operands)} and {len(b.operands)} operand layouts")
        operands = tuple(one(x, y, f"operand {i}") for i, (x, y) in enumerate(zip(a.operands, b.operands)))
    return ModulePlan(
        params,
        one(a.input, b.input, "input"),
        one(a.output, b.output, "output"),
        a.stage if a.stage is not None else b.stage,
        a.devices if a.devices is not None else b.devices,
        operands,
    )


# --- resolution onto a graph ------------------------------------------------------------------------------
def module_nodes(graph: ComputationGraph) -> dict[str, list[Node]]:
    """Module path → its nodes, for every module path of ``graph`` and each of its ancestors, in first-use order.

    A module's nodes are those whose scope lies inside it. A path that no node's scope names but a parameter's
    FQN does (a flat graph: built by hand without scopes, or a model that calls its submodules' parameters
    functionally) holds the nodes that read its parameters (``fc1`` the readers of ``fc1.weight`` and
    ``fc1.bias``), so a plan names modules by FQN on any graph.
    """
    out: dict[str, list[Node]] = {}
    for n in graph.nodes:
        parts = n.scope.split(".") if n.scope else []
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]), []).append(n)
    scoped = set(out)
    for n in graph.nodes:
        paths: dict[str, None] = {}
        for t in n.inputs:
            if graph.tensors[t].role == TensorRole.WEIGHT:
                parts = t.split(".")[:-1]
                paths.update((".".join(parts[:i]), None) for i in range(1, len(parts) + 1))
        for path in paths:
            if path not in scoped:
                out.setdefault(path, []).append(n)
    return out


def _layout(spec: PlacementSpec, group: SubMesh, what: str) -> Layout:
    if isinstance(spec, Mapping):
        bad = set(spec) - set(group.free_axes)
        if bad:
            raise PlanError(f"{what}: mesh axes {sorted(bad)} are not free axes of {group} {list(group.free_axes)}")
        return dict(spec)
    spec = tuple(spec)
    if len(spec) != len(group.free_axes):
        raise PlanError(
            f"{what}: {len(spec)} placements for the {len(group.free_axes)} axes "
            f"{list(group.free_axes)} of {group}; give one per axis or a dict {{axis: placement}}"
        )
    return dict(zip(group.free_axes, spec))


@dataclass(frozen=True)
class _Targets:
    """What each pattern of a plan names in one graph: ``modules`` (module path → its nodes, :func:`module_nodes`),
    ``matched`` (pattern → the module paths it matches) and ``named`` (pattern → the nodes whose name it matches)."""

    modules: Mapping[str, list[Node]]
    matched: Mapping[str, list[str]]
    named: Mapping[str, list[Node]]

    @classmethod
    def of(cls, plan: Plan, graph: ComputationGraph) -> _Targets:
        """Raises PlanError for a pattern that matches no module and no node."""
        modules = module_nodes(graph)
        by_name = {n.name: n for n in graph.nodes}
        matched, named = {}, {}
        for pat in plan.modules:
            if any(ch in pat for ch in "*?["):
                matched[pat] = [m for m in modules if fnmatchcase(m, pat)]
                named[pat] = [n for n in graph.nodes if fnmatchcase(n.name, pat)]
            else:  # a plain name matches itself only
                matched[pat] = [pat] if pat in modules else []
                named[pat] = [by_name[pat]] if pat in by_name else []
            if not matched[pat] and not named[pat]:
                paths = list(modules)
                raise PlanError(
                    f"plan pattern {pat!r} matches no module or node; modules are: "
                    f"{', '.join(paths[:12])}{' ...' if len(paths) > 12 else ''}"
                )
        return cls(modules, matched, named)

    def units(self, pat: str) -> list[tuple[str, list[Node]]]:
        """What ``pat`` places: (module path, its nodes) for each module it matches, and (node name, [node]) for
        each node it matches by name outside those modules."""
        paths = set(self.matched[pat])
        return [(m, self.modules[m]) for m in self.matched[pat]] + [
            (n.name, [n]) for n in self.named[pat] if n.scope not in paths
        ]


def resolve(plan: Plan, graph: ComputationGraph, mesh: Mesh) -> Annotations:
    """The plan's decisions on the tensors and nodes of ``graph``. Raises PlanError naming the module/tensor.

    Placements of parameters are given in the module's shapes (as ``parallelize_module`` takes them). A fused
    linear (:func:`~shardflow.graph.fused.fused_linears`) whose weight or bias the plan shards on the output
    features is first split into its parts (:func:`~shardflow.graph.fused.split_fused`); the annotations then
    name that graph (``Annotations.graph``), which :func:`~shardflow.parallel.pcg.build_pcg` plans instead. Its
    parameter stored by parts (``[C, 3C]`` held as ``[C, 3, C]``) is sharded on the features of every part: each
    of q, k and v by heads. One stored whole (unequal parts) that one Split node alone reads is placed part by
    part: the parameter keeps its other placements, each part is sharded on the split dim (a local split of the
    replicated parameter) — every head group of q, k and v, not ``q|k|v`` cut into blocks.

    A placement that a ``CombineOp`` of ``plan.ops`` gathers right after the parameter (FSDP's: stored ``Shard(d)``,
    all-gathered before any use) is how the parameter is *stored*, not how its readers compute: it neither splits
    a fused linear nor places its parts; the readers see the parameter without it.
    """
    targets = _Targets.of(plan, graph)
    placed = {
        f"{m}.{p}": spec
        for pat, mp in plan.modules.items()
        for m, _ in targets.units(pat)
        for p, spec in mp.params.items()
    }
    fused = [
        f
        for f in fused_linears(graph)
        if any(Shard(d) in _read(graph, t, _placements(placed.get(t)), plan.ops.get(t, ())) for t, d in f.features)
    ]
    rewritten = split_fused(graph, fused) if fused else None
    staged = any(mp.stage is not None for mp in plan.modules.values())
    free = tuple(a for a in mesh.axis_names if not (staged and a == plan.stage_axis))
    sharded = _sharded_softmaxes(rewritten or graph, placed, plan.ops, free)
    reduced: dict[str, Layout] = {}  # the partial max and sum of each softmax decomposed for a sharded dim
    if sharded:
        rewritten, partial = decompose_softmax(rewritten or graph, sharded)
        for node, axes in sharded.items():
            reduced.update((t, {a: Replicate() for a in axes}) for t in partial[node.name])
    if rewritten is not None:
        graph = rewritten
        targets = _Targets.of(plan, graph)

    groups = _stage_groups(plan, graph, mesh, targets)
    whole = SubMesh(mesh)
    for pat, mp in plan.modules.items():  # machine-view overrides
        if mp.devices is None:
            continue
        for n in {n.name: n for _, members in targets.units(pat) for n in members}.values():
            try:
                groups[n.name] = groups.get(n.name, whole).with_view(mp.devices)
            except ValueError as e:
                raise PlanError(f"plan for {pat!r}: {e}") from None
    consumers = graph.consumers()
    producer = graph.producer()

    def group_of_tensor(t: str) -> SubMesh:
        c = consumers[t]
        return groups.get(c[0][0].name, whole) if c else whole

    leaves: dict[str, Sharding] = {}
    for name, spec in plan.inputs.items():
        if name not in graph.tensors or graph.tensors[name].role not in (TensorRole.INPUT, TensorRole.CONSTANT):
            raise PlanError(
                f"plan places input {name!r}, but the graph's inputs are {list(graph.inputs)} (and its "
                f"constants {list(graph.by_role(TensorRole.CONSTANT))})"
            )
        leaves[name] = _sharding(spec, group_of_tensor(name), graph, name)
    edges: dict[tuple[str, int], Layout] = {}
    after: dict[str, Layout] = dict(reduced)
    why: dict[object, str] = {
        t: "vocabulary-parallel softmax: its max and sum over the sharded classes" for t in reduced
    }
    for pat, mp in plan.modules.items():
        for m, members in targets.units(pat):
            for p, spec in mp.params.items():
                w = f"{m}.{p}"
                if w not in graph.tensors or graph.tensors[w].role != TensorRole.WEIGHT:
                    owned = [t for t in graph.weights if t.rsplit(".", 1)[0] == m]
                    raise PlanError(
                        f"plan for module {m!r} places parameter {p!r}, which it does not have "
                        f"(its parameters: {[t.rsplit('.', 1)[1] for t in owned]})"
                    )
                given = _layout(spec, group_of_tensor(w), f"placement of {w}")
                _check_param_dims(graph, m, p, given)
                layout = {
                    a: Shard(stored_dim(graph, w, pl.dim)) if isinstance(pl, Shard) else pl for a, pl in given.items()
                }
                split = consumers[w][0][0] if len(consumers[w]) == 1 else None
                stored = {
                    a
                    for a, pl in layout.items()
                    if any(
                        isinstance(op, CombineOp) and op.axis == a and pl == Shard(op.dim) for op in plan.ops.get(w, ())
                    )
                }
                if (
                    split is not None
                    and isinstance(split.op, O.Split)
                    and any(pl == Shard(split.op.dim) and a not in stored for a, pl in layout.items())
                ):
                    per_part = {a: pl for a, pl in layout.items() if pl == Shard(split.op.dim) and a not in stored}
                    layout = {a: pl for a, pl in layout.items() if a not in per_part}
                    for part in split.outputs:
                        after[part] = per_part
                        why[part] = f"part of {w}, placed part by part"
                leaves[w] = _sharding(layout, group_of_tensor(w), graph, w)
            member_names = {n.name for n in members}
            if mp.input is not None:
                for n in members:
                    for i, t in enumerate(n.inputs):
                        src = producer.get(t)
                        entering = (
                            graph.tensors[t].role == TensorRole.INPUT if src is None else src.name not in member_names
                        )
                        if entering:
                            edges[(n.name, i)] = _layout(mp.input, groups.get(n.name, whole), f"input layout of {m}")
                            why[(n.name, i)] = f"input layout of {m}"
            if mp.operands is not None:
                if m in targets.modules and m not in {n.name for n in members}:
                    raise PlanError(
                        f"plan for {pat!r}: operands place the inputs of single nodes, but {m!r} is a module of "
                        f"{len(members)} nodes; name each node (shardflow plan --graph lists them)"
                    )
                for n in members:
                    if len(mp.operands) != len(n.inputs):
                        raise PlanError(
                            f"plan for node {n.name!r}: {len(mp.operands)} operand layouts for its {len(n.inputs)} "
                            f"inputs {list(n.inputs)}; give one per input (null: as it comes)"
                        )
                    for i, operand in enumerate(mp.operands):
                        if operand is not None:
                            edges[(n.name, i)] = _layout(operand, groups.get(n.name, whole), f"operand {i} of {n.name}")
                            why[(n.name, i)] = f"operand {i} of {n.name} (per-op placements)"
            if mp.output is not None:
                for n in members:
                    for t in n.outputs:
                        if t in graph.outputs or any(c.name not in member_names for c, _ in consumers[t]):
                            after[t] = _layout(mp.output, groups.get(n.name, whole), f"output layout of {m}")
                            why[t] = f"output layout of {m}"
    for t in plan.ops:
        if t not in graph.tensors:
            raise PlanError(f"plan inserts parallel ops after {t!r}, which is not a tensor of the graph")
    return Annotations(leaves, groups, edges, after, dict(plan.ops), why, rewritten)


def _sharded_softmaxes(
    graph: ComputationGraph,
    placed: Mapping[str, PlacementSpec],
    ops: Mapping[str, tuple[ParallelOp, ...]],
    free: tuple[str, ...],
) -> dict[Node, tuple[str, ...]]:
    """The softmax nodes over the features of a linear whose weight the plan shards on its output features (read so,
    not only stored so: :func:`_read`), each with the mesh axes that shard them: a vocabulary-parallel head's loss,
    which :func:`~shardflow.graph.softmax.decompose_softmax` keeps sharded. ``free``: the axes a placement given as
    a sequence (DTensor's spelling) names, in order."""
    by_name = {n.name: n for n in graph.nodes}
    found = {}
    for name, head in softmax_heads(graph).items():
        lin: O.Linear = head.op  # type: ignore[assignment]
        w = head.inputs[1]
        spec = placed.get(w)
        read = set(_read(graph, w, _placements(spec), ops.get(w, ())))
        layout = dict(spec) if isinstance(spec, Mapping) else dict(zip(free, spec or ()))
        axes = tuple(a for a, p in layout.items() if p in read and isinstance(p, Shard) and p.dim % 2 == lin.out_dim)
        if axes:
            found[by_name[name]] = axes
    return found


def _placements(spec: PlacementSpec | None) -> tuple[Placement, ...]:
    if spec is None:
        return ()
    return tuple(spec.values()) if isinstance(spec, Mapping) else tuple(spec)


def _read(
    graph: ComputationGraph, weight: str, placements: tuple[Placement, ...], ops: Sequence[ParallelOp]
) -> tuple[Placement, ...]:
    """``placements`` of ``weight`` (its module's shape) as its readers see them: without a ``Shard`` that a
    ``CombineOp`` of ``ops`` (the parallel ops right after it) gathers — a storage shard, FSDP's."""
    left = list(placements)
    for op in ops:
        shard = next(
            (
                p
                for p in left
                if isinstance(p, Shard) and isinstance(op, CombineOp) and stored_dim(graph, weight, p.dim) == op.dim
            ),
            None,
        )
        if shard is not None:
            left.remove(shard)
    return tuple(left)


def _check_param_dims(graph: ComputationGraph, module: str, param: str, layout: Layout) -> None:
    """Raise PlanError for a ``Shard(d)`` of a module's parameter whose dim is out of range for its shape (the
    module's, before any storing by parts): ``d`` ≥ ndim or < -ndim, which would otherwise wrap onto another dim."""
    shape = graph.module_shape(f"{module}.{param}")
    ndim = len(shape)
    for axis, pl in layout.items():
        if isinstance(pl, Shard) and not -ndim <= pl.dim < ndim:
            raise PlanError(
                f"plan for module {module!r} places parameter {param!r} (shape {list(shape)}, {ndim} dims) as "
                f"{axis}: Shard({pl.dim}), a dim it does not have; give Shard(d) with d from 0 to {ndim - 1} "
                f"(or -{ndim} to -1), e.g. Shard(0), or Replicate()"
            )


def _sharding(spec: PlacementSpec, group: SubMesh, graph: ComputationGraph, name: str) -> Sharding:
    layout = _layout(spec, group, f"placement of {name}")
    shape = graph.tensors[name].shape
    try:
        s = Sharding.replicated(len(shape)).with_layout(layout, group)
        # a placement may split a dim in uneven blocks, as DTensor's does (docs/concepts.md#uneven-shards)
        s.check(group, shape, "strategy plan", name, uneven=True)
    except DegreeError:
        raise
    except ShardingError as e:
        raise PlanError(str(e)) from None
    return s


def _stage_groups(plan: Plan, graph: ComputationGraph, mesh: Mesh, targets: _Targets) -> dict[str, SubMesh]:
    """Node → sub-mesh with the stage axis fixed. A node no staged module holds runs on every stage (the whole mesh)
    when it reads a tensor that a ``ReplicateOp`` on the stage axis (``plan.ops``) spread over every stage, or the
    output of such a node; else on the latest stage among its inputs' producers; a node that reads only leaves
    (the label path of a loss) runs where its first reader runs."""
    staged = {pat: mp.stage for pat, mp in plan.modules.items() if mp.stage is not None}
    if not staged:
        if plan.stage_axis in mesh.axis_names and mesh.axis_size(plan.stage_axis) > 1:
            raise PlanError(
                f"mesh {mesh} has a pipeline axis {plan.stage_axis!r} but the plan puts no module on a stage"
            )
        return {}
    if plan.stage_axis not in mesh.axis_names:
        raise PlanError(f"the plan has pipeline stages but mesh {mesh} has no axis {plan.stage_axis!r}")
    n_stages = mesh.axis_size(plan.stage_axis)
    for pat, s in staged.items():
        if not 0 <= s < n_stages:
            raise PlanError(f"module {pat!r} is put on stage {s}, but axis {plan.stage_axis!r} has {n_stages} stages")
    whole = SubMesh(mesh)
    every_stage = {
        t for t, pops in plan.ops.items() if any(isinstance(p, ReplicateOp) and p.axis == plan.stage_axis for p in pops)
    }
    # The most specific pattern (longest matched module path, or a node-name match) decides; the first on ties.
    decided: dict[str, tuple[int, int]] = {}  # node → (depth, stage)
    for pat, s in staged.items():
        depth: dict[str, int] = {}
        for m in targets.matched[pat]:
            for n in targets.modules[m]:
                depth[n.name] = max(depth.get(n.name, -1), len(m))
        depth.update((n.name, 10**6) for n in targets.named[pat])
        for name, d in depth.items():
            if d > decided.get(name, (-1, 0))[0]:
                decided[name] = (d, s)
    producer = graph.producer()
    groups: dict[str, SubMesh] = {}
    deferred: list[Node] = []  # unstaged nodes that read only leaves: they run where their first reader runs
    for n in graph.nodes:
        if n.name in decided:
            groups[n.name] = whole.with_fixed(plan.stage_axis, decided[n.name][1])
            continue
        if every_stage.intersection(n.inputs):
            groups[n.name] = whole
            every_stage.update(n.outputs)
            continue
        sources = [groups[producer[t].name] for t in n.inputs if t in producer and producer[t].name in groups]
        if not sources:
            deferred.append(n)
        elif any(g == whole for g in sources):
            groups[n.name] = whole
            every_stage.update(n.outputs)
        else:  # the latest stage among its producers'
            groups[n.name] = max(sources, key=lambda g: dict(g.fixed)[plan.stage_axis])
    consumers = graph.consumers()
    for n in reversed(deferred):
        readers = [groups[c.name] for t in n.outputs for c, _ in consumers[t] if c.name in groups]
        groups[n.name] = readers[0] if readers else whole.with_fixed(plan.stage_axis, 0)
    return groups
