"""POSTing a notice (alert webhooks, dead man's switch pings) over HTTP(S).

The standard library's client (urllib, http.client, email) is imported on the
first POST: most replicas never send one, and it costs about a megabyte.
Notices are sent from background threads, so `post` answers every failure,
whatever the URL or the server did, with a reason instead of raising.
"""

from __future__ import annotations

from scheduler.urls import redact_http_url


def redact_url(url: str) -> str:
    """Scheme and host only: webhook paths and queries carry secrets (Slack, healthchecks)."""
    return redact_http_url(url)


def post(url: str, body: bytes, timeout: float, content_type: str | None = None) -> str | None:
    """None on success, else the reason it failed, which never contains the URL."""
    import urllib.error
    import urllib.request

    headers = {"User-Agent": "scheduler"}
    if content_type:
        headers["Content-Type"] = content_type
    try:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        return type(exc.reason).__name__ if not isinstance(exc.reason, str) else "unreachable"
    except Exception as exc:
        # A bad URL (ValueError), a broken answer (http.client.HTTPException), a timeout.
        return type(exc).__name__
    return None
