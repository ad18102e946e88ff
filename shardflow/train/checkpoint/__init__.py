"""Checkpoints of ``shardflow train`` on ``torch.distributed.checkpoint`` (DCP): complete or absent, and loadable
under any strategy and mesh. By concern:

* :mod:`~shardflow.train.checkpoint.store` — the atomic store: ``step_<n>.tmp/`` → manifest (size and sha256 of
  every file) → ``COMPLETE`` → one ``rename``; finding checkpoints; checking a directory is writable;
* :mod:`~shardflow.train.checkpoint.dcp` — the tensors, written and read with DCP (safely: no unpickling beyond
  DCP's own metadata classes); :mod:`~shardflow.train.checkpoint.pieces` — how a rank's pieces are handed to DCP;
* :mod:`~shardflow.train.checkpoint.resume` — whether a checkpoint fits the run about to continue from it;
* :mod:`~shardflow.train.checkpoint.export` — the plain module with a checkpoint's weights, and the Hugging Face
  model directory of ``shardflow export``.

What they know of the model is its :class:`~shardflow.train.family.Family`, recorded by name with its config.

**What is saved: each rank's pieces.** Every tensor is stored as chunks of the full tensor at their offsets (DCP's
``TensorStorageMetadata``, one ``ChunkStorageMetadata`` per chunk: the format DTensor and FSDP2 write). Each rank
writes replica 0 of the pieces it holds, as they are — no tensor is gathered or copied, and a replicated piece is
written once. A resume reads into each piece a rank holds (every replica) the overlap of the chunks saved: a
checkpoint written under any strategy, mesh and process count loads under any other, and a rank holds its own
pieces and, one at a time, a chunk as it was saved — never the whole model. ``export`` and ``generate`` read full tensors from
the same files on one process (a plain ``dcp.load``). Batches depend only on (seed, step), so the step count is
also the position in the data.

``--resume`` takes the newest ``step_<n>/`` that has the marker; leftover ``.tmp`` directories are ignored and
removed by rank 0 at the next save. A fresh run (no ``--resume``) replaces an earlier run's checkpoints in the same
directory once it has written its first one (``shardflow train`` lets it only with ``--overwrite``). State that holds
NaN or inf is never saved.
"""

from shardflow.train.checkpoint.dcp import Checkpoint, Entries, NonFiniteState, Saver, model_entries, read
from shardflow.train.checkpoint.export import export, load_model
from shardflow.train.checkpoint.resume import for_resume
from shardflow.train.checkpoint.store import MARKER, CheckpointError, check_writable, complete_steps, newest

__all__ = [
    "MARKER",
    "Checkpoint",
    "CheckpointError",
    "Entries",
    "NonFiniteState",
    "Saver",
    "check_writable",
    "complete_steps",
    "export",
    "for_resume",
    "load_model",
    "model_entries",
    "newest",
    "read",
]
