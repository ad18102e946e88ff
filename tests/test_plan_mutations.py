"""The plan verifier on REAL programs: every single mutation of a lowered plan is rejected.

Programs come from ``lower_step(..., verify=False)`` for dp, tp, sp, pp, dp×tp, dp×pp and pp×tp on tiny GPT
and MLP models, plus the ring forms of sp (``LowerOptions("ring", "ring")``, and the broadcast loop).
Hypothesis applies one mutation to one rank — swap two communications, drop one, duplicate one, change a
peer / peer_from / root, a shape, a dtype or the members of a collective; drop, duplicate or move the
``Wait`` of a ring step issued without waiting — and :func:`verify` must raise
:class:`PlanVerificationError` whose problems name the mutated rank and a token. No-op mutations are skipped.
Planning level only: no process starts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardflow.capture import capture
from shardflow.graph.ops import TensorType
from shardflow.lower import LowerOptions, lower_step
from shardflow.lower.program import Comm, Free, Program, Wait, reads
from shardflow.lower.verify import PlanVerificationError, verify
from shardflow.models import GPT, MLP, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import build_pcg
from shardflow.strategy import make_plan, resolve

LONG = os.environ.get("SHARDFLOW_LONG") == "1"
RING = LowerOptions("ring", "ring")

# name -> (model, mesh, strategy, lowering options)
PLANS = {
    "gpt dp=2": ("gpt", "dp=2", "dp", None),
    "gpt tp=2": ("gpt", "tp=2", "tp", None),
    "gpt sp tp=2": ("gpt", "tp=2", "sp", None),
    "gpt pp=2": ("gpt", "pp=2", "pp", None),
    "gpt dp=2,tp=2": ("gpt", "dp=2,tp=2", "dp,tp", None),
    "gpt pp=2,tp=2": ("gpt", "pp=2,tp=2", "pp,tp", None),
    "gpt dp=2,pp=2": ("gpt", "dp=2,pp=2", "dp,pp", None),
    "gpt sp tp=4 ring": ("gpt", "tp=4", "sp", RING),
    "gpt dp,sp ring": ("gpt", "dp=2,tp=2", "dp,sp", RING),
    "gpt sp broadcast_loop": ("gpt", "tp=2", "sp", LowerOptions("broadcast_loop", "ring")),
    "mlp dp=2": ("mlp", "dp=2", "dp", None),
    "mlp tp=2": ("mlp", "tp=2", "tp", None),
    "mlp pp=2": ("mlp", "pp=2", "pp", None),
    "mlp dp=2,tp=2": ("mlp", "dp=2,tp=2", "dp,tp", None),
}


def _model(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=2, n_head=4, n_embd=8)).double()
        return model, {"idx": torch.zeros(4, 4, dtype=torch.long), "targets": torch.zeros(4, 4, dtype=torch.long)}
    model = MLP(d_in=8, hidden=8, d_out=4, n_layers=2).double()
    return model, {"x": torch.zeros(4, 8, dtype=torch.float64), "y": torch.zeros(4, dtype=torch.long)}


@functools.cache
def programs(plan: str) -> dict[int, Program]:
    model_name, mesh_text, strategy, options = PLANS[plan]
    model, inputs = _model(model_name)
    graph = capture(model, inputs)
    mesh = Mesh.parse(mesh_text)
    pcg = build_pcg(graph, mesh, resolve(make_plan(graph, mesh, strategy), graph, mesh))
    return dict(lower_step(pcg, "sgd", verify=False, options=options).programs)


def names_rank(text: str, rank: int) -> bool:
    """``rank 3``, ``ranks 1, 3`` or ``programs[3]`` — the problems name this rank."""
    return re.search(rf"\branks? (?:\d+, )*{rank}\b", text) is not None or f"programs[{rank}]" in text


@pytest.mark.parametrize("plan", PLANS)
def test_real_plans_verify(plan):
    ps = programs(plan)
    verify(ps, len(ps))
    assert sum(len(p.comms) for p in ps.values()) > 0


def test_plans_cover_every_family_the_lowering_makes():
    kinds = {c.kind for plan in PLANS for p in programs(plan).values() for c in p.comms}
    assert {"send", "recv", "all_reduce", "all_gather", "reduce_scatter", "permute", "broadcast"} <= kinds


# --- mutations ------------------------------------------------------------------------------------------------
KINDS = (
    "swap",
    "drop",
    "duplicate",
    "peer",
    "peer_from",
    "root",
    "shape",
    "dtype",
    "members",
    "drop_wait",
    "duplicate_wait",
    "early_wait",
    "late_wait",
)
DTYPES = ("float64", "float32", "bfloat16", "float16", "int64")


class NotApplicable(Exception):
    """The mutation does not apply to this program, or would change nothing."""


def require(cond) -> None:
    if not cond:
        raise NotApplicable


def mutate(ps: dict[int, Program], rank: int, kind: str, i: int, j: int, v: int) -> dict[int, Program]:
    """``ps`` with one mutation of ``kind`` on ``rank`` (``i``, ``j``, ``v`` choose what and how).
    Raises NotApplicable for a mutation that does not apply or changes nothing."""
    world = len(ps)
    instrs = list(ps[rank].instrs)
    if kind.endswith("_wait"):
        return _mutate_wait(ps, rank, kind, i)
    at = [k for k, x in enumerate(instrs) if isinstance(x, Comm)]
    require(at)
    field = {"peer": "peer", "peer_from": "peer_from", "root": "root"}.get(kind)
    if field:  # only communications that use the field
        at = [k for k in at if getattr(instrs[k], field) is not None]
    elif kind == "members":  # collectives only
        at = [k for k in at if instrs[k].family != "p2p"]
    require(at)
    k = at[i % len(at)]
    c = instrs[k]
    if kind == "swap":
        others = [m for m in at if m != k]
        require(others)
        m = others[j % len(others)]
        instrs[k], instrs[m] = instrs[m], instrs[k]
    elif kind == "drop":
        del instrs[k]
    elif kind == "duplicate":
        instrs.insert(k + 1, c)
    elif field:
        new = [r for r in range(world + 1) if r != getattr(c, field)]  # world itself is out of range
        instrs[k] = dataclasses.replace(c, **{field: new[v % len(new)]})
    elif kind == "shape":
        shape = c.type.shape
        options = [
            shape + (1,),
            shape[:-1],
            tuple(s + 1 for s in shape),
            shape[:-1] + (2 * shape[-1],) if shape else (2,),
        ]
        new_shape = options[v % len(options)]
        require(new_shape != shape)
        instrs[k] = dataclasses.replace(c, type=TensorType(new_shape, c.type.dtype))
    elif kind == "dtype":
        new = [d for d in DTYPES if d != c.type.dtype]
        instrs[k] = dataclasses.replace(c, type=TensorType(c.type.shape, new[v % len(new)]))
    elif kind == "members":
        members = list(c.members)
        how = v % 3
        if how == 0:  # drop a member other than the holder
            rest = [m for m in members if m != rank]
            require(rest)
            members.remove(rest[j % len(rest)])
        elif how == 1:  # add a rank that is not a member (or one out of range)
            extra = [r for r in range(world + 1) if r not in members]
            members.insert(j % (len(members) + 1), extra[j % len(extra)])
        else:  # another order
            require(len(members) > 1)
            s = 1 + j % (len(members) - 1)
            members = members[s:] + members[:s]
        instrs[k] = dataclasses.replace(c, members=tuple(members))
    require(tuple(instrs) != ps[rank].instrs)
    return {**ps, rank: dataclasses.replace(ps[rank], instrs=tuple(instrs))}


def _reads(instr) -> list[str]:
    if isinstance(instr, Comm):
        return [instr.send.value] if instr.send is not None else []
    return [b.value for b in getattr(instr, "ins", ())]


def _mutate_wait(ps: dict[int, Program], rank: int, kind: str, i: int) -> dict[int, Program]:
    """A ring step issued without waiting (``wait=False``) and its ``Wait``: drop or duplicate the Wait, move
    it before the communication it completes, or after the first instruction that reads the received buffer."""
    instrs = list(ps[rank].instrs)
    waits = [k for k, x in enumerate(instrs) if isinstance(x, Wait)]
    require(waits)
    k = waits[i % len(waits)]
    w = instrs[k]
    issue = next(m for m, x in enumerate(instrs) if isinstance(x, Comm) and x.token == w.token)
    if kind == "drop_wait":
        del instrs[k]
    elif kind == "duplicate_wait":
        instrs.insert(k + 1, w)
    elif kind == "early_wait":
        del instrs[k]
        instrs.insert(issue, w)
    else:  # late_wait
        require(instrs[issue].recv is not None)  # e.g. the root of a broadcast receives nothing
        recv = instrs[issue].recv.value
        reader = next((m for m in range(k + 1, len(instrs)) if recv in _reads(instrs[m])), None)
        require(reader is not None)
        instrs.insert(reader + 1, w)
        del instrs[k]
    return {**ps, rank: dataclasses.replace(ps[rank], instrs=tuple(instrs))}


@settings(max_examples=5000 if LONG else 600, deadline=None)
@given(
    plan=st.sampled_from(list(PLANS)),
    rank=st.integers(0, 3),
    kind=st.sampled_from(KINDS),
    i=st.integers(0, 10**4),
    j=st.integers(0, 10**4),
    v=st.integers(0, 100),
)
def test_every_single_mutation_is_rejected(plan, rank, kind, i, j, v):
    ps = programs(plan)
    rank %= len(ps)
    try:
        bad = mutate(ps, rank, kind, i, j, v)
    except NotApplicable:
        assume(False)
    with pytest.raises(PlanVerificationError) as e:
        verify(bad, len(bad))
    text = "\n".join(e.value.problems)
    assert names_rank(text, rank), f"{kind} on rank {rank} of {plan}: problems do not name the rank:\n{text}"
    assert re.search(r"\btokens? \d+", text), text
    assert e.value.problems[0] in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
def test_each_mutation_kind_applies_to_some_plan(kind):
    """Every kind of mutation has real programs it applies to (so the random test exercises all of them)."""
    for plan in PLANS:
        ps = programs(plan)
        for rank in ps:
            for i in range(len(ps[rank].comms)):
                try:
                    bad = mutate(ps, rank, kind, i, 1, 1)
                except NotApplicable:
                    continue
                with pytest.raises(PlanVerificationError):
                    verify(bad, len(bad))
                return
    pytest.fail(f"no plan admits a {kind!r} mutation")


# --- found while writing these tests -----------------------------------------------------------------------------
def test_dropped_wait_is_rejected():
    """Found while writing these tests (fixed since): verify() ignored Wait instructions, so a ring step whose
    Wait was dropped — its handles never waited, its receive buffer read too early — passed."""
    ps = programs("gpt sp tp=4 ring")
    rank = 0
    instrs = list(ps[rank].instrs)
    k = next(k for k, x in enumerate(instrs) if isinstance(x, Wait))
    token = instrs[k].token
    del instrs[k]
    with pytest.raises(PlanVerificationError) as e:
        verify({**ps, rank: dataclasses.replace(ps[rank], instrs=tuple(instrs))}, len(ps))
    assert any(f"rank {rank}" in p and f"token {token}" in p for p in e.value.problems), e.value.problems


def test_reduce_op_disagreement_is_rejected():
    """Regression: one rank reducing with max while the others sum must not pass verification."""
    ps = programs("gpt dp=2")
    rank = 1
    instrs = list(ps[rank].instrs)
    k = next(k for k, x in enumerate(instrs) if isinstance(x, Comm) and x.kind == "all_reduce")
    instrs[k] = dataclasses.replace(instrs[k], reduce_op="max")
    with pytest.raises(PlanVerificationError) as e:
        verify({**ps, rank: dataclasses.replace(ps[rank], instrs=tuple(instrs))}, len(ps))
    assert names_rank("\n".join(e.value.problems), rank)


def test_train_verifies_the_plan_before_launching(tmp_path, monkeypatch):
    """Regression: `shardflow train --nproc N` proves every rank's program in the parent before launching."""
    from shardflow.lower import verify as verify_module
    from shardflow.runtime import launch as launch_module
    from shardflow.train import command
    from shardflow.train.config import TrainConfig

    def planted(programs, world_size):
        raise PlanVerificationError([f"rank 0 token 0: planted problem ({world_size} ranks)"])

    def no_launch(*args, **kwargs):
        pytest.fail("launched processes for a plan that was never verified")

    monkeypatch.setattr(verify_module, "verify", planted)
    monkeypatch.setattr(launch_module, "launch", no_launch)
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    cfg = TrainConfig(
        strategy="dp",
        nproc=2,
        steps=1,
        layers=1,
        heads=2,
        embd=16,
        seq_len=16,
        batch_size=8,
        data=str(data),
        run_dir=str(tmp_path / "run"),
        timeout=5.0,
    )
    with pytest.raises(PlanVerificationError, match="planted"):
        command.main(cfg)


# --- issue #11, holes 2 and 6: per-rank dataflow and buffer identity ------------------------------------------
def _rank_of(ps, kind: str) -> int:
    return next(r for r, p in ps.items() if any(isinstance(c, Comm) and c.kind == kind for c in p.instrs))


def test_a_value_never_received_is_rejected():
    """Hole 2: a pp=2 MLP whose stage copy is missing on both ends (the communications still match) used to
    verify and fail at run time with a KeyError; the per-rank dataflow check names rank, instruction and value."""
    ps = programs("mlp pp=2")
    recv_rank = _rank_of(ps, "recv")
    recv = next(c for c in ps[recv_rank].comms if c.kind == "recv")
    bad = {}
    for r, p in ps.items():
        bad[r] = dataclasses.replace(
            p, instrs=tuple(i for i in p.instrs if not (isinstance(i, Comm) and i.token == recv.token))
        )
    with pytest.raises(PlanVerificationError) as e:
        verify(bad, len(bad))
    text = "\n".join(e.value.problems)
    assert re.search(
        rf"rank {recv_rank} instruction \d+ \[.*\] reads '{re.escape(recv.recv.value)}': never computed, "
        "received or held",
        text,
    ), text


def test_a_read_after_its_free_is_rejected():
    """Hole 2: nothing is read after its Free (a Free moved before the last reader)."""
    ps = programs("gpt tp=2")
    instrs = list(ps[0].instrs)
    k = next(
        k
        for k, i in enumerate(instrs)
        if isinstance(i, Free) and any(v in {b.value for b in reads(instrs[k - 1])} for v in i.values)
    )
    free = instrs.pop(k)
    instrs.insert(k - 1, free)
    with pytest.raises(PlanVerificationError) as e:
        verify({**ps, 0: dataclasses.replace(ps[0], instrs=tuple(instrs))}, len(ps))
    assert any(p.startswith("rank 0 instruction") and f"freed at instruction {k - 1}" in p for p in e.value.problems)


def test_sending_a_value_the_rank_does_not_hold_is_rejected():
    """Hole 2: a send buffer must be held (here: renamed to a value the rank never had)."""
    ps = programs("gpt pp=2")
    rank = _rank_of(ps, "send")
    instrs = list(ps[rank].instrs)
    k = next(k for k, i in enumerate(instrs) if isinstance(i, Comm) and i.kind == "send")
    instrs[k] = dataclasses.replace(instrs[k], send=dataclasses.replace(instrs[k].send, value="fwd:nowhere"))
    with pytest.raises(PlanVerificationError) as e:
        verify({**ps, rank: dataclasses.replace(ps[rank], instrs=tuple(instrs))}, len(ps))
    assert any(f"rank {rank} instruction {k} [token" in p and "'fwd:nowhere'" in p for p in e.value.problems)


def test_swapped_same_shape_all_reduces_with_their_tokens_are_rejected():
    """Hole 6: two same-shape all-reduces swapped on one rank *together with their token numbers* (so the
    tokens still increase) used to verify and keep the fingerprint: gradients came out wrong. The signature
    now carries the value moved."""
    ps = programs("gpt tp=2")
    instrs = list(ps[1].instrs)
    ars = [k for k, i in enumerate(instrs) if isinstance(i, Comm) and i.kind == "all_reduce"]
    k, m = next((k, m) for k in ars for m in ars if m > k and instrs[k].type == instrs[m].type)
    a, b = instrs[k], instrs[m]
    instrs[k] = dataclasses.replace(b, token=a.token)
    instrs[m] = dataclasses.replace(a, token=b.token)
    bad = {**ps, 1: dataclasses.replace(ps[1], instrs=tuple(instrs))}
    assert bad[1].fingerprint() != ps[1].fingerprint()
    with pytest.raises(PlanVerificationError) as e:
        verify(bad, len(bad))
    assert any(f"token {a.token}: holders disagree" in p and a.value in p and b.value in p for p in e.value.problems)
