"""Tokenizers of ``shardflow train``: text ↔ token ids, every kind a Hugging Face ``tokenizers`` tokenizer, so every
kind is saved, cached and shipped the same way — as one ``tokenizer.json`` that ``tokenizers.Tokenizer.from_file``
and ``transformers.PreTrainedTokenizerFast(tokenizer_file=...)`` read.

``--tokenizer`` chooses (:class:`TokenizerChoice`):

* ``bpe`` — a byte-level BPE (GPT-2's scheme: the text's UTF-8 bytes, merged pairwise) trained on the corpus to
  ``--vocab-size`` tokens, the 256 bytes included; it encodes any text. Training is deterministic: the same
  documents and vocabulary size give a byte-identical ``tokenizer.json``.
* ``char`` — one token per character of the corpus (ids in the order of the sorted characters); a character the
  corpus lacks cannot be encoded.
* a path — an existing ``tokenizer.json`` (e.g. the one a checkpoint holds), used as it is.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

TOKENIZER_FILE = "tokenizer.json"  # the file name a tokenizer is saved under, in caches and checkpoints


class TokenizerError(ValueError):
    """A tokenizer cannot be made, read or used; the message names it, says what is wrong and how to fix it."""


class Tokenizer:
    """Text ↔ token ids with a Hugging Face ``tokenizers.Tokenizer`` (``hf``). Ids are ``0 .. vocab_size - 1``."""

    def __init__(self, hf: tokenizers.Tokenizer):
        self.hf = hf
        self._json = hf.to_str()  # canonical serialisation: what is saved, hashed and compared

    @classmethod
    def train_bpe(cls, documents: Sequence[str], vocab_size: int) -> Tokenizer:
        """A byte-level BPE of at most ``vocab_size`` tokens (the 256 byte tokens included; fewer when the documents
        run out of pairs to merge) trained on ``documents``. Deterministic: same documents and size, same tokenizer."""
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        hf.train_from_iterator(documents, trainer=trainer, length=len(documents))
        return cls(hf)

    @classmethod
    def characters(cls, documents: Sequence[str]) -> Tokenizer:
        """One token per character of ``documents`` (a word-level model over single characters: id ``i`` is the
        ``i``-th of the sorted characters), no unknown token."""
        chars = sorted(set().union(*map(set, documents)))
        hf = tokenizers.Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}))
        hf.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), "isolated")  # every character alone
        hf.decoder = decoders.Fuse()
        return cls(hf)

    @classmethod
    def from_json(cls, text: str, where: str) -> Tokenizer:
        """The tokenizer a ``tokenizer.json`` text describes; ``where`` names it in the error. Raises
        TokenizerError."""
        try:
            return cls(tokenizers.Tokenizer.from_str(text))
        except Exception as e:  # noqa: BLE001 — tokenizers raises plain Exception for every parse error
            raise TokenizerError(
                f"{where} is not a tokenizer.json that Hugging Face tokenizers can read "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); pass the "
                f"tokenizer.json of a Hugging Face tokenizer, or --tokenizer bpe"
            ) from None

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        """Read the ``tokenizer.json`` at ``path``. Raises TokenizerError for a missing or unreadable file."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(
                f"tokenizer {path} cannot be read ({getattr(e, 'strerror', None) or e}); pass "
                f"--tokenizer bpe, char or an existing tokenizer.json"
            ) from None
        return cls.from_json(text, f"tokenizer {path}")

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the model's vocabulary V)."""
        return self.hf.get_vocab_size()

    @property
    def kind(self) -> str:
        """The tokenizer's model in words (``BPE``, ``WordLevel``, ``Unigram``, ...)."""
        return type(self.hf.model).__name__

    def describe(self) -> str:
        """One phrase for banners and messages, e.g. ``BPE, 4096 tokens``."""
        return f"{self.kind}, {self.vocab_size} tokens"

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (canonical: the same tokenizer gives the same text)."""
        return self._json

    @property
    def sha256(self) -> str:
        """Hex sha256 of :meth:`to_json`: the tokenizer's identity in caches and checkpoints."""
        return hashlib.sha256(self._json.encode()).hexdigest()

    def save(self, path: Path) -> None:
        """Write :meth:`to_json` to ``path``."""
        path.write_text(self._json, encoding="utf-8")

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``. Raises TokenizerError naming the characters it cannot encode."""
        try:
            return self.hf.encode(text).ids
        except Exception:  # noqa: BLE001 — e.g. WordLevel's "Missing [UNK] token"
            raise TokenizerError(
                f"the tokenizer ({self.describe()}) cannot encode the characters "
                f"{', '.join(map(repr, self.unknown(text)))}"
            ) from None

    def encode_documents(self, documents: Sequence[str]) -> list[list[int]]:
        """The token ids of each document (encoded in parallel). Raises TokenizerError like :meth:`encode`."""
        try:
            return [e.ids for e in self.hf.encode_batch(list(documents))]
        except Exception:  # noqa: BLE001
            raise TokenizerError(
                f"the tokenizer ({self.describe()}) cannot encode the characters "
                f"{', '.join(map(repr, self.unknown(''.join(documents))))}"
            ) from None

    def unknown(self, text: str) -> list[str]:
        """The characters of ``text`` this tokenizer cannot encode, sorted (none for byte-level BPE)."""
        bad = []
        for c in sorted(set(text)):
            try:
                self.hf.encode(c)
            except Exception:  # noqa: BLE001
                bad.append(c)
        return bad

    @property
    def byte_level(self) -> bool:
        """Whether tokens are UTF-8 bytes (byte-level BPE: a token may hold part of a character)."""
        return isinstance(self.hf.decoder, decoders.ByteLevel)

    def token_bytes(self, id: int) -> bytes | None:
        """The UTF-8 bytes token ``id`` stands for, for a byte-level tokenizer (a token may hold part of a
        character); None for other tokenizers (their tokens are whole characters: use :meth:`decode`)."""
        if not self.byte_level:
            return None
        token = self.hf.id_to_token(int(id))
        if token is None:
            return b""
        table = _unicode_to_byte()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode()  # an added token, kept as its text

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (a byte-level token sequence cut inside a character ends with U+FFFD)."""
        return self.hf.decode(list(map(int, ids)), skip_special_tokens=False)


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the printable character that stands for each of the 256 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class TokenizerKind(StrEnum):
    """What ``--tokenizer`` names: train a BPE, take the characters, or read a file."""

    BPE = "bpe"
    CHAR = "char"
    FILE = "file"


@dataclass(frozen=True)
class TokenizerChoice:
    """The tokenizer a run asks for: ``kind``, with ``vocab_size`` (BPE) or ``path`` (a tokenizer.json)."""

    kind: TokenizerKind
    vocab_size: int = 0
    path: Path | None = None

    @classmethod
    def of(cls, value: str, vocab_size: int) -> TokenizerChoice:
        """``--tokenizer`` (``bpe``, ``char`` or a path) and ``--vocab-size``. Raises TokenizerError for a path that
        is not a file."""
        if value in (TokenizerKind.BPE, TokenizerKind.CHAR):
            return cls(TokenizerKind(value), vocab_size if value == TokenizerKind.BPE else 0)
        path = Path(value)
        if not path.is_file():
            raise TokenizerError(
                f"--tokenizer {value}: neither bpe, char nor an existing file; pass bpe (train a "
                f"byte-level BPE on the data), char (one token per character) or the path of a "
                f"tokenizer.json"
            )
        return cls(TokenizerKind.FILE, path=path)

    @property
    def key(self) -> str:
        """Directory name of this choice in the data cache: ``bpe-4096``, ``char`` or ``file-<sha256 prefix>``."""
        if self.kind == TokenizerKind.FILE:
            return f"file-{hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]}"
        return f"bpe-{self.vocab_size}" if self.kind == TokenizerKind.BPE else "char"

    def make(self, documents: Sequence[str]) -> Tokenizer:
        """The tokenizer, trained on ``documents`` (bpe, char) or read from the file."""
        if self.kind == TokenizerKind.BPE:
            return Tokenizer.train_bpe(documents, self.vocab_size)
        if self.kind == TokenizerKind.CHAR:
            return Tokenizer.characters(documents)
        return Tokenizer.load(self.path)
