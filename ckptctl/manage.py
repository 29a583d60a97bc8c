"""Checkpoint management commands against a server: `checkpoints tag|alias`, `runs`, `aliases`, `rules`,
`policies`, `gc`, `deletions` and `notify`. A checkpoint may be named by id, by name, or as NAME@RUN or
ALIAS@RUN."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from ckpt_service.client import DEFAULT_SERVER, ServiceClient
from ckpt_service.job_kinds import names
from ckpt_service.units import human

from .common import AsJson, app, fail, make_table, out, shown
from .server_commands import Ref, Server, Token, as_uri, checkpoints_app, connect


def get(client: ServiceClient, path: str, **params: Any) -> Any:
    return client._request("GET", path, params={k: v for k, v in params.items() if v is not None})


def send(client: ServiceClient, method: str, path: str, body: Any = None) -> Any:
    return client._request(method, path, json=body, retry=False)


def resolve_ref(client: ServiceClient, ref: str) -> str:
    """The id of the checkpoint `ref` names: an id, a name, NAME@RUN or ALIAS@RUN (the server resolves them)."""
    return str(client.checkpoint(ref)["id"])


def print_managed(client: ServiceClient, checkpoint_id: str) -> None:
    m = client._request("GET", f"/v1/checkpoints/{checkpoint_id}/managed")
    if m["run"] is not None or m["aliases"] or m["rule_id"] or m["deleted_at"]:
        out.print(f"  run {shown(m['run'])}  step {shown(m['step'])}  aliases: {', '.join(m['aliases']) or '-'}"
                  + (f"  made by rule {m['rule_id']}" if m["rule_id"] else "")
                  + (f"  deleted {m['deleted_at']}" if m["deleted_at"] else ""), highlight=False)


def _pairs(items: list[str] | None, what: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not key:
            fail(f"{what} {item!r}: expected KEY=VALUE")
        found[key] = value if sep else ""
    return found


def job_options(items: list[str] | None) -> dict[str, Any]:
    """`--option KEY=VALUE` flags as a job's options, each VALUE read as JSON where it parses (else as the string).
    A KEY given more than once collects its values into one list, a JSON list's items among them (`--option
    require=finite --option 'require=max_abs<=10'`: both bounds), so no flag is silently dropped; the job's request
    model then checks the list like any other value (a repeated single-valued option is refused there)."""
    found: dict[str, list[Any]] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not key or not sep:
            fail(f"--option {item!r}: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        found.setdefault(key, []).append(value)
    options: dict[str, Any] = {}
    for key, values in found.items():
        if len(values) == 1:
            options[key] = values[0]
            continue
        options[key] = [item for value in values for item in (value if isinstance(value, list) else [value])]
    return options


def _emit(data: Any, as_json: bool) -> bool:
    if as_json:
        out.print_json(json.dumps(data))
    return as_json


def call(server: str, token: str | None, method: str, path: str, body: Any = None, *, as_json: bool = False,
         **params: Any) -> Any:
    """One request to the server (`params`: a GET's query); its reply, or None when `as_json` printed it
    (nothing is left to print)."""
    with connect(server, token) as client:
        reply = get(client, path, **params) if method == "GET" else send(client, method, path, body)
    return None if _emit(reply, as_json) else reply


def add(server: str, token: str | None, path: str, body: dict[str, Any], noun: str, as_json: bool) -> None:
    """POST a new named object (a policy, a rule) and say its id."""
    result = call(server, token, "POST", path, body, as_json=as_json)
    if result is not None:
        out.print(f"added {noun} {body['name']} ({result['id']})", highlight=False)


# -- checkpoints tag | alias -----------------------------------------------------------------------

@checkpoints_app.command("tag")
def checkpoints_tag(ref: Ref,
                    tags: Annotated[list[str] | None, typer.Argument(help="KEY=VALUE or KEY (e.g. pin).")] = None,
                    remove: Annotated[list[str] | None, typer.Option("--remove", help="Remove the tag with this "
                                                                     "key (repeatable).")] = None,
                    as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Set key=value tags (replacing the same key) or remove them; `pin` protects from GC."""
    with connect(server, token) as client:
        checkpoint_id = resolve_ref(client, ref)
        result = send(client, "POST", f"/v1/checkpoints/{checkpoint_id}/tags",
                             {"set": _pairs(tags, "tag"), "remove": remove or []})
    if not _emit(result, as_json):
        out.print(f"{checkpoint_id}: {', '.join(result['tags']) or 'no tags'}", highlight=False)


@checkpoints_app.command("alias")
def checkpoints_alias(ref: Ref,
                      name: Annotated[str, typer.Argument(help="The alias, e.g. prod.")],
                      namespace: Annotated[str | None, typer.Option("--run", help="Namespace (default: the "
                                                                    "checkpoint's run).")] = None,
                      require_finite: Annotated[bool, typer.Option("--require-finite", help="Move only when the "
                                                                   "checkpoint's newest scan found no NaN or "
                                                                   "Inf.")] = False,
                      require: Annotated[list[str] | None, typer.Option("--require", metavar="BOUND", help="Move "
                                                                        "only when the checkpoint's newest scan holds "
                                                                        "this bound: finite, or STAT<=LIMIT[:GLOB] / "
                                                                        "STAT>=LIMIT[:GLOB] with STAT max_abs, l2 or "
                                                                        "std (e.g. l2<=1e4:*.weight).")] = None,
                      as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Point an alias at a checkpoint (moves it atomically; its history keeps every move)."""
    with connect(server, token) as client:
        checkpoint_id = resolve_ref(client, ref)
        ns = namespace or get(client, f"/v1/checkpoints/{checkpoint_id}/managed")["run"] or "default"
        result = send(client, "PUT", f"/v1/aliases/{ns}/{name}",
                      {"checkpoint_id": checkpoint_id, **({"require_finite": True} if require_finite else {}),
                       **({"require": require} if require else {})})
    if not _emit(result, as_json):
        out.print(f"{name}@{ns} -> {checkpoint_id} ({result['checkpoint']['uri']})", highlight=False)


# -- runs and aliases ------------------------------------------------------------------------------

runs_app = typer.Typer(help="Training runs and their steps.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")


@runs_app.command("list")
def runs_list(as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Runs with their number of checkpoints and latest step."""
    rows = call(server, token, "GET", "/v1/runs", as_json=as_json)
    if rows is not None:
        table = make_table("run", "checkpoints", "latest step", "latest id")
        for r in rows:
            table.add_row(r["run"], str(r["checkpoints"]), shown(r["latest_step"]), shown(r["latest_id"]))
        out.print(table)


@runs_app.command("show")
def runs_show(run: str, latest: Annotated[bool, typer.Option("--latest", help="Only the latest step.")] = False,
              as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """A run's checkpoints by step (with --latest, the latest step only)."""
    with connect(server, token) as client:
        rows = [get(client, f"/v1/runs/{run}/latest")] if latest else get(client, f"/v1/runs/{run}")
    if not _emit(rows[0] if latest else rows, as_json):
        table = make_table("step", "id", "aliases", "rule", "uri")
        for m in rows:
            table.add_row(shown(m["step"]), m["checkpoint"]["id"], ",".join(m["aliases"]), m["rule_id"] or "",
                          m["checkpoint"]["uri"])
        out.print(table)


@app.command("aliases")
def aliases(history: Annotated[str | None, typer.Option("--history", help="ALIAS@RUN: every move.")] = None,
            namespace: Annotated[str | None, typer.Option("--run")] = None, as_json: AsJson = False,
            server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """List aliases (or one alias's history)."""
    with connect(server, token) as client:
        if history:
            name, _sep, ns = history.partition("@")
            rows = get(client, f"/v1/aliases/{ns or 'default'}/{name}/history")
        else:
            rows = get(client, "/v1/aliases", namespace=namespace)
    if not _emit(rows, as_json):
        for r in rows:
            when = r.get("changed_at") or r.get("updated_at")
            who = r.get("changed_by") or r.get("updated_by")
            out.print(f"{r['name']}@{r['namespace']} -> {r['checkpoint_id']}  ({who}, {when})", highlight=False)


# -- retention and GC ------------------------------------------------------------------------------

policies_app = typer.Typer(help="Retention policies (adding and removing them takes an admin token).",
                           no_args_is_help=True)
app.add_typer(policies_app, name="policies")


@policies_app.command("add")
def policies_add(name: str, run: Annotated[str | None, typer.Option("--run")] = None,
                 prefix: Annotated[str | None, typer.Option("--prefix", help="Or everything under this path.")] = None,
                 applies_to: Annotated[str, typer.Option("--applies-to", help="all, sources or exports.")] = "all",
                 keep_last: Annotated[int | None, typer.Option("--keep-last")] = None,
                 keep_every: Annotated[int | None, typer.Option("--keep-every")] = None,
                 keep_younger_than: Annotated[str | None, typer.Option("--keep-younger-than",
                                                                       help="e.g. 36h or 7d.")] = None,
                 delete_with_outputs: Annotated[bool, typer.Option("--delete-with-outputs")] = False,
                 action: Annotated[str, typer.Option("--action", help="delete, or archive: archive each checkpoint "
                                                     "it does not keep to --store, check it, then delete its "
                                                     "files (restorable).")] = "delete",
                 store: Annotated[str | None, typer.Option("--store", help="With --action archive: the archive "
                                                           "store (a folder or URI).")] = None,
                 as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Add a retention policy for a run or a path prefix."""
    body = {"name": name, "run": run, "prefix": as_uri(prefix) if prefix else None, "applies_to": applies_to,
            "keep_last": keep_last, "keep_every": keep_every, "keep_younger_than": keep_younger_than,
            "delete_with_outputs": delete_with_outputs, "action": action, "store": as_uri(store) if store else None}
    add(server, token, "/v1/policies", body, "policy", as_json)


@policies_app.command("list")
def policies_list(as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """List retention policies with their specs."""
    rows = call(server, token, "GET", "/v1/policies", as_json=as_json)
    if rows is not None:
        for p in rows:
            out.print(f"{p['id']}  {json.dumps(p['spec'])}", highlight=False)


@policies_app.command("remove")
def policies_remove(policy: str, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Remove a retention policy (admin); what it kept is not deleted."""
    with connect(server, token) as client:
        result = send(client, "DELETE", f"/v1/policies/{policy}")
    out.print(f"removed policy {result['spec']['name']}", highlight=False)


@app.command("gc")
def gc(dry_run: Annotated[bool, typer.Option("--dry-run", help="Only print the plan.")] = False,
       as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Delete what the retention policies allow (admin), after printing the plan; --dry-run prints only."""
    with connect(server, token) as client:
        report = send(client, "POST", "/v1/gc", {"dry_run": dry_run})
    if _emit(report, as_json):
        return
    for item in report["plan"]:
        verb = "would delete" if dry_run else "deleted"
        if item.get("action") == "archive":
            verb = ("would archive, then delete" if dry_run else "kept (not archived, see the audit log)"
                    if item["checkpoint_id"] in report.get("not_archived", []) else "archived, then deleted")
        out.print(f"{verb} {item['uri']}  {human(item['bytes'])}  "
                  f"[{item['policy']}] {item['reason']}", highlight=False)
    archived = report.get("archived_bytes") or 0
    out.print(f"{len(report['plan'])} checkpoint(s), {human(report['bytes'])}"
              + (f" ({human(archived)} of it archived first" + ("" if dry_run else
                 f", adding {human(report.get('archive_stored_bytes') or 0)} to the archive stores") + ")"
                 if archived else "")
              + (f"; {len(report['failed'])} left pending (see `ckptctl deletions`)" if report["failed"] else ""),
              highlight=False)


@app.command("deletions")
def deletions(state: Annotated[str | None, typer.Option("--state", help="pending, done or refused.")] = None,
              limit: Annotated[int, typer.Option("--limit")] = 100, as_json: AsJson = False,
              server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """The deletion log: what GC deleted, by which policy, who ran it, when, and how many bytes."""
    rows = call(server, token, "GET", "/v1/deletions", state=state, limit=limit, as_json=as_json)
    if rows is not None:
        table = make_table("when", "state", "uri", "bytes", "policy", "by")
        for d in rows:
            table.add_row(d["planned_at"], d["state"], d["uri"], human(d["bytes"]), d["policy"], d["requested_by"])
        out.print(table)


# -- rules and notify ------------------------------------------------------------------------------

rules_app = typer.Typer(help="Rules that convert new checkpoints as they land.", no_args_is_help=True)
app.add_typer(rules_app, name="rules")


@rules_app.command("add")
def rules_add(name: str, pattern: Annotated[str, typer.Argument(help="e.g. '/data/runs/*/step_*' (quote it).")],
              kind: Annotated[str, typer.Option("--kind", help=f"{', '.join(names(writes=True))}; or scan, scrub "
                                                "(no --target).")],
              target: Annotated[str | None, typer.Option("--target", help="With {run}, {step}, {name}.")] = None,
              option: Annotated[list[str] | None, typer.Option("--option", help="KEY=VALUE job option, e.g. "
                                                               "dtype=bfloat16 (repeatable; JSON values).")] = None,
              latest_only: Annotated[bool, typer.Option("--latest-only")] = False,
              skip_existing: Annotated[bool, typer.Option("--skip-existing/--no-skip-existing")] = True,
              max_concurrent: Annotated[int, typer.Option("--max-concurrent")] = 2,
              every: Annotated[str | None, typer.Option("--every", help="scan/scrub again once the last one is "
                                                        "older than this, e.g. 24h (a scheduled scrub).")] = None,
              as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Add a rule: each new complete checkpoint matching PATTERN gets one job (with --every, one a period)."""
    job = {"kind": kind, "target": as_uri(target) if target else None, "options": job_options(option)}
    body: dict[str, object] = {"name": name, "pattern": as_uri(pattern), "job": job, "latest_only": latest_only,
                               "skip_existing": skip_existing, "max_concurrent": max_concurrent}
    if every is not None:
        body["every"] = every
    add(server, token, "/v1/rules", body, "rule", as_json)


@rules_app.command("list")
def rules_list(as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """List rules: pattern, job, paused or not, and how often each fired."""
    rows = call(server, token, "GET", "/v1/rules", as_json=as_json)
    if rows is not None:
        table = make_table("id", "name", "paused", "pattern", "job", "triggers")
        for r in rows:
            job = r["spec"]["job"]
            table.add_row(r["id"], r["spec"]["name"], str(r["paused"]), r["spec"]["pattern"],
                          f"{job['kind']} -> {job['target']}", json.dumps(r["triggers"]))
        out.print(table)


def _rule_action(method: str, path: str, server: str, token: str | None, done: str) -> None:
    with connect(server, token) as client:
        result = send(client, method, path)
    out.print(f"{done} rule {result['spec']['name']}", highlight=False)


@rules_app.command("remove")
def rules_remove(rule: str, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Remove a rule; the jobs it queued are kept."""
    _rule_action("DELETE", f"/v1/rules/{rule}", server, token, "removed")


@rules_app.command("pause")
def rules_pause(rule: str, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Pause a rule: new checkpoints get no job until it is resumed."""
    _rule_action("POST", f"/v1/rules/{rule}/pause", server, token, "paused")


@rules_app.command("resume")
def rules_resume(rule: str, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Resume a paused rule."""
    _rule_action("POST", f"/v1/rules/{rule}/resume", server, token, "resumed")


@rules_app.command("triggers")
def rules_triggers(rule: str, as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """What a rule fired on, with the job and its outcome."""
    rows = call(server, token, "GET", f"/v1/rules/{rule}/triggers", as_json=as_json)
    if rows is not None:
        for t in rows:
            out.print(f"{t['state']:<10} {t['uri']}  job {t['job_id']}  {t['detail'] or ''}", highlight=False)


@app.command("notify")
def notify(path: str, as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Tell the server a checkpoint finished writing (it registers it and fires matching rules)."""
    result = call(server, token, "POST", "/v1/notify", {"uri": as_uri(path)}, as_json=as_json)
    if result is not None:
        out.print(f"{result['checkpoint_id']} run {result['run']} step {result['step']}: "
                  f"{len(result['triggers'])} rule trigger(s)", highlight=False)
