"""Read an output back with the loader its consumer uses, and compare with our own reading of it.

`--verify` first compares the source with our reading of the output; this module then checks that the
consumer sees the same values: `safetensors.safe_open` for safetensors, `torch.load(weights_only=True,
mmap=True)` for a torch file, and for DCP torch's own metadata reader plus a `dcp.load` of the tensors
(all of them, or a sample within a byte budget) into plain tensors allocated here. Our reading equals
the source, so the consumer's values equal the source too. A file the consumer refuses is a failure.

torch and safetensors are imported here only, when a check runs. Local outputs only: a remote output
gets a note instead (fetching it whole to a local disk would double the cost of the conversion).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import dtypes, storage
from .index import CheckpointIndex, TensorEntry
from .rangeread import RangeReader
from .tensorio import Box, compare_slab, read_box, same_bytes, slabs
from .writers.objects import load_object

CONSUMERS = {"safetensors": "safetensors.safe_open", "torch": "torch.load(weights_only=True, mmap=True)",
             "dcp": "torch.distributed.checkpoint (read_metadata + dcp.load)"}


@dataclass
class ConsumerResult:
    loader: str = ""
    compared: int = 0
    sampled_from: int = 0  # DCP: how many tensors the sample was drawn from (0: all were compared)
    unloadable: list[str] = field(default_factory=list)  # one line per file or entry the consumer refused
    different: list[str] = field(default_factory=list)  # values the consumer sees differently
    note: str = ""


def _fail_line(where: str, loader: str, exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException wraps each rank's (exception, trace)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else exc
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{where}: {loader} cannot load it ({type(exc).__name__}: {text[:300]})"


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(*box))


def _bytes_of(tensor: Any) -> memoryview:
    """The row-major bytes of a torch tensor (any dtype, 0-dim included), without a copy when contiguous."""
    import torch

    return memoryview(tensor.reshape(-1).contiguous().view(torch.uint8).numpy()).cast("B")


def _same(reader: RangeReader, entry: TensorEntry, source: Callable[[Box], Any], budget: int) -> bool:
    """Whether the consumer's slabs (`source(box)`: a torch tensor) hold our bytes for every slab of `entry`."""
    item = dtypes.itemsize(entry.dtype)
    raw = memoryview(bytearray(min(entry.nbytes, max(budget, item))))  # one buffer for every slab
    for box in slabs(entry.shape, item, budget):
        buf = raw[: dtypes.numel(box[1]) * item]
        read_box(reader, entry, box, buf)
        if not same_bytes(_bytes_of(source(box)), buf):
            return False
    return True


class _Remapped:
    """A consumer's file handle (`opener()`), opened again after every `budget` bytes read through it.

    safe_open and torch.load(mmap=True) map the whole file, and every page read stays in this process's
    RSS until the mapping goes: dropping the handle now and then keeps memory flat at any file size."""

    def __init__(self, opener: Callable[[], Any], budget: int) -> None:
        self.opener, self.budget = opener, budget
        self.handle: Any = None
        self.read = 0

    def get(self, nbytes: int) -> Any:
        if self.handle is None or self.read >= self.budget:
            self.handle = None  # unmapped before the next mapping is made
            self.handle, self.read = self.opener(), 0
        self.read += nbytes
        return self.handle


def _check_dtype(entry: TensorEntry, dtype: Any, shape: tuple[int, ...]) -> str | None:
    got = str(dtype).removeprefix("torch.")
    if got != entry.dtype or shape != entry.shape:
        return f"{entry.name} ({got}{list(shape)} vs {entry.dtype}{list(entry.shape)})"
    return None


def _by_file(written: CheckpointIndex) -> dict[str, list[TensorEntry]]:
    """Tensors grouped by the file that holds them (HF-style outputs have several)."""
    by_file: dict[str, list[TensorEntry]] = {}
    for entry in written.tensors.values():
        if entry.chunks:
            by_file.setdefault(entry.chunks[0].data.uri, []).append(entry)
    return dict(sorted(by_file.items()))


def _safetensors(written: CheckpointIndex, reader: RangeReader, budget: int, slab_bytes: int,
                 res: ConsumerResult) -> None:
    from safetensors import safe_open

    for uri, entries in _by_file(written).items():
        path = storage.local_path(uri)
        handle = _Remapped(lambda: safe_open(path, framework="pt"), budget)  # noqa: B023 (used in this loop)
        try:
            for entry in entries:
                item = dtypes.itemsize(entry.dtype)
                first = handle.get(0).get_slice(entry.name)
                shape = tuple(first.get_shape())
                probe = first[_slices(((0,) * len(shape), (1,) * len(shape)))] if shape else None
                dtype = probe.dtype if probe is not None else handle.get(entry.nbytes).get_tensor(entry.name).dtype
                first = probe = None  # both hold the current mapping: let a reopen drop it
                bad = _check_dtype(entry, dtype, shape)

                def slab(box: Box, name: str = entry.name, size: int = item, opened: _Remapped = handle) -> Any:
                    view = opened.get(dtypes.numel(box[1]) * size)
                    return view.get_slice(name)[_slices(box)] if box[0] else view.get_tensor(name)

                if bad is None and not _same(reader, entry, slab, slab_bytes):
                    bad = entry.name
                if bad is not None:
                    res.different.append(bad)
                res.compared += 1
        except Exception as exc:  # safetensors raises its own error types
            res.unloadable.append(_fail_line(path, res.loader, exc))
        finally:
            handle.handle = None


def _walk(root: Any, path: tuple[str, ...]) -> Any:
    node = root
    for key in path:
        node = node[key] if isinstance(node, dict) and key in node else node[int(key)]
    return node


def _torch(written: CheckpointIndex, reader: RangeReader, budget: int, slab_bytes: int, res: ConsumerResult) -> None:
    import torch

    files = _by_file(written)
    for uri, entries in files.items():
        path = storage.local_path(uri)
        handle = _Remapped(lambda: torch.load(path, map_location="cpu", weights_only=True,  # noqa: B023
                                              mmap=True), budget)
        try:
            handle.get(0)
        except Exception as exc:
            res.unloadable.append(_fail_line(path, res.loader, exc))
            continue
        for entry in entries:
            try:
                tensor = _walk(handle.get(0), entry.path)
            except (KeyError, IndexError, ValueError, TypeError):
                tensor = None
            bad = (f"{entry.name} (not a tensor where torch.load puts it)" if not isinstance(tensor, torch.Tensor)
                   else _check_dtype(entry, tensor.dtype, tuple(tensor.shape)))
            tensor = None

            def slab(box: Box, where: tuple[str, ...] = entry.path, item: int = dtypes.itemsize(entry.dtype),
                     opened: _Remapped = handle) -> Any:
                return _walk(opened.get(dtypes.numel(box[1]) * item), where)[_slices(box)]

            if bad is None and not _same(reader, entry, slab, slab_bytes):
                bad = entry.name
            if bad is not None:
                res.different.append(bad)
            res.compared += 1
        if len(files) == 1:  # non-tensor values (optimizer hyper-parameters) sit beside the tensors
            for obj_entry in written.objects.values():
                try:
                    value = _walk(handle.get(0), obj_entry.path)
                except (KeyError, IndexError, ValueError, TypeError):
                    value = KeyError
                if value != load_object(obj_entry, reader):
                    res.different.append(obj_entry.name)
                res.compared += 1
        handle.handle = None


def _sample(entries: list[TensorEntry], budget: int) -> Iterator[TensorEntry]:
    """All of `entries` within `budget` bytes; spread over the list (every k-th first) when they do not fit."""
    if sum(e.nbytes for e in entries) <= budget:
        yield from entries
        return
    step = max(1, len(entries) // 16)
    order = [e for k in range(step) for e in entries[k::step]]
    for entry in order:
        if entry.nbytes <= budget:
            budget -= entry.nbytes
            yield entry


def _dcp(written: CheckpointIndex, root: str, reader: RangeReader, budget: int, slab_bytes: int,
         res: ConsumerResult) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = storage.local_path(root)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()  # our own output's .metadata, written by this run
    except Exception as exc:
        res.unloadable.append(_fail_line(f"{path}/.metadata", "torch.distributed.checkpoint", exc))
        return
    keys = set(metadata.state_dict_metadata)
    for name in sorted((set(written.tensors) | set(written.objects)) ^ keys):
        res.different.append(f"{name} ({'missing from' if name not in keys else 'only in'} DCP's metadata)")
    for name, entry in written.tensors.items():
        meta = metadata.state_dict_metadata.get(name)
        if meta is not None and (not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != entry.shape
                                 or str(meta.properties.dtype).removeprefix("torch.") != entry.dtype):
            res.different.append(f"{name} (DCP's metadata disagrees on dtype or shape)")
    entries = [e for e in written.tensors.values() if e.name in keys]
    chosen = list(_sample(entries, budget))
    if len(chosen) < len(entries):
        res.sampled_from = len(entries)
    state = {e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in chosen}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        res.unloadable.append(_fail_line(path, "dcp.load", exc))
        return
    for entry in chosen:
        tensor = state[entry.name]
        if not _same(reader, entry, lambda box: tensor[_slices(box)], slab_bytes):  # noqa: B023 (called right here)
            res.different.append(entry.name)
        res.compared += 1


def check(written: CheckpointIndex, root: str, fmt: str, reader: RangeReader, budget: int) -> ConsumerResult | None:
    """The consumer's view of the output at `root` (format `fmt`) against ours; None for other formats."""
    if fmt not in CONSUMERS:
        return None
    res = ConsumerResult(loader=CONSUMERS[fmt])
    if not storage.is_local(root):
        res.note = f"{res.loader} not run: the output is remote (only local outputs are loaded by the consumer)"
        return res
    budget = max(64 * 1024, budget)
    slab = compare_slab(budget * 4)
    remap = 2 * slab  # bytes read through a consumer's file mapping before it is made again
    {"safetensors": lambda: _safetensors(written, reader, remap, slab, res),
     "torch": lambda: _torch(written, reader, remap, slab, res),
     "dcp": lambda: _dcp(written, root, reader, budget, slab, res)}[fmt]()
    return res
