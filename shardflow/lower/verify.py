"""Static checks of per-rank programs (docs/lowering.md#6-the-verifier-shardflowlowerverifyverify): :func:`verify` runs
before any process starts and proves the programs can run together; :func:`fingerprints` / :func:`check_fingerprints`
compare plan hashes across ranks at start-up, so that ranks holding different plans refuse to run.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import combinations
from typing import Iterator, Mapping

from shardflow.lower.program import Buffer, Comm, Compute, Free, Instr, Program, Wait, layout_text, reads, writes
from shardflow.lower.rendezvous import rendezvous
from shardflow.parallel.collectives import KINDS, CommKind
from shardflow.parallel.mesh import ReduceOp

SHOWN = 5  # problems quoted in the error message; all are in ``problems``


class PlanVerificationError(ValueError):
    """The programs cannot run correctly together. ``problems``: every problem found, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f"\n  ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        super().__init__(
            f"plan verification failed ({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:SHOWN]) + more
        )


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans. ``ranks``: the ranks whose fingerprint differs from rank 0's."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def verify(programs: Mapping[int, Program], world_size: int) -> None:
    """Check ``programs`` (rank -> program) for a world of ``world_size`` ranks; return None if they are sound.

    1. programs: key == ``program.rank``, rank in ``[0, world_size)``; each Comm: known kind, members valid
       ranks without duplicates that include the holder; peer / peer_from / root name members (send/recv:
       members ``(src, dst)``, held by src with ``peer=dst`` and by dst with ``peer=src``);
    2. each rank's tokens strictly increase;
    3. each token is held exactly once by each of its members, all agreeing on family, members, shape,
       dtype, root and the padding of an uneven dim (docs/concepts.md#uneven-shards); in each permute step the
       rank a member sends to receives from it;
    4. every pair of ranks issues the tokens they share in the same relative order;
    5. no deadlock: ranks run with every Comm a blocking rendezvous of its members; every rank must finish;
    6. every communication issued without waiting (``wait=False``) is completed by exactly one later
       ``Wait`` on its rank, and every ``Wait`` completes such a communication;
    7. per-rank dataflow: every buffer an instruction reads (a compute's inputs, a communication's send
       buffer) is one of the program's ``inputs``, computed or received earlier on that rank (an async
       receive only after its ``Wait``), with the piece shape and dtype it was made with; nothing is read or
       freed after its :class:`Free`, and no send buffer of a communication in flight is freed before its
       ``Wait``.

    Raises :class:`PlanVerificationError` listing every problem, naming ranks, tokens, instructions and values.
    """
    problems = (
        _check_programs(programs, world_size)
        + _check_order(programs)
        + _check_tokens(programs)
        + _check_pairs(programs)
        + _check_deadlock(programs)
        + _check_waits(programs)
        + _check_dataflow(programs)
    )
    if problems:
        raise PlanVerificationError(problems)


def fingerprints(programs: Mapping[int, Program]) -> dict[int, str]:
    """rank -> :meth:`Program.fingerprint` (sha256 of its ordered communications)."""
    return {r: p.fingerprint() for r, p in programs.items()}


def check_fingerprints(local: Mapping[int, str]) -> None:
    """Compare the fingerprints every rank computed for its plan (rank -> hex digest) with rank 0's.

    Raises :class:`PlanMismatchError` naming each differing rank (or rank 0 missing): refuse to run.
    """
    if 0 not in local:
        raise PlanMismatchError(f"no plan fingerprint from rank 0 (got ranks {sorted(local)})", [])
    differ = sorted(r for r, f in local.items() if f != local[0])
    if differ:
        raise PlanMismatchError(
            f"plan differs from rank 0 (fingerprint {local[0][:12]}) on "
            + ", ".join(f"rank {r} ({local[r][:12]})" for r in differ)
            + "; every rank must lower the same plan (same graph, strategy, mesh and shardflow version)",
            differ,
        )


_P2P = (CommKind.SEND, CommKind.RECV)  # the two ends of one transfer


def _d(c: Comm) -> str:
    return f"token {c.token} ({c.kind})"


def _what(c: Comm) -> str:
    """What the holders of a token must agree on (:meth:`Comm.signature`), in words."""
    return (
        f"{c.family} over {list(c.members)} {c.type.dtype}{list(c.type.shape)}"
        + (f" root={c.root}" if c.root is not None else "")
        + (f" op={c.reduce_op}" if c.reduce_op != ReduceOp.SUM else "")
        + (f" of {c.value}" if c.value else "")
        + (f" piece {list(c.piece)}" if c.kind in _P2P and c.piece else "")
        + "".join(f" {layout_text(h, to)}" for to, h in zip((True, False), c.padded) if h is not None)
    )


def _check_programs(programs: Mapping[int, Program], world_size: int) -> list[str]:
    out = []
    for key, p in programs.items():
        if key != p.rank:
            out.append(f"programs[{key}] holds the program of rank {p.rank}")
        if not 0 <= p.rank < world_size:
            out.append(f"rank {p.rank} is out of range for world size {world_size}")
        out += [f"rank {key} {_d(c)}: {e}" for c in p.comms for e in _comm_errors(key, c, world_size)]
    return out


def _comm_errors(rank: int, c: Comm, world_size: int) -> Iterator[str]:
    if c.kind not in KINDS:
        yield f"unknown kind; expected one of {', '.join(CommKind)}"
        return
    m = c.members
    if bad := [x for x in m if not 0 <= x < world_size]:
        yield f"members {bad} out of range for world size {world_size}"
    if rank not in m:
        yield f"the holding rank is not among members {list(m)}"
    if len(set(m)) != len(m):
        yield f"duplicate members in {list(m)}"
    used = KINDS[c.kind].fields
    for field in ("peer", "peer_from", "root"):
        v = getattr(c, field)
        if field in used and v not in m and c.kind not in _P2P:  # p2p peers: checked against (src, dst) below
            yield f"{field}={v} is not among members {list(m)}"
        elif field not in used and v is not None:
            yield f"{field}={v} is set but {c.kind} takes no {field}"
    if c.kind in _P2P and (len(m) != 2 or (rank, c.peer) != (m if c.kind == CommKind.SEND else m[::-1])):
        end, other = ("src", "dst") if c.kind == CommKind.SEND else ("dst", "src")
        yield f"needs members (src, dst), held by {end} with peer={other}; got members {list(m)}, peer={c.peer}"


def _check_order(programs: Mapping[int, Program]) -> list[str]:
    return [
        f"rank {r} issues {_d(b)} after {_d(a)}: tokens must strictly increase"
        for r, p in programs.items()
        for a, b in zip(p.comms, p.comms[1:])
        if b.token <= a.token
    ]


def _check_tokens(programs: Mapping[int, Program]) -> list[str]:
    holders: dict[int, list[tuple[int, Comm]]] = defaultdict(list)
    for r, p in programs.items():
        for c in p.comms:
            holders[c.token].append((r, c))
    out = []
    for t, hs in sorted(holders.items()):
        out += [f"rank {r} holds token {t} {n} times" for r, n in Counter(r for r, _ in hs).items() if n > 1]
        groups: dict[str, list[int]] = defaultdict(list)
        for r, c in hs:
            groups[_what(c)].append(r)
        if len(groups) > 1:
            parts = sorted(groups.items(), key=lambda g: (-len(g[1]), g[1]))
            out.append(
                f"token {t}: holders disagree: "
                + "; ".join(
                    f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} hold{'s' * (len(rs) == 1)} {w}"
                    for w, rs in parts
                )
            )
        held = dict(hs)
        for m in sorted({m for _, c in hs for m in c.members} - held.keys()):
            r, c = next((r, c) for r, c in hs if m in c.members)
            out.append(
                f"rank {r} sends token {t} to rank {m}, which has no matching recv"
                if c.kind == CommKind.SEND
                else f"rank {r} receives token {t} from rank {m}, which has no matching send"
                if c.kind == CommKind.RECV
                else f"rank {m} is a member of {_d(c)} over {list(c.members)} on rank {r} but lacks it"
            )
        for r, c in hs:
            to = held.get(c.peer) if c.kind == CommKind.PERMUTE else None
            if to is not None and to.kind == CommKind.PERMUTE and to.peer_from != r:
                out.append(f"{_d(c)}: rank {r} sends to rank {c.peer}, which receives from rank {to.peer_from}")
    return out


def _check_pairs(programs: Mapping[int, Program]) -> list[str]:
    first: dict[int, dict[int, Comm]] = {r: {} for r in programs}  # rank -> token -> first Comm, issue order
    for r, p in programs.items():
        for c in p.comms:
            first[r].setdefault(c.token, c)
    out = []
    for a, b in combinations(sorted(programs), 2):
        shared = first[a].keys() & first[b].keys()
        seq_a = [c for t, c in first[a].items() if t in shared]
        seq_b = [c for t, c in first[b].items() if t in shared]
        for i, (x, y) in enumerate(zip(seq_a, seq_b)):
            if x.token != y.token:
                out.append(
                    f"ranks {a} and {b} order their shared communications differently: at shared "
                    f"position {i} rank {a} issues {_d(x)}, rank {b} issues {_d(y)}"
                )
                break
    return out


def _check_deadlock(programs: Mapping[int, Program]) -> list[str]:
    blocked = rendezvous(programs)
    comms = {r: p.instrs[blocked[r]] for r, p in programs.items() if r in blocked}
    at: dict[int, set[int]] = defaultdict(set)
    for r, c in comms.items():
        at[c.token].add(r)

    def state(m: int) -> str:
        return (
            f"rank {m} ("
            + ("no program" if m not in programs else "finished" if m not in comms else f"blocked at {_d(comms[m])}")
            + ")"
        )

    out = []
    for r, c in sorted(comms.items()):
        absent = sorted({m for q in at[c.token] for m in comms[q].members} - at[c.token])
        out.append(
            f"deadlock: rank {r} blocks at {_d(c)} over {list(c.members)} waiting for " + ", ".join(map(state, absent))
        )
    return out


def _check_waits(programs: Mapping[int, Program]) -> list[str]:
    out = []
    for r, p in sorted(programs.items()):
        open_: dict[int, Comm] = {}  # token → async communication not yet waited
        for instr in p.instrs:
            if isinstance(instr, Wait):
                if instr.token not in open_:
                    out.append(f"rank {r} waits on token {instr.token}, which it did not issue without waiting")
                open_.pop(instr.token, None)
            elif isinstance(instr, Comm) and not instr.wait:
                open_[instr.token] = instr
        out += [f"rank {r} never waits on token {t} ({c.kind}), issued without waiting" for t, c in open_.items()]
    return out


def _instr(k: int, i: Instr) -> str:
    what = (
        f"token {i.token} ({i.kind})"
        if isinstance(i, Comm)
        else f"{i.op}"
        if isinstance(i, Compute)
        else f"wait {i.token}"
        if isinstance(i, Wait)
        else "free"
    )
    return f"instruction {k} [{what}]"


def _check_dataflow(programs: Mapping[int, Program]) -> list[str]:
    out = []
    for r, p in sorted(programs.items()):
        held: dict[str, Buffer] = {b.value: b for b in p.inputs}  # value → the buffer as made
        freed: dict[str, int] = {}  # value → index of the Free that released it
        arriving: dict[int, Buffer] = {}  # token → receive buffer of an async communication in flight
        sending: dict[int, str] = {}  # token → send buffer of an async communication in flight
        for k, i in enumerate(p.instrs):
            for b in reads(i):
                have = held.get(b.value)
                if have is None:
                    token = next((t for t, x in arriving.items() if x.value == b.value), None)
                    why = (
                        f"freed at instruction {freed[b.value]}"
                        if b.value in freed
                        else f"token {token} fills it only at its wait, later"
                        if token is not None
                        else "never computed, received or held as an input on this rank"
                    )
                    out.append(f"rank {r} {_instr(k, i)} reads {b.value!r}: {why}")
                elif have.type != b.type:
                    out.append(
                        f"rank {r} {_instr(k, i)} reads {b.value!r} as {b.type.dtype}{list(b.type.shape)} "
                        f"but it holds {have.type.dtype}{list(have.type.shape)}"
                    )
            if isinstance(i, Wait):
                if (b := arriving.pop(i.token, None)) is not None:
                    held[b.value] = b
                sending.pop(i.token, None)
            elif isinstance(i, Free):
                for v in i.values:
                    if v not in held:
                        out.append(f"rank {r} {_instr(k, i)} frees {v!r}, which it does not hold")
                    elif (t := next((t for t, s in sending.items() if s == v), None)) is not None:
                        out.append(f"rank {r} {_instr(k, i)} frees {v!r} while token {t} still sends it")
                    held.pop(v, None)
                    freed[v] = k
            elif isinstance(i, Comm) and not i.wait:
                if i.recv is not None:
                    arriving[i.token] = i.recv
                if i.send is not None:
                    sending[i.token] = i.send.value
            else:
                for b in writes(i):
                    held[b.value] = b
                    freed.pop(b.value, None)
    return out
