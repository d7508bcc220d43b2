"""plan() and the in_doubt step-run status (CONTRACT section 13): an at_most_once attempt whose
worker was lost after it started waits for an operator, not a blind failure; its deadline
fails it, never to be retried."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from runs.engine.plan import (
    AttemptView,
    Close,
    Expire,
    Finish,
    Schedule,
    Settings,
    Wake,
    plan,
)

from .test_plan import NOW, RETRY3, T0, doc, in_flight, ok, only, run, task

DAY = timedelta(days=1)


def lapsed(step_id: str = "a", **fields) -> AttemptView:
    return in_flight(
        step_id,
        effect="at_most_once",
        deadline_at=NOW + timedelta(minutes=1),
        lease_expires_at=NOW - timedelta(seconds=1),
        **fields,
    )


def doubted(step_id: str = "a", due=NOW + DAY, **fields) -> AttemptView:
    return in_flight(
        step_id,
        status="in_doubt",
        effect="at_most_once",
        not_before=due,
        error={"class": "lost", "message": "lost"},
        **fields,
    )


def test_an_at_most_once_attempt_whose_lease_lapsed_becomes_in_doubt_and_the_run_waits() -> None:
    attempt = lapsed()
    steps = doc(task("a", effect="at_most_once", retry=RETRY3), task("b"))
    out = plan(steps, run(), [attempt], NOW, Settings(in_doubt=timedelta(hours=2)))
    expired = only(out.actions, Expire)
    assert (expired.attempt_id, expired.status) == (attempt.id, "in_doubt")
    assert expired.error["class"] == "lost"
    assert expired.not_before == NOW + timedelta(hours=2)
    # Not run again (whatever its retry policy), not failed, nothing else planned: the run
    # waits, with no process alive for it.
    assert out.actions == [expired]
    assert out.waiting and not out.approval


def test_an_at_least_once_attempt_whose_lease_lapsed_is_still_offered_again() -> None:
    attempt = replace(lapsed(), effect="at_least_once")
    out = plan(doc(task("a")), run(), [attempt], NOW)
    assert only(out.actions, Expire).status == "failed"
    assert only(out.actions, Schedule).attempt == 2


def test_an_at_most_once_attempt_past_its_deadline_unreported_is_in_doubt_too() -> None:
    """Its worker never reported (a worker's own time-out is recorded as a failure, class
    timeout, before the engine's grace ends): lost or hung, it may have had its effect. A
    worker lost during a step shorter than the lease lapses here too (the lease never
    outlives the deadline plus grace)."""
    attempt = in_flight(
        "a",
        effect="at_most_once",
        deadline_at=NOW - timedelta(seconds=6),
        lease_expires_at=NOW - timedelta(seconds=1),
    )
    out = plan(doc(task("a", effect="at_most_once", retry=RETRY3)), run(), [attempt], NOW)
    expired = only(out.actions, Expire)
    assert (expired.status, expired.not_before) == ("in_doubt", NOW + DAY)
    assert "hung past its timeout_ms" in expired.error["message"]
    assert out.actions == [expired] and out.waiting


def test_an_at_least_once_attempt_past_its_deadline_is_still_timed_out() -> None:
    attempt = in_flight(
        "a", deadline_at=NOW - timedelta(seconds=6), lease_expires_at=NOW - timedelta(seconds=1)
    )
    out = plan(doc(task("a")), run(), [attempt], NOW)
    assert only(out.actions, Expire).status == "timed_out"
    assert only(out.actions, Finish).error["class"] == "timeout"


def test_an_in_doubt_attempt_before_its_deadline_holds_the_run_waiting() -> None:
    out = plan(doc(task("a", effect="at_most_once"), task("b")), run(), [doubted()], NOW)
    assert out.actions == []
    assert out.waiting


def test_an_in_doubt_attempt_holds_its_parallel_while_the_other_branch_finishes() -> None:
    steps = doc(
        {
            "id": "fan",
            "kind": "parallel",
            "branches": {"x": task("x", effect="at_most_once"), "y": task("y")},
        }
    )
    fan = AttemptView(id=900, step_id="fan", attempt=1, status="running", kind="parallel")
    journal = [fan, doubted("x", path="fan[x]/"), ok("y", 2, path="fan[y]/")]
    out = plan(steps, run(), journal, NOW)
    assert out.actions == [] and out.waiting


def test_past_its_deadline_an_in_doubt_attempt_fails_with_class_in_doubt_and_is_not_retried() -> (
    None
):
    attempt = doubted(due=NOW - timedelta(seconds=1))
    out = plan(
        doc(task("a", effect="at_most_once", retry=RETRY3), task("b")), run(), [attempt], NOW
    )
    close = only(out.actions, Close)
    assert (close.attempt_id, close.status, close.error["class"]) == (
        attempt.id,
        "failed",
        "in_doubt",
    )
    assert "not resolved by an operator" in close.error["message"]
    finish = only(out.actions, Finish)
    assert (finish.status, finish.error["class"], finish.error["step"]) == (
        "failed",
        "in_doubt",
        "a",
    )
    assert not out.of(Schedule) and not out.of(Wake)


def test_past_its_deadline_with_on_error_continue_the_run_goes_on() -> None:
    attempt = doubted(due=NOW)
    out = plan(
        doc(task("a", effect="at_most_once", on_error="continue"), task("b")),
        run(),
        [attempt],
        NOW,
    )
    assert only(out.actions, Close).status == "failed"
    assert only(out.actions, Schedule).step_id == "b"


def test_resolved_as_succeeded_the_run_goes_on_with_the_operators_output() -> None:
    """An operator's succeeded is a succeeded row with their output: the next step reads it."""
    resolved = ok("a", {"sent": True}, effect="at_most_once")
    out = plan(
        doc(task("a", effect="at_most_once"), task("b", input="${steps.a.output.sent}")),
        run(),
        [resolved],
        NOW,
    )
    scheduled = only(out.actions, Schedule)
    assert (scheduled.step_id, scheduled.input) == ("b", True)


def test_resolved_as_failed_the_step_is_not_retried_even_with_a_retry_budget() -> None:
    resolved = AttemptView(
        id=77,
        step_id="a",
        attempt=1,
        status="failed",
        effect="at_most_once",
        error={"class": "in_doubt", "message": "resolved as failed by ada"},
        finished_at=T0,
    )
    out = plan(doc(task("a", effect="at_most_once", retry=RETRY3)), run(), [resolved], NOW)
    assert only(out.actions, Finish).error["class"] == "in_doubt"
    assert not out.of(Schedule) and not out.of(Wake)
