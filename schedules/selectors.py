"""Reads of schedules, narrowed to what the caller may see (their own, and those of the
workflows whose runs they all read)."""

from __future__ import annotations

from typing import Any

from django.db.models import Q, QuerySet

from workflows import access
from workflows.errors import FieldError, NotFound, echo

from .models import Schedule


def schedule_list(*, user: Any, workflow: str | None = None) -> QuerySet[Schedule]:
    """The schedules ``user`` may see (:func:`may_view`), newest first."""
    schedules = Schedule.objects.select_related(
        "task", "task__crontab", "task__interval", "owner"
    ).order_by("-created_at", "-id")
    if workflow is not None:
        schedules = schedules.filter(workflow_id=workflow)
    viewed = access.viewed_workflows(user)
    if viewed is not None:
        mine = Q(owner_id=user.pk) if user is not None and user.is_authenticated else Q()
        schedules = schedules.filter(Q(workflow__in=viewed.values("pk")) | mine)
    return schedules


def may_view(user: Any, schedule: Schedule) -> bool:
    """A schedule is read by its owner and by whoever reads every run of its workflow (its
    viewers, operators, authors): it holds the input of the runs it starts as its owner, and
    another starter reads only the runs they started (CONTRACT section 8)."""
    if access.trusted(user):
        return True
    own = schedule.owner_id is not None and getattr(user, "pk", None) == schedule.owner_id
    return own or access.VIEWER in access.roles(user, schedule.workflow_id)


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
    """404 naming ``id`` unless ``user`` may see the schedule (:func:`may_view`)."""
    if not may_view(user, schedule):
        raise NotFound(errors=[FieldError("id", f"unknown schedule '{schedule.pk}'")])
