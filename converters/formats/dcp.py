"""Reader for torch.distributed.checkpoint folders written by FileSystemWriter (`.metadata` + `.distcp`)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, ClassVar

from .. import dtypes, storage
from ..errors import CkptError, FormatError
from ..index import ByteRange, CheckpointIndex, Chunk, ObjectEntry, TensorEntry, count, counts, short
from ..torchzip import record_tensor
from ..unpickle import Stub, loads
from .base import BaseReader

METADATA = ".metadata"
_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")
_ACCELERATE_DIR = re.compile(r"^(pytorch_model_fsdp|optimizer)_\d+$")


def _producer(uri: str, names: list[str]) -> str:
    if _ACCELERATE_DIR.match(storage.basename(uri)):
        return "Accelerate"
    heads = {n.split(".", 1)[0] for n in names}
    if {"epochs_run", "total_epochs", "max_steps_per_epoch"} & heads:  # torchtune's recipe state (TrainingProgress)
        return "torchtune"
    if {"lr_scheduler", "train_state"} & heads:  # torchtitan's CheckpointManager (a dataloader alone says neither)
        return "torchtitan"
    if "model" in heads and heads & {"optim", "optimizer"}:
        return "get_state_dict (model + optimizer)"
    return "torch.distributed.checkpoint"


def _stub(value: Any, kind: str, where: str) -> Stub:
    if not (isinstance(value, Stub) and value.qualname.endswith(kind)):
        raise FormatError(f"{where}: expected a {kind}, found {short(value)}; the metadata is damaged")
    return value


def _dict(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FormatError(f"{where}: expected a dict, found {type(value).__name__}; the metadata is damaged")
    return value


def dcp_subfolders(uri: str, names: list[str]) -> list[str]:
    """The sub-folders of `uri` (listed as `names`) that hold a DCP checkpoint."""
    return [n for n in names if storage.isdir(storage.join(uri, n)) and storage.exists(storage.join(uri, n, METADATA))]


class DcpReader(BaseReader):
    """Reads `.metadata`; each chunk's data is its record (`ByteRange.record`), located in the index for local
    folders and, from object storage, when it is first read (header and data in one request), unless
    `locate_remote` (readers whose tensors are cut into views before reading)."""

    format = "dcp"
    locate_remote: ClassVar[bool] = False

    def __init__(self, uri: str, reader: storage.RangeReader) -> None:
        super().__init__(uri, reader)
        self.where = self.check_where = storage.join(uri, METADATA)

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        return METADATA in names

    def metadata(self) -> Any:
        path = self.where
        if not storage.exists(path):
            raise FormatError(f"{self.uri}: no {METADATA} file, so this is not a DCP checkpoint folder", uri=self.uri)
        md = loads(storage.read_all(path), path)
        if not (isinstance(md, Stub) and md.qualname.endswith("checkpoint.metadata.Metadata")):
            raise FormatError(f"{path}: not a DCP metadata pickle (found {type(md).__name__}); "
                              "point at the checkpoint folder written by torch.distributed.checkpoint", uri=path)
        return md

    def _storage_data(self, md: Stub) -> dict[tuple[str, tuple[int, ...] | None], Stub]:
        by_key: dict[tuple[str, tuple[int, ...] | None], Stub] = {}
        for mi, info in _dict(md.get("storage_data"), f"{self.where} (storage_data)").items():
            mi = _stub(mi, "MetadataIndex", f"{self.where} (storage_data)")
            fqn = mi.get("fqn")
            if not isinstance(fqn, str):
                raise FormatError(f"{self.where}: storage entry name {short(fqn)} is not a string; the metadata is "
                                  "damaged", uri=self.where)
            where = f"{self.where} (storage entry for {fqn!r})"
            offset = mi.get("offset")
            key = (fqn, None if offset is None else counts(offset, where, "offset"))
            by_key[key] = _stub(info, "_StorageInfo", where)
        return by_key

    def read(self, locate: bool = True) -> CheckpointIndex:
        md = self.metadata()
        sd_meta = _dict(md.get("state_dict_metadata"), f"{self.where} (state_dict_metadata)")
        by_key = self._storage_data(md)
        files = sorted({self._rel(info) for info in by_key.values()})
        sizes = self._file_sizes(files, missing_ok=not locate)
        ranks = {int(m.group(1)) for f in files if (m := _RANK_FILE.search(f))}
        index = CheckpointIndex(uri=self.uri, format=self.format, world_size=(max(ranks) + 1) if ranks else None,
                                files=[METADATA, *files])
        missing = sorted(set(files) - set(sizes))
        if missing:
            index.notes.append("data files named in .metadata are missing: " + ", ".join(missing[:5]))
        for name, meta in sd_meta.items():
            if not isinstance(name, str):
                raise FormatError(f"{self.where}: entry name {short(name)} is not a string; the metadata is damaged",
                                  uri=self.where)
            where = f"{self.where} ({name!r})"
            if isinstance(meta, Stub) and meta.qualname.endswith("BytesStorageMetadata"):
                info = by_key.get((name, None))
                if info is None:
                    raise FormatError(f"{self.where}: no storage entry for {name!r}; metadata is damaged",
                                      uri=self.where, key=name)
                index.objects[name] = ObjectEntry(name, data=self._record(info, sizes, name))
                continue
            meta = _stub(meta, "TensorStorageMetadata", where)
            entry = TensorEntry(name, self._dtype(meta, where), counts(meta.get("size"), where, "size"), [])
            chunk_list = meta.get("chunks")
            if not isinstance(chunk_list, list | tuple):
                raise FormatError(f"{where}: chunks is {short(chunk_list)}, expected a list; the metadata is damaged")
            for chunk_meta in chunk_list:
                chunk_meta = _stub(chunk_meta, "ChunkStorageMetadata", where)
                offsets = counts(chunk_meta.get("offsets"), where, "chunk offsets")
                sizes_ = counts(chunk_meta.get("sizes"), where, "chunk sizes")
                info = by_key.get((name, offsets))
                if info is None:
                    raise FormatError(f"{self.where}: no storage entry for chunk {offsets} of "
                                      f"{name!r}; metadata is damaged", uri=self.where)
                entry.chunks.append(Chunk(offsets, sizes_, self._record(info, sizes, name)))
            index.tensors[name] = entry
        if locate and (self.locate_remote or storage.is_local(self.uri)):
            self._locate_all(list(index.tensors.values()))
        planner_data = md.get("planner_data")
        if isinstance(planner_data, dict):
            items: list[TensorEntry | ObjectEntry] = [*index.tensors.values(), *index.objects.values()]
            for item in items:
                path = planner_data.get(item.name)
                if isinstance(path, tuple | list) and path:
                    item.path = tuple(str(p) for p in path)
        index.producer = _producer(self.uri, index.names())
        return index

    @staticmethod
    def _dtype(meta: Stub, where: str) -> str:
        props = meta.get("properties")
        if not isinstance(props, Stub):
            raise FormatError(f"{where}: tensor properties are {short(props)}; the metadata is damaged")
        state = props.state
        dtype_name = state[0] if isinstance(state, tuple) and state else props.get("dtype")
        try:
            return dtypes.canonical(str(dtype_name))
        except CkptError:
            raise FormatError(f"{where}: unknown dtype {short(dtype_name)}; the metadata is damaged") from None

    def _file_sizes(self, files: list[str], missing_ok: bool) -> dict[str, int]:
        sizes = {}
        for rel in files:
            path = storage.join(self.uri, rel)
            if missing_ok and not storage.lexists(path):
                continue
            sizes[rel] = storage.size(path, f"data file named in {METADATA} is missing; the checkpoint is "
                                            "incomplete (re-copy or re-upload it)")
        return sizes

    def _rel(self, info: Stub) -> str:
        """The data file a storage entry names, refused when the name leaves the checkpoint folder."""
        rel = info.get("relative_path")
        storage.member(self.uri, rel, self.where)
        return rel

    def _record(self, info: Stub, sizes: dict[str, int], name: str) -> ByteRange:
        where = f"{self.where} (storage entry for {name!r})"
        rel = self._rel(info)
        offset = count(info.get("offset"), where, "offset")
        length = count(info.get("length"), where, "length")
        if info.get("transform_descriptors"):
            raise FormatError(f"{self.uri}/{rel}: {name!r} is stored with transforms "
                              f"{short(info.get('transform_descriptors'))} (e.g. compression), which this tool "
                              "cannot read; re-save the checkpoint without storage transforms", uri=self.uri)
        if rel in sizes and offset + length > sizes[rel]:
            raise FormatError(f"{storage.join(self.uri, rel)}: file is {sizes[rel]} bytes but {METADATA} places "
                              f"{name!r} at bytes {offset}..{offset + length}; the file is truncated "
                              "(re-copy or re-upload it)")
        return ByteRange(storage.join(self.uri, rel), offset, length, record=(offset, length, 1))

    def _locate_all(self, entries: list[TensorEntry]) -> None:
        """Point every chunk at its tensor's bytes inside its record (a torch.save archive each); the
        records' headers are read side by side from remote storage."""
        jobs = [(entry, chunk) for entry in entries for chunk in entry.chunks]
        found = self.reader.map(lambda job: record_tensor(self.reader, job[1].data, job[0].name, job[0].dtype,
                                                          job[1].sizes), jobs, remote=not storage.is_local(self.uri))
        located = iter(found)
        for entry in entries:
            entry.chunks = [replace(chunk, data=next(located)) for chunk in entry.chunks]
