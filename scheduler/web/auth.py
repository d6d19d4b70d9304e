"""Who may act on the page, and who may read it.

With `http_token` set, a person logs in with the token once: the cookie they
get holds an expiry, a random nonce and an HMAC of both keyed by the token,
never the token itself (HttpOnly, SameSite=Strict). Every replica that shares
the token recognises it, and changing the token logs everybody out. API clients
send `Authorization: Bearer <token>` instead. Forms carry a CSRF token, an HMAC
of the session's nonce; a POST from a browser must also come from this origin
(Origin and Sec-Fetch-Site, when the browser sends them). Every comparison is
constant-time. Without a token, the actions are off: their POSTs answer 403.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from scheduler.config.parsing import Refused, whole

COOKIE = "scheduler_session"
SESSION_S = 12 * 3600  # a login lasts this long
SAME_SITE = ("same-origin", "none")  # Sec-Fetch-Site values of a request made by this page


@dataclass(frozen=True)
class Session:
    nonce: str  # "" for a bearer: no cookie, so no cross-site request can carry it
    bearer: bool


class Guard:
    def __init__(
        self, token: str | None, protect: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._key = token.encode() if token else None
        self.protect_all = protect == "all"
        self.clock = clock

    @property
    def actions_on(self) -> bool:
        return self._key is not None

    def _mac(self, *parts: str) -> str:
        assert self._key is not None
        return hmac.new(self._key, "|".join(parts).encode(), hashlib.sha256).hexdigest()

    def token_matches(self, given: str) -> bool:
        if self._key is None:
            return False
        # Digests of equal length: the comparison tells nothing, not even the token's length.
        mine = hashlib.sha256(self._key).digest()
        return hmac.compare_digest(hashlib.sha256(_bytes(given)).digest(), mine)

    def new_cookie(self) -> str:
        """The Set-Cookie value of a fresh login."""
        expires = str(int(self.clock()) + SESSION_S)
        nonce = secrets.token_hex(16)
        value = f"{expires}.{nonce}.{self._mac('session', expires, nonce)}"
        return f"{COOKIE}={value}; Max-Age={SESSION_S}; Path=/; HttpOnly; SameSite=Strict"

    @staticmethod
    def cleared_cookie() -> str:
        return f"{COOKIE}=; Max-Age=0; Path=/; HttpOnly; SameSite=Strict"

    def session(self, headers: Mapping[str, str]) -> Session | None:
        """The request's session: a valid cookie, or the token as a bearer."""
        if self._key is None:
            return None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and given:
            return Session("", True) if self.token_matches(given.strip()) else None
        value = _cookie(headers.get("cookie", ""), COOKIE)
        expires, _, rest = value.partition(".")
        nonce, _, mac = rest.partition(".")
        try:
            until = whole(expires, "cookie", 0, 2**62)
        except Refused:
            return None
        if not (nonce and mac) or until < self.clock():
            return None
        if not _same(mac, self._mac("session", expires, nonce)):
            return None
        return Session(nonce, False)

    def bearer_fails(self, headers: Mapping[str, str]) -> bool:
        """Whether the request sends a token as a bearer, and a wrong one."""
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if self._key is None or scheme.lower() != "bearer" or not given:
            return False
        return not self.token_matches(given.strip())

    def csrf(self, session: Session | None) -> str:
        return "" if session is None or session.bearer else self._mac("csrf", session.nonce)

    def may_read(self, headers: Mapping[str, str]) -> bool:
        return not self.protect_all or self.session(headers) is not None

    def refuse_post(self, headers: Mapping[str, str], form: Mapping[str, str]) -> str | None:
        """Why this POST may not act (None: it may)."""
        if self._key is None:
            return "actions are off: no http_token is configured on this replica"
        session = self.session(headers)
        if session is None:
            return "log in with the token first (or send Authorization: Bearer)"
        if session.bearer:
            return None
        cross = cross_site(headers)
        if cross:
            return cross
        if not _same(form.get("csrf", ""), self.csrf(session)):
            return "the form is stale or came from elsewhere: reload the page and try again"
        return None


def cross_site(headers: Mapping[str, str]) -> str | None:
    """Why a browser's request looks cross-site, from the headers browsers set themselves."""
    site = headers.get("sec-fetch-site")
    if site is not None and site not in SAME_SITE:
        return f"refused: a {site} request"
    origin = headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1] != headers.get("host", ""):
        return "refused: the request came from another origin"
    return None


def _bytes(text: str) -> bytes:
    """Any text as bytes, one way only (a lone surrogate too), for comparing."""
    return text.encode("utf-8", "surrogatepass")


def _same(given: str, expected: str) -> bool:
    """Constant-time, whatever characters the client sent (compare_digest takes only ASCII
    text)."""
    return hmac.compare_digest(_bytes(given), _bytes(expected))


def _cookie(header: str, name: str) -> str:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""
