"""a failed run whose failure came from a body of several steps (an anonymous child
run) is retried (a new generation, no from_step): the planner must open a new body run."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from runs.engine.plan import AttemptView, Open, RunView, plan

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _task(step_id: str) -> dict:
    return {"id": step_id, "kind": "task", "handler": "h"}


def test_a_retried_run_reopens_its_failed_body_run():
    document = {
        "id": "d",
        "steps": [{"id": "fan", "kind": "foreach", "items": [1], "do": [_task("a"), _task("b")]}],
    }
    failure = {"class": "fatal", "message": "child run c1 failed: x", "step": "b"}
    journal = [
        AttemptView(id=1, step_id="fan", attempt=1, status="failed", kind="foreach", error=failure),
        AttemptView(
            id=2,
            step_id="_body",
            path="fan[0]/",
            attempt=1,
            status="failed",
            kind="subworkflow",
            error=failure,
        ),
    ]
    view = RunView(
        id="r1",
        status="running",
        input={},
        correlation=None,
        generation=2,
        started_at=NOW,
        deadline_at=NOW + timedelta(hours=1),
    )
    planned = plan(document, view, journal, NOW)  # raised KeyError: 'workflow'
    opened = [a for a in planned.actions if isinstance(a, Open) and a.step_id == "_body"]
    assert opened and opened[0].start is not None and opened[0].start["body"] == "fan.do"
