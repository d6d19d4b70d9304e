"""`Replica.wsgi()`: the page and the probes as a WSGI app, under any mount prefix.

The prefix is `SCRIPT_NAME` (werkzeug's `DispatcherMiddleware`, gunicorn's
`SCRIPT_NAME`, Django's `WSGIHandler` under a path); links, forms and
redirects follow it. A body is read only up to `REQUEST_BODY_BYTES`; the
host's server owns the threads and the timeouts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from scheduler.config.budgets import REQUEST_BODY_BYTES
from scheduler.web.asgi import PATH_SAFE
from scheduler.web.hosted import Hosted, prefixed
from scheduler.web.server import Refused, Reply, Request, header_pairs, sendable

if TYPE_CHECKING:
    from scheduler.web.hosted import HostedReplica

StartResponse = Callable[..., Any]


class WSGIApp:
    def __init__(self, replica: HostedReplica) -> None:
        self.replica = replica
        self.hosted = Hosted(replica)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        root = str(environ.get("SCRIPT_NAME", "")).rstrip("/")
        # PEP 3333: PATH_INFO holds the decoded bytes as latin-1; the routes want them encoded.
        path = quote(str(environ.get("PATH_INFO", "")).encode("latin-1"), safe=PATH_SAFE)
        if not path:
            reply = Reply(308, b"", headers=(("Location", root + "/"),))
        else:
            try:
                reply = prefixed(self.hosted.answer(_request(environ, root, path)), root)
            except Refused as refused:
                reply = refused.reply
        reply = sendable(reply)
        status = f"{reply.status} {_phrase(reply.status)}"
        start_response(status, header_pairs(reply))
        return [reply.body]


def _request(environ: dict[str, Any], root: str, path: str) -> Request:
    method = str(environ.get("REQUEST_METHOD", "GET"))
    if method not in ("GET", "POST"):
        raise Refused(501, "only GET and POST are served")
    headers = {
        name[5:].replace("_", "-").lower(): str(value)
        for name, value in environ.items()
        if name.startswith("HTTP_")
    }
    for name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if environ.get(name):
            headers[name.replace("_", "-").lower()] = str(environ[name])
    body = _body(environ, headers) if method == "POST" else b""
    query = str(environ.get("QUERY_STRING", ""))
    return Request(method, path, query, headers, body, str(environ.get("REMOTE_ADDR", "")), root)


def _body(environ: dict[str, Any], headers: dict[str, str]) -> bytes:
    value = headers.get("content-length", "0")
    if not (value.isascii() and value.isdigit()):
        raise Refused(400, "Content-Length must be a number of bytes")
    digits = value.lstrip("0") or "0"
    if len(digits) > len(str(REQUEST_BODY_BYTES)) or int(digits) > REQUEST_BODY_BYTES:
        raise Refused(413, f"at most {REQUEST_BODY_BYTES} bytes")
    body = bytes(environ["wsgi.input"].read(int(digits))) if int(digits) else b""
    if len(body) != int(digits):
        raise Refused(400, "the body is not as long as its Content-Length")
    return body


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
