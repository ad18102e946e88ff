"""Text data for ``shardflow train``: the corpus, its tokens in a memory-mapped file, deterministic batches.

``--data`` is a UTF-8 text file, a directory (every file under it that is not hidden, in sorted order) or a glob
(``books/**/*.txt``); each file is one document. Without it the corpus is the Python documentation that ships with
every CPython (``pydoc_data.topics``, one document per topic), so training needs no download.

The tokenizer (:mod:`shardflow.train.tokenizer`) and the corpus's token ids are made once and cached, keyed by the
corpus's sha256 and the tokenizer choice (nanoGPT's ``train.bin``, torchtitan's pre-tokenized shards)::

    CACHE/<corpus sha256, 16 hex digits>/<bpe-4096 | char | file-<sha256 prefix>>/
        tokenizer.json   the tokenizer (Hugging Face tokenizers format)
        tokens.bin       every document's token ids, one after the other: uint16 (vocabulary ≤ 65,536) or uint32
        tokens.json      corpus hash, tokenizer hash, dtype and token count

``CACHE`` is ``--cache-dir``, else ``.shardflow-cache`` next to the data (the file's directory, the directory, or the
glob's fixed leading directories), else — for the default corpus — ``$XDG_CACHE_HOME/shardflow`` or
``~/.cache/shardflow``. An entry is written into a temporary directory and renamed, so processes that build the same
entry at once (every rank under torchrun) leave one complete entry. The same corpus and choice give byte-identical
files. The first 90 % of the tokens are the training split, the rest validation; batches are windows at random
offsets that depend only on (seed, split, step), never on the strategy or the number of processes.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from array import array
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from shardflow.train.tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerChoice, TokenizerError

TOKENS_FILE = "tokens.bin"
META_FILE = "tokens.json"
CACHE_DIR_NAME = ".shardflow-cache"
VAL_FRACTION = 0.1
DEFAULT_SOURCE = "pydoc_data.topics (Python documentation)"

# token file dtypes: the array typecode that writes it and the torch dtype that maps it, by name
_DTYPES = {"uint16": ("H", torch.uint16), "uint32": ("I", torch.uint32)}


class DataError(ValueError):
    """The data cannot be used; the message says which file, what is wrong and how to fix it."""


class Split(StrEnum):
    """The part of the corpus a batch is drawn from."""

    TRAIN = "train"
    VAL = "val"


# --- the text ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """The documents of a corpus (each ends with a newline), a description of where they came from, the directory
    its cache lives in by default, and their sha256 (over each document's length and UTF-8 bytes)."""

    documents: tuple[str, ...]
    source: str
    cache_root: Path
    sha256: str

    @classmethod
    def of(cls, documents: tuple[str, ...], source: str, cache_root: Path) -> Text:
        """The text of ``documents``, with their sha256."""
        h = hashlib.sha256()
        for d in documents:
            b = d.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        return cls(documents, source, cache_root, h.hexdigest())

    @property
    def chars(self) -> int:
        """Characters in all documents."""
        return sum(map(len, self.documents))


def default_cache() -> Path:
    """The cache of the default corpus: ``$XDG_CACHE_HOME/shardflow``, else ``~/.cache/shardflow``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardflow"


def data_files(spec: str) -> tuple[list[Path], Path]:
    """The files ``--data`` names — a file, a directory (every file under it that is not hidden, sorted by
    relative path) or a glob (``**`` recursive; matches sorted) — and the directory next to which their cache
    lives. Raises DataError when nothing is found."""
    p = Path(spec)
    if p.is_file():
        return [p], p.parent
    if p.is_dir():
        files = sorted(
            f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not files:
            raise DataError(
                f"data directory {p} holds no files (hidden ones are skipped); put UTF-8 text files in "
                f"it, or pass --data with a file or a glob"
            )
        return files, p
    if _has_magic(spec):
        files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(
                f"--data {spec}: no file matches the pattern; check it (** matches any depth: "
                f"'books/**/*.txt'), or pass a file or a directory"
            )
        fixed = p.parts[:-1]
        stop = next((i for i, part in enumerate(fixed) if _has_magic(part)), len(fixed))
        return files, Path(*fixed[:stop]) if stop else Path(".")
    raise DataError(
        f"data file {p} does not exist (or is not a file); pass --data with a UTF-8 text file, a "
        f"directory or a glob, or omit --data to train on the Python documentation"
    )


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def load_text(spec: str | None) -> Text:
    """The corpus ``--data`` names (``None``: the Python documentation), one document per file (per topic), each
    ending with a newline. Raises DataError for a missing, empty or non-UTF-8 file."""
    if spec is None:
        from pydoc_data.topics import topics

        return Text.of(tuple(_ending(topics[k]) for k in sorted(topics)), DEFAULT_SOURCE, default_cache())
    files, root = data_files(spec)
    docs = []
    for f in files:
        try:
            docs.append(_ending(f.read_bytes().decode("utf-8")))
        except UnicodeDecodeError as e:
            narrow = (
                f"; or narrow --data to the text files with a glob such as '{spec.rstrip('/')}/**/*.txt'"
                if Path(spec).is_dir()
                else ""
            )
            raise DataError(
                f"data file {f} is not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. "
                f"iconv -f latin1 -t utf-8 {f} > {f.stem}.utf8.txt{narrow}"
            ) from None
    source = str(files[0]) if len(files) == 1 else f"{spec} ({len(files)} files)"
    text = Text.of(tuple(docs), source, root / CACHE_DIR_NAME)
    if text.chars < 2:
        what = f"data file {files[0]} is" if len(files) == 1 else f"the {len(files)} files of --data {spec} are"
        raise DataError(f"{what} empty; pass a text file with at least a few thousand characters")
    return text


def _ending(doc: str) -> str:
    return doc if not doc or doc.endswith("\n") else doc + "\n"


# --- the token file ----------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> str:
    """The token file's dtype name for a vocabulary of ``vocab_size`` ids: ``uint16`` up to 65,536, else ``uint32``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def write_tokens(path: Path, documents: list[list[int]], dtype: str) -> int:
    """Write the ids of every document, one after the other, to ``path`` as ``dtype`` (native byte order). Returns
    the number of tokens."""
    ids = array(_DTYPES[dtype][0])
    for d in documents:
        ids.extend(d)
    path.write_bytes(ids.tobytes())
    return len(ids)


def read_tokens(path: Path, count: int, dtype: str) -> torch.Tensor:
    """The ``count`` token ids of ``path``, memory-mapped (read lazily, never written): a ``dtype`` tensor [count]."""
    return torch.from_file(str(path), shared=False, size=count, dtype=_DTYPES[dtype][1])


@dataclass(frozen=True)
class Entry:
    """A cache entry: the tokenizer and the memory-mapped tokens of one corpus, and whether this load built it."""

    path: Path
    tokenizer: Tokenizer
    tokens: torch.Tensor
    built: bool


def cache_entry(text: Text, choice: TokenizerChoice, cache_dir: Path | None = None) -> Entry:
    """The cache entry of ``text`` tokenized as ``choice`` under ``cache_dir`` (default ``text.cache_root``): read if
    it exists, else built (tokenizer trained or read, every document encoded) and renamed into place. Raises
    DataError for a cache that cannot be written, a document the tokenizer cannot encode, or an entry that does
    not hold what its ``tokens.json`` says; TokenizerError for a tokenizer.json that cannot be read."""
    root = cache_dir or text.cache_root
    final = root / text.sha256[:16] / choice.key
    if (final / META_FILE).is_file():
        return _read_entry(final, text, built=False)
    tok = choice.make(text.documents)  # raises TokenizerError for an unreadable tokenizer.json
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        dtype = token_dtype(tok.vocab_size)
        tok.save(tmp / TOKENIZER_FILE)
        count = write_tokens(tmp / TOKENS_FILE, tok.encode_documents(text.documents), dtype)
        meta = {
            "source": text.source,
            "corpus_sha256": text.sha256,
            "documents": len(text.documents),
            "chars": text.chars,
            "tokenizer": tok.describe(),
            "tokenizer_sha256": tok.sha256,
            "dtype": dtype,
            "tokens": count,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its (identical) entry first
            if not (final / META_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return _read_entry(final, text, built=False)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(
            f"cannot write the data cache {root} ({e.strerror or e}); pass --cache-dir with a directory you can write"
        ) from None
    except TokenizerError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"data from {text.source}: {e}") from None
    return _read_entry(final, text, built=True)


def _read_entry(path: Path, text: Text, built: bool) -> Entry:
    fix = f"remove {path} and run again (it is rebuilt)"
    try:
        meta = json.loads((path / META_FILE).read_text())
        tok = Tokenizer.load(path / TOKENIZER_FILE)
        count, dtype = int(meta["tokens"]), meta["dtype"]
        size = (path / TOKENS_FILE).stat().st_size
        want = count * _DTYPES[dtype][1].itemsize
        problem = (
            "it was made from another corpus"
            if meta["corpus_sha256"] != text.sha256
            else "its tokenizer.json was changed"
            if meta["tokenizer_sha256"] != tok.sha256
            else f"{TOKENS_FILE} has {size} bytes, not {want}"
            if size != want
            else None
        )
    except (OSError, ValueError, KeyError, TypeError) as e:  # TokenizerError is a ValueError
        problem = f"{type(e).__name__}: {e}"
    if problem:
        raise DataError(f"data cache entry {path} is corrupt ({problem}); {fix}")
    return Entry(path, tok, read_tokens(path / TOKENS_FILE, count, dtype), built)


# --- the corpus ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """The tokens of a corpus (memory-mapped, [N] uint16 or uint32): the first 90 % for training, the rest for
    validation; its tokenizer, a description of the source, the corpus's sha256 and its characters, and the cache
    entry it was read from (``built``: this load made it)."""

    tokenizer: Tokenizer
    tokens: torch.Tensor
    source: str
    sha256: str
    chars: int
    cache: Path
    built: bool

    @classmethod
    def load(cls, data: str | None, tokenizer: TokenizerChoice, seq_len: int, cache_dir: str | None = None) -> Corpus:
        """The corpus ``--data`` names, tokenized as ``tokenizer`` (cached in ``cache_dir``, default next to the
        data). Raises DataError for unusable data, a cache that cannot be written, a validation split too short
        for ``seq_len``, or a training split that is one token repeated."""
        text = load_text(data)
        entry = cache_entry(text, tokenizer, Path(cache_dir) if cache_dir else None)
        corpus = cls(entry.tokenizer, entry.tokens, text.source, text.sha256, text.chars, entry.path, entry.built)
        if len(corpus.val) <= seq_len + 1:
            raise DataError(
                f"data from {text.source} has {text.chars} characters, {len(entry.tokens)} tokens "
                f"({entry.tokenizer.describe()}): too few for --seq-len {seq_len} (the validation split, "
                f"the last {VAL_FRACTION:.0%}, needs more than {seq_len + 1} tokens); use more text or a "
                f"shorter --seq-len"
            )
        train = corpus.train
        if not bool((train != train[0]).any()):
            raise DataError(
                f"data from {text.source}: its training split (the first {1 - VAL_FRACTION:.0%}, "
                f"{len(train):,} tokens) is one token repeated, "
                f"{entry.tokenizer.decode([int(train[0])])!r}: a model has nothing to learn from it (it "
                f"predicts that token and its loss is 0); use a text with more than one distinct "
                f"character"
            )
        return corpus

    @property
    def train(self) -> torch.Tensor:
        """The training split: the first 90 % of the tokens, [N_train]."""
        return self.tokens[: self._cut]

    @property
    def val(self) -> torch.Tensor:
        """The validation split: the last 10 % of the tokens, [N_val]."""
        return self.tokens[self._cut :]

    @property
    def _cut(self) -> int:
        return int(len(self.tokens) * (1 - VAL_FRACTION))

    def batch(self, split: Split, step: int, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
        """Inputs ``idx`` and ``targets`` (the next tokens), both int64 [batch_size, seq_len]: windows of ``split`` at
        random offsets that depend only on (seed, split, step)."""
        data = self.train if split == Split.TRAIN else self.val
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != Split.TRAIN))
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()  # [B, T + 1]
        return {"idx": rows[:, :-1].contiguous(), "targets": rows[:, 1:].contiguous()}

    def unigram_loss(self) -> float:
        """Cross-entropy (nats/token) of the validation split under the training split's token frequencies — the
        baseline a model must beat to have learnt anything beyond token frequencies."""
        v = self.tokenizer.vocab_size
        counts = torch.bincount(self.train.long(), minlength=v).double()
        # add-one smoothing so tokens unseen in training have a finite cost
        logp = torch.log((counts + 1) / (counts.sum() + v))
        return -logp[self.val.long()].mean().item()
