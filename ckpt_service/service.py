"""The service as a library: submit, read and cancel jobs; register, list and delete checkpoints.

The REST API is a thin layer over this class (it authenticates, then calls one method); so is any
Python caller. Everything a job needs is checked here, before it is queued: storage roots, options
that apply to its kind, options the engine would refuse, and targets that exist or are busy.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from converters import CkptError

from . import roots, sandbox
from .auth import Principal
from .catalog import Catalog, check_owner
from .job_requests import problems
from .jobs import APPLIES, WRITE_TARGET_KINDS, WRITING_KINDS, JobOptions, JobRecord, JobSpec, JobView, request_of
from .registry import CheckpointView, LineageView, RegisterRequest, Registry
from .service_errors import Conflict, Forbidden, InvalidRequest, NotFound
from .settings import Settings
from .store import JobStore

_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")


def request_hash(spec: JobSpec) -> str:
    return hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def _exists(uri: str, field: str) -> bool:
    from converters import storage

    try:
        return storage.exists(uri)
    except (CkptError, OSError, ValueError) as exc:
        raise InvalidRequest(f"{field}: cannot look at {uri} ({type(exc).__name__})", field) from None


def is_option(name: str) -> bool:
    """True when `name` is a job option of some kind (the name an engine error gives it)."""
    from .job_requests import REQUESTS

    return any(name in model.model_fields for model in REQUESTS.values())


#: how many of the newest succeeded scans `CkptService.stats` looks through for a checkpoint's URI
SCANS_PER_QUERY = 500  # URIs whose newest scan one query looks up (SQLite allows 32766 parameters)


class CkptService:
    def __init__(self, settings: Settings, store: JobStore | None = None) -> None:
        self.settings = settings
        self.store = store or JobStore(settings.store_location)
        self.registry = Registry(self.store)
        self.catalog = Catalog(self.store, self.registry, settings.run_pattern)

    # -- jobs --------------------------------------------------------------------------------------

    def normalise(self, spec: JobSpec) -> JobSpec:
        """Check `spec` against the roots and the engine; returns it with source/target normalised."""
        s = self.settings
        spec = spec.model_copy(update={"source": self.catalog.resolve_source(spec.source)})  # alias:RUN/NAME
        stray = sorted(spec.options.model_fields_set - APPLIES[spec.kind])
        if stray:
            raise InvalidRequest(f"options.{stray[0]}: does not apply to {spec.kind} jobs", f"options.{stray[0]}")
        try:
            request = request_of(spec.kind, spec.options)
        except ValidationError as exc:
            field, message = problems(exc, "options.")[0]
            raise InvalidRequest(f"{field}: {message} for {spec.kind} jobs", field) from None
        if not request.takes_target and spec.target is not None:
            raise InvalidRequest(f"target: {spec.kind} jobs take no target", "target")
        if request.takes_target and spec.target is None:
            raise InvalidRequest(f"target: {spec.kind} jobs need a target", "target")
        source = roots.check(spec.source, s.read_locations, field="source", purpose="read")
        target = spec.target
        if target is not None:
            writing = spec.kind in WRITE_TARGET_KINDS  # an output, or an archive store
            target = roots.check(target, s.write_locations if writing else s.read_locations, field="target",
                                 purpose="write" if writing else "read")
            if writing and roots.overlap(source, target):
                raise InvalidRequest("target: the output would overlap the source; write it elsewhere", "target")
        if spec.callback_url is not None:
            s.callback_policy.check_submitted(str(spec.callback_url))
        # the queued spec shows every option of its kind, defaults filled in
        normal = spec.model_copy(update={"source": source, "target": target,
                                         "options": JobOptions(**request.model_dump())})
        from .executor import engine_call

        try:
            engine_call(request, source, target)
        except CkptError as exc:  # the options it names (`option`, `only`) as the request names them
            field = f"options.{exc.option}" if exc.option else "options"
            text = exc.said_as(lambda name: f"options.{name}" if is_option(name) else None)
            raise InvalidRequest(text if exc.option and text != str(exc) else f"{field}: {text}", field) from None
        overwrite = getattr(request, "overwrite", False)
        if spec.kind in WRITING_KINDS and not overwrite and _exists(target or "", "target"):
            raise Conflict(f"target {target} exists; replace it with options.overwrite, or choose another target",
                           field="options.overwrite")
        return normal

    def submit(self, spec: JobSpec, principal: Principal, idempotency_key: str | None = None) -> tuple[JobView, bool]:
        """Queue a job; returns (job, created). A repeated idempotency key returns the first job."""
        idempotency = None
        if idempotency_key is not None:
            if not _IDEMPOTENCY_KEY.match(idempotency_key):
                raise InvalidRequest("Idempotency-Key: 1-200 printable ASCII characters", "Idempotency-Key")
            idempotency = (idempotency_key, request_hash(spec))
            earlier = self._replay(principal, idempotency)
            if earlier is not None:
                return earlier, False
        normal = self.normalise(spec)
        principal.check(normal.source, "read", "source")  # the caller's roots (CKPT_OIDC_GROUP_ROLES)
        if normal.target is not None:
            principal.check(normal.target, "write" if normal.kind in WRITE_TARGET_KINDS else "read", "target")
        if not _exists(normal.source, "source"):  # found now, not when the job runs (rules check their own)
            raise InvalidRequest(f"source: {normal.source} does not exist; check the path or URI", "source")
        for option in ("config_from", "base"):  # an export's side files, a merge's base: read roots
            value = getattr(normal.options, option, None)
            if value is not None:
                roots.check(value, self.settings.read_locations, field=f"options.{option}", purpose="read")
                principal.check(value, "read", f"options.{option}")
        writing = normal.kind in WRITING_KINDS
        record, created = self.store.create_job(
            kind=normal.kind, spec=normal.model_dump(mode="json"), target=normal.target if writing else None,
            callback_url=str(normal.callback_url) if normal.callback_url else None, submitted_by=principal.name,
            max_attempts=self.settings.max_attempts, queue_limit=self.settings.queue_limit, idempotency=idempotency)
        return record.view(), created

    def _replay(self, principal: Principal, idempotency: tuple[str, str]) -> JobView | None:
        """The job an earlier request with this key made (checked before the roots, which may have changed)."""
        rows = self.store.query("SELECT request_hash, job_id FROM idempotency WHERE principal = ? AND key = ?",
                                (principal.name, idempotency[0]))
        if not rows:
            return None
        if rows[0]["request_hash"] != idempotency[1]:
            raise Conflict("Idempotency-Key was already used for a different request; use a new key")
        return self.store.get(rows[0]["job_id"]).view()

    def job(self, job_id: str) -> JobRecord:
        return self.store.get(job_id)

    def jobs(self, state: str | None, kind: str | None, limit: int, cursor: str | None,
             within: list[str] | None = None) -> tuple[list[JobView], str | None, list[str]]:
        """`within`: only jobs under these root URIs (a caller's readable roots; None: all)."""
        before = None
        if cursor is not None:
            if not cursor.isdigit() or len(cursor) > 18:
                raise InvalidRequest("cursor: pass the next_cursor of the previous page", "cursor")
            before = int(cursor)
        records, next_before, unreadable = self.store.list_jobs(state, kind, limit, before, within)
        return [r.view() for r in records], (str(next_before) if next_before is not None else None), unreadable

    def cancel(self, job_id: str, principal: Principal) -> JobView:
        self.owned(self.store.get(job_id), principal, "cancel")
        return self.store.request_cancel(job_id).view()

    @staticmethod
    def owned(job: JobRecord, principal: Principal, action: str) -> None:
        """Changing a job (cancel, retry) is for the token name that submitted it and for admins."""
        if principal.scope != "admin" and job.submitted_by != principal.name:
            raise Forbidden(f"job {job.id} was submitted by {job.submitted_by!r}; only that token or an admin "
                            f"may {action} it")

    # -- checkpoints -------------------------------------------------------------------------------

    def register(self, request: RegisterRequest, owner: str | None = None) -> CheckpointView:
        """Inspect `request.uri` in a sandboxed process and register it, owned by the token name `owner`."""
        uri = roots.check(request.uri, self.settings.read_locations, field="uri", purpose="read")
        view = self.registry.register(request, uri, sandbox.inspect(uri, self.settings, request.source_format),
                                      owner)
        self.catalog.place_registered(view, "register")
        return view

    def checkpoint(self, checkpoint_id: str, tensors: bool = False) -> CheckpointView:
        view = self.registry.get(self.catalog.checkpoint_id(checkpoint_id))  # or a name, NAME@RUN, ALIAS@RUN
        if tensors:
            readable = [*self.settings.read_locations, *self.settings.write_locations]  # outputs are shown too
            uri = roots.check(view.uri, readable, field="uri", purpose="read")
            view.summary = sandbox.inspect(uri, self.settings, tensors=True)
        return view

    def checkpoints(self, name: str | None, tag: str | None, format: str | None, limit: int, cursor: str | None,
                    within: list[str] | None = None, archived: bool = False
                    ) -> tuple[list[CheckpointView], str | None, list[str]]:
        return self.registry.list(name, tag, format, limit, cursor, within, archived)

    def _scans(self, uris: list[str]) -> dict[str, JobRecord]:
        """The newest succeeded `scan` job of each of `uris` (those scanned): one query per SCANS_PER_QUERY URIs
        that picks each URI's newest row in the database, so only those rows' results are decoded."""
        newest: dict[str, JobRecord] = {}
        for start in range(0, len(uris), SCANS_PER_QUERY):
            chunk = uris[start:start + SCANS_PER_QUERY]
            marks = ", ".join("?" * len(chunk))
            rows = self.store.query(
                "SELECT * FROM jobs WHERE seq IN (SELECT MAX(seq) FROM jobs WHERE kind = 'scan' AND state = "
                f"'succeeded' AND json_extract(spec, '$.source') IN ({marks}) GROUP BY json_extract(spec, '$.source'))",
                tuple(chunk))
            for row in rows:
                job = JobRecord.from_row(row)
                if job.result is not None:
                    newest[str(job.spec.get("source"))] = job
        return newest

    def stats(self, checkpoint_id: str) -> dict[str, Any]:
        """A checkpoint's per-tensor statistics: the result of the newest succeeded `scan` job of its URI, with
        that job's id and time."""
        view = self.registry.get(self.catalog.checkpoint_id(checkpoint_id))
        job = self._scans([view.uri]).get(view.uri)
        if job is None or job.result is None:
            raise NotFound(f"checkpoint {checkpoint_id} has no statistics yet; submit a scan job of {view.uri} "
                           "(ckptctl submit scan)")
        return {"checkpoint_id": view.id, "uri": view.uri, "job_id": job.id, "scanned_at": job.finished_at,
                **job.result}

    def run_stats(self, run: str, may_read: Callable[[str], bool] | None = None) -> list[dict[str, Any]]:
        """A run's scanned steps in order, each with its layers' weight norms (the L2 norm of each layer's
        tensors together), the relative change of each norm from the step before, and its NaN/Inf count: what
        the run page plots. Steps without a scan are left out, and those whose URI `may_read` refuses."""
        from converters import layer_of

        steps = [m for m in self.catalog.steps(run) if may_read is None or may_read(m.checkpoint.uri)]
        scans = self._scans(sorted({m.checkpoint.uri for m in steps}))
        points: list[dict[str, Any]] = []
        for managed in steps:
            job = scans.get(managed.checkpoint.uri)
            if job is None or job.result is None or managed.step is None:
                continue
            squares: dict[str, float] = {}
            nonfinite = 0
            for tensor in job.result.get("tensors", []):
                l2 = tensor.get("l2")
                if isinstance(l2, int | float):
                    layer = layer_of(str(tensor["name"]))
                    squares[layer] = squares.get(layer, 0.0) + float(l2) ** 2
                nonfinite += int(tensor.get("nan", 0)) + int(tensor.get("posinf", 0)) + int(tensor.get("neginf", 0))
            norms = {layer: math.sqrt(total) for layer, total in squares.items()}
            before = points[-1]["norms"] if points else {}
            change = {layer: abs(norm - before[layer]) / before[layer] for layer, norm in norms.items()
                      if before.get(layer)}
            points.append({"step": managed.step, "checkpoint_id": managed.checkpoint.id, "job_id": job.id,
                           "nonfinite": nonfinite, "norms": norms, "norm_change": change})
        return points

    def check_scan(self, checkpoint_id: str, require: list[str], blocked: str) -> None:
        """A promotion's guard: Conflict, saying why (`blocked`: what did not happen), unless the checkpoint's
        newest scan holds every bound of `require` (`converters.stats.guards`: finite, max_abs<=100, ...)."""
        from converters import check_bounds, parse_bounds

        bounds = parse_bounds(require)
        try:
            found = self.stats(checkpoint_id)
        except NotFound as exc:
            raise Conflict(f"{blocked}: {exc}") from None
        broken = check_bounds(bounds, found.get("tensors") or [])
        if broken:
            raise Conflict(f"{blocked}: scan {found['job_id']} found {'; '.join(map(str, broken))}")

    def lineage(self, checkpoint_id: str) -> LineageView:
        return self.registry.lineage(self.catalog.checkpoint_id(checkpoint_id))

    def delete(self, checkpoint_id: str, purge: bool = False, principal: Principal | None = None) -> CheckpointView:
        """Unregister (the owner or an admin); with `purge` (admin), delete the data too, through the deletion
        log like GC (only under a write root, and not while a job uses it): the entry then stays, with
        `deleted_at`. `principal` None: an in-process caller."""
        view = self.registry.get(checkpoint_id)
        check_owner(principal, view.owner, f"checkpoint {checkpoint_id}")
        if not purge:
            return self.registry.delete(checkpoint_id)
        uri = roots.check(view.uri, self.settings.write_locations, field="uri", purpose="write")
        busy = self.store.query("SELECT id FROM jobs WHERE state IN ('queued', 'running') AND "
                                "(target = ? OR json_extract(spec, '$.source') = ? OR "
                                "json_extract(spec, '$.target') = ?)", (uri, uri, uri))
        if busy:
            raise Conflict(f"{uri} is used by job {busy[0]['id']}; wait for it or cancel it")
        from .retention import Retention

        Retention(self).purge(checkpoint_id, view.uri, principal.name if principal else "service")
        return self.registry.get(checkpoint_id)
