"""Local launcher: start N ranks on this machine the way torchrun does, watch them, report the root cause.

The parent binds the rendezvous store on a port the OS picks (port 0, loopback only) and keeps it; each rank
gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus
``TORCHELASTIC_USE_AGENT_STORE=True`` so it joins the parent's store as a client, ``OMP_NUM_THREADS`` =
cores / N, ``GLOO_SOCKET_IFNAME=lo`` and ``SHARDFLOW_LAUNCHED=1`` (:data:`LAUNCHED`: a rank tells this launcher's
ranks, whose parent owns the run, from torchrun's). Each rank's output goes to ``rank{r}.log`` in the run directory;
rank 0's is also echoed to the console. When a rank fails, the others get ``grace_s`` seconds (their
communication timeout plus a few) to exit on their own, then are killed; the launcher names the failed rank,
its exit status and the end of its log. Ctrl-C / SIGTERM are forwarded to the ranks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch.distributed as dist

LAUNCHED = "SHARDFLOW_LAUNCHED"  # set to 1 in the environment of every rank this launcher starts


@dataclass(frozen=True)
class LaunchResult:
    """Exit status of every rank, and the first failure (rank, status) if any; ``direct``: rank 0 wrote to this
    process's terminal itself (its stderr included), rather than through its log echoed on stdout."""

    returncodes: tuple[int, ...]
    failed: tuple[int, int] | None
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


def launch(cmd: Sequence[str], nproc: int, run_dir: Path, grace_s: float = 30.0, echo_rank0: bool = True,
           host: str = "127.0.0.1", keep_fds: Sequence[int] = ()) -> LaunchResult:
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
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR=host, MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                   OMP_NUM_THREADS=str(threads), GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
                   **{LAUNCHED: "1"})
        if r == 0 and direct:
            # On a terminal rank 0 writes to it directly (so it can draw a progress bar) and tees its own log.
            env["SHARDFLOW_TEE"] = str(run_dir / "rank0.log")
            p = subprocess.Popen(list(cmd), env=env, start_new_session=True, pass_fds=keep_fds)
        else:
            p = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True, pass_fds=keep_fds)
            t = threading.Thread(target=_pump, args=(p.stdout, run_dir / f"rank{r}.log", echo_rank0 and r == 0),
                                 daemon=True)
            t.start()
            pumps.append(t)
        procs.append(p)

    def forward(sig, _frame):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    failed: tuple[int, int] | None = None
    deadline = None
    try:
        while any(p.poll() is None for p in procs):
            if failed is None:
                failed = _first_failure([p.poll() for p in procs])
                if failed is not None:
                    deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for t in pumps:
        t.join(timeout=5)
    codes = tuple(p.returncode for p in procs)
    if failed is None:
        failed = _first_failure(list(codes))
    del store
    return LaunchResult(codes, failed, direct)


def _first_failure(codes: list[int | None]) -> tuple[int, int] | None:
    """The root cause among the ranks seen failed at one look: a rank killed by a signal (the launcher has sent
    none yet) before one that exited with a status — its peers exit on their own within milliseconds of losing
    it, often before the launcher looks again; else the lowest rank."""
    bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
    return min(bad, key=lambda rc: (rc[1] > 0, rc[0])) if bad else None


def describe_failure(result: LaunchResult, run_dir: Path) -> str:
    """One paragraph naming the failed rank, how it ended, and the end of its log."""
    r, code = result.failed
    how = f"was killed by signal {-code} ({_signal_name(-code)})" if code < 0 else f"exited with status {code}"
    others = [f"rank {i}: {c}" for i, c in enumerate(result.returncodes) if i != r]
    return (f"rank {r} {how} (others: {', '.join(others)}); its log {run_dir / f'rank{r}.log'} ends with:\n"
            f"{tail(run_dir / f'rank{r}.log')}")


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "unknown signal"
