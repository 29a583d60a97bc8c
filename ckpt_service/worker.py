"""Workers: claim queued jobs from the store and run each in its own OS process.

`WorkerPool` has N job slots. Its scheduler thread claims jobs while slots are free, requeues the jobs
of dead workers (lease expired, or a worker process on this host that no longer exists) after
cleaning their targets, and hands due callbacks to senders. Each claimed job gets a `JobRunner`
thread that starts `python -m ckpt_service.worker_main`, heartbeats the lease, and stops the process
when the job is cancelled or the lease was lost. A job process that dies without recording an
outcome is retried (up to the job's `max_attempts`) or failed with the reason.

`ckptctl serve` runs a pool inside the API server; `ckptctl worker` runs one alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

from . import joblogs, logs, webhooks, worker_main
from .executor import clean_target
from .jobs import JobRecord
from .service_errors import ServiceError
from .settings import Settings
from .store import JobStore

KILL_WAIT = 10.0


def describe_exit(pid: int, code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        hint = " (out of memory, or killed by an operator)" if -code == signal.SIGKILL else ""
        return f"job process {pid} was killed by {name}{hint}"
    return f"job process {pid} exited with status {code} without recording a result"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def confine(settings: Settings) -> None:
    """Confine this service process's reads (API, scheduler, worker) to its read and write roots, as its
    job processes are: defence in depth, since they leave reading checkpoints to job processes. Call it from
    the process's main thread before the server starts: the engine config it installs reaches the API's
    requests (asyncio tasks and their worker threads copy the context) and the threads made from it."""
    from converters import install_config as install

    install(settings.engine_config())  # its read roots: the read and write roots


def process_command(settings: Settings, mode: str, *args: str) -> list[str]:
    """The command line of a job process (`worker_main MODE ARGS…`): a job, or an inspection (sandbox.py).

    -P: the working directory is not put on sys.path (nothing a checkpoint names can import from it)."""
    s = settings
    return [sys.executable, "-P", "-m", "ckpt_service.worker_main", "--parent", str(os.getpid()), "--nice",
            str(s.job_nice), "--read-roots", json.dumps([str(r) for r in s.read_locations]),
            "--write-roots", json.dumps([str(r) for r in s.write_locations]), "--log-level", s.log_level,
            "--engine-config", s.engine_config().to_json(), mode, *args]


def process_env(settings: Settings) -> dict[str, str]:
    """The environment of a job process; a PostgreSQL URL travels here, not on the command line. The engine's
    settings do not: they travel as one document (`--engine-config`, `Settings.engine_config`)."""
    url = settings.database_url
    return {**os.environ, "PYTHONSAFEPATH": "1", **({worker_main.URL_ENV: url} if url else {})}


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a job process and everything it started (its own session), and reap it."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_WAIT)


class JobRunner(threading.Thread):
    """Runs and watches one attempt of one job. Lives as long as the job process (see PR_SET_PDEATHSIG)."""

    def __init__(self, pool: WorkerPool, job: JobRecord) -> None:
        super().__init__(name=f"job-{job.id}", daemon=True)
        self.pool, self.job, self.attempt = pool, job, job.attempt
        self.releasing = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        s = self.pool.settings
        # a PostgreSQL URL (it may hold a password) goes through the environment, not the command line
        store = worker_main.FROM_ENV if s.database_url else str(s.db_path)
        return process_command(s, "job", store, self.job.id, str(self.attempt), "--progress-seconds",
                               str(s.progress_seconds), "--max-bytes-per-second", str(s.job_max_bytes_per_second))

    def run(self) -> None:
        from converters import use_config as use

        try:
            with use(self.pool.engine):  # cleaning a target reads and lists under the service's confinement
                self._run()
        except Exception:
            logs.event("job.runner_error", job_id=self.job.id, attempt=self.attempt, exc_info=True)
            self._kill()
        finally:
            self.pool.runner_done(self)

    def _run(self) -> None:
        store, s, job = self.pool.store, self.pool.settings, self.job
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=process_env(s))
        assert isinstance(self.proc.stdout, io.BufferedReader)  # stdout=PIPE, buffered
        joblogs.LogCapture(s.data_dir, job.id, self.attempt, self.proc.stdout).start()
        store.set_pid(job.id, self.attempt, self.proc.pid)
        logs.event("job.process_started", job_id=job.id, attempt=self.attempt, pid=self.proc.pid,
                   worker=self.pool.id)
        why = None
        while why is None:
            try:
                self.proc.wait(timeout=s.heartbeat_seconds)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.releasing.is_set():
                why = "release"
                break
            try:
                owned, cancel = store.heartbeat(job.id, self.pool.id, self.attempt, s.lease_seconds)
            except ServiceError:
                logs.event("job.heartbeat_failed", job_id=job.id, exc_info=True)
                continue
            if not owned and self.proc.poll() is None and not self._ended_by_job():
                why = "lost"
            elif owned and cancel:
                why = "cancel"
            elif not owned:
                break  # the job process recorded its outcome and is exiting
        if why is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=KILL_WAIT)  # it has recorded its outcome; let it exit
        self._kill()
        self._settle(why)

    def _ended_by_job(self) -> bool:
        current = self.pool.store.get(self.job.id)
        return current.attempt == self.attempt and current.terminal

    def _settle(self, why: str | None) -> None:
        store, job = self.pool.store, self.job
        target, overwrite = job.target, bool(job.spec.get("options", {}).get("overwrite"))
        if why == "lost":
            logs.event("job.lease_lost", job_id=job.id, attempt=self.attempt)
            return
        current = store.get(job.id)
        if current.state != "running" or current.attempt != self.attempt:
            return  # the job process recorded its outcome
        # From here the job is still running under this attempt and its process is gone, so nobody else
        # can claim it or write its target: cleaning is safe.
        if why == "release" and not current.cancel_requested:
            clean_target(target, overwrite)
            if store.release(job.id, self.attempt):
                logs.event("job.released", job_id=job.id, attempt=self.attempt)
                return
        if why == "cancel" or current.cancel_requested:
            removed = clean_target(target, overwrite)
            if store.finish_now(job.id, self.attempt, "cancelled"):
                logs.event("job.cancelled", job_id=job.id, attempt=self.attempt, removed=removed)
            return
        if self.proc is None:
            raise RuntimeError(f"job {job.id}: settling an attempt whose process never started")
        reason = describe_exit(self.proc.pid, self.proc.returncode)
        removed = clean_target(target, overwrite)
        state = store.requeue_or_fail(job.id, self.attempt, reason)
        logs.event("job.process_died", job_id=job.id, attempt=self.attempt, reason=reason, now=state, removed=removed)

    def _kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)


class WorkerPool:
    """N job slots over one store. `start()`/`stop()` for a server; `run_until(event)` for `ckptctl worker`."""

    def __init__(self, settings: Settings, store: JobStore | None = None, slots: int | None = None) -> None:
        self.settings = settings
        self.store = store or JobStore(settings.store_location)
        self.slots = settings.workers if slots is None else slots
        self.host = socket.gethostname()
        self.id = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._runners: dict[str, JobRunner] = {}
        self._thread: threading.Thread | None = None
        self.engine = settings.engine_config()  # what this pool's threads run under (storage calls in them)

    # -- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self.store.register_worker(self.id, self.host, os.getpid(), self.slots)
        self._thread = threading.Thread(target=self._loop, name="ckpt-scheduler", daemon=True)
        self._thread.start()
        logs.event("worker.started", worker=self.id, slots=self.slots)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop claiming; put running jobs back in the queue (their processes are stopped, targets cleaned)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            runners = list(self._runners.values())
        for runner in runners:
            runner.releasing.set()
        deadline = time.monotonic() + timeout
        for runner in runners:
            runner.join(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ServiceError):
            self.store.remove_worker(self.id)
        logs.event("worker.stopped", worker=self.id, released=len(runners))

    def run_until(self, stop: threading.Event) -> None:
        self.start()
        try:
            while not stop.wait(1.0):
                if not self.alive():
                    raise RuntimeError("the scheduler thread died; see the log")
        finally:
            self.stop()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def busy(self) -> int:
        with self._lock:
            return len(self._runners)

    def runner_done(self, runner: JobRunner) -> None:
        with self._lock:
            self._runners.pop(runner.job.id, None)

    # -- the scheduler loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        from converters import use_config as use

        with use(self.engine):
            self._schedule()

    def _schedule(self) -> None:
        s = self.settings
        next_chores = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_chores:
                    next_chores = time.monotonic() + s.heartbeat_seconds
                    self.store.touch_worker(self.id)
                    self.reap()
                    webhooks.deliver_due(self.store, self.id, s.callback_timeout, s.callback_attempts,
                                          s.callback_policy)
                self.fill_slots()
            except ServiceError:
                logs.event("worker.store_error", worker=self.id, exc_info=True)
            except Exception:
                logs.event("worker.loop_error", worker=self.id, exc_info=True)
            self._stop.wait(s.poll_seconds)

    def fill_slots(self) -> None:
        while not self._stop.is_set() and self.busy() < self.slots:
            job = self.store.claim(self.id, self.settings.lease_seconds)
            if job is None:
                return
            logs.event("job.claimed", job_id=job.id, attempt=job.attempt, worker=self.id)
            runner = JobRunner(self, job)
            with self._lock:
                self._runners[job.id] = runner
            runner.start()

    def dead_reason(self, job: JobRecord, now: float) -> str | None:
        """Why the worker running `job` counts as dead, or None while it is alive."""
        if job.worker == self.id:  # reap() and fill_slots() share the scheduler thread: no race here
            with self._lock:
                return None if job.id in self._runners else "left running by this worker without a job process"
        host, _, rest = (job.worker or "").partition(":")
        pid = rest.split(":", 1)[0]
        if host == self.host and pid.isdigit() and not pid_alive(int(pid)):
            return f"worker {job.worker} is gone (process {pid} no longer exists)"
        if job.lease_until is not None and job.lease_until < now:
            return f"worker {job.worker} stopped heartbeating (lease expired)"
        return None

    def reap(self) -> None:
        now = time.time()
        for job in self.store.running():
            reason = self.dead_reason(job, now)
            if reason is None or not self.store.take_over(job.id, job.attempt, job.worker or "", self.id,
                                                          self.settings.lease_seconds):
                continue  # alive, or another worker reaped it first
            removed = clean_target(job.target, bool(job.spec.get("options", {}).get("overwrite")))
            state = self.store.requeue_or_fail(job.id, job.attempt, reason)
            if state is not None:
                logs.event("job.worker_lost", job_id=job.id, attempt=job.attempt, reason=reason, now=state,
                           removed=removed)
