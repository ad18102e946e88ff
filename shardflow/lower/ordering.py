"""Ordering (docs/lowering.md#5-ordering-tokens): one global order of every communication, and the per-rank programs.

Every communication instance gets a token, its position in one global order: the steps' order (the
dynamic graph's node order), then the order within the step (group, ring step). Token numbers are
computed arithmetically — a step's first token is the number of communications all earlier steps make
— so a rank orders only its own program at a cost that does not grow with the world size. Each rank issues
its communications in token order. Deferred instructions (a bucket's Wait and unpack) go right before the
first instruction that reads what they fill, and a gradient bucket's no later than right before the rank issues its
next gradient bucket (one in flight: :func:`_bounded`); a :class:`~shardflow.lower.program.Free` follows the last
reader of each buffer that does not outlive the step. Each program lists the pieces it holds before it starts
(``inputs``) and the process groups every rank creates, in one order (``groups``).
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate

from shardflow.graph import ops as O
from shardflow.lower.dynamic import PassError, PassName, TaskType, require
from shardflow.lower.program import Comm, Compute, Free, Instr, Program, Vjp, Wait, reads, writes
from shardflow.lower.shard_expansion import ShardedGraph, in_group, piece
from shardflow.parallel.collectives import CommKind


def ordering(sg: ShardedGraph, overlap: bool = False) -> ShardedGraph:
    """Number every communication of ``sg`` globally and build each lowered rank's :class:`Program`; with
    ``overlap``, the backward's gradient reductions travel while the computes that do not feed them run
    (:func:`overlap_reductions`); in a step of several microbatches (a pipeline), transfers between stages
    travel while each stage works on other microbatches (:func:`overlap_transfers`). Raises PassError if communication lowering has not run, or if a rank's tokens
    would not increase."""
    require(sg.done, PassName.ORDERING, (PassName.COMM_LOWERING,))
    base = [0, *accumulate(sg.tokens)]
    dg = sg.dg
    placed, keep, groups = dg.placed(), dg.persistent(), sg.groups
    programs = {}
    for r in sg.ranks:
        prog: list[Instr] = []
        later: list[tuple[set[str], list[Instr]]] = []  # (values they fill, deferred instructions)
        buckets: set[int] = set()  # tokens of the gradient buckets (_bounded) emitted so far
        for k in range(len(sg.steps)):
            _emit(prog, later, [_shift(i, base[k]) for i in sg.instrs[r][k]], buckets)
            after = [_shift(i, base[k]) for i in sg.deferred[r][k]]
            for group in _wait_groups(after):
                later.append(({b.value for i in group for b in writes(i)}, group))
        for _, instrs in later:
            prog.extend(instrs)
        if overlap:
            prog = overlap_reductions(prog)
        if dg.microbatches > 1:
            prog = overlap_transfers(prog)
        tokens = [i.token for i in prog if isinstance(i, Comm)]
        if any(b <= a for a, b in zip(tokens, tokens[1:])):
            raise PassError(f"ordering: rank {r}'s tokens do not increase: {tokens}")
        inputs = tuple(piece(dg.values[v]) for v in placed if in_group(dg.values[v].group, r))
        programs[r] = Program(r, with_frees(prog, keep), inputs, groups)
    return dataclasses.replace(sg, programs=programs, done=sg.done + (PassName.ORDERING,))


# per pass, the communications that may travel while that pass computes what they do not need
OVERLAPPED = {
    TaskType.BWD: (CommKind.ALL_REDUCE, CommKind.REDUCE_SCATTER, CommKind.SEND),
    TaskType.FWD: (CommKind.ALL_REDUCE, CommKind.REDUCE_SCATTER),
}
# the ops whose backward is split when only some of its gradients feed a reduction: each gradient is its own
# matmul (the hand-written vjp computes exactly those asked for, from the op's inputs alone)
SPLIT_OPS = (O.Linear, O.Matmul)


def overlap_reductions(prog: list[Instr]) -> list[Instr]:
    """Megatron's overlap of a tensor-parallel backward (Narayanan et al., SC 2021, §4.2; DDP's buckets do the
    same for dp), applied to a pipeline stage's gradient send too: each backward all-reduce, reduce-scatter or send
    that waits at once is issued without waiting as soon as what it sends is computed, the computes since the
    previous communication that do not feed it run while it travels, and its :class:`Wait` follows them. A
    forward all-reduce or reduce-scatter likewise: the loss's label count under dp (a sum over the batch read
    only by the loss's division) is computed and issued first and travels while the whole forward computes.

    A backward op whose outputs are partly needed (a linear's vjp: the input gradient is reduced, the weight
    gradient is not) is split in two computes of the same kernel description with complementary gradient masks
    (:func:`split_vjp`): the input gradient before the issue, the weight gradients after (ops of :data:`SPLIT_OPS`;
    any other op stays whole, before the issue if it feeds it). Communications keep their order, so the token order and every proof about it are unchanged."""
    out: list[Instr] = []
    start = 0  # where the run of computes before the next communication begins in ``out``
    for i in prog:
        if isinstance(i, Comm) and i.wait and i.kind in OVERLAPPED.get(i.task, ()) and i.send is not None:
            first, then = _feeding(out[start:], i.send.value)
            if then:
                out[start:] = [*first, dataclasses.replace(i, wait=False), *then, Wait(i.token)]
                start = len(out)
                continue
        out.append(i)
        if not isinstance(i, Compute):
            start = len(out)
    return out


def overlap_transfers(prog: list[Instr]) -> list[Instr]:
    """A pipeline's point-to-point transfers issued without waiting, as torch.distributed.pipelining issues
    them (``batch_isend_irecv``): each receive's :class:`Wait` goes right before the first instruction that reads
    what it receives, so a stage posts its receives in token order and goes on with the actions of other
    microbatches meanwhile; each send's goes right before the next send to the same peer (one send in flight
    per peer, its buffer kept until then) or at the end. Tokens keep their order; any rank's wait is on a
    communication it has issued, so the token order still rules out a deadlock."""
    transfers = [
        k for k, i in enumerate(prog) if isinstance(i, Comm) and i.wait and i.kind in (CommKind.SEND, CommKind.RECV)
    ]
    first_read: dict[str, int] = {}
    for k in reversed(range(len(prog))):  # after the loop: value → its first reader after its receive
        for b in reads(prog[k]):
            first_read[b.value] = k
    next_send: dict[int, int] = {}  # a send's index → the index of the next send to the same peer
    last_to: dict[int, int] = {}
    for k in transfers:
        if prog[k].kind == CommKind.SEND:
            if prog[k].peer in last_to:
                next_send[last_to[prog[k].peer]] = k
            last_to[prog[k].peer] = k
    waits: dict[int, list[Wait]] = {}  # instruction index → the waits that go right before it
    for k in transfers:
        i = prog[k]
        end = first_read.get(i.recv.value, len(prog)) if i.kind == CommKind.RECV else next_send.get(k, len(prog))
        waits.setdefault(end, []).append(Wait(i.token))
    issued = set(transfers)
    out: list[Instr] = []
    for k, i in enumerate(prog):
        out.extend(waits.get(k, ()))
        out.append(dataclasses.replace(i, wait=False) if k in issued else i)
    out.extend(waits.get(len(prog), ()))
    return out


def _feeding(computes: list[Instr], sent: str) -> tuple[list[Instr], list[Instr]]:
    """``computes`` (in order) as those that ``sent`` depends on and those it does not, each in order; a split
    backward op's two halves go one to each."""
    need = {sent}
    first: list[Instr] = []
    then: list[Instr] = []
    for c in reversed(computes):
        outs = {b.value for b in c.outs}
        if not outs & need:
            then.append(c)
            continue
        if outs - need and isinstance(c.kernel, Vjp) and isinstance(c.kernel.local.op, SPLIT_OPS):
            now, later = split_vjp(c, outs & need)
            first.append(now)
            then.append(later)
        else:
            first.append(c)
        need |= {b.value for b in c.ins}
    return first[::-1], then[::-1]


def split_vjp(c: Compute, now: set[str]) -> tuple[Compute, Compute]:
    """Backward compute ``c`` as two computes of its op's vjp: the one writing the gradients in ``now``, and the
    one writing the others (same inputs, complementary gradient masks)."""
    spec = c.kernel
    assert isinstance(spec, Vjp), c
    wanted = [i for i, m in enumerate(spec.grad_mask) if m]  # input index of each output, in order
    halves = []
    for keep in (True, False):
        picked = [k for k, b in enumerate(c.outs) if (b.value in now) == keep]
        inputs = {wanted[k] for k in picked}
        mask = tuple(i in inputs for i in range(len(spec.grad_mask)))
        halves.append(
            dataclasses.replace(
                c,
                outs=tuple(c.outs[k] for k in picked),
                kernel=dataclasses.replace(spec, grad_mask=mask, dtypes=tuple(spec.dtypes[k] for k in picked)),
            )
        )
    return halves[0], halves[1]


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


def _bounded(c: Comm) -> bool:
    """Whether ``c`` is a gradient bucket a rank keeps one of in flight: a backward all-reduce or reduce-scatter
    issued without waiting. Its send buffer (the bucket's packed gradients, float32 where they reduce in float32)
    lives until its Wait; left to the first read of its result — the optimizer's update — every bucket of the step
    would be live at the end of the backward (on Llama 3 405B under fsdp, one block's gradients, 12 GiB, per block).
    So its Wait goes before the next one is issued, as PyTorch FSDP waits for a reduce-scatter before the next
    (docs/lowering.md#11-gradient-buckets-and-overlap-with-the-backward)."""
    return c.task == TaskType.BWD and not c.wait and c.kind in (CommKind.ALL_REDUCE, CommKind.REDUCE_SCATTER)


def _emit(prog: list[Instr], later: list[tuple[set[str], list[Instr]]], instrs: list[Instr], buckets: set[int]) -> None:
    """Append ``instrs`` to ``prog``, each preceded by the deferred instructions (a Wait and what follows it)
    that fill a value it reads and, before a gradient bucket (:func:`_bounded`), those of the buckets issued
    before it. ``buckets``: the tokens of the gradient buckets appended so far (updated)."""
    for i in instrs:
        values = {b.value for b in reads(i)}
        bucket = i.token if isinstance(i, Comm) and _bounded(i) else None
        for item in [x for x in later if x[0] & values or bucket is not None and _waited(x[1]) in buckets]:
            later.remove(item)
            prog.extend(item[1])
        if bucket is not None:
            buckets.add(bucket)
        prog.append(i)


def _waited(group: list[Instr]) -> int:
    """The token a deferred group (:func:`_wait_groups`) waits for."""
    assert isinstance(group[0], Wait), group
    return group[0].token


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
