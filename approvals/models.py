"""People in the loop: approval requests, the approvers they were sent to, the decisions
they took, in-app notifications and the e-mails that carry them.

An approval request is one ``approval`` step run waiting for people: it is opened by the
engine in the transaction that opens the step row (``approvals.gates``), and closed in the
transaction that ends that row (a decision, the deadline, the run's end). Decisions are an
append-only audit: a row is written once and never updated or deleted.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from runs.models import Run, StepRun

from .status import ApprovalStatus, DecisionChoice, MailKind, MailStatus

# The longest comment a decision keeps (a form, the API and the link page all check it).
COMMENT_MAX = 2000


class ApprovalRequest(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="approval_requests")
    step_run = models.OneToOneField(
        StepRun, on_delete=models.CASCADE, related_name="approval_request"
    )
    step_id = models.CharField(max_length=100)
    path = models.CharField(max_length=500, blank=True, default="")
    status = models.CharField(
        max_length=20, choices=ApprovalStatus.choices, default=ApprovalStatus.PENDING
    )
    # The step's resolved message template, and its input: what the approvers decide on.
    message = models.TextField(blank=True, default="")
    details = models.JSONField(null=True, blank=True)
    # The step's ``email_details``: whether the e-mails carry the details too. Off, they
    # carry the message and the link only (the details may hold what should not travel
    # by e-mail; the pages behind the link show them).
    email_details = models.BooleanField(default=False)
    # The approvers as the document names them: {"users", "groups", "emails"}.
    approvers = models.JSONField(default=dict)
    quorum = models.PositiveIntegerField(default=1)
    deadline = models.DateTimeField(null=True, blank=True)
    remind_after_ms = models.BigIntegerField(null=True, blank=True)
    reminders_sent = models.PositiveIntegerField(default=0)
    # {"users", "groups"} notified when the deadline passes without a decision.
    escalate_to = models.JSONField(null=True, blank=True)
    escalated_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            # Checked when a workflow version is saved (workflows.services.definition_save).
            (
                "mail_external",
                "Can name e-mail approvers outside DJFLOW_APPROVER_EMAIL_DOMAINS",
            ),
            # Likewise: an author may mail no site user or group but themselves without it.
            (
                "mail_users",
                "Can name site users and groups as approvers, escalation or hand-off people",
            ),
        ]
        indexes = [
            models.Index(
                fields=["-created_at"],
                name="approval_pending_newest",
                condition=Q(status="pending"),
            ),
        ]

    def __str__(self) -> str:
        return f"approval {self.step_id} of run {self.run_id} ({self.status})"

    @property
    def is_open(self) -> bool:
        return self.status == ApprovalStatus.PENDING


class Approver(models.Model):
    """One person a request was sent to: the binding of a link (request, approver), whose
    ``token_id`` the signed token carries. Groups are expanded into their users when the
    request opens."""

    request = models.ForeignKey(ApprovalRequest, on_delete=models.CASCADE, related_name="people")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    email = models.CharField(max_length=254, blank=True, default="")
    # How the document named this person: "user", "group:<name>" or "email".
    via = models.CharField(max_length=300)
    token_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    # When a decision used this person's link or vote: a link works once.
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(
                fields=["request", "user"], condition=Q(user__isnull=False), name="approver_user"
            ),
            models.UniqueConstraint(
                fields=["request", "email"],
                condition=Q(user__isnull=True),
                name="approver_email",
            ),
        ]

    def __str__(self) -> str:
        return self.label

    @property
    def label(self) -> str:
        if self.user is not None:
            return self.user.get_username()
        return self.email

    @property
    def is_plain_address(self) -> bool:
        """Named under ``emails`` (its link works for whoever holds it), not a user of the
        site; a user approver whose user was deleted since is neither, and decides nothing."""
        return self.via == "email"


class AppendOnly(Exception):
    pass


class Decision(models.Model):
    """The audit row of one decision: written once, never changed."""

    request = models.ForeignKey(ApprovalRequest, on_delete=models.PROTECT, related_name="decisions")
    approver = models.ForeignKey(Approver, on_delete=models.PROTECT, related_name="decisions")
    # Who acted: the signed-in user, if any (a plain address's link works without signing
    # in; a user approver's only for that user, so this is the approver's user).
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    by = models.CharField(max_length=254)
    decision = models.CharField(max_length=10, choices=DecisionChoice.choices)
    comment = models.TextField(blank=True, default="")
    # "link", "inbox" or "api".
    channel = models.CharField(max_length=10)
    ip = models.GenericIPAddressField(null=True, blank=True)
    user_agent = models.TextField(blank=True, default="")
    token_id = models.UUIDField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            # One decision per approver: a double submit cannot count twice.
            models.UniqueConstraint(fields=["request", "approver"], name="decision_once"),
        ]

    def __str__(self) -> str:
        return f"{self.by} {self.decision} {self.request_id}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise AppendOnly("a decision is never changed")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        raise AppendOnly("a decision is never deleted")


class Notification(models.Model):
    """An in-app notification: a hand-off, an escalation."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications"
    )
    kind = models.CharField(max_length=20)
    title = models.CharField(max_length=300)
    body = models.TextField(blank=True, default="")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    step_run = models.ForeignKey(
        StepRun, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    read_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # A step notifies each person once, however often its transaction is retried.
            models.UniqueConstraint(
                fields=["step_run", "user", "kind"],
                condition=Q(step_run__isnull=False),
                name="notification_once",
            ),
        ]
        indexes = [
            models.Index(fields=["user"], name="notification_unread", condition=Q(read_at=None)),
        ]

    def __str__(self) -> str:
        return f"{self.kind} for {self.user_id}: {self.title}"


class Mail(models.Model):
    """An e-mail to send: written in the transaction that causes it (the outbox), sent by a
    Celery task after commit, retried on SMTP failure, offered again by the reconciler when
    its message was lost. Rendered when sent, from the rows it points at."""

    kind = models.CharField(max_length=20, choices=MailKind.choices)
    to = models.CharField(max_length=254)
    approver = models.ForeignKey(
        Approver, null=True, blank=True, on_delete=models.CASCADE, related_name="mails"
    )
    notification = models.ForeignKey(
        Notification, null=True, blank=True, on_delete=models.CASCADE, related_name="mails"
    )
    status = models.CharField(max_length=10, choices=MailStatus.choices, default=MailStatus.QUEUED)
    tries = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    offered_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["offered_at"], name="mail_queued", condition=Q(status="queued")),
        ]

    def __str__(self) -> str:
        return f"{self.kind} to {self.to} ({self.status})"
