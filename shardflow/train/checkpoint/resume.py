"""``--resume``: the newest complete checkpoint, checked against the run about to continue from it — its text
(the tokenizer's characters), the model's sizes (through the recipe's :class:`ModelAdapter`), the optimizer and
every tensor's shape. Each mismatch is one paragraph naming the checkpoint, what differs and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from shardflow.lower.dynamic import OPTIMIZER_SLOTS, Optimizer, UpdateRule
from shardflow.train.checkpoint import store
from shardflow.train.checkpoint.dcp import Checkpoint, Entries, read
from shardflow.train.checkpoint.model import ModelAdapter
from shardflow.train.checkpoint.store import CheckpointError

_OPT_NAMES = {UpdateRule.SGD: "SGD without momentum", UpdateRule.SGD_MOMENTUM: "SGD with momentum",
              UpdateRule.ADAMW: "AdamW"}


def for_resume(root: Path, adapter: ModelAdapter, config: Any, chars: str, optimizer_slots: UpdateRule,
               want: Entries, data: str | None) -> Checkpoint:
    """The newest complete checkpoint under ``root``, checked against the run about to continue from it: its model
    ``config`` (read with ``adapter``), the tokenizer's ``chars``, the optimizer's state slots, the ``want``ed
    entries and the ``--data`` it reads (for messages). Raises CheckpointError."""
    path = store.newest(root)
    if path is None:
        partial = store.incomplete(root)
        extra = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
        raise CheckpointError(f"--resume: {root} holds no complete checkpoint{extra}; point --checkpoint-dir (or "
                              f"--run-dir) at the run to continue, or start a new run without --resume")
    ck = read(path)
    saved = ck.config(adapter)
    new_run = "or start a new run without --resume (or with another --checkpoint-dir)"
    if ck.chars != chars:
        gone = sorted(set(ck.chars) - set(chars))
        added = sorted(set(chars) - set(ck.chars))
        what = ", ".join(x for x in (f"missing {_short(''.join(gone))}" if gone else "",
                                     f"new {_short(''.join(added))}" if added else "") if x) or "same characters, other order"
        raise CheckpointError(f"checkpoint {path} was trained on another text: its vocabulary has {len(ck.chars)} "
                              f"characters, --data {data or '(default corpus)'} gives {len(chars)} ({what}); "
                              f"resume with the data it was trained on ({ck.train.get('data') or 'the default corpus'}), "
                              f"{new_run}")
    diff = [(flag, getattr(saved, name), getattr(config, name)) for name, flag in adapter.must_match.items()
            if getattr(saved, name) != getattr(config, name)]
    if diff:
        theirs_, ours = (" ".join(f"{flag} {v[i]}" for flag, *v in diff) for i in (0, 1))
        raise CheckpointError(f"checkpoint {path} is of a different model: it has {theirs_}, this run {ours}; "
                              f"resume with the checkpoint's sizes ({theirs_}), {new_run}")
    theirs = _slots_of(ck.train)
    momentum = f" --momentum {ck.train.get('momentum')}"
    if theirs is not None and theirs != optimizer_slots:
        raise CheckpointError(f"checkpoint {path} holds the optimizer state of {_OPT_NAMES[theirs]} "
                              f"({', '.join(OPTIMIZER_SLOTS[theirs]) or 'none'}) but this run uses "
                              f"{_OPT_NAMES.get(optimizer_slots, optimizer_slots)}; "
                              f"resume with --optimizer {ck.train.get('optimizer')}"
                              f"{momentum if theirs != UpdateRule.ADAMW else ''}, "
                              f"{new_run}")
    ck.check_entries(want, store.fallback(path))
    return ck


def _short(chars: str, n: int = 30) -> str:
    return repr(chars) if len(chars) <= n else repr(chars[:n]) + f" and {len(chars) - n} more"


def _slots_of(train: Mapping[str, Any]) -> UpdateRule | None:
    name = train.get("optimizer")
    return UpdateRule.of(name, train.get("momentum") or 0.0) if name in set(Optimizer) else None
