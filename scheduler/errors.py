"""Errors the command line turns into one clear message, and how any error is shown in one line."""

import re

SHOWN_MAX = 200  # longest value a message repeats
LINE_MAX = 500  # longest error line passed on from a driver or library

# A password in a URL: from the user name's colon to the last `@` of the word,
# so that an unencoded `@` in the password does not leave its tail shown.
_PASSWORD = re.compile(r"(://[^:/@\s]*):\S*@")
_OPTION_PASSWORD = re.compile(r"((?:ssl)?password=)(?:'[^']*'|[^\s&'\"]+)", re.IGNORECASE)


class SchedulerError(Exception):
    """An error the scheduler tells its user in one line, without a traceback.

    The command line exits 2 on any of them (`scheduler.cli.commands`).
    """


class ConfigError(SchedulerError):
    """Bad configuration, job definitions or usage.

    The message alone must let the user fix the problem: it names the file,
    job, field and value at fault. The CLI prints it without a traceback.
    """


class PoolerError(ConfigError):
    """The database connection does not keep one server session across statements."""


class LedgerError(SchedulerError):
    """The ledger (the database) failed a command's read or write: nothing to fix in the
    configuration, and the command can be tried again. The message says what was asked."""


def shorten(text: str, limit: int = SHOWN_MAX) -> str:
    """At most `limit` characters, an ellipsis marking the cut: hostile input stays readable."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(exc: BaseException) -> str:
    """The first line of an error (a driver's, under SQLAlchemy's wrapper), passwords hidden."""
    original = getattr(exc, "orig", None) or exc
    text = str(original).strip()
    line = text.splitlines()[0] if text else type(original).__name__
    line = _OPTION_PASSWORD.sub(r"\1***", _PASSWORD.sub(r"\1:***@", line))
    return shorten(line, LINE_MAX)
