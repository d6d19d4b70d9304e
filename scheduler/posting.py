"""POSTing a notice (alert webhooks, dead man's switch pings) over HTTP(S).

The standard library's client (urllib, http.client, email) is imported on the
first POST: most replicas never send one, and it costs about a megabyte.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def redact_url(url: str) -> str:
    """Scheme and host only: webhook paths and queries carry secrets (Slack, healthchecks)."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    if parts.port:
        host += f":{parts.port}"
    return f"{parts.scheme}://{host}/…"


def post(url: str, body: bytes, timeout: float, content_type: str | None = None) -> str | None:
    """None on success, else the reason it failed, which never contains the URL."""
    import urllib.error
    import urllib.request

    headers = {"User-Agent": "scheduler"}
    if content_type:
        headers["Content-Type"] = content_type
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        return type(exc.reason).__name__ if not isinstance(exc.reason, str) else "unreachable"
    except (OSError, ValueError) as exc:
        return type(exc).__name__
    return None
