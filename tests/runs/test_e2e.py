"""The engine end to end on real processes: Postgres, Redis, `celery worker`, `celery beat`.

Every test starts its own worker (and beat where time matters) on the test database, runs
workflows from ``tests.runs.flows`` and checks the journal and the side table the handlers
write, which proves how many times a body really ran.
"""

from __future__ import annotations

import signal
import time
from decimal import Decimal
from unittest import mock

import pytest

from runs import services
from runs.engine.advance import run_advance
from runs.models import Run, StepRun
from tests.processes import wait_for
from workers.tasks import execute_step
from workflows.sync import sync_modules

from .flows import effects, ensure_effects_table

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.runs.flows"]
# Short leases so a lost worker is noticed in seconds, not the production 30 s.
FAST = {
    "DJFLOW_LEASE_SECONDS": "2",
    "DJFLOW_DEADLINE_GRACE_SECONDS": "2",
    "DJFLOW_RECONCILE_SECONDS": "2",
}
TERMINAL = ("completed", "failed", "cancelled", "timed_out")


@pytest.fixture(autouse=True)
def _effects_table(transactional_db):
    ensure_effects_table()


def finished(run_id, timeout: float = 30.0, logs=lambda: "") -> Run:
    def ended():
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=timeout, interval=0.1, message=logs)


def journal(run: Run) -> list[tuple[str, int, str]]:
    return list(run.steps.order_by("id").values_list("step_id", "attempt", "status"))


def start(workflow: str, input=None, **kwargs) -> Run:
    return services.run_start(workflow=workflow, input=input, **kwargs).run


def test_support_ticket_question_path(celery_worker, celery_processes) -> None:
    celery_worker(workflow_modules=["workflows.examples.support_ticket"])
    run = start("support_ticket", {"ticket": "Q: where is my invoice?"})
    run = finished(run.id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == {"sent": True}
    assert journal(run) == [
        ("classify", 1, "succeeded"),
        ("draft", 1, "succeeded"),
        ("approval", 1, "skipped"),
        ("send", 1, "succeeded"),
    ]
    draft = run.steps.get(step_id="draft")
    assert draft.output == "an answer to a question"
    assert draft.input == {"kind": "question"}
    assert draft.usage["input_tokens"] == 812 and draft.usage["output_tokens"] == 37
    # The example's made-up usage is the offline stand-in's: it costs nothing (issue 37).
    assert draft.cost_usd == Decimal("0")
    assert run.cost_usd == Decimal("0")
    assert (draft.spans[0]["provider"], draft.spans[0]["model"]) == ("standin", "echo")
    send = run.steps.get(step_id="send")
    assert send.input == {"text": "an answer to a question"}
    assert send.worker and send.started_at and send.finished_at
    assert run.started_at and run.finished_at


def test_a_start_handed_to_a_worker_runs_and_a_lost_advance_is_made_up(
    celery_worker, celery_beat, celery_processes
) -> None:
    """Past its pace POST /runs inserts the run and sends one runs.advance: a worker plans and
    runs it. Should that message be lost, the reconciler advances the pending run."""
    lost = {**FAST, "DJFLOW_LOST_MESSAGE_SECONDS": "1"}
    celery_worker(workflow_modules=["workflows.examples.support_ticket"], env=lost)
    celery_beat(env=lost)
    handed = start("support_ticket", {"ticket": "Q: where is my invoice?"}, plan_now=False)
    assert handed.status == "pending"
    # The message never leaves this process.
    with mock.patch("runs.dispatch._advance_signature") as lost_message:
        orphan = start("support_ticket", {"ticket": "Q: where is my parcel?"}, plan_now=False)
    lost_message.assert_called_once()
    assert not orphan.steps.exists()
    for run in (handed, orphan):
        ended = finished(run.id, timeout=60, logs=celery_processes.logs)
        assert ended.status == "completed", ended.error
        assert [step for step, _, _ in journal(ended)] == ["classify", "draft", "approval", "send"]


def test_retryable_failure_is_retried_with_backoff_then_succeeds(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    celery_beat()
    run = start("flaky", {"fail_times": 2})
    run = finished(run.id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert journal(run) == [
        ("first", 1, "succeeded"),
        ("wobbly", 1, "failed"),
        ("wobbly", 2, "failed"),
        ("wobbly", 3, "succeeded"),
    ]
    attempts = list(run.steps.filter(step_id="wobbly").order_by("attempt"))
    assert {a.error["class"] for a in attempts[:2]} == {"retryable"}
    # Exponential back-off from 300 ms: the second try no sooner than 300 ms after the
    # first failed, the third no sooner than 600 ms after the second.
    gap_1 = (attempts[1].started_at - attempts[0].finished_at).total_seconds()
    gap_2 = (attempts[2].started_at - attempts[1].finished_at).total_seconds()
    assert gap_1 >= 0.3 and gap_2 >= 0.6, (gap_1, gap_2)
    # ctx.idempotency_key is stable across the retries of one step in one run.
    assert len({a.idempotency_key for a in attempts}) == 1
    assert run.output["key"] == attempts[0].idempotency_key
    assert run.output == {
        "attempt": 3,
        "key": attempts[0].idempotency_key,
        "first": {"fail_times": 2},
    }
    assert len(effects(run.id, "wobbly")) == 3


def test_budget_exhaustion_with_fail_run_fails_the_run_naming_the_step(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    celery_beat()
    run = finished(start("flaky", {"fail_times": 5}).id, logs=celery_processes.logs)
    assert run.status == "failed"
    assert run.error == {"class": "retryable", "message": "busy on attempt 3", "step": "wobbly"}
    assert len(effects(run.id, "wobbly")) == 3


def test_on_error_continue_goes_on_and_a_later_guard_reads_the_status(
    celery_worker, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = finished(start("recovering", {}).id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert journal(run) == [("breaks", 1, "failed"), ("after", 1, "succeeded")]
    assert run.steps.get(step_id="breaks").error["message"] == "ValueError: the body broke"
    assert run.output == {"saw": {"status": "failed", "class": "fatal"}}


@pytest.mark.start_checks_workers(False)  # started before any worker exists, on purpose
def test_a_duplicate_delivery_runs_the_handler_once(celery_worker, celery_processes) -> None:
    sync_modules(FLOWS)
    run = start("fragile", {})
    # Plan the first step here, before any worker exists, then deliver its attempt three
    # times over: the original message and two duplicates.
    run_advance(run_id=run.id)
    attempt = StepRun.objects.get(run=run, step_id="one")
    execute_step.apply_async((attempt.id,))
    execute_step.apply_async((attempt.id,))
    celery_worker(workflow_modules=FLOWS, concurrency=2)
    wait_for(lambda: effects(run.id, "two"), timeout=20, message=celery_processes.logs)
    time.sleep(1)  # let every copy of the message be consumed
    assert len(effects(run.id, "one")) == 1
    assert StepRun.objects.filter(run=run, step_id="one").count() == 1


@pytest.mark.parametrize("effect", ["at_least_once", "at_most_once"])
def test_kill_9_of_the_worker_mid_step(
    effect, celery_worker, celery_beat, celery_processes
) -> None:
    """at_least_once: offered again. at_most_once: in doubt (it was a failure, class lost,
    before CONTRACT section 13), never run again, and with nobody to resolve it the deadline
    (DJFLOW_IN_DOUBT_SECONDS, a timer the beat fires) fails it, class in_doubt."""
    env = {**FAST, "DJFLOW_IN_DOUBT_SECONDS": "4"}
    doomed = celery_worker(workflow_modules=FLOWS, env=env, concurrency=1)
    celery_beat(env=env)
    run = start(f"slow_{effect}", {"seconds": 3})
    wait_for(lambda: effects(run.id, "slow"), timeout=20, message=celery_processes.logs)
    killed = doomed.kill(signal.SIGKILL)
    assert killed and not doomed.alive()
    celery_worker(workflow_modules=FLOWS, env=env, concurrency=1)
    if effect == "at_most_once":
        wait_for(
            lambda: StepRun.objects.filter(run=run, step_id="slow", status="in_doubt").exists(),
            timeout=20,
            interval=0.1,
            message=celery_processes.logs,
        )
        assert Run.objects.get(id=run.id).status == "waiting"
    run = finished(run.id, timeout=40, logs=celery_processes.logs)
    slow = list(run.steps.filter(step_id="slow").order_by("attempt"))
    if effect == "at_least_once":
        assert slow[0].error["class"] == "lost"
        assert run.status == "completed", run.error
        assert [(a.attempt, a.status) for a in slow] == [(1, "failed"), (2, "succeeded")]
        bodies = effects(run.id, "slow")
        assert len(bodies) == 2 and bodies[0][4] is None and bodies[1][4] is not None
    else:
        assert run.status == "failed"
        assert run.error["class"] == "in_doubt" and run.error["step"] == "slow"
        assert "before its deadline" in run.error["message"]
        assert [(a.attempt, a.status) for a in slow] == [(1, "failed")]
        assert len(effects(run.id, "slow")) == 1  # never run twice
        assert effects(run.id, "tail") == []


def test_max_steps_stops_a_runaway_loop_of_retries(celery_worker, celery_processes) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = finished(start("runaway", {}).id, logs=celery_processes.logs)
    assert run.status == "failed"
    assert run.error["class"] == "limit" and "limits.max_steps (5)" in run.error["message"]
    assert len(effects(run.id, "spin")) == 5
    assert run.steps.count() == 5


def test_max_cost_usd_stops_a_run_whose_agent_reports_usage(
    celery_worker, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = finished(start("costly", {}).id, logs=celery_processes.logs)
    assert run.status == "failed"
    assert run.error["class"] == "limit" and "limits.max_cost_usd (0.05)" in run.error["message"]
    assert run.error["step"] == "think"
    assert run.cost_usd == Decimal("0.060000")
    assert len(effects(run.id, "think")) == 1 and effects(run.id, "think_again") == []


def test_cancel_stops_the_run_and_nothing_starts_afterwards(
    celery_worker, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = start("steady", {})
    wait_for(lambda: effects(run.id, "tick_2"), timeout=20, message=celery_processes.logs)
    services.run_cancel(run_id=run.id)
    run.refresh_from_db()
    assert run.status == "cancelled" and run.error["class"] == "cancelled"
    time.sleep(1.5)
    assert [row[0] for row in effects(run.id)] == ["tick_1", "tick_2"]
    assert run.steps.get(step_id="tick_2").status == "cancelled"
    assert not run.steps.filter(step_id="tick_3").exists()


def test_pause_and_resume(celery_worker, celery_processes) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = start("steady", {})
    wait_for(lambda: effects(run.id, "tick_2"), timeout=20, message=celery_processes.logs)
    services.run_pause(run_id=run.id)
    # The attempt already running finishes and is recorded; nothing new starts.
    wait_for(
        lambda: StepRun.objects.filter(run=run, step_id="tick_2", status="succeeded").exists(),
        timeout=10,
    )
    time.sleep(1.0)
    assert [row[0] for row in effects(run.id)] == ["tick_1", "tick_2"]
    assert Run.objects.get(id=run.id).status == "paused"
    services.run_resume(run_id=run.id)
    run = finished(run.id, logs=celery_processes.logs)
    assert run.status == "completed" and run.output == 6
    assert [row[0] for row in effects(run.id)] == [f"tick_{n}" for n in range(1, 7)]


def test_retry_from_the_failed_step_keeps_what_succeeded(celery_worker, celery_processes) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = finished(start("fragile", {}).id, logs=celery_processes.logs)
    assert run.status == "failed" and run.error["step"] == "two"
    services.run_retry(run_id=run.id)
    run = finished(run.id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == 3
    assert journal(run) == [
        ("one", 1, "succeeded"),
        ("two", 1, "failed"),
        ("two", 2, "succeeded"),
        ("three", 1, "succeeded"),
    ]
    assert [row[0] for row in effects(run.id)] == ["one", "two", "two", "three"]
    assert run.generation == 2


@pytest.mark.start_checks_workers(False)  # started before a worker that serves it, on purpose
def test_unservable_is_requeued_for_another_worker_without_using_the_budget(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS, concurrency=1)
    celery_beat()
    run = start("orphan", {})
    wait_for(
        lambda: StepRun.objects.filter(run=run, refusals__gte=1).exists(),
        timeout=20,
        message=celery_processes.logs,
    )
    celery_worker(workflow_modules=[*FLOWS, "tests.runs.flows_extra"], concurrency=1)
    run = finished(run.id, timeout=30, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == {"served_by": "flows_extra"}
    [attempt] = run.steps.all()
    assert attempt.attempt == 1 and attempt.refusals >= 1


def test_workers_reconnect_when_their_database_connections_are_killed(
    celery_worker, celery_beat, celery_processes
) -> None:
    from django.db import connection

    celery_worker(workflow_modules=FLOWS)
    celery_beat()
    run = start("steady", {})
    for step in ("tick_2", "tick_4"):
        wait_for(lambda s=step: effects(run.id, s), timeout=20, message=celery_processes.logs)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert cursor.fetchone()[0] >= 1
    run = finished(run.id, timeout=60, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == 6
    # Every body ran once: the killed connections cost no step and repeated none.
    assert [row[0] for row in effects(run.id)] == [f"tick_{n}" for n in range(1, 7)]


def test_a_step_past_its_timeout_is_timed_out_by_the_worker_and_retried(
    celery_worker, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = finished(start("sluggish", {}).id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert journal(run) == [("slow", 1, "timed_out"), ("slow", 2, "succeeded")]
    first = run.steps.get(attempt=1)
    assert first.error["class"] == "timeout"
    assert (first.finished_at - first.started_at).total_seconds() < 2.5


def test_the_engine_times_out_a_body_that_ignores_the_workers_limit(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS, env=FAST)
    celery_beat(env=FAST)
    run = finished(start("stubborn", {}).id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert journal(run) == [("deaf", 1, "timed_out"), ("deaf", 2, "succeeded")]
    assert run.steps.get(attempt=1).error == {
        "class": "timeout",
        "message": "the attempt ran past its timeout_ms",
    }
    # The first body finishes later; its result is refused (the fence), not recorded.
    wait_for(lambda: all(row[4] for row in effects(run.id, "deaf")), timeout=10)
    time.sleep(0.5)
    assert journal(Run.objects.get(id=run.id)) == [
        ("deaf", 1, "timed_out"),
        ("deaf", 2, "succeeded"),
    ]


def test_run_timeout_ends_the_run_as_timed_out(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS)
    celery_beat()
    run = finished(start("overdue", {}).id, timeout=20, logs=celery_processes.logs)
    assert run.status == "timed_out"
    assert run.error == {
        "class": "timeout",
        "message": "limits.run_timeout_ms (2000 ms) reached",
        "step": None,
    }
    elapsed = (run.finished_at - run.started_at).total_seconds()
    assert 2.0 <= elapsed < 4.5, elapsed
    assert journal(run) == [("long", 1, "cancelled")]


@pytest.mark.parametrize(("max_inline", "messages"), [("50", 1), ("2", 2), ("0", 6)])
def test_a_worker_runs_the_next_steps_itself_within_its_budget(
    max_inline, messages, celery_worker, celery_processes, settings
) -> None:
    # The first message is sent from here: its Celery time limits leave room for the budget.
    settings.DJFLOW = {**settings.DJFLOW, "INLINE_SECONDS": 30.0}
    budget = {"DJFLOW_INLINE_MAX_STEPS": max_inline, "DJFLOW_INLINE_SECONDS": "30"}
    worker = celery_worker(workflow_modules=FLOWS, env=budget)
    run = finished(start("steady", {}).id, logs=celery_processes.logs)
    assert run.status == "completed" and run.output == 6
    received = [
        line
        for line in worker.logs().splitlines()
        # The carrier's name (the steps it runs show in Flower by theirs: workers.task_events).
        if "Task workers.execute_step[" in line and "received" in line
    ]
    # One message per broker hop: the first step's, then one per budget spent.
    assert len(received) == messages, received


def test_a_step_run_inline_has_its_own_time_limit(celery_worker, celery_processes) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = finished(start("inline", {}).id, logs=celery_processes.logs)
    assert run.status == "failed"
    capped = run.steps.get(step_id="capped")
    assert capped.status == "timed_out"
    # The worker's own alarm (not the engine's later deadline timer) stopped it.
    assert capped.error == {"class": "timeout", "message": "the attempt ran past 1000 ms"}
    assert (capped.finished_at - capped.started_at).total_seconds() < 2
    assert capped.worker == run.steps.get(step_id="quick").worker
