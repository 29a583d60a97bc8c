"""The benchmark runs end to end on a tiny checkpoint, and its output check catches a wrong output.

Nothing here looks at timings or memory: those depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_convert.py"
CASES = ("cp", "export", "inspect")


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_convert", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("bench")
    out = work / "results.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--size", "20MB", "--repeats", "1", "--cases", ",".join(CASES),
                           "--work-dir", str(work), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work, json.loads(out.read_text())


def test_bench_writes_one_checked_row_per_case(bench_run: tuple[Path, dict]) -> None:
    _, doc = bench_run
    rows = {row["case"]: row for row in doc["rows"]}
    assert sorted(rows) == sorted(CASES)
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["size"] == "20MB"
        assert len(row["wall_s"]) == 1 and len(row["rss_mb"]) == 1
    assert "FAILED" not in json.dumps(doc)
    assert rows["export"]["ratio_cp"] is not None
    assert doc["machine"]["cores"] and doc["versions"]["torch"] and doc["date"]
    assert doc["sizes"]["20MB"]["tensors"] == doc["sizes"]["20MB"]["checked_tensors"] > 0
    assert {t["target"] for t in doc["targets"]} >= {"export median / cp median", "inspect median wall s"}


def test_bench_check_rejects_a_changed_tensor(bench_run: tuple[Path, dict], tmp_path: Path) -> None:
    work, _ = bench_run
    bench = load_bench()
    samples = bench.sample_set(work, "20MB")  # cached by the run above
    ref = bench.load_reference(samples.dcp, 1 << 30)
    export = next(c for c in bench.CASES if c.name == "export")
    out, log = tmp_path / "export", tmp_path / "log"
    subprocess.run(export.argv(samples.dcp, out), check=True, timeout=300)
    assert bench.check_output(export, out, log, ref, samples.dcp)[0]

    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    name = sorted(state)[0]
    state[name] = state[name].clone()
    state[name].view(-1)[0] += 1
    save_file(state, str(out / "model.safetensors"))
    ok, note = bench.check_output(export, out, log, ref, samples.dcp)
    assert not ok and name in note
    shutil.rmtree(out)
    assert not bench.check_output(export, out, log, ref, samples.dcp)[0]


WRITER_CASES = ("cp", "cp-llama", "gguf-f16", "fp8-block", "cp-llama-hf", "export-base", "merged", "archive", "restore")


@pytest.fixture(scope="module")
def writers_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """This round's writers' rows (Megatron's is left out: its smallest MoE sample is ~0.5 GB)."""
    work = tmp_path_factory.mktemp("bench-writers")
    out = work / "results.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--size", "20MB", "--repeats", "1", "--cases",
                           ",".join(WRITER_CASES), "--work-dir", str(work), "--out", str(out)], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work, json.loads(out.read_text())


def test_bench_writer_rows_are_checked_against_the_reference_tools(writers_run: tuple[Path, dict]) -> None:
    _, doc = writers_run
    rows = {row["case"]: row for row in doc["rows"]}
    assert sorted(rows) == sorted(WRITER_CASES)
    assert {name: row["status"] for name, row in rows.items()} == dict.fromkeys(WRITER_CASES, "ok")
    assert rows["gguf-f16"]["note"].endswith("tensors equal to llama.cpp's convert_hf_to_gguf.py")
    assert rows["fp8-block"]["note"] == "every tensor equal to llm-compressor's oneshot FP8_BLOCK"
    assert rows["merged"]["note"] == "every tensor equal to PEFT's merge_and_unload bit for bit"
    assert rows["restore"]["note"] == "every file equal to the source byte for byte"
    assert rows["merged"]["ratio_plain"] is not None and rows["gguf-f16"]["ratio_cp"] is not None
    targets = {t["target"] for t in doc["targets"]}
    assert {"gguf-f16 median / cp-llama median", "merged median / export-base median", "restore median / cp median",
            "archive peak RSS MB"} <= targets


def test_bench_writer_check_rejects_a_changed_tensor(writers_run: tuple[Path, dict], tmp_path: Path) -> None:
    work, _ = writers_run
    bench_writers = load_bench().writers()

    llama = work / "samples" / "20MB-writers" / "llama"
    got = tmp_path / "merged"
    shutil.copytree(llama / "ref-merged", got)
    assert bench_writers.check("merged", got, llama / "adapter", llama / "dcp")[0]

    from safetensors.torch import load_file, save_file

    path = next(got.glob("*.safetensors"))
    state = load_file(path)
    name = sorted(state)[-1]
    state[name].view(-1)[0] += 1
    save_file(state, str(path), metadata={"format": "pt"})
    ok, note = bench_writers.check("merged", got, llama / "adapter", llama / "dcp")
    assert not ok and note == f"{name} differs"
