"""Archive tier throughput: `archive` and `restore` (converters.archive) of one checkpoint against `cp -r` of it,
and each one's peak RSS.

    python benchmarks/bench_archive.py --size 1GB --out bench-out/archive.json
    python benchmarks/bench_archive.py --source DIR            # an existing checkpoint

Without --source, `ckptctl sample DIR --size SIZE --world-size 2 --no-train` makes the checkpoint (an FSDP2
DCP folder). Each operation runs --repeat times in a fresh child process (its peak RSS from wait4, including
the interpreter); its time is measured inside the child around the call, the best run kept. CPU seconds (user +
system, the child's whole life, imports included) depend less on the machine's load than wall seconds. Page
cache stays warm for all three (cp runs first, once unmeasured); each operation starts after a sync. Archive
runs into an empty store each time; a second archive of the same checkpoint into the filled store (everything
deduplicated) is reported too.
Prints a table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
from converters.archive import archive, restore
op, a, b, c = sys.argv[1:5]
began = time.perf_counter()
if op == "archive":
    out = archive(a, b).to_dict()
else:
    restore(a, c, b)
    out = {}
out["wall_s"] = time.perf_counter() - began
print(json.dumps(out))
"""


def timed(argv: list[str]) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes, CPU seconds) of the command `argv` in a child process (rusage from
    wait4). CPU seconds do not depend on what else runs on the machine; wall seconds do. Every operation starts
    after a sync (untimed), so none pays for the writeback of the one before it."""
    os.sync()
    began = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.execvp(argv[0], argv)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - began
    if status:
        raise SystemExit(f"{argv[:3]} failed (status {status})")
    return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def child(op: str, a: str, b: str, c: str, work: Path) -> tuple[float, int, float, dict[str, Any]]:
    """(seconds of the call, peak RSS, CPU seconds of the whole child, its JSON)."""
    out = work / "child.json"
    argv = ["sh", "-c", f'"{sys.executable}" -c "$0" "$@" > "{out}"', CHILD, op, a, b, c]
    _, rss, cpu = timed(argv)
    doc = json.loads(out.read_text().strip().splitlines()[-1])
    return doc["wall_s"], rss, cpu, doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GB")
    parser.add_argument("--source", help="an existing checkpoint folder (else a sample is made)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--work", help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", default="bench-out/archive.json")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-archive-"))
    work.mkdir(parents=True, exist_ok=True)
    source = Path(args.source) if args.source else work / "sample"
    if not args.source:
        subprocess.run(["ckptctl", "sample", str(source), "--size", args.size, "--world-size", "2", "--no-train"],
                       check=True, cwd=ROOT)
    logical = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    rows: dict[str, list[tuple[float, int, float]]] = {"cp -r": [], "archive": [], "archive again": [], "restore": []}
    timed(["cp", "-r", str(source), str(work / "warm")])  # page cache warm for everyone
    shutil.rmtree(work / "warm")
    result: dict[str, Any] = {}
    for i in range(args.repeat):
        copy = work / f"copy{i}"
        rows["cp -r"].append(timed(["cp", "-r", str(source), str(copy)]))
        shutil.rmtree(copy)
        store = work / f"store{i}"
        *row, result = child("archive", str(source), str(store), "-", work)
        rows["archive"].append((row[0], row[1], row[2]))
        *row, _ = child("archive", str(source), str(store), "-", work)
        rows["archive again"].append((row[0], row[1], row[2]))
        target = work / f"restored{i}"
        *row, _ = child("restore", str(store), str(target), result["archive_id"], work)
        rows["restore"].append((row[0], row[1], row[2]))
        if i == 0:
            same = subprocess.run(["diff", "-rq", str(source), str(target)], capture_output=True).returncode == 0
            assert same, "restore differs from the source"
        shutil.rmtree(target)
        if i < args.repeat - 1:
            shutil.rmtree(store)
    cp_s = min(w for w, _, _ in rows["cp -r"])
    table = {name: {"seconds": round(min(w for w, _, _ in runs), 3),
                    "peak_rss_mb": round(max(r for _, r, _ in runs) / 2**20),
                    "cpu_s": round(min(c for _, _, c in runs), 2),
                    "x_cp": round(min(w for w, _, _ in runs) / cp_s, 2),
                    "mb_per_s": round(logical / 2**20 / min(w for w, _, _ in runs))} for name, runs in rows.items()}
    print(f"checkpoint: {source} ({logical / 1e9:.2f} GB, {sum(1 for p in source.rglob('*') if p.is_file())} files)")
    print(f"{'operation':<14}{'seconds':>9}{'x cp':>7}{'MB/s':>7}{'CPU s':>7}{'peak RSS MB':>13}")
    for name, row in table.items():
        print(f"{name:<14}{row['seconds']:>9}{row['x_cp']:>7}{row['mb_per_s']:>7}{row['cpu_s']:>7}"
              f"{row['peak_rss_mb']:>13}")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"stored {result['stored_bytes'] / 1e9:.3f} GB of {result['logical_bytes'] / 1e9:.3f} GB logical "
          f"(dedup saved {result['dedup_saved'] / 1e9:.3f} GB, compression {result['compression_saved'] / 1e9:.3f} GB)")
    doc = {"when": datetime.now(timezone.utc).isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
           "load_average": os.getloadavg()[0],
           "source": str(source), "logical_bytes": logical, "repeat": args.repeat, "operations": table,
           "archive": {k: result[k] for k in ("chunks", "stored_bytes", "unique_bytes", "dedup_saved",
                                              "compression_saved")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
