"""Reads of schedules, narrowed to what the caller may see (the workflows they may see)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from workflows import access
from workflows.errors import FieldError, NotFound, echo
from workflows.models import Workflow

from .models import Schedule


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
    schedule = schedule_row(schedule_id, Schedule.objects.select_related("owner"))
    require_view(user, schedule)
    return schedule


def schedule_row(schedule_id: Any, schedules: QuerySet[Schedule]) -> Schedule:
    """The schedule ``schedule_id`` names, from ``schedules``; 404 naming ``id`` for none (or
    an id that is not a number)."""
    try:
        pk = int(str(schedule_id), 10)
    except ValueError:
        pk = None
    found = (
        schedules.select_related("task", "task__crontab", "task__interval").filter(pk=pk).first()
        if pk is not None and 0 < pk < 2**63
        else None
    )
    if found is None:
        raise NotFound(errors=[FieldError("id", f"unknown schedule '{echo(schedule_id)}'")])
    return found


def require_view(user: Any, schedule: Schedule) -> None:
    """404 naming ``id`` unless ``user`` may see the schedule's workflow."""
    if not access.may_see_definition(user, schedule.workflow_id):
        raise NotFound(errors=[FieldError("id", f"unknown schedule '{schedule.pk}'")])
