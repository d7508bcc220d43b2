"""Events and the waits that take them (contract section 5).

An event is kept. A ``wait_event`` takes the oldest event with its name and resolved key that
arrived after its run started and that no other wait of the same run has taken: so an event
sent just before the run reaches its wait is not lost, and a run waiting twice on one key
takes two events. An event resumes every run waiting on it (one wait per run).

Two paths meet here and must not miss each other: a wait opening (under its run's lock) looks
for an event already there, and a delivery (after storing its event) looks for waits already
open. On Postgres both take a transaction-level advisory lock on the (name, key) digest around
those steps, so whichever comes second sees what the first committed. The reconciler's
periodic match is the net under both (and the only guard on SQLite).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from ..models import Event, EventScope, Run, StepRun
from ..moves import move_steps
from ..status import StepStatus
from .plan import wait_key

logger = logging.getLogger(__name__)


def lock_key(digest: str) -> None:
    """Serialise with every other opener and deliverer of this (name, key) until commit."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        # 60 bits of the digest: a signed bigint, and collisions only serialise two keys.
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [int(digest[:15], 16)])


def may_resume(workflow_id: Any) -> Q:
    """Events that may resume a wait of a run of ``workflow_id``: unscoped ones, and scoped
    ones whose sender operated that workflow when sending (CONTRACT section 8)."""
    scope = EventScope.objects.filter(event_id=OuterRef("id"), workflow_id=workflow_id)
    return Q(scoped=False) | Q(Exists(scope))


def take_event(run: Run, wait: StepRun) -> bool:
    """Resume ``wait`` (a waiting wait_event row of ``run``, locked by the caller) with the
    oldest event it may take; False when there is none (or the wait is no longer waiting)."""
    lock_key(wait.wait_key)
    taken = StepRun.objects.filter(run_id=run.id, event__isnull=False).values("event_id")
    event = (
        Event.objects.filter(wait_key=wait.wait_key, created_at__gte=run.created_at)
        .filter(may_resume(run.workflow_id))
        .exclude(id__in=taken)
        .order_by("created_at", "id")
        .first()
    )
    if event is None:
        return False
    resumed = move_steps(
        StepRun.objects.filter(id=wait.id),
        StepStatus.SUCCEEDED,
        sources=[StepStatus.WAITING],
        output=event.payload,
        event=event,
        finished_at=timezone.now(),
    )
    return resumed == 1


def resume_wait(wait_id: int, run_id: Any) -> bool:
    """Under the run's lock: give the wait its event, and plan the run on. True when the wait
    was resumed (by this call)."""
    from .advance import advance_locked, lock_run

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
        .filter(Exists(takeable))
        .order_by("id")
        .values_list("id", "run_id")[:batch]
    )
    resumed = 0
    for wait_id, run_id in list(missed):
        if resume_wait(wait_id, run_id):
            logger.warning("reconcile: wait %s took an event it had missed", wait_id)
            resumed += 1
    return resumed
