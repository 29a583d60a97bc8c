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
