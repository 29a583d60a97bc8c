"""Write a torch.distributed.checkpoint folder: `__R_0.distcp` per rank plus `.metadata`, torch-free.

Each tensor record is a `torch.save` archive of one contiguous chunk, exactly what FileSystemWriter
writes; `.metadata` is the same pickle `dcp.save` makes (built with `picklewriter`), so
`dcp.load` reads the folder at this world size or any other.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import dtypes, picklewriter
from ..copier import Copier
from ..index import CheckpointIndex, TensorEntry
from ..output import Output
from ..picklewriter import Call, Global, Obj, Pairs
from ..tensorio import Box
from ..zipwriter import ZipWriter
from .objects import writable_object

_MD = "torch.distributed.checkpoint.metadata"
_SIZE = Global("torch", "Size")


@dataclass
class Piece:
    name: str
    entry: TensorEntry
    box: Box
    dtype: str


def _size(values: tuple[int, ...]) -> Call:
    return Call(_SIZE, (tuple(values),))


def _tensor_meta(dtype: str, shape: tuple[int, ...], chunks: list[Box]) -> Obj:
    props = Obj(Global(_MD, "TensorProperties"), (
        Global("torch", dtype), Call(Global("torch.serialization", "_get_layout"), ("torch.strided",)), False,
        Call(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,)), False))
    chunk_objs = [Obj(Global(_MD, "ChunkStorageMetadata"), {"offsets": _size(o), "sizes": _size(s)})
                  for o, s in chunks]
    return Obj(Global(_MD, "TensorStorageMetadata"), {"properties": props, "size": _size(shape),
                                                      "chunks": chunk_objs})


def _planner_path(path: tuple[str, ...]) -> tuple[Any, ...]:
    """DCP keeps list indices (param_groups.<i>) as ints in planner paths."""
    return tuple(int(p) if p.isdigit() and i > 0 and path[i - 1] == "param_groups" else p
                 for i, p in enumerate(path))


def _record(fh: Any, start: int, pickled: bytes, members: list[tuple[str, Any, int]],
            copy_range: Callable[..., int] | None = None) -> int:
    """Write one torch.save archive at `start`; return its length."""
    zw = ZipWriter(fh, archive="archive", start=start)
    zw.add("data.pkl", pickled)
    for name, chunks, size in members:
        zw.write_member(name, chunks, size, copy_range)
    zw.add_torch_records()
    return zw.close()


def object_blob(value: Any) -> bytes:
    """A torch.save archive of a plain Python value (how DCP stores non-tensor entries)."""
    import io

    buf = io.BytesIO()
    zw = ZipWriter(buf, archive="archive")
    zw.add("data.pkl", picklewriter.dumps(value))
    zw.add_torch_records()
    zw.close()
    return buf.getvalue()


def write_dcp(index: CheckpointIndex, out: Output, copier: Copier, plan: list[list[Piece]],
              cast_for: Callable[[TensorEntry], str | None]) -> None:
    """Write rank R's pieces into `__R_0.distcp`; non-tensor entries go to rank 0; then `.metadata`."""
    for name, entry in index.tensors.items():  # refuse what dcp.load cannot read before anything is written
        dtypes.check_dcp(entry.dtype, name)
    storage_data = Pairs()
    chunks: dict[str, list[Box]] = {name: [] for name in index.tensors}

    def index_key(fqn: str, offsets: tuple[int, ...] | None, i: int | None) -> Obj:
        state = {"fqn": fqn, "offset": None if offsets is None else _size(offsets), "index": i}
        return Obj(Global(_MD, "MetadataIndex"), state)

    def info(rel: str, offset: int, length: int) -> Obj:
        return Obj(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                   {"relative_path": rel, "offset": offset, "length": length, "transform_descriptors": None})

    def write_rank(rank: int) -> list[tuple[Obj, Obj, Box | None]]:
        rel = f"__{rank}_0.distcp"
        entries: list[tuple[Obj, Obj, Box | None]] = []
        at = 0
        with out.open(rel) as fh:
            for piece in plan[rank]:
                nbytes = dtypes.numel(piece.box[1]) * dtypes.itemsize(piece.dtype)
                stream = copier.pieces(piece.entry, cast_for(piece.entry), piece.box, in_kernel=out.local)
                pickled = picklewriter.dumps(picklewriter.tensor("0", piece.dtype, piece.box[1]))
                length = _record(fh, at, pickled, [("data/0", stream, nbytes)], copier.copy_range)
                entries.append((index_key(piece.name, piece.box[0], None), info(rel, at, length), piece.box))
                at += length
            if rank == 0:
                for name, obj in index.objects.items():
                    blob = object_blob(writable_object(obj, copier.reader))
                    fh.write(blob)
                    entries.append((index_key(name, None, None), info(rel, at, len(blob)), None))
                    at += len(blob)
        return entries

    with ThreadPoolExecutor(min(copier.threads, len(plan)), thread_name_prefix="ckpt-rank") as pool:
        results = list(pool.map(write_rank, range(len(plan))))
    for entries in results:
        for key, value, box in entries:
            if box is not None:
                key.state["index"] = len(chunks[key.state["fqn"]])
                chunks[key.state["fqn"]].append(box)
            storage_data.append((key, value))
    sd_meta: dict[str, Any] = {}
    for name, entry in index.tensors.items():
        dtype = cast_for(entry) or entry.dtype
        sd_meta[name] = _tensor_meta(copier.out_dtype(entry, dtype), entry.shape, chunks[name])
    for name in index.objects:
        sd_meta[name] = Obj(Global(_MD, "BytesStorageMetadata"), {})
    planner_data = {name: _planner_path(e.path) for name, e in [*index.tensors.items(), *index.objects.items()]}  # type: ignore[attr-defined]  # both entry kinds have .path; mypy joins them to object
    storage_meta = Obj(Global(_MD, "StorageMeta"), {"checkpoint_id": None, "save_id": str(uuid.uuid4()),
                                                    "load_id": None, "modules": []})
    metadata = Obj(Global(_MD, "Metadata"), {"state_dict_metadata": sd_meta, "planner_data": planner_data,
                                             "storage_data": storage_data, "storage_meta": storage_meta,
                                             "version": "1.0.0"})
    with out.open(".metadata") as fh:
        fh.write(picklewriter.dumps(metadata))
