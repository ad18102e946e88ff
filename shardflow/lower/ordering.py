"""Ordering (design §6, "Order"): one global order of every communication, and the per-rank programs.

Every communication instance gets a token, its position in one global order: the steps' order (the
dynamic graph's node order), then the order within the step (group, ring step). Token numbers are
computed arithmetically — a step's first token is the number of communications all earlier steps make
— so a rank orders only its own program at a cost that does not grow with the world size. Each rank issues
its communications in token order. Deferred instructions (a bucket's Wait and unpack) go right before the
first instruction that reads what they fill; a :class:`~shardflow.lower.program.Free` follows the last reader
of each buffer that does not outlive the step. Each program lists the pieces it holds before it starts
(``inputs``) and the process groups every rank creates, in one order (``groups``).
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate

from shardflow.lower.comm_lowering import instances, process_groups
from shardflow.lower.dynamic import PassError, PassName, require
from shardflow.lower.program import Comm, Free, Instr, Program, Wait, reads, writes
from shardflow.lower.shard_expansion import ShardedGraph, in_group, piece


def ordering(sg: ShardedGraph) -> ShardedGraph:
    """Number every communication of ``sg`` globally and build each lowered rank's :class:`Program`.
    Raises PassError if communication lowering has not run, or if a rank's tokens would not increase."""
    require(sg.done, PassName.ORDERING, (PassName.COMM_LOWERING,))
    base = [0, *accumulate(instances(st, sg.decisions) for st in sg.steps)]
    dg = sg.dg
    placed, keep, groups = dg.placed(), dg.persistent(), tuple(process_groups(dg))
    programs = {}
    for r in sg.ranks:
        prog: list[Instr] = []
        later: list[tuple[set[str], list[Instr]]] = []  # (values they fill, deferred instructions)
        for k in range(len(sg.steps)):
            _emit(prog, later, [_shift(i, base[k]) for i in sg.instrs[r][k]])
            after = [_shift(i, base[k]) for i in sg.deferred[r][k]]
            for group in _wait_groups(after):
                later.append(({b.value for i in group for b in writes(i)}, group))
        for _, instrs in later:
            prog.extend(instrs)
        tokens = [i.token for i in prog if isinstance(i, Comm)]
        if any(b <= a for a, b in zip(tokens, tokens[1:])):
            raise PassError(f"ordering: rank {r}'s tokens do not increase: {tokens}")
        inputs = tuple(piece(dg.values[v]) for v in placed if in_group(dg.values[v].group, r))
        programs[r] = Program(r, with_frees(prog, keep), inputs, groups)
    return dataclasses.replace(sg, programs=programs, done=sg.done + (PassName.ORDERING,))


def _wait_groups(instrs: list[Instr]) -> list[list[Instr]]:
    """Deferred instructions cut into groups, each a :class:`Wait` and what follows it up to the next one: each
    group is placed on its own, before the first read of what it fills (a step that issues two buckets defers
    two)."""
    groups: list[list[Instr]] = []
    for i in instrs:
        if isinstance(i, Wait) or not groups:
            groups.append([])
        groups[-1].append(i)
    return groups


def _shift(i: Instr, base: int) -> Instr:
    """Instruction ``i`` with its step-relative token made global."""
    return dataclasses.replace(i, token=i.token + base) if isinstance(i, (Comm, Wait)) and base else i


def _emit(prog: list[Instr], later: list[tuple[set[str], list[Instr]]], instrs: list[Instr]) -> None:
    """Append ``instrs`` to ``prog``, each preceded by the deferred instructions (a Wait and what follows it)
    that fill a value it reads."""
    for i in instrs:
        values = {b.value for b in reads(i)}
        for item in [x for x in later if x[0] & values]:
            later.remove(item)
            prog.extend(item[1])
        prog.append(i)


def with_frees(instrs: list[Instr], keep: frozenset[str]) -> tuple[Instr, ...]:
    """``instrs`` with a :class:`Free` after the last instruction that reads each buffer (or that writes it,
    if nothing reads it), except the values in ``keep`` (they outlive the step). A buffer sent by a
    communication issued without waiting lives until that communication's ``Wait``."""
    last: dict[str, int] = {}
    for k, i in enumerate(instrs):
        for b in writes(i):
            last.setdefault(b.value, k)
        for b in reads(i):
            last[b.value] = k
    waits = {i.token: k for k, i in enumerate(instrs) if isinstance(i, Wait)}
    for i in instrs:
        if isinstance(i, Comm) and not i.wait and i.send is not None:
            last[i.send.value] = max(last[i.send.value], waits[i.token])
    after: dict[int, list[str]] = {}
    for v, k in last.items():
        if v not in keep:
            after.setdefault(k, []).append(v)
    out: list[Instr] = []
    for k, i in enumerate(instrs):
        out.append(i)
        if k in after:
            out.append(Free(tuple(after[k])))
    return tuple(out)
