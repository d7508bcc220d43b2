"""The engine's beat entries (runs/beat.py), installed at every beat start, and the beat
process's shutdown (config/celery.py)."""

from __future__ import annotations

import time

import pytest
from django.db import connection, transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask, PeriodicTasks

from runs.beat import RECONCILE, TIMERS, install_beat_entries
from tests.processes import wait_for


def test_entries_are_installed_and_repaired(db) -> None:
    PeriodicTask.objects.filter(name__in=[TIMERS, RECONCILE]).delete()
    install_beat_entries(IntervalSchedule, PeriodicTask, reconcile_seconds=7)
    install_beat_entries(IntervalSchedule, PeriodicTask, reconcile_seconds=7)
    timers = PeriodicTask.objects.get(name=TIMERS)
    reconcile = PeriodicTask.objects.get(name=RECONCILE)
    assert (timers.task, timers.queue, timers.interval.every) == ("runs.fire_timers", "timers", 1)
    assert (reconcile.task, reconcile.queue, reconcile.interval.every) == (
        "runs.reconcile",
        "timers",
        7,
    )
    assert IntervalSchedule.objects.filter(every=7, period="seconds").count() == 1
    # Without a clock priority (the data migration), the default's; beat's start gives it.
    assert (timers.priority, reconcile.priority) == (None, None)
    install_beat_entries(IntervalSchedule, PeriodicTask, reconcile_seconds=7, clock_priority=0)
    assert [e.priority for e in PeriodicTask.objects.filter(name__in=[TIMERS, RECONCILE])] == [
        0,
        0,
    ]


def test_a_duplicate_interval_does_not_stop_the_install(db) -> None:
    # Nothing makes an interval unique: one added by hand in the admin for a user's own task
    # (or by two beats starting at once) used to make every later install raise
    # MultipleObjectsReturned, so beat started without repairing or updating the entries.
    oldest = IntervalSchedule.objects.filter(every=1, period="seconds").order_by("id").first()
    oldest = oldest or IntervalSchedule.objects.create(every=1, period="seconds")
    IntervalSchedule.objects.create(every=1, period="seconds")
    IntervalSchedule.objects.create(every=9, period="seconds")
    IntervalSchedule.objects.create(every=9, period="seconds")
    PeriodicTask.objects.filter(name=TIMERS).delete()
    install_beat_entries(IntervalSchedule, PeriodicTask, reconcile_seconds=9)
    assert PeriodicTask.objects.get(name=TIMERS).interval_id == oldest.id
    assert PeriodicTask.objects.get(name=RECONCILE).interval.every == 9
    assert IntervalSchedule.objects.filter(every=9, period="seconds").count() == 2


def _waits_for_lock(cursor, table: str) -> bool:
    """Whether one query of this database waits for a lock on ``table``."""
    # pg_stat_activity is read once a transaction (the caller holds the lock in one): read
    # it afresh each time, or a first look before the wait began is all it ever sees.
    cursor.execute("SELECT pg_stat_clear_snapshot()")
    cursor.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query LIKE %s",
        [f"%{table}%"],
    )
    return cursor.fetchone()[0] == 1


@pytest.mark.slow
def test_beat_stops_at_once_when_terminated_inside_a_database_call(
    celery_beat, celery_processes
) -> None:
    # Celery's own SIGTERM handler saved the schedule from inside the signal handler: landing
    # while beat's pass was in a query, that save waited for the connection's lock, held by
    # the interrupted query, and beat hung until SIGKILL. Hold beat inside a query (each pass
    # reads the schedule-change table, locked here), then terminate it.
    beat = celery_beat(env={"DJFLOW_LOG_CLOCK": "true"})
    # Past its start-up (the entries are installed): it ticks.
    wait_for(lambda: "Sending due task" in beat.logs(), timeout=10, message=beat.logs)
    table = PeriodicTasks._meta.db_table
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        wait_for(lambda: _waits_for_lock(cursor, table), timeout=10, message=beat.logs)
        beat.terminate()
        time.sleep(0.5)  # the signal is handled while the query waits
    wait_for(lambda: not beat.alive(), timeout=5, message=beat.logs)
    assert beat.returncode == 0, beat.logs()
    assert "beat: Shutting down..." in beat.logs()


@pytest.mark.slow
def test_beat_stops_at_once_when_terminated_inside_its_start_ups_queries(
    celery_beat, celery_processes
) -> None:
    # Building the DatabaseScheduler and the beat_init receivers query the database before
    # the first pass. Our handler was installed from a beat_init receiver, so a stop landing
    # in those queries still met Celery's saving handler, and beat hung until SIGKILL (CI,
    # test_beat_starts_on_the_test_database_and_stops). Hold beat in its start-up, stop it.
    table = PeriodicTasks._meta.db_table
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        beat = celery_beat(wait=False)
        wait_for(lambda: _waits_for_lock(cursor, table), timeout=20, message=beat.logs)
        assert "Sending due task" not in beat.logs()
        beat.terminate()
        time.sleep(0.5)  # the signal is handled while the query waits
    wait_for(lambda: not beat.alive(), timeout=5, message=beat.logs)
    assert beat.returncode == 0, beat.logs()
    assert "beat: Shutting down..." in beat.logs()
    assert "Sending due task" not in beat.logs()  # it stopped before its first pass


def test_a_second_stop_signal_ends_beat_at_once() -> None:
    """The first SIGTERM asks beat's loop to end after its pass; a pass stuck for long (a
    broker that is down: Celery retries for about 46 minutes) is left by a second one."""
    import os
    import signal
    from types import SimpleNamespace

    from config.celery import Beat

    stopped: list[bool] = []
    service = SimpleNamespace(stop=lambda wait=False: stopped.append(wait))
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        Beat.install_sync_handler(None, service)  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # Python runs the handler between two bytecodes of this thread
        assert stopped == [False]
        with pytest.raises(SystemExit):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert stopped == [False]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_the_clock_has_a_queue_of_its_own_and_a_plain_worker_consumes_it() -> None:
    from config.celery import app

    def queue_of(task: str) -> str:
        return app.amqp.router.route({}, task)["queue"].name

    assert queue_of("runs.fire_timers") == queue_of("runs.reconcile") == "timers"
    assert queue_of("runs.wake_timers") == "timers"
    assert queue_of("runs.advance") == "engine"
    assert {"default", "engine", "timers"} <= set(app.amqp.queues)


def test_a_broker_outage_while_the_tick_hands_runs_out_is_logged_not_raised(caplog) -> None:
    from unittest import mock

    from runs import dispatch

    with mock.patch(
        "config.celery.app.producer_or_acquire", side_effect=ConnectionError("broker down")
    ):
        dispatch.advance_many(["r1", "r2"])  # the reconciler advances them later
    assert "could not send advance for 2 runs" in caplog.text


def test_a_wake_up_goes_at_the_clocks_priority_and_a_broker_outage_is_logged(caplog) -> None:
    """A wake-up is sent like the tick, at the top of the broker's scale; a broker that is
    down costs only the wake-up (the tick fires its timers), logged, not raised."""
    from datetime import UTC, datetime
    from unittest import mock

    from config.celery import app
    from runs import dispatch

    eta = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    with mock.patch.object(app.amqp, "send_task_message") as send:
        dispatch.wake_timers_at(eta, until=None)
    assert send.call_args.kwargs["priority"] == dispatch.broker_priority(9)
    with mock.patch.object(
        app.amqp, "send_task_message", side_effect=ConnectionError("broker down")
    ):
        dispatch.wake_timers_at(eta, until=None)
    assert "could not send a wake-up of the clock" in caplog.text


def test_a_database_error_looking_for_the_next_timer_does_not_fail_the_tick(db, caplog) -> None:
    """The tick has fired what was due; a failed look for the next timer (the wake-up's) is
    logged, and the tick returns its count: the next tick looks again."""
    from unittest import mock

    from django.db import OperationalError

    from runs import tasks

    with mock.patch.object(tasks, "wake_before", side_effect=OperationalError("gone")):
        assert tasks.fire_timers() == 0
        assert tasks.wake_timers(until=None) == 0
        assert tasks.wake_timers(until=4102444800.0) == 0
    assert caplog.text.count("could not look for the next due timer") == 2


def test_a_wake_up_never_chains_past_the_next_tick_whatever_its_message_says(db) -> None:
    """``until`` comes from a message: one far in the future (a skewed clock, a hand-made
    message) is cut to the next tick as the worker sees it."""
    from datetime import timedelta
    from unittest import mock

    from django.utils import timezone

    from runs import tasks

    with mock.patch.object(tasks, "wake_before") as wake:
        before = timezone.now()
        tasks.wake_timers(until=4102444800.0)  # 2100
        after = timezone.now()
    [until] = wake.call_args.args
    assert before + timedelta(seconds=1) <= until <= after + timedelta(seconds=1)
    with mock.patch.object(tasks, "wake_before") as wake:
        soon = (timezone.now() + timedelta(milliseconds=300)).timestamp()
        tasks.wake_timers(until=soon)
    assert wake.call_args.args[0].timestamp() == soon


def test_beats_start_gives_the_clock_the_brokers_highest_priority(db) -> None:
    """What beat installs at its start, and what its scheduler then sends: the tick and the
    reconciler at the top of the broker's scale, ahead of any run's messages."""
    from django_celery_beat.schedulers import ModelEntry

    from config import celery as celery_config
    from runs.dispatch import broker_priority

    celery_config.install_beat_entries()
    for name in (TIMERS, RECONCILE):
        entry = ModelEntry(PeriodicTask.objects.get(name=name), app=celery_config.app)
        assert entry.options["priority"] == broker_priority(9)
        assert entry.options["queue"] == "timers"
