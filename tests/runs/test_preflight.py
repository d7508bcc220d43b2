"""Pre-flight at start (workflows.preflight, CONTRACT section 10): a kind's ``preflight`` hook
names what would stop its step later, and ``POST /runs`` answers 400 naming each step field,
nested steps included, with nothing started."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from django.contrib.auth.models import Permission

from runs.models import Run
from workflows import kinds
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
