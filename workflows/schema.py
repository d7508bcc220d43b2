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
