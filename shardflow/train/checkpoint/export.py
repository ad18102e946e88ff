"""Hugging Face out and in, and a checkpoint outside training. On one process (the full tensors, whatever
strategy wrote them): the plain module with its weights (``shardflow generate``) and a Hugging Face model
directory (``shardflow export``) — ``config.json``, ``model.safetensors``, ``generation_config.json`` and the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``) — that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load; and such a directory as the start of a run (``--init-from``,
:class:`Pretrained`), each rank reading only its pieces of the weights."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from shardflow import failure
from shardflow.train.checkpoint.dcp import Checkpoint, model_entries, read
from shardflow.train.checkpoint.store import CheckpointError, check_writable, find
from shardflow.train.family import Family, is_hf
from shardflow.train.tokenizer import TOKENIZER_FILE, Tokenizer


def load_model(path: str | os.PathLike) -> tuple[Family, torch.nn.Module, Checkpoint]:
    """The family, the plain module (``family.build``) with the weights of the checkpoint at ``path`` (see
    :func:`~shardflow.train.checkpoint.store.find`) in eval mode, and the checkpoint. Raises CheckpointError."""
    ck = read(find(path))
    family = ck.family()
    config = ck.config(family)
    torch.manual_seed(0)
    model = family.build(config)
    names = [n for n, _ in model.named_parameters()]
    tensors = ck.load(model_entries(model, names))
    # not strict: a tied weight (GPT-2's lm_head) is one parameter under its first name, and loads under it
    model.load_state_dict({n: tensors[f"model/{n}"] for n in names}, strict=False)
    return family, model.eval(), ck


def hf_tokenizer(tok: Tokenizer):
    """``tok`` as a transformers ``PreTrainedTokenizerFast`` (what ``AutoTokenizer`` loads from a saved directory)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok.hf, clean_up_tokenization_spaces=False)


def export(path: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, Checkpoint]:
    """Write the checkpoint at ``path`` as the Hugging Face model directory ``out`` (module's ``save_pretrained``
    with safetensors, and the run's tokenizer). Written into a temporary sibling and renamed: ``out`` is whole or
    absent. Raises CheckpointError for an ``out`` that exists (nothing is overwritten) or cannot be written (checked
    before the checkpoint is read) and for a model that is not a Hugging Face ``PreTrainedModel``."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(
            f"--out {out} already exists; shardflow export writes a new directory and overwrites "
            f"nothing: pass another --out, or remove {out} first"
        )
    if not out.parent.is_dir():
        why = "is a file" if out.parent.exists() else "does not exist"
        raise CheckpointError(f"--out {out}: directory {out.parent} {why}; create it or write elsewhere")
    check_writable(out.parent, "directory of --out", "pass --out with a directory you can write")  # before loading
    family, model, ck = load_model(path)
    if not is_hf(model):
        raise CheckpointError(
            f"checkpoint {ck.path} holds a {type(model).__name__} ({family.name}), not a Hugging "
            f"Face PreTrainedModel: shardflow export writes Hugging Face directories; train "
            f"--model llama, gpt2 or a factory that returns a transformers model"
        )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the command prints its own line
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        hf_tokenizer(ck.tokenizer).save_pretrained(tmp)
        _plain_modes(tmp)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left
        # a full disk or a refused permission: an OSError, or safetensors' own error wrapping one
        if isinstance(e, OSError) or failure.is_space(e) or failure.is_denied(e):
            room = " with free space" if failure.is_space(e) else ""
            raise CheckpointError(
                f"cannot write --out {out} ({failure.reason(e)}); nothing was written: choose a writable location{room}"
            ) from None
        raise
    return out, ck


def _plain_modes(root: Path) -> None:
    """Give every file under ``root`` the mode ``open`` gives a new file, 0666 less the umask: safetensors writes
    ``model.safetensors`` through a private temporary file and leaves it 0600. (The umask is read by setting it: this
    runs on one thread, in ``shardflow export``.)"""
    mask = os.umask(0o022)
    os.umask(mask)
    for p in root.rglob("*"):
        if p.is_file():
            p.chmod(0o666 & ~mask)


def check_safetensors(path: Path, prefix: str = "") -> None:
    """Raise CheckpointError naming ``path`` when it is not a whole safetensors file (its header is unreadable, or
    the file is shorter than the header says: cut short by a full disk or an interrupted copy). Reads the header
    only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{prefix}{path} is corrupt or truncated ({failure.reason(e)}): it was cut short by a full disk or an "
            f"interrupted copy, or is not a safetensors file; write it again (shardflow export, or "
            f"save_pretrained(safe_serialization=True))"
        ) from None


def nonfinite(model: torch.nn.Module) -> tuple[str, str] | None:
    """The first parameter or buffer of ``model`` that holds NaN or inf, and which ("NaN" or "inf"); None when all
    are finite."""
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return n, "NaN" if bool(torch.isnan(t).any()) else "inf"
    return None


class LazyPiece:
    """One weight of a safetensors file, read only where it is indexed: ``w[slices]`` reads that block (what an
    executor's ``_put`` does for the pieces it holds) in ``dtype`` (the model's). ``shape``: the full tensor's."""

    def __init__(self, part, shape: tuple[int, ...], dtype: torch.dtype, name: str = "", where: str = ""):
        self.part, self.shape, self.dtype = part, shape, dtype
        self.name, self.where = name, where  # the weight's name and "--init-from DIR: FILE", for errors

    def __getitem__(self, index) -> torch.Tensor:
        block = self.part[index]
        if block.is_floating_point() and not bool(torch.isfinite(block).all()):
            bad = "NaN" if bool(torch.isnan(block).any()) else "inf"
            raise CheckpointError(
                f"{self.where} holds {bad} in weight {self.name}: the model it stores is broken (its "
                f"training diverged, or the file was damaged), not this run's settings; pass a directory whose "
                f"weights are finite (export another checkpoint)"
            )
        return block.to(self.dtype)


@dataclass(frozen=True)
class Pretrained:
    """A Hugging Face model directory for ``--init-from``: its ``config.json``, ``tokenizer.json`` and
    ``model.safetensors``."""

    path: Path

    @property
    def config_file(self) -> Path:
        return self.path / "config.json"

    @property
    def tokenizer_file(self) -> Path:
        return self.path / TOKENIZER_FILE

    @property
    def weights_file(self) -> Path:
        return self.path / "model.safetensors"

    @classmethod
    def open(cls, path: Path) -> Pretrained:
        """The directory at ``path``; raises CheckpointError naming the file it lacks."""
        p = cls(path)
        for f, what in (
            (p.config_file, "config.json"),
            (p.tokenizer_file, "tokenizer.json (a fast tokenizer)"),
            (p.weights_file, "model.safetensors (one file)"),
        ):
            if not f.is_file():
                raise CheckpointError(
                    f"--init-from {path}: no {what} in it; pass a Hugging Face model directory "
                    f"as shardflow export or save_pretrained(safe_serialization=True) writes it"
                )
        check_safetensors(p.weights_file, f"--init-from {path}: ")
        return p

    def weights(self, params: Mapping[str, torch.Tensor]) -> dict[str, LazyPiece]:
        """Lazy readers of the weights ``params`` names (graph names → the model's parameters, whose shapes they
        must have; pieces come in the parameters' dtypes). Raises CheckpointError for a weight the file lacks or
        holds in another shape."""
        from safetensors import safe_open

        f = safe_open(str(self.weights_file), framework="pt")
        stored = set(f.keys())
        missing = [n for n in params if n not in stored]
        fix = "pass the directory of a model of this architecture and size"
        if missing:
            raise CheckpointError(
                f"--init-from {self.path}: {self.weights_file.name} has no "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} ({len(missing)} "
                f"weights of the model missing); {fix}"
            )
        out = {}
        for n, p in params.items():
            part = f.get_slice(n)
            shape = tuple(part.get_shape())
            if shape != tuple(p.shape):
                raise CheckpointError(
                    f"--init-from {self.path}: {n} is {list(shape)} in {self.weights_file.name}, "
                    f"the model needs {list(p.shape)}; {fix}"
                )
            out[n] = LazyPiece(part, shape, p.dtype, n, f"--init-from {self.path}: {self.weights_file}")
        return out
