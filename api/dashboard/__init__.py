"""The web dashboard served at `/`: a static shell (one Jinja2 template, one stylesheet, plain ES modules).

Everything the page shows comes from the public REST API and its event streams, fetched by the browser
with the signed-in token; the server only serves the shell and its assets.
"""

from .routes import mount

__all__ = ["mount"]
