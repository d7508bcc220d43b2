"""The runs API (contract section 7). Views parse and render; services and selectors decide."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    PolymorphicProxySerializer,
    extend_schema,
    inline_serializer,
)
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.pagination import ContractCursorPagination, NewestFirstPagination
from workflows import access, secrets
from workflows.errors import FieldError, Forbidden, InvalidInput
from workflows.views import ERRORS

from . import answers, bulk, export, forecasts, forks, selectors, services, trace
from .models import Run
from .serializers import (
    AccountBodySerializer,
    AccountSerializer,
    BulkActionSerializer,
    BulkCancelSerializer,
    BulkResultSerializer,
    BulkRetrySerializer,
    BulkRunsSerializer,
    EventDeliverySerializer,
    EventSerializer,
    ForecastAnswerSerializer,
    ForecastSerializer,
    ForkPreviewSerializer,
    ModelCallDetailSerializer,
    RetryPreviewSerializer,
    RunBudgetSerializer,
    RunForkSerializer,
    RunListQuerySerializer,
    RunListSerializer,
    RunRetrySerializer,
    RunSerializer,
    RunStartSerializer,
    RunTraceSerializer,
    StepResolveSerializer,
    StepRunSerializer,
    has_traceback,
)
from .status import RunStatus

RUN_ID = OpenApiParameter(
    "run_id", OpenApiTypes.STR, OpenApiParameter.PATH, description="the run's id (a UUID)"
)


class RunPagination(NewestFirstPagination):
    """Runs, newest first (config.pagination)."""


class RunForecastView(APIView):
    @extend_schema(
        operation_id="runs_forecast",
        request=ForecastSerializer,
        examples=[
            OpenApiExample(
                "support_ticket",
                value={"workflow": "support_ticket", "input": {"ticket": "Q: where is my parcel?"}},
                request_only=True,
            )
        ],
        description=(
            "What a run of the workflow (its latest version unless `version` pins one) will do"
            " and cost, before it starts: step attempts and cost in USD as min, expected and"
            " max, in total and per step, from the document's bounds (foreach, loop, branches,"
            " retries, subworkflows), its recipes' max_tokens and prices, the input (a known"
            " list bounds its foreach) and the median of the workflow's last completed runs."
            " A null max is named in `unbounded`. Who may start runs of the workflow may ask;"
            " an unknown workflow or version is a 404 naming it."
        ),
        responses={
            200: ForecastAnswerSerializer,
            400: ERRORS,
            401: ERRORS,
            403: ERRORS,
            404: ERRORS,
        },
    )
    def post(self, request: Request) -> Response:
        body = ForecastSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        given = body.validated_data
        result = forecasts.run_forecast(
            workflow=given["workflow"],
            version=given.get("version"),
            input=given.get("input"),
            input_given="input" in given,
            user=request.user,
        )
        return Response(result.as_json())


class RunListView(APIView):
    pagination_class = RunPagination

    @extend_schema(
        operation_id="runs_list",
        description=(
            "Runs, newest first, cursor-paginated. List rows leave out `steps` and `children`"
            " for speed; read one run for its journal and children. An `input` or `output` that"
            " does not fit the answer (DJFLOW_ANSWER_VALUE_BYTES a value, DJFLOW_MAX_ANSWER_BYTES"
            " a page) is null and listed in the row's `truncated` with its link."
        ),
        parameters=[
            RunListQuerySerializer,
            *RunPagination.schema_parameters(),
        ],
        responses={200: RunListSerializer(many=True), 400: ERRORS, 401: ERRORS},
    )
    def get(self, request: Request) -> Response:
        query = RunListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        runs = selectors.run_list(**query.validated_data, user=request.user)
        paginator = self.pagination_class()
        # Read without their values; those that fit the answer are read for the page.
        page = paginator.paginate_queryset(answers.sized(runs, answers.RUN_VALUES), request, self)
        answers.bound(page or [])
        return paginator.get_paginated_response(RunListSerializer(page, many=True).data)

    @extend_schema(
        operation_id="runs_start",
        request=RunStartSerializer,
        examples=[
            OpenApiExample(
                "support_ticket",
                value={
                    "workflow": "support_ticket",
                    "input": {"ticket": "Q: where is my parcel?"},
                    "idempotency_key": "order-55",
                    "correlation": "crm-7781",
                },
                request_only=True,
            )
        ],
        description=(
            "Start a run of a workflow, on its latest version unless `version` pins one. 201 with"
            " the new run; the same `idempotency_key` for the same workflow answers 200 with the"
            " run it started. Input failing the version's `input_schema` is a 400 naming the"
            " field (`input.ticket`); an unknown workflow or version is a 404 naming it."
        ),
        responses={
            201: RunSerializer,
            200: RunSerializer,
            400: ERRORS,
            401: ERRORS,
            403: ERRORS,
            404: ERRORS,
        },
    )
    def post(self, request: Request) -> Response:
        body = RunStartSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        # The first step is planned here while starts come slowly; past the pace a worker
        # plans it and the client waits for the run's insert only (services.StartPacer). A
        # start whose handler no live worker serves is planned here all the same.
        plan_now = services.inline_starts.take()
        result = services.run_start(**body.validated_data, user=request.user, plan_now=plan_now)
        if result.created and not result.planned:
            # Its starter may read it; nothing else has been written for it in this request.
            run = selectors.run_as_started(result.run)
        elif result.created:
            run = selectors.run_as_planned(run_id=result.run.id, user=request.user)
        else:
            run = selectors.run_get(run_id=result.run.id, user=request.user)
        return Response(
            _render(request, run),
            status=status.HTTP_201_CREATED if result.created else status.HTTP_200_OK,
        )


class RunDetailView(APIView):
    @extend_schema(
        operation_id="runs_read",
        parameters=[RUN_ID],
        description="The run with its children and its journal's newest attempts (at most"
        " DJFLOW_ANSWER_STEPS, oldest first; `steps_total` counts them all and"
        " `GET /runs/{id}/steps` pages through the whole journal). A value (the run's input"
        " or output, an attempt's input, output or error) that does not fit the answer"
        " (DJFLOW_ANSWER_VALUE_BYTES a value, DJFLOW_MAX_ANSWER_BYTES in all, oldest first)"
        " is null and listed in its object's `truncated`, with the link that answers it"
        " whole.",
        responses={200: RunSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, run_id: str) -> Response:
        return Response(_render(request, selectors.run_get(run_id=run_id, user=request.user)))


def _value_response(request: Request, run: Run, value: Any, *, field: str) -> Response:
    """One stored value, whole, as the run's readers see it (secrets as ••••, tracebacks
    for its operators only). Every value is at most 1 MiB (MAX_VALUE_BYTES, or a request
    body), so it is answered as one JSON document."""
    hidden = field == "error" and has_traceback(value)
    if hidden and not access.may_see_tracebacks(request.user, run.workflow_id):
        value = {key: shown for key, shown in value.items() if key != "traceback"}
    return Response({"value": secrets.shown(value) if run.secrets else value})


VALUE_ANSWER = {
    "type": "object",
    "properties": {"value": {"description": "the whole value, any JSON"}},
    "required": ["value"],
}


def _run_value_view(field: str) -> type[APIView]:
    """The view of the run's whole ``field`` (input or output): one view per route, so that
    each has an operation of its own in the OpenAPI document (drf-spectacular refuses two
    routes of one view under one operation id, W001)."""

    class RunValueView(APIView):
        @extend_schema(
            operation_id=f"runs_{field}",
            parameters=[RUN_ID],
            description=f"The run's whole {field}, which `GET /runs/{{id}}` and `GET /runs`"
            " leave out (`truncated`) when it does not fit their answer. Whoever may read the"
            " run; 404 otherwise.",
            responses={200: VALUE_ANSWER, 401: ERRORS, 404: ERRORS},
        )
        def get(self, request: Request, run_id: str) -> Response:
            run, value = selectors.value_of(run_id=run_id, field=field, user=request.user)
            return _value_response(request, run, value, field=field)

    RunValueView.__name__ = RunValueView.__qualname__ = f"Run{field.title()}View"
    return RunValueView


RunInputView = _run_value_view("input")
RunOutputView = _run_value_view("output")


class StepValueView(APIView):
    @extend_schema(
        operation_id="runs_step_value",
        parameters=[
            RUN_ID,
            OpenApiParameter(
                "step_run_id", OpenApiTypes.STR, OpenApiParameter.PATH, description="the attempt"
            ),
            OpenApiParameter(
                "field",
                OpenApiTypes.STR,
                OpenApiParameter.PATH,
                enum=["input", "output", "error"],
                description="which of the attempt's values",
            ),
        ],
        description="One attempt's whole input, output or error, which `GET /runs/{id}` leaves"
        " out (`truncated`) when it does not fit the answer. Whoever may read the run (the"
        " error's traceback for its operators only); 404 otherwise, or for an attempt of"
        " another run.",
        responses={200: VALUE_ANSWER, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, run_id: str, step_run_id: str, field: str) -> Response:
        run, value = selectors.value_of(
            run_id=run_id, step_run_id=step_run_id, field=field, user=request.user
        )
        return _value_response(request, run, value, field=field)


class ModelCallView(APIView):
    @extend_schema(
        operation_id="runs_model_call",
        parameters=[RUN_ID],
        description="One model call of the run, with its prompt (system and messages after "
        "templates) and its reply; secrets of the run's input show as ••••.",
        responses={200: ModelCallDetailSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, run_id: str, call_id: int) -> Response:
        call = selectors.model_call_get(run_id=run_id, call_id=call_id, user=request.user)
        data = ModelCallDetailSerializer(call).data
        return Response(secrets.shown(data) if call.run.secrets else data)


def _render(request: Request, run: Run) -> Any:
    """The run as ``request.user`` may see it: tracebacks only for its operators."""
    # Asked only of a journal that holds one: a run just started has none, and its starter's
    # global permissions need not be read for it (access.require_start did not).
    tracebacks = any(
        has_traceback(step.error) for step in run.steps.all()
    ) and access.may_see_tracebacks(request.user, run.workflow_id)
    return RunSerializer(run, context={"tracebacks": tracebacks}).data


class RunActionView(APIView):
    """``POST /runs/{id}/<action>``: one lifecycle service, then the run as it now is."""

    action: Callable[..., Run]

    def post(self, request: Request, run_id: str) -> Response:
        # The service checks, under the run's lock, that the caller may operate it.
        run = self.action(run_id=run_id, user=request.user)
        return Response(_render(request, selectors.run_get(run_id=run.id, user=request.user)))


def _action_schema(name: str, description: str, codes: tuple[int, ...]) -> Any:
    return extend_schema(
        operation_id=f"runs_{name}",
        parameters=[RUN_ID],
        request=None,
        description=description,
        responses={200: RunSerializer, **dict.fromkeys(codes, ERRORS)},
    )


class RunCancelView(RunActionView):
    action = staticmethod(services.run_cancel)

    @extend_schema(
        operation_id="runs_cancel",
        parameters=[RUN_ID],
        request=None,
        description="Cancel the run and its children, transitively. Scheduled and running"
        " attempts are cancelled. 200 when the whole tree below the run ended in the request;"
        " 202 when the run is cancelled and a worker is cancelling the runs below it (more than"
        " DJFLOW_CANCEL_INLINE_RUNS, or busy), in batches. A second cancel of a cancelled run"
        " changes nothing and answers the same way; a run that ended otherwise is a 409.",
        responses={
            200: RunSerializer,
            202: RunSerializer,
            **dict.fromkeys((401, 403, 404, 409), ERRORS),
        },
    )
    def post(self, request: Request, run_id: str) -> Response:
        run = services.run_cancel(run_id=run_id, user=request.user)
        code = 202 if selectors.run_tree_ending(run=run) else 200
        return Response(
            _render(request, selectors.run_get(run_id=run.id, user=request.user)), status=code
        )


class RunPauseView(RunActionView):
    action = staticmethod(services.run_pause)

    @_action_schema(
        "pause",
        "Stop scheduling new steps; attempts already running finish and are recorded."
        " A run that has ended or is already paused is a 409.",
        (401, 403, 404, 409),
    )
    def post(self, request: Request, run_id: str) -> Response:
        return super().post(request, run_id)


class RunResumeView(RunActionView):
    action = staticmethod(services.run_resume)

    @_action_schema(
        "resume",
        f"Resume a {RunStatus.PAUSED} run. A run that is not paused is a 400 or, when it has"
        " ended, a 409.",
        (400, 401, 403, 404, 409),
    )
    def post(self, request: Request, run_id: str) -> Response:
        return super().post(request, run_id)


class RunRetryView(APIView):
    @extend_schema(
        operation_id="runs_retry",
        parameters=[RUN_ID],
        request=RunRetrySerializer,
        examples=[
            OpenApiExample(
                "from_step",
                value={"from_step": "draft", "input": {"ticket": "Q: and now?"}, "dry_run": True},
                request_only=True,
            )
        ],
        description=(
            "Retry the run; a new generation starts and the old attempts stay in the journal."
            " With no body: a failed run from its failed step, keeping what succeeded. With"
            " `from_step`: any ended run (completed, failed, cancelled, timed out) reruns that"
            " top-level step (a step inside a condition, parallel, foreach or loop: its"
            " enclosing top-level step) and every top-level step after it; the steps before it"
            " keep their outputs. `input` replaces the run input (checked against the"
            " version's input_schema; a writeOnly field left out or sent as •••• keeps its"
            " stored value) and templates resolve against it from now on. `dry_run` answers"
            " what would run again, what is kept and what would change, and changes nothing."
            " An unknown `from_step` or a bad `input` is a 400 naming it; a run in another"
            " status, or a child run, is a 409."
        ),
        responses={
            200: PolymorphicProxySerializer(
                component_name="RetryResult",
                serializers=[RunSerializer, RetryPreviewSerializer],
                resource_type_field_name=None,
            ),
            **dict.fromkeys((400, 401, 403, 404, 409), ERRORS),
        },
    )
    def post(self, request: Request, run_id: str) -> Response:
        body = RunRetrySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        # The service checks, under the run's lock, that the caller may operate it.
        result = services.run_retry(run_id=run_id, user=request.user, **body.validated_data)
        if isinstance(result, services.RetryPreview):
            return Response({"dry_run": True, **dataclasses.asdict(result)})
        return Response(_render(request, selectors.run_get(run_id=result.id, user=request.user)))


class RunForkView(APIView):
    @extend_schema(
        operation_id="runs_fork",
        parameters=[RUN_ID],
        request=RunForkSerializer,
        examples=[
            OpenApiExample(
                "from_step",
                value={"from_step": "draft", "recipes": {"draft_reply": 3}},
                request_only=True,
            )
        ],
        description=(
            "Start a new run from an ended top-level run (`forked_from` names it): as `POST"
            " /runs` starts one (the caller must read the run and start its workflow), on the"
            " run's version unless `document` names another saved version, on the run's input"
            " unless `input` gives one. With `from_step` the top-level steps before it that"
            " settled are taken from the run, outputs included, and do not run again;"
            " `recipes` pins saved recipe versions by name for every recipe step. 201 with the"
            " new run; `dry_run` answers 200 with what would be reused and run, and starts"
            " nothing. A run that has not ended, or a child run, is a 409; a bad field a 400"
            " naming it. To compare the fork with its source: /runs/{a}/compare/{b}."
        ),
        responses={
            201: RunSerializer,
            200: ForkPreviewSerializer,
            **dict.fromkeys((400, 401, 403, 404, 409), ERRORS),
        },
    )
    def post(self, request: Request, run_id: str) -> Response:
        body = RunForkSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        result = forks.run_fork(run_id=run_id, user=request.user, **body.validated_data)
        if isinstance(result, forks.ForkPreview):
            return Response({"dry_run": True, **dataclasses.asdict(result)})
        run = selectors.run_get(run_id=result.id, user=request.user)
        return Response(_render(request, run), status=status.HTTP_201_CREATED)


class StepResolveView(APIView):
    @extend_schema(
        operation_id="runs_step_resolve",
        parameters=[
            RUN_ID,
            OpenApiParameter(
                "step_run_id",
                OpenApiTypes.INT,
                OpenApiParameter.PATH,
                description="the in_doubt attempt's id (a step run of the run)",
            ),
        ],
        request=StepResolveSerializer,
        examples=[
            OpenApiExample(
                "succeeded",
                value={"outcome": "succeeded", "output": {"sent": True}},
                request_only=True,
            ),
            OpenApiExample("failed", value={"outcome": "failed"}, request_only=True),
        ],
        description=(
            "Resolve an `in_doubt` attempt: an at_most_once attempt whose worker was lost after"
            " it started, so it may or may not have had its effect. Check the attempt's"
            " `idempotency_key` with the third party first. `succeeded` with an `output`: the"
            " run goes on as if the attempt had succeeded with it. `failed`: the step fails"
            " (class `in_doubt`, never retried) and its `on_error` applies. For the workflow's"
            " operators (403 for its viewers); recorded on the run. An attempt that is not in"
            " doubt is a 409."
        ),
        responses={200: RunSerializer, **dict.fromkeys((400, 401, 403, 404, 409), ERRORS)},
    )
    def post(self, request: Request, run_id: str, step_run_id: str) -> Response:
        body = StepResolveSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        # The service checks, under the run's lock, that the caller may operate it.
        run = services.step_run_resolve(
            run_id=run_id, step_run_id=step_run_id, user=request.user, **body.validated_data
        )
        return Response(_render(request, selectors.run_get(run_id=run.id, user=request.user)))


class JournalPagination(ContractCursorPagination):
    """A run's attempts, oldest first (by id, the order they were written); a cursor whose
    position is not an id is a bad cursor (400 naming it), not a database error."""

    ordering = ("id",)
    max_page_size = 1000

    def decode_cursor(self, request: Any) -> Any:
        cursor = super().decode_cursor(request)
        position = cursor.position if cursor is not None else None
        if position is not None and not (
            position.isascii() and position.isdigit() and len(position) <= 18
        ):
            raise InvalidInput(errors=[FieldError("cursor", "is not a cursor this API gave out")])
        return cursor


class RunStepsView(APIView):
    pagination_class = JournalPagination

    @extend_schema(
        operation_id="runs_steps",
        parameters=[RUN_ID, *JournalPagination.schema_parameters()],
        description="The run's whole journal, every attempt of every step, oldest first,"
        " cursor-paginated (`limit` 1 to 1,000, 50 by default): what `GET /runs/{id}` embeds"
        " the newest DJFLOW_ANSWER_STEPS of. A value that does not fit the page's answer is"
        " null and listed in its attempt's `truncated` with its link, as there. Whoever may"
        " read the run (tracebacks for its operators); 404 otherwise.",
        responses={200: StepRunSerializer(many=True), 400: ERRORS, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, run_id: str) -> Response:
        run = selectors.run_readable(run_id=run_id, user=request.user)
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(selectors.journal_page(run), request, self) or []
        answers.bound([], page)
        tracebacks = any(has_traceback(step.error) for step in page) and access.may_see_tracebacks(
            request.user, run.workflow_id
        )
        data = StepRunSerializer(page, many=True, context={"tracebacks": tracebacks}).data
        return paginator.get_paginated_response(secrets.shown(data) if run.secrets else data)


EXPORT_ANSWER = {
    "type": "object",
    "description": "the run export, format djflow-run-export (docs/reference/run-export.md)",
    "properties": {
        "format": {"type": "string", "enum": [export.FORMAT]},
        "format_version": {"type": "integer", "enum": [export.FORMAT_VERSION]},
        "server_version": {"type": "string", "nullable": True},
        "exported_at": {"type": "string", "format": "date-time"},
        "run": {"type": "object", "description": "the run, its attempts and its children"},
        "documents": {"type": "array", "items": {"type": "object"}},
        "recipes": {"type": "array", "items": {"type": "object"}},
    },
    "required": [
        "format",
        "format_version",
        "server_version",
        "exported_at",
        "run",
        "documents",
        "recipes",
    ],
}


class RunExportView(APIView):
    @extend_schema(
        operation_id="runs_export",
        parameters=[RUN_ID],
        description="The run as one self-contained JSON file (format `djflow-run-export`,"
        " `format_version` 1): the run, its children recursively (those the caller may"
        " read), every attempt of each with its model calls' prompts and replies and its"
        " tool calls' arguments and results, the document versions and the recipes used."
        " What `manage.py run_replay` reads. Secrets show as ••••; tracebacks for the"
        " workflow's operators only. Streamed, never read whole into memory. Whoever may"
        " read the run; 404 otherwise.",
        responses={200: EXPORT_ANSWER, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, run_id: str) -> StreamingHttpResponse:
        found = export.run_export(run_id=run_id, user=request.user)
        response = StreamingHttpResponse(found.chunks(), content_type="application/json")
        response["Content-Disposition"] = f'attachment; filename="run-{found.run_id}.json"'
        return response


class RunTraceView(APIView):
    @extend_schema(
        operation_id="runs_trace",
        parameters=[RUN_ID],
        description=(
            "The run as a tree of spans: the run, a span per step (per path inside parallel,"
            " foreach and loop), per attempt, the handler's own spans, its model calls (with"
            " the GenAI attributes, usage and cost) and tool calls; child runs nest under the"
            " attempt of the step that started them, recursively. A child run of a workflow"
            " the caller may not read is left out. Ids are stable. At most 5,000 spans and 16"
            " levels of child runs: past that, `truncated` says why and a span of kind"
            " `truncated` marks it. Secrets show as ••••."
        ),
        responses={200: RunTraceSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, run_id: str) -> Response:
        return Response(trace.run_trace(run_id=run_id, user=request.user))


class EventView(APIView):
    @extend_schema(
        operation_id="events_deliver",
        request=EventSerializer,
        examples=[
            OpenApiExample(
                "approved",
                value={"name": "approved", "key": "Q: where is my parcel?", "payload": {"ok": 1}},
                request_only=True,
            )
        ],
        description=(
            "Deliver an event. It is stored, and every run waiting (`wait_event`) on this name"
            " and key takes it; a run that reaches such a wait later takes the oldest event it"
            " has not taken that arrived after the run started. `matched` is how many waits it"
            " resumed now."
        ),
        responses={200: EventDeliverySerializer, 400: ERRORS, 401: ERRORS, 403: ERRORS},
    )
    def post(self, request: Request) -> Response:
        body = EventSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        event, matched = services.event_send(**body.validated_data, user=request.user)
        return Response({"id": event.id, "matched": matched})


class BulkActionView(APIView):
    """``POST /runs/cancel`` and ``POST /runs/retry``: the list's filters in the body."""

    action: str
    body: type[BulkRunsSerializer]

    @property
    def allowed_methods(self) -> list[str]:
        # GET (and HEAD) read a run of this name (below), never this route's resource: the
        # Allow header of OPTIONS and of a 405 lists POST, as the OpenAPI document does.
        return [m for m in super().allowed_methods if m not in ("GET", "HEAD")]

    @extend_schema(exclude=True)
    def get(self, request: Request) -> Response:
        """``GET /runs/cancel`` is ``GET /runs/{id}`` of a run named "cancel", as the document
        says: the 404 of an unknown run, not this route's 405 (schemathesis drew it)."""
        name = request.path_info.rstrip("/").rsplit("/", 1)[-1]
        return Response(_render(request, selectors.run_get(run_id=name, user=request.user)))

    def post(self, request: Request) -> Response:
        body = self.body(data=request.data)
        body.is_valid(raise_exception=True)
        filters = dict(body.validated_data)
        dry_run = filters.pop("dry_run")
        started = bulk.bulk_action_start(
            action=self.action, user=request.user, dry_run=dry_run, **filters
        )
        action = started.action
        return Response(
            {
                "affected": started.affected,
                "id": action.id if action is not None else None,
                "dry_run": dry_run,
            },
            status=status.HTTP_202_ACCEPTED if action is not None else status.HTTP_200_OK,
        )


_BULK_FILTERS = (
    " Takes the filters of `GET /runs` (`workflow`, `status`, `account`, `created_after`,"
    " `created_before`) in a JSON body, at least one of them: a body naming none is a 400."
    " `affected` is how many runs they match that the caller may operate and that the"
    " action applies to, counted now; runs created after the request are never touched. A"
    " worker does the work in batches of `DJFLOW_BULK_BATCH` runs (202 with the action's"
    " `id`); each run is recorded in its actions as the caller's, with the bulk action's"
    " id. `dry_run: true` answers the count and does nothing (200)."
)


def _bulk_schema(name: str, body: type[BulkRunsSerializer], description: str) -> Any:
    return extend_schema(
        operation_id=f"runs_bulk_{name}",
        request=body,
        examples=[
            OpenApiExample(
                name,
                value={"workflow": "support_ticket", "status": "failed", "dry_run": True},
                request_only=True,
            )
        ],
        description=description + _BULK_FILTERS,
        responses={
            202: BulkResultSerializer,
            200: BulkResultSerializer,
            **dict.fromkeys((400, 401), ERRORS),
        },
    )


class BulkCancelView(BulkActionView):
    action = bulk.CANCEL
    body = BulkCancelSerializer

    @_bulk_schema(
        "cancel",
        BulkCancelSerializer,
        "Cancel every matching run that has not ended (its children too), as"
        " `POST /runs/{id}/cancel` does one. A `status` that has ended is a 400.",
    )
    def post(self, request: Request) -> Response:
        return super().post(request)


class BulkRetryView(BulkActionView):
    action = bulk.RETRY
    body = BulkRetrySerializer

    @_bulk_schema(
        "retry",
        BulkRetrySerializer,
        "Retry every matching failed top-level run from its failed step, as"
        " `POST /runs/{id}/retry` with no body does one (a failed child run is retried with"
        " its parent). A `status` other than failed is a 400.",
    )
    def post(self, request: Request) -> Response:
        return super().post(request)


class BulkActionDetailView(APIView):
    @extend_schema(
        operation_id="runs_bulk_read",
        parameters=[
            OpenApiParameter(
                "bulk_id", OpenApiTypes.STR, OpenApiParameter.PATH, description="its id (a UUID)"
            )
        ],
        description=(
            "A bulk cancel or retry and how far its batches have got: `done` runs cancelled or"
            " retried, `skipped` counted but passed over (ended, retried, or no longer the"
            " caller's to operate by the time their batch came), `finished_at` once the last"
            " batch is done. Only its requester sees it (404 for anyone else)."
        ),
        responses={200: BulkActionSerializer, 401: ERRORS, 404: ERRORS},
    )
    def get(self, request: Request, bulk_id: str) -> Response:
        found = bulk.bulk_action_get(bulk_id=bulk_id, user=request.user)
        return Response(BulkActionSerializer(found).data)


class RunBudgetView(APIView):
    @extend_schema(
        operation_id="runs_budget",
        parameters=[RUN_ID],
        request=RunBudgetSerializer,
        description=(
            "Raise the run's `limits.max_cost_usd` by `add_usd` (CONTRACT section 17): the"
            " attempts waiting for that limit (the run shows `budget_exceeded`) are offered"
            " again, and wait again should it still not be enough. For the run's operators"
            " (403 for its viewers); recorded on the run. A run without a limit of its own, or"
            " that has ended, is a 409."
        ),
        responses={200: RunSerializer, **dict.fromkeys((400, 401, 403, 404, 409), ERRORS)},
    )
    def post(self, request: Request, run_id: str) -> Response:
        body = RunBudgetSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        # The service checks, under the run's lock, that the caller may operate it.
        run = services.run_budget_add(
            run_id=run_id, add_usd=body.validated_data["add_usd"], user=request.user
        )
        return Response(_render(request, selectors.run_get(run_id=run.id, user=request.user)))


# An account is a run's `account` (POST /runs) or its starter's username: the same letters.
ACCOUNT_PATTERN = r"^[A-Za-z0-9_.@+-]{1,150}$"
ACCOUNT_NAME = OpenApiParameter(
    "name",
    OpenApiTypes.STR,
    OpenApiParameter.PATH,
    description="the account (Run.account): letters, digits and _ . @ + -, at most 150",
    pattern=ACCOUNT_PATTERN,
)


def _require_accounts(user: Any, *, write: bool) -> None:
    """Reading accounts: superusers and holders of ``runs.view_account`` or
    ``runs.change_account``; writing: ``runs.change_account`` (403 otherwise)."""
    wanted = ["runs.change_account"] if write else ["runs.view_account", "runs.change_account"]
    if not any(user.has_perm(name) for name in wanted):
        raise Forbidden(
            errors=[FieldError("account", f"needs the permission {' or '.join(wanted)}")]
        )


def _account_name(name: str) -> str:
    if not re.fullmatch(ACCOUNT_PATTERN[1:-1], name):
        raise InvalidInput(
            errors=[
                FieldError(
                    "name",
                    "is not an account name (1 to 150 letters, digits and _ . @ + -)",
                )
            ]
        )
    return name


class AccountListView(APIView):
    @extend_schema(
        operation_id="accounts_list",
        description=(
            "The accounts given a budget, with what their runs' model calls spent in the"
            " current period and hold for calls in flight. For superusers and holders of"
            " `runs.view_account` or `runs.change_account`."
        ),
        responses={
            200: inline_serializer("AccountList", {"results": AccountSerializer(many=True)}),
            **dict.fromkeys((401, 403), ERRORS),
        },
    )
    def get(self, request: Request) -> Response:
        _require_accounts(request.user, write=False)
        rows = selectors.accounts_list()
        return Response({"results": AccountSerializer(rows, many=True).data})


class AccountDetailView(APIView):
    @extend_schema(
        operation_id="accounts_get",
        parameters=[ACCOUNT_NAME],
        description="An account's budget and spend (an account never given one: no budget,"
        " what its runs cost in total).",
        responses={200: AccountSerializer, **dict.fromkeys((400, 401, 403), ERRORS)},
    )
    def get(self, request: Request, name: str) -> Response:
        _require_accounts(request.user, write=False)
        return Response(AccountSerializer(selectors.account_get(name=_account_name(name))).data)

    @extend_schema(
        operation_id="accounts_put",
        parameters=[ACCOUNT_NAME],
        request=AccountBodySerializer,
        description=(
            "Set the account's `budget_usd` and `period` (day or month, UTC boundaries; null:"
            " in total). Its runs waiting for its budget are offered again (those that still"
            " do not fit wait again). For holders of `runs.change_account`."
        ),
        responses={200: AccountSerializer, **dict.fromkeys((400, 401, 403), ERRORS)},
    )
    def put(self, request: Request, name: str) -> Response:
        _require_accounts(request.user, write=True)
        body = AccountBodySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        account = services.account_save(
            name=_account_name(name), user=request.user, **body.validated_data
        )
        return Response(AccountSerializer(account).data)
