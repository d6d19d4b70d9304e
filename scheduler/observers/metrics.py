"""Prometheus metrics: an observer of the gate's outcomes (and of alerts and the session).

Counters count what this replica did; since every tick is claimed, run,
skipped or missed by exactly one replica, summing a counter over the fleet
gives the fleet's figure without double counting.
"""

from __future__ import annotations

import time
from enum import StrEnum

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from scheduler.observers import events
from scheduler.statuses import Status

DURATION_BUCKETS = (0.005, 0.05, 0.25, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600)
# `_created` series only add noise to every scrape (prometheus_client leaves this untyped).
disable_created_metrics()  # type: ignore[no-untyped-call]

LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 60)


class Delivery(StrEnum):
    """The `result` label of `scheduler_webhook_deliveries_total`."""

    OK = "ok"
    FAILED = "failed"


class Metrics(events.Observer):
    def __init__(self, jobs: list[str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.runs = Counter(
            "scheduler_job_runs",
            "Runs finished by this replica, by outcome.",
            ["job", "status"],
            registry=r,
        )
        self.skips = Counter(
            "scheduler_job_skips",
            "Ticks this replica recorded as skipped (the previous run was still going).",
            ["job"],
            registry=r,
        )
        self.missed = Counter(
            "scheduler_job_missed",
            "Ticks this replica recorded as missed.",
            ["job"],
            registry=r,
        )
        self.timeouts = Counter(
            "scheduler_job_timeouts",
            "Runs of the job on this replica that passed its timeout.",
            ["job"],
            registry=r,
        )
        self.retries = Counter(
            "scheduler_job_retries",
            "Retries (attempts after a tick's first) this replica started.",
            ["job"],
            registry=r,
        )
        self.caught_up = Counter(
            "scheduler_job_caught_up",
            "Ticks missed while the fleet was down that this replica ran (catch_up: all).",
            ["job"],
            registry=r,
        )
        self.schedule_drift = Gauge(
            "scheduler_job_schedule_drift",
            "1 while the job's live replicas run different schedules (refreshed every 30 s).",
            ["job"],
            registry=r,
        )
        self.paused = Counter(
            "scheduler_job_paused_ticks",
            "Ticks this replica recorded as paused (the job was paused for the fleet).",
            ["job"],
            registry=r,
        )
        self.consecutive_skips = Gauge(
            "scheduler_job_consecutive_skips",
            "The job's fleet-wide streak of skipped ticks, as last seen by this replica.",
            ["job"],
            registry=r,
        )
        self.duration = Histogram(
            "scheduler_job_duration_seconds",
            "How long runs took.",
            ["job"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.lateness = Histogram(
            "scheduler_job_lateness_seconds",
            "Start of a run minus its scheduled time (database clock).",
            ["job"],
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        self.last_success = Gauge(
            "scheduler_job_last_success_timestamp_seconds",
            "When a run of the job last succeeded on this replica (Unix time).",
            ["job"],
            registry=r,
        )
        self.running = Gauge(
            "scheduler_job_running",
            "Runs of the job executing on this replica now.",
            ["job"],
            registry=r,
        )
        self.alerts = Counter(
            "scheduler_alerts",
            "Alerts and recovery notices raised by this replica.",
            ["event", "job"],
            registry=r,
        )
        self.webhook = Counter(
            "scheduler_webhook_deliveries",
            "Webhook delivery attempts, by result.",
            ["event", "result"],
            registry=r,
        )
        self.session_up = Gauge(
            "scheduler_lock_session_up",
            "1 while this replica's lock session is up.",
            registry=r,
        )
        self.lock_lost = Counter(
            "scheduler_lock_lost",
            "Times this replica lost its lock session (and every lock).",
            registry=r,
        )
        self.runs_lost = Counter(
            "scheduler_job_lock_lost",
            "Runs told their lock was lost (ctx.lock_lost).",
            ["job"],
            registry=r,
        )
        self.stray_locks = Counter(
            "scheduler_stray_locks_released",
            "Job locks the heartbeat found held with no run of the job in flight, released.",
            ["job"],
            registry=r,
        )
        for job in jobs or []:
            self.consecutive_skips.labels(job=job).set(0)
            self.running.labels(job=job).set(0)

    def run_started(self, event: events.RunStarted) -> None:
        if event.attempt > 1:
            self.retries.labels(job=event.job).inc()
        elif event.caught_up:
            self.caught_up.labels(job=event.job).inc()
        else:  # retries and caught-up ticks are late by design: not lateness
            self.lateness.labels(job=event.job).observe(max(0.0, event.lateness_s))
        self.consecutive_skips.labels(job=event.job).set(0)
        self.running.labels(job=event.job).inc()

    def run_finished(self, event: events.RunFinished) -> None:
        self.runs.labels(job=event.job, status=event.status).inc()
        self.duration.labels(job=event.job).observe(event.duration_s)
        self.running.labels(job=event.job).dec()
        if event.status == Status.SUCCEEDED:
            self.last_success.labels(job=event.job).set(time.time())

    def tick_skipped(self, event: events.TickSkipped) -> None:
        self.skips.labels(job=event.job).inc()
        self.consecutive_skips.labels(job=event.job).set(event.consecutive_skips)

    def tick_missed(self, event: events.TickMissed) -> None:
        self.missed.labels(job=event.job).inc()

    def run_timed_out(self, event: events.RunTimedOut) -> None:
        self.timeouts.labels(job=event.job).inc()

    def tick_paused(self, event: events.TickPaused) -> None:
        self.paused.labels(job=event.job).inc()

    def lock_session_up(self, event: events.LockSessionUp) -> None:
        self.session_up.set(1)

    def lock_session_lost(self, event: events.LockSessionLost) -> None:
        self.session_up.set(0)
        self.lock_lost.inc()
        for job in event.runs:
            self.runs_lost.labels(job=job).inc()

    def locks_released(self, event: events.LocksReleased) -> None:
        if event.after is None:  # a stray found by the check, not a failed claim's leftovers
            for key, name in event.jobs:
                self.stray_locks.labels(job=name or str(key)).inc()

    def alert(self, name: str, job: str) -> None:
        self.alerts.labels(event=name, job=job).inc()

    def delivery(self, name: str, ok: bool) -> None:
        self.webhook.labels(event=name, result=Delivery.OK if ok else Delivery.FAILED).inc()

    def streaks(self, skips: dict[str, int]) -> None:
        """The fleet's streaks as read from the ledger (housekeeping refreshes them)."""
        for job, count in skips.items():
            self.consecutive_skips.labels(job=job).set(count)

    def drift(self, drifting: dict[str, bool]) -> None:
        """Whether each job's live replicas disagree, as the ledger says (housekeeping)."""
        for job, differ in drifting.items():
            self.schedule_drift.labels(job=job).set(1 if differ else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
