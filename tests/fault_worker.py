"""One rank of tests/test_faults.py's safety check, started by shardflow's launcher.

Usage: python fault_worker.py OUT_DIR

Writes OUT_DIR/listeners{rank}.json: the local addresses of every listening TCP socket on the launcher's
rendezvous port (MASTER_PORT), of every listening socket the launcher process (the parent) holds, and of every
listening socket this rank holds once it has joined the gloo process group.
"""

import json
import os
import socket
import sys
from pathlib import Path


def _address(hex_addr: str) -> str:
    """'0100007F:1F90' (from /proc/net/tcp, host byte order per 32-bit word) → '127.0.0.1'."""
    host = hex_addr.split(":")[0]
    raw = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening() -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every TCP socket in state LISTEN on this machine."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                out.append((_address(f[1]), int(f[1].split(":")[1], 16), f[9]))
    return out


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def main() -> None:
    out = Path(sys.argv[1])
    port = int(os.environ["MASTER_PORT"])
    store = [a for a, p, _ in listening() if p == port]
    parent = socket_inodes(os.getppid())
    parent_listeners = [a for a, _, i in listening() if i in parent]

    from shardflow.runtime.distributed import init_from_env, shutdown

    rank, _ = init_from_env(30)
    mine = socket_inodes(os.getpid())
    rank_listeners = [a for a, _, i in listening() if i in mine]
    (out / f"listeners{rank}.json").write_text(
        json.dumps({"store": store, "parent": parent_listeners, "rank": rank_listeners})
    )
    shutdown(0)


if __name__ == "__main__":
    main()
