"""``advance``: lock the run, plan from the journal, apply, all in one transaction."""

from __future__ import annotations

import logging
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from ..models import Run, StepRun
from . import events, journal
from .apply import apply_plan
from .plan import Plan, plan
from .store import take_advance_request

logger = logging.getLogger(__name__)

# A plan that opens a wait which an event already there satisfies is planned again at once;
# each round consumes an event, so this only bounds a document of many waits in a row.
MAX_ROUNDS = 100


def run_advance(*, run_id: Any) -> Plan | None:
    """Plan and apply the next actions of a run; None when the run does not exist.

    Idempotent: the run row lock serialises concurrent calls, and each call plans from the
    journal as the previous one left it, so a duplicate finds nothing to do.
    """
    # Before the journal is read (in a transaction of its own unless the caller has one): a
    # completion committed after this asks again (see store.request_advance).
    take_advance_request(run_id)
    with transaction.atomic():
        run = lock_run(run_id)
        if run is None:
            logger.warning("advance: run %s does not exist", run_id)
            return None
        return advance_locked(run)[0]


def lock_run(run_id: Any) -> Run | None:
    """The run's row, locked until the transaction ends (``SELECT ... FOR UPDATE``).

    A raw query: it runs once per step, and the ORM's query building was a visible share
    of a step's cost.
    """
    # NO KEY UPDATE: advances still take turns, but inserts that only reference the run (an
    # attempt's deadline timer at its claim, an advance request) do not wait behind one.
    lock = " FOR NO KEY UPDATE" if connection.vendor == "postgresql" else ""
    pk = Run._meta.pk.get_db_prep_value(run_id, connection)
    found = list(Run.objects.raw(f"SELECT * FROM {Run._meta.db_table} WHERE id = %s{lock}", [pk]))
    return found[0] if found else None


def advance_locked(run: Run, *, hold: bool = False) -> tuple[Plan, StepRun | None]:
    """The body of :func:`run_advance` for a caller that already holds the run's lock;
    with ``hold``, also the lone new attempt left for the caller to run (see apply_plan).

    A wait_event the plan opened takes an event that arrived before it (after the run
    started), and the run is planned again from there, in the same transaction.
    """
    # An attempt held back in one round (not offered) is the caller's even when a later
    # round, planned again after a hand-off or a taken event, holds nothing.
    held: StepRun | None = None
    for _ in range(MAX_ROUNDS):
        now = timezone.now()
        planned = plan(
            journal.document_for(run),
            journal.run_view(run),
            journal.journal_of(run.id),
            now,
            journal.planner_settings(),
        )
        applied = apply_plan(run, planned, now, hold=hold and held is None)
        held = held or applied.held
        taken = [wait for wait in applied.waits if events.take_event(run, wait)]
        if not taken and not applied.replan:
            return planned, held
    logger.warning("advance: run %s planned %d rounds in a row; stopping", run.id, MAX_ROUNDS)
    return planned, held
