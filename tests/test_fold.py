"""Folding repeated blocks (docs/search.md#folding-repeated-blocks): a graph cut down to its first K blocks is the
K-layer model's graph, capturing with the block list cut short gives the same, a graph grown to more blocks is the
longer model's, and a plan predicted on two cut-down copies and drawn as a line matches the prediction on the whole
model."""

from __future__ import annotations

import pytest
import torch

from shardflow.capture import capture
from shardflow.graph.blocks import FoldError, grow_blocks, keep_blocks, repeated_blocks
from shardflow.lower import LowerOptions
from shardflow.lower.dynamic import ActivationCheckpointing, Optimizer
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.pipeline import Pipeline
from shardflow.runtime.accumulate import split_batch
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.search import FOLD, cut_blocks
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


def dataflow(g):
    """Each node's op, its inputs' shapes and where each input comes from: the node that made it (by position), a
    constant's values, a weight's or data input's name — the graph up to the names of nodes, activations and
    constants (a capture lifts each block's copy of a mask as its own constant; a grown block reads the last's)."""
    at = {t: i for i, n in enumerate(g.nodes) for t in n.outputs}

    def source(t):
        return at[t] if t in at else tuple(g.constants[t].flatten().tolist()) if t in g.constants else t

    return [(n.op, tuple((g.tensors[t].shape, source(t)) for t in n.inputs)) for n in g.nodes]


def test_grow_blocks_is_the_longer_model():
    """GPT grown from 3 blocks to 7: the same ops, shapes, dataflow, weights, outputs and loss as the 7-block
    model's capture; its own size or fewer is the graph itself."""
    grown, whole = grow_blocks(capture(gpt(3), BATCH), 7), capture(gpt(7), BATCH)
    assert repeated_blocks(grown) == [f"transformer.h.{i}" for i in range(7)]
    assert dataflow(grown) == dataflow(whole) and structure(grown) == structure(whole)
    assert {w: grown.tensors[w].shape for w in grown.weights} == {w: whole.tensors[w].shape for w in whole.weights}
    at = {t: i for i, n in enumerate(grown.nodes) for t in n.outputs}
    at_whole = {t: i for i, n in enumerate(whole.nodes) for t in n.outputs}
    assert [at[t] for t in grown.outputs] == [at_whole[t] for t in whole.outputs] and at[grown.loss] == at_whole[
        whole.loss
    ]
    assert grow_blocks(whole, 7) is whole and grow_blocks(whole, 3) is whole


def test_a_hugging_face_llama_grows_as_it_captures():
    """The Llama of transformers (rotary tables and the mask made outside the blocks, read by each) from 2 blocks
    to 5, against its 5-block capture."""
    pytest.importorskip("transformers")
    import zoo

    def llama(layers):
        model, batch = zoo._causal(
            zoo._hf("LlamaForCausalLM", "LlamaConfig", **{**zoo.SIZES, "num_hidden_layers": layers}), zoo.VOCAB
        )
        return capture(model, batch)

    grown, whole = grow_blocks(llama(2), 5), llama(5)
    assert dataflow(grown) == dataflow(whole) and structure(grown) == structure(whole)


def test_a_pipeline_predicted_on_a_grown_graph_is_predicted_as_on_its_capture():
    """pp = 2 × fsdp = 2, 1F1B over 4 microbatches of the 8-block GPT grown from 3: the same step time and per-rank
    peaks as on the 8-block capture (the programs differ only in names)."""
    m = Mesh.parse("pp=2,fsdp=2")
    options = LowerOptions(cost=cost_model(SPEC, m), microbatches=4)
    part = split_batch(BATCH, 4)[0]

    def predict(g):
        return Pipeline.planned(g, m, options, OptimizerConfig(Optimizer.ADAMW), "pp,fsdp").predict(SPEC, 128)

    grown, whole = predict(grow_blocks(capture(gpt(3), part), 8)), predict(capture(gpt(8), part))
    assert grown.step_seconds == pytest.approx(whole.step_seconds, rel=1e-12)
    assert grown.peak_bytes == whole.peak_bytes


def test_blocks_that_differ_or_a_single_block_do_not_grow():
    g = capture(gpt(3), BATCH)
    with pytest.raises(FoldError, match="at least 2 are needed"):
        grow_blocks(keep_blocks(g, 1), 4)
    inner = next(n for n in g.nodes if n.scope.startswith("transformer.h.0")).outputs[0]
    tapped = type(g)(g.tensors, g.nodes, (*g.outputs, inner), g.loss, g.constants, g.module_shapes, g.buffer_updates)
    grown = grow_blocks(tapped, 5)  # a graph output of the first block stays the first block's
    assert inner in grown.outputs
    last = next(n for n in reversed(g.nodes) if n.scope.startswith("transformer.h.2"))
    reread = next(n for n in g.nodes if n.scope.startswith("transformer.h.0")).outputs[0]
    bad = [n if n is not last else type(n)(n.name, n.op, (reread, *n.inputs[1:]), n.outputs, n.scope) for n in g.nodes]
    with pytest.raises(FoldError, match="not the one before"):
        grow_blocks(type(g)(g.tensors, tuple(bad), g.outputs, g.loss, g.constants, g.module_shapes), 5)


@pytest.mark.parametrize(
    "mesh,strategy,microbatches",
    [("dp=4", "dp", 1), ("fsdp=4", "fsdp", 1), ("tp=4", "sp", 1), ("pp=2,fsdp=2", "pp,fsdp", 4)],
)
def test_a_line_through_two_cut_copies_predicts_the_whole_model(mesh, strategy, microbatches):
    """Through the copies of FOLD - 1 and FOLD blocks (per chunk): step time within 0.5 %, each rank's peak within
    1 %, of the 8-block model's own prediction."""
    m = Mesh.parse(mesh)
    options = LowerOptions(cost=cost_model(SPEC, m), microbatches=microbatches)
    whole = capture(gpt(8), split_batch(BATCH, microbatches)[0])
    chunks = 2 if "pp" in mesh else 1

    def predict(g):
        return Pipeline.planned(g, m, options, OptimizerConfig(Optimizer.ADAMW), strategy).predict(SPEC, 128)

    full = predict(whole)
    few, more = (FOLD - 1) * chunks, FOLD * chunks
    line = extrapolate(predict(keep_blocks(whole, few)), predict(keep_blocks(whole, more)), few, more, 8)
    assert line.step_seconds == pytest.approx(full.step_seconds, rel=5e-3)
    assert line.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-2)
    assert line.model_flops == pytest.approx(full.model_flops, rel=1e-6)


def test_the_copies_folded_through_have_a_middle_block():
    """fsdp=4 with every block checkpointed, a GPT wide against its activations: the backward's peak comes in a
    middle block's backward (the next block's weights gathered, the last block's gradient bucket in flight), which a
    copy of 2 blocks lacks. The line through 2 and 3 blocks overstates the 8-block peak by 49 %; through FOLD - 1
    and FOLD (3 and 4) it is exact."""
    m = Mesh.parse("fsdp=4")
    options = LowerOptions(cost=cost_model(SPEC, m), ac=ActivationCheckpointing.BLOCK)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=8, vocab_size=64, block_size=16, n_head=4, n_embd=256))
    whole = capture(model, {"idx": torch.randint(0, 64, (4, 16)), "targets": torch.randint(0, 64, (4, 16))})

    def predict(k):
        g = whole if k == 8 else keep_blocks(whole, k)
        return Pipeline.planned(g, m, options, OptimizerConfig(Optimizer.ADAMW), "fsdp").predict(SPEC, 64)

    p = {k: predict(k) for k in (2, 3, 4, 8)}
    assert FOLD == 4
    assert max(extrapolate(p[3], p[4], 3, 4, 8).peak_bytes) == max(p[8].peak_bytes)
    assert max(extrapolate(p[2], p[3], 2, 3, 8).peak_bytes) > 1.4 * max(p[8].peak_bytes)
