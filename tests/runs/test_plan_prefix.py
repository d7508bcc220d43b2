"""A plan from a run's settled prefix (plan.Prefix) is the plan of the whole journal.

The planner is driven to the end of a document of every shape (tasks, a guard, a condition,
a foreach, a parallel, a retried step, a failure that goes on, templates reading earlier
outputs) by a small in-memory applier of its actions; at every round the plan made from the
previous round's prefix and the rows after it must equal the plan made from the whole
journal. The same check runs against the real engine in every test of the suite
(``DJFLOW_CHECK_PREFIX``).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runs.engine.plan import (
    AttemptView,
    Close,
    Finish,
    Open,
    Prefix,
    RunView,
    Schedule,
    Skip,
    StartRun,
    plan,
    positions_of,
    prefix_applies,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _task(step_id: str, **more: Any) -> dict[str, Any]:
    return {"id": step_id, "kind": "task", "handler": "h", **more}


DOCUMENT = {
    "id": "mixed",
    "limits": {"run_timeout_ms": 3_600_000},
    "steps": [
        _task("first"),
        _task("skipped", when={"path": "input.x", "op": "eq", "value": 2}),
        {
            "id": "choose",
            "kind": "condition",
            "if": {"path": "steps.first.output", "op": "eq", "value": "first-out"},
            "then": [_task("yes"), _task("yes2")],
            "else": [_task("no")],
        },
        {"id": "fan", "kind": "foreach", "items": [1, 2, 3], "do": _task("item")},
        {
            "id": "both",
            "kind": "parallel",
            "branches": {"a": [_task("left")], "b": [_task("right")]},
        },
        _task("flaky", retry={"max_attempts": 3, "backoff": "none"}),
        _task("broken", on_error="continue"),
        _task("after", input={"seen": "${steps.yes2.output}", "item": "${steps.fan.output}"}),
        _task("last"),
    ],
}


class _Journal:
    """The rows the applier wrote, as the database would hold them."""

    def __init__(self) -> None:
        self.rows: list[AttemptView] = []
        self.ids = itertools.count(1)

    def add(self, **row: Any) -> None:
        self.rows.append(AttemptView(id=next(self.ids), **row))

    def set(self, attempt_id: int, **changes: Any) -> None:
        self.rows = [replace(r, **changes) if r.id == attempt_id else r for r in self.rows]

    def after(self, through: int) -> list[AttemptView]:
        return [r for r in self.rows if r.id > through]


def _apply(journal: _Journal, actions: list[Any]) -> bool:
    """Write a plan's actions; False once the run finished."""
    for action in actions:
        if isinstance(action, Finish):
            return False
        if isinstance(action, Schedule | Skip | Open):
            status = {Schedule: "scheduled", Skip: "skipped"}.get(type(action))
            journal.add(
                step_id=action.step_id,
                path=action.path,
                kind=action.kind,
                attempt=action.attempt,
                generation=action.generation,
                status=status or getattr(action, "status", ""),
                branch=getattr(action, "branch", ""),
                output=getattr(action, "output", None),
                error=getattr(action, "error", None),
            )
        elif isinstance(action, Close):
            journal.set(action.attempt_id, status=action.status, output=action.output)
    return True


def _work(journal: _Journal, failures: dict[str, int]) -> None:
    """Every scheduled attempt runs: ``flaky`` fails twice (retryable), ``broken`` always."""
    for row in list(journal.rows):
        if row.status != "scheduled":
            continue
        if row.step_id == "broken" or failures.get(row.step_id, 0) > 0:
            failures[row.step_id] = failures.get(row.step_id, 0) - 1
            error = {"class": "retryable" if row.step_id == "flaky" else "fatal", "message": "x"}
            journal.set(row.id, status="failed", error=error, finished_at=NOW)
        else:
            journal.set(row.id, status="succeeded", output=f"{row.step_id}-out")
        return  # one at a time: every round in between is planned


def _view(generation: int = 1) -> RunView:
    return RunView(
        id="r1",
        status="running",
        input={"x": 1},
        correlation=None,
        generation=generation,
        started_at=NOW,
        deadline_at=NOW + timedelta(hours=1),
    )


def test_every_plan_from_a_prefix_is_the_plan_of_the_whole_journal():
    journal = _Journal()
    positions = positions_of(DOCUMENT["steps"])
    prefix: Prefix | None = None
    failures = {"flaky": 2}
    longest = 0
    for _ in range(200):
        whole = plan(DOCUMENT, _view(), journal.rows, NOW, positions=positions)
        if prefix is not None:
            partial = plan(
                DOCUMENT,
                _view(),
                journal.after(prefix.through_id),
                NOW,
                prefix=prefix,
                positions=positions,
            )
            assert partial.actions == whole.actions
            assert (partial.waiting, partial.more) == (whole.waiting, whole.more)
            prefix = partial.prefix or prefix
        else:
            prefix = whole.prefix
        longest = max(longest, prefix.steps if prefix else 0)
        if not _apply(journal, [a for a in whole.actions if not isinstance(a, StartRun)]):
            break
        _work(journal, failures)
    else:
        pytest.fail("the run did not finish in 200 rounds")
    finish = whole.finish
    assert finish is not None and finish.status == "completed"
    # The prefix grew as steps settled: all but the last by the end.
    assert longest == len(DOCUMENT["steps"]) - 1
    outputs = {r.step_id: r.output for r in journal.rows if r.status == "succeeded"}
    assert outputs["yes2"] == "yes2-out" and "no" not in outputs


def test_no_prefix_covers_a_step_with_a_row_in_flight():
    document = {"id": "d", "steps": [_task("a"), _task("b"), _task("c")]}
    rows = [
        AttemptView(id=1, step_id="a", attempt=1, status="succeeded"),
        AttemptView(id=2, step_id="b", attempt=1, status="running"),
    ]
    planned = plan(document, _view(), rows, NOW)
    assert planned.prefix is not None and planned.prefix.steps == 1
    assert planned.prefix.through_id == 1
    rows[0] = replace(rows[0], status="scheduled")
    assert plan(document, _view(), rows, NOW).prefix is None


def test_rows_out_of_step_order_cut_no_prefix():
    document = {"id": "d", "steps": [_task("a"), _task("b"), _task("c")]}
    # b's row is older than a's last one: skipping rows up to a's would skip b's.
    rows = [
        AttemptView(id=1, step_id="b", attempt=1, status="running"),
        AttemptView(id=2, step_id="a", attempt=1, status="succeeded"),
    ]
    assert plan(document, _view(), rows, NOW).prefix is None


def test_a_prefix_does_not_apply_to_another_generation_a_rerun_or_a_cost_limit():
    document = {"id": "d", "steps": [_task("a"), _task("b")]}
    rows = [AttemptView(id=1, step_id="a", attempt=1, status="succeeded")]
    rows.append(AttemptView(id=2, step_id="b", attempt=1, status="running"))
    prefix = plan(document, _view(), rows, NOW).prefix
    assert prefix is not None
    assert prefix_applies(document, 1, (), prefix)
    assert not prefix_applies(document, 2, (), prefix)
    assert not prefix_applies(document, 1, ((2, "a"),), prefix)
    limited = {**document, "limits": {"max_cost_usd": 1.0}}
    assert not prefix_applies(limited, 1, (), prefix)
    assert plan(limited, _view(), rows, NOW).prefix is None
    with pytest.raises(ValueError, match="prefix_applies"):
        plan(document, _view(generation=2), rows[1:], NOW, prefix=prefix)
