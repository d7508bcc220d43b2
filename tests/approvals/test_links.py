"""The e-mailed link: a GET shows a confirmation page and changes nothing; only the form's
POST decides, once; a used, expired, tampered or foreign token gets a clear page."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.core import signing
from django.test import Client
from django.utils import timezone

from approvals import tokens
from approvals.models import COMMENT_MAX, ApprovalRequest, Decision
from runs.models import Run, StepRun

from .builders import approver, link_path, make_user, start_approval

pytestmark = pytest.mark.django_db

UA = "Mozilla/5.0 (X11; Linux) approver-browser"


@pytest.fixture
def waiting():
    make_user("bob")
    make_user("cy")
    run, request = start_approval(users=["bob", "cy"], emails=["ext@example.org"])
    return run, request


def assert_untouched(request: ApprovalRequest) -> None:
    request.refresh_from_db()
    assert request.status == "pending"
    assert request.closed_at is None
    assert not Decision.objects.filter(request=request).exists()
    assert not request.people.filter(used_at__isnull=False).exists()
    assert Run.objects.get(id=request.run_id).status == "pending_approval"


def test_confirm_page_shows_what_is_asked(client: Client, waiting) -> None:
    run, request = waiting
    page = client.get(link_path(approver(request, "bob")))
    assert page.status_code == 200
    html = page.content.decode()
    assert "Pay 120 EUR to Acme Paper?" in html
    assert "&quot;vendor&quot;: &quot;Acme Paper&quot;" in html  # the details, pretty JSON
    assert str(run.id) in html
    assert "expense" in html and "version 1" in html
    assert "sign_off" in html
    assert "ext@example.org" in html and "cy" in html  # the other approvers
    assert 'name="decision" value="approved"' in html
    assert 'name="decision" value="rejected"' in html
    assert f'maxlength="{COMMENT_MAX}"' in html
    assert "csrfmiddlewaretoken" in html
    assert "Nobody has decided yet" in html


def test_confirm_page_shows_who_else_decided(client: Client) -> None:
    make_user("bob")
    make_user("cy")
    _, request = start_approval(users=["bob", "cy"], quorum=2)
    client.post(
        link_path(approver(request, "cy")),
        {"decision": "approved", "comment": "numbers check out"},
    )
    html = client.get(link_path(approver(request, "bob"))).content.decode()
    assert "numbers check out" in html
    assert "1 of 2 approvals needed" in html
    assert "waiting for 1 more approval" in html


def test_a_get_changes_nothing_however_often(client: Client, waiting) -> None:
    _, request = waiting
    path = link_path(approver(request, "bob"))
    # A mail scanner prefetches, a preview pane opens, the person opens it: all GETs.
    for _ in range(3):
        assert client.get(path).status_code == 200
        assert client.head(path).status_code == 200
    assert_untouched(request)


def test_approve_resumes_the_run_and_writes_the_audit_row(client: Client, waiting) -> None:
    run, request = waiting
    bob = approver(request, "bob")
    page = client.post(
        link_path(bob),
        {"decision": "approved", "comment": "fine"},
        REMOTE_ADDR="203.0.113.7",
        HTTP_USER_AGENT=UA,
    )
    assert page.status_code == 200
    html = page.content.decode()
    assert "You approved" in html
    assert 'class="status approved">approved' in html
    assert 'class="status completed">completed' in html  # the run's status after
    run.refresh_from_db()
    assert run.status == "completed"
    step = StepRun.objects.get(run=run, step_id="sign_off")
    assert step.status == "succeeded"
    assert step.output == {"decision": "approved", "by": "bob", "comment": "fine"}
    row = Decision.objects.get(request=request)
    assert (row.by, row.decision, row.comment, row.channel) == ("bob", "approved", "fine", "link")
    assert row.ip == "203.0.113.7"
    assert row.user_agent == UA
    assert row.token_id == bob.token_id
    assert row.user is None  # the link works without signing in
    bob.refresh_from_db()
    assert bob.used_at is not None


def test_reject_with_a_comment_fails_the_step_as_rejected(client: Client, waiting) -> None:
    run, request = waiting
    page = client.post(
        link_path(approver(request, "ext@example.org")),
        {"decision": "rejected", "comment": "wrong vendor"},
    )
    assert page.status_code == 200
    assert "You rejected" in page.content.decode()
    step = StepRun.objects.get(run=run, step_id="sign_off")
    assert step.status == "failed"
    assert step.error["class"] == "rejected"
    assert "wrong vendor" in step.error["message"]
    run.refresh_from_db()
    assert run.status == "failed"
    request.refresh_from_db()
    assert request.status == "rejected"
    assert Decision.objects.get(request=request).comment == "wrong vendor"


def test_replaying_a_used_link_gets_410_and_changes_nothing(client: Client) -> None:
    make_user("bob")
    make_user("cy")
    # Quorum 2: after bob's approval the request is still pending, so only the token's
    # single use stops a second vote.
    _, request = start_approval(users=["bob", "cy"], quorum=2)
    path = link_path(approver(request, "bob"))
    assert client.post(path, {"decision": "approved"}).status_code == 200

    for method in (client.get, client.post):
        page = method(path, {"decision": "approved"})
        assert page.status_code == 410
        assert "You already approved this on" in page.content.decode()
    request.refresh_from_db()
    assert request.status == "pending"
    assert Decision.objects.filter(request=request).count() == 1


def test_a_link_after_the_deadline_is_expired(client: Client) -> None:
    make_user("bob")
    _, request = start_approval(users=["bob"], timeout_ms=3_600_000)
    # The deadline passed, but the timer that expires the request has not fired yet.
    ApprovalRequest.objects.filter(id=request.id).update(
        deadline=timezone.now() - timedelta(minutes=1)
    )
    path = link_path(approver(request, "bob"))
    page = client.get(path)
    assert page.status_code == 410
    assert "This approval has expired" in page.content.decode()
    assert client.post(path, {"decision": "approved"}).status_code == 410
    assert_untouched(request)


def test_an_expired_request_says_so(client: Client, waiting) -> None:
    _, request = waiting
    ApprovalRequest.objects.filter(id=request.id).update(status="expired")
    page = client.get(link_path(approver(request, "bob")))
    assert page.status_code == 410
    assert "expired" in page.content.decode()


def test_a_request_decided_by_someone_else_is_409_naming_them(client: Client, waiting) -> None:
    _, request = waiting
    client.post(link_path(approver(request, "cy")), {"decision": "approved"})
    path = link_path(approver(request, "bob"))
    page = client.get(path)
    assert page.status_code == 409
    assert "already approved by cy" in page.content.decode()
    assert "did not decide" in page.content.decode()  # bob, on the closed request
    post = client.post(path, {"decision": "rejected"})
    assert post.status_code == 409
    assert Decision.objects.filter(request=request).count() == 1


def test_a_cancelled_request_is_409(client: Client, waiting) -> None:
    _, request = waiting
    ApprovalRequest.objects.filter(id=request.id).update(status="cancelled")
    page = client.get(link_path(approver(request, "bob")))
    assert page.status_code == 409
    assert "cancelled" in page.content.decode()


@pytest.mark.parametrize("mangle", ["flip", "garbage", "unsigned"])
def test_a_tampered_token_gets_400(client: Client, waiting, mangle: str) -> None:
    _, request = waiting
    token = tokens.make_token(approver(request, "bob"))
    bad = {
        "flip": token[:-2] + ("AA" if not token.endswith("AA") else "BB"),
        "garbage": "not-a-token",
        "unsigned": signing.dumps({"a": 1}, salt="some.other.salt"),
    }[mangle]
    for method in (client.get, client.post):
        page = method(f"/approvals/link/{bad}/", {"decision": "approved"})
        assert page.status_code == 400
        assert "This link is not valid" in page.content.decode()
    assert_untouched(request)


def test_a_signed_token_for_no_approver_of_that_request_gets_403(client: Client) -> None:
    make_user("bob")
    make_user("mallory")
    _, request = start_approval(users=["bob"])
    _, other = start_approval("other_expense", users=["mallory"])
    bob, mallory = approver(request, "bob"), approver(other, "mallory")
    forged = [
        # mallory's approver id on bob's request
        {"a": mallory.id, "r": str(request.id), "t": str(mallory.token_id)},
        # bob's ids but a token id that is not his
        {"a": bob.id, "r": str(request.id), "t": str(uuid.uuid4())},
        # ids that are not even UUIDs
        {"a": bob.id, "r": "nope", "t": "nope"},
    ]
    for claim in forged:
        path = f"/approvals/link/{signing.dumps(claim, salt=tokens.SALT)}/"
        assert client.get(path).status_code == 403
        page = client.post(path, {"decision": "approved"})
        assert page.status_code == 403
        assert "not yours" in page.content.decode()
    assert_untouched(request)
    assert_untouched(other)


def test_a_post_without_the_csrf_token_is_refused(waiting) -> None:
    _, request = waiting
    strict = Client(enforce_csrf_checks=True)
    path = link_path(approver(request, "bob"))
    assert strict.post(path, {"decision": "approved"}).status_code == 403
    assert_untouched(request)
    # With the token from the page's form, the same POST decides.
    strict.get(path)
    csrf = strict.cookies["csrftoken"].value
    decided = strict.post(path, {"decision": "approved", "csrfmiddlewaretoken": csrf})
    assert decided.status_code == 200
    request.refresh_from_db()
    assert request.status == "approved"


def test_a_comment_over_the_limit_rerenders_the_form_with_400(client: Client, waiting) -> None:
    _, request = waiting
    too_long = "x" * (COMMENT_MAX + 1)
    page = client.post(
        link_path(approver(request, "bob")), {"decision": "approved", "comment": too_long}
    )
    assert page.status_code == 400
    html = page.content.decode()
    assert "comment: is 2001 characters; the limit is 2000" in html
    assert 'name="decision" value="approved"' in html  # the form is back
    assert too_long in html  # with what was typed
    assert_untouched(request)


def test_a_post_without_a_decision_is_400(client: Client, waiting) -> None:
    _, request = waiting
    page = client.post(link_path(approver(request, "bob")), {"decision": "maybe"})
    assert page.status_code == 400
    assert "decision: must be one of approved, rejected" in page.content.decode()
    assert_untouched(request)


def test_quorum_progress_after_a_link_decision(client: Client) -> None:
    make_user("bob")
    make_user("cy")
    make_user("dee")
    run, request = start_approval(users=["bob", "cy", "dee"], quorum=2)
    first = client.post(link_path(approver(request, "bob")), {"decision": "approved"})
    assert "still waiting for 1 more approval" in first.content.decode()
    assert Run.objects.get(id=run.id).status == "pending_approval"
    second = client.post(link_path(approver(request, "dee")), {"decision": "approved"})
    assert 'class="status approved">approved' in second.content.decode()
    assert Run.objects.get(id=run.id).status == "completed"
