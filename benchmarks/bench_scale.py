"""One export through the local executor and through a local Ray cluster of 1 and 2 worker nodes (issue 14).

    python benchmarks/bench_scale.py --size 256MB --repeats 2 --out bench-out/scale.json

Makes (or reuses, under --work-dir) a model-only FSDP2 DCP checkpoint with `ckptctl sample` (world size 4,
fp32, several files), then times `export` of it to safetensors shards of --shard-size, with and without
--dtype bfloat16: through the local executor, and through a `ray.cluster_utils.Cluster` on this machine
whose head has no CPUs (it only schedules) and whose worker nodes have one CPU each (one task at a time
per node, so that a node stands for one host's link). Each export runs as its own driver process
(`--driver`, the engine's `convert`, as `ckptctl export --ray` runs it). For every run: wall seconds of the
driver, bytes written per node (from the parts' results), peak RSS of the driver and of every Ray worker
process (VmHWM from /proc), and each part's own seconds, from which the per-node bandwidth B is taken. Every
Ray output is compared with the local executor's, file by file (sha256), and a mismatch exits 1.

The model (benchmarks/README.md): T(K) = T0 + S / (K * B), where S is the bytes written, B one node's
bandwidth (here: bytes / summed part seconds of the 1-node runs) and T0 what does not divide across nodes
(driver start, index, scheduling, the final metadata). T0 comes from the 1-node run; T(2) is predicted
and printed next to the measured 2-node time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_convert import _descendants, _status_kb  # noqa: E402

NODE_MEMORY = 2 * 1024**3
OBJECT_STORE = 100 * 1000 * 1000


def parse_size(text: str) -> int:
    from ckpt_service.units import parse_size as parse

    return parse(text)


def driver(source: str, target: str, address: str, dtype: str, shard_size: int) -> None:
    """One export in this process; prints its numbers as JSON (the parent measures the rest)."""
    from converters import ConvertOptions, convert
    from converters.config import EngineConfig
    from converters.plan import Execution
    from converters.transforms import KeyOptions

    execution = Execution("local") if address == "local" else Execution("ray", address)
    options = ConvertOptions(export=True, keys=KeyOptions(only="model", clean=True), max_shard_size=shard_size,
                             dtype=dtype or None, execution=execution)
    if address != "local":  # connect first: joining the cluster is not part of the conversion
        import ray

        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    started = time.perf_counter()
    result = convert(source, target, options, config=EngineConfig.from_env())  # CKPT_RAY_PART_BYTES from the parent
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "peak_rss_kb": _status_kb(os.getpid())[1],
                      "parts": [{"name": p.name, "bytes": p.size, "node": p.node or "local", "seconds": p.seconds}
                                for p in result.parts]}))


def sample(work: Path, size: str) -> Path:
    path = work / "samples" / f"scale-{size}"
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "ckptctl", "sample", str(tmp), "--world-size", "4", "--size",
                        size, "--model-only", "--no-train"], check=True)
        tmp.rename(path)
    return path


def digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())
            if p.name != "ckpt-manifest.json"}


def worker_peaks() -> dict[int, int]:
    """VmHWM (KiB) of every Ray worker process under this one (the cluster's raylets are our children)."""
    peaks = {}
    for pid in _descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"ray::"):
            peaks[pid] = _status_kb(pid)[1]
    return peaks


def run_one(name: str, source: Path, out: Path, address: str, dtype: str, shard_size: int) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPT_RAY_PART_BYTES": str(shard_size)}
    proc = subprocess.run([sys.executable, __file__, "--driver", str(source), str(out), address, dtype,
                           str(shard_size)], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: driver failed:\n{proc.stderr[-3000:]}")
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    by_node: dict[str, int] = {}
    for part in run["parts"]:
        by_node[part["node"]] = by_node.get(part["node"], 0) + part["bytes"]
    run["bytes_per_node"] = by_node
    run["worker_peak_rss_kb"] = worker_peaks() if address != "local" else {}
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MB")
    p.add_argument("--shard-size", default="16MB", help="safetensors shard size: one part (one task) each")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtypes", default=",bfloat16", help="comma-separated; empty = no cast")
    p.add_argument("--work-dir", type=Path, default=ROOT / "bench-out")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--driver", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.driver:
        src, target, address, dtype, shard = args.driver
        driver(src, target, address, dtype, int(shard))
        return
    import ray
    from ray.cluster_utils import Cluster

    shard_size = parse_size(args.shard_size)
    source = sample(args.work_dir, args.size)
    runs_dir = args.work_dir / "scale-runs"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": OBJECT_STORE})
    nodes: list[Any] = []
    results: dict[str, list[dict[str, Any]]] = {}
    failed = False
    try:
        for k in (1, 2):
            nodes.append(cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE, memory=NODE_MEMORY))
            cluster.wait_for_nodes()
            for dtype in args.dtypes.split(","):
                for _ in range(args.repeats):
                    cases = [("local", "local")] if k == 1 else []
                    cases.append((f"ray-{k}", cluster.address))
                    for case, address in cases:
                        key = f"{case}{'-' + dtype if dtype else ''}"
                        run = run_one(key, source, runs_dir / key, address, dtype, shard_size)
                        results.setdefault(key, []).append(run)
                        ref = runs_dir / f"local{'-' + dtype if dtype else ''}"
                        if case != "local" and digest(runs_dir / key) != digest(ref):
                            failed = True
                            print(f"{key}: output differs from the local executor's", file=sys.stderr)
    finally:
        cluster.shutdown()
        ray.shutdown()
    names = {node.node_id: f"node{i}" for i, node in enumerate(nodes, 1)}
    table, model = [], {}
    for key, runs in results.items():
        secs = [r["seconds"] for r in runs]
        per_node: dict[str, int] = {}
        for node, nbytes in runs[0]["bytes_per_node"].items():
            per_node[names.get(node, node)] = nbytes
        workers = max((kb for r in runs for kb in r["worker_peak_rss_kb"].values()), default=0)
        total = sum(per_node.values())
        part_seconds = statistics.median(sum(part["seconds"] for part in r["parts"]) for r in runs)
        table.append({"case": key, "min_s": min(secs), "median_s": statistics.median(secs), "bytes": total,
                      "bytes_per_node": per_node, "driver_peak_rss_mb": max(r["peak_rss_kb"] for r in runs) / 1000,
                      "worker_peak_rss_mb": workers / 1000, "part_seconds": part_seconds})
    for dtype in args.dtypes.split(","):
        suffix = f"-{dtype}" if dtype else ""
        one = next(row for row in table if row["case"] == f"ray-1{suffix}")
        two = next(row for row in table if row["case"] == f"ray-2{suffix}")
        bandwidth = one["bytes"] / one["part_seconds"]
        t0 = one["median_s"] - one["bytes"] / bandwidth
        predicted = t0 + two["bytes"] / (2 * bandwidth)
        model[dtype or "none"] = {"B_MBps": bandwidth / 1e6, "T0_s": t0, "T1_s": one["median_s"],
                                  "T2_predicted_s": predicted, "T2_measured_s": two["median_s"],
                                  "error_pct": 100 * (two["median_s"] - predicted) / predicted}
    print(f"{'case':<18}{'min s':>8}{'median s':>10}{'MB':>8}  {'MB per node':<28}{'driver MB':>10}{'worker MB':>10}")
    for row in table:
        nodes_text = ", ".join(f"{n}={b / 1e6:.0f}" for n, b in row["bytes_per_node"].items())
        print(f"{row['case']:<18}{row['min_s']:>8.2f}{row['median_s']:>10.2f}{row['bytes'] / 1e6:>8.0f}  "
              f"{nodes_text:<28}{row['driver_peak_rss_mb']:>10.0f}{row['worker_peak_rss_mb']:>10.0f}")
    for dtype, m in model.items():
        print(f"model (dtype {dtype}): B = {m['B_MBps']:.0f} MB/s per node, T0 = {m['T0_s']:.2f} s; "
              f"T(2) predicted {m['T2_predicted_s']:.2f} s, measured {m['T2_measured_s']:.2f} s "
              f"({m['error_pct']:+.0f}%)")
    doc = {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "cpus": os.cpu_count(),
           "load1": os.getloadavg()[0], "size": args.size, "shard_size": shard_size, "repeats": args.repeats,
           "ray": ray.__version__, "table": table, "model": model, "failed": failed}
    out = args.out or args.work_dir / "scale.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
