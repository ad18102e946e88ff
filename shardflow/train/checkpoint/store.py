"""The atomic checkpoint store: a checkpoint directory is complete or absent, and its files are what was written.

Layout of a checkpoint directory (``--checkpoint-dir``)::

    step_3/            a complete checkpoint: the files of its writers, then
      shardflow.json   the manifest: step, the writer's own fields, size and sha256 of every file
      COMPLETE         the marker, written last
    step_6.tmp/        a save in progress, or one that was interrupted: never read, removed by the next save

Every rank writes into ``step_<n>.tmp/`` (:func:`begin`); once every rank has finished, rank 0 records each
file's size and sha256 in the manifest, writes ``COMPLETE`` last, syncs, and renames the directory to
``step_<n>/`` in one ``rename`` (:func:`commit`). :func:`read_manifest` checks every file against the manifest
before anything reads it. What the files hold is the business of :mod:`shardflow.train.checkpoint.dcp`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

MARKER = "COMPLETE"
META = "shardflow.json"
FORMAT = 3  # 2: the corpus (``data``) and tokenizer.json replace format 1's tokenizer characters; 3: ``model`` is
#            {family, config} (Hugging Face configs, factories) instead of shardflow's GPT config
_STEP = re.compile(r"step_(\d+)$")


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
    """The newest complete checkpoint under ``root``, or None."""
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def incomplete(root: Path) -> list[str]:
    """Names of the ``step_*`` entries under ``root`` that are not complete checkpoints (saves cut short)."""
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if p.name.startswith("step_") and p.name not in {q.name for _, q in complete_steps(root)}
    )


def is_checkpoint(p: Path) -> bool:
    """Whether ``p`` is one checkpoint (``step_<n>/``, complete or not), rather than a directory of them."""
    return bool(_STEP.match(p.name)) or (p / META).exists() or (p / MARKER).exists()


def find(path: str | os.PathLike) -> Path:
    """Resolve ``--checkpoint``: a checkpoint (``step_<n>/``), a checkpoint directory (its newest complete
    checkpoint) or a run directory (the newest in its ``checkpoints/``). Raises CheckpointError."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"checkpoint {p} does not exist; pass a checkpoint (RUN_DIR/checkpoints/step_N), a "
            f"checkpoint directory or a run directory of shardflow train"
        )
    if is_checkpoint(p):
        if not (p / MARKER).is_file():
            raise CheckpointError(
                f"checkpoint {p} is incomplete (no {MARKER} marker: its save did not finish); {fallback(p)}"
            )
        return p
    for root in (p, p / "checkpoints"):
        found = newest(root)
        if found is not None:
            return found
    partial = incomplete(p) or incomplete(p / "checkpoints")
    extra = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
    raise CheckpointError(
        f"{p} holds no complete checkpoint{extra}; pass a checkpoint step_N directory, or the "
        f"--checkpoint-dir / --run-dir of a shardflow train run that saved one"
    )


def fallback(path: Path) -> str:
    """How to get past a bad checkpoint: the previous complete one in the same directory, if any."""
    older = [p for n, p in complete_steps(path.parent) if n < _step_of(path)]
    if older:
        return f"remove {path} to fall back to {older[-1]}, the previous complete checkpoint, or pass that one"
    return f"remove {path}; no other complete checkpoint is left in {path.parent}, so train again without --resume"


def _step_of(path: Path) -> int:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else -1


# --- reading ------------------------------------------------------------------------------------------------


def digest(path: Path) -> dict[str, Any]:
    """Size (bytes) and sha256 of the file ``path``, as the manifest records them."""
    with open(path, "rb") as f:
        h = hashlib.file_digest(f, "sha256")  # through one buffer of 256 KiB
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def read_manifest(path: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The manifest of the complete checkpoint ``path``, after checking every file against the size and sha256
    recorded when it was saved. ``required``: the writer's fields that must be present. Raises CheckpointError
    naming the directory, the problem and the fix."""
    fix = fallback(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker: its save did not finish); {fix}")
    try:
        meta = json.loads((path / META).read_text())
        files, meta["step"] = meta["files"], int(meta["step"])
        missing = [k for k in required if k not in meta]
        if missing:
            raise KeyError(missing[0])
        if meta.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint {path} has format {meta.get('format')!r}; this shardflow reads format "
                f"{FORMAT}; use the shardflow version that wrote it"
            )
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a shardflow checkpoint (it has no {META}); {fix}") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"checkpoint {path} is corrupt: {META} cannot be read ({type(e).__name__}: {e}); {fix}"
        ) from None
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupt: its file {name} is missing; {fix}")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {size} bytes but {want['bytes']} were "
                f"written (truncated or overwritten); {fix}"
            )
        if digest(f)["sha256"] != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: the contents of {name} differ from what was written "
                f"(sha256 mismatch); {fix}"
            )
    return meta


# --- writing ------------------------------------------------------------------------------------------------


def check_writable(
    root: Path,
    what: str = "checkpoint directory",
    fix: str = "pass --checkpoint-dir (or --run-dir) with a directory you can write, or fix its permissions",
) -> None:
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


def begin(root: Path, step: int) -> Path:
    """Rank 0, before a save: remove the ``.tmp`` leftovers of saves cut short and create ``step_<n>.tmp/``,
    which it returns. The other ranks write into that directory once rank 0 has made it."""
    for p in root.iterdir():
        if p.name.startswith("step_") and p.name.endswith(".tmp"):
            shutil.rmtree(p, ignore_errors=True)
    tmp = staging(root, step)
    tmp.mkdir(parents=True)
    return tmp


def staging(root: Path, step: int) -> Path:
    """The directory every rank writes the checkpoint of ``step`` into."""
    return root / f"step_{step}.tmp"


def commit(root: Path, step: int, files: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any]) -> tuple[Path, int]:
    """Rank 0, once every rank's files are in ``step_<n>.tmp/``: write the manifest (``meta`` plus the step, the
    time and the ``files``' digests) and the marker, sync, and rename the directory to ``step_<n>/`` (a checkpoint
    of the same step from an earlier run is moved aside first and removed after). Returns the checkpoint's
    directory and its size in bytes."""
    tmp, final = staging(root, step), root / f"step_{step}"
    size = sum(f["bytes"] for f in files.values())
    manifest = {
        "format": FORMAT,
        "step": step,
        **meta,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": dict(files),
    }
    write_synced(tmp / META, json.dumps(manifest, indent=1) + "\n")
    write_synced(tmp / MARKER, f"step {step}\n")
    _fsync_dir(tmp)
    aside = None
    if final.exists():
        aside = final.with_name(final.name + ".old.tmp")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final, size


def prune(root: Path, ours: set[str] | None, newest: int = 0) -> None:
    """Remove the complete checkpoints under ``root`` that are not in ``ours`` (an earlier run's; None: every one
    is this run's) and, with ``newest`` > 0, all but the ``newest`` highest steps of the rest
    (``--keep-checkpoints``). Each is renamed to ``<name>.old.tmp`` before it is removed, so a removal cut short
    leaves a leftover that :func:`begin` clears, never a checkpoint that looks complete and is not."""
    steps = complete_steps(root)
    mine = [p for _, p in steps if ours is None or p.name in ours]
    kept = {p.name for p in (mine[-newest:] if newest else mine)}
    for _, p in steps:
        if p.name not in kept:
            aside = p.with_name(p.name + ".old.tmp")
            os.rename(p, aside)
            shutil.rmtree(aside, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` and sync it to disk."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
