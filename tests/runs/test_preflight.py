"""Pre-flight at start (workflows.preflight, CONTRACT section 10): a kind's ``preflight`` hook
names what would stop its step later, and ``POST /runs`` answers 400 naming each step field,
nested steps included, with nothing started."""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command

from runs.models import Run
from workflows import kinds
from workflows.models import WorkflowVersion
from workflows.preflight import preflight_errors
from workflows.services import definition_save

pytestmark = pytest.mark.django_db


def _checked(step: Mapping[str, Any], scope: Any) -> list[tuple[str, str]]:
    if step.get("target") == "missing":
        return [("target", "target 'missing' does not exist")]
    return []


@pytest.fixture(autouse=True)
def checked_kind() -> Iterator[None]:
    kinds.register(
        kinds.Kind(
            "checked",
            kinds.Role.WORKER,
            schema={"properties": {"target": {"type": "string"}}, "required": ["target"]},
            body=lambda step, workflow_id: lambda ctx, input, prior: input,
            preflight=_checked,
        )
    )
    yield
    kinds.unregister("checked")


def _save(*steps: dict[str, Any]) -> None:
    definition_save(document={"id": "preflown", "steps": list(steps)})


def test_a_failed_check_is_a_400_naming_each_field_and_nothing_starts(api: Any) -> None:
    _save(
        {"id": "a", "kind": "checked", "target": "here"},
        {"id": "b", "kind": "checked", "target": "missing"},
        {
            "id": "c",
            "kind": "foreach",
            "items": "${input.xs}",
            "do": {"id": "d", "kind": "checked", "target": "missing"},
        },
    )
    response = api.post("/api/v1/runs", {"workflow": "preflown", "input": {}}, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["errors"] == [
        {"field": "steps[1].target", "message": "target 'missing' does not exist"},
        {"field": "steps[2].do.target", "message": "target 'missing' does not exist"},
    ]
    assert not Run.objects.exists()


def test_checks_that_pass_start_the_run(api: Any) -> None:
    _save({"id": "a", "kind": "checked", "target": "here"})
    response = api.post("/api/v1/runs", {"workflow": "preflown", "input": {}}, format="json")
    assert response.status_code == 201, response.content


def test_the_run_carries_its_account_the_starters_username_by_default(api: Any, user) -> None:
    _save({"id": "a", "kind": "checked", "target": "here"})
    mine = api.post("/api/v1/runs", {"workflow": "preflown", "input": {}}, format="json")
    assert mine.json()["account"] == "ada"
    body = {"workflow": "preflown", "input": {}, "account": "team-7@acme"}
    # Another account's model slots are not a starter's to take, nor a fresh name per run
    # a way around their own limit.
    refused = api.post("/api/v1/runs", body, format="json")
    assert refused.status_code == 403, refused.content
    assert [e["field"] for e in refused.json()["errors"]] == ["account"]
    assert not Run.objects.filter(account="team-7@acme").exists()
    own = api.post("/api/v1/runs", {**body, "account": "ada"}, format="json")
    assert own.status_code == 201
    user.user_permissions.add(Permission.objects.get(codename="choose_account"))
    named = api.post("/api/v1/runs", body, format="json")
    assert named.status_code == 201, named.content
    assert named.json()["account"] == "team-7@acme"


@pytest.mark.parametrize("account", ["", "a b", "x" * 151, 7, "ünï"])
def test_a_malformed_account_is_a_400_naming_it(api: Any, account: Any) -> None:
    _save({"id": "a", "kind": "checked", "target": "here"})
    response = api.post(
        "/api/v1/runs", {"workflow": "preflown", "input": {}, "account": account}, format="json"
    )
    assert response.status_code == 400, response.content
    assert [e["field"] for e in response.json()["errors"]] == ["account"]


def test_each_check_sees_the_steps_before_it_in_the_documents_order() -> None:
    seen: list[tuple[str, list[str]]] = []

    def remember(step: Mapping[str, Any], scope: kinds.PreflightScope) -> list[tuple[str, str]]:
        seen.append((step["id"], [s["id"] for s in scope.earlier_of("checked")]))
        return []

    kinds.register(
        kinds.Kind(
            "checked",
            kinds.Role.WORKER,
            schema={"properties": {"target": {"type": "string"}}},
            body=lambda step, workflow_id: lambda ctx, input, prior: input,
            preflight=remember,
        )
    )
    document = {
        "id": "preflown",
        "steps": [
            {"id": "a", "kind": "checked", "target": "x"},
            {"id": "w", "kind": "sleep", "ms": 1},
            {
                "id": "p",
                "kind": "parallel",
                "branches": {"l": [{"id": "b", "kind": "checked", "target": "x"}]},
            },
            {"id": "c", "kind": "checked", "target": "x"},
        ],
    }
    assert preflight_errors(document) == []
    assert seen == [("a", []), ("b", ["a"]), ("c", ["a", "b"])]


# --- the same checks from the command line and on the admin's definition pages -------------


def _command(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("preflight", *args, stdout=out)
    except CommandError as error:
        return error.returncode, f"{out.getvalue()}{error}"
    return 0, out.getvalue()


def test_the_command_names_each_failed_check_and_exits_1() -> None:
    _save(
        {"id": "a", "kind": "checked", "target": "missing"},
        {"id": "b", "kind": "checked", "target": "here"},
    )
    code, out = _command("preflown")
    assert code == 1
    assert "steps[0].target: target 'missing' does not exist" in out
    assert "steps[1]" not in out
    assert "1 check(s) failed" in out
    assert not Run.objects.exists()


def test_the_command_checks_a_given_input_against_the_schema(tmp_path: Any) -> None:
    definition_save(
        document={
            "id": "preflown",
            "input_schema": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
            },
            "steps": [{"id": "a", "kind": "checked", "target": "here"}],
        }
    )
    assert _command("preflown") == (0, "preflown version 1: every check passes\n")
    code, out = _command("preflown", "--input", '{"n": "x"}')
    assert code == 1 and "input.n" in out
    assert _command("preflown", "--input", '{"n": 3}')[0] == 0
    given = tmp_path / "input.json"
    given.write_text('{"n": "y"}')
    code, out = _command("preflown", "--input-file", str(given))
    assert code == 1 and "input.n" in out


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["nothing-here"], "unknown workflow 'nothing-here'"),
        (["preflown", "--number", "9"], "has no version 9"),
        (["preflown", "--input", "{nope"], "--input: not JSON"),
        (["preflown", "--input-file", "/nonexistent/input.json"], "--input-file:"),
    ],
)
def test_the_command_refuses_what_it_cannot_check(args: list[str], said: str) -> None:
    _save({"id": "a", "kind": "checked", "target": "here"})
    code, out = _command(*args)
    assert code == 1 and said in out


def test_the_admin_shows_the_checks_on_a_definitions_pages(admin_client: Any) -> None:
    _save({"id": "a", "kind": "checked", "target": "missing"})
    page = admin_client.get("/admin/workflows/workflow/preflown/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "djflow-preflight-problems" in text
    assert "steps[0].target" in text and "target &#x27;missing&#x27; does not exist" in text
    _save({"id": "a", "kind": "checked", "target": "here"})
    version = WorkflowVersion.objects.get(workflow_id="preflown", number=2)
    page = admin_client.get(f"/admin/workflows/workflowversion/{version.pk}/change/")
    assert page.status_code == 200
    assert "Every check passes." in page.content.decode()
    assert "djflow-preflight-problems" not in page.content.decode()
