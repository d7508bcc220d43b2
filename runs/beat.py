"""The engine's beat entries, as code (STYLE.md: periodic work is code).

Installed by a data migration and again whenever a beat process starts, in one transaction
and idempotently: an entry deleted by hand, or by a test's flush, comes back with beat.
"""

from __future__ import annotations

from typing import Any

SWEEP = "djflow: sweep (every second)"


def install_beat_entries(interval_model: Any, task_model: Any) -> None:
    """Create or repair the engine's entries, given the two django-celery-beat models
    (historical ones in a migration, the real ones at run time)."""
    every_second, _ = interval_model.objects.get_or_create(every=1, period="seconds")
    task_model.objects.update_or_create(
        name=SWEEP,
        defaults={
            "task": "runs.sweep",
            "interval": every_second,
            "queue": "engine",
            "enabled": True,
            # A tick that waited past the next one is worthless: drop it, the next comes.
            "expire_seconds": 5,
            "description": "Advances runs with a due retry, deadline or lost worker.",
        },
    )
