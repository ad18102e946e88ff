"""One rank of the distributed tests: runs every case given on the command line against the single-device
run (eager module + torch.optim, computed on this rank) and writes the largest differences to JSON: loss,
gradients, the global gradient norm (relative, against clip_grad_norm_'s) and weights, compared on every replica
(each rank its own pieces, the maximum all-reduced); and whether ``per_process`` gathered every rank's number.

Usage (under shardflow's launcher or torchrun): python dist_worker.py OUT_DIR CASE [CASE ...]
CASE = strategy[:cp_attention[:cp_layout]]@mesh@dtype[@all_gather_form@reduce_scatter_form], e.g. "tp@tp=2@float64",
"sp@tp=2@float64@ring@ring", "cp:all_to_all@cp=2@float64" or "cp:ring:balanced@cp=2@float64". Special cases: "mismatch" (rank 1 plans another strategy),
"die" (rank 1 kills itself in the middle of a step), "memory" (fsdp: the executor's count of its buffers against
the replay of its program), "dropout" (tp with dropout against the one-device executor),
"dtensor" (the Trainer's parameters and gradients as DTensors: dp, tp, fsdp, pp on 2 ranks, pp,tp on 4),
"groups" (process groups from a list of regular and irregular groups, 4 ranks), "checkpoint" (a sharded checkpoint
saved under one strategy, restored under others; a NaN in one rank's pieces), "comms" (every communication kind
against the local implementation), "uneven" (uneven blocks through an all-to-all, a reduce-scatter and their
backward's all-gather, against one device and DTensor's layout), "devices" (fsdp, dropout and the checkpoint case under tests/devices.py's
DevicelessFactories: no tensor made without naming a device), "stream_waits" (two 4-rank cases waiting as on a
GPU).
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch

from shardflow.capture import capture
from shardflow.lower import LowerOptions, lower_step
from shardflow.lower.cost import CPAttention
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import build_pcg
from shardflow.reference import weights_of
from shardflow.runtime.distributed import DistributedExecutor, init_from_env, shutdown
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.strategy import make_plan, resolve
from shardflow.strategy.presets import cp_laid_out

B, T, V = 4, 8, 11


_graphs: dict = {}


def _captured(model, inputs, dtype, dropout):
    """The model's graph, captured once per dtype and dropout in this process: every case builds the same model from
    the same seed, and a capture costs a second or more (the graph holds no tensor of the model's parameters)."""
    if (dtype, dropout) not in _graphs:
        _graphs[dtype, dropout] = capture(model, inputs)
    return _graphs[dtype, dropout]


def executor(
    strategy,
    mesh_text,
    dtype,
    rank,
    cfg,
    timeout_s=60.0,
    forms=("collective", "collective"),
    dropout=0.0,
    seed=0,
    memory=False,
):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_embd=32, dropout=dropout)).to(dtype)
    gen = torch.Generator().manual_seed(1)
    inputs = {"idx": torch.randint(0, V, (B, T), generator=gen), "targets": torch.randint(0, V, (B, T), generator=gen)}
    graph = _captured(model, inputs, dtype, dropout)
    strategy, _, attention = strategy.partition(":")  # "cp:all_to_all": the preset and its --cp-attention
    attention, _, layout = attention.partition(":")  # "cp:ring:balanced": and its --cp-layout
    mesh = cp_laid_out(Mesh.parse(mesh_text), layout or "contiguous", graph)
    plan = make_plan(graph, mesh, strategy, cp_attention=attention or "auto")
    pcg = build_pcg(graph, mesh, resolve(plan, graph, mesh))
    ex = DistributedExecutor(
        lower_step(
            pcg,
            cfg.slots,
            ranks=[rank],
            options=LowerOptions(*forms, cp_attention=CPAttention(attention or "auto")),
            grad_norm=True,
        ),
        cfg,
        timeout_s=timeout_s,
        seed=seed,
        memory=memory,
    )
    ex.load(weights_of(model, graph))
    return model, inputs, ex


def run_case(case, rank, stream=False):
    """``stream``: the executor waits as on a GPU (:class:`~shardflow.runtime.distributed.Waits`: each wait inside
    the step ``work.wait()`` without a timeout — on gloo that still blocks — and the step's end looks at them all);
    the diffs then also say whether a step streamed none of its waits."""
    strategy, mesh_text, dtype_name, *forms = case.split("@")
    dtype = getattr(torch, dtype_name)
    cfg = OptimizerConfig("sgd", 0.1, 0.9)
    model, inputs, ex = executor(strategy, mesh_text, dtype, rank, cfg, forms=forms or ("collective", "collective"))
    streamed, settle = [], ex.waits.settle
    if stream:
        ex.waits.on_stream = True
        ex.waits.settle = lambda: (streamed.append(len(ex.waits.streamed)), settle())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    diffs = {"loss": 0.0, "grad": 0.0, "grad_norm": 0.0, "weight": 0.0}
    for _ in range(3):
        loss = ex.step(inputs)
        opt.zero_grad()
        want = model(**inputs)
        want.backward()
        diffs["loss"] = max(diffs["loss"], abs(loss - want.item()))
        grads = ex.grads()
        diffs["grad"] = max(
            [diffs["grad"]] + [(grads[k] - p.grad).abs().max().item() for k, p in model.named_parameters()]
        )
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()  # clip_grad_norm_'s
        diffs["grad_norm"] = max(diffs["grad_norm"], abs(ex.grad_norm - norm) / max(1.0, norm))
        opt.step()
    diffs["weight"] = ex.weight_error({k: p.detach() for k, p in model.named_parameters()})
    diffs["per_process"] = float(ex.per_process(rank + 0.5) != [r + 0.5 for r in range(ex.world)])
    if stream:
        diffs["a step streamed no wait"] = float(len(streamed) != 3 or not all(streamed) or ex.waits.streamed != [])
    return diffs


def run_memory(rank, world):
    """fsdp over every rank: its all-gathers prefetched and its gradient buckets reduce-scattered without waiting.
    The executor's count of its live buffers (``memory=True``) peaks where the replay of its program
    (:func:`~shardflow.lower.memory.program_memory`) does: a receive is counted from its issue (its buffer is
    allocated then), not from its wait; an update writes in place."""
    from shardflow.lower.memory import program_memory

    _, inputs, ex = executor("fsdp", f"fsdp={world}", torch.float64, rank, OptimizerConfig("adamw", 1e-3), memory=True)
    for _ in range(2):
        ex.step(inputs)
    replayed = program_memory(ex.program, ex.dg).peak
    return {"peak: executor - replay (bytes)": float(abs(ex.peak_bytes - replayed))}


def run_dropout(rank, world):
    """tp on every rank with dropout 0.1, 2 SGD steps: the loss of each step and every replica of every weight
    against the single-device run with the same seed (the local executor on one device, on this rank)."""
    from shardflow.runtime.local import LocalExecutor

    cfg, seed = OptimizerConfig("sgd", 0.1), 3
    model, inputs, ex = executor("tp", f"tp={world}", torch.float64, rank, cfg, dropout=0.1, seed=seed)
    graph = ex.dg.pcg.graph
    one = LocalExecutor(lower_step(build_pcg(graph, Mesh.parse("d=1")), cfg.slots), cfg, seed=seed)
    one.load(weights_of(model, graph))
    loss = max(abs(ex.step(inputs) - one.step(inputs)) for _ in range(2))
    return {"loss": loss, "weight": ex.weight_error(one.weights())}


# per world size: the strategy a checkpoint is saved under, then those it is restored under
CHECKPOINT_STRATEGIES = {
    2: (("fsdp", "fsdp=2"), ("tp", "tp=2"), ("dp", "dp=2"), ("pp", "pp=2")),
    4: (("dp,tp", "dp=2,tp=2"), ("pp,tp", "pp=2,tp=2"), ("tp", "tp=4"), ("fsdp,tp", "fsdp=2,tp=2")),
}


def run_checkpoint(rank, world, out):
    """A sharded checkpoint between strategies (AdamW, float64): saved after 2 steps under the first strategy of
    :data:`CHECKPOINT_STRATEGIES` (each rank writing replica 0 of its pieces), restored under the others (each rank
    reading every replica it holds; pipeline stages hold values on sub-meshes): every replica of every weight equals
    the saved one, and the next 2 steps give the saver's losses and weights (the optimizer state came along). Then
    a NaN in one piece of rank 1 alone: every rank refuses the save, naming that entry, and nothing is written."""
    import torch.distributed as dist

    from shardflow.lower.dynamic import forward_id
    from shardflow.train import checkpoint

    cfg = OptimizerConfig("adamw", 0.01)
    (strategy, mesh_text), *others = CHECKPOINT_STRATEGIES[world]
    _, inputs, ex = executor(strategy, mesh_text, torch.float64, rank, cfg)
    for _ in range(2):
        ex.step(inputs)
    root = out / "checkpoints"
    root.mkdir(exist_ok=True)  # the parent's work in shardflow train (check_writable)
    saver = checkpoint.Saver(root, rank, world, {"model": {}, "data": {}, "train": {}}, fresh=True)
    ck = checkpoint.read(saver.save(ex, 2)[0])
    saved = ex.weights()
    losses = [ex.step(inputs) for _ in range(2)]
    after = ex.weights()
    diffs = {}
    for strategy, mesh_text in others:
        _, _, other = executor(strategy, mesh_text, torch.float64, rank, cfg)
        ck.restore(other, world)
        diffs[f"{strategy}: weights restored"] = other.weight_error(saved)
        diffs[f"{strategy}: next losses"] = max(abs(other.step(inputs) - want) for want in losses)
        diffs[f"{strategy}: weights after"] = other.weight_error(after)
    poisoned = []
    if rank == 1:
        w = next(w for w in ex.dg.pcg.graph.weights if ex.held_pieces(forward_id(w), replica0_only=True))
        ex.held_pieces(forward_id(w), replica0_only=True)[0][1].view(-1)[0] = float("nan")
        poisoned = [f"model/{w}"]
    try:
        saver.save(ex, 4)
        names = None
    except checkpoint.NonFiniteState as e:
        names = e.names
    everyone = [None] * world
    dist.all_gather_object(everyone, (names, poisoned))
    diffs["NaN refused alike"] = float(not everyone[1][1] or any(n != everyone[1][1] for n, _ in everyone))
    diffs["NaN wrote nothing"] = float(sorted(p.name for p in root.iterdir()) != ["step_2"])
    return diffs


def run_explicit(rank):
    """h = x·w0 on stage 0; Replicate to both stages; a Repartition; a linear sharded on pp (partial output);
    a Reduction; tanh; mean. Loss and gradients against the single-device reference."""
    from dataclasses import replace

    from shardflow.graph import GraphBuilder
    from shardflow.parallel.mesh import SubMesh
    from shardflow.parallel.ops import ReductionOp, RepartitionOp, ReplicateOp
    from shardflow.parallel.sharding import Sharding
    from shardflow.reference import run_backward
    from shardflow.strategy import ModulePlan, Plan

    b = GraphBuilder()
    x = b.input("x", (4, 6), "float64")
    w0, w1 = b.weight("w0", (6, 6), "float64"), b.weight("w1", (5, 6), "float64")
    loss = b.mean(b.tanh(b.linear(b.linear(x, w0), w1)))
    g = b.build([loss], loss)
    mesh = Mesh.parse("pp=2")
    whole = SubMesh(mesh)
    ann = resolve(Plan(modules={"linear": ModulePlan(stage=0)}), g, mesh)
    ann = replace(
        ann,
        groups={"linear": whole.with_fixed("pp", 0), "linear_1": whole, "tanh": whole, "mean": whole},
        leaves={**ann.leaves, "w1": Sharding(((), ("pp",)))},
        ops={"linear": (ReplicateOp(2, "pp"), RepartitionOp(1, 2, "pp")), "linear_1": (ReductionOp(2, "pp"),)},
    )
    cfg = OptimizerConfig("sgd", 0.1)
    ex = DistributedExecutor(lower_step(build_pcg(g, mesh, ann), cfg.slots, ranks=[rank]), cfg, timeout_s=60)
    torch.manual_seed(0)
    weights = {"w0": torch.randn(6, 6, dtype=torch.float64), "w1": torch.randn(5, 6, dtype=torch.float64)}
    inputs = {"x": torch.randn(4, 6, dtype=torch.float64)}
    ex.load(weights)
    loss_v = ex.step(inputs)
    outs, grads = run_backward(g, inputs, weights)
    got = ex.grads()
    return {
        "loss": abs(loss_v - outs["mean"].item()),
        "grad": max((got[k] - grads[k]).abs().max().item() for k in weights),
        "weight": 0.0,
    }


def replicate_outside_view(partial):
    """x [4, 6] Shard(0) on tp; h = x·w0ᵀ on mesh[pp=0] under the machine view (3, 1): block 0 of h lives on
    device 3, outside its axis group {0, 2} along pp; Replicate(2, pp) to the whole mesh; z = h·w1ᵀ; tanh; mean.
    ``partial``: w1 Shard(0) on pp, so the gradient of h is partial on pp (backward: a reduce to device 3);
    else w1 is replicated (backward: device 0's copy, sent to device 3). Returns graph, PCG, weights, inputs."""
    from dataclasses import replace

    from shardflow.graph import GraphBuilder
    from shardflow.parallel.mesh import Shard, SubMesh
    from shardflow.parallel.ops import ReplicateOp
    from shardflow.parallel.sharding import Sharding
    from shardflow.strategy import ModulePlan, Plan

    b = GraphBuilder()
    x = b.input("x", (4, 6), "float64")
    loss = b.mean(b.tanh(b.dense(b.dense(x, 6, bias=False, name="fc0"), 4, bias=False, name="fc1")))
    g = b.build([loss], loss)
    mesh = Mesh.parse("pp=2,tp=2")
    plan = Plan(
        inputs={"x": {"tp": Shard(0)}},
        modules={"fc0": ModulePlan(stage=0, devices=(3, 1))},
        ops={"linear": (ReplicateOp(2, "pp"),)},
    )
    ann = resolve(plan, g, mesh)
    whole = SubMesh(mesh)
    w1 = Sharding.replicated(2).with_layout({"pp": Shard(0)} if partial else {}, whole)
    ann = replace(
        ann,
        groups={"linear": ann.groups["linear"], "linear_1": whole, "tanh": whole, "mean": whole},
        leaves={**ann.leaves, "fc1.weight": w1},
    )
    gen = torch.Generator().manual_seed(0)
    weights = {w: torch.randn(g.tensors[w].shape, generator=gen, dtype=torch.float64) for w in g.weights}
    return g, build_pcg(g, mesh, ann), weights, {"x": torch.randn(4, 6, generator=gen, dtype=torch.float64)}


def run_outside_view(rank):
    """:func:`replicate_outside_view`, both backward forms: loss and gradients against one device."""
    from shardflow.reference import run_backward

    cfg = OptimizerConfig("sgd", 0.1)
    diffs = {"loss": 0.0, "grad": 0.0, "grad_norm": 0.0, "weight": 0.0}
    for partial in (True, False):
        g, pcg, weights, inputs = replicate_outside_view(partial)
        ex = DistributedExecutor(lower_step(pcg, cfg.slots, ranks=[rank]), cfg, timeout_s=60)
        ex.load(weights)
        loss = ex.step(inputs)
        outs, grads = run_backward(g, inputs, weights)
        got = ex.grads()
        diffs["loss"] = max(diffs["loss"], abs(loss - outs[g.loss].item()))
        diffs["grad"] = max([diffs["grad"]] + [(got[k] - grads[k]).abs().max().item() for k in weights])
    return diffs


def run_groups(rank, world):
    """:class:`ProcessGroups` from regular groups (axis groups of a pp=2,tp=2 mesh: a DeviceMesh's) and plain member
    lists, created twice (the second time creates nothing): each group of this rank spans exactly its members, a
    regular one is the DeviceMesh's group along its axis, a non-member has none, each has the run's timeout (the
    world's, from init_from_env, is 60 s) and an all-reduce over each counts its members. Returns the number of
    groups that failed."""
    import datetime

    import torch.distributed as dist

    from shardflow.lower.program import Group
    from shardflow.runtime.distributed import ProcessGroups

    mesh = Mesh.parse("pp=2,tp=2")
    groups = [
        Group((3, 0, 2)),
        Group((0, 1), mesh, "tp"),
        Group((2, 3), mesh, "tp"),
        Group((1, 3), mesh, "pp"),
        Group((3, 1)),
        Group(tuple(range(world))),
    ]
    pgs = ProcessGroups(datetime.timedelta(seconds=60))
    for _ in range(2):
        pgs.create(groups)
    failed = 0
    for g in groups:
        if rank not in g.members:
            try:
                pgs.get(g.members)
                failed += 1
            except KeyError:
                pass
            continue
        pg = pgs.get(g.members)
        ranks = list(range(world)) if pg is None else dist.get_process_group_ranks(pg)
        x = torch.ones(1)
        dist.all_reduce(x, group=pg)
        timeout = (pg or dist.group.WORLD)._get_backend(torch.device("cpu")).options._timeout
        failed += (
            sorted(ranks) != sorted(g.members)
            or x.item() != len(g.members)
            or (g.mesh is not None and pg is not pgs.meshes[mesh].get_group(g.axis))
            or timeout != datetime.timedelta(seconds=60)
        )
    return {"failed groups": float(failed)}


def run_comms(rank, world):
    """Every communication kind through :func:`~shardflow.runtime.comms.issue` on this world against
    :func:`~shardflow.lower.comms.run_local` on every rank's send buffer (float64, shape [2d, 3d, 2d]): the largest
    difference per case — all-gather and reduce-scatter on each dim, all-to-all between dims, all-reduce, broadcast
    and reduce with the send buffer shared or copied, contiguous or not. Also 1.0 where a shared all-reduce did not
    reduce into its send buffer, a copied one did, or an all-gather on a dim other than 0 copied its result."""
    from shardflow.graph.ops import TensorType
    from shardflow.lower.comms import run_local
    from shardflow.lower.program import Buffer, Comm
    from shardflow.parallel.collectives import CommKind
    from shardflow.parallel.mesh import ReduceOp
    from shardflow.runtime.comms import issue

    d, members = world, tuple(range(world))
    shape = (2 * d, 3 * d, 2 * d)

    def comm(kind, piece, result, **kw):
        t = TensorType(piece, "float64")
        return Comm(
            0, kind, "FWD", members, t, 0, send=Buffer("x", t), recv=Buffer("y", TensorType(result, "float64")), **kw
        )

    def scaled(dim, f):
        return tuple(n * f if i == dim else n for i, n in enumerate(shape))

    cases = {f"all_gather dim {k}": (comm("all_gather", shape, scaled(k, d), dim=k), False) for k in range(3)}
    cases |= {
        f"reduce_scatter dim {k}": (
            comm("reduce_scatter", shape, tuple(n // d if i == k else n for i, n in enumerate(shape)), dim=k),
            False,
        )
        for k in range(3)
    }
    cases |= {
        f"all_to_all {a}->{b}": (comm("all_to_all", shape, shape, dim=a, dim2=b), False)
        for a, b in ((0, 1), (1, 0), (2, 1), (1, 1))
    }
    for own in (True, False):
        cases[f"all_reduce shared={own}"] = (comm("all_reduce", shape, shape), own)
        cases[f"all_reduce avg shared={own}"] = (comm("all_reduce", shape, shape, reduce_op=ReduceOp.AVG), own)
        cases[f"broadcast root {d - 1} shared={own}"] = (comm("broadcast", shape, shape, root=d - 1), own)
        cases[f"reduce root 1 shared={own}"] = (comm("reduce", shape, shape, root=1), own)
    diffs = {}
    for k, (name, (c, own)) in enumerate(cases.items()):
        gen = torch.Generator().manual_seed(k)
        sends = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(d)]
        for transposed in (False, True):  # a non-contiguous send buffer: a transposed view of its values
            mine = sends[rank].clone()
            if transposed:
                mine = mine.transpose(0, 2).contiguous().transpose(0, 2)
            issued = issue(c, mine, rank, in_place=own)
            for h in issued.handles:
                h.wait()
            got = issued.result()
            want = run_local([c] * d, [x.clone() for x in sends], [own] * d)[rank]
            if c.kind == CommKind.REDUCE and rank != c.root:
                diffs[f"{name}{' transposed' * transposed}"] = float(got is not None)
                continue
            diffs[f"{name}{' transposed' * transposed}"] = (got - want).abs().max().item()
            if c.kind == CommKind.ALL_REDUCE and c.reduce_op == ReduceOp.SUM and not transposed:
                diffs[f"{name}: reduced into its send buffer as told"] = float(
                    (got.data_ptr() == mine.data_ptr()) != own
                )
            if c.kind == CommKind.ALL_GATHER and c.dim != 0:
                diffs[f"{name}: result a view"] = float(got.is_contiguous())
    return diffs


def run_dtensor(rank, world):
    """``Trainer.dtensor_parameters`` / ``dtensor_grads`` (``parallelize`` on the distributed executor, 2 SGD steps)
    under dp, tp, fsdp and pp on 2 ranks, pp,tp on 4: ``full_tensor()`` of each DTensor equals the trainer's
    ``state_dict()`` / ``grads()`` entry exactly (0: equal, 1: not); the placements are the strategy's (dp
    replicated, tp's Megatron pair, fsdp ``Shard`` of each weight's first even dim; a pp stage of one device: a
    one-device mesh; pp,tp: the Megatron pair on the stage's tp sub-mesh); each weight is held by the ranks of its
    stage (every rank without pp)."""
    from collections import Counter

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    import shardflow

    def megatron(p, layer=0):
        mlp = f"transformer.h.{layer}.mlp"
        return p[f"{mlp}.c_fc.weight"].placements == (TShard(0),) and p[f"{mlp}.c_proj.weight"].placements == (
            TShard(1),
        )

    cases = {
        2: {
            "dp=2": lambda p: all(d.placements == (TReplicate(),) for d in p.values()),
            "tp=2": megatron,
            "fsdp=2": lambda p: all(d.placements == (TShard(0 if d.shape[0] % 2 == 0 else 1),) for d in p.values()),
            "pp=2": lambda p: all(d.placements == (TReplicate(),) and d.device_mesh.size() == 1 for d in p.values()),
        },
        4: {
            "pp=2,tp=2": lambda p: (
                megatron(p, rank // 2)
                and all(d.device_mesh.mesh_dim_names == ("tp",) and d.device_mesh.size() == 2 for d in p.values())
            )
        },
    }
    diffs = {}
    for mesh, placed in cases[world].items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_embd=32))
        gen = torch.Generator().manual_seed(1)
        batch = {
            "idx": torch.randint(0, V, (B, T), generator=gen),
            "targets": torch.randint(0, V, (B, T), generator=gen),
        }
        trainer = shardflow.parallelize(model, batch, mesh=mesh, executor="distributed", timeout_s=60)
        for _ in range(2):
            trainer.step(batch)
        params, grads = trainer.dtensor_parameters(), trainer.dtensor_grads()
        state, full_grads = trainer.state_dict(), trainer.grads()
        for what, got, full in (("parameters", params, state), ("grads", grads, full_grads)):
            diffs[f"{mesh}: {what} not equal"] = max(
                float(not torch.equal(d.full_tensor(), full[k])) for k, d in got.items()
            )
        held: list = [None] * world
        dist.all_gather_object(held, sorted(params))
        stage_ranks = world // trainer.plan.pcg.mesh.axis_size("pp") if "pp" in mesh else world
        planned = Counter(k for keys in held for k in keys) == dict.fromkeys(trainer.graph.weights, stage_ranks)
        diffs[f"{mesh}: weights not held as planned"] = float(not planned or sorted(grads) != sorted(params))
        diffs[f"{mesh}: placements not the strategy's"] = float(not placed(params) or not placed(grads))
    return diffs


def run_uneven(rank, world):
    """Uneven blocks on gloo (docs/concepts.md#uneven-shards): x [9, 5] Shard(0) on every rank (3, 3, 3, 0 on 4) →
    dense → an all-to-all onto the 6 features (2, 2, 2, 0), padded and trimmed → tanh, softmax over the now whole
    rows → a dense contracting the uneven features with a weight Shard(1) → a reduce-scatter of its partial sum onto
    the 9 rows, padded → mean. 2 SGD steps: loss, gradients and every replica of every weight against the
    single-device reference; the uneven weight fc2.weight (2, 2, 2, 0 columns) as a DTensor (``full_tensor()``);
    each rank's block of x against DTensor's ``distribute_tensor`` (its local shape and values)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor

    from shardflow.graph import GraphBuilder
    from shardflow.lower.dynamic import forward_id
    from shardflow.parallel.mesh import Shard, SubMesh
    from shardflow.parallel.pcg import Annotations
    from shardflow.parallel.sharding import Sharding
    from shardflow.reference import run_backward

    b = GraphBuilder()
    x = b.input("x", (9, 5), "float64")
    h = b.dense(x, 6, name="fc1")
    z = b.softmax(b.tanh(h), 0)
    y = b.dense(z, 3, name="fc2", bias=False)
    loss = b.mean(y)
    g = b.build([loss], loss)
    mesh = Mesh.parse(f"tp={world}")
    group = SubMesh(mesh)
    ann = Annotations(
        leaves={
            "x": Sharding.from_placements((Shard(0),), group, 2),
            "fc2.weight": Sharding.from_placements((Shard(1),), group, 2),
        },
        after={h: {"tp": Shard(1)}, y: {"tp": Shard(0)}},
    )
    cfg = OptimizerConfig("sgd", 0.1)
    ex = DistributedExecutor(lower_step(build_pcg(g, mesh, ann), cfg.slots, ranks=[rank]), cfg, timeout_s=60)
    torch.manual_seed(0)
    weights = {
        "fc1.weight": torch.randn(6, 5, dtype=torch.float64),
        "fc1.bias": torch.randn(6, dtype=torch.float64),
        "fc2.weight": torch.randn(3, 6, dtype=torch.float64),
    }
    inputs = {"x": torch.randn(9, 5, dtype=torch.float64)}
    ex.load(weights)
    diffs = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    ref = {k: v.clone() for k, v in weights.items()}
    for _ in range(2):
        got_loss = ex.step(inputs)
        outs, grads = run_backward(g, inputs, ref)
        got = ex.grads()
        diffs["loss"] = max(diffs["loss"], abs(got_loss - outs[g.loss].item()))
        diffs["grad"] = max(diffs["grad"], *((got[k] - grads[k]).abs().max().item() for k in ref))
        ref = {k: v - 0.1 * grads[k] for k, v in ref.items()}
    diffs["weight"] = ex.weight_error(ref)
    held = ex.dtensors({"w": forward_id("fc2.weight")})["w"]  # DTensor's local shape: the block without padding
    diffs["DTensor of fc2.weight"] = (held.full_tensor() - ref["fc2.weight"]).abs().max().item()
    kinds = {c.kind for c in ex.program.comms}
    diffs["comm kinds not all met"] = float(not {"all_to_all", "reduce_scatter", "all_gather"} <= kinds)
    dmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    local = distribute_tensor(inputs["x"], dmesh, [TShard(0)]).to_local()
    v = ex.dg.values[forward_id("x")]
    ex._put(v.id, inputs["x"])
    p = v.sharding.parallel_shape(v.group, v.type.shape)
    mine = p.valid_of(ex.buffers[v.id], v.sharding.coord_of(v.group, rank))
    diffs["block of x not DTensor's"] = float(mine.shape != local.shape or not torch.equal(mine, local))
    return diffs


def run_devices(rank, world, out):
    """An fsdp run against one device, the dropout case and the checkpoint case under
    :class:`~devices.DevicelessFactories`: their differences, and how many shardflow source lines made a tensor
    without naming a device (0: on a GPU every tensor of the distributed executor, its communications and its
    checkpoints would be on the rank's device), which it prints."""
    from devices import DevicelessFactories

    with DevicelessFactories() as mode:
        diffs = {f"fsdp {k}": v for k, v in run_case(f"fsdp@fsdp={world}@float64", rank).items()}
        diffs |= {f"dropout {k}": v for k, v in run_dropout(rank, world).items()}
        (out / "devices").mkdir(exist_ok=True)
        diffs |= run_checkpoint(rank, world, out / "devices")
    print(f"rank {rank}: tensors made without a device at {sorted(mode.sites)}", flush=True)
    return {**diffs, "deviceless factories": float(len(mode.sites))}


def main():
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    rank, world = init_from_env(timeout_s=60)
    results = {}
    for case in cases:
        if case == "mismatch":
            cfg = OptimizerConfig("sgd", 0.1)
            executor("dp" if rank == 0 else "tp", f"{'dp' if rank == 0 else 'tp'}={world}", torch.float64, rank, cfg)
            results[case] = "ran"  # must not get here: the fingerprints differ
        elif case == "diverge":  # rank 1's program has its first two forward all-reduces swapped; debug mode
            from shardflow.lower.program import Comm, Program

            cfg = OptimizerConfig("sgd", 0.1)
            _, inputs, ex = executor("tp", f"tp={world}", torch.float64, rank, cfg, timeout_s=10.0)
            ex.debug = True
            if rank == 1:
                instrs = list(ex.program.instrs)
                i, j = [k for k, x in enumerate(instrs) if isinstance(x, Comm)][:2]
                instrs[i], instrs[j] = instrs[j], instrs[i]
                ex.program = Program(1, tuple(instrs))
            ex.step(inputs)
            results[case] = "survived"
        elif case == "explicit":  # explicit Replicate and Reduction ops (see test_local_executor)
            results[case] = run_explicit(rank)
        elif case == "outside_view":  # a Replicate whose input a machine view puts outside its group
            results[case] = run_outside_view(rank)
        elif case == "groups":  # process groups from a program's group list
            results[case] = run_groups(rank, world)
        elif case == "dropout":
            results[case] = run_dropout(rank, world)
        elif case == "memory":  # the executor's count of its live buffers against the replay of its program
            results[case] = run_memory(rank, world)
        elif case == "checkpoint":
            results[case] = run_checkpoint(rank, world, out)
        elif case == "dtensor":
            results[case] = run_dtensor(rank, world)
        elif case == "devices":
            results[case] = run_devices(rank, world, out)
        elif case == "uneven":  # uneven blocks: padded collectives, masked ops, DTensor's layout
            results[case] = run_uneven(rank, world)
        elif case == "comms":  # every communication kind against the local implementation
            results[case] = run_comms(rank, world)
        elif case == "stream_waits":  # a GPU's way of waiting, on gloo: pipeline sends and receives, ring steps
            results[case] = {
                f"{k} ({c})": v
                for c in ("pp,tp@pp=2,tp=2@float64", "sp@tp=4@float64@ring@ring")
                for k, v in run_case(c, rank, stream=True).items()
            }
        elif case == "die":
            cfg = OptimizerConfig("sgd", 0.1)
            _, inputs, ex = executor("tp", f"tp={world}", torch.float64, rank, cfg, timeout_s=5.0)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            ex.step(inputs)
            results[case] = "survived"
        else:
            results[case] = run_case(case, rank)
    (out / f"result{rank}.json").write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    main()
