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

from converters.stats import diff, diffs, moments, scan
from converters.stats import stats as scan_module
from tests.ranks import run_tool

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
    monkeypatch.setattr(scan_module, "SPLIT_ELEMENTS", 3)  # each slab computed in two threads, then merged
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


def test_progress_counts_every_byte_read(sample: tuple[Path, dict[str, torch.Tensor]],
                                         two: tuple[Path, Path, dict, dict]) -> None:
    seen: list[tuple[int, int, int, int]] = []
    result = scan(str(sample[0]), on_progress=lambda p: seen.append(
        (p.done_bytes, p.total_bytes, p.done_tensors, p.total_tensors)))
    assert seen[-1] == (result.bytes_read, result.bytes_read, len(sample[1]), len(sample[1]))
    compared: list[tuple[int, int, int]] = []
    found = diff(str(two[0]), str(two[1]), on_progress=lambda p: compared.append(
        (p.done_bytes, p.total_bytes, p.done_tensors)))
    both = sum(two[2][t.name].numel() * two[2][t.name].element_size()
               + two[3][t.name].numel() * two[3][t.name].element_size() for t in found.tensors)
    assert compared[-1] == (both, both, len(found.tensors))


def test_every_float16_and_bfloat16_value_is_taken_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both are made float32 from their bits (subnormals, signed zeros, infinities and NaN payloads included), in
    blocks with and without non-finite values; with denormals-are-zero arithmetic float16 takes numpy's casts."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    g = torch.Generator().manual_seed(2)
    made = {"f16_all": bits.view(torch.float16), "bf16_all": bits.clone().view(torch.bfloat16),
            "f16_subnormal": (torch.randn(5000, generator=g) * 1e-5).half(),
            "f16_top": torch.tensor([65504.0, -65504.0, 0.5, -0.0]).half()}
    path = tmp_path / "halves.safetensors"
    save_file(made, str(path))
    monkeypatch.setattr(moments, "SUB_BLOCK", 4096)  # finite blocks (fast) and blocks with NaN or inf (slow)
    got = scan(str(path)).by_name()
    for name, t in made.items():
        assert_matches(got[name], t)
    monkeypatch.setattr(moments, "_exact_subnormals", lambda: False)
    got = scan(str(path)).by_name()
    for name, t in made.items():
        assert_matches(got[name], t)


def test_float64_overflow_is_written_as_a_string_in_json(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    save_file({"w": torch.tensor([1e200, -1e200], dtype=torch.float64)}, str(path))
    doc = json.loads(scan(str(path)).to_json())  # strict JSON: no Infinity
    assert (doc["tensors"][0]["l2"], doc["tensors"][0]["max"], doc["tensors"][0]["mean"]) == ("inf", 1e200, 0.0)


def test_dtypes_without_statistics_are_listed_as_skipped(tmp_path: Path) -> None:
    path = tmp_path / "complex.safetensors"
    save_file({"c": torch.randn(3, dtype=torch.complex64), "r": torch.ones(2)}, str(path))
    result = scan(str(path))
    assert [t.name for t in result.tensors] == ["r"]
    assert result.skipped == ["c (complex64)"]


# ---- diff ---------------------------------------------------------------------------------------------------------


def torch_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a-b|, ||a-b|| / ||b||) by torch in float64 on the whole tensors (both finite)."""
    d = a.double() - b.double()
    return float(d.abs().max()), float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(b.double()))


def pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    a = {f"layers.{i}.mlp.weight": torch.randn(64, 33, generator=g) for i in range(3)}
    a["layers.0.mlp.bias"] = torch.randn(64, generator=g)
    a["embed.weight"] = torch.randn(50, 8, generator=g).bfloat16()
    a["norm.weight"] = torch.ones(8)
    a["nan.weight"] = torch.tensor([1.0, NAN, INF, 2.0])
    a["nan_moved.weight"] = torch.tensor([1.0, NAN, 3.0])
    a["cast.weight"] = torch.randn(10, generator=g)
    a["shape.weight"] = torch.zeros(4, 2)
    a["gone.weight"] = torch.zeros(3)
    b = {name: t.clone() for name, t in a.items() if name != "gone.weight"}
    b["layers.1.mlp.weight"] += 1e-3 * torch.randn(64, 33, generator=g)  # a small step
    b["layers.2.mlp.weight"][5, 7] += 0.5  # one element moved
    b["layers.0.mlp.bias"] *= 2  # a large change in a frozen layer's neighbour: layers.0 moved
    b["nan_moved.weight"] = torch.tensor([1.0, 2.0, NAN])
    b["cast.weight"] = a["cast.weight"].bfloat16()
    b["shape.weight"] = torch.zeros(2, 4)
    b["new.weight"] = torch.ones(2)
    return a, b


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict, dict]:
    a, b = pair()
    folder = tmp_path_factory.mktemp("diff")
    save_file(a, str(folder / "a.safetensors"))
    save_file(b, str(folder / "b.safetensors"))
    return folder / "a.safetensors", folder / "b.safetensors", a, b


def check_diff(result: diffs.DiffResult, a: dict, b: dict) -> None:
    got = {t.name: t for t in result.tensors}
    assert set(got) == {n for n in a if n in b and a[n].shape == b[n].shape}
    for name in ("layers.0.mlp.weight", "embed.weight", "norm.weight"):
        assert got[name].identical and not got[name].changed and got[name].max_abs_diff == 0.0, name
        assert got[name].rel_l2 == 0.0
        assert close(got[name].l2, float(torch.linalg.vector_norm(b[name].double())), 0.0)
    for name in ("layers.1.mlp.weight", "layers.2.mlp.weight", "layers.0.mlp.bias", "cast.weight"):
        top, rel = torch_diff(a[name], b[name])
        assert got[name].max_abs_diff == top, name  # exact: |a-b| of float32 values is exact in float64
        assert close(got[name].rel_l2, rel, 0.0), name
        assert not got[name].identical and got[name].differs, name
    assert got["nan.weight"].identical and not got["nan.weight"].differs  # NaN against NaN: no difference
    moved = got["nan_moved.weight"]
    assert (moved.unmatched_nonfinite, moved.max_abs_diff, moved.differs) == (2, math.inf, True)
    assert result.only_a == ["gone.weight"] and result.only_b == ["new.weight"]
    assert result.shape_mismatch == ["shape.weight (float32[4, 2] vs float32[2, 4])"]
    assert result.dtype_mismatch == ["cast.weight"]
    assert result.differs


def test_diff_equals_torch_on_the_loaded_tensors(two: tuple[Path, Path, dict, dict]) -> None:
    path_a, path_b, a, b = two
    check_diff(diff(str(path_a), str(path_b)), a, b)


def test_diff_in_blocks_smaller_than_the_tensors(two: tuple[Path, Path, dict, dict],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path_a, path_b, a, b = two
    monkeypatch.setattr(moments, "SUB_BLOCK", 5)
    monkeypatch.setattr(diffs, "compare_slab", lambda memory_limit: 40)  # slabs of a row or less
    check_diff(diff(str(path_a), str(path_b)), a, b)


def test_diff_summarises_by_layer(two: tuple[Path, Path, dict, dict]) -> None:
    path_a, path_b, a, b = two
    result = diff(str(path_a), str(path_b))
    layers = {layer.name: layer for layer in result.layers}
    assert diffs.layer_of("optim.state.layers.3.mlp.weight.exp_avg") == "optim.state.layers.3"
    assert diffs.layer_of("embed.weight") == "embed" and diffs.layer_of("step") == "step"
    assert (layers["layers.0"].tensors, layers["layers.0"].changed) == (2, 1)
    want = math.sqrt(float(((a["layers.0.mlp.bias"].double() - b["layers.0.mlp.bias"].double()) ** 2).sum())
                     / float(sum((b[n].double() ** 2).sum() for n in ("layers.0.mlp.weight", "layers.0.mlp.bias"))))
    assert close(layers["layers.0"].rel_l2, want, 0.0)
    assert [layer.name for layer in result.layers] == ["cast", "embed", "layers.0", "layers.1", "layers.2", "nan",
                                                       "nan_moved", "norm"]
    assert result.unchanged() == ["embed", "nan", "norm"]
    assert [layer.name for layer in result.moved_most(2)] == ["nan_moved", "layers.0"]  # unmatched NaN first
    assert "unchanged: embed, nan, norm" in result.summary()
    doc = json.loads(result.to_json())
    assert doc["differs"] is True and doc["unchanged_layers"] == ["embed", "nan", "norm"]


def test_tolerances_decide_differs(tmp_path: Path) -> None:
    a = {"w": torch.tensor([1.0, 2.0, 100.0]), "step": torch.tensor(3)}
    b = {"w": torch.tensor([1.0, 2.001, 100.5]), "step": torch.tensor(3)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    args = (str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    assert diff(*args).differs
    assert diff(*args, atol=0.4).differs  # 0.5 > 0.4
    assert not diff(*args, rtol=0.006).differs  # 0.5 <= 0.006 * 100.5, 0.001 <= 0.006 * 2.001
    assert not diff(*args, atol=0.5).differs
    assert diff(*args, rtol=0.004).differs
    assert not diff(args[0], args[0]).differs
    assert "equal within" in diff(args[0], args[0]).summary()


def test_bad_tolerance_is_refused_naming_the_option(two: tuple[Path, Path, dict, dict]) -> None:
    from converters.errors import OptionError

    with pytest.raises(OptionError, match="tolerances are finite and not negative") as caught:
        diff(str(two[0]), str(two[1]), rtol=-1)
    assert caught.value.option == "rtol"


# ---- real FSDP2 steps (tests/stats_job.py) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests import stats_job

    out = tmp_path_factory.mktemp("fsdp2-steps")
    run_tool("stats_job", out)
    assert all((out / f"step-{n}").is_dir() for n in range(1, stats_job.STEPS + 1))
    return out


def unsharded(steps: Path, step: int) -> dict[str, torch.Tensor]:
    """The tensors the ranks gathered at `step`, under the names `scan` and `diff` give them (model keys cleaned)."""
    full = torch.load(steps / f"full-{step}.pt", weights_only=True)
    return {name.removeprefix("model."): t for name, t in full.items()}


@pytest.mark.slow
def test_stats_of_fsdp2_steps_equal_torch_on_the_unsharded_tensors(steps: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for i, step in enumerate((1, 2, 3, 3)):
        if i == 3:  # step 3 again, in slabs across the ranks' chunks and short sub-blocks
            monkeypatch.setattr(moments, "SUB_BLOCK", 13)
            monkeypatch.setattr(scan_module, "SLAB_BYTES", 200)
            monkeypatch.setattr(scan_module, "SPLIT_ELEMENTS", 5)
        want = unsharded(steps, step)
        result = scan(str(steps / f"step-{step}"))
        got = result.by_name()
        assert set(got) == set(want), step
        for name, t in want.items():
            assert_matches(got[name], t)
        assert result.format == "dcp"


@pytest.mark.slow
def test_a_nan_injected_by_training_is_counted(steps: Path) -> None:
    assert scan(str(steps / "step-2")).finite
    result = scan(str(steps / "step-3"))
    assert result.nonfinite == ["layers.2.weight"]
    poisoned = result.by_name()["layers.2.weight"]
    assert (poisoned.nan, poisoned.posinf, poisoned.neginf, poisoned.count) == (1, 0, 0, 24 * 24)
    assert json.loads(result.to_json())["nonfinite"] == ["layers.2.weight"]


@pytest.mark.slow
def test_diff_between_consecutive_fsdp2_steps_equals_torch(steps: Path) -> None:
    before, after = unsharded(steps, 1), unsharded(steps, 2)
    result = diff(str(steps / "step-1"), str(steps / "step-2"))
    got = {t.name: t for t in result.tensors}
    assert set(got) == set(before)
    assert (result.only_a, result.only_b, result.shape_mismatch, result.dtype_mismatch) == ([], [], [], [])
    for name, a in before.items():
        b = after[name]
        same = torch.equal(a, b)
        assert got[name].identical is same, name
        if same:
            assert got[name].max_abs_diff == 0.0 and not got[name].differs
            continue
        top, rel = torch_diff(a, b)
        assert got[name].max_abs_diff == top, name
        assert close(got[name].rel_l2, rel, 0.0), name
        assert got[name].differs
    # the frozen layer did not move, every trained one did
    assert sorted(name for name, t in got.items() if t.identical) == ["layers.1.bias", "layers.1.weight"]
    assert result.unchanged() == ["layers.1"]
    moved = {layer.name for layer in result.layers if layer.changed}
    assert moved == {"embed", "head", "layers.0", "layers.2", "optim.state.embed.weight", "optim.state.head.bias",
                     "optim.state.head.weight", "optim.state.layers.0", "optim.state.layers.2"}
    assert result.differs


@pytest.mark.slow
def test_diff_finds_the_injected_nan_and_a_checkpoint_equals_itself(steps: Path) -> None:
    result = diff(str(steps / "step-2"), str(steps / "step-3"))
    poisoned = {t.name: t for t in result.tensors}["layers.2.weight"]
    assert (poisoned.unmatched_nonfinite, poisoned.max_abs_diff, poisoned.differs) == (1, math.inf, True)
    assert result.moved_most(1)[0].name == "layers.2"
    same = diff(str(steps / "step-3"), str(steps / "step-3"))
    assert not same.differs and all(t.identical for t in same.tensors)
    assert same.unchanged() == [layer.name for layer in same.layers]


def test_unreadable_sources_are_refused_in_one_line_naming_the_file(tmp_path: Path,
                                                                     sample: tuple[Path, dict]) -> None:
    from converters.errors import FormatError, SourceError

    with pytest.raises(SourceError, match="does not exist") as missing:
        diff(str(sample[0]), str(tmp_path / "nowhere"))
    assert str(tmp_path / "nowhere") in str(missing.value) and "\n" not in str(missing.value)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(sample[0].read_bytes()[:-100])
    with pytest.raises(FormatError, match="truncated") as truncated:
        scan(str(cut))
    assert str(cut) in str(truncated.value) and "\n" not in str(truncated.value)


@pytest.mark.slow
def test_a_step_on_object_storage_scans_and_diffs_as_on_disk(steps: Path) -> None:
    import fsspec

    from .s3server import clear_fs_caches

    clear_fs_caches()
    mem = fsspec.filesystem("memory")
    try:
        for path in sorted((steps / "step-2").iterdir()):
            mem.pipe_file("memory://stats-runs/step-2/" + path.name, path.read_bytes())
        remote, local = scan("memory://stats-runs/step-2"), scan(str(steps / "step-2"))
        assert [t.to_dict() for t in remote.tensors] == [t.to_dict() for t in local.tensors]
        same = diff("memory://stats-runs/step-2", str(steps / "step-2"))
        assert not same.differs and all(t.identical for t in same.tensors) and len(same.tensors) == 30
    finally:
        mem.rm("memory://stats-runs", recursive=True)
        clear_fs_caches()
