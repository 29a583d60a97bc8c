"""Reader for torch.distributed.checkpoint folders written by FileSystemWriter (`.metadata` + `.distcp`)."""

from __future__ import annotations

import re
from typing import Any

from .. import dtypes, storage
from ..errors import FormatError, SourceError
from ..index import ByteRange, CheckpointIndex, Chunk, ObjectEntry, TensorEntry, check_tiling
from ..torchzip import read_archive
from ..unpickle import Stub, loads

METADATA = ".metadata"
_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")
_ACCELERATE_DIR = re.compile(r"^(pytorch_model_fsdp|optimizer)_\d+$")


def _tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _producer(uri: str, names: list[str]) -> str:
    if _ACCELERATE_DIR.match(storage.basename(uri)):
        return "Accelerate"
    heads = {n.split(".", 1)[0] for n in names}
    if {"dataloader", "lr_scheduler", "train_state"} & heads:
        return "torchtitan"
    if "model" in heads and heads & {"optim", "optimizer"}:
        return "get_state_dict (model + optimizer)"
    return "torch.distributed.checkpoint"


class DcpReader:
    format = "dcp"

    def __init__(self, uri: str, reader: storage.RangeReader) -> None:
        self.uri = uri
        self.reader = reader

    def metadata(self) -> Any:
        path = storage.join(self.uri, METADATA)
        if not storage.exists(path):
            raise FormatError(f"{self.uri}: no {METADATA} file, so this is not a DCP checkpoint folder")
        md = loads(storage.read_all(path), path)
        if not (isinstance(md, Stub) and md.qualname.endswith("checkpoint.metadata.Metadata")):
            raise FormatError(f"{path}: not a DCP metadata pickle (found {type(md).__name__}); "
                              "point at the checkpoint folder written by torch.distributed.checkpoint")
        return md

    def index(self, locate: bool = True) -> CheckpointIndex:
        md = self.metadata()
        sd_meta: dict[str, Stub] = md.get("state_dict_metadata") or {}
        storage_data: dict[Any, Stub] = md.get("storage_data") or {}
        by_key: dict[tuple[str, tuple[int, ...] | None], Stub] = {}
        for mi, info in storage_data.items():
            offset = mi.get("offset")
            by_key[(mi.get("fqn"), None if offset is None else _tuple(offset))] = info
        files = sorted({info.get("relative_path") for info in storage_data.values()})
        sizes = self._file_sizes(files) if locate else {}
        ranks = {int(m.group(1)) for f in files if (m := _RANK_FILE.search(f))}
        index = CheckpointIndex(uri=self.uri, format=self.format, world_size=(max(ranks) + 1) if ranks else None,
                                files=[METADATA, *files])
        for name, meta in sd_meta.items():
            if meta.qualname.endswith("BytesStorageMetadata"):
                info = by_key.get((name, None))
                if info is None:
                    raise FormatError(f"{self.uri}/{METADATA}: no storage entry for {name!r}; metadata is damaged")
                index.objects[name] = ObjectEntry(name, data=self._record(info, sizes, name, locate))
                continue
            props = meta.get("properties")
            dtype_name = props.state[0] if isinstance(props.state, tuple) else props.get("dtype")
            entry = TensorEntry(name, dtypes.canonical(str(dtype_name)), _tuple(meta.get("size")), [])
            for chunk_meta in meta.get("chunks"):
                offsets, sizes_ = _tuple(chunk_meta.get("offsets")), _tuple(chunk_meta.get("sizes"))
                info = by_key.get((name, offsets))
                if info is None:
                    raise FormatError(f"{self.uri}/{METADATA}: no storage entry for chunk {offsets} of "
                                      f"{name!r}; metadata is damaged")
                record = self._record(info, sizes, name, locate)
                data = self._locate(record, entry, sizes_) if locate else record
                entry.chunks.append(Chunk(offsets, sizes_, data))
            check_tiling(entry, f"{self.uri}/{METADATA}")
            index.tensors[name] = entry
        planner_data = md.get("planner_data")
        if isinstance(planner_data, dict):
            for entry in [*index.tensors.values(), *index.objects.values()]:
                path = planner_data.get(entry.name)
                if isinstance(path, tuple | list) and path:
                    entry.path = tuple(str(p) for p in path)
        index.producer = _producer(self.uri, index.names())
        return index

    def _file_sizes(self, files: list[str]) -> dict[str, int]:
        sizes = {}
        for rel in files:
            path = storage.join(self.uri, rel)
            try:
                sizes[rel] = storage.size(path)
            except (FileNotFoundError, OSError):
                raise SourceError(f"{path}: data file named in {METADATA} is missing; the checkpoint is "
                                  "incomplete (re-copy or re-upload it)") from None
        return sizes

    def _record(self, info: Stub, sizes: dict[str, int], name: str, locate: bool) -> ByteRange:
        rel = info.get("relative_path")
        offset, length = int(info.get("offset")), int(info.get("length"))
        if info.get("transform_descriptors"):
            raise FormatError(f"{self.uri}/{rel}: {name!r} is stored with transforms "
                              f"{info.get('transform_descriptors')} (e.g. compression), which this tool cannot "
                              "read; re-save the checkpoint without storage transforms")
        if locate and offset + length > sizes[rel]:
            raise SourceError(f"{storage.join(self.uri, rel)}: file is {sizes[rel]} bytes but {METADATA} places "
                              f"{name!r} at bytes {offset}..{offset + length}; the file is truncated "
                              "(re-copy or re-upload it)")
        return ByteRange(storage.join(self.uri, rel), offset, length)

    def _locate(self, record: ByteRange, entry: TensorEntry, sizes: tuple[int, ...]) -> ByteRange:
        label = f"{record.uri}@{record.offset}"
        archive = read_archive(self.reader, record.uri, record.offset, record.length, label=label,
                               single_storage=True)
        ref = archive.obj
        if not hasattr(ref, "storage"):
            raise FormatError(f"{label}: record for {entry.name!r} holds no tensor")
        if ref.shape != sizes or ref.dtype != entry.dtype:
            raise FormatError(f"{label}: record for {entry.name!r} is {ref.dtype}{list(ref.shape)}, metadata says "
                              f"{entry.dtype}{list(sizes)}; the checkpoint is damaged")
        member = archive.storage(ref.storage.key)
        item = dtypes.itemsize(ref.dtype)
        start = member.data_offset + ref.offset * item
        if ref.is_contiguous():
            return ByteRange(record.uri, start, dtypes.numel(sizes) * item)
        span = 1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride)) if dtypes.numel(sizes) else 0
        return ByteRange(record.uri, start, span * item, ref.stride)
