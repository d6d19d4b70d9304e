"""`Replica.asgi()`: the page and the probes as an ASGI app, under any mount prefix.

The prefix is the scope's `root_path` (Starlette's `Mount`, FastAPI's
`app.mount`, `uvicorn --root-path`); links, forms and redirects follow it.
A request is read under the budgets of the replica's own server (a body of
at most `REQUEST_BODY_BYTES`, within `REQUEST_TIMEOUT`); the page's routes
run on threads, at most `ROUTE_WORKERS` at once (beyond, 503 at once), and
the probes on the event loop, never queued behind them. Served on its own, the
app's lifespan starts and stops the replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from scheduler.config.budgets import REQUEST_BODY_BYTES, REQUEST_TIMEOUT, ROUTE_WORKERS
from scheduler.web.hosted import Hosted, prefixed
from scheduler.web.server import (
    BUSY,
    Refused,
    Reply,
    Request,
    answered_as,
    header_pairs,
    sendable,
)

if TYPE_CHECKING:
    from scheduler.web.hosted import HostedReplica

PATH_SAFE = "/:@!$&'()*+,;=-._~"  # what a path keeps unencoded (RFC 3986)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ASGIApp:
    def __init__(self, replica: HostedReplica, workers: int = ROUTE_WORKERS) -> None:
        self.replica = replica
        self.hosted = Hosted(replica)
        self.workers = workers
        self._busy = 0  # page routes on threads now (touched on the event loop only)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # a websocket: not served; the server closes it
        root, path = split_path(scope)
        if not path:
            await _send(send, Reply(308, b"", headers=(("Location", root + "/"),)))
            return
        try:
            request = await _request(scope, receive, root, path)
        except Refused as refused:
            await _send(send, refused.reply)
            return
        await _send(send, prefixed(answered_as(request, await self._reply(request)), root))

    async def _reply(self, request: Request) -> Reply:
        if self.hosted.is_probe(request):
            return self.hosted.answer(request)
        if self._busy >= self.workers:
            return BUSY
        self._busy += 1
        try:
            return await asyncio.to_thread(self.hosted.answer, request)
        finally:
            self._busy -= 1

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Served on its own (`uvicorn module:app`), the app starts and stops its replica."""
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "lifespan.startup":
                try:
                    await asyncio.to_thread(self.replica.start)
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif kind == "lifespan.shutdown":
                await asyncio.to_thread(self.replica.stop)
                await send({"type": "lifespan.shutdown.complete"})
                return


def split_path(scope: Scope) -> tuple[str, str]:
    """(the mount prefix, the path below it, still percent-encoded as the client sent it).

    Servers differ on whether `path` includes `root_path` (the ASGI spec says it
    does; older Starlette mounts did not): a path that starts with it has it cut.
    """
    root = str(scope.get("root_path", "")).rstrip("/")
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else quote(str(scope.get("path", "")), safe=PATH_SAFE)
    path = path.split("?", 1)[0]
    quoted_root = quote(root, safe=PATH_SAFE)
    if root and path.startswith(quoted_root):
        path = path[len(quoted_root) :]
    return root, path


async def _request(scope: Scope, receive: Receive, root: str, path: str) -> Request:
    method = str(scope["method"])
    if method not in ("GET", "POST"):
        raise Refused(501, "only GET and POST are served")
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    body = b""
    if method == "POST":
        body = await _body(receive, _declared_length(headers))
    client = scope.get("client")
    return Request(
        method,
        path,
        bytes(scope.get("query_string", b"")).decode("latin-1"),
        headers,
        body,
        str(client[0]) if client else "",
        root,
    )


def _declared_length(headers: dict[str, str]) -> int | None:
    value = headers.get("content-length")
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise Refused(400, "Content-Length must be a number of bytes")
    digits = value.lstrip("0") or "0"
    if len(digits) > len(str(REQUEST_BODY_BYTES)) or int(digits) > REQUEST_BODY_BYTES:
        raise Refused(413, f"at most {REQUEST_BODY_BYTES} bytes")
    return int(digits)


async def _body(receive: Receive, declared: int | None) -> bytes:
    """The body within its budget of bytes and time."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Refused(400, "the client went away")
                chunk = bytes(message.get("body", b""))
                size += len(chunk)
                if size > REQUEST_BODY_BYTES:
                    raise Refused(413, f"at most {REQUEST_BODY_BYTES} bytes")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise Refused(408, "the request took too long to arrive") from None
    body = b"".join(chunks)
    if declared is not None and len(body) != declared:
        raise Refused(400, "the body is not as long as its Content-Length")
    return body


async def _send(send: Send, reply: Reply) -> None:
    reply = sendable(reply)
    headers = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in header_pairs(reply)]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})
