"""Reader for safetensors: one file, an HF-sharded folder (`model.safetensors.index.json`), or a DCP
folder written by HuggingFaceStorageWriter (per-rank files whose header carries `DCP_SHARDING_INFO`)."""

from __future__ import annotations

import json
import struct

from .. import dtypes, storage
from ..errors import FormatError
from ..index import ByteRange, CheckpointIndex, Chunk, TensorEntry, check_tiling

INDEX_NAME = "model.safetensors.index.json"
SHARDING_KEY = "DCP_SHARDING_INFO"
_MAX_HEADER = 100 * 1024 * 1024


def read_header(reader: storage.RangeReader, uri: str) -> tuple[dict, int]:
    """(header JSON, absolute offset of the data section) of a safetensors file."""
    try:
        (length,) = struct.unpack("<Q", reader.read(uri, 0, 8))
    except Exception:
        raise FormatError(f"{uri}: not a safetensors file (shorter than 8 bytes)") from None
    if length > _MAX_HEADER:
        raise FormatError(f"{uri}: not a safetensors file (header length {length} is implausible)")
    try:
        header = json.loads(reader.read(uri, 8, length))
    except (ValueError, UnicodeDecodeError):
        raise FormatError(f"{uri}: not a safetensors file (header is not JSON)") from None
    return header, 8 + length


def safetensors_files(uri: str) -> list[str]:
    """The data files of a safetensors checkpoint given as a file, an index file, or a folder."""
    if not storage.isdir(uri):
        if uri.endswith(".json"):
            weight_map = json.loads(storage.read_all(uri)).get("weight_map", {})
            base = storage.parent(uri)
            return [storage.join(base, name) for name in sorted(set(weight_map.values()))]
        return [uri]
    names = storage.listdir(uri)
    if INDEX_NAME in names:
        return safetensors_files(storage.join(uri, INDEX_NAME))
    found = [storage.join(uri, n) for n in names if n.endswith(".safetensors")]
    if not found and "sharded" in names:
        return safetensors_files(storage.join(uri, "sharded"))
    return found


class SafetensorsReader:
    format = "safetensors"

    def __init__(self, uri: str, reader: storage.RangeReader) -> None:
        self.uri = uri
        self.reader = reader

    def index(self, locate: bool = True) -> CheckpointIndex:
        files = safetensors_files(self.uri)
        if not files:
            raise FormatError(f"{self.uri}: no .safetensors files found")
        index = CheckpointIndex(uri=self.uri, format=self.format, producer="safetensors",
                                files=[storage.basename(f) for f in files])
        sharded = False
        for path in files:
            header, data_start = read_header(self.reader, path)
            meta = header.pop("__metadata__", None) or {}
            sharding = json.loads(meta[SHARDING_KEY]) if SHARDING_KEY in meta else {}
            sharded = sharded or bool(sharding)
            for name, info in header.items():
                shape = tuple(int(s) for s in info["shape"])
                begin, end = info["data_offsets"]
                offsets = tuple(int(o) for o in sharding.get(name, {}).get("saved_offsets", [0] * len(shape)))
                dtype = dtypes.from_safetensors(info["dtype"])
                if end - begin != dtypes.numel(shape) * dtypes.itemsize(dtype):
                    raise FormatError(f"{path}: {name!r} has {end - begin} bytes for shape {list(shape)} "
                                      f"{dtype}; the file is damaged")
                chunk = Chunk(offsets, shape, ByteRange(path, data_start + begin, end - begin))
                entry = index.tensors.get(name)
                if entry is None:
                    index.tensors[name] = TensorEntry(name, dtype, shape, [chunk], path=(name,))
                else:
                    entry.chunks.append(chunk)
                    entry.shape = tuple(max(a, o + s) for a, o, s in zip(entry.shape, offsets, shape))
            if locate:
                last = max((info["data_offsets"][1] for info in header.values()), default=0)
                if storage.size(path) < data_start + last:
                    raise FormatError(f"{path}: file is shorter than its header says; it is truncated "
                                      "(re-copy or re-upload it)")
        if sharded:
            index.format, index.producer = "hf-dcp", "HuggingFaceStorageWriter"
            ranks = {f.rsplit("shard-", 1)[-1][:5] for f in files if "shard-" in storage.basename(f)}
            index.world_size = len(ranks) or None
            for entry in index.tensors.values():
                check_tiling(entry, self.uri)
        return index
