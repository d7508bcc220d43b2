"""Each run on its own in the periodic passes (the reconciler's parts, the clock tick,
retention, the apps' repairs): one run that makes a pass raise cannot stop the pass for the
others, nor eat every pass's budget.

Before, a run whose plan raised something other than a database error (a row changed by
hand, a document a later release no longer reads, a bug) made the whole reconciler tick raise
every ``RECONCILE_SECONDS``, and its later parts (concurrency admissions, missed events, cost
releases, the approvals' mail repairs) never ran for anyone.

Invariants:

- A pass's work on one run (:func:`guarded`) is in a savepoint of its own when the pass holds
  a transaction, so a failure rolls back that run's work only; outside a transaction the
  work's own transactions roll themselves back. Either way the pass goes on with the next run.
- A failure is logged with the pass and the run's id, counted
  (``djflow_pass_failures_total{pass}``) and marked (:func:`record_failure`): a
  :class:`~runs.models.RunFault` row per (run, pass), and a ``pass_failed``
  :class:`~runs.models.RunAction` that the run's resource, the inspector and the admin show.
- A marked run is left out of that pass's candidates (:func:`in_backoff`) until its
  ``retry_at``: ``PASS_BACKOFF_SECONDS``, doubling with each failure in a row, at most a day.
  A poison run then costs a pass one try per back-off, not one per tick, and never holds the
  head of a batch ordered by age. An operator's retry or resume of the run deletes its marks
  (``runs.services``): the passes try it again at once, and a new failure counts from one.
- A transient failure (``OperationalError``: a deadlock, a lock time-out, a lost connection)
  is logged and counted but not marked: it says nothing about the run, and the next pass tries
  again, as before.
- Marking never raises: a run deleted meanwhile, or a database that refuses the mark too, is
  logged and the pass goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from .. import metrics
from ..models import Run, RunAction, RunFault

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The longest back-off, and the quiet after which a new failure starts a new count.
BACKOFF_MAX = timedelta(days=1)
# RunAction.action of a mark; RunFault.pass_name and the metric's label hold the pass.
PASS_FAILED = "pass_failed"
# How much of an error's text a mark keeps (a traceback is in the log).
ERROR_CHARS = 2000


def guarded(pass_name: str, run_id: Any, work: Callable[[], T], *, failed: T) -> T:
    """``work()`` for one run of a pass; on any exception, the failure recorded
    (:func:`record_failure`) and ``failed`` returned instead."""
    try:
        if connection.in_atomic_block:
            # A savepoint: the pass's transaction outlives this run's failure.
            with transaction.atomic():
                return work()
        return work()
    except Exception as error:
        record_failure(pass_name, run_id, error)
        return failed


def record_failure(pass_name: str, run_id: Any, error: BaseException) -> None:
    """Log, count and (unless transient) mark the failure of ``pass_name`` on the run
    (``run_id`` None: a failure of no one run, logged and counted)."""
    if run_id is None:
        logger.error("%s failed, the rest goes on: %s", pass_name, describe(error), exc_info=error)
    else:
        logger.error(
            "%s: run %s failed, the pass goes on without it: %s",
            pass_name,
            run_id,
            describe(error),
            exc_info=error,
        )
    metrics.pass_failed(pass_name)
    if run_id is None or isinstance(error, OperationalError):
        return
    try:
        _mark(pass_name, run_id, describe(error), timezone.now())
    except Exception:
        logger.warning("%s: could not mark run %s", pass_name, run_id, exc_info=True)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:ERROR_CHARS]


def backoff(failures: int) -> timedelta:
    """The back-off after ``failures`` failures in a row: the setting, doubled each time."""
    base = timedelta(seconds=float(settings.DJFLOW["PASS_BACKOFF_SECONDS"]))
    # min() on the exponent first: 2**failures of a run failing for years stays small.
    longest: timedelta = min(base * 2 ** min(failures - 1, 32), BACKOFF_MAX)
    return longest


def in_backoff(pass_name: str, now: datetime, run: str = "run_id") -> Exists:
    """True for a candidate row (its run's id in the field ``run``) whose run ``pass_name``
    leaves alone now: ``.exclude(in_backoff(...))``. One probe of the (run, pass) index."""
    return Exists(
        RunFault.objects.filter(run_id=OuterRef(run), pass_name=pass_name, retry_at__gt=now)
    )


def _mark(pass_name: str, run_id: Any, text: str, now: datetime) -> None:
    with transaction.atomic():
        # The run's foreign keys are checked at commit: a run deleted meanwhile (retention)
        # would fail the caller's transaction there, so look first.
        if not Run.objects.filter(id=run_id).exists():
            return
        fault = RunFault.objects.select_for_update().filter(run_id=run_id, pass_name=pass_name)
        found = fault.first()
        streak = found is not None and found.last_failed_at >= now - BACKOFF_MAX * 2
        failures = found.failures + 1 if found is not None and streak else 1
        retry_at = now + backoff(failures)
        if found is None:
            RunFault.objects.create(
                run_id=run_id,
                pass_name=pass_name,
                error=text,
                failures=1,
                first_failed_at=now,
                last_failed_at=now,
                retry_at=retry_at,
            )
        else:
            fault.update(
                error=text,
                failures=failures,
                first_failed_at=found.first_failed_at if streak else now,
                last_failed_at=now,
                retry_at=retry_at,
            )
        RunAction.objects.create(
            run_id=run_id,
            action=PASS_FAILED,
            created_at=now,
            detail={
                "pass": pass_name,
                "error": text,
                "failures": failures,
                "retry_at": retry_at.isoformat(),
            },
        )
