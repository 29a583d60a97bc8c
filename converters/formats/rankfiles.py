"""Reader for per-rank `torch.save` files of a sharded state dict (`rank0.pt … rankN.pt`,
Accelerate's `pytorch_model_fsdp_0_rank{r}.bin`): FSDP1 ShardedTensor and FSDP2 DTensor values.

The files are read through the allow-list unpickler: ShardedTensor and DTensor become plain
records of their metadata and local tensor, so no process group, no torch.distributed import and
no foreign code is needed. A DTensor's local storage carries FSDP2's padding; its true chunk is
computed from the global shape with `torch.chunk` semantics and read as a prefix of that storage.
"""

from __future__ import annotations

from typing import Any

from .. import dtypes, storage
from ..errors import FormatError
from ..index import CheckpointIndex, Chunk, ObjectEntry, TensorEntry
from ..layouts import chunk_bounds
from ..names import RANK_FILE
from ..torchzip import Archive, read_archive
from ..unpickle import (
    BASE_ALLOWED,
    Bad,
    Device,
    DType,
    Stub,
    TensorRef,
    Token,
    Wrapped,
    check_args,
    check_bool,
    check_int,
    check_ints,
    enum_int,
    stub_token,
)
from .base import BaseReader
from .torchsave import named, tensor_entry

_SHARD = "torch.distributed._shard"
_STUBS = [
    f"{_SHARD}.sharded_tensor.shard.Shard",
    f"{_SHARD}.metadata.ShardMetadata",
    "torch.distributed.remote_device._remote_device",
    f"{_SHARD}.sharded_tensor.metadata.ShardedTensorMetadata",
    f"{_SHARD}.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
    f"{_SHARD}.sharded_tensor.api.ShardedTensor.ProcessGroupState",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
    "torch.distributed.tensor.placement_types.Shard",
    "torch.distributed.tensor.placement_types.Replicate",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed._tensor.placement_types.Shard",
    "torch.distributed._tensor.placement_types.Replicate",
]
_SUBCLASSES = [
    f"{_SHARD}.sharded_tensor.api.ShardedTensor",
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor._api.DTensor",
]
# getattr(class, name) pairs torch writes (ShardedTensor pickles its nested ProcessGroupState class)
_ATTRIBUTES = {(f"{_SHARD}.sharded_tensor.api.ShardedTensor", "ProcessGroupState")}


def _wrapper_subclass(args: tuple) -> tuple:
    """`_rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad)`."""
    name = "torch._utils._rebuild_wrapper_subclass"
    check_args(args, name, 8, 8)
    cls, dtype, size, stride, offset, layout, device, requires_grad = args
    if not isinstance(cls, Token) or cls.kind != "subclass":
        raise Bad(f"{name}: unsupported tensor subclass {cls!r}")
    if type(dtype) is not DType or type(device) is not Device or not isinstance(layout, str):
        raise Bad(f"{name}: dtype, layout and device arguments have the wrong types")
    check_ints(size, f"{name}: size")
    check_ints(stride, f"{name}: stride")
    check_int(offset, f"{name}: storage offset")
    check_bool(requires_grad, f"{name}: requires_grad")
    return args


def _getattr(args: tuple) -> Token:
    check_args(args, "getattr", 2, 2)
    owner, name = args
    if not isinstance(owner, Token) or (owner.qualname, name) not in _ATTRIBUTES:
        raise Bad(f"the pickle calls getattr({owner!r}, {name!r}), which torch does not write")
    return ALLOWED[f"{owner.qualname}.{name}"]


_TENSOR_PROPERTIES = f"{_SHARD}.sharded_tensor.metadata.TensorProperties"
ALLOWED: dict[str, Any] = {
    **BASE_ALLOWED,
    **{name: stub_token(name) for name in _STUBS},
    **{name: Token(name, kind="subclass") for name in _SUBCLASSES},
    _TENSOR_PROPERTIES: stub_token(_TENSOR_PROPERTIES, "tuple"),
    f"{_SHARD}.sharded_tensor.metadata.MEM_FORMAT_ENCODING": Token(
        f"{_SHARD}.sharded_tensor.metadata.MEM_FORMAT_ENCODING", enum_int("MEM_FORMAT_ENCODING")),
    "torch._utils._rebuild_wrapper_subclass": Token("torch._utils._rebuild_wrapper_subclass", _wrapper_subclass,
                                                     kind="wrapper"),
    "__builtin__.getattr": Token("__builtin__.getattr", _getattr),
    "builtins.getattr": Token("builtins.getattr", _getattr),
}


def _fields(obj: Any) -> dict[str, Any]:
    """The state of a stub as a dict (dataclass state, or (None, slots) pairs)."""
    state = obj.state if isinstance(obj, Stub) else obj
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        merged = dict(state[0] or {})
        merged.update(state[1])
        return merged
    return state if isinstance(state, dict) else {}


class RankFilesReader(BaseReader):
    format = "rank-files"

    @classmethod
    def sniff_file(cls, uri: str) -> bool:
        return bool(RANK_FILE.match(storage.basename(uri)))

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        return any(RANK_FILE.match(n) for n in names)

    def _groups(self) -> dict[str, dict[int, str]]:
        """stem -> {rank: path}, e.g. {"": {0: rank0.pt, 1: rank1.pt}, "optim_": {...}}."""
        folder = self.uri if storage.isdir(self.uri) else storage.parent(self.uri)
        groups: dict[str, dict[int, str]] = {}
        for name in storage.listdir(folder):
            m = RANK_FILE.match(name)
            if m:
                groups.setdefault(m.group("stem"), {})[int(m.group("rank"))] = storage.join(folder, name)
        if not storage.isdir(self.uri):
            stem = RANK_FILE.match(storage.basename(self.uri))
            groups = {stem.group("stem"): groups[stem.group("stem")]} if stem else {}
        return groups

    def read(self, locate: bool = True) -> CheckpointIndex:
        groups = self._groups()
        if not groups:
            raise FormatError(f"{self.uri}: no per-rank files (rank0.pt, …_rank0.bin) found", uri=self.uri)
        world = {len(g) for g in groups.values()}
        index = CheckpointIndex(uri=self.uri, format=self.format, world_size=max(world),
                                files=sorted(storage.basename(p) for g in groups.values() for p in g.values()))
        kinds: set[str] = set()
        for stem, files in sorted(groups.items()):
            n = len(files)
            missing = sorted(set(range(n)) - set(files))
            if missing:
                raise FormatError(f"{self.uri}: {stem}rank{missing[0]} file is missing (found ranks "
                                  f"{sorted(files)}); copy every rank's file", uri=self.uri)
            optimizer = "optim" in stem.lower()
            for rank, path in sorted(files.items()):
                archive = read_archive(self.reader, path, allowed=ALLOWED)
                try:
                    self._add_file(index, archive, rank, n, ("optim",) if optimizer else (), kinds)
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                    # the stand-ins hold what the pickle said; fields of the wrong shape end here, by file
                    raise FormatError(f"{path}: not a sharded state dict as torch writes it "
                                      f"({type(exc).__name__} in its fields); the file is damaged", uri=path) from None
        index.producer = " + ".join(sorted(kinds)) or "torch.save per rank"
        return index

    def _add_file(self, index: CheckpointIndex, archive: Archive, rank: int, world: int,
                  prefix: tuple[str, ...], kinds: set[str]) -> None:
        if not isinstance(archive.obj, dict):
            raise FormatError(f"{archive.uri}: holds a {type(archive.obj).__name__}, not a state dict", uri=archive.uri)
        for name, (path, value) in named(archive.obj, archive.uri, prefix).items():
            if isinstance(value, Wrapped):
                chunks, dtype, shape = self._wrapped_chunks(archive, name, value, rank, world, kinds)
                entry = index.tensors.get(name)
                if entry is None:
                    index.tensors[name] = TensorEntry(name, dtype, shape, chunks, path=path)
                else:
                    entry.chunks.extend(chunks)
            elif isinstance(value, TensorRef):
                if name not in index.tensors:  # replicated on every rank: keep rank 0's copy
                    entry = tensor_entry(name, value, archive)
                    entry.path = path
                    index.tensors[name] = entry
            elif name not in index.objects:
                index.objects[name] = ObjectEntry(name, value=value, path=path)

    def _wrapped_chunks(self, archive: Archive, name: str, value: Wrapped, rank: int, world: int,
                        kinds: set[str]) -> tuple[list[Chunk], str, tuple[int, ...]]:
        args = value.args  # checked by _wrapper_subclass
        dtype, shape = str(args[1]), tuple(args[2])
        where = f"{archive.uri} ({name})"
        if value.kind.endswith("ShardedTensor"):
            kinds.add("FSDP1 ShardedTensor")
            return self._sharded_tensor(archive, where, value, shape), dtype, shape
        if value.kind.endswith("DTensor"):
            kinds.add("FSDP2 DTensor")
            return self._dtensor(archive, where, value, shape, rank, world), dtype, shape
        raise FormatError(f"{where}: unsupported tensor subclass {value.kind}")

    def _sharded_tensor(self, archive: Archive, where: str, value: Wrapped, shape: tuple[int, ...]) -> list[Chunk]:
        state = value.state
        shards = state[0] if isinstance(state, tuple) else _fields(state).get("_local_shards", [])
        chunks = []
        for shard in shards:
            f = _fields(shard)
            meta = _fields(f.get("metadata"))
            ref = f.get("tensor")
            if not isinstance(ref, TensorRef):
                raise FormatError(f"{where}: shard holds no tensor")
            sizes = tuple(int(s) for s in meta["shard_sizes"])
            if ref.shape != sizes:
                raise FormatError(f"{where}: shard tensor is {list(ref.shape)}, metadata says {list(sizes)}")
            entry = tensor_entry(where, ref, archive)
            chunks.append(Chunk(tuple(int(o) for o in meta["shard_offsets"]), sizes, entry.chunks[0].data))
        return chunks

    def _dtensor(self, archive: Archive, where: str, value: Wrapped, shape: tuple[int, ...], rank: int,
                 world: int) -> list[Chunk]:
        state = _fields(value.state)
        local, spec = state.get("_local_tensor"), _fields(state.get("_spec"))
        placements = list(spec.get("placements") or [])
        if not isinstance(local, TensorRef):
            raise FormatError(f"{where}: DTensor holds no local tensor")
        if len(placements) != 1:
            raise FormatError(f"{where}: DTensor on a {len(placements)}-D mesh; only 1-D meshes (FSDP2) are "
                              "supported for per-rank files; save with torch.distributed.checkpoint instead")
        placement = placements[0]
        if placement.qualname.endswith("Replicate"):
            if rank != 0:
                return []
            entry = tensor_entry(where, local, archive)
            return entry.chunks
        if not placement.qualname.endswith(".Shard"):
            raise FormatError(f"{where}: unsupported DTensor placement {placement.qualname}")
        dim = int(_fields(placement).get("dim", placement.args[0] if placement.args else 0))
        start, size = chunk_bounds(shape[dim], world, rank)
        sizes = tuple(size if d == dim else s for d, s in enumerate(shape))
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        if size == 0:
            return []
        if dim != 0 and not local.is_contiguous():
            raise FormatError(f"{where}: non-contiguous local shard; save with torch.distributed.checkpoint")
        # the local tensor may carry padding rows beyond `size`: take the leading `size` rows
        trimmed = TensorRef(local.storage, local.offset, sizes, local.stride)
        if dim != 0 and local.shape[dim] != size:
            raise FormatError(f"{where}: padded shard on dim {dim} is not supported")
        entry = tensor_entry(where, trimmed, archive)
        if dtypes.numel(local.shape) < dtypes.numel(sizes):
            raise FormatError(f"{where}: local shard {list(local.shape)} is smaller than its chunk {list(sizes)}")
        return [Chunk(offsets, sizes, entry.chunks[0].data)]
