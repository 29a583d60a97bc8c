"""The floor of the merged-adapter export (issue 32) on this machine: what its parts cost alone, each in a fresh
process, against the plain export's kernel copy.

    python benchmarks/merge_floor.py WORK [--repeats 3]

WORK holds `base/` (an HF folder, one safetensors file) and `adapter/` (its PEFT LoRA), as
benchmarks/merge_adapter.py makes them (`--keep`). Parts, each timed (wall and CPU seconds, user + system) in its
own process, interleaved, medians:

- `import-torch`: `python -c "import torch"` (the merged export imports it; the plain export does not);
- `copy`: `copy_file_range` of the base file into a new file (the plain export's work, less its start-up);
- `gemm-1t`, `gemm-2w`: every LoRA Linear's `(B @ A) * scaling` in the export's row slabs (2 MiB), in one
  thread, and in two worker threads side by side (torch at one intra-op thread each), as the export runs them;
- `rw-in-place`: read back, add a delta to and overwrite in place every merged weight's bytes in a file the
  kernel copied first (what the export does after the GEMMs, without them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

SLAB = 2 << 20  # the export's row slab: memory_limit (256 MiB) / 128


def _times() -> tuple[float, float]:
    t = os.times()
    return time.perf_counter(), t.user + t.system


def _lora_weights(work: Path) -> list[tuple[int, int, list[int], str]]:
    """(start, end, shape, name) of each base weight the adapter targets, in the base file."""
    path = next((work / "base").glob("*.safetensors"))
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    config = json.loads((work / "adapter" / "adapter_config.json").read_text())
    targets = config["target_modules"]
    targets = targets if isinstance(targets, list) else []
    found = []
    for name, info in header.items():
        if name == "__metadata__" or not name.endswith(".weight") or len(info["shape"]) != 2:
            continue
        module = name.rsplit(".", 2)[-2]
        if module in targets or (not targets and module.endswith("proj")):
            found.append((8 + n + info["data_offsets"][0], 8 + n + info["data_offsets"][1], info["shape"], name))
    return found


def part(name: str, work: Path) -> dict[str, float]:
    """Run one part in this process; its wall and CPU seconds."""
    base = next((work / "base").glob("*.safetensors"))
    out = work / "floor.out"
    if name == "copy":
        src = os.open(base, os.O_RDONLY)
        dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        size, at = os.fstat(src).st_size, 0
        w0, c0 = _times()
        while at < size:
            at += os.copy_file_range(src, dst, min(1 << 30, size - at), at, at)
        w1, c1 = _times()
        os.close(dst)
        os.close(src)
        out.unlink()
        return {"wall_s": w1 - w0, "cpu_s": c1 - c0}
    import torch

    rank = json.loads((work / "adapter" / "adapter_config.json").read_text())["r"]
    weights = _lora_weights(work)
    if name.startswith("gemm"):
        from concurrent.futures import ThreadPoolExecutor

        torch.manual_seed(0)
        jobs = []
        for _, _, (rows, cols), _ in weights:
            a, b = torch.randn(rank, cols), torch.randn(rows, rank)
            step = max(4, SLAB // (cols * 4))
            jobs += [(a, b[start: start + step].clone()) for start in range(0, rows, step)]
        local = threading.local()  # each thread's reused product buffer, as the export's workspaces

        def one(job: tuple[torch.Tensor, torch.Tensor]) -> None:
            a, b = job
            if not hasattr(local, "buf"):
                torch.set_num_threads(1)
                local.buf = torch.empty(SLAB // 4 + 4 * a.shape[1])
            product = local.buf[: b.shape[0] * a.shape[1]].view(b.shape[0], a.shape[1])
            torch.matmul(b, a, out=product)
            product.mul_(2.0)

        w0, c0 = _times()
        if name == "gemm-1t":
            for job in jobs:
                one(job)
        else:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(one, jobs))
        w1, c1 = _times()
        return {"wall_s": w1 - w0, "cpu_s": c1 - c0,
                "gflop": sum(2 * r * c * rank for _, _, (r, c), _ in weights) / 1e9}
    if name == "rw-in-place":
        src = os.open(base, os.O_RDONLY)
        dst = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        size, at = os.fstat(src).st_size, 0
        while at < size:  # the copy the export makes first (not timed)
            at += os.copy_file_range(src, dst, min(1 << 30, size - at), at, at)
        buf = torch.empty(SLAB // 4)
        delta = torch.full((SLAB // 4,), 1e-3)
        view = buf.view(torch.uint8).numpy().data.cast("B")
        w0, c0 = _times()
        for start, end, _, _ in weights:
            for off in range(start, end, SLAB):
                n = min(SLAB, end - off)
                os.preadv(dst, [view[:n]], off)
                buf[: n // 4].add_(delta[: n // 4])
                os.pwrite(dst, view[:n], off)
        w1, c1 = _times()
        os.close(dst)
        os.close(src)
        out.unlink()
        return {"wall_s": w1 - w0, "cpu_s": c1 - c0, "gb": sum(e - s for s, e, _, _ in weights) / 1e9}
    raise ValueError(name)


def fresh(name: str, work: Path) -> dict[str, float]:
    """One part in a fresh process (import-torch: the whole process, measured from outside)."""
    if name == "import-torch":
        w0 = time.perf_counter()
        c0 = os.times()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        c1 = os.times()
        return {"wall_s": time.perf_counter() - w0,
                "cpu_s": (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)}
    got = subprocess.run([sys.executable, __file__, str(work), "--part", name], check=True, capture_output=True,
                         text=True)
    return json.loads(got.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        print(json.dumps(part(args.part, args.work)))
        return 0
    names = ["import-torch", "copy", "gemm-1t", "gemm-2w", "rw-in-place"]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    loads = []
    for _ in range(args.repeats):
        for name in names:
            os.sync()
            for path in [*(args.work / "base").iterdir(), *(args.work / "adapter").iterdir()]:  # warm page cache
                with open(path, "rb") as fh:
                    while fh.read(1 << 24):
                        pass
            runs[name].append(fresh(name, args.work))
            loads.append(os.getloadavg()[0])
    print(f"{os.cpu_count()} cores, load {min(loads):.1f}-{max(loads):.1f}, medians of {args.repeats}")
    for name, results in runs.items():
        wall = statistics.median(r["wall_s"] for r in results)
        cpu = statistics.median(r["cpu_s"] for r in results)
        extra = {k: v for k, v in results[0].items() if k not in ("wall_s", "cpu_s")}
        each = [round(r["cpu_s"], 2) for r in results]
        print(f"{name:<13} wall {wall:6.2f} s  CPU {cpu:6.2f} s  (CPU runs {each}) {extra or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
