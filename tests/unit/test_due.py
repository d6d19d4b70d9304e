"""Which ticks were due (scheduler.fleet.due): the rule, and that nothing else walks a schedule."""

from __future__ import annotations

import ast
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from scheduler.fleet import due
from scheduler.ledger.registrations import Registration
from scheduler.registry.catalog import schedule_text
from tests.unit.test_policies import job

PACKAGE = Path(due.__file__).resolve().parent
# What walks a schedule from any instant, the past included: only the one module (and
# scheduler.config.schedules, which defines them) may call these.
WALKERS = {"ticks_between", "ticks_after", "latest"}
ALLOWED = {PACKAGE / "due.py", PACKAGE / "schedules.py"}

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def walkers_called(path: Path) -> list[str]:
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            called = node.func
            name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", "")
            if name in WALKERS:
                found.append(f"{where}:{node.lineno} {name}")
        elif isinstance(node, ast.ImportFrom) and node.module == "scheduler.config.schedules":
            found += [
                f"{where}:{node.lineno} imports {a.name}" for a in node.names if a.name in WALKERS
            ]
    return found


def test_no_module_but_scheduler_due_walks_a_schedule_over_the_past():
    calls = [
        c
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in ALLOWED
        for c in walkers_called(path)
    ]
    assert calls == [], "ask scheduler.fleet.due which ticks were due instead"


def test_the_guard_sees_a_walk_written_any_way(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text(
        "from scheduler.config.schedules import ticks_between\n"
        "def f(trigger, a, b):\n"
        "    return ticks_between(trigger, a, b, 5) + trigger.latest(a, b, 1)\n"
        "def g(trigger, a):\n"
        "    return list(trigger.ticks_after(a))\n"
    )
    assert len(walkers_called(sneaky)) == 4


def every(seconds: int):
    return job(interval=f"{seconds}s")


def reg(
    seconds: int | None, since: datetime, until: datetime | None = None, instance: str = "r1"
) -> Registration:
    text = schedule_text(every(seconds)) if seconds is not None else None
    return Registration(instance, 5, "j5", text, since, until)


def seconds(ticks: list[datetime]) -> list[int]:
    return [int((t - T0).total_seconds()) for t in ticks]


def test_each_tick_is_judged_by_the_schedule_in_force_at_it():
    """2 s until a reload at +10 s, 3 s after it: no tick of either outside its time."""
    registered = [reg(2, T0, T0 + timedelta(seconds=10)), reg(3, T0 + timedelta(seconds=10))]
    found = due.InForce(registered).between(
        T0 - timedelta(minutes=1), T0 + timedelta(seconds=20), 100
    )
    assert seconds(found) == [0, 2, 4, 6, 8, 12, 15, 18]  # 10: a 2 s tick the 3 s grid lacks


def test_a_tick_when_no_schedule_was_in_force_was_never_due():
    registered = [reg(2, T0 + timedelta(seconds=5))]
    found = due.InForce(registered).between(
        T0 - timedelta(minutes=1), T0 + timedelta(seconds=10), 100
    )
    assert seconds(found) == [6, 8, 10]
    assert due.InForce([]).between(T0, T0 + timedelta(hours=1), 100) == []
    assert due.InForce([reg(None, T0)]).between(T0, T0 + timedelta(seconds=9), 100) == []


def test_replicas_that_differ_agree_only_on_common_ticks():
    registered = [reg(2, T0, instance="r-old"), reg(3, T0, instance="r-new")]
    found = due.InForce(registered).between(T0, T0 + timedelta(seconds=20), 100)
    assert seconds(found) == [6, 12, 18]


def test_the_latest_ticks_only_and_none_for_nothing():
    found = due.InForce([reg(1, T0)]).between(T0, T0 + timedelta(days=30), 3)
    assert seconds(found) == [30 * 86400 - 2, 30 * 86400 - 1, 30 * 86400]
    assert due.InForce([reg(1, T0)]).between(T0, T0 + timedelta(seconds=5), 0) == []


@pytest.mark.parametrize("live", [{"r1", "r2"}, {"r1"}])
def test_the_next_ticks_are_those_the_live_replicas_fire(live):
    registered = [reg(2, T0, instance="r1"), reg(3, T0, instance="r2")]
    found = due.upcoming(every(5), registered, live, T0 + timedelta(seconds=1), 4)
    assert seconds(found) == ([2, 3, 4, 6] if "r2" in live else [2, 4, 6, 8])
    # No live replica registered it yet: this config.yaml's own schedule.
    assert seconds(due.upcoming(every(5), registered, set(), T0, 2)) == [0, 5]


def test_a_changed_schedule_starts_at_its_first_tick_from_the_change():
    assert due.first_from(every(5), T0 + timedelta(seconds=1)) == T0 + timedelta(seconds=5)
    assert due.first_from(every(5), T0) == T0


def test_schedules_that_differ_are_walked_as_far_as_the_due_ticks_asked_for():
    """During a rolling deploy only the common ticks (every 15 s) were due: the latest
    one is found however many ticks of each schedule lie after it."""
    registered = [reg(5, T0, instance="r-old"), reg(3, T0, instance="r-new")]
    end = T0 + timedelta(seconds=44)
    assert seconds(due.InForce(registered).between(T0, end, 1)) == [30]
    assert seconds(due.InForce(registered).between(T0, end, 2)) == [15, 30]
    assert seconds(due.InForce(registered).between(T0, end, 5)) == [15, 30]


def test_a_look_walks_a_bounded_number_of_ticks(monkeypatch):
    """A schedule in force that never fires, beside one that does: nothing was due, and
    finding so walks at most WALK_LIMIT ticks of each schedule."""
    walked: list[int] = []
    walk = due.ticks_between

    def counted(trigger, after, until, limit):
        walked.append(limit)
        return walk(trigger, after, until, limit)

    monkeypatch.setattr(due, "WALK_LIMIT", 1000)
    monkeypatch.setattr(due, "ticks_between", counted)
    registered = [reg(1, T0, instance="r1"), reg(None, T0, instance="r2")]
    assert due.InForce(registered).between(T0, T0 + timedelta(days=7), 10) == []
    assert walked == [10, 40, 160, 640, 1000]
