"""``advance``: lock the run, plan from the journal, apply, all in one transaction."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from ..models import Run
from . import journal
from .apply import apply_plan
from .plan import Plan, plan

logger = logging.getLogger(__name__)


def run_advance(*, run_id: Any) -> Plan | None:
    """Plan and apply the next actions of a run; None when the run does not exist.

    Idempotent: the run row lock serialises concurrent calls, and each call plans from the
    journal as the previous one left it, so a duplicate finds nothing to do.
    """
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(id=run_id).first()
        if run is None:
            logger.warning("advance: run %s does not exist", run_id)
            return None
        return advance_locked(run)


def advance_locked(run: Run) -> Plan:
    """The body of :func:`run_advance` for a caller that already holds the run's lock."""
    now = timezone.now()
    planned = plan(
        journal.document_of(run.version_id),
        journal.run_view(run),
        journal.journal_of(run.id),
        now,
        journal.planner_settings(),
    )
    apply_plan(run, planned, now)
    return planned
