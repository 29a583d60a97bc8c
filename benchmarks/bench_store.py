"""Job store throughput: jobs claimed per second by 4 workers, on SQLite and on PostgreSQL, and the API's
/healthz latency meanwhile.

    python benchmarks/bench_store.py --jobs 2000 --out bench-out/store.json
    python benchmarks/bench_store.py --database-url postgresql://user@host/db   # an existing server

For each store: queue --jobs jobs, start `ckptctl serve --workers 0` on the store (the API replica) and
--workers claimer processes, each of which loops `claim` -> `finish` (a job's two store transactions
without the conversion in between, so the store is what is measured) until the queue is empty. One
thread meanwhile sends GET /healthz sequentially over one keep-alive connection. Without --database-url
a PostgreSQL 15 server is started in a temporary directory (Debian's `postgresql` package, as the tests
do). Prints a table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.healthz_under_load import percentile  # noqa: E402
from tests.service_harness import make_server  # noqa: E402


def claimer(location: str, name: str, start: Any, results: Any) -> None:
    """One worker: claim and finish jobs until none is left; reports (jobs, first claim, last finish)."""
    from ckpt_service.store import JobStore

    store = JobStore(location, migrate=False)
    store.ping()
    done, first, last = 0, None, None
    start.wait()
    while (job := store.claim(name, 60)) is not None:
        first = first or time.time()
        assert store.finish_now(job.id, job.attempt, "succeeded", result={"ok": True})
        done, last = done + 1, time.time()
    store.close()
    results.put((name, done, first, last))


def queue_jobs(location: str, jobs: int) -> None:
    from ckpt_service.store import JobStore

    store = JobStore(location)
    for i in range(jobs):
        store.create_job(kind="inspect", spec={"kind": "inspect", "source": f"/data/c{i}"}, target=None,
                         callback_url=None, submitted_by="bench", max_attempts=2, queue_limit=jobs + 1)
    store.close()


def poll_healthz(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=5.0) as http:
        while not stop.is_set():
            started = time.perf_counter()
            http.get("/healthz").raise_for_status()
            out.append((time.perf_counter() - started) * 1000)
            time.sleep(0.005)


def run_store(kind: str, location: str, work: Path, jobs: int, workers: int) -> dict[str, Any]:
    queue_jobs(location, jobs)
    env = {"CKPT_DATABASE_URL": location} if kind == "postgresql" else {}
    data = Path(location).parent if kind == "sqlite" else work / "api-postgresql"  # SQLite: the data dir's ckpt.db
    server = make_server(data, read_roots=[work], write_roots=[work], workers=0, extra_env=env).start()
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=claimer, args=(location, f"bench:{i}", start, results)) for i in range(workers)]
    latencies: list[float] = []
    stop = threading.Event()
    try:
        for p in procs:
            p.start()
        time.sleep(2.0)  # the claimers have imported and connected
        poller = threading.Thread(target=poll_healthz, args=(server.url, stop, latencies))
        poller.start()
        time.sleep(0.5)
        start.set()
        got = [results.get(timeout=600) for _ in procs]
        stop.set()
        poller.join()
        for p in procs:
            p.join(30)
    finally:
        stop.set()
        server.stop()
    claimed = sum(g[1] for g in got)
    first = min(g[2] for g in got if g[2])
    last = max(g[3] for g in got if g[3])
    return {"store": kind, "workers": workers, "jobs": claimed, "seconds": round(last - first, 3),
            "claims_per_second": round(claimed / (last - first), 1), "per_worker": sorted(g[1] for g in got),
            "healthz": {"count": len(latencies), "p50_ms": round(percentile(latencies, 50), 2),
                        "p99_ms": round(percentile(latencies, 99), 2), "max_ms": round(max(latencies), 2)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--database-url", default=None, help="an empty PostgreSQL database (default: start one)")
    parser.add_argument("--stores", default="sqlite,postgresql")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "store.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    server = None
    rows = []
    try:
        for kind in args.stores.split(","):
            if kind == "sqlite":
                (work / "sqlite").mkdir()
                location = str(work / "sqlite" / "ckpt.db")
            else:
                if args.database_url is None:
                    from tests.pg_server import start_server

                    server = start_server()
                location = args.database_url or server.create_database()
            print(f"{kind}: {args.jobs} jobs, {args.workers} claimers ...", flush=True)
            rows.append(run_store(kind, location, work, args.jobs, args.workers))
    finally:
        if server is not None:
            server.pg_ctl("-m", "immediate", "stop")
    print(f"\n{'store':<12}{'workers':>8}{'jobs':>7}{'seconds':>9}{'claims/s':>10}{'healthz p50':>13}"
          f"{'p99 ms':>8}{'max ms':>8}")
    for r in rows:
        h = r["healthz"]
        print(f"{r['store']:<12}{r['workers']:>8}{r['jobs']:>7}{r['seconds']:>9}{r['claims_per_second']:>10}"
              f"{h['p50_ms']:>13}{h['p99_ms']:>8}{h['max_ms']:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "load_1m": os.getloadavg()[0], "python": platform.python_version(),
              "results": rows}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
