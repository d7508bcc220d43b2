"""Statuses of approval requests and mails.

A request has one move: it leaves ``pending`` once, for one of the other four, either by a
conditional update on ``status='pending'`` (expiry, cancellation) or under its row lock
(a decision, ``approvals.services``). A mail leaves ``queued`` once, the same way."""

from __future__ import annotations

from django.db import models


class ApprovalStatus(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    # The deadline passed with no outcome (the step fails with class timeout).
    EXPIRED = "expired"
    # The run ended, or the step was cancelled, before an outcome.
    CANCELLED = "cancelled"


class DecisionChoice(models.TextChoices):
    APPROVED = "approved"
    REJECTED = "rejected"


class MailKind(models.TextChoices):
    REQUEST = "request"
    REMINDER = "reminder"
    ESCALATION = "escalation"
    HANDOFF = "handoff"
    # A run waits for budget (CONTRACT section 17): to the workflow's operators.
    BUDGET = "budget"


class MailStatus(models.TextChoices):
    QUEUED = "queued"
    SENT = "sent"
    # Given up after the retries (the error is kept on the row).
    FAILED = "failed"
