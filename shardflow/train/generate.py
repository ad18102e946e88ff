"""``shardflow generate``: sample text from a checkpoint of ``shardflow train`` with the plain ``GPT`` module on one
process (the checkpoint holds full tensors, whatever strategy wrote it)."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from shardflow.models import GPT
from shardflow.train.checkpoint import CheckpointError, load_model
from shardflow.train.data import CharTokenizer
from shardflow.train.recipe import GPT_MODEL


def sample(model: GPT, tok: CharTokenizer, prompt: str, tokens: int, temperature: float = 1.0, seed: int = 0,
           out: TextIO | None = None) -> str:
    """``prompt`` followed by ``tokens`` sampled characters (greedy when ``temperature`` is 0); the context is the
    last ``block_size`` characters. Each character is written to ``out`` as it is sampled, when given."""
    idx = tok.encode(prompt)[None]  # [1, T]
    gen = torch.Generator().manual_seed(seed)
    block = model.config.block_size
    text = prompt
    with torch.no_grad():
        for _ in range(tokens):
            logits = model.logits(idx[:, -block:])[0, -1]  # [V]
            if temperature == 0:
                nxt = logits.argmax().view(1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
            idx = torch.cat([idx, nxt.view(1, 1)], 1)
            ch = tok.chars[int(nxt)]
            text += ch
            if out is not None:
                out.write(ch)
                out.flush()
    return text


def main(checkpoint: str, prompt: str, tokens: int, temperature: float, seed: int) -> int:
    """Entry of ``shardflow generate``: prints the prompt and the sampled characters. Raises CheckpointError for a
    bad checkpoint or argument."""
    if tokens < 0:
        raise CheckpointError(f"--tokens {tokens}: give the number of characters to sample (0 or more)")
    if temperature < 0:
        raise CheckpointError(f"--temperature {temperature}: must be 0 (greedy) or positive")
    if not prompt:
        raise CheckpointError("--prompt is empty; the model needs at least one character to continue from")
    model, ck = load_model(checkpoint, GPT_MODEL)
    unknown = sorted(set(prompt) - set(ck.chars))
    if unknown:
        raise CheckpointError(f"--prompt has characters outside the model's vocabulary: "
                              f"{', '.join(repr(c) for c in unknown)}; the model from {ck.path} knows only the "
                              f"{len(ck.chars)} characters of its training text: {ck.chars!r}")
    sys.stdout.write(prompt)
    sample(model, ck.tokenizer, prompt, tokens, temperature, seed, out=sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
