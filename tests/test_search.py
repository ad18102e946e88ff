"""``--strategy auto`` (docs/search.md): the candidates, the golden choices of a small model (data parallelism with
memory to spare, fully sharded when the replicated optimizer state does not fit), the choice never slower than a
preset it saw, and a saved plan that plans the same programs again."""

from __future__ import annotations

import collections
import json

import pytest
import torch
import transformers
import zoo

import shardflow.search as searching
from shardflow.graph.graph import TensorRole
from shardflow.lower import LowerOptions
from shardflow.lower.dynamic import Optimizer
from shardflow.lower.program import programs_fingerprint
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Mesh, Replicate, Shard
from shardflow.pipeline import Pipeline
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.search import SearchError, candidates, explain, factorizations, search_model
from shardflow.simulator.machine import MachineSpec
from shardflow.strategy import Plan
from shardflow.strategy.placements import placement

SPEC = MachineSpec.named("h100")
torch.manual_seed(0)
MODEL = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
BATCH = {"idx": torch.randint(0, 64, (64, 16)), "targets": torch.randint(0, 64, (64, 16))}


def run(world: int, budget: int | None = None, model=MODEL, batch=BATCH, placements: bool = True, screen: bool = True):
    return search_model(
        model,
        batch,
        world,
        LowerOptions(),
        OptimizerConfig(Optimizer.ADAMW),
        SPEC,
        budget,
        placements=placements,
        screen=screen,
    )


pytestmark = pytest.mark.integration  # each search plans and predicts ~70 presets: a minute in all


@pytest.fixture(scope="module")
def eight():
    return run(8, screen=False)


def test_factorizations_and_candidates():
    assert sorted(factorizations(4, 2)) == [(1, 4), (2, 2), (4, 1)]
    assert len(list(factorizations(8, 4))) == 20
    # a batch of 2 splits at most 2 ways (no dp=4, fsdp=4, dp=2,fsdp=2) and, under a pipeline of 2 stages, into 2
    # microbatches only where nothing else splits it; 2 blocks make at most 2 stages (no pp=4)
    cs = candidates(4, blocks=2, batch=2)
    assert {str(c.mesh) for c in cs} == {"tp=4", "dp=2,tp=2", "fsdp=2,tp=2", "pp=2,tp=2"}
    assert {c.strategy for c in cs if str(c.mesh) == "tp=4"} == {"tp", "sp"}
    assert {(c.microbatches, str(c.schedule)) for c in cs if "pp" in c.mesh.axis_names} == {(2, "1f1b"), (2, "gpipe")}


def test_a_small_model_with_a_large_batch_gets_data_parallelism(eight):
    best = eight.best.candidate
    assert (best.strategy, str(best.mesh), str(best.ac)) == ("dp", "dp=8", "none")
    kinds = {c.kind for p in eight.pipeline.lower().programs.values() for c in p.comms}
    assert kinds == {"all_reduce"}  # the gradients' (bucketed) and the loss's label count, nothing else


def test_the_choice_is_never_slower_than_a_preset_it_saw(eight):
    assert eight.best.fits and eight.best.prediction is not None
    fitting = [o.prediction.step_seconds for o in eight.outcomes if o.fits]
    assert len(fitting) > 20 and eight.best.prediction.step_seconds == min(fitting)
    doc = eight.to_json()
    assert {"mesh", "strategy", "predicted", "alternatives", "search_seconds"} <= set(doc)
    assert doc["mesh"] == "dp=8" and {"fsdp", "dp,tp", "pp,dp"} <= {a["strategy"] for a in doc["alternatives"]}
    assert all(a["why"] for a in doc["alternatives"])


def test_screening_keeps_the_choice_of_the_whole_search_and_predicts_fewer(eight):
    """The search by estimates (the default, docs/search.md#screening) answers as the search of every candidate
    (``eight``) does, predicting a fraction of its candidates; each family it did not predict is still named among
    the runners-up, with its estimate."""
    screened = run(8)
    assert screened.best.candidate == eight.best.candidate
    assert screened.best.prediction.step_seconds == eight.best.prediction.step_seconds
    predicted = [o for o in screened.outcomes if o.prediction is not None]
    assert 0 < len(predicted) < sum(o.prediction is not None for o in eight.outcomes) // 2
    assert screened.screened > 0 and eight.screened == 0 and screened.to_json()["screened"] == screened.screened
    named = {o.candidate.family for o in screened.alternatives()} | {screened.best.candidate.family}
    assert named == {o.candidate.family for o in eight.outcomes}
    left = [o for o in screened.alternatives() if o.prediction is None and "estimate" in o.refused]
    assert left and all("could not beat the best step found" in screened.why(o) for o in left)
    assert all(o.candidate in {c for c, _ in screened.left} for o in left)


def test_a_search_for_some_plans_answers_the_fastest_of_them(eight):
    """``wanted``: only the plans asked for count as found (benchmarks/search.py's fastest preset): here fsdp's, the
    fastest fsdp outcome of the whole search."""
    only = search_model(
        MODEL, BATCH, 8, LowerOptions(), OptimizerConfig(Optimizer.ADAMW), SPEC, wanted=lambda c: c.strategy == "fsdp"
    )
    fsdp = min(
        (o for o in eight.outcomes if o.fits and o.candidate.strategy == "fsdp"),
        key=lambda o: o.prediction.step_seconds,
    )
    assert only.best.candidate == fsdp.candidate and only.best.prediction.step_seconds == fsdp.prediction.step_seconds


def test_without_memory_for_replicated_optimizer_state_it_shards_the_state_not_the_model(monkeypatch):
    """A wider model and a larger batch, on a device that holds the fully sharded plan's peak and an eighth more
    but not the replicated state: the state sharded, not the model — every matmul on its batch shard. The per-op
    placements (docs/search.md#per-op-placements) store only the largest weights sharded (gathered before use,
    their gradients reduce-scattered: FSDP where the budget needs it, data parallelism elsewhere) and beat the fsdp
    preset. Each placement problem is solved once, and candidates whose caps lead to the same answer share its
    prediction (docs/search.md#search-time)."""
    torch.manual_seed(0)
    wide = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=256))
    batch = {"idx": torch.randint(0, 64, (512, 16)), "targets": torch.randint(0, 64, (512, 16))}
    free = run(8, model=wide, batch=batch, placements=False, screen=False)  # every preset's peak, no per-op ones
    peaks = {
        str(o.candidate.mesh): max(o.prediction.peak_bytes)
        for o in free.outcomes
        if o.prediction and not o.candidate.placements
    }
    budget = peaks["fsdp=8"] * 9 // 8
    assert peaks["dp=8"] > budget  # replicated, the AdamW state does not fit
    solved, predicted = [], []
    solve, predict = searching.placements_plan, Pipeline.predict
    monkeypatch.setattr(
        searching,
        "placements_plan",
        lambda g, mesh, spec, memory: solved.append((id(g), mesh, memory)) or solve(g, mesh, spec, memory=memory),
    )
    monkeypatch.setattr(Pipeline, "predict", lambda self, *a, **k: predicted.append(self) or predict(self, *a, **k))
    res = run(8, budget=budget, model=wide, batch=batch)
    per_op = [o for o in res.outcomes if o.candidate.placements and o.prediction]
    assert len(solved) == len(set(solved)) < len(per_op)  # checkpointing and caps share the solves
    placed = [p for p in predicted if p.plan.name.startswith("placements")]
    assert (
        placed
        and not [  # no program predicted twice (answers equal under two caps share one prediction)
            (a, b)
            for i, a in enumerate(placed)
            for b in placed[i + 1 :]
            if a.graph is b.graph and a.plan == b.plan and a.options == b.options
        ]
    )
    best = res.best.candidate
    assert best.placements and best.mesh.size == 8 and best.memory_level > 0
    assert max(res.best.prediction.peak_bytes) <= res.budget
    pcg = res.pipeline.pcg
    axes = best.mesh.axis_names
    matmuls = [n for n in pcg.nodes if not n.is_parallel and n.op.kind in ("linear", "attention")]
    assert {placement(pcg.tensors[n.outputs[0]].sharding, a) for n in matmuls for a in axes} == {Shard(0)}
    stored = [placement(t.sharding, "tp") for t in pcg.tensors.values() if t.role == TensorRole.WEIGHT]
    assert 0 < sum(p != Replicate() for p in stored) < len(stored)
    fsdp = min(o.prediction.step_seconds for o in res.outcomes if o.fits and str(o.candidate.mesh) == "fsdp=8")
    assert res.best.prediction.step_seconds < fsdp
    with pytest.raises(SearchError, match="no plan of 8 devices fits the memory budget"):
        run(8, budget=1000)


def test_long_sequences_the_batch_cannot_split_get_context_parallelism():
    """Two sequences of 4,096 tokens on 8 devices: the batch splits 2 ways, and the rest goes to context
    parallelism — its attention reading the split sequence by all-to-all onto the 4 heads (DeepSpeed-Ulysses), the
    simulator's choice among the three forms — ahead of tensor parallelism on the same devices by ≥ 5 %. cp is
    tried only where the batch runs out of sequences (docs/search.md#context-parallelism): with 16 sequences no
    candidate has a cp axis."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=4096, n_layer=2, n_head=4, n_embd=64))
    ids = torch.randint(0, 64, (2, 4096))
    res = run(8, model=model, batch={"idx": ids, "targets": ids}, placements=False)
    best = res.best.candidate
    assert (best.strategy, str(best.mesh), str(best.cp_attention)) == ("dp,cp", "dp=2,cp=4", "all_to_all")
    assert best.flags()[-2:] == ["--cp-attention", "all_to_all"]
    kinds = {c.kind for p in res.pipeline.lower().programs.values() for c in p.comms}
    assert "all_to_all" in kinds
    without_cp = [o.prediction.step_seconds for o in res.outcomes if o.fits and "cp" not in o.candidate.mesh.axis_names]
    assert res.best.prediction is not None and res.best.prediction.step_seconds <= 0.95 * min(without_cp)
    assert not [c for c in candidates(8, blocks=2, batch=16, seq=4096) if "cp" in c.mesh.axis_names]
    assert {str(c.mesh) for c in candidates(8, blocks=2, batch=2, seq=4096) if "cp" in c.mesh.axis_names} == {
        "cp=8",
        "dp=2,cp=4",
        "fsdp=2,cp=4",
        "cp=4,tp=2",
        "dp=2,cp=2,tp=2",
        "fsdp=2,cp=2,tp=2",
        "pp=2,cp=4",
    }  # not cp=2,tp=4 nor pp=2,cp=2,tp=2: dp=2 in place of cp=2 dominates them


def test_a_mixture_of_experts_whose_experts_do_not_fit_replicated_gets_expert_parallelism():
    """A Mixtral of 8 experts per layer on 8 devices whose memory holds neither the replicated (dp) nor the fully
    sharded (fsdp) plan's peak: each device stores one expert of each layer — expert parallelism, ep = 8, not fsdp
    with ep beside it (which gathers the other weights) nor ep with tp. The ep meshes are exactly those whose degree
    divides the experts, beside fsdp and tp only (docs/search.md#expert-parallelism); a dense model gets none."""
    torch.manual_seed(0)
    wide = {**zoo.MIXTRAL, "hidden_size": 256, "intermediate_size": 1024, "num_local_experts": 8}
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**wide))
    ids = torch.randint(0, 96, (16, 32))
    batch = {"input_ids": ids, "labels": ids}
    free = run(8, model=model, batch=batch, placements=False)
    peaks = {str(o.candidate): max(o.prediction.peak_bytes) for o in free.outcomes if o.prediction}
    budget = peaks["--strategy fsdp --mesh fsdp=8"] * 9 // 10
    assert peaks["--strategy ep --mesh ep=8"] < budget < peaks["--strategy dp --mesh dp=8"]
    res = run(8, budget=budget, model=model, batch=batch, placements=False)
    assert str(res.best.candidate) == "--strategy ep --mesh ep=8"
    assert {str(c.mesh) for c in candidates(8, blocks=2, batch=16, node=8, experts=8) if "ep" in c.mesh.axis_names} == {
        "ep=8",
        "fsdp=2,ep=4",
        "fsdp=4,ep=2",
        "ep=4,tp=2",
        "ep=2,tp=4",
        "fsdp=2,ep=2,tp=2",
    }
    assert not [c for c in candidates(8, blocks=2, batch=16, node=8) if "ep" in c.mesh.axis_names]


def test_a_saved_plan_plans_the_same_programs_again(eight, tmp_path):
    chosen = eight.best.candidate
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(eight.pipeline.plan.to_json()))
    again = Pipeline.planned(
        eight.pipeline.graph,
        Mesh.parse(str(chosen.mesh)),
        eight.pipeline.options,
        eight.pipeline.optimizer,
        None,
        Plan.load(path),
    )
    assert programs_fingerprint(again.lower().programs) == programs_fingerprint(eight.pipeline.lower().programs)


def test_parallelize_auto_trains_the_choice_as_one_device_does():
    from shardflow import parallelize

    def trainer(**kw):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
        return parallelize(model, BATCH, optimizer="adamw", lr=1e-3, **kw)

    auto, one = trainer(mesh="d=4", strategy="auto"), trainer(mesh="d=1", strategy="single")
    assert auto.plan.pcg.mesh.size == 4 and auto.plan.name != "single"
    for _ in range(3):  # float32, partial sums added in another order: ~1e-6 relative
        assert auto.step(BATCH) == pytest.approx(one.step(BATCH), rel=1e-5)
    with pytest.raises(ValueError, match="strategy='auto' chooses the plan itself"):
        trainer(mesh="d=4", strategy="auto", plan="p.json")


def test_check_auto_compares_the_choice_with_eager(capsys, monkeypatch):
    from pathlib import Path

    from shardflow.cli import main

    monkeypatch.chdir(Path(__file__).parents[1])
    assert main(["check", "--model", "examples/hf_llama.py:tiny_llama", "--strategy", "auto", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "over every replica (tolerance" in out and out.rstrip().endswith("OK")


def test_explain_shows_an_op_under_the_choice_and_each_runner_up(eight):
    text = explain(eight, "transformer.h.0.mlp")
    assert text.startswith("# --explain transformer.h.0.mlp on h100, rank 0\n# chosen: --strategy dp --mesh dp=8")
    assert text.count("# runner-up: ") == len([o for o in eight.alternatives() if o.prediction is not None])
    chosen = text.split("# runner-up")[0]
    assert "compute: FWD" in chosen and "BWD" in chosen and "communication: none" in chosen
    tp = next(part for part in text.split("# runner-up: ")[1:] if part.startswith("--strategy dp,tp "))
    assert "all_reduce ×" in tp  # Megatron's pair: the row-parallel output's all-reduce (and the input grad's)
    with pytest.raises(ValueError, match="no op of the captured graph has that name"):
        explain(eight, "transformer.h.9")


def test_weights_that_do_not_fit_under_fsdp_get_megatron_pairs():
    """A wide model and a small batch on 4 devices whose memory holds tensor parallelism's peak but not a gathered
    block of fsdp's: Megatron's column→row pairs, found op by op (docs/search.md#per-op-placements) — one all-reduce
    per attention and per MLP in the forward, and nothing else: with a vocabulary of 64 the program keeps the
    embedding and the loss whole, where the tp preset makes them vocabulary-parallel (three all-reduces and a
    reduce-scatter more: docs/concepts.md#vocabulary-parallel-embedding-and-loss), so it beats every preset."""
    torch.manual_seed(0)
    wide = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=8, n_embd=1024))
    batch = {"idx": torch.randint(0, 64, (4, 16)), "targets": torch.randint(0, 64, (4, 16))}
    free = run(4, model=wide, batch=batch, placements=False, screen=False)  # every preset's peak, no per-op placements
    peaks = {str(o.candidate): max(o.prediction.peak_bytes) for o in free.outcomes if o.prediction}
    split = max(peaks["--strategy tp --mesh tp=4"], peaks["--strategy fsdp,tp --mesh fsdp=2,tp=2"])
    assert split < peaks["--strategy fsdp --mesh fsdp=4"]  # a gathered block of fsdp's is more than tp's holds
    res = run(4, budget=(split + peaks["--strategy fsdp --mesh fsdp=4"]) // 2, model=wide, batch=batch)
    assert str(res.best.candidate) == "--plan PLAN.json --mesh tp=4" and res.best.candidate.placements
    presets = [o.prediction.step_seconds for o in res.outcomes if o.fits and not o.candidate.placements]
    assert res.best.prediction.step_seconds < min(presets)
    placed = {m: mp.params["weight"]["tp"] for m, mp in res.pipeline.plan.modules.items() if "weight" in mp.params}
    assert placed == {
        f"transformer.h.{i}.{m}": Shard(1) if m.endswith("c_proj") else Shard(0)
        for i in (0, 1)
        for m in ("attn.q", "attn.k", "attn.v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    for prog in res.pipeline.lower().programs.values():
        assert [c.kind for c in prog.comms if c.task == "FWD"] == ["all_reduce"] * 4  # attention and MLP of 2 blocks
    # saved as a plan file (its per-node operand layouts), it plans the same programs again
    saved = Plan.from_json(json.loads(json.dumps(res.pipeline.plan.to_json())))
    p = res.pipeline
    again = Pipeline.planned(p.graph, res.best.candidate.mesh, p.options, p.optimizer, None, saved)
    assert programs_fingerprint(again.lower().programs) == programs_fingerprint(p.lower().programs)
    # --explain on the MLP's first linear lists the program's choices, cheapest first: the column-parallel one taken
    fc = next(n.name for n in res.pipeline.graph.nodes if n.scope == "transformer.h.0.mlp.c_fc")
    chosen = explain(res, fc).split("# runner-up: ")[0]
    rows = [line for line in chosen.splitlines() if line.startswith("#     [")]
    assert rows[0].startswith("#     [Replicate(), Shard(0), Shard(0)] → [Shard(2)]") and rows[0].endswith("← chosen")
    assert sum(r.endswith("← chosen") for r in rows) == 1 and len(rows) >= 4


def test_where_nothing_fits_as_it_is_it_recomputes_or_accumulates():
    """A budget just under every candidate's peak as planned: the choice recomputes blocks or accumulates
    micro-steps (the fallbacks), fits, and says so in its flags."""
    free = run(2, screen=False)
    plain = [o for o in free.outcomes if o.prediction and o.candidate.ac == "none" and o.candidate.accumulate == 1]
    res = run(2, budget=min(max(o.prediction.peak_bytes) for o in plain) - 1)
    best = res.best.candidate
    assert best.ac == "block" or best.accumulate > 1
    assert max(res.best.prediction.peak_bytes) <= res.budget
    assert ("--ac" in best.flags()) == (best.ac == "block") and ("--accumulate" in best.flags()) == (
        best.accumulate > 1
    )


@pytest.mark.parametrize(
    "optimizer,momentum,copies", [(Optimizer.SGD, 0.0, 2), (Optimizer.SGD, 0.9, 3), (Optimizer.ADAMW, 0.0, 4)]
)
def test_the_state_floor_counts_each_optimizer_slot_once(optimizer, momentum, copies):
    """Weights, gradients and one copy per optimizer state slot (SGD none, with momentum one, AdamW two), plus the
    master weights under mixed precision, sharded by every axis but dp (a regression: the slots were counted by the
    letters of the optimizer's name, refusing 70B on 8 h100 with 131 GiB where 82 GiB is the floor)."""
    from shardflow.lower.cost import MixedPrecision
    from shardflow.search import Candidate, state_bytes

    opt = OptimizerConfig(optimizer, momentum=momentum)
    c = Candidate(Mesh.parse("dp=2,fsdp=4"), "hsdp")
    assert state_bytes(8000, c, opt, LowerOptions()) == copies * 8000 // 4
    mixed = LowerOptions(precision=MixedPrecision(torch.bfloat16, torch.float32))
    assert state_bytes(8000, c, opt, mixed) == (copies + 1) * 8000 // 4


def test_a_time_limit_answers_with_the_best_it_tried_once_one_fits(eight):
    order = candidates(8, blocks=2, batch=64, node=SPEC.devices_per_node)
    optimizer = OptimizerConfig(Optimizer.ADAMW)
    limited = search_model(MODEL, BATCH, 8, LowerOptions(), optimizer, SPEC, time_limit=0)
    *refused, found = limited.outcomes
    # with no time at all, candidates are tried until the first fits (the first ones split 4 heads 8 ways), then
    # no more; its figures are the unlimited search's
    assert all(o.prediction is None for o in refused) and found.fits and limited.best is found
    assert {o.candidate for o in limited.outcomes} <= set(order)
    same = next(o for o in eight.outcomes if o.candidate == found.candidate)
    assert found.prediction.step_seconds == same.prediction.step_seconds
    assert limited.unsearched == len(order) - len(limited.outcomes) > 0 and eight.unsearched == 0
    assert limited.to_json()["unsearched"] == limited.unsearched
    assert f"the time limit ran out: {limited.unsearched} candidates not tried" in limited.describe()
    # where that one does not fit the budget, the search goes on past the limit until one does
    budget = max(found.prediction.peak_bytes) - 1
    tight = search_model(MODEL, BATCH, 8, LowerOptions(), optimizer, SPEC, budget, time_limit=0)
    assert not next(o for o in tight.outcomes if o.candidate == found.candidate).fits
    assert tight.best.fits and max(tight.best.prediction.peak_bytes) <= budget
    assert tight.best.candidate != found.candidate and 0 < tight.unsearched <= limited.unsearched
    # past the limit with nothing fitting, it stops where no candidate left could fit by its estimate: none here
    with pytest.raises(SearchError, match=f"left {len(order)} candidates untried, none of which could fit by its"):
        search_model(MODEL, BATCH, 8, LowerOptions(), optimizer, SPEC, 1024, time_limit=0)
    with pytest.raises(ValueError, match="--search-seconds -1: give a finite number of seconds"):
        search_model(MODEL, BATCH, 8, LowerOptions(), optimizer, SPEC, time_limit=-1)


def test_plan_auto_with_a_time_limit_says_what_it_left(capsys):
    from shardflow.cli import main

    flags = ["plan", "--strategy", "auto", "--nproc", "8", "--machine", "h100", "--format", "json"]
    assert main([*flags, "--search-seconds", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unsearched"] > 0 and doc["tried"] >= 1
    assert main([*flags[:-2], "--search-seconds", "-2"]) == 2
    assert "--search-seconds -2.0 is out of range: give a finite value ≥ 0" in capsys.readouterr().err


def test_plan_auto_screens_by_default_and_searches_all_on_request(capsys):
    """`plan --strategy auto` leaves the candidates whose estimate could not win (docs/search.md#screening) and says
    how many; `--search-all` predicts every one of them and answers the same here."""
    from shardflow.cli import main

    flags = ["plan", "--strategy", "auto", "--nproc", "4", "--machine", "h100", "--format", "json"]
    assert main(flags) == 0
    screened = json.loads(capsys.readouterr().out)
    assert main([*flags, "--search-all"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert screened["screened"] > 0 and every["screened"] == 0
    assert every["tried"] + every["refused"] > screened["tried"] + screened["refused"]
    assert (screened["mesh"], screened["flags"]) == (every["mesh"], every["flags"])


def test_variants_that_cannot_fit_are_not_replayed():
    """Long sequences on a narrow model: every candidate's activations are far over a small budget as planned and
    fit only recomputed and accumulated. Screening leaves out a candidate's variants (itself, its fallbacks) whose
    estimated peak is over the budget — over FAR budgets under a pipeline — while a later one's could fit, but for
    the anchor of the line to every block recomputed (docs/search.md#screening): none of the pipelines replayed
    peaks at 2.5 budgets (before, the first one was replayed as planned: 3.1), none of the others at 3 (before:
    14, tp = 4 as planned), of each candidate one variant at most that does not recompute every block (the anchor),
    and the choice fits."""
    torch.manual_seed(0)
    narrow = GPT(GPTConfig(vocab_size=64, block_size=256, n_layer=4, n_head=4, n_embd=64))
    batch = {"idx": torch.randint(0, 64, (32, 256)), "targets": torch.randint(0, 64, (32, 256))}
    budget = 7 * 2**20
    res = run(4, budget, model=narrow, batch=batch, placements=False)
    pipelines = [max(o.prediction.peak_bytes) for o in res.outcomes if o.prediction and o.candidate.microbatches > 1]
    assert pipelines and max(pipelines) <= 2.5 * budget
    plain = [o.candidate for o in res.outcomes if o.prediction and o.candidate.microbatches == 1]
    peaks = [max(o.prediction.peak_bytes) for o in res.outcomes if o.prediction and o.candidate.microbatches == 1]
    assert plain and max(peaks) <= 3 * budget
    anchors = collections.Counter((c.mesh, c.strategy) for c in plain if c.ac != "block")
    assert max(anchors.values()) == 1  # before: 4 each (as planned, selective, accumulating 2 and 4)
    assert max(res.best.prediction.peak_bytes) <= budget
