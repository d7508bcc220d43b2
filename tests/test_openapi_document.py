"""The OpenAPI document says what the server accepts and answers (issue 37, deliverable 3):
each disagreement schemathesis found, fixed on the side the contract says was wrong.
tests/test_api_fuzz.py holds the whole API to the document with every check."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission
from rest_framework.test import APIClient

from workflows.models import Recipe
from workflows.services import definition_save, recipe_save

from .workflows.documents import support_ticket


@pytest.fixture
def document(api: APIClient) -> dict[str, Any]:
    return api.get("/api/v1/schema/?format=json").json()


def _operations(document: dict[str, Any]):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield f"{method.upper()} {path}", operation


def _request_schema(document: dict[str, Any], label: str) -> dict[str, Any]:
    operation = dict(_operations(document))[label]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    ref = schema.get("$ref")
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


@pytest.mark.django_db
def test_every_operation_documents_the_statuses_of_the_layers_before_its_view(document) -> None:
    for label, operation in _operations(document):
        answers = operation["responses"]
        # gunicorn's 414 (its HTML page), the throttles' 429 and the database's 503.
        assert {"406", "414", "429", "503"} <= set(answers), label
        assert "text/html" in answers["414"]["content"], label
        assert "Retry-After" in answers["429"]["headers"], label
        if "requestBody" in operation:
            assert {"400", "413", "415"} <= set(answers), label
        if operation.get("parameters"):
            assert "400" in answers, label


@pytest.mark.django_db
def test_bodies_that_refuse_unknown_fields_say_so(document) -> None:
    for label in (
        "POST /api/v1/runs",
        "POST /api/v1/events",
        "POST /api/v1/runs/cancel",
        "POST /api/v1/runs/{run_id}/retry",
        "POST /api/v1/runs/{run_id}/steps/{step_run_id}/resolve",
        "POST /api/v1/approvals/{approval_id}/reject",
        "POST /api/v1/schedules",
        "POST /api/v1/definitions",
        "POST /api/v1/recipes",
    ):
        assert _request_schema(document, label)["additionalProperties"] is False, label
    definition = _request_schema(document, "POST /api/v1/definitions")
    assert definition["required"] == ["id", "steps"]
    assert _request_schema(document, "POST /api/v1/recipes")["required"] == ["name", "prompt"]


@pytest.mark.django_db
def test_rules_across_fields_are_in_the_document(document) -> None:
    schedule = _request_schema(document, "POST /api/v1/schedules")
    assert [branch["required"] for branch in schedule["oneOf"]] == [["cron"], ["every_ms"]]
    cancel = _request_schema(document, "POST /api/v1/runs/cancel")
    assert {"completed", "failed"}.isdisjoint(cancel["properties"]["status"]["enum"])
    assert len(cancel["anyOf"]) == 5
    retry = _request_schema(document, "POST /api/v1/runs/retry")
    assert retry["properties"]["status"]["enum"] == ["failed"]
    resolve = _request_schema(document, "POST /api/v1/runs/{run_id}/steps/{step_run_id}/resolve")
    assert [b["properties"]["outcome"]["enum"] for b in resolve["oneOf"]] == [
        ["succeeded"],
        ["failed"],
    ]


@pytest.mark.django_db
def test_limit_has_the_bounds_the_server_keeps_and_links_follow_a_start(document) -> None:
    operations = dict(_operations(document))
    for label, most in (("GET /api/v1/runs", 500), ("GET /api/v1/runs/{run_id}/steps", 1000)):
        (limit,) = [p for p in operations[label]["parameters"] if p["name"] == "limit"]
        assert (limit["schema"]["minimum"], limit["schema"]["maximum"]) == (1, most)
    links = operations["POST /api/v1/runs"]["responses"]["201"]["links"]
    assert links["runs_read"] == {
        "operationId": "runs_read",
        "parameters": {"run_id": "$response.body#/id"},
    }


@pytest.mark.django_db
def test_a_schedules_enabled_is_a_json_boolean(api: APIClient) -> None:
    definition_save(document={k: v for k, v in support_ticket().items() if k != "version"})
    body = {"workflow": "support_ticket", "input": {"ticket": "x"}, "cron": "0 2 * * *"}
    for enabled in (0, 1, "false", "off"):
        answer = api.post("/api/v1/schedules", {**body, "enabled": enabled}, format="json")
        assert answer.status_code == 400, answer.json()
        assert [e["field"] for e in answer.json()["errors"]] == ["enabled"]
    assert (
        api.post("/api/v1/schedules", {**body, "enabled": False}, format="json").status_code == 201
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/api/v1/runs?workflow=", "workflow"),
        ("/api/v1/runs?status=", "status"),
        ("/api/v1/approvals?status=", "status"),
        ("/api/v1/schedules?workflow=", "workflow"),
    ],
)
def test_an_empty_query_parameter_is_a_400_naming_it(api: APIClient, path: str, name: str) -> None:
    answer = api.get(path)
    assert answer.status_code == 400, answer.json()
    assert [e["field"] for e in answer.json()["errors"]] == [name]


@pytest.mark.django_db
def test_no_version_after_the_largest_is_a_409_not_a_500(api: APIClient, user) -> None:
    """The fuzz saved recipe 'a' as version 2147483647, then 'a' again without a version:
    the next number overflowed the column (a 500)."""
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_recipe", "change_recipe"])
    )
    recipe_save(document={"name": "a", "version": 2_147_483_647, "prompt": "x"})
    answer = api.post("/api/v1/recipes", {"name": "a", "prompt": "y"}, format="json")
    assert answer.status_code == 409, answer.json()
    assert [e["field"] for e in answer.json()["errors"]] == ["version"]
    assert Recipe.objects.filter(name="a").count() == 1
    document = {k: v for k, v in support_ticket().items() if k != "version"}
    definition_save(document={**document, "version": 2_147_483_647})
    again = api.post("/api/v1/definitions", {**document, "description": "new"}, format="json")
    assert again.status_code == 409, again.json()
    assert [e["field"] for e in again.json()["errors"]] == ["version"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/runs/cancel", "/api/v1/runs/retry"])
def test_the_bulk_routes_allow_what_the_document_lists(api: APIClient, path: str) -> None:
    # GET reads a run of that name (404): not a method of this route.
    assert "GET" not in api.options(path)["Allow"]
    assert "POST" in api.options(path)["Allow"]
    assert api.get(path).status_code == 404
