"""`ckptctl serve`, `ckptctl worker` and `ckptctl token create`: run the service, or a worker alone.

fastapi and uvicorn are imported inside the commands, so the offline commands never load them.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import app, fail, out

Host = Annotated[str | None, typer.Option("--host", help="Address to listen on (CKPT_HOST).")]
Port = Annotated[int | None, typer.Option("--port", help="Port to listen on (CKPT_PORT).")]
Workers = Annotated[int | None, typer.Option("--workers", help="Job slots; each job runs in its own process "
                                             "(CKPT_WORKERS, default 2).")]
DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Job store and default storage root "
                                              "(CKPT_DATA_DIR, default ~/.local/share/ckpt-service).")]
DatabaseUrl = Annotated[str | None, typer.Option("--database-url", help="postgresql://USER@HOST/DB: a job store "
                                                 "shared by many hosts (CKPT_DATABASE_URL; default SQLite).")]
Config = Annotated[Path | None, typer.Option("--config", help="A .toml or .json settings file (CKPT_CONFIG).")]
LogLevel = Annotated[str | None, typer.Option("--log-level", help="debug, info, warning or error.")]


def load_settings(config: Path | None, **flags: Any) -> Any:
    """Validated settings, or a clean exit naming every bad setting."""
    from pydantic import ValidationError

    from ckpt_service.service_errors import SettingsError
    from ckpt_service.settings import describe, load

    try:
        return load(config, **flags)
    except ValidationError as exc:
        fail(describe(exc))
    except (SettingsError, ValueError) as exc:
        fail(str(exc))


def open_store(settings: Any) -> Any:
    """The job store, checked (integrity, schema version) and migrated; a clean exit 2 when it cannot be used."""
    from ckpt_service.service_errors import StoreError
    from ckpt_service.store import JobStore
    from ckpt_service.store_check import check

    try:
        settings.prepare()
        if settings.database_url or settings.db_path.exists():
            check(settings.store_location)
        return JobStore(settings.store_location)
    except OSError as exc:
        fail(f"data dir {settings.data_dir}: {exc.strerror or exc}")
    except StoreError as exc:
        fail(str(exc))


def check_port(host: str, port: int) -> None:
    """Refuse, in one line naming --port, a port this host cannot listen on, before anything starts (uvicorn
    would log its failure only after the app, its job slots and the store were up)."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as exc:
        fail(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another with --port "
             "or CKPT_PORT, or stop what holds it")


def dashboard_url(host: str, port: int) -> str:
    """Where a browser on this machine finds the dashboard of a server listening on `host`."""
    local = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{local}]:{port}/" if ":" in local else f"http://{local}:{port}/"


@app.command()
def serve(host: Host = None, port: Port = None, workers: Workers = None, data_dir: DataDir = None,
          database_url: DatabaseUrl = None, config: Config = None, log_level: LogLevel = None,
          print_config: Annotated[bool, typer.Option("--print-config", help="Print the effective settings "
                                                     "(secrets masked) and exit.")] = False) -> None:
    """Run the REST API and a pool of job slots (jobs in their own processes), with the job store under the data dir."""
    settings = load_settings(config, host=host, port=port, workers=workers, data_dir=data_dir,
                             database_url=database_url, log_level=log_level)
    if print_config:
        out.print_json(json.dumps(settings.masked()))
        return
    check_port(settings.host, settings.port)
    import uvicorn

    from api.app import create_app
    from ckpt_service import logs
    from ckpt_service.worker import WorkerPool, confine

    if sys.stdout.isatty():
        out.print(f"Dashboard: {dashboard_url(settings.host, settings.port)}  (API docs: /docs)", highlight=False)
    logs.setup(settings.log_level)
    store = open_store(settings)
    confine(settings)  # the API and its scheduler read nothing outside the roots (checkpoints: not at all)
    pool = WorkerPool(settings, store) if settings.workers else None
    server_config = uvicorn.Config(create_app(settings, pool, store=store), host=settings.host, port=settings.port,
                                   log_config=None, log_level=settings.log_level, timeout_graceful_shutdown=5,
                                   server_header=False)
    uvicorn.Server(server_config).run()


@app.command()
def worker(workers: Workers = None, data_dir: DataDir = None, database_url: DatabaseUrl = None,
           config: Config = None, log_level: LogLevel = None) -> None:
    """Run job slots alone against the same store as a `ckptctl serve` (scale workers apart from the API)."""
    settings = load_settings(config, workers=workers, data_dir=data_dir, database_url=database_url,
                             log_level=log_level)
    from ckpt_service import logs
    from ckpt_service.worker import WorkerPool, confine

    logs.setup(settings.log_level)
    store = open_store(settings)
    confine(settings)
    if settings.workers < 1:
        fail("--workers must be at least 1 for a worker")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    WorkerPool(settings, store).run_until(stop)


token_app = typer.Typer(help="Make API tokens.", no_args_is_help=True)
app.add_typer(token_app, name="token")


@token_app.command("create")
def token_create(scope: Annotated[str, typer.Option("--scope", help="read, write or admin.")] = "read",
                 name: Annotated[str | None, typer.Option("--name", help="A label for logs and errors.")] = None,
                 as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Print a new token once (stdout) and the hashed entry to add to CKPT_TOKENS (stderr)."""
    from ckpt_service.auth import create

    try:
        token, entry = create(scope, name)  # type: ignore[arg-type]
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        out.print_json(json.dumps({"token": token, "entry": entry.line(), "scope": entry.scope, "name": entry.name}))
        return
    typer.echo(token)
    typer.echo(f"add to CKPT_TOKENS (the token itself is stored nowhere): {entry.line()}", err=True)


store_app = typer.Typer(help="Check, back up and restore the job store (SQLite under the data dir).",
                        no_args_is_help=True)
app.add_typer(store_app, name="store")


def sqlite_only(settings: Any, action: str) -> Any:
    if settings.database_url:
        fail(f"store {action}: the job store is in PostgreSQL (CKPT_DATABASE_URL); use pg_dump / pg_restore")
    return settings


def _store_run(action: Any) -> Any:
    from ckpt_service.service_errors import StoreError

    try:
        return action()
    except StoreError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{exc.filename or 'job store'}: {exc.strerror or exc}")


@store_app.command("check")
def store_check(data_dir: DataDir = None, database_url: DatabaseUrl = None, config: Config = None,
                as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Run SQLite's integrity check (PostgreSQL: `SELECT 1`) and the schema checks on the job store (read-only)."""
    from ckpt_service.store_check import check

    settings = load_settings(config, data_dir=data_dir, database_url=database_url)
    report = _store_run(lambda: check(settings.store_location))
    if as_json:
        out.print_json(json.dumps({"path": report.path, "ok": True, "version": report.version, "jobs": report.jobs}))
    else:
        typer.echo(report.line())


@store_app.command("backup")
def store_backup(dest: Annotated[Path, typer.Argument(help="The backup file to write.")], data_dir: DataDir = None,
                 config: Config = None,
                 overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing file.")] = False
                 ) -> None:
    """Copy the job store to DEST with SQLite's online backup API (consistent while the service runs)."""
    from ckpt_service.store_check import backup

    settings = sqlite_only(load_settings(config, data_dir=data_dir), "backup")
    report = _store_run(lambda: backup(settings.db_path, dest.absolute(), overwrite))
    typer.echo(f"backed up {settings.db_path} to {report.path} (schema version {report.version}, {report.jobs} jobs)")


@store_app.command("restore")
def store_restore(backup_file: Annotated[Path, typer.Argument(metavar="BACKUP", help="A file from `ckptctl store "
                                                               "backup`.")],
                  data_dir: DataDir = None, config: Config = None) -> None:
    """Replace the job store with a checked backup (stop the service first); the old files are kept beside it."""
    from ckpt_service.store_check import restore

    settings = sqlite_only(load_settings(config, data_dir=data_dir), "restore")
    report, aside = _store_run(lambda: restore(backup_file.absolute(), settings.db_path))
    kept = f"; the previous store is at {aside}" if aside else ""
    typer.echo(f"restored {settings.db_path} from {backup_file} ({report.jobs} jobs){kept}")
