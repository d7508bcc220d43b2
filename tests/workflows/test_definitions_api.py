"""The definitions API (contract sections 4 and 7) over HTTP, against Postgres."""

from __future__ import annotations

import json
import threading

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from rest_framework.test import APIClient

from workflows.models import Workflow, WorkflowVersion
from workflows.schema import MAX_DURATION_MS, load_schema
from workflows.services import definition_save

from ..listening import never_contacted
from .documents import every_kind, support_ticket
from .test_validation import CASES

pytestmark = pytest.mark.django_db


def _no_version(doc):
    return {k: v for k, v in doc.items() if k != "version"}


def test_save_with_an_explicit_version_then_same_body_then_conflict(api: APIClient) -> None:
    first = api.post("/api/v1/definitions", support_ticket(), format="json")
    assert first.status_code == 201, first.json()
    assert first.json()["id"] == "support_ticket"
    assert first.json()["version"] == 3
    assert first.json()["created"] is True

    again = api.post("/api/v1/definitions", support_ticket(), format="json")
    assert again.status_code == 200
    assert again.json()["version"] == 3
    assert again.json()["created"] is False

    changed = support_ticket(description="another body")
    conflict = api.post("/api/v1/definitions", changed, format="json")
    assert conflict.status_code == 409
    assert conflict.json()["errors"][0]["field"] == "version"
    assert WorkflowVersion.objects.count() == 1


def test_omitted_version_gets_the_next_number(api: APIClient) -> None:
    api.post("/api/v1/definitions", support_ticket(), format="json")
    body = _no_version(support_ticket(description="v4"))
    response = api.post("/api/v1/definitions", body, format="json")
    assert response.status_code == 201
    assert response.json()["version"] == 4
    # The same body again, still without a version, is the version that holds it.
    again = api.post("/api/v1/definitions", body, format="json")
    assert (again.status_code, again.json()["version"]) == (200, 4)
    # A body equal to an older version is that version, not a new one.
    older = api.post("/api/v1/definitions", _no_version(support_ticket()), format="json")
    assert (older.status_code, older.json()["version"]) == (200, 3)


def test_stored_document_is_the_posted_one_with_its_version(api: APIClient, user) -> None:
    api.post("/api/v1/definitions", _no_version(support_ticket()), format="json")
    version = WorkflowVersion.objects.get()
    assert version.number == 1
    assert version.document == {**_no_version(support_ticket()), "version": 1}
    assert version.created_by == user
    assert len(version.content_hash) == 64


def test_legacy_templates_are_stored_translated(api: APIClient) -> None:
    doc = _no_version(support_ticket())
    doc["steps"][1]["input"] = {"kind": "{{step.classify.kind}}"}
    doc["steps"][2]["key"] = "{{workflow_input.ticket}}"
    assert api.post("/api/v1/definitions", doc, format="json").status_code == 201
    stored = api.get("/api/v1/definitions/support_ticket/versions/1").json()["document"]
    assert stored["steps"][1]["input"] == {"kind": "${steps.classify.output.kind}"}
    assert stored["steps"][2]["key"] == "${input.ticket}"
    # ...and the translated body is the same body as the one written in ${} syntax.
    same = api.post("/api/v1/definitions", _no_version(support_ticket()), format="json")
    assert (same.status_code, same.json()["version"]) == (200, 1)


@pytest.mark.parametrize(
    ("rule", "base", "mutate", "field", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_every_rule_is_a_400_naming_the_field(api, rule, base, mutate, field, words) -> None:
    definition_save(document={"id": "billing", "steps": [{"id": "x", "kind": "task"}]})
    doc = base()
    mutate(doc)
    response = api.post("/api/v1/definitions", doc, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()["errors"]
    assert any(e.get("field") == field and all(w in e["message"] for w in words) for e in errors)
    # Nothing is half-saved.
    assert not WorkflowVersion.objects.exclude(workflow_id="billing").exists()
    assert not Workflow.objects.exclude(id="billing").exists()


def test_duration_error_names_field_limit_and_value(api: APIClient) -> None:
    doc = support_ticket()
    doc["steps"][2]["timeout_ms"] = MAX_DURATION_MS + 1
    response = api.post("/api/v1/definitions", doc, format="json")
    assert response.status_code == 400
    [error] = response.json()["errors"]
    assert error["field"] == "steps[2].timeout_ms"
    assert "315360000000" in error["message"] and "315360000001" in error["message"]


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"{not json", "application/json"),
        (b"", "application/json"),
        (b"\xff\xfe\x00garbage", "application/json"),
        (b"[1, 2, 3]", "application/json"),
        (b'"a string"', "application/json"),
        (b"null", "application/json"),
        (b'{"id": "x", "steps": "nope"}', "application/json"),
        (b'{"id": 1e999, "steps": []}', "application/json"),
        (b"id=x", "application/x-www-form-urlencoded"),
        (b"<xml/>", "text/xml"),
    ],
)
def test_any_bytes_get_a_4xx_naming_the_problem(
    api: APIClient, body: bytes, content_type: str
) -> None:
    response = api.generic("POST", "/api/v1/definitions", body, content_type=content_type)
    assert 400 <= response.status_code < 500, response.content
    errors = response.json()["errors"]
    assert errors and all(e["message"] for e in errors)
    assert not Workflow.objects.exists()


def test_a_body_over_the_size_limit_is_refused(api: APIClient, settings) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    doc = support_ticket(description="x" * 4096)
    response = api.generic(
        "POST", "/api/v1/definitions", json.dumps(doc), content_type="application/json"
    )
    assert response.status_code == 413
    assert response.json() == {
        "errors": [
            {"field": "body", "message": "is larger than 2048 bytes (DJFLOW_MAX_BODY_BYTES)"}
        ]
    }
    assert not Workflow.objects.exists()


def test_list_is_cursor_paginated(api: APIClient) -> None:
    for n in range(5):
        definition_save(document={"id": f"wf_{n}", "steps": [{"id": "a", "kind": "task"}]})
    seen, cursor = [], None
    while True:
        url = "/api/v1/definitions?limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = api.get(url).json()
        assert set(page) == {"results", "next"}
        seen += [row["id"] for row in page["results"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == [f"wf_{n}" for n in range(5)]
    row = api.get("/api/v1/definitions").json()["results"][0]
    assert row["latest_version"] == 1


def test_a_bad_cursor_is_a_4xx(api: APIClient) -> None:
    response = api.get("/api/v1/definitions?cursor=%%%garbage")
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "cursor"


def test_read_a_workflow_and_its_versions(api: APIClient) -> None:
    definition_save(document=_no_version(support_ticket()))
    definition_save(document=_no_version(support_ticket(description="second")))
    detail = api.get("/api/v1/definitions/support_ticket").json()
    assert detail["id"] == "support_ticket"
    assert detail["latest_version"] == 2
    assert [v["version"] for v in detail["versions"]] == [2, 1]
    assert detail["document"]["description"] == "second"
    v1 = api.get("/api/v1/definitions/support_ticket/versions/1").json()
    assert v1["version"] == 1
    assert v1["document"] == {**_no_version(support_ticket()), "version": 1}


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("/api/v1/definitions/nope", "id"),
        ("/api/v1/definitions/support_ticket/versions/9", "version"),
        ("/api/v1/definitions/nope/versions/1", "workflow"),
        ("/api/v1/definitions/support_ticket/versions/one", "version"),
        ("/api/v1/definitions/support_ticket/versions/0", "version"),
        ("/api/v1/definitions/support_ticket/versions/%C2%B9", "version"),
        ("/api/v1/definitions/support_ticket/versions/99999999999999999999", "version"),
        # More digits than int() reads (4,300): a 404 still, not a ValueError's 500.
        ("/api/v1/definitions/support_ticket/versions/" + "9" * 5000, "version"),
    ],
)
def test_unknown_things_are_json_404s(api: APIClient, url: str, field: str) -> None:
    definition_save(document=_no_version(support_ticket()))
    response = api.get(url)
    assert response.status_code == 404
    assert response.json()["errors"][0]["field"] == field


def test_unknown_api_route_is_a_json_404(api: APIClient) -> None:
    response = api.get("/api/v1/nothing/here")
    assert response.status_code == 404
    assert response.json() == {"errors": [{"message": "not found"}]}


def test_authentication_is_required(anon_api: APIClient) -> None:
    for method, url in [("get", "/api/v1/definitions"), ("post", "/api/v1/definitions")]:
        response = getattr(anon_api, method)(url, {}, format="json")
        assert response.status_code == 401
        assert response.json()["errors"][0]["message"]
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    assert bad.get("/api/v1/definitions").status_code == 401


def test_session_authentication_works_with_csrf(user) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.get("/api/v1/definitions").status_code == 200
    # A session-authenticated write without the CSRF token is refused, as JSON.
    response = client.post("/api/v1/definitions", support_ticket(), format="json")
    assert response.status_code == 403
    assert response.json()["errors"][0]["message"]


def test_wrong_method_is_a_json_405(api: APIClient) -> None:
    response = api.delete("/api/v1/definitions/support_ticket")
    assert response.status_code == 405
    assert response.json()["errors"][0]["message"]


def test_definition_schema_is_served_publicly(anon_api: APIClient) -> None:
    response = anon_api.get("/api/v1/definition.schema.json")
    assert response.status_code == 200
    assert json.loads(response.content) == load_schema()
    kinds = set(load_schema()["$defs"]["step"]["properties"]["kind"]["enum"])
    assert kinds == {
        "task",
        "agent",
        "recipe",
        "sleep",
        "sleep_until",
        "wait_event",
        "approval",
        "parallel",
        "foreach",
        "loop",
        "subworkflow",
        "condition",
        "write_kb",
        "handoff",
        "mcp_tool",
        "http",
    }


def test_openapi_and_swagger_are_served(api: APIClient) -> None:
    schema = api.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = json.loads(schema.content)["paths"]
    assert "/api/v1/definitions" in paths
    assert "/api/v1/definitions/{workflow_id}/versions/{version}" in paths
    docs = api.get("/api/v1/docs/")
    assert docs.status_code == 200
    assert b"swagger" in docs.content.lower()


def test_every_kind_document_round_trips(api: APIClient, settings, user) -> None:
    # Its approval mails boss@example.com: a domain anyone may name, here; and a group and a
    # hand-off's group, which needs approvals.mail_users (issue 36).
    settings.DJFLOW = {**settings.DJFLOW, "APPROVER_EMAIL_DOMAINS": ["example.com"]}
    user.user_permissions.add(Permission.objects.get(codename="mail_users"))
    response = api.post("/api/v1/definitions", every_kind(), format="json")
    assert response.status_code == 201, response.json()
    stored = api.get("/api/v1/definitions/every_kind/versions/1").json()["document"]
    assert stored == {**every_kind(), "version": 1}


@pytest.mark.django_db(transaction=True)
def test_concurrent_saves_of_the_next_version_never_share_a_number() -> None:
    """Eight threads, each on its own Postgres connection, save different bodies at once."""
    assert connection.vendor == "postgresql"
    definition_save(document={"id": "race", "steps": [{"id": "a", "kind": "task"}]})
    barrier = threading.Barrier(8)
    results: list[int] = []
    failures: list[BaseException] = []

    def save(n: int) -> None:
        try:
            barrier.wait()
            doc = {"id": "race", "description": f"body {n}", "steps": [{"id": "a", "kind": "task"}]}
            results.append(definition_save(document=doc).version.number)
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=save, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert sorted(results) == list(range(2, 10))
    assert WorkflowVersion.objects.filter(workflow_id="race").count() == 9


@pytest.mark.django_db(transaction=True)
def test_concurrent_saves_of_a_new_workflow_and_same_explicit_version() -> None:
    """The first save of a workflow races safely; the same explicit version: one 201, rest 200."""
    barrier = threading.Barrier(6)
    created: list[bool] = []
    failures: list[BaseException] = []
    doc = {"id": "fresh", "version": 1, "steps": [{"id": "a", "kind": "task"}]}

    def save() -> None:
        try:
            barrier.wait()
            created.append(definition_save(document=doc).created)
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=save) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert sorted(created) == [False] * 5 + [True]
    assert WorkflowVersion.objects.filter(workflow_id="fresh").count() == 1


@pytest.mark.parametrize("depth", [101, 5000])
def test_json_nested_too_deep_is_a_400(api: APIClient, depth: int) -> None:
    nested = '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)
    raw = '{"id": "deep", "steps": [{"id": "a", "kind": "task", "input": ' + nested + "}]}"
    response = api.generic("POST", "/api/v1/definitions", raw, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        {"field": "body", "message": "JSON nested more than 100 levels deep"}
    ]
    assert not Workflow.objects.exists()


def test_a_nul_character_is_a_400_naming_its_place(api: APIClient) -> None:
    raw = (
        '{"id": "nul", "description": "a\\u0000b",'
        ' "steps": [{"id": "a", "kind": "task", "input": {"k\\u0000": 1}}]}'
    )
    response = api.generic("POST", "/api/v1/definitions", raw, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        {"field": "description", "message": "a string may not contain the character \\u0000"},
        {"field": "steps[0].input", "message": "a key may not contain the character \\u0000"},
    ]
    assert not Workflow.objects.exists()


def test_a_remote_ref_in_input_schema_is_a_400_and_never_fetched(api: APIClient) -> None:
    document = support_ticket()
    with never_contacted() as ref:
        document["input_schema"]["properties"]["x"] = {"$ref": ref}
        response = api.post("/api/v1/definitions", document, format="json")
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == ["input_schema.properties.x.$ref"]
    assert not WorkflowVersion.objects.exists()
