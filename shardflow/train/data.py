"""Text data for ``shardflow train``: a character-level tokenizer, the corpus, deterministic batches.

The default corpus is the Python documentation text that ships with every CPython (``pydoc_data.topics``),
so training needs no download. Batches depend only on (seed, split, step), never on the strategy or the
number of processes, so runs under different strategies see identical data step by step.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


class DataError(ValueError):
    """The data file cannot be used; the message says which file, what is wrong and how to fix it."""


def load_text(path: str | None) -> tuple[str, str]:
    """The corpus text and a description of where it came from. Raises DataError for a missing, empty or
    non-UTF-8 file."""
    if path is None:
        from pydoc_data.topics import topics

        return "\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics (Python documentation)"
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file {p} does not exist (or is not a file); pass --data with a UTF-8 text file, or "
                        f"omit --data to train on the Python documentation")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {p} is not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. "
                        f"iconv -f latin1 -t utf-8 {p} > {p.stem}.utf8.txt") from None
    if len(text) < 2:
        raise DataError(f"data file {p} is empty; pass a text file with at least a few thousand characters")
    return text, str(p)


@dataclass(frozen=True)
class CharTokenizer:
    """Characters ↔ ids; the vocabulary is the sorted set of characters of the corpus."""

    chars: str

    @classmethod
    def fit(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """int64 ids [len(text)]; raises DataError for a character outside the vocabulary."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise DataError(f"character {e.args[0]!r} is not in the model's vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass(frozen=True)
class Corpus:
    """Encoded train/validation splits (first 90 % / last 10 % of the text) and the tokenizer."""

    tokenizer: CharTokenizer
    train: torch.Tensor
    val: torch.Tensor
    source: str

    @classmethod
    def load(cls, path: str | None, seq_len: int) -> Corpus:
        text, source = load_text(path)
        tok = CharTokenizer.fit(text)
        ids = tok.encode(text)
        n = int(len(ids) * 0.9)
        train, val = ids[:n], ids[n:]
        if len(val) <= seq_len + 1:
            raise DataError(f"data from {source} has {len(ids)} characters: too few for --seq-len {seq_len} "
                            f"(the validation split needs more than {seq_len + 1}); use more text or a shorter "
                            f"--seq-len")
        return cls(tok, train, val, source)

    def batch(self, split: str, step: int, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
        """Inputs ``idx`` and ``targets`` (next characters), both int64 [batch_size, seq_len], from random
        offsets that depend only on (seed, split, step)."""
        data = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        idx = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
        targets = torch.stack([data[s + 1:s + 1 + seq_len] for s in starts.tolist()])
        return {"idx": idx, "targets": targets}

    def unigram_loss(self) -> float:
        """Cross-entropy (nats/char) of the validation split under the train split's character frequencies —
        the baseline a model must beat to have learnt anything beyond letter frequencies."""
        counts = Counter(self.train.tolist())
        total = sum(counts.values())
        v = self.tokenizer.vocab_size
        # add-one smoothing so characters unseen in train have a finite cost
        logp = {c: math.log((counts.get(c, 0) + 1) / (total + v)) for c in range(v)}
        return -sum(logp[c] for c in self.val.tolist()) / len(self.val)
