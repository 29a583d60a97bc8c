"""Request size limit, as plain ASGI middleware: a declared Content-Length over the limit is refused at
once; a body streamed without one is counted and cut off at the limit (413 either way)."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckpt_service.errors import PayloadTooLarge


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
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise PayloadTooLarge(f"request body over {self.max_bytes} bytes")
            return message

        await self.app(scope, counted, send)


async def _refuse(send: Send, max_bytes: int) -> None:
    message = f"request body over {max_bytes} bytes"
    payload: dict[str, Any] = {"error": {"type": "payload_too_large", "message": message}}
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
