"""`GET /` (the dashboard shell) and `/dashboard/static/*` (its assets), with a strict Content-Security-Policy.

The shell holds no data: the job form's kinds and fields are rendered from the kinds' declarations
(`job_kinds`, through `JobOptions` and `APPLIES`), so the form always offers exactly the kinds the API takes
and the options each kind takes, and the browser fills in everything else from the API.
"""

from __future__ import annotations

import hashlib
import typing
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.responses import Response
from starlette.types import Scope

from ckpt_service.job_kinds import kinds
from ckpt_service.job_requests import shape
from ckpt_service.jobs import APPLIES, KINDS, STATES, TERMINAL, Format, JobOptions

HERE = Path(__file__).parent
STATIC = HERE / "static"
STATIC_URL = "/dashboard/static"

# Scripts and styles only from this origin, no inline script or style element, no eval, no plugins, no
# framing; the page talks only to its own origin. (Setting `element.style.x` from a module is CSSOM, which
# CSP allows; the templates and scripts never write a `style` attribute or an inline handler.)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


def asset_version(root: Path = STATIC) -> str:
    """A digest of every asset, put in their URLs: a changed file gets a new URL, so assets may be cached for good."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


class Assets(StaticFiles):
    """Static files with the security headers; cached for a year when asked for by the current version."""

    def __init__(self, version: str) -> None:
        super().__init__(directory=STATIC)
        self.version = version

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        query = scope.get("query_string", b"").decode("latin-1")
        fresh = response.status_code == 200 and query == f"v={self.version}"
        response.headers["Cache-Control"] = "public, max-age=31536000, immutable" if fresh else "no-cache"
        return response


def _widget(annotation: Any) -> dict[str, Any]:
    """How the form asks for one option: a select for a choice, a tick box for a bool, lines for a list."""
    value = shape(annotation)
    if value.kind == "choice":
        return {"widget": "select", "choices": list(value.choices)}
    if value.kind == "bool":
        return {"widget": "tristate" if value.optional else "check", "choices": ["true", "false"]}
    if value.kind == "list":
        return {"widget": "lines"}
    return {"widget": "number" if value.kind in ("int", "float") else "text"}


def option_fields() -> list[dict[str, Any]]:
    """The job form's option fields, in `JobOptions` order, each with the kinds it applies to."""
    fields = []
    for name, info in JobOptions.model_fields.items():
        kinds = [kind for kind in KINDS if name in APPLIES[kind]]
        default = info.get_default(call_default_factory=True)
        fields.append({"name": name, "label": name.replace("_", " "), "kinds": " ".join(kinds),
                       "help": info.description or "", "default": default, **_widget(info.annotation)})
    return fields


def mount(app: FastAPI) -> None:
    """Serve the dashboard at `/` and its assets under `/dashboard/static` (neither is in the OpenAPI document)."""
    version = asset_version()
    templates = Jinja2Templates(directory=HERE / "templates")
    context = {"asset": lambda name: f"{STATIC_URL}/{name}?v={version}", "kinds": KINDS, "states": STATES,
               "target_kinds": " ".join(k.name for k in kinds().values() if k.takes_target),
               "terminal": " ".join(state for state in STATES if state in TERMINAL),
               "formats": typing.get_args(Format), "options": option_fields(), "version": app.version}
    router = APIRouter(include_in_schema=False)

    @router.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        response = templates.TemplateResponse(request, "index.html", context)
        response.headers.update(SECURITY_HEADERS)
        response.headers["Cache-Control"] = "no-cache"
        return response

    app.include_router(router)
    app.mount(STATIC_URL, Assets(version), name="dashboard-static")
