"""Errors the command line turns into one clear message and exit status 2."""


class ConfigError(Exception):
    """Bad configuration, job definitions or usage.

    The message alone must let the user fix the problem: it names the file,
    job, field and value at fault. The CLI prints it without a traceback.
    """


class PoolerError(ConfigError):
    """The database connection does not keep one server session across statements."""
