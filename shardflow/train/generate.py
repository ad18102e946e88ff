"""``shardflow generate``: sample text from a checkpoint of ``shardflow train`` with the plain ``GPT`` module on one
process (the checkpoint holds full tensors, whatever strategy wrote it, and the run's tokenizer)."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from shardflow.models import GPT
from shardflow.train.checkpoint import CheckpointError, load_model
from shardflow.train.recipe import GPT_MODEL
from shardflow.train.tokenizer import Tokenizer

# what a byte-level decode ends with while the last token stops inside a character's UTF-8 bytes
_CUT = "\ufffd"


def sample(model: GPT, tok: Tokenizer, prompt: str, tokens: int, temperature: float = 1.0, seed: int = 0,
           out: TextIO | None = None) -> str:
    """``prompt`` followed by the text of ``tokens`` sampled tokens (greedy when ``temperature`` is 0); the context is
    the last ``block_size`` tokens. The sampled text is written to ``out`` as it grows, when given, whole characters
    only (a character whose bytes span several tokens appears once they have all been sampled)."""
    idx = torch.tensor(tok.encode(prompt), dtype=torch.long)[None]  # [1, T]
    gen = torch.Generator().manual_seed(seed)
    block = model.config.block_size
    new: list[int] = []
    shown = ""
    with torch.no_grad():
        for _ in range(tokens):
            logits = model.logits(idx[:, -block:])[0, -1]  # [V]
            if temperature == 0:
                nxt = logits.argmax().view(1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
            idx = torch.cat([idx, nxt.view(1, 1)], 1)
            new.append(int(nxt))
            text = tok.decode(new)
            if out is not None and not text.endswith(_CUT):
                out.write(text[len(shown):])
                out.flush()
                shown = text
    text = tok.decode(new)
    if out is not None:
        out.write(text[len(shown):])
    return prompt + text


def main(checkpoint: str, prompt: str, tokens: int, temperature: float, seed: int) -> int:
    """Entry of ``shardflow generate``: prints the prompt and the sampled text. Raises CheckpointError for a bad
    checkpoint or argument."""
    if tokens < 0:
        raise CheckpointError(f"--tokens {tokens}: give the number of tokens to sample (0 or more)")
    if temperature < 0:
        raise CheckpointError(f"--temperature {temperature}: must be 0 (greedy) or positive")
    if not prompt:
        raise CheckpointError("--prompt is empty; the model needs at least one character to continue from")
    model, ck = load_model(checkpoint, GPT_MODEL)
    tok = ck.tokenizer
    unknown = tok.unknown(prompt)
    if unknown:
        raise CheckpointError(f"--prompt has characters outside the model's vocabulary: "
                              f"{', '.join(repr(c) for c in unknown)}; the tokenizer of {ck.path} "
                              f"({tok.describe()}) has no token for them: use characters of its training text")
    sys.stdout.write(prompt)
    sample(model, tok, prompt, tokens, temperature, seed, out=sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
