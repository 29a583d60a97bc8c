"""`/docs`: the API's Swagger UI, served whole from this server (no CDN: it works air-gapped).

The UI's files come from the `swagger-ui-bundle` package (`/docs/assets/*`); the page itself holds no
inline script or style (its start-up is `/docs/init.js`), so it is served under the dashboard's strict
Content-Security-Policy: scripts, styles and everything else from this origin only. There is no /redoc.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

from .dashboard.routes import SECURITY_HEADERS

ASSETS_URL = "/docs/assets"

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title} - API docs</title>
<link rel="stylesheet" href="{assets}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{assets}/swagger-ui-bundle.js"></script>
<script src="/docs/init.js"></script>
</body>
</html>
"""

INIT = """window.ui = SwaggerUIBundle({{
  url: {openapi_url},
  dom_id: "#swagger-ui",
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
}});
"""


class DocsAssets(StaticFiles):
    """The Swagger UI package's files, with the security headers."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def mount(app: FastAPI) -> None:
    """Serve `/docs`, `/docs/init.js` and `/docs/assets/*` (create the app with `docs_url=None, redoc_url=None`)."""
    import json

    from swagger_ui_bundle import swagger_ui_path

    page = PAGE.format(title=app.title, assets=ASSETS_URL)
    init = INIT.format(openapi_url=json.dumps(app.openapi_url))

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(page, headers=SECURITY_HEADERS)

    @app.get("/docs/init.js", include_in_schema=False)
    def docs_init() -> Response:
        return Response(init, media_type="text/javascript", headers=SECURITY_HEADERS)

    app.mount(ASSETS_URL, DocsAssets(directory=swagger_ui_path), name="docs-assets")
