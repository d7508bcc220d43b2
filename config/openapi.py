"""What the OpenAPI document says of every operation, added after drf-spectacular has built it
(``SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]``): the statuses any route can answer, whatever
its view, and the links between operations (an id one answers is the path of others).

The statuses come from layers in front of the views, so no view's ``extend_schema`` lists them:

- 400: a path or query holding NUL (``config.middleware.NulRefusalMiddleware``), on every
  operation that takes a path or query parameter;
- 413: a body over ``DJFLOW_MAX_BODY_BYTES`` (Django's ``RequestDataTooBig``, answered by
  ``config.views.bad_request``), on every operation that takes a body;
- 415: a body that is not ``application/json`` (DRF's parser negotiation), same;
- 406: an ``Accept`` that excludes JSON (DRF's content negotiation);
- 414: a request line over gunicorn's ``limit_request_line`` (4,094 bytes by default), before
  Django sees it: gunicorn's own HTML page, whichever the route;
- 429: past ``DJFLOW_API_THROTTLE_USER`` / ``_ANON`` (every API view is throttled), with
  ``Retry-After``;
- 503: the database unreachable (``config.api_errors``), with ``Retry-After``.
"""

from __future__ import annotations

from typing import Any

# A component's additions (``runs.serializers.StrictBodySchema``), merged by the hook below.
MERGED_LATER = "x-djflow-merged-later"

ERROR_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["errors"],
    "properties": {
        "errors": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
                "required": ["message"],
            },
        }
    },
}

_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "schema": {"type": "integer", "minimum": 0},
    }
}


def _errors(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": ERROR_BODY}},
    }
    if headers:
        answer["headers"] = headers
    return answer


EVERY_OPERATION = {
    "406": _errors("The Accept header excludes application/json, the only type answered."),
    "414": {
        "description": "The request line (method, path and query) is over the server's limit "
        "(gunicorn's limit_request_line, 4,094 bytes by default): the server's own page.",
        "content": {"text/html": {"schema": {"type": "string"}}},
    },
    "429": _errors(
        "Too many requests (DJFLOW_API_THROTTLE_USER, DJFLOW_API_THROTTLE_ANON).", _RETRY_AFTER
    ),
    "503": _errors("The database is unavailable; nothing was written.", _RETRY_AFTER),
}
WITH_PARAMETERS = {
    "400": _errors("Bad input, each problem naming its field (here: NUL in the path or query)."),
}
WITH_BODY = {
    "400": _errors("Bad input, each problem naming its field."),
    "413": _errors("The body is over DJFLOW_MAX_BODY_BYTES (1 MiB by default)."),
    "415": _errors("The body is not application/json."),
}

# An id a created resource answers, and the operations that take it: (source operation,
# its answers with the id, where the id is in the answer, target operations, parameter).
LINKS: list[tuple[str, tuple[str, ...], str, tuple[str, ...], str]] = [
    (
        "runs_start",
        ("200", "201"),
        "$response.body#/id",
        (
            "runs_read",
            "runs_steps",
            "runs_trace",
            "runs_input",
            "runs_output",
            "runs_cancel",
            "runs_pause",
            "runs_resume",
            "runs_retry",
        ),
        "run_id",
    ),
    ("runs_bulk_cancel", ("202",), "$response.body#/id", ("runs_bulk_read",), "bulk_id"),
    ("runs_bulk_retry", ("202",), "$response.body#/id", ("runs_bulk_read",), "bulk_id"),
    (
        "schedules_create",
        ("201",),
        "$response.body#/id",
        ("schedules_read", "schedules_delete"),
        "schedule_id",
    ),
    (
        "definitions_save",
        ("200", "201"),
        "$response.body#/id",
        ("definitions_read",),
        "workflow_id",
    ),
    ("recipes_save", ("200", "201"), "$response.body#/name", ("recipes_read",), "name"),
]


def every_operation_answers(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """The postprocessing hook: the statuses above on each operation (a status a view
    documents itself is kept), and :data:`LINKS`."""
    for component in result.get("components", {}).get("schemas", {}).values():
        _merge(component, component.pop(MERGED_LATER, {}))
    schemas = result.get("components", {}).get("schemas", {})
    for name, component in schemas.items():
        if name.endswith("Request"):
            _no_nul(component)
    operations = {}
    for path_item in result.get("paths", {}).values():
        for operation in path_item.values():
            operations[operation["operationId"]] = operation
            for parameter in operation.get("parameters", []):
                _no_nul(parameter.get("schema", {}))
            body = operation.get("requestBody")
            if body is not None:
                _body_required(body, schemas)
            answers = operation.setdefault("responses", {})
            added = dict(EVERY_OPERATION)
            if operation.get("parameters"):
                added.update(WITH_PARAMETERS)
            if "requestBody" in operation:
                added.update(WITH_BODY)
            for status, answer in added.items():
                answers.setdefault(status, answer)
    for source, statuses, where, targets, parameter in LINKS:
        if source not in operations:
            continue
        links = {
            target: {"operationId": target, "parameters": {parameter: where}}
            for target in targets
            if target in operations
        }
        for status in statuses:
            answer = operations[source]["responses"].get(status)
            if answer is not None:
                answer["links"] = links
    return result


def _merge(schema: dict[str, Any], more: dict[str, Any]) -> None:
    """``more`` into ``schema``: its ``properties`` replace the type of the fields they name
    (an enum component's ``$ref`` included), anything else is added."""
    more = dict(more)
    properties = schema.setdefault("properties", {})
    for name, stated in more.pop("properties", {}).items():
        kept = {
            k: v for k, v in properties.get(name, {}).items() if k not in ("$ref", "allOf", "oneOf")
        }
        properties[name] = {**kept, **stated}
    schema.update(more)


# Text holding NUL, anywhere in a path, a query or a body, is a 400 (CONTRACT section 9):
# config.middleware.NulRefusalMiddleware and config.parsers.JSONParser.
NO_NUL = "^[^\\u0000]*$"


def _no_nul(schema: Any) -> None:
    """Every string of ``schema`` (a parameter's, or a request body's, however nested) says
    it holds no NUL, unless it is an enum or has a pattern of its own."""
    if isinstance(schema, list):
        for item in schema:
            _no_nul(item)
        return
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "string" and not ({"pattern", "enum", "format"} & set(schema)):
        schema["pattern"] = NO_NUL
    for key in ("properties",):
        for item in schema.get(key, {}).values():
            _no_nul(item)
    for key in ("items", "additionalProperties", "oneOf", "anyOf", "allOf"):
        _no_nul(schema.get(key))


def _body_required(body: dict[str, Any], schemas: dict[str, Any]) -> None:
    """A body whose schema requires something of ``{}`` (a ``oneOf`` or ``anyOf`` of required
    fields: the bulk actions' filters, a schedule's cron or every_ms) is required: no body
    reads as ``{}``, which the server refuses."""
    for media in body.get("content", {}).values():
        ref = media.get("schema", {}).get("$ref", "")
        component = schemas.get(ref.rsplit("/", 1)[-1], {}) if ref else media.get("schema", {})
        if component.get("required") or "anyOf" in component or "oneOf" in component:
            body["required"] = True
