"""Template and guard paths into steps whose output shape is known are checked at save
(contract sections 4 and 17, ``workflows.shapes``): a path the shape cannot have is a 400 naming
the field, wherever the template is; a path it may have, or one into an unknown shape, passes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from rest_framework.test import APIClient

from workflows import steps
from workflows.builder import workflow
from workflows.errors import InvalidDocument
from workflows.models import WorkflowVersion
from workflows.shapes import UNKNOWN, output_problem, output_shape
from workflows.steps import when
from workflows.validation import validate_document

Doc = dict[str, Any]

TRIAGE_SCHEMA: Doc = {
    "type": "object",
    "required": ["kind"],
    "additionalProperties": False,
    "properties": {
        "kind": {"enum": ["bug", "question"]},
        "urgency": {"type": "integer"},
        "meta": {"$ref": "#/$defs/meta"},
        "tags": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "additionalProperties": False,
            },
        },
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
        "answer": {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"text": {"type": "string"}},
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"refusal": {"type": "string"}},
                    "additionalProperties": False,
                },
            ]
        },
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
        "free": {"type": "object", "properties": {"a": {"type": "string"}}},
        "labels": {"type": "object", "patternProperties": {"^x_": {"type": "string"}}},
        "both": {
            "allOf": [
                {"type": "object", "properties": {"p": {"type": "string"}}},
                {"type": "object", "properties": {"q": {}}, "additionalProperties": False},
            ]
        },
        "maybe": {
            "type": ["object", "null"],
            "properties": {"z": {}},
            "additionalProperties": False,
        },
        "anything": {},
    },
    "$defs": {
        "meta": {
            "type": "object",
            "properties": {"source": {"type": "string"}, "next": {"$ref": "#/$defs/meta"}},
            "additionalProperties": False,
        }
    },
}


def document(template: Any = None, *, guard: Doc | None = None, output: Any = None) -> Doc:
    """One step of each kind whose output is known, then a task whose input is ``template``
    (and whose guard is ``guard``), and ``output`` as the document's output."""
    doc: Doc = {
        "id": "shapes",
        "steps": [
            {
                "id": "classify",
                "kind": "recipe",
                "prompt": "Sort: ${input}",
                "output": "json",
                "output_schema": copy.deepcopy(TRIAGE_SCHEMA),
            },
            {"id": "draft", "kind": "recipe", "prompt": "Answer: ${input}"},
            {"id": "loose", "kind": "recipe", "prompt": "Any: ${input}", "output": "json"},
            {"id": "stored", "kind": "recipe", "recipe": "triage"},
            {"id": "fetch", "kind": "http", "method": "GET", "url": "https://example.com/"},
            {"id": "review", "kind": "approval", "approvers": {"users": ["ann"]}},
            {"id": "keep", "kind": "write_kb", "kb": "notes", "key": "k", "content": "c"},
            {"id": "nap", "kind": "sleep", "ms": 1},
            {"id": "event", "kind": "wait_event", "event": "go", "key": "k"},
            {"id": "tool", "kind": "task"},
            {
                "id": "each",
                "kind": "foreach",
                "items": "${steps.classify.output.tags}",
                "do": {
                    "id": "reply",
                    "kind": "recipe",
                    "prompt": "p",
                    "output": "json",
                    "output_schema": {
                        "type": "object",
                        "properties": {"ok": {}},
                        "additionalProperties": False,
                    },
                },
            },
            {
                "id": "fan",
                "kind": "parallel",
                "branches": {
                    "left": {
                        "id": "left_call",
                        "kind": "http",
                        "method": "GET",
                        "url": "https://example.com/l",
                    },
                    "right": [
                        {"id": "right_a", "kind": "task"},
                        {"id": "right_b", "kind": "sleep", "ms": 1},
                    ],
                },
            },
            {
                "id": "settled",
                "kind": "parallel",
                "mode": "all_settled",
                "branches": {"only": {"id": "only_call", "kind": "recipe", "prompt": "p"}},
            },
            {
                "id": "again",
                "kind": "loop",
                "max_iterations": 3,
                "do": {"id": "again_review", "kind": "approval", "approvers": {"users": ["ann"]}},
            },
            {
                "id": "pick",
                "kind": "condition",
                "if": {"path": "input.x", "op": "exists"},
                "then": [
                    {
                        "id": "pick_fetch",
                        "kind": "http",
                        "method": "GET",
                        "url": "https://example.com/p",
                    }
                ],
                "else": [
                    {"id": "pick_review", "kind": "approval", "approvers": {"users": ["ann"]}}
                ],
            },
            {
                "id": "half",
                "kind": "condition",
                "if": {"path": "input.x", "op": "exists"},
                "then": [
                    {
                        "id": "half_keep",
                        "kind": "write_kb",
                        "kb": "notes",
                        "key": "k",
                        "content": "c",
                    }
                ],
            },
            {"id": "use", "kind": "task"},
        ],
    }
    if template is not None:
        doc["steps"][-1]["input"] = {"value": template}
    if guard is not None:
        doc["steps"][-1]["when"] = guard
    if output is not None:
        doc["output"] = output
    return doc


def errors_of(doc: Doc) -> list[tuple[str | None, str]]:
    return [(e.field, e.message) for e in validate_document(doc)]


def test_the_base_document_is_valid() -> None:
    assert errors_of(document()) == []


ALLOWED = [
    # a JSON recipe's output_schema
    "steps.classify.output",
    "steps.classify.output.kind",
    "steps.classify.output.urgency",
    "steps.classify.output.meta.source",
    "steps.classify.output.meta.next.next.source",  # a $ref that refers to itself
    "steps.classify.output.tags.0.name",
    "steps.classify.output.tags.12",
    "steps.classify.output.pair.0",
    "steps.classify.output.pair.1",
    "steps.classify.output.answer.text",  # oneOf: the first alternative has it
    "steps.classify.output.answer.refusal",  # oneOf: the second has it
    "steps.classify.output.extra.anything",  # additionalProperties: a schema
    "steps.classify.output.free.b.c",  # additional properties allowed: anything
    "steps.classify.output.labels.x_colour",  # patternProperties
    "steps.classify.output.labels.other",  # no additionalProperties: allowed
    "steps.classify.output.both.q",
    "steps.classify.output.maybe.z",
    "steps.classify.output.anything.deep.0.down",
    # what no shape is known of
    "steps.loose.output.anything.at.all",
    "steps.stored.output.colour",
    "steps.fetch.output.body.any.thing",
    "steps.event.output.payload.x",
    "steps.tool.output.x.0.y",
    # fixed shapes
    "steps.fetch.output.status",
    "steps.fetch.output.headers.content-type",
    "steps.review.output.decision",
    "steps.review.output.by",
    "steps.review.output.comment",
    "steps.keep.output.version",
    # composite steps
    "steps.each.output.0.ok",
    "steps.fan.output.left.status",
    "steps.fan.output.right",  # a body of several steps: its last step's output (null)
    "steps.settled.output.only.status",
    "steps.settled.output.only.error.class",
    "steps.again.output.decision",
    "steps.pick.output.status",  # the then branch's http
    "steps.pick.output.decision",  # the else branch's approval
    "steps.half.output.kb",
]


@pytest.mark.parametrize("path", ALLOWED)
def test_a_path_the_shape_may_have_passes(path: str) -> None:
    assert errors_of(document(f"${{{path}}}")) == []


REFUSED = [
    (
        "steps.classify.output.colour",
        "recipe step 'classify''s output_schema has no property "
        "'colour' (it has: kind, urgency, meta, tags, pair, answer, extra, free, labels, both, "
        "maybe, anything)",
    ),
    ("steps.classify.output.kind.name", "at output.kind is a string"),
    ("steps.classify.output.urgency.0", "at output.urgency is an integer"),
    (
        "steps.classify.output.meta.colour",
        "at output.meta has no property 'colour' (it has: source, next)",
    ),
    ("steps.classify.output.meta.next.colour", "at output.meta.next has no property 'colour'"),
    ("steps.classify.output.tags.name", "at output.tags is an array; index it with a number"),
    (
        "steps.classify.output.tags.0.colour",
        "at output.tags.0 has no property 'colour' (it has: name)",
    ),
    ("steps.classify.output.pair.0.x", "at output.pair.0 is a string"),
    (
        "steps.classify.output.answer.colour",
        "at output.answer has no property 'colour' (it has: text, refusal)",
    ),
    ("steps.classify.output.extra.a.b", "at output.extra.a is an integer"),
    ("steps.classify.output.both.p", "at output.both has no property 'p' (it has: q)"),
    ("steps.classify.output.maybe.y", "at output.maybe has no property 'y' (it has: z)"),
    ("steps.draft.output.text", "text recipe step 'draft''s output is a string"),
    (
        "steps.fetch.output.code",
        "http step 'fetch''s output has no property 'code' (it has: status, headers, body)",
    ),
    ("steps.fetch.output.status.x", "at output.status is an integer"),
    (
        "steps.fetch.output.headers.Content-Type",
        "lower-case header names only: read 'content-type'",
    ),
    ("steps.fetch.output.headers.etag.x", "at output.headers.etag is a string"),
    (
        "steps.review.output.verdict",
        "approval step 'review''s output has no property 'verdict' (it has: decision, by, comment)",
    ),
    ("steps.review.output.decision.x", "at output.decision is a string"),
    ("steps.keep.output.title", "write_kb step 'keep''s output has no property 'title'"),
    ("steps.nap.output.x", "sleep step 'nap''s output is null"),
    ("steps.each.output.first", "foreach step 'each''s output is an array; index it with a number"),
    ("steps.each.output.0.colour", "at output.0 has no property 'colour' (it has: ok)"),
    (
        "steps.fan.output.middle",
        "parallel step 'fan''s output has no branch 'middle' (it has: left, right)",
    ),
    ("steps.fan.output.left.code", "at output.left has no property 'code'"),
    ("steps.fan.output.right.x", "at output.right is null"),
    (
        "steps.settled.output.only.result",
        "at output.only has no property 'result' (it has: status, output, error)",
    ),
    ("steps.settled.output.only.output.x", "at output.only.output is a string"),
    ("steps.again.output.verdict", "loop step 'again''s output has no property 'verdict'"),
    (
        "steps.pick.output.colour",
        "condition step 'pick''s output has no property 'colour' (it "
        "has: status, headers, body, decision, by, comment)",
    ),
    ("steps.half.output.title", "has no property 'title'"),
]


@pytest.mark.parametrize(("path", "words"), REFUSED, ids=[p for p, _ in REFUSED])
def test_a_path_the_shape_cannot_have_is_refused_naming_the_field(path: str, words: str) -> None:
    [(field, message)] = errors_of(document(f"${{{path}}}"))
    assert field == "steps[16].input.value"
    assert message.startswith(f"'{path}': ")
    assert words in message


@pytest.mark.parametrize(
    ("place", "expected_field"),
    [
        ("input", "steps[16].input.value"),
        ("embedded", "steps[16].input.value"),
        ("guard", "steps[16].when.path"),
        ("nested guard", "steps[16].when.any[1].not.path"),
        ("output", "output.colour"),
        ("http url", "steps[17].url"),
        ("approval message", "steps[17].message"),
        ("foreach items", "steps[17].items"),
        ("loop until", "steps[17].until.path"),
        ("condition if", "steps[17].if.path"),
        ("inside a body", "steps[17].do.input.value"),
        ("on_failure", "on_failure[0].input.value"),
    ],
)
def test_every_place_a_template_can_be_is_checked(place: str, expected_field: str) -> None:
    bad, good = "steps.classify.output.colour", "steps.classify.output.kind"
    for path, refused in ((bad, True), (good, False)):
        ref = f"${{{path}}}"
        doc = document()
        added: Doc | None = None
        if place == "input":
            doc = document(ref)
        elif place == "embedded":
            doc = document(f"colour: {ref}!")
        elif place == "guard":
            doc = document(guard={"path": path, "op": "eq", "value": "red"})
        elif place == "nested guard":
            inner = {"not": {"path": path, "op": "exists"}}
            doc = document(guard={"any": [{"path": "input.x", "op": "exists"}, inner]})
        elif place == "output":
            doc = document(output={"colour": ref})
        elif place == "http url":
            added = {
                "id": "late",
                "kind": "http",
                "method": "GET",
                "url": f"https://example.com/{ref}",
            }
        elif place == "approval message":
            added = {
                "id": "late",
                "kind": "approval",
                "approvers": {"users": ["ann"]},
                "message": f"Colour {ref}?",
            }
        elif place == "foreach items":
            added = {
                "id": "late",
                "kind": "foreach",
                "items": ref,
                "do": {"id": "late_do", "kind": "task"},
            }
        elif place == "loop until":
            added = {
                "id": "late",
                "kind": "loop",
                "max_iterations": 2,
                "do": {"id": "late_do", "kind": "task"},
                "until": {"path": path, "op": "exists"},
            }
        elif place == "condition if":
            added = {
                "id": "late",
                "kind": "condition",
                "if": {"path": path, "op": "exists"},
                "then": [{"id": "late_do", "kind": "task"}],
            }
        elif place == "inside a body":
            added = {
                "id": "late",
                "kind": "loop",
                "max_iterations": 2,
                "do": {"id": "late_do", "kind": "task", "input": {"value": ref}},
            }
        elif place == "on_failure":
            doc["on_failure"] = [{"id": "late", "kind": "task", "input": {"value": ref}}]
        if added is not None:
            doc["steps"].append(added)
        found = errors_of(doc)
        if place == "foreach items" and not refused:
            # kind is a string, not an array: only the items' own check may speak, not ours.
            assert all("output_schema" not in message for _, message in found)
            continue
        if refused:
            assert [field for field, _ in found] == [expected_field], found
            assert "has no property 'colour'" in found[0][1]
        else:
            assert found == [], found


def test_every_bad_path_is_reported_at_once() -> None:
    doc = document(
        {"a": "${steps.classify.output.colour}", "b": "${steps.fetch.output.code}"},
        output={"x": "${steps.review.output.verdict}"},
    )
    assert [field for field, _ in errors_of(doc)] == [
        "steps[16].input.value.a",
        "steps[16].input.value.b",
        "output.x",
    ]


def test_a_schema_that_refers_to_itself_only_is_anything() -> None:
    for schema in (
        {"$ref": "#"},
        {"$ref": "#", "type": "object"},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    ):
        shape = output_shape(
            {"kind": "recipe", "prompt": "p", "output": "json", "output_schema": schema}
        )
        assert output_problem(shape, ["a", "b", "c"], "x", str) is None


def test_a_false_schema_allows_nothing_and_true_anything() -> None:
    schema = {"type": "object", "properties": {"gone": False, "any": True}}
    shape = output_shape(
        {"kind": "recipe", "prompt": "p", "output": "json", "output_schema": schema}
    )
    assert output_problem(shape, ["any", "x"], "it", str) is None
    assert output_problem(shape, ["gone", "x"], "it", str) == "it at 1 allows no value"


def test_const_enum_and_max_items_are_exact() -> None:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "fixed": {"const": {"a": 1}},
            "pick": {"enum": [{"b": 1}, [1, 2]]},
            "few": {"type": "array", "maxItems": 2},
        },
    }
    shape = output_shape(
        {"kind": "recipe", "prompt": "p", "output": "json", "output_schema": schema}
    )
    assert output_problem(shape, ["fixed", "a"], "it", str) is None
    assert "has no property 'b'" in (output_problem(shape, ["fixed", "b"], "it", str) or "")
    assert output_problem(shape, ["pick", "b"], "it", str) is None
    assert output_problem(shape, ["pick", "1"], "it", str) is None
    assert output_problem(shape, ["pick", "2"], "it", str) is not None
    assert output_problem(shape, ["few", "1"], "it", str) is None
    assert "at most 2 items" in (output_problem(shape, ["few", "2"], "it", str) or "")


def test_unknown_kinds_and_stored_recipes_are_unknown() -> None:
    assert output_shape({"kind": "my_own_kind"}) == UNKNOWN
    assert output_shape({"kind": "recipe", "recipe": "triage"}) == UNKNOWN
    assert output_shape({"kind": "subworkflow", "workflow": "w"}) == UNKNOWN
    assert output_shape({"kind": "mcp_tool"}) == UNKNOWN


def test_a_deeply_nested_path_is_cheap_and_never_raises() -> None:
    schema: Doc = {
        "type": "object",
        "properties": {"a": {"$ref": "#"}},
        "additionalProperties": False,
    }
    shape = output_shape(
        {"kind": "recipe", "prompt": "p", "output": "json", "output_schema": schema}
    )
    assert output_problem(shape, ["a"] * 5000, "it", str) is None
    assert output_problem(shape, ["a"] * 5000 + ["b"], "it", str) is not None
    alternatives: Doc = {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}
    shape = output_shape(
        {"kind": "recipe", "prompt": "p", "output": "json", "output_schema": alternatives}
    )
    assert output_problem(shape, ["a"] * 50, "it", str) is None


# --- through the API and the builder ---------------------------------------------------------


@pytest.fixture
def root_api(admin_user: Any) -> APIClient:
    """A superuser's client: the document names a stored recipe and mails a user, which need
    rights of their own (checked after the document is valid)."""
    client = APIClient()
    client.force_authenticate(admin_user)
    return client


def test_the_api_answers_400_naming_the_field(root_api: APIClient) -> None:
    api = root_api
    doc = document(
        {"a": "${steps.classify.output.colour}"},
        guard={"path": "steps.review.output.verdict", "op": "exists"},
        output={"colour": "${steps.draft.output.colour}"},
    )
    response = api.post("/api/v1/definitions", doc, format="json")
    assert response.status_code == 400, response.content
    found = {e["field"]: e["message"] for e in response.json()["errors"]}
    assert set(found) == {"steps[16].when.path", "steps[16].input.value.a", "output.colour"}
    assert (
        "output_schema has no property 'colour' (it has: kind, urgency"
        in found["steps[16].input.value.a"]
    )
    assert (
        "has no property 'verdict' (it has: decision, by, comment)" in found["steps[16].when.path"]
    )
    assert "text recipe step 'draft''s output is a string" in found["output.colour"]
    assert not WorkflowVersion.objects.filter(workflow_id="shapes").exists()

    good = document(
        {"a": "${steps.classify.output.kind}"},
        guard={"path": "steps.review.output.decision", "op": "eq", "value": "approved"},
        output={"text": "${steps.draft.output}"},
    )
    saved = api.post("/api/v1/definitions", good, format="json")
    assert saved.status_code == 201, saved.content


def _triage_builder(reads: str) -> Any:
    wf = workflow("built_shapes")
    wf.add(
        steps.recipe(
            "classify", prompt="Sort: ${input}", output="json", output_schema=TRIAGE_SCHEMA
        )
    )
    wf.add(steps.task("route", input={"kind": f"${{{reads}}}"}, when=when(reads, "exists")))
    return wf


@pytest.mark.django_db
def test_the_builder_save_refuses_naming_the_field() -> None:
    with pytest.raises(InvalidDocument) as refused:
        _triage_builder("steps.classify.output.colour").save()
    assert sorted(e.field or "" for e in refused.value.errors) == [
        "steps[1].input.kind",
        "steps[1].when.path",
    ]
    assert not WorkflowVersion.objects.filter(workflow_id="built_shapes").exists()
    assert _triage_builder("steps.classify.output.kind").save().created is True
