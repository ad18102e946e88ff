"""Folding repeated blocks (docs/search.md#folding-repeated-blocks): a graph cut down to its first K blocks is the
K-layer model's graph, capturing with the block list cut short gives the same, and a plan predicted on two
cut-down copies and drawn as a line matches the prediction on the whole model."""

from __future__ import annotations

import pytest
import torch

from shardflow.capture import capture
from shardflow.graph.blocks import FoldError, keep_blocks, repeated_blocks
from shardflow.lower import LowerOptions
from shardflow.lower.dynamic import Optimizer
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.pipeline import Pipeline
from shardflow.runtime.accumulate import split_batch
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.search import cut_blocks
from shardflow.simulator.estimate import cost_model, extrapolate
from shardflow.simulator.machine import MachineSpec

SPEC = MachineSpec.named("h100")
CONFIG = dict(vocab_size=64, block_size=16, n_head=4, n_embd=32)


def gpt(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, **CONFIG))


BATCH = {"idx": torch.randint(0, 64, (8, 16)), "targets": torch.randint(0, 64, (8, 16))}


def structure(g):
    return [(n.op.kind, tuple(g.tensors[t].shape for t in n.inputs)) for n in g.nodes], sorted(g.weights)


def test_keep_blocks_is_the_shorter_model():
    whole = capture(gpt(5), BATCH)
    assert len(repeated_blocks(whole)) == 5
    cut = keep_blocks(whole, 2)
    assert repeated_blocks(cut) == ["transformer.h.0", "transformer.h.1"]
    assert structure(cut) == structure(capture(gpt(2), BATCH))
    assert cut.loss in cut.outputs and keep_blocks(whole, 5) is whole
    with pytest.raises(FoldError, match="at least one"):
        keep_blocks(whole, 0)


def test_cut_blocks_captures_the_shorter_model_and_restores():
    model = gpt(5)
    with cut_blocks(model, 3):
        g = capture(model, BATCH)
    assert len(model.transformer.h) == 5
    assert structure(g) == structure(keep_blocks(capture(model, BATCH), 3))


def test_a_middle_block_read_after_the_blocks_is_not_foldable():
    g = capture(gpt(4), BATCH)
    inner = next(n for n in g.nodes if n.scope.startswith("transformer.h.1")).outputs[0]
    tapped = type(g)(g.tensors, g.nodes, (*g.outputs, inner), g.loss, g.constants, g.module_shapes, g.buffer_updates)
    with pytest.raises(FoldError, match="graph output"):
        keep_blocks(tapped, 1)


@pytest.mark.parametrize(
    "mesh,strategy,microbatches",
    [("dp=4", "dp", 1), ("fsdp=4", "fsdp", 1), ("tp=4", "sp", 1), ("pp=2,fsdp=2", "pp,fsdp", 4)],
)
def test_a_line_through_two_cut_copies_predicts_the_whole_model(mesh, strategy, microbatches):
    """Step time within 0.5 %, each rank's peak within 1 %, of the 8-block model's own prediction."""
    m = Mesh.parse(mesh)
    options = LowerOptions(cost=cost_model(SPEC, m), microbatches=microbatches)
    whole = capture(gpt(8), split_batch(BATCH, microbatches)[0])
    chunks = 2 if "pp" in mesh else 1

    def predict(g):
        return Pipeline.planned(g, m, options, OptimizerConfig(Optimizer.ADAMW), strategy).predict(SPEC, 128)

    full = predict(whole)
    line = extrapolate(
        predict(keep_blocks(whole, 2 * chunks)), predict(keep_blocks(whole, 3 * chunks)), 2 * chunks, 3 * chunks, 8
    )
    assert line.step_seconds == pytest.approx(full.step_seconds, rel=5e-3)
    assert line.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-2)
    assert line.model_flops == pytest.approx(full.model_flops, rel=1e-6)
