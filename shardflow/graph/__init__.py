"""The computation graph (full shapes, no parallelism): ops, the graph IR and the builder API."""

from shardflow.graph.builder import GraphBuilder
from shardflow.graph.graph import ComputationGraph, Node, TensorSpec
from shardflow.graph.ops import OpError, TensorType

__all__ = ["ComputationGraph", "GraphBuilder", "Node", "OpError", "TensorSpec", "TensorType"]
