"""What differs between the torch versions shardflow runs on, chosen once, at import (README.md: Supported versions).

* **Flat-buffer collectives.** torch 2.13 names them ``all_gather_single`` and ``reduce_scatter_single``; every
  torch since 2.0 has them as ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (the same arguments: output,
  input, then ``op``/``group``/``async_op`` by keyword). :data:`all_gather_single` and
  :data:`reduce_scatter_single` are the first of the two that this torch has; every caller in shardflow goes
  through them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

# the `_single` forms where this torch has them, else the tensor forms they renamed (same signature)
all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
