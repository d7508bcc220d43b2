"""Reads of the approvals app that are more than a filter."""

from __future__ import annotations

from typing import Any

from django.db.models import Exists, OuterRef, Q, QuerySet

from .models import ApprovalRequest, Approver, Notification


def approvals_for(user: Any, status: str | None = None) -> QuerySet[ApprovalRequest]:
    """The requests ``user`` is an approver of, newest first."""
    mine = Q(user=user)
    if user.email:
        mine |= Q(user__isnull=True, email__iexact=user.email)
    requests = ApprovalRequest.objects.filter(
        Exists(Approver.objects.filter(mine, request=OuterRef("pk")))
    ).select_related("run")
    if status:
        requests = requests.filter(status=status)
    return requests.order_by("-created_at")


def unread_count(user: Any) -> int:
    if not user.is_authenticated:
        return 0
    return Notification.objects.filter(user=user, read_at__isnull=True).count()
