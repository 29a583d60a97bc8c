"""Client commands: `ckptctl submit KIND …` (the offline flags, run on a server), `jobs`, `status`, `cancel`,
`checkpoints list|show|register|lineage|delete`, against `--server` / CKPT_SERVER with CKPT_TOKEN.

A command moves from local to remote by adding `submit`: `ckptctl export A B --dtype bfloat16` becomes
`ckptctl submit export A B --dtype bfloat16`. Local paths are made absolute before they are sent.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from ckpt_service.client import DEFAULT_SERVER, ServiceClient
from ckpt_service.job_kinds import kinds, names
from ckpt_service.job_requests import JobRequest
from ckpt_service.service_errors import DIFFERENT, ClientError, exit_code
from ckpt_service.units import human

from .common import AsJson, From, Quiet, app, err, fail, in_cli_words, make_table, out, shown
from .flags import job_command, keyword

Server = Annotated[str, typer.Option("--server", envvar="CKPT_SERVER", help="Service URL.")]
Token = Annotated[str | None, typer.Option("--token", envvar="CKPT_TOKEN", show_default=False,
                                           help="Bearer token (prefer the CKPT_TOKEN variable).")]
Wait = Annotated[bool, typer.Option("--wait", help="Follow the job until it ends; exit 1 unless it succeeds.")]
Callback = Annotated[str | None, typer.Option("--callback-url", help="POSTed the final job document.")]
Ref = Annotated[str, typer.Argument(metavar="CHECKPOINT", help="Checkpoint id, name, NAME@RUN or ALIAS@RUN.")]
IdemKey = Annotated[str | None, typer.Option("--idempotency-key", help="Resubmitting with the same key returns "
                                             "the same job (default: a fresh key per command).")]


@contextmanager
def connect(server: str, token: str | None) -> Iterator[ServiceClient]:
    client = ServiceClient(server, token)
    try:
        yield client
    except ClientError as exc:
        if exc.status == 401:  # the server's words are about the header; here the token is a variable or a flag
            fail(f"{exc.message.partition(':')[0]}: set CKPT_TOKEN or pass --token (a token comes from `ckptctl "
                 "token create`) (HTTP 401)", exit_code(exc))
        fail(in_cli_words(exc), exit_code(exc))
    finally:
        client.close()


def as_uri(path: str) -> str:
    """Local paths made absolute; URIs and registry aliases (`alias:RUN/NAME`) as given."""
    return path if "://" in path or path.startswith("alias:") else os.path.abspath(os.path.expanduser(path))


def print_job(job: dict[str, Any]) -> None:
    spec = job["spec"]
    arrow = f" -> {spec['target']}" if spec.get("target") else ""
    out.print(f"{job['id']}  {job['kind']}  {job['state']}  attempt {job['attempt']}/{job['max_attempts']}",
              highlight=False)
    out.print(f"  {spec['source']}{arrow}", highlight=False)
    progress = job.get("progress") or {}
    if progress.get("total_bytes"):
        rate = progress.get("throughput_bytes_per_s")
        eta = progress.get("eta_seconds")
        out.print(f"  progress: {human(progress['done_bytes'])} of {human(progress['total_bytes'])}, "
                  f"{progress['done_tensors']}/{progress['total_tensors']} tensors"
                  + (f", {human(rate)}/s" if rate else "") + (f", ETA {eta:.0f} s" if eta else ""), highlight=False)
    if job.get("error"):
        out.print(f"  error: {job['error']['type']}: {job['error']['message']}", highlight=False)
    result = job.get("result") or {}
    if job["state"] == "succeeded" and "outputs" in result:
        out.print(f"  wrote {len(result['outputs'])} file(s), {human(result.get('total_bytes', 0))}"
                  + (f"; registered as {result['checkpoint_id']}" if result.get("checkpoint_id") else ""),
                  highlight=False)
    if result.get("verify_summary") or isinstance(result.get("summary"), str):  # a verify report says `summary`
        out.print(f"  verify: {result.get('verify_summary') or result['summary']}", highlight=False)
    if job["state"] == "succeeded" and "format" in result:  # a checkpoint's summary (inspect)
        for key in ("format", "world_size", "tensors", "total_bytes", "has_optimizer"):
            out.print(f"  {key}: {shown(result.get(key))}", highlight=False)


def follow(client: ServiceClient, job_id: str, quiet: bool) -> dict[str, Any]:
    """Follow a job's events (a progress bar on a terminal, state lines otherwise) and return the final job."""
    if quiet or not sys.stderr.isatty():
        def lines(event: str, data: dict[str, Any]) -> None:
            if event == "state" and not quiet:
                err.print(f"{data['id']}: {data['state']} (attempt {data['attempt']})", highlight=False)

        return client.wait(job_id, lines)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=err.real(), transient=True) as bar:
        task = bar.add_task(job_id, total=None)

        def draw(event: str, data: dict[str, Any]) -> None:
            progress = data.get("progress") or {}
            bar.update(task, description=f"{job_id} {data.get('state', '')}", completed=progress.get("done_bytes", 0),
                       total=progress.get("total_bytes") or None)

        return client.wait(job_id, draw)


def finish(client: ServiceClient, job: dict[str, Any], wait: bool, quiet: bool, as_json: bool) -> None:
    if wait:
        job = follow(client, job["id"], quiet or as_json)
    if as_json:
        out.print_json(json.dumps(job))
    elif wait:
        print_job(job)
    else:
        typer.echo(job["id"])
        if not quiet:
            err.print(f"queued {job['kind']} job {job['id']}; follow it with: ckptctl status {job['id']} --follow",
                      highlight=False)
    if wait and job["state"] != "succeeded":
        raise typer.Exit(DIFFERENT)


def submit_job(request: JobRequest, source: str, target: str | None = None, *, server: str, token: str | None,
               callback_url: str | None, idempotency_key: str | None, wait: bool, quiet: bool,
               as_json: bool) -> None:
    """Send `request` (checked here, every option of its kind: `model_dump()`) as a job to the server."""
    spec: dict[str, Any] = {"kind": request.kind, "source": as_uri(source),
                            "options": request.model_dump(mode="json")}
    if target is not None:
        spec["target"] = as_uri(target)
    if callback_url:
        spec["callback_url"] = callback_url
    with connect(server, token) as client:
        job = client.submit(spec, idempotency_key)
        finish(client, job, wait, quiet, as_json)


submit_app = typer.Typer(help="Queue a job on a ckpt-service server, with the offline command's flags.",
                         no_args_is_help=True)
app.add_typer(submit_app, name="submit")

SUBMIT_EXTRAS = [keyword("wait", Wait, False), keyword("quiet", Quiet, False), keyword("as_json", AsJson, False),
                 keyword("callback_url", Callback, None), keyword("idempotency_key", IdemKey, None),
                 keyword("server", Server, DEFAULT_SERVER), keyword("token", Token, None)]
for _kind in kinds().values():
    job_command(submit_app, _kind.request, list(_kind.arguments), SUBMIT_EXTRAS, submit_job,
                help=f"{_kind.help} On the server.")


@app.command()
def jobs(state: Annotated[str | None, typer.Option("--state", help="queued, running, succeeded, failed, "
                                                   "cancelled.")] = None,
         kind: Annotated[str | None, typer.Option("--kind", help=f"{', '.join(names())}.")] = None,
         limit: Annotated[int, typer.Option("--limit")] = 50, as_json: AsJson = False,
         server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """List jobs on the server, newest first."""
    with connect(server, token) as client:
        page = client.jobs(state, kind, limit)
    if as_json:
        out.print_json(json.dumps(page))
        return
    table = make_table("id", "kind", "state", "attempt", "progress", "source", "target")
    for job in page["items"]:
        progress = job.get("progress") or {}
        fraction = progress.get("fraction")
        table.add_row(job["id"], job["kind"], job["state"], f"{job['attempt']}/{job['max_attempts']}",
                      f"{fraction:.0%}" if fraction is not None else "", job["spec"]["source"],
                      job["spec"].get("target") or "")
    out.print(table)


@app.command()
def status(job_id: str, follow_events: Annotated[bool, typer.Option("--follow", "-f", help="Follow until the job "
                                                                    "ends (live progress bar).")] = False,
           quiet: Quiet = False, as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Show a job; with --follow, wait for it to end (exit 1 unless it succeeds)."""
    from ckpt_service.jobs import TERMINAL

    with connect(server, token) as client:
        job = client.job(job_id)
        if follow_events and job["state"] not in TERMINAL:
            job = follow(client, job_id, quiet or as_json)
    if as_json:
        out.print_json(json.dumps(job))
    else:
        print_job(job)
    if follow_events and job["state"] != "succeeded":
        raise typer.Exit(DIFFERENT)


@app.command()
def cancel(job_id: str, as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Cancel a job: a queued one never starts, a running one is stopped and its partial output removed."""
    with connect(server, token) as client:
        job = client.cancel(job_id)
    if as_json:
        out.print_json(json.dumps(job))
    else:
        note = " (stopping)" if job["state"] == "running" else ""
        out.print(f"{job['id']}: {job['state']}{note}", highlight=False)


checkpoints_app = typer.Typer(help="The checkpoint registry on the server.", no_args_is_help=True)
app.add_typer(checkpoints_app, name="checkpoints")


def print_checkpoint(c: dict[str, Any]) -> None:
    out.print(f"{c['id']}  {c['name']}  {shown(c['format'])}  world size {shown(c['world_size'])}  "
              f"{shown(c['tensors'])} tensors  {human(c['total_bytes'] or 0)}", highlight=False)
    out.print(f"  {c['uri']}", highlight=False)
    if c["tags"] or c["metadata"]:
        out.print(f"  tags: {', '.join(c['tags'])}  metadata: {json.dumps(c['metadata'])}", highlight=False)
    via = c.get("registered_via") or {}
    if c["made_by_job"]:
        out.print(f"  made by job {c['made_by_job']}", highlight=False)
    elif via.get("how") == "source":
        out.print(f"  registered as the source of job {via.get('job')}", highlight=False)
    elif via.get("how") in ("discovered", "notified", "registered"):
        out.print(f"  {via['how']}{' by ' + via['by'] if via.get('by') else ''}", highlight=False)


@checkpoints_app.command("list")
def checkpoints_list(name: Annotated[str | None, typer.Option("--name")] = None,
                     tag: Annotated[str | None, typer.Option("--tag")] = None,
                     format: Annotated[str | None, typer.Option("--format")] = None,
                     limit: Annotated[int, typer.Option("--limit")] = 50,
                     archived: Annotated[bool, typer.Option("--archived", help="Instead of the live checkpoints, "
                                                            "those an archive store holds, live or with their files "
                                                            "deleted (restorable).")] = False,
                     as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """List registered checkpoints (with --archived, the archived ones and where each is archived)."""
    with connect(server, token) as client:
        page = client.checkpoints(name, tag, format, limit, archived=archived)
    if as_json:
        out.print_json(json.dumps(page))
        return
    table = make_table("id", "name", "format", "world size", "size", "tags", "uri",
                       *(("files", "archived in", "stored") if archived else ()))
    for c in page["items"]:
        where = [(a["store"], a["archive_id"], human(a["stored_bytes"])) for a in c.get("archives") or []]
        table.add_row(c["id"], c["name"], shown(c["format"]), shown(c["world_size"]), human(c["total_bytes"] or 0),
                      ",".join(c["tags"]), c["uri"],
                      *(("deleted" if c.get("deleted_at") else "on disk", ", ".join(f"{s} ({i})" for s, i, _ in where),
                         ", ".join(b for _, _, b in where)) if archived else ()))
    out.print(table)


@checkpoints_app.command("show")
def checkpoints_show(ref: Ref, tensors: Annotated[bool, typer.Option("--tensors")] = False,
                     as_json: AsJson = False, server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Show a registered checkpoint (with --tensors, its tensor table)."""
    from .manage import print_managed

    with connect(server, token) as client:
        c = client.checkpoint(ref, tensors)
        if as_json:
            out.print_json(json.dumps(c))
            return
        print_checkpoint(c)
        print_managed(client, c["id"])
    if tensors:
        table = make_table("name", "dtype", "shape", "chunks")
        for row in c["summary"].get("tensor_table", []):
            table.add_row(row["name"], row["dtype"], str(row["shape"]), str(row["chunks"]))
        out.print(table)


@checkpoints_app.command("register")
def checkpoints_register(uri: str, name: Annotated[str | None, typer.Option("--name")] = None,
                         tag: Annotated[list[str] | None, typer.Option("--tag", help="Repeatable.")] = None,
                         meta: Annotated[list[str] | None, typer.Option("--meta", help="KEY=VALUE, repeatable "
                                                                        "(e.g. step=2000).")] = None,
                         source_format: From = None, as_json: AsJson = False, server: Server = DEFAULT_SERVER,
                         token: Token = None) -> None:
    """Register a checkpoint (the server inspects it) with a name, tags and metadata."""
    metadata: dict[str, Any] = {}
    for item in meta or []:
        key, sep, value = item.partition("=")
        if not sep:
            fail(f"--meta {item!r}: expected KEY=VALUE")
        metadata[key] = int(value) if value.isdigit() else value
    with connect(server, token) as client:
        c = client.register(as_uri(uri), name, tag or [], metadata, source_format)
    if as_json:
        out.print_json(json.dumps(c))
    else:
        print_checkpoint(c)


@checkpoints_app.command("lineage")
def checkpoints_lineage(ref: Ref, as_json: AsJson = False, server: Server = DEFAULT_SERVER,
                        token: Token = None) -> None:
    """What a checkpoint was derived from, and what was derived from it."""
    with connect(server, token) as client:
        view = client.lineage(ref)
    if as_json:
        out.print_json(json.dumps(view))
        return
    for label, edges in (("derived from", view["ancestors"]), ("derived into", view["descendants"])):
        for edge in edges:
            c = edge["checkpoint"]
            out.print(f"{'  ' * (edge['depth'] - 1)}{label} {c['id']} {c['uri']} (job {edge['job_id']})",
                      highlight=False)


@checkpoints_app.command("delete")
def checkpoints_delete(ref: Ref,
                       purge: Annotated[bool, typer.Option("--purge", help="Delete the data too (admin).")] = False,
                       server: Server = DEFAULT_SERVER, token: Token = None) -> None:
    """Unregister a checkpoint (with --purge, delete its data)."""
    from .manage import resolve_ref

    with connect(server, token) as client:
        c = client.delete(resolve_ref(client, ref), purge)
    out.print(f"unregistered {c['id']} ({c['uri']})" + ("; data deleted" if purge else ""), highlight=False)
