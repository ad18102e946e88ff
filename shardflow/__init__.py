"""shardflow: train neural networks across devices from a parallel computation graph (PCG)."""

__version__ = "0.1.0"
