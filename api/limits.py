"""Request size limit, as plain ASGI middleware: 413 for any body over the limit, however it is sent.

A declared Content-Length over the limit is refused before anything is read. Otherwise (a smaller
Content-Length, or a chunked body with none) the body is read here, up to the limit, before the app
sees the request: past the limit the answer is 413 at once, and the app never runs. Within it the app
gets the body as one message, then the connection's own messages (so it still sees a disconnect).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _refuse(send, self.max_bytes)
            return
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                await _refuse(send, self.max_bytes)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _refuse(send: Send, max_bytes: int) -> None:
    message = f"request body over {max_bytes} bytes"
    payload: dict[str, Any] = {"error": {"type": "payload_too_large", "message": message}}
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
