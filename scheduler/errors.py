"""Errors the command line turns into one clear message, and how any error is shown in one line."""

import re

_PASSWORD = re.compile(r"(://[^:/@\s]+):[^@\s]*@")


class ConfigError(Exception):
    """Bad configuration, job definitions or usage.

    The message alone must let the user fix the problem: it names the file,
    job, field and value at fault. The CLI prints it without a traceback.
    """


class PoolerError(ConfigError):
    """The database connection does not keep one server session across statements."""


def one_line(exc: BaseException) -> str:
    """The first line of an error (a driver's, under SQLAlchemy's wrapper), passwords hidden."""
    original = getattr(exc, "orig", None) or exc
    text = str(original).strip()
    line = text.splitlines()[0] if text else type(original).__name__
    return _PASSWORD.sub(r"\1:***@", line)
