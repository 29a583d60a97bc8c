"""The model weights of a checkpoint, under clean names: what the serving exports (FP8, GGUF) read."""

from __future__ import annotations

from . import storage
from .errors import FormatError
from .formats import load_index
from .index import CheckpointIndex
from .transforms import KeyOptions, apply


def model_view(source: str, source_format: str | None, reader: storage.RangeReader, doing: str) -> CheckpointIndex:
    """`source`'s model tensors (no optimizer state, keys cleaned); a checkpoint without any is refused in one
    line saying what there was nothing `doing` (e.g. "to quantize")."""
    view = apply(load_index(source, source_format, reader=reader), KeyOptions(only="model"), reader).index
    if not view.tensors:
        raise FormatError(f"{source}: holds no model tensors {doing}", uri=source)
    return view
