"""Entry point of a job process: `python -m ckpt_service.worker_main --parent PID … MODE …`, where MODE is

- `job DB JOB_ID ATTEMPT`: run one attempt of a job and record its outcome. DB is the SQLite file, or
  `postgresql` for the URL in $CKPT_DATABASE_URL (kept off the command line);
- `inspect --uri URI`: read a checkpoint's metadata for the API (`sandbox.py`), under an address-space
  limit, and print its summary (or the one-line error) as one JSON document on stdout.

The process runs with a clean sys.path (no working directory on it), asks the kernel to kill it when
its parent (the worker that watches it) dies, lowers its own priority so the API stays responsive,
runs the job and records the outcome itself.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1
#: the DB argument that means: the PostgreSQL URL in $CKPT_DATABASE_URL
FROM_ENV = "postgresql"
URL_ENV = "CKPT_DATABASE_URL"


def clean_sys_path() -> None:
    """Drop the working directory ('' or its path) from sys.path, unless PYTHONPATH names it on purpose.

    The worker starts this process with `python -P` already; this holds for any other way of starting it.
    """
    here = os.path.realpath(os.getcwd())
    wanted = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    sys.path[:] = [p for p in sys.path if p != "" and (os.path.realpath(p) != here or here in wanted)]


def die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the thread that started it exits; elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(4)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="ckpt_service.worker_main")
    top.add_argument("--parent", type=int, default=0)
    top.add_argument("--nice", type=int, default=0)
    top.add_argument("--read-roots", default=None, help="JSON list: check the job's paths again")
    top.add_argument("--write-roots", default=None, help="JSON list")
    top.add_argument("--log-level", default="info")
    top.add_argument("--engine-config", default=None, help="JSON document: the engine config the job runs under "
                     "(default: from the CKPT_* variables)")
    modes = top.add_subparsers(dest="mode", required=True)
    job = modes.add_parser("job")
    job.add_argument("db")
    job.add_argument("job_id")
    job.add_argument("attempt", type=int)
    job.add_argument("--progress-seconds", type=float, default=0.5)
    job.add_argument("--max-bytes-per-second", type=int, default=0)
    look = modes.add_parser("inspect")
    look.add_argument("--uri", required=True)
    look.add_argument("--format", default=None)
    look.add_argument("--tensors", action="store_true", help="add the tensor table")
    look.add_argument("--complete", action="store_true", help="as rules check: every file as long as it should be")
    look.add_argument("--memory-limit", type=int, default=0, help="address-space limit in bytes (0: none)")
    return top


def limit_memory(limit: int) -> None:
    """Cap this process's address space: a hostile file that makes reading it allocate fails here, alone."""
    if limit <= 0:
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def main(argv: list[str] | None = None) -> int:
    clean_sys_path()
    args = parser().parse_args(argv)
    die_with_parent(args.parent)
    if args.nice:
        with contextlib.suppress(OSError):
            os.nice(args.nice)

    from . import logs, roots

    logs.setup(args.log_level)
    from converters import EngineConfig
    from converters import use_config as use

    config = EngineConfig.from_env() if args.engine_config is None else EngineConfig.from_json(args.engine_config)
    allowed = None
    if args.read_roots is not None and args.write_roots is not None:
        read, write = json.loads(args.read_roots), json.loads(args.write_roots)
        allowed = ([roots.parse_root(r) for r in read], [roots.parse_root(r) for r in write])
        # every file the engine opens (members a checkpoint names, symlinks resolved) must lie in a root;
        # the write roots too, since --verify and the registry read outputs back
        config = config.replace(read_roots=tuple(dict.fromkeys([*read, *write])))
    with use(config):
        return _run(args, allowed)


def _run(args: argparse.Namespace, allowed: Any) -> int:
    if args.mode == "inspect":
        from .executor import inspection

        limit_memory(args.memory_limit)
        sys.stdout.buffer.write(inspection(args.uri, args.format, args.tensors, args.complete))
        sys.stdout.buffer.flush()
        return 0
    from .executor import run_job
    from .store import JobStore

    store = JobStore(os.environ.get(URL_ENV, "") if args.db == FROM_ENV else args.db, migrate=False)
    return run_job(store, args.job_id, args.attempt, args.progress_seconds, args.max_bytes_per_second, allowed)


if __name__ == "__main__":
    sys.exit(main())
