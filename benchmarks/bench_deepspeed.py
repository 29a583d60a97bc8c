"""Benchmark: export a DeepSpeed ZeRO-3 checkpoint (world size 4) with ckpt-service vs DeepSpeed's zero_to_fp32.

    python benchmarks/bench_deepspeed.py --size 2GB --out bench-out/deepspeed.json

Makes (or reuses, cached under --work-dir) a real ZeRO-3 checkpoint with DeepSpeed on CPU (gloo, one Adam
step, fp32, `tests.deepspeed_job`), then times, each in a fresh process, `ckptctl export` and DeepSpeed's own
`zero_to_fp32.py --safe_serialization` (the script DeepSpeed saves beside the checkpoint), both writing
safetensors. Wall time runs to exit plus `sync`; peak RSS is polled over the process tree (bench_convert's
`run_once`). The two outputs are compared tensor by tensor (names, dtypes, bits). Needs `deepspeed`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import ROOT, run_once

from ckpt_service.units import parse_size

WORLD_SIZE = 4


def make_checkpoint(work: Path, size: str) -> tuple[Path, float]:
    """A ZeRO-3 save of about `size` fp32 parameter bytes; cached by size."""
    base = work / f"zero3-ws{WORLD_SIZE}-{size}"
    marker = base / "made.json"
    if marker.is_file():
        return base / "ckpt", json.loads(marker.read_text())["seconds"]
    shutil.rmtree(base, ignore_errors=True)
    print(f"making a {size} ZeRO-3 checkpoint (world size {WORLD_SIZE}) in {base} ...", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tests.deepspeed_job", str(base), "--stage", "3", "--world-size",
                    str(WORLD_SIZE), "--size", str(parse_size(size)), "--no-reference"], check=True, cwd=ROOT,
                   env={**os.environ, "DS_ACCELERATOR": "cpu"}, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    marker.write_text(json.dumps({"size": size, "seconds": seconds}))
    return base / "ckpt", seconds


def compare(a: Path, b: Path) -> str:
    """'identical', or what differs, between two safetensors folders (one tensor at a time)."""
    from bench_writers import compare_safetensors

    problem = compare_safetensors(a, b)
    return problem or f"identical ({len(list(a.glob('*.safetensors')))} files)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GB", help="fp32 parameter bytes of the model, e.g. 200MB, 2GB")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench-out" / "deepspeed")
    parser.add_argument("--memory-limit", default="256MiB", help="ckptctl --memory-limit")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt, made_s = make_checkpoint(args.work_dir, args.size)
    tag = (ckpt / "latest").read_text().strip()
    source_bytes = sum(p.stat().st_size for p in (ckpt / tag).iterdir())
    cases = {
        "ckptctl export": [sys.executable, "-m", "ckptctl", "export", str(ckpt), "{out}", "-q",
                           "--memory-limit", args.memory_limit],
        "zero_to_fp32": [sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), "{out}", "--safe_serialization"],
    }
    rows = []
    outs = {}
    for name, argv_ in cases.items():
        out = args.work_dir / f"out-{name.replace(' ', '-')}"
        shutil.rmtree(out, ignore_errors=True)
        log = args.work_dir / f"{name.replace(' ', '-')}.log"
        result = run_once([a.replace("{out}", str(out)) for a in argv_], out, log, "all", args.timeout)
        outs[name] = out
        rows.append({"case": name, "wall_s": round(result.wall_s, 2), "peak_rss_mb": round(result.peak_rss_mb, 1),
                     "cpu_s": round(result.cpu_s, 2), "returncode": result.returncode})
    check = compare(outs["ckptctl export"], outs["zero_to_fp32"]) if all(r["returncode"] == 0 for r in rows) \
        else "a case failed: see its log"
    print(f"\nZeRO-3, world size {WORLD_SIZE}, {args.size} fp32 parameters; source files {source_bytes / 1e6:.0f} MB "
          f"(made in {made_s:.0f} s)")
    print(f"{'case':<16} {'wall s':>8} {'peak RSS MB':>12} {'CPU s':>8}")
    for row in rows:
        print(f"{row['case']:<16} {row['wall_s']:>8.2f} {row['peak_rss_mb']:>12.1f} {row['cpu_s']:>8.2f}")
    print(f"outputs: {check}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"size": args.size, "world_size": WORLD_SIZE, "source_bytes": source_bytes,
                                        "memory_limit": args.memory_limit, "rows": rows, "outputs": check},
                                       indent=2) + "\n")
    return 0 if check.startswith("identical") else 1


if __name__ == "__main__":
    sys.exit(main())
