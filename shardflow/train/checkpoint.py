"""Checkpoints of ``shardflow train`` on ``torch.distributed.checkpoint`` (DCP): complete or absent, and loadable
under any strategy and mesh.

Layout of the checkpoint directory (``--checkpoint-dir``, default ``RUN_DIR/checkpoints``)::

    step_3/            a complete checkpoint
      __0_0.distcp     DCP's data files (one per rank that wrote something)
      .metadata        DCP's index of the tensors in them
      shardflow.json   step, model sizes, tokenizer characters, training config, size and sha256 of every file
      COMPLETE         the marker, written last
    step_6.tmp/        a save in progress, or one that was interrupted: never read, removed by the next save

**What is saved, and why full tensors.** The model's weights by graph name (``model/<name>``; graph weight names
are the ``named_parameters()`` names of the module) and the optimizer state by value id
(``optim/opt:<slot>:<weight>``), every tensor whole (unsharded). Every rank assembles the full tensors with the
executor's collective ``weights()`` / ``state()`` and hands the same state dict to ``dcp.save``, which
deduplicates identical entries across ranks (each tensor is written by one rank, the bytes spread over the
ranks) and coordinates the write. Loading reads full-size tensors on every rank and the executor keeps its own
pieces (``ex.load``). Because nothing in the files depends on how the run was sharded, a checkpoint written by
any strategy and mesh loads under any other, and ``export`` / ``generate`` read it on one process. The price is
memory: while saving or loading, every rank holds the whole model and its optimizer state (for AdamW 3× the
parameters) next to its own shards. Fine for the models ``shardflow train`` trains; a sharded save
(DTensor-style entries, each rank writing only its pieces) is the way out for models that do not fit one rank.
Batches depend only on (seed, step), so the step count is also the position in the data.

**Atomic.** Every rank writes into ``step_<n>.tmp/``; after a barrier (every rank finished) rank 0 records each
file's size and sha256 in ``shardflow.json``, writes ``COMPLETE`` last, syncs, and renames the directory to
``step_<n>/`` in one ``rename`` — so ``step_<n>/`` either does not exist or is complete. ``--resume`` takes the
newest ``step_<n>/`` that has the marker; leftover ``.tmp`` directories are ignored and removed by rank 0 at the
next save. A fresh run (no ``--resume``) replaces an earlier run's checkpoints in the same directory once it
has written its first one.

**Safe to load.** Nothing is unpickled except DCP's ``.metadata``, and that through an unpickler that admits
only DCP's own metadata classes, torch dtypes and sizes; tensors come back with ``torch.load(weights_only=True)``
(DCP's reader). Non-tensor entries, which DCP would load with a full unpickler, are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from shardflow.lower.dynamic import OPTIMIZER_SLOTS
from shardflow.models import GPT, GPTConfig
from shardflow.train.data import CharTokenizer

MARKER = "COMPLETE"
META = "shardflow.json"
FORMAT = 1
_STEP = re.compile(r"step_(\d+)$")
# flag of `shardflow train` for each GPTConfig field (vocab_size comes from the data)
_FLAGS = {"block_size": "--seq-len", "n_layer": "--layers", "n_head": "--heads", "n_embd": "--embd",
          "vocab_size": "--data", "bias": None}

Entries = dict[str, tuple[tuple[int, ...], torch.dtype]]


class CheckpointError(ValueError):
    """A checkpoint cannot be written or used; the message names the directory, what is wrong and how to fix it."""


# --- finding checkpoints ------------------------------------------------------------------------------------

def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints (``step_<n>/`` with the marker) under ``root``, oldest first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP.match(p.name)
            if m and p.is_dir() and (p / MARKER).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def newest(root: Path) -> Path | None:
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def _incomplete(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and p.name not in
                  {q.name for _, q in complete_steps(root)})


def find(path: str | os.PathLike) -> Path:
    """Resolve ``--checkpoint``: a checkpoint (``step_<n>/``), a checkpoint directory (its newest complete
    checkpoint) or a run directory (the newest in its ``checkpoints/``). Raises CheckpointError."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist; pass a checkpoint (RUN_DIR/checkpoints/step_N), a "
                              f"checkpoint directory or a run directory of shardflow train")
    if _STEP.match(p.name) or (p / META).exists() or (p / MARKER).exists():
        if not (p / MARKER).is_file():
            raise CheckpointError(f"checkpoint {p} is incomplete (no {MARKER} marker: its save did not finish); "
                                  f"{_fallback(p)}")
        return p
    for root in (p, p / "checkpoints"):
        found = newest(root)
        if found is not None:
            return found
    partial = _incomplete(p) or _incomplete(p / "checkpoints")
    extra = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
    raise CheckpointError(f"{p} holds no complete checkpoint{extra}; pass a checkpoint step_N directory, or the "
                          f"--checkpoint-dir / --run-dir of a shardflow train run that saved one")


def _fallback(path: Path) -> str:
    """How to get past a bad checkpoint: the previous complete one in the same directory, if any."""
    older = [p for n, p in complete_steps(path.parent) if n < _step_of(path)]
    if older:
        return f"remove {path} to fall back to {older[-1]}, the previous complete checkpoint, or pass that one"
    return f"remove {path}; no other complete checkpoint is left in {path.parent}, so train again without --resume"


def _step_of(path: Path) -> int:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else -1


# --- reading ------------------------------------------------------------------------------------------------

def _metadata_classes() -> set[tuple[str, str]]:
    import torch.distributed.checkpoint.metadata as md
    allowed = {(md.__name__, n) for n, o in vars(md).items() if isinstance(o, type) and o.__module__ == md.__name__}
    return allowed | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                      ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                      ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only its metadata classes, torch dtypes and sizes: a crafted file
    cannot run code."""

    allowed: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            _MetadataUnpickler.allowed = _MetadataUnpickler.allowed or _metadata_classes()
            with open(Path(self.path) / ".metadata", "rb") as f:
                md = _MetadataUnpickler(f).load()
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(path)


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint whose files were verified: what ``shardflow.json`` says and DCP's tensor index."""

    path: Path
    step: int
    model: GPTConfig
    chars: str
    train: dict[str, Any]
    entries: Entries
    mesh: str = "?"

    @property
    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer(self.chars)

    def check_entries(self, want: Entries, fix: str) -> None:
        """Raise CheckpointError unless every wanted entry is stored with its shape and dtype."""
        problems = []
        for k, (shape, dtype) in want.items():
            if k not in self.entries:
                problems.append(f"{k} is missing")
            elif self.entries[k] != (tuple(shape), dtype):
                have = self.entries[k]
                problems.append(f"{k} is {list(have[0])} {str(have[1]).removeprefix('torch.')}, the model needs "
                                f"{list(shape)} {str(dtype).removeprefix('torch.')}")
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise CheckpointError(f"checkpoint {self.path} does not fit this model: {'; '.join(problems[:3])}{more}; "
                                  f"{fix}")

    def load(self, want: Entries) -> dict[str, torch.Tensor]:
        """Full-size tensors of ``want`` (entry name → shape, dtype), read with DCP on this process alone."""
        import torch.distributed.checkpoint as dcp

        self.check_entries(want, _fallback(self.path))
        sd = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in want.items()}
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.load(sd, storage_reader=_reader(self.path), no_dist=True)
        except (Exception, CheckpointException) as e:  # any failure to read is a corrupt checkpoint to the user
            raise CheckpointError(f"checkpoint {self.path} is corrupt: its tensors cannot be read ({_why(e)}); "
                                  f"{_fallback(self.path)}") from None
        return sd


def _why(e: BaseException) -> str:
    """The first line of what went wrong inside DCP. DCP wraps every rank's failure — a Ctrl-C too — in a
    CheckpointException (a BaseException): an interrupt is raised again as KeyboardInterrupt."""
    failures = [pair[0] for pair in getattr(e, "failures", {}).values()] or [e]
    for x in failures:
        if isinstance(x, (KeyboardInterrupt, SystemExit)):
            raise KeyboardInterrupt(str(x)) from None
    x = failures[0]
    text = str(x).strip().splitlines()[0] if str(x).strip() else ""
    if len(text) > 120 and ". " in text:  # e.g. torch.load's advice to load unsafely: not for a corrupt file
        text = text.split(". ")[0]
    return f"{type(x).__name__}: {text}" if text else type(x).__name__


def read(path: Path) -> Checkpoint:
    """Open the complete checkpoint ``path``: check every file against the size and sha256 recorded when it was
    saved, then read DCP's index (safely). Raises CheckpointError naming the directory, the problem and the fix."""
    fix = _fallback(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker: its save did not finish); {fix}")
    try:
        meta = json.loads((path / META).read_text())
        files, step, model, chars = meta["files"], int(meta["step"]), meta["model"], meta["chars"]
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}; this shardflow reads format "
                                  f"{FORMAT}; use the shardflow version that wrote it")
        gpt = GPTConfig(**model)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a shardflow checkpoint (it has no {META}); {fix}") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {path} is corrupt: {META} cannot be read ({type(e).__name__}: {e}); "
                              f"{fix}") from None
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupt: its file {name} is missing; {fix}")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} has {size} bytes but {want['bytes']} were "
                                  f"written (truncated or overwritten); {fix}")
        if _digest(f)["sha256"] != want["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: the contents of {name} differ from what was written "
                                  f"(sha256 mismatch); {fix}")
    try:
        md = _reader(path).read_metadata()
        entries: Entries = {}
        for k, v in md.state_dict_metadata.items():
            if not hasattr(v, "properties") or not hasattr(v, "size"):
                raise CheckpointError(f"checkpoint {path} holds a non-tensor entry {k!r}, which shardflow does not "
                                      f"write and will not unpickle; {fix}")
            entries[k] = (tuple(v.size), v.properties.dtype)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 — an unreadable or refused index
        raise CheckpointError(f"checkpoint {path} is corrupt: DCP's .metadata cannot be read ({e}); {fix}") from None
    return Checkpoint(path, step, gpt, chars, meta.get("train", {}), entries, str(meta.get("mesh", "?")))


def model_entries(model: torch.nn.Module, names, slots: tuple[str, ...] = ()) -> Entries:
    """The entries a checkpoint of ``model`` holds: weights ``model/<name>`` and optimizer state
    ``optim/opt:<slot>:<name>`` (same shape as the weight)."""
    params = dict(model.named_parameters())
    out: Entries = {f"model/{n}": (tuple(params[n].shape), params[n].dtype) for n in names}
    for s in slots:
        out.update({f"optim/opt:{s}:{n}": (tuple(params[n].shape), params[n].dtype) for n in names})
    return out


def for_resume(root: Path, model: GPTConfig, chars: str, optimizer_slots: str, want: Entries,
               data: str | None) -> Checkpoint:
    """The newest complete checkpoint under ``root``, checked against the run about to continue from it."""
    path = newest(root)
    if path is None:
        partial = _incomplete(root)
        extra = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
        raise CheckpointError(f"--resume: {root} holds no complete checkpoint{extra}; point --checkpoint-dir (or "
                              f"--run-dir) at the run to continue, or start a new run without --resume")
    ck = read(path)
    new_run = "or start a new run without --resume (or with another --checkpoint-dir)"
    if ck.chars != chars:
        gone = sorted(set(ck.chars) - set(chars))
        added = sorted(set(chars) - set(ck.chars))
        what = ", ".join(x for x in (f"missing {_short(''.join(gone))}" if gone else "",
                                     f"new {_short(''.join(added))}" if added else "") if x) or "same characters, other order"
        raise CheckpointError(f"checkpoint {path} was trained on another text: its vocabulary has {len(ck.chars)} "
                              f"characters, --data {data or '(default corpus)'} gives {len(chars)} ({what}); "
                              f"resume with the data it was trained on ({ck.train.get('data') or 'the default corpus'}), "
                              f"{new_run}")
    diff = [(_FLAGS.get(f.name) or f.name, getattr(ck.model, f.name), getattr(model, f.name))
            for f in dataclasses.fields(GPTConfig) if f.name not in ("dropout", "vocab_size")
            and getattr(ck.model, f.name) != getattr(model, f.name)]
    if diff:
        theirs_, ours = (" ".join(f"{flag} {v[i]}" for flag, *v in diff) for i in (0, 1))
        raise CheckpointError(f"checkpoint {path} is of a different model: it has {theirs_}, this run {ours}; "
                              f"resume with the checkpoint's sizes ({theirs_}), {new_run}")
    theirs = _slots_of(ck.train)
    if theirs is not None and theirs != optimizer_slots:
        raise CheckpointError(f"checkpoint {path} holds the optimizer state of {_OPT_NAMES[theirs]} "
                              f"({', '.join(OPTIMIZER_SLOTS[theirs]) or 'none'}) but this run uses "
                              f"{_OPT_NAMES.get(optimizer_slots, optimizer_slots)}; "
                              f"resume with --optimizer {ck.train.get('optimizer')}"
                              f"{' --momentum ' + str(ck.train.get('momentum')) if theirs.startswith('sgd') else ''}, "
                              f"{new_run}")
    ck.check_entries(want, _fallback(path))
    return ck


_OPT_NAMES = {"sgd": "SGD without momentum", "sgd_momentum": "SGD with momentum", "adamw": "AdamW"}


def _short(chars: str, n: int = 30) -> str:
    return repr(chars) if len(chars) <= n else repr(chars[:n]) + f" and {len(chars) - n} more"


def _slots_of(train: Mapping[str, Any]) -> str | None:
    name = train.get("optimizer")
    if name == "adamw":
        return "adamw"
    if name == "sgd":
        return "sgd_momentum" if train.get("momentum") else "sgd"
    return None


# --- writing ------------------------------------------------------------------------------------------------

def check_writable(root: Path, what: str = "checkpoint directory",
                   fix: str = "pass --checkpoint-dir (or --run-dir) with a directory you can write, or fix its "
                              "permissions") -> None:
    """Create ``root`` if needed and prove a file can be written there; raises CheckpointError otherwise, naming
    ``what`` the directory is and the ``fix``. The parent calls this before any process starts."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"{what} {root} cannot be created: it or one of its parents is a file; {fix}") from None
    except OSError as e:
        raise CheckpointError(f"{what} {root} is not writable ({e.strerror or e}); {fix}") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class Saver:
    """Writes checkpoints of one run. Every rank makes one and calls :meth:`save` at the same steps.

    ``meta``: what ``shardflow.json`` records besides step and files (model config, characters, train config).
    ``fresh``: this run did not resume, so complete checkpoints it did not write are an earlier run's and are
    removed once it has committed its first.
    """

    def __init__(self, root: Path, rank: int, world: int, meta: Mapping[str, Any], fresh: bool):
        self.root, self.rank, self.world, self.meta, self.fresh = root, rank, world, dict(meta), fresh
        self.written: set[str] = set()
        # test hook (``SHARDFLOW_FAULT=kill_in_save``, see shardflow.train.loop.Fault): called with the step once
        # this rank's files are in ``step_<n>.tmp/``, before the checkpoint is committed
        self.on_written: Callable[[int], None] | None = None

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    def save(self, ex, step: int) -> tuple[Path, int]:
        """Save the executor's weights and optimizer state after ``step`` steps (collective: every rank calls it).
        Returns the checkpoint's directory and its size in bytes (on rank 0; 0 elsewhere)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException

        sd = {f"model/{k}": v for k, v in ex.weights().items()}  # collective on the distributed executor
        sd.update({f"optim/{k}": v for k, v in ex.state().items()})
        tmp, final = self.root / f"step_{step}.tmp", self.root / f"step_{step}"
        if self.rank == 0:
            self._remove_leftovers()
            tmp.mkdir(parents=True)
        self._barrier()
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.save(sd, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=self.world == 1)
        except (Exception, CheckpointException) as e:  # e.g. disk full, on any rank
            raise CheckpointError(f"writing checkpoint {tmp} failed ({_why(e)}); free space or fix "
                                  f"--checkpoint-dir, then --resume from the last complete checkpoint") from None
        prefix = f"__{self.rank}_" if self.world > 1 else "__"
        mine = {p.name: _digest(p) for p in sorted(tmp.iterdir()) if p.name.startswith(prefix)}
        if self.on_written is not None:
            self.on_written(step)
        if self.world > 1:
            everyone: list[Any] | None = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, everyone, dst=0)
        else:
            everyone = [mine]
        size = 0
        if self.rank == 0:
            files = {k: v for part in everyone for k, v in part.items()}
            files[".metadata"] = _digest(tmp / ".metadata")
            size = sum(f["bytes"] for f in files.values())
            meta = {"format": FORMAT, "step": step, **self.meta, "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "files": files}
            _write_synced(tmp / META, json.dumps(meta, indent=1) + "\n")
            _write_synced(tmp / MARKER, f"step {step}\n")
            _fsync_dir(tmp)
            self._commit(tmp, final)
            self.written.add(final.name)
            if self.fresh:
                for _, p in complete_steps(self.root):
                    if p.name not in self.written:
                        shutil.rmtree(p, ignore_errors=True)
        self._barrier()
        return final, size

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final`` (one rename; a checkpoint of the same step from an earlier run is moved
        aside first and removed after)."""
        aside = None
        if final.exists():
            aside = final.with_name(final.name + ".old.tmp")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        for p in self.root.iterdir():
            if p.name.startswith("step_") and p.name.endswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)


# --- for export and generate --------------------------------------------------------------------------------

def load_model(path: str | os.PathLike) -> tuple[GPT, Checkpoint]:
    """The plain ``GPT`` with the weights of the checkpoint at ``path`` (see :func:`find`), in eval mode."""
    ck = read(find(path))
    torch.manual_seed(0)
    model = GPT(ck.model)
    names = [n for n, _ in model.named_parameters()]
    tensors = ck.load(model_entries(model, names))
    model.load_state_dict({n: tensors[f"model/{n}"] for n in names}, strict=True)
    return model.eval(), ck


def export(path: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, Checkpoint]:
    """Write the checkpoint's weights as one safetensors file under the module's parameter names, with the model
    config (GPTConfig fields and the tokenizer's characters) as JSON in the metadata key ``config``. Written to a
    temporary name and renamed, so ``out`` is whole or untouched."""
    from safetensors.torch import save_file

    out = Path(out)
    if not out.parent.is_dir():
        raise CheckpointError(f"--out {out}: directory {out.parent} does not exist; create it or write elsewhere")
    if out.is_dir():
        raise CheckpointError(f"--out {out} is a directory; pass a file name such as {out / 'model.safetensors'}")
    model, ck = load_model(path)
    config = {**dataclasses.asdict(ck.model), "chars": ck.chars}
    metadata = {"format": "pt", "config": json.dumps(config), "step": str(ck.step), "source": str(ck.path)}
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write --out {out} ({e.strerror or e}); choose a writable location") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out, ck
