"""Schedules: a workflow started on a cron or an interval with a fixed input.

The timing is django-celery-beat's, as users know it: each schedule owns one ``PeriodicTask``
(with its ``CrontabSchedule`` or ``IntervalSchedule``) whose task is ``schedules.fire`` with
the schedule's id, so beat sends the message and the admin's "Periodic tasks" page shows it.
What beat does not know lives here: whose schedule it is (its runs are started as them), the
input (secrets sealed like a run's), which slot fires next (``next_run_at``, the only state
the fire decides on, under this row's lock) and what the last fire did.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from workflows.models import Workflow


class CatchUp(models.TextChoices):
    # A start missed while beat (or every worker) was down: none, or one for all of them.
    SKIP = "skip"
    ONE = "one"


class Schedule(models.Model):
    workflow = models.ForeignKey(Workflow, on_delete=models.CASCADE, related_name="schedules")
    # Pinned version number; null: the latest version when each run starts.
    version = models.PositiveIntegerField(null=True, blank=True)
    # Stored with its secrets (writeOnly fields) replaced by tokens, as a run's input is.
    input = models.JSONField(null=True, blank=True)
    secrets = models.TextField(blank=True, default="", editable=False)
    # Runs are started as this user, who must still be a starter of the workflow at each
    # fire. Null once the user is deleted: each fire then fails, recorded here.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Beat's side: the timing, enabled, last_run_at. Deleting the periodic task (here or on
    # the admin's "Periodic tasks" page) deletes the schedule.
    task = models.OneToOneField(
        PeriodicTask, on_delete=models.CASCADE, related_name="djflow_schedule"
    )
    # The periodic task's timing next_run_at was computed from ("cron:<fields> <tz>" or
    # "every:<ms>"): a fire that finds another (edited on beat's "Periodic tasks" page)
    # counts from the new one, from then.
    timing = models.CharField(max_length=250, blank=True, default="")
    # Null: DJFLOW["SCHEDULE_CATCH_UP"] when the fire happens.
    catch_up = models.CharField(max_length=8, choices=CatchUp.choices, null=True, blank=True)  # noqa: DJ001
    next_run_at = models.DateTimeField()
    # What the fires did: the slot and run of the last start, starts made, slots missed, and
    # the last failure (a start refused: the owner may no longer start it, the input no longer
    # fits the latest version, ...), never cleared by a later success so it stays visible.
    last_slot_at = models.DateTimeField(null=True, blank=True)
    last_run = models.ForeignKey(
        "runs.Run", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    starts = models.PositiveIntegerField(default=0)
    missed = models.PositiveIntegerField(default=0)
    failures = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    last_error_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["-created_at", "-id"], name="schedule_newest"),
            # The sweep's look for overdue slots (schedules.services.schedules_sweep).
            models.Index(fields=["next_run_at"], name="schedule_next_run"),
        ]

    def __str__(self) -> str:
        return f"schedule {self.pk} of {self.workflow_id}"
