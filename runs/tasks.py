"""Thin Celery tasks of the engine: they take ids, call a service, and are idempotent."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="runs.advance", ignore_result=True, acks_late=True)
def advance(run_id: str) -> None:
    """Plan and apply the next actions of a run. A second delivery finds nothing to do."""
    from .engine.advance import run_advance

    run_advance(run_id=run_id)


@shared_task(name="runs.fire_timers", ignore_result=True)
def fire_timers() -> int:
    """The engine's clock tick (beat, every second): fire due timers, advance their runs."""
    from .engine.timers import fire_due

    return fire_due()


@shared_task(name="runs.reconcile", ignore_result=True)
def reconcile() -> dict[str, int]:
    """The reconciler (beat, every RECONCILE_SECONDS): recover lost messages and workers."""
    from .engine.reconcile import reconcile as reconcile_once

    return reconcile_once()
