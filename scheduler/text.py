"""Text from outside (a job's error, an instance name) made safe where it goes.

- `storable`: for the ledger. PostgreSQL text cannot hold NUL, and neither
  backend can store a lone surrogate (a file name decoded with
  `os.fsdecode`); both are escaped, and the length is capped.
- `printable`: for logs and terminals. Control characters (a newline that
  forges a log line, an escape sequence that rewrites the terminal) are
  escaped, so one line stays one line and says only what it says.
"""

from __future__ import annotations

import re

MAX_STORED = 2000  # characters of an error kept in the ledger

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]|\n|\r|\t")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def storable(text: str | None, limit: int = MAX_STORED) -> str | None:
    if text is None:
        return None
    text = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text).replace("\x00", "\\x00")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def printable(text: str | None) -> str:
    """One line, with control characters shown as escapes (`\\n`, `\\x1b`)."""
    if text is None:
        return ""
    if text.isprintable():  # the usual case, and cheap: no control character, no surrogate
        return text
    text = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", str(text))
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    if char in named:
        return named[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
