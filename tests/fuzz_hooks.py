"""Schemathesis hooks of the API fuzz (tests/test_api_fuzz.py), loaded by the CLI through
``SCHEMATHESIS_HOOKS=tests.fuzz_hooks``.

Each hook takes out of a drawn case one value whose validity depends on data no OpenAPI schema
can state, and that the server rightly refuses as a 400 naming it (it would never succeed):
``positive_data_acceptance`` would otherwise count a refusal of a schema-valid request. What is
taken out is checked by the unit tests of each rule (tests/test_pagination.py, tests/runs/
test_bulk.py, tests/runs/test_retry*.py, tests/schedules). Only values that are valid by the
schema are touched, so a negative case stays negative.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs

import schemathesis
from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants

from workflows.kb_names import KEY_MAX_LENGTH

# Hypothesis (6.170) mixes literals of every module the process has imported into its draws,
# parsing their source (ast.parse, which failed once here with "AST constructor recursion
# depth mismatch"), so the draws depend on what was imported. None of them: the same draws
# in every run, as the in-process fuzz this replaced did (a private function of the pinned
# version).
providers._get_local_constants = Constants  # type: ignore[assignment]

# Steps of the seeded workflow (tests/workflows/documents.support_ticket), what a retry's
# from_step may name: another name is "not a step of support_ticket" (400).
STEPS = {"classify", "draft", "approval", "send"}
GOOD_CRON = "0 2 * * *"


def _is_cursor(text: str) -> bool:
    """Whether ``text`` decodes as DRF's cursors do (base64 of o=&r=&p=): an opaque token
    the API gives out in ``next``; any other is a 400 naming ``cursor``."""
    try:
        decoded = base64.b64decode(text.encode("ascii"), validate=False).decode("ascii")
    except (UnicodeError, binascii.Error, ValueError):
        return False
    return bool(set(parse_qs(decoded, keep_blank_values=True)) & {"o", "p", "r"})


def _instant(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _ordered(values: dict[str, Any]) -> None:
    """``created_before`` at or before ``created_after`` matches no run, and is refused as a
    400 naming created_before (a swapped range): the pair is a rule across two fields."""
    after, before = _instant(values.get("created_after")), _instant(values.get("created_before"))
    if after is not None and before is not None:
        try:
            reversed_range = after >= before
        except TypeError:  # one naive, one aware: Django reads both in the default zone
            reversed_range = False
        if reversed_range:
            values.pop("created_before")


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    query = case.query if isinstance(case.query, dict) else None
    if query is not None:
        cursor = query.get("cursor")
        if isinstance(cursor, str) and not _is_cursor(cursor):
            query.pop("cursor")
        _ordered(query)
        if case.operation.label == "GET /api/v1/kbs/{kb}/documents" and "q" in query:
            # A search (q) answers one page of the best documents: it takes neither key (the
            # versions of one document) nor a cursor, each a 400 naming it.
            for other in ("key", "cursor"):
                if _valid_text(query.get(other), KEY_MAX_LENGTH):
                    query.pop(other)
    body = case.body if isinstance(case.body, dict) else None
    label = case.operation.label
    if body is not None and label in ("POST /api/v1/runs/cancel", "POST /api/v1/runs/retry"):
        _ordered(body)
    if body is not None and label in (
        "POST /api/v1/runs/{run_id}/retry",
        "POST /api/v1/runs/{run_id}/fork",
    ):
        step = body.get("from_step")
        if _valid_text(step, 100) and step not in STEPS:
            body["from_step"] = "draft"
    if body is not None and label == "POST /api/v1/runs/{run_id}/fork":
        # A recipe pin names a recipe the document's steps name (400 otherwise), and the
        # input is held to the workflow's input_schema (400 naming each field): rules of the
        # data (tests/runs/test_forks.py), not of the schema.
        if isinstance(body.get("recipes"), dict) and body["recipes"]:
            body.pop("recipes")
        if isinstance(body.get("input"), dict):
            body.pop("input")
    if body is not None and label == "POST /api/v1/schedules":
        cron = body.get("cron")
        if _valid_text(cron, 200) and not _valid_cron(cron):
            body["cron"] = GOOD_CRON
    return case


def _valid_text(value: Any, most: int) -> bool:
    """Whether ``value`` is text the document allows (1 to ``most`` characters, no NUL): only
    such a value is replaced, so a case drawn to break the schema still breaks it."""
    return isinstance(value, str) and 1 <= len(value) <= most and "\x00" not in value


def _valid_cron(text: str) -> bool:
    from celery.schedules import crontab

    fields = text.split()
    if len(fields) != 5:
        return False
    try:
        crontab(*fields)
    except Exception:
        return False
    return True
