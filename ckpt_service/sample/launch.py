"""Run a sample :class:`~ckpt_service.sample.train.Job` in spawned gloo processes, staged and retried.

Outputs are written into hidden temporary siblings of their final paths and renamed into place only
once every rank has finished, so a failed or killed run never leaves a half-written output behind.
Success is judged from the files (a per-rank "done" marker written after the last barrier, and the
layout's expected files), not from exit codes: gloo jobs sometimes abort at exit after saving
("terminate called without an active exception"). A run that did not finish is retried once.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch.multiprocessing as mp

from ..helpers import free_port, remove_tree
from ..service_errors import SampleJobError
from .train import Job, worker

JOB_TIMEOUT_S = float(os.environ.get("CKPT_SAMPLE_TIMEOUT_S", "3600"))


def check_free(path: Path) -> None:
    """Refuse to overwrite: ``path`` must not exist, or be an empty folder."""
    if path.is_dir() and not any(path.iterdir()):
        return
    if path.exists() or path.is_symlink():
        raise FileExistsError(f"{path} already exists (and is not an empty folder)")


def staging(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}")


def _spawn(job: Job, timeout_s: float) -> BaseException | None:
    """Run ``job`` in ``world_size`` processes; the first error seen, or None."""
    ctx = mp.start_processes(worker, args=(job,), nprocs=job.world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                return TimeoutError(f"sample job did not finish in {timeout_s:.0f} s")
    except Exception as e:  # ProcessRaisedException / ProcessExitedException: judged by the files
        return e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return None


def _worth_retrying(error: BaseException | None) -> bool:
    """A Python exception raised in a rank is deterministic, unless it is a rendezvous/connection one."""
    if not isinstance(error, mp.ProcessRaisedException):
        return True  # killed by a signal, exit code without traceback, timeout, no error at all
    text = str(error)
    return any(s in text for s in ("Address already in use", "Connection", "DistNetworkError", "timed out"))


def run_staged(
    job: Job,
    finals: dict[str, Path],
    set_paths: Callable[[Job, dict[str, Path]], Job],
    expected: Callable[[dict[str, Path]], list[Path]],
    attempts: int = 2,
) -> None:
    """Run ``job`` so that each of ``finals`` (name -> final path) appears only when the job succeeded.

    ``set_paths(job, staged)`` returns the job pointed at the staging paths (name -> staging path);
    ``expected(staged)`` lists the files that must exist after a successful run.
    """
    for path in finals.values():
        check_free(path)
        path.parent.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for attempt in range(attempts):
        tag = f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staged = {name: staging(path, tag) for name, path in finals.items()}
        with tempfile.TemporaryDirectory(prefix="ckpt-sample-") as done_dir:
            run = replace(set_paths(job, staged), port=free_port(), done_dir=done_dir)
            try:
                error = _spawn(run, JOB_TIMEOUT_S)
                markers = [Path(done_dir, f"rank{r}") for r in range(job.world_size)]
                missing = [p for p in [*markers, *expected(staged)] if not p.exists()]
                if not missing:
                    for name, path in finals.items():
                        if path.is_dir():
                            path.rmdir()  # empty, checked above; os.replace needs it gone for a file
                        os.replace(staged[name], path)
                    return
                errors.append(f"attempt {attempt + 1}: {error}\nmissing: {[str(p) for p in missing][:5]}")
                if not _worth_retrying(error):
                    break
            finally:
                for path in staged.values():
                    remove_tree(path)
    raise SampleJobError("sample job failed:\n" + "\n".join(errors))
