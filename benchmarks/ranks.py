"""One rank of ``benchmarks/run.py``: ``python benchmarks/ranks.py WORKLOAD OUT_DIR PARAMS_JSON``.

Started by the driver through ``shardflow.runtime.launch.launch`` (torchrun's environment, one thread per rank).
Every rank builds the same variants and runs them interleaved (``harness.interleave``); rank 0 writes
``OUT_DIR/result.json``. Workloads:

* ``mlp``     — (a) Megatron MLP h → 4h → h (GELU, cross-entropy), forward + backward + SGD: shardflow tp=2,
                DTensor ``parallelize_module``, hand-written tensor parallelism, one process;
* ``gpt``     — (b) the training job's default GPT, tp=2 and dp=2: shardflow, DTensor / DDP, one process;
                (e) per-rank memory of shardflow's tp=2 plan against one device;
* ``comm``    — (c) all-gather / reduce-scatter / all-reduce in each form shardflow issues, gloo's built-ins,
                and the loopback TCP bound;
* ``sp``      — (d) a column-parallel linear fed by an all-gather of a sequence-sharded input, each form of
                the all-gather and of its backward reduce-scatter, through ``DistributedExecutor``;
* ``profile`` — where the time of one shardflow tp=2 step of (a) goes (timers around the executor's kernels
                and communications, and cProfile), rank 0;
* ``ckpt``    — (f) the memory a checkpoint save allocates on each rank beyond its state: the sharded save of
                ``shardflow train`` against a save of full tensors gathered first;
* ``fsdp``    — (g) the training job's default model: shardflow's fsdp against PyTorch FSDP2 (``fully_shard``);
* ``pipeline`` — (q) pp=2 with microbatches: shardflow 1F1B and GPipe against torch.distributed.pipelining's
                ``Schedule1F1B`` / ``ScheduleGPipe``, each stage's measured bubble and peak memory;
* ``chunked`` — (t) a row-parallel matmul's all-reduce waited at once against the same cut in chunks whose
                all-reduces travel while the next chunk computes (the technique of async tensor parallelism);
* ``moe``     — (m) a Mixtral-style model: shardflow's ep and dp against expert parallelism written by hand
                (``all_to_all_single`` dispatch and combine around the same expert MLPs).
"""

from __future__ import annotations

import copy
import cProfile
import dataclasses
import functools
import io
import json
import math
import pstats
import socket
import sys
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Variant, interleave, machine, say, stats, write_result  # noqa: E402

from shardflow.capture import capture  # noqa: E402
from shardflow.graph import GraphBuilder  # noqa: E402
from shardflow.graph.ops import TensorType  # noqa: E402
from shardflow.lower import LowerOptions, lower_step  # noqa: E402
from shardflow.lower.comm_lowering import ring_peers  # noqa: E402
from shardflow.lower.cost import PLAIN, EPDispatch  # noqa: E402
from shardflow.lower.dynamic import NodeKind, forward_id  # noqa: E402
from shardflow.lower.program import Buffer, Comm, Compute  # noqa: E402
from shardflow.lower.shard_expansion import in_group, piece  # noqa: E402
from shardflow.parallel.collectives import bound_bytes  # noqa: E402
from shardflow.parallel.mesh import Mesh, Replicate, Shard, SubMesh  # noqa: E402
from shardflow.parallel.pcg import Annotations, build_pcg  # noqa: E402
from shardflow.parallel.sharding import Sharding  # noqa: E402
from shardflow.reference import weights_of  # noqa: E402
from shardflow.runtime.buffers import Kept  # noqa: E402
from shardflow.runtime.comms import issue  # noqa: E402
from shardflow.runtime.distributed import DistributedExecutor, init_from_env, shutdown  # noqa: E402
from shardflow.runtime.kernels import OptimizerConfig  # noqa: E402
from shardflow.runtime.local import LocalExecutor  # noqa: E402
from shardflow.strategy import make_plan, resolve  # noqa: E402

TIMEOUT_S = 300.0
UPDATES = "kernel: UPD every update (one call)"  # the timer of the optimizer updates (one kernel per run of them)
warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated.*", category=FutureWarning)


def shardflow_executor(
    graph,
    mesh_text: str,
    strategy: str | None,
    cfg: OptimizerConfig,
    rank: int,
    annotations: Annotations | None = None,
    options: LowerOptions | None = None,
):
    mesh = Mesh.parse(mesh_text)
    ann = annotations if annotations is not None else resolve(make_plan(graph, mesh, strategy), graph, mesh)
    step = lower_step(build_pcg(graph, mesh, ann), cfg.slots, ranks=[rank], options=options)
    return DistributedExecutor(step, cfg, timeout_s=TIMEOUT_S)


def measured_peak(step, cfg: OptimizerConfig, ex: DistributedExecutor, batch: dict) -> int:
    """This rank's peak of live buffers (bytes) over two steps of ``step``, run by an executor that counts them
    (``memory=True``) on ``ex``'s weights: the timed executors do no accounting."""
    counted = DistributedExecutor(step, cfg, timeout_s=TIMEOUT_S, share=ex, memory=True)
    for _ in range(2):
        counted.step(batch)
    return counted.peak_bytes


def program_size(ex: DistributedExecutor) -> dict[str, int]:
    p = ex.program
    return {"instrs": len(p.instrs), "comms": len(p.comms), "computes": sum(isinstance(i, Compute) for i in p.instrs)}


# ==========================================================================================================
# (a) Megatron MLP
# ==========================================================================================================
class MegatronMLP(nn.Module):
    """h → 4h → GELU → h, mean cross-entropy against ``y`` (class ids in [0, h))."""

    def __init__(self, h: int):
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x))), y)


class HandTP:
    """Megatron tensor parallelism by hand on plain tensors: rank r holds rows r of fc1 (column shard of W1 and
    b1) and the matching columns of fc2 (row shard of W2); fc2's partial output is all-reduced (forward). The
    input x needs no gradient, so the backward has no communication. Forward, backward and the SGD update are
    written out with torch ops (no autograd)."""

    def __init__(self, model: MegatronMLP, rank: int, world: int, lr: float):
        h4 = model.fc1.out_features
        s = slice(rank * h4 // world, (rank + 1) * h4 // world)
        self.w1 = model.fc1.weight.detach()[s].clone()  # [4h/d, h]
        self.b1 = model.fc1.bias.detach()[s].clone()  # [4h/d]
        self.w2 = model.fc2.weight.detach()[:, s].contiguous()  # [h, 4h/d]
        self.b2 = model.fc2.bias.detach().clone()  # [h]
        self.lr = lr

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        z = torch.addmm(self.b1, x, self.w1.t())  # [B, 4h/d]
        a = F.gelu(z)
        out = a @ self.w2.t()  # [B, h], partial sum over ranks
        dist.all_reduce(out)
        out += self.b2
        logp = out.log_softmax(1)
        rows = torch.arange(x.shape[0])
        loss = -logp[rows, y].mean()
        dout = logp.exp_()  # softmax
        dout[rows, y] -= 1
        dout /= x.shape[0]
        dw2 = dout.t() @ a
        db2 = dout.sum(0)
        dz = torch.ops.aten.gelu_backward(dout @ self.w2, z)
        dw1 = dz.t() @ x
        db1 = dz.sum(0)
        for w, g in ((self.w1, dw1), (self.b1, db1), (self.w2, dw2), (self.b2, db2)):
            w.add_(g, alpha=-self.lr)
        return loss.item()


def torch_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: dict) -> Callable:
    def step() -> float:
        opt.zero_grad(set_to_none=True)
        out = model(**inputs)
        loss = out if isinstance(out, torch.Tensor) else out.loss  # a Hugging Face model returns its output
        loss.backward()
        opt.step()
        return loss.item()

    return step


def dtensor_mlp(model: MegatronMLP, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    m = copy.deepcopy(model)
    parallelize_module(m, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return m


def first_losses(variants: list[Variant], n: int, rank: int) -> dict[str, list[float]]:
    """The losses of each variant's first ``n`` steps from the same weights (a check that they compute the
    same thing; these steps are also the first warm-up). Solo variants run on rank 0 only."""
    out = {}
    for v in variants:
        dist.barrier()
        if v.solo and rank != 0:
            continue
        if v.solo:
            torch.set_num_threads(v.threads)
        out[v.name] = [float(v.step()) for _ in range(n)]
        if v.solo:
            torch.set_num_threads(1)
    dist.barrier()
    return out


def run_mlp(p: dict, rank: int, world: int) -> dict:
    results = []
    lr = 1e-3
    for h, rounds, iters in p["sizes"]:
        torch.manual_seed(0)
        model = MegatronMLP(h)
        gen = torch.Generator().manual_seed(1)
        inputs = {
            "x": torch.randn(p["batch"], h, generator=gen),
            "y": torch.randint(0, h, (p["batch"],), generator=gen),
        }
        say(rank, f"(a) h={h}: building the variants")
        graph = capture(model, inputs)
        cfg = OptimizerConfig("sgd", lr)
        ex = shardflow_executor(graph, f"tp={world}", "tp", cfg, rank)
        ex.load(weights_of(model, graph))
        dt = dtensor_mlp(model, world)
        dt_opt = torch.optim.SGD(dt.parameters(), lr=lr)
        hand = HandTP(model, rank, world, lr)
        variants = [
            Variant("shardflow", lambda ex=ex: ex.step(inputs)),  # bound now: deleted after the size
            Variant("dtensor", torch_step(dt, dt_opt, inputs)),
            Variant("hand", lambda hand=hand: hand.step(**inputs)),
        ]
        if rank == 0:
            one = model
            one_opt = torch.optim.SGD(one.parameters(), lr=lr)
            one_step = torch_step(one, one_opt, inputs)
        else:
            one_step = None
        variants.append(Variant("one_process", lambda: one_step(), solo=True))
        variants.append(Variant("one_process_1t", lambda: one_step(), solo=True, threads=1))
        losses = first_losses(variants, 2, rank)
        say(rank, f"(a) h={h}: first losses " + ", ".join(f"{k} {v[0]:.6f}/{v[1]:.6f}" for k, v in losses.items()))
        samples = interleave(variants, rounds, iters, p["warmup"], rank, log=lambda s: say(rank, s))
        results.append(
            {
                "h": h,
                "batch": p["batch"],
                "rounds": rounds,
                "iters": iters,
                "losses": losses,
                "samples": samples,
                "stats": {k: stats(v) for k, v in samples.items()},
                "program": program_size(ex),
            }
        )
        del ex, dt, dt_opt, hand, variants, model
    return {"rows": results}


# ==========================================================================================================
# (b) GPT tokens/s, (e) memory
# ==========================================================================================================
def _attn_forward_local_heads(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward for tensor parallelism with local tensors (as torchtitan writes its attention):
    the number of heads is taken from the local q/k/v width (``-1``), not from the module's ``n_head``."""
    B, T, _ = x.size()
    D = self.head_dim
    q = self.q(x).view(B, T, -1, D).transpose(1, 2)
    k = self.k(x).view(B, T, -1, D).transpose(1, 2)
    v = self.v(x).view(B, T, -1, D).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, -1)
    return self.resid_dropout(self.c_proj(y))


def dtensor_gpt(model: nn.Module, world: int) -> nn.Module:
    """torchtitan-style plan: q, k, v and c_fc column-parallel, both c_proj row-parallel (a Hugging Face Llama: q, k,
    v, gate and up column-parallel, o and down row-parallel); the rest replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    m = copy.deepcopy(model)
    plan = {}
    if hasattr(m, "model"):  # a Hugging Face Llama: its attention already views q, k, v with -1 heads
        for i in range(len(m.model.layers)):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(m, mesh, plan)
        return m
    for i, block in enumerate(m.transformer.h):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.c_fc"):
            plan[f"transformer.h.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.c_proj", "mlp.c_proj"):
            plan[f"transformer.h.{i}.{name}"] = RowwiseParallel()
        attn = block.attn
        attn.head_dim = model.config.n_embd // model.config.n_head
        attn.forward = types.MethodType(_attn_forward_local_heads, attn)
    parallelize_module(m, mesh, plan)
    return m


class _CopyToTP(torch.autograd.Function):
    """Megatron-LM's f: identity forward; the gradient all-reduced over the tp ranks (each rank's column shards
    give a partial input gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """Megatron-LM's g: the row shards' partial outputs all-reduced forward; identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def megatron_llama(model: nn.Module, rank: int, world: int) -> nn.Module:
    """A Hugging Face Llama under tensor parallelism written by hand as Megatron-LM writes it, on plain tensors: each
    rank keeps its rows of q, k, v, gate and up (column-parallel) and its columns of o and down (row-parallel) as
    ordinary ``nn.Linear`` weights; f (:class:`_CopyToTP`) on the input of attention and MLP, g
    (:class:`_ReduceFromTP`) on the outputs of o and down: two all-reduces per layer each way, no DTensor. The
    attention views q, k, v with the local head count (the model's ``-1``); the rest is replicated."""
    m = copy.deepcopy(model)

    def cut(lin: nn.Linear, dim: int) -> None:
        n = lin.weight.shape[dim]
        lin.weight = nn.Parameter(lin.weight.detach().narrow(dim, rank * n // world, n // world).clone())

    def f_on_input(module, args, kwargs):
        if args:
            return (_CopyToTP.apply(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _CopyToTP.apply(kwargs["hidden_states"])}

    for layer in m.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj):
            cut(lin, 0)
        for lin in (a.o_proj, mlp.down_proj):
            cut(lin, 1)
            lin.register_forward_hook(lambda mod, args, out: _ReduceFromTP.apply(out))
        a.register_forward_pre_hook(f_on_input, with_kwargs=True)
        mlp.register_forward_pre_hook(f_on_input, with_kwargs=True)
    return m


def adamw(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def _state_parts(dg) -> dict[str, tuple[str, ...]]:
    """The values a step keeps, by kind: the weights, the gradients the updates read (the executor keeps them)
    and the optimizer state."""
    return {
        "params": tuple(forward_id(w) for w in dg.pcg.graph.weights),
        "grads": tuple(n.inputs[1] for n in dg.nodes if n.kind == NodeKind.UPDATE),
        "optimizer": dg.state_values(),
    }


def state_bytes(dg, rank: int) -> dict[str, int]:
    """This rank's bytes of parameters, gradients (those the updates read) and optimizer state, from the plan
    (piece sizes)."""

    def total(vids) -> int:
        return sum(piece(dg.values[v]).type.nbytes for v in vids if in_group(dg.values[v].group, rank))

    return {k: total(vids) for k, vids in _state_parts(dg).items()}


def run_gpt(p: dict, rank: int, world: int) -> dict:

    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import setup

    base = TrainConfig()
    out: dict = {}
    s_tp = setup(dataclasses.replace(base, strategy="tp", mesh=f"tp={world}", nproc=world), world)
    cfg = s_tp.optimizer
    model = s_tp.whole_model()
    batch = s_tp.batch("train", 0)  # the model's inputs (token ids, labels) of the run's first batch
    c = model.config
    out["model"] = {
        "params": sum(q.numel() for q in model.parameters()),
        "vocab": c.vocab_size,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "embd": c.hidden_size,
        "seq_len": base.seq_len,
        "batch": base.batch_size,
        "optimizer": dataclasses.asdict(cfg),
    }
    step_tp = lower_step(s_tp.pcg, cfg.slots, ranks=[rank])
    ex_tp = DistributedExecutor(step_tp, cfg, timeout_s=TIMEOUT_S)
    ex_tp.load(weights_of(model, s_tp.graph))
    blocking = LowerOptions("collective", "collective", overlap=False)  # every backward all-reduce waited at once
    ex_tp_blocking = DistributedExecutor(
        lower_step(s_tp.pcg, cfg.slots, ranks=[rank], options=blocking), cfg, timeout_s=TIMEOUT_S
    )
    ex_tp_blocking.load(weights_of(model, s_tp.graph))
    out["program_tp"] = program_size(ex_tp)
    if p.get("timing", True):
        s_dp = setup(dataclasses.replace(base, strategy="dp", mesh=f"dp={world}", nproc=world), world)
        step_dp = lower_step(s_dp.pcg, cfg.slots, ranks=[rank])
        ex_dp = DistributedExecutor(step_dp, cfg, timeout_s=TIMEOUT_S)
        ex_dp.load(s_dp.initial_weights())
        out["program_dp"] = program_size(ex_dp)
        ex_dp0 = DistributedExecutor(
            lower_step(
                s_dp.pcg, cfg.slots, ranks=[rank], options=LowerOptions("collective", "collective", bucket_bytes=0)
            ),
            cfg,
            timeout_s=TIMEOUT_S,
        )
        ex_dp0.load(s_dp.initial_weights())
        out["program_dp0"] = program_size(ex_dp0)
        ex_dp1 = DistributedExecutor(
            lower_step(
                s_dp.pcg,
                cfg.slots,
                ranks=[rank],  # DDP's first bucket's size
                options=LowerOptions(bucket_bytes=dist._DEFAULT_FIRST_BUCKET_BYTES),
            ),
            cfg,
            timeout_s=TIMEOUT_S,
        )
        ex_dp1.load(s_dp.initial_weights())
        out["program_dp1"] = program_size(ex_dp1)
        dt = dtensor_gpt(model, world)
        dt_opt = adamw(dt.parameters(), cfg)
        meg = megatron_llama(model, rank, world)
        meg_opt = adamw(meg.parameters(), cfg)
        ddp = DDP(copy.deepcopy(model))
        ddp_opt = adamw(ddp.parameters(), cfg)
        per = base.batch_size // world
        local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
        variants = [
            Variant("shardflow_tp", lambda: ex_tp.step(batch)),
            Variant("shardflow_tp_blocking", lambda: ex_tp_blocking.step(batch)),
            Variant("dtensor_tp", torch_step(dt, dt_opt, batch)),
            Variant("megatron_tp", torch_step(meg, meg_opt, batch)),
            Variant("shardflow_dp", lambda: ex_dp.step(batch)),
            Variant("shardflow_dp_nobucket", lambda: ex_dp0.step(batch)),
            Variant("shardflow_dp_1mib", lambda: ex_dp1.step(batch)),
            Variant("ddp", torch_step(ddp, ddp_opt, local)),
        ]
        if rank == 0:
            one = copy.deepcopy(model)
            one_step = torch_step(one, adamw(one.parameters(), cfg), batch)
        else:
            one_step = None
        variants.append(Variant("one_process", lambda: one_step(), solo=True))
        variants.append(Variant("one_process_1t", lambda: one_step(), solo=True, threads=1))
        losses = first_losses(variants, 2, rank)
        say(
            rank,
            "(b) first losses (ddp: rank 0's half batch) "
            + ", ".join(f"{k} {v[0]:.6f}/{v[1]:.6f}" for k, v in losses.items()),
        )
        samples = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank, log=lambda s: say(rank, s))
        out.update(
            losses=losses,
            samples=samples,
            stats={k: stats(v) for k, v in samples.items()},
            tokens_per_step=base.batch_size * base.seq_len,
            rounds=p["rounds"],
            iters=p["iters"],
        )
        out["comm_share"] = {"tp": comm_share(ex_tp, batch), "dp": comm_share(ex_dp, batch)}
        out["peak_dp"] = measured_peak(step_dp, cfg, ex_dp, batch)
        out["state_dp"] = state_bytes(ex_dp.dg, rank)
    # (e) memory: this rank's peak under tp, and one device (local executor on a 1-device mesh, rank 0)
    mem = {
        "peak_tp": measured_peak(step_tp, cfg, ex_tp, batch),
        "state_tp": state_bytes(ex_tp.dg, rank),
        "state_tp_measured": sum(
            ex_tp.buffers[v].numel() * ex_tp.buffers[v].element_size()
            for v in ex_tp.buffers
            if v in _state_vids(ex_tp.dg)
        ),
    }
    peaks = torch.tensor([mem["peak_tp"]], dtype=torch.float64)
    everyone = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(everyone, peaks)
    mem["peak_tp_per_rank"] = [int(t.item()) for t in everyone]
    if rank == 0:
        one_pcg = build_pcg(s_tp.graph, Mesh(("d",), (1,)))
        one_step = lower_step(one_pcg, cfg.slots)
        lx = LocalExecutor(one_step, cfg, memory=True)
        lx.load(weights_of(model, s_tp.graph))
        for _ in range(2):
            lx.step(batch)
        mem["peak_one"] = lx.peak_bytes[0]
        mem["state_one"] = state_bytes(one_step.dg, 0)
    out["memory"] = mem
    return out


def comm_share(ex: DistributedExecutor, batch: dict, steps: int = 5) -> dict:
    """Per step (ms, this rank, the executor's tracer): the whole step, the time spent in communication
    instructions (issue + wait, so including the wait for the peer), and the part of it in the forward's."""
    from shardflow.runtime.trace import LANES, Tracer

    ex.tracer = Tracer(ex.rank, ex.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        ex.step(batch)
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    forward = {f"#{c.token}" for c in ex.program.comms if c.task == "FWD"}
    events = [e for e in ex.tracer.events if e["tid"] == LANES["communication"]]
    ex.tracer = None
    return {
        "step_ms": step_ms,
        "comm_ms": sum(e["dur"] for e in events) / steps / 1e3,
        "fwd_comm_ms": sum(e["dur"] for e in events if e["name"].split()[0] in forward) / steps / 1e3,
    }


def _state_vids(dg) -> set[str]:
    return {v for vids in _state_parts(dg).values() for v in vids}


# ==========================================================================================================
# (c) collectives
# ==========================================================================================================
def _wait_all(works) -> None:
    for w in works:
        w.wait()


def comm_forms(
    n_bytes: int, rank: int, world: int, own: torch.Tensor | None = None, full: torch.Tensor | None = None
) -> dict[str, tuple[str, Callable[[], torch.Tensor]]]:
    """kind and step of each form, for a full tensor of ``n_bytes`` (float32): what shardflow's executor issues
    for each form (``DistributedExecutor._communicate`` and the ring / broadcast-loop lowering, on dim 0),
    and gloo's built-ins. ``own`` (this rank's chunk, all-gather input) and ``full`` (reduce input) default to
    random data. Each step returns its result."""
    d, p = world, rank
    n = n_bytes // 4
    full = torch.randn(n) if full is None else full
    own = torch.randn(n // d) if own is None else own
    gathered = torch.empty(n)
    mine = torch.empty(n // d)
    summed = torch.zeros(n)  # the in-place all-reduce keeps it zero: no growth to inf over the repetitions

    members = tuple(range(d))
    chunk_t, full_t = TensorType((n // d,), "float32"), TensorType((n,), "float32")
    buf = Buffer("x", chunk_t)

    slots = {form: Kept(torch.device("cpu")) for form in ("ag", "ag_ring", "ag_loop", "rs", "rs_ring", "ar")}

    def run(
        c: Comm, send: torch.Tensor | None, slot: str, alloc: Callable[[tuple[int, ...]], torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """One communication through shardflow's own implementation (:func:`shardflow.runtime.comms.issue`),
        received into a buffer kept from call to call, as the executor's receive slots are (or by ``alloc``)."""
        issued = issue(c, send, p, alloc=alloc or functools.partial(slots[slot], torch.float32))
        _wait_all(issued.handles)
        return issued.result()

    def sf_ag_collective():  # the executor's all-gather
        return run(Comm(0, "all_gather", "FWD", members, chunk_t, 0, dim=0), own, "ag")

    def sf_ag_ring():  # d−1 collective-permute steps into their blocks of one buffer, then own chunk copied in
        out = slots["ag_ring"](torch.float32, (n,))
        for i in range(1, d):
            to, frm = ring_peers(p, i, d)
            run(
                Comm(i, "permute", "FWD", members, chunk_t, 0, peer=to, peer_from=frm, recv=buf, dim=0),
                own,
                "",
                alloc=lambda shape, j=frm: out[j * shape[0] : (j + 1) * shape[0]],
            )
        out[p * own.numel() : (p + 1) * own.numel()].copy_(own)
        return out

    def sf_ag_broadcast_loop():  # d broadcasts, root = step, then the concat compute
        chunks = [
            run(
                Comm(root, "broadcast", "FWD", members, chunk_t, 0, root=root, recv=None if p == root else buf),
                own if p == root else None,
                "ag_loop",
            )
            for root in range(d)
        ]
        return torch.cat([own if x is None else x for x in chunks], 0)

    def sf_rs_collective():  # the executor's reduce-scatter
        return run(Comm(0, "reduce_scatter", "FWD", members, full_t, 0, dim=0), full, "rs")

    def sf_rs_ring():  # chunk compute, then d−1 permute steps each followed by a local add
        parts = [c.contiguous() for c in full.chunk(d, 0)]
        acc = parts[p]
        for i in range(1, d):
            to, frm = ring_peers(p, i, d)
            acc = acc + run(
                Comm(i, "permute", "FWD", members, chunk_t, 0, peer=to, peer_from=frm, recv=buf), parts[to], "rs_ring"
            )
        return acc

    def sf_all_reduce():  # the executor's all-reduce
        return run(Comm(0, "all_reduce", "FWD", members, full_t, 0), full, "ar")

    def gloo_ag():
        dist.all_gather_into_tensor(gathered, own)
        return gathered

    def gloo_rs():
        dist.reduce_scatter_single(mine, full)
        return mine

    def gloo_ar():  # in place, as a user would call it
        dist.all_reduce(summed)
        return summed

    return {
        "ag:shardflow collective": ("all_gather", sf_ag_collective),
        "ag:shardflow ring": ("all_gather", sf_ag_ring),
        "ag:shardflow broadcast_loop": ("all_gather", sf_ag_broadcast_loop),
        "ag:gloo all_gather_into_tensor": ("all_gather", gloo_ag),
        "rs:shardflow collective": ("reduce_scatter", sf_rs_collective),
        "rs:shardflow ring": ("reduce_scatter", sf_rs_ring),
        "rs:gloo reduce_scatter_single": ("reduce_scatter", gloo_rs),
        "ar:shardflow all_reduce": ("all_reduce", sf_all_reduce),
        "ar:gloo all_reduce": ("all_reduce", gloo_ar),
    }


class Loopback:
    """A TCP connection between ranks 0 and 1 on 127.0.0.1 (others idle): the loopback bound."""

    def __init__(self, rank: int, n_bytes: int):
        self.rank, self.n = rank, n_bytes
        self.buf = bytearray(n_bytes)
        self.view = memoryview(self.buf)
        self.out = bytearray(n_bytes)
        port = [0]
        if rank == 0:
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            port = [srv.getsockname()[1]]
        dist.broadcast_object_list(port, src=0)
        if rank == 0:
            self.conn, _ = srv.accept()
            srv.close()
        elif rank == 1:
            self.conn = socket.create_connection(("127.0.0.1", port[0]))
        else:
            self.conn = None
        if self.conn is not None:
            self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _recv_all(self) -> None:
        view, got = memoryview(self.out), 0
        while got < self.n:
            k = self.conn.recv_into(view[got:], min(self.n - got, 1 << 22))
            if k == 0:
                raise ConnectionError("loopback peer closed")
            got += k

    def one_way(self) -> None:
        """Rank 0 sends n bytes; rank 1 receives them and answers one byte."""
        if self.rank == 0:
            self.conn.sendall(self.view)
            self.conn.recv(1)
        elif self.rank == 1:
            self._recv_all()
            self.conn.sendall(b"k")

    def both_ways(self) -> None:
        """Ranks 0 and 1 each send n bytes to the other at the same time."""
        if self.conn is None:
            return
        t = threading.Thread(target=self.conn.sendall, args=(self.view,))
        t.start()
        self._recv_all()
        t.join()


def run_comm(p: dict, rank: int, world: int) -> dict:
    variants: list[Variant] = []
    meta: dict[str, dict] = {}
    for n_bytes in p["sizes"]:
        iters = max(1, min(p["max_iters"], p["bytes_per_sample"] // n_bytes))
        for form, (kind, fn) in comm_forms(n_bytes, rank, world).items():
            name = f"{form}@{n_bytes}"
            variants.append(Variant(name, _repeat(fn, iters)))
            meta[name] = {
                "form": form,
                "kind": kind,
                "bytes": n_bytes,
                "calls_per_step": iters,
                "bound_bytes": bound_bytes(kind, n_bytes // world if kind == "all_gather" else n_bytes, world),
            }
    if p.get("loopback") and world >= 2:
        lb = Loopback(rank, p["loopback"])
        variants += [Variant("loopback one_way", lb.one_way), Variant("loopback both_ways", lb.both_ways)]
        meta["loopback one_way"] = {"bytes": p["loopback"], "calls_per_step": 1}
        meta["loopback both_ways"] = {"bytes": p["loopback"], "calls_per_step": 1}
    # correctness of the forms (all ranks: ones → gathered ones; a reduce-scatter of ones → world)
    samples = interleave(
        variants, p["rounds"], 1, p["warmup"], rank, log=lambda s: say(rank, s.split(":")[0] + ": done")
    )
    for name, s in samples.items():
        k = meta[name]["calls_per_step"]
        samples[name] = [x / k for x in s]
    return {
        "samples": samples,
        "meta": meta,
        "stats": {k: stats(v) for k, v in samples.items()},
        "rounds": p["rounds"],
        "check": _check_forms(rank, world),
    }


def _repeat(fn: Callable, k: int) -> Callable:
    def run():
        for _ in range(k):
            fn()

    return run


def _check_forms(rank: int, world: int) -> dict[str, bool]:
    """Each form's result on known data (rank r contributes r + 1): all-gathers give every rank's chunk in rank
    order, reduce-scatters this rank's block of the sum, all-reduces the sum."""
    n = 64 * world
    own = torch.full((n // world,), float(rank + 1))
    full = torch.arange(n, dtype=torch.float32) * (rank + 1)
    total = torch.arange(n, dtype=torch.float32) * sum(range(1, world + 1))
    want = {
        "all_gather": torch.cat([torch.full((n // world,), float(r + 1)) for r in range(world)]),
        "reduce_scatter": total.chunk(world)[rank],
        "all_reduce": total,
    }
    ok = {}
    for form, (kind, fn) in comm_forms(n * 4, rank, world, own=own, full=full).items():
        if form == "ar:gloo all_reduce":
            continue  # in place on its own buffer: checked through "ar:shardflow all_reduce"'s call
        ok[form] = bool(torch.equal(fn(), want[kind]))
    return ok


# ==========================================================================================================
# (d) sequence-parallel column linear
# ==========================================================================================================
def sp_graph(B: int, T: int, C: int):
    """x [B, T, C] (a trainable leaf, so that it has a gradient) → fc (4C) → tanh → sum."""
    b = GraphBuilder()
    x = b.weight("x", (B, T, C))
    loss = b.sum(b.tanh(b.dense(x, 4 * C, name="fc")))
    return b.build([loss], loss)


def sp_annotations(mesh: Mesh) -> Annotations:
    """x sharded on T (Shard(1)), fc's weight and bias on dim 0 (column parallel); the linear reads x replicated,
    so x is all-gathered forward and its gradient reduce-scattered backward."""
    whole = SubMesh(mesh)
    return Annotations(
        leaves={
            "x": Sharding.from_placements([Shard(1)], whole, 3),
            "fc.weight": Sharding.from_placements([Shard(0)], whole, 2),
            "fc.bias": Sharding.from_placements([Shard(0)], whole, 1),
        },
        edges={("linear", 0): {"tp": Replicate()}},
    )


class ComputeOnly:
    """The same step's local compute with no communication: each rank has the whole x already, computes its
    column block of fc and its tanh-sum, backward by autograd (dx, dW, db), SGD on W and b. A floor."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, rank: int, world: int, lr: float):
        rows = slice(rank * w.shape[0] // world, (rank + 1) * w.shape[0] // world)
        self.x = x.clone().requires_grad_()
        self.w = w[rows].clone().requires_grad_()
        self.b = b[rows].clone().requires_grad_()
        self.lr = lr

    def step(self) -> float:
        loss = torch.tanh(F.linear(self.x, self.w, self.b)).sum()
        dx, dw, db = torch.autograd.grad(loss, (self.x, self.w, self.b))
        with torch.no_grad():
            self.w -= self.lr * dw
            self.b -= self.lr * db
        return loss.item()


def run_sp(p: dict, rank: int, world: int) -> dict:
    return {"rows": [_sp_shape(shape, p, rank, world) for shape in p["shapes"]]}


def _sp_shape(shape: list[int], p: dict, rank: int, world: int) -> dict:
    B, T, C = shape
    lr = 1e-6
    graph = sp_graph(B, T, C)
    mesh = Mesh.parse(f"tp={world}")
    torch.manual_seed(0)
    full = {"x": torch.randn(B, T, C), "fc.weight": torch.randn(4 * C, C) / math.sqrt(C), "fc.bias": torch.zeros(4 * C)}
    cfg = OptimizerConfig("sgd", lr)
    variants, programs, executors = [], {}, {}
    for ag, rs in p["forms"]:
        ex = shardflow_executor(
            graph, f"tp={world}", None, cfg, rank, annotations=sp_annotations(mesh), options=LowerOptions(ag, rs)
        )
        ex.load(full)
        name = f"{ag} / {rs}"
        executors[name] = ex
        variants.append(Variant(name, (lambda e: lambda: e.step({}))(ex)))
        programs[name] = {
            **program_size(ex),
            "comm_kinds": sorted({c.kind for c in ex.program.comms}),
            "comm_bytes": sum(c.nbytes for c in ex.program.comms),
        }
    auto = lower_step(build_pcg(graph, mesh, sp_annotations(mesh)), cfg.slots, ranks=[rank], options=LowerOptions())
    auto_kinds = sorted({(c.task, c.kind) for c in auto.programs[rank].comms})
    floor = ComputeOnly(full["x"], full["fc.weight"], full["fc.bias"], rank, world, lr)
    variants.append(Variant("compute only", floor.step))
    losses = first_losses(variants, 2, rank)
    say(rank, f"(d) {shape}: first losses " + ", ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in losses.items()))
    samples = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank, log=lambda s: say(rank, s))
    # where each form's time goes (timers around kernels and communications, a few steps, after the rounds)
    breakdown = {name: _timed_steps(ex, {}, p["breakdown_steps"]) for name, ex in executors.items()}
    return {
        "shape": shape,
        "samples": samples,
        "stats": {k: stats(v) for k, v in samples.items()},
        "losses": losses,
        "programs": programs,
        "auto": [list(k) for k in auto_kinds],
        "rounds": p["rounds"],
        "iters": p["iters"],
        "breakdown": breakdown,
    }


# ==========================================================================================================
# profile of one shardflow tp=2 step of (a)
# ==========================================================================================================
class Timers:
    def __init__(self):
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[label] = self.s.get(label, 0.0) + time.perf_counter() - t0
                self.n[label] = self.n.get(label, 0) + 1

        return timed


def _classify(key: tuple, name: str) -> str:
    """cProfile entry → comm / torch / python. Built-ins (file ``~``) of torch.distributed or a Work's wait are
    communication; other built-ins of torch are torch ops; everything else (Python code, and built-ins of
    Python itself) is Python overhead."""
    filename = key[0]
    if filename == "~":
        if "_distributed_c10d" in name or "'wait'" in name:
            return "comm"
        if "torch" in name or "Tensor" in name:
            return "torch"
    return "python"


def _mlp_pair(h: int, B: int, rank: int, world: int):
    torch.manual_seed(0)
    model = MegatronMLP(h)
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(B, h, generator=gen), "y": torch.randint(0, h, (B,), generator=gen)}
    graph = capture(model, inputs)
    cfg = OptimizerConfig("sgd", 1e-3)
    ex = shardflow_executor(graph, f"tp={world}", "tp", cfg, rank)
    ex.load(weights_of(model, graph))
    return ex, HandTP(model, rank, world, 1e-3), inputs


def _instrument(ex: DistributedExecutor, timers: Timers, kernels: bool = True) -> Callable[[], None]:
    """Wrap the executor's kernels (those of dynamic-graph nodes, per instruction label, wherever the executor
    takes them: a ring's fused linears write into its buffers), ``_communicate``, ``_put`` and ``_get`` with timers
    (instance attributes shadow the methods; the library is not changed). Returns the undo."""
    if kernels:

        def timed(instr):
            k = DistributedExecutor._kernel(ex, instr)
            return timers.wrap(f"kernel: {instr.task} {instr.op.split('(')[0]}", k) if instr.dnode else k

        ex._kernel = timed
        ex._update_kernel = lambda us: timers.wrap(UPDATES, DistributedExecutor._update_kernel(ex, us))
        ex.compiled.clear()  # segments bind their kernels when compiled: compile again with the timed ones
    ex._communicate = timers.wrap("communication (issue + wait)", ex._communicate)
    ex._put = timers.wrap("input placement (_put)", ex._put)
    ex._get = timers.wrap("loss read-back (_get: an all-reduce)", ex._get)

    def undo() -> None:
        ex.compiled.clear()
        for attr in ("_communicate", "_put", "_get", *(("_kernel", "_update_kernel") if kernels else ())):
            delattr(ex, attr)

    return undo


def _timed_steps(ex: DistributedExecutor, inputs: dict, n: int) -> dict:
    timers = Timers()
    undo = _instrument(ex, timers)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        ex.step(inputs)
    total = time.perf_counter() - t0
    undo()
    return {"steps": n, "total_s": total, "sum_s": timers.s, "calls": timers.n}


def run_profile(p: dict, rank: int, world: int) -> dict:
    B, n = p["batch"], p["steps"]
    out: dict = {"batch": B}
    for h in (p["h"], p["tiny_h"]):
        ex, hand, inputs = _mlp_pair(h, B, rank, world)
        variants = [
            Variant("shardflow", lambda ex=ex: ex.step(inputs)),  # bound now: deleted after the size
            Variant("hand", lambda hand=hand: hand.step(**inputs)),
        ]
        iters = p["iters"] if h == p["h"] else p["iters"] * 10
        samples = interleave(variants, p["rounds"], iters, p["warmup"], rank)
        r: dict = {
            "h": h,
            "samples": samples,
            "stats": {k: stats(v) for k, v in samples.items()},
            "program": program_size(ex),
            "iters": iters,
        }
        k = n if h == p["h"] else n * 10
        # 1. timers around every kernel, communication, input placement and loss read-back
        r["timers"] = _timed_steps(ex, inputs, k)
        # 2. torch.profiler (ATen self time) with timers on the communication calls in the same run
        r["aten"] = {
            "shardflow": _aten_profile(ex, lambda ex=ex: ex.step(inputs), k, rank),
            "hand": _aten_profile(None, lambda hand=hand: hand.step(**inputs), k, rank),
        }
        if h == p["h"]:
            out["listing"] = [str(i).strip() for i in ex.program.instrs]
            r["cprofile"] = _cprofile(lambda ex=ex: ex.step(inputs), n, rank)
        out[f"h{h}" if h != p["h"] else "main"] = r
        del ex, hand, variants
    return out


def _cprofile(fn: Callable, n: int, rank: int) -> dict | None:
    """cProfile of ``n`` steps on rank 0 (the other ranks run the same steps unprofiled)."""
    dist.barrier()
    prof = cProfile.Profile()
    if rank == 0:
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    wall = time.perf_counter() - t0
    if rank != 0:
        return None
    prof.disable()
    st = pstats.Stats(prof)
    cats = {"comm": 0.0, "torch": 0.0, "python": 0.0}
    rows = []
    for key, (cc, nc, tt, ct, _) in st.stats.items():
        name = pstats.func_std_string(key)
        cat = _classify(key, name)
        cats[cat] += tt
        rows.append((tt, ct, nc, cat, name.replace(str(ROOT) + "/", "").split("site-packages/")[-1]))
    rows.sort(reverse=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    return {
        "steps": n,
        "wall_s": wall,
        "categories_s": cats,
        "top_tottime": [list(r) for r in rows[:25]],
        "cumulative_text": text.getvalue(),
    }


def _aten_profile(ex: DistributedExecutor | None, fn: Callable, n: int, rank: int) -> dict | None:
    """Per ATen op: calls and self CPU seconds over ``n`` steps of ``fn`` (rank 0 profiles, the others run the
    same steps), the wall time, and (with ``ex``) the time in the executor's communication calls."""
    from torch.profiler import ProfilerActivity, profile

    timers = Timers()
    undo = _instrument(ex, timers, kernels=False) if ex is not None else None
    dist.barrier()
    if rank != 0:
        for _ in range(n):
            fn()
        if undo:
            undo()
        return None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        wall = time.perf_counter() - t0
    if undo:
        undo()
    ops = {}
    for e in prof.key_averages():
        ops[e.key] = {"calls": e.count, "self_s": e.self_cpu_time_total / 1e6}
    return {
        "steps": n,
        "wall_s": wall,
        "timers_s": timers.s,
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["self_s"])),
    }


# ==========================================================================================================
# main
# ==========================================================================================================
def peak_extra_bytes(fn: Callable[[], object]) -> dict[str, int]:
    """What ``fn()`` allocates at its peak beyond what was live before it (bytes): ``tensors`` — torch's CPU
    allocator (torch.profiler's memory records, in time order, summed: + allocations, − frees) — and ``python`` —
    Python's heap (tracemalloc: e.g. the bytes DCP pickles, the blocks a file's sha256 is read in); the peaks need
    not coincide, so their sum bounds the whole from above."""
    import tracemalloc

    from torch.profiler import ProfilerActivity, profile

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    python = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    live = peak = 0
    for _, n in sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ):  # every allocation (+) and free (−), whatever op made it
        live += n
        peak = max(peak, live)
    return {"tensors": peak, "python": python}


def run_ckpt(p: dict, rank: int, world: int) -> dict:
    """(f) The default GPT under tp (AdamW, 2 steps), saved: by ``checkpoint.Saver`` (each rank writes replica 0
    of its pieces) and, as before sharded checkpoints, by gathering the full weights and optimizer state on every
    rank (the executor's collective ``weights()`` / ``state()``) and handing them to ``dcp.save``. Each variant is
    saved once to warm up, then measured (:func:`peak_extra_bytes`) on its second save."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    from shardflow.train import checkpoint
    from shardflow.train.config import TrainConfig
    from shardflow.train.data import Split
    from shardflow.train.recipe import setup

    base = TrainConfig()
    s = setup(dataclasses.replace(base, strategy="tp", mesh=f"tp={world}", nproc=world), world)
    cfg = s.optimizer
    ex = DistributedExecutor(lower_step(s.pcg, cfg.slots, ranks=[rank]), cfg, timeout_s=TIMEOUT_S)
    ex.load(weights_of(s.model, s.graph))
    for step in range(2):
        ex.step(s.batch(Split.TRAIN, step))
    box = [tempfile.mkdtemp(prefix="ckpt-bench-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = Path(box[0])
    saver = checkpoint.Saver(root / "sharded", rank, world, s.checkpoint_meta(world), fresh=True)
    (root / "sharded").mkdir(exist_ok=True)

    def full_save(step: int) -> None:
        sd = {f"model/{k}": v for k, v in ex.weights().items()} | {f"optim/{k}": v for k, v in ex.state().items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(root / f"full_{step}", sync_files=True))

    out: dict = {"params": sum(q.numel() for q in s.model.parameters()), "state": state_bytes(ex.dg, rank)}
    variants = {"sharded": lambda step: saver.save(ex, step), "full": full_save}
    for name, save in variants.items():
        save(1)
        dist.barrier()
        out[name] = peak_extra_bytes(lambda: save(2))
        dist.barrier()
    files = {}
    for name, d in (("sharded", root / "sharded" / "step_2"), ("full", root / "full_2")):
        files[name] = {f.name: f.stat().st_size for f in sorted(d.iterdir()) if f.suffix == ".distcp"}
    out["files"] = files
    everyone: list = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return {"model_params": out["params"], "ranks": everyone}


def run_fsdp(p: dict, rank: int, world: int) -> dict:
    """(g) The training job's default model (the Llama) under shardflow's fsdp (``DistributedExecutor``, the plan
    ``shardflow train --strategy fsdp`` lowers: resharding after the forward) against PyTorch FSDP2 (``fully_shard``
    on every decoder layer and on the root, ``reshard_after_forward=True``), same weights, AdamW, the same batch
    split over the ranks; interleaved rounds."""

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardflow.train.config import TrainConfig
    from shardflow.train.data import Split
    from shardflow.train.recipe import setup

    base = dataclasses.replace(TrainConfig(), strategy="fsdp", mesh=f"fsdp={world}", nproc=world)
    s = setup(base, world)
    cfg = s.optimizer
    ex = DistributedExecutor(
        lower_step(s.pcg, cfg.slots, ranks=[rank], options=s.pipeline.options), cfg, timeout_s=TIMEOUT_S
    )
    ex.load(s.initial_weights())
    model = s.whole_model()
    batch = s.batch(Split.TRAIN, 0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model.parameters(), cfg)
    per = base.batch_size // world
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}

    def fsdp2() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(**local).loss
        loss.backward()
        opt.step()
        return loss.item()

    variants = [Variant("shardflow_fsdp", lambda: ex.step(batch)), Variant("fsdp2", fsdp2)]
    losses = first_losses(variants, 2, rank)
    say(
        rank,
        "(g) first losses (fsdp2: this rank's half batch) "
        + ", ".join(f"{k} {v[0]:.6f}/{v[1]:.6f}" for k, v in losses.items()),
    )
    samples = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank, log=lambda x: say(rank, x))
    return {
        "losses": losses,
        "samples": samples,
        "stats": {k: stats(v) for k, v in samples.items()},
        "tokens_per_step": base.batch_size * base.seq_len,
        "rounds": p["rounds"],
        "iters": p["iters"],
        "program": program_size(ex),
        "params": sum(q.numel() for q in s.model.parameters()),
        "comm_share": comm_share(ex, batch),
    }


def _pipeline_stage_module(model: nn.Module, chunk: int, chunks: int) -> nn.Module:
    """Chunk ``chunk`` of ``chunks`` of shardflow's MLP as torch.distributed.pipelining takes it: its range of
    linear layers (the ranges the ``pp`` preset cuts equal layers into) with the ReLUs between them (the loss is the
    schedule's)."""
    layers = list(model.layers)
    cut = [i * chunks // len(layers) for i in range(len(layers))]
    mods: list[nn.Module] = []
    for i, layer in enumerate(layers):
        if cut[i] == chunk:
            mods.append(layer)
            if i < len(layers) - 1:
                mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _blocked_share(ex: DistributedExecutor, batch: dict, steps: int) -> dict:
    """This rank's time per step blocked on another stage (its waits and blocking communications, the tracer's
    communication lane) and in its computes, over ``steps`` traced steps back to back (seconds per step)."""
    from shardflow.runtime import trace

    ex.tracer = trace.Tracer(dist.get_rank(), ex.device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        ex.step(batch)
    wall = (time.perf_counter() - t0) / steps
    events, ex.tracer = ex.tracer.events, None
    blocked, _ = trace.blocked({0: events})[0]
    computing = sum(e["dur"] for e in events if e["tid"] == trace.LANES["compute"]) / 1e6
    return {"step_s": wall, "compute_s": computing / steps, "blocked_s": blocked / steps}


def run_pipeline(p: dict, rank: int, world: int) -> dict:
    """(q) Pipeline parallelism with microbatches: an MLP of ``layers`` linear layers of width ``width`` cut into
    ``world`` stages, ``microbatches`` microbatches of a batch of ``batch`` rows, SGD. shardflow 1F1B, GPipe and
    interleaved 1F1B with 2 chunks per stage (``--microbatches``, ``DistributedExecutor``) against
    torch.distributed.pipelining's ``Schedule1F1B``, ``ScheduleGPipe`` and ``ScheduleInterleaved1F1B`` on the same
    stages, weights and batch; interleaved rounds. Then each shardflow stage's time
    blocked on the other stage (its measured bubble), and each stage's peak of live buffers under both schedules
    (local executor's ledger, rank 0)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from shardflow.models import MLP

    W, L, B, M = p["width"], p["layers"], p["batch"], p["microbatches"]
    torch.manual_seed(0)
    model = MLP(d_in=W, hidden=W, d_out=W, n_layers=L)
    cfg = OptimizerConfig("sgd", lr=1e-3)
    micro = capture(model, {"x": torch.zeros(B // M, W), "y": torch.zeros(B // M, dtype=torch.long)})
    mesh = Mesh.parse(f"pp={world}")
    pcgs = {v: build_pcg(micro, mesh, resolve(make_plan(micro, mesh, "pp", v), micro, mesh)) for v in (1, 2)}
    pcg = pcgs[1]
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(B, W, generator=gen), "y": torch.randint(0, W, (B,), generator=gen)}
    ours, programs = {}, {}
    for kind in ("1f1b", "gpipe", "interleaved"):
        step = lower_step(
            pcgs[2 if kind == "interleaved" else 1],
            "sgd",
            ranks=[rank],
            options=LowerOptions(microbatches=M, schedule=kind),
        )
        ours[kind] = DistributedExecutor(step, cfg, timeout_s=TIMEOUT_S)
        ours[kind].load(weights)
        programs[kind] = program_size(ours[kind])

    def torch_variant(schedule_cls, v: int = 1) -> Callable[[], float]:
        chunks = [rank + k * world for k in range(v)]  # chunk c on rank c mod p
        mods = [copy.deepcopy(_pipeline_stage_module(model, c, world * v)) for c in chunks]
        stages = [PipelineStage(m, c, world * v, torch.device("cpu")) for m, c in zip(mods, chunks)]
        sched = schedule_cls(
            stages if v > 1 else stages[0], n_microbatches=M, loss_fn=lambda out, y: F.cross_entropy(out, y)
        )
        opt = torch.optim.SGD([q for m in mods for q in m.parameters()], lr=cfg.lr)

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            losses: list = []
            if rank == 0:
                sched.step(batch["x"])
            elif rank == world - 1:
                sched.step(target=batch["y"], losses=losses)
            else:
                sched.step()
            opt.step()
            return float(sum(losses) / len(losses)) if losses else math.nan

        return step

    variants = [
        Variant("shardflow_1f1b", lambda: ours["1f1b"].step(batch)),
        Variant("shardflow_gpipe", lambda: ours["gpipe"].step(batch)),
        Variant("shardflow_interleaved", lambda: ours["interleaved"].step(batch)),
        Variant("torch_1f1b", torch_variant(Schedule1F1B)),
        Variant("torch_gpipe", torch_variant(ScheduleGPipe)),
        Variant("torch_interleaved", torch_variant(ScheduleInterleaved1F1B, 2)),
    ]
    losses: list = [None] * world  # torch's losses are the last stage's
    dist.all_gather_object(losses, first_losses(variants, 2, rank))
    samples = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank, log=lambda x: say(rank, x))
    blocked = {kind: _blocked_share(ex, batch, p["traced_steps"]) for kind, ex in ours.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, blocked)
    out = {
        "losses": {k: v if k.startswith("shardflow") else losses[-1][k] for k, v in losses[0].items()},
        "samples": samples,
        "stats": {k: stats(v) for k, v in samples.items()},
        "rounds": p["rounds"],
        "iters": p["iters"],
        "programs": programs,
        "blocked": everyone,
        "traced_steps": p["traced_steps"],
        "params": sum(q.numel() for q in model.parameters()),
        "model": {k: p[k] for k in ("width", "layers", "batch", "microbatches")},
    }
    if rank == 0:  # each stage's peak of live buffers, both schedules (every rank in this process: the ledger)
        peaks = {}
        for kind in ("1f1b", "gpipe"):
            lx = LocalExecutor(
                lower_step(pcg, "sgd", options=LowerOptions(microbatches=M, schedule=kind)), cfg, memory=True
            )
            lx.load(weights)
            lx.step(batch)
            peaks[kind] = lx.peak_bytes
        out.update(peaks=peaks, activation_bytes=B // M * W * 4)
    return out


def run_chunked(p: dict, rank: int, world: int) -> dict:
    """(t) The forward of a tensor-parallel block at the main job's shape under tp=2: a row-parallel matmul
    (tokens × k/world → tokens × n), the all-reduce of its partial sum, and a matmul that reads the sum (n → m).
    ``whole``: the all-reduce waited at once (shardflow's, Megatron's, DTensor's forward). ``chunks=c``: the rows cut
    in c chunks, each chunk's all-reduce issued without waiting right after its matmul and waited before the next
    matmul reads it, so it travels while the later chunks compute (async tensor parallelism's decomposition)."""
    gen = torch.Generator().manual_seed(rank)
    tokens, k, n, m = p["tokens"], p["k"], p["n"], p["m"]
    x, w = torch.randn(tokens, k // world, generator=gen), torch.randn(n, k // world, generator=gen)
    w_next = torch.randn(m, n, generator=gen)

    def whole() -> torch.Tensor:
        y = x @ w.t()
        dist.all_reduce(y)
        return y @ w_next.t()

    def chunked(c: int) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            parts, works = [], []
            for xc in x.chunk(c):
                parts.append(xc @ w.t())
                works.append(dist.all_reduce(parts[-1], async_op=True))
            outs = []
            for y, work in zip(parts, works):
                work.wait()
                outs.append(y @ w_next.t())
            return torch.cat(outs)

        return step

    variants = [Variant("whole", whole)] + [Variant(f"chunks={c}", chunked(c)) for c in p["chunks"]]
    ref = whole()
    worst = max(float((v.step() - ref).abs().max()) for v in variants[1:])
    samples = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank)
    return {"samples": samples, "worst": worst}


def run_vocab(p: dict, rank: int, world: int) -> dict:
    """(v) The main job's model at ``shardflow train``'s defaults under tp, at each vocabulary size of
    ``p["vocab_sizes"]`` (None: the default): the preset (vocabulary-parallel embedding, head and loss) against the
    same Megatron pairs with the embedding and the head replicated. Per plan: this rank's parameters + gradients +
    optimizer state, the bytes its communications send in one step, and the step time (interleaved rounds); the
    first losses of both from the same weights."""

    from shardflow.strategy.presets import tensor_parallel
    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import setup

    out: dict = {}
    for vocab in p["vocab_sizes"]:
        base = TrainConfig() if vocab is None else TrainConfig(vocab_size=vocab)
        cfg = dataclasses.replace(base, strategy="tp", mesh=f"tp={world}", nproc=world)
        s = setup(cfg, world)
        mesh = Mesh.parse(f"tp={world}")
        plans = {
            "vocabulary": s.pcg,
            "replicated": build_pcg(
                s.graph, mesh, resolve(tensor_parallel(s.graph, world, vocabulary=False), s.graph, mesh)
            ),
        }
        weights, batch = s.initial_weights(), s.batch("train", 0)
        res: dict = {"params": sum(q.numel() for q in s.model.parameters()), "vocab": s.model.config.vocab_size}
        executors = {}
        for name, pcg in plans.items():
            step = lower_step(pcg, s.optimizer.slots, ranks=[rank])
            ex = DistributedExecutor(step, s.optimizer, timeout_s=TIMEOUT_S)
            ex.load(weights)
            executors[name] = ex
            res[name] = {
                "state": state_bytes(step.dg, rank),
                "comm_bytes": sum(c.nbytes for c in ex.program.comms),
                "comms": len(ex.program.comms),
            }
        one = lower_step(build_pcg(s.graph, Mesh.parse("d=1")), s.optimizer.slots).dg
        res["one_device_state"] = state_bytes(one, 0)
        variants = [Variant(name, functools.partial(ex.step, batch)) for name, ex in executors.items()]
        res["losses"] = first_losses(variants, 2, rank)
        res["samples"] = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank)
        out[str(res["vocab"])] = res
    return {"sizes": out}


# ==========================================================================================================
# (m) mixtures of experts: expert parallelism
# ==========================================================================================================
class HandExperts(nn.Module):
    """Expert parallelism written by hand, as torchtitan and Megatron-LM's all-to-all dispatcher write it, around
    the same expert MLPs as Hugging Face's ``MixtralExperts``: rank r holds experts [r·E/w, (r+1)·E/w); the token-
    expert pairs of this rank's tokens are sorted by expert, sent to their experts' ranks by ``all_to_all_single``
    (the split sizes exchanged first by a fixed-size all-to-all of counts), computed there expert by expert, sent
    back the same way, weighted and summed per token. ``sent`` counts the bytes this rank sends to other ranks
    (forward; the backward sends as much again)."""

    def __init__(self, experts: nn.Module, rank: int, world: int):
        super().__init__()
        self.e_local = experts.gate_up_proj.shape[0] // world
        block = slice(rank * self.e_local, (rank + 1) * self.e_local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[block].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[block].clone())
        self.act, self.rank, self.world, self.sent = experts.act_fn, rank, world, 0

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        n, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        expert = flat[order]
        send = torch.bincount(expert // self.e_local, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # the split sizes, a fixed-size all-to-all
        out_splits, in_splits = send.tolist(), recv.tolist()
        x_sent = all_to_all_single(
            x.new_empty(sum(in_splits), x.shape[1]), x[order // k], in_splits, out_splits
        )  # autograd: the backward sends the gradients back
        e_recv = expert.new_empty(sum(in_splits))
        dist.all_to_all_single(e_recv, expert, in_splits, out_splits)
        e_recv = e_recv - self.rank * self.e_local
        y = torch.zeros_like(x_sent)
        for e in range(self.e_local):
            rows = torch.nonzero(e_recv == e).squeeze(1)
            gate, up = F.linear(x_sent[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = y.index_add(0, rows, F.linear(self.act(gate) * up, self.down_proj[e]))
        back = all_to_all_single(y.new_empty(n * k, x.shape[1]), y, out_splits, in_splits)
        mine = out_splits[self.rank]
        self.sent += (sum(out_splits) - mine) * x.shape[1] * x.element_size() * 2  # tokens there, results back
        self.sent += (self.world - 1) * send.element_size() + (sum(out_splits) - mine) * expert.element_size()
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(weighted).index_copy(0, order, weighted).view(n, k, -1).sum(1)


def run_moe(p: dict, rank: int, world: int) -> dict:
    """(m) A Mixtral-style model (Hugging Face ``MixtralForCausalLM`` from a config, random init, float32, SGD)
    under shardflow's ep — with the all-to-all token dispatcher (the default) and the all-gather one — and dp
    (``DistributedExecutor``) and a hand-written expert-parallel step (:class:`HandExperts` in each layer, the dense
    weights' gradients all-reduced as DDP does), same weights, the same batch split over the ranks; interleaved
    rounds. Bytes each rank sends per step: shardflow's from its program (the all-to-alls of data-dependent sizes at
    their bound, and as measured in the first step: ``Executor.sized_sent``), the hand-written step's counted at its
    calls."""
    import transformers

    from shardflow.reference import weights_of

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**p["config"], use_cache=False)
    model = transformers.MixtralForCausalLM(config)
    batch_size, seq = p["batch"], p["seq"]
    ids = torch.randint(0, config.vocab_size, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    graph = capture(model, batch)
    cfg = OptimizerConfig(lr=p["lr"])
    executors = {}
    for name, strategy, dispatch in (("ep", "ep", "all_to_all"), ("ep_gather", "ep", "all_gather"), ("dp", "dp", "")):
        options = dataclasses.replace(PLAIN, ep_dispatch=EPDispatch(dispatch)) if dispatch else None
        ex = shardflow_executor(graph, f"{strategy}={world}", strategy, cfg, rank, options=options)
        ex.load(weights_of(model, graph))
        executors[name] = ex

    hand = copy.deepcopy(model)
    layers = [layer.mlp for layer in hand.model.layers]
    for mlp in layers:
        mlp.experts = HandExperts(mlp.experts, rank, world)
    experts = {id(q) for mlp in layers for q in mlp.experts.parameters()}
    dense = [q for q in hand.parameters() if id(q) not in experts]
    opt = torch.optim.SGD(hand.parameters(), lr=p["lr"])
    per = batch_size // world
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    dense_bytes = sum(q.numel() * q.element_size() for q in dense)

    def hand_step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = hand(**local).loss
        loss.backward()
        for q in dense:  # DDP's all-reduce of the gradients, averaged over the ranks
            dist.all_reduce(q.grad)
            q.grad /= world
        for mlp in layers:  # each rank's loss is its tokens' mean: the experts' gradient sums every rank's
            for q in mlp.experts.parameters():
                q.grad /= world
        opt.step()
        loss = loss.detach()
        dist.all_reduce(loss)  # the whole batch's loss, as shardflow's step returns it
        return loss.item() / world

    variants = [
        Variant("shardflow_ep", lambda: executors["ep"].step(batch)),
        Variant("shardflow_ep_gather", lambda: executors["ep_gather"].step(batch)),
        Variant("hand_ep", hand_step),
        Variant("shardflow_dp", lambda: executors["dp"].step(batch)),
    ]
    losses = first_losses(variants, 2, rank)
    measured = {}  # the second step's bytes: the dispatcher's all-to-alls as they ran, every other one as counted
    for name, ex in executors.items():
        sized = sum(c.nbytes for c in ex.program.comms if c.splits is not None)
        measured[f"shardflow_{name}"] = sum(c.nbytes for c in ex.program.comms) - sized + ex.sized_sent[rank]
    say(rank, "(m) first losses " + ", ".join(f"{k} {v}" for k, v in losses.items()))
    for mlp in layers:
        mlp.experts.sent = 0
    hand_step()
    sent_hand = sum(mlp.experts.sent for mlp in layers) * 2 + 2 * (world - 1) * dense_bytes // world
    samples = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank, log=lambda x: say(rank, x))
    return {
        "losses": losses,
        "samples": samples,
        "stats": {k: stats(v) for k, v in samples.items()},
        "tokens_per_step": batch_size * seq,
        "rounds": p["rounds"],
        "iters": p["iters"],
        "params": sum(q.numel() for q in model.parameters()),
        "config": p["config"],
        "sent": {
            **{f"shardflow_{k}": sum(c.nbytes for c in ex.program.comms) for k, ex in executors.items()},
            "hand_ep": sent_hand,
        },
        "measured": measured,
        "collectives": {s: sorted({str(c.family) for c in ex.program.comms}) for s, ex in executors.items()},
    }


# ==========================================================================================================
# (x) context parallelism: the attention forms
# ==========================================================================================================
def run_context(p: dict, rank: int, world: int) -> dict:
    """(x) The main job's model at ``shardflow train``'s defaults on one sequence of ``p["seq_len"]`` tokens per step
    under ``--strategy cp`` over every rank, with each attention form of ``p["forms"]`` (``--cp-attention``): the
    step time (interleaved rounds, the same weights and batch), the first losses, the bytes this rank sends per step
    and its peak of live buffers (an executor that counts them, on the same weights)."""

    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import setup

    executors, res = {}, {}
    for variant in p["forms"]:
        form, _, how = variant.partition(":")  # "ring:serial": each permute waited at its issue; "ring:balanced"
        cfg = dataclasses.replace(
            TrainConfig(),
            seq_len=p["seq_len"],
            batch_size=1,
            strategy="cp",
            mesh=f"cp={world}",
            nproc=world,
            cp_attention=form,
            cp_layout="balanced" if how == "balanced" else "contiguous",
        )
        s = setup(cfg, world)
        pipeline = s.pipeline
        if how == "serial":
            pipeline = dataclasses.replace(pipeline, options=dataclasses.replace(pipeline.options, overlap=False))
        step = pipeline.lower((rank,), False, True, None)
        ex = DistributedExecutor(step, s.optimizer, timeout_s=TIMEOUT_S)
        weights, batch = s.initial_weights(), s.batch("train", 0)
        ex.load(weights)
        executors[variant] = (ex, batch)
        res[variant] = {
            "comm_bytes": sum(c.nbytes for c in ex.program.comms),
            "kinds": sorted({str(c.family) for c in ex.program.comms if c.axis == "cp"}),
            "peak": measured_peak(step, s.optimizer, ex, batch),
        }
    variants = [Variant(form, functools.partial(ex.step, batch)) for form, (ex, batch) in executors.items()]
    losses = first_losses(variants, 2, rank)
    samples = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank, log=lambda x: say(rank, x))
    return {"forms": res, "losses": losses, "samples": samples, "stats": {k: stats(v) for k, v in samples.items()}}


# ==========================================================================================================
# (u) uneven shards
# ==========================================================================================================
def run_uneven(p: dict, rank: int, world: int) -> dict:
    """(u) The main job's model at ``shardflow train``'s defaults under dp over ``world`` ranks, at each global batch
    of ``p["batches"]``: one the degree divides and ones it does not (docs/concepts.md#uneven-shards: blocks of
    ⌈B/world⌉ sequences, the last ones short and padded). Per batch: the bytes this rank's communications send in
    one step, its instructions, the step time (interleaved rounds), the time its communications take (the tracer,
    waits included) and the first losses against one device's."""
    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import setup

    out: dict = {}
    executors, batches = {}, {}
    for b in p["batches"]:
        cfg = dataclasses.replace(TrainConfig(batch_size=b), strategy="dp", mesh=f"dp={world}", nproc=world)
        s = setup(cfg, world)
        step = lower_step(s.pcg, s.optimizer.slots, ranks=[rank])
        ex = DistributedExecutor(step, s.optimizer, timeout_s=TIMEOUT_S)
        weights = s.initial_weights()
        ex.load(weights)
        batch = s.batch("train", 0)
        one = lower_step(build_pcg(s.graph, Mesh.parse("d=1")), s.optimizer.slots)
        ref = LocalExecutor(one, s.optimizer)
        ref.load(weights)
        executors[str(b)], batches[str(b)] = ex, batch
        out[str(b)] = {
            "comm_bytes": sum(c.nbytes for c in ex.program.comms),
            "comms": len(ex.program.comms),
            "instrs": len(ex.program.instrs),
            "redistributed_bytes": sum(r.nbytes for r in s.pcg.redistributions),
            "one_device_losses": [ref.step(batch) for _ in range(2)],
            "tokens": int(batch["input_ids"].numel()),
        }
    variants = [Variant(b, functools.partial(ex.step, batches[b])) for b, ex in executors.items()]
    losses = first_losses(variants, 2, rank)
    samples = interleave(variants, p["rounds"], p["iters"], p["warmup"], rank)
    for b in out:
        out[b]["losses"], out[b]["samples"] = losses[b], samples[b]
        out[b]["trace"] = comm_share(executors[b], batches[b])
    return {"batches": out}


WORKLOADS = {
    "mlp": run_mlp,
    "gpt": run_gpt,
    "comm": run_comm,
    "sp": run_sp,
    "profile": run_profile,
    "ckpt": run_ckpt,
    "fsdp": run_fsdp,
    "pipeline": run_pipeline,
    "chunked": run_chunked,
    "vocab": run_vocab,
    "moe": run_moe,
    "context": run_context,
    "uneven": run_uneven,
}


def main() -> None:
    workload, out_dir, params = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank, world = init_from_env(TIMEOUT_S)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = {"workload": workload, "world": world, "params": params, "machine_start": machine()}
    result.update(WORKLOADS[workload](params, rank, world))
    result["machine_end"] = machine()
    result["session_s"] = time.perf_counter() - t0
    write_result(out_dir, rank, result)
    shutdown(0)


if __name__ == "__main__":
    main()
