"""plan() for ``approval`` and ``handoff`` steps, without a database."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from runs.engine.plan import AttemptView, Close, Finish, Open, Schedule, Wake, plan

from .test_plan import NOW, doc, failed, in_flight, ok, only, run, task

DECISION = {"decision": "rejected", "by": "ann", "comment": "too dear"}


def approval(step_id: str = "gate", **fields: Any) -> dict[str, Any]:
    return {"id": step_id, "kind": "approval", "approvers": {"users": ["ann"]}, **fields}


def handoff(step_id: str = "tell", **fields: Any) -> dict[str, Any]:
    return {"id": step_id, "kind": "handoff", "group": "support", **fields}


def waiting(step_id: str = "gate", kind: str = "approval", **fields: Any) -> AttemptView:
    return in_flight(step_id, status="waiting", kind=kind, **fields)


def rejected(step_id: str = "gate", **fields: Any) -> AttemptView:
    return failed(step_id, "rejected", kind="approval", output=DECISION, **fields)


# --- opening -------------------------------------------------------------------------------


def test_an_approval_opens_a_waiting_row_with_what_the_request_shows_and_its_deadline() -> None:
    step = approval(
        message="Refund ${input.amount} to ${steps.pre.output.who}?",
        input={"amount": "${input.amount}"},
        approvers={"users": ["ann"], "groups": ["finance"], "emails": ["x@example.com"]},
        quorum=2,
        timeout_ms=60_000,
        remind_after_ms=10_000,
        escalate_to={"users": ["boss"]},
    )
    out = plan(doc(task("pre"), step), run(input={"amount": 12}), [ok("pre", {"who": "bo"})], NOW)
    opened = only(out.actions, Open)
    assert (opened.step_id, opened.kind, opened.status, opened.attempt) == (
        "gate",
        "approval",
        "waiting",
        1,
    )
    assert opened.input == {
        "message": "Refund 12 to bo?",
        "details": {"amount": 12},
        "approvers": {"users": ["ann"], "groups": ["finance"], "emails": ["x@example.com"]},
        "quorum": 2,
        "timeout_ms": 60_000,
        "remind_after_ms": 10_000,
        "escalate_to": {"users": ["boss"]},
    }
    assert opened.not_before == NOW + timedelta(milliseconds=60_000)
    assert opened.timer == "approval_timeout"
    assert (out.waiting, out.approval) == (True, True)
    assert not out.of(Schedule) and not out.of(Finish)


def test_an_approval_without_input_shows_the_previous_output_as_details() -> None:
    out = plan(doc(task("pre"), approval()), run(), [ok("pre", {"total": 3})], NOW)
    opened = only(out.actions, Open)
    assert opened.input["details"] == {"total": 3}
    assert (opened.input["message"], opened.input["quorum"]) == (None, 1)


def test_an_approval_without_a_timeout_has_no_deadline_and_no_timer() -> None:
    opened = only(plan(doc(approval()), run(), [], NOW).actions, Open)
    assert (opened.not_before, opened.timer, opened.input["timeout_ms"]) == (None, None, None)


def test_the_request_does_not_share_the_documents_approvers() -> None:
    step = approval(escalate_to={"users": ["boss"]})
    opened = only(plan(doc(step), run(), [], NOW).actions, Open)
    opened.input["approvers"]["users"].append("eve")
    opened.input["escalate_to"]["users"].append("eve")
    assert step["approvers"] == {"users": ["ann"]} and step["escalate_to"] == {"users": ["boss"]}


# --- what the run shows ----------------------------------------------------------------------


def test_a_waiting_approval_keeps_the_run_pending_approval_and_plans_nothing() -> None:
    row = waiting(not_before=NOW + timedelta(minutes=1))
    out = plan(doc(approval(timeout_ms=120_000), task("after")), run(), [row], NOW)
    assert out.actions == []
    assert (out.waiting, out.approval) == (True, True)


def test_a_sleep_alone_shows_waiting_not_pending_approval() -> None:
    out = plan(doc({"id": "nap", "kind": "sleep", "ms": 60_000}), run(), [], NOW)
    assert (out.waiting, out.approval) == (True, False)


def test_an_approval_beside_a_running_task_is_not_waiting() -> None:
    document = doc(
        {
            "id": "par",
            "kind": "parallel",
            "branches": {"ask": approval(), "work": task("work")},
        }
    )
    out = plan(document, run(), [], NOW)
    assert {o.kind for o in out.of(Open)} == {"parallel", "approval"}
    assert only(out.actions, Schedule).step_id == "work"
    assert (out.waiting, out.approval) == (False, False)


def test_an_approval_beside_a_sleep_shows_pending_approval() -> None:
    document = doc(
        {
            "id": "par",
            "kind": "parallel",
            "branches": {"ask": approval(), "nap": {"id": "nap", "kind": "sleep", "ms": 60_000}},
        }
    )
    out = plan(document, run(), [], NOW)
    assert (out.waiting, out.approval) == (True, True)


# --- the deadline -------------------------------------------------------------------------------


def test_an_approval_past_its_deadline_times_out_with_class_timeout_and_fails_the_run() -> None:
    row = waiting(not_before=NOW - timedelta(milliseconds=1))
    out = plan(doc(approval(timeout_ms=1000), task("after")), run(), [row], NOW)
    closed = only(out.actions, Close)
    assert (closed.attempt_id, closed.status, closed.error["class"]) == (
        row.id,
        "timed_out",
        "timeout",
    )
    assert "1000 ms" in closed.error["message"]
    finish = only(out.actions, Finish)
    assert (finish.status, finish.error["class"], finish.error["step"]) == (
        "failed",
        "timeout",
        "gate",
    )


def test_at_its_deadline_exactly_the_approval_times_out() -> None:
    row = waiting(not_before=NOW)
    out = plan(doc(approval(timeout_ms=1000)), run(), [row], NOW)
    assert only(out.actions, Close).status == "timed_out"


def test_an_approval_timed_out_with_continue_goes_on_with_a_null_output() -> None:
    row = waiting(not_before=NOW - timedelta(seconds=1))
    document = doc(
        approval(timeout_ms=1000, on_error="continue"),
        task("after", input={"s": "${steps.gate.status}", "e": "${steps.gate.error.class}"}),
    )
    out = plan(document, run(), [row], NOW)
    assert only(out.actions, Close).status == "timed_out"
    assert only(out.actions, Schedule).input == {"s": "failed", "e": "timeout"}


def test_a_retry_policy_opens_a_new_request_after_a_time_out() -> None:
    step = approval(timeout_ms=1000, retry={"max_attempts": 2, "backoff": "none"})
    row = waiting(not_before=NOW - timedelta(seconds=1))
    out = plan(doc(step), run(), [row], NOW)
    assert only(out.actions, Close).status == "timed_out"
    again = only(out.actions, Open)
    assert (again.kind, again.attempt, again.status) == ("approval", 2, "waiting")
    assert again.not_before == NOW + timedelta(seconds=1)
    assert out.approval


def test_a_retry_with_back_off_after_a_time_out_waits_for_a_timer() -> None:
    step = approval(timeout_ms=1000, retry={"max_attempts": 2, "backoff": "fixed"})
    out = plan(doc(step), run(), [failed("gate", "timeout", kind="approval")], NOW)
    assert only(out.actions, Wake).at > NOW
    assert (out.waiting, out.approval) == (False, False)


def test_a_rejection_is_never_retried() -> None:
    step = approval(retry={"max_attempts": 3, "backoff": "none"})
    out = plan(doc(step), run(), [rejected()], NOW)
    finish = only(out.actions, Finish)
    assert (finish.status, finish.error["class"]) == ("failed", "rejected")
    assert not out.of(Open)


# --- decided --------------------------------------------------------------------------------------


def test_an_approved_row_hands_its_decision_to_the_next_step() -> None:
    decision = {"decision": "approved", "by": "ann", "comment": ""}
    out = plan(doc(approval(), task("after")), run(), [ok("gate", decision, kind="approval")], NOW)
    assert only(out.actions, Schedule).input == decision


def test_an_approved_row_is_the_runs_output_when_it_is_last() -> None:
    decision = {"decision": "approved", "by": "ann", "comment": "ok"}
    out = plan(doc(approval()), run(), [ok("gate", decision, kind="approval")], NOW)
    assert only(out.actions, Finish).output == decision


def test_a_rejection_with_continue_keeps_the_decision_as_the_steps_output() -> None:
    document = doc(
        approval(on_error="continue"),
        task(
            "after",
            input={
                "out": "${steps.gate.output}",
                "status": "${steps.gate.status}",
                "class": "${steps.gate.error.class}",
            },
        ),
    )
    out = plan(document, run(), [rejected()], NOW)
    assert only(out.actions, Schedule).input == {
        "out": DECISION,
        "status": "failed",
        "class": "rejected",
    }


def test_a_rejection_with_continue_is_the_default_input_of_the_next_step() -> None:
    out = plan(doc(approval(on_error="continue"), task("after")), run(), [rejected()], NOW)
    assert only(out.actions, Schedule).input == DECISION


def test_after_a_retry_of_the_run_a_passed_rejection_still_shows_its_decision() -> None:
    # Generation 1 went past the rejected approval (continue), then failed at "after";
    # the retried run (generation 2) schedules "after" again: it reads the same decision.
    document = doc(
        approval(on_error="continue"),
        task("after", input={"out": "${steps.gate.output}"}),
    )
    journal = [rejected(), failed("after")]
    out = plan(document, run(generation=2), journal, NOW)
    step = only(out.actions, Schedule)
    assert (step.step_id, step.input) == ("after", {"out": DECISION})


def test_a_rejection_without_continue_fails_the_run_with_class_rejected() -> None:
    out = plan(doc(approval(), task("after")), run(), [rejected()], NOW)
    finish = only(out.actions, Finish)
    assert (finish.status, finish.error["class"], finish.error["step"]) == (
        "failed",
        "rejected",
        "gate",
    )


def test_a_failed_request_with_invalid_input_is_not_retried() -> None:
    step = approval(retry={"max_attempts": 3, "backoff": "none"}, on_error="continue")
    journal = [failed("gate", "invalid_input", kind="approval")]
    out = plan(doc(step, task("after")), run(), journal, NOW)
    assert only(out.actions, Schedule).step_id == "after"


# --- hand-offs ------------------------------------------------------------------------------------


def test_a_handoff_opens_a_running_row_with_its_resolved_message_and_blocks() -> None:
    step = handoff(message="Ticket ${input.ticket} is yours")
    out = plan(doc(step, task("after")), run(input={"ticket": "T-9"}), [], NOW)
    opened = only(out.actions, Open)
    assert (opened.kind, opened.status, opened.timer, opened.not_before) == (
        "handoff",
        "running",
        None,
        None,
    )
    assert opened.input == {"group": "support", "message": "Ticket T-9 is yours"}
    assert not out.of(Schedule)
    assert (out.waiting, out.approval) == (False, False)


def test_a_handoff_row_ended_by_the_gate_lets_the_run_go_on_with_a_null_output() -> None:
    done = ok("tell", None, kind="handoff")
    out = plan(doc(task("pre"), handoff(), task("after")), run(), [ok("pre", 5), done], NOW)
    assert only(out.actions, Schedule).input is None


def test_a_running_handoff_row_holds_the_run() -> None:
    out = plan(doc(handoff(), task("after")), run(), [in_flight("tell", kind="handoff")], NOW)
    assert out.actions == [] and not out.waiting


def test_a_handoff_that_failed_for_an_unknown_group_fails_the_run() -> None:
    out = plan(doc(handoff()), run(), [failed("tell", "invalid_input", kind="handoff")], NOW)
    assert only(out.actions, Finish).error["class"] == "invalid_input"


# --- limits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("done", [0, 1])
def test_max_steps_counts_approvals_and_handoffs(done: int) -> None:
    decision = {"decision": "approved", "by": "ann", "comment": ""}
    journal = [ok("gate", decision, kind="approval"), ok("tell", kind="handoff")][: done + 1]
    document = doc(approval(), handoff(), task("after"), limits={"max_steps": 2})
    out = plan(document, run(), journal, NOW)
    if done == 0:
        assert only(out.actions, Open).kind == "handoff"
    else:
        finish = only(out.actions, Finish)
        assert (finish.error["class"], finish.error["step"]) == ("limit", "after")


def test_max_steps_stops_an_approval_from_opening() -> None:
    out = plan(doc(task("a"), approval(), limits={"max_steps": 1}), run(), [ok("a")], NOW)
    assert not out.of(Open)
    assert only(out.actions, Finish).error["class"] == "limit"


# --- a child run waiting for people ---------------------------------------------------------


@pytest.mark.parametrize(
    ("child_status", "approval_shown"),
    [("pending_approval", True), ("waiting", False), ("running", False)],
)
def test_a_subworkflow_whose_child_waits_for_people_holds_the_parent_for_them(
    child_status: str, approval_shown: bool
) -> None:
    step = {"id": "child", "kind": "subworkflow", "workflow": "inner"}
    row = waiting("child", kind="subworkflow", child={"id": "c1", "status": child_status})
    out = plan(doc(step), run(), [row], NOW)
    assert out.actions == []
    assert out.waiting is True
    assert out.approval is approval_shown
