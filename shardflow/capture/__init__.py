"""Model capture: ``torch.export`` of any ``nn.Module`` → a :class:`~shardflow.graph.ComputationGraph` of ATen ops."""

from shardflow.capture.export import KEEP, CaptureError, export
from shardflow.capture.lift import capture, lift_exported
from shardflow.capture.precision import at_dtype, wide_floats

__all__ = ["KEEP", "CaptureError", "capture", "export", "lift_exported", "at_dtype", "wide_floats"]
