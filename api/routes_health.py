"""/healthz (process alive), /readyz (store sound and reachable, workers alive), /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ckpt_service.service_errors import ServiceError, StoreDamaged

from .schemas import Health, Ready, errors

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz() -> Health:
    """Answers from the event loop without touching the store: the process is alive and serving."""
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, responses={503: {"model": Ready}}, summary="Readiness")
def readyz(request: Request) -> JSONResponse:
    checks: dict[str, object] = {"database": request.app.state.service.store.dialect.name}
    ready = True
    problem = request.app.state.store_health.problem()
    if problem is not None:
        kind = "damaged" if isinstance(problem, StoreDamaged) else "unavailable"
        checks["store"], checks["store_problem"], ready = kind, str(problem), False
    else:
        try:
            request.app.state.service.store.ping()
            checks["store"] = "ok"
        except ServiceError:
            checks["store"], ready = "unreachable", False
    pool = request.app.state.pool
    if pool is not None:
        alive = pool.alive()
        checks["workers"] = {"alive": alive, "slots": pool.slots, "busy": pool.busy()}
        ready = ready and alive
    else:
        checks["workers"] = "none in this process"
    if checks["store"] == "ok":
        try:
            live = request.app.state.service.store.live_workers(2 * request.app.state.settings.lease_seconds)
            checks["workers_seen"] = len(live)
        except ServiceError:
            checks["workers_seen"] = None
    status = "ready" if ready else "unavailable"
    return JSONResponse(Ready(status=status, checks=checks).model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}},
                                                            **errors(401, 403)}, summary="Prometheus metrics")
def metrics(request: Request) -> Response:
    if not request.app.state.settings.metrics_public:
        request.app.state.checker.require(request.headers.get("authorization"), "read")
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
