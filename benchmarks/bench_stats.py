"""Time `converters.stats.scan` and `diff` against `cp -r` on one checkpoint (issue 33: a scan within 1.3x cp).

    ckptctl sample /tmp/s1g --size 1GB --world-size 2
    python benchmarks/bench_stats.py /tmp/s1g --repeats 3

Also times `ckptctl export` with and without `--stats` (issue 33: a conversion with statistics within 1.1x the
same conversion without), each to exit plus `sync`, and prints their ratio.

Warm page cache (the checkpoint is read once first). Each case runs as its own process, interleaved
(repeat 1 of every case, then repeat 2, ...), timed from start to exit; cp is timed to exit and to exit plus
`sync` (bench_convert.py's floor: the copy's writes reach the disk). Prints medians, CPU seconds, peak RSS
(of the process, from wait4) and the load average each run started at.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(argv: list[str], sync: bool = False) -> tuple[float, float, float, float, float]:
    """(wall to exit, wall to exit plus sync, CPU seconds, peak RSS MB, 1-minute load at start)."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done = time.perf_counter()
    if proc.returncode:
        sys.exit(f"{argv[0]} failed with exit {proc.returncode}")
    if sync:
        os.sync()
    return done - start, time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    source = str(Path(args.source).resolve())
    size = sum(p.stat().st_size for p in Path(source).rglob("*") if p.is_file())
    work = Path(tempfile.mkdtemp(prefix="bench-stats-", dir=Path(source).parent))
    py = [sys.executable, "-c"]
    ckptctl = [sys.executable, "-m", "ckptctl"]
    cases = {
        "cp -r": ["cp", "-r", source, str(work / "copy")],
        "scan": [*py, f"from converters.stats import scan; scan({source!r})"],
        "diff (same)": [*py, f"from converters.stats import diff; diff({source!r}, {source!r})"],
        "export": [*ckptctl, "export", source, str(work / "copy"), "-q"],
        "export --stats": [*ckptctl, "export", source, str(work / "copy"), "-q", "--stats"],
    }
    synced = ("cp -r", "export", "export --stats")  # writers: timed to exit plus sync
    times: dict[str, list[tuple[float, float, float, float, float]]] = {name: [] for name in cases}
    try:
        subprocess.run(["cat", *map(str, sorted(p for p in Path(source).rglob("*") if p.is_file()))],
                       stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        for rep in range(args.repeats):
            for name, argv in cases.items():
                shutil.rmtree(work / "copy", ignore_errors=True)
                os.sync()
                times[name].append(run(argv, sync=name in synced))
                print(f"repeat {rep + 1} {name:<14} wall {times[name][-1][0]:6.2f} s  +sync {times[name][-1][1]:6.2f} s"
                      f"  (load {times[name][-1][4]:.1f})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{size / 1e9:.2f} GB, medians over {args.repeats}:")
    cp_wall = statistics.median(t[0] for t in times["cp -r"])
    cp_sync = statistics.median(t[1] for t in times["cp -r"])
    for name, runs in times.items():
        wall = statistics.median(t[0] for t in runs)
        line = (f"  {name:<12} wall {wall:6.2f} s  cpu {statistics.median(t[2] for t in runs):6.2f} s  "
                f"rss {max(t[3] for t in runs):7.0f} MB")
        if name == "cp -r":
            line += f"  (+sync {cp_sync:.2f} s)"
        elif name in synced:
            line += f"  +sync {statistics.median(t[1] for t in runs):.2f} s"
        else:
            line += f"  {wall / cp_wall:.2f}x cp, {wall / cp_sync:.2f}x cp+sync"
        print(line)
    plain = statistics.median(t[1] for t in times["export"])
    with_stats = statistics.median(t[1] for t in times["export --stats"])
    pairs = [b[1] / a[1] for a, b in zip(times["export"], times["export --stats"], strict=True)]
    print(f"  export --stats / export (with sync, medians): {with_stats / plain:.2f}x (target <= 1.1); per repeat: "
          + ", ".join(f"{r:.2f}" for r in pairs))


if __name__ == "__main__":
    main()
