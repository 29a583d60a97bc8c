"""`diff`: what changed between two checkpoints of any formats, tensor by tensor and layer by layer.

Both sides are opened as `verify` opens them (`load_index`, the same key clean-up), and each tensor present
on both sides with the same shape is read in the same bounded slabs from each (`tensorio.read_box` into two
reused buffers, as `verification` compares), then widened to float64 in cache-sized sub-blocks: memory stays
at two slabs and two sub-blocks whatever the checkpoints' sizes.

Per tensor: whether the bytes are identical (same dtype), the largest |a-b|, and the relative L2 change
||a-b|| / ||b|| (0 when both are zero, inf when only `b` is). Equal non-finite values (NaN against NaN, +Inf
against +Inf) count as no difference; a non-finite value against anything else makes the largest difference
inf and is counted, and the L2 norms cover the finite differences and the finite values of `b`. A tensor
`differs` when some |a-b| > atol + rtol * |b| (`torch.isclose`'s rule) or a non-finite value is unmatched.
Values are compared in float64 (exact for every floating dtype; integers beyond 2**53 round, though equal
bytes are still found identical).

Layers: tensors grouped by their key up to the first numeric component (`layers.3` of
`layers.3.mlp.up.weight`, `optim.state.layers.3` of its optimizer state) or else by their module (the key
without its last component): per layer the tensors changed and the relative L2 change of all of them
together, so that frozen layers and a resume that loaded nothing stand out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import dtypes, storage
from ..config import EngineConfig, use
from ..copier import DEFAULT_MEMORY_LIMIT, Progress
from ..errors import OptionError
from ..formats import load_index
from ..index import TensorEntry
from ..tensorio import compare_slab, read_box, same_bytes, slabs
from ..transforms import KeyOptions
from ..writers.objects import load_object
from . import moments
from .moments import SUPPORTED, Widener, json_number, numpy_dtype, sum_squares
from .stats import reading, select


@dataclass
class TensorDiff:
    name: str
    dtype: str  # in `a`
    other_dtype: str  # in `b`
    shape: tuple[int, ...]
    identical: bool = True  # the same bytes (False whenever the dtypes differ)
    max_abs_diff: float = 0.0
    diff_l2: float = 0.0  # ||a-b|| over the finite differences
    l2: float = 0.0  # ||b|| over its finite values
    unmatched_nonfinite: int = 0  # positions where a non-finite value faces a different value
    differs: bool = False  # beyond rtol/atol (or an unmatched non-finite value)

    @property
    def changed(self) -> bool:
        """Any value differs at all (the bytes may differ and the values not: -0.0 against 0.0)."""
        return self.max_abs_diff > 0 or self.unmatched_nonfinite > 0

    @property
    def rel_l2(self) -> float:
        return relative(self.diff_l2, self.l2)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "other_dtype": self.other_dtype, "shape": list(self.shape),
                "identical": self.identical, "max_abs_diff": json_number(self.max_abs_diff),
                "rel_l2": json_number(self.rel_l2), "diff_l2": json_number(self.diff_l2), "l2": json_number(self.l2),
                "unmatched_nonfinite": self.unmatched_nonfinite, "differs": self.differs}


@dataclass
class LayerDiff:
    name: str
    tensors: int = 0
    changed: int = 0  # tensors whose values changed at all
    differs: int = 0  # tensors beyond the tolerance
    max_abs_diff: float = 0.0
    diff_sq: float = 0.0
    sq: float = 0.0

    @property
    def rel_l2(self) -> float:
        return relative(math.sqrt(self.diff_sq), math.sqrt(self.sq))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tensors": self.tensors, "changed": self.changed, "differs": self.differs,
                "max_abs_diff": json_number(self.max_abs_diff), "rel_l2": json_number(self.rel_l2)}


@dataclass
class DiffResult:
    a: str
    b: str
    rtol: float
    atol: float
    tensors: list[TensorDiff] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)  # entries (tensors and objects) in `a` alone
    only_b: list[str] = field(default_factory=list)
    shape_mismatch: list[str] = field(default_factory=list)  # "name (float32[4, 2] vs float32[2, 4])": not compared
    dtype_mismatch: list[str] = field(default_factory=list)  # names: compared by value in float64
    objects_differ: list[str] = field(default_factory=list)  # non-tensor entries that are not equal
    skipped: list[str] = field(default_factory=list)  # "name (dtype)": dtypes without values to compare
    layers: list[LayerDiff] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        """The checkpoints differ beyond rtol/atol: a tensor's values, an entry on one side only, a shape, a
        non-tensor entry (dtypes alone do not: compare a cast export with a tolerance)."""
        return bool(self.only_a or self.only_b or self.shape_mismatch or self.objects_differ
                    or any(t.differs for t in self.tensors))

    def moved_most(self, n: int = 5) -> list[LayerDiff]:
        """The `n` changed layers with the largest relative change (those with unmatched NaN/Inf first)."""
        return sorted((layer for layer in self.layers if layer.changed),
                      key=lambda layer: (math.isinf(layer.max_abs_diff), layer.rel_l2), reverse=True)[:n]

    def unchanged(self) -> list[str]:
        """Layers none of whose tensors changed at all (frozen, or not loaded on resume)."""
        return [layer.name for layer in self.layers if not layer.changed]

    def summary(self) -> str:
        differing = [t.name for t in self.tensors if t.differs]
        head = (f"differ beyond rtol={self.rtol:g}, atol={self.atol:g}" if self.differs
                else f"equal within rtol={self.rtol:g}, atol={self.atol:g}")
        parts = [f"{head}: {len(self.tensors)} tensors compared, {len(differing)} differ, "
                 f"{sum(t.identical for t in self.tensors)} identical"]
        for label, names in (("values differ", differing), (f"only in {self.a}", self.only_a),
                             (f"only in {self.b}", self.only_b), ("shapes differ", self.shape_mismatch),
                             ("dtypes differ", self.dtype_mismatch), ("objects differ", self.objects_differ),
                             ("not compared (dtype)", self.skipped)):
            if names:
                parts.append(f"{label}: {', '.join(names[:8])}" + (f" (+{len(names) - 8})" if len(names) > 8 else ""))
        moved = self.moved_most()
        if moved:
            parts.append("moved most: " + ", ".join(f"{layer.name} ({layer.rel_l2:.3g})" for layer in moved))
        still = self.unchanged()
        if still and moved:
            parts.append(f"unchanged: {', '.join(still[:8])}" + (f" (+{len(still) - 8})" if len(still) > 8 else ""))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "rtol": self.rtol, "atol": self.atol, "differs": self.differs,
                "only_a": self.only_a, "only_b": self.only_b, "shape_mismatch": self.shape_mismatch,
                "dtype_mismatch": self.dtype_mismatch, "objects_differ": self.objects_differ,
                "skipped": self.skipped, "unchanged_layers": self.unchanged(),
                "layers": [layer.to_dict() for layer in self.layers],
                "tensors": [t.to_dict() for t in self.tensors]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def relative(diff: float, base: float) -> float:
    if base:
        return diff / base
    return 0.0 if diff == 0 else math.inf


def layer_of(name: str) -> str:
    """The layer a key belongs to: up to its first numeric component, else its module (`layers.3`,
    `optim.state.layers.3`, `tok_emb` of `tok_emb.weight`; a key without a dot is its own layer)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


class _Pair:
    """Differences of one tensor, fed with aligned blocks of both sides as numpy arrays."""

    def __init__(self, diff: TensorDiff, rtol: float, atol: float) -> None:
        self.diff, self.rtol, self.atol = diff, rtol, atol
        self.wide_a, self.wide_b = Widener(diff.dtype), Widener(diff.other_dtype)
        self.diff_sq = 0.0
        self.sq = 0.0
        self._scratch = np.empty(0, dtype=np.float64)

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        step = moments.SUB_BLOCK
        for start in range(0, a.size, step):
            self._add_part(a[start: start + step], b[start: start + step])

    def _add_part(self, part_a: np.ndarray, part_b: np.ndarray) -> None:
        a = self.wide_a.load(part_a)
        b = self.wide_b.load(part_b)
        if self._scratch.size < a.size:
            self._scratch = np.empty(max(a.size, moments.SUB_BLOCK), dtype=np.float64)
        d = np.subtract(a, b, out=self._scratch[: a.size])
        with np.errstate(invalid="ignore"):
            top = float(np.abs(d).max()) if d.size else 0.0
        if not math.isfinite(top):  # a non-finite value on either side
            same = (a == b) | (np.isnan(a) & np.isnan(b))
            d[same] = 0.0
            bad = ~np.isfinite(d)
            unmatched = int(np.count_nonzero(bad))
            d[bad] = 0.0
            b = np.where(np.isfinite(b), b, 0.0)
            self.diff.unmatched_nonfinite += unmatched
            top = math.inf if unmatched else float(np.abs(d).max())
        self.diff.max_abs_diff = max(self.diff.max_abs_diff, top)
        self.diff_sq += sum_squares(d)
        self.sq += sum_squares(b)
        if not self.diff.differs:
            if self.diff.unmatched_nonfinite:
                self.diff.differs = True
            elif top > self.atol:  # |a-b| <= atol passes whatever rtol is
                self.diff.differs = bool(np.any(np.abs(d) > self.atol + self.rtol * np.abs(b)))

    def result(self) -> TensorDiff:
        self.diff.diff_l2 = math.sqrt(self.diff_sq)
        self.diff.l2 = math.sqrt(self.sq)
        return self.diff


def tensor_diff(reader: storage.RangeReader, a: TensorEntry, b: TensorEntry, budget: int, rtol: float,
                atol: float, progress: Progress | None = None) -> TensorDiff:
    """Compare `a` with `b` (same shape) slab by slab, each side read into its own reused buffer."""
    diff = TensorDiff(a.name, a.dtype, b.dtype, a.shape, identical=a.dtype == b.dtype)
    pair = _Pair(diff, rtol, atol)
    item_a, item_b = dtypes.itemsize(a.dtype), dtypes.itemsize(b.dtype)
    boxes = list(slabs(a.shape, max(item_a, item_b), budget))
    most = max((dtypes.numel(box[1]) for box in boxes), default=0)
    raw_a, raw_b = memoryview(bytearray(most * item_a)), memoryview(bytearray(most * item_b))
    kind_a, kind_b = numpy_dtype(a.dtype), numpy_dtype(b.dtype)
    for box in boxes:
        n = dtypes.numel(box[1])
        buf_a, buf_b = raw_a[: n * item_a], raw_b[: n * item_b]
        read_box(reader, a, box, buf_a)
        read_box(reader, b, box, buf_b)
        if progress is not None:
            progress.add(len(buf_a) + len(buf_b))
        if diff.identical and same_bytes(buf_a, buf_b):  # no difference: only ||b|| is needed
            pair.sq += _sum_squares(pair.wide_b, np.frombuffer(buf_b, dtype=kind_b))
            continue
        diff.identical = False
        pair.add(np.frombuffer(buf_a, dtype=kind_a), np.frombuffer(buf_b, dtype=kind_b))
    if progress is not None:
        progress.add(tensors=1)
    return pair.result()


def _sum_squares(wide: Widener, values: np.ndarray) -> float:
    total = 0.0
    step = moments.SUB_BLOCK
    for start in range(0, values.size, step):
        x = wide.load(values[start: start + step])
        if not np.isfinite(x).all():
            x = x[np.isfinite(x)]
        total += sum_squares(x)
    return total


def diff(a: str, b: str, rtol: float = 0.0, atol: float = 0.0, *, a_format: str | None = None,
         b_format: str | None = None, keys: KeyOptions | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
         on_progress: Callable[[Progress], None] | None = None, config: EngineConfig | None = None) -> DiffResult:
    """Compare checkpoint `a` with checkpoint `b` (any formats the engine reads) after the same key clean-up
    (`keys`, default `verify`'s: every entry under clean names), streaming both sides, under `config`."""
    if rtol < 0 or atol < 0 or not (math.isfinite(rtol) and math.isfinite(atol)):
        raise OptionError(f"rtol {rtol:g}, atol {atol:g}: tolerances are finite and not negative", option="rtol")
    if memory_limit < 1024 * 1024:
        raise OptionError("memory_limit must be at least 1MiB", option="memory_limit")
    with use(config), reading(a), reading(b):
        reader = storage.RangeReader()
        try:
            left = select(load_index(a, a_format, reader=reader), keys, reader)
            right = select(load_index(b, b_format, reader=reader), keys, reader)
            result = DiffResult(a, b, rtol, atol)
            names_a = set(left.tensors) | set(left.objects)
            names_b = set(right.tensors) | set(right.objects)
            result.only_a = sorted(names_a - names_b)
            result.only_b = sorted(names_b - names_a)
            budget = compare_slab(memory_limit)
            pairs = []
            for name, ta in left.tensors.items():
                tb = right.tensors.get(name)
                if tb is None:
                    continue
                if ta.shape != tb.shape:
                    result.shape_mismatch.append(f"{name} ({ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)})")
                elif ta.dtype not in SUPPORTED or tb.dtype not in SUPPORTED:
                    result.skipped.append(f"{name} ({ta.dtype} vs {tb.dtype})")
                else:
                    result.dtype_mismatch += [name] if ta.dtype != tb.dtype else []
                    pairs.append((ta, tb))
            progress = Progress(total_bytes=sum(ta.nbytes + tb.nbytes for ta, tb in pairs), total_tensors=len(pairs),
                                callback=on_progress)
            for ta, tb in pairs:
                result.tensors.append(tensor_diff(reader, ta, tb, budget, rtol, atol, progress))
            for name in sorted(set(left.objects) & set(right.objects)):
                if load_object(left.objects[name], reader) != load_object(right.objects[name], reader):
                    result.objects_differ.append(name)
            for name in sorted(set(left.tensors) & set(right.objects)) + sorted(set(left.objects) & set(right.tensors)):
                result.shape_mismatch.append(f"{name} (a tensor on one side, an object on the other)")
            result.layers = layers(result.tensors)
            return result
        finally:
            reader.close()


def layers(tensors: list[TensorDiff]) -> list[LayerDiff]:
    """The tensors' differences summed by layer (`layer_of`), layers in natural order (`layers.2` before
    `layers.10`)."""
    by_layer: dict[str, LayerDiff] = {}
    for t in tensors:
        layer = by_layer.setdefault(layer_of(t.name), LayerDiff(layer_of(t.name)))
        layer.tensors += 1
        layer.changed += t.changed
        layer.differs += t.differs
        layer.max_abs_diff = max(layer.max_abs_diff, t.max_abs_diff)
        layer.diff_sq += t.diff_l2 ** 2
        layer.sq += t.l2 ** 2
    return [by_layer[name] for name in sorted(by_layer, key=natural)]


def natural(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in name.split(".")]
