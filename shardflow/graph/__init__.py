"""The computation graph (full shapes, no parallelism): ops, the graph IR and the builder API."""

from shardflow.graph.builder import GraphBuilder
from shardflow.graph.graph import ComputationGraph, Node, TensorRole, TensorSpec
from shardflow.graph.ops import OpError, TensorType

__all__ = ["ComputationGraph", "GraphBuilder", "Node", "OpError", "TensorRole", "TensorSpec", "TensorType"]
