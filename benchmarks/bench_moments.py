"""CPU seconds per GB of the statistics kernel (`converters.stats.moments.Moments`) by dtype (issue 33).

    python benchmarks/bench_moments.py --mb 256 --repeats 5

Normal values (std 0.02, as initialised weights) of float32, bfloat16 and float16, fed to one `Moments` in
blocks of `--block-mb` as a scan's or a conversion's slabs are, in this thread alone; prints the least and
the median thread CPU seconds per GB of the dtype's bytes, with the load average. Run an older tree's kernel
with PYTHONPATH pointing at it to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from converters.stats.moments import Moments


def samples(nbytes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    single = rng.standard_normal(nbytes // 2, dtype=np.float32) * np.float32(0.02)
    return {"float32": single[: nbytes // 4],
            "bfloat16": (single.view(np.uint32) >> 16).astype(np.uint16),  # truncated: bfloat16 bit patterns
            "float16": single.astype(np.float16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="bytes of each dtype's sample, in MiB")
    parser.add_argument("--block-mb", type=int, default=4, help="bytes handed to Moments.add at a time, in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = samples(args.mb << 20)
    print(f"load {os.getloadavg()[0]:.1f}")
    for dtype, values in data.items():
        step = (args.block_mb << 20) // values.itemsize
        runs = []
        for _ in range(args.repeats):
            moments = Moments("x", dtype, values.shape)
            start = time.thread_time()
            for at in range(0, values.size, step):
                moments.add(values[at: at + step])
            runs.append((time.thread_time() - start) / (values.nbytes / 1e9))
        print(f"{dtype:9s} CPU s/GB min {min(runs):.3f} median {statistics.median(runs):.3f}")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
