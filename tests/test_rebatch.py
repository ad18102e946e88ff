"""A captured graph at another batch size drawn from two captures (shardflow.graph.rebatch,
docs/search.md#capturing-once-per-depth): equal to capturing at that size for the models the search sees, refused
where the graph changes otherwise with the batch, and the search capturing each depth at two sizes only."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_llama
from torch import nn

import shardflow.search as searching
from shardflow.capture import capture
from shardflow.graph.blocks import repeated_blocks
from shardflow.graph.rebatch import RebatchError, rebatch
from shardflow.lower import LowerOptions
from shardflow.lower.dynamic import Optimizer
from shardflow.models import GPT, GPTConfig
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.simulator.machine import MachineSpec


def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    return model, lambda b: {"idx": torch.randint(0, 64, (b, 16)), "targets": torch.randint(0, 64, (b, 16))}


def _llama():
    model, batch = tiny_hf_llama()
    return model, lambda b: {k: v[:1].expand(b, -1).contiguous() for k, v in batch.items()}


@pytest.mark.parametrize("family", [_gpt, _llama], ids=["gpt", "hf-llama"])
def test_a_graph_drawn_at_another_batch_size_equals_its_capture(family):
    model, batch = family()
    two, three = capture(model, batch(2)), capture(model, batch(3))
    for size in (1, 4, 8):
        assert rebatch(two, 2, three, 3, size) == capture(model, batch(size)), size


class _Branchy(nn.Module):
    """A model whose forward takes another path from 3 sequences on: not a line in the batch size."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return (y * 2 if x.shape[0] > 2 else y).sum()


class _Scaled(nn.Module):
    """A model with a float that depends on the batch size (a mean written as a multiplication)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).sum() * (1.0 / x.shape[0])


@pytest.mark.parametrize(
    ("module", "where"),
    [(_Branchy, "entries at batch size 2"), (_Scaled, "at batch size 2 but")],
    ids=["branch", "float"],
)
def test_a_graph_that_changes_otherwise_with_the_batch_is_refused(module, where):
    model = module()
    two, three = (capture(model, {"x": torch.randn(b, 4)}) for b in (2, 3))
    with pytest.raises(RebatchError, match=where):
        rebatch(two, 2, three, 3, 6)


class _Triangular(nn.Module):
    """A model with a size quadratic in the batch size, b·(b + 1)/2: not a line in it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        b = x.shape[0]
        return self.lin(x).reshape(-1)[: b * (b + 1) // 2].sum()


def test_a_line_that_lands_between_whole_sizes_is_refused():
    model = _Triangular()
    two, four = (capture(model, {"x": torch.randn(b, 4)}) for b in (2, 4))  # 3 and 10 elements: 3.5 more per sequence
    with pytest.raises(RebatchError, match="give no whole size at 3"):
        rebatch(two, 2, four, 4, 3)


def test_the_search_captures_each_depth_at_two_batch_sizes_only(monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=searching.FOLD + 1, n_head=4, n_embd=32))
    batch = {"idx": torch.randint(0, 64, (64, 16)), "targets": torch.randint(0, 64, (64, 16))}
    captured: list[tuple[int, int]] = []  # (blocks, sequences) of each capture
    drawn: list[int] = []
    real_capture, real_rebatch = searching.capture, searching.rebatch

    def counted(m, inputs):
        g = real_capture(m, inputs)
        captured.append((len(repeated_blocks(g)), next(iter(inputs.values())).shape[0]))
        return g

    def draw(*args):
        drawn.append(args[-1])
        return real_rebatch(*args)

    monkeypatch.setattr(searching, "capture", counted)
    monkeypatch.setattr(searching, "rebatch", draw)
    result = searching.search_model(  # every candidate predicted, pipelines among them (no screening)
        model, batch, 4, LowerOptions(), OptimizerConfig(Optimizer.ADAMW), MachineSpec.named("h100"), screen=False
    )
    # the folded copy (FOLD blocks) at two sizes; the other sizes are drawn, the pipelines' FOLD + 1 blocks grown
    # from it
    fold = searching.FOLD
    assert [b for b, _ in captured] == [fold, fold] and len({n for _, n in captured}) == 2, captured
    assert drawn and not set(drawn) & {n for _, n in captured}, (drawn, captured)
    assert any(o.candidate.microbatches > 1 and o.prediction for o in result.outcomes)  # pipelines were predicted
    result.pipeline  # the plan the search returns: on the whole model's capture
    assert [b for b, _ in captured] == [fold, fold, fold + 1], captured


def test_blocks_that_differ_are_cut_from_the_whole_model_not_grown(monkeypatch):
    """The last block's MLP twice as wide: the pipelines' copies are cut from the whole model's capture (FOLD + 1
    blocks), not grown from the folded one's FOLD alike blocks, which would copy the narrow MLP."""
    torch.manual_seed(0)
    fold = searching.FOLD
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=fold + 1, n_head=4, n_embd=32))
    model.transformer.h[fold].mlp.c_fc = torch.nn.Linear(32, 256)
    model.transformer.h[fold].mlp.c_proj = torch.nn.Linear(256, 32)
    batch = {"idx": torch.randint(0, 64, (64, 16)), "targets": torch.randint(0, 64, (64, 16))}
    captured: list[int] = []
    real_capture = searching.capture
    monkeypatch.setattr(searching, "capture", lambda m, i: captured.append(len(m.transformer.h)) or real_capture(m, i))
    searching.search_model(
        model,
        batch,
        4,
        LowerOptions(),
        OptimizerConfig(Optimizer.ADAMW),
        MachineSpec.named("h100"),
        placements=False,
        screen=False,  # every candidate predicted, pipelines among them
    )
    assert sorted(set(captured)) == [fold, fold + 1], captured
