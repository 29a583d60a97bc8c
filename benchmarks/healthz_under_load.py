"""How fast does the API answer health checks while both job slots run big conversions?

    python benchmarks/healthz_under_load.py --size 1GB --out bench-out/healthz.json

Makes (or reuses, under --work-dir) a real FSDP2 checkpoint with the project's sample generator, starts
`ckptctl serve --workers 2` on a free loopback port, measures GET /healthz and GET /readyz latency on an
idle server, then submits two `convert --only all --dtype bfloat16` jobs (model and optimizer state, cast:
the CPU-heaviest conversion) and keeps measuring until both end. Requests are sequential over one
keep-alive connection, one every --interval seconds. Prints a table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from ckpt_service.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent




def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarise(latencies_ms: list[float], budget_ms: float) -> dict[str, Any]:
    return {"count": len(latencies_ms), "p50_ms": round(statistics.median(latencies_ms), 2),
            "p95_ms": round(percentile(latencies_ms, 95), 2), "p99_ms": round(percentile(latencies_ms, 99), 2),
            "max_ms": round(max(latencies_ms), 2),
            "within_budget": round(sum(v <= budget_ms for v in latencies_ms) / len(latencies_ms), 4)}


def ensure_sample(work: Path, size: str) -> Path:
    sample = work / f"sample-{size}"
    if (sample / ".metadata").exists():
        return sample
    from ckpt_service.sample import make_sample

    if sample.exists():
        shutil.rmtree(sample)
    print(f"making a {size} FSDP2 sample (once; cached in {sample}) ...", flush=True)
    make_sample(sample, world_size=2, layout="fsdp2-dcp", size=size)
    return sample


def probe(http: httpx.Client, path: str) -> float:
    start = time.perf_counter()
    response = http.get(path)
    elapsed = (time.perf_counter() - start) * 1000
    response.raise_for_status()
    return elapsed


def measure(http: httpx.Client, seconds: float | None, interval: float, until: Any = None,
            limit_s: float = 1800) -> dict[str, list[float]]:
    """Probe /healthz and /readyz alternately until `seconds` pass or `until()` is true (at most limit_s)."""
    found: dict[str, list[float]] = {"/healthz": [], "/readyz": []}
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < limit_s:
        if seconds is not None and time.monotonic() - start >= seconds:
            break
        if until is not None and n % 10 == 0 and until():
            break
        path = "/healthz" if n % 2 == 0 else "/readyz"
        found[path].append(probe(http, path))
        n += 1
        time.sleep(interval)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GB", help="fp32 parameter bytes of the sample (optimizer state triples "
                        "it); default 1GB")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench-out" / "healthz")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default: WORK_DIR/healthz.json)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between probes")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--budget-ms", type=float, default=100.0)
    parser.add_argument("--job-nice", type=int, default=None, help="override CKPT_JOB_NICE (default 10)")
    args = parser.parse_args()

    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    sample = ensure_sample(work, args.size)
    data = work / "service"
    if data.exists():
        shutil.rmtree(data)
    data.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update({"CKPT_READ_ROOTS": json.dumps([str(work)]), "CKPT_WRITE_ROOTS": json.dumps([str(data)])})
    if args.job_nice is not None:
        env["CKPT_JOB_NICE"] = str(args.job_nice)
    log = open(data / "server.log", "wb")  # noqa: SIM115 (closed in finally)
    server = subprocess.Popen([sys.executable, "-m", "ckptctl", "serve", "--port", str(port), "--workers",
                               "2", "--data-dir", str(data)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the server did not come up; see {data / 'server.log'}")
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=30) as http:
            measure(http, 1.0, args.interval)  # warm up
            idle = measure(http, args.idle_seconds, args.interval)
            jobs = []
            for i in range(2):
                spec = {"kind": "convert", "source": str(sample), "target": str(data / f"out-{i}.safetensors"),
                        "options": {"only": "all", "dtype": "bfloat16"}}
                response = http.post("/v1/jobs", json=spec)
                response.raise_for_status()
                jobs.append(response.json()["id"])
            deadline = time.monotonic() + 120
            while any(http.get(f"/v1/jobs/{j}").json()["state"] == "queued" for j in jobs):
                if time.monotonic() > deadline:
                    raise SystemExit("the jobs did not start")
                time.sleep(0.1)

            def finished() -> bool:
                return all(http.get(f"/v1/jobs/{j}").json()["state"] not in ("queued", "running") for j in jobs)

            loaded = measure(http, None, args.interval, until=finished)
            finals = [http.get(f"/v1/jobs/{j}").json() for j in jobs]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

    for job in finals:
        if job["state"] != "succeeded":
            raise SystemExit(f"job {job['id']} ended {job['state']}: {job['error']}")
    rows = []
    for phase, found in (("idle", idle), ("2 jobs running", loaded)):
        for path, values in found.items():
            rows.append({"phase": phase, "path": path, **summarise(values, args.budget_ms)})
    job_rows = [{"id": j["id"], "bytes": j["progress"]["total_bytes"],
                 "seconds": round(datetime.fromisoformat(j["finished_at"]).timestamp()
                                  - datetime.fromisoformat(j["started_at"]).timestamp(), 2),
                 "throughput_mb_s": round((j["progress"]["throughput_bytes_per_s"] or 0) / 1e6, 1)} for j in finals]

    print(f"\n/healthz and /readyz latency, sequential probes every {args.interval * 1000:.0f} ms "
          f"({os.cpu_count()} cores, job niceness {args.job_nice if args.job_nice is not None else 10})")
    print(f"{'phase':<16} {'path':<9} {'n':>5} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'<=' + str(int(args.budget_ms)) + ' ms':>9}")
    for r in rows:
        print(f"{r['phase']:<16} {r['path']:<9} {r['count']:>5} {r['p50_ms']:>8.2f} {r['p95_ms']:>8.2f} "
              f"{r['p99_ms']:>8.2f} {r['max_ms']:>8.2f} {r['within_budget']:>9.2%}")
    for j in job_rows:
        print(f"job {j['id']}: {j['bytes'] / 1e9:.2f} GB of tensors in {j['seconds']} s "
              f"({j['throughput_mb_s']} MB/s)")
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "size": args.size, "interval_s": args.interval, "budget_ms": args.budget_ms,
           "job_nice": args.job_nice if args.job_nice is not None else 10, "rows": rows, "jobs": job_rows}
    out = args.out or work / "healthz.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    for i in range(2):
        (data / f"out-{i}.safetensors").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
