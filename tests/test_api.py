"""``shardflow.parallelize``: a model and a batch in, a trainer out — on our GPT and on Hugging Face models built from
tiny configs (random init, nothing downloaded) — and ``load_model``, the factory specs of ``shardflow check``.

Numbers: float64 inside ``wide_floats`` (Hugging Face computes its loss in float32 otherwise), 2 SGD steps on the
local executor against eager PyTorch with torch.optim.SGD. A sharded step adds partial sums in another order than
one device does, so the two agree to rounding (~1e-15); 1e-9 is the tolerance ``shardflow check`` states and still
catches any wrong scale or misplaced block (O(1)) and a missed or doubled gradient reduction (O(lr) in the weights).
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from titan import titan_lambda
from torch import nn

import shardflow
from shardflow.api import StepDeviation
from shardflow.capture import wide_floats
from shardflow.model_spec import ModelSpecError, load_model
from shardflow.models import GPT, GPTConfig
from shardflow.parallel.mesh import Replicate, Shard
from shardflow.runtime.kernels import OptimizerConfig
from shardflow.strategy import PlanError

transformers = pytest.importorskip("transformers")

TOL = 1e-9
B, T = 4, 8


def our_gpt():
    model = GPT(GPTConfig(vocab_size=11, block_size=T, n_layer=1, n_head=4, n_embd=32))
    gen = torch.Generator().manual_seed(1)
    return model, {
        "idx": torch.randint(0, 11, (B, T), generator=gen),
        "targets": torch.randint(0, 11, (B, T), generator=gen),
    }


def hf_batch(vocab=96):
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def hf_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg), hf_batch()


def hf_gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=96,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        use_cache=False,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg), hf_batch()


class Detached(nn.Module):
    """Gradients stopped twice: by ``.detach()`` and by a ``torch.no_grad()`` region (capture once turned both into
    plain aliases, and the gradient flowed through them)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        h = torch.tanh(self.up(x))
        with torch.no_grad():
            scale = h.abs().mean() + 1.0
        z = self.down(h) / scale
        return nn.functional.cross_entropy(z, y) + (z * z.detach()).mean()


def detached():
    gen = torch.Generator().manual_seed(2)
    return Detached(), {
        "x": torch.randn(B, 8, generator=gen, dtype=torch.float64),
        "y": torch.randint(0, 4, (B,), generator=gen),
    }


def made(factory, dtype=torch.float64):
    torch.manual_seed(0)
    model, batch = factory()
    return model.to(dtype), batch


def eager_step(model, opt, batch) -> float:
    opt.zero_grad()
    out = model(**batch)
    loss = getattr(out, "loss", out)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("factory", [our_gpt, hf_llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("mesh", ["dp=2", "tp=2"])
def test_trainer_equals_eager(factory, mesh):
    """Each step's loss, then the state dict after 2 steps (every key of the module's, full tensors) and every
    replica of every weight piece equal eager PyTorch's."""
    equals_eager(factory, mesh)


@pytest.mark.parametrize("mesh", ["dp=2", "fsdp=2"])
def test_stopped_gradients_equal_eager(mesh):
    """``.detach()`` and ``torch.no_grad()`` stop the gradient as they do in eager PyTorch."""
    equals_eager(detached, mesh)


class PartlyFrozen(nn.Module):
    """An MLP whose first layer is frozen (``requires_grad=False``, as a fine-tuning run freezes a backbone)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)
        self.up.requires_grad_(False)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.down(torch.tanh(self.up(x))), y)


@pytest.mark.parametrize("mesh", ["dp=2", "tp=2", "fsdp=2"])
def test_frozen_parameters_are_not_trained(mesh):
    """A parameter with requires_grad=False takes no gradient, no optimizer state and no update (AdamW's weight decay
    included), as in eager PyTorch; the others train as eager's AdamW trains them."""
    model = PartlyFrozen().double()
    gen = torch.Generator().manual_seed(3)
    batch = {"x": torch.randn(B, 8, generator=gen, dtype=torch.float64), "y": torch.randint(0, 4, (B,), generator=gen)}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    kwargs = {"weight_decay": 0.1}
    trainer = shardflow.parallelize(
        model, batch, mesh=mesh, optimizer=torch.optim.AdamW, lr=0.1, optimizer_kwargs=kwargs
    )
    opt = shardflow.api.torch_optimizer(trainer.optimizer, [p for p in model.parameters() if p.requires_grad])
    for _ in range(2):
        assert abs(trainer.step(batch) - eager_step(model, opt, batch)) <= TOL
    assert set(trainer.grads()) == {"down.weight", "down.bias"}
    state = trainer.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=TOL, rtol=0, msg=k)
    assert all(torch.equal(state[k], v) for k, v in frozen.items())


def equals_eager(factory, mesh):
    model, batch = made(factory)
    with wide_floats():
        trainer = shardflow.parallelize(model, batch, mesh=mesh, lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = trainer.step(batch)
            assert abs(loss - eager_step(model, opt, batch)) <= TOL
            # the global gradient norm every step computes, as shardflow train logs it
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            assert trainer.grad_norm == pytest.approx(norm.item(), abs=TOL)
    state, want = trainer.state_dict(), model.state_dict()
    assert list(state) == list(want)
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, atol=TOL, rtol=0, msg=k)
    assert trainer.weight_error(want) <= TOL
    assert trainer.steps_done == 2


def test_accumulated_steps_equal_eager_on_the_whole_batch():
    """accumulate=2 on dp=2: the Llama is captured on 2 of the 4 sequences; each step runs 2 micro-steps (1 sequence
    per rank each), the weights' gradients reduced once; each step's loss, the gradients and every replica of every
    weight piece equal eager PyTorch's on the whole batch (TOL; a missing 1/2 would be O(1) in the gradients)."""
    from shardflow.runtime.batch import BatchSplitError

    model, batch = made(hf_llama)
    with wide_floats():
        trainer = shardflow.parallelize(model, batch, mesh="dp=2", lr=0.1, accumulate=2)
        assert trainer.graph.tensors["input_ids"].shape == (B // 2, T)
        steps = list(trainer.compare_with_eager(model, batch, 2))
    assert [s.step for s in steps] == [1, 2]
    assert all(s.dloss <= TOL and s.grad <= TOL and s.weight <= TOL for s in steps), steps
    with pytest.raises(BatchSplitError, match="3 rows along dim 0, which do not split into 2 micro-batches"):
        trainer.step({k: v[:3] for k, v in batch.items()})
    with pytest.raises(ValueError, match=r"is int64\[1, 8\], expected int64\[2, 8\] \(one of the 2 micro-batches"):
        trainer.step({k: v[:2] for k, v in batch.items()})
    assert trainer.steps_done == 2


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_microbatches_equal_eager_on_the_whole_batch(schedule):
    """microbatches=2 on pp=2 (issue #17): the Llama is captured on 2 of the 4 sequences; each step runs both
    microbatches through the 2 stages in the schedule's order and updates once; each step's loss, the gradients and
    every replica of every weight piece equal eager PyTorch's on the whole batch (TOL)."""
    model, batch = made(hf_llama)
    with wide_floats():
        trainer = shardflow.parallelize(model, batch, mesh="pp=2", lr=0.1, microbatches=2, schedule=schedule)
        assert trainer.graph.tensors["input_ids"].shape == (B // 2, T)
        steps = list(trainer.compare_with_eager(model, batch, 2))
    assert all(s.dloss <= TOL and s.grad <= TOL and s.weight <= TOL for s in steps), steps
    with pytest.raises(ValueError, match=r"one of the 2 micro-batches of accumulate=1 × microbatches=2"):
        trainer.step({k: v[:2] for k, v in batch.items()})
    with pytest.raises(ValueError, match="give --schedule interleaved with --stages-per-rank ≥ 2, or neither"):
        shardflow.parallelize(model, batch, mesh="pp=2", microbatches=2, stages_per_rank=2)


def test_dtensors_need_one_process_per_device():
    """On the local executor (every rank in this process) the trainer hands out no DTensors: the error names the
    fix (torchrun, or full tensors). Before a step there is no gradient to hand out. (The DTensors themselves:
    tests/test_distributed.py, case "dtensor".)"""
    model, batch = our_gpt()
    trainer = shardflow.parallelize(model, batch, mesh="dp=2", executor="local")
    with pytest.raises(ValueError, match="local executor runs every rank of mesh dp=2 in this one process.*torchrun"):
        trainer.dtensor_parameters()
    with pytest.raises(ValueError, match="no step has run yet"):
        trainer.dtensor_grads()
    trainer.step(batch)
    with pytest.raises(ValueError, match="read full tensors with state_dict"):
        trainer.dtensor_grads()


def test_tp_shards_llama_attention_and_mlp():
    """The strategy a tp=2 mesh names (tp) shards q/k/v and gate/up column-parallel, o_proj and down_proj
    row-parallel, in both layers; the plan prints with its summary."""
    model, batch = made(hf_llama, torch.float32)
    trainer = shardflow.parallelize(model, batch, mesh="tp=2")
    tensors = trainer.plan.pcg.tensors
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert tensors[f"{p}{name}.weight"].placements == (Shard(0),), name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert tensors[f"{p}{name}.weight"].placements == (Shard(1),), name
    assert tensors["model.norm.weight"].placements == (Replicate(),)
    text = str(trainer.plan)
    assert text.startswith("# strategy tp: mesh tp=2 (2 devices);")
    assert "weight   model.layers.0.self_attn.q_proj.weight: float32[64/2, 64] (S(0))" in text


def test_state_dict_of_tied_weights_loads_into_the_plain_module():
    """GPT-2 ties lm_head to wte (one graph weight) and fuses q|k|v in c_attn (held by parts, [64, 3, 64], sharded by
    heads under tp): the state dict has both tied keys, equal and trained, every parameter in its module's shape, and
    loads strictly into a fresh module, which then computes the trainer's next loss."""
    model, batch = made(hf_gpt2)
    with wide_floats():
        trainer = shardflow.parallelize(model, batch, mesh="dp=2,tp=2", lr=0.5)
        assert trainer.plan.pcg.tensors["transformer.h.0.attn.c_attn.weight"].placements == (Replicate(), Shard(2))
        first = trainer.step(batch)
        state = trainer.state_dict()
        assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
        assert not torch.equal(state["lm_head.weight"], model.lm_head.weight)  # trained; the module is left as it was
        fresh, _ = made(hf_gpt2)
        fresh.load_state_dict(state)  # strict: every key, every shape
        after = fresh(**batch).loss.item()
        assert after < first and abs(after - trainer.step(batch)) <= TOL


def test_compare_with_eager_reports_each_step_and_sees_a_difference(monkeypatch):
    """On dp=2 every deviation is rounding; with eager PyTorch's learning rate doubled, the weights part after the
    first update (by lr × gradient: far beyond rounding) while the first loss still agrees."""
    model, batch = made(our_gpt)
    trainer = shardflow.parallelize(model, batch, mesh="dp=2", optimizer=OptimizerConfig("sgd", 0.1, momentum=0.9))
    rows = list(trainer.compare_with_eager(model, batch, 2))
    assert [r.step for r in rows] == [1, 2] and all(isinstance(r, StepDeviation) for r in rows)
    assert max(max(r.dloss, r.grad, r.weight) for r in rows) <= TOL
    assert rows[1].loss < rows[0].loss

    model, batch = made(our_gpt)
    trainer = shardflow.parallelize(model, batch, mesh="dp=2", lr=0.1)
    monkeypatch.setattr(shardflow.api, "torch_optimizer", lambda cfg, params: torch.optim.SGD(params, lr=0.2))
    first = next(trainer.compare_with_eager(model, batch, 1))
    assert first.dloss <= TOL and first.grad <= TOL and first.weight > 1e-4


def test_compare_with_eager_refuses_what_cannot_match():
    """A model already trained apart from the trainer, and a model with dropout (eager draws other masks)."""
    model, batch = made(our_gpt)
    trainer = shardflow.parallelize(model, batch, mesh="dp=2")
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(ValueError, match="parameters differ from the trainer's weights by up to 1"):
        trainer.compare_with_eager(model, batch, 1)

    torch.manual_seed(0)
    dropping = GPT(GPTConfig(vocab_size=11, block_size=T, n_layer=1, n_head=4, n_embd=32, dropout=0.1))
    trainer = shardflow.parallelize(dropping, batch, mesh="dp=2")
    with pytest.raises(ValueError, match=r"draws random numbers \(dropout\) in 'transformer.drop', "):
        trainer.compare_with_eager(dropping, batch, 1)
    assert trainer.steps_done == 0


def test_step_checks_the_batch_against_the_example():
    model, batch = made(our_gpt)
    trainer = shardflow.parallelize(model, batch, mesh="dp=2")
    with pytest.raises(KeyError, match=r"missing input\(s\): 'targets' \(expected int64\[4, 8\]\)"):
        trainer.step({"idx": batch["idx"]})
    with pytest.raises(ValueError, match=r"input 'idx' is int64\[2, 8\], expected int64\[4, 8\]"):
        trainer.step({"idx": batch["idx"][:2], "targets": batch["targets"][:2]})
    assert trainer.steps_done == 0


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"optimizer": OptimizerConfig("sgd", 0.1), "lr": 0.2}, ValueError, "set lr and the options in the config"),
        ({"optimizer": "lion"}, ValueError, "lion"),
        ({"executor": "gpu"}, ValueError, "use one of local, distributed, auto"),
        ({"strategy": "dp", "plan": shardflow.Plan()}, PlanError, "a strategy or a plan, not both"),
        ({"mesh": "x=2"}, PlanError, "axis 'x' names no preset strategy"),
        ({"plan": "/nonexistent/plan.toml"}, PlanError, "No such file"),
        ({"accumulate": 0}, ValueError, r"accumulate=0: give the micro-steps per step, 1 \(no accumulation\) or more"),
        ({"accumulate": 3}, ValueError, r"input 'idx' \[4, 8\] has 4 rows along dim 0, which do not split into 3 "),
    ],
)
def test_parallelize_argument_errors(kwargs, error, words):
    model, batch = our_gpt()
    with pytest.raises(error, match=words):
        shardflow.parallelize(model, batch, **{"mesh": "dp=2", **kwargs})


def test_a_user_plan_and_a_single_device_mesh():
    """A Plan object (the classifier's Megatron pair on tp) and a one-device mesh (strategy single) both train as
    eager does."""

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.net(x), y)

    gen = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(B, 8, dtype=torch.float64, generator=gen), "y": torch.randint(0, 4, (B,), generator=gen)}

    plan = shardflow.Plan(
        modules={
            "net.0": shardflow.ModulePlan(params={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}),
            "net.2": shardflow.ModulePlan(params={"weight": {"tp": Shard(1)}}, output={"tp": Replicate()}),
        }
    )
    for mesh, kw in (("tp=2", {"plan": plan}), ("d=1", {})):
        torch.manual_seed(0)
        model = Classifier().double()
        trainer = shardflow.parallelize(model, batch, mesh=mesh, **kw)
        rows = list(trainer.compare_with_eager(model, batch, 2))
        assert max(max(r.dloss, r.grad, r.weight) for r in rows) <= TOL
        assert trainer.plan.name == ("user" if kw else "single")
    assert trainer.plan.pcg.mesh.size == 1


def test_wide_floats_keeps_float64_through_every_spelling_of_to():
    """``shardflow check --dtype float64`` runs the model inside wide_floats: a cast down stays float64 however it is
    spelled (Module.to passes device, dtype and non_blocking positionally), and other conversions still happen."""
    x = torch.ones(2, dtype=torch.float64)
    with wide_floats():
        assert {
            y.dtype
            for y in (
                x.float(),
                x.to(torch.float32),
                x.to(None, torch.float16, False),
                x.to(dtype=torch.bfloat16),
                x.to("cpu", torch.float32),
            )
        } == {torch.float64}
        assert x.to(torch.int64).dtype == torch.int64 and x.float().to(torch.float32) is x
        module = nn.Linear(2, 2).double().to(torch.float64)
        assert module.weight.dtype == torch.float64
    assert x.float().dtype == torch.float32


# --- load_model ---------------------------------------------------------------------------------------------------

FACTORIES = """
import torch
from torch import nn
from sibling import WIDTH


def good():
    return nn.Linear(WIDTH, 2), {"input": torch.randn(3, WIDTH)}


def random_weight():
    return torch.rand(()).item()


class Builder:
    @staticmethod
    def tiny():
        return good()


def wrong():
    return nn.Linear(2, 2)


def flagged():
    return nn.Linear(2, 2), {"input": torch.zeros(2, 2), "use_cache": False}


def raises():
    return undefined_name
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A file of factories importing a sibling module, also importable as ``mypkg.factories``."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "factories.py").write_text(FACTORIES)
    (pkg / "sibling.py").write_text("WIDTH = 5\n")
    monkeypatch.syspath_prepend(str(pkg))  # where load_model would put it (sys.path is restored after the test)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg / "factories.py"
    for name in ("mypkg", "mypkg.factories", "sibling", "shardflow_model_factories"):
        sys.modules.pop(name, None)


def test_load_model_from_a_file_and_a_module(factories):
    for spec in (f"{factories}:good", "mypkg.factories:good", f"{factories}:Builder.tiny"):
        model, batch = load_model(spec)
        assert isinstance(model, nn.Linear) and model.in_features == 5 and list(batch) == ["input"]
    # seeded before the call: every process that loads a spec builds the same weights
    assert load_model(f"{factories}:good")[0].weight.equal(load_model("mypkg.factories:good")[0].weight)


@pytest.mark.parametrize(
    "name, words",
    [
        ("missing", "has no 'missing'; its functions: flagged, good, raises, random_weight, wrong"),
        (
            "wrong",
            "wrong() must return (module, batch): an nn.Module and a dict of input name → tensor; it returned Linear",
        ),
        ("random_weight", "random_weight() must return (module, batch)"),
        (
            "flagged",
            "the batch has non-tensor entries 'use_cache' (bool) (settings such as use_cache=False belong in "
            "the model's config)",
        ),
        ("raises", "calling raises() raised NameError: name 'undefined_name' is not defined (at "),
    ],
)
def test_load_model_errors_name_the_spec_and_the_fix(factories, name, words):
    with pytest.raises(ModelSpecError) as e:
        load_model(f"{factories}:{name}")
    assert str(e.value).startswith(f"--model {factories}:{name}: ") and words in str(e.value)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("nofile.py:f", "no file nofile.py (from "),
        ("no_such_package.models:f", "no module named 'no_such_package.models' (a file needs its .py suffix)"),
        ("examples/hf_llama.py", "write FILE.py:FACTORY or package.module:FACTORY"),
    ],
)
def test_load_model_errors_for_what_cannot_be_found(spec, words):
    with pytest.raises(ModelSpecError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_model(spec)


def test_wide_floats_keeps_float64_through_dtype_arguments_and_complex_casts():
    """Gemma 2's attention calls ``softmax(x, dtype=torch.float32)``: inside wide_floats the argument is widened too
    (the eager side of a float64 check otherwise rounds there and shardflow's capture does not); a complex128 tensor
    stays complex128."""
    x = torch.randn(2, 3, dtype=torch.float64)
    z = torch.randn(2, 3, dtype=torch.complex128)
    with wide_floats():
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert x.sum(dtype=torch.float32).dtype == torch.float64
        assert z.to(torch.complex64).dtype == torch.complex128
        assert torch.softmax(x.to(torch.float32), -1).dtype == torch.float64
    assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float32


def test_at_dtype_keeps_the_imaginary_part_of_complex_buffers():
    """``Module.to(torch.float64)`` casts a complex buffer to float64, dropping its imaginary part (torchtitan's
    rotary table ``freqs_cis``); at_dtype makes it complex128 and says what it converted."""
    from shardflow.capture import at_dtype

    module = nn.Linear(2, 2)
    table = torch.polar(torch.ones(3), torch.tensor([0.5, 1.0, 2.0]))
    module.register_buffer("table", table)
    model, batch, changed = at_dtype(module, {"x": torch.ones(2), "i": torch.ones(2, dtype=torch.int64)}, torch.float64)
    assert model.table.dtype == torch.complex128 and torch.equal(model.table, table.to(torch.complex128))
    assert model.weight.dtype == torch.float64 and batch["x"].dtype == torch.float64 and batch["i"].dtype == torch.int64
    assert changed == {
        "weight": ("float32", "float64"),
        "bias": ("float32", "float64"),
        "table": ("complex64", "complex128"),
        "batch.x": ("float32", "float64"),
    }


# --- the torchtitan user's API: torch.optim classes, an lr schedule, clipping, a DeviceMesh -----------------------


@pytest.mark.parametrize(
    "decay, warmup, min_ratio", [("constant", 3, 0.0), ("cosine", 2, 0.1), ("linear", 0, 0.0), ("cosine", 0, 0.0)]
)
def test_lr_schedule_equals_torchtitans_lambda_lr(decay, warmup, min_ratio):
    """Each step's learning rate equals torch's LambdaLR with torchtitan's formula, stepped after each optimizer
    step (step s, counted from 1, trains at the factor of scheduler step s − 1)."""
    steps, peak = 10, 0.5
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=peak)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, titan_lambda(warmup, steps, decay, min_ratio))
    cfg = OptimizerConfig("sgd", peak, schedule=shardflow.LRSchedule(decay, warmup, steps, min_ratio))
    for step in range(1, steps + 1):
        assert cfg.lr_at(step) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-15), step
        opt.step()
        sched.step()
    assert cfg.lr_at(steps) == pytest.approx(peak * (min_ratio if decay != "constant" else 1.0))


@pytest.mark.parametrize(
    "optimizer, kwargs",
    [
        (torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}),
        (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "foreach": True}),
        (functools.partial(torch.optim.SGD, momentum=0.9), {"lr": 0.1, "weight_decay": 0.01}),
    ],
    ids=["adam", "adamw", "sgd-partial"],
)
def test_torch_optim_class_schedule_and_clipping_equal_eager(optimizer, kwargs):
    """The user's torch.optim class and options, a warm-up + cosine schedule and clipping by global norm on dp=2:
    3 steps' losses and the weights equal eager torch.optim with LambdaLR (torchtitan's formula) and
    clip_grad_norm_ (float64, TOL). Adam's L2 weight decay (added to the gradient) and AdamW's decoupled one
    differ by O(lr·wd) per step: either mix-up fails."""
    model, batch = made(our_gpt)
    schedule = shardflow.LRSchedule("cosine", warmup_steps=1, steps=3, min_lr_ratio=0.1)
    with wide_floats():
        trainer = shardflow.parallelize(
            model,
            batch,
            mesh="dp=2",
            optimizer=optimizer,
            optimizer_kwargs=kwargs,
            lr_schedule=schedule,
            clip_norm=0.05,
        )
        opt = (optimizer.func if isinstance(optimizer, functools.partial) else optimizer)(
            model.parameters(), **{**getattr(optimizer, "keywords", {}), **kwargs}
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, titan_lambda(1, 3, "cosine", 0.1))
        for step in range(1, 4):
            loss = trainer.step(batch)
            opt.zero_grad()
            eager = model(**batch)
            eager.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            sched.step()
            assert abs(loss - eager.item()) <= TOL, step
    assert trainer.optimizer.name == {torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}.get(optimizer, "sgd")
    assert trainer.weight_error(model.state_dict()) <= TOL


@pytest.mark.parametrize(
    "optimizer, kwargs, words",
    [
        (
            torch.optim.LBFGS,
            {},
            r"optimizer=LBFGS: shardflow updates each shard .* only optimizers whose update is "
            r"elementwise.*Pass torch.optim.SGD, torch.optim.Adam or torch.optim.AdamW",
        ),
        (torch.optim.RMSprop, {}, r"optimizer=RMSprop: .* Pass torch.optim.SGD"),
        (
            torch.optim.Adam,
            {"amsgrad": True},
            r"optimizer=Adam with amsgrad=True: shardflow computes Adam's update with "
            r"torch.optim's default for amsgrad only .* drop amsgrad=True",
        ),
        (torch.optim.SGD, {"nesterov": True, "momentum": 0.9}, r"SGD with nesterov=True: .* drop nesterov=True"),
        (torch.optim.AdamW, {"momentum": 0.9}, r"AdamW: no option momentum; AdamW takes lr, betas"),
        (functools.partial(torch.optim.SGD, 0.1), {}, r"give its options by name"),
        ("sgd", {"lr": 0.1}, r"options go with a torch.optim class"),
        (OptimizerConfig("adam"), {"lr": 0.1}, r"set lr and the options in the config"),
    ],
)
def test_optimizers_shardflow_does_not_compute_are_refused(optimizer, kwargs, words):
    model, batch = our_gpt()
    with pytest.raises(ValueError, match=words):
        shardflow.parallelize(model, batch, mesh="dp=2", optimizer=optimizer, optimizer_kwargs=kwargs)


def test_adam_with_decoupled_weight_decay_is_adamw():
    """torch.optim.Adam(decoupled_weight_decay=True) is AdamW, as torch documents."""
    from shardflow.api import from_torch_optim

    cfg = from_torch_optim(torch.optim.Adam, {"decoupled_weight_decay": True, "lr": torch.tensor(0.5)})
    assert cfg == OptimizerConfig("adamw", 0.5)  # a 0-dim tensor lr taken as its value


@pytest.fixture
def world_of_one(tmp_path):
    """A one-process gloo group (file:// rendezvous in tmp_path): what init_device_mesh needs to make a DeviceMesh;
    destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_device_mesh_is_taken_for_its_names_and_shape(world_of_one):
    """A torch DeviceMesh (init_device_mesh on the CPU, world 1) is the Mesh of its dim names and sizes: the
    one-device dp mesh trains as eager does; a DeviceMesh without names is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardflow.api import as_mesh

    assert as_mesh(init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))) == shardflow.Mesh(("dp", "tp"), (1, 1))
    with pytest.raises(ValueError, match="a DeviceMesh without mesh_dim_names; name its axes"):
        as_mesh(init_device_mesh("cpu", (1,)))
    model, batch = made(our_gpt)
    with wide_floats():
        trainer = shardflow.parallelize(
            model, batch, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), lr=0.1
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert abs(trainer.step(batch) - eager_step(model, opt, batch)) <= TOL
    assert trainer.plan.pcg.mesh == shardflow.Mesh(("dp",), (1,))
    assert trainer.weight_error(model.state_dict()) <= TOL
