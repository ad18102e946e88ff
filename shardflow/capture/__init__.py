"""Model capture: turn a PyTorch ``nn.Module`` into a :class:`~shardflow.graph.ComputationGraph`."""

from shardflow.capture.fx import CaptureError, capture

__all__ = ["CaptureError", "capture"]
