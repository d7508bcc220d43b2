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

This module is the taking, which the planner's applier calls under the run's lock
(``runs.engine.advance``); delivering an event and resuming the runs it wakes plans them
on, so it lives above the engine's advance, in ``runs.engine.delivery``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import connection
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from workflows.templates import encoded_size

from ..models import Event, EventScope, Run, StepRun
from ..moves import move_steps
from ..status import StepStatus
from .store import Increment, max_run_bytes, over_cap_error, update_run

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
    size = encoded_size(event.payload) if event.payload is not None else 0
    if run.stored_bytes + size > max_run_bytes():
        # The payload would pass what the run may store (DJFLOW_MAX_RUN_BYTES): the wait
        # takes the event (it is not offered again) but fails, class limit, which fails the
        # run; the payload is not written.
        resumed = move_steps(
            StepRun.objects.filter(id=wait.id),
            StepStatus.FAILED,
            sources=[StepStatus.WAITING],
            error=over_cap_error("the event's payload", size, run.stored_bytes),
            event=event,
            finished_at=timezone.now(),
        )
        return resumed == 1
    resumed = move_steps(
        StepRun.objects.filter(id=wait.id),
        StepStatus.SUCCEEDED,
        sources=[StepStatus.WAITING],
        output=event.payload,
        event=event,
        finished_at=timezone.now(),
    )
    if resumed == 1 and size:
        # The run is locked by the caller: its total is the row's, and rises by the payload.
        update_run(run.id, {"stored_bytes": Increment(size)})
        run.stored_bytes += size
    return resumed == 1
