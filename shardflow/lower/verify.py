"""Static checks of per-rank programs, run before any process starts (design §6, "Order").

:func:`verify` proves that a set of per-rank programs can run together: every communication is well formed,
each rank issues its communications in token order, every member of a communication holds it and all agree
on what it is (every send has its recv, every permute step is one consistent exchange), every pair of ranks
sees their shared communications in the same order, and running all ranks cannot deadlock.
:func:`fingerprints` and :func:`check_fingerprints` compare plan hashes across ranks at start-up.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import combinations
from typing import Iterator, Mapping

from shardflow.lower.program import COMM_KINDS, Comm, Program

SHOWN = 5  # problems quoted in the error message; all are in ``problems``

# The fields among peer / peer_from / root that each family uses (each must name a member); others are None.
_FIELDS = {"p2p": ("peer",), "permute": ("peer", "peer_from"), "broadcast": ("root",), "reduce": ("root",)}


class PlanVerificationError(ValueError):
    """The programs cannot run correctly together. ``problems``: every problem found, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f"\n  ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        super().__init__(f"plan verification failed ({len(problems)} problem(s)):\n  "
                         + "\n  ".join(problems[:SHOWN]) + more)


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
       dtype and root; in each permute step the rank a member sends to receives from it;
    4. every pair of ranks issues the tokens they share in the same relative order;
    5. no deadlock: ranks run with every Comm a blocking rendezvous of its members; every rank must finish.

    Raises :class:`PlanVerificationError` listing every problem, naming ranks, tokens and kinds.
    """
    problems = (_check_programs(programs, world_size) + _check_order(programs) + _check_tokens(programs)
                + _check_pairs(programs) + _check_deadlock(programs))
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
            + "; every rank must lower the same plan (same graph, strategy, mesh and shardflow version)", differ)


def _d(c: Comm) -> str:
    return f"token {c.token} ({c.kind})"


def _what(c: Comm) -> str:
    root = f" root={c.root}" if c.root is not None else ""
    return f"{c.family} over {list(c.members)} {c.type.dtype}{list(c.type.shape)}{root}"


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
    if c.kind not in COMM_KINDS:
        yield f"unknown kind; expected one of {', '.join(COMM_KINDS)}"
        return
    m = c.members
    if bad := [x for x in m if not 0 <= x < world_size]:
        yield f"members {bad} out of range for world size {world_size}"
    if rank not in m:
        yield f"the holding rank is not among members {list(m)}"
    if len(set(m)) != len(m):
        yield f"duplicate members in {list(m)}"
    used = _FIELDS.get(c.family, ())
    for field in ("peer", "peer_from", "root"):
        v = getattr(c, field)
        if field in used and v not in m:
            yield f"{field}={v} is not among members {list(m)}"
        elif field not in used and v is not None:
            yield f"{field}={v} is set but {c.kind} takes no {field}"
    if c.family == "p2p" and len(m) != 2:
        yield f"members must be (src, dst), got {list(m)}"
    elif c.family == "p2p":
        me, other = m if c.kind == "send" else m[::-1]
        if (rank, c.peer) != (me, other):
            yield f"with (src, dst) = {m} it belongs on rank {me} with peer {other}, got peer {c.peer}"


def _check_order(programs: Mapping[int, Program]) -> list[str]:
    return [f"rank {r} issues {_d(b)} after {_d(a)}: tokens must strictly increase"
            for r, p in programs.items() for a, b in zip(p.comms, p.comms[1:]) if b.token <= a.token]


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
            out.append(f"token {t}: holders disagree: " + "; ".join(
                f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} hold{'s' * (len(rs) == 1)} {w}"
                for w, rs in parts))
        held = dict(hs)
        for m in sorted({m for _, c in hs for m in c.members} - held.keys()):
            r, c = next((r, c) for r, c in hs if m in c.members)
            out.append(f"rank {r} sends token {t} to rank {m}, which has no matching recv" if c.kind == "send" else
                       f"rank {r} receives token {t} from rank {m}, which has no matching send" if c.kind == "recv"
                       else f"rank {m} is a member of {_d(c)} over {list(c.members)} on rank {r} but lacks it")
        for r, c in hs:
            to = held.get(c.peer) if c.kind == "permute" else None
            if to is not None and to.kind == "permute" and to.peer_from != r:
                out.append(f"{_d(c)}: rank {r} sends to rank {c.peer}, which receives from rank {to.peer_from}")
    return out


def _check_pairs(programs: Mapping[int, Program]) -> list[str]:
    tokens = {r: {c.token for c in p.comms} for r, p in programs.items()}
    out = []
    for a, b in combinations(sorted(programs), 2):
        shared = tokens[a] & tokens[b]
        seq_a = [c for c in programs[a].comms if c.token in shared]
        seq_b = [c for c in programs[b].comms if c.token in shared]
        for i, (x, y) in enumerate(zip(seq_a, seq_b)):
            if x.token != y.token:
                out.append(f"ranks {a} and {b} order their shared communications differently: at shared "
                           f"position {i} rank {a} issues {_d(x)}, rank {b} issues {_d(y)}")
                break
    return out


def _check_deadlock(programs: Mapping[int, Program]) -> list[str]:
    comms = {r: p.comms for r, p in programs.items()}
    pos = dict.fromkeys(comms, 0)
    waiting: dict[int, set[int]] = defaultdict(set)  # token -> ranks blocked at it
    for r, cs in comms.items():
        if cs:
            waiting[cs[0].token].add(r)
    pending = list(waiting)
    while pending:  # fire a token once every rank blocked at it finds all its members there
        t = pending.pop()
        at = waiting.get(t)
        if not at or any(set(comms[r][pos[r]].members) - at for r in at):
            continue
        del waiting[t]
        for r in at:
            pos[r] += 1
            if pos[r] < len(comms[r]):
                waiting[comms[r][pos[r]].token].add(r)
                pending.append(comms[r][pos[r]].token)

    def state(m: int) -> str:
        if m not in comms:
            return f"rank {m} (no program)"
        return f"rank {m} ({'finished' if pos[m] == len(comms[m]) else f'blocked at {_d(comms[m][pos[m]])}'})"

    out = []
    for r in sorted(r for r in comms if pos[r] < len(comms[r])):
        c = comms[r][pos[r]]
        at = waiting[c.token]
        absent = sorted({m for q in at for m in comms[q][pos[q]].members} - at)
        out.append(f"deadlock: rank {r} blocks at {_d(c)} over {list(c.members)} waiting for "
                   + ", ".join(map(state, absent)))
    return out
