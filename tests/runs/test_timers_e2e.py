"""Durable time end to end: sleeps and their timers on real Postgres, Redis, `celery worker`
and `celery beat` processes.

The workflows (``tests.runs.flows_time``) sleep, then run a handler step on the worker, which
writes each execution to the side table: a run that completed twice, or a sleep that ended
twice, shows there. Every timer's ``fires`` counter is made by the tick's conditional claim,
so ``fires == 1`` proves one claim, however many ticks or beats looked at the row.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.db.models import Count
from django.utils import timezone

from runs import services
from runs.models import Run, StepRun, Timer
from tests.processes import wait_for

from .flows import EFFECTS_TABLE, effects, ensure_effects_table

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.runs.flows_time"]
TERMINAL = ("completed", "failed", "cancelled", "timed_out")


@pytest.fixture(autouse=True)
def _effects_table(transactional_db):
    ensure_effects_table()


def start(workflow: str, input=None) -> Run:
    return services.run_start(workflow=workflow, input=input).run


def finished(run_id, timeout: float = 30.0, logs=lambda: "") -> Run:
    def ended():
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=timeout, interval=0.05, message=logs)


def all_finished(run_ids: list, timeout: float, logs=lambda: "") -> None:
    def count() -> int:
        return Run.objects.filter(id__in=run_ids, status__in=TERMINAL).count()

    wait_for(
        lambda: count() == len(run_ids),
        timeout=timeout,
        interval=0.25,
        message=lambda: f"{count()} of {len(run_ids)} runs ended\n{logs()}",
    )


def journal(run: Run) -> list[tuple[str, int, str]]:
    return list(run.steps.order_by("id").values_list("step_id", "attempt", "status"))


def epoch_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def ring_effects_per_run(run_ids: list) -> Counter:
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT run_id, count(*) FROM {EFFECTS_TABLE}"
            " WHERE step = 'ring' AND run_id = ANY(%s) GROUP BY run_id",
            [[str(r) for r in run_ids]],
        )
        return Counter(dict(cursor.fetchall()))


def assert_each_ran_once(run_ids: list) -> None:
    """Every run completed, with one succeeded sleep row, one sleep timer fired once, and the
    handler after the sleep run once."""
    runs = Counter(Run.objects.filter(id__in=run_ids).values_list("status", flat=True))
    assert runs == {"completed": len(run_ids)}, runs
    sleeps = StepRun.objects.filter(run_id__in=run_ids, step_id="until")
    rows = Counter(sleeps.values_list("status", flat=True))
    assert rows == {"succeeded": len(run_ids)}, rows
    per_run = sleeps.values("run_id").annotate(n=Count("id")).filter(n__gt=1)
    assert not per_run.exists(), list(per_run)
    timers = Timer.objects.filter(run_id__in=run_ids, purpose="sleep")
    assert timers.count() == len(run_ids)
    assert Counter(timers.values_list("fires", flat=True)) == {1: len(run_ids)}
    assert not timers.filter(fired_at__isnull=True).exists()
    ringing = ring_effects_per_run(run_ids)
    assert len(ringing) == len(run_ids) and set(ringing.values()) == {1}, ringing.most_common(3)


# --- 1. a sleep ---------------------------------------------------------------------------


def test_a_sleeping_run_waits_with_nothing_in_flight_and_wakes_on_time(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    celery_beat()
    run = start("napper", {})
    nap = run.steps.get(step_id="nap")
    assert nap.status == "waiting"
    assert nap.not_before - nap.started_at == timedelta(seconds=2)
    timer = Timer.objects.get(run=run, purpose="sleep")
    assert (timer.step_run_id, timer.fire_at, timer.fired_at) == (nap.id, nap.not_before, None)

    # While it sleeps: the run shows waiting, no attempt is offered or running, no body ran.
    samples = 0
    while timezone.now() < nap.not_before - timedelta(milliseconds=200):
        assert Run.objects.get(id=run.id).status == "waiting"
        in_flight = StepRun.objects.filter(run=run, status__in=["scheduled", "running"])
        assert not in_flight.exists(), list(in_flight)
        assert effects(run.id) == []
        samples += 1
        time.sleep(0.1)
    assert samples >= 10

    run = finished(run.id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == "awake"
    assert journal(run) == [("nap", 1, "succeeded"), ("after_nap", 1, "succeeded")]
    nap.refresh_from_db()
    lateness = (nap.finished_at - nap.not_before).total_seconds()
    print(f"sleep of 2 s ended {lateness * 1000:.0f} ms after its due time")
    assert 0 <= lateness <= 1.5, lateness
    timer.refresh_from_db()
    assert timer.fires == 1 and timer.fire_at <= timer.fired_at <= nap.finished_at
    assert len(effects(run.id, "after_nap")) == 1


# --- 2. sleep_until -------------------------------------------------------------------------


def test_sleep_until_a_past_time_is_over_at_once_and_a_later_one_waits_for_it(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    # No beat yet: a time already past must not need the tick.
    past = start("alarm", {"until": "2020-02-29T12:00:00+01:00"})
    past = finished(past.id, timeout=15, logs=celery_processes.logs)
    assert past.status == "completed", past.error
    assert journal(past) == [("until", 1, "succeeded"), ("ring", 1, "succeeded")]
    over = past.steps.get(step_id="until")
    assert over.started_at == over.finished_at
    assert over.input == {"until": "2020-02-29T12:00:00+01:00"}
    assert not Timer.objects.filter(run=past, purpose="sleep").exists()

    celery_beat()
    due = timezone.now() + timedelta(seconds=2.5)
    ahead = start("alarm", {"until": epoch_ms(due)})
    assert ahead.status == "waiting"
    row = ahead.steps.get(step_id="until")
    assert row.status == "waiting"
    assert row.not_before == datetime.fromtimestamp(epoch_ms(due) / 1000, UTC)
    ahead = finished(ahead.id, timeout=15, logs=celery_processes.logs)
    assert ahead.status == "completed", ahead.error
    row.refresh_from_db()
    assert row.status == "succeeded"
    lateness = (row.finished_at - row.not_before).total_seconds()
    print(f"sleep_until (epoch ms) ended {lateness * 1000:.0f} ms after its due time")
    assert 0 <= lateness <= 1.5, lateness
    [(_, _, _, ring_started, _)] = effects(ahead.id, "ring")
    assert ring_started >= row.not_before.timestamp()
    assert Timer.objects.get(run=ahead, purpose="sleep").fires == 1


def test_timers_fire_at_their_instant_not_at_the_next_tick(
    celery_worker, celery_beat, celery_processes
) -> None:
    """Between beat's one-second ticks the clock wakes at the next due timer
    (``runs.wake_timers``, DJFLOW_TIMER_RESOLUTION_MS 100 by default). Sleeps due at six
    instants spread over one second each fire within the resolution and a message's latency
    of their instant; so do three armed due within the second, each of which asks for a
    wake-up as it commits. From the tick alone, lateness spreads from 0 to 1 s over the
    phases of a second: at most two of the six would be under 350 ms."""
    celery_worker(workflow_modules=FLOWS)
    celery_beat()
    base = timezone.now() + timedelta(seconds=3)
    runs = [start("alarm", {"until": epoch_ms(base + timedelta(seconds=k / 6))}) for k in range(6)]
    all_finished([run.id for run in runs], timeout=30, logs=celery_processes.logs)
    soon = []
    for _ in range(3):
        soon.append(start("alarm", {"until": epoch_ms(timezone.now() + timedelta(seconds=0.4))}))
        time.sleep(0.37)
    all_finished([run.id for run in soon], timeout=30, logs=celery_processes.logs)
    timers = Timer.objects.filter(run__in=[*runs, *soon], purpose="sleep")
    late = sorted((t.fired_at - t.fire_at).total_seconds() for t in timers)
    print("sleeps fired " + ", ".join(f"{s * 1000:.0f}" for s in late) + " ms after their instant")
    assert len(late) == 9 and late[0] >= 0, late
    assert late[-1] <= 0.35, late
    assert Counter(timers.values_list("fires", flat=True)) == {1: 9}
    assert Counter(
        Run.objects.filter(id__in=[r.id for r in [*runs, *soon]]).values_list("status", flat=True)
    ) == {"completed": 9}


# --- 3. a thousand runs due at one instant ---------------------------------------------------


def test_a_thousand_runs_sleeping_until_one_instant_each_fire_once_and_complete(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS, concurrency=2)
    celery_beat()
    count = 1000
    # Far enough ahead for every run to be started (and waiting) before it falls due.
    due = timezone.now() + timedelta(seconds=15)
    began = time.monotonic()
    run_ids = [start("alarm", {"until": due.isoformat()}).id for _ in range(count)]
    started_in = time.monotonic() - began
    assert timezone.now() < due, f"starting {count} runs took {started_in:.1f} s"
    assert Run.objects.filter(id__in=run_ids, status="waiting").count() == count
    assert not Timer.objects.filter(run_id__in=run_ids, fired_at__isnull=False).exists()

    all_finished(run_ids, timeout=90, logs=celery_processes.logs)
    last = max(Run.objects.filter(id__in=run_ids).values_list("finished_at", flat=True))
    print(
        f"{count} runs started in {started_in:.1f} s; all done "
        f"{(last - due).total_seconds():.1f} s after their instant"
    )
    assert_each_ran_once(run_ids)
    # The one instant's timers were all claimed by the first tick after it.
    fired_at = Timer.objects.filter(run_id__in=run_ids, purpose="sleep").values_list(
        "fired_at", flat=True
    )
    assert due <= min(fired_at) and max(fired_at) - due <= timedelta(seconds=1.5)


# --- 4. beat down while timers fall due ------------------------------------------------------


def test_timers_that_fell_due_while_beat_was_down_fire_once_when_it_is_back(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    beat = celery_beat()
    first_due = timezone.now() + timedelta(seconds=2)
    dues = [first_due + timedelta(seconds=0.9 * i) for i in range(20)]  # over 17 s
    run_ids = [start("alarm", {"until": due.isoformat()}).id for due in dues]
    # Killed, as a crashed beat host would be, and at once: the first timer is 2 s ahead.
    beat.kill()
    down_since = time.monotonic()
    assert not beat.alive()
    assert timezone.now() < first_due, "the beat stopped after the first timer fell due"

    # 20 s without a beat: every timer falls due, none fires, no run moves.
    time.sleep(max(0.0, 20 - (time.monotonic() - down_since)))
    assert timezone.now() > dues[-1]
    assert Timer.objects.filter(run_id__in=run_ids, purpose="sleep", fired_at=None).count() == 20
    assert Run.objects.filter(id__in=run_ids, status="waiting").count() == 20
    assert ring_effects_per_run(run_ids) == Counter()

    back = timezone.now()
    celery_beat()
    all_finished(run_ids, timeout=20, logs=celery_processes.logs)
    assert_each_ran_once(run_ids)
    timers = Timer.objects.filter(run_id__in=run_ids, purpose="sleep")
    assert not timers.filter(fired_at__lt=back).exists()
    caught_up = max(timers.values_list("fired_at", flat=True)) - back
    print(f"beat back: every overdue timer fired within {caught_up.total_seconds():.2f} s")


# --- 5. two beats ------------------------------------------------------------------------


def test_two_beats_fire_each_timer_once_and_each_run_completes_once(
    celery_worker, celery_beat, celery_processes
) -> None:
    # Small batches: each tick claims a few timers at a time and advances their runs itself,
    # so the two beats' ticks, run side by side by the two pool processes, interleave.
    # The clock's routine lines logged: they are what this test counts.
    small = {"DJFLOW_TIMER_BATCH": "5", "DJFLOW_LOG_CLOCK": "true"}
    worker = celery_worker(workflow_modules=FLOWS, env=small, concurrency=2)
    beats = [celery_beat(env=small), celery_beat(env=small)]
    count = 200
    # Room to start the 200 runs before the first is due, on a loaded machine too (a CI run
    # beside other work once took more than 3 s).
    first_due = timezone.now() + timedelta(seconds=6)
    run_ids = [
        start("alarm", {"until": (first_due + timedelta(milliseconds=25 * i)).isoformat()}).id
        for i in range(count)
    ]  # due over 5 s
    assert timezone.now() < first_due
    all_finished(run_ids, timeout=40, logs=celery_processes.logs)
    assert_each_ran_once(run_ids)
    # Both beats sent ticks, and the counts of the ticks and of the wake-ups each asked for
    # between ticks (two chains of them, one a beat) add up to one firing per timer.
    for beat in beats:
        assert "Sending due task djflow: fire timers" in beat.logs(), beat.logs()
    ticks = [
        int(line.rsplit(":", 1)[1])
        for line in worker.logs().splitlines()
        if ("runs.fire_timers[" in line or "runs.wake_timers[" in line) and " succeeded in " in line
    ]
    assert sum(ticks) == count, ticks


# --- 6. fired runs handed to workers in batches ------------------------------------------------

# Every fired run handed to the pool (none advanced by the tick itself), 8 to a message.
BATCHED = {"DJFLOW_TIMER_INLINE_RUNS": "0", "DJFLOW_TIMER_ADVANCE_BATCH": "8"}


def alarms_due_together(count: int, logs) -> list:
    """``count`` runs sleeping until one instant a few seconds ahead, waited for to the end,
    each of them run once."""
    due = timezone.now() + timedelta(seconds=4)
    run_ids = [start("alarm", {"until": due.isoformat()}).id for _ in range(count)]
    assert timezone.now() < due
    all_finished(run_ids, timeout=40, logs=logs)
    assert_each_ran_once(run_ids)
    return run_ids


def test_fired_runs_go_to_workers_in_batches_and_their_next_step_runs_without_a_message(
    celery_worker, celery_beat, celery_processes
) -> None:
    worker = celery_worker(workflow_modules=FLOWS, env=BATCHED, concurrency=2)
    celery_beat(env=BATCHED)
    count = len(alarms_due_together(40, celery_processes.logs))
    logs = worker.logs()
    # At least count/8 batches (a tick may split them), one message per batch: no advance
    # message and no execute_step message for any run.
    batches = logs.count("Task workers.advance_runs[")
    assert count // 8 <= batches <= count, logs[-3000:]
    assert "Task runs.advance[" not in logs, logs[-3000:]
    assert "Task workers.execute_step[" not in logs, logs[-3000:]


def test_a_worker_that_does_not_consume_the_steps_queue_offers_the_next_step(
    celery_worker, celery_beat, celery_processes
) -> None:
    # The engine's worker consumes the engine's queues only; the steps' queue is another's.
    engine = celery_worker(
        workflow_modules=FLOWS, env=BATCHED, queues=["engine", "timers"], concurrency=1
    )
    steps = celery_worker(workflow_modules=FLOWS, env=BATCHED, queues=["default"], concurrency=1)
    celery_beat(env=BATCHED)
    run_ids = alarms_due_together(16, celery_processes.logs)
    assert "Task workers.advance_runs[" in engine.logs()
    ringers = set(
        StepRun.objects.filter(run_id__in=run_ids, step_id="ring").values_list("worker", flat=True)
    )
    assert {ringer.split(":")[0] for ringer in ringers} == {steps.hostname}, ringers
    assert "Task workers.execute_step[" in steps.logs()
