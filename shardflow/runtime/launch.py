"""Local launcher: start N ranks on this machine the way torchrun does, watch them, report the root cause.

The parent binds the rendezvous store on a port the OS picks (port 0, loopback only) and keeps it; each rank
gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus
``TORCHELASTIC_USE_AGENT_STORE=True`` so it joins the parent's store as a client, ``OMP_NUM_THREADS`` =
cores / N, ``GLOO_SOCKET_IFNAME=lo``, ``SHARDFLOW_LAUNCHED=1`` (:data:`LAUNCHED`: a rank tells this launcher's
ranks, whose parent owns the run, from torchrun's) and the launcher's PID (:data:`LAUNCHER_PID`: a rank stops when
the launcher dies, even by SIGKILL: :func:`stop_with_launcher`). A rank is a new Python process running the command,
or — when the caller passes the rank's entry and forking is safe (:func:`_can_fork`) — a fork of the launcher that
calls it, sparing every rank the imports and the plan the launcher has already paid for (docs/execution.md#forked-ranks).
Each rank's output goes to ``rank{r}.log`` in the
run directory; rank 0's is also echoed to the console. When a rank fails, the others get ``grace_s`` seconds (their
communication timeout plus a few) to exit on their own, then are killed; the launcher names the rank at the root of
the failure — from the ranks' exit statuses (:class:`Status`) and the order it saw them exit: a rank that stopped
answering rather than the one that timed out waiting on it — its exit status and the end of its log. Ctrl-C /
SIGTERM are forwarded to the ranks.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Set
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import IO, Mapping, Sequence

import torch
import torch.distributed as dist

LAUNCHED = "SHARDFLOW_LAUNCHED"  # set to 1 in the environment of every rank this launcher starts
LAUNCHER_PID = "SHARDFLOW_LAUNCHER_PID"  # the launcher's process id, in the same environments
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies (Linux)


class Status(IntEnum):
    """The exit statuses by which a launched rank tells the launcher why it ended (besides 0, and 130 when a signal
    stopped it)."""

    FAILED = 1  # its own error, with a traceback
    REFUSED = 2  # an input it cannot use, in one paragraph
    WAITED_OUT = 3  # a member of one of its communications stopped answering: it waited out the timeout
    PEER_LOST = 4  # a member of one of its communications left (exited or was killed)


@dataclass(frozen=True)
class LaunchResult:
    """Exit status of every rank, and the root cause of a failure (rank, status) if any (:func:`root_cause`);
    ``waited_by``: where the failed rank stopped answering, the rank that gave up waiting on it; ``killed``: the ranks
    the launcher killed once the others had failed; ``direct``: rank 0 wrote to this process's terminal itself (its
    stderr included), rather than through its log echoed on stdout."""

    returncodes: tuple[int, ...]
    failed: tuple[int, int] | None
    waited_by: int | None = None
    killed: tuple[int, ...] = ()
    direct: bool = False

    @property
    def ok(self) -> bool:
        return self.failed is None


def _pump(stream, log: Path, echo: bool) -> None:
    with open(log, "w", buffering=1) as f:
        for line in iter(stream.readline, ""):
            f.write(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()


def tail(path: Path, n: int = 15) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return ""


def _listen(host: str) -> tuple[int, int]:
    """A listening socket on ``host`` and a port the OS picks: (its file descriptor, handed over, and the port)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(addr)
    sock.listen(128)
    port = sock.getsockname()[1]
    return sock.detach(), port  # the store owns the descriptor from now on (it closes it)


def stop_with_launcher() -> None:
    """In a rank this launcher started: have Linux send this process SIGTERM when the launcher dies — even by
    SIGKILL, which the launcher cannot forward — so that no rank trains on orphaned, holding the run directory's
    lock (the rank stops on SIGTERM as on Ctrl-C; a save in flight leaves only its ``.tmp``). A no-op in other
    processes (torchrun's ranks: its agent watches them) and on other systems than Linux (prctl(2))."""
    parent = os.environ.get(LAUNCHER_PID)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    try:
        os.kill(int(parent), 0)
    except ProcessLookupError:  # the launcher died before the request: nobody will send the signal
        os.kill(os.getpid(), signal.SIGTERM)


class _Forked:
    """A rank forked from the launcher, watched like a :class:`subprocess.Popen` (``returncode``: -N when signal N
    ended it)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _can_fork(threads: int) -> bool:
    """Forking the launcher is safe: it runs one Python thread (a thread holding a lock at the fork would leave the
    rank's copy of that lock held forever; :func:`launch` stops tqdm's first), CUDA is not initialised (a forked
    process cannot use it) and each rank computes on one thread (GNU OpenMP's thread pool does not survive a fork: a
    rank that starts a team of threads after the launcher has run one hangs)."""
    return threads == 1 and threading.active_count() == 1 and not torch.cuda.is_initialized()


def _stop_tqdm_monitor() -> None:
    """Stop tqdm's monitor thread, if one runs: torch.fx's interpreter opens a (disabled) tqdm bar at every capture,
    and the thread it starts outlives the bar. A later bar starts a new one."""
    tqdm = sys.modules.get("tqdm")
    monitor = getattr(getattr(tqdm, "tqdm", None), "monitor", None)
    if monitor is not None:
        monitor.exit()


def _fork_rank(main: Callable[[], int], env: Mapping[str, str], out: int | None, close: Sequence[int]) -> _Forked:
    """Fork a rank that runs ``main`` with ``env`` added to its environment, its stdout and stderr on descriptor
    ``out`` (None: the launcher's own), in a session of its own, and exits with ``main``'s status (1 after a
    traceback, which it prints); ``close``: the launcher's descriptors the rank must not hold."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Forked(pid)
    code = 1
    try:  # the rank: from here it never returns into the launcher's frames
        os.setsid()
        for fd in close:
            os.close(fd)
        os.environ.update(env)
        if out is not None:
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
            sys.stdout = _line_writer(1)  # sys.__stdout__ writes to descriptor 1 too
            sys.stderr = _line_writer(2)
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)  # the launcher's, if it set one
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # a closed or broken output: the status still reaches the launcher
                pass
        os._exit(code)


def _line_writer(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="replace", write_through=True)


def launch(
    cmd: Sequence[str],
    nproc: int,
    run_dir: Path,
    grace_s: float = 30.0,
    echo_rank0: bool = True,
    host: str = "127.0.0.1",
    keep_fds: Sequence[int] = (),
    rank_main: list[Callable[[], int]] | None = None,
) -> LaunchResult:
    """Run ``cmd`` (an argv, e.g. ``[python, -m, shardflow.cli, train, ...]``) as ``nproc`` ranks.

    Returns when every rank has exited (killed ``grace_s`` after the first failure). Per-rank logs:
    ``run_dir/rank{r}.log``. ``keep_fds``: descriptors every rank inherits (the run directory's lock, held while any
    rank lives). ``rank_main``: a one-element list holding what ``cmd`` runs in a rank, as a function returning the
    exit status; where :func:`_can_fork`, every rank is a fork of this process that calls it instead of a new
    process. The launcher takes it out of the list, so that once the ranks have started it holds nothing the
    function holds (a model).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    # TCPStore given port 0 listens on every interface; a socket we bind on ``host`` alone keeps it on loopback
    fd, port = _listen(host)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    main = rank_main.pop() if rank_main else None
    if main is not None:
        _stop_tqdm_monitor()
    fork = main is not None and _can_fork(threads)
    direct = echo_rank0 and sys.stdout.isatty()
    procs: list = []
    outs: list[tuple[int, IO[str]]] = []  # (rank, the read end of its output)
    for r in range(nproc):
        env = dict(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            OMP_NUM_THREADS=str(threads),
            GLOO_SOCKET_IFNAME="lo",
            PYTHONUNBUFFERED="1",
            **{LAUNCHED: "1", LAUNCHER_PID: str(os.getpid())},
        )
        if r == 0 and direct:
            # On a terminal rank 0 writes to it directly (so it can draw a progress bar) and tees its own log.
            env["SHARDFLOW_TEE"] = str(run_dir / "rank0.log")
        piped = not (r == 0 and direct)
        if fork and main is not None:
            others = [fd, *(o.fileno() for _, o in outs)]  # descriptors the rank closes
            if piped:
                read, write = os.pipe()
                procs.append(_fork_rank(main, env, write, [*others, read]))
                os.close(write)
                outs.append((r, open(read, encoding="utf-8", errors="replace")))
            else:
                procs.append(_fork_rank(main, env, None, others))
        else:
            p = subprocess.Popen(
                list(cmd),
                env={**os.environ, **env},
                stdout=subprocess.PIPE if piped else None,
                stderr=subprocess.STDOUT if piped else None,
                text=True,
                start_new_session=True,
                pass_fds=keep_fds,
            )
            procs.append(p)
            if p.stdout is not None:
                outs.append((r, p.stdout))
    del main  # the ranks hold their own copies now
    store = dist.TCPStore(host, port, nproc, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    pumps = []
    for r, stream in outs:
        t = threading.Thread(target=_pump, args=(stream, run_dir / f"rank{r}.log", echo_rank0 and r == 0), daemon=True)
        t.start()
        pumps.append(t)

    def forward(sig, _frame):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)

    old = (
        {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    seen: dict[int, int] = {}  # rank → the look at which it was first seen exited
    killed: list[int] = []
    deadline = None
    looks = 0
    try:
        while len(seen) < nproc:
            looks += 1
            seen.update((r, looks) for r, p in enumerate(procs) if r not in seen and p.poll() is not None)
            if deadline is None and any(procs[r].returncode for r in seen):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        killed.append(r)
                deadline = math.inf
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for t in pumps:
        t.join(timeout=5)
    codes = tuple(p.returncode for p in procs)
    del store
    return LaunchResult(codes, *root_cause(codes, seen, set(killed)), tuple(killed), direct)


def root_cause(
    codes: Sequence[int], seen: Mapping[int, int], killed: Set[int]
) -> tuple[tuple[int, int] | None, int | None]:
    """The failed rank at the root of a failure, as (rank, status), and the rank that gave up waiting on it (or
    None), from every rank's exit status, the look at which the launcher first saw it exited (``seen``) and the
    ranks it killed itself. In order: a rank killed by a signal the launcher did not send (its peers lose their
    connection to it at once); a rank that failed on its own (status 1, 2; not a :class:`Status` that blames
    another); a rank that stopped answering — the lowest rank still running when the first rank waited out its
    timeout that did not wait out its own (it was stuck, not waiting: it exits later, on finding its peers gone, or
    is killed by the launcher); else the first rank seen failed. None when every rank succeeded."""
    failed = sorted((seen[r], r) for r, c in enumerate(codes) if c)
    if not failed:
        return None, None
    blame = (Status.WAITED_OUT, Status.PEER_LOST, 130)
    for look, r in failed:
        if codes[r] < 0 and r not in killed:
            return (r, codes[r]), None
    for look, r in failed:
        if codes[r] > 0 and codes[r] not in blame:
            return (r, codes[r]), None
    waited = [r for _, r in failed if codes[r] == Status.WAITED_OUT]
    if waited:
        first = waited[0]
        stuck = [r for r in range(len(codes)) if seen[r] > seen[first] and codes[r] != Status.WAITED_OUT]
        if stuck:
            return (stuck[0], codes[stuck[0]]), first
    _, r = failed[0]
    return (r, codes[r]), None


def describe_failure(result: LaunchResult, run_dir: Path) -> str:
    """One paragraph naming the rank at the root of the failure and how it ended — for a rank that stopped
    answering, the rank that gave up waiting on it and that rank's last line — then the end of its log (or that its
    log is empty)."""
    r, code = result.failed
    log = run_dir / f"rank{r}.log"
    how = (
        f"was killed by signal {-code} ({_signal_name(-code)})"
        if code < 0 and r not in result.killed
        else "was still stuck when the launcher killed it"
        if code < 0
        else f"exited with status {code}"
    )
    others = [f"rank {i}: {c}" for i, c in enumerate(result.returncodes) if i != r]
    end = tail(log)
    logged = f"its log {log} ends with:\n{end}" if end.strip() else f"its log {log} is empty"
    if result.waited_by is not None:
        w = result.waited_by
        said = tail(run_dir / f"rank{w}.log", 1).strip()
        return (
            f"rank {r} stopped answering: rank {w} gave up waiting on it after the communication timeout, then "
            f"rank {r} {how} (others: {', '.join(others)}); rank {w}'s log ends with: {said}; rank {r}'s "
            f"{logged.removeprefix('its ')}"
        )
    return f"rank {r} {how} (others: {', '.join(others)}); {logged}"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "unknown signal"
