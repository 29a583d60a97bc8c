"""Output writers behind one protocol, in one table: name -> writer. Each writes a (transformed) index
into an open `Output` (which makes the result atomic)."""

from __future__ import annotations

from typing import Protocol

from ..copier import Copier
from ..index import CheckpointIndex
from ..output import Output
from .dcp import Piece, write_dcp
from .safetensors import write_safetensors
from .torchsave import write_torch


class Writer(Protocol):
    def __call__(self, index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
                 max_shard_size: int, metadata: dict[str, str]) -> None: ...


def _safetensors(index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
                 max_shard_size: int, metadata: dict[str, str]) -> None:
    write_safetensors(index, out, copier, cast_to=cast_to, max_shard_size=max_shard_size, metadata=metadata)


def _torch(index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
           max_shard_size: int, metadata: dict[str, str]) -> None:
    write_torch(index, out, copier, cast_to=cast_to)


def _dcp(index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
         max_shard_size: int, metadata: dict[str, str]) -> None:
    """One rank holding every tensor whole (`reshard` writes the N-rank plans)."""
    plan = [[Piece(name, entry, ((0,) * len(entry.shape), entry.shape), copier.out_dtype(entry, cast_to))
             for name, entry in index.tensors.items()]]
    write_dcp(index, out, copier, plan, lambda entry: cast_to)


WRITERS: dict[str, Writer] = {"safetensors": _safetensors, "torch": _torch, "dcp": _dcp}
