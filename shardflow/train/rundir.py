"""Run directories of ``shardflow train``: where a run writes its logs, metrics, configuration and checkpoints, and
the rules that keep one run from destroying another's.

* **A new directory per run.** Without ``--run-dir`` a run gets ``runs/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ...
  when that name is taken), and ``runs/latest`` is a symlink to the newest: a symlink made under a temporary name,
  then renamed over the old one (``os.replace``), so a reader sees the old run or the new one, never neither.
  ``--resume`` without ``--run-dir`` continues the run ``runs/latest`` points at.
* **An earlier run is not overwritten.** A run directory holding an earlier run (``config.toml``, the metrics file
  or a complete checkpoint in the checkpoint directory) is refused unless ``--resume`` (continue it) or
  ``--overwrite`` (replace it; its checkpoints go once the new run has written its first complete one).
* **One run at a time.** ``RUN_DIR/.lock`` is ``flock``-ed by the process that owns the run, which writes its PID
  and host into it: the parent of ``--nproc N`` (its ranks inherit the descriptor, so the directory stays locked as
  long as any of them lives), the one process of ``--nproc 1``, or torchrun's rank 0 (torchrun's ranks are siblings
  under torchrun's agent, none of them ours to outlive the others; rank 0 claims the directory before joining and
  tells the others its name once they have joined). A second run into a locked directory is refused naming the
  holder. The same lock covers each path outside it that the user names: ``--checkpoint-dir`` (its ``.lock``),
  ``--metrics`` and ``--trace`` (a ``.NAME.lock`` beside the file), so two runs with their own run directories but
  one of these paths do not keep only the second's checkpoints or records: the second is refused naming the path
  and the first run. A named path inside the directory of another live run, and a run whose own checkpoint
  directory or metrics file another live run names, are refused too.
* **Outputs do not overwrite the run's own files.** ``--metrics`` and ``--trace`` may not name ``config.toml``, the
  lock, a rank log, a file of the checkpoint directory, nor each other.

Every refusal is a :class:`RunDirError` (one paragraph, exit status 2) raised before any process starts.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import socket
import time
from pathlib import Path
from typing import Callable

from shardflow import failure
from shardflow.train.checkpoint import complete_steps
from shardflow.train.config import RUNS, TrainConfig

LATEST = RUNS / "latest"
LOCK = ".lock"
CONFIG = "config.toml"
_RANK_LOG = re.compile(r"rank\d+\.log")


class RunDirError(ValueError):
    """A run directory cannot be used by this run; the message names it, why, and the fix."""


def metrics_path(cfg: TrainConfig) -> Path:
    """The metrics file of the run: ``--metrics``, else ``RUN_DIR/metrics.jsonl``."""
    return Path(cfg.metrics) if cfg.metrics else Path(cfg.run_dir) / "metrics.jsonl"


class RunDir:
    """The run directory of one run, from before planning to the end of the run (a context manager).

    ``owner``: this process owns the run (the parent of ``--nproc N``, the one process of ``--nproc 1``, torchrun's
    rank 0); elsewhere (torchrun's other ranks) nothing happens here and ``cfg`` is the one given. For the owner,
    ``cfg.run_dir`` is resolved at once: a new directory (made now, empty, and removed again if the run ends before
    :meth:`claim`), the one ``runs/latest`` points at (``--resume`` without ``--run-dir``), or ``--run-dir``.
    """

    def __init__(self, cfg: TrainConfig, owner: bool):
        self.owner, self.fd, self.new = owner, None, False
        self.held: list[int] = []  # the locks of the named outputs (--checkpoint-dir, --metrics, --trace)
        if owner and cfg.resume and cfg.overwrite:
            raise RunDirError(
                "--resume continues the earlier run in the run directory and --overwrite replaces it: give one of them"
            )
        if owner and cfg.run_dir is None:
            self.new = not cfg.resume
            cfg = dataclasses.replace(cfg, run_dir=str(_new_dir() if self.new else _latest_run()))
        self.cfg = cfg
        self.path = Path(cfg.run_dir) if cfg.run_dir is not None else None

    def __enter__(self) -> RunDir:
        return self

    @property
    def fds(self) -> tuple[int, ...]:
        """Every lock this run holds (the run directory's first): the descriptors its ranks inherit."""
        return (*((self.fd,) if self.fd is not None else ()), *self.held)

    def __exit__(self, *exc) -> None:
        for fd in self.held:
            os.close(fd)
        self.held = []
        if self.fd is not None:
            os.close(self.fd)  # releases the lock (ranks that inherited the descriptor are gone by now)
            self.fd = None
        if self.new:
            try:
                self.path.rmdir()  # only while empty: a run that ended before it was claimed leaves nothing
            except OSError:
                pass

    def claim(self) -> None:
        """The owner, once every check of the configuration and the plan has passed and just before training starts:
        refuse ``--metrics`` / ``--trace`` onto the run's own files, lock the directory and the outputs the user
        names (:meth:`_lock_outputs`), refuse an earlier run in it (unless ``--resume`` or ``--overwrite``), point
        ``runs/latest`` at a new directory and write ``config.toml``. Raises RunDirError."""
        cfg, run = self.cfg, self.path
        _check_targets(cfg)
        run.mkdir(parents=True, exist_ok=True)
        self.fd = lock(run)
        self._lock_outputs()
        if not (cfg.resume or cfg.overwrite):
            earlier = earlier_run(cfg)
            if earlier:
                raise RunDirError(
                    f"run directory {run} holds an earlier run ({', '.join(earlier)}), which this run "
                    f"would overwrite: pass --resume to continue it, --overwrite to replace it, or "
                    f"another --run-dir (without --run-dir every run gets a new directory under {RUNS}/)"
                )
        if self.new:
            _point_latest(run)
        (run / CONFIG).write_text(cfg.to_toml())
        failure.set_run_dir(run)  # where the traceback of a bug is written

    def _lock_outputs(self) -> None:
        """Lock each output the user names (``--checkpoint-dir``, ``--metrics``, ``--trace``) for this run, and refuse
        one that lies in the directory of another live run; refuse a default output (the checkpoint directory or
        metrics file in the run directory) that another live run holds as its named one. Raises RunDirError."""
        cfg, run = self.cfg, self.path
        assert run is not None  # the owner's, resolved in __init__
        mine = {(run / LOCK).resolve()}
        for flag, target, named in outputs(cfg):
            at = output_lock(target, flag)
            if at.resolve() in mine:
                continue  # e.g. --checkpoint-dir RUN_DIR: the run directory's lock covers it
            if not named:
                _probe(at, lambda who, at=at, flag=flag, target=target: _in_use(flag, target, who, at))
                continue
            for d in Path(target).resolve().parents:  # a live run whose own directory holds the path
                other = d / LOCK
                if other not in mine and (d / CONFIG).is_file():
                    _probe(other, lambda who, d=d, flag=flag, target=target: _inside(flag, target, d, who))
            at.parent.mkdir(parents=True, exist_ok=True)
            self.held.append(lock(run, target, flag))
            mine.add(at.resolve())


# the paths besides the run directory a run writes, and its flag: what it is, and what two runs at once would lose
OUTPUTS = {
    "--checkpoint-dir": ("checkpoint directory", "checkpoints"),
    "--metrics": ("metrics file", "records"),
    "--trace": ("trace file", "timeline"),
}


def outputs(cfg: TrainConfig) -> list[tuple[str, Path, bool]]:
    """The outputs of a run besides its run directory's own files: (flag, path, whether the user named it)."""
    found = [
        ("--checkpoint-dir", cfg.checkpoints, bool(cfg.checkpoint_dir)),
        ("--metrics", metrics_path(cfg), bool(cfg.metrics)),
    ]
    return found + ([("--trace", Path(cfg.trace), True)] if cfg.trace else [])


def output_lock(target: Path, flag: str) -> Path:
    """The lock file of an output: ``DIR/.lock`` for the checkpoint directory, ``.NAME.lock`` beside a file."""
    target = Path(target)
    return target / LOCK if flag == "--checkpoint-dir" else target.parent / f".{target.name}.lock"


def _holder(fd: int) -> str:
    """Who holds the lock whose file ``fd`` reads: ``PID p on HOST, run directory RUN`` (as :func:`lock` wrote)."""
    holder = os.read(fd, 4096).decode(errors="replace").strip().split(maxsplit=2)
    if len(holder) < 2:
        return "a process that is just starting"
    return f"PID {holder[0]} on {holder[1]}" + (f", run directory {holder[2]}" if len(holder) == 3 else "")


def _probe(at: Path, refuse) -> None:
    """Raise ``refuse(holder)`` when another process holds the lock file ``at`` (one that does not exist is free;
    nothing is created)."""
    try:
        fd = os.open(at, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _holder(fd)
        os.close(fd)
        raise refuse(who) from None
    os.close(fd)  # released at once: only a held lock refuses


def _in_use(flag: str, target: Path, who: str, at: Path) -> RunDirError:
    what, lost = OUTPUTS[flag]
    return RunDirError(
        f"{what} {target} is in use by another shardflow train ({who}; it holds {at}), and two runs writing it at "
        f"once would keep only one's {lost}: wait for that run to end or stop it, or pass another {flag}"
    )


def _inside(flag: str, target: Path, run: Path, who: str) -> RunDirError:
    what, lost = OUTPUTS[flag]
    return RunDirError(
        f"{flag} {target}: the {what} lies in the run directory {run} of another shardflow train ({who}; it "
        f"holds {run / LOCK}), which writes there too, and two runs at once would keep only one's {lost}: wait for that "
        f"run to end or stop it, or pass another {flag}"
    )


def earlier_run(cfg: TrainConfig) -> list[str]:
    """What an earlier run left where this one would write: ``config.toml``, the metrics file, the complete
    checkpoints of the checkpoint directory (paths, for a message)."""
    found = [str(p) for p in (Path(cfg.run_dir) / CONFIG, metrics_path(cfg)) if p.exists()]
    steps = complete_steps(cfg.checkpoints)
    if steps:
        found.append(
            f"{len(steps)} checkpoint{'s' * (len(steps) > 1)} in {cfg.checkpoints}, the newest {steps[-1][1].name}"
        )
    return found


def lock(run: Path, target: Path | None = None, flag: str = "--run-dir") -> int:
    """Lock the run directory ``run`` for this process (``flock`` on ``run/.lock``, which then holds this process's PID,
    host and run directory), or with ``target`` one more path the run writes, ``flag`` saying which
    (:func:`output_lock`), and return the descriptor that holds the lock: closing it, or the end of every process
    that inherited it, releases the lock. Raises RunDirError naming the holder when another process has it."""
    path = run / LOCK if target is None else output_lock(target, flag)

    def refuse(who: str) -> RunDirError:
        if target is not None:
            return _in_use(flag, target, who, path)
        who = who.split(", run directory")[0]  # this directory
        return RunDirError(
            f"run directory {run} is in use by another shardflow train ({who} holds {path}); wait for "
            f"that run to end or stop it, or pass another --run-dir"
        )

    return exclusive(path, refuse, str(run))


def exclusive(path: Path, refuse: Callable[[str], Exception], note: str = "") -> int:
    """Hold an exclusive ``flock`` on lock file ``path`` (created if missing), which then reads this process's PID,
    host and ``note``, and return its descriptor (closing it, or the end of every process that inherited it,
    releases the lock). Raises ``refuse(holder)`` — the holder as :func:`_holder` words it — when another process
    holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _holder(fd)
        os.close(fd)
        raise refuse(who) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()} {note}".strip().encode() + b"\n")
    return fd


def _new_dir() -> Path:
    """Make and return ``runs/<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``, ... when another run took that name."""
    if LATEST.exists() and not LATEST.is_symlink():
        raise RunDirError(
            f"{LATEST} is a directory (a run of an earlier shardflow, whose default --run-dir it was); "
            f"rename it (e.g. mv {LATEST} {RUNS}/old) so that {LATEST} can point at the newest run, or "
            f"pass --run-dir"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    RUNS.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = RUNS / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RunDirError(f"{RUNS}/{stamp} and 998 more names are taken; pass --run-dir")


def _latest_run() -> Path:
    """The run ``runs/latest`` points at (``--resume`` without ``--run-dir``)."""
    if LATEST.is_symlink():
        return RUNS / os.readlink(LATEST)
    if LATEST.is_dir():
        return LATEST
    raise RunDirError(
        f"--resume without --run-dir continues the newest run, {LATEST}, which does not exist; pass "
        f"--run-dir with the directory of the run to continue"
    )


def _point_latest(run: Path) -> None:
    """Point ``runs/latest`` at ``run`` (a sibling): a symlink under a temporary name renamed over the old one."""
    tmp = LATEST.with_name(f".latest.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(run.name, tmp)
    os.replace(tmp, LATEST)


def _check_targets(cfg: TrainConfig) -> None:
    """Raise RunDirError when ``--metrics`` or ``--trace`` names a file the run writes for another purpose."""
    run = Path(cfg.run_dir).resolve()
    ckpts = cfg.checkpoints.resolve()
    metrics = metrics_path(cfg)
    for flag, value, other in (
        ("--metrics", cfg.metrics, cfg.trace and Path(cfg.trace)),
        ("--trace", cfg.trace, metrics),
    ):
        if not value:
            continue
        p = Path(value).resolve()
        what = (
            "the run's resolved configuration"
            if p == run / CONFIG
            else "the run directory's lock"
            if p == run / LOCK
            else f"the log of {p.stem.replace('rank', 'rank ')}"
            if p.parent == run and _RANK_LOG.fullmatch(p.name)
            else f"a file of the checkpoint directory {cfg.checkpoints}"
            if p.is_relative_to(ckpts)
            else ("the --trace file" if flag == "--metrics" else "the metrics file")
            if other and p == other.resolve()
            else None
        )
        if what:
            raise RunDirError(
                f"{flag} {value} would overwrite {what}, which the run writes too; pass another file for {flag}"
            )
