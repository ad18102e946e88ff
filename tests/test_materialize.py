"""A model built on the meta device, materialized piece by piece (shardflow/runtime/materialize.py): every piece is
the same block of the whole tensor bit for bit, computed without anything larger than the piece; the values follow
the model's own initialisation (distributions, constants, padding rows, buffers); what cannot be replayed is refused
naming the tensor."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardflow.graph.fused import ByParts
from shardflow.runtime.materialize import InitError, materialize_buffers, record

transformers = pytest.importorskip("transformers")


def _hf(name: str):
    t = transformers
    return {
        "llama": lambda: t.LlamaForCausalLM(
            t.LlamaConfig(
                num_hidden_layers=2,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=96,
                use_cache=False,
            )
        ),
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=64, use_cache=False)
        ),
        "bert": lambda: t.BertForMaskedLM(
            t.BertConfig(
                num_hidden_layers=1,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                vocab_size=96,
                max_position_embeddings=64,
                pad_token_id=3,
            )
        ),
    }[name]


def _meta(build):
    with torch.device("meta"):
        return build()


def _blocks(shape, parts=2):
    """Every block of a grid splitting each dim into ``parts`` (uneven where it does not divide)."""
    cuts = [[(k * n // parts, (k + 1) * n // parts) for k in range(parts)] for n in shape]
    for idx in __import__("itertools").product(*cuts):
        yield tuple(slice(a, b) for a, b in idx)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op produced while active."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_every_piece_is_its_block_of_the_whole_and_allocates_no_more_than_itself(name):
    model = _meta(_hf(name))
    inits = record(model, seed=7)
    assert set(inits) >= {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        init = inits[n]
        full = init.full()
        assert (full.shape, full.dtype) == (p.shape, p.dtype) and bool(torch.isfinite(full).all()), n
        for block in _blocks(tuple(p.shape), parts=3):
            piece_numel = math.prod(s.stop - s.start for s in block)
            with _Largest() as seen:
                piece = init[block]
            assert torch.equal(piece, full[block]), (n, block)
            # nothing larger than the piece (or one of its index ranges, for an empty piece)
            assert seen.most <= max(piece_numel, *(s.stop - s.start for s in block)), (n, block, seen.most)
    # the seed decides the draws; the same seed draws the same
    again = record(_meta(_hf(name)), seed=7)
    other = record(_meta(_hf(name)), seed=8)
    w = next(n for n, p in model.named_parameters() if p.ndim == 2)
    assert torch.equal(again[w].full(), inits[w].full()) and not torch.equal(other[w].full(), inits[w].full())


def test_a_weight_stored_by_parts_is_replayed_block_by_block():
    """GPT-2's c_attn weight [64, 192] and bias [192] are held as [64, 3, 64] and [3, 64] (q|k|v by parts:
    shardflow.graph.fused): every block of that shape, read through ByParts from the replay in the module's shape,
    is the block of the whole tensor so viewed."""
    inits = record(_meta(_hf("gpt2")), seed=7)
    for n in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"):
        module = inits[n].shape
        shape = module[:-1] + (3, module[-1] // 3)
        full = inits[n].full().reshape(shape)
        by_parts = ByParts(inits[n], shape, len(module) - 1)
        for block in _blocks(shape, parts=2):
            assert torch.equal(by_parts[block], full[block]), (n, block)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_values_follow_the_models_own_initialisation(name):
    """Same distributions as the model initialised eagerly by torch: normal(0, 0.02) weights (GPT-2's residual
    projections 0.02/√(2·layers)), norm weights 1, biases 0, BERT's padding row 0, buffers equal."""
    torch.manual_seed(0)
    real = _hf(name)()
    model = _meta(_hf(name))
    inits = record(model, seed=0)
    materialize_buffers(model, inits)
    for n, b in real.named_buffers():
        assert torch.equal(dict(model.named_buffers())[n], b), n
    for n, p in real.named_parameters():
        ours = inits[n].full()
        if p.std() == 0:  # a constant: ones, zeros
            assert torch.equal(ours, p.detach()), n
        else:
            noise = 1 / math.sqrt(ours.numel())  # relative sampling error of a std (÷√2) and of a mean (in stds)
            assert abs(ours.std().item() / p.std().item() - 1) < 6 * noise, (n, ours.std(), p.std())
            assert abs(ours.mean().item() - p.mean().item()) < 6 * noise * p.std().item(), n
    if name == "bert":
        emb = inits["bert.embeddings.word_embeddings.weight"].full()
        assert torch.equal(emb[3], torch.zeros(64)) and bool((emb[2] != 0).all())


def test_torch_modules_reset_parameters_and_element_wise_chains_replay():
    """Without Hugging Face: each module's reset_parameters (Linear's kaiming uniform bounds, LayerNorm's ones and
    zeros) and chains of element-wise ops in place (uniform_, erfinv_, mul_, add_, clamp_) replay piece by piece."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(48, 32)
            self.norm = nn.LayerNorm(32)
            self.table = nn.Parameter(torch.empty(40, 16))

        def reset_parameters(self):  # a truncated normal by the inverse CDF, in place (what torch's used to be)
            self.table.uniform_(-0.9, 0.9).erfinv_().mul_(0.5 * math.sqrt(2)).add_(0.01).clamp_(min=-0.4, max=0.4)

    model = _meta(Net)
    inits = record(model, seed=3)
    w = inits["fc.weight"].full()
    bound = 1 / math.sqrt(48)  # kaiming_uniform_(a=√5) on fan_in 48
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert torch.equal(inits["norm.weight"].full(), torch.ones(32)) and torch.equal(
        inits["norm.bias"].full(), torch.zeros(32)
    )
    t = inits["table"]
    full = t.full()
    assert full.abs().max() <= 0.4 and full.std() > 0.15
    assert torch.equal(t[slice(10, 30), slice(4, 16)], full[10:30, 4:16])


def test_what_cannot_be_replayed_is_refused_naming_the_tensor():
    class Symmetric(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 8))

        def reset_parameters(self):
            self.w.normal_()
            self.w.copy_(self.w + self.w.t())  # the whole matrix read: no piece has it

    class Exponential(Symmetric):
        def reset_parameters(self):
            self.w.exponential_()  # a random op not in the tables

    class Never(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))

    with pytest.raises(InitError, match=r"copies into w \[8, 8\] a value computed on the meta device"):
        record(_meta(Symmetric), 0)
    with pytest.raises(
        InitError,
        match=r"applies aten.exponential_.default to w \[8, 8\], which shardflow cannot "
        r"replay on one piece",
    ):
        record(_meta(Exponential), 0)

    class Truncated(Never):
        def reset_parameters(self):
            nn.init.trunc_normal_(self.w)  # since torch 2.12 rejection sampling, which torch skips on meta

    with pytest.raises(InitError, match=r"never sets all of w \[4\]"):
        record(_meta(Never), 0)
    if _trunc_normal_skips_meta():
        with pytest.raises(InitError, match=r"never sets all of w \[4\].*trunc_normal_"):
            record(_meta(Truncated), 0)
    else:  # before torch 2.12: inverse-CDF sampling, uniform_ then element-wise ops, replayed like any other
        w = record(_meta(Truncated), 0)["w"].full()
        assert w.shape == (4,) and bool(((w >= -2) & (w <= 2)).all())


def _trunc_normal_skips_meta() -> bool:
    """Whether this torch's ``nn.init.trunc_normal_`` leaves a meta tensor alone (the rejection sampling of 2.12 on returns
    at once) rather than writing it with ops that replay (``uniform_``, ``erfinv_``, ``mul_``, ``add_``,
    ``clamp_``: torch before 2.12)."""
    ops = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with Log():
        nn.init.trunc_normal_(torch.empty(4, device="meta"))
    return torch.ops.aten.uniform_.default not in ops


def test_a_model_built_on_meta_captures_the_graph_of_the_model_built_whole():
    """Capture of the meta-built model (buffers materialized) = capture of the eagerly built one: same ops, same
    folded constants (rotary tables, masks); the labels' move to the logits' device (meta) is no op in the graph."""
    from shardflow.capture import capture

    real = _hf("llama")()
    model = _meta(_hf("llama"))
    materialize_buffers(model, record(model, 0))
    ids = torch.randint(0, 96, (2, 8))
    a, b = (capture(m, {"input_ids": ids, "labels": ids}) for m in (real, model))
    assert [n.op for n in a.nodes] == [n.op for n in b.nodes]
    assert a.constants.keys() == b.constants.keys()
    assert all(torch.equal(a.constants[k], b.constants[k]) for k in a.constants)


def test_the_main_jobs_ranks_materialize_only_their_pieces(corpus):
    """`shardflow train`'s model (the default Llama) is built on the meta device: no parameter has values in the
    setup; under tp=2 each device's piece of every weight is its block of the whole initial tensor, and loading
    the executor allocates no tensor larger than the largest piece it places (its optimizer state's zeros too)."""
    from shardflow.lower.dynamic import forward_id
    from shardflow.runtime.local import LocalExecutor
    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import setup

    s = setup(
        TrainConfig(
            layers=1,
            heads=2,
            kv_heads=2,
            embd=32,
            seq_len=16,
            batch_size=4,
            strategy="tp",
            mesh="tp=2",
            nproc=1,
            data=str(corpus),
        ),
        1,
    )
    assert all(p.is_meta for p in s.model.parameters()) and not any(b.is_meta for b in s.model.buffers())
    ex = LocalExecutor(s.lower(), s.optimizer, seed=0)
    with _Largest() as seen:
        ex.load(s.initial_weights())
    pieces = {w: ex._pieces(forward_id(w)) for w in s.graph.weights}
    assert seen.most <= max(t.numel() for held in pieces.values() for t in held.values())
    whole = {w: s.inits[w].full() for w in s.graph.weights}
    assert ex.weight_error(whole) == 0.0
    cut = [w for w in s.graph.weights if pieces[w][0].shape != whole[w].shape]
    # q, k, v, o, gate, up, down cut by tp; the embedding and the head by the vocabulary (its 289 tokens in uneven
    # blocks of 145 and 144, padded: docs/concepts.md#uneven-shards)
    assert len(cut) == 7 + 2, cut


def test_parallelize_takes_a_model_built_on_the_meta_device():
    """shardflow.parallelize of a meta-device model trains what the same initialisation, whole, trains on one
    device: dp=2,tp=2 on the local executor equals the single-device run of the materialized model (float64, 1e-12)."""
    import shardflow
    from shardflow.capture import wide_floats

    model = _meta(_hf("llama")).double()
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    inits = record(_meta(_hf("llama")).double(), seed=5)
    whole = _hf("llama")().double()
    whole.load_state_dict({n: inits[n].full() for n, _ in whole.named_parameters()}, strict=False)
    with wide_floats():  # the loss in float64 (Hugging Face casts logits to float32)
        trainer = shardflow.parallelize(model, batch, mesh="dp=2,tp=2", optimizer="adamw", lr=1e-2, seed=5)
        one = shardflow.parallelize(whole, batch, mesh="d=1", optimizer="adamw", lr=1e-2)
    for _ in range(2):
        assert abs(trainer.step(batch) - one.step(batch)) < 1e-12
    got, want = trainer.state_dict(), one.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-12
