"""Compare two checkpoint indexes tensor by tensor, streaming both in the same bounded slabs.

`verify_output` (`--verify`) also reads the output back with its consumer's own loader (`consumer`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from . import dtypes
from .consumer import ConsumerResult, check
from .copier import DEFAULT_MEMORY_LIMIT
from .index import CheckpointIndex, TensorEntry
from .rangeread import RangeReader
from .tensorio import cast, compare_slab, read_box, same_bytes, slabs
from .writers.objects import load_object

if TYPE_CHECKING:
    from .certificate_check import CertificateReport


def check_certificate(uri: str, with_source: bool = True,
                      memory_limit: int = DEFAULT_MEMORY_LIMIT) -> CertificateReport:
    """Re-check the output at `uri` against the certificate in its manifest (`converters.certificate_check`)."""
    from .certificate_check import check_certificate as check

    return check(uri, with_source=with_source, memory_limit=memory_limit)


@dataclass
class VerifyReport:
    compared: int = 0
    compared_bytes: int = 0
    missing: list[str] = field(default_factory=list)  # in the first, not in the second
    extra: list[str] = field(default_factory=list)  # in the second, not in the first
    mismatched: list[str] = field(default_factory=list)  # shape or dtype differs
    different: list[str] = field(default_factory=list)  # values differ
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    consumer: ConsumerResult | None = None  # the output read back with its consumer's own loader
    notes: list[str] = field(default_factory=list)  # how the comparison was made (an export's own view)
    tolerance: tuple[float, float] | None = None  # (atol, rtol) when values were compared within them
    max_diff: float = 0.0  # largest |a-b| over the tensors compared within the tolerance
    cast: int = 0  # tensors compared bit for bit after casting the first side to the second's dtype
    shapes_differ: int = 0  # of the mismatched: those whose shapes differ (the rest differ in dtype only)

    @property
    def ok(self) -> bool:
        bad_consumer = self.consumer is not None and (self.consumer.unloadable or self.consumer.different)
        return not (self.missing or self.extra or self.mismatched or self.different or bad_consumer)

    def summary(self) -> str:
        c = self.consumer
        if self.ok:
            compared = f"{self.compared} entries, {self.compared_bytes} bytes compared"
            if self.tolerance is not None:
                atol, rtol = self.tolerance
                line = f"equal within rtol={rtol:g}, atol={atol:g}, max difference {self.max_diff:g}: {compared}"
            else:
                line = f"identical: {compared}"
                if self.cast:
                    line += f" ({self.cast} after casting to the second's dtype)"
            if c is not None:
                line += f"; {c.note}" if c.note else (
                    f"; {c.loader} loads it: {c.compared} entries "
                    + ("with the values read here" if self.tolerance else "identical")
                    + (f" (a sample of {c.sampled_from} tensors)" if c.sampled_from else ""))
            return line
        parts = []
        for label, names in (("missing", self.missing), ("extra", self.extra),
                             ("shape/dtype differ", self.mismatched), ("values differ", self.different),
                             ("not loadable by its consumer", c.unloadable if c else []),
                             (f"{c.loader if c else ''} reads different values", c.different if c else [])):
            if names:
                parts.append(f"{label}: {', '.join(names[:8])}" + (f" (+{len(names) - 8})" if len(names) > 8 else ""))
        if self.mismatched and not self.shapes_differ:
            parts.append("only dtypes differ: to compare the values, pass a tolerance such as --rtol 1e-2 "
                         "(bfloat16) or --rtol 1e-3 (float16)")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "compared": self.compared, "compared_bytes": self.compared_bytes,
                "missing": self.missing, "extra": self.extra, "mismatched": self.mismatched,
                "different": self.different, "max_abs_diff": self.max_abs_diff,
                "consumer": asdict(self.consumer) if self.consumer else None, "notes": self.notes,
                "tolerance": ({"atol": self.tolerance[0], "rtol": self.tolerance[1], "max_diff": self.max_diff}
                              if self.tolerance is not None else None)}


def _compare(reader: RangeReader, a: TensorEntry, b: TensorEntry, budget: int, atol: float, rtol: float,
             cast_ok: bool) -> tuple[bool, float]:
    """(equal, max |a-b|): bytes must match exactly, unless dtypes differ and a cast is allowed."""
    item = max(dtypes.itemsize(a.dtype), dtypes.itemsize(b.dtype))
    exact = a.dtype == b.dtype and atol == 0 and rtol == 0
    worst = 0.0
    equal = True
    boxes = list(slabs(a.shape, item, budget))
    most = max((dtypes.numel(box[1]) for box in boxes), default=0)
    # one pair of buffers for every slab of the tensor: no page faults per slab
    raw_a = memoryview(bytearray(most * dtypes.itemsize(a.dtype)))
    raw_b = memoryview(bytearray(most * dtypes.itemsize(b.dtype)))
    for box in boxes:
        n = dtypes.numel(box[1])
        buf_a, buf_b = raw_a[: n * dtypes.itemsize(a.dtype)], raw_b[: n * dtypes.itemsize(b.dtype)]
        read_box(reader, a, box, buf_a)
        read_box(reader, b, box, buf_b)
        if exact:
            if not same_bytes(buf_a, buf_b):
                equal = False
                worst = max(worst, _max_diff(buf_a, buf_b, a.dtype, b.dtype))
            continue
        if cast_ok and a.dtype != b.dtype and atol == 0 and rtol == 0:
            # a cast output: the first side cast to the second's dtype must match bit for bit
            if not same_bytes(cast(buf_a, a.dtype, b.dtype), buf_b):
                equal = False
                worst = max(worst, _max_diff(buf_a, buf_b, a.dtype, b.dtype))
            continue
        ok, diff = _close(buf_a, buf_b, a.dtype, b.dtype, atol, rtol)
        equal = equal and ok
        worst = max(worst, diff)
    return equal, worst


def _tensors(buf_a: memoryview, buf_b: memoryview, da: str, db: str) -> tuple[Any, Any]:
    import torch

    ta = torch.frombuffer(buf_a, dtype=getattr(torch, da)) if len(buf_a) else torch.empty(0)
    tb = torch.frombuffer(buf_b, dtype=getattr(torch, db)) if len(buf_b) else torch.empty(0)
    return ta.double(), tb.double()


def _max_diff(buf_a: memoryview, buf_b: memoryview, da: str, db: str) -> float:
    ta, tb = _tensors(buf_a, buf_b, da, db)
    return float((ta - tb).abs().nan_to_num(float("inf")).max()) if ta.numel() else 0.0


def _close(buf_a: memoryview, buf_b: memoryview, da: str, db: str, atol: float, rtol: float) -> tuple[bool, float]:
    import torch

    ta, tb = _tensors(buf_a, buf_b, da, db)
    if not ta.numel():
        return True, 0.0
    return bool(torch.allclose(ta, tb, rtol=rtol, atol=atol, equal_nan=True)), float((ta - tb).abs().max())


def verify_indexes(a: CheckpointIndex, b: CheckpointIndex, reader: RangeReader, *, atol: float = 0.0,
                   rtol: float = 0.0, cast_ok: bool = False,
                   memory_limit: int = DEFAULT_MEMORY_LIMIT) -> VerifyReport:
    report = VerifyReport(tolerance=(atol, rtol) if atol > 0 or rtol > 0 else None)
    budget = compare_slab(memory_limit)
    report.missing = sorted(set(a.tensors) - set(b.tensors))
    report.extra = sorted(set(b.tensors) - set(a.tensors))
    for name, ta in a.tensors.items():
        tb = b.tensors.get(name)
        if tb is None:
            continue
        if ta.shape != tb.shape or (ta.dtype != tb.dtype and not cast_ok):
            report.mismatched.append(f"{name} ({ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)})")
            report.shapes_differ += ta.shape != tb.shape
            continue
        equal, diff = _compare(reader, ta, tb, budget, atol, rtol, cast_ok)
        report.compared += 1
        report.compared_bytes += ta.nbytes
        report.max_diff = max(report.max_diff, diff)
        report.cast += ta.dtype != tb.dtype and report.tolerance is None
        if not equal:
            report.different.append(name)
            report.max_abs_diff[name] = diff
    for name in sorted(set(a.objects) & set(b.objects)):
        report.compared += 1
        if load_object(a.objects[name], reader) != load_object(b.objects[name], reader):
            report.different.append(name)
    return report


def find_tie(index: CheckpointIndex, name: str, reader: RangeReader) -> str | None:
    """Another tensor of `index` with exactly the same values as `name` (same bytes), or None."""
    target = index.tensors[name]
    candidates = [t for n, t in index.tensors.items()
                  if n != name and t.shape == target.shape and t.dtype == target.dtype]
    for other in candidates:
        if [c.data for c in other.chunks] == [c.data for c in target.chunks]:
            return other.name
    for other in candidates:
        if _compare(reader, target, other, 64 * 1024 * 1024, 0.0, 0.0, False)[0]:
            return other.name
    return None


def verify_output(view: CheckpointIndex, root: str, fmt: str, reader: RangeReader, *, cast_ok: bool,
                  memory_limit: int, target: str) -> VerifyReport:
    """Read back what a conversion just wrote at `root` and compare it with its source; raise if it differs."""
    from .errors import VerifyError
    from .formats import load_index

    written = load_index(root, fmt, reader=reader, complete=False)
    as_written = replace(written, tensors=dict(written.tensors), objects=dict(written.objects))
    written.tensors = {".".join(t.path): t for t in written.tensors.values()}
    written.objects = {".".join(o.path): o for o in written.objects.values()}
    report = verify_indexes(view, written, reader, cast_ok=cast_ok, memory_limit=memory_limit)
    if report.ok:
        report.consumer = check(as_written, root, fmt, reader, memory_limit // 4)
    if not report.ok:
        raise VerifyError(f"{target}: verification failed, output removed: {report.summary()}")
    return report
