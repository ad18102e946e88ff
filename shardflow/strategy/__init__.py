"""Strategies: user plans in DTensor spelling and preset dp / tp / sp / pp plans, resolved onto a graph."""

from shardflow.strategy.plan import ModulePlan, Plan, PlanError, resolve
from shardflow.strategy.presets import data_parallel, make_plan, pipeline, tensor_parallel

__all__ = ["ModulePlan", "Plan", "PlanError", "data_parallel", "make_plan", "pipeline", "resolve", "tensor_parallel"]
