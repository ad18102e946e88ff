"""``--resume``: the newest complete checkpoint, checked against the run about to continue from it — its text
(the corpus's sha256), its tokenizer, the model's family and sizes (:class:`~shardflow.train.family.Family`), the optimizer,
the other settings that change the numbers (:data:`NUMERIC_SETTINGS`, unless ``--allow-changed-settings``) and every
tensor's shape. Each mismatch is one paragraph naming the checkpoint, what differs and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from shardflow.lower.dynamic import OPTIMIZER_SLOTS, Optimizer, UpdateRule
from shardflow.train.checkpoint import store
from shardflow.train.checkpoint.dcp import Checkpoint, Entries, read
from shardflow.train.checkpoint.store import CheckpointError
from shardflow.train.family import Family
from shardflow.train.tokenizer import TOKENIZER_FILE, Tokenizer

_OPT_NAMES = {
    UpdateRule.SGD: "SGD without momentum",
    UpdateRule.SGD_MOMENTUM: "SGD with momentum",
    UpdateRule.ADAMW: "AdamW",
}


# The settings of shardflow train that change a run's numbers and that no other check of --resume compares (the corpus,
# tokenizer, model sizes and optimizer state slots are): a resumed run with another value would not reproduce the
# uninterrupted run's losses. (--steps only under a decaying learning rate, whose every step it sets: with a constant
# one, a resumed run is given more steps; not the placement, --accumulate, --microbatches, --dtype or --ac, under
# which a run resumes to float32 rounding, docs/execution.md.)
NUMERIC_SETTINGS = (
    "seed",
    "optimizer",
    "momentum",
    "lr",
    "weight_decay",
    "lr_schedule",
    "warmup_steps",
    "lr_min_ratio",
    "clip_norm",
    "batch_size",
    "seq_len",
    "dropout",
    "steps",
)


def changed_settings(saved: Mapping[str, Any], ours: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(flag, the checkpoint's value, this run's) for each of :data:`NUMERIC_SETTINGS` that differs between the
    settings a checkpoint records (``saved``; one it lacks is not compared) and this run's (``ours``): ``--momentum``
    only where both use SGD, ``--lr-min-ratio`` and ``--steps`` only where a schedule decays (to the ratio, at the
    last step)."""
    out = []
    for name in NUMERIC_SETTINGS:
        if name not in saved or saved[name] == ours.get(name):
            continue
        if name == "momentum" and not saved.get("optimizer") == ours.get("optimizer") == str(Optimizer.SGD):
            continue
        if name in ("lr_min_ratio", "steps") and saved.get("lr_schedule") == ours.get("lr_schedule") == "constant":
            continue
        out.append(("--" + name.replace("_", "-"), saved[name], ours.get(name)))
    return out


def for_resume(
    root: Path,
    family: Family,
    config: Any,
    corpus: Mapping[str, Any],
    tokenizer: Tokenizer,
    optimizer_slots: UpdateRule,
    want: Entries,
    settings: Mapping[str, Any] | None = None,
) -> Checkpoint:
    """The newest complete checkpoint under ``root``, checked against the run about to continue from it: its model
    ``family`` and ``config``, its ``corpus`` (``source``, ``sha256``, ``chars``, as the checkpoint records
    it), its ``tokenizer``, the optimizer's state slots, the run's ``settings`` (its TrainConfig as a dict:
    :func:`changed_settings`, unless its ``allow_changed_settings``) and the ``want``ed entries. Raises
    CheckpointError."""
    if store.is_checkpoint(root):
        raise CheckpointError(
            f"--resume: {root} is one checkpoint, not a checkpoint directory; --checkpoint-dir "
            f"names the directory that holds the step_N checkpoints (the newest complete one is "
            f"resumed): pass --checkpoint-dir {root.parent}"
        )
    path = store.newest(root)
    if path is None:
        partial = store.incomplete(root)
        extra = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
        raise CheckpointError(
            f"--resume: {root} holds no complete checkpoint{extra}; point --checkpoint-dir (or "
            f"--run-dir) at the run to continue, or start a new run without --resume"
        )
    ck = read(path)
    new_run = "or start a new run without --resume (or with another --checkpoint-dir)"
    theirs_family = ck.family()
    if theirs_family.name != family.name:
        raise CheckpointError(
            f"checkpoint {path} is of a {theirs_family.name} model, this run trains "
            f"{family.name}; resume with --model {theirs_family.name}, {new_run}"
        )
    saved = ck.config(family)
    if ck.data.get("sha256") != corpus["sha256"]:
        raise CheckpointError(
            f"checkpoint {path} was trained on another text: {_text(ck.data)}, this run's --data "
            f"is {_text(corpus)}; resume with the data it was trained on "
            f"({ck.train.get('data') or 'the default corpus'}), {new_run}"
        )
    theirs_tok = ck.tokenizer
    if theirs_tok.sha256 != tokenizer.sha256:
        raise CheckpointError(
            f"checkpoint {path} was trained with another tokenizer: {theirs_tok.describe()} (sha256 "
            f"{theirs_tok.sha256[:12]}), this run's is {tokenizer.describe()} (sha256 "
            f"{tokenizer.sha256[:12]}); resume with --tokenizer {path / TOKENIZER_FILE}, {new_run}"
        )
    diff = [
        (flag, getattr(saved, name, None), getattr(config, name, None))
        for name, flag in family.must_match
        if getattr(saved, name, None) != getattr(config, name, None)
    ]
    if diff:
        theirs_, ours = (" ".join(f"{flag} {v[i]}" for flag, *v in diff) for i in (0, 1))
        raise CheckpointError(
            f"checkpoint {path} is of a different model: it has {theirs_}, this run {ours}; "
            f"resume with the checkpoint's sizes ({theirs_}), {new_run}"
        )
    theirs = _slots_of(ck.train)
    momentum = f" --momentum {ck.train.get('momentum')}"
    if theirs is not None and theirs != optimizer_slots:
        raise CheckpointError(
            f"checkpoint {path} holds the optimizer state of {_OPT_NAMES[theirs]} "
            f"({', '.join(OPTIMIZER_SLOTS[theirs]) or 'none'}) but this run uses "
            f"{_OPT_NAMES.get(optimizer_slots, optimizer_slots)}; "
            f"resume with --optimizer {ck.train.get('optimizer')}"
            f"{momentum if theirs != UpdateRule.ADAMW else ''}, "
            f"{new_run}"
        )
    changed = changed_settings(ck.train, settings) if settings and not settings.get("allow_changed_settings") else []
    if changed:
        theirs_ = " ".join(f"{flag} {old}" for flag, old, _ in changed)
        raise CheckpointError(
            f"checkpoint {path} was trained with other settings than this run's: "
            f"{', '.join(f'{flag} {old} → {new}' for flag, old, new in changed)}; its losses from here would not "
            f"match the uninterrupted run's: resume with the checkpoint's ({theirs_}), pass --allow-changed-settings "
            f"to continue with this run's on purpose, {new_run}"
        )
    ck.check_entries(want, store.fallback(path))
    return ck


def _text(corpus: Mapping[str, Any]) -> str:
    return f"{corpus.get('source')} ({corpus.get('chars', 0):,} characters, sha256 {str(corpus.get('sha256'))[:12]})"


def _slots_of(train: Mapping[str, Any]) -> UpdateRule | None:
    name = train.get("optimizer")
    return UpdateRule.of(name, train.get("momentum") or 0.0) if name in set(Optimizer) else None
