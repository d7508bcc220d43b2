"""DJFLOW_CHECK_PREFIX reads the journal a second time, in another statement. An
attempt inside a composite step is recorded without the run's lock (_record_inside), so a
completion committed between the two reads makes the check see a different journal and
raise on a plan that was right (a false alarm, in whatever process planned: a worker's
recording transaction or an advance task, which then fails)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from runs import services
from runs.engine import advance, journal
from runs.models import StepRun
from workers.execution import execute
from workflows.sdk import handler
from workflows.services import definition_save

pytestmark = pytest.mark.django_db(transaction=True)


@handler("review_check.noop")
def noop(ctx: Any, input: Any, prior: Any) -> None:
    return None


def _task(step_id: str) -> dict[str, Any]:
    return {"id": step_id, "kind": "task", "handler": "review_check.noop"}


def test_a_completion_between_the_two_reads_is_no_difference(settings, monkeypatch):
    settings.DJFLOW = {**settings.DJFLOW, "INLINE_MAX_STEPS": 0, "CHECK_PREFIX": True}
    journal.forget_prefixes()
    definition_save(
        document={
            "id": "review_check",
            "steps": [
                _task("s0"),
                {
                    "id": "both",
                    "kind": "parallel",
                    "branches": {"a": [_task("a")], "b": [_task("b")]},
                },
                _task("after"),
            ],
        }
    )
    run = services.run_start(workflow="review_check", input={}).run
    execute(StepRun.objects.get(run=run, step_id="s0").id, worker="in-process")
    assert journal.prefix_for(run) is not None  # s0 settled: this process plans from it
    now = timezone.now()
    StepRun.objects.filter(run=run, step_id="a").update(status="succeeded", finished_at=now)
    StepRun.objects.filter(run=run, step_id="b").update(status="running")

    def b_recorded_elsewhere() -> None:
        # What another worker's _record_inside commits, without the run's lock.
        try:
            StepRun.objects.filter(run=run, step_id="b").update(
                status="succeeded", finished_at=timezone.now()
            )
        finally:
            connections.close_all()

    real = advance.plan

    def plan_then_b_commits(*args: Any, **kwargs: Any) -> Any:
        planned = real(*args, **kwargs)
        if kwargs.get("prefix") is not None:
            other = threading.Thread(target=b_recorded_elsewhere)
            other.start()
            other.join()
        return planned

    monkeypatch.setattr(advance, "plan", plan_then_b_commits)
    advance.run_advance(run_id=run.id)  # raised AssertionError: from a prefix ... from the journal
    assert connection.in_atomic_block is False
