"""The metrics file of ``shardflow train`` (rank 0): one JSON object per step — ``step``, ``loss``,
``tokens_per_s``, ``step_s``, and ``val_loss`` when measured."""

from __future__ import annotations

import json
import os
from pathlib import Path


def open_metrics(path: Path, start: int):
    """The metrics file: new, or on resume the records up to ``start`` kept (a run that went on past its last
    checkpoint wrote records that the resumed run writes again) and appended to."""
    if start == 0 or not path.exists():
        return open(path, "w")
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= start:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when the run was stopped
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
    return open(path, "a")
