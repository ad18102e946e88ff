"""Counter-based draws (shardflow.graph.rng): each element's number is a pure function of (seed, step, node, global
index) — the same for a piece as for the whole tensor, different for another step, node or seed — and dropout
built on it drops a fraction p; the sharded forward (simulate) draws what the reference interpreter draws."""

import math

import pytest
import torch

from shardflow.capture import capture
from shardflow.graph.ops import Dropout, OpError
from shardflow.graph.rng import DrawSite, PieceSite, splitmix64
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import build_pcg, lift
from shardflow.parallel.simulate import simulate_outputs
from shardflow.reference import run_forward, weights_of
from shardflow.strategy import make_plan, resolve

U64 = (1 << 64) - 1


def splitmix64_python(state: int) -> int:
    """splitmix64's finaliser on Python integers (exact, unsigned): the arithmetic the torch version must match."""
    z = state & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def test_int64_arithmetic_is_splitmix64():
    """Wrapping multiplications and logical shifts on int64 give splitmix64 bit for bit: its first output from seed
    0 is 0xE220A8397B1DCDAF (the published value), and states with the sign bit set (negative int64) match too."""
    states = [0x9E3779B97F4A7C15, 1, (1 << 63) - 1, 1 << 63, U64, 0xDEADBEEFCAFEF00D, 12345]
    z = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in states], dtype=torch.int64)
    got = [v & U64 for v in splitmix64(z).tolist()]
    assert got == [splitmix64_python(s) for s in states]
    assert got[0] == 0xE220A8397B1DCDAF


def test_uniforms_are_splitmix64_outputs_of_the_global_index():
    """Element i of the full tensor gets the top 53 bits of splitmix64 output i + 1 seeded with the site's key."""
    site = DrawSite.whole(3, 7, "dropout_2", (5, 40))
    key = site.key & U64
    want = [(splitmix64_python(key + (i + 1) * 0x9E3779B97F4A7C15) >> 11) * 2.0**-53 for i in range(200)]
    assert site.uniform((5, 40)).reshape(-1).tolist() == want


def test_a_piece_draws_what_the_whole_tensor_draws_there():
    """Every blocked piece layout (any cut per dim) draws exactly the whole tensor's numbers at its block."""
    shape = (6, 8, 10)
    whole = DrawSite.whole(0, 1, "drop", shape).uniform(shape)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        start = tuple(int(torch.randint(0, s, (), generator=gen)) for s in shape)
        piece = tuple(int(torch.randint(1, s - a + 1, (), generator=gen)) for a, s in zip(start, shape))
        got = DrawSite(0, 1, "drop", shape, start).uniform(piece)
        assert torch.equal(got, whole[tuple(slice(a, a + n) for a, n in zip(start, piece))])


def test_same_key_same_mask_and_any_other_key_another():
    """Pure: the same (seed, step, node) gives the same mask. Step, node and seed each change it: with p = 0.5, two
    independent masks disagree on half the elements (1e5 elements: σ = 0.0016; 0.45-0.55 is > 30 σ wide)."""
    shape, p = (100, 1000), 0.5
    base = DrawSite.whole(0, 1, "dropout", shape)
    mask = base.keep(shape, p)
    assert torch.equal(mask, base.uniform(shape) >= p)  # keep compares on the integers, the same as on uniforms
    assert torch.equal(mask, DrawSite.whole(0, 1, "dropout", shape).keep(shape, p))
    for other in (
        DrawSite.whole(0, 2, "dropout", shape),
        DrawSite.whole(0, 1, "dropout_1", shape),
        DrawSite.whole(1, 1, "dropout", shape),
    ):
        differ = (other.keep(shape, p) != mask).double().mean().item()
        assert 0.45 < differ < 0.55, (other, differ)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_fraction_dropped_is_p(p):
    """On 1e6 elements the dropped fraction is p within 5 binomial standard deviations (sqrt(p(1-p)/n) ≤ 5e-4), and
    the kept elements are scaled by 1/(1-p), so the mean is kept (within 5 σ of the kept count, scaled)."""
    n = 10**6
    x = torch.ones(1000, 1000, dtype=torch.float64)
    (y,) = Dropout(p).compute(x, at=DrawSite.whole(0, 1, "dropout", (1000, 1000)))
    dropped = (y == 0).double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped - p) < 5 * sigma
    assert torch.all((y == 0) | (y == 1 / (1 - p)))
    assert abs(y.mean().item() - 1) < 5 * sigma / (1 - p)


def test_uniforms_lie_in_zero_one_on_a_2_to_minus_53_grid():
    u = DrawSite.whole(9, 3, "x", (4096,)).uniform((4096,))
    assert 0 <= u.min().item() and u.max().item() < 1
    assert torch.equal(u * 2.0**53, torch.floor(u * 2.0**53))
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / 4096)


def test_dropout_needs_its_site_and_p_zero_is_identity():
    x = torch.randn(3, 4)
    assert Dropout(0.0).compute(x)[0] is x
    with pytest.raises(OpError, match=r"dropout\(p=0.1\) draws its mask from \(seed, step, node, element index\)"):
        Dropout(0.1).compute(x)
    with pytest.raises(ValueError, match="does not fit in the full tensor"):
        DrawSite(0, 1, "d", (4, 4), (2, 0)).uniform((3, 4))
    with pytest.raises(ValueError, match="one index per dim"):
        DrawSite(0, 1, "d", (4, 4), (0,))


@pytest.mark.parametrize("mesh, strategy", [("dp=2", "dp"), ("tp=2", "sp"), ("dp=2,tp=2", "dp,tp")])
def test_sharded_forward_draws_what_the_reference_draws(mesh, strategy):
    """simulate() on a sharded PCG, simulate() on one device and the reference interpreter give the same loss and
    activations for a GPT with dropout 0.5, with the same seed and step (float64: equal to rounding, 1e-12)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=4, n_embd=16, dropout=0.5)).double()
    gen = torch.Generator().manual_seed(1)
    inputs = {k: torch.randint(0, 11, (4, 8), generator=gen) for k in ("idx", "targets")}
    graph = capture(model, inputs)
    m = Mesh.parse(mesh)
    pcg = build_pcg(graph, m, resolve(make_plan(graph, m, strategy), graph, m))
    leaves = {**inputs, **weights_of(model, graph)}
    want = run_forward(graph, inputs, weights_of(model, graph), seed=4, step=2)
    other_step = run_forward(graph, inputs, weights_of(model, graph), seed=4, step=3)
    assert abs(want[graph.loss] - other_step[graph.loss]).item() > 1e-3  # another step drops other elements
    for got in (simulate_outputs(pcg, leaves, seed=4, step=2), simulate_outputs(lift(graph), leaves, seed=4, step=2)):
        for name in [n.outputs[0] for n in graph.nodes if n.op.kind == "dropout"] + [graph.loss]:
            torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=0, msg=name)


def test_micro_batches_draw_their_rows_of_the_whole_batch():
    """Under gradient accumulation micro-batch i of N (rows i·B/N … of the whole batch, here as dp pieces) draws
    exactly the whole batch's numbers for those rows, and two micro-batches draw different ones."""
    whole = PieceSite("dropout", (8, 3), (0, 0)).at(7, 2).bits((8, 3))
    for i in range(4):
        for start in (0, 1):  # a micro-batch of 2 rows, split over dp=2: one row per device
            piece = PieceSite("dropout", (2, 3), (start, 0)).at(7, 2, i, 4).bits((1, 3))
            assert torch.equal(piece, whole[2 * i + start : 2 * i + start + 1])
    assert not torch.equal(
        PieceSite("dropout", (2, 3), (0, 0)).at(7, 2, 0, 4).bits((2, 3)),
        PieceSite("dropout", (2, 3), (0, 0)).at(7, 2, 1, 4).bits((2, 3)),
    )
