"""Reader for full state dicts saved with `torch.save` (`.pt`, `.bin`, HF `pytorch_model.bin.index.json`).

Only the archive headers and `data.pkl` are read, through the allow-list unpickler; tensors become
byte ranges of their storages, so tied weights (two names, one storage) stay two entries.
"""

from __future__ import annotations

from typing import Any

from .. import storage
from ..errors import FormatError
from ..index import CheckpointIndex, Chunk, ObjectEntry, TensorEntry
from ..torchzip import Archive, read_archive, storage_range
from ..unpickle import TensorRef
from . import index_files

BIN_INDEX_NAME = "pytorch_model.bin.index.json"


def flatten(obj: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Flatten nested dicts (and lists holding dicts or tensors) into key paths, like DCP does."""
    out: dict[tuple[str, ...], Any] = {}
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list | tuple) and any(isinstance(v, dict | TensorRef) for v in _leaves(obj)):
        items = enumerate(obj)
    else:
        return {path: obj}
    for key, value in items:
        out.update(flatten(value, (*path, str(key))))
    return out


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, list | tuple):
        return [leaf for v in obj for leaf in (_leaves(v) if isinstance(v, list | tuple) else [v])]
    return [obj]


def tensor_entry(name: str, ref: TensorRef, archive: Archive) -> TensorEntry:
    data = storage_range(archive.uri, name, ref, archive.storage(ref.storage.key), archive.uri)
    return TensorEntry(name, ref.dtype, ref.shape, [Chunk((0,) * len(ref.shape), ref.shape, data)])


def torch_files(uri: str) -> list[str]:
    if storage.isdir(uri):
        names = storage.listdir(uri)
        if BIN_INDEX_NAME in names:
            return torch_files(storage.join(uri, BIN_INDEX_NAME))
        found = [storage.join(uri, n) for n in names if n.endswith((".pt", ".pth", ".bin", ".ckpt"))]
        if len(found) != 1:
            raise FormatError(f"{uri}: expected one torch.save file, found {len(found)}; point at the file")
        return found
    if uri.endswith(".json"):
        return index_files(uri)
    return [uri]


class TorchSaveReader:
    format = "torch"

    def __init__(self, uri: str, reader: storage.RangeReader) -> None:
        self.uri = uri
        self.reader = reader

    def index(self, locate: bool = True) -> CheckpointIndex:
        files = torch_files(self.uri)
        index = CheckpointIndex(uri=self.uri, format=self.format, producer="torch.save",
                                files=[storage.basename(f) for f in files])
        for path in files:
            archive = read_archive(self.reader, path)
            if not isinstance(archive.obj, dict):
                raise FormatError(f"{path}: holds a {type(archive.obj).__name__}, not a state dict")
            for path, value in flatten(archive.obj).items():
                name = ".".join(path)
                if isinstance(value, TensorRef):
                    index.tensors[name] = tensor_entry(name, value, archive)
                    index.tensors[name].path = path
                else:
                    index.objects[name] = ObjectEntry(name, value=value, path=path)
        return index
