"""What the approval pages show: a request as people read it, and the page a link or a
decision gets when it cannot be used. Views call these and render; nothing here writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from workflows.errors import EngineError

from .models import ApprovalRequest, Approver, Decision
from .outbox import pretty
from .status import ApprovalStatus, DecisionChoice


@dataclass(frozen=True)
class Person:
    approver: Approver
    decision: Decision | None


@dataclass
class Summary:
    """One request with everything its pages show, read in a handful of queries."""

    approval: ApprovalRequest
    details: str
    decisions: list[Decision]
    people: list[Person]
    approvals: int
    # Approvals still needed to reach the quorum while the request is pending.
    remaining: int
    pending_people: list[Approver] = field(default_factory=list)


def summarize(approval_id: Any) -> Summary:
    approval = ApprovalRequest.objects.select_related("run__version", "run__workflow").get(
        id=approval_id
    )
    decisions = list(approval.decisions.select_related("approver"))
    by_approver = {d.approver_id: d for d in decisions}
    people = [
        Person(person, by_approver.get(person.id))
        for person in approval.people.select_related("user")
    ]
    approvals = sum(1 for d in decisions if d.decision == DecisionChoice.APPROVED)
    return Summary(
        approval=approval,
        details=pretty(approval.details),
        decisions=decisions,
        people=people,
        approvals=approvals,
        remaining=max(approval.quorum - approvals, 0),
        pending_people=[p.approver for p in people if p.decision is None],
    )


# --- pages for what cannot be done --------------------------------------------------------


def problem(
    request: HttpRequest, status: int, title: str, sentence: str, summary: Summary | None = None
) -> HttpResponse:
    context = {"title": title, "sentence": sentence, "summary": summary}
    return render(request, "approvals/problem.html", context, status=status)


def link_problem(request: HttpRequest, reason: str) -> HttpResponse:
    """The page for a token that names no usable approver (``tokens.LinkProblem``)."""
    if reason == "tampered":
        return problem(
            request,
            400,
            "This link is not valid",
            "The link is incomplete or has been altered. Open it again from the e-mail, or copy"
            " the whole address.",
        )
    return problem(
        request,
        403,
        "This link is not yours to use",
        "The link does not belong to any approver of this request, so it cannot decide it.",
    )


def blocked(
    request: HttpRequest, approver: Approver, now: datetime | None = None
) -> HttpResponse | None:
    """The page for an approver who cannot decide (any more), or None when they can.

    The order matters: someone who already decided is told so even after the request closed;
    an expired request says so even when its timer has not fired yet."""
    now = now or timezone.now()
    summary = summarize(approver.request_id)
    approval = summary.approval
    mine = next((p.decision for p in summary.people if p.approver.id == approver.id), None)
    if approver.used_at is not None or mine is not None:
        when = mine.created_at if mine is not None else approver.used_at
        verb = mine.decision if mine is not None else "decided"
        return problem(
            request,
            410,
            "This link has already been used",
            f"You already {verb} this on {_when(when)}. A link works once.",
            summary,
        )
    expired = approval.status == ApprovalStatus.EXPIRED or (
        approval.status == ApprovalStatus.PENDING
        and approval.deadline is not None
        and now >= approval.deadline
    )
    if expired:
        deadline = f" on {_when(approval.deadline)}" if approval.deadline else ""
        return problem(
            request,
            410,
            "This approval has expired",
            f"Its deadline passed{deadline} before a decision was reached; it can no longer be"
            " decided.",
            summary,
        )
    if approval.status != ApprovalStatus.PENDING:
        return problem(request, 409, "This approval is closed", closed_sentence(summary), summary)
    return None


def closed_sentence(summary: Summary) -> str:
    approval = summary.approval
    if approval.status == ApprovalStatus.CANCELLED:
        return "It was cancelled (its run ended or its step was cancelled) before a decision."
    deciders = [d for d in summary.decisions if d.decision == approval.status]
    names = ", ".join(f"{d.by} on {_when(d.created_at)}" for d in deciders)
    return f"It was already {approval.status}" + (f" by {names}." if names else ".")


def service_problem(request: HttpRequest, error: EngineError) -> HttpResponse:
    """A decision refused by ``approval_decide`` that has no more precise page."""
    titles = {
        403: "You are not an approver of this request",
        404: "No such approval",
        409: "This approval cannot be decided",
    }
    title = titles.get(error.status, "The decision was not recorded")
    return problem(request, error.status, title, "; ".join(e.message for e in error.errors))


def _when(moment: datetime | None) -> str:
    if moment is None:
        return "an earlier date"
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M %Z")
