"""Reads of the approvals app that are more than a filter."""

from __future__ import annotations

from typing import Any

from django.db.models import Exists, OuterRef, Q, QuerySet
from django.urls import reverse

from runs.inspection import AuditRow
from workflows import access

from .models import ApprovalRequest, Approver, Decision, Notification
from .status import ApprovalStatus


def as_approver(user: Any) -> Q:
    """The approver rows a signed-in user acts as: theirs, or plain e-mail approvers with
    their address (not the row of a user deleted since, which kept that user's address)."""
    mine = Q(user=user)
    if user.email:
        mine |= Q(user__isnull=True, via="email", email__iexact=user.email)
    return mine


def approvals_for(user: Any, status: str | None = None) -> QuerySet[ApprovalRequest]:
    """The requests ``user`` is an approver of, newest first."""
    requests = ApprovalRequest.objects.filter(
        Exists(Approver.objects.filter(as_approver(user), request=OuterRef("pk")))
    ).select_related("run")
    if status:
        requests = requests.filter(status=status)
    return requests.order_by("-created_at")


def unread_count(user: Any) -> int:
    if not user.is_authenticated:
        return 0
    return Notification.objects.filter(user=user, read_at__isnull=True).count()


def inbox_for(
    user: Any, history_limit: int = 100
) -> tuple[list[ApprovalRequest], list[ApprovalRequest]]:
    """The user's inbox: requests still waiting for their decision (pending, and they have
    not decided), and the rest, newest first (the latest ``history_limit``). Each row carries
    ``decided``: whether this user has decided it."""
    decided = Exists(
        Approver.objects.filter(as_approver(user), request=OuterRef("pk"), used_at__isnull=False)
    )
    rows = approvals_for(user).annotate(decided=decided)
    waiting = Q(status="pending", decided=False)
    pending = list(rows.filter(waiting))
    history = list(rows.exclude(waiting)[:history_limit])
    return pending, history


# The pending requests a run's page links to; a run waits on a handful at most (one per
# approval step in flight, a foreach of approvals one per item), so a few are plenty.
RUN_PAGE_LINKS = 20


def run_page_links(run: Any, user: Any) -> list[tuple[str, str, str]]:
    """The run inspector's links (``runs.inspection.on_page_links``): each request of the run
    (or of a run below it that ``user`` may read) still waiting for a decision, as (step id,
    text, its page). The page itself shows the request only to its approvers; a link to it
    tells others where the run waits, nothing more."""
    # Its own requests and, for a run at the top of a tree, those of the runs below it (a
    # foreach of approvals waits in its body runs).
    pending = ApprovalRequest.objects.filter(
        Q(run_id=run.id) | Q(run__root_run_id=run.id), status=ApprovalStatus.PENDING
    ).order_by("created_at")
    # A subworkflow's child run may be of a workflow the reader may not see: its requests'
    # ids and step ids are not theirs to learn (contract section 8).
    readable = access.run_filter(user, prefix="run__")
    if readable is not None:
        pending = pending.filter(readable)
    return [
        (
            f"{request.path}{request.step_id}",
            f"waiting for approval (quorum {request.quorum}): open the approval request",
            reverse("approvals:detail", kwargs={"approval_id": request.id}),
        )
        for request in pending.only("id", "path", "step_id", "quorum")[:RUN_PAGE_LINKS]
    ]


def run_page_audit(run: Any, limit: int) -> list[AuditRow]:
    """The run inspector's audit lines (``runs.inspection.on_page_audit``): the newest
    ``limit`` decisions on the run's own requests, who decided which step and how. The
    request's page keeps the rest (the comment, the address it came from) for its approvers."""
    decisions = (
        Decision.objects.filter(request__run_id=run.id)
        .select_related("request")
        .only("by", "decision", "channel", "created_at", "request__path", "request__step_id")
        .order_by("-created_at", "-id")[:limit]
    )
    return [
        AuditRow(
            decision.created_at,
            decision.by,
            f"approval {decision.decision}",
            f"{decision.request.path}{decision.request.step_id} (via {decision.channel})",
        )
        for decision in decisions
    ]
