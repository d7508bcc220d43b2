"""The engine's beat entries, as code (STYLE.md: periodic work is code).

Installed by a data migration and again whenever a beat process starts, in one transaction
and idempotently: an entry deleted by hand, or by a test's flush, comes back with beat, and
the reconciler's period follows ``DJFLOW["RECONCILE_SECONDS"]`` at each start.
"""

from __future__ import annotations

from typing import Any

TIMERS = "djflow: fire timers (every second)"
RECONCILE = "djflow: reconcile"
KB_EMBEDDINGS = "djflow: embed knowledge-base documents a lost message left"
RETENTION = "djflow: delete ended runs past DJFLOW_RETENTION_DAYS"
# The 1-second sweep of earlier versions, replaced by the two entries above.
OLD_SWEEP = "djflow: sweep (every second)"


def install_beat_entries(
    interval_model: Any,
    task_model: Any,
    reconcile_seconds: int = 30,
    retention_seconds: int = 3600,
    clock_priority: int | None = None,
) -> None:
    """Create or repair the engine's entries, given the two django-celery-beat models
    (historical ones in a migration, the real ones at run time). ``clock_priority`` is the
    broker's highest priority (``runs.dispatch.broker_priority(9)``), given at beat's start:
    the tick and the reconciler go before any run's messages a worker could take instead
    (kombu's Redis transport pops every queue's highest-priority list first, across queues),
    so urgent runs never delay the clock."""
    every_second = _interval(interval_model, 1)  # runs.dispatch.TICK_SECONDS
    every_reconcile = _interval(interval_model, max(1, int(reconcile_seconds)))
    task_model.objects.filter(name=OLD_SWEEP).delete()
    task_model.objects.update_or_create(
        name=TIMERS,
        defaults={
            "task": "runs.fire_timers",
            "interval": every_second,
            "queue": "timers",
            "priority": clock_priority,
            "enabled": True,
            # A tick that waited past the next one is worthless: drop it, the next comes.
            "expire_seconds": 5,
            "description": "Fires due timers (sleeps, wait time-outs, retries, deadlines).",
        },
    )
    task_model.objects.update_or_create(
        name=RECONCILE,
        defaults={
            "task": "runs.reconcile",
            "interval": every_reconcile,
            "queue": "timers",
            "priority": clock_priority,
            "enabled": True,
            "expire_seconds": max(5, int(reconcile_seconds)),
            "description": "Re-offers lost work, fails lost at_most_once attempts, advances "
            "stuck runs.",
        },
    )
    # The workers' sweep (workers.kb_embed), by name: it does nothing unless
    # DJFLOW_EMBEDDINGS_MODEL is set. On the default queue, which every worker consumes (it
    # sends messages, it calls no model), not on the clock's.
    task_model.objects.update_or_create(
        name=KB_EMBEDDINGS,
        defaults={
            "task": "workers.sweep_kb_embeddings",
            "interval": every_reconcile,
            "queue": "default",
            "enabled": True,
            "expire_seconds": max(5, int(reconcile_seconds)),
            "description": "Sends knowledge-base document versions still missing an embedding "
            "(DJFLOW_EMBEDDINGS_MODEL) to be embedded.",
        },
    )

    # Retention (runs.retention): does nothing while DJFLOW_RETENTION_DAYS is empty. On the
    # default queue: a pass may take RETENTION_TICK_SECONDS, which neither the clock nor the
    # engine's planning should wait behind.
    task_model.objects.update_or_create(
        name=RETENTION,
        defaults={
            "task": "runs.purge_expired",
            "interval": _interval(interval_model, max(1, int(retention_seconds))),
            "queue": "default",
            "enabled": True,
            "expire_seconds": max(5, int(retention_seconds)),
            "description": "Deletes ended runs (whole trees, with everything of theirs) past "
            "their status's age in DJFLOW_RETENTION_DAYS.",
        },
    )


def _interval(interval_model: Any, seconds: int) -> Any:
    """An interval of ``seconds``, the oldest if there are several. Nothing makes (every,
    period) unique: a person may add the same interval in the admin for a task of their own,
    and two beats starting at once may each create one. ``get_or_create`` would then raise
    MultipleObjectsReturned at every beat start, and the entries would never be repaired."""
    found = interval_model.objects.filter(every=seconds, period="seconds").order_by("id").first()
    return found or interval_model.objects.create(every=seconds, period="seconds")
