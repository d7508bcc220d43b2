"""Every rule of contract section 4, each broken alone by at least one document.

Each case mutates a valid document so that it breaks exactly one rule, then checks that the
validator names the field and says why. The same table drives the API test, which checks the
400 body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from workflows.errors import InvalidDocument
from workflows.schema import MAX_DURATION_MS
from workflows.validation import field_path, prepare_document, validate_document

from .documents import every_kind, support_ticket

Doc = dict[str, Any]


def known(workflow_id: str, version: int | None) -> bool:
    return workflow_id in {"every_kind", "billing"} and version in (None, 1)


def _set(path: list[Any], value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        target = doc
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return mutate


def _append(step: Doc) -> Callable[[Doc], None]:
    return lambda doc: doc["steps"].append(step)


def _drop(path: list[Any]) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        target = doc
        for part in path[:-1]:
            target = target[part]
        del target[path[-1]]

    return mutate


# (rule, base, mutation, field, words the message must contain)
CASES: list[tuple[str, Callable[[], Doc], Callable[[Doc], None], str, list[str]]] = [
    # unknown fields, everywhere
    ("unknown top-level field", support_ticket, _set(["colour"], 1), "colour", ["unknown field"]),
    (
        "unknown step field",
        support_ticket,
        _set(["steps", 0, "colour"], "red"),
        "steps[0].colour",
        ["unknown field 'colour'"],
    ),
    (
        "misspelt common field",
        support_ticket,
        _set(["steps", 0, "retyr"], {}),
        "steps[0].retyr",
        ["did you mean 'retry'"],
    ),
    (
        "unknown retry field",
        support_ticket,
        _set(["steps", 3, "retry", "tries"], 2),
        "steps[3].retry.tries",
        ["unknown field"],
    ),
    (
        "unknown limits field",
        support_ticket,
        _set(["limits", "max_stepz"], 2),
        "limits.max_stepz",
        ["did you mean 'max_steps'"],
    ),
    (
        "misspelt guard key",
        support_ticket,
        _set(["steps", 2, "when", "pth"], "x"),
        "steps[2].when.pth",
        ["unknown field"],
    ),
    (
        "unknown field in a nested step",
        every_kind,
        _set(["steps", 6, "branches", "right", 1, "x"], 1),
        "steps[6].branches.right[1].x",
        ["unknown field"],
    ),
    (
        "unknown field of another kind",
        support_ticket,
        _set(["steps", 0, "ms"], 5),
        "steps[0].ms",
        ["unknown field 'ms'"],
    ),
    (
        "unknown guard op",
        support_ticket,
        _set(["steps", 2, "when", "op"], "equals"),
        "steps[2].when.op",
        ["must be one of"],
    ),
    (
        "guard value missing",
        support_ticket,
        _drop(["steps", 2, "when", "value"]),
        "steps[2].when.value",
        ["required field 'value'"],
    ),
    (
        "exists takes no value",
        support_ticket,
        _set(["steps", 2, "when", "op"], "exists"),
        "steps[2].when.value",
        ["takes no 'value'"],
    ),
    (
        "unknown kind",
        support_ticket,
        _set(["steps", 0, "kind"], "taks"),
        "steps[0].kind",
        ["must be one of"],
    ),
    (
        "missing required field",
        every_kind,
        _drop(["steps", 2, "ms"]),
        "steps[2].ms",
        ["required field 'ms'"],
    ),
    (
        "loop needs max_iterations",
        every_kind,
        _drop(["steps", 8, "max_iterations"]),
        "steps[8].max_iterations",
        ["required"],
    ),
    # bad ids
    ("bad workflow id", support_ticket, _set(["id"], "Support-Ticket"), "id", ["must match"]),
    (
        "bad step id",
        support_ticket,
        _set(["steps", 1, "id"], "2draft"),
        "steps[1].id",
        ["must match"],
    ),
    (
        "bad branch name",
        every_kind,
        lambda d: d["steps"][6]["branches"].update({"Left!": {"id": "zz", "kind": "task"}}),
        "steps[6].branches.Left!",
        ["not a valid name"],
    ),
    # duplicate ids, nested included
    (
        "duplicate step id",
        support_ticket,
        _append({"id": "classify", "kind": "task"}),
        "steps[4].id",
        ["duplicate step id 'classify'", "steps[0]"],
    ),
    (
        "duplicate nested id",
        every_kind,
        _set(["steps", 7, "do", "id"], "left_task"),
        "steps[7].do.id",
        ["duplicate step id 'left_task'"],
    ),
    (
        "duplicate id in a condition",
        every_kind,
        _set(["steps", 10, "else", 0, "id"], "note"),
        "steps[10].else[0].id",
        ["duplicate"],
    ),
    # templates and guards read steps declared earlier
    (
        "template reads a later step",
        support_ticket,
        _set(["steps", 1, "input"], {"x": "${steps.send.output}"}),
        "steps[1].input.x",
        ["not declared before"],
    ),
    (
        "template reads itself",
        support_ticket,
        _set(["steps", 1, "input"], "${steps.draft.output}"),
        "steps[1].input",
        ["not declared before"],
    ),
    (
        "template reads an unknown step",
        support_ticket,
        _set(["steps", 1, "input"], ["${steps.nope.output}"]),
        "steps[1].input[0]",
        ["unknown step 'nope'"],
    ),
    (
        "guard reads a later step",
        support_ticket,
        _set(["steps", 2, "when", "path"], "steps.send.status"),
        "steps[2].when.path",
        ["not declared before"],
    ),
    (
        "nested guard reads an unknown step",
        support_ticket,
        _set(["steps", 2, "when"], {"not": {"any": [{"path": "steps.zz.output", "op": "exists"}]}}),
        "steps[2].when.not.any[0].path",
        ["unknown step 'zz'"],
    ),
    (
        "output reads a step inside a foreach",
        every_kind,
        _set(["output"], "${steps.each_get.output}"),
        "output",
        ["inside a parallel, foreach or loop"],
    ),
    (
        "a branch reads its sibling",
        every_kind,
        _set(["steps", 6, "branches", "left", "input"], "${steps.right_a.output}"),
        "steps[6].branches.left.input",
        ["not declared before"],
    ),
    (
        "else reads then",
        every_kind,
        _set(["steps", 10, "else", 0, "message"], "${steps.note.output}"),
        "steps[10].else[0].message",
        ["not declared before"],
    ),
    # a path the step cannot produce
    (
        "unknown step attribute",
        support_ticket,
        _set(["output"], "${steps.send.result}"),
        "output",
        [".output, .status or .error"],
    ),
    (
        "step without attribute",
        support_ticket,
        _set(["output"], "${steps.send}"),
        "output",
        [".output, .status or .error"],
    ),
    (
        "status has no fields",
        support_ticket,
        _set(["output"], "${steps.send.status.code}"),
        "output",
        ["status is a string"],
    ),
    (
        "error has class and message",
        support_ticket,
        _set(["output"], "${steps.send.error.code}"),
        "output",
        ["class and message"],
    ),
    (
        "sleep output is null",
        every_kind,
        _set(["output"], "${steps.nap.output.x}"),
        "output",
        ["output is null"],
    ),
    (
        "approval output keys",
        every_kind,
        _set(["output"], "${steps.review.output.verdict}"),
        "output",
        ["decision"],
    ),
    (
        "http output keys",
        every_kind,
        _set(["output"], "${steps.fetch.output.code}"),
        "output",
        ["status"],
    ),
    (
        "parallel branch names",
        every_kind,
        _set(["output"], "${steps.fan.output.middle}"),
        "output",
        ["no branch 'middle'"],
    ),
    (
        "foreach output is an array",
        every_kind,
        _set(["output"], "${steps.each.output.first}"),
        "output",
        ["array"],
    ),
    (
        "unknown root",
        support_ticket,
        _set(["output"], "${inputs.ticket}"),
        "output",
        ["unknown root 'inputs'"],
    ),
    (
        "run has id and correlation",
        support_ticket,
        _set(["output"], "${run.started}"),
        "output",
        ["run.id and run.correlation"],
    ),
    (
        "item outside foreach",
        support_ticket,
        _set(["output"], "${item.x}"),
        "output",
        ["only defined inside a foreach"],
    ),
    (
        "iter outside loop",
        every_kind,
        _set(["steps", 7, "do", "url"], "${iter.index}"),
        "steps[7].do.url",
        ["only defined inside a loop"],
    ),
    (
        "closed input_schema",
        support_ticket,
        lambda d: (
            d["input_schema"].update({"additionalProperties": False}),
            d["steps"][1].update({"input": "${input.tikcet}"}),
        ),
        "steps[1].input",
        ["input_schema does not allow"],
    ),
    (
        "unclosed reference",
        support_ticket,
        _set(["steps", 1, "input"], "hello ${input.ticket"),
        "steps[1].input",
        ["unclosed"],
    ),
    (
        "invalid regex",
        support_ticket,
        _set(["steps", 2, "when"], {"path": "input.ticket", "op": "matches", "value": "(["}),
        "steps[2].when.value",
        ["regular expression"],
    ),
    (
        "a backreference RE2 cannot run",
        support_ticket,
        _set(["steps", 2, "when"], {"path": "input.ticket", "op": "matches", "value": r"(a)\1"}),
        "steps[2].when.value",
        ["regular expression", "RE2"],
    ),
    (
        "a lookahead RE2 cannot run",
        support_ticket,
        _set(["steps", 2, "when"], {"path": "input.ticket", "op": "matches", "value": "(?=a)a"}),
        "steps[2].when.value",
        ["regular expression", "RE2"],
    ),
    # foreach.items must be a path
    (
        "foreach items not a path",
        every_kind,
        _set(["steps", 7, "items"], "input.urls"),
        "steps[7].items",
        ["path template"],
    ),
    (
        "foreach items with text",
        every_kind,
        _set(["steps", 7, "items"], "all of ${input.urls}"),
        "steps[7].items",
        ["path template"],
    ),
    (
        "foreach items an object",
        every_kind,
        _set(["steps", 7, "items"], {"a": 1}),
        "steps[7].items",
        ["must be string or array"],
    ),
    (
        "static items over max_items",
        every_kind,
        _set(["steps", 7, "items"], list(range(51))),
        "steps[7].items",
        ["51 items", "max_items 50"],
    ),
    # durations
    (
        "duration too large",
        support_ticket,
        _set(["steps", 2, "timeout_ms"], MAX_DURATION_MS + 1),
        "steps[2].timeout_ms",
        ["steps[2].timeout_ms", str(MAX_DURATION_MS), str(MAX_DURATION_MS + 1)],
    ),
    (
        "negative duration",
        support_ticket,
        _set(["limits", "step_timeout_ms"], -1),
        "limits.step_timeout_ms",
        [str(MAX_DURATION_MS), "got -1"],
    ),
    (
        "fractional duration",
        every_kind,
        _set(["steps", 2, "ms"], 1.5),
        "steps[2].ms",
        [str(MAX_DURATION_MS), "got 1.5"],
    ),
    (
        "string duration",
        support_ticket,
        _set(["steps", 3, "retry", "initial_ms"], "500"),
        "steps[3].retry.initial_ms",
        [str(MAX_DURATION_MS), 'got "500"'],
    ),
    (
        "nested duration",
        every_kind,
        _set(["steps", 6, "branches", "left", "timeout_ms"], 10**13),
        "steps[6].branches.left.timeout_ms",
        [str(MAX_DURATION_MS), str(10**13)],
    ),
    (
        "wait outlasts run_timeout_ms",
        support_ticket,
        _set(["limits", "run_timeout_ms"], 600000),
        "steps[2].timeout_ms",
        ["604800000", "run_timeout_ms (600000"],
    ),
    (
        "sleep outlasts the default run timeout",
        lambda: {"id": "w", "steps": [{"id": "s", "kind": "sleep", "ms": 300001}]},
        lambda d: None,
        "steps[0].ms",
        ["run_timeout_ms (300000"],
    ),
    # input_schema must be JSON Schema
    (
        "input_schema with a remote $ref",
        support_ticket,
        _set(["input_schema", "properties", "x"], {"$ref": "http://127.0.0.1:9/x.json"}),
        "input_schema.properties.x.$ref",
        ["not a local reference", "http://127.0.0.1:9/x.json"],
    ),
    (
        "input_schema with a relative $ref deep inside",
        support_ticket,
        _set(["input_schema", "$defs"], {"a": {"anyOf": [{"$ref": "other.json#/a"}]}}),
        "input_schema.$defs.a.anyOf[0].$ref",
        ["not a local reference"],
    ),
    (
        "input_schema pattern RE2 cannot run",
        support_ticket,
        _set(["input_schema", "properties", "ticket", "pattern"], r"(a)\1"),
        "input_schema.properties.ticket.pattern",
        ["regular expression", "RE2"],
    ),
    (
        "input_schema not a schema",
        support_ticket,
        _set(["input_schema"], {"type": "strnig"}),
        "input_schema.type",
        ["not a valid JSON Schema"],
    ),
    (
        "input_schema not an object",
        support_ticket,
        _set(["input_schema"], 5),
        "input_schema",
        ["must be object or boolean"],
    ),
    # subworkflow names a known workflow
    (
        "unknown subworkflow",
        every_kind,
        _set(["steps", 9, "workflow"], "nobody"),
        "steps[9].workflow",
        ["unknown workflow 'nobody'"],
    ),
    (
        "unknown subworkflow version",
        every_kind,
        lambda d: d["steps"][9].update({"workflow": "billing", "version": 7}),
        "steps[9].version",
        ["no version 7"],
    ),
    # kinds' own rules
    (
        "recipe gives recipe and prompt",
        every_kind,
        _set(["steps", 1, "recipe"], "summary"),
        "steps[1].prompt",
        ["exactly one of", "not both"],
    ),
    (
        "recipe gives neither recipe nor prompt",
        every_kind,
        lambda d: d["steps"][1].pop("prompt"),
        "steps[1]",
        ["exactly one of"],
    ),
    (
        "quorum over approvers",
        every_kind,
        lambda d: d["steps"][5].update({"approvers": {"users": ["ada"]}, "quorum": 2}),
        "steps[5].quorum",
        ["quorum 2"],
    ),
    # (Without its output, which would read a step that is no longer there.)
    (
        "empty steps",
        support_ticket,
        lambda d: d.update(steps=[]) or d.pop("output"),
        "steps",
        ["should be non-empty"],
    ),
    ("document not an object", lambda: [], lambda d: None, "body", ["JSON object"]),
]


def test_bases_are_valid() -> None:
    assert validate_document(support_ticket(), workflow_exists=known) == []
    assert validate_document(every_kind(), workflow_exists=known) == []


@pytest.mark.parametrize(
    ("rule", "base", "mutate", "field", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_rule(
    rule: str, base: Callable[[], Doc], mutate: Callable[[Doc], None], field: str, words: list[str]
) -> None:
    doc = base()
    mutate(doc)
    errors = validate_document(doc, workflow_exists=known)
    assert errors, f"{rule}: accepted"
    matching = [e for e in errors if e.field == field]
    assert matching, f"{rule}: no error at {field}: {errors}"
    assert any(all(w in e.message for w in words) for e in matching), matching
    # The document breaks only this rule: every error is about the same place.
    prefix = field.split(".")[0].split("[")[0]
    assert all((e.field or "").startswith(prefix) for e in errors), errors


def test_every_problem_is_reported_at_once() -> None:
    doc = support_ticket()
    doc["steps"][0]["colour"] = "red"
    doc["steps"][1]["id"] = "Draft"
    doc["limits"]["run_timeout_ms"] = -5
    fields = {e.field for e in validate_document(doc)}
    assert {"steps[0].colour", "steps[1].id", "limits.run_timeout_ms"} <= fields


def test_prepare_translates_legacy_syntax_before_checking() -> None:
    doc = support_ticket()
    doc["steps"][1]["input"] = {"kind": "{{step.classify.kind}}", "t": "{{workflow_input.ticket}}"}
    prepared = prepare_document(doc, workflow_exists=known)
    assert prepared["steps"][1]["input"] == {
        "kind": "${steps.classify.output.kind}",
        "t": "${input.ticket}",
    }


def test_prepare_rejects_legacy_reference_to_a_later_step() -> None:
    doc = support_ticket()
    doc["steps"][1]["input"] = "{{step.send.sent}}"
    with pytest.raises(InvalidDocument) as caught:
        prepare_document(doc, workflow_exists=known)
    assert caught.value.errors[0].field == "steps[1].input"


def test_field_path_formats_indexes_and_keys() -> None:
    assert field_path(["steps", 2, "when", "path"]) == "steps[2].when.path"
    assert field_path([]) == ""


def test_self_recursion_is_allowed_without_lookup() -> None:
    doc = {"id": "me", "steps": [{"id": "again", "kind": "subworkflow", "workflow": "me"}]}
    assert validate_document(doc, workflow_exists=lambda *_: False) == []


def test_shape_errors_and_cross_references_come_in_one_answer() -> None:
    """A user fixing a document sees every problem at once: an unknown field (the schema)
    beside a duplicate id, a read of a later step and a bad foreach path (the walk)."""
    doc = support_ticket()
    doc["steps"][0]["colour"] = "red"
    doc["steps"][2]["id"] = "classify"
    doc["steps"][1]["input"] = {"kind": "${steps.send.output.sent}"}
    doc["steps"].append({"id": "each", "kind": "foreach", "items": "hits", "do": 7})
    errors = {e.field: e.message for e in validate_document(doc, workflow_exists=known)}
    assert "unknown field 'colour'" in errors["steps[0].colour"]
    assert "duplicate step id 'classify'" in errors["steps[2].id"]
    assert "not declared before" in errors["steps[1].input.kind"]
    assert "path template" in errors["steps[4].items"]
    assert "steps[4].do" in errors  # the schema: a body is a step or a list of steps


@pytest.mark.parametrize(
    "broken",
    [
        {"id": "x", "kind": "condition", "if": "yes", "then": "no", "else": 3},
        {"id": "x", "kind": "parallel", "branches": ["a"]},
        {"id": "x", "kind": "foreach", "items": {"a": 1}, "do": [1, None, {"id": 5}]},
        {"id": "x", "kind": "loop", "do": {"kind": "task"}, "until": [1]},
        {"id": "x", "kind": "subworkflow", "workflow": {"$gt": ""}, "version": "1"},
        {"id": "x", "kind": "approval", "approvers": "everyone", "quorum": "all"},
        {"id": "x", "kind": "sleep", "ms": "soon", "when": {"all": 5}},
        {"id": "x", "kind": "wait_event", "event": 1, "key": {"k": []}, "timeout_ms": []},
        {"id": "x", "kind": "recipe", "context": "kb"},
        {"id": ["x"], "kind": ["task"]},
        "a step",
        None,
    ],
)
def test_a_document_of_any_shape_gets_errors_not_an_exception(broken: Any) -> None:
    doc = support_ticket()
    doc["steps"].insert(1, broken)
    doc["limits"] = {"run_timeout_ms": "long"}
    doc["input_schema"] = {"type": 12}
    doc["output"] = {"x": "${steps.x.output.y}"}
    errors = validate_document(doc, workflow_exists=known)
    assert any((e.field or "").startswith("steps[1]") for e in errors), errors
    assert any((e.field or "").startswith("input_schema") for e in errors), errors
