"""A fleet scheduler: N identical replicas, each tick of each job run exactly once.

Users write jobs with :func:`job` and receive a :class:`RunContext`.
"""

from scheduler.context import Interrupted, RunContext
from scheduler.registry import job

__all__ = ["Interrupted", "RunContext", "job"]
__version__ = "0.1.0"
