"""Activation checkpointing (``--ac block``, ``--ac selective``): the exact plan — each block's forward run again right before its
backward, the backward reading only recomputed activations of its block — fewer activation bytes at the peak, and
the numbers of the plan without it (float64, every replica), dropout masks included; and of the first K blocks only
(``--ac-blocks K``): the others' nodes run once, the peak between none and every block, the same numbers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from conftest import tiny_hf_llama_float64  # noqa: E402

from shardflow.api import parallelize  # noqa: E402
from shardflow.capture import capture  # noqa: E402
from shardflow.lower import LowerOptions, lower_step  # noqa: E402
from shardflow.lower.cost import CommForm  # noqa: E402
from shardflow.lower.dynamic import (
    ActivationCheckpointing,
    NodeKind,
    PassError,
    TaskType,
    UpdateRule,  # noqa: E402
    ValueRole,
    block_of,
)
from shardflow.lower.memory import program_memory  # noqa: E402
from shardflow.lower.pass_expansion import KEPT_UNDER_SELECTIVE, checkpoint_blocks, pass_expansion  # noqa: E402
from shardflow.lower.program import Comm  # noqa: E402
from shardflow.models.gpt import GPT, GPTConfig  # noqa: E402
from shardflow.parallel.mesh import Mesh  # noqa: E402
from shardflow.parallel.pcg import build_pcg  # noqa: E402
from shardflow.reference import weights_of  # noqa: E402
from shardflow.runtime.kernels import OptimizerConfig  # noqa: E402
from shardflow.runtime.local import LocalExecutor  # noqa: E402
from shardflow.strategy import resolve  # noqa: E402
from shardflow.strategy.presets import make_plan  # noqa: E402

STEPS = 3
TOL = 1e-12  # float64: partial sums in another order than one device (seen ~1e-14)
LAYERS = 2  # of conftest's tiny Llama


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_llama_float64()


def _pcg(graph, mesh_text: str, strategy: str):
    mesh = Mesh.parse(mesh_text)
    return build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy), graph, mesh))


def _lower(graph, mesh_text: str, strategy: str, ac: str, reshard: bool = True, ac_blocks: int | None = None):
    options = LowerOptions(
        CommForm.COLLECTIVE, CommForm.COLLECTIVE, reshard_after_forward=reshard, ac=ac, ac_blocks=ac_blocks
    )
    return lower_step(_pcg(graph, mesh_text, strategy), UpdateRule.ADAMW, options=options)


def _run(model, batch, graph, step):
    ex = LocalExecutor(step, OptimizerConfig("adamw", 1e-2), seed=0)
    ex.load(weights_of(model, graph))
    return [ex.step(batch) for _ in range(STEPS)], ex


def test_block_of_is_the_module_under_the_first_integer_index():
    assert block_of("model.layers.3.mlp.up_proj") == "model.layers.3"
    assert block_of("transformer.h.0") == "transformer.h.0"
    assert block_of("encoder.layer.1.attention.self.layers.2") == "encoder.layer.1"
    assert block_of("model.embed_tokens") == block_of("") == ""


def test_each_block_is_recomputed_once_right_before_its_backward_and_its_backward_reads_only_recomputed_activations(
    llama,
):
    _, _, graph = llama
    pcg = _pcg(graph, "d=1", "single")
    blocks = checkpoint_blocks(pcg)
    assert set(blocks.values()) == {f"model.layers.{i}" for i in range(LAYERS)}
    assert not any(n.scope.startswith("model.layers.") for n in pcg.nodes if n.name not in blocks)
    dg = pass_expansion(pcg, UpdateRule.ADAMW, ac=ActivationCheckpointing.BLOCK)
    plain = pass_expansion(pcg, UpdateRule.ADAMW)
    again = [n for n in dg.nodes if n.recompute]
    # every node of a block once more, in forward order, block by block from the last
    assert [n.src for n in again] == [
        m for b in reversed(sorted(set(blocks.values()))) for m in (n.name for n in pcg.nodes) if blocks.get(m) == b
    ]
    assert all(n.task == TaskType.FWD and n.kind == NodeKind.COMPUTE for n in again)
    assert len(dg.nodes) == len(plain.nodes) + len(again)
    position = {n.name: k for k, n in enumerate(dg.nodes)}
    made_by = {v: n for n in dg.nodes for v in n.outputs}
    first_bwd = {}
    for n in dg.nodes:
        if n.task == TaskType.BWD and n.kind == NodeKind.COMPUTE and n.src in blocks:
            first_bwd.setdefault(blocks[n.src], position[n.name])
            for v in n.inputs:  # an activation of its own block: the recomputed one
                maker = made_by.get(v)
                if maker is not None and dg.values[v].role == ValueRole.FWD and blocks.get(maker.src) == blocks[n.src]:
                    assert maker.recompute, (n.name, v)
    for b, k in first_bwd.items():  # the block's recomputation runs after every other block's forward, before its
        own = [position[n.name] for n in again if blocks[n.src] == b]  # backward, with nothing else in between
        assert max(position[n.name] for n in dg.nodes if n.task == TaskType.FWD and not n.recompute) < min(own)
        assert own == list(range(min(own), max(own) + 1)) and max(own) < k


def test_recomputation_holds_fewer_activation_bytes_and_repeats_the_blocks_forward_communication(llama):
    _, _, graph = llama
    for mesh, strategy in (("d=1", "single"), ("fsdp=2", "fsdp")):
        steps = {ac: _lower(graph, mesh, strategy, ac) for ac in ActivationCheckpointing}
        held = {ac: program_memory(s.programs[0], s.dg) for ac, s in steps.items()}
        assert held["block"].peak < held["none"].peak, mesh
    # tp: the row-parallel linears' all-reduce (two per block) runs again in each block's recomputation; fsdp: each
    # weight of a block is gathered once more (the recomputation's and its backward's read the same regather)
    for mesh, strategy, extra in (("tp=2", "tp", {"all_reduce": 2 * LAYERS}), ("fsdp=2", "fsdp", {})):
        counts = {
            ac: Counter(
                str(i.kind) for i in _lower(graph, mesh, strategy, ac).programs[0].instrs if isinstance(i, Comm)
            )
            for ac in ActivationCheckpointing
        }
        assert counts["block"] - counts["none"] == Counter(extra), (mesh, counts)


def test_the_first_blocks_only_are_recomputed_and_the_others_keep_their_activations(llama):
    """``ac_blocks=K``: the recompute nodes are those of ``model.layers.0`` … ``model.layers.{K-1}`` (the blocks'
    forward order), exactly the nodes ``ac_blocks=None`` recomputes in those blocks; the other blocks' backward reads
    the forward's own activations, as under ``ac="none"``; K = the number of blocks is every block."""
    _, _, graph = llama
    pcg = _pcg(graph, "tp=2", "tp")
    blocks = checkpoint_blocks(pcg)
    every = [
        n.src for n in pass_expansion(pcg, UpdateRule.ADAMW, ac=ActivationCheckpointing.BLOCK).nodes if n.recompute
    ]
    assert {blocks[m] for m in every} == {f"model.layers.{i}" for i in range(LAYERS)}
    for k in range(1, LAYERS + 1):
        dg = pass_expansion(pcg, UpdateRule.ADAMW, ac=ActivationCheckpointing.BLOCK, ac_blocks=k)
        again = [n.src for n in dg.nodes if n.recompute]
        assert {blocks[m] for m in again} == {f"model.layers.{i}" for i in range(k)}, k
        assert again == [m for m in every if blocks[m] in {f"model.layers.{i}" for i in range(k)}], k
        assert set(checkpoint_blocks(pcg, k)) == set(again), k
    dg = pass_expansion(pcg, UpdateRule.ADAMW, ac=ActivationCheckpointing.BLOCK, ac_blocks=1)
    made_by = {v: n for n in dg.nodes for v in n.outputs}
    kept = [  # block 1's backward reads activations its forward made
        v
        for n in dg.nodes
        if n.task == TaskType.BWD and blocks.get(n.src) == "model.layers.1"
        for v in n.inputs
        if v in made_by and dg.values[v].role == ValueRole.FWD and blocks.get(made_by[v].src) == "model.layers.1"
    ]
    assert kept and not any(made_by[v].recompute for v in kept)
    plain = pass_expansion(pcg, UpdateRule.ADAMW)
    assert len(dg.nodes) == len(plain.nodes) + len([n for n in dg.nodes if n.recompute])


def test_selective_recomputation_runs_again_only_the_cheap_ops_and_no_communication(llama):
    """``--ac selective`` on tp=2 and fsdp=2: the recompute nodes are exactly those ``--ac block`` recomputes less the
    matmuls, attention and parallel ops (KEPT_UNDER_SELECTIVE), whose outputs the backward reads from the forward;
    the programs communicate what they do without checkpointing (no all-reduce, no gather repeated); with
    ``ac_blocks=1`` block 0 recomputes whole and block 1 selectively. On one device and under fsdp, the ledger peak
    lies between none's and block's."""
    _, _, graph = llama
    for mesh, strategy in (("tp=2", "tp"), ("fsdp=2", "fsdp")):
        pcg = _pcg(graph, mesh, strategy)
        nodes = {n.name: n for n in pcg.nodes}
        costly = {m for m, n in nodes.items() if n.is_parallel or isinstance(n.op, KEPT_UNDER_SELECTIVE)}
        whole = [
            n.src for n in pass_expansion(pcg, UpdateRule.ADAMW, ac=ActivationCheckpointing.BLOCK).nodes if n.recompute
        ]
        dg = pass_expansion(pcg, UpdateRule.ADAMW, ac=ActivationCheckpointing.SELECTIVE)
        again = [n.src for n in dg.nodes if n.recompute]
        assert again == [m for m in whole if m not in costly] and len(again) < len(whole), mesh
        assert any(isinstance(nodes[m].op, KEPT_UNDER_SELECTIVE) for m in whole), mesh
        made_by = {v: n for n in dg.nodes for v in n.outputs}
        read = {  # what the backward of the blocks reads of their linears' outputs: the forward's
            made_by[v].recompute
            for n in dg.nodes
            if n.task == TaskType.BWD
            for v in n.inputs
            if v in made_by and made_by[v].kind == NodeKind.COMPUTE and made_by[v].src in costly
        }
        assert read == {False}, mesh
        mixed = [
            n.src
            for n in pass_expansion(pcg, UpdateRule.ADAMW, ac=ActivationCheckpointing.SELECTIVE, ac_blocks=1).nodes
            if n.recompute
        ]
        blocks = checkpoint_blocks(pcg)
        assert mixed == [m for m in whole if blocks[m] == "model.layers.0" or m not in costly], mesh
        counts = {
            ac: Counter(
                str(i.kind) for i in _lower(graph, mesh, strategy, ac).programs[0].instrs if isinstance(i, Comm)
            )
            for ac in ("none", "selective")
        }
        assert counts["selective"] == counts["none"], (mesh, counts)
    for mesh, strategy in (("d=1", "single"), ("fsdp=2", "fsdp")):
        held = {
            ac: program_memory(s.programs[0], s.dg).peak
            for ac in ActivationCheckpointing
            for s in [_lower(graph, mesh, strategy, ac)]
        }
        assert held["none"] > held["selective"] >= held["block"], (mesh, held)


def test_recomputing_the_first_blocks_holds_fewer_bytes_than_none_and_more_than_every_block():
    """The ledger peak (``program_memory`` of rank 0's program) of a 3-block GPT on one device and under fsdp:
    none > the first block > every block, not increasing in K. K=2 may equal every block (fsdp: 853,776 B both): the
    last block's backward starts right after its forward, so its recomputation holds what its forward kept."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    graph = capture(model, {"idx": ids, "targets": ids})
    for mesh, strategy in (("d=1", "single"), ("fsdp=2", "fsdp")):

        def peak(ac: str, k: int | None = None) -> int:
            s = _lower(graph, mesh, strategy, ac, ac_blocks=k)
            return program_memory(s.programs[0], s.dg).peak

        peaks = [peak("none"), peak("block", 1), peak("block", 2), peak("block")]
        assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[1] > peaks[-1], (mesh, peaks)


@pytest.mark.parametrize(
    "mesh, strategy, ac, ac_blocks",
    [
        ("d=1", "single", "block", None),
        ("fsdp=2", "fsdp", "block", None),
        ("dp=2,tp=2", "dp,tp", "block", None),
        ("fsdp=2,tp=2", "fsdp,tp", "block", None),
        ("d=1", "single", "block", 1),  # block 0 recomputed, block 1 keeping its activations
        ("fsdp=2,tp=2", "fsdp,tp", "block", 1),
        ("d=1", "single", "selective", None),
        ("fsdp=2,tp=2", "fsdp,tp", "selective", None),
        ("fsdp=2,tp=2", "fsdp,tp", "selective", 1),  # block 0 recomputed whole, block 1 selectively
    ],
)
def test_recomputation_gives_the_numbers_of_one_device(llama, mesh, strategy, ac, ac_blocks):
    """AdamW, 3 steps: the loss of each step and every replica of every weight piece equal one device's without
    recomputation (float64; TOL: the partial sums' order), every block recomputed, only the first
    (``ac_blocks=1``), every block selectively, or the first whole and the other selectively."""
    model, batch, graph = llama
    ref_losses, ref = _run(model, batch, graph, _lower(graph, "d=1", "single", "none"))
    losses, ex = _run(model, batch, graph, _lower(graph, mesh, strategy, ac, ac_blocks=ac_blocks))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
    assert ex.weight_error(ref.weights()) < TOL


def test_recomputed_dropout_draws_the_forwards_mask():
    """GPT with dropout in every block: the recomputed forward draws the same mask as the forward (the backward
    would otherwise differ from the forward's function); bitwise the plan without recomputation on dp=2."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.2)).double()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    batch = {"idx": ids, "targets": ids}
    graph = capture(model, batch)
    assert any(n.op.random for n in graph.nodes)
    runs = {ac: _run(model, batch, graph, _lower(graph, "dp=2", "dp", ac)) for ac in ActivationCheckpointing}
    assert runs["block"][0] == runs["none"][0]
    assert runs["block"][1].weight_error(runs["none"][1].weights()) == 0.0


def test_an_unknown_mode_is_refused_before_capture():
    model, batch = _tiny()
    with pytest.raises(ValueError, match=r"^ac must be one of \['none', 'block', 'selective'\], got 'full'$"):
        parallelize(model, batch, mesh="d=1", ac="full")


@pytest.mark.parametrize(
    "ac, ac_blocks, error, message",
    [
        ("block", 0, ValueError, r"^ac_blocks=0: give the number of blocks to recompute, 1 or more .*every block$"),
        (
            "none",
            1,
            ValueError,
            r"^ac_blocks=1 with ac='none': .*add --ac block or --ac selective, or leave --ac-blocks out$",
        ),
        (
            "block",
            2,
            PassError,
            r"^ac_blocks=2: the graph has 1 blocks \(transformer\.h\.0 … transformer\.h\.0\); give --ac-blocks between "
            r"1 and 1 .*or leave it out to recompute every block$",
        ),
    ],
)
def test_a_number_of_blocks_out_of_range_or_without_block_checkpointing_is_refused(ac, ac_blocks, error, message):
    """``ac_blocks`` < 1 or without ``ac="block"``: refused with the settings, before capture; above the graph's
    blocks (1 here): refused when the step is lowered, naming the blocks."""
    model, batch = _tiny()
    with pytest.raises(error, match=message):
        parallelize(model, batch, mesh="d=1", ac=ac, ac_blocks=ac_blocks)


class _Flat(torch.nn.Module):
    """Two linears as attributes: no module under an integer index, no block."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.down(torch.relu(self.up(x))), y)


def test_a_model_without_blocks_is_refused_by_name():
    batch = {"x": torch.randn(4, 4), "y": torch.zeros(4, dtype=torch.long)}
    with pytest.raises(PassError, match=r"no op of the graph lies in a block .*leave --ac out \(ac='none'\)$"):
        parallelize(_Flat(), batch, mesh="d=1", ac="block")


def _tiny():
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=1, n_embd=8))
    ids = torch.zeros(2, 4, dtype=torch.long)
    return model, {"idx": ids, "targets": ids}
