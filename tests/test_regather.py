"""Regathering activations (``LowerOptions.regather_activations``, ``--regather-activations``; docs/lowering.md
#regathering-activations): an activation all-gathered by a Combine — sequence parallelism's gather before a
column-parallel linear — is freed after its forward readers and gathered again before its first backward reader,
as Megatron-LM's sequence parallelism does (Korthikanti et al. 2022, §4.2.2). The exact plan (one more all-gather
per such Combine, in the backward, of the forward's bytes), less activation memory at the peak, and the numbers of
one device at float64 under sp, fsdp,sp, a pipeline's microbatches and activation checkpointing."""

from __future__ import annotations

from collections import Counter

import pytest

import shardflow

pytest.importorskip("transformers")

from conftest import lower_preset, run_adamw, tiny_hf_llama_float64  # noqa: E402

from shardflow.capture import wide_floats  # noqa: E402
from shardflow.graph.graph import TensorRole  # noqa: E402
from shardflow.lower.dynamic import ActivationCheckpointing  # noqa: E402
from shardflow.lower.memory import MemoryKind, program_memory  # noqa: E402
from shardflow.lower.program import Comm  # noqa: E402
from shardflow.parallel.ops import CombineOp  # noqa: E402

STEPS = 3
TOL = 1e-12  # float64: partial sums in another order than one device (seen ~1e-14)


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_llama_float64()


def _lower(graph, mesh_text: str, strategy: str, regather: bool, **more):
    return lower_preset(graph, mesh_text, strategy, regather_activations=regather, **more)


def _run(model, batch, graph, step):
    return run_adamw(model, batch, graph, step, STEPS)


@pytest.fixture(scope="module")
def one_device(llama):
    model, batch, graph = llama
    return _run(model, batch, graph, _lower(graph, "d=1", "single", False)[1])


def _activation_gathers(pcg):
    """The PCG's Combines of an activation whose output a backward reads (every one here: a linear's input)."""
    return [
        n for n in pcg.nodes if isinstance(n.op, CombineOp) and pcg.tensors[n.inputs[0]].role == TensorRole.ACTIVATION
    ]


def test_sp_gathers_each_activation_again_for_the_backward(llama):
    """Under sp on tp=2 each activation Combine (the norms' outputs gathered before q/k/v and gate/up, the final
    norm's before the head) is one all-gather in the forward and, regathered, one more in the backward of the same
    bytes; nothing else changes."""
    _, _, graph = llama
    pcg, kept = _lower(graph, "tp=2", "sp", False)
    _, again = _lower(graph, "tp=2", "sp", True)
    gathers = _activation_gathers(pcg)
    assert len(gathers) == 5  # 2 blocks × (attention's, MLP's) + the head's
    for rank in (0, 1):

        def comms(step):
            return Counter((str(c.kind), c.task, c.nbytes) for c in step.programs[rank].instrs if isinstance(c, Comm))

        extra = comms(again) - comms(kept)
        assert not comms(kept) - comms(again), rank  # nothing left out
        forward = Counter({(k, t, b): n for (k, t, b), n in comms(kept).items() if k == "all_gather" and t == "FWD"})
        assert sum(extra.values()) == len(gathers), (rank, extra)
        assert {(k, t) for k, t, _ in extra} == {("all_gather", "BWD")}, extra
        assert sorted(b for _, _, b in extra.elements()) == sorted(b for _, _, b in forward.elements()), rank


def test_regathering_holds_less_activation_memory_at_the_peak(llama):
    """The whole gathered activations die with their forward readers: rank 0's activations at its peak shrink."""
    _, _, graph = llama
    peaks = {}
    for regather in (False, True):
        _, step = _lower(graph, "tp=2", "sp", regather)
        peaks[regather] = program_memory(step.programs[0], step.dg)
    assert peaks[True].by_kind[MemoryKind.ACTIVATIONS] < peaks[False].by_kind[MemoryKind.ACTIVATIONS]


@pytest.mark.parametrize(
    "mesh, strategy, more",
    [
        ("tp=2", "sp", {}),
        ("fsdp=2,tp=2", "fsdp,sp", {}),
        ("tp=2", "sp", {"ac": ActivationCheckpointing.SELECTIVE}),
        ("tp=2", "sp", {"ac": ActivationCheckpointing.BLOCK}),
        ("dp=2,tp=2", "dp,sp", {"accumulate": 2}),
    ],
)
def test_regathered_sp_equals_one_device(llama, one_device, mesh, strategy, more):
    """AdamW, 3 steps: the loss of each step and every replica of every weight piece equal one device's (float64)."""
    model, batch, graph = llama
    losses, ex = _run(model, batch, graph, _lower(graph, mesh, strategy, True, **more)[1])
    ref_losses, ref = one_device
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
    assert ex.weight_error(ref.weights()) < TOL


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_regathered_in_each_microbatch_of_a_pipeline_equals_eager(llama, schedule):
    """pp=2 × sp on tp=2, 2 microbatches, through ``parallelize(regather_activations=True)``: every microbatch
    gathers its own activations again (not shared as a weight's regather is), and each step's loss, the gradients
    and every weight equal eager PyTorch's on the whole batch (float64, TOL)."""
    model, batch, _ = llama
    with wide_floats():
        trainer = shardflow.parallelize(
            model,
            batch,
            mesh="pp=2,tp=2",
            strategy="pp,sp",
            lr=0.1,
            microbatches=2,
            schedule=schedule,
            regather_activations=True,
            executor="local",
        )
        regathers = [n for n in trainer.plan.lowered.dg.nodes if n.name.startswith("BWD regather")]
        assert regathers and {n.micro for n in regathers} == {0, 1}
        steps = list(trainer.compare_with_eager(model, batch, 2))
    assert all(s.dloss <= TOL and s.grad <= TOL and s.weight <= TOL for s in steps), steps
