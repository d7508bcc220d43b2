"""What a saved ``input_schema`` may make the server do, and what its refusals may say
(security review of the start page, issue 37; contract sections 8 and 9):

- a chain of ``allOf``s naming one ``$ref`` twice doubles the work at each link (18 links:
  7 s of a web worker for one start, 30 links: hours); a ``$ref`` that leads back to itself
  without descending into the value raised RecursionError, a 500 at every start. Both are
  refused at save, naming the place, and a version stored before is refused at start, fast;
- a secret in an ``anyOf`` branch the value fails was quoted back in the 400's message;
- ``writeOnly`` under ``contains`` (and the like) was stored in the clear: refused at save;
- a form body in another charset than UTF-8 carried a lone surrogate into the database."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from tests.approvals.builders import make_user
from workflows import access
from workflows.input_schema import MAX_IN_PLACE_EVALUATIONS, cost_problems, schema_errors
from workflows.models import WorkflowVersion
from workflows.services import definition_save

SECRET = "HUNTER2-one-secret"


def _doubling(links: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"a{i}": {"allOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]}
        for i in range(links)
    }
    defs[f"a{links}"] = {"type": "string", "minLength": 1}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/a0"}}, "$defs": defs}


LOOP = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/x"}},
    "$defs": {"x": {"$ref": "#/$defs/x"}},
}


def test_a_doubling_chain_is_refused_naming_where_and_a_short_one_is_not() -> None:
    assert cost_problems(_doubling(6)) == []  # about 2**8 evaluations: fine
    (problem,) = schema_errors(_doubling(30), "input_schema")
    assert problem[0].startswith("input_schema.") and str(MAX_IN_PLACE_EVALUATIONS) in problem[1]


@pytest.mark.parametrize(
    "schema",
    [
        LOOP,
        {"$ref": "#"},
        {"allOf": [{"$ref": "#/$defs/y"}], "$defs": {"y": {"anyOf": [{"$ref": "#"}]}}},
    ],
)
def test_a_ref_that_leads_back_in_place_is_refused(schema: dict[str, Any]) -> None:
    problems = schema_errors(schema, "input_schema")
    assert any("never end" in message for _, message in problems), problems


def test_recursion_through_the_value_and_long_chains_are_fine() -> None:
    tree = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
    }
    chain = {
        "$ref": "#/$defs/c0",
        "$defs": {f"c{i}": {"$ref": f"#/$defs/c{i + 1}"} for i in range(400)},
    }
    chain["$defs"]["c400"] = {"type": "string"}
    assert schema_errors(tree, "input_schema") == []
    assert cost_problems(chain) == []  # 401 links in place, each once
    # Deeper than Python's stack: counted without recursion, and refused as too costly.
    deep = {
        "$ref": "#/$defs/c0",
        "$defs": {f"c{i}": {"$ref": f"#/$defs/c{i + 1}"} for i in range(5000)},
    }
    deep["$defs"]["c5000"] = {"type": "string"}
    assert "evaluates more than" in cost_problems(deep)[0][1]


@pytest.mark.django_db
def test_the_api_refuses_them_at_save_and_at_start_of_a_version_stored_before(api) -> None:
    for schema in (_doubling(30), LOOP):
        body = {"id": "costly", "input_schema": schema, "steps": [{"id": "s", "kind": "task"}]}
        answer = api.post("/api/v1/definitions", body, format="json")
        assert answer.status_code == 400, answer.content
        assert answer.json()["errors"][0]["field"].startswith("input_schema")
    # A version saved before the rule: its starts are refused at once, naming input.
    version = definition_save(
        document={"id": "costly", "steps": [{"id": "s", "kind": "task"}]}
    ).version
    for schema in (_doubling(30), LOOP):
        WorkflowVersion.objects.filter(id=version.id).update(
            document={**version.document, "input_schema": schema}
        )
        started = time.monotonic()
        answer = api.post(
            "/api/v1/runs", {"workflow": "costly", "input": {"a": "xx"}}, format="json"
        )
        assert time.monotonic() - started < 5
        assert answer.status_code == 400, answer.content
        assert answer.json()["errors"][0]["field"] == "input"


def test_write_only_under_contains_is_refused_at_save() -> None:
    schema = {
        "type": "object",
        "properties": {"k": {"type": "array", "contains": {"type": "string", "writeOnly": True}}},
    }
    (problem,) = schema_errors(schema, "input_schema")
    assert problem[0] == "input_schema.properties.k.contains.writeOnly"
    assert "contains" in problem[1]


@pytest.mark.django_db
def test_a_secret_in_a_failed_branch_is_not_quoted_back(api) -> None:
    schema = {
        "type": "object",
        "properties": {
            "k1": {
                "anyOf": [
                    {"type": "string", "writeOnly": True, "minLength": 30},
                    {"type": "integer"},
                ]
            }
        },
    }
    body = {"id": "branchy", "input_schema": schema, "steps": [{"id": "s", "kind": "task"}]}
    assert api.post("/api/v1/definitions", body, format="json").status_code == 201
    answer = api.post(
        "/api/v1/runs", {"workflow": "branchy", "input": {"k1": SECRET}}, format="json"
    )
    assert answer.status_code == 400
    assert SECRET not in answer.content.decode()
    assert answer.json()["errors"][0]["field"] == "input.k1"


@pytest.mark.django_db
def test_a_form_body_in_another_charset_is_a_400_naming_it() -> None:
    definition_save(document={"id": "wt", "steps": [{"id": "s", "kind": "task"}]})
    sam = make_user("sam")
    access.grant(access.STARTER, "wt", user=sam)
    client = Client()
    client.force_login(sam)
    body = b'--BB\r\nContent-Disposition: form-data; name="input"\r\n\r\n"a\\ud800b"\r\n--BB--\r\n'
    answer = client.generic(
        "POST",
        "/workflows/wt/start",
        body,
        content_type="multipart/form-data; boundary=BB; charset=unicode_escape",
    )
    assert answer.status_code == 400
    assert b"Content-Type" in answer.content
