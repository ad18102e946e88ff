"""What reaches the top of a command unhandled, as one paragraph: nothing silent, nothing lost, no traceback.

:func:`describe` turns an exception into ``(exit status, paragraph)``. Known classes a user can act on — a full
disk, a permission refused, a corrupt or truncated file (safetensors, JSON, ``torch.load``) — name the file or value
and the fix (status 2, as every input error). Anything else is a bug in shardflow: its full traceback is written to
a file (the run directory when the command has one, else a temporary file) and the paragraph gives that path and
how to report it (status 1).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import pickle
import tempfile
import traceback
from pathlib import Path
from types import TracebackType

BUG = 1  # exit status of an exception shardflow did not expect (a traceback would have ended with 1 as well)
USER = 2  # exit status of an error the user can fix

# where a command that has a run directory writes the traceback of a bug (set once the directory is claimed)
_run_dirs: list[Path] = []


def set_run_dir(path: Path | None) -> None:
    """The run directory of this command, where a bug's traceback is written (None: a temporary file)."""
    _run_dirs[:] = [path] if path is not None else []


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or during (innermost cause last)."""
    seen: list[BaseException] = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return seen


def _is_file(v: object) -> str | None:
    try:
        if isinstance(v, (str, os.PathLike)):
            p = os.fspath(v)
            return p if isinstance(p, str) and 0 < len(p) < 4096 and os.path.isfile(p) else None
        if isinstance(v, (int, float, bool, type(None))) or not (hasattr(v, "read") or hasattr(v, "write")):
            return None
        name = getattr(v, "name", None)  # an open file
        return _is_file(name) if isinstance(name, str) else None
    except Exception:  # a local whose attributes cannot be read
        return None


def file_of(e: BaseException) -> str | None:
    """The file ``e`` is about: its ``filename`` (OSError), else the innermost frame of its traceback that holds a
    path of an existing file (or an open file) in a local variable — the file being read or written."""
    for x in _chain(e):
        name = getattr(x, "filename", None)
        if isinstance(name, (str, os.PathLike)):
            return os.fspath(name)  # type: ignore[return-value]
    for x in _chain(e):
        frames: list[TracebackType] = []
        tb = x.__traceback__
        while tb is not None:
            frames.append(tb)
            tb = tb.tb_next
        for t in reversed(frames):
            for v in list(t.tb_frame.f_locals.values()):
                found = _is_file(v)
                if found is not None:
                    return found
    return None


def _safetensors_error() -> type[BaseException] | None:
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - a dependency of transformers
        return None
    return SafetensorError


def _corrupt(e: BaseException) -> bool:
    """Whether ``e`` says a file it read is corrupt or truncated (not valid safetensors, JSON or torch.save data)."""
    st = _safetensors_error()
    if st is not None and isinstance(e, st):
        return "No space left" not in str(e) and "Permission denied" not in str(e)
    if isinstance(e, (json.JSONDecodeError, pickle.UnpicklingError, EOFError, UnicodeDecodeError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "PytorchStreamReader" in text or "invalid load key" in text or "central directory" in text
    )


def is_space(e: BaseException) -> bool:
    """Whether ``e`` says the disk (or the user's quota) is full: an OSError, or safetensors' own error wrapping one."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    st = _safetensors_error()
    return st is not None and isinstance(e, st) and "No space left" in str(e)


def is_denied(e: BaseException) -> bool:
    """Whether ``e`` says a permission was refused: an OSError, or safetensors' own error wrapping one."""
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return True
    st = _safetensors_error()
    return st is not None and isinstance(e, st) and "Permission denied" in str(e)


def reason(e: BaseException) -> str:
    """What went wrong, in a few words: an OSError's text, "No space left on device" or "Permission denied" for
    safetensors' error wrapping one, else the first line of the exception's message."""
    if not isinstance(e, OSError) and is_space(e):
        return "No space left on device"
    if not isinstance(e, OSError) and is_denied(e):
        return "Permission denied"
    return _first_line(e)


def _first_line(e: BaseException) -> str:
    text = (getattr(e, "strerror", None) or str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


def known(e: BaseException, chain: bool = True) -> str | None:
    """The paragraph (without the ``shardflow CMD: error:`` prefix) of an exception a user can act on, or None;
    ``chain``: also when an exception ``e`` was raised from or during is one."""
    for x in _chain(e) if chain else [e]:
        if is_space(x):
            where = file_of(x) or file_of(e)
            at = f" while writing {where}" if where else ""
            return (
                f"no space left on the device{at} ({reason(x)}); free space there or write elsewhere, then "
                f"run the command again (nothing was lost: files are written whole or not at all)"
            )
        if is_denied(x):
            where = file_of(x) or file_of(e)
            at = f" on {where}" if where else ""
            return (
                f"permission denied{at} ({reason(x)}); make it readable/writable for you (chmod, chown) or "
                f"choose another location"
            )
        if _corrupt(x):
            where = file_of(x) or file_of(e)
            what = f"file {where}" if where else "a file it read"
            return (
                f"{what} is corrupt or truncated ({type(x).__name__}: {_first_line(x)}); it was cut short by a "
                f"full disk or an interrupted copy, or is not the kind of file expected there: write or copy it "
                f"again (shardflow export, or the checkpoint of another step)"
            )
    return None


def write_traceback(e: BaseException, command: str, argv: list[str] | None = None) -> Path | None:
    """Write ``e``'s full traceback (and the command line) to the run directory, else a temporary file; its path,
    or None when no file could be written."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    text = f"shardflow {command} {' '.join(argv or [])}\n\n" + "".join(
        traceback.format_exception(type(e), e, e.__traceback__)
    )
    for d in _run_dirs:
        try:
            path = Path(d) / f"traceback-{stamp}-{os.getpid()}.txt"
            path.write_text(text)
            return path
        except OSError:
            pass
    try:
        fd, name = tempfile.mkstemp(prefix=f"shardflow-{command}-traceback-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    except OSError:
        return None


def describe(e: BaseException, command: str, argv: list[str] | None = None) -> tuple[int, str]:
    """``(exit status, one paragraph)`` for an exception that reached the top of ``shardflow COMMAND``."""
    said = known(e)
    if said is not None:
        return USER, f"shardflow {command}: error: {said}"
    path = write_traceback(e, command, argv)
    where = (
        f"the full traceback is in {path}"
        if path is not None
        else "its traceback could not be written to a file (no writable directory)"
    )
    return BUG, (
        f"shardflow {command}: error: internal error, a bug in shardflow ({type(e).__name__}: "
        f"{_first_line(e)}); {where}. Please report it to shardflow's issue tracker with that file and the "
        f"command line; your inputs may be fine"
    )
