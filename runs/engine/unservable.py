"""Attempts that no live worker serves: why the run waits, and the failure that ends the wait.

An attempt of a ``task`` or ``agent`` step waits for a worker that serves its handler on its
queue (``workflows.heartbeats``). Once it is seen that none does, the attempt records what it
waits for (``waiting_for``, the handler) and since when (``waiting_since``), and an
``unservable`` timer is set ``UNSERVABLE_SECONDS`` later. When the timer fires and the
attempt is still scheduled, it fails with class ``unservable``, naming the handler, unless a
worker that serves it was seen since ``waiting_since``: then the wait is called off and the
attempt offered again (should that worker not take it, the next hand-back or reconciler
pass starts a new wait). The run then fails, or goes on past an ``on_error: continue`` step,
as it does for any failed step.

Who sees it: a worker that lacks the handler (its hand-back asks), and the reconciler, for
attempts left scheduled ``LOST_MESSAGE_SECONDS`` that no worker handed back (no worker
consumes their queue, or none runs). The reconciler also ends a wait whose timer fired
without ending it (``expire_overdue``): the timer fires once, and an attempt that a worker
held at that instant (claimed on a re-offer, about to hand it back) is not ``scheduled``, so
the tick leaves it; back to ``scheduled`` with its wait still set, nothing else would ever
end it (the hand-back's arming keeps an existing wait, and ``arm_unclaimed`` skips it).

A worker that lacks a handler another live worker has only hands the attempt back (contract
section 5: requeued, budget untouched).

Invariants:

- arming is idempotent: ``waiting_since`` is set only where it is empty, so hand-backs
  during one wait keep its start; the timer's key holds that start, one row per wait;
- ``waiting_since`` is set only on a scheduled attempt, and only by arming; it stays through
  a claim by a worker that hands the attempt back (the wait goes on), and is cleared when the
  wait is called off;
- the failure is a conditional update from ``scheduled`` with the same ``waiting_since``: a
  worker's claim racing it either wins (the body runs) or finds the attempt failed.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from workflows import heartbeats, kinds
from workflows.registry import step_handler

from .. import dispatch
from ..models import StepRun, Timer, TimerPurpose
from ..moves import move_steps
from ..status import StepStatus
from . import journal
from .advance import run_advance
from .isolation import guarded, in_backoff

logger = logging.getLogger(__name__)

UNSERVABLE = "unservable"
# The passes' names, as their failures are counted and marked (isolation.py).
ARM = "reconcile.unservable"
EXPIRE = "unservable.expire"


@transaction.atomic
def unservable_arm(
    *, step_run_id: int, run_id: Any, handler: str, queue: str, now: datetime
) -> bool:
    """Start the attempt's wait for a worker if no live worker serves ``handler`` on
    ``queue``; True when the attempt waits (started now or earlier), False when a live
    worker serves it (it only needs offering again). The wait and its timer are written
    together: a wait without its timer would never end (the reconciler skips attempts
    already waiting)."""
    if heartbeats.handler_served(handler=handler, queue=queue, now=now):
        return False
    started = StepRun.objects.filter(
        id=step_run_id, status=StepStatus.SCHEDULED, waiting_since__isnull=True
    ).update(waiting_for=handler, waiting_since=now)
    if started:
        fire_at = now + timedelta(seconds=settings.DJFLOW["UNSERVABLE_SECONDS"])
        Timer.objects.bulk_create(
            [
                Timer(
                    run_id=run_id,
                    step_run_id=step_run_id,
                    purpose=TimerPurpose.UNSERVABLE,
                    key=f"unservable:{step_run_id}:{now.isoformat()}",
                    fire_at=fire_at,
                )
            ],
            ignore_conflicts=True,
        )
        logger.warning(
            "attempt %s waits for a worker that serves %s on queue %s; it fails at %s",
            step_run_id,
            handler,
            queue,
            fire_at.isoformat(timespec="seconds"),
        )
    return True


def unservable_expire(*, step_run_ids: list[int]) -> int:
    """End the waits whose timer fired (the timer tick); returns how many attempts failed.
    A database error on one is logged: its timer is fired, and the reconciler ends the wait
    later (``expire_overdue``)."""
    # Each attempt on its own: a failure is logged, counted and marked on its run, and the
    # reconciler ends that wait later (``expire_overdue``), after the run's back-off.
    run_of = dict(StepRun.objects.filter(id__in=step_run_ids).values_list("id", "run_id"))
    return sum(
        guarded(EXPIRE, run_of.get(step_run_id), partial(_expire_one, step_run_id), failed=0)
        for step_run_id in step_run_ids
    )


def _expire_one(step_run_id: int) -> bool:
    found = (
        StepRun.objects.filter(
            id=step_run_id, status=StepStatus.SCHEDULED, waiting_since__isnull=False
        )
        .select_related("run")
        .first()
    )
    if found is None or found.waiting_since is None:
        return False  # taken, cancelled, or its wait called off meanwhile
    step = heartbeats.StepHandler("", found.step_id, found.waiting_for, found.queue)
    with transaction.atomic():
        same_wait = StepRun.objects.filter(
            id=found.id, status=StepStatus.SCHEDULED, waiting_since=found.waiting_since
        )
        served = heartbeats.handler_served(
            handler=step.handler, queue=step.queue, since=found.waiting_since
        )
        if served:
            if same_wait.update(waiting_for="", waiting_since=None):
                dispatch.offer_on_commit(found, workflow_id=found.run.workflow_id)
            return False
        waited = (timezone.now() - found.waiting_since).total_seconds()
        message = heartbeats.unserved_message(step, heartbeats.workers_live())
        error = {"class": UNSERVABLE, "message": f"{message} (waited {waited:.0f} s)"}
        failed = move_steps(
            same_wait,
            StepStatus.FAILED,
            sources=[StepStatus.SCHEDULED],
            error=error,
            finished_at=timezone.now(),
            claim=None,
        )
        if not failed:
            return False
    logger.warning("attempt %s failed: %s", found.id, error["message"])
    # A transaction of its own, as the tick advances any run; should it fail, the
    # reconciler advances a run left with nothing in flight.
    run_advance(run_id=found.run_id)
    return True


def arm_unclaimed(now: datetime, batch: int) -> int:
    """The reconciler's part: attempts left scheduled ``LOST_MESSAGE_SECONDS`` with no wait
    started, whose handler no live worker serves (no worker consumed their message, so
    none handed them back). Returns how many started waiting."""
    lost = now - timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"])
    rows = list(
        StepRun.objects.filter(
            status=StepStatus.SCHEDULED,
            # Kinds whose body is a handler: what workers' heartbeats say they serve.
            kind__in=kinds.handler_kinds(),
            scheduled_at__lte=lost,
            waiting_since__isnull=True,
            # Waiting for budget, not for a worker (runs.engine.budgets).
            budget_wait__isnull=True,
        )
        .exclude(in_backoff(ARM, now))
        .select_related("run")
        .order_by("scheduled_at")[:batch]
    )
    if not rows:
        return 0
    # One read of the heartbeats for the batch: most such rows are served (a backlog, a
    # lost message) and need no more.
    live = heartbeats.workers_live(now=now)
    started = 0
    for row in rows:
        # One attempt's failure (its version's document unreadable, say) is logged, counted
        # and marked, and the others go on (isolation.py).
        started += guarded(ARM, row.run_id, partial(_arm_one, row, live, now), failed=0)
    return started


def _arm_one(row: StepRun, live: Any, now: datetime) -> int:
    handler = handler_of(row.run.workflow_id, row.run.version_id, row.step_id)
    if any(heartbeats.serves(worker, handler, row.queue) for worker in live):
        return 0
    return unservable_arm(
        step_run_id=row.id, run_id=row.run_id, handler=handler, queue=row.queue, now=now
    )


def expire_overdue(now: datetime, batch: int) -> int:
    """The reconciler's part: end the waits past their window whose timer has fired (or is
    gone) while the attempt is ``scheduled``; returns how many attempts failed. A wait whose
    timer is still to fire is the tick's."""
    window = timedelta(seconds=settings.DJFLOW["UNSERVABLE_SECONDS"])
    pending_timer = Timer.objects.filter(
        step_run_id=OuterRef("id"), purpose=TimerPurpose.UNSERVABLE, fired_at__isnull=True
    )
    overdue = list(
        StepRun.objects.filter(status=StepStatus.SCHEDULED, waiting_since__lte=now - window)
        .exclude(Exists(pending_timer))
        .exclude(in_backoff(EXPIRE, now))
        .order_by("waiting_since")
        .values_list("id", flat=True)[:batch]
    )
    if overdue:
        logger.warning("unservable: %d waits past their window had no timer left", len(overdue))
    return unservable_expire(step_run_ids=overdue)


def handler_of(workflow_id: str, version_id: int, step_id: str) -> str:
    """The handler a step is looked up by (``workflows.registry.lookup``)."""
    step = journal.steps_of(version_id).get(step_id, {})
    return step_handler(workflow_id, step_id, step.get("handler"))


def waiting_reason(step_run: StepRun) -> str | None:
    """Why a scheduled attempt is not running, as the run shows it; None when nothing is
    known to hold it."""
    if step_run.status != StepStatus.SCHEDULED or step_run.waiting_since is None:
        return None
    fails_at = step_run.waiting_since + timedelta(seconds=settings.DJFLOW["UNSERVABLE_SECONDS"])
    return (
        f"waiting for a worker that serves {step_run.waiting_for} (step '{step_run.step_id}', "
        f"queue '{step_run.queue}'); the step fails as unservable at "
        f"{fails_at.isoformat(timespec='seconds')} unless one starts"
    )


def offer_waiting(*, handlers: list[str], queues: list[str], batch: int) -> int:
    """Offer again the attempts waiting for one of ``handlers`` on one of ``queues``: what a
    worker that starts serving them does, so it takes them now rather than at the
    reconciler's next pass. Their wait goes on until one is taken (or called off when it
    ends: a worker that serves it was seen). Returns how many were offered."""
    rows = list(
        StepRun.objects.filter(
            status=StepStatus.SCHEDULED, waiting_for__in=handlers, queue__in=queues
        )
        .select_related("run")
        .order_by("waiting_since")[:batch]
    )
    for row in rows:
        dispatch.offer_now(row, workflow_id=row.run.workflow_id)
    return len(rows)
