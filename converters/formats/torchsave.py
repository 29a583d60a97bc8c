"""Reader for full state dicts saved with `torch.save` (`.pt`, `.bin`, HF `pytorch_model.bin.index.json`).

Only the archive headers and `data.pkl` are read, through the allow-list unpickler; tensors become
byte ranges of their storages, so tied weights (two names, one storage) stay two entries.
"""

from __future__ import annotations

from typing import Any

from .. import storage
from ..errors import FormatError
from ..index import CheckpointIndex, Chunk, ObjectEntry, TensorEntry
from ..names import RANK_FILE, TORCH_INDEX, TORCH_SUFFIXES
from ..torchzip import Archive, read_archive, storage_range
from ..unpickle import TensorRef
from . import index_files
from .base import BaseReader


def flatten(obj: Any, path: tuple[str, ...] = (), where: str = "the state dict") -> dict[tuple[str, ...], Any]:
    """Flatten nested dicts (and lists holding dicts or tensors) into key paths, like DCP does.

    Two entries whose keys read the same (`1` and `"1"`, two NaN keys) are refused, naming both (`where` names
    the file). Iterative, so its cost is bounded by the unpickler's limits on objects, shared references and
    depth."""
    structured = _structured_lists(obj)
    out: dict[tuple[str, ...], Any] = {}
    keys: dict[tuple[str, ...], tuple[Any, ...]] = {}  # path -> the keys it was made from
    todo: list[tuple[Any, tuple[str, ...], tuple[Any, ...]]] = [(obj, path, path)]
    while todo:
        node, at, raw = todo.pop()
        if isinstance(node, dict):
            items: list[tuple[Any, Any]] = list(node.items())
        elif isinstance(node, list | tuple) and id(node) in structured:
            items = list(enumerate(node))
        else:
            if at in keys:
                raise _collision(where, keys[at], raw, ".".join(at))
            out[at], keys[at] = node, raw
            continue
        todo.extend((value, (*at, str(key)), (*raw, key)) for key, value in reversed(items))
    return out


def named(obj: Any, where: str, prefix: tuple[str, ...] = ()) -> dict[str, tuple[tuple[str, ...], Any]]:
    """name -> (key path, value) of a flattened state dict; two paths that join to one dotted name
    (`{"a.b": x, "a": {"b": y}}`) are refused, naming both."""
    out: dict[str, tuple[tuple[str, ...], Any]] = {}
    for path, value in flatten(obj, prefix, where).items():
        name = ".".join(path)
        if name in out:
            raise _collision(where, out[name][0], path, name)
        out[name] = (path, value)
    return out


def _collision(where: str, first: tuple[Any, ...], second: tuple[Any, ...], name: str) -> FormatError:
    keys = [repr(list(k))[:80] for k in (first, second)]
    return FormatError(f"{where}: the entries at keys {keys[0]} and {keys[1]} both flatten to the name "
                       f"{name[:80]!r}; rename one of them and save again", uri=where, key=name)


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
        if TORCH_INDEX in names:
            return torch_files(storage.join(uri, TORCH_INDEX))
        found = [storage.join(uri, n) for n in names if n.endswith(TORCH_SUFFIXES)]
        if len(found) != 1:
            raise FormatError(f"{uri}: expected one torch.save file, found {len(found)}; point at the file", uri=uri)
        return found
    if uri.endswith(".json"):
        return index_files(uri)
    return [uri]


def is_torch_zip(uri: str) -> bool:
    """Whether a file of any name starts as torch.save's zip does: a first member `<archive>/data.pkl` (Lightning's
    consolidated `.consolidated`, a renamed `.pt`); only its first local header is read."""
    head = 30 + 256
    with storage.RangeReader() as reader:
        data = reader.read(uri, 0, min(head, reader.file_size(uri)))
    if len(data) < 30 or data[:4] != b"PK\x03\x04":
        return False
    length = int.from_bytes(data[26:28], "little")
    return 30 + length <= len(data) and data[30:30 + length].endswith(b"/data.pkl")


class TorchSaveReader(BaseReader):
    format = "torch"

    @classmethod
    def sniff_file(cls, uri: str) -> bool:
        name = storage.basename(uri)
        return not RANK_FILE.match(name) and (name.endswith(TORCH_SUFFIXES) or name.endswith(".bin.index.json")
                                              or (not name.endswith(".distcp") and is_torch_zip(uri)))

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        if TORCH_INDEX in names:
            return True
        return len([n for n in names if n.endswith(TORCH_SUFFIXES)]) == 1 and not any(RANK_FILE.match(n) for n in names)

    def read(self, locate: bool = True) -> CheckpointIndex:
        files = torch_files(self.uri)
        index = CheckpointIndex(uri=self.uri, format=self.format, producer="torch.save",
                                files=[storage.basename(f) for f in files])
        for path in files:
            archive = read_archive(self.reader, path)
            if not isinstance(archive.obj, dict):
                raise FormatError(f"{path}: holds a {type(archive.obj).__name__}, not a state dict", uri=path)
            add_entries(index, archive)
        return index


def add_entries(index: CheckpointIndex, archive: Archive, obj: Any = None) -> list[str]:
    """Add the tensors and values of a torch.save archive (or of `obj`, a part of it) to `index`; their names.
    A name the index already holds (from another file of the checkpoint) is refused, naming both files."""
    names = []
    for name, (path, value) in named(archive.obj if obj is None else obj, archive.uri).items():
        if name in index.tensors or name in index.objects:
            raise FormatError(f"{archive.uri}: entry {name!r} is also in another part of the checkpoint "
                              f"({index.uri}); the checkpoint is damaged", uri=archive.uri, key=name)
        if isinstance(value, TensorRef):
            index.tensors[name] = tensor_entry(name, value, archive)
            index.tensors[name].path = path
        else:
            index.objects[name] = ObjectEntry(name, value=value, path=path)
        names.append(name)
    return names
