"""The Hugging Face Llama the benchmarks use: ``transformers.LlamaForCausalLM`` from a config, random init
(nothing is downloaded), ``use_cache=False``. The tiny one is the tests' (tests/test_hf_models.py): 2 layers,
hidden 64, 4 heads, 2 key/value heads, MLP 128, vocabulary 96."""

from __future__ import annotations

import torch
import transformers


def llama(
    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 96, device: str | None = None
) -> transformers.LlamaForCausalLM:
    """A Llama with ``layers`` decoder layers of width ``hidden`` (MLP 2 × hidden), built on ``device`` (``"meta"``:
    shapes only, for planning), seeded with 0."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return transformers.LlamaForCausalLM(cfg)


def tokens(batch: int, seq: int, vocab: int = 96, device: str | None = None) -> dict[str, torch.Tensor]:
    """``input_ids`` [batch, seq] (random, seed 0) and the same tensor as ``labels`` (the model shifts them)."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    if device:
        ids = ids.to(device)
    return {"input_ids": ids, "labels": ids}
