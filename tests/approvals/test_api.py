"""The approvals API: the caller's approvals, one approval, approve and reject, and every
refusal in the contract's error shape."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import Permission
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from approvals.models import Decision
from runs.models import Run, StepRun

from .builders import make_user, start_approval

pytestmark = pytest.mark.django_db


def api_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.fixture
def bob():
    return make_user("bob")


def errors(response) -> list[dict]:
    body = response.json()
    assert isinstance(body["errors"], list) and body["errors"], body
    return body["errors"]


def test_list_is_the_callers_approvals_newest_first(bob) -> None:
    make_user("cy")
    _, first = start_approval("expense", users=["bob"])
    _, other = start_approval("travel", users=["cy"])
    _, second = start_approval("refund", emails=["bob@example.com"])
    response = api_for(bob).get("/api/v1/approvals")
    assert response.status_code == 200
    body = response.json()
    assert [a["id"] for a in body["results"]] == [str(second.id), str(first.id)]
    assert body["next"] is None
    assert str(other.id) not in {a["id"] for a in body["results"]}


def test_list_filters_by_status_and_paginates(bob) -> None:
    _, open_one = start_approval("expense", users=["bob"])
    _, closed = start_approval("refund", users=["bob"])
    api = api_for(bob)
    api.post(f"/api/v1/approvals/{closed.id}/reject")
    pending = api.get("/api/v1/approvals?status=pending").json()["results"]
    assert [a["id"] for a in pending] == [str(open_one.id)]
    rejected = api.get("/api/v1/approvals?status=rejected").json()["results"]
    assert [a["id"] for a in rejected] == [str(closed.id)]

    page = api.get("/api/v1/approvals?limit=1").json()
    assert len(page["results"]) == 1 and page["next"]
    rest = api.get(f"/api/v1/approvals?limit=1&cursor={page['next']}").json()
    assert [a["id"] for a in rest["results"]] == [str(open_one.id)]


def test_an_unknown_status_is_400_naming_it(bob) -> None:
    response = api_for(bob).get("/api/v1/approvals?status=maybe")
    assert response.status_code == 400
    assert errors(response)[0]["field"] == "status"


def test_the_approval_shape(bob) -> None:
    run, request = start_approval(users=["bob"], emails=["ext@example.org"], timeout_ms=3_600_000)
    body = api_for(bob).get(f"/api/v1/approvals/{request.id}").json()
    for name in ("id", "run", "step_id", "status", "message", "approvers", "quorum", "deadline"):
        assert name in body
    assert body["id"] == str(request.id)
    assert body["run"] == str(run.id)
    assert body["workflow"] == "expense"
    assert (body["step_id"], body["status"], body["quorum"]) == ("sign_off", "pending", 1)
    assert body["message"] == "Pay 120 EUR to Acme Paper?"
    assert body["details"] == {"amount": 120, "vendor": "Acme Paper"}
    assert body["approvers"] == {"users": ["bob"], "emails": ["ext@example.org"]}
    assert body["deadline"] is not None
    assert body["decisions"] == []
    assert body["people"] == [
        {"name": "bob", "via": "user", "decided": False},
        {"name": "ext@example.org", "via": "email", "decided": False},
    ]


def test_approve_resumes_the_run(bob) -> None:
    run, request = start_approval(users=["bob"])
    response = api_for(bob).post(
        f"/api/v1/approvals/{request.id}/approve",
        {"comment": "lgtm"},
        format="json",
        HTTP_USER_AGENT="ci-bot/1",
        REMOTE_ADDR="198.51.100.4",
    )
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "approved"
    assert len(body["decisions"]) == 1
    shown = body["decisions"][0]
    assert set(shown) == {"by", "decision", "comment", "channel", "created_at"}  # no IP, no UA
    assert (shown["by"], shown["decision"], shown["comment"], shown["channel"]) == (
        "bob",
        "approved",
        "lgtm",
        "api",
    )
    assert body["people"][0]["decided"] is True
    assert Run.objects.get(id=run.id).status == "completed"
    row = Decision.objects.get(request=request)
    assert (row.ip, row.user_agent, row.user_id, row.token_id) == (
        "198.51.100.4",
        "ci-bot/1",
        bob.id,
        None,
    )


def test_reject_fails_the_step_as_rejected(bob) -> None:
    run, request = start_approval(users=["bob"])
    response = api_for(bob).post(
        f"/api/v1/approvals/{request.id}/reject", {"comment": "no budget"}, format="json"
    )
    assert response.status_code == 200
    assert response.json()["status"] == "rejected"
    step = StepRun.objects.get(run=run, step_id="sign_off")
    assert step.status == "failed" and step.error["class"] == "rejected"
    assert Run.objects.get(id=run.id).status == "failed"


def test_approve_without_a_body_or_with_a_null_comment(bob) -> None:
    cy = make_user("cy")
    _, request = start_approval(users=["bob", "cy"], quorum=2)
    bob_api = api_for(bob)
    assert bob_api.post(f"/api/v1/approvals/{request.id}/approve").status_code == 200
    body = bob_api.get(f"/api/v1/approvals/{request.id}").json()
    assert body["status"] == "pending"  # quorum 2: one approval so far
    assert body["decisions"][0]["comment"] == ""
    null = api_for(cy).post(
        f"/api/v1/approvals/{request.id}/approve", {"comment": None}, format="json"
    )
    assert null.status_code == 200
    assert null.json()["status"] == "approved"


@pytest.mark.parametrize("raw", [None, "not-a-uuid"])
def test_unknown_or_malformed_id_is_404(bob, raw) -> None:
    approval_id = raw or uuid.uuid4()
    api = api_for(bob)
    for response in (
        api.get(f"/api/v1/approvals/{approval_id}"),
        api.post(f"/api/v1/approvals/{approval_id}/approve", {}, format="json"),
        api.post(f"/api/v1/approvals/{approval_id}/reject", {}, format="json"),
    ):
        assert response.status_code == 404
        assert errors(response)[0]["message"]


def test_not_an_approver_is_404_as_for_an_unknown_id_and_changes_nothing(bob) -> None:
    """CONTRACT section 8: one who may not see it must not learn it exists (issue 36)."""
    _, request = start_approval(users=["bob"])
    eve = api_for(make_user("eve"))
    unknown = uuid.uuid4()
    for path in (f"/api/v1/approvals/{request.id}", f"/api/v1/approvals/{unknown}"):
        answer = eve.get(path)
        assert answer.status_code == 404
        assert errors(answer)[0]["field"] == "id"
    for verb in ("approve", "reject"):
        response = eve.post(f"/api/v1/approvals/{request.id}/{verb}", {}, format="json")
        assert response.status_code == 404
        assert errors(response) == [{"field": "id", "message": f"no approval {request.id}"}]
    request.refresh_from_db()
    assert request.status == "pending"
    assert not Decision.objects.exists()
    assert eve.get("/api/v1/approvals").json()["results"] == []


def test_a_reader_of_the_run_who_is_no_approver_is_403(bob) -> None:
    """Seeing but not acting: the run's steps show the approval to its readers anyway."""
    _, request = start_approval(users=["bob"])
    viewer = make_user("vic")
    viewer.user_permissions.add(Permission.objects.get(codename="view_run"))
    vic = api_for(viewer)
    assert vic.get(f"/api/v1/approvals/{request.id}").status_code == 403
    response = vic.post(f"/api/v1/approvals/{request.id}/approve", {}, format="json")
    assert response.status_code == 403
    assert "not among" in errors(response)[0]["message"]
    assert not Decision.objects.exists()


def test_closed_and_already_decided_are_409(bob) -> None:
    cy, dee = make_user("cy"), make_user("dee")
    _, request = start_approval(users=["bob", "cy", "dee"], quorum=2)
    bob_api = api_for(bob)
    assert bob_api.post(f"/api/v1/approvals/{request.id}/approve").status_code == 200
    again = bob_api.post(f"/api/v1/approvals/{request.id}/reject")
    assert again.status_code == 409
    assert "already recorded" in errors(again)[0]["message"]
    assert api_for(cy).post(f"/api/v1/approvals/{request.id}/approve").status_code == 200
    late = api_for(dee).post(f"/api/v1/approvals/{request.id}/reject")
    assert late.status_code == 409
    assert "already approved" in errors(late)[0]["message"]
    assert bob_api.get(f"/api/v1/approvals/{request.id}").json()["status"] == "approved"
    assert Decision.objects.filter(request=request).count() == 2


def test_a_comment_over_the_limit_is_400_naming_comment(bob) -> None:
    _, request = start_approval(users=["bob"])
    response = api_for(bob).post(
        f"/api/v1/approvals/{request.id}/approve", {"comment": "z" * 2001}, format="json"
    )
    assert response.status_code == 400
    assert errors(response)[0]["field"] == "comment"
    request.refresh_from_db()
    assert request.status == "pending"
    assert not Decision.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"comment": "ok", "decision": "rejected"}, "decision"),
        ({"comment": 5}, "comment"),
        ([], "body"),
    ],
)
def test_a_strict_body(bob, body, field) -> None:
    _, request = start_approval(users=["bob"])
    response = api_for(bob).post(f"/api/v1/approvals/{request.id}/approve", body, format="json")
    assert response.status_code == 400
    assert errors(response)[0]["field"] == field
    assert not Decision.objects.exists()


def test_the_api_needs_authentication(bob) -> None:
    _, request = start_approval(users=["bob"])
    anonymous = APIClient()
    assert anonymous.get("/api/v1/approvals").status_code == 401
    assert anonymous.post(f"/api/v1/approvals/{request.id}/approve").status_code == 401
    assert not Decision.objects.exists()


def test_the_schema_lists_the_approval_operations(bob) -> None:
    schema = api_for(bob).get("/api/v1/schema/?format=json").json()
    paths = schema["paths"]
    assert "get" in paths["/api/v1/approvals"]
    assert "get" in paths["/api/v1/approvals/{approval_id}"]
    assert "post" in paths["/api/v1/approvals/{approval_id}/approve"]
    assert "post" in paths["/api/v1/approvals/{approval_id}/reject"]
