"""Communications and their buffers (no processes): which communications of a per-rank program may use their send
buffer itself (:func:`shardflow.lower.buffer_reuse.shared_sends`) — exact plan structure, and each hazard that forbids
it on a hand-written program — and the local implementation sharing buffers as the distributed one does, checked
against one device. The distributed side (``issue`` against ``run_local`` on real ranks) is the ``comms`` case of
tests/dist_worker.py."""

from dataclasses import replace

import pytest
import torch
from test_lower import MEGATRON, _sp_step, against_one_device, lowered, mlp, replicate_broadcast  # the same plans

from shardflow.graph.ops import TensorType, Unary
from shardflow.lower import LowerOptions
from shardflow.lower.buffer_reuse import inplace_sums, kept_receives, ring_regions, shared_sends
from shardflow.lower.comms import run_local
from shardflow.lower.dynamic import TaskType
from shardflow.lower.ordering import with_frees
from shardflow.lower.program import Buffer, Comm, Compute, Forward, Keep, OnesLike, Program, Sum, Update, Vjp, Wait
from shardflow.parallel.collectives import KINDS, CommKind, bound_bytes
from shardflow.parallel.mesh import Mesh, Partial, ReduceOp
from shardflow.parallel.rules import LocalOp
from shardflow.runtime.comms import issue
from shardflow.runtime.kernels import OptimizerConfig, make_kernel, recorded_nodes
from shardflow.strategy import make_plan


def shared(step) -> dict[int, list[tuple[str, str, bool]]]:
    """Per rank, each reduction or broadcast with a send buffer: (pass, kind, shares its send buffer)."""
    out = {}
    for r, p in step.programs.items():
        chosen = shared_sends(p, recorded_nodes(p))
        out[r] = [
            (c.task, c.kind, c.token in chosen)
            for c in p.comms
            if c.send is not None and c.kind in ("all_reduce", "reduce", "broadcast")
        ]
    return out


def test_tensor_parallel_all_reduces_are_in_place():
    """fc2's partial output (a linear's: new storage, its forward records no graph — the linear's vjp is
    hand-written) and fc1's input gradient (the linear vjp's: new storage) are read by nothing after their
    all-reduce: both are reduced in place, on both ranks; the numbers are one device's."""
    graph = mlp(pre=True)
    step = lowered(graph, "tp=2", MEGATRON)
    assert shared(step) == {r: [("FWD", "all_reduce", True), ("BWD", "all_reduce", True)] for r in (0, 1)}
    against_one_device(step, graph)


@pytest.mark.parametrize("bucket_bytes", [0, None])
def test_data_parallel_gradient_all_reduces_are_in_place(bucket_bytes):
    """Each weight gradient's all-reduce (unbucketed) or the one bucket's reads a gradient nothing reads again:
    in place — the scale's gradient too, though the mul's vjp may return the output gradient it was given, since
    that is read by nothing after the vjp."""
    graph = mlp(pre=True)
    options = LowerOptions() if bucket_bytes is None else LowerOptions(bucket_bytes=bucket_bytes)
    step = lowered(graph, "dp=2", make_plan(graph, Mesh.parse("dp=2"), "dp"), options=options)
    n = 1 if bucket_bytes is None else len(graph.weights)
    assert shared(step) == {r: [("BWD", "all_reduce", True)] * n for r in (0, 1)}
    against_one_device(step, graph)


def test_replicate_broadcast_root_sends_its_buffer_and_the_reduce_is_in_place():
    """h on stage 0, broadcast to both stages (root 0), consumed by a linear sharded on pp; its gradient's partial
    sums reduced to the root. The root sends h as it is (its own replica is h's buffer: nothing updates either in
    place) and reduces its partial gradient in place (read by nothing after); rank 1 sends no broadcast buffer and
    reduces in place too. The numbers are one device's."""
    g, step = replicate_broadcast()
    assert shared(step) == {0: [("FWD", "broadcast", True), ("BWD", "reduce", True)], 1: [("BWD", "reduce", True)]}
    against_one_device(step, g)


# --- hand-written programs: each hazard ---------------------------------------------------------------------
F64 = TensorType((4,), "float64")
TANH = LocalOp(Unary("tanh"), (1.0,))


def buf(v: str) -> Buffer:
    return Buffer(v, F64)


def made(v: str) -> Compute:
    """``v``, a new tensor made on this rank (from the input x)."""
    return Compute(TaskType.FWD, v, "ones", (buf("x"),), (buf(v),), v, kernel=OnesLike())


def keep(src: str, dst: str) -> Compute:
    return Compute(TaskType.FWD, dst, "keep", (buf(src),), (buf(dst),), dst, kernel=Keep())


def read(*vs: str, out: str) -> Compute:
    return Compute(TaskType.FWD, out, "keep", tuple(map(buf, vs)), (buf(out),), out, kernel=Keep())


def all_reduce(t: int, send: str, wait: bool = True) -> Comm:
    return Comm(t, "all_reduce", TaskType.FWD, (0, 1), F64, 64, send=buf(send), recv=buf(f"{send}.sum"), wait=wait)


def broadcast(t: int, send: str, wait: bool = True) -> Comm:
    return Comm(
        t, "broadcast", TaskType.FWD, (0, 1), F64, 32, root=0, send=buf(send), recv=buf(f"{send}.rep"), wait=wait
    )


def update(w: str, g: str) -> Compute:
    return Compute(TaskType.UPD, "upd", "sgd", (buf(w), buf(g)), (buf(f"upd:{w}"),), "upd", kernel=Update((), 0.0))


def program(*instrs, keep_values=("w", "upd:w")) -> Program:
    """Rank 0's program of ``instrs`` with the frees lowering adds; ``keep_values`` outlive the step."""
    return Program(0, with_frees(list(instrs), frozenset(keep_values)), (buf("x"), buf("w"), buf("g")))


def test_an_all_reduce_is_in_place_only_when_nothing_sharing_its_storage_is_read_after_it():
    # y = a itself (a kept piece): reducing y in place would change a, read afterwards
    assert (
        shared_sends(program(made("a"), keep("a", "y"), all_reduce(0, "y"), read("a", "y.sum", out="z")), ())
        == frozenset()
    )
    assert shared_sends(program(made("a"), keep("a", "y"), read("a", out="z"), all_reduce(0, "y")), ()) == {0}
    # a value that outlives the step (a weight, a gradient the update reads, the loss) is never overwritten, nor
    # one the executor placed (the step's data may be the caller's tensors)
    assert shared_sends(program(made("a"), keep("a", "y"), all_reduce(0, "y"), keep_values=("a",)), ()) == frozenset()
    assert shared_sends(program(keep("x", "y"), all_reduce(0, "y")), ()) == frozenset()


def test_a_recorded_forward_keeps_its_outputs_until_the_backward():
    fwd = Compute(TaskType.FWD, "n", "tanh", (buf("x"),), (buf("y"),), "fwd:n", kernel=Forward(TANH, None, (True,)))
    bwd = Compute(
        TaskType.BWD,
        "n",
        "vjp",
        (buf("x"), buf("y.sum")),
        (buf("dx"),),
        "bwd:n",
        kernel=Vjp(TANH, None, (True,), (1.0,), (True,), ("float64",)),
    )
    p = program(fwd, all_reduce(0, "y"), bwd)
    assert shared_sends(p, ()) == {0}  # no graph recorded: y is dead after its all-reduce
    assert shared_sends(p, (("n", 0),)) == frozenset()  # tanh's graph saves y for the backward


def test_a_buffer_in_flight_is_not_overwritten():
    # a is read by an async broadcast until its wait: y = a may not be reduced in place before that wait
    assert shared_sends(
        program(made("a"), keep("a", "y"), broadcast(0, "a", wait=False), all_reduce(1, "y"), Wait(0)), ()
    ) == {0}
    assert shared_sends(
        program(made("a"), keep("a", "y"), broadcast(0, "a", wait=False), Wait(0), all_reduce(1, "y")), ()
    ) == {0, 1}


def test_a_broadcast_root_shares_a_weight_only_if_its_replica_is_not_read_after_the_update():
    """The root's replica of a weight broadcast as it is shares the weight's storage; the optimizer then updates
    the weight in place, so the replica must not be read after the update (a received value must never alias a
    buffer updated in place while it is still read). If it is, the root sends a copy."""
    assert shared_sends(program(broadcast(0, "w"), read("w.rep", out="z"), update("w", "g")), ()) == {0}
    assert shared_sends(program(broadcast(0, "w"), update("w", "g"), read("w.rep", out="z")), ()) == frozenset()
    # nor may an in-place reduction overwrite a replica whose root buffer is still read
    assert shared_sends(program(made("a"), broadcast(0, "a"), all_reduce(1, "a.rep"), read("a", out="z")), ()) == {0}
    assert shared_sends(program(made("a"), broadcast(0, "a"), read("a", out="z"), all_reduce(1, "a.rep")), ()) == {0, 1}


def test_run_local_writes_a_shared_reduction_into_the_send_buffer():
    c = all_reduce(0, "y")
    a, b = torch.ones(4, dtype=torch.float64), torch.full((4,), 2.0, dtype=torch.float64)
    got = run_local([c, c], [a, b], [True, False])
    assert got[0] is a and got[1] is not b
    assert torch.equal(a, torch.full((4,), 3.0, dtype=torch.float64)) and torch.equal(got[1], a)
    assert torch.equal(b, torch.full((4,), 2.0, dtype=torch.float64))  # not shared: left as it was
    bc = broadcast(0, "x")
    sends = [a, None]
    for flag in (True, False):
        out = run_local([bc, replace(bc, send=None)], sends, [flag, False])
        assert (out[0] is a) == flag and out[1] is not a and torch.equal(out[1], a)


def test_gpt_data_parallel_copies_only_the_gradient_the_add_shares():
    """dp=2 on the tiny GPT: the loss's all-reduce and the gradient bucket's are in place; the position
    embedding's gradient is copied first — the add (token + position embeddings) vjp hands the one output gradient
    to both operands, and the token embedding's backward reads it after that all-reduce."""
    from shardflow.capture import capture
    from shardflow.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))
    batch = {"idx": torch.randint(0, 11, (4, 8)), "targets": torch.randint(0, 11, (4, 8))}
    graph = capture(model, batch)
    step = lowered(graph, "dp=2", make_plan(graph, Mesh.parse("dp=2"), "dp"))
    assert shared(step)[0] == [("FWD", "all_reduce", True), ("BWD", "all_reduce", False), ("BWD", "all_reduce", True)]
    p = step.programs[0]
    copied = [c for c in p.comms if c.token not in shared_sends(p, recorded_nodes(p))]
    assert [c.send.value for c in copied] == ["grad:embedding_1@add"]


def add(*vs: str, out: str) -> Compute:
    return Compute(TaskType.BWD, out, "sum", tuple(map(buf, vs)), (buf(out),), out, kernel=Sum())


def test_a_gradient_sum_accumulates_into_its_first_input_only_when_that_buffer_is_dead_after_it():
    """As autograd accumulates ``.grad``: a + b written into a's buffer when nothing sharing a's storage is read after
    the sum; not when a (or y, a itself) is read later, when b shares a's storage, or when a is a placed input."""
    assert inplace_sums(program(made("a"), made("b"), add("a", "b", out="s"), read("s", out="z")), ()) == {"s"}
    assert (
        inplace_sums(program(made("a"), made("b"), keep("a", "y"), add("a", "b", out="s"), read("y", out="z")), ())
        == frozenset()
    )
    assert inplace_sums(program(made("a"), keep("a", "b"), add("a", "b", out="s")), ()) == frozenset()
    assert inplace_sums(program(made("b"), add("g", "b", out="s")), ()) == frozenset()  # g: placed before the step
    chain = program(made("a"), made("b"), add("a", "b", out="s"), made("c"), add("s", "c", out="t"))
    assert inplace_sums(chain, ()) == {"s", "t"}  # microbatches' running sums: one buffer throughout


def test_the_in_place_sum_kernel_adds_into_a_dense_first_input_and_copies_an_expanded_one():
    instr = add("a", "b", out="s")
    kernel = make_kernel(instr, OptimizerConfig("sgd", lr=0.1), lambda: 1, in_place=True)
    a, b = torch.ones(4, dtype=torch.float64), torch.arange(4.0, dtype=torch.float64)
    (s,) = kernel([a, b])
    assert s.data_ptr() == a.data_ptr() and torch.equal(s, 1 + torch.arange(4.0, dtype=torch.float64))
    wide = torch.ones(1, dtype=torch.float64).expand(4)  # a broadcast's vjp: one element stored for four
    (s,) = kernel([wide, b])
    assert s.data_ptr() != wide.data_ptr() and torch.equal(s, 1 + b)
    assert torch.equal(wide, torch.ones(4, dtype=torch.float64))


# --- receive slots: received buffers kept from step to step -------------------------------------------------------
def recv(t: int, v: str, wait: bool = True) -> Comm:
    return Comm(t, "recv", TaskType.FWD, (1, 0), F64, 0, peer=1, recv=buf(v), wait=wait)


def test_a_receive_reuses_a_slot_only_once_everything_sharing_the_earlier_one_is_dead():
    """Interval colouring of received buffers: r2 takes r1's slot when r1 was read and freed before r2 arrives; two
    receives live at once take two slots; a received value that outlives the step, directly or through a buffer
    sharing its storage, gets none; one still in flight as a send holds its slot until its wait."""
    assert kept_receives(program(recv(0, "r1"), read("r1", out="z1"), recv(1, "r2"), read("r2", out="z2")), ()) == {
        0: 0,
        1: 0,
    }
    assert kept_receives(program(recv(0, "r1"), recv(1, "r2"), read("r1", "r2", out="z")), ()) == {0: 0, 1: 1}
    assert kept_receives(program(recv(0, "r1"), read("r1", out="z"), keep_values=("w", "r1")), ()) == {}
    assert kept_receives(
        program(recv(0, "r1"), keep("r1", "k"), recv(1, "r2"), read("r2", out="z"), keep_values=("w", "k")), ()
    ) == {1: 0}
    assert kept_receives(
        program(recv(0, "r1"), all_reduce(1, "r1", wait=False), recv(2, "r2"), Wait(1), read("r2", "r1.sum", out="z")),
        (),
    ) == {0: 0, 2: 1}
    # a received value reduced in place is the all-reduce's own buffer: the all-reduce itself receives nothing
    assert kept_receives(program(recv(0, "r1"), all_reduce(1, "r1"), read("r1.sum", out="z")), ()) == {0: 0}


def test_fsdp_receives_share_slots_only_between_disjoint_lives_and_match_one_device():
    """fsdp=2 on the MLP, unbucketed, all-gathers collective and reduce-scatters rings: every weight all-gather and
    every reduce-scatter ring step receives into a kept slot; fc1's and fc2's gathered weights (1,024 elements each)
    both live until the backward, so they take two slots, while the two weight gradients' ring receives (512
    elements each, one dead before the other arrives) share one. The all-reduce of scale's gradient works in place
    (no slot). Two steps on the local executor (which copies each receive into its slot) give one device's losses
    and weights."""
    graph = mlp(pre=True)
    step = lowered(
        graph,
        "fsdp=2",
        make_plan(graph, Mesh.parse("fsdp=2"), "fsdp"),
        options=LowerOptions("collective", "ring", bucket_bytes=0, reshard_after_forward=False),
    )
    for p in step.programs.values():
        assert [(c.kind, c.recv.type.numel) for c in p.comms] == [
            ("all_gather", 1024),
            ("all_gather", 64),
            ("all_gather", 1024),
            ("all_gather", 16),
            ("permute", 512),  # each gradient reduce-scattered right after the backward makes it: fc2's first
            ("permute", 8),
            ("permute", 512),
            ("permute", 32),
            ("all_reduce", 16),
        ]
        assert kept_receives(p, recorded_nodes(p)) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 4, 7: 6}
    against_one_device(step, graph)


@pytest.mark.parametrize("form", ["ring", "broadcast_loop"])
def test_a_product_by_a_matrix_fused_into_the_gather_writes_into_one_output(form):
    """x [4, 8, 8] sharded on dim 1 over tp=4, gathered into ``x @ w`` (w [8, 8] sharded on its columns): the
    product's four output chunks are blocks of one buffer (``ring_regions``, ``in_place_product``), as a linear's;
    the local executor gives one device's numbers over two steps."""
    from shardflow.lower import LowerOptions
    from shardflow.lower.buffer_reuse import in_place_product

    step, graph = _sp_step(LowerOptions(form, "ring"), with_graph=True, matmul=True)
    for p in step.programs.values():
        products = [i for i in p.instrs if isinstance(i, Compute) and i.op.startswith("matmul") and i.task == "FWD"]
        assert len(products) == 4 and all(in_place_product(i) for i in products)
        assert sorted(ring_regions(p)[i.outs[0].value][1] for i in products) == [0, 1, 2, 3]
    against_one_device(step, graph)


def test_a_ring_all_gather_is_received_into_blocks_of_one_kept_buffer():
    """x [4, 8, 8] sharded on dim 1 over tp=4, gathered by a ring of collective-permutes into a fused linear. Rank
    1's three received chunks are blocks of the gathered buffer (``ring_regions``: their places in its concat),
    taken as one slot of the whole value, and the backward's reduce-scatter ring receives into another, one chunk
    at a time. The ring's concat copies in only the rank's own chunk and returns the slot's storage, the full
    tensor. The fused linear's output chunks are computed into blocks of one buffer the same way (all four: the
    first one computed allocates it), so its concat copies nothing either and returns that buffer, the gathered
    dim stored first. Two steps on the local executor give one device's numbers."""
    import torch
    import torch.nn.functional as F

    from shardflow.lower import LowerOptions
    from shardflow.lower.buffer_reuse import buffer_reuse
    from shardflow.runtime.buffers import Receives

    step, graph = _sp_step(LowerOptions("ring", "ring"), with_graph=True)
    p = step.programs[1]
    joins = [k for k, i in enumerate(p.instrs) if isinstance(i, Compute) and i.op == "concat" and not i.dnode]
    outputs = {f"fwd:linear#{j}": (joins[1], j) for j in range(4)}
    assert ring_regions(p) == {**{f"fwd:x.combine#{j}": (joins[0], j) for j in (0, 2, 3)}, **outputs}
    assert [(c.kind, c.task, c.dim) for c in p.comms] == [("permute", "FWD", 1)] * 3 + [("permute", "BWD", None)] * 3
    slots = kept_receives(p, recorded_nodes(p))
    assert slots == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}

    receives = Receives(p, buffer_reuse(p, recorded_nodes(p)), torch.device("cpu"))
    kept = receives.kept
    full = torch.randn(4, 8, 8)
    chunks = list(full.chunk(4, 1))
    got = {}
    for c in p.comms[:3]:  # what each step receives, written where the communication would write it
        j = ring_regions(p)[c.recv.value][1]
        block = receives.alloc(c)((2, 4, 8))
        got[j] = block.copy_(chunks[j].movedim(1, 0)).movedim(0, 1)
    concat = p.instrs[joins[0]]
    xs = [got.get(j, chunks[1].clone()) for j in range(4)]
    (out,) = receives.kernel(concat)(xs)
    assert torch.equal(out, full)
    assert out.data_ptr() == kept[0].flat.data_ptr() and kept[0].nbytes == full.numel() * 4

    w, bias = torch.randn(2, 8), torch.randn(2)  # rank 1's rows of fc's weight [8, 8] and bias
    ys = {}
    for i in p.instrs:  # in program order: the own chunk first
        if isinstance(i, Compute) and i.outs[0].value in outputs:
            j = outputs[i.outs[0].value][1]
            (ys[j],) = receives.kernel(i)([xs[j], w, bias])
    assert sorted(ys) == [0, 1, 2, 3]
    (y,) = receives.kernel(p.instrs[joins[1]])([ys[j] for j in range(4)])
    torch.testing.assert_close(y, F.linear(full, w, bias), rtol=1e-6, atol=1e-6)
    stored = y.movedim(1, 0)
    assert stored.is_contiguous() and all(ys[j].data_ptr() == stored[2 * j].data_ptr() for j in range(4))
    against_one_device(step, graph)


def test_every_kind_is_one_entry_with_both_implementations():
    """Each kind's entry carries its local implementation and, registered from the runtime, its torch.distributed
    one; a kind without an entry is refused by both."""
    assert list(KINDS) == list(CommKind) and all(s.kind == k for k, s in KINDS.items())
    assert all(s.local is not None and s.distributed is not None for s in KINDS.values())
    bogus = Comm(0, "gather", TaskType.FWD, (0, 1), F64, 0)
    with pytest.raises(ValueError, match="no local implementation of communication kind 'gather'"):
        run_local([bogus, bogus], [None, None], [False, False])
    with pytest.raises(ValueError, match="rank 0: no implementation of communication kind 'gather'"):
        issue(bogus, None, 0)


@pytest.mark.parametrize(
    "kind,d,root,want",
    [
        ("all_gather", 4, False, 300),
        ("reduce_scatter", 4, False, 75),
        ("all_to_all", 4, False, 75),
        ("reduce", 4, False, 75),
        ("all_reduce", 4, False, 150),
        ("broadcast", 4, True, 100),
        ("broadcast", 4, False, 0),
        ("send", 2, False, 100),
        ("recv", 2, False, 0),
        ("permute", 1, False, 100),
        ("all_reduce", 1, False, 0),
        ("broadcast", 1, True, 0),
    ],
)
def test_bound_bytes_per_kind(kind, d, root, want):
    assert bound_bytes(CommKind(kind), 100, d, root) == want


def test_one_reduce_op_spelled_as_the_user_writes_it():
    assert Partial("avg").reduce_op is ReduceOp.AVG and repr(Partial("max")) == "Partial('max')"
    with pytest.raises(ValueError, match=r"reduce_op must be one of \('sum', 'avg', 'max', 'min'\), got 'prod'"):
        Partial("prod")
    pieces = torch.tensor([[1.0, 4.0], [3.0, 2.0]])
    assert [op.combine(pieces).tolist() for op in ReduceOp] == [[4.0, 6.0], [2.0, 3.0], [3.0, 4.0], [1.0, 2.0]]
