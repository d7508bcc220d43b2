"""Schedules' own beat entry, as code (STYLE.md: periodic work is code), installed with the
engine's whenever beat starts (``config.celery``), in one transaction and idempotently.

Beat sends each schedule's message itself; this entry is the reconciler of those messages: a
``schedules.fire`` lost with a broker restart would leave its slot to the next one, counted
as missed. Every ``RECONCILE_SECONDS`` it fires the schedules whose slot is more than
``LOST_MESSAGE_SECONDS`` overdue (``schedules.services.schedules_sweep``); a schedule whose
message did come has moved its ``next_run_at`` on, so the sweep never starts a slot twice.
"""

from __future__ import annotations

from typing import Any

SWEEP = "djflow: fire schedules a lost message left"


def install_beat_entry(interval_model: Any, task_model: Any, reconcile_seconds: int = 30) -> None:
    """Create or repair the entry, given django-celery-beat's two models."""
    seconds = max(1, int(reconcile_seconds))
    every = interval_model.objects.filter(every=seconds, period="seconds").order_by("id").first()
    every = every or interval_model.objects.create(every=seconds, period="seconds")
    task_model.objects.update_or_create(
        name=SWEEP,
        defaults={
            "task": "schedules.sweep",
            "interval": every,
            "queue": "timers",
            "enabled": True,
            "expire_seconds": max(5, seconds),
            "description": "Fires schedules whose slot is overdue (a lost schedules.fire).",
        },
    )
