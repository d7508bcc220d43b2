"""The periodic sweep: find runs that need the engine without any message arriving.

- a run whose ``wake_at`` has passed (a retry back-off, its run deadline);
- a running attempt whose lease lapsed (its worker is lost) or that ran past its deadline;
- an attempt left ``scheduled`` too long (its message lost, or handed back too often in a
  row by workers without its handler), offered again.

Bounded work per tick; each run is advanced under its own lock, so two sweeps at once, or a
sweep racing a worker, plan from the same journal and cannot both act.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Q
from django.utils import timezone

from .. import dispatch
from ..models import Run, StepRun
from ..status import RUN_TERMINAL, StepStatus
from .advance import run_advance

logger = logging.getLogger(__name__)


def sweep_due() -> int:
    """Advance what is due; returns how many runs were advanced."""
    now = timezone.now()
    batch = settings.DJFLOW["SWEEP_BATCH"]
    due = set(
        Run.objects.filter(wake_at__lte=now)
        .exclude(status__in=RUN_TERMINAL)
        .order_by("wake_at")
        .values_list("id", flat=True)[:batch]
    )
    due |= set(
        StepRun.objects.filter(status=StepStatus.RUNNING, lease_expires_at__lte=now)
        .order_by("lease_expires_at")
        .values_list("run_id", flat=True)[:batch]
    )
    advanced = 0
    for run_id in due:
        try:
            run_advance(run_id=run_id)
            advanced += 1
        except DatabaseError:
            # Log and go on: the next tick tries again (a scheduler must not die on a blip).
            logger.exception("sweep: advancing run %s failed", run_id)
    _reoffer_stale(now)
    return advanced


def _reoffer_stale(now: datetime) -> None:
    """Offer again the attempts that stayed ``scheduled`` too long: their message was lost
    (a broker outage at commit, a purge), or every worker that took it lacked the handler.

    A duplicate offer is harmless (the claim decides), so this errs on the side of offering.
    """
    quick = settings.DJFLOW["MAX_QUICK_REFUSALS"]
    lost = now - timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"])
    refused = now - timedelta(seconds=1)
    rows = (
        StepRun.objects.filter(status=StepStatus.SCHEDULED)
        .filter(Q(scheduled_at__lte=lost) | Q(refusals__gte=quick, scheduled_at__lte=refused))
        .select_related("run")
        .order_by("scheduled_at")[:100]
    )
    for row in rows:
        with transaction.atomic():
            unchanged = StepRun.objects.filter(
                id=row.id, status=StepStatus.SCHEDULED, scheduled_at=row.scheduled_at
            )
            if unchanged.update(scheduled_at=now):
                dispatch.offer_on_commit(row, workflow_id=row.run.workflow_id)
