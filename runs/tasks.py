"""Thin Celery tasks of the engine: they take ids, call a service, and are idempotent."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from celery import shared_task
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from . import bulk, metrics, retention
from .dispatch import TICK_SECONDS
from .engine import trees
from .engine.advance import run_advance, run_fan_in
from .engine.reconcile import reconcile as reconcile_once
from .engine.timers import fire_due, wake_before

logger = logging.getLogger(__name__)

# Rows the reconciler acted on that are housekeeping, not a repair: said at debug only.
_RECONCILE_HOUSEKEEPING = frozenset({"timers_pruned"})


@shared_task(name="runs.advance", ignore_result=True, acks_late=True)
def advance(run_id: str, fan_in: bool = False) -> None:
    """Plan and apply the next actions of a run. A second delivery finds nothing to do.
    ``fan_in``: the body of a fan-out's chord (runs.dispatch), a nudge that plans only once
    nothing of the run is in flight."""
    if fan_in:
        run_fan_in(run_id=run_id)
    else:
        run_advance(run_id=run_id)


# No task events for the one-second tick: Flower keeps the newest 10,000 tasks, and 86,400
# ticks a day would push every step out of its list within three hours. A stuck clock shows
# in the timers' lag (the admin's timer list), not in Flower; the reconciler keeps its events.
@shared_task(name="runs.fire_timers", ignore_result=True, send_events=False)
def fire_timers() -> int:
    """The engine's clock tick (beat, every second): fire due timers, advance their runs.
    Said at info only when it fired some: an idle tick is debug (config.logging drops
    Celery's own lines about it)."""
    began = timezone.now()
    fired = fire_due()
    # The timers due before the next tick fire at their instant, not at that tick.
    _wake_before(began + timedelta(seconds=TICK_SECONDS))
    logger.log(logging.INFO if fired else logging.DEBUG, "timers: fired %d due timer(s)", fired)
    return fired


@shared_task(name="runs.wake_timers", ignore_result=True, send_events=False)
def wake_timers(until: float | None = None) -> int:
    """A wake-up of the clock between ticks (runs.engine.timers.wake_before): fire what is
    due; given ``until`` (the next tick's instant, epoch seconds), ask for the next wake-up
    before it. As quiet as the tick: Flower and the log hear of it only when it fired some."""
    fired = fire_due(tick=False)
    if until is not None:
        # Never past the next tick as this worker sees it: a message's ``until`` (a skewed
        # clock's, or one written by hand) cannot make a chain of wake-ups that never ends.
        next_tick = timezone.now() + timedelta(seconds=TICK_SECONDS)
        _wake_before(min(datetime.fromtimestamp(until, tz=UTC), next_tick))
    logger.log(logging.INFO if fired else logging.DEBUG, "timers: fired %d due timer(s)", fired)
    return fired


def _wake_before(until: datetime) -> None:
    try:
        wake_before(until)
    except DatabaseError:
        # The tick fires them anyway, a second later at most.
        logger.warning("timers: could not look for the next due timer", exc_info=True)


@shared_task(name="runs.reconcile", ignore_result=True)
def reconcile() -> dict[str, int]:
    """The reconciler (beat, every RECONCILE_SECONDS): recover lost messages and workers."""
    counts = reconcile_once()
    metrics.reconciled(counts)
    repaired = {part: n for part, n in counts.items() if n and part not in _RECONCILE_HOUSEKEEPING}
    if repaired:
        logger.info("reconcile: repaired %s", ", ".join(f"{n} {p}" for p, n in repaired.items()))
    else:
        logger.debug("reconcile: nothing to repair %s", counts)
    return counts


@shared_task(name="runs.end_tree", ignore_result=True, acks_late=True)
def end_tree(root_id: str) -> None:
    """End, in batches, the runs that ends of this tree left behind (a cancel of a large
    tree, children busy at their parent's end); sends itself again while some are left. A
    second delivery finds fewer, or none."""
    trees.end_tree(root_id=root_id)


@shared_task(name="runs.bulk_action", ignore_result=True, acks_late=True)
def bulk_action(bulk_id: str, batch: int) -> None:
    """One batch of a bulk cancel or retry; it sends the next. A batch delivered again
    finds itself done and does nothing (runs.bulk)."""
    bulk.bulk_action_batch(bulk_id=bulk_id, batch=batch)


@shared_task(name="runs.purge_expired", ignore_result=True)
def purge_expired() -> dict[str, int]:
    """Retention (beat, every RETENTION_EVERY_SECONDS): delete ended runs past their
    status's age, for at most RETENTION_TICK_SECONDS; what is left is handed to the next
    message at once. Nothing while DJFLOW_RETENTION_DAYS is empty."""
    tunables = settings.DJFLOW
    ages = retention.retention_ages(tunables["RETENTION_DAYS"])
    if not ages:
        return {}
    try:
        report = retention.retention_purge(
            older_than=ages,
            batch=tunables["RETENTION_BATCH"],
            seconds=tunables["RETENTION_TICK_SECONDS"],
        )
    except DatabaseError:
        # Log and go on: the next pass tries again (a scheduler must not die on a blip).
        logger.exception("retention: a purge failed; the next pass tries again")
        return {}
    if report.more:
        purge_expired.apply_async(queue="default")
    if report.runs:
        logger.info("retention: deleted %s", ", ".join(report.lines()))
    return dict(report.deleted)
