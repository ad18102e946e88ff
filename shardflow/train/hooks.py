"""Hooks into the ranks of ``shardflow train``: callbacks a program installs before it runs the command; none by
default. The test suite breaks real runs through them (``tests/faults.py``: a rank killed in the middle of a step
or while saving a checkpoint, a rank that stalls); shardflow itself installs nothing.

Hooks live in a process. ``shardflow train --nproc N`` forks its ranks where it can (docs/execution.md#forked-ranks):
they inherit the parent's hooks. Elsewhere it starts them as new processes: ``command`` is how the parent starts one
(the argv before ``train ...``), so a program that installs hooks names itself there and installs them again in every
rank it is started as.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable


def _no_step(rank: int, step: int) -> AbstractContextManager:
    return contextlib.nullcontext()


def _no_save(rank: int, step: int) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """* ``step(rank, step)``: the context rank ``rank`` runs training step ``step`` (from 1) under;
    * ``saved(rank, step)``: called once rank ``rank``'s files of the checkpoint of ``step`` are written, before
      the checkpoint is committed;
    * ``command``: the argv that starts one rank, before ``train`` and its flags.
    """

    step: Callable[[int, int], AbstractContextManager] = _no_step
    saved: Callable[[int, int], None] = _no_save
    command: tuple[str, ...] = (sys.executable, "-m", "shardflow.cli")


_installed = Hooks()


def install(hooks: Hooks) -> None:
    """Use ``hooks`` in this process's training runs from now on."""
    global _installed
    _installed = hooks


def installed() -> Hooks:
    """The hooks of this process (:class:`Hooks` with no callbacks unless a program installed some)."""
    return _installed
