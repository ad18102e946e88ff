"""shardflow: train neural networks across devices from a parallel computation graph (PCG).

The entry point for a model of your own: :func:`parallelize` (``shardflow.api``) returns a :class:`Trainer`.
"""

__version__ = "0.1.0"

from shardflow.api import ParallelPlan, Trainer, parallelize  # noqa: E402
from shardflow.capture import wide_floats  # noqa: E402
from shardflow.lower import MixedPrecision  # noqa: E402
from shardflow.lower.dynamic import Optimizer  # noqa: E402
from shardflow.model_spec import load_model  # noqa: E402
from shardflow.parallel.mesh import Mesh, Partial, Replicate, Shard  # noqa: E402
from shardflow.runtime.kernels import LRDecay, LRSchedule, OptimizerConfig  # noqa: E402
from shardflow.strategy import ModulePlan, Plan, plan_from_styles  # noqa: E402

__all__ = [
    "LRDecay",
    "LRSchedule",
    "Mesh",
    "MixedPrecision",
    "ModulePlan",
    "Optimizer",
    "OptimizerConfig",
    "ParallelPlan",
    "Partial",
    "Plan",
    "Replicate",
    "Shard",
    "Trainer",
    "load_model",
    "parallelize",
    "plan_from_styles",
    "wide_floats",
]
