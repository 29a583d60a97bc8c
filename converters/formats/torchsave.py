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
    """Flatten nested dicts (and lists holding dicts or tensors) into key paths, like DCP does.

    Iterative, so its cost is bounded by the unpickler's limits on objects, shared references and depth."""
    structured = _structured_lists(obj)
    out: dict[tuple[str, ...], Any] = {}
    todo: list[tuple[Any, tuple[str, ...]]] = [(obj, path)]
    while todo:
        node, at = todo.pop()
        if isinstance(node, dict):
            items: list[tuple[Any, Any]] = list(node.items())
        elif isinstance(node, list | tuple) and id(node) in structured:
            items = list(enumerate(node))
        else:
            out[at] = node
            continue
        todo.extend((value, (*at, str(key))) for key, value in reversed(items))
    return out


def _structured_lists(obj: Any) -> set[int]:
    """ids of the lists/tuples that hold a dict or a tensor, directly or through nested lists/tuples."""
    found: set[int] = set()
    seen: set[int] = set()
    todo: list[tuple[Any, bool]] = [(obj, False)]
    while todo:  # post-order: a container is decided after all of its children
        node, children_done = todo.pop()
        if children_done:
            if isinstance(node, list | tuple) and any(isinstance(v, dict | TensorRef) or id(v) in found
                                                      for v in node):
                found.add(id(node))
        elif isinstance(node, dict | list | tuple) and id(node) not in seen:
            seen.add(id(node))
            todo.append((node, True))
            todo.extend((child, False) for child in (node.values() if isinstance(node, dict) else node))
    return found


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
            add_entries(index, archive)
        return index


def add_entries(index: CheckpointIndex, archive: Archive, obj: Any = None) -> list[str]:
    """Add the tensors and values of a torch.save archive (or of `obj`, a part of it) to `index`; their names."""
    names = []
    for path, value in flatten(archive.obj if obj is None else obj).items():
        name = ".".join(path)
        if isinstance(value, TensorRef):
            index.tensors[name] = tensor_entry(name, value, archive)
            index.tensors[name].path = path
        else:
            index.objects[name] = ObjectEntry(name, value=value, path=path)
        names.append(name)
    return names
