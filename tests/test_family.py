"""What `shardflow train --model` builds (shardflow.train.family): Hugging Face configs sized by defaults,
--model-config and flags; how each model takes a batch; the errors of sizes and feeds that make no model."""

import json

import pytest
import torch
from torch import nn

from shardflow.train.family import Feed, ModelError, Sizes, factory_family, hf_config, hf_family


def test_default_llama_and_gpt2_sizes():
    llama = hf_config(None, None, Sizes(), vocab_size=300, seq_len=32, dropout=0.0)
    assert (
        llama.model_type,
        llama.num_hidden_layers,
        llama.num_attention_heads,
        llama.num_key_value_heads,
        llama.hidden_size,
        llama.intermediate_size,
    ) == ("llama", 2, 4, 2, 128, 384)  # 8/3·128 → a multiple of 64
    assert (llama.vocab_size, llama.max_position_embeddings, llama.use_cache) == (300, 32, False)
    gpt2 = hf_config("gpt2", None, Sizes(layers=3, embd=64), vocab_size=300, seq_len=32, dropout=0.1)
    assert (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, gpt2.n_inner, gpt2.n_positions) == (3, 4, 64, 256, 32)
    assert (gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop) == (0.1, 0.1, 0.0)  # no dropout inside attention


def test_model_config_file_sizes_and_flags_override(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
            }
        )
    )
    c = hf_config(None, str(path), Sizes(layers=1), vocab_size=300, seq_len=32, dropout=0.0)
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("qwen2", 1, 64, 96)
    assert (c.vocab_size, c.max_position_embeddings) == (300, 128)  # the tokenizer's; the file's positions
    model = hf_family("qwen2").build(c)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ModelError, match="--model llama but --model-config .* is of model_type 'qwen2'"):
        hf_config("llama", str(path), Sizes(), 300, 32, 0.0)


@pytest.mark.parametrize(
    "model, sizes, dropout, words",
    [
        (None, Sizes(heads=3), 0.0, ["--embd 128 is not a multiple of --heads 3", "e.g. --heads 2"]),
        (None, Sizes(heads=4, kv_heads=3), 0.0, ["--heads 4 is not a multiple of --kv-heads 3"]),
        ("gpt2", Sizes(kv_heads=2), 0.0, ["--kv-heads 2: gpt2 has no grouped-query attention"]),
        (None, Sizes(), 0.1, ["--dropout 0.1: llama has dropout only inside attention", "train gpt2"]),
        ("nonsense", Sizes(), 0.0, ["--model nonsense: not a model type of transformers", "FILE.py:FACTORY"]),
    ],
)
def test_sizes_that_make_no_model(model, sizes, dropout, words):
    with pytest.raises(ModelError) as e:
        hf_config(model, None, sizes, 300, 32, dropout)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_hugging_face_model_is_fed_so_its_loss_is_the_next_token_loss():
    """input_ids, labels and shift_labels = targets: transformers does not shift again; the loss is the mean
    cross-entropy over every position, as forward(idx, targets) of a model that takes the targets shifted."""
    config = hf_config(None, None, Sizes(layers=1, embd=32), 50, 8, 0.0)
    torch.manual_seed(0)
    model = hf_family("llama").build(config)
    tokens = torch.randint(0, 50, (2, 9))
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    loss = model(**Feed.CAUSAL_LM.inputs(idx, targets)).loss
    logits = model(input_ids=idx).logits
    assert torch.allclose(loss, nn.functional.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1)))


FACTORIES = """
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

class Bigram(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)
    def logits(self, idx):
        return self.table(idx)
    def forward(self, idx, targets):
        return nn.functional.cross_entropy(self.logits(idx).flatten(0, 1), targets.flatten())

def bigram(vocab_size=7):
    return Bigram(vocab_size), {"idx": torch.zeros(2, 4, dtype=torch.long), "targets": torch.zeros(2, 4, dtype=torch.long)}

def hf(vocab_size=7):
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    ids = torch.zeros(2, 4, dtype=torch.long)
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}

def not_hf():
    return Bigram(7), {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}

def other_keys():
    return Bigram(7), {"x": torch.zeros(2, 4, dtype=torch.long)}
"""


def test_factories_are_fed_by_their_batch_keys(tmp_path):
    f = tmp_path / "factories.py"
    f.write_text(FACTORIES)
    family, config = factory_family(f"{f}:bigram", 300)
    assert family.feed is Feed.NEXT_TOKEN and family.build(config).table.num_embeddings == 300  # the tokenizer's
    idx = torch.tensor([[1, 2, 3]])
    assert family.logits(family.build(config), idx).shape == (1, 3, 300)
    family, config = factory_family(f"{f}:hf", 300)
    assert family.feed is Feed.CAUSAL_LM and family.build(config).config.vocab_size == 300
    with pytest.raises(ModelError, match="input_ids and labels \\(a Hugging Face PreTrainedModel\\)"):
        factory_family(f"{f}:not_hf", 300)
    with pytest.raises(ModelError, match="the factory's batch has x"):
        factory_family(f"{f}:other_keys", 300)


def test_size_flags_do_not_apply_to_a_factory(tmp_path):
    from shardflow.train.config import TrainConfig
    from shardflow.train.recipe import build_model

    f = tmp_path / "factories.py"
    f.write_text(FACTORIES)
    with pytest.raises(ModelError, match=f"--layers 2: size the built-in models .* --model {f}:bigram sizes its own"):
        build_model(TrainConfig(model=f"{f}:bigram", layers=2), 300, None)
    family, config, module = build_model(TrainConfig(model=f"{f}:bigram"), 300, None)
    assert family.name == f"{f}:bigram" and config.vocab_size == 300


def test_mlp_sets_the_mlp_width(tmp_path):
    """--mlp sets the MLP width (intermediate_size; GPT-2's n_inner) over the family's rule and a --model-config's own;
    a checkpoint must share it to be resumed."""
    assert hf_config(None, None, Sizes(mlp=200), 300, 32, 0.0).intermediate_size == 200
    assert hf_config("gpt2", None, Sizes(embd=64, mlp=100), 300, 32, 0.0).n_inner == 100
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96}))
    assert hf_config(None, str(path), Sizes(), 300, 32, 0.0).intermediate_size == 96
    assert hf_config(None, str(path), Sizes(mlp=80), 300, 32, 0.0).intermediate_size == 80
    assert ("intermediate_size", "--mlp") in hf_family("llama").must_match
    assert ("n_inner", "--mlp") in hf_family("gpt2").must_match


def test_a_resized_config_recomputes_its_head_size():
    """A Hugging Face config computes head_dim from its width and heads when it is made; the size flags change both
    after, so the head size must follow them (the main job's Llama: 128 wide, 4 heads → 32, not LlamaConfig's 128)."""
    from shardflow.train.family import Sizes, hf_config

    assert hf_config("llama", None, Sizes(), 1024, 64, 0.0).head_dim == 32
    c = hf_config("llama", None, Sizes(embd=256, heads=8), 1024, 64, 0.0)
    assert c.head_dim == 32 and c.hidden_size == 256


def test_a_config_files_own_residual_and_embedding_dropout_is_kept(tmp_path):
    """A GPT-2 config.json with resid_pdrop 0.1 and embd_pdrop 0.2 (before: zeroed without a word by the default
    --dropout 0): kept as the file says; --dropout 0.3 replaces both; attention dropout stays 0 (refused when asked)."""
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_embd": 64,
                "n_layer": 1,
                "n_head": 4,
                "resid_pdrop": 0.1,
                "embd_pdrop": 0.2,
                "attn_pdrop": 0.0,
            }
        )
    )
    kept = hf_config(None, str(path), Sizes(), vocab_size=300, seq_len=32, dropout=0.0)
    assert (kept.resid_pdrop, kept.embd_pdrop, kept.attn_pdrop) == (0.1, 0.2, 0.0)
    flag = hf_config(None, str(path), Sizes(), vocab_size=300, seq_len=32, dropout=0.3)
    assert (flag.resid_pdrop, flag.embd_pdrop) == (0.3, 0.3)
