"""`scan`: per-tensor statistics of any checkpoint the engine reads, in one streaming pass.

The source is opened as `verify` opens it (`load_index`, then the key clean-up of `transforms.apply`), and
each tensor is read through the copier's slabs (`Copier.stream`, DCP records located, and grouped for the
order they are read in, as a conversion to safetensors reads them), one slab read ahead in a thread while
two threads compute on the one before: memory stays at two slabs plus two float64 sub-blocks whatever the
checkpoint's size. What is computed, and how, is in `moments`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from .. import storage
from ..config import ContextPool, EngineConfig, use
from ..copier import DEFAULT_MEMORY_LIMIT, Copier, Progress
from ..errors import OptionError, SourceError
from ..files import static_source
from ..formats import load_index
from ..index import CheckpointIndex, TensorEntry
from ..readahead import Budget, ReadAhead
from ..tensorio import group_records, read_positions
from ..transforms import KeyOptions, apply
from .moments import SUPPORTED, Moments, TensorStats, numpy_dtype

#: the key clean-up `verify` applies when none is given: every entry, under clean names, not nested
DEFAULT_KEYS = KeyOptions(only="all", clean=True, nest=False)
SLAB_BYTES = 8 << 20  # bytes read at a time: two slabs (one read ahead) stay small
SPLIT_ELEMENTS = 1 << 17  # a block of twice this or more is computed in two threads


@dataclass
class ScanResult:
    source: str
    format: str
    tensors: list[TensorStats] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "name (dtype)": dtypes without statistics (complex, packed)
    bytes_read: int = 0

    @property
    def nonfinite(self) -> list[str]:
        """Names of the tensors holding a NaN or an infinity."""
        return [t.name for t in self.tensors if t.nonfinite]

    @property
    def finite(self) -> bool:
        return not self.nonfinite

    def by_name(self) -> dict[str, TensorStats]:
        return {t.name: t for t in self.tensors}

    def summary(self) -> str:
        bad = self.nonfinite
        line = f"{len(self.tensors)} tensors, {self.bytes_read} bytes scanned"
        if self.skipped:
            line += f"; no statistics for {len(self.skipped)} (dtype): " + ", ".join(self.skipped[:5])
        if bad:
            return line + f"; non-finite values in {len(bad)}: " + ", ".join(bad[:8]) + (
                f" (+{len(bad) - 8})" if len(bad) > 8 else "")
        return line + "; all finite"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "format": self.format, "finite": self.finite, "nonfinite": self.nonfinite,
                "bytes_read": self.bytes_read, "skipped": self.skipped,
                "tensors": [t.to_dict() for t in self.tensors]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def tensor_stats(entry: TensorEntry, blocks: Iterable[memoryview], helper: Executor | None = None) -> TensorStats:
    """The statistics of `entry` from its row-major bytes in `blocks` (`Copier.stream`). With `helper` (a pool),
    the second half of each large block is computed there while this thread computes the first, and the two
    are merged (Chan's update again) at the end."""
    moments = Moments(entry.name, entry.dtype, entry.shape)
    second = Moments(entry.name, entry.dtype, entry.shape)
    kind = numpy_dtype(entry.dtype)
    for view in blocks:
        values = np.frombuffer(view, dtype=kind)
        half = values.size // 2
        if helper is None or half < SPLIT_ELEMENTS:
            moments.add(values)
            continue
        other = helper.submit(second.add, values[half:])
        try:
            moments.add(values[:half])
        finally:
            other.result()  # the block's buffer is reused once this loop moves on
    moments.merge(second)
    return moments.result()


@contextmanager
def reading(uri: str) -> Iterator[None]:
    """An OSError while reading `uri` becomes one SourceError naming the file (remote listings cached)."""
    try:
        with static_source(uri):
            yield
    except OSError as exc:
        name = os.fsdecode(exc.filename) if exc.filename else uri
        raise SourceError(f"{name}: cannot read ({exc.strerror or exc}); check the checkpoint {uri}",
                          uri=name) from None


def select(index: CheckpointIndex, keys: KeyOptions | None, reader: storage.RangeReader) -> CheckpointIndex:
    """`index` under the key clean-up `verify` uses (or `keys`)."""
    return apply(index, keys or DEFAULT_KEYS, reader).index


def scan(source: str, *, source_format: str | None = None, keys: KeyOptions | None = None,
         memory_limit: int = DEFAULT_MEMORY_LIMIT, on_progress: Callable[[Progress], None] | None = None,
         config: EngineConfig | None = None) -> ScanResult:
    """Per-tensor statistics of the checkpoint at `source` (any format the engine reads), streamed in one
    read pass under `config` (default: the engine config in force). `keys` picks and names the tensors as in
    `verify` (default: all of them, keys cleaned)."""
    if memory_limit < 1024 * 1024:
        raise OptionError("memory_limit must be at least 1MiB", option="memory_limit")
    with use(config), reading(source):
        reader = storage.RangeReader()
        try:
            index = load_index(source, source_format, reader=reader)
            view = select(index, keys, reader)
            result = ScanResult(source, index.format)
            chosen = [t for t in view.tensors.values() if t.dtype in SUPPORTED]
            # DCP records from object storage fetched in groups, for the order they are read in here
            chosen = list(group_records({t.name: t for t in chosen}, read_positions([[(t, None) for t in chosen]]))
                          .values())
            result.skipped = [f"{t.name} ({t.dtype})" for t in view.tensors.values() if t.dtype not in SUPPORTED]
            progress = Progress(total_bytes=sum(t.nbytes for t in chosen), total_tensors=len(chosen),
                                callback=on_progress)
            copier = Copier(reader, memory_limit, progress, threads=1)
            copier.slab_bytes = min(copier.slab_bytes, SLAB_BYTES)
            with ContextPool(1, thread_name_prefix="ckpt-scan") as pool, \
                    ContextPool(1, thread_name_prefix="ckpt-stats") as helper, \
                    ReadAhead(pool, [partial(copier.stream, entry, None, None) for entry in chosen],
                              Budget(2 * copier.slab_bytes)) as ahead:
                for i, entry in enumerate(chosen):  # one thread reads the next slab while two compute
                    result.tensors.append(tensor_stats(entry, ahead.blocks(i), helper))
                    result.bytes_read += entry.nbytes
            return result
        finally:
            reader.close()
