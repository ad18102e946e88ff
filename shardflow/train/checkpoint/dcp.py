"""The tensors of a checkpoint, written and read with ``torch.distributed.checkpoint`` (DCP), into and out of the
atomic store (:mod:`shardflow.train.checkpoint.store`).

Entries: the model's weights by graph name (``model/<name>``; graph weight names are the ``named_parameters()``
names of the module) and the optimizer state by value id (``optim/opt:<slot>:<weight>``).

**Sharded.** Each entry is stored as chunks of the full tensor with their offsets — DCP's
``TensorStorageMetadata`` with one ``ChunkStorageMetadata`` per chunk, the format DTensor and FSDP2 write. To save,
every rank hands DCP only the pieces it holds (:class:`~shardflow.train.checkpoint.pieces.Pieces`, from the
executor's :meth:`~shardflow.runtime.executor.Executor.held_pieces`), and of each block only replica 0, so the
chunks tile each tensor once and a replicated piece is written once; no rank assembles a full tensor. Before
anything is written each rank checks its pieces for NaN and inf, and the ranks agree (:class:`NonFiniteState`).
To load (:meth:`Checkpoint.restore`), every rank asks DCP for the pieces it holds — every replica — at their offsets
(:meth:`~shardflow.runtime.executor.Executor.load_pieces`), and DCP reads into each the overlap of every chunk
saved: a checkpoint written under one strategy, mesh and process count loads under any other. A plain
``dcp.load`` into full tensors reads the same files (:meth:`Checkpoint.load`: ``export``, ``generate``, and the
one-device reference of ``train --check --resume``).

**Safe to load.** Nothing is unpickled except DCP's ``.metadata``, and that through an unpickler that admits
only DCP's own metadata classes, torch dtypes and sizes; tensors come back with ``torch.load(weights_only=True)``
(DCP's reader). Non-tensor entries, which DCP would load with a full unpickler, are refused.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from shardflow.graph.fused import same_elements
from shardflow.graph.ops import torch_dtype
from shardflow.lower.dynamic import forward_id, state_id
from shardflow.train.checkpoint import store
from shardflow.train.checkpoint.store import CheckpointError
from shardflow.train.family import Family, ModelError, family_of
from shardflow.train.tokenizer import TOKENIZER_FILE, Tokenizer

Entries = dict[str, tuple[tuple[int, ...], torch.dtype]]


def model_entries(
    model: torch.nn.Module,
    names,
    slots: tuple[str, ...] = (),
    master: torch.dtype | None = None,
    frozen: frozenset[str] = frozenset(),
) -> Entries:
    """The entries a checkpoint of ``model`` holds: weights ``model/<name>`` and optimizer state
    ``optim/opt:<slot>:<name>`` (same shape as the weight) of those not ``frozen`` (trained), in the parameters' dtype
    or, under mixed precision, the ``master`` dtype the weights are held in."""
    params = dict(model.named_parameters())
    out: Entries = {f"model/{n}": (tuple(params[n].shape), master or params[n].dtype) for n in names}
    for s in slots:
        out.update(
            {
                f"optim/{state_id(s, n)}": (tuple(params[n].shape), master or params[n].dtype)
                for n in names
                if n not in frozen
            }
        )
    return out


def _values(ex) -> dict[str, str]:
    """Entry → the value id of executor ``ex`` it holds: each weight ``model/<graph name>`` (its forward value), each
    optimizer state ``optim/<value id>``."""
    graph = ex.dg.pcg.graph
    return {**{f"model/{w}": forward_id(w) for w in graph.weights}, **{f"optim/{v}": v for v in ex.dg.state_values()}}


def _entry(ex, vid: str) -> tuple[tuple[int, ...], torch.dtype]:
    """The full shape and dtype of value ``vid`` of executor ``ex``."""
    t = ex.dg.values[vid].type
    return tuple(t.shape), torch_dtype(t.dtype)


# --- reading ------------------------------------------------------------------------------------------------


def _metadata_classes() -> set[tuple[str, str]]:
    import torch.distributed.checkpoint.metadata as md

    allowed = {(md.__name__, n) for n, o in vars(md).items() if isinstance(o, type) and o.__module__ == md.__name__}
    return allowed | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only its metadata classes, torch dtypes and sizes: a crafted file
    cannot run code."""

    allowed: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            _MetadataUnpickler.allowed = _MetadataUnpickler.allowed or _metadata_classes()
            with open(Path(self.path) / ".metadata", "rb") as f:
                md = _MetadataUnpickler(f).load()
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(path)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint whose files were verified: what its manifest says and DCP's tensor index.
    ``model`` is the model as recorded (JSON ``{"family": name, "config": {...}}``; :meth:`family` and :meth:`config`
    read it);
    ``data`` the corpus it was trained on (``source``, ``sha256``, ``chars``, ``tokens``)."""

    path: Path
    step: int
    model: Mapping[str, Any]
    data: Mapping[str, Any]
    train: dict[str, Any]
    entries: Entries
    mesh: str = "?"

    @property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer, saved with the checkpoint as ``tokenizer.json`` (verified by the manifest)."""
        return Tokenizer.load(self.path / TOKENIZER_FILE)

    def family(self) -> Family:
        """The model family that wrote it (:mod:`shardflow.train.family`); raises CheckpointError when the record
        does not fit."""
        return self._read(lambda: family_of(self.model))

    def config(self, family: Family) -> Any:
        """The model's config read by ``family``; raises CheckpointError when the recorded one does not fit."""
        return self._read(lambda: family.from_json(self.model["config"]))

    def _read(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except (ValueError, TypeError, KeyError, ModelError) as e:
            raise CheckpointError(
                f"checkpoint {self.path} is corrupt: {store.META} cannot be read "
                f"({type(e).__name__}: {e}); {store.fallback(self.path)}"
            ) from None

    def check_entries(self, want: Entries, fix: str) -> None:
        """Raise CheckpointError unless every wanted entry is stored with its shape (or, wanted in its module
        parameter's shape, stored by parts: :func:`~shardflow.graph.fused.same_elements`) and dtype."""
        problems = []
        for k, (shape, dtype) in want.items():
            if k not in self.entries:
                problems.append(f"{k} is missing")
            elif self.entries[k] != (tuple(shape), dtype) and not (
                self.entries[k][1] == dtype and same_elements(shape, self.entries[k][0])
            ):
                have = self.entries[k]
                problems.append(
                    f"{k} is {list(have[0])} {str(have[1]).removeprefix('torch.')}, the model needs "
                    f"{list(shape)} {str(dtype).removeprefix('torch.')}"
                )
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise CheckpointError(
                f"checkpoint {self.path} does not fit this model: {'; '.join(problems[:3])}{more}; {fix}"
            )

    def load(self, want: Entries) -> dict[str, torch.Tensor]:
        """Full-size tensors of ``want`` (entry name → shape, dtype), read with a plain ``dcp.load`` on this process
        alone (whatever chunks were saved); an entry stored by parts comes in the wanted (module's) shape. Raises
        CheckpointError."""
        self.check_entries(want, store.fallback(self.path))
        sd = {k: torch.empty(self.entries[k][0], dtype=dtype) for k, (_, dtype) in want.items()}
        self._load(sd, None, no_dist=True)
        return {k: t.reshape(want[k][0]) for k, t in sd.items()}

    def restore(self, ex, world: int) -> None:
        """Load the weights and optimizer state of executor ``ex`` from this checkpoint, after :attr:`step` steps,
        each rank reading only the pieces it holds (every replica; :meth:`Executor.load_pieces
        <shardflow.runtime.executor.Executor.load_pieces>`): DCP reads into each piece the overlap of every chunk
        saved, under whatever strategy, mesh and process count, so no rank holds a full tensor — only, one at a
        time, a chunk as it was saved. ``world``: the processes of the run (> 1: collective, every rank calls it).
        Raises CheckpointError for an entry that is missing or of another shape or dtype, or that cannot be read."""
        values = _values(ex)
        want = {k: _entry(ex, vid) for k, vid in values.items()}
        self.check_entries(want, store.fallback(self.path))

        def read(pieces) -> None:
            from shardflow.train.checkpoint.pieces import LoadPlanner, Pieces

            sd = {k: Pieces(*want[k], tuple(pieces[vid])) for k, vid in values.items()}
            self._load(sd, LoadPlanner(), no_dist=world == 1)

        ex.load_pieces({vid: want[k][1] for k, vid in values.items()}, read, self.step)

    def _load(self, sd: dict[str, Any], planner: Any, no_dist: bool) -> None:
        """``dcp.load`` of ``sd`` with ``planner`` (None: DCP's default) through the safe reader; any failure to read
        is a corrupt checkpoint to the user (CheckpointError, on every rank)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.load(sd, storage_reader=_reader(self.path), planner=planner, no_dist=no_dist)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint {self.path} is corrupt: its tensors cannot be read ({_why(e)}); "
                f"{store.fallback(self.path)}"
            ) from None


def _why(e: BaseException) -> str:
    """The first line of what went wrong inside DCP. DCP wraps every rank's failure — a Ctrl-C too — in a
    CheckpointException (a BaseException): an interrupt is raised again as KeyboardInterrupt."""
    failures = [pair[0] for pair in getattr(e, "failures", {}).values()] or [e]
    for x in failures:
        if isinstance(x, (KeyboardInterrupt, SystemExit)):
            raise KeyboardInterrupt(str(x)) from None
    x = failures[0]
    text = str(x).strip().splitlines()[0] if str(x).strip() else ""
    if len(text) > 120 and ". " in text:  # e.g. torch.load's advice to load unsafely: not for a corrupt file
        text = text.split(". ")[0]
    return f"{type(x).__name__}: {text}" if text else type(x).__name__


def read(path: Path) -> Checkpoint:
    """Open the complete checkpoint ``path``: check every file against the size and sha256 recorded when it was
    saved, then read DCP's index (safely). Raises CheckpointError naming the directory, the problem and the fix."""
    meta = store.read_manifest(path, required=("model", "data"))
    fix = store.fallback(path)
    try:
        md = _reader(path).read_metadata()
        entries: Entries = {}
        for k, v in md.state_dict_metadata.items():
            if not hasattr(v, "properties") or not hasattr(v, "size"):
                raise CheckpointError(
                    f"checkpoint {path} holds a non-tensor entry {k!r}, which shardflow does not "
                    f"write and will not unpickle; {fix}"
                )
            entries[k] = (tuple(v.size), v.properties.dtype)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 — an unreadable or refused index
        raise CheckpointError(f"checkpoint {path} is corrupt: DCP's .metadata cannot be read ({e}); {fix}") from None
    return Checkpoint(
        path, meta["step"], meta["model"], meta["data"], meta.get("train", {}), entries, str(meta.get("mesh", "?"))
    )


# --- writing ------------------------------------------------------------------------------------------------


class NonFiniteState(CheckpointError):
    """The state to save after ``step`` holds NaN or inf (``names``: those tensors' entries): nothing was written, and
    the previous complete checkpoint stays the newest."""

    def __init__(self, step: int, names: list[str]):
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        super().__init__(f"the state after step {step} holds NaN or inf ({names[0]}{more}): checkpoint not saved")
        self.step, self.names = step, names


class Saver:
    """Writes checkpoints of one run. Every rank makes one and calls :meth:`save` at the same steps.

    ``meta``: what the manifest records besides step and files (model config, data, train config).
    ``fresh``: this run did not resume, so complete checkpoints it did not write are an earlier run's and are
    removed once it has committed its first. ``files``: text files (name → contents, e.g. the tokenizer) that rank
    0 writes beside the tensors; the manifest records them like the tensor files. ``keep`` > 0: after each save
    only the ``keep`` newest complete checkpoints stay (``--keep-checkpoints``).
    """

    def __init__(
        self,
        root: Path,
        rank: int,
        world: int,
        meta: Mapping[str, Any],
        fresh: bool,
        files: Mapping[str, str] | None = None,
        keep: int = 0,
    ):
        self.root, self.rank, self.world, self.meta, self.fresh = root, rank, world, dict(meta), fresh
        self.keep = keep
        self.files = dict(files or {})
        self.written: set[str] = set()
        # called with the step once this rank's files are in ``step_<n>.tmp/``, before the checkpoint is committed
        # (the ``saved`` hook of shardflow.train.hooks)
        self.on_written: Callable[[int], None] | None = None

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def _non_finite(self, names: list[str], mine: set[str], device: torch.device) -> list[str]:
        """The entries of ``names`` (the same list on every rank) whose pieces hold NaN or inf on any rank, ``mine``
        on this one: the ranks agree with one all-reduce of a flag per entry on ``device`` (the executor's: NCCL
        talks CUDA tensors), none on one process."""
        if self.world > 1:
            import torch.distributed as dist

            flags = torch.tensor([k in mine for k in names], dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            mine = {k for k, f in zip(names, flags.tolist()) if f}
        return [k for k in names if k in mine]

    def save(self, ex, step: int) -> tuple[Path, int]:
        """Save the executor's weights and optimizer state after ``step`` steps (collective: every rank calls it),
        each rank writing replica 0 of the pieces it holds, as they are (no copy, no full tensor). Returns the
        checkpoint's directory and its size in bytes (on rank 0; 0 elsewhere). Raises NonFiniteState on every rank,
        writing nothing, when a piece to write holds NaN or inf on any rank; ValueError for a partial value;
        CheckpointError where this rank cannot write it (e.g. a full disk); and PeerLost or CommTimeout where
        another rank left or stopped answering during the save; either way the complete checkpoints saved before
        stay."""
        from torch.distributed.checkpoint.api import CheckpointException

        from shardflow.runtime.distributed import CommFailure, comm_failure

        try:
            return self._save(ex, step)
        except (CheckpointError, CommFailure):  # NonFiniteState is a CheckpointError
            raise
        except (Exception, CheckpointException) as e:
            failure = comm_failure(
                e, f"rank {self.rank} saving {store.staging(self.root, step)} (the complete checkpoints before it stay)"
            )
            if failure is None:
                raise
            raise failure from None

    def _save(self, ex, step: int) -> tuple[Path, int]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException

        from shardflow.runtime.distributed import comm_failure
        from shardflow.train.checkpoint.pieces import Pieces, SavePlanner

        sd = {
            k: Pieces(*_entry(ex, vid), tuple(ex.held_pieces(vid, replica0_only=True)))
            for k, vid in _values(ex).items()
        }
        bad = self._non_finite(list(sd), {k for k, p in sd.items() if p.non_finite()}, ex.device)
        if bad:  # every rank refuses the same save, before anything is written
            raise NonFiniteState(step, bad)
        tmp = store.begin(self.root, step) if self.rank == 0 else store.staging(self.root, step)
        self._barrier()
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.save(
                    sd,
                    storage_writer=FileSystemWriter(tmp, sync_files=True),
                    planner=SavePlanner(),
                    no_dist=self.world == 1,
                )
        except (Exception, CheckpointException) as e:  # e.g. disk full, on any rank
            why = _why(e)  # an interrupt is raised again here
            if comm_failure(e, "") is not None:  # another rank left or stopped answering: not this disk
                raise
            raise CheckpointError(
                f"writing checkpoint {tmp} failed ({why}); free space or fix --checkpoint-dir, "
                f"then --resume from the last complete checkpoint"
            ) from None
        prefix = f"__{self.rank}_" if self.world > 1 else "__"
        mine = {p.name: store.digest(p) for p in sorted(tmp.iterdir()) if p.name.startswith(prefix)}
        if self.on_written is not None:
            self.on_written(step)
        if self.world > 1:
            everyone: list[Any] | None = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, everyone, dst=0)
        else:
            everyone = [mine]
        final, size = self.root / f"step_{step}", 0
        if self.rank == 0:
            files = {k: v for part in everyone for k, v in part.items()}
            files[".metadata"] = store.digest(tmp / ".metadata")
            for name, text in self.files.items():
                store.write_synced(tmp / name, text)
                files[name] = store.digest(tmp / name)
            final, size = store.commit(self.root, step, files, self.meta)
            self.written.add(final.name)
            if self.fresh or self.keep:
                store.prune(self.root, self.written if self.fresh else None, self.keep)
        self._barrier()
        return final, size
