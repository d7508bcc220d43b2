"""The engine's side of approvals and hand-offs, in the database (no worker: approvals,
hand-offs, sleeps and waits run in the engine, and a task's end is written straight into
its row where a test needs one)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core import mail as django_mail
from django.db import DatabaseError, transaction
from django.utils import timezone

from approvals import gates, outbox
from approvals.models import ApprovalRequest, Approver, Decision, Mail, Notification
from approvals.services import (
    AlreadyDecided,
    Origin,
    RequestClosed,
    approval_decide,
)
from runs import services
from runs.engine import timers
from runs.engine.advance import advance_locked, lock_run, run_advance
from runs.models import AdvanceRequest, Run, StepRun, Timer
from tests.runs.test_events import fire_now
from workflows.errors import NotFound
from workflows.services import definition_save

pytestmark = pytest.mark.django_db

HOUR = 3_600_000
LIMITS = {"run_timeout_ms": 24 * HOUR}


@pytest.fixture(autouse=True)
def short_reminders(settings) -> None:
    """Reminders a second or a minute apart, below the deployment's floor
    (``DJFLOW_MIN_REMIND_MS``, 10 minutes by default), keep these tests' clocks short."""
    settings.DJFLOW = {**settings.DJFLOW, "MIN_REMIND_MS": 1_000}


# --- building blocks --------------------------------------------------------------------------


@pytest.fixture
def people(db) -> dict[str, Any]:
    """ann, bob, cy (with addresses), dee (none), zed (inactive); groups finance (bob, cy)
    and support (ann, dee, zed)."""
    make = get_user_model().objects.create_user
    users = {
        "ann": make(username="ann", email="ann@example.com"),
        "bob": make(username="bob", email="bob@example.com"),
        "cy": make(username="cy", email="cy@example.com"),
        "dee": make(username="dee", email=""),
        "zed": make(username="zed", email="zed@example.com", is_active=False),
    }
    Group.objects.create(name="finance").user_set.add(users["bob"], users["cy"])
    Group.objects.create(name="support").user_set.add(users["ann"], users["dee"], users["zed"])
    return users


def approval(step_id: str = "gate", **fields: Any) -> dict[str, Any]:
    fields.setdefault("approvers", {"users": ["ann"]})
    return {"id": step_id, "kind": "approval", **fields}


def save(*steps: dict[str, Any], workflow: str = "gates", **top: Any) -> None:
    top.setdefault("limits", LIMITS)
    definition_save(document={"id": workflow, "steps": list(steps), **top})


def start(workflow: str = "gates", **run_input: Any) -> Run:
    return services.run_start(workflow=workflow, input={"ticket": "T-1", **run_input}).run


def fresh(run: Run) -> Run:
    return Run.objects.get(id=run.id)


def step(run: Run, step_id: str = "gate", **more: Any) -> StepRun:
    return StepRun.objects.filter(run=run, step_id=step_id, **more).order_by("-id").first()


def request_of(run: Run, step_id: str = "gate") -> ApprovalRequest:
    return (
        ApprovalRequest.objects.filter(run=run, step_id=step_id)
        .order_by("-step_run__attempt", "-step_run__generation")
        .first()
    )


def decide(
    request: ApprovalRequest, who: str, decision: str = "approved", comment: str = ""
) -> tuple[ApprovalRequest, Decision]:
    user = get_user_model().objects.get(username=who)
    return approval_decide(
        request_id=request.id,
        decision=decision,
        comment=comment,
        origin=Origin("inbox"),
        user=user,
    )


def fire_reminders(run: Run) -> int:
    """Travel to the run's next reminder slot and tick there."""
    due = (
        Timer.objects.filter(run=run, fired_at__isnull=True, purpose="approval_reminder")
        .values_list("fire_at", flat=True)
        .first()
    )
    if due is None:
        return timers.fire_due()
    with time_machine.travel(due + timedelta(milliseconds=1), tick=False):
        return timers.fire_due()


def notify_parents() -> None:
    """What the advance messages sent on commit do: advance every run that asked."""
    for run_id in list(AdvanceRequest.objects.values_list("run_id", flat=True)):
        run_advance(run_id=run_id)


def mails(kind: str | None = None) -> list[str]:
    found = Mail.objects.all() if kind is None else Mail.objects.filter(kind=kind)
    return sorted(found.values_list("to", flat=True))


def finish_task(run: Run, step_id: str, *, output: Any = None, error: Any = None) -> None:
    """What a worker would record: the task's attempt ends, then the run advances."""
    ended = {"status": "failed", "error": error} if error else {"status": "succeeded"}
    changed = StepRun.objects.filter(run=run, step_id=step_id, status="scheduled").update(
        output=output, finished_at=timezone.now(), **ended
    )
    assert changed == 1
    run_advance(run_id=run.id)


# --- opening a request -----------------------------------------------------------------------


def test_a_run_at_an_approval_is_pending_approval_with_one_request(people) -> None:
    save(
        {"id": "pre", "kind": "sleep", "ms": 0},
        approval(
            message="Refund ${input.amount} for ${input.ticket}?",
            input={"amount": "${input.amount}"},
            timeout_ms=HOUR,
        ),
    )
    before = timezone.now()
    run = start(amount=12)
    assert fresh(run).status == "pending_approval"
    row = step(run)
    assert (row.kind, row.status) == ("approval", "waiting")
    request = request_of(run)
    assert (request.status, request.message, request.details) == (
        "pending",
        "Refund 12 for T-1?",
        {"amount": 12},
    )
    assert request.step_run_id == row.id and request.quorum == 1
    assert request.deadline == row.not_before
    assert before + timedelta(hours=1) <= request.deadline <= timezone.now() + timedelta(hours=1)
    timer = Timer.objects.get(run=run, step_run=row)
    assert (timer.purpose, timer.fire_at) == ("approval_timeout", request.deadline)


def test_approvers_are_users_group_members_and_emails_each_once(people) -> None:
    approvers = {
        "users": ["ann", "bob", "ann"],
        "groups": ["finance", "support"],
        "emails": ["ANN@example.com", "ext@example.org", "ext@example.org"],
    }
    save(approval(approvers=approvers))
    run = start()
    request = request_of(run)
    rows = list(request.people.order_by("id").values_list("user__username", "email", "via"))
    assert rows == [
        ("ann", "ann@example.com", "user"),
        ("bob", "bob@example.com", "user"),
        ("cy", "cy@example.com", "group:finance"),
        ("dee", "", "group:support"),  # zed is inactive: left out
        (None, "ext@example.org", "email"),
    ]
    # One request mail each, for those with an address.
    assert mails("request") == [
        "ann@example.com",
        "bob@example.com",
        "cy@example.com",
        "ext@example.org",
    ]
    assert Mail.objects.filter(approver__isnull=True).count() == 0


def test_no_timeout_means_no_deadline_and_no_timer(people) -> None:
    save(approval())
    run = start()
    assert request_of(run).deadline is None
    assert not Timer.objects.filter(run=run, step_run__isnull=False).exists()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"approvers": {"users": ["ann", "nobody"]}}, "approvers.users"),
        ({"approvers": {"users": ["zed"]}}, "approvers.users"),  # inactive
        ({"approvers": {"groups": ["finance", "ghosts"]}}, "approvers.groups"),
        ({"approvers": {"groups": ["finance"]}, "quorum": 3}, "quorum"),
        # Listed twice under two names, one person: quorum 2 cannot be met.
        ({"approvers": {"users": ["ann"], "emails": ["ann@example.com"]}, "quorum": 2}, "quorum"),
        ({"escalate_to": {"users": ["nobody"]}}, "escalate_to.users"),
        ({"escalate_to": {"groups": ["ghosts"]}}, "escalate_to.groups"),
    ],
)
def test_approvers_that_do_not_resolve_fail_the_step_with_invalid_input(
    people, fields: dict[str, Any], named: str
) -> None:
    save(approval(**fields, timeout_ms=HOUR), {"id": "after", "kind": "sleep", "ms": 0})
    run = fresh(start())
    assert run.status == "failed"
    row = step(run)
    assert (row.status, row.error["class"]) == ("failed", "invalid_input")
    assert row.error["message"].startswith(f"{named}:")
    assert (run.error["class"], run.error["step"]) == ("invalid_input", "gate")
    assert not ApprovalRequest.objects.exists() and not Mail.objects.exists()
    assert not Timer.objects.filter(run=run, fired_at__isnull=True).exists()


def test_an_unresolved_approval_with_continue_lets_the_run_go_on(people) -> None:
    save(
        approval(approvers={"users": ["nobody"]}, on_error="continue"),
        approval("second"),
        output={"first": "${steps.gate.status}", "why": "${steps.gate.error.class}"},
    )
    run = start()
    assert fresh(run).status == "pending_approval"
    assert request_of(run, "second").status == "pending"
    decide(request_of(run, "second"), "ann")
    assert fresh(run).output == {"first": "failed", "why": "invalid_input"}


# --- deciding --------------------------------------------------------------------------------


def test_quorum_two_of_three(people) -> None:
    save(
        approval(approvers={"users": ["ann", "bob", "cy"]}, quorum=2),
        output="${steps.gate.output}",
    )
    run = start()
    request = request_of(run)
    decide(request, "ann", comment="fine")
    assert request_of(run).status == "pending"
    assert (step(run).status, fresh(run).status) == ("waiting", "pending_approval")
    with pytest.raises(AlreadyDecided):
        decide(request, "ann")
    decide(request, "bob", comment="ok")
    request = request_of(run)
    assert request.status == "approved" and request.closed_at is not None
    row = step(run)
    output = {"decision": "approved", "by": "bob", "comment": "ok"}
    assert (row.status, row.output) == ("succeeded", output)
    run = fresh(run)
    assert (run.status, run.output) == ("completed", output)
    with pytest.raises(RequestClosed):
        decide(request, "cy")
    assert Decision.objects.filter(request=request).count() == 2


def test_a_rejection_after_one_approval_rejects(people) -> None:
    save(
        approval(approvers={"users": ["ann", "bob", "cy"]}, quorum=2),
        {"id": "after", "kind": "sleep", "ms": 0},
    )
    run = start()
    request = request_of(run)
    decide(request, "ann")
    decide(request, "bob", "rejected", "too dear")
    assert request_of(run).status == "rejected"
    row = step(run)
    assert (row.status, row.error["class"]) == ("failed", "rejected")
    assert "too dear" in row.error["message"]
    assert row.output == {"decision": "rejected", "by": "bob", "comment": "too dear"}
    run = fresh(run)
    assert (run.status, run.error["class"], run.error["step"]) == ("failed", "rejected", "gate")
    assert not step(run, "after")


def test_a_rejection_with_continue_hands_the_decision_on(people) -> None:
    save(approval(on_error="continue"), approval("second"), output="${steps.gate.output}")
    run = start()
    decide(request_of(run), "ann", "rejected", "no")
    assert fresh(run).status == "pending_approval"
    assert request_of(run, "second").details == {
        "decision": "rejected",
        "by": "ann",
        "comment": "no",
    }
    decide(request_of(run, "second"), "ann")
    assert fresh(run).output == {"decision": "rejected", "by": "ann", "comment": "no"}


def test_a_plain_email_approver_decides_through_its_approver_row(people) -> None:
    save(approval(approvers={"emails": ["ext@example.org"]}))
    run = start()
    request = request_of(run)
    approver = request.people.get()
    approval_decide(
        request_id=request.id,
        decision="approved",
        origin=Origin("link"),
        approver_id=approver.id,
    )
    assert fresh(run).status == "completed"
    made = Decision.objects.get()
    assert (made.by, made.token_id, made.user) == ("ext@example.org", approver.token_id, None)


def test_a_decision_after_the_deadline_before_the_timer_fired_is_refused(people) -> None:
    save(approval(timeout_ms=HOUR))
    run = start()
    ApprovalRequest.objects.filter(run=run).update(
        deadline=timezone.now() - timedelta(milliseconds=1)
    )
    with pytest.raises(RequestClosed):
        decide(request_of(run), "ann")
    assert not Decision.objects.exists() and step(run).status == "waiting"


# --- the deadline ----------------------------------------------------------------------------


def test_expiry_times_the_step_out_and_fails_the_run(people) -> None:
    save(approval(timeout_ms=HOUR))
    run = start()
    fire_now(run)
    row = step(run)
    assert (row.status, row.error["class"]) == ("timed_out", "timeout")
    request = request_of(run)
    assert (request.status, request.escalated_at) == ("expired", None)
    assert request.closed_at is not None
    run = fresh(run)
    assert (run.status, run.error["class"]) == ("failed", "timeout")
    with pytest.raises(RequestClosed):
        decide(request, "ann")


def test_expiry_with_continue_completes_the_run(people) -> None:
    save(
        approval(timeout_ms=HOUR, on_error="continue"),
        output={"status": "${steps.gate.status}", "class": "${steps.gate.error.class}"},
    )
    run = start()
    fire_now(run)
    run = fresh(run)
    # ``continue`` marks the step failed (contract section 1); its row says timed_out.
    assert (run.status, run.output) == ("completed", {"status": "failed", "class": "timeout"})
    assert step(run).status == "timed_out"
    assert request_of(run).status == "expired"


def test_a_retry_policy_opens_a_new_request_after_expiry(people) -> None:
    save(approval(timeout_ms=HOUR, retry={"max_attempts": 2, "backoff": "none"}))
    run = start()
    first = request_of(run)
    fire_now(run)
    assert fresh(run).status == "pending_approval"
    second = request_of(run)
    assert second.id != first.id and second.status == "pending"
    assert ApprovalRequest.objects.get(id=first.id).status == "expired"
    assert step(run).attempt == 2
    decide(second, "ann")
    assert fresh(run).status == "completed"


def test_escalation_notifies_and_mails_at_expiry(people) -> None:
    save(
        approval(
            message="Refund?",
            timeout_ms=HOUR,
            escalate_to={"users": ["bob"], "groups": ["support"]},
        )
    )
    run = start()
    assert not Notification.objects.exists()
    fire_now(run)
    request = request_of(run)
    assert request.status == "expired" and request.escalated_at is not None
    notes = Notification.objects.filter(kind="escalation")
    assert sorted(n.user.username for n in notes) == ["ann", "bob", "dee"]
    assert {n.step_run_id for n in notes} == {step(run).id}
    assert all(n.body == "Refund?" and n.run_id == run.id for n in notes)
    assert mails("escalation") == ["ann@example.com", "bob@example.com"]


def test_escalation_commits_with_the_time_out_or_not_at_all(people, monkeypatch) -> None:
    save(approval(timeout_ms=HOUR, escalate_to={"users": ["bob"]}))
    run = start()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise DatabaseError("the notification insert failed")

    monkeypatch.setattr(gates, "notify", broken)
    fire_now(run)  # the tick logs the failed advance and goes on
    assert step(run).status == "waiting"
    assert request_of(run).status == "pending"
    assert fresh(run).status == "pending_approval"
    monkeypatch.undo()
    run_advance(run_id=run.id)  # what the reconciler does for a run left behind
    assert step(run).status == "timed_out"
    assert Notification.objects.filter(kind="escalation").count() == 1


# --- reminders --------------------------------------------------------------------------------


def test_reminders_mail_only_those_who_have_not_decided_until_the_request_closes(people) -> None:
    save(
        approval(
            approvers={"users": ["ann", "bob", "cy"]},
            quorum=2,
            timeout_ms=HOUR,
            remind_after_ms=60_000,
        )
    )
    before = timezone.now()
    run = start()
    reminder = Timer.objects.get(run=run, purpose="approval_reminder")
    assert reminder.step_run_id == step(run).id
    assert before + timedelta(minutes=1) <= reminder.fire_at
    assert reminder.fire_at <= timezone.now() + timedelta(minutes=1)
    request = request_of(run)
    decide(request, "ann")
    assert fire_reminders(run) == 1
    assert mails("reminder") == ["bob@example.com", "cy@example.com"]
    assert request_of(run).reminders_sent == 1
    assert fresh(run).status == "pending_approval" and step(run).status == "waiting"
    # The next one is set; it mails whoever has still not decided.
    assert Timer.objects.filter(run=run, purpose="approval_reminder", fired_at=None).count() == 1
    decide(request, "bob", "rejected")
    assert request_of(run).status == "rejected"
    fire_reminders(run)
    assert mails("reminder") == ["bob@example.com", "cy@example.com"]  # none after closing
    assert request_of(run).reminders_sent == 1


def test_a_second_reminder_reaches_who_is_still_undecided(people) -> None:
    save(
        approval(
            approvers={"users": ["ann", "bob"]}, quorum=2, timeout_ms=HOUR, remind_after_ms=60_000
        )
    )
    run = start()
    fire_reminders(run)
    decide(request_of(run), "ann")
    fire_reminders(run)
    assert mails("reminder") == ["ann@example.com", "bob@example.com", "bob@example.com"]
    assert request_of(run).reminders_sent == 2


def test_no_reminder_is_set_at_or_after_the_deadline(people) -> None:
    save(approval(timeout_ms=60_000, remind_after_ms=60_000))
    run = start()
    assert not Timer.objects.filter(run=run, purpose="approval_reminder").exists()


def test_a_reminder_does_not_advance_the_run(people) -> None:
    save(approval(timeout_ms=HOUR, remind_after_ms=1000))
    run = start()
    updated = fresh(run).updated_at
    fire_reminders(run)
    run = fresh(run)
    assert (run.status, run.updated_at) == ("pending_approval", updated)


# --- cancelling -------------------------------------------------------------------------------


def test_cancelling_the_run_cancels_its_pending_request(people) -> None:
    save(approval(timeout_ms=HOUR, remind_after_ms=60_000))
    run = start()
    services.run_cancel(run_id=run.id)
    request = request_of(run)
    assert (request.status, step(run).status) == ("cancelled", "cancelled")
    assert request.closed_at is not None
    with pytest.raises(RequestClosed):
        decide(request, "ann")
    assert not Timer.objects.filter(run=run, fired_at=None).exists()


def test_a_failed_parallel_branch_cancels_the_approvals_request(people) -> None:
    save(
        {
            "id": "par",
            "kind": "parallel",
            "branches": {"ask": approval(), "work": {"id": "work", "kind": "task"}},
        }
    )
    run = start()
    assert fresh(run).status == "running"  # a task is offered beside the approval
    assert request_of(run).status == "pending"
    finish_task(run, "work", error={"class": "fatal", "message": "boom"})
    run = fresh(run)
    assert (run.status, run.error["step"]) == ("failed", "work")
    assert request_of(run).status == "cancelled"
    assert step(run).status == "cancelled"
    with pytest.raises(RequestClosed):
        decide(request_of(run), "ann")


def test_an_approval_beside_a_task_then_alone_shows_pending_approval(people) -> None:
    save(
        {
            "id": "par",
            "kind": "parallel",
            "branches": {"ask": approval(), "work": {"id": "work", "kind": "task"}},
        },
        output="${steps.par.output}",
    )
    run = start()
    finish_task(run, "work", output=1)
    assert fresh(run).status == "pending_approval"
    decide(request_of(run), "ann")
    run = fresh(run)
    assert run.status == "completed"
    assert run.output == {"ask": {"decision": "approved", "by": "ann", "comment": ""}, "work": 1}


def test_the_run_deadline_cancels_a_pending_request(people) -> None:
    save(approval(), limits={"run_timeout_ms": 60_000})
    run = start()
    Run.objects.filter(id=run.id).update(deadline_at=timezone.now() - timedelta(seconds=1))
    run_advance(run_id=run.id)
    assert fresh(run).status == "timed_out"
    assert request_of(run).status == "cancelled"


# --- at any depth -----------------------------------------------------------------------------


def test_approvals_inside_a_foreach_are_decided_each_on_its_own(people) -> None:
    save(
        {
            "id": "fan",
            "kind": "foreach",
            "items": "${input.xs}",
            "do": [approval(message="Pay ${item}?", input="${item}")],
        },
        output="${steps.fan.output}",
    )
    run = start(xs=["a", "b"])
    assert fresh(run).status == "pending_approval"
    requests = {r.path: r for r in ApprovalRequest.objects.filter(run=run)}
    assert sorted(requests) == ["fan[0]/", "fan[1]/"]
    assert [requests[p].message for p in sorted(requests)] == ["Pay a?", "Pay b?"]
    assert [requests[p].details for p in sorted(requests)] == ["a", "b"]
    decide(requests["fan[1]/"], "ann", comment="second")
    assert fresh(run).status == "pending_approval"
    assert ApprovalRequest.objects.get(id=requests["fan[0]/"].id).status == "pending"
    decide(requests["fan[0]/"], "ann", comment="first")
    run = fresh(run)
    assert run.status == "completed"
    assert [o["comment"] for o in run.output] == ["first", "second"]


def test_approvals_inside_a_foreach_body_of_several_steps_run_in_child_runs(people) -> None:
    save(
        {
            "id": "fan",
            "kind": "foreach",
            "items": "${input.xs}",
            "do": [
                {"id": "pause", "kind": "sleep", "ms": 0},
                approval(message="Pay ${item}?"),
            ],
        },
        output="${steps.fan.output}",
    )
    run = start(xs=["a", "b"])
    children = list(Run.objects.filter(parent_run=run).order_by("created_at", "id"))
    assert [c.status for c in children] == ["pending_approval", "pending_approval"]
    notify_parents()  # the children asked: the parent waits for people too
    assert fresh(run).status == "pending_approval"
    for child, comment in zip(reversed(children), ["second", "first"], strict=True):
        decide(request_of(child), "ann", comment=comment)
        assert fresh(child).status == "completed"
        notify_parents()
    run = fresh(run)
    assert run.status == "completed"
    assert [o["comment"] for o in run.output] == ["first", "second"]
    assert sorted(r.message for r in ApprovalRequest.objects.all()) == ["Pay a?", "Pay b?"]


def test_an_approval_inside_a_subworkflow(people) -> None:
    save(approval(message="Inner ${input.ticket}"), workflow="inner")
    save(
        {"id": "child", "kind": "subworkflow", "workflow": "inner", "input": "${input}"},
        output="${steps.child.output.decision}",
    )
    run = start()
    child = Run.objects.get(parent_run=run)
    assert child.status == "pending_approval"
    notify_parents()  # the child asked: its parent shows it waits for people
    assert fresh(run).status == "pending_approval"
    request = request_of(child)
    assert request.message == "Inner T-1"
    decide(request, "ann")
    assert fresh(child).status == "completed"
    notify_parents()
    run = fresh(run)
    assert (run.status, run.output) == ("completed", "approved")


def test_a_parent_shows_waiting_again_once_its_childs_approval_is_decided(people) -> None:
    save(approval(), {"id": "nap", "kind": "sleep", "ms": 60_000}, workflow="inner")
    save({"id": "child", "kind": "subworkflow", "workflow": "inner"})
    run = start()
    child = Run.objects.get(parent_run=run)
    notify_parents()
    assert fresh(run).status == "pending_approval"
    decide(request_of(child), "ann")
    assert fresh(child).status == "waiting"  # now sleeping
    notify_parents()
    assert fresh(run).status == "waiting"


def test_cancelling_the_parent_cancels_the_childs_request(people) -> None:
    save(approval(), workflow="inner")
    save({"id": "child", "kind": "subworkflow", "workflow": "inner"})
    run = start()
    child = Run.objects.get(parent_run=run)
    services.run_cancel(run_id=run.id)
    assert (fresh(child).status, request_of(child).status) == ("cancelled", "cancelled")


# --- retrying ---------------------------------------------------------------------------------


def test_retrying_a_run_failed_by_a_rejection_opens_a_new_request(people) -> None:
    save(approval(), output="${steps.gate.output.decision}")
    run = start()
    first = request_of(run)
    decide(first, "ann", "rejected")
    assert fresh(run).status == "failed"
    services.run_retry(run_id=run.id)
    run_advance(run_id=run.id)  # the advance the retry sends on commit
    assert fresh(run).status == "pending_approval"
    second = request_of(run)
    assert second.id != first.id and second.status == "pending"
    assert step(run).attempt == 2 and step(run).generation == 2
    assert mails("request") == ["ann@example.com", "ann@example.com"]
    decide(second, "ann")
    assert (fresh(run).status, fresh(run).output) == ("completed", "approved")


# --- hand-offs --------------------------------------------------------------------------------


def test_a_handoff_notifies_the_group_and_never_blocks(people) -> None:
    save(
        {"id": "tell", "kind": "handoff", "group": "support", "message": "Ticket ${input.ticket}"},
        approval(),
        output={"handoff": "${steps.tell.output}", "status": "${steps.tell.status}"},
    )
    run = start()
    assert fresh(run).status == "pending_approval"  # went on to the approval at once
    row = step(run, "tell")
    assert (row.kind, row.status, row.output) == ("handoff", "succeeded", None)
    notes = Notification.objects.filter(kind="handoff")
    assert sorted(n.user.username for n in notes) == ["ann", "dee"]  # zed is inactive
    assert {(n.body, n.run_id, n.step_run_id) for n in notes} == {("Ticket T-1", run.id, row.id)}
    assert mails("handoff") == ["ann@example.com"]  # dee has no address
    decide(request_of(run), "ann")
    assert fresh(run).output == {"handoff": None, "status": "succeeded"}


def test_a_handoff_last_completes_the_run(people) -> None:
    save({"id": "tell", "kind": "handoff", "group": "finance"})
    run = fresh(start())
    assert (run.status, run.output) == ("completed", None)
    assert Notification.objects.count() == 2


def test_a_handoff_to_an_unknown_group_fails_with_invalid_input(people) -> None:
    save({"id": "tell", "kind": "handoff", "group": "ghosts"})
    run = fresh(start())
    row = step(run, "tell")
    assert (row.status, row.error["class"]) == ("failed", "invalid_input")
    assert row.error["message"].startswith("group:")
    assert (run.status, run.error["class"]) == ("failed", "invalid_input")
    assert not Notification.objects.exists() and not Mail.objects.exists()


def test_an_unknown_group_with_continue_goes_on(people) -> None:
    save(
        {"id": "tell", "kind": "handoff", "group": "ghosts", "on_error": "continue"},
        output="${steps.tell.status}",
    )
    run = fresh(start())
    assert (run.status, run.output) == ("completed", "failed")


# --- the outbox -------------------------------------------------------------------------------


def test_deliver_sends_a_mail_once(people, settings) -> None:
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    save(approval(message="Refund?"))
    run = start()
    queued = Mail.objects.get(kind="request")
    assert outbox.deliver(queued.id) is True
    assert len(django_mail.outbox) == 1
    sent = django_mail.outbox[0]
    assert sent.to == ["ann@example.com"]
    assert "/approvals/link/" in sent.body
    queued.refresh_from_db()
    assert (queued.status, queued.tries) == ("sent", 1) and queued.sent_at is not None
    assert outbox.deliver(queued.id) is False
    assert len(django_mail.outbox) == 1
    assert fresh(run).status == "pending_approval"


def test_reoffer_unsent_offers_stale_queued_mails_again(people) -> None:
    save(approval(approvers={"users": ["ann", "bob"]}))
    start()
    now = timezone.now()
    quiet = timedelta(seconds=django_settings.DJFLOW["LOST_MESSAGE_SECONDS"] + 1)
    ann = Mail.objects.get(to="ann@example.com")
    Mail.objects.filter(id=ann.id).update(offered_at=now - quiet)
    Mail.objects.filter(to="bob@example.com").update(status="sent")
    assert outbox.reoffer_unsent(now, 100) == 1
    ann.refresh_from_db()
    assert ann.offered_at == now
    assert outbox.reoffer_unsent(now, 100) == 0  # just offered: left alone
    assert Mail.objects.filter(status="queued").count() == 1


def test_reoffer_leaves_a_mail_in_its_retries_alone_until_they_are_lost(people) -> None:
    save(approval())
    start()
    now = timezone.now()
    quiet = timedelta(seconds=django_settings.DJFLOW["LOST_MESSAGE_SECONDS"] + 1)
    # Tried once and failed 11 s ago: Celery's retry (up to 5 min away) has it.
    Mail.objects.update(tries=1, offered_at=now - quiet)
    assert outbox.reoffer_unsent(now, 100) == 0
    # Quiet for longer than any retry waits: the retry was lost with its worker.
    Mail.objects.update(offered_at=now - timedelta(seconds=outbox.RETRIES_LOST_SECONDS + 1))
    assert outbox.reoffer_unsent(now, 100) == 1


def test_gates_cancel_leaves_closed_requests_alone(people) -> None:
    save(approval())
    run = start()
    decide(request_of(run), "ann")
    assert gates.cancel([step(run).id], timezone.now()) == 0
    assert request_of(run).status == "approved"


def test_approver_rows_bind_one_token_each(people) -> None:
    save(approval(approvers={"users": ["ann", "bob"]}))
    start()
    tokens = list(Approver.objects.values_list("token_id", flat=True))
    assert len(set(tokens)) == 2


def test_a_worker_that_holds_the_next_attempt_gets_it_beside_a_handoff(people) -> None:
    # A worker finishing "pre" plans on with hold: the lone attempt it schedules is handed
    # back to it to run. A hand-off opened in the same plan makes the engine plan again; the
    # attempt held in the first round must still come back (else nobody offers it).
    save(
        {"id": "pre", "kind": "task"},
        {
            "id": "par",
            "kind": "parallel",
            "branches": {
                "tell": {"id": "tell", "kind": "handoff", "group": "finance"},
                "work": {"id": "work", "kind": "task"},
            },
        },
    )
    run = start()
    StepRun.objects.filter(run=run, step_id="pre").update(
        status="succeeded", finished_at=timezone.now()
    )
    with transaction.atomic():
        _, held = advance_locked(lock_run(run.id), hold=True)
    assert held is not None and held.step_id == "work"
    assert step(run, "tell").status == "succeeded"
    assert Notification.objects.filter(kind="handoff").count() == 2


def test_a_rejected_item_fails_the_foreach_and_cancels_the_other_requests(people) -> None:
    save(
        {
            "id": "fan",
            "kind": "foreach",
            "items": "${input.xs}",
            "do": [approval(input="${item}")],
        }
    )
    run = start(xs=["a", "b", "c"])
    requests = {r.path: r for r in ApprovalRequest.objects.filter(run=run)}
    decide(requests["fan[0]/"], "ann")
    decide(requests["fan[1]/"], "ann", "rejected", "not b")
    run = fresh(run)
    assert (run.status, run.error["class"]) == ("failed", "rejected")
    states = dict(ApprovalRequest.objects.filter(run=run).values_list("path", "status"))
    assert states == {"fan[0]/": "approved", "fan[1]/": "rejected", "fan[2]/": "cancelled"}
    with pytest.raises(RequestClosed):
        decide(requests["fan[2]/"], "ann")


def test_a_rejected_body_run_cancels_the_requests_of_the_other_body_runs(people) -> None:
    save(
        {
            "id": "fan",
            "kind": "foreach",
            "items": "${input.xs}",
            "do": [{"id": "pause", "kind": "sleep", "ms": 0}, approval()],
        }
    )
    run = start(xs=["a", "b"])
    first, second = Run.objects.filter(parent_run=run).order_by("created_at", "id")
    decide(request_of(first), "ann", "rejected")
    assert fresh(first).status == "failed"
    notify_parents()
    assert fresh(run).status == "failed"
    assert (fresh(second).status, request_of(second).status) == ("cancelled", "cancelled")


def test_a_decision_on_a_paused_run_is_kept_and_the_run_goes_on_when_resumed(people) -> None:
    save(approval(), {"id": "after", "kind": "sleep", "ms": 0})
    run = start()
    services.run_pause(run_id=run.id)
    decide(request_of(run), "ann")
    assert step(run).status == "succeeded"
    assert fresh(run).status == "paused" and not step(run, "after")
    services.run_resume(run_id=run.id)
    run_advance(run_id=run.id)  # the advance the resume sends on commit
    assert fresh(run).status == "completed"


def test_handoffs_inside_a_foreach_notify_once_per_item(people) -> None:
    save(
        {
            "id": "fan",
            "kind": "foreach",
            "items": "${input.xs}",
            "do": {"id": "tell", "kind": "handoff", "group": "finance", "message": "${item}"},
        },
        output="${steps.fan.output}",
    )
    run = fresh(start(xs=["a", "b"]))
    assert (run.status, run.output) == ("completed", [None, None])
    bodies = sorted(Notification.objects.values_list("body", "user__username"))
    assert bodies == [("a", "bob"), ("a", "cy"), ("b", "bob"), ("b", "cy")]
    assert len(mails("handoff")) == 4


def test_two_approvals_in_parallel_hold_the_run_until_both_are_decided(people) -> None:
    save(
        {
            "id": "par",
            "kind": "parallel",
            "branches": {"one": approval("one"), "two": approval("two")},
        },
        output="${steps.par.output}",
    )
    run = start()
    decide(request_of(run, "two"), "ann", comment="2")
    assert fresh(run).status == "pending_approval"
    decide(request_of(run, "one"), "ann", comment="1")
    run = fresh(run)
    assert run.status == "completed"
    assert {k: v["comment"] for k, v in run.output.items()} == {"one": "1", "two": "2"}


def test_an_approval_in_a_loop_opens_a_request_per_iteration(people) -> None:
    save(
        {
            "id": "lp",
            "kind": "loop",
            "max_iterations": 2,
            "do": approval(message="round ${iter.index}"),
        },
        output="${steps.lp.output.comment}",
    )
    run = start()
    decide(ApprovalRequest.objects.get(run=run, status="pending"), "ann", comment="first")
    second = ApprovalRequest.objects.get(run=run, status="pending")
    assert second.message == "round 1"
    decide(second, "ann", comment="last")
    assert (fresh(run).status, fresh(run).output) == ("completed", "last")


def test_escalation_reaches_who_still_resolves_when_one_was_deactivated(people) -> None:
    # Checked when the request opened; by the deadline cy has left. bob is still told.
    save(approval(timeout_ms=HOUR, escalate_to={"users": ["cy", "bob"]}))
    run = start()
    get_user_model().objects.filter(username="cy").update(is_active=False)
    fire_now(run)
    assert request_of(run).status == "expired"
    notes = Notification.objects.filter(kind="escalation")
    assert [n.user.username for n in notes] == ["bob"]
    assert mails("escalation") == ["bob@example.com"]


def test_a_guarded_approval_that_is_skipped_opens_no_request(people) -> None:
    save(
        approval(when={"path": "input.amount", "op": "gt", "value": 100}),
        output="${steps.gate.status}",
    )
    run = fresh(start(amount=5))
    assert (run.status, run.output) == ("completed", "skipped")
    assert not ApprovalRequest.objects.exists() and not Mail.objects.exists()


def test_an_approval_inside_a_condition_branch(people) -> None:
    save(
        {
            "id": "big",
            "kind": "condition",
            "if": {"path": "input.amount", "op": "gt", "value": 100},
            "then": [approval(message="${input.amount}")],
        },
        output="${steps.big.output.decision}",
    )
    run = start(amount=500)
    assert fresh(run).status == "pending_approval"
    assert request_of(run).message == "500"
    decide(request_of(run), "ann")
    assert (fresh(run).status, fresh(run).output) == ("completed", "approved")


def test_someone_not_among_the_approvers_is_refused(people) -> None:
    save(approval())
    run = start()
    # As for an unknown approval: bob may not read the run either (CONTRACT section 8).
    with pytest.raises(NotFound):
        decide(request_of(run), "bob")
    assert not Decision.objects.exists() and request_of(run).status == "pending"


def test_a_plain_email_approver_is_reminded_too(people) -> None:
    save(
        approval(
            approvers={"users": ["ann"], "emails": ["ext@example.org"]},
            quorum=2,
            timeout_ms=HOUR,
            remind_after_ms=60_000,
        )
    )
    run = start()
    decide(request_of(run), "ann")
    fire_reminders(run)
    assert mails("reminder") == ["ext@example.org"]


def test_reminders_keep_the_requests_own_beat_when_a_tick_fires_late(people) -> None:
    save(approval(remind_after_ms=60_000, timeout_ms=3_600_000))
    run = start()
    request = request_of(run)
    first = Timer.objects.get(run=run, purpose="approval_reminder")
    assert first.fire_at == request.created_at + timedelta(minutes=1)
    # The first reminder is sent 2.5 minutes in (a tick far behind): the second is due at
    # minute 3 of the request, not a minute after the late one, and minute 2 is skipped.
    late = request.created_at + timedelta(minutes=2, seconds=30)
    Timer.objects.filter(id=first.id).update(fired_at=late)
    with time_machine.travel(late, tick=False):
        assert gates.remind(step_run_id=request.step_run_id) == 1
    following = Timer.objects.get(run=run, purpose="approval_reminder", fired_at=None)
    assert following.fire_at == request.created_at + timedelta(minutes=3)
    assert following.key.endswith(":3")


def test_the_reconciler_restores_a_reminder_whose_timer_fired_but_sent_nothing(people) -> None:
    save(approval(approvers={"users": ["ann", "bob"]}, remind_after_ms=60_000, timeout_ms=HOUR))
    run = start()
    request = request_of(run)
    slot = request.created_at + timedelta(minutes=1)
    # The tick claimed the timer and died (or its reminder's transaction failed).
    Timer.objects.filter(run=run, purpose="approval_reminder").update(fired_at=slot)
    late = slot + timedelta(seconds=django_settings.DJFLOW["LOST_MESSAGE_SECONDS"] + 1)
    assert gates.restore_reminders(slot + timedelta(seconds=1), 100) == 0  # not yet quiet
    with time_machine.travel(late, tick=False):
        assert gates.restore_reminders(late, 100) == 1
        assert gates.restore_reminders(late, 100) == 0  # covered, and the next one is set
    assert mails("reminder") == ["ann@example.com", "bob@example.com"]
    assert request_of(run).reminders_sent == 1
    following = Timer.objects.get(run=run, purpose="approval_reminder", fired_at=None)
    assert following.fire_at == request.created_at + timedelta(minutes=2)


def test_the_reminders_repair_goes_on_past_a_request_it_cannot_remind(people) -> None:
    """A request whose reminder period no date can be computed with (a row written by hand:
    timedelta overflows) raises in the repair: it is logged, counted and marked on its run,
    and the request after it is still reminded (before, the repair raised and reminded no
    one after it, at every reconciler tick)."""
    from runs.models import RunAction, RunFault

    save(approval(approvers={"users": ["ann"]}, remind_after_ms=60_000, timeout_ms=HOUR))
    broken, fine = start(), start()
    for run in (broken, fine):
        Timer.objects.filter(run=run, purpose="approval_reminder").delete()
    ApprovalRequest.objects.filter(run=broken).update(remind_after_ms=10**17)
    created = request_of(fine).created_at
    late = created + timedelta(
        minutes=1, seconds=django_settings.DJFLOW["LOST_MESSAGE_SECONDS"] + 1
    )
    with time_machine.travel(late, tick=False):
        assert gates.restore_reminders(late, 100) == 1
    assert mails("reminder") == ["ann@example.com"]
    assert request_of(fine).reminders_sent == 1
    fault = RunFault.objects.get(run=broken)
    assert fault.pass_name == gates.REMINDERS and "OverflowError" in fault.error
    assert RunAction.objects.filter(run=broken, action="pass_failed").count() == 1
    # In its back-off, the next pass leaves it alone.
    with time_machine.travel(late, tick=False):
        assert gates.restore_reminders(late, 100) == 0
    assert RunAction.objects.filter(run=broken, action="pass_failed").count() == 1


def test_one_slot_is_reminded_once_by_whoever_comes_first(people) -> None:
    save(approval(remind_after_ms=60_000, timeout_ms=HOUR))
    run = start()
    request = request_of(run)
    moment = request.created_at + timedelta(minutes=1, seconds=30)
    assert gates.remind(step_run_id=request.step_run_id, now=moment) == 1
    assert gates.remind(step_run_id=request.step_run_id, now=moment) == 0
    assert mails("reminder") == ["ann@example.com"]


def test_reminder_slots_stop_before_the_deadline(people) -> None:
    save(approval(remind_after_ms=1_000, timeout_ms=3_000))
    run = start()
    request = request_of(run)
    at = request.created_at
    assert [gates.slots_passed(request, at + timedelta(seconds=s)) for s in (0, 1, 2, 3, 9)] == [
        0,
        1,
        2,
        2,
        2,
    ]


def test_a_reminder_that_fails_in_the_tick_is_logged_and_the_tick_goes_on(
    people, monkeypatch, caplog
) -> None:
    save(approval(remind_after_ms=60_000, timeout_ms=HOUR))
    run = start()

    def broken(**kwargs: Any) -> int:
        raise DatabaseError("the connection dropped")

    monkeypatch.setattr(gates, "remind", broken)
    assert fire_reminders(run) == 1  # fired, and the tick did not raise
    assert "reminding approvers of step run" in caplog.text
    assert not Mail.objects.filter(kind="reminder").exists()
    # Nothing is left waiting: the reconciler's net (restore_reminders) covers it.
    assert not Timer.objects.filter(run=run, purpose="approval_reminder", fired_at=None).exists()
