"""A small GPT (nanoGPT layout) as a plain ``nn.Module``.

Dims: B batch, T sequence (``T <= block_size``), C = ``n_embd``, H = ``n_head``, D = C / H, V = ``vocab_size``.
Unlike nanoGPT, attention has separate ``q``, ``k``, ``v`` projections and ``lm_head`` is not tied to ``wte``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes. ``block_size`` is the longest context; ``bias`` adds biases to Linear and LayerNorm."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``[B, T, C] -> [B, T, C]``.

    Raises:
        ValueError: ``n_embd`` is not a multiple of ``n_head``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}")
        C = config.n_embd
        self.n_head = config.n_head
        self.q = nn.Linear(C, C, bias=config.bias)
        self.k = nn.Linear(C, C, bias=config.bias)
        self.v = nn.Linear(C, C, bias=config.bias)
        self.c_proj = nn.Linear(C, C, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        H = self.n_head
        q = self.q(x).view(B, T, H, C // H).transpose(1, 2)  # [B, H, T, D]
        k = self.k(x).view(B, T, H, C // H).transpose(1, 2)
        v = self.v(x).view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Feed-forward block ``[B, T, C] -> [B, T, 4C] -> GELU -> [B, T, C]``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block ``[B, T, C] -> [B, T, C]``: attention and MLP, each with a residual."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model. Parameters use PyTorch's default init (seed with ``torch.manual_seed``)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, V]`` for tokens ``idx [B, T]`` (int64, ``T <= block_size``).

        Raises:
            IndexError: ``T > block_size`` or a token is outside ``[0, V)`` (from the embedding lookup).
        """
        B, T = idx.size()
        pos = torch.arange(T, device=idx.device)  # [T]
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # [B, T, C]
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy ``[]`` of the next-token logits of ``idx [B, T]`` against ``targets [B, T]`` (int64)."""
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
