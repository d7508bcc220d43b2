"""The reconciler (beat, every ``RECONCILE_SECONDS``): find what a lost message, a lost
worker or a crash left behind, and put it right. Bounded work per tick.

- an attempt left ``scheduled`` too long (its message lost: a broker restart, a purge; or
  handed back too often by workers without its handler) is offered again;
- a ``running`` attempt whose lease lapsed (its worker is gone) has its run advanced: the
  planner fails it as ``lost`` and offers an ``at_least_once`` step again, or makes an
  ``at_most_once`` one ``in_doubt`` (it may have had its effect: an operator resolves it);
- a run with nothing in flight that should be moving (a lost ``advance``, a fired timer whose
  message was lost, a sleep past due, a deadline passed) is advanced;
- a run waiting for a concurrency slot while its key has one free is admitted
  (``slots.admit_waiting``, keys taking turns);
- a run whose advance request (made by a completion inside a fan-out) has been pending
  that long is advanced;
- a wait left waiting although an event it may take is stored is given it;
- an attempt left scheduled that long whose handler no live worker serves starts its wait
  for one (``unservable.py``: it fails if none comes), and a wait past its window whose
  timer fired while a worker held the attempt ends;
- fired timers older than ``TIMER_RETENTION_SECONDS`` are deleted;
- cost reserved for a model call by an attempt that ended without settling it (its worker
  was lost mid-call) is charged, its worst case (``costs.py``).

Each run is on its own (``isolation.py``): a part that fails on one run logs it, counts it,
marks the run and goes on with the others, and leaves that run out of its candidates for a
back-off; a part that fails as a whole is logged and counted, and the parts after it still
run. One poison run cannot skip the repairs of everyone else.

A tick has a time budget (half of ``RECONCILE_SECONDS``): the runs it advances get one
bounded round each (``advance.ADVANCE_ACTIONS``; a run with more asks a worker for the rest),
and once the budget is spent the runs left are handed to workers as advance messages and the
parts not reached wait for the next tick.

Two reconcilers at once (two beats) are safe: on Postgres a session advisory lock lets one
run at a time, and each action is itself conditional (a re-offer updates ``scheduled_at``
from the value it read, a stuck run is claimed by updating ``updated_at`` from the value it
read, and advancing plans under the run's lock), so no row is acted on twice.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from functools import partial
from uuid import UUID

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from workflows import kinds
from workflows.kinds import Role

from .. import dispatch
from ..models import AdvanceRequest, Run, StepRun, Timer, TimerPurpose
from ..status import RunStatus, StepStatus
from . import costs, delivery, hooks, slots, trees, unservable
from .advance import run_advance
from .isolation import guarded, in_backoff

logger = logging.getLogger(__name__)

# A time budget that never ends (a part called on its own, outside a tick).
_NO_END = float("inf")
# Any constant shared by every reconciler of one database.
_LOCK_ID = 0x646A666C6F77  # "djflow"
# The passes' names (RunFault.pass_name, the failures metric's label). The three parts that
# advance runs share one: a run whose plan fails in one fails in the others.
ADVANCE = "reconcile.advance"
REOFFER = "reconcile.reoffer"


def reconcile(*, budget_seconds: float | None = None) -> dict[str, int]:
    """One reconciler tick; returns how many rows each part acted on (empty when another
    reconciler holds the lock). Parts not reached within ``budget_seconds`` (half of
    RECONCILE_SECONDS) are left for the next tick and not listed."""
    with _only_one() as alone:
        if not alone:
            return {}
        # Half the period: a slow tick must not run into the next one.
        seconds = settings.DJFLOW["RECONCILE_SECONDS"] / 2
        until = time.monotonic() + (seconds if budget_seconds is None else budget_seconds)
        now = timezone.now()
        batch = settings.DJFLOW["RECONCILE_BATCH"]
        parts: list[tuple[str, Callable[[], int]]] = [
            # Before re-offering, which makes the lost attempts look just offered.
            ("unservable", lambda: unservable.arm_unclaimed(now, batch)),
            ("unservable_overdue", lambda: unservable.expire_overdue(now, batch)),
            ("reoffered", lambda: reoffer_lost(now, batch)),
            ("lost_workers", lambda: advance_lost_workers(now, batch, until=until)),
            ("stuck_runs", lambda: advance_stuck(now, batch, until=until)),
            # Runs waiting for a concurrency slot while their key has one free (the ends
            # admit in their own transaction; this is the re-check), keys taking turns.
            ("admitted", lambda: slots.admit_waiting(now, batch)),
            ("requested", lambda: advance_requested(now, batch, until=until)),
            # Trees whose ends left runs behind and whose runs.end_tree message was lost.
            ("orphaned_trees", lambda: trees.resume_orphaned(now, batch)),
            ("missed_events", lambda: delivery.match_missed(batch)),
            ("timers_pruned", lambda: prune_timers(now, batch)),
            # Cost held by attempts whose worker was lost during a model call: charged.
            ("reservations_released", lambda: costs.release_ended(batch)),
        ]
        # The repairs of apps above the engine (approvals' mails and reminders).
        parts += [(name, partial(repair, now, batch)) for name, repair in hooks.repairs()]
        counts: dict[str, int] = {}
        for name, part in parts:
            if time.monotonic() >= until:
                logger.warning("reconcile: out of time; %s and after wait a tick", name)
                break
            counts[name] = _part(name, part)
        return counts


def _part(name: str, part: Callable[[], int]) -> int:
    """One part; should it fail as a whole (its own query, not one run's work, which each
    part isolates), logged and counted, and the parts after it still run."""
    return guarded(f"reconcile.{name}", None, part, failed=0)


@contextlib.contextmanager
def _only_one() -> Iterator[bool]:
    if connection.vendor != "postgresql":
        yield True
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [_LOCK_ID])
        alone = cursor.fetchone()[0]
    try:
        yield alone
    finally:
        if alone:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [_LOCK_ID])


def reoffer_lost(now: datetime, batch: int) -> int:
    """Offer again the attempts left ``scheduled`` too long. A duplicate offer is harmless
    (the claim decides), so this errs on the side of offering."""
    tunables = settings.DJFLOW
    lost = now - timedelta(seconds=tunables["LOST_MESSAGE_SECONDS"])
    refused = now - timedelta(seconds=1)
    rows = (
        # An attempt waiting for budget is not lost: offered, it would be handed back at once
        # (runs.engine.budgets releases it).
        StepRun.objects.filter(status=StepStatus.SCHEDULED, budget_wait__isnull=True)
        .filter(
            Q(scheduled_at__lte=lost)
            | Q(refusals__gte=tunables["MAX_QUICK_REFUSALS"], scheduled_at__lte=refused)
        )
        .exclude(in_backoff(REOFFER, now))
        .select_related("run")
        .order_by("scheduled_at")[:batch]
    )
    offered = 0
    for row in rows:
        offered += guarded(REOFFER, row.run_id, partial(_reoffer, row, now), failed=0)
    return offered


def _reoffer(row: StepRun, now: datetime) -> int:
    with transaction.atomic():
        unchanged = StepRun.objects.filter(
            id=row.id, status=StepStatus.SCHEDULED, scheduled_at=row.scheduled_at
        )
        if unchanged.update(scheduled_at=now):
            dispatch.offer_on_commit(row, workflow_id=row.run.workflow_id)
            return 1
    return 0


def advance_lost_workers(now: datetime, batch: int, *, until: float = _NO_END) -> int:
    """Advance the runs of running attempts whose lease lapsed (the lease never outlives the
    attempt's deadline plus grace, so this also catches a body past its deadline)."""
    run_ids = list(
        StepRun.objects.filter(status=StepStatus.RUNNING, lease_expires_at__lte=now)
        .exclude(in_backoff(ADVANCE, now))
        .order_by("lease_expires_at")
        .values_list("run_id", flat=True)[:batch]
    )
    return _advance_each(dict.fromkeys(run_ids), until)


def advance_stuck(now: datetime, batch: int, *, until: float = _NO_END) -> int:
    """Advance runs that should be moving but have not for ``LOST_MESSAGE_SECONDS``."""
    tunables = settings.DJFLOW
    quiet = now - timedelta(seconds=tunables["LOST_MESSAGE_SECONDS"])
    grace = timedelta(seconds=tunables["DEADLINE_GRACE_SECONDS"])
    # Attempts of worker steps in flight; an open composite or condition row is not work.
    busy = StepRun.objects.filter(
        run_id=OuterRef("id"),
        status__in=[StepStatus.SCHEDULED, StepStatus.RUNNING],
        kind__in=kinds.names(Role.WORKER),
    )
    # A sleep just due is the tick's to end; one still waiting this long after is left over.
    # An in_doubt attempt past its deadline likewise (its timer's advance was lost).
    due_wait = StepRun.objects.filter(
        run_id=OuterRef("id"),
        status__in=[StepStatus.WAITING, StepStatus.IN_DOUBT],
        not_before__lte=quiet,
    )
    backing_off = Timer.objects.filter(
        run_id=OuterRef("id"),
        # A child run waiting for its tree's pace (runs.engine.trees) is quiet on purpose too.
        purpose__in=[TimerPurpose.RETRY_BACKOFF, TimerPurpose.TREE_PACE],
        fired_at__isnull=True,
    )
    # A timer the tick fired within the quiet period: the run's advance is on its way, in a
    # queue that a burst of due timers makes long. Re-advancing such runs was double work
    # that competed for their locks: 400 to 500 of 3,000 runs due at once (bench.timers).
    # Its message lost, the run is found once the timer fired that long ago.
    fired_lately = Timer.objects.filter(run_id=OuterRef("id"), fired_at__gt=quiet)
    candidates = (
        Run.objects.filter(
            status__in=[
                RunStatus.PENDING,
                RunStatus.RUNNING,
                RunStatus.WAITING,
                RunStatus.PENDING_APPROVAL,
            ],
            updated_at__lte=quiet,
        )
        .alias(
            busy=Exists(busy),
            backing_off=Exists(backing_off),
            due_wait=Exists(due_wait),
            fired_lately=Exists(fired_lately),
        )
        .filter(
            Q(status__in=[RunStatus.PENDING, RunStatus.RUNNING], busy=False, backing_off=False)
            | Q(due_wait=True)
            | Q(deadline_at__lte=now - grace)
        )
        # A run waiting for a concurrency slot is quiet on purpose (admit_waiting's).
        .filter(Q(concurrency_key__isnull=True) | Q(admitted_at__isnull=False))
        .filter(fired_lately=False)
        .exclude(in_backoff(ADVANCE, now, run="id"))
        .order_by("updated_at")
        .values_list("id", "updated_at")[:batch]
    )
    claimed: dict[UUID, None] = {}
    for run_id, updated_at in list(candidates):
        # The claim: only one reconciler moves updated_at from the value it read.
        if Run.objects.filter(id=run_id, updated_at=updated_at).update(updated_at=now):
            claimed[run_id] = None
    return _advance_each(claimed, until)


def advance_requested(now: datetime, batch: int, *, until: float = _NO_END) -> int:
    """Advance runs whose advance request has been pending for ``LOST_MESSAGE_SECONDS``:
    the message sent with it was lost, and later completions found it pending."""
    quiet = now - timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"])
    stale = (
        AdvanceRequest.objects.filter(requested_at__lte=quiet)
        .exclude(in_backoff(ADVANCE, now))
        .order_by("requested_at")
        .values_list("run_id", flat=True)[:batch]
    )
    return _advance_each(dict.fromkeys(stale), until)


def _advance_each(run_ids: dict[UUID, None], until: float = _NO_END) -> int:
    """Advance each run one bounded round until ``until`` (monotonic); hand the rest to
    workers. Returns how many runs were advanced or handed over."""
    advanced = 0
    pending = list(run_ids)
    for index, run_id in enumerate(pending):
        if time.monotonic() >= until:
            # Out of time: workers advance the rest (their messages may be lost too; the
            # next tick finds those runs again).
            dispatch.advance_many(pending[index:])
            return advanced + len(pending) - index
        # One bounded round; a run with more to plan asks a worker for the rest. A failure
        # is logged, counted and marked, and the next run goes on (isolation.py).
        advanced += guarded(ADVANCE, run_id, partial(_advance_one, run_id), failed=0)
    return advanced


def _advance_one(run_id: UUID) -> int:
    run_advance(run_id=run_id, seconds=0)
    return 1


def prune_timers(now: datetime, batch: int) -> int:
    """Delete fired timers past their retention, a batch at a time."""
    kept_since = now - timedelta(seconds=settings.DJFLOW["TIMER_RETENTION_SECONDS"])
    old = Timer.objects.filter(fired_at__lte=kept_since).order_by("fired_at").values("id")[:batch]
    return Timer.objects.filter(id__in=list(old.values_list("id", flat=True))).delete()[0]
