"""The engine's side of approvals and hand-offs: called by ``runs.engine.apply`` inside the
transaction that opens or closes an ``approval`` or ``handoff`` step row, under the run's
lock. Whatever they write commits with that row or not at all; e--mails leave after commit
(``approvals.outbox``).

An approval step's row input (planned by ``runs.engine.plan``) is
``{"message", "details", "approvers", "quorum", "timeout_ms", "remind_after_ms",
"escalate_to"}``; a hand-off's is ``{"group", "message"}``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from runs.engine import isolation
from runs.models import Run, StepRun, Timer, TimerPurpose
from workflows import access
from workflows.mailbox import MailboxProblem, mailbox
from workflows.services import MAIL_EXTERNAL, NAMING_PEOPLE, may_name_people
from workflows.validation import MAX_APPROVERS, outside_domains

from . import outbox
from .models import ApprovalRequest, Approver, Notification
from .status import ApprovalStatus, MailKind

logger = logging.getLogger(__name__)

INVALID_INPUT = "invalid_input"
# The reconciler's reminder repair, as its failures are named (runs.engine.isolation).
REMINDERS = "reconcile.reminders_restored"


def open_request(run: Run, step_run: StepRun, now: datetime) -> dict[str, Any] | None:
    """Open the approval request of a waiting approval row and mail its approvers; the
    error that fails the step instead (class invalid_input) when the approvers named do not
    resolve to enough people, resolve to too many, or include an address its version's
    author may not mail."""
    spec = step_run.input or {}
    # Asked before any name is looked up: an author who may not name people must not learn
    # from the run's error which names exist.
    problem = _unnamable(run, {"kind": "approval", **spec})
    people: list[tuple[Any, str, str]] = []
    if problem is None:
        people, problem = _approvers(spec.get("approvers") or {})
    quorum = int(spec.get("quorum") or 1)
    if problem is None and len(people) > MAX_APPROVERS:
        # Groups are expanded only now; a request never mails more people than this.
        problem = (
            f"approvers: resolve to {len(people)} people; a request asks at most {MAX_APPROVERS}"
        )
    if problem is None and quorum > len(people):
        problem = (
            f"quorum: {quorum} approvals are needed but the approvers resolve to "
            f"{len(people)} person(s)"
        )
    if problem is None:
        problem = _unmailable(run, spec.get("approvers") or {})
    if problem is None and spec.get("escalate_to"):
        problem = _users(spec["escalate_to"], "escalate_to")[1]
    if problem is not None:
        return {"class": INVALID_INPUT, "message": problem}
    request = ApprovalRequest.objects.create(
        run=run,
        step_run=step_run,
        step_id=step_run.step_id,
        path=step_run.path,
        message=_text(spec.get("message")),
        details=spec.get("details"),
        approvers=spec.get("approvers") or {},
        quorum=quorum,
        deadline=step_run.not_before,
        remind_after_ms=_remind_period(spec.get("remind_after_ms")),
        escalate_to=spec.get("escalate_to"),
        email_details=bool(_step_of(run, step_run.step_id).get("email_details")),
        created_at=now,
    )
    approvers = Approver.objects.bulk_create(
        [Approver(request=request, user=user, email=email, via=via) for user, email, via in people]
    )
    for approver in approvers:
        outbox.queue(MailKind.REQUEST, approver.email, approver=approver)
    _set_reminder(request, step_run, now)
    return None


def _unnamable(run: Run, step: Mapping[str, Any]) -> str | None:
    """The error for a step naming site users or groups its version's author may not name
    (``approvals.mail_users``, held now; see ``workflows.services.may_name_people``), or
    None. Saving checks this already; here it holds versions saved before the rule, or by an
    author who has lost the permission. A version saved with no user is the deployment's."""
    author = run.version.created_by
    field = None if author is None else may_name_people(author, step)
    if field is None:
        return None
    number = run.version.number
    return f"{field}: {NAMING_PEOPLE} (the author of version {number} does not hold it)"


def _unmailable(run: Run, spec: Mapping[str, Any]) -> str | None:
    """The first address outside ``DJFLOW_APPROVER_EMAIL_DOMAINS`` that the author of the
    run's version may not name (``approvals.mail_external``, held now), or None.

    Saving checks this already; here it holds versions saved before the rule existed, or by
    an author who has since lost the permission. A version saved with no user (the
    deployment's own builders; also one whose author was deleted) is not held to it."""
    domains = frozenset(settings.DJFLOW["APPROVER_EMAIL_DOMAINS"])
    outside = [
        (index, address)
        for index, address in enumerate(spec.get("emails") or [])
        if outside_domains(mailbox(address), domains)
    ]
    if not outside:
        return None
    author = run.version.created_by
    if author is None or author.has_perm(MAIL_EXTERNAL):
        return None
    index, address = outside[0]
    return (
        f"approvers.emails[{index}]: '{address}' is outside the approver e-mail domains, and "
        f"the author of version {run.version.number} ({author.get_username()}) does not hold "
        "the permission approvals.mail_external"
    )


def _remind_period(asked: Any) -> int | None:
    """A request's reminder period: what the step asks, but never more often than
    ``DJFLOW_MIN_REMIND_MS`` (saving refuses less; a version stored before the bound, or
    under a lower one, is held to it here)."""
    if not asked:
        return None
    return max(int(asked), settings.DJFLOW["MIN_REMIND_MS"])


def _step_of(run: Run, step_id: str) -> Mapping[str, Any]:
    """The step ``step_id`` as the run's version declares it (ids are unique in a
    document, nested ones included); empty when not found."""
    pending: list[Any] = list(run.version.document.get("steps") or [])
    while pending:
        step = pending.pop()
        if isinstance(step, list):
            pending.extend(step)
            continue
        if not isinstance(step, dict):
            continue
        if step.get("id") == step_id:
            return step
        pending.extend([step.get("then"), step.get("else"), step.get("do")])
        branches = step.get("branches")
        if isinstance(branches, dict):
            pending.extend(branches.values())
    return {}


def remind(*, step_run_id: int, now: datetime | None = None) -> int:
    """Reminder slots have passed that no reminder covered: mail again everyone who has not
    decided, once however many slots were missed, and set the next one. Returns how many
    were reminded: 0 when the request is no longer pending or no slot is uncovered (so the
    tick and the reconciler never both remind for one slot)."""
    now = now or timezone.now()
    with transaction.atomic():
        request = (
            ApprovalRequest.objects.select_for_update()
            .select_related("step_run")
            .filter(step_run_id=step_run_id)
            .first()
        )
        if request is None or request.status != ApprovalStatus.PENDING:
            return 0
        passed = slots_passed(request, now)
        if passed <= request.reminders_sent:
            _set_reminder(request, request.step_run, now)
            return 0
        undecided = list(request.people.filter(used_at__isnull=True).select_related("user"))
        for approver in undecided:
            outbox.queue(MailKind.REMINDER, approver.email, approver=approver)
        request.reminders_sent = passed
        request.save(update_fields=["reminders_sent"])
        _set_reminder(request, request.step_run, now)
        return len(undecided)


def slots_passed(request: ApprovalRequest, now: datetime) -> int:
    """How many reminder slots (n x remind_after_ms after the request opened, before its
    deadline) have come by ``now``."""
    if not request.remind_after_ms:
        return 0
    period = timedelta(milliseconds=request.remind_after_ms)
    passed = max(int((now - request.created_at) / period), 0)
    if request.deadline is not None:
        before_deadline = -(-(request.deadline - request.created_at) // period) - 1
        passed = min(passed, max(before_deadline, 0))
    return passed


def restore_reminders(now: datetime, batch: int) -> int:
    """The reconciler's net for reminders: a pending request with a slot passed for
    ``LOST_MESSAGE_SECONDS`` that no reminder covered, and no reminder timer waiting (its
    timer fired but the reminder failed, or the tick died after claiming it), is reminded
    now and its next timer set. Returns how many requests were reminded."""
    from django.conf import settings

    waiting = Timer.objects.filter(
        step_run_id=OuterRef("step_run_id"),
        purpose=TimerPurpose.APPROVAL_REMINDER,
        fired_at__isnull=True,
    )
    quiet = now - timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"])
    candidates = (
        ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING, remind_after_ms__gt=0)
        .filter(~Exists(waiting))
        .exclude(isolation.in_backoff(REMINDERS, now))
        .order_by("created_at")[:batch]
    )
    # Each request on its own: one whose reminder fails (a row no slot can be computed for,
    # an approver whose mail cannot be queued) is logged, counted and marked on its run, and
    # the others are reminded (runs.engine.isolation).
    return sum(
        isolation.guarded(
            REMINDERS, request.run_id, partial(_restore, request, quiet, now), failed=0
        )
        for request in candidates
    )


def _restore(request: ApprovalRequest, quiet: datetime, now: datetime) -> int:
    if slots_passed(request, quiet) <= request.reminders_sent:
        return 0
    logger.warning("reconcile: approval %s missed a reminder", request.id)
    return int(bool(remind(step_run_id=request.step_run_id, now=now)))


def _set_reminder(request: ApprovalRequest, step_run: StepRun, now: datetime) -> None:
    """The next reminder's timer: on the request's own beat (``remind_after_ms`` after it
    opened, twice that, ...), so a tick that fires late does not push the later ones back;
    a slot already past is skipped. Reminder n is never set before reminder n - 1 was sent."""
    every = request.remind_after_ms
    if not every:
        return
    period = timedelta(milliseconds=every)
    number = max(int((now - request.created_at) / period) + 1, request.reminders_sent + 1)
    due = request.created_at + number * period
    if request.deadline is not None and due >= request.deadline:
        return  # the deadline (and its escalation) comes first
    Timer.objects.bulk_create(
        [
            Timer(
                run_id=request.run_id,
                step_run=step_run,
                purpose=TimerPurpose.APPROVAL_REMINDER,
                key=f"approval_reminder:{step_run.id}:{number}",
                fire_at=due,
            )
        ],
        ignore_conflicts=True,
    )


def expire(step_run_id: int, now: datetime) -> bool:
    """The deadline passed with no outcome (the step times out in this transaction): the
    request expires, and ``escalate_to`` is notified first. True when this call expired it."""
    request = ApprovalRequest.objects.filter(step_run_id=step_run_id).select_related("run").first()
    if request is None:
        return False
    changed = ApprovalRequest.objects.filter(id=request.id, status=ApprovalStatus.PENDING).update(
        status=ApprovalStatus.EXPIRED,
        closed_at=now,
        escalated_at=now if request.escalate_to else None,
    )
    if changed and request.escalate_to:
        # Checked when the request opened; someone gone since must not silence the rest.
        users, _ = _users(request.escalate_to, "escalate_to", strict=False)
        title = f"Approval '{request.step_id}' of {request.run.workflow_id} expired undecided"
        notify(users, "escalation", title, request.message, request.run, request.step_run_id)
    return bool(changed)


def cancel(step_run_ids: Iterable[int], now: datetime) -> int:
    """Approval rows cancelled (their composite failed, their run ended): their requests
    close, and their links show a closed request."""
    return ApprovalRequest.objects.filter(
        step_run_id__in=list(step_run_ids), status=ApprovalStatus.PENDING
    ).update(status=ApprovalStatus.CANCELLED, closed_at=now)


def handoff(run: Run, step_run: StepRun) -> dict[str, Any] | None:
    """Notify the users of the hand-off's group (in the app and by e-mail); the error that
    fails the step (class invalid_input) when the group does not exist."""
    spec = step_run.input or {}
    name = spec.get("group")
    problem = _unnamable(run, {"kind": "handoff", "group": name})
    if problem is not None:
        return {"class": INVALID_INPUT, "message": problem}
    group = Group.objects.filter(name=name).first()
    if group is None:
        return {"class": INVALID_INPUT, "message": f"group: no group named '{name}'"}
    users = list(group.user_set.filter(is_active=True).order_by("id"))
    if not users:
        logger.warning("handoff %s of run %s: group '%s' has no users", step_run.id, run.id, name)
    title = f"Hand-off from {run.workflow_id}: {step_run.step_id}"
    notify(users, "handoff", title, _text(spec.get("message")), run, step_run.id)
    return None


def budget_exceeded(run_id: Any, step_run_id: int) -> None:
    """Tell the workflow's operators, in-app and by e-mail, that an attempt of the run waits
    for budget (``runs.engine.hooks``; CONTRACT section 17): once per attempt and person, in
    the transaction that made it wait. A failure here is logged, never the wait's: telling
    people must not stop the run from waiting (its reason says it all the same)."""
    from runs.serializers import budget_reason

    try:
        with transaction.atomic():
            run = Run.objects.get(id=run_id)
            step = StepRun.objects.get(id=step_run_id)
            reason = budget_reason(step) or "it waits for budget"
            title = f"Run of {run.workflow_id} waits for budget at step {step.step_id}"
            for user in access.operators(run.workflow_id):
                notification, made = Notification.objects.get_or_create(
                    step_run_id=step_run_id,
                    user=user,
                    kind=MailKind.BUDGET,
                    defaults={"title": title[:300], "body": reason, "run": run},
                )
                if made:
                    outbox.queue(MailKind.BUDGET, user.email, notification=notification)
    except Exception:
        # Whatever failed (the database, a backend), the wait stands: it is the run's state.
        logger.exception("run %s: telling its operators it waits for budget failed", run_id)


def notify(
    users: Iterable[Any], kind: str, title: str, body: str, run: Run, step_run_id: int
) -> list[Notification]:
    """An in-app notification for each user, and an e-mail to each who has an address."""
    made = Notification.objects.bulk_create(
        [
            Notification(
                user=user,
                kind=kind,
                title=title[:300],
                body=body,
                run=run,
                step_run_id=step_run_id,
            )
            for user in users
        ]
    )
    for notification in made:
        outbox.queue(kind, notification.user.email, notification=notification)
    return made


# --- who the document names ---------------------------------------------------------------


def _approvers(spec: Mapping[str, Any]) -> tuple[list[tuple[Any, str, str]], str | None]:
    """(user or None, e-mail, via) for each distinct person; or the problem naming the field.
    A plain address that is a listed user's is that user."""
    named, problem = _named_users(spec, "approvers")
    if problem is not None:
        return [], problem
    people = [(user, user.email, via) for user, via in named]
    known = {(user.email or "").lower() for user, _ in named}
    for index, entry in enumerate(spec.get("emails") or []):
        # Saving parsed these already; a version stored before the parser is held to it
        # here. The approver row keeps the address mail is sent to, nothing else.
        try:
            email = mailbox(entry)
        except MailboxProblem as problem:
            return [], f"approvers.emails[{index}]: {problem}"
        if email.lower() not in known:
            known.add(email.lower())
            people.append((None, email, "email"))
    return people, None


def _users(
    spec: Mapping[str, Any], where: str, *, strict: bool = True
) -> tuple[list[Any], str | None]:
    """The active users named (users, group members), or the problem naming the field;
    without ``strict``, those that resolve (names that no longer do are skipped)."""
    named, problem = _named_users(spec, where, strict=strict)
    return [user for user, _ in named], problem


def _named_users(
    spec: Mapping[str, Any], where: str, *, strict: bool = True
) -> tuple[list[tuple[Any, str]], str | None]:
    """(user, via) for each distinct active user named by ``users`` (via "user") or as a
    member of ``groups`` (via "group:<name>"), first naming first; or the problem naming the
    field (``strict``), else what resolves."""
    names = list(dict.fromkeys(spec.get("users") or []))
    active = get_user_model().objects.filter(username__in=names, is_active=True)
    found = {user.get_username(): user for user in active}
    named: dict[Any, tuple[Any, str]] = {}
    for name in names:
        user = found.get(name)
        if user is None:
            if strict:
                return [], f"{where}.users: no active user named '{name}'"
            continue
        named.setdefault(user.pk, (user, "user"))
    for name in dict.fromkeys(spec.get("groups") or []):
        group = Group.objects.filter(name=name).first()
        if group is None:
            if strict:
                return [], f"{where}.groups: no group named '{name}'"
            continue
        for user in group.user_set.filter(is_active=True).order_by("id"):
            named.setdefault(user.pk, (user, f"group:{name}"))
    return list(named.values()), None


def _text(value: Any) -> str:
    """A message template's value as the request and mails show it."""
    return value if isinstance(value, str) else outbox.pretty(value)
