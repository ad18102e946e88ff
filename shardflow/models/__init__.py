"""Example models written as plain PyTorch modules, for capture and end-to-end runs."""

from shardflow.models.gpt import GPT, GPTConfig
from shardflow.models.mlp import MLP

__all__ = ["GPT", "GPTConfig", "MLP"]
