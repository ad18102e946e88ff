"""Tiny models nobody wrote for shardflow, for the model matrix (tests/test_model_matrix.py, docs/models.md):
Hugging Face families built from configs (random init, nothing downloaded) and a torchtitan-style Llama 3.

Each factory returns ``(module, batch)`` as ``shardflow check --model tests/zoo.py:NAME`` takes it:
``module(**batch)`` returns the loss or an output with ``.loss``. Sizes: 2 layers, width 64, 4 heads (2 key/value
heads where the family has grouped-query attention), vocabulary 96, a batch of 2 sequences of 8 tokens (images of
2 × 3 × 16 × 16 for ViT). Dropouts are 0 (a check compares against eager PyTorch, which draws other numbers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, B, T = 96, 2, 8
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    use_cache=False,
)


def _tokens(seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _causal(make, vocab_size: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A causal LM (``make(vocab_size)``) and its batch, the labels being the tokens (the model shifts them)."""
    torch.manual_seed(0)
    ids = _tokens(vocab=vocab_size)
    return make(vocab_size), {"input_ids": ids, "labels": ids}


def _hf(cls: str, config: str, **kw):
    """``make(vocab_size)`` of Hugging Face's ``cls`` from ``config(**kw)``; ``shardflow train --model`` passes its
    tokenizer's vocabulary size to a factory that takes ``vocab_size``."""
    import transformers

    return lambda vocab_size=VOCAB: getattr(transformers, cls)(
        getattr(transformers, config)(**{**kw, "vocab_size": vocab_size})
    )


# --- torchtitan's Llama 3, as its models/llama3 writes it: the rotary table a complex64 buffer (torch.polar),
# applied by view_as_complex → complex multiply → view_as_real; separate wq/wk/wv; the loss outside the model.
def _rotary_table(head_dim: int, length: int, theta: float = 10000.0) -> torch.Tensor:
    """[length, head_dim / 2] complex64: e^(i·t·θ^(-2k/head_dim)) for position t and frequency k."""
    freqs = theta ** -(torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated pairwise by table [T', D/2] (complex), in float32 then back to x's dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [B, T, H, D/2]
    rotated = torch.view_as_real(pairs * table[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return rotated.type_as(x)


class _TitanAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = _rotate(self.wq(x).view(b, t, -1, self.head_dim), table)
        k = _rotate(self.wk(x).view(b, t, -1, self.head_dim), table)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        rep = self.heads // self.kv_heads  # repeat_kv
        k, v = (
            y.unsqueeze(3).expand(b, t, self.kv_heads, rep, self.head_dim).reshape(b, t, self.heads, -1) for y in (k, v)
        )
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, t, -1))


class _TitanBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention = _TitanAttention(dim, heads, kv_heads)
        self.w1, self.w2, self.w3 = (
            nn.Linear(dim, hidden, bias=False),
            nn.Linear(hidden, dim, bias=False),
            nn.Linear(dim, hidden, bias=False),
        )
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TitanLlama3(nn.Module):
    """torchtitan's Llama 3 at debug size: ``forward(tokens, labels)`` → the mean cross-entropy of next tokens."""

    def __init__(
        self,
        vocab: int = VOCAB,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        hidden: int = 128,
        max_seq: int = 64,
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", _rotary_table(dim // heads, max_seq), persistent=True)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(dim, heads, kv_heads, hidden) for i in range(layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(0, 1))


def torchtitan_llama3(vocab_size: int = VOCAB):
    torch.manual_seed(0)
    ids = _tokens(vocab=vocab_size)
    return TitanLlama3(vocab_size), {"tokens": ids, "labels": ids}


# --- Hugging Face families ------------------------------------------------------------------------------------
def llama(vocab_size: int = VOCAB):
    return _causal(_hf("LlamaForCausalLM", "LlamaConfig", **SIZES, num_key_value_heads=2), vocab_size)


def gpt2(vocab_size: int = VOCAB):
    return _causal(
        _hf(
            "GPT2LMHeadModel",
            "GPT2Config",
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            use_cache=False,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        ),
        vocab_size,
    )


def qwen3(vocab_size: int = VOCAB):
    return _causal(_hf("Qwen3ForCausalLM", "Qwen3Config", **SIZES, num_key_value_heads=2, head_dim=16), vocab_size)


def gemma2(vocab_size: int = VOCAB):
    return _causal(_hf("Gemma2ForCausalLM", "Gemma2Config", **SIZES, num_key_value_heads=2, head_dim=16), vocab_size)


def gemma3(vocab_size: int = VOCAB):
    return _causal(
        _hf("Gemma3ForCausalLM", "Gemma3TextConfig", **SIZES, num_key_value_heads=2, head_dim=16), vocab_size
    )


def phi3(vocab_size: int = VOCAB):
    return _causal(_hf("Phi3ForCausalLM", "Phi3Config", **SIZES, num_key_value_heads=2, pad_token_id=0), vocab_size)


def olmo2(vocab_size: int = VOCAB):
    return _causal(_hf("Olmo2ForCausalLM", "Olmo2Config", **SIZES, num_key_value_heads=2), vocab_size)


def gpt_neox(vocab_size: int = VOCAB):
    return _causal(
        _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **SIZES, hidden_dropout=0.0, attention_dropout=0.0), vocab_size
    )


def stablelm(vocab_size: int = VOCAB):
    return _causal(_hf("StableLmForCausalLM", "StableLmConfig", **SIZES, num_key_value_heads=2), vocab_size)


def falcon(vocab_size: int = VOCAB):
    return _causal(
        _hf(
            "FalconForCausalLM",
            "FalconConfig",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            new_decoder_architecture=False,
            use_cache=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        vocab_size,
    )


MIXTRAL = dict(SIZES, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


def mixtral(vocab_size: int = VOCAB):
    return _causal(_hf("MixtralForCausalLM", "MixtralConfig", **MIXTRAL), vocab_size)


def mixtral_four_sequences(vocab_size: int = VOCAB):
    """Mixtral on a batch of 4 sequences, one per device of ep = 4: not a family of the matrix, tests/test_moe.py's."""
    model, _ = mixtral(vocab_size)
    ids = torch.randint(0, vocab_size, (4, T), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def mixtral_router_loss(vocab_size: int = VOCAB):
    """Mixtral whose config asks for the router's load-balancing loss (Switch Transformer's, added to the loss with
    coefficient 0.02): not a family of the matrix, tests/test_moe.py's."""
    return _causal(
        _hf("MixtralForCausalLM", "MixtralConfig", **MIXTRAL, output_router_logits=True, router_aux_loss_coef=0.02),
        vocab_size,
    )


def qwen3_moe(vocab_size: int = VOCAB):
    return _causal(
        _hf(
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            **SIZES,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
        ),
        vocab_size,
    )


def deepseek_v3(vocab_size: int = VOCAB):
    return _causal(
        _hf(
            "DeepseekV3ForCausalLM",
            "DeepseekV3Config",
            **SIZES,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
        vocab_size,
    )


def mamba(vocab_size: int = VOCAB):
    return _causal(
        _hf(
            "MambaForCausalLM",
            "MambaConfig",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            state_size=8,
            use_cache=False,
        ),
        vocab_size,
    )


def mamba2(vocab_size: int = VOCAB):
    return _causal(
        _hf(
            "Mamba2ForCausalLM",
            "Mamba2Config",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=16,
            state_size=16,
            n_groups=1,
            expand=2,
            chunk_size=8,
            use_cache=False,
        ),
        vocab_size,
    )


def roberta():
    """Masked LM: labels on every third token, -100 (ignored) elsewhere."""
    torch.manual_seed(0)
    model = _hf(
        "RobertaForMaskedLM",
        "RobertaConfig",
        **{**SIZES, "max_position_embeddings": 66},
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
    )()
    ids = _tokens() + 2  # clear of the padding token
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return model, {"input_ids": ids, "labels": labels}


def t5():
    """Encoder-decoder: the decoder reads the labels shifted right (Hugging Face does the shift)."""
    torch.manual_seed(0)
    model = _hf(
        "T5ForConditionalGeneration",
        "T5Config",
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
    )()
    return model, {"input_ids": _tokens(), "labels": _tokens(1)}


def vit():
    """Image classification: 16 × 16 images in 4 × 4 patches, 10 classes."""
    torch.manual_seed(0)
    model = _hf(
        "ViTForImageClassification",
        "ViTConfig",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=16,
        patch_size=4,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )()
    gen = torch.Generator().manual_seed(0)
    return model, {
        "pixel_values": torch.randn(B, 3, 16, 16, generator=gen),
        "labels": torch.randint(0, 10, (B,), generator=gen),
    }


FAMILIES = {
    f.__name__: f
    for f in (
        torchtitan_llama3,
        llama,
        gpt2,
        qwen3,
        gemma2,
        gemma3,
        phi3,
        olmo2,
        gpt_neox,
        stablelm,
        falcon,
        mixtral,
        qwen3_moe,
        deepseek_v3,
        mamba,
        mamba2,
        roberta,
        t5,
        vit,
    )
}
