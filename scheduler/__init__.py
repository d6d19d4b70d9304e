"""A fleet scheduler: N identical replicas, each tick of each job run exactly once.

Users write jobs with :func:`job` and receive a :class:`RunContext`.
"""

from scheduler.errors import ConfigError, SchedulerError
from scheduler.registry.context import Interrupted, RunContext
from scheduler.registry.jobs import job

__all__ = ["ConfigError", "Interrupted", "RunContext", "SchedulerError", "job"]
__version__ = "0.1.0"
