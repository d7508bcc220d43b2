"""A document's ``on_failure`` steps at save (CONTRACT section 13): validated like the main
steps, ``${error}`` readable there only, ids unique across both, and counted against the
document's step limit; the builder writes the same field."""

from __future__ import annotations

from typing import Any

import pytest

from workflows.sdk import workflow
from workflows.steps import task
from workflows.validation import every_step, validate_document

from .documents import support_ticket


def with_handler(*handler: dict[str, Any]) -> dict[str, Any]:
    doc = support_ticket()
    doc["on_failure"] = list(handler)
    return doc


def errors_of(doc: dict[str, Any], **kwargs: Any) -> dict[str, str]:
    return {e.field or "": e.message for e in validate_document(doc, **kwargs)}


def test_a_handler_reading_the_error_and_any_top_level_step_is_valid() -> None:
    doc = with_handler(
        {
            "id": "apologise",
            "kind": "task",
            "input": {
                "why": "${error.message}",
                "class": "${error.class}",
                "at": "${error.step}",
                "draft": "${steps.draft.output}",
                "whole": "${error}",
            },
        },
        {"id": "close", "kind": "task", "input": "${steps.apologise.output}"},
    )
    assert validate_document(doc) == []
    assert [where for _, where in every_step(doc)][-2:] == ["on_failure[0]", "on_failure[1]"]


@pytest.mark.parametrize(
    ("handler", "field", "words"),
    [
        ({"id": "x", "kind": "task", "colour": 1}, "on_failure[0].colour", "unknown field"),
        ({"id": "send", "kind": "task"}, "on_failure[0].id", "duplicate step id 'send'"),
        (
            {"id": "x", "kind": "task", "input": "${error.traceback}"},
            "on_failure[0].input",
            "error has only error.class, error.message and error.step",
        ),
        (
            {"id": "x", "kind": "task", "input": "${steps.y.output}"},
            "on_failure[0].input",
            "reads step 'y', which is not declared before this point",
        ),
        ({"id": "X", "kind": "task"}, "on_failure[0].id", "must match"),
        (
            {"id": "x", "kind": "sleep", "ms": 10**12},
            "on_failure[0].ms",
            "milliseconds",
        ),
    ],
)
def test_a_bad_handler_step_is_refused_naming_its_field(handler, field: str, words: str) -> None:
    # A later handler step "y": reading it from an earlier one is reading ahead.
    doc = with_handler(handler, {"id": "y", "kind": "task"})
    found = errors_of(doc)
    assert field in found, found
    assert words in found[field], found[field]


def test_the_error_root_outside_the_handler_is_refused() -> None:
    doc = support_ticket()
    doc["steps"][0]["input"] = "${error.message}"
    found = errors_of(doc)
    assert "only defined inside the on_failure steps" in found["steps[0].input"]


@pytest.mark.parametrize("value", [[], {}, "steps", [1]])
def test_on_failure_must_be_a_non_empty_list_of_steps(value: Any) -> None:
    doc = support_ticket()
    doc["on_failure"] = value
    assert any(field.startswith("on_failure") for field in errors_of(doc)), errors_of(doc)


def test_handler_steps_count_against_the_documents_step_limit() -> None:
    doc = with_handler(*({"id": f"h{n}", "kind": "task"} for n in range(3)))
    main = len(support_ticket()["steps"])
    assert validate_document(doc, max_steps=main + 3) == []
    found = errors_of(doc, max_steps=main + 2)
    assert f"the document has {main + 3} steps" in found["steps"]


def test_the_builder_writes_on_failure_and_registers_its_handlers() -> None:
    flow = workflow("refund_sdk_on_failure")

    @flow.step("charge")
    def charge(ctx: Any, input: Any, prior: Any) -> Any:
        return None

    flow.on_failure(task("refund", input={"why": "${error.message}"}), task("tell"))

    @flow.handler("refund")
    def refund(ctx: Any, input: Any, prior: Any) -> Any:
        return input

    document = flow.document()
    assert document["on_failure"] == [
        {"id": "refund", "kind": "task", "input": {"why": "${error.message}"}},
        {"id": "tell", "kind": "task"},
    ]
    assert validate_document(document) == []
    with pytest.raises(ValueError, match="'charge' is used twice"):
        flow.on_failure(task("charge"))
    # Replacing the handler frees its ids.
    flow.on_failure(task("tell"))
    assert [s["id"] for s in flow.document()["on_failure"]] == ["tell"]
    with pytest.raises(ValueError, match="at least one step"):
        flow.on_failure()
