"""Reads of schedules, narrowed to what the caller may see (the workflows they may see)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from workflows import access
from workflows.models import Workflow

from .models import Schedule
from .services import _find, require_view


def schedule_list(*, user: Any, workflow: str | None = None) -> QuerySet[Schedule]:
    """Schedules of the workflows ``user`` may see, newest first."""
    schedules = Schedule.objects.select_related(
        "task", "task__crontab", "task__interval", "owner"
    ).order_by("-created_at", "-id")
    if workflow is not None:
        schedules = schedules.filter(workflow_id=workflow)
    if not access.sees_all_definitions(user):
        visible = access.visible_workflows(user, Workflow.objects.all())
        schedules = schedules.filter(workflow__in=visible.values("pk"))
    return schedules


def schedule_get(*, schedule_id: Any, user: Any) -> Schedule:
    """One schedule; 404 naming ``id`` when it does not exist or ``user`` may not see it."""
    schedule = _find(schedule_id, Schedule.objects.select_related("owner"))
    require_view(user, schedule)
    return schedule
