"""torchtitan's tensor-parallel plans (``torch.distributed.tensor.parallel`` styles) translated into shardflow plans:
the Megatron attention and MLP of shardflow's GPT planned from styles is the tp preset (the same PCG, the same
numbers), torchtitan's sequence-parallel plan with embeddings is the hand-written plan it stands for and trains as
eager PyTorch does, and what has no translation is refused naming the style, the module and the fix.

Numbers: the styles' plan builds the very PCG of the tp preset, so the two runs give equal losses (exactly, the same
programs); against eager PyTorch, float64 inside ``wide_floats`` to 1e-9 (test_api.py's tolerance: partial sums in
another order agree to ~1e-15; a wrong block or a missed reduction is O(1) or O(lr)).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import _StridedShard

import shardflow
from shardflow.capture import capture, wide_floats
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh, Replicate, Shard
from shardflow.parallel.pcg import build_pcg
from shardflow.strategy import ModulePlan, Plan, PlanError, make_plan, plan_from_styles, resolve

TOL = 1e-9
B, T, V = 4, 8, 12

# torchtitan's Megatron plan with its loss parallelism, written for shardflow's GPT (separate q, k, v): the token
# embedding Rowwise (its rows, the vocabulary, cut), the head Colwise with Shard(-1) logits left to the loss
MEGATRON = {
    "transformer.wte": RowwiseParallel(input_layouts=TReplicate()),
    "lm_head": ColwiseParallel(output_layouts=TShard(-1), use_local_output=False),
    "transformer.h.*.attn.q": ColwiseParallel(),
    "transformer.h.*.attn.k": ColwiseParallel(),
    "transformer.h.*.attn.v": ColwiseParallel(),
    "transformer.h.*.attn.c_proj": RowwiseParallel(),
    "transformer.h.*.mlp.c_fc": ColwiseParallel(),
    "transformer.h.*.mlp.c_proj": RowwiseParallel(),
}


def gpt(dtype=torch.float32):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_embd=32)).to(dtype)
    gen = torch.Generator().manual_seed(1)
    return model, {
        "idx": torch.randint(0, V, (B, T), generator=gen),
        "targets": torch.randint(0, V, (B, T), generator=gen),
    }


def test_megatron_styles_are_the_tp_preset():
    """Colwise q/k/v/c_fc and Rowwise c_proj, the Rowwise embedding and the Colwise head (the preset's vocabulary
    parallelism, docs/concepts.md#vocabulary-parallel-embedding-and-loss) give every module the tp preset's parameter
    placements, and the PCG
    (every tensor's placements, every parallel op) is the preset's, on tp=2 and — merged with the batch split —
    on dp=2,tp=2; parallelize(plan=styles) trains to the preset's losses."""
    model, batch = gpt()
    graph = capture(model, batch)
    plan = plan_from_styles(model, MEGATRON, axis="tp")
    assert plan.modules["transformer.h.1.attn.q"] == ModulePlan(
        params={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
        input={"tp": Replicate()},
        output={"tp": Shard(-1)},
    )
    assert plan.modules["transformer.h.0.mlp.c_proj"] == ModulePlan(
        params={"weight": {"tp": Shard(1)}}, input={"tp": Shard(-1)}, output={"tp": Replicate()}
    )
    assert len(plan.modules) == 2 + 12  # the embedding and the head; 6 patterns × 2 layers
    for mesh_text, preset, styles in (
        ("tp=2", "tp", plan),
        ("dp=2,tp=2", "dp,tp", plan.merge(Plan(inputs={"idx": {"dp": Shard(0)}, "targets": {"dp": Shard(0)}}))),
    ):
        mesh = Mesh.parse(mesh_text)
        want = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, preset), graph, mesh))
        got = build_pcg(graph, mesh, resolve(styles, graph, mesh))
        assert got.listing() == want.listing(), mesh_text
    by_styles = shardflow.parallelize(model, batch, mesh="tp=2", plan=MEGATRON)
    by_preset = shardflow.parallelize(model, batch, mesh="tp=2", strategy="tp")
    assert [by_styles.step(batch) for _ in range(3)] == [by_preset.step(batch) for _ in range(3)]


def test_torchtitan_sequence_parallel_plan_with_embeddings():
    """torchtitan's plan with sequence parallelism — embeddings Rowwise (rows cut) into a sequence-sharded residual
    stream, norms SequenceParallel, c_proj Rowwise to Shard(1), the head Colwise (embedding dim cut) gathered to
    Replicate — is the hand-written plan it stands for, and trains as eager PyTorch does (float64, 2 SGD steps:
    losses, gradients, every replica of every weight)."""
    model, batch = gpt(torch.float64)
    seq = SequenceParallel()
    styles = {
        "transformer.wte": RowwiseParallel(input_layouts=TReplicate(), output_layouts=TShard(1)),
        "transformer.wpe": ColwiseParallel(output_layouts=TReplicate()),
        "transformer.h.*.ln_?": seq,
        "transformer.h.*.attn.[qkv]": ColwiseParallel(input_layouts=TShard(1)),
        "transformer.h.*.attn.c_proj": RowwiseParallel(output_layouts=TShard(1)),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(input_layouts=TShard(1)),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(output_layouts=TShard(1)),
        "transformer.ln_f": seq,
        "lm_head": ColwiseParallel(input_layouts=TShard(1), output_layouts=TReplicate(), use_local_output=False),
    }
    plan = plan_from_styles(model, styles)
    assert plan.modules["transformer.wte"] == ModulePlan(
        params={"weight": {"tp": Shard(0)}}, input={"tp": Replicate()}, output={"tp": Shard(1)}
    )
    assert plan.modules["transformer.wpe"] == ModulePlan(
        params={"weight": {"tp": Shard(1)}}, input={"tp": Replicate()}, output={"tp": Replicate()}
    )
    assert plan.modules["transformer.h.1.ln_2"] == ModulePlan(input={"tp": Shard(1)}, output={"tp": Shard(1)})
    assert plan.modules["lm_head"] == ModulePlan(
        params={"weight": {"tp": Shard(0)}}, input={"tp": Replicate()}, output={"tp": Replicate()}
    )
    assert len(plan.modules) == 2 + 2 * 2 + 2 * 6 + 2  # wte, wpe; 2 norms, 6 linears per layer; ln_f, lm_head
    with wide_floats():
        trainer = shardflow.parallelize(model, batch, mesh="tp=2", plan=styles, lr=0.1)
        steps = list(trainer.compare_with_eager(model, batch, 2))
    assert all(s.dloss <= TOL and s.grad <= TOL and s.weight <= TOL for s in steps), steps
    tensors = trainer.plan.pcg.tensors
    assert tensors["transformer.h.0.ln_1.weight"].placements == (Replicate(),)
    assert tensors["transformer.h.0.attn.c_proj.weight"].placements == (Shard(1),)


class Float8Colwise(ColwiseParallel):
    """A subclass, as torchtitan's float8 styles are: its _apply may do more than ColwiseParallel's placements."""


@pytest.mark.parametrize(
    "styles, match",
    [
        (
            {"transformer.h.0.attn": PrepareModuleInput(input_layouts=TShard(1), desired_input_layouts=TReplicate())},
            r"style PrepareModuleInput of module 'transformer.h.0.attn' \(pattern 'transformer.h.0.attn'\): shardflow "
            r"does not translate module-preparation styles.*drop this entry, or say the layout with "
            r"ModulePlan\(input=",
        ),
        (
            {"transformer.h.*.mlp.c_fc": Float8Colwise()},
            r"style Float8Colwise of module 'transformer.h.0.mlp.c_fc' .*the classes themselves: a subclass's _apply "
            r"may do more.*write a ModulePlan for this module",
        ),
        (
            {"transformer.h.0.ln_1": ColwiseParallel()},
            r"style ColwiseParallel of module 'transformer.h.0.ln_1' .*: the module is a LayerNorm, and torch's "
            r"column- and row-parallel styles shard an nn.Linear or an nn.Embedding only; give it SequenceParallel\(\)",
        ),
        (
            {"transformer.h.0.mlp.fc": ColwiseParallel()},
            r"style pattern 'transformer.h.0.mlp.fc' \(ColwiseParallel\) matches no module of the model; its modules "
            r"are: transformer, transformer.wte",
        ),
        (
            {"transformer.h.*.mlp": SequenceParallel()},  # one name per '*', as parallelize_module matches
            None,
        ),
        (
            {"transformer.*.mlp.c_fc": ColwiseParallel()},
            r"'transformer.\*.mlp.c_fc' \(ColwiseParallel\) matches no module.*a '\*' stands for one name between dots",
        ),
        (
            {"transformer.h.0.mlp.c_fc": ColwiseParallel(), "transformer.h.*.mlp.c_*": RowwiseParallel()},
            r"module 'transformer.h.0.mlp.c_fc' is matched by style patterns 'transformer.h.0.mlp.c_fc' and "
            r"'transformer.h.\*.mlp.c_\*'; give each module one style",
        ),
        (
            {"lm_head": RowwiseParallel(output_layouts=_StridedShard(0, split_factor=2))},
            r"style RowwiseParallel of module 'lm_head' \(pattern 'lm_head'\): placement _StridedShard\(dim=0, sf=2\) "
            r"has no shardflow spelling",
        ),
    ],
    ids=["prepare-input", "subclass", "not-linear", "no-match", "per-atom", "star-is-one-name", "twice", "strided"],
)
def test_styles_without_translation_are_refused(styles, match):
    model = gpt()[0]
    if match is None:
        assert set(plan_from_styles(model, styles).modules) == {"transformer.h.0.mlp", "transformer.h.1.mlp"}
        return
    with pytest.raises(PlanError, match=match):
        plan_from_styles(model, styles)


def test_parallelize_places_styles_on_tp_or_the_only_axis():
    """parallelize(plan=styles) shards the tp axis, or a one-axis mesh's axis whatever its name; a mesh of several
    axes without tp is refused, naming plan_from_styles(..., axis=...)."""
    model, batch = gpt()
    styles = {"transformer.h.0.mlp.c_fc": ColwiseParallel(), "transformer.h.0.mlp.c_proj": RowwiseParallel()}
    for mesh, axis in (("dp=2,tp=2", "tp"), ("model=2", "model")):
        trainer = shardflow.parallelize(model, batch, mesh=mesh, plan=styles)
        tensors = trainer.plan.pcg.tensors
        assert dict(zip(trainer.plan.pcg.mesh.axis_names, tensors["transformer.h.0.mlp.c_fc.weight"].placements))[
            axis
        ] == Shard(0)
    with pytest.raises(PlanError, match=r"mesh dp=2,fsdp=2, which has no axis 'tp': name the axis they shard, "):
        shardflow.parallelize(model, batch, mesh="dp=2,fsdp=2", plan=styles)


def test_styles_take_nn_linear_and_embedding_weights_as_torch_shards_them():
    """A Linear's weight is [out, in] (Colwise Shard(0), Rowwise Shard(1), the bias only under Colwise); an
    Embedding's is [num, dim] (Colwise Shard(1), Rowwise Shard(0)) — torch's _partition_linear_fn and
    _partition_embedding_fn."""
    model = nn.ModuleDict({"emb": nn.Embedding(8, 4), "lin": nn.Linear(4, 6, bias=False)})
    col = plan_from_styles(model, {"emb": ColwiseParallel(), "lin": ColwiseParallel()}, axis="m")
    row = plan_from_styles(model, {"emb": RowwiseParallel(), "lin": RowwiseParallel()}, axis="m")
    assert col.modules["emb"].params == {"weight": {"m": Shard(1)}} and row.modules["emb"].params == {
        "weight": {"m": Shard(0)}
    }
    assert col.modules["lin"].params == {"weight": {"m": Shard(0)}} and row.modules["lin"].params == {
        "weight": {"m": Shard(1)}
    }
    assert [p.modules["emb"].input for p in (col, row)] == [{"m": Replicate()}] * 2
