"""A fleet scheduler: N identical replicas, each tick of each job run exactly once.

Users write jobs with :func:`job` and receive a :class:`RunContext`; an
application runs a replica in its own processes with :class:`Replica`.
"""

from typing import TYPE_CHECKING, Any

from scheduler.errors import ConfigError, SchedulerError
from scheduler.registry.context import Interrupted, RunContext
from scheduler.registry.jobs import job

if TYPE_CHECKING:
    from scheduler.replica import Replica

__all__ = ["ConfigError", "Interrupted", "Replica", "RunContext", "SchedulerError", "job"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`Replica` is imported when asked for: a job module importing `job` needs none of it."""
    if name == "Replica":
        from scheduler.replica import Replica

        return Replica
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
