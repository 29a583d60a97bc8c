"""Run a conversion plan's parts as Ray tasks across a cluster (imported only when the executor is `ray`).

Parts are grouped into tasks that each move at most `EngineConfig.ray_part_bytes` (CKPT_RAY_PART_BYTES,
default 1 GiB; a single larger part is its own task), scheduled with SPREAD so that bandwidth adds up across nodes, each
asking Ray for `memory_limit` bytes of memory and running its copier within that same limit. Tasks write
into the temporary target (a shared filesystem path, or the object-storage prefix) and return each file's
size and CRC-32; the driver checks every size against the file itself before it finishes the output.
A task that fails on a lost worker or node, or on an I/O error, is retried by Ray up to `max_retries`
times; anything else fails the conversion, and every task still running is cancelled (forced) and
waited for, so that nothing writes into the temporary target after the output removed it.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from . import storage
from .config import EngineConfig, current, use
from .copier import Copier, Progress
from .errors import CkptError, TargetError
from .output import Output
from .plan import PartResult, Plan, greedy_groups, run_part

MAX_RETRIES = 3
POLL_SECONDS = 0.1
REPORT_SECONDS = 0.5
CANCEL_WAIT = 30.0


@dataclass
class Target:
    """The temporary target as a task sees it (serialisable; no open files)."""

    uri: str
    root: str
    single_file: bool

    def output(self) -> Output:
        out = Output(self.uri, self.single_file)
        out.root = self.root
        return out


def batches(parts: list[Any], part_bytes: int) -> list[list[Any]]:
    """Group consecutive parts into tasks of at most `part_bytes` (a larger part is a task of its own)."""
    return greedy_groups(parts, part_bytes)


class _Reporter:
    """A task's progress callback: sends byte and tensor deltas to the driver's sink, at most twice a second."""

    def __init__(self, sink: Any, run: str) -> None:
        self.sink, self.run, self.sent, self.last = sink, run, (0, 0), 0.0

    def __call__(self, progress: Progress, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < REPORT_SECONDS:
            return
        done = (progress.done_bytes, progress.done_tensors)
        delta = (done[0] - self.sent[0], done[1] - self.sent[1])
        if delta != (0, 0):
            self.sink.add.remote(self.run, *delta)
        self.sent, self.last = done, now


def run_batch(target: Target, parts: list[Any], memory_limit: int, threads: int, config: EngineConfig,
              sink: Any, run: str) -> list[PartResult]:
    """The Ray task: run `parts` into `target` under the driver's engine config; return each file's size,
    CRC-32 and this node's id. Its reads are confined by the config's read roots, as the driver's are."""
    with use(config):
        return _run_batch(target, parts, memory_limit, threads, sink, run)


def _run_batch(target: Target, parts: list[Any], memory_limit: int, threads: int, sink: Any,
               run: str) -> list[PartResult]:
    import ray

    out = target.output()
    reporter = _Reporter(sink, run)
    reader = storage.RangeReader()
    try:
        copier = Copier(reader, memory_limit, Progress(callback=reporter), threads=threads)
        results = [run_part(part, out, copier, None, checksum=True) for part in parts]
        reporter(copier.progress, force=True)
    finally:
        reader.close()
    node = ray.get_runtime_context().get_node_id()
    for result in results:
        result.node = node
    return results


def _connect(address: str) -> Any:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)  # type: ignore[arg-type]  # ray takes level names too
    return ray


_sink: Any = None


def _progress_sink(ray: Any) -> Any:
    """This driver's progress actor, next to the driver (started once: an actor takes a worker process to
    start, longer than a small conversion runs). Every run counts under its own id."""
    from ray.exceptions import RayError

    global _sink
    if _sink is not None:
        try:
            ray.get(_sink.get.remote(""), timeout=10)
            return _sink
        except RayError:
            _sink = None  # its node is gone: start another

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class ProgressSink:
        """Sums the progress every task of a run reports; the driver polls it."""

        def __init__(self) -> None:
            self.runs: dict[str, list[int]] = {}

        def add(self, run: str, nbytes: int, tensors: int) -> None:
            done = self.runs.setdefault(run, [0, 0])
            done[0] += nbytes
            done[1] += tensors

        def get(self, run: str) -> tuple[int, int]:
            done = self.runs.get(run, [0, 0])
            return done[0], done[1]

        def drop(self, run: str) -> None:
            self.runs.pop(run, None)

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    _sink = ProgressSink.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]  # added by @ray.remote
    return _sink


def _update(progress: Progress, done: tuple[int, int]) -> None:
    """Move the job's progress up to what the tasks report (retries may report bytes twice: clamp)."""
    nbytes = min(done[0], progress.total_bytes) - progress.done_bytes
    tensors = min(done[1], progress.total_tensors) - progress.done_tensors
    if nbytes > 0 or tensors > 0:
        progress.add(max(nbytes, 0), max(tensors, 0))


def _cancel(ray: Any, refs: list[Any]) -> None:
    for ref in refs:
        with contextlib.suppress(Exception):  # already finished, or its worker is gone: nothing left to stop
            ray.cancel(ref, force=True)
    ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT)


def _check(results: list[PartResult], out: Output) -> None:
    """Every file a task reports must exist with the size it reports (a task on a node that did not
    see the same filesystem would otherwise commit an output with holes)."""
    for result in results:
        path = out.path(result.name) if out.local else (storage.join(out.root, result.name) if result.name and not
                                                          out.single_file else out.root)
        try:
            size = os.path.getsize(path) if out.local else storage.size(path)
        except (OSError, CkptError):
            size = -1
        if size != result.size:
            raise TargetError(f"{path}: a Ray task reported {result.size} bytes written but the target holds "
                              f"{size if size >= 0 else 'no such file'}; every node must write to the same "
                              "target (a shared filesystem or object storage)")
        out.record(result.name, result.size, result.crc32)


def run_ray(plan: Plan, out: Output, copier: Copier, address: str) -> list[PartResult]:
    """Run `plan`'s parts as Ray tasks and return their results in plan order."""
    ray = _connect(address)
    from ray.exceptions import RayError, RayTaskError

    memory_limit = copier.memory_limit
    config = current()
    task = ray.remote(run_batch).options(num_cpus=1, memory=memory_limit, scheduling_strategy="SPREAD",
                                         max_retries=MAX_RETRIES, retry_exceptions=[OSError])
    sink, run = _progress_sink(ray), uuid.uuid4().hex  # if the sink is lost, progress stops, not the job
    target = Target(out.uri, out.root, out.single_file)
    # the task carries the driver's config (with its read roots): a worker runs under it, not under its own
    refs = [task.remote(target, group, memory_limit, copier.threads, config, sink, run)
            for group in batches(plan.parts, config.ray_part_bytes)]
    try:
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            with contextlib.suppress(RayError):
                _update(copier.progress, ray.get(sink.get.remote(run), timeout=POLL_SECONDS * 4))
        try:
            results = [result for group in ray.get(refs) for result in group]
        except RayTaskError as exc:
            cause = exc.cause
            raise (cause if isinstance(cause, CkptError | OSError) else exc) from None
    except BaseException:
        _cancel(ray, refs)
        raise
    finally:
        sink.drop.remote(run)
    _check(results, out)
    _update(copier.progress, (copier.progress.total_bytes, copier.progress.total_tensors))
    return results
