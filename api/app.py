"""The FastAPI app: `create_app(settings, pool=None)`.

Routes live under /v1 (jobs, checkpoints) plus /healthz, /readyz and /metrics. The app only
validates, authorises and enqueues; jobs run in worker processes (`pool`, when this server has job
slots, is started and stopped with the app). Routes that touch the store are plain `def` routes, so
they run in the thread pool and the event loop stays free for health checks and event streams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import anyio
from fastapi import FastAPI

from ckpt_service import logs
from ckpt_service.audit import AuditLog
from ckpt_service.service import CkptService
from ckpt_service.settings import Settings
from ckpt_service.store import JobStore
from ckpt_service.store_check import StoreHealth

from . import http_errors
from .audit_trail import AuditTrail
from .dashboard import mount as mount_dashboard
from .docs import mount as mount_docs
from .events import StreamSlots
from .limits import BodyLimit
from .metrics import Metrics, RequestMetrics
from .routes_audit import router as audit_router
from .routes_checkpoints import router as checkpoints_router
from .routes_dashboard_support import router as session_router
from .routes_health import router as health_router
from .routes_jobs import router as jobs_router
from .routes_manage import install as install_manage

DESCRIPTION = """Convert, export, reshard, verify and inspect sharded PyTorch checkpoints, as jobs.

Send `Authorization: Bearer <token>` (tokens come from `ckptctl token create`). Errors are
`{"error": {"type", "message", "fields"}}`.
"""


def _version() -> str:
    try:
        return version("ckpt-service")
    except PackageNotFoundError:
        return "0+unknown"


def create_app(settings: Settings, pool: Any = None, store: JobStore | None = None) -> FastAPI:
    """The API over the store in `settings.data_dir`; `pool` (a WorkerPool) runs with the app if given."""
    service = CkptService(settings, store or (pool.store if pool is not None else None))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if pool is not None:
            pool.start()
        scheduler.start()
        logs.event("api.started", data_dir=str(settings.data_dir), slots=pool.slots if pool else 0,
                   anonymous=settings.anonymous)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(scheduler.stop)
            if pool is not None:
                await anyio.to_thread.run_sync(pool.stop)
            logs.event("api.stopped")

    app = FastAPI(title="ckpt-service", version=_version(), description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # /docs is served from the package, below (no CDN)
    app.state.settings = settings
    app.state.service = service
    app.state.pool = pool
    app.state.checker = settings.token_checker()
    app.state.audit = AuditLog(service.store)
    app.state.metrics = Metrics(service.store, pool)
    app.state.store_health = StoreHealth(service.store.path, settings.store_check_seconds)
    app.state.streams = StreamSlots(settings.sse_max_streams, settings.sse_max_streams_per_principal)
    http_errors.install(app)
    app.include_router(jobs_router)
    app.include_router(checkpoints_router)
    scheduler = install_manage(app)
    app.include_router(audit_router)
    app.include_router(health_router)
    app.include_router(session_router)
    mount_dashboard(app)
    mount_docs(app)
    app.add_middleware(AuditTrail, api=app)  # inside BodyLimit: an oversized body never gets this far
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    return app
