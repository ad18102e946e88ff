"""A batch as micro-batches: the micro-steps of gradient accumulation (:class:`~shardflow.runtime.accumulate.MicroSteps`)
and the microbatches of a pipelined step (:meth:`~shardflow.runtime.executor.Executor.step`) each take 1/N of it."""

from __future__ import annotations

from typing import Mapping

import torch


class BatchSplitError(ValueError):
    """A batch whose inputs do not split into the micro-batches of the step: dim 0 not a multiple of N."""


def split_batch(inputs: Mapping[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """``inputs`` (by name, each [B, ...], B sequences along dim 0) as ``count`` micro-batches of B/count
    sequences each, in order (micro-batch i holds sequences i·B/count to (i+1)·B/count − 1). Raises BatchSplitError
    naming an input whose dim 0 is not a multiple of ``count``; ``count`` 1 gives ``inputs`` as they are."""
    if count == 1:
        return [dict(inputs)]
    for name, x in inputs.items():
        if x.dim() == 0 or x.shape[0] % count:
            rows = "a scalar" if x.dim() == 0 else f"{x.shape[0]} rows along dim 0"
            raise BatchSplitError(
                f"input {name!r} {list(x.shape)} has {rows}, which do not split into {count} "
                f"micro-batches of equal size; give a batch whose size is a multiple of {count}"
            )
    return [{name: x.chunk(count)[i] for name, x in inputs.items()} for i in range(count)]
