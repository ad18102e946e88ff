"""torchtitan's learning-rate schedule, written out as its ``lr_scheduler.py`` has it: the reference the tests hold
shardflow's :class:`~shardflow.runtime.kernels.LRSchedule` against (through torch's ``LambdaLR``)."""

import math


def titan_lambda(warmup: int, steps: int, decay: str, min_ratio: float):
    """torchtitan's ``linear_warmup_stable_decay`` (lr_scheduler.py, no stable phase, decay over the steps after
    the warm-up) as the LambdaLR factor of a 0-indexed scheduler step; "constant": its warm-up, then 1."""

    def factor(current: int) -> float:
        if current < warmup:
            return (current + 1) / (warmup + 1)
        if decay == "constant":
            return 1.0
        progress = (current + 1 - warmup) / (steps - warmup)
        adjust = 1 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1 - min_ratio) * adjust

    return factor
