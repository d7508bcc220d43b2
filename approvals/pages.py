"""What the approval pages show: a request as people read it, and the page a link or a
decision gets when it cannot be used. Views call these and render; nothing here writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.contrib.auth.views import redirect_to_login
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


def problem(request: HttpRequest, status: int, title: str, sentence: str) -> HttpResponse:
    """A page that says what cannot be done and why, and nothing of the request."""
    context = {"title": title, "sentence": sentence}
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
    """The page for a link that cannot decide (any more), or None when it can.

    It shows nothing of the request (no message, details, people or decisions), only that
    the link is used, expired or closed: a used or closed link still reaches whoever finds
    the mail later, and a signed-in approver has the request in their inbox. The order
    matters: a used link says so even after the request closed; an expired request says so
    even when its timer has not fired yet."""
    now = now or timezone.now()
    approval = ApprovalRequest.objects.only("status", "deadline").get(id=approver.request_id)
    mine = Decision.objects.filter(approver=approver).only("created_at").first()
    if approver.used_at is not None or mine is not None:
        when = mine.created_at if mine is not None else approver.used_at
        return problem(
            request,
            410,
            "This link has already been used",
            f"It was used on {_when(when)}. A link works once.",
        )
    expired = approval.status == ApprovalStatus.EXPIRED or (
        approval.status == ApprovalStatus.PENDING
        and approval.deadline is not None
        and now >= approval.deadline
    )
    if expired:
        return problem(
            request,
            410,
            "This approval has expired",
            "Its deadline passed before a decision was reached; the link no longer works.",
        )
    if approval.status != ApprovalStatus.PENDING:
        return problem(
            request,
            409,
            "This approval is closed",
            "It was decided by others, or its run ended, before this link was used; the link"
            " no longer works.",
        )
    return None


def not_theirs(request: HttpRequest, approver: Approver) -> HttpResponse | None:
    """The answer to a link of a user approver opened by anyone but that user signed in, or
    None when the visitor is that user (or the approver is a plain address, whose link works
    for whoever holds it). Anonymous: the sign-in page, back to the link after; another
    user: 403. Neither shows anything of the request."""
    if approver.is_plain_address:
        return None
    if approver.user_id is None:
        return problem(
            request,
            410,
            "This link no longer works",
            "The user it was sent to no longer exists.",
        )
    if not request.user.is_authenticated:
        # Back to the link itself after signing in; a query string is not carried along.
        return redirect_to_login(request.path)
    if request.user.pk != approver.user_id:
        return problem(
            request,
            403,
            "This link is for another user",
            "It was sent to another user of this site and works only for them, signed in."
            " Sign out and sign in as that user to use it.",
        )
    return None


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
