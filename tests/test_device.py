"""Where the executors keep their buffers (shardflow/runtime/device.py): torchrun's convention, ``cuda:LOCAL_RANK``
with NCCL when CUDA is available, else the CPU with gloo.

On a machine without CUDA the device path is checked by what it must never do: make a tensor without naming a
device. Under a torch function mode that records every factory call (zeros, empty, tensor, arange, ...) made
without ``device=`` from shardflow's own code (tests/devices.py), a step, a load, a save and a restore under
every kind of plan (dp, tp, fsdp×tp, pp, accumulation, dropout, gradient clipping) make none — so on a GPU every
tensor lands on the executor's device (tests/test_distributed.py checks the distributed executor the same way). The tests marked ``cuda`` run the real thing and skip, with the reason, without CUDA.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from devices import PACKAGE, DevicelessFactories

from shardflow.capture import capture
from shardflow.graph.ops import TensorType
from shardflow.lower import LowerOptions, MicroStep, lower_step
from shardflow.lower.dynamic import UpdateRule
from shardflow.lower.program import Comm
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.collectives import CommKind
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import build_pcg
from shardflow.reference import weights_of
from shardflow.runtime.accumulate import MicroSteps
from shardflow.runtime.batch import split_batch
from shardflow.runtime.device import DeviceError, backend_for, check_device, device_type, rank_device
from shardflow.runtime.distributed import CommTimeout, PeerLost, Waits, check_backend, comm_failure, group_timeout
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.runtime.local import LocalExecutor
from shardflow.strategy import make_plan, resolve
from shardflow.train import checkpoint

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False on this machine)"
)
ADAMW = OptimizerConfig("adamw", 1e-2)


def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    return model, {"idx": ids, "targets": ids}


@pytest.fixture(scope="module")
def gpt():
    model, batch = _gpt()
    return model, batch, {n: capture(model, split_batch(batch, n)[0]) for n in (1, 2)}  # by micro-steps per step


def test_the_check_sees_a_factory_without_a_device_in_shardflows_code_only():
    code = compile("torch.zeros(2)\ntorch.zeros(2, device='cpu')\n", PACKAGE + "runtime/probe.py", "exec")
    exempt = compile("torch.zeros(2)\n", PACKAGE + "models/probe.py", "exec")
    with DevicelessFactories() as mode:
        exec(code, {"torch": torch})
        exec(exempt, {"torch": torch})
        torch.zeros(2)  # a test's own line
    assert mode.sites == {"runtime/probe.py:1 zeros"}


@pytest.mark.parametrize(
    "mesh, strategy, accumulate",
    [("dp=2", "dp", 1), ("tp=2", "tp", 1), ("fsdp=2,tp=2", "fsdp,tp", 2), ("pp=2", "pp", 1)],
)
def test_no_tensor_of_a_step_load_save_or_restore_is_made_without_a_device(gpt, tmp_path, mesh, strategy, accumulate):
    model, batch, graphs = gpt
    graph = graphs[accumulate]
    m = Mesh.parse(mesh)
    pcg = build_pcg(graph, m, resolve(make_plan(graph, m, strategy), graph, m))
    steps = {
        mi: lower_step(pcg, UpdateRule.ADAMW, micro=mi, options=LowerOptions(), clip_norm=1.0)
        for mi in dict.fromkeys(MicroStep.sequence(accumulate))
    }
    last = steps[MicroStep.sequence(accumulate)[-1]]
    with DevicelessFactories() as mode:
        ex = LocalExecutor(last, ADAMW, seed=3, device=torch.device("cpu"))
        others = {mi: LocalExecutor(s, ADAMW, share=ex, seed=3) for mi, s in steps.items() if not mi.last}
        ex.load(weights_of(model, graph))
        run = MicroSteps([others.get(mi, ex) for mi in MicroStep.sequence(accumulate)])
        losses = [run.step(batch) for _ in range(2)]
        assert ex.grad_norm > 0
        path, _ = checkpoint.Saver(tmp_path, 0, 1, {"model": {}, "data": {}, "train": {}}, fresh=True).save(ex, 2)
        back = LocalExecutor(last, ADAMW, seed=3, device=torch.device("cpu"))
        checkpoint.read(path).restore(back, world=1)
        assert back.weight_error(ex.weights()) == 0.0
    assert mode.sites == set(), sorted(mode.sites)
    assert all(torch.isfinite(torch.tensor(x)) for x in losses)


def test_the_cpu_is_chosen_without_cuda_and_gloo_goes_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device("auto", {"LOCAL_RANK": "3"}) == torch.device("cpu")
    assert rank_device("cpu") == torch.device("cpu")
    assert device_type("auto") == "cpu" and device_type("cuda") == "cuda"
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "nccl"
    with pytest.raises(DeviceError, match=r"--device cuda: this machine has no CUDA device .* use --device cpu"):
        rank_device("cuda")
    with pytest.raises(ValueError, match=r"device 'gpu': choose one of \['auto', 'cpu', 'cuda'\]"):
        check_device("gpu")


def test_more_local_ranks_than_gpus_are_refused_for_cuda_and_fall_back_to_the_cpu_for_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_type("auto", 2) == "cuda" and device_type("auto", 3) == "cpu"
    check_device("auto", 3)
    assert rank_device("auto", {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}) == torch.device("cpu")
    with pytest.raises(
        DeviceError,
        match=r"local rank 2 has no GPU of its own: this machine has 2 CUDA device\(s\); "
        r"start at most 2 processes per machine \(--nproc 2\)",
    ):
        check_device("cuda", 3)
    check_device("cpu", 8)  # the CPU takes any number


class _Work:
    """A communication handle that completes at its ``polls``-th look (never: None), recording each wait's
    arguments; its wait returns ``answer`` or raises it — a wait with a timeout on one that never completes raises
    as NCCL's does when the timeout passes."""

    def __init__(self, polls: int | None = 0, answer: bool | Exception = True):
        self.polls, self.answer, self.waited, self.looks = polls, answer, [], 0

    def wait(self, *timeout):
        self.waited.append(timeout)
        if isinstance(self.answer, Exception):
            raise self.answer
        if timeout and self.polls is None:
            time.sleep(timeout[0].total_seconds())
            raise RuntimeError("Work timed out")
        return self.answer

    def is_completed(self) -> bool:
        self.looks += 1
        return self.polls is not None and self.looks > self.polls


def _send(token: int) -> Comm:
    """A point-to-point send of rank 1's program (what ``Waits`` names and tells from a collective)."""
    return Comm(token, CommKind.SEND, "FWD", (1, 0), TensorType((2,), "float32"), 8, "pp", peer=0)


def test_on_the_cpu_every_wait_blocks_with_the_timeout():
    two = datetime.timedelta(seconds=2)
    waits = Waits(two, on_stream=False, where=lambda c: f"rank 0 waited on {c}")
    work = _Work()
    waits.wait(work, "x")
    waits.settle()
    assert work.waited == [(two,)] and work.looks == 0  # blocked at its wait; nothing left for the step's end
    with pytest.raises(CommTimeout, match=r"^rank 0 waited on y: no completion within 2 s$"):
        waits.wait(_Work(answer=False), "y")
    with pytest.raises(PeerLost, match=r"^rank 0 waited on z: a member left \(Connection closed by peer"):
        waits.wait(_Work(answer=RuntimeError("[../gloo/pair.cc:1] Connection closed by peer [::1]:5")), "z")


def test_on_a_gpu_a_wait_in_the_step_only_orders_the_stream_and_the_step_end_bounds_it():
    """NCCL's wait given a timeout blocks the CPU until the communication ends (``torch.distributed.Work.wait``);
    inside the step a wait must not. The step's end waits each collective again with what is left of the timeout (a
    second wait of a finished collective returns at once; gloo's reduce-scatter handle never says ``is_completed``)
    and looks at each point-to-point one until it completes (gloo blocks on a second wait of a finished send), and
    names the first unfinished one."""
    timeout = datetime.timedelta(seconds=0.3)
    waits = Waits(timeout, on_stream=True, where=lambda c: f"rank 1 waited on {c}")
    bucket, sent, number = _Work(), _Work(polls=3), _Work()
    waits.wait(bucket, "a bucket")
    waits.wait(sent, _send(2))
    waits.wait(number, "a number", read=True)  # the CPU reads it next: it blocks, with the timeout
    assert bucket.waited == [()] and sent.waited == [()] and number.waited == [(timeout,)]
    assert bucket.looks == sent.looks == 0  # nothing waited for on the CPU before the step's end
    waits.settle()
    assert len(bucket.waited) == 2 and bucket.waited[1][0] <= timeout and bucket.looks == 0
    assert (sent.waited, sent.looks, number.looks) == ([()], 4, 0)
    waits.settle()  # each communication is settled once
    assert len(bucket.waited) == 2 and sent.looks == 4

    store = dist.HashStore()  # real handles: torch's Work has the calls used on a GPU
    group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=5))
    waits.wait(group.allreduce([torch.ones(2)]), "a real all-reduce")
    out = torch.empty(2)
    waits.wait(group._reduce_scatter_base(out, torch.ones(2)), "a real reduce-scatter")  # is_completed: never
    waits.settle()

    for late in (_Work(polls=None), _send(4)):  # a collective and a send that never complete
        waits.wait(_Work(polls=2), "token 3 (all_gather)")
        waits.wait(_Work(polls=None), late if isinstance(late, Comm) else "token 4 (reduce_scatter)")
        t0 = time.monotonic()
        with pytest.raises(
            CommTimeout,
            match=r"^rank 1 waited on .*4.*: not complete 0.3 s after the "
            r"step's last instruction was queued; a member stopped answering",
        ):
            waits.settle()
        assert time.monotonic() - t0 >= 0.3  # not before its bound (load only delays it)


def test_nccls_watchdog_waits_longer_than_the_executor_and_its_remote_error_is_a_member_lost():
    """NCCL ends the process a group's timeout after a communication was queued; the executor's bound counts from
    the step's end, so the groups' must be longer for a stalled member to be named (tests/dist_worker.py's "groups"
    checks every group of a run is made with it)."""
    two = datetime.timedelta(seconds=2)
    assert group_timeout(two, "cuda") == 2 * two and group_timeout(two, "cpu") == two
    nccl = RuntimeError(
        "NCCL error in: ProcessGroupNCCL.cpp:2042, remote process exited or there was a network "
        "error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network error"
    )
    lost = comm_failure(nccl, "rank 0 waited on token 7")
    assert isinstance(lost, PeerLost) and str(lost).startswith(
        "rank 0 waited on token 7: a member left (remote process exited or there was a network error, NCCL version"
    )


def test_a_process_group_initialised_before_must_carry_the_buffers_device():
    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")
    for backend, device in [("nccl", gpu), ("gloo", cpu), ("cpu:gloo,cuda:nccl", gpu), ("cpu:gloo,cuda:nccl", cpu)]:
        check_backend(backend, device)
    with pytest.raises(
        ValueError,
        match=r"^the process group was initialised before shardflow joined it, with "
        r"backend 'gloo', which cannot carry this rank's buffers on cuda:1 \(nccl "
        r"does\): initialise it with init_process_group\('nccl', device_id=torch"
        r"\.device\('cuda', LOCAL_RANK\)\), or leave it to shardflow",
    ):
        check_backend("gloo", gpu)
    with pytest.raises(ValueError, match=r"with backend 'nccl', which cannot carry this rank's buffers on cpu"):
        check_backend("nccl", cpu)


def test_a_tracer_on_a_gpu_times_what_the_device_did_not_what_was_queued(monkeypatch):
    from shardflow.runtime.trace import Tracer

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    gpu = torch.device("cuda", 1)
    t0 = Tracer(0, gpu).now()
    Tracer(0).now()  # the CPU's work is done when its call returns
    assert synced == [gpu] and abs(t0 - time.time()) < 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is no bad input here")
def test_train_on_cuda_without_cuda_is_refused_before_any_process(run_here, tmp_path):
    run, path = run_here(tmp_path, "nogpu", "--device", "cuda")
    assert run.returncode == 2 and not path.exists()
    assert run.stderr.strip() == (
        "shardflow train: error: --device cuda: this machine has no CUDA device torch can "
        "use (torch.cuda.is_available() is False); use --device cpu (gloo), or install a "
        "CUDA build of torch"
    ), run.stderr


# --- on a GPU ----------------------------------------------------------------------------------------------------
@CUDA
@pytest.mark.parametrize("mesh, strategy", [("d=1", "single"), ("tp=2", "tp"), ("fsdp=2", "fsdp")])
def test_a_step_on_the_gpu_gives_the_numbers_of_the_cpu(mesh, strategy):
    """float64 with dropout: every rank's buffers on cuda:0 (the local executor), the loss and every replica of every
    weight after 3 AdamW steps equal the CPU's to 1e-9 (kernels differ, masks do not: they are drawn by index)."""
    model, batch = _gpt()
    model = model.double()
    graph = capture(model, batch)
    m = Mesh.parse(mesh)
    step = lower_step(build_pcg(graph, m, resolve(make_plan(graph, m, strategy), graph, m)), UpdateRule.ADAMW)
    runs = {}
    for device in ("cpu", "cuda"):
        ex = LocalExecutor(step, ADAMW, seed=3, device=torch.device(device))
        ex.load(weights_of(model, graph))
        runs[device] = ([ex.step(batch) for _ in range(3)], ex)
    assert all(b.is_cuda for bufs in runs["cuda"][1].buffers.values() for b in bufs.values())
    assert max(abs(a - b) for a, b in zip(runs["cpu"][0], runs["cuda"][0])) < 1e-9
    assert runs["cuda"][1].weight_error(runs["cpu"][1].weights()) < 1e-9


@CUDA
def test_train_on_one_gpu(run_here, tmp_path):
    """``shardflow train --nproc 1 --device cuda`` (every rank of tp=2 on cuda:0) trains 4 steps and checks them
    against one device."""
    run, _ = run_here(tmp_path, "gpu", "--nproc", "1", "--device", "cuda", "--check")
    assert run.returncode == 0 and "check against one device" in run.stdout, run.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL between two ranks)")
@pytest.mark.parametrize("strategy", ["tp", "fsdp"])
def test_train_on_two_gpus_with_nccl_equals_one_device(run_train, tmp_path, strategy):
    """``shardflow train --nproc 2 --device cuda --check``: NCCL between cuda:0 and cuda:1, the loss and every weight
    against one device within --check's tolerance."""
    run, _ = run_train(tmp_path, strategy, "--nproc", "2", "--device", "cuda", "--strategy", strategy, "--check")
    assert run.returncode == 0 and "check against one device" in run.stdout, run.stderr
