"""Fired timers' runs handed to workers in batches (``workers.advance_runs``): the worker
advances each run and runs its next step itself when it serves the step's queue and handler,
so a resumed run costs no ``execute_step`` message; otherwise it offers the attempt as an
advance does. Run in this process (the worker's own code path, without a worker process);
the messages the engine would send are recorded, not sent."""

from __future__ import annotations

import itertools
import os
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from runs import dispatch, services
from runs.engine import advance, timers
from runs.models import Run, StepRun, Timer
from workers import batches, execution
from workflows.sdk import workflow
from workflows.services import definition_save

pytestmark = pytest.mark.django_db

ran: list[str] = []

# A sleep, then a step this process has the handler of.
resumed = workflow("resumed_after_nap", limits={"run_timeout_ms": 600_000})
resumed.sleep("nap", ms=60_000)


# Seconds a run's step sleeps (a slow body), by run id; when each step ended.
naps: dict[str, float] = {}
ended: dict[str, float] = {}


@resumed.step("after")
def after(ctx: Any, input: Any, prior: Any) -> str:
    ran.append(ctx.run_id)
    time.sleep(naps.get(ctx.run_id, 0.0))
    ended[ctx.run_id] = time.time()
    return "after"


# The same with an at_most_once step: claimed only before its body, recorded at once.
once = workflow("resumed_at_most_once", limits={"run_timeout_ms": 600_000})
once.sleep("nap", ms=60_000)


@once.step("after", effect="at_most_once")
def after_once(ctx: Any, input: Any, prior: Any) -> str:
    ran.append(ctx.run_id)
    return "after"


# The same with a step shorter than the lease: a lost worker would leave it timed out.
brief = workflow("resumed_brief", limits={"run_timeout_ms": 600_000})
brief.sleep("nap", ms=60_000)
brief.step("after", timeout_ms=1000)(after)


# The same on a queue of its own, which a worker may not consume.
elsewhere = workflow("resumed_elsewhere", limits={"run_timeout_ms": 600_000})
elsewhere.sleep("nap", ms=60_000)
elsewhere.task("after", handler="resumed.gpu_step", queue="gpu")


# A sleep, then two steps: the first one's record holds the run's next attempt.
twice = workflow("resumed_then_again", limits={"run_timeout_ms": 600_000})
twice.sleep("nap", ms=60_000)
twice.step("after")(after)
twice.step("again")(after)


@pytest.fixture
def sent(monkeypatch) -> dict[str, list[Any]]:
    """What the engine would send: attempts offered (by the advance's commit or by the
    worker), advance requests, batches of runs."""
    ran.clear()
    # However slow this machine: each test's batch is one task unless it says otherwise.
    monkeypatch.setattr(execution, "ADVANCE_RUNS_SECONDS", 60.0)
    # Nor is a body handed off as slow on a loaded machine: the hand-off's thread has a
    # connection of its own, which does not see a test's uncommitted rows.
    monkeypatch.setattr(batches, "HAND_OFF_SECONDS", 60.0)
    # Nor does a chain stop at INLINE_SECONDS and offer the rest: the tests count what one
    # task records together.
    from django.conf import settings

    monkeypatch.setitem(settings.DJFLOW, "INLINE_SECONDS", 60.0)
    messages: dict[str, list[Any]] = {"offered": [], "advance": [], "batches": []}

    def offered(step_run: Any, **_: Any) -> None:
        messages["offered"].append(step_run.id)

    monkeypatch.setattr(dispatch, "offer", offered)
    monkeypatch.setattr(dispatch, "offer_on_commit", offered)
    monkeypatch.setattr(dispatch, "advance_on_commit", messages["advance"].append)
    monkeypatch.setattr(
        dispatch,
        "advance_in_batches",
        lambda run_ids, *, size: messages["batches"].append((list(run_ids), size)),
    )
    return messages


def start_sleeping(workflow_id: str, count: int) -> list[Run]:
    document = {
        "resumed_after_nap": resumed,
        "resumed_elsewhere": elsewhere,
        "resumed_at_most_once": once,
        "resumed_brief": brief,
        "resumed_then_again": twice,
    }[workflow_id]
    definition_save(document=document.document())
    return [services.run_start(workflow=workflow_id, input={}).run for _ in range(count)]


def fire(runs: list[Run], step_id: str | None = None) -> list[str]:
    """The sleeps' timers due and claimed, as a tick claims them; the runs' ids. With
    ``step_id``, only that step's wait is over (another waiting row stays as it is)."""
    past = timezone.now() - timedelta(milliseconds=1)
    ids = [run.id for run in runs]
    Timer.objects.filter(run_id__in=ids, purpose="sleep").update(fire_at=past)
    over = StepRun.objects.filter(run_id__in=ids, status="waiting")
    (over.filter(step_id=step_id) if step_id else over).update(not_before=past)
    assert len(timers.claim_due(timezone.now(), 1000)) >= len(runs)
    return [str(run_id) for run_id in ids]


def statuses(run_ids: list[str]) -> set[str]:
    return set(Run.objects.filter(id__in=run_ids).values_list("status", flat=True))


def test_the_tick_hands_many_fired_runs_to_workers_in_batches(sent, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "TIMER_INLINE_RUNS": 2, "TIMER_ADVANCE_BATCH": 4}
    runs = start_sleeping("resumed_after_nap", 5)
    past = timezone.now() - timedelta(milliseconds=1)
    Timer.objects.filter(run__in=runs, purpose="sleep").update(fire_at=past)
    assert timers.fire_due() == 5  # the sleeps (the runs' deadlines are ten minutes away)
    [(batched, size)] = sent["batches"]
    assert size == 4 and sorted(batched) == sorted(run.id for run in runs)
    # Nothing advanced by the tick itself: the workers do it.
    assert statuses([str(run.id) for run in runs]) == {"waiting"}


def test_a_wake_up_hands_even_a_few_fired_runs_to_workers_and_leaves_leases_to_the_tick(
    sent, settings, monkeypatch
) -> None:
    """Between ticks a wake-up fires a few runs at a time: they go to workers in a batch
    (advanced by the wake-up, each would cost an execute_step message of its own), and the
    lapsed leases, which the tick looks for every second, are not looked for."""
    settings.DJFLOW = {**settings.DJFLOW, "TIMER_INLINE_RUNS": 20, "TIMER_ADVANCE_BATCH": 4}
    runs = start_sleeping("resumed_after_nap", 2)
    past = timezone.now() - timedelta(milliseconds=1)
    Timer.objects.filter(run__in=runs, purpose="sleep").update(fire_at=past)
    leases = []
    monkeypatch.setattr(timers, "lapsed_leases", lambda *a: leases.append(a) or [])
    assert timers.fire_due(tick=False) == 2
    [(batched, size)] = sent["batches"]
    assert size == 4 and sorted(batched) == sorted(run.id for run in runs)
    assert statuses([str(run.id) for run in runs]) == {"waiting"} and leases == []
    assert sent["offered"] == [] and not StepRun.objects.filter(step_id="after").exists()
    # The tick, with as few, advances them itself and looks for lapsed leases.
    more = start_sleeping("resumed_after_nap", 2)
    # The sleeps over too (the planner reads the row's instant; the timer's alone re-arms).
    StepRun.objects.filter(run__in=more, step_id="nap").update(not_before=past)
    Timer.objects.filter(run__in=more, purpose="sleep").update(fire_at=past)
    assert timers.fire_due() == 2
    assert len(sent["batches"]) == 1 and len(leases) == 1
    # Each run's next step written and offered by the tick's own advance.
    after = StepRun.objects.filter(step_id="after")
    assert sorted(after.values_list("run_id", flat=True)) == sorted(run.id for run in more)
    assert sorted(sent["offered"]) == sorted(after.values_list("id", flat=True))


def test_a_batch_advances_each_run_and_runs_its_next_step_without_a_message(sent) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    ran_here = execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    assert ran_here == 3
    assert sorted(ran) == sorted(run_ids)
    assert statuses(run_ids) == {"completed"}
    assert sent["offered"] == []  # no execute_step message for any of them
    workers = set(StepRun.objects.filter(step_id="after").values_list("worker", flat=True))
    assert workers == {"w:1"}


def test_a_run_advanced_twice_runs_its_next_step_once(sent) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 2))
    # A redelivered batch, and a batch that overlaps it (the reconciler's advance, say).
    execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    assert execution.advance_and_execute(run_ids + run_ids, worker="w:2", queues={"default"}) == 0
    assert sorted(ran) == sorted(run_ids)
    assert StepRun.objects.filter(step_id="after").count() == 2
    assert statuses(run_ids) == {"completed"}


def test_a_worker_that_does_not_consume_the_steps_queue_offers_it(sent) -> None:
    run_ids = fire(start_sleeping("resumed_elsewhere", 2))
    # The handler is not this process's either way: the queue decides first.
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 0
    attempts = StepRun.objects.filter(run_id__in=run_ids, step_id="after")
    assert sorted(sent["offered"]) == sorted(attempts.values_list("id", flat=True))
    # Offered as they were written: scheduled, never claimed or handed back.
    assert set(attempts.values_list("status", "refusals")) == {("scheduled", 0)}
    assert ran == []


def test_a_worker_without_the_handler_offers_the_attempt_unclaimed(sent, monkeypatch) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 1))
    monkeypatch.setattr(execution, "_serves", lambda step_run, workflow_id: False)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 0
    attempt = StepRun.objects.get(run_id=run_ids[0], step_id="after")
    assert sent["offered"] == [attempt.id]
    assert (attempt.status, attempt.refusals, attempt.claim) == ("scheduled", 0, None)


def test_the_handler_check_names_a_registered_handler_and_not_a_missing_one(sent) -> None:
    here = fire(start_sleeping("resumed_after_nap", 1))
    gone = fire(start_sleeping("resumed_elsewhere", 1))
    execution.advance_and_execute(here + gone, worker="w:1", queues=set())  # both offered
    mine = StepRun.objects.get(run_id=here[0], step_id="after")
    theirs = StepRun.objects.get(run_id=gone[0], step_id="after")
    assert execution._serves(mine, "resumed_after_nap")
    assert not execution._serves(theirs, "resumed_elsewhere")


def test_past_the_tasks_time_the_rest_of_the_batch_is_offered(sent, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "INLINE_MAX_STEPS": 1}
    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 1
    assert len(ran) == 1
    # The two others advanced all the same, their attempts offered through the broker.
    assert len(sent["offered"]) == 2
    assert statuses(run_ids) == {"completed", "running"}
    assert StepRun.objects.filter(run_id__in=run_ids, step_id="after").count() == 3


def test_past_the_batchs_time_the_runs_left_go_back_to_the_queue_in_one_message(
    sent, monkeypatch
) -> None:
    monkeypatch.setattr(execution, "ADVANCE_RUNS_SECONDS", 0)
    monkeypatch.setattr(execution, "ADVANCE_RUNS_CHUNK", 1)
    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 1
    # The first advanced and its next step run; the two others sent on, not advanced here.
    assert ran == [run_ids[0]]
    assert sent["batches"] == [(run_ids[1:], 2)]
    assert [Run.objects.get(id=run_id).status for run_id in run_ids] == [
        "completed",
        "waiting",
        "waiting",
    ]
    assert sent["offered"] == []


def test_a_run_that_fails_to_advance_does_not_stop_the_batch(sent, monkeypatch) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    real = advance.advance_locked

    def broken_after_writing(run: Any, **options: Any) -> Any:
        planned = real(run, **options)  # the sleep closed, the next attempt written
        if str(run.id) == run_ids[1]:
            raise RuntimeError("a bug in the plan")
        return planned

    monkeypatch.setattr(advance, "advance_locked", broken_after_writing)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 2
    assert sorted(ran) == sorted([run_ids[0], run_ids[2]])
    # The failed one's writes went back (the batch's transaction, then its own when the runs
    # were advanced one by one): it is the reconciler's (its timer fired, nothing in flight);
    # the two others' advances committed.
    assert Run.objects.get(id=run_ids[1]).status == "waiting"
    assert not StepRun.objects.filter(run_id=run_ids[1], step_id="after").exists()
    assert StepRun.objects.get(run_id=run_ids[1], step_id="nap").status == "waiting"
    assert statuses([run_ids[0], run_ids[2]]) == {"completed"}
    assert sent["offered"] == []


def test_a_database_error_in_one_runs_advance_rolls_back_that_run_only(sent, monkeypatch) -> None:
    from django.db import connection

    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    real = advance.advance_locked

    def failing_statement(run: Any, **options: Any) -> Any:
        planned = real(run, **options)
        if str(run.id) == run_ids[0]:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")  # aborts the statement, not the batch
        return planned

    monkeypatch.setattr(advance, "advance_locked", failing_statement)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 2
    assert Run.objects.get(id=run_ids[0]).status == "waiting"
    assert not StepRun.objects.filter(run_id=run_ids[0], step_id="after").exists()
    assert statuses(run_ids[1:]) == {"completed"}


def test_a_chunk_whose_transaction_fails_is_advanced_one_run_at_a_time(sent, monkeypatch) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 3))

    def lost(run_ids: Any, **options: Any) -> Any:
        raise advance.BatchFailed("the connection dropped")

    monkeypatch.setattr(execution, "advance_many", lost)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 3
    assert sorted(ran) == sorted(run_ids)
    assert statuses(run_ids) == {"completed"}


def test_a_chunk_committed_unacknowledged_leaves_no_attempt_claimed_by_nobody(
    sent, monkeypatch
) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 2))
    real = advance.advance_many

    def committed_then_lost(run_ids: Any, **options: Any) -> Any:
        real(run_ids, **options)  # the first attempt claimed in it
        raise advance.BatchFailed("the commit's answer was lost")

    monkeypatch.setattr(execution, "advance_many", committed_then_lost)
    execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    attempts = StepRun.objects.filter(run_id__in=run_ids, step_id="after")
    # Nothing was run, and the claims nobody would run (both attempts were inserted claimed)
    # are handed back and offered; the runs advanced again plan nothing new.
    assert ran == []
    assert set(attempts.values_list("status", flat=True)) == {"scheduled"}
    assert sorted(sent["offered"]) == sorted(attempts.values_list("id", flat=True))


def test_a_batchs_attempts_are_inserted_claimed_and_recorded_in_one_transaction(
    sent, monkeypatch
) -> None:
    """The chunk's transaction inserts its at_least_once attempts claimed (no claim
    statement), and their results are recorded together: one transaction (here a savepoint,
    inside the test's) for the four, not one each."""
    from django.test.utils import CaptureQueriesContext

    run_ids = fire(start_sleeping("resumed_after_nap", 4))
    claimed: list[Any] = []
    monkeypatch.setattr(execution, "claim_attempt", lambda *a, **k: claimed.append(a))
    with CaptureQueriesContext(connection) as queries:
        assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 4
    assert claimed == []
    assert statuses(run_ids) == {"completed"}
    assert sorted(ran) == sorted(run_ids)
    savepoints = [q for q in queries.captured_queries if q["sql"].startswith("SAVEPOINT")]
    # The chunk's advance, the four records.
    assert len(savepoints) == 2, [q["sql"][:60] for q in queries.captured_queries]
    attempts = StepRun.objects.filter(run_id__in=run_ids, step_id="after")
    assert set(attempts.values_list("worker", flat=True)) == {"w:1"}
    assert len(set(attempts.values_list("claim", flat=True))) == 1


def test_runs_that_end_with_the_steps_recorded_together_are_ended_in_one_statement(
    sent,
) -> None:
    """The runs whose step, recorded together, was their last end together too (ending.Ends):
    one statement moves the four, drops their timers (each run's deadline timer) and reads
    what they leave, instead of one a run."""
    from django.test.utils import CaptureQueriesContext

    run_ids = fire(start_sleeping("resumed_after_nap", 4))
    assert Timer.objects.filter(run_id__in=run_ids, fired_at__isnull=True).count() == 4
    with CaptureQueriesContext(connection) as queries:
        assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 4
    ends = [q["sql"] for q in queries.captured_queries if "UPDATE runs_run" in q["sql"]]
    assert [sql.count(" AS (UPDATE runs_run") for sql in ends if "moved" in sql] == [4], ends
    assert statuses(run_ids) == {"completed"}
    assert not Timer.objects.filter(run_id__in=run_ids, fired_at__isnull=True).exists()
    ended = Run.objects.filter(id__in=run_ids).values_list("finished_at", "output")
    assert all(finished is not None for finished, _ in ended)
    assert {output for _, output in ended} == {"after"}


@pytest.mark.skipif("connection.vendor != 'postgresql'")  # Ends write together there only
def test_runs_whose_ends_together_fail_are_recorded_and_ended_one_by_one(sent, monkeypatch) -> None:
    """The batch's ends fail as one (a row moved meanwhile, a lost connection): the batch's
    transaction rolls back, results and all, and each result is recorded, and its run
    ended, in a transaction of its own; no body runs again."""
    from runs.engine import ending

    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    real = ending._move_many
    together: list[int] = []

    def failing_together(entries: Any) -> Any:
        if len(entries) > 1:
            together.append(len(entries))
            raise RuntimeError("the batch's ends failed")
        return real(entries)

    monkeypatch.setattr(ending, "_move_many", failing_together)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 3
    assert together == [3]
    assert statuses(run_ids) == {"completed"}
    assert sorted(ran) == sorted(run_ids)
    after = StepRun.objects.filter(run_id__in=run_ids, step_id="after")
    assert set(after.values_list("status", "attempt")) == {("succeeded", 1)}
    assert not Timer.objects.filter(run_id__in=run_ids, fired_at__isnull=True).exists()


def test_an_at_most_once_attempt_is_claimed_before_its_body_and_recorded_on_its_own(
    sent, monkeypatch
) -> None:
    """Not inserted claimed: a worker lost before its body would leave it failed without
    having run. Claimed in the chunk's transaction or the recording before it, as before."""
    run_ids = fire(start_sleeping("resumed_at_most_once", 3))
    real = execution.claim_attempt
    claimed: list[int] = []

    def claim(step_run_id: int, **options: Any) -> Any:
        claimed.append(step_run_id)
        return real(step_run_id, **options)

    monkeypatch.setattr(execution, "claim_attempt", claim)
    together: list[Any] = []
    monkeypatch.setattr(execution, "lock_runs_recording_reading", together.append)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 3
    attempts = StepRun.objects.filter(run_id__in=run_ids, step_id="after")
    assert sorted(claimed) == sorted(attempts.values_list("id", flat=True))
    # Each recorded in a transaction of its own, none together.
    assert together == []
    assert statuses(run_ids) == {"completed"}


def test_a_step_shorter_than_the_lease_is_not_claimed_ahead(sent, monkeypatch) -> None:
    """Claimed ahead and its worker lost, it would be timed out (a try used) instead of
    lost (offered again for free): it is claimed as it runs."""
    run_ids = fire(start_sleeping("resumed_brief", 3))
    claimed: list[int] = []
    real = execution.claim_attempt

    def claim(step_run_id: int, **options: Any) -> Any:
        claimed.append(step_run_id)
        return real(step_run_id, **options)

    monkeypatch.setattr(execution, "claim_attempt", claim)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 3
    attempts = StepRun.objects.filter(run_id__in=run_ids, step_id="after")
    assert sorted(claimed) == sorted(attempts.values_list("id", flat=True))
    assert statuses(run_ids) == {"completed"}


def test_an_at_most_once_attempt_beside_attempts_claimed_ahead_is_claimed_after_them(
    sent,
) -> None:
    """Claimed in the chunk's transaction, it would wait claimed behind their bodies, its
    lease running down (in doubt, then run anyway): it is claimed as it runs, after them."""
    ahead = fire(start_sleeping("resumed_after_nap", 2))
    lone = fire(start_sleeping("resumed_at_most_once", 1))
    assert execution.advance_and_execute(ahead + lone, worker="w:1", queues={"default"}) == 3
    assert statuses(ahead + lone) == {"completed"}
    claimed_at = StepRun.objects.get(run_id=lone[0], step_id="after").started_at
    assert claimed_at.timestamp() > max(ended[run_id] for run_id in ahead)


def test_a_failure_running_ahead_does_not_stop_the_chunks_other_runs(sent, monkeypatch) -> None:
    ahead = fire(start_sleeping("resumed_after_nap", 2))
    lone = fire(start_sleeping("resumed_at_most_once", 1))

    def broken(self: Any, *args: Any) -> Any:
        raise RuntimeError("a bug running ahead")

    monkeypatch.setattr(execution._Batch, "run_ahead", broken)
    execution.advance_and_execute(ahead + lone, worker="w:1", queues={"default"})
    assert statuses(lone) == {"completed"}
    # What was claimed ahead and never run is handed back and offered, not left to lapse.
    attempts = StepRun.objects.filter(run_id__in=ahead, step_id="after")
    assert set(attempts.values_list("status", "claim")) == {("scheduled", None)}
    assert sorted(sent["offered"]) == sorted(attempts.values_list("id", flat=True))


def test_a_results_finish_and_duration_are_its_bodys_not_its_records(sent) -> None:
    run_ids = sorted(fire(start_sleeping("resumed_after_nap", 3)))
    naps.update({run_id: 0.05 for run_id in run_ids})
    try:
        execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    finally:
        naps.clear()
    finished = {
        str(run_id): at
        for run_id, at in StepRun.objects.filter(run_id__in=run_ids, step_id="after").values_list(
            "run_id", "finished_at"
        )
    }
    # Each finished as its body ended, before the next body did (recorded after all three).
    for run_id, later in itertools.pairwise(run_ids):
        assert finished[run_id].timestamp() < ended[later]


def test_a_batch_whose_record_fails_records_each_result_on_its_own(sent, monkeypatch) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 3))

    def lost(entries: Any) -> Any:
        raise advance.DatabaseError("the batch's transaction failed")

    monkeypatch.setattr(execution, "lock_runs_recording_reading", lost)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 3
    # Each body ran once, and its result was recorded alone.
    assert sorted(ran) == sorted(run_ids)
    assert statuses(run_ids) == {"completed"}
    assert not execution.keeper.held()


def test_a_result_that_cannot_be_recorded_is_left_to_its_lease(sent, monkeypatch) -> None:
    """One run's record fails alone too: the others are recorded, and its attempt stays
    running, its lease no longer kept (the tick gives it up, the run retries it)."""
    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    broken = sorted(run_ids)[1]
    real = execution._recorded

    def recorded(row: Any, *args: Any, **options: Any) -> Any:
        if str(row.run_id) == broken:
            raise ValueError("this run's plan raised")
        return real(row, *args, **options)

    monkeypatch.setattr(execution, "_recorded", recorded)
    execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    assert statuses([r for r in run_ids if r != broken]) == {"completed"}
    assert StepRun.objects.get(run_id=broken, step_id="after").status == "running"
    assert not execution.keeper.held()


def test_a_batchs_results_are_written_and_their_runs_locked_and_read_in_three_statements(
    sent,
) -> None:
    from django.test.utils import CaptureQueriesContext

    run_ids = fire(start_sleeping("resumed_after_nap", 5))
    real = execution.lock_runs_recording_reading
    seen: list[int] = []

    def counted(entries: Any) -> Any:
        with CaptureQueriesContext(connection) as queries:
            found = real(entries)
        seen.append(len(queries))
        # Each result written, each run found with its journal (the step's result in it).
        assert [(run is not None, recorded) for run, recorded, _ in found] == [(True, True)] * 5
        for _, _, read in found:
            assert read is not None and any(a.status == "succeeded" for a in read[1])
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(execution, "lock_runs_recording_reading", counted)
        assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 5
    assert seen == [3]
    assert statuses(run_ids) == {"completed"}


def test_results_of_runs_inside_a_tree_are_not_recorded_together() -> None:
    """A child run may be changed by its parent's plan earlier in the same batch: each is
    locked and read in its own turn."""
    from types import SimpleNamespace

    results = [
        execution._Result(SimpleNamespace(run_id=f"r{n}", root_run_id=root), *[None] * 6)
        for n, root in enumerate([None, "root"])
    ]
    assert execution._recorded_together(results) is None  # type: ignore[arg-type]


def test_a_results_claim_lost_meanwhile_is_dropped_and_the_others_recorded(sent) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    given_up = sorted(run_ids)[0]
    real = execution._run_chain

    def run_chain(chain: Any, shown: Any, held: Any) -> Any:
        outcome = real(chain, shown, held)
        if str(held[0].run_id) == given_up:
            # Given up while its result waited for the batch (the tick, a cancel).
            StepRun.objects.filter(id=held[0].id).update(claim=None, status="failed")
        return outcome

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(execution, "_run_chain", run_chain)
        execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    assert StepRun.objects.get(run_id=given_up, step_id="after").status == "failed"
    assert statuses([r for r in run_ids if r != given_up]) == {"completed"}


def _caught_up() -> None:
    """Wait for the threads that record a batch's results while a body runs long."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "batch-catch-up":
            thread.join(10)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("slow_at", [1, 2])
def test_a_slow_body_keeps_neither_the_results_before_it_nor_the_claims_after_it(
    sent, monkeypatch, slow_at
) -> None:
    """While a body of a batch runs past HAND_OFF_SECONDS, the hand-off thread records the
    results collected before it and hands back the attempts claimed after it: none waits
    behind it (a claimed attempt could be timed out by the tick without having run). The
    last body too: the results before it have no attempt after them to wait for."""
    from runs.models import Run

    monkeypatch.setattr(batches, "HAND_OFF_SECONDS", 0.2)
    run_ids = sorted(fire(start_sleeping("resumed_after_nap", 3)))  # the chunk's order
    slow, before, after = run_ids[slow_at], run_ids[:slow_at], run_ids[slow_at + 1 :]
    naps[slow] = 1.0
    try:
        execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    finally:
        naps.clear()
        _caught_up()
    assert ran == [*before, slow]
    # The results before it were recorded while the slow body still ran.
    for run_id in before:
        assert Run.objects.get(id=run_id).finished_at.timestamp() < ended[slow]
    assert statuses([*before, slow]) == {"completed"}
    handed_back = StepRun.objects.filter(run_id__in=after, step_id="after")
    assert set(handed_back.values_list("status", "claim")) <= {("scheduled", None)}
    assert sorted(sent["offered"]) == sorted(handed_back.values_list("id", flat=True))
    assert not execution.keeper.held()


@pytest.mark.django_db(transaction=True)
def test_a_result_recorded_while_a_body_runs_offers_its_runs_next_attempt(
    sent, monkeypatch
) -> None:
    """The hand-off's catch-up thread records a result whose run goes on: it runs no body,
    so it offers the run's next attempt, once its record has committed."""
    monkeypatch.setattr(batches, "HAND_OFF_SECONDS", 0.2)
    first, slow, last = sorted(fire(start_sleeping("resumed_then_again", 3)))
    naps[slow] = 1.0
    offered_while_slow_ran: list[int] = []
    real = dispatch.offer

    def offered(step_run: Any, **options: Any) -> None:
        if slow in ran and slow not in ended:
            offered_while_slow_ran.append(step_run.id)
        real(step_run, **options)

    monkeypatch.setattr(dispatch, "offer", offered)
    try:
        execution.advance_and_execute([first, slow, last], worker="w:1", queues={"default"})
    finally:
        naps.clear()
        _caught_up()
    again = StepRun.objects.get(run_id=first, step_id="again")
    # Committed (another connection: the thread's own) and offered, not claimed.
    assert (again.status, again.claim) == ("scheduled", None)
    assert again.id in offered_while_slow_ran
    assert sent["offered"].count(again.id) == 1


def test_a_batchs_step_durations_are_each_bodys_own(sent, monkeypatch) -> None:
    """Results claimed ahead are recorded together after the chunk's last body: the step
    duration each counts (djflow_step_duration_seconds) is its body's, not its wait too."""
    durations: dict[str, float] = {}

    def attempt_recorded(*, workflow: str, seconds: float, **_: Any) -> None:
        durations[str(len(durations))] = seconds

    monkeypatch.setattr(execution.metrics, "attempt_recorded", attempt_recorded)
    run_ids = sorted(fire(start_sleeping("resumed_after_nap", 2)))
    naps[run_ids[1]] = 0.5
    try:
        execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    finally:
        naps.clear()
    assert statuses(run_ids) == {"completed"}
    # Both recorded after the slow body ended, in the chunk's order.
    assert durations["0"] < 0.4 <= 0.5 <= durations["1"], durations


def test_a_hand_back_that_fails_while_a_body_runs_leaves_the_attempts_to_their_leases(
    monkeypatch,
) -> None:
    """Their leases are no longer kept: the tick gives them up as lost (offered again)."""
    from types import SimpleNamespace

    def broken(left: Any) -> None:
        raise execution.OperationalError("the database is restarting")

    monkeypatch.setattr(execution, "_give_back", broken)
    row = SimpleNamespace(id=-7)
    execution.keeper.hold(row.id, uuid.uuid4(), timezone.now())
    # On a thread of its own, as the hand-off starts it (it closes its own connection).
    import threading

    thread = threading.Thread(target=execution._catch_up, args=([(None, "wf", row)], []))
    thread.start()
    thread.join(10)
    assert row.id not in execution.keeper.held()


def test_the_leases_of_attempts_claimed_ahead_are_kept_until_they_are_recorded(
    sent, monkeypatch
) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 4))
    attempts = StepRun.objects.filter(run_id__in=run_ids, step_id="after")
    held_while_running: list[set[int]] = []
    real = execution._run_chain

    def run_chain(*args: Any, **options: Any) -> Any:
        held_while_running.append(set(execution.keeper.held()))
        return real(*args, **options)

    monkeypatch.setattr(execution, "_run_chain", run_chain)
    execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    ids = set(attempts.values_list("id", flat=True))
    # Before each body: every attempt of the chunk held (run or not yet run).
    assert held_while_running == [ids] * 4
    assert not execution.keeper.held()
    assert statuses(run_ids) == {"completed"}


def test_attempts_claimed_ahead_past_the_tasks_time_are_handed_back(
    sent, monkeypatch, settings
) -> None:
    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    real = execution._run_chain

    def run_chain(*args: Any, **options: Any) -> Any:
        try:
            return real(*args, **options)
        finally:
            # The first body took the task's time.
            monkeypatch.setitem(settings.DJFLOW, "INLINE_SECONDS", 0)

    monkeypatch.setattr(execution, "_run_chain", run_chain)
    execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    assert len(ran) == 1
    attempts = StepRun.objects.filter(run_id__in=run_ids, step_id="after").exclude(run_id=ran[0])
    assert set(attempts.values_list("status", "claim")) == {("scheduled", None)}
    assert sorted(sent["offered"]) == sorted(attempts.values_list("id", flat=True))
    assert statuses([ran[0]]) == {"completed"}
    assert not execution.keeper.held()


def test_a_fired_runs_statements_do_not_grow(sent) -> None:
    """Statements per fired run of a batch (advance, claim, body, record): one transaction
    for the chunk's advances, one for its records, no claim statement."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    run_ids = fire(start_sleeping("resumed_after_nap", 10))
    with CaptureQueriesContext(connection) as queries:
        assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 10
    per_run = len(queries) / 10
    assert per_run <= PER_FIRED_RUN, [q["sql"][:80] for q in queries.captured_queries[:40]]
    print(f"statements per fired run: {per_run}")


# Measured (issue 17): 16.0 before chunks were advanced in one transaction, 14.3 with it,
# 12.5 with the chunk's runs locked and their journals read in one statement each, 3.8 with
# the chunk's attempts inserted claimed and their results recorded in one transaction (no
# savepoint, claim, BEGIN or COMMIT of their own), 2.1 with the results written and their
# runs locked and read in one statement each. Raise it only with a reason.
PER_FIRED_RUN = 2.1


def test_the_task_hands_the_service_the_queues_its_worker_consumes(monkeypatch) -> None:
    from celery.signals import task_prerun
    from kombu import Queue

    from config.celery import recycle_database_connections
    from workers.tasks import advance_runs

    called: dict[str, Any] = {}

    def service(run_ids: list[str], **options: Any) -> int:
        called.update(options, run_ids=run_ids)
        return len(run_ids)

    monkeypatch.setattr(execution, "advance_and_execute", service)
    # A worker started with -Q engine,timers: what Celery selects before the pool forks.
    selected = {name: Queue(name) for name in ("engine", "timers")}
    monkeypatch.setattr(advance_runs.app.amqp.queues, "_consume_from", selected)
    # Applied in this process: without the per-task connection recycling of a worker.
    task_prerun.disconnect(recycle_database_connections)
    try:
        assert advance_runs.apply(args=[["r1", "r2"]]).get() == 2
    finally:
        task_prerun.connect(recycle_database_connections)
    assert called["run_ids"] == ["r1", "r2"]
    assert called["queues"] == {"engine", "timers"}
    assert called["worker"].endswith(f":{os.getpid()}")


def test_a_batchs_journals_read_at_once_are_each_runs_own(sent) -> None:
    from runs.engine import journal

    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    execution.advance_and_execute(run_ids[:2], worker="w:1", queues={"default"})
    first = StepRun.objects.filter(run_id=run_ids[0]).order_by("id").first()
    assert first is not None
    afters = {run_ids[0]: first.id, run_ids[1]: 0, run_ids[2]: 0}
    read = journal.journals_of(afters)
    assert read == {run_id: journal.journal_of(run_id, after=afters[run_id]) for run_id in run_ids}
    assert [len(read[run_id]) for run_id in run_ids] == [1, 2, 1]


def test_a_batch_locks_its_runs_in_one_statement_and_reads_their_journals_in_one(sent) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    run_ids = fire(start_sleeping("resumed_after_nap", 4))
    with CaptureQueriesContext(connection) as queries:
        execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    statements = [q["sql"] for q in queries.captured_queries]
    # Once for the chunk's advance, once for its results' record.
    assert sum("AS a(run_id, after)" in sql for sql in statements) == 2  # journal.journals_of
    assert sum("= ANY(" in sql and "FOR NO KEY UPDATE" in sql for sql in statements) == 2
    assert statuses(run_ids) == {"completed"}


def test_a_batch_with_a_parent_and_its_child_reads_the_child_in_its_own_turn(sent, caplog) -> None:
    """A parent's advance may end its child earlier in the same transaction: the child is
    locked with the chunk but read again in its own turn, never planned from the chunk's
    read (which would move a cancelled run, or schedule on it)."""
    from django.db import transaction

    inner = {"id": "gate", "kind": "wait_event", "event": "go", "key": "x", "timeout_ms": 1}
    definition_save(document={"id": "batch_inner", "steps": [inner]})
    late = {"id": "late", "kind": "wait_event", "event": "never", "timeout_ms": 60_000}
    child_step = {"id": "child", "kind": "subworkflow", "workflow": "batch_inner"}
    definition_save(
        document={
            "id": "batch_outer",
            "steps": [{"id": "par", "kind": "parallel", "branches": {"c": child_step, "t": late}}],
        }
    )
    parent = services.run_start(workflow="batch_outer", input={}).run
    child = Run.objects.get(parent_run=parent)
    past = timezone.now() - timedelta(seconds=1)
    StepRun.objects.filter(run__in=[parent, child], status="waiting").update(not_before=past)
    Timer.objects.filter(run__in=[parent, child]).update(fire_at=past, fired_at=None)
    assert {run_id for run_id, *_ in timers.claim_due(timezone.now(), 1000)} == {
        parent.id,
        child.id,
    }

    with transaction.atomic():
        read = advance._read_many([str(parent.id), str(child.id)])
    assert list(read) == [str(parent.id)]

    execution.advance_and_execute([str(child.id), str(parent.id)], worker="w:1", queues=set())
    assert "failed; the reconciler takes it" not in caplog.text
    assert Run.objects.get(id=parent.id).status == "failed"
    assert Run.objects.get(id=child.id).status in {"cancelled", "failed"}
    assert not StepRun.objects.filter(
        run__in=[parent, child], status__in=["scheduled", "running", "waiting"]
    ).exists()


def _fired_and_advanced(workflow_id: str, count: int) -> tuple[list[str], list[str]]:
    """``count`` runs of ``workflow_id`` whose sleep ``nap`` is over, advanced in one batch;
    (their ids, the statements the batch sent), read before anything else runs on the
    connection (Django's query log is read lazily)."""
    from django.test.utils import CaptureQueriesContext

    runs = [services.run_start(workflow=workflow_id, input={}).run for _ in range(count)]
    run_ids = fire(runs, step_id="nap")
    with CaptureQueriesContext(connection) as captured:
        execution.advance_and_execute(run_ids, worker="w:1", queues={"default"})
    sent = [" ".join(query["sql"].split()) for query in captured.captured_queries]
    return run_ids, sent


# A sleep alone: its run ends when it is over.
NAP_ONLY = {"id": "nap_only", "steps": [{"id": "nap", "kind": "sleep", "ms": 60_000}]}
# A sleep beside a wait that never ends: the run waits on once the sleep is over.
NAP_BESIDE_WAIT = {
    "id": "nap_beside_wait",
    "steps": [
        {
            "id": "par",
            "kind": "parallel",
            "branches": {
                "nap": {"id": "nap", "kind": "sleep", "ms": 60_000},
                "wait": {"id": "wait", "kind": "wait_event", "event": "never"},
            },
        }
    ],
}


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_a_fired_sleeps_close_rides_on_its_next_attempts_insert_and_its_end_is_one_statement(
    sent,
) -> None:
    definition_save(document=resumed.document())
    run_ids, statements = _fired_and_advanced("resumed_after_nap", 10)
    assert statuses(run_ids) == {"completed"}
    assert sorted(ran) == sorted(run_ids)
    naps = StepRun.objects.filter(run_id__in=run_ids, step_id="nap")
    assert set(naps.values_list("status", flat=True)) == {"succeeded"}
    assert naps.filter(finished_at__isnull=True).count() == 0
    # The runs' deadline timers went with their ends.
    assert not Timer.objects.filter(run_id__in=run_ids, fired_at__isnull=True).exists()
    # The close is a data-modifying WITH of the insert, not a statement of its own; the
    # chunk's ten runs (ADVANCE_RUNS_CHUNK) insert their next attempts in one statement,
    # each run's close and update riding on it.
    closes = [s for s in statements if s.startswith("UPDATE runs_steprun SET status = 'succeeded'")]
    assert closes == []
    [insert] = [s for s in statements if "INSERT INTO runs_steprun" in s]
    assert insert.startswith("WITH rider_0 AS (UPDATE runs_steprun") and "UNNEST(" in insert
    assert insert.count("UPDATE runs_steprun SET status = 'succeeded'") == 10
    assert insert.count("UPDATE runs_run SET") == 10
    # The ends move the runs, drop their timers and read what they leave, in one statement
    # for the ten (ending.Ends: their steps were recorded together).
    [ends] = [s for s in statements if s.startswith("WITH moved_0 AS (UPDATE runs_run")]
    assert ends.count(" AS (UPDATE runs_run") == 10
    separate = ("UPDATE runs_run", "DELETE FROM runs_timer")
    assert not [s for s in statements if s.startswith(separate)]
    # The chunk's statements, shared by its ten runs: the advance (requests taken; lock and
    # journals read; next attempts inserted claimed, with the closes) and the recording
    # together of the ten next steps' results (lock, record, journals, ends), each in a
    # transaction (savepoints here). It was 9.5 a run before the close rode and the end was
    # one statement, 7.5 before the chunk's inserts were one, 2.1 before the ends were one.
    assert len(statements) / len(run_ids) <= 1.2, statements


def test_a_sleep_closed_just_before_the_runs_end_is_written_before_the_end_reads(sent) -> None:
    """A plan of a close then the run's end: the end reads the run's rows in flight and
    cancels them, so the close (a rider) must be sent before it, not after."""
    definition_save(document=NAP_ONLY)
    run_ids, _ = _fired_and_advanced("nap_only", 2)
    assert statuses(run_ids) == {"completed"}
    naps = StepRun.objects.filter(run_id__in=run_ids)
    assert list(naps.values_list("status", flat=True)) == ["succeeded", "succeeded"]


def test_a_close_with_nothing_after_it_is_still_written(sent) -> None:
    """A plan whose only write is the close (another branch still waits, the run's status
    stays): the rider goes on its own."""
    definition_save(document=NAP_BESIDE_WAIT)
    run_ids, _ = _fired_and_advanced("nap_beside_wait", 2)
    assert statuses(run_ids) == {"waiting"}
    rows = StepRun.objects.filter(run_id__in=run_ids)
    assert set(rows.filter(step_id="nap").values_list("status", flat=True)) == {"succeeded"}
    assert set(rows.filter(step_id="wait").values_list("status", flat=True)) == {"waiting"}


def test_a_chunk_of_runs_that_end_close_or_go_on_is_written_in_order(sent) -> None:
    """One chunk of runs whose plans differ: a next attempt (its insert deferred to the
    chunk's one statement), the run's end right after a close, a close alone (another
    branch still waits). Each is written as if advanced alone."""
    for document in (resumed.document(), NAP_ONLY, NAP_BESIDE_WAIT):
        definition_save(document=document)
    kinds = {"resumed_after_nap": 3, "nap_only": 3, "nap_beside_wait": 3}
    runs = [
        services.run_start(workflow=workflow_id, input={}).run
        for workflow_id, count in kinds.items()
        for _ in range(count)
    ]
    run_ids = fire(runs, step_id="nap")
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 3
    by_workflow = {
        workflow_id: statuses([str(run.id) for run in runs if run.workflow_id == workflow_id])
        for workflow_id in kinds
    }
    assert by_workflow == {
        "resumed_after_nap": {"completed"},
        "nap_only": {"completed"},
        "nap_beside_wait": {"waiting"},
    }
    assert set(StepRun.objects.filter(step_id="nap").values_list("status", flat=True)) == {
        "succeeded"
    }
    afters = StepRun.objects.filter(step_id="after")
    assert sorted(afters.values_list("run_id", flat=True)) == sorted(
        run.id for run in runs if run.workflow_id == "resumed_after_nap"
    )
    assert set(afters.values_list("status", "attempt")) == {("succeeded", 1)}
    # Each run's own update rode on the chunk's insert: its count of attempts scheduled.
    resumed_runs = Run.objects.filter(workflow_id="resumed_after_nap")
    assert set(resumed_runs.values_list("attempts", flat=True)) == {1}


def test_a_chunk_whose_inserts_fail_is_advanced_one_run_at_a_time(sent, monkeypatch) -> None:
    """The chunk's one statement of next attempts failing (a run that cannot move as
    planned, a lost connection) rolls the chunk back, and its runs are advanced one by
    one, each with its own insert."""
    from runs.engine import apply

    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    tried: list[int] = []

    def failing(entries: Any) -> Any:
        tried.append(len(entries))
        raise RuntimeError("1 of 3 runs cannot move as planned")

    monkeypatch.setattr(apply, "insert_lone_attempts", failing)
    assert execution.advance_and_execute(run_ids, worker="w:1", queues={"default"}) == 3
    assert tried == [3]
    assert sorted(ran) == sorted(run_ids)
    assert statuses(run_ids) == {"completed"}
    assert StepRun.objects.filter(run_id__in=run_ids, step_id="after").count() == 3


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_the_chunks_insert_refuses_a_run_that_cannot_move_and_its_transaction_writes_nothing(
    sent,
) -> None:
    import uuid

    from django.db import transaction

    from runs.engine import apply, store

    run_ids = fire(start_sleeping("resumed_after_nap", 3))
    template = {name: getattr(StepRun(), attname) for name, attname in apply._ATTEMPT_FIELDS}

    def entry(run_id: str, status: str) -> store.LoneAttempt:
        values = {
            **template,
            "run": uuid.UUID(run_id),
            "step_id": "after",
            "kind": "task",
            "attempt": 1,
            "status": "scheduled",
            "input": {},
        }
        return store.LoneAttempt(run_id, values, {"attempts": 1, "status": status}, [])

    # A waiting run may become running; a completed one may not become waiting (a plan
    # made on a stale instance).
    Run.objects.filter(id=run_ids[2]).update(status="completed")
    with pytest.raises(RuntimeError, match="1 of 2 runs cannot move"), transaction.atomic():
        store.insert_lone_attempts([entry(run_ids[0], "running"), entry(run_ids[2], "waiting")])
    assert statuses(run_ids[:2]) == {"waiting"}
    assert not StepRun.objects.filter(run_id__in=run_ids, step_id="after").exists()
    with transaction.atomic():
        ids = store.insert_lone_attempts(
            [entry(run_ids[0], "running"), entry(run_ids[1], "running")]
        )
    attempts = StepRun.objects.in_bulk(ids)
    assert [str(attempts[i].run_id) for i in ids] == run_ids[:2]
    assert statuses(run_ids[:2]) == {"running"}


def test_results_written_together_are_each_as_written_alone_and_fenced_by_their_claim(
    sent,
) -> None:
    """store.record_results: a success with no output, a failure with an error, a time-out,
    each row as record_result writes it; a claim lost meanwhile writes nothing."""
    from runs.engine import store

    run_ids = fire(start_sleeping("resumed_after_nap", 4))
    attempts = []
    for run_id in run_ids:
        row = StepRun.objects.get(run_id=run_id, step_id="nap")
        attempt = StepRun.objects.create(
            run_id=run_id,
            step_id="after",
            kind="task",
            attempt=1,
            status="running",
            claim=uuid.uuid4(),
            input={},
            idempotency_key=f"{run_id}::after",
            celery_task_id=str(uuid.uuid4()),
            generation=row.generation,
        )
        attempts.append(attempt)
    now = timezone.now()
    common = {"finished_at": now, "lease_expires_at": None, "usage": {}, "reserved_usd": 0}
    values = [
        {"status": "succeeded", "output": None, "error": None, "spans": [], **common},
        {
            "status": "failed",
            "output": None,
            "error": {"class": "fatal", "message": "x"},
            "spans": [{"name": "s"}],
            **common,
        },
        {
            "status": "timed_out",
            "output": None,
            "error": {"class": "timeout"},
            "spans": [],
            **common,
        },
        {"status": "succeeded", "output": {"a": [1, "é"]}, "error": None, "spans": [], **common},
    ]
    stale = uuid.uuid4()  # the last one's claim was lost (given up, claimed again)
    entries = [
        (a.id, a.claim if n < 3 else stale, v)
        for n, (a, v) in enumerate(zip(attempts, values, strict=True))
    ]
    assert store.record_results(entries) == {a.id for a in attempts[:3]}
    for attempt, written in zip(attempts[:3], values[:3], strict=True):
        row = StepRun.objects.get(id=attempt.id)
        assert (row.status, row.output, row.error, row.spans) == (
            written["status"],
            written["output"],
            written["error"],
            written["spans"],
        )
        assert row.finished_at == now and row.lease_expires_at is None
    assert StepRun.objects.get(id=attempts[3].id).status == "running"
