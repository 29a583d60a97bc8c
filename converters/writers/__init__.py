"""Output writers behind one protocol, in one table: name -> planner. A planner turns a (transformed) index
into a `Plan` of output parts; `plan.execute` writes them into an open `Output` (which makes the result
atomic), locally or as Ray tasks."""

from __future__ import annotations

from typing import Protocol

from ..copier import Copier
from ..index import CheckpointIndex
from ..output import Output
from ..plan import Plan
from .safetensors import plan_safetensors


class Writer(Protocol):
    def __call__(self, index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
                 max_shard_size: int, metadata: dict[str, str]) -> Plan: ...


def _safetensors(index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
                 max_shard_size: int, metadata: dict[str, str]) -> Plan:
    return plan_safetensors(index, out, copier, cast_to=cast_to, max_shard_size=max_shard_size, metadata=metadata)


def _torch(index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
           max_shard_size: int, metadata: dict[str, str]) -> Plan:
    from .torchsave import plan_torch  # here and in _dcp: the pickle and zip writers load only when used

    return plan_torch(index, cast_to=cast_to)


def _dcp(index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
         max_shard_size: int, metadata: dict[str, str]) -> Plan:
    """One rank holding every tensor whole (`reshard` plans N ranks)."""
    from .dcp import Piece, plan_dcp

    plan = [[Piece(name, entry, ((0,) * len(entry.shape), entry.shape), copier.out_dtype(entry, cast_to))
             for name, entry in index.tensors.items()]]
    return plan_dcp(index, copier, plan, lambda entry: cast_to)


WRITERS: dict[str, Writer] = {"safetensors": _safetensors, "torch": _torch, "dcp": _dcp}
