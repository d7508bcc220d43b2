"""Delivering an event (contract sections 5 and 7): store it, then resume every wait it
satisfies, each under its run's lock, planning the run on; and the reconciler's net for waits
that missed an event.

It sits above ``runs.engine.advance`` (it plans the runs it resumes), while the taking of an
event by a wait (``runs.engine.events``) sits below it: the applier takes events for waits
it has just opened.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from ..models import Event, EventScope, StepRun
from ..status import StepStatus
from .advance import advance_locked, lock_run
from .events import lock_key, take_event
from .isolation import guarded, in_backoff
from .plan import wait_key

logger = logging.getLogger(__name__)

# The reconciler's net, as its failures are named (isolation.py).
MISSED_EVENTS = "reconcile.missed_events"


def resume_wait(wait_id: int, run_id: Any) -> bool:
    """Under the run's lock: give the wait its event, and plan the run on. True when the wait
    was resumed (by this call)."""
    with transaction.atomic():
        run = lock_run(run_id)
        if run is None:
            return False
        wait = StepRun.objects.filter(id=wait_id, status=StepStatus.WAITING).first()
        if wait is None or not take_event(run, wait):
            return False
        advance_locked(run)
        return True


def deliver(
    *,
    name: str,
    key: str,
    payload: Any = None,
    user: Any = None,
    workflows: list[str] | None = None,
) -> tuple[Event, list[Any]]:
    """Store an event and resume the waits it satisfies; returns it and the runs it resumed.

    ``workflows`` scopes it: only waits of runs of these workflows may take it, now or later
    (``None``: any)."""
    digest = wait_key(name, key)
    with transaction.atomic():
        lock_key(digest)
        event = Event.objects.create(
            name=name,
            key=key,
            wait_key=digest,
            payload=payload,
            created_by=user if user is not None and user.is_authenticated else None,
            scoped=workflows is not None,
        )
        if workflows:
            EventScope.objects.bulk_create(
                [EventScope(event=event, workflow_id=workflow) for workflow in workflows]
            )
    waiting = StepRun.objects.filter(wait_key=digest, status=StepStatus.WAITING, kind="wait_event")
    if workflows is not None:
        waiting = waiting.filter(run__workflow_id__in=workflows)
    resumed = [
        run_id
        for wait_id, run_id in waiting.order_by("id").values_list("id", "run_id")
        if resume_wait(wait_id, run_id)
    ]
    return event, resumed


def match_missed(batch: int) -> int:
    """The reconciler's net: waits left waiting although an event they may take is stored
    (a delivery that died between storing its event and resuming the waits, say)."""
    taken = StepRun.objects.filter(run_id=OuterRef(OuterRef("run_id")), event_id=OuterRef("id"))
    in_scope = EventScope.objects.filter(
        event_id=OuterRef("id"), workflow_id=OuterRef(OuterRef("run__workflow_id"))
    )
    takeable = (
        Event.objects.filter(
            wait_key=OuterRef("wait_key"), created_at__gte=OuterRef("run__created_at")
        )
        .filter(Q(scoped=False) | Q(Exists(in_scope)))
        .filter(~Exists(taken))
    )
    missed = (
        StepRun.objects.filter(status=StepStatus.WAITING, kind="wait_event")
        .exclude(in_backoff(MISSED_EVENTS, timezone.now()))
        .filter(Exists(takeable))
        .order_by("id")
        .values_list("id", "run_id")[:batch]
    )
    resumed = 0
    for wait_id, run_id in list(missed):
        # One run's failure is logged, counted and marked; the other waits go on.
        if guarded(MISSED_EVENTS, run_id, partial(resume_wait, wait_id, run_id), failed=False):
            logger.warning("reconcile: wait %s took an event it had missed", wait_id)
            resumed += 1
    return resumed
