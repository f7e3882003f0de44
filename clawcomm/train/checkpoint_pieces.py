"""A tensor- or expert-parallel slice as torch.distributed.checkpoint (DCP) sees it:
the pieces (boxes) of a whole tensor that this rank holds.

A checkpoint keys every parameter by its name in the whole model and stores
whole tensors, so that a stock DCP reader sees them whole and any layout
loads them. A TP rank holds ``Split.pieces`` of each split parameter (Q, K
and V's rows for its heads are three pieces of the attention's ``qkv``
weight); ``Pieces`` hands DCP one chunk per piece on save, asks for the same
boxes on load (DCP reads them from whatever chunks another layout wrote),
and the two planners below find a piece by its offsets, which DCP's default
planners do only for DTensors and ShardedTensors (whose local part is one
box).

    sd["model/1.qkv.weight"] = Pieces(p, split_of(p))
    dcp.save(sd, storage_writer=..., planner=SavePlanner())
    dcp.load(sd, storage_reader=..., planner=LoadPlanner())
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class Pieces:
    """``local`` (this rank's tensor) as the pieces ``split`` names."""

    def __init__(self, local: torch.Tensor, split):
        if tuple(local.shape) != split.local_shape():
            raise ValueError(
                f"checkpoint: a slice of {list(split.whole)} holds {split.local_shape()}, "
                f"got {list(local.shape)}"
            )
        self.local, self.split = local, split
        self._boxes = split.boxes()

    def size(self) -> torch.Size:
        return torch.Size(self.split.whole)

    def _view(self, offsets) -> torch.Tensor:
        for off, sizes, at in self._boxes:
            if tuple(off) == tuple(offsets):
                view = self.local
                for d, _ in self.split.cuts():
                    view = view.narrow(d, at[d], sizes[d])
                return view
        raise ValueError(f"checkpoint: no piece of this slice starts at {list(offsets)}")

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)),
                    properties=props,
                    size=self.size(),
                ),
            )
            for off, sizes, _ in self._boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._view(index.offset)


def wrap(tensor: torch.Tensor, split):
    """``tensor`` as DCP should see it: Pieces of a split parameter, else itself."""
    return tensor if split is None else Pieces(tensor, split)


class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index).contiguous()
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up replaces every value it does not know (Pieces) with
        # None, in place: put them back.
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)
