"""Shapes of runs in the API (contract section 7).

The input serializers check only the shape of a request (types, lengths, unknown fields); what
a value means (does the workflow exist, does the input fit its schema) is for the services.
The output serializers render rows as they are stored and decide nothing, except that a
secret's token (what a writeOnly input field is stored as) is shown as ``••••``.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.validators import RegexValidator
from django.db.models import Q
from django.urls import reverse
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from config.openapi import MERGED_LATER
from workflows import secrets
from workflows.templates import encoded_size

from . import answers, bulk
from .engine import contents, slots, unservable
from .models import BulkAction, ModelCall, Run, RunAction, StepRun, ToolCall
from .selectors import RUN_LIST_FILTERS, SHOWN_ACTIONS
from .status import RunStatus, StepStatus

MAX_VERSION = 2_147_483_647  # the largest number a version column holds


# --- input ----------------------------------------------------------------------------------


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer, not a numeric string, a boolean or a float."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictCharField(serializers.CharField):
    """A JSON string, not a number turned into one."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """A JSON boolean, not "true", 1 or "yes"."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictBodySerializer(serializers.Serializer):
    """A request body that must be a JSON object with no field but the declared ones; each
    unknown field is named ("is not a field of <body_name>")."""

    body_name = "this request"

    @classmethod
    def body_schema(cls) -> dict[str, Any]:
        """What the OpenAPI document adds to the fields' schema (:class:`StrictBodySchema`):
        ``properties`` replacing some, ``oneOf`` or ``anyOf`` over them."""
        return {}

    def run_validation(self, data: Any = serializers.empty) -> Any:
        # Before DRF's own checks, which answer a null body without naming anything.
        if not isinstance(data, Mapping):
            shown = "null" if data is None or data is serializers.empty else type(data).__name__
            raise serializers.ValidationError({"body": [f"must be a JSON object, not {shown}"]})
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {name: [f"is not a field of {self.body_name}"] for name in unknown}
            )
        return super().run_validation(data)


class StrictBodySchema(OpenApiSerializerExtension):
    """What the OpenAPI document says of every :class:`StrictBodySerializer`: no property but
    the declared ones (``additionalProperties: false``), as the serializer refuses any other;
    a client generated from the schema then sends none. A subclass's ``body_schema()`` adds to
    it (``oneOf``, ``anyOf``: what its ``validate`` requires of its fields together), merged
    by ``config.openapi`` after drf-spectacular has named the enums (which would otherwise
    fold a one-value enum of a ``oneOf`` into the field's own)."""

    target_class = "runs.serializers.StrictBodySerializer"
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        more = self.target.body_schema()
        return {**schema, **({MERGED_LATER: more} if more else {}), "additionalProperties": False}


class RunStartSerializer(StrictBodySerializer):
    """The body of ``POST /runs``. Unknown fields are refused, each named."""

    workflow = StrictCharField(max_length=100, trim_whitespace=False, help_text="the workflow's id")
    version = StrictIntegerField(
        min_value=1,
        max_value=MAX_VERSION,
        required=False,
        allow_null=True,
        help_text="the version to pin; the latest when omitted",
    )
    input = serializers.JSONField(
        default=None,
        allow_null=True,
        help_text="any JSON; checked against the version's input_schema",
    )
    idempotency_key = StrictCharField(
        max_length=255,
        required=False,
        allow_null=True,
        trim_whitespace=False,
        help_text="the same key for the same workflow returns the run it started (200)",
    )
    correlation = StrictCharField(
        max_length=255, required=False, allow_null=True, trim_whitespace=False
    )
    account = StrictCharField(
        max_length=150,
        validators=[RegexValidator(r"^[A-Za-z0-9_.@+-]+\Z", "letters, digits and _ . @ + - only")],
        required=False,
        allow_null=True,
        help_text="who the run's model calls count against (DJFLOW_MODEL_CONCURRENCY per "
        "account); default: the starter's username",
    )
    priority = StrictIntegerField(
        min_value=0,
        max_value=9,
        required=False,
        allow_null=True,
        help_text="0 (lowest) to 9 (highest), default 5: the broker's priority for the run's "
        "messages, and which run waiting for a concurrency slot of its key starts first",
    )

    body_name = "a run start"


class EventSerializer(StrictBodySerializer):
    """The body of ``POST /events``. Unknown fields are refused, each named."""

    name = StrictCharField(max_length=200, trim_whitespace=False, help_text="the event's name")
    key = StrictCharField(
        max_length=500,
        allow_blank=True,
        trim_whitespace=False,
        help_text='matched against each wait_event\'s resolved `key` (text; 42 is sent as "42")',
    )
    payload = serializers.JSONField(
        default=None, allow_null=True, help_text="any JSON: the output of the waits it resumes"
    )

    body_name = "an event"


class EventDeliverySerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="the stored event's id")
    matched = serializers.IntegerField(help_text="how many waits the event resumed")


class QuerySerializer(serializers.Serializer):
    """Query parameters: an empty one (``?workflow=``) is a 400 naming it, as the OpenAPI
    document's ``minLength: 1`` (or enum) says; DRF would read it as left out, and a client
    that meant a value would get every row."""

    def run_validation(self, data: Any = serializers.empty) -> Any:
        if isinstance(data, Mapping):
            empty = [name for name in self.fields if data.get(name) == ""]
            if empty:
                raise serializers.ValidationError(
                    {name: ["must not be empty; leave the parameter out"] for name in empty}
                )
        return super().run_validation(data)


class RunListQuerySerializer(QuerySerializer):
    """The filters of ``GET /runs``, and of the bulk actions (``POST /runs/cancel``,
    ``/runs/retry``), which act on the runs the list would show: the keywords of
    ``selectors.run_list``."""

    # Strict: the bulk actions read them from JSON, where 0 is not the text "0".
    workflow = StrictCharField(max_length=100, required=False, trim_whitespace=False)
    status = serializers.ChoiceField(choices=RunStatus.choices, required=False)
    account = StrictCharField(
        max_length=150, required=False, trim_whitespace=False, help_text="the run's account"
    )
    created_after = serializers.DateTimeField(
        required=False, help_text="runs created at or after this instant (ISO 8601)"
    )
    created_before = serializers.DateTimeField(
        required=False,
        help_text="runs created before this instant (ISO 8601); with created_after, later than "
        "it (a swapped range matches no run: a 400 naming created_before)",
    )

    FILTERS = RUN_LIST_FILTERS

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        after, before = attrs.get("created_after"), attrs.get("created_before")
        if after is not None and before is not None and after >= before:
            raise serializers.ValidationError(
                {"created_before": ["must be later than created_after"]}
            )
        return attrs


class BulkRunsSerializer(StrictBodySerializer, RunListQuerySerializer):
    """The body of ``POST /runs/cancel`` and ``POST /runs/retry``: the list's filters (at
    least one: the service refuses a body that names none) and ``dry_run``."""

    dry_run = StrictBooleanField(
        default=False, help_text="answer how many runs would be affected, and do nothing"
    )

    body_name = "a bulk action"
    # The statuses the action applies to (runs.bulk.APPLIES_TO, which refuses the others
    # with a 400 naming status); every status in the shared serializer.
    statuses: tuple[str, ...] = tuple(RunStatus.values)

    @classmethod
    def body_schema(cls) -> dict[str, Any]:
        # runs.bulk refuses a body that names no filter: "every run" is never meant.
        return {
            "anyOf": [{"required": [name]} for name in cls.FILTERS],
            "properties": {"status": {"type": "string", "enum": list(cls.statuses)}},
        }


class BulkCancelSerializer(BulkRunsSerializer):
    statuses = tuple(str(s) for s in bulk.APPLIES_TO[bulk.CANCEL])


class BulkRetrySerializer(BulkRunsSerializer):
    statuses = tuple(str(s) for s in bulk.APPLIES_TO[bulk.RETRY])


class BulkActionSerializer(serializers.ModelSerializer):
    """A bulk action and how far its batches have got."""

    requested_by = serializers.CharField(source="requested_by_name", read_only=True)

    class Meta:
        model = BulkAction
        fields = [
            "id",
            "action",
            "filters",
            "requested_by",
            "requested_at",
            "affected",
            "done",
            "skipped",
            "batches",
            "finished_at",
        ]
        read_only_fields = fields


class BulkResultSerializer(serializers.Serializer):
    affected = serializers.IntegerField(
        help_text="the runs matched that the caller may operate and the action applies to, "
        "counted when the request was made"
    )
    id = serializers.UUIDField(
        allow_null=True, help_text="the bulk action's id (null for a dry run or none affected)"
    )
    dry_run = serializers.BooleanField()


# --- output ---------------------------------------------------------------------------------

RUN_ERROR_SCHEMA = {
    "type": "object",
    "nullable": True,
    "description": "null, or why the run failed, timed out or was cancelled",
    "properties": {
        "class": {"type": "string"},
        "message": {"type": "string"},
        "step": {"type": "string", "nullable": True},
        "on_failure": {
            "type": "object",
            "description": "when the document's on_failure steps failed too: their error "
            "(class, message, step); the run's own error stays the original one",
            "properties": {
                "class": {"type": "string"},
                "message": {"type": "string"},
                "step": {"type": "string", "nullable": True},
            },
        },
    },
    "required": ["class", "message", "step"],
}

STEP_ERROR_SCHEMA = {
    "type": "object",
    "nullable": True,
    "description": "null, or why this attempt failed: class, message and, if any, traceback",
    "properties": {
        "class": {"type": "string"},
        "message": {"type": "string"},
        "traceback": {"type": "string"},
    },
}

PARENT_SCHEMA = {
    "type": "object",
    "nullable": True,
    "description": "null, or the run and the subworkflow step that started this run",
    "properties": {
        "run": {"type": "string", "format": "uuid"},
        "step": {"type": "string", "nullable": True},
    },
    "required": ["run", "step"],
}


CONTENT_SCHEMA = {
    "type": "object",
    "nullable": True,
    "description": "stored once by the SHA-256 of its JSON (digest): a prompt's system and "
    "messages after templates, a reply's text",
    "properties": {
        "digest": {"type": "string"},
        "size": {"type": "integer"},
        "system": {"type": "string", "nullable": True},
        "messages": {"type": "array", "items": {"type": "object"}},
        "text": {"type": "string"},
    },
}

CALL_FIELDS = [
    "id",
    "url",
    "provider",
    "model",
    "answered_by",
    "recipe",
    "recipe_version",
    "retrieved",
    "status",
    "error",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "latency_ms",
    "cost_usd",
    "reserved_usd",
    "request_id",
    "created_at",
    "prompt_digest",
    "prompt_size",
    "reply_digest",
    "reply_size",
]


class ModelCallSerializer(serializers.ModelSerializer):
    """One model call of an attempt (CONTRACT section 10), as its run lists it: what it cost
    and where its prompt and reply are (``url``), not their texts, so a run of many long
    calls stays a bounded response."""

    url = serializers.SerializerMethodField(help_text="the call with its prompt and reply")
    cost_usd = serializers.FloatField(read_only=True, allow_null=True)
    reserved_usd = serializers.FloatField(read_only=True)
    prompt_digest = serializers.CharField(source="prompt_id", read_only=True)
    reply_digest = serializers.CharField(source="reply_id", read_only=True, allow_null=True)
    prompt_size = serializers.IntegerField(read_only=True)
    reply_size = serializers.IntegerField(read_only=True, allow_null=True)
    retrieved = serializers.JSONField(
        read_only=True,
        allow_null=True,
        help_text="what the recipe's context retrieved into the prompt: {kb, query, hits: "
        "[{key, version, score}]}; null without a context",
    )

    class Meta:
        model = ModelCall
        fields = CALL_FIELDS
        read_only_fields = fields

    def get_url(self, call: ModelCall) -> str:
        return reverse("run-call", args=[str(call.run_id), call.id])


class ModelCallDetailSerializer(ModelCallSerializer):
    """``GET /runs/{id}/calls/{call}``: the call with its prompt and reply."""

    prompt = serializers.SerializerMethodField()
    reply = serializers.SerializerMethodField()

    class Meta:
        model = ModelCall
        fields = [*CALL_FIELDS, "prompt", "reply"]
        read_only_fields = fields

    @extend_schema_field(CONTENT_SCHEMA)
    def get_prompt(self, call: ModelCall) -> dict[str, Any] | None:
        return _content(call.prompt)

    @extend_schema_field(CONTENT_SCHEMA)
    def get_reply(self, call: ModelCall) -> dict[str, Any] | None:
        return _content(call.reply)


class ToolCallSerializer(serializers.ModelSerializer):
    """One MCP tool call of an attempt (CONTRACT section 10, "MCP tools"), as its run lists
    it: where its arguments and result are stored and how big they are, not their bodies
    (the attempt's ``input`` is the call as made and its ``output`` the tool's answer)."""

    arguments_digest = serializers.CharField(source="arguments_id", read_only=True)
    arguments_size = serializers.IntegerField(read_only=True)
    result_digest = serializers.CharField(source="result_id", read_only=True, allow_null=True)
    result_size = serializers.IntegerField(read_only=True, allow_null=True)

    class Meta:
        model = ToolCall
        fields = [
            "id",
            "server",
            "tool",
            "status",
            "error",
            "latency_ms",
            "created_at",
            "arguments_digest",
            "arguments_size",
            "result_digest",
            "result_size",
        ]
        read_only_fields = fields


def _content(content: Any) -> dict[str, Any] | None:
    if content is None:
        return None
    # A prompt stored in parts answers whole (runs.engine.contents).
    whole = contents.body(content)
    body = whole if isinstance(whole, dict) else {"value": whole}
    return {"digest": content.digest, "size": content.size, **body}


def has_traceback(error: Any) -> bool:
    """Whether a step's error shows a traceback (an operator's to read, CONTRACT section 8).
    The engine writes errors as objects; anything else has none to hide."""
    return isinstance(error, dict) and "traceback" in error


# An object's values left out of an answer (runs.answers): {field: {"bytes", "url"}} or null.
TRUNCATED_SCHEMA = {
    "type": "object",
    "nullable": True,
    "description": "the values shown as null because they did not fit the answer "
    "(DJFLOW_ANSWER_VALUE_BYTES a value, DJFLOW_MAX_ANSWER_BYTES an answer): each one's "
    "size as JSON text and the link that answers it whole",
    "additionalProperties": {
        "type": "object",
        "properties": {
            "bytes": {"type": "integer"},
            "url": {"type": "string", "format": "uri"},
        },
        "required": ["bytes", "url"],
    },
}


def api_url(name: str, *args: Any) -> str:
    """An API address on SITE_URL (as ``inspect_url``): the same whoever asks."""
    return f"{settings.SITE_URL.rstrip('/')}{reverse(name, args=args)}"


class StepRunSerializer(serializers.ModelSerializer):
    """One attempt of one step."""

    cost_usd = serializers.FloatField(read_only=True)
    input = serializers.JSONField(read_only=True, allow_null=True)
    output = serializers.JSONField(read_only=True, allow_null=True)
    usage = serializers.JSONField(read_only=True)
    error = serializers.SerializerMethodField()
    model_calls = ModelCallSerializer(many=True, read_only=True)
    tool_calls = ToolCallSerializer(many=True, read_only=True)
    truncated = serializers.SerializerMethodField()

    class Meta:
        model = StepRun
        fields = [
            "id",
            "step_id",
            "path",
            "kind",
            "attempt",
            "generation",
            "status",
            "effect",
            "branch",
            "input",
            "output",
            "error",
            "worker",
            "scheduled_at",
            "started_at",
            "finished_at",
            "usage",
            "cost_usd",
            "model_calls",
            "tool_calls",
            "waiting_for",
            "waiting_since",
            "idempotency_key",
            "not_before",
            "truncated",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "idempotency_key": {
                "help_text": "ctx.idempotency_key of the attempt's handler: what to check with "
                "the third party before resolving an in_doubt attempt"
            },
            "not_before": {
                "help_text": "a sleep's end, a wait's time-out, or when an in_doubt attempt "
                "fails unless resolved"
            },
            "waiting_for": {
                "help_text": "while no live worker serves this scheduled attempt: its handler"
            },
            "waiting_since": {"help_text": "since when no live worker has served it"},
        }

    @extend_schema_field(TRUNCATED_SCHEMA)
    def get_truncated(self, step: StepRun) -> dict[str, Any] | None:
        return answers.truncated(
            step, lambda name: api_url("run-step-value", step.run_id, step.id, name)
        )

    @extend_schema_field(STEP_ERROR_SCHEMA)
    def get_error(self, step: StepRun) -> dict[str, Any] | None:
        if not step.error:
            return None
        if self.context.get("tracebacks", False) or not has_traceback(step.error):
            return step.error
        # Tracebacks are for the workflow's operators (CONTRACT section 8): they show code,
        # paths and values that a starter or a viewer has no business reading.
        return {key: value for key, value in step.error.items() if key != "traceback"}


class RunChildSerializer(serializers.ModelSerializer):
    workflow = serializers.CharField(source="workflow_id", read_only=True)

    class Meta:
        model = Run
        fields = ["id", "workflow", "status"]
        read_only_fields = fields


class RunListSerializer(serializers.ModelSerializer):
    """A run without its journal and children (what ``GET /runs`` lists)."""

    workflow = serializers.CharField(source="workflow_id", read_only=True)
    version = serializers.IntegerField(source="version.number", read_only=True)
    input = serializers.JSONField(read_only=True, allow_null=True)
    output = serializers.JSONField(read_only=True, allow_null=True)
    error = serializers.SerializerMethodField()
    parent = serializers.SerializerMethodField()
    cost_usd = serializers.FloatField(read_only=True)
    inspect_url = serializers.SerializerMethodField(
        help_text="the run's page in the run inspector (graph, timeline, attempts, actions), "
        "for people who may read the run; absolute, on SITE_URL"
    )
    truncated = serializers.SerializerMethodField()
    forked_from = serializers.SerializerMethodField(
        help_text="null, or the run this one was forked from (POST /runs/{id}/fork) and the "
        "top-level step it began at (null for a fork from the start)"
    )
    recipe_pins = serializers.DictField(
        child=serializers.IntegerField(),
        read_only=True,
        help_text="recipe versions by name that this run's recipe steps use whatever the step "
        "pins (a fork's recipes); {} for none",
    )

    class Meta:
        model = Run
        fields = [
            "id",
            "workflow",
            "version",
            "status",
            "input",
            "output",
            "error",
            "correlation",
            "idempotency_key",
            "account",
            "priority",
            "concurrency_key",
            "parent",
            "generation",
            "attempts",
            "cost_usd",
            "created_at",
            "started_at",
            "finished_at",
            "deadline_at",
            "forked_from",
            "recipe_pins",
            "inspect_url",
            "truncated",
        ]
        read_only_fields = fields

    @extend_schema_field(
        {
            "type": "object",
            "nullable": True,
            "properties": {
                "run": {"type": "string", "format": "uuid"},
                "step": {"type": "string", "nullable": True},
            },
            "required": ["run", "step"],
        }
    )
    def get_forked_from(self, run: Run) -> dict[str, Any] | None:
        if run.forked_from_id is None:
            return None
        return {"run": str(run.forked_from_id), "step": run.fork_step or None}

    def to_representation(self, run: Run) -> dict[str, Any]:
        data: dict[str, Any] = super().to_representation(run)
        # Only a run with secrets has tokens (its own or its parent's) in what it stores:
        # its representation, journal included, is walked once, others not at all.
        return secrets.shown(data) if run.secrets else data

    @extend_schema_field(RUN_ERROR_SCHEMA)
    def get_error(self, run: Run) -> dict[str, Any] | None:
        if not run.error:
            return None
        error = dict(run.error)
        return {
            **error,
            "class": str(error.get("class") or "error"),
            "message": str(error.get("message") or ""),
            "step": error.get("step"),
        }

    @extend_schema_field(TRUNCATED_SCHEMA)
    def get_truncated(self, run: Run) -> dict[str, Any] | None:
        return answers.truncated(run, lambda name: api_url(f"run-{name}", run.id))

    @extend_schema_field(OpenApiTypes.URI)
    def get_inspect_url(self, run: Run) -> str:
        # On SITE_URL, as the approval links in e-mails are (approvals.tokens.link_for): the
        # same address whoever asks and however the request reached the site (a proxy, a
        # webhook's body, a run read from a script), never a Host header a client chose.
        return f"{settings.SITE_URL.rstrip('/')}{reverse('runs:inspect', args=[run.id])}"

    @extend_schema_field(PARENT_SCHEMA)
    def get_parent(self, run: Run) -> dict[str, Any] | None:
        if run.parent_run_id is None:
            return None
        step = run.parent_step_run
        return {"run": str(run.parent_run_id), "step": step.step_id if step else None}


# The run's resource embeds its newest SHOWN_ACTIONS actions (oldest first), each detail
# whole when its compact JSON is at most ACTION_DETAIL_BYTES, else each top-level entry over
# ACTION_ENTRY_BYTES as {"bytes": n} (or the whole detail as that, should it still be over):
# at most about 400 KB of a GET /runs/{id} however many actions the run has or how large a
# detail an older release recorded (a retry's input changes; security review, issue 36).
ACTION_DETAIL_BYTES = 8192
ACTION_ENTRY_BYTES = 1024


def shown_detail(detail: Any) -> Any:
    """An action's detail within ACTION_DETAIL_BYTES (see above)."""
    size = encoded_size(detail)
    if size <= ACTION_DETAIL_BYTES:
        return detail
    if isinstance(detail, dict):
        cut = {}
        for key, value in detail.items():
            entry = encoded_size(value)
            cut[key] = value if entry <= ACTION_ENTRY_BYTES else {"bytes": entry}
        if encoded_size(cut) <= ACTION_DETAIL_BYTES:
            return cut
    return {"bytes": size}


class NewestActionsSerializer(serializers.ListSerializer):
    """The newest SHOWN_ACTIONS of the run's actions (prefetched newest first), oldest first."""

    def to_representation(self, data: Any) -> list[Any]:
        rows = list(data.all()) if hasattr(data, "all") else list(data)
        # Prefetched newest first (selectors.run_detail_queryset), or given in any order.
        rows.sort(key=lambda action: (action.created_at, action.id))
        return super().to_representation(rows[-SHOWN_ACTIONS:])


class RunActionSerializer(serializers.ModelSerializer):
    by = serializers.SerializerMethodField(help_text="who acted; null for the system")
    at = serializers.DateTimeField(source="created_at", read_only=True)

    class Meta:
        model = RunAction
        fields = ["action", "by", "at", "detail"]
        read_only_fields = fields
        list_serializer_class = NewestActionsSerializer

    def get_by(self, action: RunAction) -> str | None:
        return action.actor_name or None

    def to_representation(self, action: RunAction) -> dict[str, Any]:
        data: dict[str, Any] = super().to_representation(action)
        data["detail"] = shown_detail(data["detail"])
        return data


class RunSerializer(RunListSerializer):
    """A run with its children and its journal: every attempt, in the order it was written.
    Pass ``context={"tracebacks": True}`` to show step tracebacks (operators only)."""

    children = RunChildSerializer(many=True, read_only=True)
    steps = StepRunSerializer(
        many=True,
        read_only=True,
        help_text="the journal's newest attempts (at most DJFLOW_ANSWER_STEPS, 1,000 by "
        "default), oldest first; `steps_total` says how many it holds, `steps_url` pages "
        "through them all",
    )
    steps_total = serializers.SerializerMethodField(
        help_text="how many attempts the run's journal holds (more than `steps` shows when "
        "it is over DJFLOW_ANSWER_STEPS)"
    )
    steps_url = serializers.SerializerMethodField(
        help_text="GET /runs/{id}/steps: the whole journal, oldest first, cursor-paginated"
    )
    actions = RunActionSerializer(
        many=True,
        read_only=True,
        help_text="who cancelled, paused, resumed, retried, resolved an attempt in doubt or "
        "sent events: the newest 50, oldest first; a detail over 8 KB shows its larger "
        'entries as {"bytes": n}',
    )
    reason = serializers.SerializerMethodField(
        help_text="null, or why the run does not move on (it waits for a concurrency slot of "
        "its key; a step waits for a worker that serves its handler, and when it fails if "
        "none comes; an attempt in doubt waits for an operator to resolve it)"
    )

    class Meta(RunListSerializer.Meta):
        fields = [
            *RunListSerializer.Meta.fields,
            "reason",
            "actions",
            "children",
            "steps",
            "steps_total",
            "steps_url",
        ]
        read_only_fields = fields

    def get_steps_total(self, run: Run) -> int:
        # Set by selectors.with_journal; a run rendered otherwise shows all it was given.
        return int(getattr(run, "steps_total", len(run.steps.all())))

    @extend_schema_field(OpenApiTypes.URI)
    def get_steps_url(self, run: Run) -> str:
        return api_url("run-steps", run.id)

    def get_reason(self, run: Run) -> str | None:
        queued = slots.waiting_reason(run)
        if queued is not None:
            return queued
        # The newest attempts are prefetched (selectors.with_journal): no query.
        shown = run.steps.all()
        reasons = (
            in_doubt_reason(run, step) or unservable.waiting_reason(step) or budget_reason(step)
            for step in shown
        )
        reason = next((reason for reason in reasons if reason), None)
        if reason is None and len(shown) < self.get_steps_total(run):
            # An attempt in doubt or waiting for a worker among those not shown (a foreach
            # of thousands): one look-up on the run_journal index.
            older = (
                StepRun.objects.filter(run_id=run.id, id__lt=shown[0].id)
                .filter(
                    Q(status=StepStatus.IN_DOUBT)
                    | Q(status=StepStatus.SCHEDULED, waiting_since__isnull=False)
                    | Q(status=StepStatus.SCHEDULED, budget_wait__isnull=False)
                )
                .order_by("id")
                # What the two reasons say, not the attempt's values (up to 3 MiB of them).
                .only(
                    "id",
                    "run_id",
                    "step_id",
                    "status",
                    "not_before",
                    "idempotency_key",
                    "waiting_since",
                    "waiting_for",
                    "queue",
                    "budget_wait",
                )
                .first()
            )
            if older is not None:
                reason = (
                    in_doubt_reason(run, older)
                    or unservable.waiting_reason(older)
                    or budget_reason(older)
                )
        return reason


def budget_reason(step: StepRun) -> str | None:
    """Why the run waits for budget (CONTRACT section 17): the limit, the amount asked for,
    and what lets it go on."""
    wait = step.budget_wait if step.status == StepStatus.SCHEDULED else None
    if not wait:
        return None
    message = str(wait.get("message") or "").removeprefix("recipe: call not made: ")
    if wait.get("limit") == "account":
        until = wait.get("until")
        then = f", or the new period at {until}" if until else ""
        after = f"the account's budget raised (PUT /api/v1/accounts/{wait.get('account')}){then}"
    else:
        after = f"a top-up (POST /api/v1/runs/{wait.get('run')}/budget)"
    return (
        f"step '{step.step_id}' waits for budget: {message} (asked for ${wait.get('asked_usd')});"
        f" it goes on after {after}"
    )


def in_doubt_reason(run: Run, step: StepRun) -> str | None:
    """Why the run waits on an in_doubt attempt, and what an operator does about it."""
    if step.status != StepStatus.IN_DOUBT:
        return None
    deadline = step.not_before.isoformat(timespec="seconds") if step.not_before else "never"
    return (
        f"step '{step.step_id}' (step run {step.id}) is in doubt: its worker was lost after the "
        f"at_most_once attempt started. Check idempotency key '{step.idempotency_key}' with "
        f"the third party, then POST /api/v1/runs/{run.id}/steps/{step.id}/resolve with "
        f'{{"outcome": "succeeded", "output": ...}} or {{"outcome": "failed"}}; it fails at '
        f"{deadline} otherwise"
    )


class StepResolveSerializer(StrictBodySerializer):
    """The body of ``POST /runs/{id}/steps/{step_run_id}/resolve``."""

    outcome = serializers.ChoiceField(
        choices=["succeeded", "failed"],
        help_text="succeeded: the step's effect happened (the run goes on with `output`); "
        "failed: it did not (the step fails, class in_doubt, never retried; its on_error "
        "applies)",
    )
    output = serializers.JSONField(
        required=False,
        allow_null=True,
        default=None,
        help_text="the step's output when it succeeded (what the handler would have returned)",
    )

    body_name = "a resolution"

    @classmethod
    def body_schema(cls) -> dict[str, Any]:
        # What validate() below requires: an output only with outcome succeeded.
        return {
            "oneOf": [
                {"properties": {"outcome": {"type": "string", "enum": ["succeeded"]}}},
                {
                    "properties": {
                        "outcome": {"type": "string", "enum": ["failed"]},
                        # Null or absent: nothing, and null (OpenAPI 3.0 has no type null).
                        "output": {"nullable": True, "not": {}},
                    }
                },
            ]
        }

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["outcome"] == "failed" and data.get("output") is not None:
            raise serializers.ValidationError(
                {"output": ["only an attempt that succeeded has one"]}
            )
        return data


# --- retry and trace ------------------------------------------------------------------------


class RunRetrySerializer(StrictBodySerializer):
    """The body of ``POST /runs/{id}/retry``; every field optional, unknown fields refused."""

    from_step = StrictCharField(
        max_length=100,
        required=False,
        trim_whitespace=False,
        help_text="rerun this step and every top-level step after it (a step inside a "
        "condition, parallel, foreach or loop reruns its enclosing top-level step); any ended "
        "run. Without it: a failed run from its failed step",
    )
    input = serializers.JSONField(
        required=False,
        help_text="a new run input (an object), checked against the version's input_schema; "
        "a writeOnly field left out or sent as •••• keeps its stored value",
    )
    dry_run = StrictBooleanField(
        required=False,
        default=False,
        help_text="answer what the retry would do and change nothing",
    )

    body_name = "a retry"

    @classmethod
    def body_schema(cls) -> dict[str, Any]:
        # runs.services.run_retry refuses an input that is not an object (400 naming input).
        return {"properties": {"input": {"type": "object"}}}


class RunForkSerializer(StrictBodySerializer):
    """The body of ``POST /runs/{id}/fork``; every field optional, unknown fields refused."""

    from_step = StrictCharField(
        max_length=100,
        required=False,
        trim_whitespace=False,
        help_text="begin at this top-level step (a step inside a condition, parallel, foreach "
        "or loop: its enclosing top-level step); the steps before it that settled keep the "
        "source run's outputs and do not run. Without it the fork runs every step",
    )
    document = serializers.JSONField(
        required=False,
        help_text="a saved version number of the run's workflow to run (the run's own by "
        "default); a document not saved is tried offline with manage.py run_replay --document",
    )
    recipes = serializers.JSONField(
        required=False,
        help_text='recipe versions by name ({"draft_reply": 3}): every recipe step of the fork '
        "naming that recipe uses that saved version, whatever version it pins",
    )
    input = serializers.JSONField(
        required=False,
        help_text="the fork's input (an object), checked against the version's input_schema; "
        "without it the source run's. A writeOnly field left out or sent as •••• keeps the "
        "source's value (for an author of the workflow or the source's starter)",
    )
    dry_run = StrictBooleanField(
        required=False,
        default=False,
        help_text="answer what the fork would reuse and run, and start nothing",
    )

    body_name = "a fork"

    @classmethod
    def body_schema(cls) -> dict[str, Any]:
        return {
            "properties": {
                "document": {"type": "integer", "minimum": 1, "maximum": MAX_VERSION},
                "recipes": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": MAX_VERSION,
                    },
                },
                "input": {"type": "object"},
            }
        }


class ForkPreviewSerializer(serializers.Serializer):
    """What a dry run of a fork answers (``runs.forks.ForkPreview``)."""

    dry_run = serializers.BooleanField(help_text="always true")
    source = serializers.UUIDField(help_text="the run it forks")
    version = serializers.IntegerField(help_text="the version of the workflow it would run")
    from_step = serializers.CharField(
        allow_null=True, help_text="the top-level step it would begin at"
    )
    reused = serializers.ListField(
        child=serializers.CharField(),
        help_text="top-level steps whose outputs it would take from the source run",
    )
    rerun = serializers.ListField(
        child=serializers.CharField(), help_text="top-level steps it would run"
    )
    recipes = serializers.DictField(
        child=serializers.IntegerField(), help_text="the recipe versions it would pin"
    )


class InputChangeSerializer(serializers.Serializer):
    field = serializers.CharField(help_text="input.<path>")
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)


class StepInputChangeSerializer(serializers.Serializer):
    step = serializers.CharField()
    path = serializers.CharField()
    before = serializers.JSONField(allow_null=True, help_text="the input it last ran with")
    after = serializers.JSONField(allow_null=True, help_text="the input it would run with")


class RetryPreviewSerializer(serializers.Serializer):
    """What a dry run of a retry answers (``runs.services.RetryPreview``)."""

    dry_run = serializers.BooleanField(help_text="always true")
    generation = serializers.IntegerField(help_text="the generation the retry would start")
    restart_at = serializers.CharField(
        allow_null=True, help_text="the top-level step it would start from"
    )
    rerun = serializers.ListField(
        child=serializers.CharField(), help_text="top-level steps that would run again"
    )
    kept = serializers.ListField(
        child=serializers.CharField(), help_text="top-level steps whose outputs are kept"
    )
    input_changes = InputChangeSerializer(many=True)
    step_inputs = StepInputChangeSerializer(
        many=True,
        help_text="the resolved inputs of the attempts it would schedule first, before and "
        "after (later steps' inputs depend on outputs not made yet)",
    )


class TraceSpanSerializer(serializers.Serializer):
    id = serializers.CharField(
        help_text="stable: run:<uuid>, step:<run>:<path><step id>, "
        "attempt:<id>, span:<attempt>:<n>, model_call:<id>, tool_call:<id>"
    )
    parent = serializers.CharField(allow_null=True)
    name = serializers.CharField()
    kind = serializers.CharField(
        help_text="run, step, attempt, truncated, or the handler span's own kind "
        "(internal, model_generation, retrieval, embedding, client)"
    )
    step_id = serializers.CharField(allow_null=True)
    attempt = serializers.IntegerField(allow_null=True)
    start = serializers.DateTimeField(allow_null=True)
    end = serializers.DateTimeField(allow_null=True)
    status = serializers.CharField(allow_null=True)
    attributes = serializers.DictField()
    usage = serializers.DictField()
    cost_usd = serializers.FloatField(allow_null=True)


class TruncatedSerializer(serializers.Serializer):
    reason = serializers.ChoiceField(choices=["spans", "depth"])
    limit = serializers.IntegerField()


class RunTraceSerializer(serializers.Serializer):
    run = serializers.UUIDField()
    spans = TraceSpanSerializer(many=True)
    truncated = TruncatedSerializer(
        allow_null=True, help_text="null, or why spans were left out (a span of kind truncated)"
    )


# The most USD a budget holds (the columns' 14 digits, 6 after the point).
MAX_USD = 99_999_999


class UsdField(serializers.FloatField):
    """An amount of USD in a body: a JSON number, rounded to the micro-dollar
    (a Decimal, as the columns keep it). A number, not a decimal string, in the OpenAPI
    document: every number within the bounds is taken (a string of any shape, or a seventh
    decimal place, would be a schema-valid value refused)."""

    def to_internal_value(self, data: Any) -> Any:
        # A JSON number only: not true/false (float(False) is 0.0), not a string.
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        value = super().to_internal_value(data)
        return Decimal(repr(value)).quantize(Decimal("0.000001"))


PERIOD_HELP = (
    "day or month, with UTC boundaries (midnight, the first of the month); null: a budget in total"
)


class AccountSerializer(serializers.Serializer):
    """An account's budget and what its runs' model calls spent and hold (CONTRACT
    section 17). ``spent_usd`` and ``reserved_usd`` are the engine's."""

    name = serializers.CharField(read_only=True)
    budget_usd = serializers.DecimalField(
        max_digits=14, decimal_places=6, allow_null=True, read_only=True, coerce_to_string=False
    )
    period = serializers.ChoiceField(
        choices=["day", "month"], allow_null=True, read_only=True, help_text=PERIOD_HELP
    )
    period_start = serializers.DateTimeField(read_only=True)
    spent_usd = serializers.DecimalField(
        max_digits=14, decimal_places=6, read_only=True, coerce_to_string=False
    )
    reserved_usd = serializers.DecimalField(
        max_digits=14, decimal_places=6, read_only=True, coerce_to_string=False
    )

    def to_representation(self, instance: Any) -> Any:
        data = super().to_representation(instance)
        data["period"] = instance.period or None
        return data


class AccountBodySerializer(StrictBodySerializer):
    """The body of ``PUT /accounts/{name}``: what operators set."""

    budget_usd = UsdField(
        min_value=0,
        max_value=MAX_USD,
        allow_null=True,
        help_text="USD the account's model calls may cost per period (null: no cap), to the "
        "micro-dollar",
    )
    period = serializers.ChoiceField(
        choices=["day", "month"],
        allow_null=True,
        required=False,
        default=None,
        help_text=PERIOD_HELP,
    )

    body_name = "an account"


class RunBudgetSerializer(StrictBodySerializer):
    """The body of ``POST /runs/{id}/budget``."""

    add_usd = UsdField(
        min_value=0.000001,
        max_value=1_000_000,
        help_text="USD added to the run's limits.max_cost_usd, to the micro-dollar",
    )

    body_name = "a top-up"


class ForecastSerializer(StrictBodySerializer):
    """The body of ``POST /runs/forecast``. Unknown fields are refused, each named."""

    workflow = StrictCharField(max_length=100, trim_whitespace=False, help_text="the workflow's id")
    version = StrictIntegerField(
        min_value=1,
        max_value=MAX_VERSION,
        required=False,
        allow_null=True,
        help_text="the version to forecast; the latest when omitted",
    )
    input = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text="the run's input, when known: a foreach over ${input.<list>} is then "
        "bounded by that list's length",
    )

    body_name = "a forecast"


class _CountRangeSerializer(serializers.Serializer):
    min = serializers.IntegerField()
    max = serializers.IntegerField(allow_null=True, help_text="null when unbounded")


class _CostRangeSerializer(serializers.Serializer):
    min = serializers.FloatField()
    expected = serializers.FloatField(
        allow_null=True,
        help_text="the median of the workflow's last completed runs; without any, the "
        "midpoint of min and max",
    )
    max = serializers.FloatField(allow_null=True, help_text="null when unbounded")


class _StepForecastSerializer(serializers.Serializer):
    step_id = serializers.CharField()
    kind = serializers.CharField()
    field = serializers.CharField(help_text="where the step is in the document")
    attempts = _CountRangeSerializer()
    calls = _CountRangeSerializer(help_text="model calls")
    cost_usd = _CostRangeSerializer()


class ForecastAnswerSerializer(serializers.Serializer):
    """The answer of ``POST /runs/forecast`` (``workflows.forecast.Forecast.as_json``)."""

    steps = _CountRangeSerializer(help_text="step attempts, as limits.max_steps counts them")
    cost_usd = _CostRangeSerializer()
    per_step = _StepForecastSerializer(many=True)
    unbounded = serializers.ListField(
        child=serializers.CharField(), help_text="why each unknown max is unknown"
    )
