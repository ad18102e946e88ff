"""Strategies: user plans in DTensor spelling (or torch's tensor-parallel styles) and preset dp / tp / sp / pp
plans, resolved onto a graph."""

from shardflow.strategy.plan import ModulePlan, Plan, PlanError, resolve
from shardflow.strategy.presets import data_parallel, make_plan, pipeline, tensor_parallel
from shardflow.strategy.styles import plan_from_styles

__all__ = [
    "ModulePlan",
    "Plan",
    "PlanError",
    "data_parallel",
    "make_plan",
    "pipeline",
    "plan_from_styles",
    "resolve",
    "tensor_parallel",
]
