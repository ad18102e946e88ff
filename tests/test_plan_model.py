"""`shardflow plan` (and `check`) size a model with `shardflow train`'s flags (--model-config, --layers ... --mlp,
--vocab-size, --seq-len, --batch-size), read into the same config train builds; plan builds it on the meta device."""

import json

import pytest

from shardflow import cli
from shardflow.cli import build_parser, main, model_and_batch
from shardflow.train.config import TrainConfig
from shardflow.train.recipe import build_model

# train's flags that size the model (TrainConfig's fields): plan and check have each, with train's default
MODEL_FLAGS = (
    "model",
    "model_config",
    "layers",
    "heads",
    "kv_heads",
    "embd",
    "mlp",
    "vocab_size",
    "seq_len",
    "batch_size",
)

QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture
def qwen2(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2))
    return str(path)


def weights(out: str) -> dict[str, str]:
    """``--graph``'s weights: name → type (``float32[96, 64]``)."""
    return dict(line.removeprefix("weight   ").split(": ") for line in out.splitlines() if line.startswith("weight "))


@pytest.mark.parametrize("command", ["plan", "check"])
def test_every_model_flag_of_train_with_its_default(command):
    train = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    ours = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices[command]._actions}
    for name in MODEL_FLAGS:
        assert train[name].option_strings[0] in ours[name].option_strings, name
    args = build_parser().parse_args([command])
    assert cli.train_settings(args) == TrainConfig()  # nothing given: train's defaults
    assert build_parser().parse_args([command, "--vocab", "300"]).vocab_size == 300  # the flag's earlier name


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--layers", "1", "--heads", "2", "--kv-heads", "1", "--embd", "32", "--mlp", "80", "--vocab-size", "300"],
        ["--model", "gpt2", "--layers", "1", "--mlp", "96", "--seq-len", "16"],
        ["CONFIG", "--layers", "2", "--mlp", "160", "--seq-len", "256"],
    ],
)
def test_train_and_plan_build_the_same_config(flags, qwen2):
    flags = [x for f in flags for x in (["--model-config", qwen2] if f == "CONFIG" else [f])]
    cfg = TrainConfig.from_args(build_parser().parse_args(["train", *flags]))
    _, trains, _ = build_model(cfg, cfg.vocab_size, None)
    model, batch = model_and_batch(build_parser().parse_args(["plan", *flags]), meta=True)
    assert model.config.to_dict() == trains.to_dict()
    assert batch["input_ids"].shape == (cfg.batch_size, cfg.seq_len)


def test_plan_takes_the_model_config_and_mlp(capsys, qwen2):
    assert main(["plan", "--model-config", qwen2, "--graph"]) == 0
    w = weights(capsys.readouterr().out)
    assert w["model.layers.2.mlp.gate_proj.weight"] == "float32[96, 64]"  # the file's sizes, train's vocabulary
    assert w["model.embed_tokens.weight"] == "float32[1024, 64]"
    assert (
        main(["plan", "--model-config", qwen2, "--layers", "1", "--mlp", "80", "--vocab-size", "300", "--graph"]) == 0
    )
    w = weights(capsys.readouterr().out)
    assert "model.layers.1.mlp.up_proj.weight" not in w
    assert (w["model.layers.0.mlp.up_proj.weight"], w["model.layers.0.mlp.down_proj.weight"]) == (
        "float32[80, 64]",
        "float32[64, 80]",
    )
    assert w["lm_head.weight"] == "float32[300, 64]"
    argv = ["plan", "--model-config", qwen2, "--layers", "1", "--mlp", "80", "--format", "json", "--rank", "0"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    inputs = {x["value"]: x["shape"] for x in doc["ranks"][0]["inputs"]}
    assert doc["verified"] and inputs["fwd:model.layers.0.mlp.down_proj.weight"] == [64, 80 // 2]  # tp=2: row-parallel


def test_check_takes_the_same_flags_with_real_weights(qwen2):
    model, _ = model_and_batch(build_parser().parse_args(["check", "--model-config", qwen2, "--mlp", "80"]))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert (
        model.model.layers[0].mlp.up_proj.weight.shape == (80, 64)
        and float(model.lm_head.weight.detach().abs().sum()) > 0
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "gpt", "--mlp", "80"], ["--mlp 80: sizes the Hugging Face models", "drop --mlp"]),
        (["--model", "mlp", "--model-config", "c.json"], ["--model-config c.json", "--model mlp sizes its own model"]),
        (["--model", "examples/hf_llama.py:tiny_llama", "--mlp", "8"], ["--mlp 8", "drop --mlp"]),
        (["--mlp", "0"], ["--mlp 0 is out of range"]),
    ],
)
def test_size_flags_a_model_does_not_take(capsys, argv, words):
    assert main(["plan", *argv, "--graph"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardflow plan: error: ") and err.count("\n") == 1
    assert all(w in err for w in words), err


def test_plan_builds_the_model_on_the_meta_device(capsys, monkeypatch):
    """Llama-3.1-8B's widths with two layers (1.5 billion parameters: 6 GB in float32) plan in seconds: the
    parameters are on the meta device when captured, the buffers (rotary table) real."""
    seen = {}
    capture = cli.capture

    def spy(model, batch, **kw):
        seen["params"] = {p.device.type for p in model.parameters()}
        seen["buffers"] = {b.device.type for b in model.buffers()}
        seen["count"] = sum(p.numel() for p in model.parameters())
        return capture(model, batch, **kw)

    monkeypatch.setattr(cli, "capture", spy)
    eight_b = ["--layers", "2", "--embd", "4096", "--heads", "32", "--kv-heads", "8", "--mlp", "14336"]
    assert main(["plan", *eight_b, "--vocab-size", "128256", "--dtype", "bf16", "--graph"]) == 0
    assert seen == {"params": {"meta"}, "buffers": {"cpu"}, "count": 1_486_901_248}
    assert "weight   model.layers.1.mlp.down_proj.weight: bfloat16[4096, 14336]" in capsys.readouterr().out
