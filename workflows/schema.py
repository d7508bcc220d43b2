"""The published JSON Schema of workflow documents, ``definition.schema.json``."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from . import kinds
from .input_schema import FORMAT_CHECKER

SCHEMA_PATH = Path(__file__).with_name("definition.schema.json")

# Every duration field is bounded by this: 3650 days in milliseconds (contract section 1).
MAX_DURATION_MS = 315_360_000_000
DEFAULT_RUN_TIMEOUT_MS = 300_000
DEFAULT_STEP_TIMEOUT_MS = 60_000
# A foreach's max_items when it gives none (the planner refuses more items at run time).
DEFAULT_MAX_ITEMS = 1000

# Bounds on the work one document may ask for (contract section 9), checked at save.
# Steps in a document, nested ones included, unless DJFLOW_MAX_DOCUMENT_STEPS says otherwise.
DEFAULT_MAX_DOCUMENT_STEPS = 500
# Levels of steps inside steps: a top-level step is at level 1.
MAX_NESTING = 8
# The product of the bounds of nested loops (max_iterations) and foreach (max_items): how
# many times the innermost body may run for one run of the outermost step.
MAX_REPEATS = 100_000


@cache
def load_schema() -> dict[str, Any]:
    with SCHEMA_PATH.open(encoding="utf-8") as f:
        return json.load(f)


def schema_validator() -> Draft202012Validator:
    """The validator of documents: the published schema, plus the steps of kinds registered
    outside it (``workflows.kinds``; rebuilt when one is registered)."""
    return _validator(kinds.generation())


@lru_cache(maxsize=2)
def _validator(generation: int) -> Draft202012Validator:
    schema = with_registered_kinds(load_schema(), kinds.extra_schemas())
    Draft202012Validator.check_schema(schema)
    # The project's checker: a registered kind's schema with ``format: regex`` must not run
    # Python's ``re`` on an author's value (workflows.input_schema).
    return Draft202012Validator(schema, format_checker=FORMAT_CHECKER)


# The fields every step has, as the published schema gives them for a task (less its handler).
_COMMON = ("id", "input", "when", "retry", "on_error", "effect", "timeout_ms", "queue")


def with_registered_kinds(
    schema: dict[str, Any], extra: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """``schema`` with a step definition for each kind in ``extra``: the common step fields,
    plus the kind's own ``properties`` and ``required`` (its ``Kind.schema``)."""
    if not extra:
        return schema
    schema = copy.deepcopy(schema)
    defs = schema["$defs"]
    step = defs["step"]
    common = {name: defs["task_step"]["properties"][name] for name in _COMMON}
    for name, own in extra.items():
        if name in step["properties"]["kind"]["enum"]:
            continue  # a kind the published schema describes keeps its definition
        step["properties"]["kind"]["enum"].append(name)
        defs[f"{name}_step"] = {
            "description": own.get("description", f"A step of the registered kind '{name}'."),
            "type": "object",
            "required": ["id", "kind", *own.get("required", [])],
            "additionalProperties": False,
            "properties": {**common, "kind": {"const": name}, **own.get("properties", {})},
        }
        step["allOf"].append(
            {
                "if": {"properties": {"kind": {"const": name}}, "required": ["kind"]},
                "then": {"$ref": f"#/$defs/{name}_step"},
            }
        )
    return schema


def step_kinds() -> list[str]:
    return list(load_schema()["$defs"]["step"]["properties"]["kind"]["enum"])


def document_body_schema() -> dict[str, Any]:
    """The body of ``POST /definitions`` in the OpenAPI document (OpenAPI 3.0's subset of
    JSON Schema): the published schema's top level, its required fields and no others
    (``additionalProperties: false``, as the save refuses an unknown field). A field whose
    schema uses what OpenAPI 3.0 lacks (``$ref`` into ``$defs``, a list of types) is stated
    loosely: its whole shape is in ``/api/v1/definition.schema.json``, which the save checks."""
    published = load_schema()
    defs = published["$defs"]
    properties: dict[str, Any] = {}
    for name, field in published["properties"].items():
        if field.get("$ref", "").startswith("#/$defs/"):
            field = {**defs[field["$ref"].rsplit("/", 1)[1]], **_without(field, "$ref")}
        properties[name] = _openapi_field(field)
    return {
        "type": "object",
        "description": "A workflow document: /api/v1/definition.schema.json has its whole shape.",
        "required": list(published["required"]),
        "properties": properties,
        "additionalProperties": False,
    }


def _openapi_field(field: dict[str, Any]) -> dict[str, Any]:
    if "$ref" not in json.dumps(field) and isinstance(field.get("type", ""), str):
        return field
    if field.get("type") == "array":
        # Steps: objects whose shape is each kind's ($defs/step in the published schema).
        bounds = {k: v for k, v in field.items() if k in ("minItems", "maxItems", "description")}
        return {"type": "array", "items": {"type": "object"}, **bounds}
    if isinstance(field.get("type"), list):
        loose = _without(field, "type")
        return {"anyOf": [{"type": kind} for kind in field["type"]], **loose}
    return {
        k: v for k, v in field.items() if k == "description" or (k == "type" and isinstance(v, str))
    }


def _without(field: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in field.items() if k != key}
