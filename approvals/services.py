"""Writes of the approvals app: a decision, a notification read.

A decision takes the run's lock first and then the request's row, in the order the engine
takes them when the deadline fires (``runs.engine.advance`` locks the run; closing the
request happens under it). So two approvers deciding at once, a decision racing the deadline
timer and a form submitted twice are serialised: the first to lock decides, the rest find
the request closed (409) or their vote already counted (409), and the run is planned on by
exactly the transaction that closed the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from runs.engine.advance import advance_locked, lock_run
from runs.models import StepRun
from runs.moves import move_steps
from runs.status import StepStatus
from workflows import access
from workflows.errors import Conflict, FieldError, Forbidden, InvalidInput, NotFound

from .models import COMMENT_MAX, ApprovalRequest, Approver, Decision, Notification
from .selectors import as_approver
from .status import ApprovalStatus, DecisionChoice

REJECTED = "rejected"


class RequestClosed(Conflict):
    code = "approval_closed"


class AlreadyDecided(Conflict):
    code = "already_decided"


class NotApprover(Forbidden):
    code = "not_an_approver"


@dataclass(frozen=True)
class Origin:
    """Where a decision came from, for its audit row."""

    channel: str  # "link", "inbox" or "api"
    ip: str | None = None
    user_agent: str = ""


def check_decision(decision: Any, comment: Any) -> tuple[str, str]:
    """The decision and comment, or InvalidInput naming the field."""
    if decision not in DecisionChoice.values:
        raise InvalidInput(
            errors=[FieldError("decision", f"must be one of {', '.join(DecisionChoice.values)}")]
        )
    if comment is None:
        comment = ""
    if not isinstance(comment, str):
        raise InvalidInput(errors=[FieldError("comment", "must be a string")])
    if "\x00" in comment:
        # Postgres text holds no NUL: stored, it was a 500 (contract section 9: a 400).
        raise InvalidInput(errors=[FieldError("comment", "may not hold NUL characters")])
    if len(comment) > COMMENT_MAX:
        raise InvalidInput(
            errors=[
                FieldError("comment", f"is {len(comment)} characters; the limit is {COMMENT_MAX}")
            ]
        )
    return decision, comment


def not_theirs(request: ApprovalRequest, user: Any) -> NotFound | NotApprover:
    """What a signed-in user who is no approver of ``request`` is told (CONTRACT section 8):
    403 when they may read its run, where the approval shows anyway (seeing but not
    acting); otherwise the 404 of an approval that does not exist, so ids do not leak."""
    run = request.run
    if access.may_view_run(user, run.workflow_id, run.created_by_id):
        return NotApprover(errors=[FieldError(None, "you are not among this approval's approvers")])
    return unknown(request.id)


def unknown(request_id: Any) -> NotFound:
    return NotFound(errors=[FieldError("id", f"no approval {request_id}")])


def approver_for(request: ApprovalRequest, user: Any) -> Approver | None:
    """The approver row a signed-in user acts as: theirs, or a plain e-mail approver with
    their address."""
    if user is None or not user.is_authenticated:
        return None
    return request.people.filter(as_approver(user)).order_by("id").first()


def approval_decide(
    *,
    request_id: Any,
    decision: str,
    comment: str = "",
    origin: Origin,
    user: Any = None,
    approver_id: int | None = None,
) -> tuple[ApprovalRequest, Decision]:
    """Record one approver's decision and close the request when it decides the outcome
    (any rejection; ``quorum`` approvals), ending the step and planning the run on.

    ``approver_id`` is the approver a link was made for: a plain address's link works for
    whoever holds it, a user approver's only for that ``user`` (anyone else is refused, so
    the audit row's user is always the approver's). Without it the signed-in ``user`` must be
    among the approvers.
    """
    decision, comment = check_decision(decision, comment)
    found = ApprovalRequest.objects.filter(id=request_id).values_list("run_id", flat=True)
    run_id = found.first()
    if run_id is None:
        raise unknown(request_id)
    now = timezone.now()
    with transaction.atomic():
        run = lock_run(run_id)
        request = ApprovalRequest.objects.select_for_update().get(id=request_id)
        if approver_id is not None:
            approver = request.people.filter(id=approver_id).select_related("user").first()
            if approver is not None and not approver.is_plain_address and not _is(user, approver):
                approver = None
        else:
            approver = approver_for(request, user)
            if approver is None:
                raise not_theirs(request, user)
        if approver is None:
            # A link's token was checked: its holder knows the request exists.
            raise NotApprover(
                errors=[FieldError(None, "you are not among this approval's approvers")]
            )
        closed = _closed_reason(request, now)
        if closed:
            raise RequestClosed(errors=[FieldError(None, closed)])
        if approver.used_at is not None:
            raise AlreadyDecided(errors=[FieldError(None, "your decision is already recorded")])
        try:
            with transaction.atomic():
                made = Decision.objects.create(
                    request=request,
                    approver=approver,
                    user=user if user is not None and user.is_authenticated else None,
                    by=approver.label,
                    decision=decision,
                    comment=comment,
                    channel=origin.channel,
                    ip=origin.ip,
                    user_agent=origin.user_agent[:1000],
                    token_id=approver.token_id if origin.channel == "link" else None,
                    created_at=now,
                )
        except IntegrityError:
            raise AlreadyDecided(
                errors=[FieldError(None, "your decision is already recorded")]
            ) from None
        Approver.objects.filter(id=approver.id).update(used_at=now)
        approvals = request.decisions.filter(decision=DecisionChoice.APPROVED).count()
        if decision == DecisionChoice.REJECTED:
            outcome = ApprovalStatus.REJECTED
        elif approvals >= request.quorum:
            outcome = ApprovalStatus.APPROVED
        else:
            return request, made
        request.status, request.closed_at = outcome, now
        request.save(update_fields=["status", "closed_at"])
        output = {"decision": decision, "by": approver.label, "comment": comment}
        ended: dict[str, Any] = {"output": output}
        if outcome == ApprovalStatus.APPROVED:
            step_status = StepStatus.SUCCEEDED
        else:
            message = f"rejected by {approver.label}" + (f": {comment}" if comment else "")
            step_status = StepStatus.FAILED
            ended["error"] = {"class": REJECTED, "message": message}
        changed = move_steps(
            StepRun.objects.filter(id=request.step_run_id),
            step_status,
            sources=[StepStatus.WAITING],
            finished_at=now,
            **ended,
        )
        if changed and run is not None:
            advance_locked(run)
        return request, made


def _is(user: Any, approver: Approver) -> bool:
    """Whether ``user`` is signed in as the user ``approver`` names (never, once that user
    was deleted)."""
    return (
        approver.user_id is not None
        and user is not None
        and user.is_authenticated
        and user.pk == approver.user_id
    )


def _closed_reason(request: ApprovalRequest, now: Any) -> str:
    if request.status != ApprovalStatus.PENDING:
        return f"this approval is already {request.status}"
    if request.deadline is not None and now >= request.deadline:
        # The deadline timer has not fired yet; it will expire the request.
        return "this approval expired"
    return ""


def notification_read(*, user: Any, notification_id: int | None = None) -> int:
    """Mark one of the user's notifications read (or all, without an id)."""
    unread = Notification.objects.filter(user=user, read_at__isnull=True)
    if notification_id is not None:
        unread = unread.filter(id=notification_id)
    return unread.update(read_at=timezone.now())
