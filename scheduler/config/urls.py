"""Database and notice URLs: validated when configured, shown without their secrets.

A leaf module: no database code. A database URL is checked with libpq's URI
rules, stricter where libpq would silently guess: ``postgresql://u:p@ss@h/db``
is read by libpq as password ``p`` on host ``ss@h``, so any ``@``, ``#``,
``/`` or ``?`` of a password must be percent-encoded, and this module says so
without ever repeating what it was given (a fragment of the URL may be a
fragment of the password).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")
SECRET_OPTIONS = frozenset({"password", "sslpassword"})
HIDDEN = "***"
UNPARSEABLE = "postgresql://…"

_ENCODE = (
    "special characters in the user name and password must be percent-encoded "
    "(`@` as %40, `:` as %3A, `/` as %2F, `?` as %3F, `#` as %23, `%` as %25)"
)
_CONTROL = re.compile(r"[\s\x00-\x1f\x7f]")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_HOST = re.compile(r"[A-Za-z0-9._~%!$&'()*+;=-]*")
_IPV6 = re.compile(r"[0-9A-Za-z:.%]+")  # with a zone: fe80::1%25eth0
_SHORT_SECRET = 4  # shorter secrets are scrubbed only where they stand alone


@dataclass(frozen=True)
class DatabaseUrl:
    """The parts of a valid database URL, as written (still percent-encoded)."""

    user: str | None
    password: str | None
    hosts: str
    dbname: str | None
    options: tuple[tuple[str, str], ...]

    @property
    def option_names(self) -> frozenset[str]:
        """The query options it sets (decoded, as libpq reads them)."""
        return frozenset(unquote(key) for key, _ in self.options)

    @property
    def host_count(self) -> int:
        """How many hosts libpq may try, named before the path or in a `host` option."""
        named = [self.hosts] + [
            unquote(value) for key, value in self.options if unquote(key) in ("host", "hostaddr")
        ]
        return max((len(hosts.split(",")) for hosts in named if hosts), default=1)

    def secrets(self) -> list[str]:
        """Every password in the URL, as written and decoded."""
        found = [] if self.password is None else [self.password, unquote(self.password)]
        for key, value in self.options:
            if unquote(key) in SECRET_OPTIONS:
                found += [value, unquote(value)]
        return [secret for secret in dict.fromkeys(found) if secret]


def parse_database_url(url: str) -> DatabaseUrl:
    """Split a ``postgresql://`` URL; ValueError says what is wrong, never with what."""
    scheme, separator, rest = url.partition("://")
    if not separator or scheme not in SCHEMES:
        raise ValueError("must be a postgresql:// URL (leave it unset for the embedded mode)")
    if _CONTROL.search(rest):
        raise ValueError(f"contains a space or a control character; {_ENCODE}")
    if "#" in rest:
        raise ValueError(f"contains `#`; {_ENCODE}")
    if _BAD_ESCAPE.search(rest):
        raise ValueError(f"has a `%` not followed by two hexadecimal digits; {_ENCODE}")
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, remainder = rest[:end], rest[end:]
    if authority.count("@") > 1:
        raise ValueError(f"has more than one `@` before the host; {_ENCODE}")
    if "@" in remainder:
        raise ValueError(f"has an `@` after a `/` or `?`; {_ENCODE}")
    userinfo, at, hosts = authority.rpartition("@")
    user = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        password = secret if colon else None
    for host in hosts.split(",") if hosts else []:
        _check_host(host)
    path, _, query = remainder.partition("?")
    options = tuple(_options(query)) if query else ()
    for key, value in options:
        if unquote(key) == "port":
            for port in unquote(value).split(","):
                _check_port(port)
    return DatabaseUrl(
        user=user,
        password=password,
        hosts=hosts,
        dbname=path[1:] if path else None,
        options=options,
    )


def validate_database_url(url: str) -> str:
    """The URL itself when libpq and SQLAlchemy will read it as written; else ValueError."""
    parse_database_url(url)
    return url


def libpq_url(url: str) -> str:
    """The URL as libpq (psycopg.connect) takes it: a multi-host URL stays one string."""
    return "postgresql://" + url.partition("://")[2]


def _check_host(host: str) -> None:
    if host.startswith("["):
        close = host.find("]")
        if close < 0:
            raise ValueError("has an IPv6 address without its closing `]`")
        address, after = host[1:close], host[close + 1 :]
        if not _IPV6.fullmatch(address):
            raise ValueError(f"has an invalid IPv6 address; {_ENCODE}")
        if after and not after.startswith(":"):
            raise ValueError(f"has text after an IPv6 address; {_ENCODE}")
        if after:
            _check_port(after[1:])
        return
    name, colon, port = host.partition(":")
    if not _HOST.fullmatch(name):
        raise ValueError(f"has an invalid host name; {_ENCODE}")
    if colon:
        _check_port(port)


def _check_port(port: str) -> None:
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"has an invalid port (a number from 1 to 65535); {_ENCODE}")


def _options(query: str) -> Iterable[tuple[str, str]]:
    for item in query.split("&"):
        if not item:
            continue
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise ValueError("has a query option that is not name=value")
        yield key, value


def redact_database_url(url: str) -> str:
    """The URL with every password hidden; never raises (an unparseable URL shows nothing)."""
    try:
        parts = parse_database_url(url)
    except Exception:
        return UNPARSEABLE
    shown = "postgresql://"
    if parts.user is not None:
        shown += parts.user + ("" if parts.password is None else f":{HIDDEN}") + "@"
    shown += parts.hosts
    if parts.dbname is not None:
        shown += "/" + parts.dbname
    if parts.options:
        shown += "?" + "&".join(
            f"{key}={HIDDEN if unquote(key) in SECRET_OPTIONS else value}"
            for key, value in parts.options
        )
    return shown


def database_url_secrets(url: str) -> list[str]:
    """The passwords a message about this URL must not contain (a best guess if unparseable)."""
    try:
        return parse_database_url(url).secrets()
    except Exception:
        pass
    rest = url.partition("://")[2]
    password = rest.rpartition("@")[0].partition(":")[2]
    found = [password, *re.split(r"[@:/?#&=]", password)]
    found += re.findall(r"password=([^&\s]+)", rest)
    return [secret for secret in dict.fromkeys(found) if len(secret) >= _SHORT_SECRET]


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret, as given, percent-decoded or percent-encoded, replaced.

    Secrets of fewer than four characters are replaced only where they stand
    alone, so that a one-letter password does not blank out every message.
    """
    forms: set[str] = set()
    for secret in secrets:
        forms.update(form for form in (secret, unquote(secret), quote(secret, safe="")) if form)
    if not forms:
        return text
    patterns = [
        re.escape(form)
        if len(form) >= _SHORT_SECRET
        else rf"(?<![A-Za-z0-9]){re.escape(form)}(?![A-Za-z0-9])"
        for form in sorted(forms, key=len, reverse=True)
    ]
    return re.sub("|".join(patterns), HIDDEN, text)


def validate_http_url(url: str) -> str:
    """An http(s) URL with a host and a valid port; ValueError never repeats it."""
    if _CONTROL.search(url):
        raise ValueError("contains a space or a control character")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("is not a valid URL (an IPv6 host needs [brackets])") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("has no host (expected http(s)://host/...)")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError("has an invalid port (a number from 1 to 65535)")
    return url


def redact_http_url(url: str) -> str:
    """Scheme and host only: webhook paths and queries carry secrets. Never raises."""
    try:
        parts = urlsplit(url)
    except Exception:
        return "…"
    scheme = parts.scheme if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,15}", parts.scheme) else "?"
    try:
        host = parts.hostname or "?"
    except Exception:
        host = "?"
    if not re.fullmatch(r"[A-Za-z0-9._:-]{1,100}", host):
        host = "?"
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except Exception:
        port = None
    return f"{scheme}://{host}{f':{port}' if port else ''}/…"
