"""Running per-rank programs together, with every communication a blocking meeting of its members — the one
simulation the verifier (deadlock check), the local executor (runs the step) and the predicted timeline
(``--trace``) share.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Mapping

from shardflow.lower.program import Comm, Program


def rendezvous(
    programs: Mapping[int, Program],
    local: Callable[[int, int, int], None] | None = None,
    meet: Callable[[list[tuple[int, Comm]]], None] | None = None,
) -> dict[int, int]:
    """Run ``programs`` (rank → program): each rank runs its instructions in order; a :class:`Comm` blocks
    its rank until every member has reached the same token, then completes for all of them at once.

    ``local(rank, start, stop)`` runs the instructions ``start`` to ``stop - 1`` of the rank's program, a run of
    instructions between two communications (none of them a :class:`Comm`), in order on its rank (one call per
    run, not per instruction: the local executor's loop is per-op overhead); ``meet(holders)``
    once per completed communication, ``holders`` = [(rank, its Comm)] in ``members`` order. A communication
    issued without waiting completes here too (its ``Wait`` is a local instruction). The result does not
    depend on the order in which ranks are advanced: each event depends only on its own rank's earlier
    events and on the members' meeting.

    Returns rank → index of the instruction it is blocked at, for every rank that cannot finish (empty:
    all finished; a non-empty result is a deadlock or a communication with a member that never arrives).
    """
    instrs = {r: p.instrs for r, p in programs.items()}
    pos = dict.fromkeys(instrs, 0)
    waiting: dict[int, set[int]] = defaultdict(set)  # token → ranks blocked at it
    moved = list(instrs)  # ranks that can advance
    while moved:
        r = moved.pop()
        p = instrs[r]
        start = pos[r]
        while pos[r] < len(p) and not isinstance(p[pos[r]], Comm):
            pos[r] += 1
        if local is not None and pos[r] > start:
            local(r, start, pos[r])
        if pos[r] == len(p):
            continue
        c = p[pos[r]]
        at = waiting[c.token]
        at.add(r)
        if all(set(instrs[q][pos[q]].members) <= at for q in at):  # every member is there: it completes
            del waiting[c.token]
            if meet is not None:
                meet([(m, instrs[m][pos[m]]) for m in c.members])
            for q in at:
                pos[q] += 1
            moved += at
    return {r: k for r, k in pos.items() if k < len(instrs[r])}
