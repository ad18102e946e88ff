"""A multi-layer perceptron classifier with a cross-entropy loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``n_layers`` linear layers ``layers.0 .. layers.{n_layers-1}`` (d_in → hidden → ... → d_out), ReLU between.

    Raises:
        ValueError: ``n_layers < 1``.
    """

    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 16, n_layers: int = 2):
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"MLP needs at least one layer, got n_layers={n_layers}")
        sizes = [d_in] + [hidden] * (n_layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy ``[]`` of the logits ``[B, d_out]`` of ``x [B, d_in]`` against ``y [B]`` (int64)."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return F.cross_entropy(x, y)
