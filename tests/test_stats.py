"""Per-tensor statistics (`converters.stats.scan`) and checkpoint diffs (`converters.stats.diff`).

Fast tests: hand-made tensors of every dtype the engine reads, written with safetensors, against torch's
float64 computation on the whole tensor. Slow tests: real FSDP2 steps at 2 gloo ranks (tests/stats_job.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from converters.stats import moments, scan
from converters.stats import stats as scan_module

NAN, INF = float("nan"), float("inf")
REL = 1e-12  # float64 rounding: blockwise sums differ from torch's whole-tensor order in the last bits


def close(got: float | None, want: float, scale: float) -> bool:
    """`got` equals `want` to float64 rounding, relative to `scale` (the data's magnitude)."""
    return got is not None and abs(got - want) <= REL * max(abs(want), scale)


def reference(t: torch.Tensor) -> dict:
    """The statistics as torch computes them on the whole tensor in float64 (finite elements for the moments)."""
    x = t.reshape(-1).double()
    finite = x[torch.isfinite(x)]
    integer = not (t.is_floating_point())
    want: dict = {"count": t.numel(), "nan": int(x.isnan().sum()), "posinf": int((x == INF).sum()),
                  "neginf": int((x == -INF).sum()), "zeros": int((x == 0).sum())}
    if finite.numel():
        own = t.reshape(-1)
        if integer:  # exact in the dtype
            want["min"], want["max"] = int(own.min()), int(own.max())
        else:
            want["min"], want["max"] = float(finite.min()), float(finite.max())
        want["mean"] = float(finite.mean())
        want["std"] = float(finite.std(correction=0))
    want["l2"] = float(torch.linalg.vector_norm(finite))
    want["scale"] = float(finite.abs().max()) if finite.numel() else 0.0
    return want


def assert_matches(got: moments.TensorStats, t: torch.Tensor) -> None:
    want = reference(t)
    where = f"{got.name}: got {got}, want {want}"
    for key in ("count", "nan", "posinf", "neginf", "zeros"):
        assert getattr(got, key) == want[key], where
    if "min" not in want:
        assert (got.min, got.max, got.mean, got.std, got.l2) == (None, None, None, None, 0.0), where
        return
    assert (got.min, got.max) == (want["min"], want["max"]), where
    assert type(got.min) is type(want["min"]), where
    scale = want["scale"]
    assert close(got.mean, want["mean"], scale), where
    assert close(got.std, want["std"], scale), where
    assert close(got.l2, want["l2"], 0.0), where


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 37, generator=g)
    special = torch.tensor([1.5, NAN, INF, -INF, 0.0, -2.0, NAN, 0.0, 3.25])
    out = {
        "f32": base * 3 + 5,
        "f32_offset": base * 1e-4 + 1.0,  # mean far above the spread: a naive sum of squares would cancel
        "f32_special": special,
        "f32_all_nan": torch.full((4, 2), NAN),
        "f32_constant": torch.full((1000,), 0.1),
        "f64": base.double() * 7,
        "f16": (base * 2).half(),
        "f16_special": special.half(),
        "bf16": (base * 100).bfloat16(),
        "bf16_special": special.bfloat16(),
        "f8_e4m3": base.clamp(-400, 400).to(torch.float8_e4m3fn),
        "f8_e4m3_nan": torch.tensor([1.0, NAN, -3.0, 0.0]).to(torch.float8_e4m3fn),
        "f8_e5m2": (base * 10).to(torch.float8_e5m2),
        "f8_e5m2_special": special.to(torch.float8_e5m2),
        "i8": torch.randint(-128, 128, (500,), generator=g, dtype=torch.int8),
        "i16": torch.randint(-30000, 30000, (500,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-2**31, 2**31 - 1, (500,), generator=g, dtype=torch.int32),
        "i64_huge": torch.tensor([2**62 + 1, -(2**62) - 3, 0, 5], dtype=torch.int64),  # min/max beyond 2**53
        "u8": torch.randint(0, 256, (500,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(333, generator=g) > 0.3,
        "empty": torch.empty(0, 5),
        "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "scalar": torch.tensor(-4.5),
        "wide": torch.randn(3, 5, 7, 11, generator=g),
    }
    return out


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    made = tensors()
    path = tmp_path_factory.mktemp("stats") / "every_dtype.safetensors"
    save_file(made, str(path))
    return path, made


def test_scan_equals_torch_float64_for_every_dtype(sample: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, made = sample
    result = scan(str(path))
    got = result.by_name()
    assert set(got) == set(made)
    for name, t in made.items():
        assert_matches(got[name], t)
    assert result.skipped == []
    assert result.bytes_read == sum(t.numel() * t.element_size() for t in made.values())


def test_blocks_smaller_than_the_tensor_give_the_same_statistics(sample: tuple[Path, dict[str, torch.Tensor]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, made = sample
    monkeypatch.setattr(moments, "SUB_BLOCK", 7)  # many sub-blocks per slab, and a short last one
    monkeypatch.setattr(scan_module, "SLAB_BYTES", 100)  # slabs of a few rows: many reads per tensor
    got = scan(str(path)).by_name()
    for name, t in made.items():
        assert_matches(got[name], t)


def test_special_values_are_counted_and_left_out_of_the_moments(sample: tuple[Path, dict[str, torch.Tensor]]
                                                                 ) -> None:
    result = scan(str(sample[0]))
    special = result.by_name()["f32_special"]
    finite = [1.5, 0.0, -2.0, 0.0, 3.25]
    assert (special.count, special.nan, special.posinf, special.neginf, special.zeros) == (9, 2, 1, 1, 2)
    assert (special.min, special.max) == (-2.0, 3.25)
    assert special.mean == sum(finite) / 5
    assert special.l2 == math.sqrt(sum(v * v for v in finite))
    assert result.by_name()["f32_all_nan"].to_dict() == {
        "name": "f32_all_nan", "dtype": "float32", "shape": [4, 2], "count": 8, "nan": 8, "posinf": 0, "neginf": 0,
        "zeros": 0, "min": None, "max": None, "mean": None, "std": None, "l2": 0.0}
    assert result.by_name()["i64_huge"].min == -(2**62) - 3  # exact, not rounded through float64
    assert not result.finite
    assert result.nonfinite == sorted(result.nonfinite, key=[t.name for t in result.tensors].index)
    assert set(result.nonfinite) == {"f32_special", "f32_all_nan", "f16_special", "bf16_special", "f8_e4m3_nan",
                                     "f8_e5m2_special"}
    assert "non-finite values in 6" in result.summary()


def test_scan_result_is_json(sample: tuple[Path, dict[str, torch.Tensor]]) -> None:
    result = scan(str(sample[0]))
    doc = json.loads(result.to_json())
    assert doc["finite"] is False
    assert doc["format"] == "safetensors"
    assert {t["name"] for t in doc["tensors"]} == set(sample[1])
    assert all("NaN" not in json.dumps(t) for t in doc["tensors"])


def test_dtypes_without_statistics_are_listed_as_skipped(tmp_path: Path) -> None:
    path = tmp_path / "complex.safetensors"
    save_file({"c": torch.randn(3, dtype=torch.complex64), "r": torch.ones(2)}, str(path))
    result = scan(str(path))
    assert [t.name for t in result.tensors] == ["r"]
    assert result.skipped == ["c (complex64)"]
