"""The schedules API (CONTRACT section 13). Views parse and render; services decide."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.pagination import NewestFirstPagination
from workflows.views import ERRORS

from . import selectors, services
from .serializers import ScheduleCreateSerializer, ScheduleListQuerySerializer, ScheduleSerializer

SCHEDULE_ID = OpenApiParameter(
    "schedule_id", OpenApiTypes.STR, OpenApiParameter.PATH, description="the schedule's id"
)


class SchedulePagination(NewestFirstPagination):
    """Schedules, newest first (config.pagination)."""


class ScheduleListView(APIView):
    pagination_class = SchedulePagination

    @extend_schema(
        operation_id="schedules_list",
        description=(
            "The schedules the caller may see, newest first: their own, and every schedule"
            " of the workflows whose runs they all read (viewers, operators, authors)."
        ),
        parameters=[
            ScheduleListQuerySerializer,
            *SchedulePagination.schema_parameters(),
        ],
        responses={200: ScheduleSerializer(many=True), 400: ERRORS, 401: ERRORS},
    )
    def get(self, request: Request) -> Response:
        query = ScheduleListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        schedules = selectors.schedule_list(**query.validated_data, user=request.user)
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(schedules, request, view=self)
        return paginator.get_paginated_response(ScheduleSerializer(page, many=True).data)

    @extend_schema(
        operation_id="schedules_create",
        request=ScheduleCreateSerializer,
        examples=[
            OpenApiExample(
                "nightly",
                value={
                    "workflow": "support_ticket",
                    "input": {"ticket": "nightly"},
                    "cron": "0 2 * * *",
                },
                request_only=True,
            )
        ],
        description=(
            "Start a workflow on a schedule with a fixed input: `cron` (five fields, minute"
            " first, in CELERY_TIMEZONE) or `every_ms`, exactly one. The caller must be a"
            " starter of the workflow (an unknown or unseen workflow is a 404, one the caller"
            " may only read a 403); its runs are started as the caller. A bad cron, an"
            " `every_ms` below DJFLOW_SCHEDULE_MIN_INTERVAL_MS, an input the version's"
            " input_schema refuses, or a caller who already has DJFLOW_SCHEDULES_PER_WORKFLOW"
            " schedules of the workflow is a 400 naming the field."
        ),
        responses={201: ScheduleSerializer, 400: ERRORS, 401: ERRORS, 403: ERRORS, 404: ERRORS},
    )
    def post(self, request: Request) -> Response:
        body = ScheduleCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        schedule = services.schedule_create(**body.validated_data, user=request.user)
        schedule = selectors.schedule_get(schedule_id=schedule.pk, user=request.user)
        return Response(ScheduleSerializer(schedule).data, status=status.HTTP_201_CREATED)


class ScheduleDetailView(APIView):
    @extend_schema(
        operation_id="schedules_read",
        parameters=[SCHEDULE_ID],
        description="One schedule, with what its fires did (starts, missed slots, failures).",
        responses={200: ScheduleSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, schedule_id: str) -> Response:
        schedule = selectors.schedule_get(schedule_id=schedule_id, user=request.user)
        return Response(ScheduleSerializer(schedule).data)

    @extend_schema(
        operation_id="schedules_delete",
        parameters=[SCHEDULE_ID],
        request=None,
        description=(
            "Delete the schedule (its owner or an operator of the workflow). Runs it started"
            " are kept."
        ),
        responses={204: None, 401: ERRORS, 403: ERRORS, 404: ERRORS},
    )
    def delete(self, request: Request, schedule_id: str) -> Response:
        services.schedule_delete(schedule_id=schedule_id, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)
