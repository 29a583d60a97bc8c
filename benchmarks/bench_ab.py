"""An older tree of ckpt-service against this one on the same checkpoint: export, export --stats, reshard and
convert, each a fresh process, interleaved (old, new, old, new, ...), timed to exit and to exit plus `sync`.

    git worktree add /tmp/old 4cb9ec5
    python benchmarks/bench_ab.py /tmp/old bench-out/samples/1GB-no-train/fsdp2-dcp --repeats 5

The old tree runs from PYTHONPATH (its `converters`, `ckpt_service`, `api` and `ckptctl` shadow the installed
ones); `cp -r` of the checkpoint, timed the same way, is the floor. Prints medians (exit, exit + sync, the
latter against cp's, CPU seconds of the process tree, peak RSS from /usr/bin/time) and every run's time with
sync; writes the runs as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
Run = tuple[float, float, float, float]  # exit s, exit + sync s, CPU s, peak RSS MB


def cases(source: str, out: str) -> dict[str, list[str] | None]:
    """name -> ckptctl arguments (None: the `cp -r` floor)."""
    return {"cp -r": None,
            "export": ["export", source, out, "-q"],
            "export --stats": ["export", source, out, "-q", "--stats"],
            "reshard --world-size 3": ["reshard", source, out, "--world-size", "3", "-q"],
            "convert --to torch": ["convert", source, f"{out}/model.pt", "--to", "torch", "-q"]}


def run_once(argv: list[str], tree: Path, out: Path, work: Path) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    timing = work / "time.txt"
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "%U %S %M", "-o", str(timing), *argv], env=env, cwd=work,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    exited = time.perf_counter()
    os.sync()
    synced = time.perf_counter()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({tree}): {done.stderr.strip()[-400:]}")
    user, system, rss_kb = timing.read_text().split()[-3:]
    return exited - start, synced - start, float(user) + float(system), int(rss_kb) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the older tree (a git worktree or an unpacked `git archive`)")
    parser.add_argument("source", help="the checkpoint (an FSDP/DCP folder)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write every run as JSON here")
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": ROOT}
    source = os.path.abspath(args.source)
    runs: dict[tuple[str, str], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ab-", dir=ROOT / "bench-out") as tmp:
        work = Path(tmp)
        out = work / "out"
        for repeat in range(args.repeats):
            for name, ckptctl in cases(source, str(out)).items():
                for side, tree in trees.items():
                    if ckptctl is None and side == "old":
                        continue
                    argv = ["cp", "-r", source, str(out)] if ckptctl is None else \
                        [sys.executable, "-m", "ckptctl", *ckptctl]
                    runs.setdefault((name, side), []).append(run_once(argv, tree, out, work))
            print(f"repeat {repeat + 1} done, load {os.getloadavg()[0]:.1f}", flush=True)
    floor = statistics.median(r[1] for r in runs[("cp -r", "new")])
    print(f"{'case':24s} {'tree':4s} {'exit s':>7s} {'+sync s':>8s} {'/cp+sync':>8s} {'CPU s':>6s} {'RSS MB':>7s}  "
          "runs with sync (s)")
    for (name, side), rs in runs.items():
        exit_s, synced, cpu, rss = (statistics.median(r[k] for r in rs) for k in range(4))
        print(f"{name:24s} {side:4s} {exit_s:7.2f} {synced:8.2f} {synced / floor:8.2f} {cpu:6.2f} {rss:7.0f}  "
              + ", ".join(f"{r[1]:.2f}" for r in rs))
    if args.out is not None:
        args.out.write_text(json.dumps({f"{name} | {side}": rs for (name, side), rs in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
