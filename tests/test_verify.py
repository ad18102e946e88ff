"""The plan verifier (docs/lowering.md#6-the-verifier-shardflowlowerverifyverify): hand-built valid multi-rank programs
pass; every single mutation of them (swap, drop, duplicate, wrong peer / shape / dtype / members / root / token, a
cross-rank cycle) is rejected with a message naming the ranks and tokens involved. Planning level only: no processes.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardflow.graph.ops import TensorType
from shardflow.lower.program import Buffer, Comm, Compute, Program
from shardflow.lower.verify import PlanMismatchError, PlanVerificationError, check_fingerprints, fingerprints, verify

T = TensorType((4, 8))


class Plan:
    """Builds per-rank programs with one global token counter, in issue order."""

    def __init__(self, world: int):
        self.world = world
        self.instrs: dict[int, list] = {r: [] for r in range(world)}
        self.token = 0

    def compute(self, *ranks: int, name: str = "mm") -> Plan:
        for r in ranks or range(self.world):
            self.instrs[r].append(Compute("FWD", name, "matmul", (Buffer("fwd:x", T),), (Buffer(f"fwd:{name}", T),)))
        return self

    def collective(self, kind: str, members, root: int | None = None, type_: TensorType = T) -> Plan:
        for r in members:
            self.instrs[r].append(Comm(self.token, kind, "FWD", tuple(members), type_, 64, "tp", root=root))
        self.token += 1
        return self

    def p2p(self, src: int, dst: int) -> Plan:
        self.instrs[src].append(Comm(self.token, "send", "FWD", (src, dst), T, 128, "copy", peer=dst))
        self.instrs[dst].append(Comm(self.token, "recv", "FWD", (src, dst), T, 0, "copy", peer=src))
        self.token += 1
        return self

    def permute(self, ring, step: int) -> Plan:
        """nvFuser's swizzle1d: at step i ring position k sends to (k - i) mod d, receives from (k + i) mod d."""
        d = len(ring)
        for k, r in enumerate(ring):
            self.instrs[r].append(
                Comm(
                    self.token,
                    "permute",
                    "FWD",
                    tuple(ring),
                    T,
                    128,
                    "tp",
                    peer=ring[(k - step) % d],
                    peer_from=ring[(k + step) % d],
                )
            )
        self.token += 1
        return self

    def programs(self) -> dict[int, Program]:
        return {r: Program(r, tuple(i), inputs=(Buffer("fwd:x", T),)) for r, i in self.instrs.items()}


def mixed() -> dict[int, Program]:
    """4 ranks: ring all-gather, sub-group all-reduces, send/recv, broadcast, reduce, a 3-step permute ring."""
    p = Plan(4).compute().collective("all_gather", [0, 1, 2, 3]).compute(0, 1)
    p.collective("all_reduce", [0, 1]).collective("all_reduce", [2, 3]).p2p(1, 2).compute(2)
    p.collective("broadcast", [0, 1, 2, 3], root=2).collective("reduce", [1, 3], root=3)
    for i in (1, 2, 3):
        p.permute([0, 1, 2, 3], i).compute(name=f"chunk{i}")
    return p.collective("reduce_scatter", [0, 1, 2, 3]).collective("all_to_all", [0, 2]).p2p(3, 0).programs()


def permute_ring() -> dict[int, Program]:
    """A permute ring in a non-identity rank order (3, 1, 0, 2), computes between steps."""
    p = Plan(4).compute()
    for i in (1, 2, 3):
        p.permute([3, 1, 0, 2], i).compute()
    return p.programs()


def pipeline() -> dict[int, Program]:
    """2-stage pipeline, 2 micro-batches: forward activations 0 -> 1, gradients back 1 -> 0."""
    p = Plan(2)
    for _ in range(2):
        p.compute(0).p2p(0, 1).compute(1)
    for _ in range(2):
        p.compute(1).p2p(1, 0).compute(0)
    return p.programs()


VALID = {"mixed": mixed, "permute_ring": permute_ring, "pipeline": pipeline}


def rejected(programs) -> PlanVerificationError:
    with pytest.raises(PlanVerificationError) as e:
        verify(programs, len(programs))
    return e.value


def names_rank(text: str, rank: int) -> bool:
    return re.search(rf"\branks? (?:\d+, )*{rank}\b", text) is not None


def comm_at(programs, rank: int, token: int) -> int:
    """Index in rank's instrs of its Comm with this token."""
    return next(i for i, c in enumerate(programs[rank].instrs) if isinstance(c, Comm) and c.token == token)


def edit(programs, rank: int, fn) -> dict[int, Program]:
    """programs with rank's instruction list replaced by fn(list)."""
    instrs = list(programs[rank].instrs)
    fn(instrs)
    return {**programs, rank: dataclasses.replace(programs[rank], instrs=tuple(instrs))}


def change(programs, rank: int, tok: int, **fields) -> dict[int, Program]:
    """programs with fields of rank's Comm for token tok replaced."""
    i = comm_at(programs, rank, tok)
    return edit(programs, rank, lambda xs: xs.__setitem__(i, dataclasses.replace(xs[i], **fields)))


@pytest.mark.parametrize("make", VALID.values(), ids=VALID.keys())
def test_valid_programs_pass(make):
    programs = make()
    verify(programs, len(programs))
    assert len(set(fingerprints(programs).values())) == len(programs)  # distinct programs, distinct hashes


def test_permute_convention():
    """Step i: rank r sends to (r - i) mod 4 and receives from (r + i) mod 4."""
    programs = mixed()
    for r in range(4):
        steps = [c for c in programs[r].comms if c.kind == "permute"]
        assert [(c.peer, c.peer_from) for c in steps] == [((r - i) % 4, (r + i) % 4) for i in (1, 2, 3)]


# Hand mutations of mixed(): name -> (mutate, ranks and tokens the problems must name, a phrase they contain).
# Tokens in mixed(): 0 all_gather, 1 all_reduce[0,1], 2 all_reduce[2,3], 3 send 1->2, 4 broadcast root 2,
# 5 reduce[1,3] root 3, 6-8 permute, 9 reduce_scatter, 10 all_to_all[0,2], 11 send 3->0.
def swap_comms(ps):
    i, j = comm_at(ps, 1, 1), comm_at(ps, 1, 3)

    def swap(xs):
        xs[i], xs[j] = xs[j], xs[i]

    return edit(ps, 1, swap)


MUTATIONS = {
    "swap": (swap_comms, [1], [1, 3], "rank 1 issues token 1 (all_reduce) after token 3 (send)"),
    "drop_recv": (
        lambda ps: edit(ps, 2, lambda xs: xs.pop(comm_at(ps, 2, 3))),
        [1, 2],
        [3],
        "rank 1 sends token 3 to rank 2, which has no matching recv",
    ),
    "drop_send": (
        lambda ps: edit(ps, 3, lambda xs: xs.pop(comm_at(ps, 3, 11))),
        [0, 3],
        [11],
        "rank 0 receives token 11 from rank 3, which has no matching send",
    ),
    "drop_member": (
        lambda ps: edit(ps, 2, lambda xs: xs.pop(comm_at(ps, 2, 0))),
        [2],
        [0],
        "rank 2 is a member of token 0 (all_gather)",
    ),
    "duplicate": (
        lambda ps: edit(ps, 0, lambda xs: xs.insert(comm_at(ps, 0, 4), xs[comm_at(ps, 0, 4)])),
        [0],
        [4],
        "rank 0 holds token 4 2 times",
    ),
    "peer": (lambda ps: change(ps, 2, 3, peer=0), [2], [3], "rank 2 token 3 (recv)"),
    "permute_peer": (
        lambda ps: change(ps, 1, 7, peer=0),
        [0, 1],
        [7],
        "token 7 (permute): rank 1 sends to rank 0, which receives from rank 2",
    ),
    "permute_from": (
        lambda ps: change(ps, 0, 8, peer_from=2),
        [0, 3],
        [8],
        "token 8 (permute): rank 3 sends to rank 0, which receives from rank 2",
    ),
    "shape": (lambda ps: change(ps, 3, 9, type=TensorType((4, 4))), [3], [9], "token 9: holders disagree"),
    "dtype": (lambda ps: change(ps, 0, 1, type=TensorType((4, 8), "bfloat16")), [0], [1], "bfloat16"),
    "members": (lambda ps: change(ps, 3, 2, members=(1, 2, 3)), [3], [2], "token 2: holders disagree"),
    "root": (lambda ps: change(ps, 0, 4, root=1), [0], [4], "root=1"),
    "token": (lambda ps: change(ps, 2, 10, token=12), [2], [10, 12], "rank 0 is a member of token 12"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutation_rejected(name):
    mutate, ranks, tokens, phrase = MUTATIONS[name]
    err = rejected(mutate(mixed()))
    text = "\n".join(err.problems)
    assert phrase in text, text
    assert all(names_rank(text, r) for r in ranks), text
    assert all(f"token {t}" in text for t in tokens), text
    assert err.problems[0] in str(err)


def test_cycle_is_caught_by_order_and_deadlock():
    """rank 0: send t0 to 1, recv t1 from 1; rank 1: send t1 to 0, recv t0 from 0. Peers and signatures are
    consistent; no token numbering can order both ranks (rank 0 needs t0 < t1, rank 1 t1 < t0), so the order
    checks report it — and the deadlock simulation, which ignores token numbers, catches the cycle too."""

    def send(t, s, d):
        return Comm(t, "send", "FWD", (s, d), T, 128, peer=d)

    def recv(t, s, d):
        return Comm(t, "recv", "FWD", (s, d), T, 0, peer=s)

    programs = {0: Program(0, (send(0, 0, 1), recv(1, 1, 0))), 1: Program(1, (send(1, 1, 0), recv(0, 0, 1)))}
    problems = rejected(programs).problems
    assert "rank 1 issues token 0 (recv) after token 1 (send): tokens must strictly increase" in problems
    assert any(p.startswith("ranks 0 and 1 order their shared communications differently") for p in problems)
    assert (
        "deadlock: rank 0 blocks at token 0 (send) over [0, 1] waiting for rank 1 (blocked at token 1 (send))"
        in problems
    )
    assert len([p for p in problems if p.startswith("deadlock")]) == 2
    assert not [p for p in problems if "no matching" in p or "disagree" in p]


def test_malformed_programs():
    ps = mixed()
    ps = change(ps, 0, 0, members=(0, 1, 2, 3, 7))
    ps = change(ps, 1, 1, members=(0, 1, 1))
    ps = change(ps, 3, 5, root=0)
    ps = change(ps, 2, 9, peer=1)
    ps[5] = Program(7, ())
    with pytest.raises(PlanVerificationError) as e:
        verify(ps, 4)
    text = "\n".join(e.value.problems)
    for phrase in (
        "rank 0 token 0 (all_gather): members [7] out of range for world size 4",
        "rank 1 token 1 (all_reduce): duplicate members in [0, 1, 1]",
        "rank 3 token 5 (reduce): root=0 is not among members [1, 3]",
        "rank 2 token 9 (reduce_scatter): peer=1 is set but reduce_scatter takes no peer",
        "programs[5] holds the program of rank 7",
        "rank 7 is out of range for world size 4",
    ):
        assert phrase in text, text


def test_all_problems_reported():
    ps = change(change(mixed(), 0, 0, type=TensorType((1,))), 3, 11, peer=1)
    err = rejected(ps)
    assert any("token 0: holders disagree" in p for p in err.problems)
    assert any(p.startswith("rank 3 token 11 (send)") for p in err.problems)
    assert "problem(s)" in str(err) and len(str(err).splitlines()) <= 7


def test_fingerprint_check():
    local = fingerprints(mixed())
    check_fingerprints({r: local[0] for r in range(4)})
    with pytest.raises(PlanMismatchError, match=r"differs from rank 0 .* on rank 1 \(.*\), rank 3") as e:
        check_fingerprints({0: "a" * 64, 1: "b" * 64, 2: "a" * 64, 3: "c" * 64})
    assert e.value.ranks == [1, 3]
    with pytest.raises(PlanMismatchError, match="rank 0"):
        check_fingerprints({1: "a" * 64})


# Random single mutations: any rank, any instruction, any kind; no-ops are skipped.
KINDS = ("swap", "drop", "duplicate", "peer", "peer_from", "root", "shape", "dtype", "members", "token")


def mutate(programs, rank: int, i: int, j: int, kind: str, value: int):
    instrs = list(programs[rank].instrs)
    comm_idx = [k for k, x in enumerate(instrs) if isinstance(x, Comm)]
    if kind == "swap":  # any two instructions; a no-op unless the comm order changes
        i, j = i % len(instrs), j % len(instrs)
        instrs[i], instrs[j] = instrs[j], instrs[i]
        assume([c.token for c in instrs if isinstance(c, Comm)] != [c.token for c in programs[rank].comms])
        return {**programs, rank: dataclasses.replace(programs[rank], instrs=tuple(instrs))}
    k = comm_idx[i % len(comm_idx)]
    c = instrs[k]
    if kind == "drop":
        del instrs[k]
    elif kind == "duplicate":
        instrs.insert(k, c)
    else:
        new = {
            "peer": {"peer": value},
            "peer_from": {"peer_from": value},
            "root": {"root": value},
            "shape": {"type": TensorType((value + 1, 8))},
            "dtype": {"type": TensorType((4, 8), "float16")},
            "members": {"members": c.members[:-1] if value % 2 and len(c.members) > 2 else c.members + (value,)},
            "token": {"token": c.token + value - 3},
        }[kind]
        instrs[k] = dataclasses.replace(c, **new)
        assume(instrs[k] != c)
    return {**programs, rank: dataclasses.replace(programs[rank], instrs=tuple(instrs))}


@settings(max_examples=200, deadline=None)
@given(
    make=st.sampled_from(list(VALID)),
    rank=st.integers(0, 3),
    i=st.integers(0, 50),
    j=st.integers(0, 50),
    kind=st.sampled_from(KINDS),
    value=st.integers(0, 5),
)
def test_random_mutation_rejected(make, rank, i, j, kind, value):
    programs = VALID[make]()
    rank %= len(programs)
    bad = mutate(programs, rank, i, j, kind, value)
    err = rejected(bad)
    assert names_rank("\n".join(err.problems), rank) or any(f"programs[{rank}]" in p for p in err.problems)
