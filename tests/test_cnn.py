"""Conv nets nobody wrote for shardflow, captured with torch.export: a ResNet written as torchvision writes its
blocks (batch norm), and a small conv-relu-maxpool-fc net.

Batch-norm statistics over a data-parallel batch are reductions: capture lifts them to mean/sub/mul/sum ops whose
rules make the statistics partial sums over ``dp``, and planning all-reduces them (the mean, and the variance
before its ``rsqrt``) — synchronized batch norm, with nothing written for it. So dp=2 gives the single-device
numbers, which per-rank (DDP-style) batch norm does not, and the running statistics a step leaves are one
device's too. Tolerance: float64, 1e-9 (sums in another order agree to ~1e-15; a per-rank statistic is off by
O(1e-2)).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_local_executor import check_against_eager
from torch import nn
from torch.nn import functional as F

import shardflow
from shardflow.capture import CaptureError, capture
from shardflow.graph import ComputationGraph
from shardflow.graph import ops as O
from shardflow.lower import lower_step
from shardflow.lower.dynamic import TaskType
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import build_pcg
from shardflow.reference import run_backward, weights_of
from shardflow.strategy import make_plan, resolve


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's ResNet block: conv3x3-bn-relu-conv3x3-bn, plus the shortcut (identity, or conv1x1-bn where
    the stride or the width changes), then relu."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv3x3(c_in, c_out, stride)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(c_out, c_out)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet layout at toy size: stem (conv7x7 stride 2, bn, relu, maxpool 3/2), one stage per
    width (the first block of a later stage strides 2), global average pool, fc; ``forward(x [N, 3, H, W], y [N])``
    returns the mean cross-entropy."""

    def __init__(self, widths=(8, 16), blocks=2, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, c = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(
                nn.Sequential(*(BasicBlock(c if k == 0 else w, w, 2 if i and k == 0 else 1) for k in range(blocks)))
            )
            c = w
        self.layers = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x, y):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = torch.flatten(self.avgpool(self.layers(x)), 1)
        return F.cross_entropy(self.fc(x), y)


class SmallCNN(nn.Module):
    """conv-relu-maxpool twice, fc: ``forward(x [N, 3, 8, 8], y [N])`` → mean cross-entropy."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, num_classes)

    def forward(self, x, y):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.cross_entropy(self.fc(x.flatten(1)), y)


def resnet() -> ResNet:
    torch.manual_seed(0)
    return ResNet().double()


def images(n=8, size=16, seed=1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, 3, size, size, generator=gen, dtype=torch.float64),
        "y": torch.randint(0, 10, (n,), generator=gen),
    }


def dp2(graph: ComputationGraph):
    mesh = Mesh.parse("dp=2")
    return build_pcg(graph, mesh, resolve(make_plan(graph, mesh, "dp"), graph, mesh))


BN_SCOPES = (
    ["bn1"] + [f"layers.{s}.{b}.bn{k}" for s in (0, 1) for b in (0, 1) for k in (1, 2)] + ["layers.1.0.downsample.1"]
)


def test_resnet_lifts_every_op_to_a_rule():
    """Batch norm, max pool, the global average pool (a mean) and the loss: no op falls back to the generic Aten op,
    and no batch-norm node is left whole (it is mean/sub/mul/sum/rsqrt ops in its module)."""
    graph = capture(resnet(), images())
    assert [n.op.describe() for n in graph.nodes if isinstance(n.op, O.Aten)] == []
    assert sorted(
        {n.scope for n in graph.nodes if n.scope.split(".")[-1].startswith("bn") or n.scope.endswith("downsample.1")}
    ) == sorted(BN_SCOPES)
    assert [n.op for n in graph.nodes if isinstance(n.op, O.Pool)] == [O.Pool("max", (3, 3), (2, 2), (1, 1))]
    means = [n.op for n in graph.nodes if n.scope == "bn1" and isinstance(n.op, O.Reduce)]
    assert means == [O.Reduce("mean", (0, 2, 3), True), O.Reduce("sum", (0, 2, 3), True)]


def test_resnet_dp_equals_one_device():
    """dp=2, float64: loss and every gradient at each of 2 SGD steps (momentum 0.9) and every replica of every
    weight after them equal the eager module on the whole batch (1e-9)."""
    check_against_eager(resnet(), images(), "dp=2", "dp", atol=1e-9, steps=2)


def test_running_statistics_equal_one_device_under_dp():
    """Training also updates batch norm's running statistics: the step's batch mean and unbiased variance per
    channel are graph outputs (partial sums over dp, summed when read), blended into the buffers as nn.BatchNorm2d
    does, and the batch counter advances. After 2 steps on dp=2 and dp=4 every running mean, variance and counter
    equals eager PyTorch's on one device (float64, 1e-12; before any update they differ by O(0.1)), so the trained
    module normalises in eval mode as the eager one does. (DDP keeps each rank's own statistics instead.)"""
    for mesh in ("dp=2", "dp=4"):
        model, b = resnet(), images()
        fresh = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = shardflow.parallelize(model, b, mesh=mesh, lr=0.1)
        updated = trainer.graph.buffer_updates
        assert set(updated) == {
            f"{s}.{k}" for s in BN_SCOPES for k in ("running_mean", "running_var", "num_batches_tracked")
        }
        assert all(u.stat in trainer.graph.outputs for u in updated.values() if u.stat is not None)
        rows = list(trainer.compare_with_eager(model, b, 2))  # trains the eager model alongside
        assert max(max(r.dloss, r.grad, r.weight, r.buffer) for r in rows) <= 1e-12, rows
        state = trainer.state_dict()
        assert all(int(state[f"{s}.num_batches_tracked"]) == 2 for s in BN_SCOPES)
        assert min((state[k] - fresh[k]).abs().max().item() for k in updated if "running" in k) > 1e-3
        plain = resnet()
        plain.load_state_dict(state)
        with torch.no_grad():
            assert torch.allclose(plain.eval()(**b), model.eval()(**b), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "options",
    [dict(mesh="dp=2", accumulate=2), dict(mesh="pp=2", microbatches=2)],
    ids=["dp-accumulate", "pp-microbatches"],
)
def test_running_statistics_follow_each_micro_batch(options):
    """accumulate=2 on dp=2, and 2 microbatches through a 2-stage pipeline (the statistics held by the stage that
    computes them): each micro-batch is normalised by its own statistics, which are blended into the running ones in
    order, as an eager loop over the two halves does (two forwards, one SGD step); the counter advances twice per
    step. Every parameter and buffer equals eager's (float64, 1e-12)."""
    model, b = resnet(), images()
    eager = resnet()
    trainer = shardflow.parallelize(model, b, lr=0.1, **options)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        trainer.step(b)
        opt.zero_grad()
        for half in range(2):
            (eager(**{k: v[half * 4 : (half + 1) * 4] for k, v in b.items()}) / 2).backward()
        opt.step()
    state, want = trainer.state_dict(), eager.state_dict()
    assert all(int(state[f"{s}.num_batches_tracked"]) == 4 for s in BN_SCOPES)
    assert max((state[k] - want[k]).abs().max().item() for k in want) <= 1e-12


def resnet_and_images():
    """A factory for ``shardflow check --model``."""
    return resnet(), images()


def test_check_on_two_processes_compares_the_running_statistics(capsys):
    """``shardflow check`` on 2 gloo processes (each rank reads the statistics' sum over both): the running statistics
    are compared with eager PyTorch's too, and equal them."""
    from shardflow.cli import main

    assert (
        main(["check", "--model", f"{__file__}:resnet_and_images", "--mesh", "dp=2", "--nproc", "2", "--steps", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "step 2:" in out and "|Δbuffer|" in out.splitlines()[-1] and out.rstrip().endswith(": OK")


def test_a_forward_that_changes_another_buffer_is_refused():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.register_buffer("seen", torch.zeros(3))

        def forward(self, x):
            self.seen.copy_(x.sum(0))
            return (x * self.w).sum()

    with pytest.raises(CaptureError, match=r"changes its buffer 'seen' .*keep the buffer constant in the forward"):
        capture(Counts(), {"x": torch.randn(2, 3)})


def test_batch_norm_statistics_are_all_reduced():
    """The PCG of dp=2: in each of the 10 batch norms the batch mean (a Reduce over N, H, W of a batch-sharded
    tensor) is a partial sum, all-reduced before it is subtracted; the variance (a partial sum of squares, plus
    eps) is reduce-scattered over the channels, its rsqrt computed on each device's half of them, and all-gathered
    before the normalisation: the planner's cheapest choice, a reduce-scatter being half an all-reduce's bytes.
    Rank 0's forward: one all-reduce per batch norm plus the label count of the loss, one reduce-scatter and one
    all-gather per batch norm — and nothing else (the convolutions need no communication under dp)."""
    graph = capture(resnet(), images())
    pcg = dp2(graph)
    producer = {o: n for n in pcg.nodes for o in n.outputs}
    per_bn: dict[str, list] = {}
    for r in pcg.redistributions:
        if r.scope in BN_SCOPES:
            per_bn.setdefault(r.scope, []).append((r.op, type(producer[r.tensor].op), [op.kind for op in r.ops]))
    assert sorted(per_bn) == sorted(BN_SCOPES)
    for scope, moves in per_bn.items():
        assert moves == [
            (O.Binary("sub"), O.Reduce, ["reduction"]),  # x - mean: the mean all-reduced
            (O.Unary("rsqrt"), O.Scalar, ["reduction", "repartition"]),  # rsqrt(var + eps)
            (O.Binary("mul"), O.Unary, ["combine"]),
        ], scope  # (x - mean) * rstd
    step = lower_step(pcg)
    fwd = Counter(c.kind for c in step.programs[0].comms if c.task == TaskType.FWD)
    assert fwd == {"all_reduce": 10 + 1, "reduce_scatter": 10, "all_gather": 10}


def test_per_rank_batch_norm_would_differ():
    """DDP's batch norm normalises each rank's half batch by that half's statistics: the mean of the two half-batch
    losses differs from the whole batch's by ~1e-2 and a gradient by ~0.3, so dp=2 matching one device to 1e-9 is
    no accident of the data."""
    model, b = resnet(), images()
    whole = model(**b)
    grads = torch.autograd.grad(whole, list(model.parameters()))
    halves = [model(**{k: v[i * 4 : (i + 1) * 4] for k, v in b.items()}) for i in (0, 1)]
    ddp = (halves[0] + halves[1]) / 2
    ddp_grads = torch.autograd.grad(ddp, list(model.parameters()))
    assert abs(ddp.item() - whole.item()) > 1e-3  # measured 8.8e-3
    assert max((g - h).abs().max().item() for g, h in zip(grads, ddp_grads)) > 1e-1  # measured 0.34


def test_eval_mode_normalises_by_the_running_statistics():
    """Captured in eval mode, batch norm is an affine map by the running statistics (folded constants): no
    reduction over the batch, so dp=2 needs no communication in the forward but the loss's label count."""
    model, b = resnet(), images()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.normal_(generator=torch.Generator().manual_seed(2))
                m.running_var.uniform_(0.5, 2.0)
    model.eval()
    graph = capture(model, b)
    w = weights_of(model, graph)
    env, grads = run_backward(graph, b, w)
    loss = model(**b)
    loss.backward()
    assert abs(env[graph.loss].item() - loss.item()) <= 1e-12
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-12, rtol=0)
    assert not any(isinstance(n.op, O.Reduce) and n.scope in BN_SCOPES for n in graph.nodes)
    assert len(dp2(graph).redistributions) == 1  # the label count of the mean cross-entropy


def test_small_cnn_dp_equals_one_device():
    """conv-relu-maxpool twice, fc: dp=2 equals one device (float64, 1e-9, 2 SGD steps)."""
    torch.manual_seed(0)
    check_against_eager(SmallCNN().double(), images(size=8), "dp=2", "dp", atol=1e-9, steps=2)


def test_pooling_variants_lift_with_eager_numbers():
    """max pool (padding, dilation, ceil mode) and average pool (padding without counting it, a divisor override),
    2-d and 1-d, lift to Pool ops with the eager loss and gradient (float64, 1e-12)."""

    class Pools(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64).view(3, 1, 1))

        def forward(self, x):
            x = x * self.scale
            a = F.max_pool2d(x, 3, 2, 1, dilation=2, ceil_mode=True)
            b = F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)
            c = F.avg_pool2d(x, 2, divisor_override=3)
            d = F.avg_pool1d(x.flatten(2), 4)
            return (a * a).sum() + (b * b).sum() + (c * c).sum() + (d * d).sum()

    model, x = Pools(), torch.randn(2, 3, 9, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    graph = capture(model, {"x": x})
    assert sorted(n.op.fn for n in graph.nodes if isinstance(n.op, O.Pool)) == ["avg", "avg", "avg", "max"]
    assert not any(isinstance(n.op, O.Aten) for n in graph.nodes)
    env, grads = run_backward(graph, {"x": x}, weights_of(model, graph))
    loss = model(x)
    loss.backward()
    assert abs(env[graph.loss].item() - loss.item()) <= 1e-12
    torch.testing.assert_close(grads["scale"], model.scale.grad, atol=1e-12, rtol=0)
