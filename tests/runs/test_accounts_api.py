"""The accounts API and the run top-up (CONTRACT section 17): who may, and bad bodies."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs.models import Account
from tests.runs.factories import RunFactory, WorkflowVersionFactory, support_ticket_document

pytestmark = pytest.mark.django_db


def _client(*permissions: str) -> APIClient:
    name = "u_" + "_".join(permissions)
    person = get_user_model().objects.create_user(username=name, password="x")
    for codename in permissions:
        person.user_permissions.add(Permission.objects.get(codename=codename))
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=person)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def test_operators_set_a_budget_and_readers_see_the_engines_counters() -> None:
    writer = _client("change_account")
    answer = writer.put(
        "/api/v1/accounts/acme", {"budget_usd": 12.5, "period": "day"}, format="json"
    )
    assert answer.status_code == 200, answer.content
    assert answer.json()["budget_usd"] == 12.5 and answer.json()["period"] == "day"
    assert answer.json()["spent_usd"] == 0 and answer.json()["reserved_usd"] == 0
    reader = _client("view_account")
    listed = reader.get("/api/v1/accounts").json()["results"]
    assert [a["name"] for a in listed] == ["acme"]
    assert reader.get("/api/v1/accounts/acme").json()["budget_usd"] == 12.5
    # An account never given a budget: no budget, what its runs cost.
    RunFactory(account="other", cost_usd=Decimal("0.25"))
    other = reader.get("/api/v1/accounts/other").json()
    assert other["budget_usd"] is None and other["spent_usd"] == 0.25


def test_who_may_not_read_or_write_accounts_gets_403() -> None:
    nobody = _client()
    assert nobody.get("/api/v1/accounts").status_code == 403
    assert nobody.get("/api/v1/accounts/acme").status_code == 403
    reader = _client("view_account")
    answer = reader.put("/api/v1/accounts/acme", {"budget_usd": 1}, format="json")
    assert answer.status_code == 403
    assert not Account.objects.exists()
    assert APIClient().get("/api/v1/accounts").status_code in (401, 403)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"budget_usd": -1}, "budget_usd"),
        ({"budget_usd": "lots"}, "budget_usd"),
        # A JSON number only (the OpenAPI document says so): not its text, not a boolean.
        ({"budget_usd": "5"}, "budget_usd"),
        ({"budget_usd": False}, "budget_usd"),
        ({"budget_usd": 1, "period": "week"}, "period"),
        ({"budget_usd": 1, "spent_usd": 0}, "spent_usd"),
        ({}, "budget_usd"),
        ([], "body"),
    ],
)
def test_a_bad_account_body_is_a_400_naming_the_field(body: object, field: str) -> None:
    answer = _client("change_account").put("/api/v1/accounts/acme", body, format="json")
    assert answer.status_code == 400, answer.content
    assert field in answer.content.decode()


def test_a_top_up_is_for_the_runs_operators_and_names_bad_fields(api: APIClient) -> None:
    limits = {"run_timeout_ms": 691_200_000, "max_cost_usd": 0.1}
    run = RunFactory(
        version=WorkflowVersionFactory(document=support_ticket_document(limits=limits)),
        status="budget_exceeded",
    )
    for body, field in (({"add_usd": 0}, "add_usd"), ({"add": 1}, "add"), ({}, "add_usd")):
        answer = api.post(f"/api/v1/runs/{run.id}/budget", body, format="json")
        assert answer.status_code == 400 and field in answer.content.decode(), answer.content
    answer = api.post(f"/api/v1/runs/{run.id}/budget", {"add_usd": 0.5}, format="json")
    assert answer.status_code == 200, answer.content
    run.refresh_from_db()
    assert run.budget_added_usd == Decimal("0.5")
    viewer = _client("view_run")
    answer = viewer.post(f"/api/v1/runs/{run.id}/budget", {"add_usd": 1}, format="json")
    assert answer.status_code == 403
    stranger = _client()
    answer = stranger.post(f"/api/v1/runs/{run.id}/budget", {"add_usd": 1}, format="json")
    assert answer.status_code == 404
