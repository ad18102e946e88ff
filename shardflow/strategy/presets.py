"""Preset strategies — data, tensor (Megatron), sequence and pipeline parallelism — and their combinations.

Each preset reads the *structure* of the captured graph, never module names, so any model with the same
structure gets the same plan:

* **dp** (axis ``dp``): every data input is ``Shard(0)`` (batch), and so is every folded attention mask of the batch's leading
  size (an attention mask folded at capture); weights are replicated, so their gradients come out ``Partial``
  and are reduced before the update.
* **tp** (axis ``tp``, Megatron-LM, Shoeybi et al. 2019): a group of linears reading the same input is made
  column-parallel (weight and bias sharded on the output features) when everything downstream of it, up to
  the next linears, can run on the sharded features or heads; those next linears are made row-parallel
  (weight sharded on the input features) and their output is reduced to ``Replicate``. In a GPT block this
  finds q/k/v → attention → output projection, and c_fc → GELU → c_proj; in Llama's, q/k/v (grouped-query:
  the key/value heads shard too) and gate/up → SiLU·mul → down. A linear whose output the model splits into
  q|k|v (GPT-2's ``c_attn``) is searched and planned part by part (:func:`~shardflow.graph.fused.split_fused`),
  so its heads shard like separate projections.
* **sp** (axis ``tp``, Korthikanti et al. 2022): tp, plus the residual stream between the repeated blocks
  sharded on the sequence dim (dim 1): norms, dropout and residual adds run on ``Shard(1)``; a column group's
  input is all-gathered (Combine) and a row-parallel output reduce-scattered (Reduction + Repartition).
* **pp** (axis ``pp``): the repeated blocks (children of the model's first ``ModuleList``) are cut into
  contiguous ranges, one per stage, balanced by a step's FLOPs — compute and the parameters' update
  (:func:`block_costs`, :func:`stage_cuts`); what comes before the blocks runs on stage 0, what follows on the last.
* **fsdp** (axis ``fsdp``; ZeRO-3, Rajbhandari et al. 2020; PyTorch FSDP, Zhao et al. 2023): a data-parallel
  axis (the batch is ``Shard(0)`` on it, as under dp) on which every weight is stored ``Shard(d)`` — its first dim
  the other strategies leave whole and the degree divides — with a Combine (all-gather) right after it: every use
  reads the whole weight, the Combine's backward reduce-scatters the gradient to ``Shard(d)``, and the optimizer
  state and update are the piece's. **hsdp** is ``dp,fsdp``: replicated on ``dp``, sharded on ``fsdp``.
* **ep** (axis ``ep``, expert parallelism; GShard, Lepikhin et al. 2020): the batch split as under dp, and each
  mixture-of-experts layer's experts split over the axis (:func:`expert_parallel`).

Strategies combine on a multi-axis mesh: ``dp,tp`` on ``dp=2,tp=2``; ``fsdp,tp`` on ``fsdp=2,tp=2``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from shardflow.graph import ops as O
from shardflow.graph.blocks import repeated_blocks
from shardflow.graph.flops import node_flops
from shardflow.graph.fused import fused_linears, split_fused, stored_dim
from shardflow.graph.graph import ComputationGraph, Node, TensorRole, TensorSpec
from shardflow.graph.softmax import softmax_heads
from shardflow.parallel.mesh import Balance, Mesh, Placement, Replicate, Shard
from shardflow.parallel.ops import CombineOp
from shardflow.parallel.pcg import build_pcg
from shardflow.parallel.rules import RuleError
from shardflow.parallel.shape import DegreeError
from shardflow.strategy.plan import ModulePlan, Plan, PlanError, module_nodes, resolve

STRATEGIES = ("single", "dp", "fsdp", "hsdp", "tp", "sp", "pp", "cp", "ep")
AXIS_OF = {"dp": "dp", "fsdp": "fsdp", "tp": "tp", "sp": "tp", "pp": "pp", "cp": "cp", "ep": "ep"}
COMBINED = {"hsdp": ("dp", "fsdp")}  # a name for a combination of strategies
DATA_AXES = ("dp", "fsdp", "ep")  # the axes a preset splits the batch over


def data_parallel(graph: ComputationGraph, axis: str = "dp") -> Plan:
    """Shard every data input on its first (batch) dim along ``axis``, and every folded attention mask whose first
    dim has the batch's size: a per-example tensor that capture folded because it depends on the batch's shape
    only (Hugging Face's ``[B, 1, T, S]``), which attention must see split like the batch. A mask is a constant
    that reaches an attention's mask input through views, casts and slices only (other constants, such as a batch
    norm's running statistics ``[C, 1, 1]`` with C equal to the batch size, stay replicated)."""
    sizes = {graph.tensors[n].shape[0] for n in graph.inputs if graph.tensors[n].shape}
    producer = graph.producer()
    masks: list[str] = []
    for n in graph.nodes:
        if not (isinstance(n.op, O.Attention) and n.op.mask):
            continue
        t = n.inputs[3]
        while t in producer and isinstance(producer[t].op, _MASK_PATH) and len(producer[t].inputs) == 1:
            t = producer[t].inputs[0]
        spec = graph.tensors[t]
        if (
            spec.role == TensorRole.CONSTANT
            and len(sizes) == 1
            and len(spec.shape) > 1
            and spec.shape[0] in sizes
            and t not in masks
        ):
            masks.append(t)
    return Plan(inputs={name: {axis: Shard(0)} for name in graph.inputs + tuple(masks)}, name="dp")


_MASK_PATH = (O.Expand, O.Reshape, O.Slice, O.Cast, O.Permute)


def _parameters(graph: ComputationGraph) -> set[str]:
    """The weights, and the parts of a weight that one Split node cuts it into (a fused linear's weight after
    :func:`~shardflow.graph.fused.split_fused`; of one stored by parts, each part viewed without the parts dim)."""
    weights = set(graph.weights)
    params = set(weights)
    for n in graph.nodes:
        if (
            isinstance(n.op, O.Split)
            and n.inputs[0] in weights
            or isinstance(n.op, O.Reshape)
            and n.inputs[0] in params - weights
        ):
            params.update(n.outputs)
    return params


def _linears(graph: ComputationGraph) -> list[Node]:
    params = _parameters(graph)
    return [n for n in graph.nodes if isinstance(n.op, O.Linear) and n.inputs[1] in params and n.scope]


def megatron_regions(graph: ComputationGraph, degree: int, axis: str = "tp") -> list[tuple[list[Node], list[Node]]]:
    """(column-parallel linears, row-parallel linears) pairs found by trying each group and propagating.

    A group = the linears reading one input. Its region = every node reachable from the group's outputs
    without passing through a linear's input; the region's frontier linears become row-parallel. The group is
    kept if the region reads nothing from outside but weights and constants, and the sharding rules accept it
    on a ``degree``-way axis. Raises DegreeError when the structure fits but a size does not divide
    (e.g. heads, or a grouped-query attention's key/value heads, not divisible by tp), naming the module, dim,
    size and degree.

    A fused linear (:func:`~shardflow.graph.fused.fused_linears`: GPT-2's ``c_attn``, q|k|v in one weight) is
    searched part by part: the pairs name the nodes of ``split_fused(graph, fused_linears(graph))``, where each
    part is a linear of its own, so q, k and v join the group of their input like separate projections.

    Cost: a group whose plan can only affect its own linears, region and modules (see :func:`_trial_nodes`) is
    tried on the sub-graph of those nodes alone, so a model of n blocks costs O(n) small propagations instead of n
    propagations of the whole graph; any other group is tried on the whole graph with every group kept so far.
    """
    fused = fused_linears(graph)
    if fused:
        graph = split_fused(graph, fused)
    consumers = graph.consumers()
    linears = _linears(graph)
    is_linear_x = {(n.name, 0) for n in linears}
    leaves = _parameters(graph) | set(graph.by_role(TensorRole.CONSTANT))
    groups: dict[str, list[Node]] = {}
    for n in linears:
        groups.setdefault(n.inputs[0], []).append(n)
    trial_mesh = Mesh((axis,), (degree,))
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    modules = module_nodes(graph)
    accepted: list[tuple[list[Node], list[Node]]] = []
    used: set[str] = set()
    isolated_so_far = True  # every group kept so far was tried (and acts) on its own nodes only
    for x, cols in groups.items():
        if any(c.name in used for c in cols):
            continue
        region: dict[str, Node] = {}
        rows: dict[str, Node] = {}
        frontier = [o for c in cols for o in c.outputs]
        ok = True
        while frontier and ok:
            t = frontier.pop()
            if t in graph.outputs or not consumers[t]:
                ok = False
            for node, i in consumers[t]:
                if (node.name, i) in is_linear_x:
                    rows[node.name] = node
                elif node.name not in region:
                    region[node.name] = node
                    frontier.extend(node.outputs)
        inside = {o for n in list(region.values()) + cols for o in n.outputs}
        if (
            not ok
            or not rows
            or len(region) > 64
            or any(t not in inside and t not in leaves for n in region.values() for t in n.inputs)
        ):
            continue
        candidate = (cols, list(rows.values()))
        trial = (
            _trial_nodes(graph, candidate, list(region.values()), consumers, modules, order)
            if isolated_so_far and not (set(rows) & used)
            else None
        )
        try:
            if trial is not None:
                sub = _trial_graph(graph, *trial, order)
                plan = _megatron_plan([candidate], axis, sequence=False)
                build_pcg(sub, trial_mesh, resolve(plan, sub, trial_mesh), strict=True)
            else:
                plan = _megatron_plan(accepted + [candidate], axis, sequence=False)
                build_pcg(graph, trial_mesh, resolve(plan, graph, trial_mesh), strict=True)
        except DegreeError as e:
            raise e.at(
                hint=f"tensor parallelism splits the heads of each attention (with grouped-query attention, "
                f"its key/value heads too) and the features of each linear pair {degree} ways"
            ) from None
        except (RuleError, PlanError):
            _key_value_heads_split(graph, cols, region.values(), degree, axis)
            continue
        isolated_so_far = trial is not None
        accepted.append(candidate)
        used.update(c.name for c in cols)
        used.update(rows)
    return accepted


def _key_value_heads_split(
    graph: ComputationGraph, cols: list[Node], region: Iterable[Node], degree: int, axis: str
) -> None:
    """Raise DegreeError where a group the rules refused is an attention's projections (q, k and v: separate
    linears) whose query heads ``degree`` divides but whose key/value heads it does not (Llama or Qwen2 with one
    key/value head on tp=2): left out, the attention would be replicated while the plan reads as tensor parallel,
    so the error names the module, the key/value heads, the degree and the ways out. A fused q|k|v (Falcon's
    ``query_key_value``, one linear cut by a view and slices) is not such a group: it stays replicated, as
    docs/concepts.md says."""
    if len(cols) < 2:
        return
    for n in region:
        if not isinstance(n.op, O.Attention):
            continue
        q, k = (graph.tensors[t].type.shape for t in n.inputs[:2])
        heads, kv = q[-3], k[-3]
        if heads % degree == 0 and kv % degree:
            module = n.scope or n.name
            raise DegreeError(
                len(k) - 3,
                kv,
                degree,
                n.name,
                n.inputs[1],
                f"in module {module!r}; tensor parallelism splits the heads of each attention {degree} ways, but "
                f"this one has {kv} key/value head{'s' * (kv != 1)}, which do{'es' * (kv == 1)} not split "
                f"{degree} ways (its projections {', '.join(c.scope for c in cols if c.scope)} would stay "
                f"replicated, only the MLP split): use {axis}=1 for "
                f"this model (e.g. --strategy dp or fsdp), a {axis} degree dividing its {kv} key/value "
                f"head{'s' * (kv != 1)}, or a --plan file that shards only its MLP",
            )


def _trial_nodes(
    graph: ComputationGraph,
    candidate: tuple[list[Node], list[Node]],
    region: list[Node],
    consumers: dict,
    modules: dict[str, list[Node]],
    order: dict[str, int],
) -> tuple[list[Node], list[str]] | None:
    """The nodes the plan of ``candidate`` can affect and the tensors they hand to the rest of the graph, when
    that plan affects nothing else; else None.

    The plan names each linear's module (so the path must be a plain name: no glob characters, no other node so
    called), places its ``weight`` (and a column's ``bias``) and sets the layouts entering the columns' modules
    and leaving the rows'. It stays within: the linears, the region, every node of their modules (Hugging Face's
    ``Conv1D`` reshapes around its ``addmm``) and the Split nodes that cut a placed parameter into the parts a
    column reads (a fused q|k|v; stored by parts, each part viewed without its parts dim) — provided only those read the placed parameters, the linears read no other
    activation than their input 0, and whatever leaves these nodes leaves a row's module (whose output layout
    restores it to ``Replicate``). Then the sharding rules accept the group on the whole graph (with the other
    such groups) exactly when they accept it on the sub-graph of these nodes."""
    cols, rows = candidate
    linears = {n.name for n in cols + rows}
    nodes = {n.name: n for n in cols + rows + region}
    for lin in cols + rows:
        pat = lin.scope
        if any(ch in pat for ch in "*?[") or (pat in order and pat != lin.name):
            return None
        nodes.update((n.name, n) for n in modules[pat])
        placed = [f"{pat}.weight"] + ([f"{pat}.bias"] if any(lin is c for c in cols) and lin.op.bias else [])
        readable = set(placed)
        for p in placed:
            if p not in graph.tensors or graph.tensors[p].role != TensorRole.WEIGHT:
                return None
            for reader, _ in consumers[p]:
                if reader.name in linears:
                    continue
                if not isinstance(reader.op, O.Split):
                    return None
                nodes[reader.name] = reader
                for o in reader.outputs:  # each part read by linears, or viewed (stored by parts) for them
                    for r, _ in consumers[o]:
                        if isinstance(r.op, O.Reshape) and all(c.name in linears for c, _ in consumers[r.outputs[0]]):
                            nodes[r.name] = r
                            readable.update(r.outputs)
                        elif r.name not in linears:
                            return None
                    readable.add(o)
        if any(t not in readable and graph.tensors[t].role == TensorRole.ACTIVATION for t in lin.inputs[1:]):
            return None
    in_rows = {n.name for r in rows for n in modules[r.scope]}
    leaving: list[str] = []
    for n in nodes.values():
        for o in n.outputs:
            if o in graph.outputs or any(c.name not in nodes for c, _ in consumers[o]):
                if n.name not in in_rows:
                    return None
                leaving.append(o)
    return sorted(nodes.values(), key=lambda n: order[n.name]), leaving


def _trial_graph(
    graph: ComputationGraph, nodes: list[Node], outputs: list[str], order: dict[str, int]
) -> ComputationGraph:
    """The sub-graph of ``nodes`` (in graph order): tensors they read from outside become leaves (an activation
    becomes an input), ``outputs`` its outputs."""
    nodes = sorted(nodes, key=lambda n: order[n.name])
    made = {o for n in nodes for o in n.outputs}
    tensors: dict[str, TensorSpec] = {}
    for n in nodes:
        for t in n.inputs:
            if t not in made and t not in tensors:
                spec = graph.tensors[t]
                tensors[t] = spec if spec.role != TensorRole.ACTIVATION else TensorSpec(t, spec.type, TensorRole.INPUT)
    for n in nodes:
        for o in n.outputs:
            tensors[o] = graph.tensors[o]
    constants = {t: graph.constants[t] for t, spec in tensors.items() if spec.role == TensorRole.CONSTANT}
    shapes = {w: s for w, s in graph.module_shapes.items() if w in tensors}
    frozen = frozenset(w for w in graph.frozen if w in tensors)
    return ComputationGraph(tensors, tuple(nodes), tuple(outputs), None, constants, shapes, frozen=frozen)


def _megatron_plan(regions, axis: str, sequence: bool) -> Plan:
    modules: dict[str, ModulePlan] = {}
    for cols, rows in regions:
        for c in cols:  # weight sharded on the output features ([out, in]: dim 0; transposed [in, out]: dim 1)
            params = {"weight": {axis: Shard(c.op.out_dim)}} | ({"bias": {axis: Shard(0)}} if c.op.bias else {})
            modules[c.scope] = ModulePlan(params=params, input={axis: Replicate()})
        for r in rows:  # weight sharded on the input features
            modules[r.scope] = ModulePlan(
                params={"weight": {axis: Shard(1 - r.op.out_dim)}}, output={axis: Shard(1) if sequence else Replicate()}
            )
    return Plan(modules, name="sp" if sequence else "tp")


def vocabulary_parallel(
    graph: ComputationGraph, degree: int, axis: str = "tp", sequence: bool = False, taken: Plan | None = None
) -> Plan:
    """Megatron-LM's vocabulary parallelism on ``axis`` (docs/concepts.md#vocabulary-parallel-embedding-and-loss).

    Each head — a linear whose output features a softmax normalises (:func:`~shardflow.graph.softmax.softmax_heads`:
    a language model's ``lm_head`` and its loss) — is column-parallel, its weight ``Shard`` on the output features;
    the loss then runs on the sharded vocabulary (:func:`~shardflow.graph.softmax.decompose_softmax`, the
    vocabulary-parallel gather of :func:`~shardflow.parallel.rules.rule_gather`). Each embedding whose table is a
    head's weight (tied) or has a head's vocabulary as its rows is vocabulary-parallel, its table ``Shard(0)``, and
    its module's output, ``Partial(sum)`` pieces, is reduced where Megatron reduces it: to ``Replicate`` (all-reduce),
    or under sequence parallelism to ``Shard(1)`` (reduce-scatter onto the residual stream's layout). A head's input
    is ``Replicate`` (under sequence parallelism the all-gather of the sequence, whose backward reduce-scatters the
    input gradient), its bias sharded like its output features. A head whose module ``taken`` (the Megatron pairs'
    plan) places already is left to it: a row-parallel head's output is whole. A vocabulary
    that ``degree`` does not divide is split in uneven blocks (docs/concepts.md#uneven-shards); a parameter of the
    root module stays replicated (no module path to place it by)."""
    params: dict[str, dict[str, dict[str, Shard]]] = {}
    inputs: set[str] = set()
    outputs: set[str] = set()
    vocab, tables = set(), set()
    for head in {h.name: h for h in softmax_heads(graph).values()}.values():
        lin: O.Linear = head.op  # type: ignore[assignment]
        w, d = head.inputs[1], lin.out_dim
        path, _, leaf = w.rpartition(".")
        if taken is not None and head.scope in taken.modules:
            continue
        if w in graph.weights and path:
            params.setdefault(path, {})[leaf] = {axis: Shard(d)}
            if lin.bias and head.inputs[2] in graph.weights:
                bias_path, _, bias_leaf = head.inputs[2].rpartition(".")
                params.setdefault(bias_path, {})[bias_leaf] = {axis: Shard(0)}
            vocab.add(graph.tensors[w].shape[d])
            tables.add(w)
            if head.scope:
                inputs.add(head.scope)
    for n in graph.nodes:
        if not isinstance(n.op, O.Embedding) or n.inputs[1] not in graph.weights or not n.scope:
            continue
        w = n.inputs[1]
        path, _, leaf = w.rpartition(".")
        rows = graph.tensors[w].shape[0]
        if path and (w in tables or rows in vocab):
            params.setdefault(path, {})[leaf] = {axis: Shard(0)}
            outputs.add(n.scope)
    layout = {axis: Shard(1) if sequence else Replicate()}
    modules = {
        m: ModulePlan(
            params=params.get(m, {}),
            input={axis: Replicate()} if m in inputs else None,
            output=layout if m in outputs else None,
        )
        for m in list(params) + sorted((inputs | outputs) - set(params))
    }
    return Plan(modules, name="vocabulary")


def tensor_parallel(
    graph: ComputationGraph, degree: int, axis: str = "tp", sequence: bool = False, vocabulary: bool = True
) -> Plan:
    """Megatron tensor parallelism on ``axis`` (optionally with sequence parallelism), with the vocabulary of a
    language model's embedding and head sharded too unless ``vocabulary`` is False (:func:`vocabulary_parallel`;
    off: they stay replicated, as the benchmark against it measures). Features and a vocabulary that ``degree`` does
    not divide are split in uneven blocks (docs/concepts.md#uneven-shards). Raises PlanError when the model has no
    column/row pair, DegreeError when its heads (or a grouped-query attention's key/value heads) do not divide
    ``degree``: the chunk layout would cut a head."""
    regions = megatron_regions(graph, degree, axis)
    if not regions:
        raise PlanError(
            "tensor parallelism found no column-parallel/row-parallel pair of linears in the model "
            "(a linear whose output reaches another linear through shardable ops only)"
        )
    plan = _megatron_plan(regions, axis, sequence)
    vocab = vocabulary_parallel(graph, degree, axis, sequence, taken=plan) if vocabulary else Plan()
    plan = dataclasses.replace(plan.merge(vocab), name=plan.name)
    if not sequence:
        return plan
    blocks = repeated_blocks(graph)
    if not blocks:
        raise PlanError(
            "sequence parallelism shards the residual stream between repeated blocks, "
            "but the model has no ModuleList of blocks"
        )
    modules = dict(plan.modules)
    for b in blocks:
        modules[b] = ModulePlan(input={axis: Shard(1)})
    # the stream leaves the blocks whole, unless a vocabulary-parallel head gathers it (after the final norm, as
    # Megatron-LM's sequence parallelism does)
    heads = any(mp.input is not None for mp in vocab.modules.values())
    modules[blocks[-1]] = ModulePlan(input={axis: Shard(1)}, output=None if heads else {axis: Replicate()})
    return Plan(modules, name="sp")


def context_parallel(graph: ComputationGraph, degree: int = 2, axis: str = "cp", attention: str = "auto") -> Plan:
    """Context parallelism on ``axis`` of ``degree`` devices (docs/concepts.md#context-parallelism): every data input
    of two dims or more is ``Shard(1)``, its sequence split into blocks (contiguous, or in the load-balanced layout
    where the mesh says so: :func:`cp_laid_out`), and so is every activation that
    follows it; the weights stay replicated, their gradients summed over the axis as under dp. Each attention reads
    the whole sequence, as ``attention`` says (``--cp-attention``, :class:`~shardflow.lower.cost.CPAttention`):

    * ``all_gather``: the planner all-gathers the keys and values (the all-gather form of PyTorch's
      ``context_parallel``), each device's queries attending with their block's rows of the causal mask
      (:func:`~shardflow.parallel.rules.rule_attention`); the backward reduce-scatters the key and value gradients;
    * ``all_to_all`` (DeepSpeed-Ulysses, Jacobs et al. 2023): the queries, keys and values move from the sequence
      onto the heads (``Shard`` of the heads dim: an all-to-all each), every device attends over the whole sequence
      for its heads, and the output moves back onto the sequence — four all-to-alls of a 1/``degree`` piece, where
      the all-gather receives the whole keys and values; the degree must divide the key/value heads;
    * ``ring``: planned as ``all_gather``; lowering runs each pair of gathers as a ring of collective-permutes with
      the attention computed block by block (:func:`~shardflow.lower.comm_lowering.attention_rings`);
    * ``auto``: per attention, all-to-all where the degree divides its heads and it sends fewer bytes — for
      grouped-query attention with g query heads per key/value head, where ``degree`` > g + 1 — else all-gather.

    Raises PlanError when no data input has a sequence dim, the model has no attention, or ``all_to_all`` meets
    heads the degree does not divide."""
    inputs = {name: {axis: Shard(1)} for name in graph.inputs if len(graph.tensors[name].shape) >= 2}
    if not inputs:
        raise PlanError(
            f"context parallelism splits the sequence (dim 1) of the batch, but no data input of the model has two "
            f"dims (its inputs: {list(graph.inputs)}); use dp or fsdp to split the batch instead"
        )
    attentions = [n for n in graph.nodes if isinstance(n.op, O.Attention)]
    if not attentions:
        raise PlanError(
            "context parallelism splits the sequence that attention reads whole, but the model has no attention "
            "(F.scaled_dot_product_attention); split its batch with dp or fsdp instead"
        )
    if attention not in ("auto", "all_gather", "all_to_all", "ring"):
        raise PlanError(f"--cp-attention {attention!r}: give all_gather, all_to_all, ring or auto")
    modules: dict[str, ModulePlan] = {}
    for n in attentions:
        q, k, v = (graph.tensors[t].type for t in n.inputs[:3])
        out = graph.tensors[n.outputs[0]].type
        heads, kv = q.shape[-3], k.shape[-3]
        splits = heads % degree == 0 and kv % degree == 0
        if attention == "all_to_all" and not splits:
            raise PlanError(
                f"--cp-attention all_to_all moves attention {n.name!r} (in {n.scope or 'the model'}) onto its heads "
                f"over cp={degree}, but it has {heads} query and {kv} key/value heads, which {degree} does not "
                f"divide: use --cp-attention all_gather, or a cp degree that divides {kv}"
            )
        gathered = (degree - 1) * (k.nbytes + v.nbytes) // degree  # each device receives the rest of k and v
        moved = (degree - 1) * (q.nbytes + k.nbytes + v.nbytes + out.nbytes) // degree**2  # its piece of 4, re-cut
        if attention == "all_to_all" or attention == "auto" and splits and moved < gathered:
            on_heads: dict[str, Placement] = {axis: Shard(q.ndim - 3)}
            whole: dict[str, Placement] = {axis: Replicate()}
            modules[n.name] = ModulePlan(
                operands=(on_heads, on_heads, on_heads, *(whole for _ in n.inputs[3:])),
                output={axis: Shard(out.ndim - 2)},
            )
    return Plan(modules, inputs=inputs, name="cp")


def expert_parallel(graph: ComputationGraph, degree: int, axis: str = "ep") -> Plan:
    """Expert parallelism on ``axis`` of ``degree`` devices (docs/concepts.md#expert-parallelism): the batch is split
    over the axis as :func:`data_parallel` splits it, and every expert layer (an
    :class:`~shardflow.graph.ops.Experts` node) stores its stacked weights ``Shard(0)`` — each device E/``degree``
    experts, their gradients and optimizer state. The layer reads the tokens whole on the axis (the planner
    all-gathers them), each device computes its experts for every token, and the output's partial sums are
    reduce-scattered back onto the tokens: Megatron-LM's all-gather token dispatcher, which lowering runs as the
    all-to-all one by default (:func:`~shardflow.lower.comm_lowering.expert_dispatches`). Everything else runs as
    under dp.

    Raises PlanError where the model has no expert layer, or ``degree`` does not divide a layer's experts."""
    layers = [n for n in graph.nodes if isinstance(n.op, O.Experts)]
    if not layers:
        raise PlanError(
            "expert parallelism splits the experts of a mixture-of-experts layer, but the model has none (no expert "
            "layer was found: docs/concepts.md#mixtures-of-experts); split its batch with dp or fsdp instead"
        )
    modules: dict[str, ModulePlan] = {}
    for n in layers:
        experts = graph.tensors[n.inputs[3]].shape[0]
        if experts % degree:
            raise PlanError(
                f"expert parallelism over ep={degree} splits the experts of {n.scope or n.name!r}, but it has "
                f"{experts}, which {degree} does not divide: use an ep degree that divides {experts}"
            )
        params = {w.rpartition(".")[2]: {axis: Shard(0)} for w in n.inputs[3:]}
        modules[n.scope] = ModulePlan(params=params, input={axis: Replicate()}, output={axis: Shard(0)})
    return dataclasses.replace(data_parallel(graph, axis).merge(Plan(modules, name="ep")), name="ep")


def fully_sharded(graph: ComputationGraph, degree: int, axis: str = "fsdp", others: Plan | None = None) -> Plan:
    """FSDP on ``axis`` of ``degree`` devices (see the module docstring): the batch split as :func:`data_parallel`
    splits it, every weight ``Shard(d)`` and gathered by a ``CombineOp(d)`` before any use. ``d`` is the weight's
    first dim that ``others`` (the plan of the strategies it combines with, e.g. tp's) does not shard and that
    ``degree`` divides, else the first it does not shard of ``degree`` or more indices, in uneven blocks (as FSDP2
    shards any dim 0: docs/concepts.md#uneven-shards); a weight without one, or of the root module (no module path
    to place it by), stays replicated on ``axis`` (its gradient all-reduced, as under dp)."""
    taken: dict[str, set[int]] = {}
    for pat, mp in others.modules.items() if others else ():
        for leaf, spec in mp.params.items():
            placements = spec.values() if isinstance(spec, dict) else spec
            taken.setdefault(f"{pat}.{leaf}", set()).update(p.dim for p in placements if isinstance(p, Shard))
    modules: dict[str, dict[str, dict[str, Shard]]] = {}
    ops = {}
    for w in graph.weights:
        path, _, leaf = w.rpartition(".")
        shape = graph.module_shape(w)  # a plan places parameters in their modules' shapes
        free = [d for d in range(len(shape)) if d not in taken.get(w, ())]
        # a dim the degree divides, else (as FSDP2) one it splits in uneven blocks: docs/concepts.md#uneven-shards
        d = next((d for d in free if shape[d] % degree == 0), next((d for d in free if shape[d] >= degree), None))
        if not path or d is None:
            continue
        modules.setdefault(path, {})[leaf] = {axis: Shard(d)}
        ops[w] = (CombineOp(dim=stored_dim(graph, w, d), degree=degree, axis=axis),)
    sharded = Plan({path: ModulePlan(params=params) for path, params in modules.items()}, ops=ops, name="fsdp")
    return dataclasses.replace(data_parallel(graph, axis).merge(sharded), name="fsdp")


def pipeline(graph: ComputationGraph, stages: int, axis: str = "pp", virtual: int = 1) -> Plan:
    """Cut the repeated blocks into ``stages`` contiguous ranges on ``axis``, balanced by cost
    (:func:`stage_cuts`): what comes before the blocks (an embedding) runs on the first stage, what follows them (a
    final norm, the head, the loss) on the last. With ``virtual`` V > 1 (the interleaved schedule's chunks), into
    ``stages``·V ranges, range c on stage c mod ``stages``."""
    blocks = repeated_blocks(graph)
    chunks = stages * virtual
    if len(blocks) < chunks:
        what = f"{stages} stages" if virtual == 1 else f"{stages} stages × {virtual} chunks per stage"
        raise PlanError(
            f"a pipeline of {what} needs at least {chunks} repeated blocks; the model has "
            f"{len(blocks)} ({', '.join(blocks) or 'none'}). Use fewer stages or more layers"
        )
    costs, before, after = block_costs(graph, blocks)
    stage = [c % stages for c in stage_cuts(costs, chunks, before, after)]
    modules = {b: ModulePlan(stage=s) for b, s in zip(blocks, stage)}
    return Plan(modules, stage_axis=axis, name="pp")


# A step's cost of a node in FLOPs: forward and backward ≈ 3 × the forward's (the backward computes two products
# for each of the forward's: 6·N FLOPs per token for N parameters, Narayanan et al., SC'21), plus the optimizer's
# update of the weights it reads, ≈ 12 FLOPs per element (AdamW: two moments, their bias corrections, the step).
STEP_PER_FORWARD_FLOP = 3
UPDATE_FLOPS_PER_PARAMETER = 12


def block_costs(graph: ComputationGraph, blocks: list[str]) -> tuple[list[int], int, int]:
    """The cost of each block of ``blocks`` (module paths), of what runs before the first and after the last, in
    FLOPs of a training step: :data:`STEP_PER_FORWARD_FLOP` × the forward's
    (:func:`~shardflow.graph.flops.node_flops`) plus :data:`UPDATE_FLOPS_PER_PARAMETER` × the elements of the
    weights its nodes read — compute and parameters, so an embedding, which computes nothing, still weighs on its
    stage."""
    weights = set(graph.weights)

    def cost(n: Node) -> int:
        params = sum(graph.tensors[t].type.numel for t in n.inputs if t in weights)
        return STEP_PER_FORWARD_FLOP * node_flops(graph, n) + UPDATE_FLOPS_PER_PARAMETER * params

    mods = module_nodes(graph)
    inside = {n.name for b in blocks for n in mods.get(b, ())}
    first = next((k for k, n in enumerate(graph.nodes) if n.name in inside), len(graph.nodes))
    costs = [sum(map(cost, mods.get(b, ()))) for b in blocks]
    before = sum(cost(n) for n in graph.nodes[:first] if n.name not in inside)
    after = sum(cost(n) for n in graph.nodes[first:] if n.name not in inside)
    return costs, before, after


def stage_cuts(costs: list[int], stages: int, before: int = 0, after: int = 0) -> list[int]:
    """The stage of each of ``len(costs)`` blocks in order, contiguous ranges of at least one block, minimising the
    largest stage cost (the first stage also pays ``before``, the last ``after``): the linear partition problem,
    solved exactly by dynamic programming (O(stages · n²)). The even split (block i on stage ⌊i·stages/n⌋) is kept
    when it is as good. Raises PlanError when there are fewer blocks than stages."""
    n = len(costs)
    if n < stages:
        raise PlanError(f"{n} blocks cannot fill {stages} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def load(s: int, i: int, j: int) -> int:  # stage s holding blocks i..j-1
        return prefix[j] - prefix[i] + (before if s == 0 else 0) + (after if s == stages - 1 else 0)

    even = [i * stages // n for i in range(n)]
    starts = [even.index(s) for s in range(stages)] + [n]
    even_max = max(load(s, starts[s], starts[s + 1]) for s in range(stages))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][j]: blocks 0..j-1 on stages 0..s-1
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], load(s - 1, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    if even_max <= best[stages][n]:
        return even
    out, j = [0] * n, n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        out[i:j] = [s - 1] * (j - i)
        j = i
    return out


def parse_strategy(text: str) -> list[str]:
    """``"dp,tp"`` / ``"dp+tp"`` → ["dp", "tp"]; ``"hsdp"`` → ["dp", "fsdp"]. Raises PlanError for unknown names, an
    empty part (``"tp,"``) and a name given twice."""
    parts = [p for s in re.split(r"[,+x×]", text) for p in COMBINED.get(s.strip(), (s.strip(),))]
    if "" in parts:
        named = ",".join(filter(None, parts)) or "tp"
        raise PlanError(f"strategy {text!r} has an empty part; write the names separated by commas, e.g. {named!r}")
    bad = [s for s in parts if s not in STRATEGIES]
    if bad:
        raise PlanError(f"unknown strategy {text!r}; use {', '.join(STRATEGIES)} or a combination such as 'dp,tp'")
    twice = sorted({s for s in parts if parts.count(s) > 1})
    if twice:
        raise PlanError(
            f"strategy {text!r} names {twice[0]} twice; each strategy uses its own mesh axis once: write "
            f"it once (e.g. '{','.join(dict.fromkeys(parts))}')"
        )
    if "tp" in parts and "sp" in parts:
        raise PlanError("sp already includes tp: use 'sp' (or 'dp,sp')")
    if "single" in parts and len(parts) > 1:
        raise PlanError(
            f"strategy {text!r}: single runs on one device and combines with nothing; use "
            f"'{','.join(p for p in parts if p != 'single')}' or 'single'"
        )
    return [n for n in parts if n != "single"]


def default_mesh(strategy: str, nproc: int) -> Mesh:
    """The mesh a one-strategy run uses when no ``--mesh`` is given: its axis with all ``nproc`` devices (``single``:
    one device; PlanError for more)."""
    names = parse_strategy(strategy)
    if not names:
        if nproc > 1:
            raise PlanError(
                f"strategy {strategy!r} runs on one device, but {nproc} are asked for (--nproc {nproc}, "
                f"or torchrun's world size); pass --nproc 1, or a strategy that splits the work over "
                f"{nproc} devices: dp, tp, sp or pp"
            )
        return Mesh(("d",), (1,))
    if len(names) > 1:
        example = ",".join(f"{AXIS_OF[n]}=2" for n in names)
        raise PlanError(f"strategy {strategy!r} combines several axes: give the mesh, e.g. --mesh {example}")
    return Mesh((AXIS_OF[names[0]],), (nproc,))


def cp_laid_out(mesh: Mesh, cp_layout: str, graph: ComputationGraph) -> Mesh:
    """``mesh`` with the sequences its ``cp`` axis splits balanced where ``cp_layout`` is ``"balanced"``
    (``--cp-layout``; docs/concepts.md#the-load-balanced-layout): the sequences of ``graph``'s data inputs (dim 1,
    as :func:`context_parallel` splits them) are then stored in head-tail order. ``"auto"``: balanced where every
    attention of ``graph`` is causal and the sequences cut into 2·cp chunks, else contiguous. A mesh without a cp
    axis of 2 or more devices is returned as it is. Raises PlanError when ``"balanced"`` meets sequences that differ
    in length or that 2·cp does not divide."""
    cp = AXIS_OF["cp"]
    if cp_layout == "contiguous" or cp not in mesh.axis_names or mesh.axis_size(cp) == 1:
        return mesh
    lengths = {name: graph.tensors[name].shape for name in graph.inputs if len(graph.tensors[name].shape) >= 2}
    chunks = 2 * mesh.axis_size(cp)
    if cp_layout == "auto":
        attentions = [n.op for n in graph.nodes if isinstance(n.op, O.Attention)]
        even = len({s[1] for s in lengths.values()}) == 1 and all(s[1] % chunks == 0 for s in lengths.values())
        if not (attentions and all(a.causal for a in attentions) and even):
            return mesh
    for name, shape in lengths.items():
        if shape[1] % chunks or shape[1] != next(iter(lengths.values()))[1]:
            raise PlanError(
                f"the load-balanced layout (--cp-layout balanced) cuts the sequence into 2·cp = {chunks} chunks, but "
                f"input {name!r} {list(shape)} has {shape[1]} positions along dim 1"
                + (
                    f" (the inputs' lengths: {sorted({s[1] for s in lengths.values()})})"
                    if len({s[1] for s in lengths.values()}) > 1
                    else ""
                )
                + f": give a sequence length that {chunks} divides (--seq-len), or --cp-layout contiguous"
            )
    if not lengths:
        return mesh
    return dataclasses.replace(mesh, balanced=Balance(cp, next(iter(lengths.values()))[1]))


def make_plan(
    graph: ComputationGraph, mesh: Mesh, strategy: str, stages_per_rank: int = 1, cp_attention: str = "auto"
) -> Plan:
    """The combined plan of the named strategies on ``mesh`` (each uses the axis of its name; sp uses tp);
    ``stages_per_rank``: the chunks of the model each pipeline stage holds (:func:`pipeline`'s ``virtual``);
    ``cp_attention``: how attention reads a sequence split over cp (:func:`context_parallel`'s ``attention``).

    Raises PlanError if a strategy's axis is missing from the mesh, a mesh axis is used by no strategy, or
    ``stages_per_rank`` > 1 without pp.
    """
    names = parse_strategy(strategy)
    if stages_per_rank > 1 and "pp" not in names:
        raise PlanError(
            f"--stages-per-rank {stages_per_rank} cuts a pipeline into chunks, but strategy {strategy!r} "
            f"has no pp; add pp (e.g. --strategy pp) or drop --stages-per-rank"
        )
    axes = {AXIS_OF[n] for n in names}
    for n in names:
        if AXIS_OF[n] not in mesh.axis_names:
            raise PlanError(
                f"strategy {n!r} runs on mesh axis {AXIS_OF[n]!r}, which mesh {mesh} lacks; e.g. --mesh {AXIS_OF[n]}=2"
            )
    unknown = [a for a in mesh.axis_names if a not in AXIS_OF.values()] if mesh.size > 1 else []
    if unknown:
        rest = ",".join(f"{a}={s}" for a, s in zip(mesh.axis_names, mesh.shape) if a in AXIS_OF.values())
        raise PlanError(
            f"mesh {mesh}: axis {unknown[0]!r} is none of the strategies' axes (dp, fsdp, tp (also sp), pp, cp, ep), "
            f"so no strategy in {strategy!r} would use it; drop it (--mesh {rest or 'dp=2'}) or name it "
            f"after the strategy that should use it"
        )
    unused = [a for a, s in zip(mesh.axis_names, mesh.shape) if a not in axes and s > 1]
    if unused:
        raise PlanError(
            f"mesh axes {unused} of {mesh} are used by no strategy in {strategy!r}; "
            f"add one (axis names: dp, fsdp, tp (also sp), pp, cp, ep) or drop the axis"
        )
    plan = Plan(name="single")
    for n in sorted(names, key=lambda n: n == "fsdp"):  # fsdp last: it shards a dim the others leave whole
        size = mesh.axis_size(AXIS_OF[n])
        part = {
            "dp": lambda: data_parallel(graph),
            "fsdp": lambda: fully_sharded(graph, size, others=plan),
            "tp": lambda: tensor_parallel(graph, size),
            "sp": lambda: tensor_parallel(graph, size, sequence=True),
            "pp": lambda: pipeline(graph, size, virtual=stages_per_rank),
            "cp": lambda: context_parallel(graph, size, attention=cp_attention),
            "ep": lambda: expert_parallel(graph, size),
        }[n]()
        plan = part if plan.name == "single" else plan.merge(part)
    return plan
