"""Write safetensors: one file, or HF-sharded files plus `model.safetensors.index.json`."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import dtypes
from ..copier import Copier, pwrite_all
from ..index import CheckpointIndex, TensorEntry

INDEX_NAME = "model.safetensors.index.json"
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
    shards: list[list[Planned]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards


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


def write_file(path: str, items: list[Planned], copier: Copier, cast_to: str | None,
               metadata: dict[str, str], pool: ThreadPoolExecutor) -> int:
    """Write one safetensors file: the header, then every tensor at its offset, several at a time."""
    header = header_bytes(items, metadata)
    total = len(header) + sum(item.nbytes for item in items)
    with open(path, "wb") as fh:
        fd = fh.fileno()
        pwrite_all(fd, header, 0)
        offsets, at = [], len(header)
        for item in items:
            offsets.append(at)
            at += item.nbytes
        futures = [pool.submit(copier.write_at, fd, off, item.entry, cast_to) for off, item in zip(offsets, items)]
        for future in futures:
            future.result()
        os.ftruncate(fd, total)
    return total


def write_safetensors(index: CheckpointIndex, out_dir: str, copier: Copier, *, cast_to: str | None,
                      max_shard_size: int, single_file: bool = False,
                      metadata: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """Write the tensors of `index` under `out_dir` (or to the file `out_dir` when `single_file`)."""
    meta = {"format": "pt", **(metadata or {})}
    items = [Planned(name, entry, copier.out_dtype(entry, cast_to)) for name, entry in index.tensors.items()]
    with ThreadPoolExecutor(copier.threads, thread_name_prefix="ckpt-write") as pool:
        if single_file:
            return [(out_dir, write_file(out_dir, items, copier, cast_to, meta, pool))]
        os.makedirs(out_dir, exist_ok=True)
        shards = plan_shards(items, max_shard_size)
        if len(shards) == 1:
            path = os.path.join(out_dir, SINGLE_NAME)
            return [(SINGLE_NAME, write_file(path, shards[0], copier, cast_to, meta, pool))]
        written: list[tuple[str, int]] = []
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            written.append((name, write_file(os.path.join(out_dir, name), shard, copier, cast_to, meta, pool)))
            weight_map.update({item.name: name for item in shard})
    index_doc = {"metadata": {"total_size": sum(i.nbytes for i in items), **(metadata or {})},
                 "weight_map": weight_map}
    with open(os.path.join(out_dir, INDEX_NAME), "w") as fh:
        json.dump(index_doc, fh, indent=2)
    written.append((INDEX_NAME, os.path.getsize(os.path.join(out_dir, INDEX_NAME))))
    return written
