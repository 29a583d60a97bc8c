"""A job process's own output (stdout and stderr), kept per job under the data directory, bounded.

The worker points the process's stdout and stderr at a pipe; `LogCapture` copies what comes through to
`<data_dir>/job-logs/<job id>.log` (each attempt after a header line) and to the worker's own stderr
(where it went before), and keeps the file to the last `LIMIT` bytes. `GET /v1/jobs/{id}/logs` reads it.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from pathlib import Path

LIMIT = 256 * 1024  # bytes of a job's output kept (the newest)
CHUNK = 64 * 1024
DIR = "job-logs"


def log_path(data_dir: Path, job_id: str) -> Path:
    return data_dir / DIR / f"{job_id}.log"


def keep_last(path: Path, limit: int = LIMIT) -> None:
    """Cut the file to its last `limit` bytes (from a line start), by a rename: a reader sees old or new."""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        tail = f.read(limit)
    if len(tail) == limit and b"\n" in tail:
        tail = tail[tail.index(b"\n") + 1:]
    part = path.with_suffix(".part")
    part.write_bytes(tail)
    os.replace(part, path)


def read_tail(data_dir: Path, job_id: str, limit: int = LIMIT) -> tuple[str, bool]:
    """(the last `limit` bytes of the job's output as text, whether older output was left out)."""
    path = log_path(data_dir, job_id)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except FileNotFoundError:
        return "", False
    return data.decode("utf-8", "replace"), size > limit


class LogCapture(threading.Thread):
    """Copies a job process's output from `pipe` to its log file and to this process's stderr."""

    def __init__(self, data_dir: Path, job_id: str, attempt: int, pipe: io.BufferedReader) -> None:
        super().__init__(name=f"log-{job_id}", daemon=True)
        self.path, self.pipe = log_path(data_dir, job_id), pipe
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            f.write(f"--- attempt {attempt} ---\n".encode())

    def run(self) -> None:
        with self.pipe:
            while chunk := self.pipe.read1(CHUNK):
                with self.path.open("ab") as f:
                    f.write(chunk)
                    grown = f.tell() > 2 * LIMIT
                if grown:
                    keep_last(self.path)
                with contextlib.suppress(OSError, ValueError):  # the worker's own stderr may be gone
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()
        keep_last(self.path)
