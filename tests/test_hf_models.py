"""Decoders and encoders of the Hugging Face library, built from tiny configs with random init (nothing is
downloaded), captured with no per-model code: GPT-2, Llama, Qwen2, Mistral (causal LM) and BERT (masked LM).

For each: the captured graph's loss and every gradient equal eager PyTorch's, and dp=2 on the local executor
equals the eager module over 2 SGD steps (loss, gradients, every replica of every weight). float64 inside
``wide_floats()`` (the models upcast their logits with ``.float()``); tolerances: the captured graph runs the
same ops in the same order (1e-12, rounding); dp=2 adds partial sums in another order (1e-9).
docs/models.md lists, per model, which ATen ops ran on a rule and which ran replicated (tests/test_docs.py).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import pytest
import torch
import zoo
from test_local_executor import check_against_eager
from torch import nn

from shardflow.capture import capture, wide_floats
from shardflow.graph import ops as O
from shardflow.reference import run_backward, weights_of

transformers = pytest.importorskip("transformers")

VOCAB, B, T = 96, 2, 8
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            use_cache=False,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, num_key_value_heads=2, use_cache=False))


def qwen2() -> nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES, num_key_value_heads=2, use_cache=False))


def mistral() -> nn.Module:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, num_key_value_heads=2, use_cache=False))


def bert() -> nn.Module:
    return transformers.BertForMaskedLM(
        transformers.BertConfig(**SIZES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    )


def causal_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def masked_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """BERT's masked-LM batch: labels only where a token is masked (every third position), -100 elsewhere."""
    b = causal_batch(seed)
    labels = torch.full_like(b["input_ids"], -100)
    labels[:, ::3] = b["input_ids"][:, ::3]
    return {"input_ids": b["input_ids"], "labels": labels}


# Hugging Face class → (tiny model factory, example batch factory)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict]]] = {
    "GPT2LMHeadModel": (gpt2, causal_batch),
    "LlamaForCausalLM": (llama, causal_batch),
    "Qwen2ForCausalLM": (qwen2, causal_batch),
    "MistralForCausalLM": (mistral, causal_batch),
    "BertForMaskedLM": (bert, masked_batch),
}


def model_and_batch(name: str, dtype=torch.float64) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The tiny ``name`` model (seed 0, ``dtype``) and its example batch."""
    make, batch = MODELS[name]
    torch.manual_seed(0)
    model = make().to(dtype)
    assert type(model).__name__ == name
    return model, batch()


@functools.cache
def graph_of(name: str, dtype=torch.float64):
    """The graph of :func:`model_and_batch`'s model (seeded: the same in every test), captured once per dtype — float64
    inside ``wide_floats()``, as ``shardflow check`` captures."""
    model, b = model_and_batch(name, dtype)
    with wide_floats() if dtype == torch.float64 else contextlib.nullcontext():
        return capture(model, b)


@pytest.mark.parametrize("name", MODELS)
def test_captured_graph_has_the_eager_numbers(name):
    model, b = model_and_batch(name)
    graph = graph_of(name)
    with wide_floats():
        env, grads = run_backward(graph, b, weights_of(model, graph))
        out = model(**b)
    out.loss.backward()
    assert abs(env[graph.loss].item() - out.loss.item()) <= 1e-12
    params = dict(model.named_parameters())
    assert sorted(graph.weights) == sorted(params)
    for w in graph.weights:
        torch.testing.assert_close(grads[w], params[w].grad, atol=1e-12, rtol=0, msg=w)


@pytest.mark.parametrize("name", MODELS)
def test_dp_equals_one_device(name):
    model, b = model_and_batch(name)
    with wide_floats():
        check_against_eager(model, b, "dp=2", "dp", atol=1e-9, steps=2, graph=graph_of(name))


@pytest.mark.parametrize("family, mesh, strategy", [("deepseek_v3", "tp=2", "tp"), ("mamba2", "pp=2", "pp")])
def test_models_with_generic_ops_train_as_eager(family, mesh, strategy):
    """DeepSeek-V3: its key states written by copy_ into slices of a new tensor (ATen's copy has no derivative) and
    its router's topk indices (no gradient: the gather's vjp had none to give). Mamba2: a zeros_like of an
    activation (no gradient: autograd refused its backward). The tiny models of tests/zoo.py, float64 inside
    wide_floats, 2 SGD steps: the sharded step sums in another order than eager, 1e-9."""
    model, b = zoo.FAMILIES[family]()
    with wide_floats():
        check_against_eager(model.to(torch.float64), b, mesh, strategy, atol=1e-9, steps=2)


def test_every_op_has_a_rule():
    """No ATen op of the five falls back to the generic (replicated) Aten op; docs/models.md lists them."""
    for name in MODELS:
        graph = graph_of(name, torch.float32)
        assert [n.op.describe() for n in graph.nodes if isinstance(n.op, O.Aten)] == [], name


def test_llama_on_the_meta_device_gives_the_cpu_graph():
    """A model built on the meta device (no weights anywhere, how a large model is planned) captures to the graph of
    the same model on the CPU: its rotary frequencies (a meta buffer) fold to meta constants of the same shapes, the
    position ids and masks (from arange, no meta input) to real ones."""
    _, b = model_and_batch("LlamaForCausalLM", torch.float32)
    with torch.device("meta"):
        meta = llama()
    graph = capture(meta, {k: v.to("meta") for k, v in b.items()})
    assert graph.listing() == graph_of("LlamaForCausalLM", torch.float32).listing()
    assert {c.device.type for c in graph.constants.values()} == {"meta", "cpu"}
