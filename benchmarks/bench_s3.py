"""Object storage at link speed (issues 5 and 17): export and reshard against a plain parallel byte copy.

    python benchmarks/bench_s3.py --size 400MB --repeats 3 --out bench-out/s3.json

Makes (or reuses, under --work-dir) a model-only FSDP2 DCP checkpoint with `ckptctl sample` (world size 4,
fp32), starts a moto S3 server on loopback (`tests/s3server.py`, with ranged GETs that cost their range as
on S3: moto itself reads the whole object for each; multipart uploads completed without copying the object,
as on S3, its parts joined when it is first read; objects kept in memory, not spilled to this machine's
disk; `--moto-complete`: moto as it comes), then runs, --repeats times, interleaved, each run on a fresh
server with the checkpoint uploaded to it (moto keeps every object it was sent, deleted ones too: a server
grown by gigabytes slows the whole machine, and the runs late in a shared server's life would pay for it):

- `copy`: the floor, a plain parallel byte copy of the same objects to a new prefix through s3fs (the client
  library the engine uses): ranged GETs of one part each, multipart uploads of `UPLOAD_BLOCK` parts, the
  engine's concurrency (REMOTE_PARALLEL reads and upload.parallel() parts in flight), no server-side copy;
- `export` (safetensors, uncast) and `reshard` (world size 4 -> 3): local -> local (the reference),
  S3 -> S3, S3 -> local and local -> S3;
- `index +20ms serial` / `index +20ms parallel`: the DCP index read from S3 with every record located (each
  record's header read, as for Megatron's layer views; export and reshard locate a record when they read
  it instead, its header in the same request as its data), with 20 ms added before every request
  (loopback has no round trip; S3's time to first byte is 20-50 ms), one read at a time and the engine's
  `storage.INDEX_PARALLEL` at a time; both must give the same located chunks (their MB/s and "x copy"
  columns mean nothing).

Each run is a worker subprocess that times only the engine call (everything is synced between runs, so that
no run writes back another's local output) (`converters.convert` /
`converters.reshard`; interpreter start-up and imports are not counted) and reports the engine's
RangeReader counters (bytes fetched / bytes needed), its CPU seconds and the server's, and its memory: RSS
before the call and peak RSS (`ru_maxrss`: resident anonymous and file-backed pages of the process, imports
included), and the difference, which is what the run itself added. Throughput is source bytes (every
object of the checkpoint) per second; each S3 row is also given as a ratio to the copy floor's median of
the same run. Every output is compared file by file with the local -> local output (sha256 of every file
but the manifest; DCP's random ids are pinned), the copy with the source. Targets (issue 17): export and
reshard S3 -> S3 at >= 80% of the copy's throughput, fetched / needed <= 1.05. Prints a table and whether
each target is met, and writes JSON with the machine, versions and load average. moto is a Python server,
far slower than real S3: compare the rows with each other, not with AWS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MANIFEST = "ckpt-manifest.json"
ROUTES = ("local-local", "s3-s3", "s3-local", "local-s3")
#: moto keeps an object's bytes in a SpooledTemporaryFile that spills to a temporary file on this machine's disk
#: past 5 MiB (every 16 MiB part, every output); S3 does not share the client's disk and cores: the bench's
#: server keeps objects up to this size in memory (moto's own setting, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE)
KEY_BUFFER = 2 << 30
LATENCY_S = 0.02  # the index cases' time to first byte, as on S3 (loopback has none)
INDEX_CASES = {"index +20ms serial": 1, "index +20ms parallel": None}  # index reads at a time (None: the engine's)
CASES = ("copy", *(f"export {r}" for r in ROUTES), *(f"reshard {r}" for r in ROUTES), *INDEX_CASES)
TARGET_RATIO = 0.8
TARGET_FETCH = 1.05
BUCKET = "bench"
SOURCE = "run/step_2000"


# --- the worker: one timed run in its own process ---------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Run one case (`op` from `source` to `target`) in this process; time and counters as a dict."""
    import converters.rangeread
    import converters.writers.dcp
    import converters.zipwriter
    from converters import ConvertOptions, ReshardOptions, convert, reshard, storage
    from converters.transforms import KeyOptions

    fixed = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=0x5EED))  # DCP's random ids, pinned
    converters.writers.dcp.uuid = fixed  # type: ignore[attr-defined]
    converters.zipwriter.uuid = fixed  # type: ignore[attr-defined]
    class Delayed(storage.RangeReader):
        """Every remote request waits `LATENCY_S` first, as S3's time to first byte."""

        def _fetch(self, uri: str, start: int, end: int) -> bytes:
            time.sleep(LATENCY_S)
            return super()._fetch(uri, start, end)

    reader = Delayed() if job["op"] == "index" else storage.RangeReader()
    if job.get("parallel"):
        converters.rangeread.INDEX_PARALLEL = job["parallel"]
    digest = ""
    before = rss_mb()
    cpu = time.process_time()
    start = time.perf_counter()
    if job["op"] == "copy":
        copy_objects(job["source"], job["target"])
    elif job["op"] == "index":
        from converters.formats import load_index
        from converters.formats.dcp import DcpReader

        DcpReader.locate_remote = True  # every record's header read with the index, as for Megatron's views
        index = load_index(job["source"], reader=reader)
        located = sorted((name, c.offsets, c.data.uri, c.data.offset, c.data.length)
                         for name, entry in index.tensors.items() for c in entry.chunks)
        digest = hashlib.sha256(repr(located).encode()).hexdigest()
    elif job["op"] == "export":
        convert(job["source"], job["target"], ConvertOptions(overwrite=True), reader=reader)
    else:
        reshard(job["source"], job["target"], ReshardOptions(world_size=3, keys=KeyOptions(only="all"),
                                                             overwrite=True), reader=reader)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    return {"seconds": seconds, "cpu_s": cpu, "rss_before_mb": before, "rss_peak_mb": peak,
            "rss_added_mb": peak - before, "fetched": reader.fetched, "requested": reader.requested,
            "requests": reader.requests, "digest": digest}


def copy_objects(source: str, target: str) -> None:
    """The floor: copy every object under `source` to `target` as bytes through s3fs, in parallel, with the
    engine's part size and concurrency (K ranged GETs and K part uploads in flight, 2K parts in memory)."""
    from fsspec.asyn import sync

    from converters import storage, upload

    fs, _ = storage.filesystem(source)
    part, reads, writes = upload.UPLOAD_BLOCK, storage.REMOTE_PARALLEL, upload.parallel()

    async def run() -> None:
        read_slots, write_slots, held = (asyncio.Semaphore(reads), asyncio.Semaphore(writes),
                                         asyncio.Semaphore(reads + writes))
        listing = await fs._find(source, detail=True)

        async def get(path: str, lo: int, hi: int) -> bytes:
            async with read_slots:
                return await fs._cat_file(path, start=lo, end=hi)

        async def put_part(path: str, key: str, upload_id: str, number: int, lo: int, hi: int) -> dict[str, Any]:
            async with held:
                data = await get(path, lo, hi)
                async with write_slots:
                    reply = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                              PartNumber=number, Body=data)
            return {"PartNumber": number, "ETag": reply["ETag"]}

        async def one(path: str, size: int) -> None:
            key = f"{prefix}/{path.split('/', 1)[1][len(source_key) + 1:]}"
            if size < part:
                async with held:
                    data = await get(path, 0, size)
                    async with write_slots:
                        await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data)
                return
            mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            parts = await asyncio.gather(*(put_part(path, key, mpu["UploadId"], i + 1, lo, min(lo + part, size))
                                           for i, lo in enumerate(range(0, size, part))))
            await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                              MultipartUpload={"Parts": list(parts)})

        await asyncio.gather(*(one(path, info["size"]) for path, info in listing.items()))

    bucket, prefix = target.split("://", 1)[1].split("/", 1)
    source_key = source.split("://", 1)[1].split("/", 1)[1]
    sync(fs.loop, run)


# --- the driver -------------------------------------------------------------------------------------------


def make_sample(work: Path, size: str) -> Path:
    path = work / f"sample-ws4-{size}"
    if not (path / ".metadata").exists():
        subprocess.run([sys.executable, "-m", "ckptctl", "sample", str(path), "--world-size", "4",
                        "--size", size, "--model-only"], check=True, timeout=3600)
    return path


def _sha256(chunks: Any) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def local_digests(folder: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            with open(p, "rb") as fh:
                out[p.name] = (p.stat().st_size, _sha256(iter(lambda fh=fh: fh.read(1 << 24), b"")))
    return out


def s3_digests(client: Any, prefix: str) -> dict[str, tuple[int, str]]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) + 1:]
            if name != MANIFEST:
                body = client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"]
                out[name] = (obj["Size"], _sha256(body.iter_chunks(1 << 24)))
    return out


def upload_source(endpoint: str, sample: Path) -> Any:
    """The sample in a new bucket of the server at `endpoint`, each object read once (so that its parts are
    joined and kept before the timed run, as S3 serves any object); a boto3 client for it."""
    from tests.s3server import boto3_client

    client = boto3_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(sample.iterdir()):
        client.upload_file(str(path), BUCKET, f"{SOURCE}/{path.name}")
        client.get_object(Bucket=BUCKET, Key=f"{SOURCE}/{path.name}", Range="bytes=0-0")["Body"].read()
    return client


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_case(case: str, sample: Path, scratch: Path, server_pid: int) -> dict[str, Any]:
    op, _, route = case.partition(" ")
    run = uuid.uuid4().hex[:8]
    if op == "copy":
        source, target = f"s3://{BUCKET}/{SOURCE}", f"s3://{BUCKET}/copies/{run}"
    elif op == "index":
        source, target = f"s3://{BUCKET}/{SOURCE}", ""
    else:
        source = f"s3://{BUCKET}/{SOURCE}" if route.startswith("s3") else str(sample)
        target = f"s3://{BUCKET}/out/{run}" if route.endswith("s3") else str(scratch / f"out-{run}")
    job = {"op": op, "source": source, "target": target, "parallel": INDEX_CASES.get(case)}
    server_cpu = process_cpu(server_pid)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed: {proc.stderr[-3000:]}")
    return {"case": case, "target": target, "server_cpu_s": process_cpu(server_pid) - server_cpu,
            **json.loads(proc.stdout.strip().splitlines()[-1])}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("s3fs", "aiobotocore", "botocore", "fsspec", "moto", "torch", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def summarise(runs: list[dict[str, Any]], data_bytes: int, cases: list[str]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for case in cases:
        rows = [r for r in runs if r["case"] == case]
        median = statistics.median(r["seconds"] for r in rows)
        entry: dict[str, Any] = {"median_s": median, "min_s": min(r["seconds"] for r in rows),
                                 "mb_per_s": data_bytes / median / 1e6,
                                 "cpu_s": statistics.median(r["cpu_s"] for r in rows),
                                 "server_cpu_s": statistics.median(r["server_cpu_s"] for r in rows),
                                 "rss_peak_mb": max(r["rss_peak_mb"] for r in rows),
                                 "rss_added_mb": max(r["rss_added_mb"] for r in rows),
                                 "identical": all(r["identical"] for r in rows)}
        if rows[0]["requested"]:
            entry.update({"fetched": rows[0]["fetched"], "requested": rows[0]["requested"],
                          "requests": rows[0]["requests"],
                          "fetched_over_needed": max(r["fetched"] / r["requested"] for r in rows)})
        summary[case] = entry
    floor = summary["copy"]["mb_per_s"]
    for entry in summary.values():
        entry["vs_copy"] = entry["mb_per_s"] / floor
    return summary


def targets(summary: dict[str, dict[str, Any]]) -> dict[str, bool]:
    out = {}
    for case in ("export s3-s3", "reshard s3-s3"):
        if case not in summary:
            continue
        out[f"{case}: >= {TARGET_RATIO:.0%} of the copy's throughput"] = summary[case]["vs_copy"] >= TARGET_RATIO
        out[f"{case}: fetched / needed <= {TARGET_FETCH}"] = summary[case]["fetched_over_needed"] <= TARGET_FETCH
    out["every output identical to the local one (the copy to its source)"] = all(
        e["identical"] for e in summary.values())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="400MB", help="sample size for `ckptctl sample` (e.g. 50MB, 400MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench-out" / "s3")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "s3.json")
    parser.add_argument("--moto-complete", action="store_true",
                        help="moto as it comes: complete multipart uploads with moto's own code (five copies of the "
                             "object in the server, see tests/s3server.py) instead of joining the parts once, and "
                             "spill objects over 5 MiB to temporary files instead of keeping them in memory")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated subset of: " + ", ".join(CASES) + " (copy always runs: the floor)")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    wanted = {case.strip() for case in args.cases.split(",") if case.strip()}
    unknown = wanted - set(CASES)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    cases = [case for case in CASES if case in wanted or case == "copy"]

    from tests.s3server import MotoServer, aws_env

    args.work_dir.mkdir(parents=True, exist_ok=True)
    sample = make_sample(args.work_dir, args.size)
    data_bytes = sum(p.stat().st_size for p in sample.iterdir() if p.is_file())
    load_before = os.getloadavg()
    server_env = {} if args.moto_complete else {"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(KEY_BUFFER)}
    source_digests = local_digests(sample)
    reference: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for repeat in range(args.repeats):
            for case in cases:
                # a fresh server for every run: moto keeps what it was sent (deleted objects too), and a server
                # grown by gigabytes slows the whole machine, so that runs late in the order would pay for it
                with MotoServer(server_env, log_dir=str(args.work_dir), ranged_reads=True,
                                s3_complete=not args.moto_complete) as server:
                    os.environ.update(aws_env(server.endpoint))
                    client = upload_source(server.endpoint, sample)
                    assert server.proc is not None
                    row = run_case(case, sample, Path(tmp), server.proc.pid)
                    target = row.pop("target")
                    digest = row.pop("digest")
                    prefix = target.split("/", 3)[3] if target.startswith("s3://") else ""
                    op = case.split()[0]
                    got: Any = digest if op == "index" else s3_digests(client, prefix) if prefix else \
                        local_digests(Path(target))
                want = source_digests if op == "copy" else reference.setdefault(op, got)  # the first run of op
                row["identical"] = got == want
                row["repeat"] = repeat + 1
                runs.append(row)
                print(f"  {repeat + 1}/{args.repeats} {case:<20} {row['seconds']:7.2f} s"
                      f"{'' if row['identical'] else '  OUTPUT DIFFERS'}", flush=True)
                if target and not prefix:
                    shutil.rmtree(target)
                os.sync()  # the next run must not pay for writing back this one's local output
    load_after = os.getloadavg()

    summary = summarise(runs, data_bytes, cases)
    met = targets(summary)
    print(f"\n{args.size} FSDP2 DCP checkpoint, world size 4 ({data_bytes / 1e6:.1f} MB in "
          f"{len(source_digests)} objects), median of {args.repeats}, load {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f} on {os.cpu_count()} CPUs")
    header = (f"{'case':<20} {'median s':>9} {'MB/s':>7} {'x copy':>7} {'fetched/needed':>15} {'requests':>9} "
              f"{'CPU s':>6} {'server CPU s':>13} {'peak RSS MB':>12} {'added MB':>9} same")
    print(header)
    print("-" * len(header))
    for case, e in summary.items():
        ratio = f"{e['fetched_over_needed']:.3f}" if "fetched_over_needed" in e else "-"
        print(f"{case:<20} {e['median_s']:>9.2f} {e['mb_per_s']:>7.0f} {e['vs_copy']:>7.2f} {ratio:>15} "
              f"{e.get('requests', '-'):>9} {e['cpu_s']:>6.2f} {e['server_cpu_s']:>13.2f} {e['rss_peak_mb']:>12.0f} "
              f"{e['rss_added_mb']:>9.0f} "
              f"{'yes' if e['identical'] else 'NO'}")
    for name, ok in met.items():
        print(f"{'MET ' if ok else 'MISSED'} {name}")
    doc = {"issue": 17, "size": args.size, "data_bytes": data_bytes, "objects": len(source_digests),
           "repeats": args.repeats, "server": {"ranged_reads": True, "s3_complete": not args.moto_complete,
                                                   "key_buffer": None if args.moto_complete else KEY_BUFFER},
           "summary": summary, "targets": met, "runs": runs,
           "cpu": "cpu_s: the worker's CPU seconds in the timed call (all its threads); server_cpu_s: the moto "
                  "server's CPU seconds during the run",
           "rss": "worker process: ru_maxrss (peak resident set, anonymous and file-backed pages, imports "
                  "included); rss_added: peak minus the RSS just before the timed call",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "load_before": load_before, "load_after": load_after},
           "versions": versions(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
