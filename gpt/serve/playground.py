"""The playground page `serve.py` serves at `/`: its three files, read once from the package, and the
headers that keep it safe with any model output.

    GET /                            the page (gpt/serve/page/index.html)
    GET /playground/playground.js    its script
    GET /playground/playground.css   its style

The routes are fixed names, never a path taken from the request, so no request reaches another file. Every
reply carries a Content-Security-Policy that allows only this server's own scripts, styles and API (no
inline script or event handler, no other origin, no framing), and `nosniff`. The page sets model text only
as text (`textContent`), never as HTML. It needs no API key to load (it holds no model data); its requests
to the API send the key the user gives it.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

__all__ = ["PAGE_PATHS", "SECURITY_HEADERS", "add_playground_routes"]

_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
          "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
          "/playground/playground.css": ("playground.css", "text/css; charset=utf-8")}
PAGE_PATHS = tuple(_FILES)

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def add_playground_routes(app: FastAPI) -> None:
    """GET routes for the page's three files, each read now."""
    folder = resources.files("gpt.serve") / "page"
    for path, (name, media_type) in _FILES.items():
        app.add_api_route(path, _file_route((folder / name).read_bytes(), media_type), methods=["GET"],
                          include_in_schema=False)


def _file_route(body: bytes, media_type: str):
    async def serve_file():
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

    return serve_file
