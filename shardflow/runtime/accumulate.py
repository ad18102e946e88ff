"""Gradient accumulation (``--accumulate N``): one optimizer step as N micro-steps, each on 1/N of the batch.

Each micro-step is a lowered step of its own (:class:`~shardflow.lower.dynamic.MicroStep`): the first keeps the
weight-gradient contributions each device holds, a middle one adds its own to them, the last adds them to its own,
reduces each weight's gradient once and updates. :class:`MicroSteps` runs them in order on executors that share
their buffers (each built with ``share=`` the last one's), so the sums stay where the previous micro-step left them.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from shardflow.runtime.batch import split_batch
from shardflow.runtime.executor import Executor


class MicroSteps:
    """One step as micro-steps: ``executors[i]`` runs micro-step i on micro-batch i (the same executor may serve
    several). The last one's step ends the optimizer step: its weights, gradients, state and ``steps_done`` are the
    run's. With one executor, :meth:`step` is that executor's step."""

    def __init__(self, executors: Sequence[Executor]):
        if not executors:
            raise ValueError("a step has at least one micro-step")
        self.executors = tuple(executors)

    def step(self, inputs: Mapping[str, torch.Tensor], after: Callable[[Executor], None] | None = None) -> float:
        """Run every micro-step on its part of the full ``inputs`` (by graph input name); returns the mean of their
        losses — the whole batch's loss when the loss is a mean over equally many elements in every micro-batch.
        Every micro-step counts as the optimizer step it belongs to (AdamW's step, dropout's draws), and draws its
        random numbers as its rows of the whole batch (``Executor.micro``). ``after(executor)`` runs after each
        micro-step (e.g. to read its batch statistics). Raises BatchSplitError for inputs that do not split."""
        last = self.executors[-1]
        done = last.steps_done
        losses = []
        n = len(self.executors)
        for i, (ex, part) in enumerate(zip(self.executors, split_batch(inputs, n))):
            ex.steps_done, ex.micro = done, (i, n)
            losses.append(ex.step(part))
            if after is not None:
                after(ex)
        last.steps_done = done + 1
        return sum(losses) / len(losses)
