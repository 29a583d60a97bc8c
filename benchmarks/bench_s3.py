"""Object storage throughput and read amplification (issue 5): an S3 -> S3 export next to local -> local.

    python benchmarks/bench_s3.py --size 50MB --repeats 3 --out bench-out/s3.json

Makes (or reuses, under --work-dir) a model-only FSDP2 DCP checkpoint with `ckptctl sample` (world size 2,
fp32), starts a moto S3 server on loopback (`python -m moto.server`), uploads the checkpoint, then times the
export (`converters.api.convert`, in this process, so interpreter start-up is not counted) four ways:
local -> local, S3 -> S3, S3 -> local and local -> S3, --repeats times each, interleaved. Every output is
compared file by file with the local -> local output (size and sha256 of every file but the manifest).
For the runs that read S3, the engine's RangeReader counters give bytes fetched / bytes needed. Prints a
table and writes the numbers as JSON. moto is an in-memory Python server, far slower than real S3: compare
the S3 rows with each other and with the upload floor (boto3 upload_file of the same files), not with AWS.
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
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from converters import storage  # noqa: E402
from converters.api import ConvertOptions, convert  # noqa: E402
from tests.s3server import MotoServer, aws_env, boto3_client, clear_fs_caches  # noqa: E402

CASES = ("local-local", "s3-s3", "s3-local", "local-s3")
MANIFEST = "ckpt-manifest.json"


def make_sample(work: Path, size: str) -> Path:
    path = work / f"sample-{size}"
    if not (path / ".metadata").exists():
        subprocess.run([sys.executable, "-m", "ckpt_service.cli", "sample", str(path), "--world-size", "2",
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


def s3_digests(client: Any, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) + 1:]
            if name != MANIFEST:
                body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"]
                out[name] = (obj["Size"], _sha256(body.iter_chunks(1 << 24)))
    return out


def s3_delete(client: Any, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])


def run_case(case: str, sample: Path, bucket: str, scratch: Path, options: ConvertOptions) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    source = f"s3://{bucket}/run/step_2000" if case.startswith("s3") else str(sample)
    target = f"s3://{bucket}/exports/{run}" if case.endswith("s3") else str(scratch / f"export-{run}")
    clear_fs_caches()
    reader = storage.RangeReader()
    start = time.perf_counter()
    convert(source, target, options, reader=reader)
    seconds = time.perf_counter() - start
    return {"case": case, "seconds": seconds, "target": target, "fetched": reader.fetched,
            "requested": reader.requested, "requests": reader.requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="50MB", help="sample size for `ckptctl sample` (e.g. 50MB, 500MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="cast on export (float32 keeps the bytes; default)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench-out" / "s3")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "s3.json")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    sample = make_sample(args.work_dir, args.size)
    data_bytes = sum(p.stat().st_size for p in sample.glob("*.distcp"))
    options = ConvertOptions(dtype=args.dtype, overwrite=True)

    with MotoServer(log_dir=str(args.work_dir)) as server, tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        os.environ.update(aws_env(server.endpoint))
        client = boto3_client(server.endpoint)
        bucket = "bench"
        client.create_bucket(Bucket=bucket)
        start = time.perf_counter()
        for path in sorted(sample.iterdir()):
            client.upload_file(str(path), bucket, f"run/step_2000/{path.name}")
        upload_seconds = time.perf_counter() - start

        scratch = Path(tmp)
        reference: dict[str, str] | None = None
        runs: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            for case in CASES:
                row = run_case(case, sample, bucket, scratch, options)
                target = row.pop("target")
                prefix = target.split("/", 3)[3] if target.startswith("s3://") else ""
                got = s3_digests(client, bucket, prefix) if prefix else local_digests(Path(target))
                if reference is None:
                    reference = got  # local-local runs first
                row["identical_to_local"] = got == reference
                row["output_bytes"] = sum(size for size, _ in got.values())
                row["repeat"] = repeat + 1
                runs.append(row)
                if prefix:
                    s3_delete(client, bucket, prefix)
                else:
                    shutil.rmtree(target)

    summary: dict[str, dict[str, Any]] = {}
    for case in CASES:
        rows = [r for r in runs if r["case"] == case]
        median = statistics.median(r["seconds"] for r in rows)
        entry: dict[str, Any] = {"median_s": median, "min_s": min(r["seconds"] for r in rows),
                                 "mb_per_s": data_bytes / median / 1e6,
                                 "identical_to_local": all(r["identical_to_local"] for r in rows)}
        if rows[0]["requested"]:
            entry.update({"fetched": rows[0]["fetched"], "requested": rows[0]["requested"],
                          "requests": rows[0]["requests"],
                          "fetched_over_needed": rows[0]["fetched"] / rows[0]["requested"],
                          "fetched_over_data": rows[0]["fetched"] / data_bytes})
        summary[case] = entry
    local = summary["local-local"]["median_s"]
    for entry in summary.values():
        entry["vs_local_local"] = entry["median_s"] / local

    print(f"\nexport of a {args.size} FSDP2 DCP checkpoint ({data_bytes / 1e6:.1f} MB of .distcp data), "
          f"median of {args.repeats}; upload floor (boto3 upload_file): {upload_seconds:.2f} s, "
          f"{data_bytes / upload_seconds / 1e6:.0f} MB/s")
    header = f"{'case':<12} {'median s':>9} {'MB/s':>8} {'x local':>8} {'fetched/needed':>15} {'requests':>9} same"
    print(header)
    print("-" * len(header))
    for case, e in summary.items():
        ratio = f"{e['fetched_over_needed']:.2f}" if "fetched_over_needed" in e else "-"
        requests = str(e.get("requests", "-"))
        print(f"{case:<12} {e['median_s']:>9.2f} {e['mb_per_s']:>8.0f} {e['vs_local_local']:>8.1f} {ratio:>15} "
              f"{requests:>9} {'yes' if e['identical_to_local'] else 'NO'}")
    doc = {"issue": 5, "size": args.size, "data_bytes": data_bytes, "repeats": args.repeats, "dtype": args.dtype,
           "upload_floor_s": upload_seconds, "summary": summary, "runs": runs,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(e["identical_to_local"] for e in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
