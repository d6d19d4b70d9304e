"""Embedded job locks on a shared host: files removed under their holders, files left open
to others by an older version, descriptors a job closes. No run may start beside another."""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import threading

import pytest

from scheduler.backends.base import Outcome, SessionLost
from scheduler.backends.embedded_keeper import EXIT_RESTART
from scheduler.errors import ConfigError
from scheduler.gate import Gate
from scheduler.observers import events
from tests.support import Recorder, make_job, now_tick, wait_for
from tests.unit.embedded_helpers import (
    KEY,
    NAMESPACE,
    Replica,
    claim,
    finish,
    mode,
    nobody,
    opened,
    replica,
    statuses,
    tick,
)

OTHER = 78


@pytest.fixture
def replicas(tmp_path):
    with opened(tmp_path) as make:
        yield make


# -- 1. lock files and folders removed under running replicas --------------------------


def test_a_lock_file_removed_under_its_run_lets_no_other_replica_start_the_job(replicas):
    a, b = replicas("a"), replicas("b")
    first = claim(a, tick(10))
    assert first.outcome is Outcome.RUN
    a.locks.path(KEY).unlink()  # a temp cleaner

    second = claim(b, tick(9))
    assert (second.outcome, second.holder) == (Outcome.SKIPPED, "a")
    assert statuses(a)[first.scheduled_at] == "running"  # not marked crashed

    assert a.keep_once()  # the holder takes its lock back on the file now at the path
    assert claim(b, tick(8)).outcome is Outcome.SKIPPED
    finish(a, first)
    assert claim(b, tick(7)).outcome is Outcome.RUN  # and the job goes on once it is over


def test_a_lock_folder_removed_under_running_replicas_is_made_again_by_itself(replicas):
    a, b = replicas("a"), replicas("b")
    assert claim(a, tick(10)).outcome is Outcome.RUN
    shutil.rmtree(a.locks.folder)  # rm -rf scheduler.db.locks

    assert claim(b, tick(9)).outcome is Outcome.SKIPPED  # a's run goes on
    assert claim(b, tick(9), key=OTHER).outcome is Outcome.RUN  # every other job runs
    assert a.keep_once() and b.keep_once()
    assert {i["name"] for i in a.live_instances(None)} == {"a", "b"}
    assert a.locks.held_now([KEY, OTHER]) == {KEY, OTHER}
    assert mode(a.locks.folder) == 0o700
    said = {i["name"]: i["note"] for i in a.live_instances(None)}
    assert "took back the locks of job key(s) 77" in said["a"]
    # b's claim found the folder gone and made it before any keeper looked: still said
    assert "the lock folder" in said["b"] and "made it again" in said["b"], said


def test_presence_files_removed_are_made_again(replicas):
    a, b = replicas("a"), replicas("b")
    for path in (a.locks.folder / "instances").iterdir():
        path.unlink()
    assert a.live_instances(None) == []
    assert a.keep_once() and b.keep_once()
    assert {i["name"] for i in a.live_instances(None)} == {"a", "b"}


def test_a_lock_another_process_took_on_the_new_file_is_a_lost_session(replicas):
    a = replicas("a")
    assert claim(a, tick(3)).outcome is Outcome.RUN
    path = a.locks.path(KEY)
    path.unlink()
    squatter = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(squatter, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert not a.keep_once()
        fd = a.fileno()
        assert fd is not None and select.select([fd], [], [], 1)[0]  # the gate wakes
        with pytest.raises(SessionLost, match="another process holds the new one"):
            a.check_alive()
    finally:
        os.close(squatter)


def test_a_run_whose_lock_file_was_taken_over_is_told_lock_lost(tmp_path):
    """Through the gate's own dispatcher: the keeper's news reaches the run."""
    told = threading.Event()
    started = threading.Event()

    def long(ctx):
        started.set()
        if ctx.lock_lost.wait(15):
            told.set()

    job = make_job(KEY, long, name="long")
    backend = Replica(tmp_path / "scheduler.db", "g1", keep_every=0.05)
    backend.migrate()
    seen = Recorder()
    gate = Gate(backend, instance="g1", max_workers=2, holder_timeout=30, listeners=[seen])
    gate.start()
    squatter = None
    try:
        gate.submit(job, now_tick())
        assert started.wait(20)
        path = backend.locks.path(KEY)
        path.unlink()
        squatter = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(squatter, fcntl.LOCK_EX | fcntl.LOCK_NB)
        wait_for(told.is_set, 10, "the run to be told its lock is lost")
        wait_for(lambda: seen.of(events.LockSessionLost), 10, "the lost session's event")
    finally:
        if squatter is not None:
            os.close(squatter)
        gate.stop(5)


# -- 3. files an older version left open to other users ---------------------------------


def test_lock_files_an_older_version_left_open_to_others_are_replaced(tmp_path):
    """0755 folder and 0644 lock files; another user opened one back then and holds it."""
    folder = tmp_path / "scheduler.db.locks"
    (folder / "instances").mkdir(parents=True)
    for made in (folder, folder / "instances"):
        made.chmod(0o755)
    old = folder / f"{NAMESPACE}-{KEY}.lock"
    old.touch()
    old.chmod(0o644)
    theirs = os.open(old, os.O_RDONLY)  # opened while it was open to all, and kept
    fcntl.flock(theirs, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        a = replica(tmp_path, "a", connect=False)
        a.verify()
        a.connect()
        assert (mode(folder), mode(folder / "instances"), mode(old)) == (0o700, 0o700, 0o600)
        assert claim(a, tick()).outcome is Outcome.RUN  # their lock holds nothing now
        a.close()
    finally:
        os.close(theirs)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")
def test_a_lock_file_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "scheduler.db.locks"
    (folder / "instances").mkdir(parents=True, mode=0o700)
    theirs = folder / f"{NAMESPACE}-{KEY}.lock"
    theirs.touch(mode=0o600)
    os.chown(theirs, *nobody())
    a = replica(tmp_path, "a", connect=False)
    with pytest.raises(ConfigError, match="not a file of this user's; remove it"):
        a.verify()


# -- 5. a job that closes descriptors it did not open -----------------------------------


def test_a_closed_lock_descriptor_ends_the_replica_and_no_second_run_starts(replicas):
    a, b = replicas("a"), replicas("b")
    first = claim(a, tick(10))
    os.close(a.locks._held[KEY].fd)  # the job's os.closerange(3, 1000): the flock is gone

    second = claim(b, tick(9))
    assert (second.outcome, second.holder) == (Outcome.SKIPPED, "a")  # a still lives

    assert not a.keep_once()
    assert a.exits == [EXIT_RESTART] and "closed under it" in (a.broken or "")
    a.locks.release_all()  # the process ends
    third = claim(b, tick(8))
    assert (third.outcome, third.crashed) == (Outcome.RUN, 1)
    assert statuses(b)[first.scheduled_at] == "crashed"


def test_a_presence_file_that_cannot_be_made_again_is_a_lost_session(replicas, monkeypatch):
    a = replicas("a")
    a.locks.presence_path.unlink()

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(a.locks, "_join", full)
    assert not a.keep_once()
    with pytest.raises(SessionLost, match="cannot make the presence file again"):
        a.check_alive()


def test_a_replica_whose_descriptors_were_closed_writes_nothing_more_to_the_ledger(replicas):
    """SQLite would write to its old descriptor numbers, whatever a job has opened on them
    since: the check comes before every statement, not at the keeper's next look."""
    a, b = replicas("a"), replicas("b")
    os.close(a.locks._presence.fd)  # the job's os.closerange(3, 1000)
    with pytest.raises(SessionLost, match="closed under it"):
        claim(a, tick())
    assert a.exits == [EXIT_RESTART]
    assert statuses(b) == {}


# -- 6. a lock given back on purpose ------------------------------------------------------


def test_a_lock_given_back_after_a_lost_reply_lets_the_next_claim_run(replicas):
    """A claim whose reply was lost leaves a `running` row that no run is behind, and its
    replica gives the lock back (it runs nothing of the job). The next claim elsewhere must
    run the job and mark that row crashed, as on PostgreSQL, not skip the job for as long
    as the first replica lives (the file still named it)."""
    a, b = replicas("a"), replicas("b")
    first = claim(a, tick(10))
    assert first.outcome is Outcome.RUN
    assert a.release_strays(set()) == [KEY]

    second = claim(b, tick(9))
    assert (second.outcome, second.crashed) == (Outcome.RUN, 1)
    assert statuses(b)[first.scheduled_at] == "crashed"


def test_a_lock_let_go_without_being_given_back_still_proves_nothing(replicas):
    """Only a replica's own give-back says its run is over: a lock released otherwise (the
    job closed the descriptor, a claim that could not prove its lock) keeps the job held."""
    a, b = replicas("a"), replicas("b")
    first = claim(a, tick(10))
    a.locks.unlock(KEY)  # released, but not given back: the run may go on
    assert claim(b, tick(9)).outcome is Outcome.SKIPPED
    assert statuses(b)[first.scheduled_at] == "running"
