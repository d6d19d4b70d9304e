"""Whether the live replicas agree on a job's schedule, and when the fleet is told."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from scheduler.fleet.agreement import Drift, Variant, live_schedules, step, words
from scheduler.ledger.registrations import Registration
from scheduler.observers import alerts

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
GRACE = timedelta(minutes=10)
EVERY_2S = '{"interval":2.0,"start":null}'
EVERY_1S = '{"interval":1.0,"start":null}'


def registration(instance: str, schedule: str | None, until: datetime | None = None):
    return Registration(instance, 7, "sync", schedule, T0 - timedelta(hours=1), until)


def test_live_replicas_are_grouped_by_schedule_and_gone_ones_left_out():
    found = live_schedules(
        [
            registration("r1", EVERY_2S),
            registration("r2", EVERY_1S),
            registration("r3", EVERY_2S),
            registration("gone", '{"cron":"0 2 * * *","timezone":"UTC"}'),
            registration("r4", EVERY_1S, until=T0),  # a schedule that was superseded
        ],
        live={"r1", "r2", "r3", "r4"},
    )
    assert found == {7: [Variant(EVERY_2S, ("r1", "r3")), Variant(EVERY_1S, ("r2",))]}
    assert [v.as_json() for v in found[7]] == [
        {"schedule": "every 2s", "instances": ["r1", "r3"]},
        {"schedule": "every 1s", "instances": ["r2"]},
    ]


def test_schedules_read_as_people_write_them():
    assert words('{"cron":"0 2 * * *","timezone":"Europe/Berlin"}') == (
        "cron 0 2 * * * in Europe/Berlin"
    )
    assert words('{"interval":90.0,"start":"2026-01-01T00:00:00+00:00"}') == (
        "every 1m30s from 2026-01-01T00:00:00+00:00"
    )
    assert words(None).startswith("not scheduled")
    assert words("{not json").startswith("unreadable")


def test_a_disagreement_is_told_once_after_the_grace_and_its_end_once():
    state, told = Drift(), []
    timeline = [(0, True), (300, True), (600, True), (900, True), (1000, False), (1100, False)]
    for seconds, differ in timeline:
        state, event = step(state, differ, T0 + timedelta(seconds=seconds), GRACE)
        told.append(event)
    assert told == [None, None, alerts.SCHEDULE_DRIFT, None, alerts.SCHEDULE_AGREED, None]
    assert state == Drift()


def test_a_rolling_deploy_shorter_than_the_grace_stays_quiet():
    state, told = Drift(), []
    for seconds, differ in [(0, True), (120, True), (240, False), (300, False)]:
        state, event = step(state, differ, T0 + timedelta(seconds=seconds), GRACE)
        told.append(event)
    assert told == [None, None, None, None] and state == Drift()
