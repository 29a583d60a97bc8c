"""Reading a checkpoint for the API process, in a job process of its own.

The API process never parses checkpoint contents: registering a checkpoint, its tensor table, `POST /v1/notify`
and rule discovery call `inspect`, which runs `python -m ckpt_service.worker_main … inspect --uri URI`, the
process jobs run in (started the same way: clean sys.path, dies with the thread that started it, lower
priority, every read confined to the storage roots, symlinks resolved), here with a time limit and an
address-space limit, and returns the summary it prints. The API only stores that result.

A checkpoint that cannot be read, takes longer than `INSPECT_SECONDS` or needs more than `INSPECT_MEMORY`
is an `InvalidRequest` naming it in one line; nothing the checkpoint holds is quoted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from typing import Any

from .service_errors import InvalidRequest, TooMany
from .settings import Settings
from .worker import kill_group, process_command, process_env

#: Longest one inspection may take, and the address space its process may use.
INSPECT_SECONDS = 120.0
INSPECT_MEMORY = 4 * 1024**3
#: Inspections running at once in this process; more wait (up to INSPECT_SECONDS) for a slot.
INSPECT_PARALLEL = 4
_slots = threading.BoundedSemaphore(INSPECT_PARALLEL)


def inspect(uri: str, settings: Settings, source_format: str | None = None, tensors: bool = False,
            complete: bool = False) -> dict[str, Any]:
    """The summary of the checkpoint at `uri` (checked against the roots by the caller), read in a job process.

    `tensors` adds the tensor table; `complete` reads as rules do (no unfinished upload, every file as long
    as the metadata says)."""
    args = [f"--uri={uri}", f"--memory-limit={INSPECT_MEMORY}"]
    args += [f"--format={source_format}"] if source_format else []
    args += ["--tensors"] if tensors else []
    args += ["--complete"] if complete else []
    if not _slots.acquire(timeout=INSPECT_SECONDS):
        raise TooMany(f"{INSPECT_PARALLEL} checkpoints are being read for other requests; try again shortly")
    try:
        code, out = _run(process_command(settings, "inspect", *args), process_env(settings))
    finally:
        _slots.release()
    if code is None:
        raise InvalidRequest(f"{uri}: reading its metadata took longer than {INSPECT_SECONDS:g} s; the checkpoint "
                             "is damaged or too large to inspect", "uri")
    return _result(uri, code, out)


def _run(command: list[str], env: dict[str, str]) -> tuple[int | None, bytes]:
    """(exit status, stdout) of the inspecting process; (None, b"") when it ran out of time (it is killed)."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True,
                            env=env)
    try:
        out, _ = proc.communicate(timeout=INSPECT_SECONDS)
    except subprocess.TimeoutExpired:
        return None, b""
    finally:
        kill_group(proc)
        if proc.stdout is not None:
            proc.stdout.close()
    return proc.returncode, out


def _result(uri: str, code: int, out: bytes) -> dict[str, Any]:
    try:
        document = json.loads(out.decode()) if code == 0 else None
    except ValueError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("summary"), dict):
        return document["summary"]
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        raise InvalidRequest(str(document["error"].get("message", "")), "uri")
    how = (f"was killed by {signal.Signals(-code).name}" if -code in signal.Signals._value2member_map_
           else f"exited with status {code}")
    raise InvalidRequest(f"{uri}: the process reading its metadata {how}; the checkpoint is damaged or needs more "
                         f"than {INSPECT_MEMORY // 1024**3} GiB to inspect", "uri")
