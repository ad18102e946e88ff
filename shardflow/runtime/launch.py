"""Local launcher: start N ranks on this machine the way torchrun does, watch them, report the root cause.

The parent binds the rendezvous store on a port the OS picks (port 0, loopback only) and keeps it; each rank
gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus
``TORCHELASTIC_USE_AGENT_STORE=True`` so it joins the parent's store as a client, ``OMP_NUM_THREADS`` =
cores / N, ``GLOO_SOCKET_IFNAME=lo``, ``SHARDFLOW_LAUNCHED=1`` (:data:`LAUNCHED`: a rank tells this launcher's
ranks, whose parent owns the run, from torchrun's) and the launcher's PID (:data:`LAUNCHER_PID`: a rank stops when
the launcher dies, even by SIGKILL: :func:`stop_with_launcher`). Each rank's output goes to ``rank{r}.log`` in the
run directory; rank 0's is also echoed to the console. When a rank fails, the others get ``grace_s`` seconds (their
communication timeout plus a few) to exit on their own, then are killed; the launcher names the rank at the root of
the failure — from the ranks' exit statuses (:class:`Status`) and the order it saw them exit: a rank that stopped
answering rather than the one that timed out waiting on it — its exit status and the end of its log. Ctrl-C /
SIGTERM are forwarded to the ranks.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Set
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Mapping, Sequence

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


def launch(
    cmd: Sequence[str],
    nproc: int,
    run_dir: Path,
    grace_s: float = 30.0,
    echo_rank0: bool = True,
    host: str = "127.0.0.1",
    keep_fds: Sequence[int] = (),
) -> LaunchResult:
    """Run ``cmd`` (an argv, e.g. ``[python, -m, shardflow.cli, train, ...]``) as ``nproc`` ranks.

    Returns when every rank has exited (killed ``grace_s`` after the first failure). Per-rank logs:
    ``run_dir/rank{r}.log``. ``keep_fds``: descriptors every rank inherits (the run directory's lock, held while any
    rank lives).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    # TCPStore given port 0 listens on every interface; a socket we bind on ``host`` alone keeps it on loopback
    fd, port = _listen(host)
    store = dist.TCPStore(host, port, nproc, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    direct = echo_rank0 and sys.stdout.isatty()
    procs, pumps = [], []
    for r in range(nproc):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR=host,
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            OMP_NUM_THREADS=str(threads),
            GLOO_SOCKET_IFNAME="lo",
            PYTHONUNBUFFERED="1",
            **{LAUNCHED: "1", LAUNCHER_PID: str(os.getpid())},
        )
        if r == 0 and direct:
            # On a terminal rank 0 writes to it directly (so it can draw a progress bar) and tees its own log.
            env["SHARDFLOW_TEE"] = str(run_dir / "rank0.log")
            p = subprocess.Popen(list(cmd), env=env, start_new_session=True, pass_fds=keep_fds)
        else:
            p = subprocess.Popen(
                list(cmd),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                pass_fds=keep_fds,
            )
            t = threading.Thread(
                target=_pump, args=(p.stdout, run_dir / f"rank{r}.log", echo_rank0 and r == 0), daemon=True
            )
            t.start()
            pumps.append(t)
        procs.append(p)

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
