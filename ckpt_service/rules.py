"""Rules: convert new checkpoints as they land.

A rule is a source pattern (`/data/runs/*/step_*` or `s3://bucket/runs/*/step_*`; `*`, `?` and `[…]`
match within one path segment), a job template (kind, options, and a target with `{run}`, `{step}` and
`{name}`), and options: only the latest step of each run, skip when the target exists, at most N of its
jobs queued or running at once.

Discovery (polling every `discover_seconds`, or `POST /v1/notify` for one path) registers each new
checkpoint once it is *complete*: no unfinished-upload marker, and the engine's own index loads with
every file at least as long as the metadata says (a DCP `.metadata` is written last; our
`ckpt-manifest.json` lists each file's size; a DeepSpeed folder names its tag in `latest`). A half-written
checkpoint fails that check and is looked at again on the next poll.

Each (rule, checkpoint) pair fires at most once: the trigger row's primary key is claimed with
`INSERT … ON CONFLICT DO NOTHING` before the job is submitted, and the job is submitted with an
idempotency key derived from the pair, so a claim left behind by a crash is finished by the next scan
(on any replica) without a second job. Outputs get the source's run and step and link to the rule.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import defaultdict
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from converters import CkptError, ContextThread

from . import logs, roots, sandbox
from .audit import AuditLog
from .auth import Principal
from .catalog import NAME, check_owner, when
from .job_kinds import kind_of
from .jobs import KINDS, WRITE_TARGET_KINDS, WRITING_KINDS, JobOptions, JobSpec
from .service_errors import Conflict, InvalidRequest, NotFound, ServiceError
from .store import new_id
from .units import DURATION

if TYPE_CHECKING:
    from .service import CkptService

STALE_CLAIM_SECONDS = 300.0
HELD_BACK_SECONDS = 2.0  # with polling off: how often checkpoints held back by max_concurrent are retried
MAX_SKIPPED = 100  # candidates shown per rule as left by its last look
PERIODIC_CHECK_SECONDS = 30.0  # how often a rule with `every` looks for checkpoints that are due
_GLOB = set("*?[")


#: the kinds a rule may run: those that write an output or archive the checkpoint (`job_kinds`), in declaration order
#: (not restore: its source is an archive store, not the checkpoint a rule found)
TEMPLATE_KINDS = tuple(k for k in KINDS if k in WRITE_TARGET_KINDS and kind_of(k).store != "source")
#: kinds that read the checkpoint and write nothing (no target): a rule runs them once per checkpoint, or again
#: every `every` seconds (a scheduled scrub)
CHECK_KINDS = tuple(k for k in ("scan", "scrub") if k in KINDS)
if TYPE_CHECKING:
    TemplateKind = str  # declared at run time, like `jobs.Kind`
else:
    TemplateKind = Literal[TEMPLATE_KINDS + CHECK_KINDS]


class JobTemplate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: TemplateKind
    target: str | None = Field(None, min_length=1, max_length=4096, description="With {run}, {step} and {name} "
                               "(the source's last path segment), e.g. s3://bucket/exports/{run}/{step}. Omitted "
                               f"for {' and '.join(CHECK_KINDS)}, which write nothing.")
    options: JobOptions = Field(default_factory=JobOptions)

    @model_validator(mode="after")
    def _target(self) -> JobTemplate:
        if self.kind in CHECK_KINDS and self.target is not None:
            raise ValueError(f"a {self.kind} job writes nothing: leave out target")
        if self.kind not in CHECK_KINDS and self.target is None:
            raise ValueError(f"a {self.kind} job needs a target, e.g. s3://bucket/exports/{{run}}/{{step}}")
        return self


class RuleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME.pattern)
    pattern: str = Field(min_length=1, max_length=4096, description="Checkpoints to convert: a path or URI glob.")
    job: JobTemplate
    latest_only: bool = Field(False, description="Only the newest complete step of each run; older new ones are "
                              "recorded as superseded.")
    skip_existing: bool = Field(True, description="Skip (and record) a checkpoint whose target exists.")
    max_concurrent: int = Field(2, ge=1, le=1000, description="This rule's jobs queued or running at once.")
    every: Annotated[float | None, DURATION] = Field(
        None, ge=1, le=366 * 86400, description="Run the job again on each registered checkpoint the pattern matches "
        "(outputs too) once its last job of this kind is older than this (seconds, or 90m, 24h, 7d): a scheduled "
        f"scrub. Only for {' and '.join(CHECK_KINDS)}.")

    @model_validator(mode="after")
    def _periodic(self) -> RuleSpec:
        if self.every is not None and self.job.kind not in CHECK_KINDS:
            raise ValueError(f"every: only {' and '.join(CHECK_KINDS)} jobs repeat (a {self.job.kind} would "
                             "write its target again)")
        return self


class RuleView(BaseModel):
    id: str
    spec: RuleSpec
    paused: bool
    created_by: str
    created_at: datetime
    triggers: dict[str, int] = Field(default_factory=dict, description="Trigger counts by state.")
    skipped: dict[str, str] = Field(default_factory=dict, description="Candidates the last look of this server's "
                                    f"discovery left, and why: not complete yet, unreadable or refused (first "
                                    f"{MAX_SKIPPED}).")
    last_error: str | None = Field(None, description="What stopped this rule's last discovery pass, if anything.")


class TriggerView(BaseModel):
    rule_id: str
    uri: str
    checkpoint_id: str | None
    state: Literal["claimed", "submitted", "done", "job_failed", "skipped", "superseded", "failed"]
    job_id: str | None
    detail: str | None
    claimed_at: datetime


class NotifyResult(BaseModel):
    uri: str
    checkpoint_id: str
    run: str | None
    step: int | None
    triggers: list[TriggerView]


def trigger_key(rule_id: str, uri: str) -> str:
    """The idempotency key of the job a rule submits for a checkpoint (the same on every replica and retry)."""
    return "rule-" + hashlib.sha256(f"{rule_id}\n{uri}".encode()).hexdigest()[:40]


def render(template: str, run: str | None, step: int | None, uri: str) -> str:
    for key, value in (("{run}", run), ("{step}", step)):
        if key in template and value is None:
            raise InvalidRequest(f"job.target: {uri} has no {key[1:-1]} (see CKPT_RUN_PATTERN)", "job.target")
        template = template.replace(key, str(value))
    return template.replace("{name}", uri.rstrip("/").rsplit("/", 1)[-1])


def matches(pattern: str, uri: str) -> bool:
    a, b = pattern.rstrip("/").split("/"), uri.rstrip("/").split("/")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(y, x) for x, y in zip(a, b))


def expand(pattern: str) -> list[str]:
    """The paths or URIs a pattern matches now (hidden names, such as temporary outputs, left out)."""
    from converters import storage

    if storage.is_local(pattern):
        found = glob.glob(storage.local_path(pattern))
    else:
        fs, path = storage.filesystem(pattern)
        scheme = pattern.split("://", 1)[0]
        fs.invalidate_cache()
        found = [f"{scheme}://{p}" for p in fs.glob(path.split("://", 1)[-1])]
    return sorted(p for p in found if not p.rstrip("/").rsplit("/", 1)[-1].startswith("."))


class Rules:
    def __init__(self, service: CkptService) -> None:
        self.service = service
        self.store = service.store
        self._scan_lock = threading.Lock()
        #: per rule: the candidates its last look left (uri -> why), and what stopped its last pass
        self._skipped: dict[str, dict[str, str]] = {}
        self._failed: dict[str, str] = {}
        self._periodic_at: dict[str, float] = {}  # per rule with `every`: when it last looked (monotonic)

    # -- managing rules ----------------------------------------------------------------------------

    def add(self, spec: RuleSpec, by: str) -> RuleView:
        s = self.service.settings
        fixed = _fixed_part(spec.pattern)
        pattern = roots.check(fixed, s.read_locations, field="pattern", purpose="read").rstrip("/")
        spec = spec.model_copy(update={"pattern": pattern + spec.pattern[len(fixed.rstrip("/")):]})
        probe = None if spec.job.target is None else render(spec.job.target, "run", 1, "name")
        if probe is not None:
            roots.check(probe, s.write_locations, field="job.target", purpose="write")
            parts = probe.rstrip("/").split("/")
            if (any(matches(spec.pattern, "/".join(parts[:i])) for i in range(1, len(parts) + 1))
                    or roots.parse(probe, resolve=False).contains(roots.parse(fixed, resolve=False))):
                raise InvalidRequest("job.target: outputs would land where the pattern looks; write them elsewhere",
                                     "job.target")
        example = re.sub(r"\[[^\]/]*\]|[*?]", "x", spec.pattern)  # a path the pattern would match
        writes = probe is not None and spec.job.kind in WRITING_KINDS  # an archive store takes no overwrite
        options = spec.job.options.model_copy(update={"overwrite": True}) if writes else spec.job.options
        self.service.normalise(JobSpec(kind=spec.job.kind, source=example, target=probe, options=options,
                                       callback_url=None))
        rule_id, now = new_id("rule"), time.time()
        with self.store.transaction() as conn:
            if conn.execute("SELECT 1 FROM rules WHERE name = ?", (spec.name,)).fetchone():
                raise Conflict(f"a rule named {spec.name} exists; remove it first or choose another name")
            conn.execute("INSERT INTO rules (id, name, spec, paused, created_by, created_at) VALUES (?, ?, ?, 0, ?, ?)",
                         (rule_id, spec.name, spec.model_dump_json(exclude_unset=True), by, now))
        return self.get(rule_id)

    def get(self, rule_id: str) -> RuleView:
        rows = self.store.query("SELECT * FROM rules WHERE id = ? OR name = ?", (rule_id, rule_id))
        if not rows:
            raise NotFound(f"no rule {rule_id}")
        return self._view(rows[0])

    def _view(self, row: Any) -> RuleView:
        counts = {r["state"]: r["n"] for r in self.store.query(
            "SELECT state, COUNT(*) AS n FROM rule_triggers WHERE rule_id = ? GROUP BY state", (row["id"],))}
        return RuleView(id=row["id"], spec=RuleSpec.model_validate_json(row["spec"]), paused=bool(row["paused"]),
                        created_by=row["created_by"], created_at=when(row["created_at"]),
                        triggers=counts, skipped=self._skipped.get(row["id"], {}),
                        last_error=self._failed.get(row["id"]))

    def all(self) -> list[RuleView]:
        return [self._view(r) for r in self.store.query("SELECT * FROM rules ORDER BY name")]

    def remove(self, rule_id: str, principal: Principal | None = None) -> RuleView:
        view = self.get(rule_id)
        check_owner(principal, view.created_by, f"rule {view.spec.name}")
        with self.store.transaction() as conn:
            conn.execute("DELETE FROM rules WHERE id = ?", (view.id,))
        return view

    def pause(self, rule_id: str, paused: bool, principal: Principal | None = None) -> RuleView:
        view = self.get(rule_id)
        check_owner(principal, view.created_by, f"rule {view.spec.name}")
        with self.store.transaction() as conn:
            conn.execute("UPDATE rules SET paused = ? WHERE id = ?", (int(paused), view.id))
        return self.get(view.id)

    def triggers(self, rule_id: str) -> list[TriggerView]:
        view = self.get(rule_id)
        self.link_outputs()
        return [_trigger(r) for r in self.store.query(
            "SELECT * FROM rule_triggers WHERE rule_id = ? ORDER BY claimed_at, uri", (view.id,))]

    # -- discovery ---------------------------------------------------------------------------------

    def complete(self, uri: str) -> tuple[dict[str, Any] | None, str]:
        """(summary, "") for a complete checkpoint; (None, why not) for anything else. Read in a job process."""
        try:
            return sandbox.inspect(uri, self.service.settings, complete=True), ""
        except CkptError as exc:
            return None, str(exc)[:300]

    def _registered(self, uri: str, summary_of: Any, by: str) -> tuple[str, str | None, int | None] | None:
        """(checkpoint id, run, step) of a complete checkpoint, registering it first if it is new; None while
        it is incomplete or after GC deleted it."""
        registry, catalog = self.service.registry, self.service.catalog
        rows = self.store.query("SELECT c.id, r.run, r.step, r.deleted_at FROM checkpoints c LEFT JOIN "
                                "checkpoint_runs r ON r.checkpoint_id = c.id WHERE c.uri = ?", (uri,))
        if rows:
            row = rows[0]
            return None if row["deleted_at"] is not None else (row["id"], row["run"], row["step"])
        summary, why = summary_of(uri)
        if summary is None:
            logs.event("rules.incomplete", uri=uri, reason=why, level=logging.DEBUG)
            return None
        run, step = catalog.derive(uri)
        with self.store.transaction() as conn:
            if conn.execute("SELECT 1 FROM checkpoints WHERE uri = ?", (uri,)).fetchone():
                return self._registered(uri, summary_of, by)  # another replica registered it meanwhile
            checkpoint_id = registry.add(conn, uri=uri, name=uri.rstrip("/").rsplit("/", 1)[-1], summary=summary,
                                         tags=[], metadata={}, via=_via(by))
            catalog.place(conn, checkpoint_id, run, step, by)
        logs.event("rules.discovered", uri=uri, checkpoint_id=checkpoint_id, run=run, step=step)
        return checkpoint_id, run, step

    def scan(self, by: str = "discovery", look: bool = True) -> int:
        """One pass over every active rule; returns the number of jobs submitted. It fires on registered
        checkpoints the rule matches and has not fired on (e.g. held back by max_concurrent) and, with `look`,
        on new complete checkpoints its pattern finds. A rule that fails is logged and shown on the rule
        (`last_error`); the others go on."""
        with self._scan_lock:
            self.link_outputs()
            submitted = 0
            for row in self.store.query("SELECT * FROM rules WHERE paused = 0 ORDER BY name"):
                try:
                    submitted += self._scan_rule(row["id"], RuleSpec.model_validate_json(row["spec"]), by, look)
                    self._failed.pop(row["id"], None)
                except Exception as exc:  # one rule never stops the others
                    self._failed[row["id"]] = _one_line(exc)
                    logs.event("rules.scan_failed", rule=row["name"], error=_one_line(exc),
                               exc_info=not isinstance(exc, CkptError))
            return submitted

    def _scan_rule(self, rule_id: str, spec: RuleSpec, by: str, look: bool) -> int:
        if spec.every is not None:
            return self._scan_periodic(rule_id, spec)
        seen = {r["uri"]: r for r in self.store.query(
            "SELECT uri, state, claimed_at FROM rule_triggers WHERE rule_id = ?", (rule_id,))}
        registered = [r["uri"] for r in self.store.query(
            "SELECT c.uri FROM checkpoints c LEFT JOIN checkpoint_runs r ON r.checkpoint_id = c.id "
            "WHERE c.made_by_job IS NULL AND r.deleted_at IS NULL") if matches(spec.pattern, r["uri"])]
        candidates = sorted(set(registered) | set(expand(spec.pattern) if look else ()))
        fresh, skipped = self._candidates(spec, candidates, seen, by)
        if look:
            self._skipped[rule_id] = dict(list(skipped.items())[:MAX_SKIPPED])
        stale = [u for u, r in seen.items() if r["state"] == "claimed"
                 and r["claimed_at"] < time.time() - STALE_CLAIM_SECONDS]
        if spec.latest_only:
            fresh = self._supersede(rule_id, fresh)
        fresh.sort(key=lambda f: (f[2] or "", f[3] if f[3] is not None else -1, f[0]))
        submitted = 0
        for uri in stale:
            submitted += self._fire(rule_id, spec, uri, reclaim=True)
        for uri, checkpoint_id, _, _ in fresh:
            if self._active(rule_id) >= spec.max_concurrent:
                break  # the rest waits for the next scan
            submitted += self._fire(rule_id, spec, uri, checkpoint_id=checkpoint_id)
        return submitted

    def _scan_periodic(self, rule_id: str, spec: RuleSpec) -> int:
        """A rule with `every` (a scheduled scrub): fire on each registered checkpoint the pattern matches (outputs
        too) whose newest job of the rule's kind, by anyone, was made or finished more than `every` ago, none
        being queued or running. The trigger row is claimed again only once a period has passed since its last
        claim (an upsert whose WHERE says so), so replicas fire once per period; its job's idempotency key
        names the claim."""
        every = spec.every or 0.0
        if time.monotonic() - self._periodic_at.get(rule_id, -math.inf) < min(PERIODIC_CHECK_SECONDS, every):
            return 0
        self._periodic_at[rule_id] = time.monotonic()
        now = time.time()
        due = now - every
        last = {r["uri"]: r for r in self.store.query(
            "SELECT json_extract(spec, '$.source') AS uri, MAX(COALESCE(finished_at, created_at)) AS at, "
            "SUM(CASE WHEN state IN ('queued', 'running') THEN 1 ELSE 0 END) AS active FROM jobs WHERE kind = ? "
            "GROUP BY json_extract(spec, '$.source')", (spec.job.kind,))}
        rows = self.store.query("SELECT c.id, c.uri FROM checkpoints c LEFT JOIN checkpoint_runs r ON "
                                "r.checkpoint_id = c.id WHERE r.deleted_at IS NULL ORDER BY c.uri")
        submitted = 0
        for row in rows:
            uri, before = row["uri"], last.get(row["uri"])
            if not matches(spec.pattern, uri) or (before is not None and (before["active"] or before["at"] >= due)):
                continue
            if self._active(rule_id) >= spec.max_concurrent:
                break  # the rest waits for the next look
            with self.store.transaction() as conn:
                cur = conn.execute(
                    "INSERT INTO rule_triggers (rule_id, uri, checkpoint_id, state, claimed_at) VALUES "
                    "(?, ?, ?, 'claimed', ?) ON CONFLICT (rule_id, uri) DO UPDATE SET state = 'claimed', "
                    "job_id = NULL, detail = NULL, claimed_at = excluded.claimed_at WHERE rule_triggers.claimed_at < ?",
                    (rule_id, uri, row["id"], now, due))
            if cur.rowcount == 1:
                submitted += self._submit_claimed(rule_id, spec, uri, row["id"], f"{uri}\n{now!r}")
        return submitted

    def _candidates(self, spec: RuleSpec, uris: list[str], seen: dict[str, Any], by: str
                    ) -> tuple[list[tuple[str, str, str | None, int | None]], dict[str, str]]:
        """(the complete checkpoints among `uris` the rule has not fired on, registered now if new; the others
        and why). Each is handled on its own: one that cannot be read or breaks is logged and left."""
        fresh: list[tuple[str, str, str | None, int | None]] = []
        skipped: dict[str, str] = {}

        def summary_of(uri: str) -> tuple[dict[str, Any] | None, str]:
            summary, why = self.complete(uri)
            if summary is None:
                skipped[uri] = why
            return summary, why

        for uri in uris:
            if uri in seen:
                continue
            try:
                uri = roots.check(uri, self.service.settings.read_locations, field="source", purpose="read")
                found = self._registered(uri, summary_of, by)
            except Exception as exc:  # e.g. a symlink out of the roots; the others go on
                skipped[uri] = _one_line(exc)
                logs.event("rules.candidate_failed", rule=spec.name, uri=uri, error=skipped[uri],
                           exc_info=not isinstance(exc, CkptError))
                continue
            if found is not None:
                fresh.append((uri, *found))
        return fresh, skipped

    def _supersede(self, rule_id: str, fresh: list[tuple[str, str, str | None, int | None]]
                   ) -> list[tuple[str, str, str | None, int | None]]:
        """latest_only: keep the newest fresh step per run (if nothing newer fired already); record the rest."""
        newest: dict[str | None, int] = defaultdict(lambda: -1)
        for r in self.store.query("SELECT r.run, MAX(r.step) AS step FROM rule_triggers t JOIN checkpoint_runs r ON "
                                  "r.checkpoint_id = t.checkpoint_id WHERE t.rule_id = ? AND t.state <> 'superseded' "
                                  "GROUP BY r.run", (rule_id,)):
            newest[r["run"]] = r["step"] if r["step"] is not None else -1
        best: dict[str | None, tuple[str, str, str | None, int | None]] = {}
        for f in fresh:
            if f[2] is None or f[3] is None:
                best[f[0]] = f  # no run or step: nothing to compare with
            elif f[3] > newest[f[2]] and (f[2] not in best or f[3] > (best[f[2]][3] or -1)):
                best[f[2]] = f
        keep = set(best.values())
        now = time.time()
        with self.store.transaction() as conn:
            for f in fresh:
                if f not in keep:
                    conn.execute("INSERT INTO rule_triggers (rule_id, uri, checkpoint_id, state, detail, claimed_at) "
                                 "VALUES (?, ?, ?, 'superseded', 'a newer step of the run came first', ?) "
                                 "ON CONFLICT (rule_id, uri) DO NOTHING", (rule_id, f[0], f[1], now))
        return [f for f in fresh if f in keep]

    def _active(self, rule_id: str) -> int:
        row = self.store.query("SELECT COUNT(*) AS n FROM rule_triggers t LEFT JOIN jobs j ON j.id = t.job_id "
                               "WHERE t.rule_id = ? AND (t.state = 'claimed' OR (t.state = 'submitted' AND "
                               "j.state IN ('queued', 'running')))", (rule_id,))
        return int(row[0]["n"])

    def _fire(self, rule_id: str, spec: RuleSpec, uri: str, checkpoint_id: str | None = None,
              reclaim: bool = False) -> int:
        """Claim (rule, uri) and submit its job; 1 when a job was submitted by this call."""
        now = time.time()
        with self.store.transaction() as conn:
            if reclaim:
                cur = conn.execute("UPDATE rule_triggers SET claimed_at = ? WHERE rule_id = ? AND uri = ? AND "
                                   "state = 'claimed' AND claimed_at < ?",
                                   (now, rule_id, uri, now - STALE_CLAIM_SECONDS))
                row = conn.execute("SELECT checkpoint_id FROM rule_triggers WHERE rule_id = ? AND uri = ?",
                                   (rule_id, uri)).fetchone()
                checkpoint_id = row["checkpoint_id"] if row else None
            else:
                cur = conn.execute("INSERT INTO rule_triggers (rule_id, uri, checkpoint_id, state, claimed_at) "
                                   "VALUES (?, ?, ?, 'claimed', ?) ON CONFLICT (rule_id, uri) DO NOTHING",
                                   (rule_id, uri, checkpoint_id, now))
        if cur.rowcount != 1:
            return 0  # another scan (another replica) has it
        return self._submit_claimed(rule_id, spec, uri, checkpoint_id, uri)

    def _submit_claimed(self, rule_id: str, spec: RuleSpec, uri: str, checkpoint_id: str | None, key: str) -> int:
        """Submit the job of a trigger this process claimed and record the outcome; 1 when a job was submitted.
        `key` makes its idempotency key (the uri; with `every`, the uri and the time of the claim)."""
        state, job_id, detail = self._submit(rule_id, spec, uri, checkpoint_id, key)
        with self.store.transaction() as conn:
            conn.execute("UPDATE rule_triggers SET state = ?, job_id = ?, detail = ? WHERE rule_id = ? AND uri = ?",
                         (state, job_id, detail, rule_id, uri))
        logs.event("rules.fired", rule=spec.name, uri=uri, state=state, job_id=job_id, detail=detail)
        return int(state == "submitted")

    def _submit(self, rule_id: str, spec: RuleSpec, uri: str, checkpoint_id: str | None, key: str
                ) -> tuple[str, str | None, str | None]:
        from converters import storage

        row = self.store.query("SELECT run, step FROM checkpoint_runs WHERE checkpoint_id = ?", (checkpoint_id,))
        run, step = (row[0]["run"], row[0]["step"]) if row else (None, None)
        try:
            target = None if spec.job.target is None else render(spec.job.target, run, step, uri)
            if target is not None and spec.skip_existing and spec.job.kind in WRITING_KINDS \
                    and storage.exists(target):  # a store is shared
                return "skipped", None, f"target {target} exists"
            job = JobSpec(kind=spec.job.kind, source=uri, target=target, options=spec.job.options, callback_url=None)
            view, created = self.service.submit(job, Principal(f"rule:{spec.name}", "write"),
                                                idempotency_key=trigger_key(rule_id, key))
        except (ServiceError, CkptError, OSError) as exc:
            return "failed", None, str(exc)[:500]
        if created:
            AuditLog(self.store).record(f"rule:{spec.name}", "job.submit", f"job:{view.id}",
                                        after=view.model_dump(mode="json"))
        return "submitted", view.id, None

    def link_outputs(self) -> None:
        """Give finished rule jobs' outputs their source's run and step and the rule's id (lineage)."""
        rows = self.store.query(
            "SELECT t.rule_id, t.uri, t.checkpoint_id, j.state, j.result, j.error_message FROM rule_triggers t "
            "JOIN jobs j ON j.id = t.job_id WHERE t.state = 'submitted' AND j.state IN "
            "('succeeded', 'failed', 'cancelled')")
        for r in rows:
            output = (json.loads(r["result"]) if r["result"] else {}).get("checkpoint_id")
            with self.store.transaction() as conn:
                if r["state"] == "succeeded":  # a scan or scrub has no output
                    if output:
                        source = conn.execute("SELECT run, step FROM checkpoint_runs WHERE checkpoint_id = ?",
                                              (r["checkpoint_id"],)).fetchone()
                        self.service.catalog.place(conn, output, source["run"] if source else None,
                                                   source["step"] if source else None, "rule", rule_id=r["rule_id"])
                    conn.execute("UPDATE rule_triggers SET state = 'done', detail = ? WHERE rule_id = ? AND uri = ?",
                                 (output, r["rule_id"], r["uri"]))
                else:
                    conn.execute("UPDATE rule_triggers SET state = 'job_failed', detail = ? WHERE rule_id = ? AND "
                                 "uri = ?", ((r["error_message"] or r["state"])[:500], r["rule_id"], r["uri"]))

    def notify(self, uri: str, by: str) -> NotifyResult:
        """A pipeline says `uri` is finished: register it if complete and fire the rules whose pattern matches."""
        uri = roots.check(uri, self.service.settings.read_locations, field="uri", purpose="read")
        reasons: list[str] = []

        def summary_of(u: str) -> tuple[dict[str, Any] | None, str]:
            summary, why = self.complete(u)
            reasons.append(why)
            return summary, why

        found = self._registered(uri, summary_of, by)
        if found is None:
            why = reasons[-1] if reasons else "it was deleted by garbage collection"
            raise Conflict(f"{uri} is not a complete checkpoint ({why}); notify again once it is written")
        checkpoint_id, run, step = found
        fired: list[TriggerView] = []
        with self._scan_lock:
            self.link_outputs()
            for row in self.store.query("SELECT * FROM rules WHERE paused = 0 ORDER BY name"):
                spec = RuleSpec.model_validate_json(row["spec"])
                if not matches(spec.pattern, uri):
                    continue
                entry = (uri, checkpoint_id, run, step)
                if (not spec.latest_only or self._supersede(row["id"], [entry])) \
                        and self._active(row["id"]) < spec.max_concurrent:
                    self._fire(row["id"], spec, uri, checkpoint_id=checkpoint_id)
                fired.extend(_trigger(t) for t in self.store.query(
                    "SELECT * FROM rule_triggers WHERE rule_id = ? AND uri = ?", (row["id"], uri)))
        return NotifyResult(uri=uri, checkpoint_id=checkpoint_id, run=run, step=step, triggers=fired)


def _one_line(exc: BaseException) -> str:
    """An error as one short line (its class when it has no message of ours)."""
    text = " ".join(str(exc).split()) if isinstance(exc, CkptError) else ""
    return (text or f"{type(exc).__name__} (see the log)")[:300]


def _via(by: str) -> dict[str, str]:
    """How discovery (`by` = "discovery") or a push from a token (`by` = its name) registered a checkpoint."""
    return {"how": "discovered"} if by == "discovery" else {"how": "notified", "by": by}


def _fixed_part(pattern: str) -> str:
    """The pattern up to its first segment with a glob character (what the roots check looks at)."""
    head, rest = (pattern.split("://", 1)[0] + "://", pattern.split("://", 1)[1]) if "://" in pattern else ("", pattern)
    fixed = []
    for segment in rest.split("/"):
        if _GLOB & set(segment):
            break
        fixed.append(segment)
    return head + "/".join(fixed)


def _trigger(row: Any) -> TriggerView:
    return TriggerView(rule_id=row["rule_id"], uri=row["uri"], checkpoint_id=row["checkpoint_id"], state=row["state"],
                       job_id=row["job_id"], detail=row["detail"], claimed_at=when(row["claimed_at"]))


class Scheduler(ContextThread):
    """Discovery every `discover_seconds` (0: pushes only, and what max_concurrent held back is retried every
    HELD_BACK_SECONDS) and GC every `gc_seconds` (0: off), inside the API process (under the engine config in
    force where it was made: the service's confinement)."""

    def __init__(self, rules: Rules, retention: Any, discover_seconds: float, gc_seconds: float) -> None:
        super().__init__(name="ckpt-manage", daemon=True)
        self.rules, self.retention = rules, retention
        self.discover_seconds, self.gc_seconds = discover_seconds, gc_seconds
        self.stopping = threading.Event()

    def run(self) -> None:
        next_scan = next_gc = time.monotonic()
        if self.gc_seconds:
            next_gc += self.gc_seconds
        while not self.stopping.is_set():
            now = time.monotonic()
            try:
                if now >= next_scan:  # without polling, still fire what max_concurrent held back after pushes
                    next_scan = now + (self.discover_seconds or HELD_BACK_SECONDS)
                    self.rules.scan(look=bool(self.discover_seconds))
                if self.gc_seconds and now >= next_gc:
                    next_gc = now + self.gc_seconds
                    self.retention.run(dry_run=False, by="scheduler")
            except Exception:
                logs.event("manage.loop_error", exc_info=True)
            self.stopping.wait(0.2)

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)
