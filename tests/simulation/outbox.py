"""The outbox's delivery in a simulated fleet: each replica's real `Notices`, with no thread.

A replica delivers the notices its claims and finishes raised (the gate's events reach
its `Notices` as they would in the daemon); the simulation pumps what is due after each
step. A `Receiver` stands in for the webhook: it takes the POST at once and answers it at
the replica's next pump, failing the first attempts of some notices, so a replica that dies
in between has delivered a notice it never marked delivered (at least once). A replica that
dies holding a lease leaves its notices to whichever replica adopts them once the lease has
run out. The outbox's clock is the database's (which wrote the leases), moved on by a
lease's length each time a replica dies and as the fleet settles: a dead replica's
leases run out (and so may a live one's: it and the adopter both deliver, at least once).
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine

from scheduler.ledger.outbox import adopt_notices
from scheduler.observers import events
from scheduler.observers.notices import Notices

URL = "http://receiver.invalid/hook"


class Receiver:
    """The webhook: every POST it took, by notice id; some notices' first attempts fail."""

    def __init__(self) -> None:
        self.delivered: Counter[int] = Counter()  # notice id -> POSTs answered 2xx
        self.attempts: Counter[int] = Counter()

    def take(self, body: bytes) -> str | None:
        """One POST: None when it is delivered, else the error the sender sees."""
        notice = int(json.loads(body)["notice_id"])
        self.attempts[notice] += 1
        fails = 2 if notice % 5 == 0 else 1 if notice % 3 == 0 else 0
        if self.attempts[notice] <= fails:
            return "HTTP 503 from the receiver (simulated)"
        self.delivered[notice] += 1
        return None


class Courier:
    """The POSTs of one replica: taken by the receiver at once, answered at the next pump."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.answers: list[tuple[Callable[[str | None], None], str | None]] = []

    def send(
        self,
        url: str,
        body: bytes,
        content_type: str | None = None,
        then: Callable[[str | None], None] | None = None,
    ) -> bool:
        error = self.receiver.take(body)
        if then is not None:
            self.answers.append((then, error))
        return True

    def answer(self) -> None:
        answers, self.answers = self.answers, []
        for then, error in answers:
            then(error)

    def close(self, timeout: float) -> None:
        self.answers = []


class SimNotices(Notices):
    """A replica's `Notices`, pumped by the simulation instead of a thread of its own."""

    def __init__(
        self,
        engine: Engine,
        instance: str,
        receiver: Receiver,
        clock: Callable[[], datetime],
        monotonic: Callable[[], float],
    ) -> None:
        super().__init__(engine, instance, URL, clock=clock, monotonic=monotonic)
        self.courier = Courier(receiver)  # type: ignore[assignment]
        self.failed = 0  # pumps the ledger was away for (the real loop logs, goes on)

    def schedule(self, ids: tuple[int, ...] | list[int], delay: float = 0.0) -> None:
        due = self.monotonic() + delay
        for notice in ids:
            heapq.heappush(self._due, (due, notice))

    def pump(self) -> None:
        """What the thread would have done by now: the answers come in, due notices go."""
        try:
            self.courier.answer()  # type: ignore[attr-defined]
            ids = []
            while self._due and self._due[0][0] <= self.monotonic():
                notice = heapq.heappop(self._due)[1]
                if notice not in self._sending:
                    ids.append(notice)
            if ids:
                self.deliver(ids)
        except Exception:
            self.failed += 1  # the leases run out, others adopt

    def adopt_now(self) -> int:
        """What housekeeping does: adopt in its transaction, hand over once committed."""
        try:
            with self.engine.begin() as conn:
                ids = adopt_notices(conn, self.instance, self.clock())
        except Exception:
            self.failed += 1
            return 0
        self.schedule(ids)
        return len(ids)


def outbox_clock(ahead: Callable[[], float]) -> Callable[[], datetime]:
    """The database's clock (which wrote each notice's lease), `ahead()` seconds on."""
    return lambda: datetime.now(UTC) + timedelta(seconds=ahead())


class Heard(events.Observer):
    """What a replica's gate said about alerts: (event, job key, notice ids, the flags)."""

    def __init__(self, heard: list[tuple[str, int, tuple[int, ...], dict[str, Any]]]) -> None:
        self.heard = heard

    def tick_skipped(self, event: events.TickSkipped) -> None:
        if event.alert or event.notices:
            self.heard.append(("skipped", event.key, event.notices, {"alert": event.alert}))

    def run_finished(self, event: events.RunFinished) -> None:
        flags = {
            "failures_alert": event.failures_alert,
            "failures_recovered": event.failures_recovered,
            "skips_recovered": event.skips_recovered,
        }
        if any(flags.values()) or event.notices:
            self.heard.append(("finished", event.key, event.notices, flags))
