"""FSDP as placements (strategy presets fsdp, hsdp = dp,fsdp, and fsdp,tp): the exact plan — every weight stored
Shard(d) on the fsdp axis, one all-gather per weight before its use (two with reshard-after-forward: again for the
backward), one reduce-scatter of its gradient — and the numbers of one device, at float64, for each."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from conftest import lower_preset, run_adamw, tiny_hf_llama_float64  # noqa: E402

from shardflow.lower.cost import DEFAULT_BUCKET_BYTES  # noqa: E402
from shardflow.lower.dynamic import block_of  # noqa: E402
from shardflow.lower.memory import MemoryKind, program_memory  # noqa: E402
from shardflow.lower.program import Comm  # noqa: E402
from shardflow.parallel.mesh import Mesh, Replicate, Shard  # noqa: E402
from shardflow.parallel.pcg import build_pcg  # noqa: E402
from shardflow.reference import weights_of  # noqa: E402
from shardflow.runtime.kernels import OptimizerConfig  # noqa: E402
from shardflow.runtime.local import LocalExecutor  # noqa: E402
from shardflow.strategy import PlanError, resolve  # noqa: E402
from shardflow.strategy.presets import default_mesh, make_plan, parse_strategy  # noqa: E402

STEPS = 3
TOL = 1e-12  # float64: partial sums in another order than one device (seen ~1e-14)


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_llama_float64()


def _lower(graph, mesh_text: str, strategy: str, reshard: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    return lower_preset(graph, mesh_text, strategy, reshard_after_forward=reshard, bucket_bytes=bucket_bytes)


def _run(model, batch, graph, step):
    return run_adamw(model, batch, graph, step, STEPS)


@pytest.fixture(scope="module")
def one_device(llama):
    model, batch, graph = llama
    return _run(model, batch, graph, _lower(graph, "d=1", "single", False)[1])


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("bucket_bytes", [DEFAULT_BUCKET_BYTES, 0])
def test_fsdp_plan_shards_every_weight_gathers_before_use_and_reduce_scatters_its_gradient(
    llama, reshard, bucket_bytes
):
    _, _, graph = llama
    pcg, step = _lower(graph, "fsdp=2", "fsdp", reshard, bucket_bytes)
    weights = graph.weights
    for w in weights:  # stored Shard(0) on fsdp: every dim 0 of this model divides by 2
        assert pcg.tensors[w].sharding.placements(pcg.tensors[w].group) == (Shard(0),), w
    # bucketed (the default): one all-gather and one reduce-scatter per block's weights — model.layers.0,
    # model.layers.1, and the rest (embedding, final norm, head) — as FSDP2 gathers one flat parameter per module
    # and reduce-scatters its flat gradient; without buckets one per weight
    gathers = len({block_of(w) for w in weights}) if bucket_bytes else len(weights)
    assert gathers == (3 if bucket_bytes else 21)
    for rank, prog in step.programs.items():
        comms = [i for i in prog.instrs if isinstance(i, Comm)]
        kinds = Counter(str(c.kind) for c in comms)
        # the gathers in the forward, again before the backward reads the weights (reshard), one reduce-scatter per
        # weight's gradient, and the loss's label count (a 4-byte all-reduce: the batch is split)
        assert kinds == {"all_gather": gathers * (2 if reshard else 1), "reduce_scatter": gathers, "all_reduce": 1}, (
            rank,
            kinds,
        )
        per_weight = {w: graph.tensors[w].type.nbytes for w in weights}
        gather_bytes = sum(c.nbytes for c in comms if str(c.kind) == "all_gather")
        assert gather_bytes == sum(per_weight.values()) // 2 * (2 if reshard else 1), gather_bytes
        scatter_bytes = sum(c.nbytes for c in comms if str(c.kind) == "reduce_scatter")
        assert scatter_bytes == sum(per_weight.values()) // 2, scatter_bytes  # (d-1)/d of every gradient, once


@pytest.mark.parametrize("bucket_bytes", [DEFAULT_BUCKET_BYTES, 0])
def test_hsdp_reduce_scatters_over_fsdp_then_all_reduces_the_piece_over_dp(llama, bucket_bytes):
    """hsdp (dp=2, fsdp=2): a weight's gradient, Partial on dp and fsdp, is reduce-scattered over fsdp first and the
    half it leaves all-reduced over dp (FSDP2's HSDP order): the dp all-reduces move 1/F of every gradient (the whole
    gradient when they ran first). Bucketed, the all-reduce of a block's pieces is one bucket issued right after that
    block's reduce-scatter bucket."""
    _, _, graph = llama
    _, step = _lower(graph, "dp=2,fsdp=2", "hsdp", True, bucket_bytes)
    weights = graph.weights
    total = sum(graph.tensors[w].type.nbytes for w in weights)
    per_weight = len({block_of(w) for w in weights}) if bucket_bytes else len(weights)
    for rank, prog in step.programs.items():
        comms = [i for i in prog.instrs if isinstance(i, Comm)]
        kinds = Counter((str(c.kind), c.axis) for c in comms)
        # the forward's: the loss's label count, a scalar partial on both axes (the batch is split on both), one
        # all-reduce over the flattened dp×fsdp (docs/lowering.md#mesh-flatten)
        assert kinds == {
            ("all_gather", "fsdp"): 2 * per_weight,
            ("reduce_scatter", "fsdp"): per_weight,
            ("all_reduce", "dp"): per_weight,
            ("all_reduce", "dp×fsdp"): 1,
        }, (rank, kinds)
        nbytes = Counter()
        for c in comms:
            if c.task == "BWD":
                nbytes[str(c.kind), c.axis] += c.nbytes
        assert nbytes["reduce_scatter", "fsdp"] == total // 2  # (F−1)/F of every gradient
        assert nbytes["all_reduce", "dp"] == total // 2  # 2(D−1)/D of its 1/F piece (of the whole: total)
        order = [(str(c.kind), c.axis) for c in comms if c.task == "BWD"]
        for k, kind in enumerate(order):  # each reduce-scatter is followed by the all-reduce of what it leaves
            if kind == ("reduce_scatter", "fsdp"):
                assert order[k + 1] == ("all_reduce", "dp"), order


def test_reshard_after_forward_holds_less_of_the_weights_at_the_peak(llama):
    """Without resharding every gathered weight lives from its forward use to the backward; with it, at the peak
    at most two blocks' (the one computing and the one prefetched) besides the pieces each rank stores. (The total
    peak is the benchmark's: on this tiny model the regathers' communication buffers outweigh what they save.)"""
    _, _, graph = llama
    steps = {r: _lower(graph, "fsdp=2", "fsdp", r)[1] for r in (True, False)}
    peaks = {r: program_memory(s.programs[0], s.dg) for r, s in steps.items()}
    stored = sum(graph.tensors[w].type.nbytes for w in graph.weights) // 2  # rank 0's pieces
    gathered = {r: p.by_kind[MemoryKind.PARAMETERS] - stored for r, p in peaks.items()}
    per_block = Counter()
    for w in graph.weights:
        per_block[block_of(w)] += graph.tensors[w].type.nbytes
    assert gathered[False] == sum(per_block.values())  # every weight whole at once
    assert gathered[True] <= 2 * max(per_block.values()) < gathered[False]


@pytest.mark.parametrize(
    "mesh, strategy, reshard",
    [
        ("fsdp=2", "fsdp", True),
        ("fsdp=4", "fsdp", False),
        ("dp=2,fsdp=2", "hsdp", True),
        ("fsdp=2,tp=2", "fsdp,tp", True),
        ("fsdp=2,tp=2", "fsdp,tp", False),
    ],
)
def test_fsdp_equals_one_device(llama, one_device, mesh, strategy, reshard):
    """AdamW, 3 steps: the loss of each step and every replica of every weight piece equal one device's (float64)."""
    model, batch, graph = llama
    losses, ex = _run(model, batch, graph, _lower(graph, mesh, strategy, reshard)[1])
    ref_losses, ref = one_device
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
    assert ex.weight_error(ref.weights()) < TOL


def test_fsdp_with_tp_shards_another_dim_than_tp(llama):
    """Under fsdp,tp a column-parallel weight (tp: Shard(0)) is stored Shard(1) on fsdp, a row-parallel one (tp:
    Shard(1)) Shard(0), a norm's weight Shard(0) and replicated on tp: each device holds a quarter of the linears'."""
    _, _, graph = llama
    pcg, _ = _lower(graph, "fsdp=2,tp=2", "fsdp,tp", True)

    def placed(w):
        t = pcg.tensors[w]
        return t.sharding.placements(t.group)

    layer = "model.layers.0"
    assert placed(f"{layer}.self_attn.q_proj.weight") == (Shard(1), Shard(0))
    assert placed(f"{layer}.mlp.down_proj.weight") == (Shard(0), Shard(1))
    assert placed(f"{layer}.input_layernorm.weight") == (Shard(0), Replicate())


def test_strategy_names():
    assert parse_strategy("hsdp") == ["dp", "fsdp"] and parse_strategy("fsdp,tp") == ["fsdp", "tp"]
    assert default_mesh("fsdp", 4) == Mesh(("fsdp",), (4,))
    with pytest.raises(PlanError, match=r"give the mesh, e.g. --mesh dp=2,fsdp=2"):
        default_mesh("hsdp", 4)


class SelectiveScanLike(torch.nn.Module):
    """The weight layouts of a Mamba mixer, in small: a linear whose output is split into equal halves (stored by
    parts), one whose output is split into unequal parts (Mamba's ``x_proj``: dt | B | C), a depthwise conv1d and a
    parameter read through slices."""

    def __init__(self):
        super().__init__()
        self.in_proj = torch.nn.Linear(8, 32, bias=False)
        self.conv1d = torch.nn.Conv1d(16, 16, 3, groups=16, padding=2)
        self.x_proj = torch.nn.Linear(16, 10)
        self.A = torch.nn.Parameter(torch.randn(16, 4))
        self.out_proj = torch.nn.Linear(16, 8)

    def forward(self, x):  # x [B, T, 8] → a scalar
        h, gate = self.in_proj(x).split([16, 16], dim=-1)  # [B, T, 16] each
        h = self.conv1d(h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)  # causal conv over T
        dt, b, c = self.x_proj(h).split([2, 4, 4], dim=-1)  # [B, T, 2], [B, T, 4], [B, T, 4]
        y = h * (dt.sum(-1, keepdim=True) + b @ self.A[:, :4].T[:, :16] + (c @ self.A.T) * self.A[:, 0])
        return self.out_proj(y * torch.nn.functional.silu(gate)).square().mean()


class OneMixer(torch.nn.Module):
    """:class:`SelectiveScanLike` as a child module (fsdp leaves the root module's own parameters replicated)."""

    def __init__(self):
        super().__init__()
        self.mixer = SelectiveScanLike()

    def forward(self, x):
        return self.mixer(x)


@pytest.fixture(scope="module")
def scan_like():
    from shardflow.capture import capture

    torch.manual_seed(0)
    model = OneMixer().double()
    batch = {"x": torch.randn(4, 6, 8, dtype=torch.float64)}
    return model, batch, capture(model, batch)


def test_fsdp_stores_every_weight_layout_sharded_and_computes_on_the_unchanged_graph(scan_like):
    """A weight whose linear's output is split (equal or unequal parts), a conv1d's and a sliced one: each stored
    Shard(0) of its module's shape on fsdp and gathered by one Combine before its readers, which see the graph as
    captured — fsdp's storage shard is no column-parallel split of a fused linear."""
    _, _, graph = scan_like
    mesh = Mesh.parse("fsdp=2")
    ann = resolve(make_plan(graph, mesh, "fsdp"), graph, mesh)
    assert ann.graph is None  # no linear computed part by part
    pcg = build_pcg(graph, mesh, ann)
    for w in graph.weights:
        t = pcg.tensors[w]
        stored = 1 if w == "mixer.in_proj.weight" else 0  # [32, 8] stored by parts as [2, 16, 8]: dim 0's features
        assert t.sharding.placements(t.group) == (Shard(stored),), w
    gathered = Counter(
        n.inputs[0] for n in pcg.parallel_nodes if n.op.kind == "combine" and n.inputs[0] in graph.weights
    )
    assert gathered == {w: 1 for w in graph.weights}
    assert not pcg.redistributions


@pytest.mark.parametrize("strategy, mesh", [("fsdp", "fsdp=2"), ("hsdp", "dp=2,fsdp=2")])
def test_fsdp_on_every_weight_layout_equals_eager_pytorch(scan_like, strategy, mesh):
    """AdamW, 2 steps: the loss of each step and every replica of every weight piece after them equal
    eager PyTorch's at 1e-9 (float64; partial sums in another order differ by ~1e-15)."""
    import copy

    model, batch, graph = scan_like
    model = copy.deepcopy(model)
    ex = LocalExecutor(_lower(graph, mesh, strategy, True)[1], OptimizerConfig("adamw", 1e-2))
    ex.load(weights_of(model, graph))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(2):
        loss = ex.step(batch)
        opt.zero_grad()
        want = model(**batch)
        want.backward()
        opt.step()
        assert abs(loss - want.item()) < 1e-9
    assert ex.weight_error({k: p.detach() for k, p in model.named_parameters()}) < 1e-9


def test_fsdp_on_hugging_face_mamba_shards_every_weight_and_moves_what_dp_moves():
    """Mamba's mixer (in_proj split in halves after a transpose, x_proj into dt | B | C, a depthwise conv1d, A_log
    and D): every weight stored Shard(d) on fsdp and gathered once, and the rules refuse what they refuse under
    dp (log1p, which has no rule, and the loss's label count) — the fsdp plan of any other model."""
    from transformers import MambaConfig, MambaForCausalLM

    from shardflow.capture import capture, wide_floats

    torch.manual_seed(0)
    model = MambaForCausalLM(
        MambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, state_size=8, use_cache=False)
    ).double()
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    with wide_floats():
        graph = capture(model, {"input_ids": ids, "labels": ids})
    pcg, _ = _lower(graph, "fsdp=2", "fsdp", True)
    dp, _ = _lower(graph, "dp=2", "dp", True)
    for w in graph.weights:
        t = pcg.tensors[w]
        assert t.sharding.placements(t.group)[0] in (Shard(0), Shard(1)), w
    gathered = Counter(
        n.inputs[0] for n in pcg.parallel_nodes if n.op.kind == "combine" and n.inputs[0] in graph.weights
    )
    assert gathered == {w: 1 for w in graph.weights}
    assert [r.node for r in pcg.redistributions] == [r.node for r in dp.redistributions] == ["log1p", "div"]


def test_hsdp_reduce_scatters_travel_while_the_next_block_computes():
    """The built-in GPT of 3 blocks under hsdp (dp=2 × fsdp=2, buckets, reshard): each block's reduce-scatter over
    fsdp is waited for only after the next block's gradients are computed, and the all-reduce over dp of the pieces
    it leaves is issued after that wait and before the next block's reduce-scatter (FSDP2's HSDP, whose
    reduce-scatters run on their own stream; docs/lowering.md#11-gradient-buckets-and-overlap-with-the-backward).
    Before, each all-reduce was issued right after its reduce-scatter, which the rank waited for at once."""
    from shardflow.capture import capture
    from shardflow.lower.program import Compute, Wait
    from shardflow.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=16))
    idx = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(1))
    graph = capture(model, {"idx": idx, "targets": idx})
    _, step = _lower(graph, "dp=2,fsdp=2", "dp,fsdp", True)
    blocks = [f"transformer.h.{i}" for i in (2, 1, 0)]  # the backward's order
    for rank, prog in step.programs.items():
        instrs = list(prog.instrs)

        def scatter(block: str) -> int:
            return next(
                k
                for k, i in enumerate(instrs)
                if isinstance(i, Comm) and str(i.kind) == "reduce_scatter" and f" grad:{block}." in i.note
            )

        def wait(k: int) -> int:
            return next(j for j, i in enumerate(instrs) if isinstance(i, Wait) and i.token == instrs[k].token)

        grads = {
            b: [
                k
                for k, i in enumerate(instrs)
                if isinstance(i, Compute)
                and i.task == "BWD"
                and i.op.startswith("vjp")
                and any(x.value.startswith(f"grad:{b}.") for x in i.outs)
            ]
            for b in blocks
        }
        for block, nxt in zip(blocks, blocks[1:]):
            waited = wait(scatter(block))
            reduce = next(
                k for k in range(waited, len(instrs)) if isinstance(instrs[k], Comm) and instrs[k].axis == "dp"
            )
            assert str(instrs[reduce].kind) == "all_reduce" and not instrs[reduce].wait, (rank, block)
            assert scatter(block) < min(grads[nxt]) and max(grads[nxt]) < waited < reduce < scatter(nxt), (rank, block)


def test_each_block_s_gradients_are_reduce_scattered_as_soon_as_its_backward_is_done():
    """The built-in GPT of 3 blocks at fsdp=2 (buckets, reshard): each block's reduce-scatter bucket is issued right
    after the last gradient it packs is computed — after that block's backward computes, before the next block's —
    so it travels while the earlier blocks' backward computes (FSDP2's post-backward reduce-scatter); the first one
    issued is before the last block's backward compute. Its wait and unpack stay after the backward, before the
    first update of its weights."""
    from shardflow.capture import capture
    from shardflow.lower.program import Compute, Wait
    from shardflow.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=16))
    idx = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(1))
    graph = capture(model, {"idx": idx, "targets": idx})
    _, step = _lower(graph, "fsdp=2", "fsdp", True)
    blocks = [f"transformer.h.{i}" for i in range(3)]
    for rank, prog in step.programs.items():
        instrs = list(prog.instrs)

        def grads_of(block: str) -> list[int]:  # where the backward computes the block's weights' gradients
            return [
                k
                for k, i in enumerate(instrs)
                if isinstance(i, Compute)
                and i.task == "BWD"
                and i.op.startswith("vjp")
                and any(b.value.startswith(f"grad:{block}.") for b in i.outs)
            ]

        scatters = {
            block: k
            for k, i in enumerate(instrs)
            for block in blocks
            if isinstance(i, Comm) and str(i.kind) == "reduce_scatter" and f" grad:{block}." in i.note
        }

        def first_update(block: str) -> int:
            return min(
                k
                for k, i in enumerate(instrs)
                if isinstance(i, Compute) and i.task == "UPD" and any(f":{block}." in b.value for b in i.ins)
            )

        for later, earlier in zip(blocks[::-1], blocks[::-1][1:]):  # the backward's order: h.2, h.1, h.0
            assert max(grads_of(later)) < scatters[later] < min(grads_of(earlier)), (rank, later, scatters)
        assert min(scatters.values()) < max(grads_of(blocks[0])), rank

        def wait_of(block: str) -> int:
            return next(
                j for j, i in enumerate(instrs) if isinstance(i, Wait) and i.token == instrs[scatters[block]].token
            )

        # each travels while the next block's gradients are computed and is waited for before the next is issued
        # (one in flight: docs/lowering.md#11-gradient-buckets-and-overlap-with-the-backward); the last before
        # the first update of its weights
        for later, earlier in zip(blocks[::-1], blocks[::-1][1:]):
            assert max(grads_of(earlier)) < wait_of(later) < scatters[earlier], (rank, later, wait_of(later))
        assert scatters[blocks[0]] < wait_of(blocks[0]) < first_update(blocks[0]), rank
