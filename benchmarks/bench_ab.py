"""An older tree of ckpt-service against this one on the same checkpoint: export, export --stats, reshard and
convert, each a fresh process, interleaved (old, new, old, new, ...), timed to exit plus `sync`.

    git worktree add /tmp/old 4cb9ec5
    python benchmarks/bench_ab.py /tmp/old bench-out/samples/1GB-no-train/fsdp2-dcp --repeats 5

The old tree runs from PYTHONPATH (its `converters`, `ckpt_service`, `api` and `ckptctl` shadow the installed
ones); `cp -r` of the checkpoint, timed the same way, is the floor. Each run is bench_convert's `run_once` (wall
to exit plus `sync`, CPU seconds and peak RSS of the process tree). Prints medians (wall also against cp's) and
every run's time; writes the runs as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import ROOT, RunResult, run_once

TIMEOUT = 600.0  # seconds one command may run


def cases(source: str, out: str) -> dict[str, list[str] | None]:
    """name -> ckptctl arguments (None: the `cp -r` floor)."""
    return {"cp -r": None,
            "export": ["export", source, out, "-q"],
            "export --stats": ["export", source, out, "-q", "--stats"],
            "reshard --world-size 3": ["reshard", source, out, "--world-size", "3", "-q"],
            "convert --to torch": ["convert", source, f"{out}/model.pt", "--to", "torch", "-q"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the older tree (a git worktree or an unpacked `git archive`)")
    parser.add_argument("source", help="the checkpoint (an FSDP/DCP folder)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write every run as JSON here")
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": ROOT}
    source = os.path.abspath(args.source)
    runs: dict[tuple[str, str], list[RunResult]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ab-", dir=ROOT / "bench-out") as tmp:
        out, log = Path(tmp) / "out", Path(tmp) / "log"
        for repeat in range(args.repeats):
            for name, ckptctl in cases(source, str(out)).items():
                for side, tree in trees.items():
                    if ckptctl is None and side == "old":
                        continue
                    argv = ["cp", "-r", source, str(out)] if ckptctl is None else \
                        ["env", f"PYTHONPATH={tree}", sys.executable, "-m", "ckptctl", *ckptctl]
                    shutil.rmtree(out, ignore_errors=True)
                    os.sync()
                    result = run_once(argv, out, log, "all", TIMEOUT)
                    if result.returncode != 0:
                        raise SystemExit(f"{' '.join(argv)} failed: {log.read_text()[-400:]}")
                    runs.setdefault((name, side), []).append(result)
            print(f"repeat {repeat + 1} done, load {os.getloadavg()[0]:.1f}", flush=True)
    floor = statistics.median(r.wall_s for r in runs[("cp -r", "new")])
    print(f"{'case':24s} {'tree':4s} {'+sync s':>8s} {'/cp+sync':>8s} {'CPU s':>6s} {'RSS MB':>7s}  runs (s)")
    for (name, side), rs in runs.items():
        wall = statistics.median(r.wall_s for r in rs)
        cpu = statistics.median(r.cpu_s for r in rs)
        rss = max(r.peak_rss_mb for r in rs)
        print(f"{name:24s} {side:4s} {wall:8.2f} {wall / floor:8.2f} {cpu:6.2f} {rss:7.0f}  "
              + ", ".join(f"{r.wall_s:.2f}" for r in rs))
    if args.out is not None:
        args.out.write_text(json.dumps({f"{name} | {side}": [[r.wall_s, r.cpu_s, r.peak_rss_mb] for r in rs]
                                        for (name, side), rs in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
