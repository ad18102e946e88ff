"""What the checkpoint code needs to know about the model it holds, given by the training recipe
(:data:`shardflow.train.recipe.GPT_MODEL` for ``shardflow train``'s GPT): nothing else in
:mod:`shardflow.train.checkpoint` depends on a particular model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch


@dataclass(frozen=True)
class ModelAdapter:
    """A model family as checkpoints see it.

    * ``name``: the module's name in messages (``GPT``);
    * ``config_type``: the model's config, a dataclass; a checkpoint records its fields as JSON;
    * ``build``: the plain module of a config (seeded by the caller);
    * ``must_match``: the config fields a run resuming from a checkpoint must share with it (they decide the
      tensors' shapes), in order, each with the flag of ``shardflow train`` that sets it.
    """

    name: str
    config_type: type
    build: Callable[[Any], torch.nn.Module]
    must_match: Mapping[str, str]

    def to_json(self, config: Any) -> dict[str, Any]:
        """The config as the JSON object a checkpoint records."""
        return dataclasses.asdict(config)

    def from_json(self, saved: Mapping[str, Any]) -> Any:
        """The config a checkpoint recorded; raises TypeError for fields the config does not have."""
        return self.config_type(**saved)
