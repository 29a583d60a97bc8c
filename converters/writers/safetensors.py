"""Write safetensors: one file, or HF-sharded files plus `model.safetensors.index.json`."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from .. import dtypes
from ..config import ContextPool
from ..copier import Copier, pwrite_all
from ..index import CheckpointIndex, TensorEntry
from ..names import SAFETENSORS_INDEX as INDEX_NAME
from ..output import Output
from ..plan import Plan, greedy_groups
from ..tensorio import group_records, read_positions

SINGLE_NAME = "model.safetensors"


@dataclass
class Planned:
    name: str
    entry: TensorEntry
    dtype: str

    @property
    def nbytes(self) -> int:
        return dtypes.numel(self.entry.shape) * dtypes.itemsize(self.dtype)


def plan_shards(items: list[Planned], max_shard_size: int) -> list[list[Planned]]:
    """Greedy in key order, like huggingface_hub: start a new shard when the next tensor would overflow."""
    return greedy_groups(items, max_shard_size)


def header_bytes(items: list[Planned], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for item in items:
        header[item.name] = {"dtype": dtypes.to_safetensors(item.dtype), "shape": list(item.entry.shape),
                             "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_file(out: Output, name: str, items: list[Planned], copier: Copier, cast_to: str | None,
               metadata: dict[str, str], pool: ThreadPoolExecutor) -> None:
    """One safetensors file: the header, then each tensor (`items`, in file order: `in_file_order`). Locally
    the tensors are written at their offsets by several threads at once; to object storage they stream in
    order (from a remote source, the next tensors are read ahead in the pool's threads while the ones before
    upload: `Copier.in_order`)."""
    header = header_bytes(items, metadata)
    total = len(header) + sum(item.nbytes for item in items)
    if not out.local:
        with out.open(name) as fh, \
                copier.in_order([(item.entry, cast_to, None) for item in items], pool) as streams:
            # a failure stops the readers first, then the upload is aborted
            fh.write(header)
            for blocks in streams:
                for block in blocks:
                    fh.write(block)
        return
    path = out.path(name)
    with open(path, "wb") as fh:
        fd = fh.fileno()
        pwrite_all(fd, header, 0)
        copier.note(fd, 0, header)
        offsets, at = [], len(header)
        for item in items:
            offsets.append(at)
            at += item.nbytes
        copier.write_many(fd, [(off, item.entry, cast_to) for off, item in zip(offsets, items)], pool)
        os.ftruncate(fd, total)
    out.record(name, total)


def in_file_order(items: list[Planned]) -> list[Planned]:
    """`items` in the order a file holds them (as `save_file` writes them), which is the order they are read
    in, with the DCP records they come from grouped for that order (`group_records`)."""
    items = sorted(items, key=lambda item: dtypes.safetensors_order(item.dtype, item.name))
    positions = read_positions([[(item.entry, None) for item in items]])
    tensors = group_records({item.name: item.entry for item in items}, positions)
    return [replace(item, entry=tensors[item.name]) for item in items]


@dataclass
class ShardPart:
    """One safetensors file: its header and tensors, written by `write_file`."""

    name: str
    items: list[Planned]
    cast_to: str | None
    metadata: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    def run(self, out: Output, copier: Copier, pool: ThreadPoolExecutor | None) -> None:
        if pool is not None:
            write_file(out, self.name, self.items, copier, self.cast_to, self.metadata, pool)
            return
        with ContextPool(copier.threads, thread_name_prefix="ckpt-write") as own:
            write_file(out, self.name, self.items, copier, self.cast_to, self.metadata, own)


@dataclass
class SafetensorsPlan(Plan):
    index_doc: dict | None = None

    def finish(self, out: Output, extras: list[object]) -> None:
        if self.index_doc is not None:
            with out.open(INDEX_NAME) as fh:
                fh.write(json.dumps(self.index_doc, indent=2).encode())


def shard_names(count: int) -> list[str]:
    """The Hub's names for `count` shard files (`model.safetensors` alone, else `model-0000i-of-0000n`)."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class Sized(Protocol):
    name: str

    @property
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=Sized)


def write_shards(out: Output, items: list[S], max_shard_size: int, write: Callable[[Output, str, list[S]], None],
                 side: Mapping[str, bytes]) -> None:
    """Write `items` as HF shards, each file by `write`, the index when there is more than one, then the side
    files (name -> bytes): the layout every HF-folder export (quantized, merged) shares."""
    shards = greedy_groups(items, max_shard_size)
    names = shard_names(len(shards))
    for name, shard in zip(names, shards):
        write(out, name, shard)
    if len(shards) > 1:
        doc = {"metadata": {"total_size": sum(i.nbytes for i in items)},
               "weight_map": {item.name: name for name, shard in zip(names, shards) for item in shard}}
        with out.open(INDEX_NAME) as fh:
            fh.write(json.dumps(doc, indent=2).encode())
    for name, data in side.items():
        with out.open(name) as fh:
            fh.write(data)


def plan_safetensors(index: CheckpointIndex, out: Output, copier: Copier, *, cast_to: str | None,
                     max_shard_size: int, metadata: dict[str, str] | None = None) -> SafetensorsPlan:
    """Plan the tensors of `index` as one file (`model.safetensors`, or the target itself when it is a
    `.safetensors` file) or as HF shards plus `model.safetensors.index.json`."""
    meta = {"format": "pt", **(metadata or {})}
    items = [Planned(name, entry, copier.out_dtype(entry, cast_to)) for name, entry in index.tensors.items()]
    for item in items:  # refuse dtypes safetensors cannot hold before anything is written
        dtypes.to_safetensors(item.dtype, item.name)
    if out.single_file:
        return SafetensorsPlan("safetensors", [ShardPart("", in_file_order(items), cast_to, meta)])
    shards = plan_shards(items, max_shard_size)
    parts = [ShardPart(name, in_file_order(shard), cast_to, meta)
             for name, shard in zip(shard_names(len(shards)), shards)]
    if len(parts) == 1:
        return SafetensorsPlan("safetensors", parts)
    weight_map = {item.name: part.name for part in parts for item in part.items}
    index_doc = {"metadata": {"total_size": sum(i.nbytes for i in items), **(metadata or {})},
                 "weight_map": weight_map}
    return SafetensorsPlan("safetensors", parts, index_doc=index_doc)
