"""The schedule resource (CONTRACT section 13): ``{id, workflow, version?, input, cron |
every_ms, enabled, next_run_at}`` and what its fires did."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from runs.serializers import (
    MAX_VERSION,
    QuerySerializer,
    StrictBodySerializer,
    StrictBooleanField,
    StrictCharField,
    StrictIntegerField,
)

from . import services
from .clock import CATCH_UP
from .models import Schedule


class ScheduleCreateSerializer(StrictBodySerializer):
    """The body of ``POST /schedules``. Unknown fields are refused, each named."""

    workflow = StrictCharField(max_length=100, trim_whitespace=False, help_text="the workflow's id")
    version = StrictIntegerField(
        min_value=1,
        max_value=MAX_VERSION,
        required=False,
        allow_null=True,
        help_text="the version to pin; each run starts the latest when omitted",
    )
    input = serializers.JSONField(
        default=None, allow_null=True, help_text="the input of every run; checked at creation"
    )
    cron = StrictCharField(
        max_length=200,
        required=False,
        allow_null=True,
        help_text="five fields: minute hour day-of-month month day-of-week (CELERY_TIMEZONE)",
    )
    every_ms = StrictIntegerField(
        required=False,
        allow_null=True,
        help_text="the interval in milliseconds; at least DJFLOW_SCHEDULE_MIN_INTERVAL_MS",
    )
    # A JSON boolean: DRF's BooleanField took 0, "no" and "off" as false.
    enabled = StrictBooleanField(default=True)
    catch_up = serializers.ChoiceField(
        choices=CATCH_UP,
        required=False,
        allow_null=True,
        help_text="slots missed while beat was down: one start for all (one) or none (skip);"
        " DJFLOW_SCHEDULE_CATCH_UP when omitted",
    )

    @classmethod
    def body_schema(cls) -> dict[str, Any]:
        # schedules.services: exactly one of cron and every_ms (a null one is not given),
        # every_ms within [DJFLOW_SCHEDULE_MIN_INTERVAL_MS, a year].
        every = {
            "type": "integer",
            "minimum": int(settings.DJFLOW["SCHEDULE_MIN_INTERVAL_MS"]),
            "maximum": services.MAX_EVERY_MS,
        }
        return {
            "properties": {"every_ms": {**every, "nullable": True}},
            "oneOf": [
                {"required": ["cron"], "properties": {"cron": {"type": "string"}}},
                {"required": ["every_ms"], "properties": {"every_ms": every}},
            ],
        }


class ScheduleSerializer(serializers.ModelSerializer[Schedule]):
    workflow = serializers.CharField(source="workflow_id")
    input = serializers.SerializerMethodField()
    cron = serializers.SerializerMethodField()
    every_ms = serializers.SerializerMethodField()
    enabled = serializers.BooleanField(source="task.enabled")
    catch_up = serializers.SerializerMethodField()
    owner = serializers.SerializerMethodField()
    last_run = serializers.UUIDField(source="last_run_id", allow_null=True)

    class Meta:
        model = Schedule
        fields = [
            "id",
            "workflow",
            "version",
            "input",
            "cron",
            "every_ms",
            "enabled",
            "next_run_at",
            "catch_up",
            "owner",
            "created_at",
            "last_slot_at",
            "last_run",
            "starts",
            "missed",
            "failures",
            "last_error",
            "last_error_at",
        ]

    @extend_schema_field(OpenApiTypes.ANY)
    def get_input(self, schedule: Schedule) -> Any:
        return services.shown_input(schedule)

    def get_cron(self, schedule: Schedule) -> str | None:
        return services.cron_of(schedule.task)

    def get_every_ms(self, schedule: Schedule) -> int | None:
        every = services.every_of(schedule.task)
        return None if every is None else round(every.total_seconds() * 1000)

    def get_catch_up(self, schedule: Schedule) -> str:
        return services.catch_up_of(schedule)

    def get_owner(self, schedule: Schedule) -> str | None:
        return schedule.owner.get_username() if schedule.owner is not None else None


class ScheduleListQuerySerializer(QuerySerializer):
    workflow = StrictCharField(max_length=100, required=False)
