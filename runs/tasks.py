"""Thin Celery tasks of the engine: they take ids, call a service, and are idempotent."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="runs.advance", ignore_result=True, acks_late=True)
def advance(run_id: str) -> None:
    """Plan and apply the next actions of a run. A second delivery finds nothing to do."""
    from .engine.advance import run_advance

    run_advance(run_id=run_id)


@shared_task(name="runs.sweep", ignore_result=True)
def sweep() -> int:
    """The engine's clock tick (beat, every second): advance runs with something due."""
    from .engine.sweep import sweep_due

    return sweep_due()
