"""Timers' statements as Postgres plans them: the tick's claim of due timers
(``runs.engine.timers.claim_due``) and a run's end deleting its unfired ones."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from runs.engine import ending, timers
from runs.models import Run, Timer

from .factories import RunFactory

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif("connection.vendor != 'postgresql'"),
]


def test_the_claim_never_joins_every_due_timer_with_every_claimed_one() -> None:
    """With the timers table's statistics estimating one due row (as between bursts), a
    claim written as a join of the due ids was planned as a nested loop that compared every
    due row with every claimed one: about a second for 1,000 of 3,000 (bench/README.md). The
    claim matches an array of ids instead, whatever the estimates."""
    with connection.cursor() as cursor:
        # Statistics from an empty table: the estimate a quiet day leaves.
        cursor.execute("ANALYZE runs_timer")
    past = timezone.now() - timedelta(seconds=1)
    runs = [RunFactory() for _ in range(20)]
    Timer.objects.bulk_create(
        Timer(run=run, purpose="sleep", key=f"k{index}", fire_at=past)
        for run in runs
        for index in range(30)
    )
    sql = timers._CLAIM_POSTGRES.format(timer=Timer._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", {"now": timezone.now(), "batch": 100})
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Join Filter" not in plan and "Nested Loop" not in plan, plan
    claimed = timers.claim_due(timezone.now(), 100)
    assert len(claimed) == 100
    assert Timer.objects.filter(fired_at__isnull=False).count() == 100
    assert len(timers.claim_due(timezone.now(), 1000)) == 500


@pytest.mark.parametrize("statistics", ["empty", "all fired"])
@pytest.mark.parametrize("several", [False, True], ids=["one run", "a batch's ten"])
def test_a_runs_end_reads_only_its_own_timers(several: bool, statistics: str) -> None:
    """A run's end deletes its timers not fired yet. With statistics counting few unfired
    timers (from an empty table, or from one analysed while every timer had fired, as
    between bursts), Postgres read them through timer_due, every pending timer of every run
    on each end: in a burst of 10,000 fired runs, a cost per end that grew with the burst
    (bench/README.md). The delete reads the ending runs' own timers alone, whatever the
    statistics, and deletes their unfired ones."""
    if statistics == "empty":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE runs_timer")
    later = timezone.now() + timedelta(hours=1)
    first = RunFactory()
    # As in a burst: many runs, each with its deadline pending (and a sleep fired).
    others = Run.objects.bulk_create(
        Run(workflow=first.workflow, version=first.version, status="pending", input={})
        for _ in range(PENDING - 1)
    )
    runs = [first, *others]
    Timer.objects.bulk_create(
        Timer(run=run, purpose=purpose, key=purpose, fire_at=later)
        for run in runs
        for purpose in ("run_deadline", "sleep")
    )
    if statistics == "all fired":
        Timer.objects.update(fired_at=timezone.now())
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE runs_timer")
        Timer.objects.filter(purpose="run_deadline").update(fired_at=None)
    else:
        Timer.objects.filter(purpose="sleep").update(fired_at=timezone.now())
    # One run's end, or a batch's ten ending together (ending.Ends).
    ending_runs = runs[PENDING // 2 : PENDING // 2 + (10 if several else 1)]
    key, parameter = (ending._SEVERAL, "uuid[]") if several else (ending._ONE, "uuid")
    ids = [str(run.id) for run in ending_runs]
    value = "ARRAY[" + ", ".join(f"'{i}'::uuid" for i in ids) + "]" if several else f"'{ids[0]}'"
    with connection.cursor() as cursor:
        # As a worker's prepared cursor plans it (runs.engine.sql): once, for any run.
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        drop = ending._drop_timers_sql(key).replace("%s", "$1")
        cursor.execute(f"PREPARE drop_timers({parameter}) AS {drop}")
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE drop_timers({value})")
        plan = cursor.fetchone()[0][0]["Plan"]
        cursor.execute("DEALLOCATE drop_timers")
    read = [
        (
            node.get("Index Name"),
            (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"],
        )
        for node in _scans(plan)
    ]
    # The ending runs' own timers, found by run (two each; an index holds an entry for each
    # version the updates above wrote, up to five): not the 2,000 pending.
    assert read and all(rows <= 5 * len(ending_runs) for _, rows in read), read
    assert "timer_due" not in {name for name, _ in read}, read
    for run in ending_runs:
        assert list(Timer.objects.filter(run=run).values_list("purpose", flat=True)) == ["sleep"]
    assert Timer.objects.filter(fired_at__isnull=True).count() == PENDING - len(ending_runs)


@pytest.mark.django_db(transaction=True)
def test_a_timer_fired_as_its_run_ends_is_kept_fired() -> None:
    """The clock fires a run's timer (its claim not committed yet) as the run's end deletes
    the run's unfired timers: the end waits for the claim, and keeps the timer, fired."""
    import threading

    import psycopg

    run = RunFactory()
    now = timezone.now()
    timer = Timer.objects.create(
        run=run, purpose="sleep", key="sleep", fire_at=now - timedelta(seconds=1)
    )
    unfired = Timer.objects.create(
        run=run, purpose="run_deadline", key="deadline", fire_at=now + timedelta(hours=1)
    )
    database = connection.settings_dict
    clock, end = (
        psycopg.connect(
            host=database["HOST"],
            port=database["PORT"] or 5432,
            user=database["USER"],
            password=database["PASSWORD"],
            dbname=database["NAME"],
        )
        for _ in range(2)
    )
    ended: list[BaseException | None] = []

    def ending_run() -> None:
        try:
            with end.cursor() as cursor:
                cursor.execute(ending._drop_timers_sql(ending._ONE), [run.id])
            end.commit()
            ended.append(None)
        except BaseException as exc:  # reported below, in the test's thread
            ended.append(exc)

    try:
        with clock.cursor() as cursor:
            # The clock's claim, not committed yet.
            cursor.execute(
                "UPDATE runs_timer SET fired_at = now(), fires = fires + 1 WHERE id = %s",
                [timer.id],
            )
            ending_thread = threading.Thread(target=ending_run)
            ending_thread.start()
            # The end waits for the claim's lock on the timer.
            for _ in range(500):
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))"
                )
                if cursor.fetchone()[0]:
                    break
                ending_thread.join(0.01)
            else:
                pytest.fail(f"the end never waited for the claim: {ended}")
        clock.commit()
        ending_thread.join(10)
    finally:
        clock.close()
        end.close()
    assert ended == [None]
    kept = Timer.objects.get(id=timer.id)
    assert kept.fired_at is not None and kept.fires == 1
    assert not Timer.objects.filter(id=unfired.id).exists()


PENDING = 2000


def _scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan's scans (an index's, a bitmap's, the table's), depth first."""
    found = [plan] if "Scan" in plan["Node Type"] else []
    for child in plan.get("Plans", []):
        found += _scans(child)
    return found


def test_the_clock_asks_to_wake_at_the_next_timer_due_before_the_next_tick(settings) -> None:
    """``wake_before``: the earliest unfired timer due before the next tick, no sooner than
    the resolution from now; nothing when the tick comes first or the resolution is 0."""
    from unittest import mock

    from runs import dispatch

    settings.DJFLOW = {**settings.DJFLOW, "TIMER_RESOLUTION_MS": 100}
    run = RunFactory()
    now = timezone.now()
    until = now + timedelta(seconds=1)

    def asked(fired: Any = None, **timers_at: Any) -> list[Any]:
        Timer.objects.all().delete()
        if fired is not None:
            Timer.objects.create(run=run, purpose="sleep", key="f", fire_at=fired, fired_at=now)
        for key, at in timers_at.items():
            Timer.objects.create(run=run, purpose="sleep", key=key, fire_at=at)
        with mock.patch.object(dispatch, "wake_timers_at") as wake:
            eta = timers.wake_before(until)
        assert [call.kwargs["until"] for call in wake.call_args_list] == [until] * len(
            wake.call_args_list
        )
        sent = [call.args[0] for call in wake.call_args_list]
        assert sent == ([] if eta is None else [eta])
        return sent

    soon, later = now + timedelta(milliseconds=400), now + timedelta(milliseconds=700)
    assert asked(a=later, b=soon, c=now + timedelta(hours=1)) == [soon]
    # A fired timer is not waited for, nor one the next tick comes before.
    assert asked(fired=soon, a=now + timedelta(seconds=1.5)) == []
    assert asked(fired=soon, a=later) == [later]
    assert asked() == []
    # One due already (a tick out of budget): not before the resolution from now.
    [eta] = asked(a=now - timedelta(seconds=3))
    assert eta >= now + timedelta(milliseconds=100)
    settings.DJFLOW = {**settings.DJFLOW, "TIMER_RESOLUTION_MS": 0}
    assert asked(a=soon) == []
