"""Handlers no worker serves, on real processes: workers' heartbeats (a start after the only
worker stopped is accepted and waits), a handler that goes away with its worker mid-run (the
step fails ``unservable``, naming it, within the configured time), and a hand-back as Flower
sees it (RETRY: it is offered again, never SUCCESS)."""

from __future__ import annotations

import time

import pytest
from celery import states

from runs import services
from runs.models import Run, StepRun
from tests.processes import wait_for
from tests.test_flower_events import FlowerView, flower  # noqa: F401 (a fixture)
from workers.task_events import CARRIER
from workflows.errors import InvalidInput
from workflows.models import WorkerHeartbeat
from workflows.sync import sync_modules

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.runs.flows_unservable"]
WINDOW = 3  # DJFLOW_UNSERVABLE_SECONDS in these tests
FAST = {
    "DJFLOW_UNSERVABLE_SECONDS": str(WINDOW),
    "DJFLOW_RECONCILE_SECONDS": "2",
    "DJFLOW_LOST_MESSAGE_SECONDS": "2",
}
TERMINAL = ("completed", "failed", "cancelled", "timed_out")


@pytest.fixture(autouse=True)
def _documents(transactional_db) -> None:
    """Saved before any worker starts (a worker saves them too, at its start)."""
    sync_modules(FLOWS)


def finished(run: Run, timeout: float, logs) -> Run:
    def ended() -> Run | None:
        current = Run.objects.get(id=run.id)
        return current if current.status in TERMINAL else None

    return wait_for(ended, timeout=timeout, interval=0.05, message=logs)


def test_a_worker_beats_before_it_answers_pings_and_says_when_it_stops(
    celery_worker, celery_processes
) -> None:
    with pytest.raises(InvalidInput):  # no worker ever (the check is on with real workers)
        services.run_start(workflow="vanishing", input={})
    worker = celery_worker(workflow_modules=FLOWS)
    # Right after the fixture's ping: not refused.
    run = services.run_start(workflow="vanishing", input={}).run
    row = WorkerHeartbeat.objects.get(hostname=worker.hostname)
    assert {"vanishing.first", "vanishing.last", "orphaned.greet"} <= set(row.handlers)
    assert row.queues == ["default", "engine", "mail", "timers"]
    assert (row.pid, row.stopped_at) == (worker.pid, None)
    first_seen = row.last_seen
    wait_for(
        lambda: WorkerHeartbeat.objects.get(hostname=worker.hostname).last_seen > first_seen,
        timeout=10,
        message="a second heartbeat",
    )
    worker.stop()
    assert WorkerHeartbeat.objects.get(hostname=worker.hostname).stopped_at is not None
    # Stopped cleanly a moment ago, within the window: a start is accepted and waits for a
    # worker (CONTRACT section 14), the run saying for which handler.
    waiting = services.run_start(workflow="vanishing", input={}).run
    assert services_reason(waiting).startswith(
        "waiting for a worker that serves vanishing.first (step 'first'"
    )
    assert run.steps.filter(step_id="first", status="succeeded").exists()


def test_a_handler_that_goes_away_mid_run_fails_unservable_within_the_window(
    celery_worker, celery_beat, celery_processes
) -> None:
    serving = celery_worker(workflow_modules=FLOWS, env=FAST)
    celery_beat(env=FAST)
    run = services.run_start(workflow="vanishing", input={}).run
    wait_for(
        lambda: run.steps.filter(step_id="nap", status="waiting").exists(),
        timeout=20,
        message=celery_processes.logs,
    )
    serving.stop()  # while the run sleeps: `last` has nobody left to serve it
    gone = time.monotonic()
    celery_worker(env=FAST)  # runs the clock and the engine, without the module

    def waiting() -> str | None:
        return services_reason(run)

    reason = wait_for(waiting, timeout=20, interval=0.05, message=celery_processes.logs)
    assert reason.startswith("waiting for a worker that serves vanishing.last (step 'last'")

    run = finished(run, timeout=30, logs=celery_processes.logs)
    elapsed = time.monotonic() - gone
    assert run.status == "failed"
    assert (run.error["class"], run.error["step"]) == ("unservable", "last")
    assert "no live worker serves handler 'vanishing.last' (step 'last')" in run.error["message"]
    [last] = run.steps.filter(step_id="last")
    assert (last.status, last.error["class"], last.attempt) == ("failed", "unservable", 1)
    # The sleep (3 s) ends, the worker hands `last` back at once, and the wait lasts the
    # window; the tick fires it within a second.
    assert elapsed < 3 + WINDOW + 4, elapsed
    print(f"handler gone -> unservable failure: {elapsed:.1f} s (sleep 3 s, window {WINDOW} s)")


def services_reason(run: Run) -> str | None:
    from runs.selectors import run_get
    from runs.serializers import RunSerializer

    return RunSerializer(run_get(run_id=run.id)).data["reason"]


@pytest.mark.start_checks_workers(False)  # started with no worker that serves it, on purpose
def test_a_hand_back_shows_retry_in_flower_not_success(
    celery_worker,
    celery_processes,
    flower: FlowerView,  # noqa: F811
) -> None:
    celery_worker(extra_args=["-E"])  # without the module: hands `orphaned.greet` back
    run = services.run_start(workflow="orphaned", input={}).run
    attempt = wait_for(
        lambda: (
            StepRun.objects.filter(run=run, refusals__gte=1, waiting_since__isnull=False)
            .order_by("id")
            .first()
        ),
        timeout=20,
        message=celery_processes.logs,
    )
    carrier = wait_for(
        lambda: (
            (task := flower.task(attempt.celery_task_id)) and task.state == states.RETRY and task
        ),
        timeout=10,
        message=lambda: f"{flower.task(attempt.celery_task_id)!r} {flower.task_events()}",
    )
    assert carrier.name == CARRIER
    assert "lacks its handler" in carrier.exception
    # The step's own task (workers.task_events) says the same.
    [step_task] = flower.wait_for_states(run, [("orphaned.greet", states.RETRY)])
    assert "lacks the handler" in step_task.exception
    # Never SUCCESS, whatever arrives later: no other event for either.
    time.sleep(1)
    assert (carrier.state, step_task.state) == (states.RETRY, states.RETRY)
