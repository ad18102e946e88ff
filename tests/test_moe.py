"""Mixtures of experts (docs/concepts.md#mixtures-of-experts): Hugging Face's expert layers lifted to one
``Experts`` op at capture, the router's ``topk`` on a rule, and what that buys under dp and with the experts
split over a mesh axis — numbers against eager PyTorch on one device (float64, 2 SGD steps, 1e-9) and plan
structure (which tensors move)."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import zoo  # noqa: E402
from hf_worker import SGD, compare, weights_of  # noqa: E402

from shardflow.api import parallelize  # noqa: E402
from shardflow.capture import CaptureError, capture, wide_floats  # noqa: E402
from shardflow.cli import main  # noqa: E402
from shardflow.graph import dispatch as D  # noqa: E402
from shardflow.graph import ops as O  # noqa: E402
from shardflow.graph.flops import node_flops  # noqa: E402
from shardflow.graph.graph import ComputationGraph  # noqa: E402
from shardflow.lower import lower_step  # noqa: E402
from shardflow.lower.cost import PLAIN, EPDispatch  # noqa: E402
from shardflow.lower.dynamic import ActivationCheckpointing  # noqa: E402
from shardflow.lower.program import Comm, Compute  # noqa: E402
from shardflow.lower.verify import PlanVerificationError, verify  # noqa: E402
from shardflow.parallel.mesh import Mesh, Replicate, Shard  # noqa: E402
from shardflow.parallel.pcg import build_pcg  # noqa: E402
from shardflow.runtime.local import LocalExecutor  # noqa: E402
from shardflow.simulator.cost import balanced_bytes, compute_flops  # noqa: E402
from shardflow.strategy import PlanError, make_plan, resolve  # noqa: E402
from shardflow.strategy.plan import ModulePlan, Plan  # noqa: E402

TOL = 1e-9
# family → its layers with routed experts (DeepSeek-V3's first layer is dense: first_k_dense_replace=1)
MOE_LAYERS = {"mixtral": 2, "qwen3_moe": 2, "deepseek_v3": 1}
INTERMEDIATE = {"mixtral": 128, "qwen3_moe": 32, "deepseek_v3": 32}  # an expert's hidden width I


@functools.cache
def captured(family: str, sequences: int = zoo.B):
    """The float64 model of tests/zoo.py's ``family``, a batch of ``sequences`` sequences and its graph (captured as
    ``shardflow check`` does, inside ``wide_floats()``)."""
    model, batch = getattr(zoo, family)()
    model = model.double()
    if sequences != zoo.B:
        ids = torch.randint(0, zoo.VOCAB, (sequences, zoo.T), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids}
    with wide_floats():
        graph = capture(model, batch)
    return model, batch, graph


def _compare(family: str, pcg, sequences: int = zoo.B) -> dict[str, float]:
    model, batch, graph = captured(family, sequences)
    return compare(model, batch, graph, LocalExecutor(lower_step(pcg, SGD.slots), SGD))


@pytest.mark.parametrize("family", list(MOE_LAYERS))
def test_each_expert_layer_is_one_op(family):
    """One Experts node per layer with routed experts, reading the layer's two stacked weights; none of the routing
    program it replaces (sort, histc, cumsum, index, the grouped products) is left, and the routers' topk are on a
    rule."""
    _, _, graph = captured(family)
    experts = [n for n in graph.nodes if isinstance(n.op, O.Experts)]
    assert len(experts) == MOE_LAYERS[family]
    for n in experts:
        assert n.scope.endswith(".mlp.experts"), n.scope
        assert n.inputs[3:] == (f"{n.scope}.gate_up_proj", f"{n.scope}.down_proj")
        assert n.op == O.Experts("silu", transposed=False)
        # 16 tokens, 2 experts each, an expert's w1 [2I, H] and w2 [H, I]: 2·16·2·3·H·I FLOPs
        assert node_flops(graph, n) == 2 * 16 * 2 * 3 * 64 * INTERMEDIATE[family]
    generic = {n.op.describe() for n in graph.nodes if isinstance(n.op, O.Aten)}
    assert not generic & {"sort", "histc", "cumsum", "index.Tensor", "index_put", "transformers.grouped_mm_fallback"}
    assert sum(isinstance(n.op, O.TopK) for n in graph.nodes) >= MOE_LAYERS[family]
    assert not generic, generic  # DeepSeek-V3's group-limited router: full_like and scatter on rules too


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_dp_routes_and_computes_the_tokens_where_they_are(family):
    """dp=2: the router and the experts run on each device's half of the tokens — no redistribution anywhere in a
    mixture-of-experts block (before, the router's scores were gathered to every device) — and one device's numbers
    come out."""
    _, _, graph = captured(family)
    mesh = Mesh.parse("dp=2")
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "dp"), graph, mesh))
    moved = [r.node for r in pcg.redistributions if ".mlp" in r.scope]
    assert moved == []
    for n in pcg.nodes:
        if isinstance(n.op, O.Experts):
            assert [pcg.tensors[t].sharding.dims[0] for t in n.inputs[:3]] == [("dp",)] * 3
            assert pcg.tensors[n.outputs[0]].sharding.dims[0] == ("dp",)
    diffs = _compare(family, pcg)
    assert all(d <= TOL for d in diffs.values()), diffs


def _routings(family: str) -> list[torch.Tensor]:
    """Each expert layer's routing ``[tokens, K]`` by the eager model on the batch of :func:`captured` (its experts
    modules' ``top_k_index`` argument)."""
    model, batch, _ = captured(family)
    seen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_pre_hook(lambda _, args: seen.append(args[1]))
        for name, m in model.named_modules()
        if name.endswith(".mlp.experts")
    ]
    try:
        with torch.no_grad(), wide_floats():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _routed(family: str) -> list[torch.Tensor]:
    """Tokens routed to each expert of each expert layer by the eager model on the batch of :func:`captured`."""
    config = captured(family)[0].config
    n_experts = config.num_local_experts if family == "mixtral" else config.num_experts
    return [torch.bincount(idx.flatten(), minlength=n_experts) for idx in _routings(family)]


@pytest.mark.parametrize("mesh, strategy", [("dp=2", "dp"), ("ep=2", "ep"), ("ep=2,tp=2", "ep,tp")])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_each_expert_layer_s_load_counts_the_tokens_routed_to_each_expert(family, mesh, strategy):
    """Capture adds one graph output per expert layer, the tokens routed to each of its experts (a Histc of its
    routing, Partial(sum) where the tokens are split: no communication in the step), and the executor reads it
    summed over the batch: the counts eager PyTorch routes, whatever the plan."""
    _, _, graph = captured(family)
    loads = graph.expert_loads
    assert len(loads) == MOE_LAYERS[family] and set(loads) <= set(graph.outputs)
    pcg = _ep_pcg(family, mesh, strategy)
    assert not [r for r in pcg.redistributions if r.node.endswith(".load")]
    model, batch, _ = captured(family)
    ex = LocalExecutor(lower_step(pcg, SGD.slots), SGD)
    ex.load(weights_of(model, graph))
    ex.step(batch)
    got = [ex.expert_loads()[t] for t in loads]
    assert [g.tolist() for g in got] == [w.tolist() for w in _routed(family)]
    assert all(int(g.sum()) == 16 * 2 for g in got)  # every token's 2 experts counted once


@pytest.mark.parametrize("mesh, strategy", [("dp=2", "dp"), ("ep=2", "ep")])
def test_the_router_s_load_balancing_loss_counts_tokens_where_they_are(mesh, strategy):
    """Mixtral with ``output_router_logits``: the load-balancing loss counts the tokens routed to each expert with
    ``histc`` of each device's tokens — ``Partial(sum)`` counts, reduced where the loss divides by them (a few bytes),
    not every token gathered — and the numbers equal one device's."""
    pcg = _ep_pcg("mixtral_router_loss", mesh, strategy)
    counts = [n for n in pcg.nodes if isinstance(n.op, O.Histc)]
    assert counts and all(pcg.tensors[n.outputs[0]].sharding.partial == (strategy,) for n in counts)
    assert not [r for r in pcg.redistributions if isinstance(r.op, O.Histc)]
    diffs = _compare("mixtral_router_loss", pcg)
    assert all(d <= TOL for d in diffs.values()), diffs


def test_experts_split_over_an_axis_sum_their_outputs():
    """The experts' stacked weights Shard(0) on tp=2 (each device holds 2 of Mixtral's 4 experts, their gradients
    and optimizer state): each device computes its experts for every token, the outputs are Partial(sum) on tp,
    all-reduced at the layer's output; numbers equal one device's."""
    _, _, graph = captured("mixtral")
    mesh = Mesh.parse("tp=2")
    experts = ModulePlan(params={"gate_up_proj": (Shard(0),), "down_proj": (Shard(0),)}, output=(Replicate(),))
    plan = Plan({f"model.layers.{i}.mlp.experts": experts for i in range(2)})
    pcg = build_pcg(graph, mesh, resolve(plan, graph, mesh))
    nodes = [n for n in pcg.nodes if isinstance(n.op, O.Experts)]
    assert len(nodes) == 2
    for n in nodes:
        assert [pcg.tensors[t].sharding.dims[0] for t in n.inputs] == [(), (), (), ("tp",), ("tp",)]
        assert pcg.tensors[n.outputs[0]].sharding.partial == ("tp",)
        assert [pcg.local_of(n, d).op.start for d in (0, 1)] == [0, 2]
    diffs = _compare("mixtral", pcg)
    assert all(d <= TOL for d in diffs.values()), diffs


class _Experts(nn.Module):
    """An expert layer written with einsum and gather instead of Hugging Face's sort and grouped products: every
    expert on every token, the K chosen ones gathered; ``scale`` ≠ 1 makes it something else than an expert layer."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(4, 8, 8) * 0.3)

    def forward(self, x, idx, w):  # x [N, H], idx and w [N, K]
        gate, up = torch.einsum("nh,eoh->neo", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("nei,ehi->neh", nn.functional.silu(gate) * up, self.down_proj)  # [N, E, H]
        chosen = y.gather(1, idx.unsqueeze(-1).expand(-1, -1, y.shape[-1]))  # [N, K, H]
        return (chosen * w.unsqueeze(-1)).sum(1) * self.scale


class _Moe(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = _Experts(scale)

    def forward(self, x):
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, idx, w).pow(2).mean()


@pytest.mark.parametrize("scale, fused", [(1.0, True), (2.0, False)])
def test_a_region_becomes_the_op_only_where_it_computes_it(scale, fused):
    """Another implementation of an expert layer is lifted to the op too (the region computes what the op computes
    on a random routing); the same code scaled by 2 is not an expert layer and stays as captured."""
    torch.manual_seed(0)
    graph = capture(_Moe(scale), {"x": torch.randn(8, 8)})
    kinds = [type(n.op) for n in graph.nodes if n.scope == "experts"]
    assert (kinds == [O.Experts]) == fused and (O.Experts not in kinds) == (not fused), kinds


class _Routing(nn.Module):
    """Token-choice routing written with the routing ops on their own, as a dispatcher writes them (not an expert
    layer: capture keeps them): each sequence's token-expert pairs sorted by expert and ranked by a running sum, the
    rows gathered in that order, and summed per expert by ``index_add``."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)

    def forward(self, x):  # x [B, T, 8]
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)  # [B, T, 2]
        pairs = idx.flatten(1)  # [B, T·2]
        order = torch.sort(pairs, dim=1, stable=True).indices  # each sequence's pairs by expert
        ranked = torch.cumsum(torch.ones_like(pairs), dim=1)
        rows = x.unsqueeze(2).expand(-1, -1, 2, -1).flatten(1, 2) * w.flatten(1).unsqueeze(-1)  # [B, T·2, 8]
        rows = rows.gather(1, order.unsqueeze(-1).expand(-1, -1, 8))
        experts = pairs.gather(1, order).flatten()  # [B·T·2]
        per_expert = torch.zeros(4, 8).index_add(0, experts, rows.flatten(0, 1))  # [E, 8]
        return per_expert.pow(2).mean() + (ranked * pairs).float().mean() / 100


def test_routing_ops_run_on_the_tokens_a_device_holds():
    """dp=2 on :class:`_Routing`: ``sort`` and ``cumsum`` along each sequence keep the batch split, and ``index_add``
    of the split rows gives ``Partial(sum)`` sums per expert (each device adds its rows, the zeros counted once) —
    the one redistribution of the step is that partial sum's reduction before the square; no routing op runs
    replicated; 2 SGD steps equal eager PyTorch's (float32: 1e-5 of the loss)."""
    torch.manual_seed(0)
    model, batch = _Routing(), {"x": torch.randn(4, 6, 8)}
    graph = capture(model, batch)
    assert not [n for n in graph.nodes if isinstance(n.op, O.Aten)]
    assert ComputationGraph.from_json(graph.to_json()) == graph  # the typed routing ops round-trip
    mesh = Mesh.parse("dp=2")
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "dp"), graph, mesh))
    kinds = {type(n.op): n for n in pcg.nodes}
    for op in (O.Sort, O.Cumsum):
        assert pcg.tensors[kinds[op].outputs[0]].sharding.dims[0] == ("dp",)
    added = pcg.tensors[kinds[O.IndexAdd].outputs[0]].sharding
    assert added.partial == ("dp",) and added.dims == ((), ())
    moved = pcg.redistributions
    assert len(moved) == 1 and moved[0].tensor == kinds[O.IndexAdd].outputs[0], moved
    trainer = parallelize(model, batch, mesh=mesh, strategy="dp", optimizer=SGD)
    for step in trainer.compare_with_eager(model, batch, 2):
        tol = 1e-5 * max(1.0, abs(step.eager_loss))
        assert abs(step.loss - step.eager_loss) <= tol and step.grad <= tol and step.weight <= tol, step


def _ep_pcg(family: str, mesh_text: str, strategy: str, sequences: int = zoo.B):
    _, _, graph = captured(family, sequences)
    mesh = Mesh.parse(mesh_text)
    return build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy), graph, mesh))


def _lowered(pcg, dispatch: str):
    return lower_step(pcg, SGD.slots, options=dataclasses.replace(PLAIN, ep_dispatch=EPDispatch(dispatch)))


def test_ep_stores_each_device_s_experts_and_gathers_the_tokens():
    """ep=2 on Mixtral (4 experts): each device stores 2 experts of each layer (weights, gradients, optimizer
    state); the batch is split over ep as over dp; the plan asks each expert layer for its tokens, routings and
    routing weights whole on ep and gives partial sums; under ``--ep-dispatch all_gather`` they are all-gathered
    (the all-gather token dispatcher), each device computes its experts for every token and reduce-scatters the
    partial sums back onto the tokens; numbers equal one device's."""
    pcg = _ep_pcg("mixtral", "ep=2", "ep")
    assert pcg.tensors["input_ids"].sharding.dims[0] == ("ep",)
    for i in range(2):
        for w in ("gate_up_proj", "down_proj"):
            assert pcg.tensors[f"model.layers.{i}.mlp.experts.{w}"].sharding.dims[0] == ("ep",)
    producer = {o: n for n in pcg.nodes for o in n.outputs}
    experts = [n for n in pcg.nodes if isinstance(n.op, O.Experts)]
    assert len(experts) == 2
    for n in experts:
        assert [producer[t].op.describe() for t in n.inputs[:3]] == ["CombineOp(dim=0, degree=2, axis=ep)"] * 3
        assert pcg.tensors[n.outputs[0]].sharding.partial == ("ep",)
    lowered = _lowered(pcg, "all_gather")
    kinds = Counter((c.task, c.family) for c in lowered.programs[0].comms if c.axis == "ep")
    assert kinds[("FWD", "all_gather")] == 3 * 2 and kinds[("FWD", "reduce_scatter")] == 2
    model, batch, graph = captured("mixtral")
    # a device's 2 of the 4 experts, on every token: half the layer's pairs, on a balanced routing (the simulator's)
    layers = [n for n in graph.nodes if isinstance(n.op, O.Experts)]
    local = [
        i
        for i in lowered.programs[0].instrs
        if isinstance(i, Compute) and i.op.startswith("experts") and i.task == "FWD"
    ]
    assert [compute_flops(i) for i in local] == [node_flops(graph, n) // 2 for n in layers]
    diffs = compare(model, batch, graph, LocalExecutor(lowered, SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def test_the_all_to_all_dispatcher_sends_each_token_only_to_its_experts_ranks():
    """ep=2 on Mixtral (2 layers, 4 experts, top 2; 16 tokens of width 64, 8 per rank) under the default
    ``--ep-dispatch all_to_all``: per layer and rank, the forward exchanges the rows per expert (an all-to-all of
    [2, 2] counts), sends each token-expert pair's row to its expert's rank and the results back (two all-to-alls of
    those sizes), the backward sends the rows' gradients the same two ways; no token is all-gathered and no output
    reduce-scattered on ep. The programs count each all-to-all's bound (the 16 rows a rank sends; the 32 rows it
    can receive, 2 of every token of the group), the simulator a balanced routing's (8 rows each way); the executor
    measures what they send: the rows of the pairs eager PyTorch routes to the other rank's experts, and back.
    Numbers equal one device's."""
    pcg = _ep_pcg("mixtral", "ep=2", "ep")
    lowered = lower_step(pcg, SGD.slots)
    row = 64 * 8  # float64
    for program in lowered.programs.values():
        comms = [c for c in program.comms if c.axis == "ep"]
        kinds = Counter((c.task, c.kind) for c in comms)
        assert kinds[("FWD", "all_to_all")] == 2 and kinds[("FWD", "all_to_all_v")] == 4
        assert kinds[("BWD", "all_to_all_v")] == 4 and not kinds[("FWD", "all_gather")]
        assert not {c.family for c in comms} & {"all_gather", "reduce_scatter"}
        sized = [c for c in comms if c.kind == "all_to_all_v"]
        assert [c.nbytes for c in sized] == [16 * row, 32 * row] * 4
        assert all(c.splits is not None for c in sized)
        assert [balanced_bytes(c) for c in sized] == [8 * row] * 8  # the simulator's: half of 16 rows each way
    model, batch, graph = captured("mixtral")
    ex = LocalExecutor(lowered, SGD)
    ex.load(weights_of(model, graph))
    ex.step(batch)
    for r in (0, 1):
        mine = [idx[8 * r : 8 * (r + 1)] for idx in _routings("mixtral")]
        theirs = [idx[8 * (1 - r) : 8 * (2 - r)] for idx in _routings("mixtral")]
        away = sum(int((idx // 2 != r).sum()) for idx in mine)
        here = sum(int((idx // 2 == r).sum()) for idx in theirs)
        assert ex.sized_sent[r] == 2 * (away + here) * row, (r, away, here)
    diffs = compare(model, batch, graph, LocalExecutor(lowered, SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def _through_the_dispatcher(capacity: int, d: int = 2, local: int = 2, k: int = 2, n: int = 6, hidden: int = 8):
    """The dispatcher's three local ops on ``d`` ranks with the all-to-alls done by hand: each rank's ``n`` tokens
    (random, float64) routed to ``k`` of ``d·local`` experts; (the ranks' outputs joined, the inputs)."""
    torch.manual_seed(0)
    e, inner = d * local, 6
    xs = [torch.randn(n, hidden, dtype=torch.float64) for _ in range(d)]
    idxs = [torch.stack([torch.randperm(e)[:k] for _ in range(n)]) for _ in range(d)]
    ws = [torch.rand(n, k, dtype=torch.float64) for _ in range(d)]
    w1, w2 = torch.randn(e, 2 * inner, hidden, dtype=torch.float64), torch.randn(e, hidden, inner, dtype=torch.float64)
    mine = [slice(p * local, (p + 1) * local) for p in range(d)]
    route = D.ExpertRoute(d, local, capacity)
    sent = [route.compute(x, i) for x, i in zip(xs, idxs)]
    if capacity:  # fixed sizes: C rows per expert, local · C per member
        chunk = [[local * capacity] * d] * d
    else:
        chunk = [c.sum(1).tolist() for _, c in sent]
    parts = [rows.split(sizes) for (rows, *_), sizes in zip(sent, chunk)]
    received = [torch.cat([parts[s][p] for s in range(d)]) for p in range(d)]
    counts = [torch.stack([sent[s][1][p] for s in range(d)]) for p in range(d)] if not capacity else [None] * d
    done = [
        D.ExpertsLocal(capacity=capacity).compute(
            received[p], *([counts[p]] if counts[p] is not None else []), w1[mine[p]], w2[mine[p]]
        )[0]
        for p in range(d)
    ]
    back_sizes = [[chunk[s][p] for s in range(d)] for p in range(d)]
    pieces = [y.split(sizes) for y, sizes in zip(done, back_sizes)]
    outs = [
        D.ExpertCombine(capacity).compute(torch.cat([pieces[p][s] for p in range(d)]), idxs[s], ws[s])[0]
        for s in range(d)
    ]
    return torch.cat(outs), (xs, idxs, ws, w1, w2)


@pytest.mark.parametrize("capacity", [0, 1, 2, 6])
def test_the_dispatcher_s_local_ops_compute_the_expert_layer_and_drop_past_capacity(capacity):
    """Route, experts and combine around all-to-alls equal the expert layer on every token of every rank
    (``O.Experts``) without a capacity, and with a capacity C each rank's first C pairs per expert in token order
    (GShard's capacity), the others adding nothing — written out pair by pair here; C = n drops nothing."""
    got, (xs, idxs, ws, w1, w2) = _through_the_dispatcher(capacity)
    if capacity == 0:
        want = O.Experts().compute(torch.cat(xs), torch.cat(idxs), torch.cat(ws), w1, w2)[0]
    else:
        outs = []
        for x, idx, w in zip(xs, idxs, ws):
            out, taken = torch.zeros_like(x), Counter()
            for t in range(len(x)):
                for j, e in enumerate(idx[t].tolist()):
                    if taken[e] < capacity:
                        out[t] += w[t, j] * O.expert_mlp("silu", x[t : t + 1], w1[e], w2[e])[0]
                    taken[e] += 1
            outs.append(out)
        want = torch.cat(outs)
    assert (got - want).abs().max().item() <= 1e-12


def test_a_capacity_factor_gives_all_to_alls_of_fixed_size():
    """``--capacity-factor 1`` on Mixtral under ep=2 (8 tokens per rank, top 2 of 4 experts: C = ⌈1 · 8·2/4⌉ = 4):
    per layer, two all-to-alls of fixed size forward and two backward, each of the 4 experts' 4 slots of 64 float64
    (half of them to the other rank: 4,096 bytes), no exchange of counts, nothing of data-dependent size; with a
    factor of 2 (C = 8: every pair of a rank's tokens fits) the numbers of one device."""
    pcg = _ep_pcg("mixtral", "ep=2", "ep")
    lowered = lower_step(pcg, SGD.slots, options=dataclasses.replace(PLAIN, capacity_factor=1.0))
    for program in lowered.programs.values():
        comms = [c for c in program.comms if c.axis == "ep"]
        kinds = Counter((c.task, c.kind) for c in comms)
        assert kinds[("FWD", "all_to_all")] == 4 and kinds[("BWD", "all_to_all")] == 4
        assert not kinds[("FWD", "all_to_all_v")] and not kinds[("BWD", "all_to_all_v")]
        assert {(c.type.shape, c.nbytes) for c in comms if c.kind == "all_to_all"} == {((16, 64), 4096)}
    model, batch, graph = captured("mixtral")
    roomy = lower_step(pcg, SGD.slots, options=dataclasses.replace(PLAIN, capacity_factor=2.0))
    diffs = compare(model, batch, graph, LocalExecutor(roomy, SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


@pytest.mark.parametrize(
    "more, said",
    [
        (["--strategy", "ep", "--capacity-factor", "0"], "capacity_factor=0.0: give the rows each expert takes"),
        (
            ["--strategy", "ep", "--capacity-factor", "1", "--ep-dispatch", "all_gather"],
            "capacity_factor=1.0 with ep_dispatch='all_gather': a capacity caps the rows",
        ),
        (
            ["--strategy", "dp", "--capacity-factor", "1"],
            "--capacity-factor 1.0 caps the rows the all-to-all token dispatcher sends each expert, but expert layer "
            "'model.layers.0.mlp.experts' is not dispatched by all-to-all",
        ),
    ],
)
def test_a_capacity_factor_is_refused_where_it_cannot_apply(capsys, more, said):
    """A capacity factor of 0 or less, one with the all-gather dispatcher, and one where an expert layer is not
    dispatched by all-to-all (dp): each a clear error before any process starts (exit status 2)."""
    code = main(["check", "--model", f"{zoo.__file__}:mixtral", "--nproc", "2", *more])
    err = capsys.readouterr().err
    assert code == 2 and f"shardflow check: error: {said}" in err, err


@pytest.mark.parametrize("ac, sized", [("block", 12), ("selective", 8)])
def test_the_all_to_all_dispatcher_under_activation_checkpointing(ac, sized):
    """Under ``--ac block`` each layer's forward runs again before its backward, its dispatch too (per layer and
    rank: 2 all-to-alls of rows in the forward, 2 in the recomputation, 2 in the backward); under ``--ac selective``
    the experts' outputs are kept and nothing is sent again (2 + 2). Numbers equal one device's."""
    lowered = lower_step(
        _ep_pcg("mixtral", "ep=2", "ep"), SGD.slots, options=dataclasses.replace(PLAIN, ac=ActivationCheckpointing(ac))
    )
    assert sum(c.kind == "all_to_all_v" for c in lowered.programs[0].comms) == sized
    model, batch, graph = captured("mixtral")
    diffs = compare(model, batch, graph, LocalExecutor(lowered, SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def test_the_verifier_proves_the_all_to_all_dispatcher_s_order_and_counts():
    """What the verifier proves of the data-dependent all-to-alls (docs/lowering.md#17-the-all-to-all-token-dispatcher---ep-dispatch-all_to_all): every member issues them
    in one order — a rank whose two all-to-alls of one layer are swapped is refused — and the counts that size one
    are held before it is issued — an all-to-all moved before the counts' exchange is refused."""
    programs = dict(lower_step(_ep_pcg("mixtral", "ep=2", "ep"), SGD.slots).programs)
    verify(programs, 2)
    instrs = list(programs[1].instrs)
    sized = [k for k, i in enumerate(instrs) if isinstance(i, Comm) and i.kind == "all_to_all_v"]
    first, second = sized[0], sized[1]
    swapped = list(instrs)
    swapped[first] = dataclasses.replace(instrs[first], token=instrs[second].token)
    swapped[second] = dataclasses.replace(instrs[second], token=instrs[first].token)
    with pytest.raises(PlanVerificationError, match="token"):
        verify({**programs, 1: dataclasses.replace(programs[1], instrs=tuple(swapped))}, 2)
    counts = max(k for k in range(first) if isinstance(instrs[k], Comm))  # the exchange of the counts
    early = instrs[:counts] + [instrs[first], instrs[counts]] + instrs[counts + 1 : first] + instrs[first + 1 :]
    early[counts], early[counts + 1] = (
        dataclasses.replace(early[counts], token=instrs[counts].token),
        dataclasses.replace(early[counts + 1], token=instrs[first].token),
    )
    with pytest.raises(PlanVerificationError, match="received_counts"):
        verify({**programs, 1: dataclasses.replace(programs[1], instrs=tuple(early))}, 2)


EP_CASES = [
    ("qwen3_moe", "ep=2", "ep", 2),
    ("mixtral", "ep=2,tp=2", "ep,tp", 2),
    ("mixtral", "ep=4", "ep", 4),  # one expert per device
    ("mixtral", "ep=2,fsdp=2", "ep,fsdp", 4),  # each device a quarter of 2 experts
]


@pytest.mark.parametrize(
    "family, mesh, strategy, sequences, dispatch",
    [case + ("all_to_all",) for case in EP_CASES]
    + [
        ("mixtral", "fsdp=2,ep=2", "ep,fsdp", 4, "all_to_all"),
        ("mixtral", "dp=2,ep=2", "dp,ep", 4, "all_to_all"),
        ("mixtral", "tp=2,ep=2", "ep,tp", 2, "all_to_all"),
    ]
    + [case + ("all_gather",) for case in EP_CASES],
)
def test_ep_alone_and_combined_equals_one_device(family, mesh, strategy, sequences, dispatch):
    """Both dispatchers, with the numbers of one device. The all-to-all one runs where each expert layer's tokens
    are all-gathered over ep in one collective — ep after the other axes that split them in the mesh (with
    ``ep=2,fsdp=2`` or ``ep=2,tp=2`` the planner gathers over both axes and splits again: the all-gather
    dispatcher runs)."""
    lowered = _lowered(_ep_pcg(family, mesh, strategy, sequences), dispatch)
    sized = sum(c.kind == "all_to_all_v" for c in lowered.programs[0].comms)
    layers = MOE_LAYERS[family]
    inner = mesh.endswith("ep=2") or mesh == "ep=4"
    assert sized == (4 * layers if dispatch == "all_to_all" and inner else 0)
    model, batch, graph = captured(family, sequences)
    diffs = compare(model, batch, graph, LocalExecutor(lowered, SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


@pytest.mark.parametrize(
    "factory, nproc, more",
    [
        ("mixtral", 1, []),
        ("mixtral", 2, []),
        ("mixtral_four_sequences", 4, ["--capacity-factor", "4"]),
    ],
)
def test_shardflow_check_under_ep(capsys, factory, nproc, more):
    """``shardflow check --strategy ep`` in one process and on 2 and 4 gloo processes (the distributed executor,
    every replica compared), dropless and, on 4, with a capacity that drops nothing (each expert may take every pair
    of a rank's tokens: F · n·K / E = n)."""
    argv = ["check", "--model", f"{zoo.__file__}:{factory}", "--strategy", "ep", "--nproc", str(nproc)]
    code = main(argv + ["--steps", "2", "--timeout", "60", *more])
    out, err = capsys.readouterr()
    assert code == 0 and out.rstrip().endswith("over every replica (tolerance 1e-09): OK"), out + err
    size = 2 if nproc < 4 else 4
    assert f"strategy ep: mesh ep={size} ({size} devices)" in out


def test_pp_and_ep_with_microbatches_equal_one_device():
    """pp=2 × ep=2 on Mixtral (one layer per stage), 2 microbatches of 2 sequences: each microbatch's expert layer
    dispatched by all-to-all with buffers of its own, and 2 SGD steps equal eager PyTorch's in float32 (1e-5)."""
    model, batch = zoo.mixtral_four_sequences()
    trainer = parallelize(model, batch, mesh="pp=2,ep=2", strategy="pp,ep", microbatches=2, optimizer=SGD)
    program = trainer.executor.lowered.programs[0]
    sized = [c for c in program.comms if c.kind == "all_to_all_v"]
    assert len(sized) == 2 * 2 * 2 and len({c.send.value for c in sized}) == len(sized)
    for step in trainer.compare_with_eager(model, batch, 2):
        assert abs(step.loss - step.eager_loss) <= 1e-5 and step.grad <= 1e-5 and step.weight <= 1e-5, step


def test_ep_refuses_a_dense_model_and_a_degree_that_does_not_divide_the_experts():
    with pytest.raises(PlanError, match="expert parallelism splits the experts of a mixture-of-experts layer, but the"):
        make_plan(captured_dense(), Mesh.parse("ep=2"), "ep")
    _, _, graph = captured("mixtral")
    with pytest.raises(PlanError, match=r"'model.layers.0.mlp.experts', but it has 4, which 8 does not divide"):
        make_plan(graph, Mesh.parse("ep=8"), "ep")


def captured_dense():
    model, batch = zoo.llama()
    return capture(model, batch)


MIXTRAL_CONFIG = {
    "model_type": "mixtral",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}


def test_train_a_mixtral_config_under_ep_resume_under_fsdp_and_back_and_export(capsys, corpus, tmp_path, read_metrics):
    """``shardflow train --model-config mixtral.json --strategy ep`` (the model built on the meta device, as every
    ``--model-config`` run builds it: its experts count integer expert ids there) trains 2 steps on a 2-device mesh
    with its self-check against one device, the router's balance (tokens per expert: min/mean/max) in each step's
    line and record; ``--resume --strategy fsdp`` continues from the ep checkpoint to step 4 and ``--resume
    --strategy ep`` from that fsdp checkpoint to step 6, each checked again; ``shardflow export`` writes a directory
    transformers loads as Mixtral, its experts whole."""
    import json

    import transformers

    config = tmp_path / "mixtral.json"
    config.write_text(json.dumps(MIXTRAL_CONFIG))
    run = tmp_path / "run"
    common = ["--model-config", str(config), "--data", str(corpus), "--run-dir", str(run), "--nproc", "1"]
    common += ["--seq-len", "8", "--batch-size", "4", "--eval-every", "2", "--eval-batches", "1", "--check"]
    outs = []
    for strategy, steps, extra in (("ep", "2", []), ("fsdp", "4", ["--resume"]), ("ep", "6", ["--resume"])):
        code = main(["train", *common, "--strategy", strategy, "--mesh", f"{strategy}=2", "--steps", steps, *extra])
        out, err = capsys.readouterr()
        assert code == 0, out + err
        assert "check against one device: " in out and out.rstrip().endswith("OK"), out
        assert re.search(r"step +\d+/ *\d+ .* experts \d+/16/\d+ tok", out), out
        outs.append(out)
    assert "(step 2; written under strategy ep on mesh ep=2)" in outs[1]
    assert "(step 4; written under strategy fsdp on mesh fsdp=2)" in outs[2]
    # 4 sequences of 8 tokens, each token routed to 2 of the 4 experts: 16 tokens per expert on average, every layer
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    logged = [r for r in records if "expert_tokens_mean" in r]  # the steps with a line, as their memory
    assert [r["step"] for r in logged] == [r["step"] for r in records if "mem_mib" in r] and len(logged) >= 2
    for r in logged:
        assert r["expert_tokens_mean"] == 16 and 0 <= r["expert_tokens_min"] <= 16 <= r["expert_tokens_max"] <= 32
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "MixtralForCausalLM"
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 128, 32)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_transformers_experts_implementations_are_lifted_and_train_exactly(implementation):
    """Hugging Face's experts implementations that export captures — the default grouped products (sorted tokens)
    and ``batched_mm`` (every token-expert pair's weights gathered, one batched product) — each become the Experts
    op, and dp gives one device's numbers."""
    model, batch = zoo.mixtral()
    model.set_experts_implementation(implementation)
    model = model.double()
    with wide_floats():
        graph = capture(model, batch)
    assert sum(isinstance(n.op, O.Experts) for n in graph.nodes) == 2
    assert not [n for n in graph.nodes if isinstance(n.op, O.Aten)]
    mesh = Mesh.parse("dp=2")
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "dp"), graph, mesh))
    diffs = compare(model, batch, graph, LocalExecutor(lower_step(pcg, SGD.slots), SGD))
    assert all(d <= TOL for d in diffs.values()), diffs


def test_the_eager_experts_loop_is_refused_naming_the_implementations_that_capture():
    """``experts_implementation='eager'`` loops over the experts a batch hits (a branch on the routing, which
    torch.export cannot trace): capture refuses in one paragraph naming the two that work."""
    model, batch = zoo.mixtral()
    model.set_experts_implementation("eager")
    with pytest.raises(CaptureError, match=r"keep the default experts implementation \('grouped_mm'\), or call "):
        capture(model, batch)


def test_ep_keeps_deepseek_v3_s_shared_experts_dense():
    """DeepSeek-V3's layer adds shared experts (a dense MLP every token goes through) to its routed ones: under
    ep=2 the routed experts are split, the shared experts' weights stay whole on every device (they are no
    ``Experts`` op), and the numbers equal one device's."""
    pcg = _ep_pcg("deepseek_v3", "ep=2", "ep")
    assert pcg.tensors["model.layers.1.mlp.experts.gate_up_proj"].sharding.dims[0] == ("ep",)
    shared = [t for t in pcg.tensors if ".shared_experts." in t and t.endswith(".weight")]
    assert len(shared) == 3 and all(not any(pcg.tensors[t].sharding.dims) for t in shared)
    diffs = _compare("deepseek_v3", pcg)
    assert all(d <= TOL for d in diffs.values()), diffs
