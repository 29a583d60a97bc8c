"""Write a torch.distributed.checkpoint folder: `__R_0.distcp` per rank plus `.metadata`, torch-free.

Each tensor record is a `torch.save` archive of one contiguous chunk, exactly what FileSystemWriter
writes; `.metadata` is the same pickle `dcp.save` makes (built with `picklewriter`), so
`dcp.load` reads the folder at this world size or any other.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from .. import dtypes, picklewriter
from ..copier import Copier
from ..index import CheckpointIndex, ObjectEntry, TensorEntry
from ..output import Output
from ..picklewriter import Call, Global, Obj, Pairs
from ..plan import Plan
from ..tensorio import Box, group_records, read_positions
from ..zipwriter import ZipWriter, serial_id
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
            copy_range: Callable[..., int] | None = None, serial: str | None = None,
            note: Callable[[int, Any], None] | None = None) -> int:
    """Write one torch.save archive at `start`; return its length (`note`: told what is written where)."""
    zw = ZipWriter(fh, archive="archive", start=start, note=note)
    zw.add("data.pkl", pickled)
    for name, chunks, size in members:
        zw.write_member(name, chunks, size, copy_range)
    zw.add_torch_records(serial)
    return zw.close()


def object_blob(value: Any, serial: str | None = None) -> bytes:
    """A torch.save archive of a plain Python value (how DCP stores non-tensor entries)."""
    import io

    buf = io.BytesIO()
    zw = ZipWriter(buf, archive="archive")
    zw.add("data.pkl", picklewriter.dumps(value))
    zw.add_torch_records(serial)
    zw.close()
    return buf.getvalue()


Record = tuple[str, tuple[int, ...] | None, int, int, Box | None]  # name, chunk offsets, at, length, box


@dataclass
class RankPart:
    """`__R_0.distcp` of one target rank: one torch.save record per piece, then (rank 0) the non-tensor
    entries. Returns where each record landed, for `.metadata`."""

    rank: int
    pieces: list[Piece]
    objects: list[ObjectEntry]
    serial: str = field(default_factory=serial_id)  # the archives' ids derive from it (see `serial_id`)
    folder: str = ""  # the DCP folder inside the output ('' for the output itself)

    @property
    def file(self) -> str:
        """The file's name inside its DCP folder (what `.metadata` names)."""
        return f"__{self.rank}_0.distcp"

    @property
    def name(self) -> str:
        return in_folder(self.folder, self.file)

    @property
    def nbytes(self) -> int:
        return sum(dtypes.numel(p.box[1]) * dtypes.itemsize(p.dtype) for p in self.pieces)

    def run(self, out: Output, copier: Copier, pool: object = None) -> list[Record]:
        records: list[Record] = []
        at = 0
        # piece.dtype is the output dtype: as a cast target it casts exactly when the plan did
        jobs = [(piece.entry, piece.dtype, piece.box) for piece in self.pieces]
        with out.open(self.name) as fh, (nullcontext(None) if out.local else copier.in_order(jobs)) as ahead:
            note = partial(copier.note, fh.fileno()) if out.local else None
            for i, piece in enumerate(self.pieces):
                nbytes = dtypes.numel(piece.box[1]) * dtypes.itemsize(piece.dtype)
                stream = ahead[i] if ahead is not None else copier.pieces(*jobs[i], as_ranges=True)
                pickled = picklewriter.tensor_pickle("0", piece.dtype, tuple(piece.box[1]))
                length = _record(fh, at, pickled, [("data/0", stream, nbytes)], copier.copy_range,
                                 serial_id(self.serial, self.rank, i), note)
                records.append((piece.name, piece.box[0], at, length, piece.box))
                at += length
            for obj in self.objects:
                blob = object_blob(writable_object(obj, copier.reader), serial_id(self.serial, self.rank, obj.name))
                fh.write(blob)
                if note is not None:
                    note(at, blob)
                records.append((obj.name, None, at, len(blob), None))
                at += len(blob)
        return records


@dataclass
class DcpPlan(Plan):
    """Rank files as parts; `.metadata` (chunks in rank order, storage offsets) by the driver at the end."""

    tensor_meta: dict[str, tuple[str, tuple[int, ...], tuple[str, ...]]] = field(default_factory=dict)
    object_paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    folder: str = ""

    def finish(self, out: Output, extras: list[list[Record]]) -> None:
        storage_data = Pairs()
        chunks: dict[str, list[Box]] = {name: [] for name in self.tensor_meta}
        for part, records in zip(self.parts, extras):
            for name, offsets, at, length, box in records:
                state: dict[str, Any] = {"fqn": name, "offset": None if offsets is None else _size(offsets),
                                         "index": None}
                if box is not None:
                    state["index"] = len(chunks[name])
                    chunks[name].append(box)
                info = {"relative_path": part.file, "offset": at, "length": length, "transform_descriptors": None}
                storage_data.append((Obj(Global(_MD, "MetadataIndex"), state),
                                     Obj(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"), info)))
        sd_meta: dict[str, Any] = {name: _tensor_meta(dtype, shape, chunks[name])
                                   for name, (dtype, shape, _) in self.tensor_meta.items()}
        for name in self.object_paths:
            sd_meta[name] = Obj(Global(_MD, "BytesStorageMetadata"), {})
        paths = {name: path for name, (_, _, path) in self.tensor_meta.items()} | self.object_paths
        planner_data = {name: _planner_path(path) for name, path in paths.items()}
        storage_meta = Obj(Global(_MD, "StorageMeta"), {"checkpoint_id": None, "save_id": str(uuid.uuid4()),
                                                        "load_id": None, "modules": []})
        metadata = Obj(Global(_MD, "Metadata"), {"state_dict_metadata": sd_meta, "planner_data": planner_data,
                                                 "storage_data": storage_data, "storage_meta": storage_meta,
                                                 "version": "1.0.0"})
        with out.open(in_folder(self.folder, ".metadata")) as fh:
            fh.write(picklewriter.dumps(metadata))


def in_folder(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def plan_dcp(index: CheckpointIndex, copier: Copier, plan: list[list[Piece]],
             cast_for: Callable[[TensorEntry], str | None], folder: str = "") -> DcpPlan:
    """Rank R's pieces go into `__R_0.distcp`; non-tensor entries go to rank 0; then `.metadata`; all inside
    `folder` of the output when given (a DCP folder of several in one output, as Accelerate saves)."""
    for name, entry in index.tensors.items():  # refuse what dcp.load cannot read before anything is written
        dtypes.check_dcp(entry.dtype, name)
    serial = serial_id()
    # the DCP records the ranks read, grouped for the order they read them in, side by side
    grouped = group_records({p.name: p.entry for pieces in plan for p in pieces},
                            read_positions([[(p.entry, p.box) for p in pieces] for pieces in plan]))
    plan = [[replace(p, entry=grouped[p.name]) for p in pieces] for pieces in plan]
    parts = [RankPart(rank, pieces, list(index.objects.values()) if rank == 0 else [], serial, folder)
             for rank, pieces in enumerate(plan)]
    tensor_meta = {name: (copier.out_dtype(entry, cast_for(entry) or entry.dtype), entry.shape, entry.path)
                   for name, entry in index.tensors.items()}
    object_paths = {name: obj.path for name, obj in index.objects.items()}
    return DcpPlan("dcp", parts, parallel=True, tensor_meta=tensor_meta, object_paths=object_paths, folder=folder)
