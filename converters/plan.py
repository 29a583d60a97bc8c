"""A conversion plan: the output files a conversion writes, each an independent, serialisable `Part`.

A writer plans first (index -> output layout -> per output file: which source byte ranges it reads and
where they go), then an executor runs the parts: `run_local` in threads, as one process always did, or
`converters.ray_executor` as Ray tasks across a cluster. A part writes exactly one file of the temporary
target and returns what the driver needs to finish (`Part.run` -> `extra`). Only the driver, after every
part is done and checked, writes the files that describe the whole (index, `.metadata`, manifest) via
`Plan.finish`, and the output commits.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import storage
from .checksum import crc32
from .config import EXECUTORS, ContextPool, current
from .copier import Copier
from .errors import OptionError
from .output import Output


def greedy_groups(items: list[Any], limit: int) -> list[list[Any]]:
    """Consecutive items in groups of at most `limit` bytes (`item.nbytes`): a new group starts when the next
    item would overflow the current one; an item larger than `limit` is a group of its own."""
    groups: list[list[Any]] = [[]]
    size = 0
    for item in items:
        if groups[-1] and size + item.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    return groups



class Part(Protocol):
    """One output file: `name` ('' for a single-file target) and the tensor bytes it moves."""

    name: str

    @property
    def nbytes(self) -> int: ...

    def run(self, out: Output, copier: Copier, pool: ThreadPoolExecutor | None) -> Any:
        """Write the file into `out` (reading the source through `copier`); return the part's extra result."""


@dataclass
class PartResult:
    """What a part's run reports back: the file it wrote, its size and CRC-32, where it ran."""

    name: str
    size: int
    crc32: int | None
    extra: Any = None
    node: str = ""
    seconds: float = 0.0  # how long the part took to write (a Ray task's own timing)


@dataclass
class Plan:
    """`parts` in output order; `parallel`: the local executor runs parts side by side (small files, each
    written sequentially) rather than one after the other with their tensors side by side (large files)."""

    kind: str
    parts: list[Any]
    parallel: bool = False
    results: list[PartResult] = field(default_factory=list)

    def finish(self, out: Output, extras: list[Any]) -> None:
        """Write what describes the whole output (driver only, after every part succeeded)."""


@dataclass
class Execution:
    """Which executor runs a plan: `local`, or `ray` at `address` (`ray://host:10001`, `auto`, or a GCS
    address); `None` fields come from the engine config (`current()`: executor, ray_address); an address alone
    means Ray."""

    executor: str | None = None
    address: str | None = None

    def resolve(self) -> Execution:
        config = current()
        executor = self.executor or config.executor
        if self.address and not self.executor:
            executor = "ray"
        if executor not in EXECUTORS:
            raise OptionError(f"executor {executor}: choose local or ray")
        address = self.address or config.ray_address
        return Execution(executor, address if executor == "ray" else None)


def file_crc(out: Output, name: str, size: int, block: int = 8 << 20) -> int:
    """CRC-32 of a local output file, read back through a small buffer."""
    crc = 0
    buf = bytearray(min(block, max(size, 1)))
    view = memoryview(buf)
    with open(out.path(name), "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(view)
            if not n:
                return crc
            crc = crc32(view[:n], crc)


def run_part(part: Any, out: Output, copier: Copier, pool: ThreadPoolExecutor | None,
             checksum: bool = False) -> PartResult:
    """Run one part; report its file's size (and CRC-32 with `checksum`, or whenever the output computed it)."""
    started = time.perf_counter()
    extra = part.run(out, copier, pool)
    key = part.name or storage.basename(out.uri)
    info = out.files[key]
    crc = info.get("crc32")
    if crc is None and checksum:
        crc = file_crc(out, part.name, info["bytes"])
    return PartResult(part.name, info["bytes"], crc, extra, seconds=time.perf_counter() - started)


def run_local(plan: Plan, out: Output, copier: Copier) -> list[PartResult]:
    """Run the parts in this process, in threads, as the writers always did."""
    if plan.parallel:
        with ContextPool(max(1, min(copier.threads, len(plan.parts))), thread_name_prefix="ckpt-part") as pool:
            return list(pool.map(lambda part: run_part(part, out, copier, None), plan.parts))
    with ContextPool(copier.threads, thread_name_prefix="ckpt-write") as pool:
        return [run_part(part, out, copier, pool) for part in plan.parts]


def execute(plan: Plan, out: Output, copier: Copier, execution: Execution | None = None) -> list[PartResult]:
    """Run every part of `plan` with the chosen executor, then let the driver finish the output."""
    execution = (execution or Execution()).resolve()
    if execution.executor == "ray":
        from .ray_executor import run_ray

        results = run_ray(plan, out, copier, execution.address or "auto")
    else:
        results = run_local(plan, out, copier)
    plan.results = results
    plan.finish(out, [r.extra for r in results])
    return results
