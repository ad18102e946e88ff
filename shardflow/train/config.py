"""Typed configuration of ``shardflow train``: each field's ``help`` is its command-line help.

Precedence: built-in defaults < ``--config FILE.toml`` < command-line flags. The resolved configuration is
saved as ``config.toml`` in the run directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on."""

    strategy: str = _f("tp", "single, dp, tp, sp, pp or a combination such as dp,tp")
    mesh: str | None = _f(None, "device mesh, e.g. dp=2,tp=2 (default: the strategy's axis with --nproc devices)")
    nproc: int = _f(2, "local processes to start (one per device); under torchrun, WORLD_SIZE decides")
    steps: int = _f(600, "optimizer steps to train for")
    batch_size: int = _f(16, "sequences per step (global, split over data-parallel ranks)")
    seq_len: int = _f(64, "characters per sequence (the model's context length)")
    layers: int = _f(2, "transformer blocks")
    heads: int = _f(4, "attention heads")
    embd: int = _f(128, "embedding width")
    dropout: float = _f(0.0, "dropout probability")
    lr: float = _f(3e-3, "learning rate")
    optimizer: str = _f("adamw", "sgd or adamw", choices=("sgd", "adamw"))
    momentum: float = _f(0.9, "SGD momentum")
    weight_decay: float = _f(0.0, "weight decay (decoupled for AdamW)")
    seed: int = _f(0, "seed for the initial weights, the batches and the dropout masks")
    data: str | None = _f(None, "UTF-8 text file to train on (default: the Python documentation of this CPython)")
    run_dir: str = _f("runs/latest", "directory for logs, metrics, checkpoints and the resolved config")
    metrics: str | None = _f(None, "JSON-lines metrics file (default: RUN_DIR/metrics.jsonl)")
    checkpoint_dir: str | None = _f(None, "directory for checkpoints (default: RUN_DIR/checkpoints)")
    checkpoint_every: int = _f(0, "save a checkpoint every N steps (0: only the final one; the last step is "
                                  "always saved)")
    resume: bool = _f(False, "continue from the newest complete checkpoint in the checkpoint directory (any "
                             "strategy or mesh may have written it)")
    log_every: int = _f(10, "print a progress line every N steps")
    eval_every: int = _f(100, "measure the validation loss every N steps (and at the end)")
    eval_batches: int = _f(4, "validation batches per measurement")
    clip_norm: float = _f(0.0, "clip gradients to this global norm (0 = off)")
    all_gather: str = _f("auto", "all-gather form: auto (cost model), collective, ring or broadcast_loop",
                         choices=("auto", "collective", "ring", "broadcast_loop"))
    reduce_scatter: str = _f("auto", "reduce-scatter form: auto (cost model), collective or ring",
                             choices=("auto", "collective", "ring"))
    bucket_mb: float = _f(25.0, "pack gradient all-reduces into buckets of this many MiB, each issued while the "
                                "backward goes on (as DDP's bucket_cap_mb; 0 = one all-reduce per gradient)")
    debug: bool = _f(False, "check before every communication that all its members are at the same token")
    trace: str | None = _f(None, "write a Chrome-trace timeline (Perfetto) of step 2 to this JSON file: per-rank "
                                 "compute and communication lanes, and the cost model's prediction beside them")
    timeout: float = _f(120.0, "seconds any rank may wait on one communication before failing")
    check: bool = _f(False, "also run the same steps on one device and compare the loss and every replica of "
                            "every parameter")

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="TOML file of these settings (flags override it)")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                p.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
                continue
            typ = {"int": int, "float": float}.get(f.type, str)
            p.add_argument(flag, type=typ, default=None, choices=f.metadata.get("choices"),
                           help=f"{f.metadata['help']} (default {f.default})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """Defaults, then the --config file, then the flags given. Raises ValueError for unknown keys."""
        values: dict[str, Any] = {}
        if getattr(args, "config", None):
            path = Path(args.config)
            try:
                values = tomllib.loads(path.read_text())
            except FileNotFoundError:
                raise ValueError(f"config file {path} does not exist") from None
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"config file {path} is not valid TOML: {e}") from None
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ValueError(f"config file {path} has unknown settings {unknown}; known: {sorted(known)}")
        for f in fields(cls):
            v = getattr(args, f.name, None)
            if v is not None:
                values[f.name] = v
        return cls(**values)

    @property
    def checkpoints(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.run_dir) / "checkpoints"

    def to_toml(self) -> str:
        lines = []
        for k, v in dataclasses.asdict(self).items():
            if v is None:
                continue
            lines.append(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, str) else v}")
        return "\n".join(lines) + "\n"

    def argv(self) -> list[str]:
        """Command-line flags that reproduce this configuration (for the ranks the launcher starts)."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or v is False:
                continue
            flag = "--" + f.name.replace("_", "-")
            out += [flag] if v is True else [flag, str(v)]
        return out
