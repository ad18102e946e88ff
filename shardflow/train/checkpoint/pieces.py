"""A sharded checkpoint's tensors in DCP: :class:`Pieces` — some pieces of one tensor, each the block of the full
tensor at its offsets — and the planners that let DCP save and load them (:mod:`shardflow.train.checkpoint.dcp`
uses them). Its own module because DCP takes a while to import: only a save or a load imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True, eq=False)
class Pieces:
    """Some pieces of one tensor as DCP saves and loads them: each piece is the block of the full tensor (``shape``,
    ``dtype``) at its offsets (per dim, the index of its first element), and is one chunk of DCP's
    ``TensorStorageMetadata`` — the format DTensor and FSDP2 write. To save: the pieces this rank writes (disjoint;
    over the ranks they tile the tensor once). To load: the pieces this rank holds, replicas included (two may sit
    at the same offsets); DCP copies into each the overlap of every chunk saved.

    It implements DCP's checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``) and is found by offset through :class:`SavePlanner` / :class:`LoadPlanner` (DCP's own
    lookup takes offsets only on tensors). Not a DTensor: a DTensor has one local tensor per rank and needs a live
    ``DeviceMesh`` for every value, whereas the local executor holds every device's pieces in one process (and no
    process group), and pipeline stages hold values on sub-meshes. The files are the same as a DTensor's, so a
    plain ``dcp.load`` into full tensors reads them (:meth:`~shardflow.train.checkpoint.dcp.Checkpoint.load`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[tuple[tuple[int, ...], torch.Tensor], ...]

    def size(self) -> torch.Size:
        """The full tensor's shape (DCP checks it against the saved one before loading)."""
        return torch.Size(self.shape)

    def non_finite(self) -> bool:
        """Whether a piece holds NaN or inf. From each piece's minimum and maximum (NaN propagates to both, an
        infinity is one of them): no temporary of a piece's size, as ``isfinite`` would make."""
        return any(not bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()) for _, t in self.pieces if t.numel())

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """Each piece's block (offsets, sizes): what a load asks DCP to fill."""
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in self.pieces]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """One chunk (``WriteItemType.SHARD``) per piece of entry ``fqn``: what a save writes."""
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, c.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=c, properties=props, size=self.size()),
            )
            for c in self.__create_chunk_list__()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The piece at ``index.offset``. When loading, ``index.index`` is the position in
        :meth:`__create_chunk_list__` (it tells replicas at the same offsets apart); when saving it is the chunk's
        position among every rank's, so the offsets decide."""
        i = index.index
        if i is not None and i < len(self.pieces) and torch.Size(self.pieces[i][0]) == index.offset:
            return self.pieces[i][1]
        for o, t in self.pieces:
            if torch.Size(o) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no piece at offsets {list(index.offset or ())}")


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner over a flat dict of :class:`Pieces`, each piece found by its offsets
    (``lookup_object``: the extension point DCP documents)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner into a flat dict of :class:`Pieces`, each piece found by its offsets and index
    (``lookup_tensor``: the extension point DCP documents)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # as DefaultLoadPlanner's, less its first step — materializing meta-device tensors — which would replace
        # every entry that is not a tensor by None; the pieces are allocated already
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)
