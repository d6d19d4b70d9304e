"""Every budget, in bytes and in time, for what comes from the network: in one place.

Incoming requests are read under these by `scheduler.web.server`, before
anything parses them; outgoing POSTs (webhook notices, pings) read their
replies under these in `scheduler.observers.posting`. Nothing else in the scheduler
reads from a socket. docs/operating.md: Network budgets.
"""

from __future__ import annotations

# -- requests to the HTTP endpoint (health, metrics, the page, the API) -------------------

REQUEST_HEAD_BYTES = 16 * 1024  # the request line and every header together
REQUEST_HEAD_LINES = 64  # the request line and the header lines
REQUEST_BODY_BYTES = 16 * 1024  # a POST body: the page's forms send a few dozen
REQUEST_TIMEOUT = 5.0  # seconds for the whole request to arrive, however slowly it trickles
REPLY_TIMEOUT = 10.0  # seconds for a whole reply to be taken by a client that reads slowly
LINGER_BYTES = 64 * 1024  # read and dropped after refusing a request not read whole,
LINGER_TIMEOUT = 1.0  # so that the refusal reaches the client instead of a reset
OPEN_CONNECTIONS = 128  # held at once; beyond, the oldest not being answered is closed
FD_SHARE = 8  # and never more than this share of the process's descriptor limit
ROUTE_WORKERS = 32  # page and API requests answered at once; more are answered 503
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})  # answered at once, never queued

# -- POSTs this replica sends (alert webhooks, dead man's switch pings) -------------------

ATTEMPT_DEADLINE = 5.0  # seconds for one attempt: connect, send, and read the reply
REPLY_BYTES = 16 * 1024  # of a reply, status line, headers and body together
NOTICE_ATTEMPTS_AT_ONCE = 8  # webhook attempts in flight: a slow receiver holds one each
NOTICES_QUEUED = 1000
PING_WORKERS = 4
PINGS_PER_RECEIVER = 1  # to one host at a time, in order (/start before success)
PINGS_QUEUED = 1000
