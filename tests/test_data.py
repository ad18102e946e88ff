"""The data layer of `shardflow train`: tokenizers (byte-level BPE, characters, a tokenizer.json), the cache of the
tokenizer and the memory-mapped token file (keyed by the corpus hash, byte-identical across builds), `--data` as a
file, directory or glob, deterministic batches, the unigram baseline in tokens, and the tokenizer travelling with a
run's checkpoints (generate and resume use it)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter

import pytest
import torch
from conftest import patience

from shardflow.cli import main as cli_main
from shardflow.train import data
from shardflow.train.data import (
    CACHE_DIR_NAME,
    META_FILE,
    TOKENS_FILE,
    Corpus,
    DataError,
    Split,
    cache_entry,
    data_files,
    load_text,
    read_tokens,
    token_dtype,
    write_tokens,
)
from shardflow.train.tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerChoice, TokenizerError, TokenizerKind

BPE = TokenizerChoice(TokenizerKind.BPE, 300)
CHAR = TokenizerChoice(TokenizerKind.CHAR)
TEXT = "the quick brown fox jumps over the lazy dog. " * 200


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "data" / "text.txt"
    path.parent.mkdir()
    path.write_text(TEXT)
    return path


# --- tokenizers -----------------------------------------------------------------------------------------------------


def test_bpe_round_trips_any_text_and_merges_frequent_words():
    tok = Tokenizer.train_bpe([TEXT], 300)
    assert tok.kind == "BPE" and 256 < tok.vocab_size <= 300
    assert len(tok.encode("the lazy dog")) == 3  # a token per word (with its leading space)
    for text in ("the lazy dog", "Ünïcode → 🙂\n\tend", ""):
        assert tok.decode(tok.encode(text)) == text  # byte-level: nothing is unknown
    assert tok.unknown("Ünïcode 🙂") == []


def test_bpe_training_is_deterministic_across_processes(tmp_path):
    """The same documents and vocabulary size give a byte-identical tokenizer.json and token file, here built in this
    process and in a fresh interpreter (its own hash seeds)."""
    docs = [TEXT, "Some other document, with Capitals and 123 numbers.\n" * 50]
    text = data.Text.of(tuple(docs), "test", tmp_path)
    here = cache_entry(text, BPE, tmp_path / "here")
    code = (
        f"import sys; from pathlib import Path; from shardflow.train import data; from shardflow.train.tokenizer "
        f"import TokenizerChoice, TokenizerKind; docs = {docs!r}; "
        f"t = data.Text.of(tuple(docs), 'test', Path('.')); "
        f"data.cache_entry(t, TokenizerChoice(TokenizerKind.BPE, 300), Path(sys.argv[1]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "there")],
        check=True,
        timeout=patience(120),
        env={**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    there = tmp_path / "there" / here.path.relative_to(tmp_path / "here")
    for name in (TOKENIZER_FILE, TOKENS_FILE, META_FILE):
        assert (here.path / name).read_bytes() == (there / name).read_bytes(), name
    assert Tokenizer.train_bpe(docs, 300).to_json() == here.tokenizer.to_json()


def test_char_tokenizer_ids_are_the_sorted_characters():
    tok = Tokenizer.characters(["hello world\n"])
    assert tok.kind == "WordLevel" and tok.vocab_size == 9
    assert tok.encode("hello") == [4, 3, 5, 5, 6]  # ids of the sorted characters "\n", " ", d, e, h, l, o, r, w
    assert tok.decode(tok.encode("world\n")) == "world\n"
    assert tok.unknown("Hello, world!") == ["!", ",", "H"]
    with pytest.raises(TokenizerError, match="cannot encode the characters '!', ',', 'H'"):
        tok.encode("Hello, world!")


def test_tokenizer_file_choice(tmp_path):
    tok = Tokenizer.train_bpe([TEXT], 300)
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    choice = TokenizerChoice.of(str(path), vocab_size=999)  # --vocab-size applies to bpe only
    assert choice.kind == TokenizerKind.FILE and choice.make([]).sha256 == tok.sha256
    assert TokenizerChoice.of("bpe", 512) == TokenizerChoice(TokenizerKind.BPE, 512)
    assert TokenizerChoice.of("char", 512) == CHAR
    with pytest.raises(TokenizerError, match="--tokenizer nope.json: neither bpe, char nor an existing file"):
        TokenizerChoice.of("nope.json", 512)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=f"tokenizer {bad} is not a tokenizer.json that Hugging Face"):
        TokenizerChoice.of(str(bad), 512).make([])


def test_tokenizer_that_cannot_encode_the_data(text_file, tmp_path):
    path = tmp_path / "abc.json"
    Tokenizer.characters(["abc \n"]).save(path)
    with pytest.raises(
        DataError,
        match=r"data from .*text.txt: the tokenizer \(WordLevel, 5 tokens\) cannot encode the "
        r"characters '\.', 'd', 'e', ",
    ):
        Corpus.load(str(text_file), TokenizerChoice.of(str(path), 0), 16)
    assert not list((text_file.parent / CACHE_DIR_NAME).rglob("tokens.bin"))  # nothing left behind


# --- --data: files, directories, globs ------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """books/a.txt, books/b/c.txt, books/b/d.md, books/.hidden/x.txt, books/.shardflow-cache/y.txt"""
    books = tmp_path / "books"
    for name, content in (
        ("a.txt", "alpha"),
        ("b/c.txt", "gamma\n"),
        ("b/d.md", "# delta"),
        (".hidden/x.txt", "hidden"),
        (f"{CACHE_DIR_NAME}/y.txt", "cache"),
    ):
        (books / name).parent.mkdir(parents=True, exist_ok=True)
        (books / name).write_text(content)
    return books


def test_data_directory_takes_every_visible_file_sorted(tree):
    files, root = data_files(str(tree))
    assert [f.relative_to(tree).as_posix() for f in files] == ["a.txt", "b/c.txt", "b/d.md"] and root == tree
    text = load_text(str(tree))
    assert text.documents == ("alpha\n", "gamma\n", "# delta\n")  # each document ends with a newline
    assert text.source == f"{tree} (3 files)" and text.cache_root == tree / CACHE_DIR_NAME


def test_data_glob_is_sorted_and_its_cache_sits_in_the_fixed_directories(tree):
    files, root = data_files(f"{tree}/**/*.txt")
    assert [f.relative_to(tree).as_posix() for f in files] == ["a.txt", "b/c.txt"] and root == tree
    files, root = data_files(f"{tree}/b/*.md")
    assert [f.name for f in files] == ["d.md"] and root == tree / "b"
    with pytest.raises(DataError, match=r"--data .*/\*\.csv: no file matches the pattern"):
        data_files(f"{tree}/*.csv")


def test_data_errors(tmp_path, tree):
    with pytest.raises(DataError, match="data file .*missing.txt does not exist"):
        data_files(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="data directory .*empty holds no files"):
        data_files(str(tmp_path / "empty"))
    (tree / "b" / "latin.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(
        DataError,
        match=r"data file .*latin.txt is not UTF-8 text .*narrow --data to the text files "
        r"with a glob such as '.*books/\*\*/\*\.txt'",
    ):
        load_text(str(tree))
    (tmp_path / "e1.txt").write_text("")
    with pytest.raises(DataError, match="data file .*e1.txt is empty"):
        load_text(str(tmp_path / "e1.txt"))


def test_default_corpus_is_the_python_documentation():
    from pydoc_data.topics import topics

    text = load_text(None)
    assert len(text.documents) == len(topics) and text.cache_root == data.default_cache()
    assert text.source == data.DEFAULT_SOURCE


# --- the cache and the token file -----------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size, dtype", [(256, "uint16"), (65_536, "uint16"), (65_537, "uint32")])
def test_token_file_round_trip(tmp_path, vocab_size, dtype):
    assert token_dtype(vocab_size) == dtype
    docs = [[0, 1, vocab_size - 1], [], [7, vocab_size // 2]]
    path = tmp_path / "tokens.bin"
    assert write_tokens(path, docs, dtype) == 5
    assert path.stat().st_size == 5 * {"uint16": 2, "uint32": 4}[dtype]
    t = read_tokens(path, 5, dtype)
    assert str(t.dtype) == f"torch.{dtype}"
    assert t.long().tolist() == [0, 1, vocab_size - 1, 7, vocab_size // 2]


def test_cache_is_next_to_the_data_and_a_second_load_reads_it(text_file, monkeypatch):
    first = Corpus.load(str(text_file), BPE, 16)
    assert first.built and first.cache == text_file.parent / CACHE_DIR_NAME / first.sha256[:16] / "bpe-300"
    meta = json.loads((first.cache / META_FILE).read_text())
    assert meta["tokens"] == len(first.tokens) and meta["corpus_sha256"] == first.sha256
    stamps = {p.name: p.stat().st_mtime_ns for p in first.cache.iterdir()}

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer was trained again")

    monkeypatch.setattr(Tokenizer, "train_bpe", no_training)
    again = Corpus.load(str(text_file), BPE, 16)
    assert not again.built and again.cache == first.cache
    assert {p.name: p.stat().st_mtime_ns for p in first.cache.iterdir()} == stamps  # nothing rewritten
    assert torch.equal(again.tokens.long(), first.tokens.long())
    assert again.tokenizer.sha256 == first.tokenizer.sha256
    # another vocabulary size or another text is another entry (and trains)
    with pytest.raises(AssertionError, match="trained again"):
        Corpus.load(str(text_file), TokenizerChoice(TokenizerKind.BPE, 290), 16)
    text_file.write_text(TEXT + "more")
    with pytest.raises(AssertionError, match="trained again"):
        Corpus.load(str(text_file), BPE, 16)


def test_cache_dir_flag_and_corrupt_or_unwritable_cache(text_file, tmp_path):
    corpus = Corpus.load(str(text_file), CHAR, 16, cache_dir=str(tmp_path / "elsewhere"))
    assert corpus.cache.parent.parent == tmp_path / "elsewhere" and corpus.cache.name == "char"
    tokens = corpus.cache / TOKENS_FILE
    tokens.write_bytes(tokens.read_bytes()[:100])
    with pytest.raises(
        DataError,
        match=r"data cache entry .* is corrupt \(tokens.bin has 100 bytes, not 18002\); "
        r"remove .* and run again",
    ):
        Corpus.load(str(text_file), CHAR, 16, cache_dir=str(tmp_path / "elsewhere"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DataError, match=f"cannot write the data cache {blocker}/c .*pass --cache-dir"):
        Corpus.load(str(text_file), CHAR, 16, cache_dir=str(blocker / "c"))


def test_splits_and_unigram_baseline_in_tokens(text_file):
    corpus = Corpus.load(str(text_file), CHAR, 16)
    n = len(corpus.tokens)
    assert n == len(TEXT) + 1 and len(corpus.train) == int(n * 0.9)  # the document's closing newline
    assert torch.equal(torch.cat([corpus.train, corpus.val]).long(), corpus.tokens.long())
    assert corpus.tokenizer.decode(corpus.tokens.tolist()) == TEXT + "\n"
    # the baseline by hand: add-one smoothed training frequencies, mean cross-entropy over the validation tokens
    counts, total, v = Counter(corpus.train.tolist()), len(corpus.train), corpus.tokenizer.vocab_size
    want = -sum(math.log((counts[t] + 1) / (total + v)) for t in corpus.val.tolist()) / len(corpus.val)
    assert corpus.unigram_loss() == pytest.approx(want, rel=1e-12)


# --- batches ------------------------------------------------------------------------------------------------------


def test_batches_depend_only_on_seed_split_and_step(text_file, tmp_path):
    a = Corpus.load(str(text_file), BPE, 16)
    b = Corpus.load(str(text_file), BPE, 16, cache_dir=str(tmp_path / "other"))  # another build of the same data
    later = a.batch(Split.TRAIN, 7, 8, 16, 0)  # drawn first: no state carried from call to call
    for split in Split:
        for step in (0, 1, 7):
            x = a.batch(split, step, 8, 16, 0)
            y = b.batch(split, step, 8, 16, 0)
            assert torch.equal(x["idx"], y["idx"]) and torch.equal(x["targets"], y["targets"])
            assert x["idx"].dtype == torch.int64 and x["idx"].shape == (8, 16)
            assert torch.equal(x["idx"][:, 1:], x["targets"][:, :-1])  # targets: the next tokens
    assert torch.equal(later["idx"], a.batch(Split.TRAIN, 7, 8, 16, 0)["idx"])
    base = a.batch(Split.TRAIN, 0, 8, 16, 0)["idx"]
    for other in (
        a.batch(Split.TRAIN, 1, 8, 16, 0),
        a.batch(Split.VAL, 0, 8, 16, 0),
        a.batch(Split.TRAIN, 0, 8, 16, 1),
    ):
        assert not torch.equal(base, other["idx"])
    # windows lie inside their split
    val = a.val.long().tolist()
    for row in a.batch(Split.VAL, 3, 8, 16, 0)["idx"].tolist():
        assert any(val[s : s + 16] == row for s in range(len(val) - 15))


# --- the tokenizer travels with the run -----------------------------------------------------------------------------


def test_char_run_saves_its_tokenizer_for_generate_and_resume(tmp_path, text_file, tiny, capsys):
    run = tmp_path / "run"
    argv = [
        "train",
        *tiny,
        "--steps",
        "2",
        "--data",
        str(text_file),
        "--run-dir",
        str(run),
        "--strategy",
        "single",
        "--nproc",
        "1",
    ]
    assert cli_main([*argv, "--tokenizer", "char"]) == 0
    assert "tokenizer: WordLevel, 29 tokens" in capsys.readouterr().out
    step2 = run / "checkpoints" / "step_2"
    saved = Tokenizer.load(step2 / TOKENIZER_FILE)
    assert saved.sha256 == Tokenizer.characters([TEXT + "\n"]).sha256
    # generate uses it: a character the text lacks cannot be encoded
    assert cli_main(["generate", str(run), "--prompt", "The Fox"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            "shardflow generate: error: --prompt has characters outside the model's vocabulary: "
            "'F', 'T'; the tokenizer of "
        )
        and "WordLevel, 29 tokens" in err
    )
    assert cli_main(["generate", str(run), "--prompt", "the ", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the ") and len(out.rstrip("\n")) == 4 + 5  # one character per token
    # resume: the run's tokenizer must be this one; the checkpoint's file gives it back
    assert cli_main([*argv, "--steps", "3", "--resume"]) == 2  # --tokenizer bpe: another tokenizer
    err = capsys.readouterr().err
    assert f"checkpoint {step2} was trained with another tokenizer: WordLevel, 29 tokens" in err
    assert f"resume with --tokenizer {step2 / TOKENIZER_FILE}" in err
    kept = tmp_path / "tokenizer.json"
    shutil.copy(step2 / TOKENIZER_FILE, kept)
    assert cli_main([*argv, "--steps", "3", "--resume", "--tokenizer", str(kept)]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_generate_writes_whole_characters_only():
    """A byte-level BPE splits "€" (3 UTF-8 bytes) over 3 byte tokens: generate shows it once all 3 are sampled, drops
    a stray continuation byte and an incomplete character at the end, and never writes U+FFFD (docs/execution.md
    promises whole characters; before, the text ended with U+FFFD)."""
    import io
    from types import SimpleNamespace

    import torch

    from shardflow.train.generate import sample
    from shardflow.train.tokenizer import Tokenizer, _unicode_to_byte

    tok = Tokenizer.train_bpe(["plain ascii text. " * 20], 260)  # no merge holds a byte of "€" or "é"
    assert tok.byte_level
    to_char = {b: c for c, b in _unicode_to_byte().items()}
    byte_ids = [tok.hf.token_to_id(to_char[b]) for b in "€a".encode() + b"\x82" + "b".encode() + "é".encode()[:1]]
    assert tok.token_bytes(byte_ids[0]) == b"\xe2"
    plan = iter(byte_ids)

    def logits(model, idx):  # the next planned token, whatever the context
        out = torch.zeros(1, idx.shape[1], tok.vocab_size)
        out[0, -1, next(plan)] = 1.0
        return out

    writes: list[str] = []

    class Out(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    out = Out()
    text = sample(SimpleNamespace(logits=logits), None, tok, 8, "x", len(byte_ids), 0.0, out=out)
    assert text == "x€ab" and out.getvalue() == "€ab", (text, out.getvalue())
    assert writes[0] == "€" and all("\ufffd" not in w for w in writes)
    assert tok.decode(byte_ids).endswith("\ufffd")  # what a plain decode shows
