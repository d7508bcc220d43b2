"""Schedules end to end on real ``celery worker`` and TWO ``celery beat`` processes (the
DatabaseScheduler), Postgres and Redis: an interval schedule and an on-the-minute cron fire,
each fire starts exactly one run although both beats send a message for every slot, the runs
complete on the worker with the schedule's input, and a start missed while every beat was
down is made once when a beat comes back."""

from __future__ import annotations

import itertools
import re
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.utils import timezone

from runs.models import Run
from schedules import services
from schedules.models import Schedule
from tests.processes import wait_for
from workflows.models import Workflow

from ..runs.flows import EFFECTS_TABLE, ensure_effects_table
from ..runs.test_timers_e2e import all_finished

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.schedules.flows_schedules"]
EVERY = timedelta(seconds=3)
# A fire more than this late counts as missed (the worker's setting).
GRACE_SECONDS = "1.5"


@pytest.fixture(autouse=True)
def _effects_table(transactional_db):
    ensure_effects_table()


def slot_of(run: Run) -> datetime:
    """The slot a run was started for, from its idempotency key (schedule:<id>:<slot>)."""
    return datetime.fromisoformat(run.idempotency_key.split(":", 2)[2])


def runs_of(schedule: Schedule) -> list[Run]:
    return list(Run.objects.filter(correlation=f"schedule:{schedule.pk}").order_by("created_at"))


def fires_received(logs: str) -> int:
    """``schedules.fire`` messages the worker received (of every schedule)."""
    return len(re.findall(r"Task schedules\.fire\[[^\]]+\] received", logs))


def ticks_per_run(run_ids: list) -> Counter:
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT run_id, count(*) FROM {EFFECTS_TABLE}"
            " WHERE step = 'tick' AND run_id = ANY(%s) GROUP BY run_id",
            [[str(r) for r in run_ids]],
        )
        return Counter(dict(cursor.fetchall()))


def test_two_beats_each_slot_starts_one_run_and_a_returning_beat_catches_up_once(
    celery_worker, celery_beat, celery_processes, user, settings
) -> None:
    env = {"DJFLOW_SCHEDULE_GRACE_SECONDS": GRACE_SECONDS}
    worker = celery_worker(workflow_modules=FLOWS, env=env)
    wait_for(lambda: Workflow.objects.filter(pk="ticker").exists(), message="ticker saved")
    beats = [celery_beat(env=env, name=f"beat{n}") for n in (1, 2)]
    # Seconds are allowed here so the test need not wait minutes (the default is a minute).
    settings.DJFLOW = {**settings.DJFLOW, "SCHEDULE_MIN_INTERVAL_MS": 1000}
    every = services.schedule_create(
        workflow="ticker",
        input={"region": "eu"},
        every_ms=int(EVERY.total_seconds() * 1000),
        user=user,
    )
    minutely = services.schedule_create(
        workflow="ticker", input={"region": "us"}, cron="* * * * *", user=user
    )
    minute = minutely.next_run_at
    assert (minute.second, minute.microsecond) == (0, 0)

    # Until the minute's slot has fired, and at least four interval slots.
    def progress() -> bool:
        return len(runs_of(minutely)) >= 1 and len(runs_of(every)) >= 4

    wait_for(progress, timeout=75, interval=0.25, message=celery_processes.logs)
    # Both beats send every slot's message: the worker received about twice as many
    # messages as there were starts (the first one each beat sends at its start aside).
    time.sleep(EVERY.total_seconds() * 0.5)
    minute_runs, interval_runs = runs_of(minutely), runs_of(every)
    received = fires_received(worker.logs())
    started = len(minute_runs) + len(interval_runs)
    print(f"{received} schedules.fire messages received, {started} runs started")
    assert received >= 2 * started - 3, (received, started)

    # The on-the-minute cron: its slot started one run, for the top of the minute.
    assert len(minute_runs) == 1, [r.idempotency_key for r in minute_runs]
    assert slot_of(minute_runs[0]) == minute.astimezone(UTC)
    lag = (minute_runs[0].created_at - minute).total_seconds()
    print(f"the minute's run was started {lag * 1000:.0f} ms after the minute")
    assert 0 <= lag < 2, lag
    # The interval: one run per slot, slots a period apart (never two in one period).
    slots = [slot_of(r) for r in interval_runs]
    assert len(set(slots)) == len(slots)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(slots)]
    print(f"interval slots {gaps} s apart")
    assert all(EVERY.total_seconds() - 1.1 <= gap <= EVERY.total_seconds() + 1.1 for gap in gaps)
    for schedule in (every, minutely):
        schedule.refresh_from_db()
        assert schedule.failures == 0, schedule.last_error
        assert schedule.missed == 0
        assert schedule.starts == len(runs_of(schedule))

    # Every beat goes down over two slots and more; one comes back.
    for beat in beats:
        beat.stop()
    down_at = timezone.now()
    before = len(runs_of(every))
    time.sleep(2.5 * EVERY.total_seconds())
    assert len(runs_of(every)) == before  # nothing fired while no beat ran
    celery_beat(env=env, name="beat3")
    back_at = timezone.now()  # it logged "beat: Starting..." and now reads the schedule
    wait_for(lambda: len(runs_of(every)) > before, timeout=15, message=celery_processes.logs)
    every.refresh_from_db()
    caught = runs_of(every)[before]
    # One start for the slots missed while down (catch_up "one", the default), made at once
    # for a slot that passed while no beat ran, without waiting for a period.
    print(
        f"missed {every.missed} slot(s) while down; caught up {caught.created_at - back_at} "
        f"after the beat came back, for the slot at {slot_of(caught)}"
    )
    assert every.missed >= 1, every.missed
    # (Its slot is the latest due, which may be up to a quarter period ahead: a message
    # that comes a moment before its slot counts for it.)
    assert down_at < slot_of(caught) <= caught.created_at + EVERY / 4
    assert (caught.created_at - back_at).total_seconds() < EVERY.total_seconds() - 0.5
    assert "slot(s) missed (beat or the workers were down); catch_up=one" in worker.logs()
    # ... and only one: the next run is the next period's.
    wait_for(lambda: len(runs_of(every)) > before + 1, timeout=15, message=celery_processes.logs)
    following = runs_of(every)[before + 1]
    assert (slot_of(following) - slot_of(caught)).total_seconds() >= EVERY.total_seconds() - 1.1

    # Every run completes on the worker, with its schedule's input, its handler run once.
    run_ids = [r.id for s in (every, minutely) for r in runs_of(s)]
    all_finished(run_ids, timeout=30, logs=celery_processes.logs)
    assert Counter(Run.objects.filter(id__in=run_ids).values_list("status", flat=True)) == {
        "completed": len(run_ids)
    }
    assert {r.output["region"] for r in runs_of(every)} == {"eu"}
    assert runs_of(minutely)[0].output == {"region": "us"}
    assert set(ticks_per_run(run_ids).values()) == {1}
    assert len(ticks_per_run(run_ids)) == len(run_ids)
    assert {r.created_by_id for r in Run.objects.filter(id__in=run_ids)} == {user.pk}
