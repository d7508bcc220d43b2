"""Attempts no live worker serves (``runs.engine.unservable``), in the database: the wait
starts, shows on the run, and ends in an ``unservable`` failure, or is called off when a
worker that serves the handler was seen. The end to end test, with real workers, is in
``test_unservable_e2e.py``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.utils import timezone

from runs import services
from runs.engine import timers, unservable
from runs.engine.reconcile import reconcile
from runs.models import Run, StepRun, Timer, TimerPurpose
from workflows import heartbeats
from workflows.services import definition_save

pytestmark = pytest.mark.django_db

HELLO = {"id": "hello", "steps": [{"id": "greet", "kind": "task"}]}
WINDOW = 60.0  # UNSERVABLE_SECONDS' default


def start(document: dict[str, Any] = HELLO) -> tuple[Run, StepRun]:
    definition_save(document=document)
    run = services.run_start(workflow=document["id"], input={}).run
    return run, run.steps.get(status="scheduled")


def arm(attempt: StepRun, handler: str = "hello.greet") -> bool:
    return unservable.unservable_arm(
        step_run_id=attempt.id,
        run_id=attempt.run_id,
        handler=handler,
        queue=attempt.queue,
        now=timezone.now(),
    )


def beat(handlers: list[str], hostname: str = "w1@test") -> None:
    heartbeats.heartbeat_record(
        hostname=hostname,
        handlers=handlers,
        queues=["default"],
        pid=1,
        started_at=timezone.now(),
    )


def fire_after(seconds: float) -> int:
    with time_machine.travel(timezone.now() + timedelta(seconds=seconds), tick=False):
        return timers.fire_due()


def test_a_wait_starts_once_and_shows_on_the_run(api) -> None:
    run, attempt = start()
    assert arm(attempt)
    attempt.refresh_from_db()
    since = attempt.waiting_since
    assert (attempt.waiting_for, since is not None) == ("hello.greet", True)
    [timer] = Timer.objects.filter(purpose=TimerPurpose.UNSERVABLE)
    assert timer.fire_at == since + timedelta(seconds=WINDOW)
    # A second hand-back during the same wait keeps its start and its one timer.
    assert arm(attempt)
    attempt.refresh_from_db()
    assert attempt.waiting_since == since
    assert Timer.objects.filter(purpose=TimerPurpose.UNSERVABLE).count() == 1

    body = api.get(f"/api/v1/runs/{run.id}").json()
    assert body["reason"].startswith(
        "waiting for a worker that serves hello.greet (step 'greet', queue 'default'); the "
        "step fails as unservable at "
    )
    assert body["steps"][0]["waiting_for"] == "hello.greet"


def test_no_wait_while_a_live_worker_serves_the_handler(api) -> None:
    beat(["hello.greet"])
    run, attempt = start()
    assert not arm(attempt)
    attempt.refresh_from_db()
    assert (attempt.waiting_for, attempt.waiting_since) == ("", None)
    assert api.get(f"/api/v1/runs/{run.id}").json()["reason"] is None


def test_the_wait_ends_in_an_unservable_failure_naming_the_handler() -> None:
    run, attempt = start()
    arm(attempt)
    assert fire_after(WINDOW - 1) == 0
    assert fire_after(WINDOW + 0.5) == 1
    attempt.refresh_from_db()
    run.refresh_from_db()
    assert attempt.status == "failed"
    assert attempt.error["class"] == "unservable"
    assert attempt.error["message"].startswith(
        "no live worker serves handler 'hello.greet' (step 'greet'); start a worker that "
        "imports it (WORKFLOW_MODULES) (waited "
    )
    assert run.status == "failed"
    assert (run.error["class"], run.error["step"]) == ("unservable", "greet")
    assert "'hello.greet'" in run.error["message"]
    # Never retried: unservable is not a retryable class.
    assert run.steps.count() == 1


def test_on_error_continue_goes_on_past_an_unservable_step() -> None:
    document = {
        "id": "hello",
        "steps": [
            {"id": "greet", "kind": "task", "on_error": "continue"},
            {"id": "nap", "kind": "sleep", "ms": 1},
        ],
    }
    run, attempt = start(document)
    arm(attempt)
    fire_after(WINDOW + 1)
    assert run.steps.get(step_id="greet").status == "failed"
    assert run.steps.filter(step_id="nap").exists()


def test_a_worker_seen_during_the_wait_calls_it_off_and_offers_again(
    django_capture_on_commit_callbacks,
) -> None:
    run, attempt = start()
    arm(attempt)
    beat(["hello.greet"])  # started, and busy: it has not taken the attempt yet
    heartbeats.heartbeat_stop(hostname="w1@test")  # then gone again
    with django_capture_on_commit_callbacks() as offers:
        assert fire_after(WINDOW + 1) == 1
    attempt.refresh_from_db()
    assert (attempt.status, attempt.waiting_since) == ("scheduled", None)
    assert len(offers) == 1
    run.refresh_from_db()
    assert run.status == "running"
    # The next hand-back starts a new wait, with a timer of its own.
    assert arm(attempt)
    assert Timer.objects.filter(purpose=TimerPurpose.UNSERVABLE, fired_at__isnull=True).count() == 1


def test_an_attempt_taken_meanwhile_is_left_alone() -> None:
    _run, attempt = start()
    arm(attempt)
    StepRun.objects.filter(id=attempt.id).update(status="running")
    assert unservable.unservable_expire(step_run_ids=[attempt.id]) == 0
    attempt.refresh_from_db()
    assert attempt.status == "running"


def left_scheduled(served: list[str]) -> StepRun:
    """An attempt no worker took for LOST_MESSAGE_SECONDS, a worker serving ``served``."""
    _run, attempt = start()
    beat(served)
    long_ago = timezone.now() - timedelta(seconds=11)
    StepRun.objects.filter(id=attempt.id).update(scheduled_at=long_ago)
    return attempt


def test_the_reconciler_starts_the_wait_of_an_attempt_no_worker_handed_back() -> None:
    attempt = left_scheduled(["other.handler"])
    assert reconcile()["unservable"] == 1
    attempt.refresh_from_db()
    assert attempt.waiting_for == "hello.greet"
    assert reconcile()["unservable"] == 0  # already waiting


def test_the_reconciler_leaves_a_served_attempt_to_be_offered_again() -> None:
    attempt = left_scheduled(["hello.greet"])
    assert reconcile()["unservable"] == 0
    attempt.refresh_from_db()
    assert attempt.waiting_since is None


def test_a_worker_that_starts_serving_the_handler_offers_the_waiting_attempts() -> None:
    _run, attempt = start()
    arm(attempt)
    assert unservable.offer_waiting(handlers=["other"], queues=["default"], batch=10) == 0
    assert unservable.offer_waiting(handlers=["hello.greet"], queues=["io"], batch=10) == 0
    offered = unservable.offer_waiting(handlers=["hello.greet"], queues=["default"], batch=10)
    assert offered == 1


def test_a_wait_whose_timer_fired_while_a_worker_held_the_attempt_still_ends() -> None:
    """The timer fires once. Re-offered by the reconciler, the attempt was claimed by a worker
    without the handler at that instant; handed back, it is scheduled and waiting again with
    no timer left. The reconciler ends the wait (the flaky end-to-end test's cause)."""
    run, attempt = start()
    arm(attempt)
    StepRun.objects.filter(id=attempt.id).update(status="running")  # claimed, then...
    assert fire_after(WINDOW + 1) == 1  # the tick leaves an attempt a worker holds
    StepRun.objects.filter(id=attempt.id).update(status="scheduled")  # ...handed back
    attempt.refresh_from_db()
    assert attempt.status == "scheduled" and attempt.waiting_since is not None
    with time_machine.travel(timezone.now() + timedelta(seconds=WINDOW + 2), tick=False):
        assert reconcile()["unservable_overdue"] == 1
    attempt.refresh_from_db()
    run.refresh_from_db()
    assert (attempt.status, attempt.error["class"]) == ("failed", "unservable")
    assert run.status == "failed"


def test_the_reconciler_leaves_a_wait_to_its_timer_until_the_timer_fires() -> None:
    _run, attempt = start()
    arm(attempt)
    with time_machine.travel(timezone.now() + timedelta(seconds=WINDOW + 2), tick=False):
        # Due but not fired yet: the tick's, not the reconciler's.
        assert reconcile()["unservable_overdue"] == 0
    attempt.refresh_from_db()
    assert attempt.status == "scheduled"
