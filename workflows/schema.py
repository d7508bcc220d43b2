"""The published JSON Schema of workflow documents, ``definition.schema.json``."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

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


@cache
def schema_validator() -> Draft202012Validator:
    schema = load_schema()
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def step_kinds() -> list[str]:
    return list(load_schema()["$defs"]["step"]["properties"]["kind"]["enum"])
