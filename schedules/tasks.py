"""The one task of schedules: beat sends it for each schedule's periodic task."""

from __future__ import annotations

from celery import shared_task

from .services import schedule_fire, schedules_sweep


# Beat sends one message per periodic task when it is due; two beats send two, and the
# broker may redeliver: the service decides under the schedule's lock which slot (if any)
# this message starts, so any number of them starts each slot's run once.
@shared_task(name="schedules.fire", ignore_result=True)
def fire(schedule_id: int) -> None:
    schedule_fire(schedule_id=schedule_id)


@shared_task(name="schedules.sweep", ignore_result=True)
def sweep() -> int:
    """Every RECONCILE_SECONDS (beat): fire schedules whose message was lost."""
    return schedules_sweep()
