"""``shardflow generate``: sample text on one process from a checkpoint of ``shardflow train`` (full tensors, whatever
strategy wrote it, and the run's tokenizer: the plain module of its model family) or from a Hugging Face model
directory (``shardflow export``'s, loaded with ``AutoModelForCausalLM``)."""

from __future__ import annotations

import codecs
import sys
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from shardflow.train.checkpoint import CheckpointError, load_model
from shardflow.train.checkpoint.export import check_safetensors, nonfinite
from shardflow.train.family import Family, hf_family
from shardflow.train.tokenizer import TOKENIZER_FILE, Tokenizer

# what a byte-level decode ends with while the last token stops inside a character's UTF-8 bytes
_CUT = "\ufffd"


def sample(
    family: Family,
    model: nn.Module,
    tok: Tokenizer,
    context: int,
    prompt: str,
    tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    out: TextIO | None = None,
) -> str:
    """``prompt`` followed by the text of ``tokens`` sampled tokens (greedy when ``temperature`` is 0); the model sees
    the last ``context`` tokens. The sampled text is written to ``out`` as it grows, when given, and returned, whole
    characters only: a character whose bytes span several tokens appears once they have all been sampled; bytes
    that make no character (an incomplete one at the end, a stray continuation byte) are dropped, never shown as
    U+FFFD."""
    idx = torch.tensor(tok.encode(prompt), dtype=torch.long)[None]  # [1, T]
    gen = torch.Generator().manual_seed(seed)
    new: list[int] = []
    # byte-level tokens: their bytes through an incremental UTF-8 decoder, which holds back the bytes of a
    # character not yet complete and drops bytes that make no character; other tokenizers decode whole characters
    utf8 = codecs.getincrementaldecoder("utf-8")("ignore")
    shown = ""
    with torch.no_grad():
        for _ in range(tokens):
            logits = family.logits(model, idx[:, -context:])[0, -1]  # [V]
            if temperature == 0:
                nxt = logits.argmax().view(1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
            idx = torch.cat([idx, nxt.view(1, 1)], 1)
            new.append(int(nxt))
            raw = tok.token_bytes(int(nxt))
            if raw is not None:
                piece = utf8.decode(raw)
            else:
                text = tok.decode(new)
                piece = "" if text.endswith(_CUT) else text[len(shown) :]
            if piece and out is not None:
                out.write(piece)
                out.flush()
            shown += piece
    # an incomplete character at the end is dropped: the byte-level decoder holds its bytes back for good
    if not tok.byte_level:  # what a decode that ended inside a character held back, less that character
        rest = tok.decode(new)[len(shown) :].rstrip(_CUT)
        if rest and out is not None:
            out.write(rest)
        shown += rest
    return prompt + shown


def load(source: str) -> tuple[Family, nn.Module, Tokenizer, int, str]:
    """The family, module (eval mode), tokenizer and context length (tokens) of ``source``: a Hugging Face model
    directory (it has ``config.json``) or a checkpoint, checkpoint directory or run directory; and its description.
    Raises CheckpointError."""
    path = Path(source)
    if (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        if not (path / TOKENIZER_FILE).is_file():
            raise CheckpointError(
                f"{path} has no {TOKENIZER_FILE}: shardflow generate needs the fast tokenizer "
                f"(shardflow export writes it)"
            )
        weights = path / "model.safetensors"
        if weights.is_file():
            check_safetensors(weights)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        config = model.config
        _finite(model, f"{weights if weights.is_file() else path}")
        return (
            hf_family(config.model_type),
            model,
            Tokenizer.load(path / TOKENIZER_FILE),
            config.max_position_embeddings,
            f"the Hugging Face model in {path}",
        )
    family, model, ck = load_model(source)
    _finite(model, f"checkpoint {ck.path}")
    return family, model, ck.tokenizer, int(ck.train.get("seq_len", 64)), f"checkpoint {ck.path}"


def _finite(model: nn.Module, what: str) -> None:
    """Refuse weights that hold NaN or inf (they would sample garbage, or fail inside torch.multinomial)."""
    bad = nonfinite(model)
    if bad is not None:
        raise CheckpointError(
            f"{what} holds {bad[1]} in tensor {bad[0]}: the model it stores is broken (its training diverged, or "
            f"the file was damaged); generate from a checkpoint whose weights are finite (an earlier step)"
        )


def main(source: str, prompt: str, tokens: int, temperature: float, seed: int) -> int:
    """Entry of ``shardflow generate`` (its flags checked by the command line: a non-empty ``prompt``, ``tokens`` ≥ 0,
    a finite ``temperature`` ≥ 0): prints the prompt and the sampled text. Raises CheckpointError for a bad source or
    a prompt the tokenizer cannot encode."""
    family, model, tok, context, what = load(source)
    unknown = tok.unknown(prompt)
    if unknown:
        raise CheckpointError(
            f"--prompt has characters outside the model's vocabulary: "
            f"{', '.join(repr(c) for c in unknown)}; the tokenizer of {what} "
            f"({tok.describe()}) has no token for them: use characters of its training text"
        )
    sys.stdout.write(prompt)
    sample(family, model, tok, context, prompt, tokens, temperature, seed, out=sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
