"""Reader for safetensors: one file, an HF-sharded folder (`model.safetensors.index.json`), or a DCP
folder written by HuggingFaceStorageWriter (per-rank files whose header carries `DCP_SHARDING_INFO`)."""

from __future__ import annotations

import struct

from .. import dtypes, storage
from ..errors import FormatError
from ..index import ByteRange, CheckpointIndex, Chunk, TensorEntry, count, counts, short
from ..jsonsafe import loads
from ..names import SAFETENSORS_INDEX
from . import index_files
from .base import BaseReader

SHARDING_KEY = "DCP_SHARDING_INFO"
_MAX_HEADER = 100 * 1024 * 1024


def read_header(reader: storage.RangeReader, uri: str) -> tuple[dict, int]:
    """(header JSON, absolute offset of the data section) of a safetensors file; the header's size is checked
    against the file's real size before it is read."""
    size = reader.file_size(uri)
    if size < 8:
        raise FormatError(f"{uri}: not a safetensors file (shorter than 8 bytes)", uri=uri)
    (length,) = struct.unpack("<Q", reader.read(uri, 0, 8))
    if length > min(_MAX_HEADER, storage.max_metadata_bytes()):
        raise FormatError(f"{uri}: not a safetensors file (header length {length} is implausible)", uri=uri)
    if 8 + length > size:
        raise FormatError(f"{uri}: header of {length} bytes runs past the end of the {size}-byte file; the file is "
                          "truncated (re-copy or re-upload it)", uri=uri)
    header = loads(reader.read(uri, 8, length), uri, "the safetensors header")
    if not isinstance(header, dict):
        raise FormatError(f"{uri}: safetensors header is a JSON {type(header).__name__}, expected an object", uri=uri)
    return header, 8 + length


def _entry(path: str, name: str, info: object) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field checked."""
    where = f"{path} ({name!r})"
    if not isinstance(info, dict):
        raise FormatError(f"{where}: header entry is {short(info)}, expected an object with dtype, shape and "
                          "data_offsets; the file is damaged")
    code = info.get("dtype")
    dtype = dtypes.from_safetensors(code, path, name)
    shape = counts(info.get("shape"), where, "shape")
    offsets = info.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise FormatError(f"{where}: data_offsets is {short(offsets)}, expected [begin, end]; the file is damaged")
    begin, end = count(offsets[0], where, "data_offsets[0]"), count(offsets[1], where, "data_offsets[1]")
    if end < begin or end - begin != dtypes.numel(shape) * dtypes.itemsize(dtype):
        raise FormatError(f"{where}: data_offsets {offsets} hold {end - begin} bytes, but shape {list(shape)} {dtype} "
                          f"needs {dtypes.numel(shape) * dtypes.itemsize(dtype)}; the file is damaged")
    return dtype, shape, begin, end


def _metadata(path: str, header: dict) -> dict[str, tuple[int, ...]]:
    """The string metadata of a header, and from it HF-DCP's saved offsets per tensor (empty if none)."""
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{path} (__metadata__): must be an object of strings; the file is damaged", uri=path)
    if SHARDING_KEY not in meta:
        return {}
    where = f"{path} (__metadata__.{SHARDING_KEY})"
    sharding = loads(meta[SHARDING_KEY], where, SHARDING_KEY)
    if not isinstance(sharding, dict) or not all(isinstance(v, dict) for v in sharding.values()):
        raise FormatError(f"{where}: expected an object of tensor name -> {{saved_offsets}}; the file is damaged")
    return {name: counts(info.get("saved_offsets"), f"{where} ({name!r})", "saved_offsets")
            for name, info in sharding.items()}


def check_layout(path: str, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """Tensor byte ranges must lie in the data section, must not overlap and must cover it (as safetensors
    itself requires: a header length off by a few bytes would otherwise shift every tensor)."""
    last_end, last_name = 0, ""
    for begin, end, name in sorted(spans):
        if begin < last_end:
            raise FormatError(f"{path} ({name!r}): data_offsets overlap those of {last_name!r}; the file is damaged",
                              uri=path)
        last_end, last_name = end, name
    if last_end > data_bytes:
        raise FormatError(f"{path} ({last_name!r}): data ends at byte {last_end} of a {data_bytes}-byte data "
                          "section; the file is truncated (re-copy or re-upload it)", uri=path)
    covered = sum(end - begin for begin, end, _ in spans)
    if covered != data_bytes:
        raise FormatError(f"{path}: the tensors cover {covered} of the {data_bytes} bytes after the header (the format "
                          "allows no holes); the header length or data_offsets are damaged", uri=path)


def safetensors_files(uri: str) -> list[str]:
    """The data files of a safetensors checkpoint given as a file, an index file, or a folder."""
    if not storage.isdir(uri):
        if uri.endswith(".json"):
            return index_files(uri)
        return [uri]
    names = storage.listdir(uri)
    if SAFETENSORS_INDEX in names:
        return safetensors_files(storage.join(uri, SAFETENSORS_INDEX))
    found = [storage.join(uri, n) for n in names if n.endswith(".safetensors")]
    if not found and "sharded" in names:
        return safetensors_files(storage.join(uri, "sharded"))
    return found


class SafetensorsReader(BaseReader):
    format = "safetensors"

    @classmethod
    def sniff_file(cls, uri: str) -> bool:
        name = storage.basename(uri)
        return name.endswith(".safetensors") or name == SAFETENSORS_INDEX

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        return SAFETENSORS_INDEX in names or "sharded" in names or any(n.endswith(".safetensors") for n in names)

    def read(self, locate: bool = True) -> CheckpointIndex:
        files = safetensors_files(self.uri)
        if not files:
            raise FormatError(f"{self.uri}: no .safetensors files found", uri=self.uri)
        index = CheckpointIndex(uri=self.uri, format=self.format, producer="safetensors",
                                files=[storage.basename(f) for f in files])
        sharded = False
        headers = self.reader.map(lambda path: read_header(self.reader, path), files,
                                  remote=not storage.is_local(self.uri))
        for path, (header, data_start) in zip(files, headers):
            saved = _metadata(path, header)
            sharded = sharded or bool(saved)
            spans = []
            for name, info in header.items():
                dtype, shape, begin, end = _entry(path, name, info)
                spans.append((begin, end, name))
                offsets = saved.get(name, (0,) * len(shape))
                if len(offsets) != len(shape):
                    raise FormatError(f"{path} ({name!r}): saved_offsets {list(offsets)} do not match shape "
                                      f"{list(shape)}; the file is damaged", uri=path)
                chunk = Chunk(offsets, shape, ByteRange(path, data_start + begin, end - begin))
                entry = index.tensors.get(name)
                if entry is None:
                    index.tensors[name] = TensorEntry(name, dtype, shape, [chunk], path=(name,))
                elif entry.dtype != dtype or len(entry.shape) != len(shape):
                    raise FormatError(f"{path} ({name!r}): {dtype}{list(shape)} here, {entry.dtype}"
                                      f"{list(entry.shape)} in another file; the checkpoint is damaged", uri=path)
                else:
                    entry.chunks.append(chunk)
                    entry.shape = tuple(max(a, o + s) for a, o, s in zip(entry.shape, offsets, shape))
            check_layout(path, spans, self.reader.file_size(path) - data_start)
        if sharded:
            index.format, index.producer = "hf-dcp", "HuggingFaceStorageWriter"
            ranks = {f.rsplit("shard-", 1)[-1][:5] for f in files if "shard-" in storage.basename(f)}
            index.world_size = len(ranks) or None
        return index
