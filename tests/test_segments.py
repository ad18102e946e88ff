"""Compiled segments (shardflow.runtime.segments) and the multi-tensor optimizer update (kernels.update_kernel).

A segment must do what the instructions say, one by one: every value that outlives the segment written to the
buffers, no value freed inside it ever written there, frees of outside values popped, the ledger counting what an
instruction-by-instruction run counts; consecutive updates one call. The update kernel against torch.optim on the
same tensors: float32 and float64 take the fused kernel (the same formulas in one kernel: 1e-6 and 1e-12 relative),
bfloat16 foreach (torch.optim's arithmetic to one rounding step of bfloat16, 1e-2 relative: foreach adds in float32
where the single-tensor step rounds in between).
"""

from __future__ import annotations

import pytest
import torch

from shardflow.capture import capture
from shardflow.graph.ops import TensorType
from shardflow.lower import lower_step
from shardflow.lower.dynamic import TaskType
from shardflow.lower.memory import Ledger
from shardflow.lower.program import Buffer, Compute, Free, Update
from shardflow.models import MLP
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import build_pcg
from shardflow.runtime.kernels import OptimizerConfig, update_kernel
from shardflow.runtime.local import LocalExecutor
from shardflow.runtime.segments import calls, compile_segment, is_update, runs

F32 = TensorType((2,), "float32")


def _add(out: str, *ins: str) -> Compute:
    return Compute(TaskType.FWD, out, "add", tuple(Buffer(v, F32) for v in ins), (Buffer(out, F32),))


class Recorder(dict):
    """Buffers that remember every key written and popped."""

    def __init__(self, *a):
        super().__init__(*a)
        self.written, self.popped = [], []

    def __setitem__(self, k, v):
        self.written.append(k)
        super().__setitem__(k, v)

    def pop(self, k, *default):
        self.popped.append(k)
        return super().pop(k, *default)


def _segment(instrs, ledger=None):
    def kernel(c):
        return lambda xs: [sum(xs[1:], xs[0])]

    return compile_segment(instrs, kernel, lambda us: None, ledger)


def test_a_segment_writes_only_values_that_outlive_it():
    """a (from outside) → t = a + a → u = t + a; t freed inside, a freed inside, u kept: only u is written, a is
    popped, t never reaches the buffers; the numbers are the instructions'."""
    instrs = [_add("t", "a", "a"), _add("u", "t", "a"), Free(("t", "a"))]
    b = Recorder({"a": torch.tensor([1.0, 2.0])})
    _segment(instrs)(b, None)
    assert b.written == ["u"] and b.popped == ["a"] and set(b) == {"u"}
    assert b["u"].tolist() == [3.0, 6.0]


def test_the_ledger_counts_what_each_instruction_does():
    """With a ledger: each write counts the buffer's bytes, each free releases them; the peak is the three live
    buffers (a, t, u: 8 bytes each) before the free."""
    ledger = Ledger()
    b = {"a": torch.tensor([1.0, 2.0])}
    ledger.sync(b)
    _segment([_add("t", "a", "a"), _add("u", "t", "a"), Free(("t", "a"))], ledger)(b, None)
    assert ledger.peak == 24 and ledger.total == 8 and set(ledger.live) == {"u"}


def test_runs_cut_at_boundaries_and_calls_group_consecutive_updates():
    """runs: boundaries alone, the rest in maximal runs. calls: every update of the MLP's program in one call
    (they are consecutive at the end of a single-device step), every other compute alone, frees kept."""
    instrs = [_add("t", "a"), Free(("a",)), _add("u", "t"), _add("w", "u")]
    assert runs(instrs, (Free,)) == [(0, 1), (1, 2), (2, 4)]
    assert runs(instrs, (Compute,)) == [(0, 1), (1, 2), (2, 3), (3, 4)]

    torch.manual_seed(0)
    model = MLP(4, 4, 4, 3)
    graph = capture(model, {"x": torch.randn(8, 4), "y": torch.randint(0, 4, (8,))})
    program = lower_step(build_pcg(graph, Mesh.parse("d=1")), OptimizerConfig("adamw").slots).programs[0]
    grouped = calls(program.instrs)
    updates = [c for c in grouped if isinstance(c, list) and is_update(c[0])]
    assert len(updates) == 1 and len(updates[0]) == len(graph.weights) == 6
    assert sum(len(c) for c in grouped if isinstance(c, list)) == sum(isinstance(i, Compute) for i in program.instrs)
    assert [c for c in grouped if isinstance(c, Free)] == [i for i in program.instrs if isinstance(i, Free)]


def test_peak_bytes_needs_memory_accounting():
    torch.manual_seed(0)
    model = MLP(4, 4, 4, 2)
    graph = capture(model, {"x": torch.randn(8, 4), "y": torch.randint(0, 4, (8,))})
    step = lower_step(build_pcg(graph, Mesh.parse("d=1")), OptimizerConfig().slots)
    with pytest.raises(RuntimeError, match="memory=True"):
        LocalExecutor(step, OptimizerConfig()).peak_bytes


def _updates(n: int, cfg: OptimizerConfig, dtype: str, clip: float) -> list[Compute]:
    slots = {"sgd": ("momentum",) if cfg.momentum else (), "adamw": ("exp_avg", "exp_avg_sq")}[cfg.name]
    out = []
    for i in range(n):
        t = TensorType((3, i + 1), dtype)
        ins = [Buffer(f"w{i}", t), Buffer(f"g{i}", t), *(Buffer(f"{s}{i}", t) for s in slots)]
        ins += [Buffer("norm", TensorType((), dtype))] if clip else []
        outs = [Buffer(f"w{i}'", t), *(Buffer(f"{s}{i}'", t) for s in slots)]
        out.append(
            Compute(TaskType.UPD, f"w{i}", "adamw", tuple(ins), tuple(outs), f"upd:w{i}", kernel=Update(slots, clip))
        )
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize(
    "cfg, clip",
    [
        (OptimizerConfig("sgd", 0.1, 0.9, 0.01), 0.0),
        (OptimizerConfig("adamw", 0.01, weight_decay=0.1), 0.0),
        (OptimizerConfig("adamw", 0.01), 0.5),
    ],
    ids=["sgd", "adamw", "adamw-clip"],
)
def test_update_kernel_equals_torch_optim(dtype, cfg, clip):
    """Three updates of three shards at once against torch.optim (SGD with momentum and weight decay, AdamW with
    decoupled weight decay, AdamW after clip_grad_norm_), three steps; the state is the kernel's own tensors."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    updates = _updates(3, cfg, dtype, clip)
    step = [0]
    kernel = update_kernel(updates, cfg, lambda: step[0])
    shapes = [u.ins[0].type.shape for u in updates]
    ws = [torch.randn(s).to(dt) for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    ref = (
        torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        if cfg.name == "sgd"
        else torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    )
    n_state = len(updates[0].kernel.slots)
    state = [[torch.zeros(s, dtype=dt) for _ in range(n_state)] for s in shapes]
    for step[0] in (1, 2, 3):
        gs = [torch.randn(s).to(dt) for s in shapes]
        for p, g in zip(params, gs):
            p.grad = g.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        ref.step()
        norm = torch.stack([g.double().pow(2).sum() for g in gs]).sum().to(dt)
        xs = [t for w, g, st in zip(ws, gs, state) for t in (w, g, *st, *([norm] if clip else []))]
        out = kernel(xs)
        assert all(o is x for o, x in zip(out, [t for w, st in zip(ws, state) for t in (w, *st)]))  # in place
    tol = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 1e-2}[dtype]
    for w, p in zip(ws, params):
        torch.testing.assert_close(w, p.detach(), rtol=tol, atol=tol)


def test_update_kernel_reads_a_gradient_that_is_a_broadcast_view():
    """The gradient of a weight added to the batch and averaged is the mean's vjp, a scalar expanded to the weight's
    shape (stride 0): the multi-tensor kernels must read it as its values (they read raw memory), two SGD steps with
    momentum against torch.optim."""
    cfg = OptimizerConfig("sgd", 0.1, 0.9)
    (u,) = _updates(1, cfg, "float64", 0.0)
    step = [0]
    kernel = update_kernel([u], cfg, lambda: step[0])
    w = torch.randn(u.ins[0].type.shape, dtype=torch.float64)
    p = torch.nn.Parameter(w.clone())
    ref = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    buf = torch.zeros_like(w)
    for step[0] in (1, 2):
        g = torch.tensor(0.25, dtype=torch.float64).expand(w.shape)
        p.grad = g.clone()
        ref.step()
        kernel([w, g, buf])
    torch.testing.assert_close(w, p.detach(), rtol=1e-12, atol=1e-12)
