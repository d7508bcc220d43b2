"""The inbox at /approvals/: a signed-in approver's pending approvals and history, a detail
page per request and its decide form (channel ``inbox``)."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from approvals.models import Decision
from runs.models import Run, StepRun

from .builders import PASSWORD, decide_by_link, make_group, make_user, start_approval

pytestmark = pytest.mark.django_db


def signed_in(username: str) -> Client:
    client = Client()
    assert client.login(username=username, password=PASSWORD)
    return client


def test_the_inbox_needs_a_login() -> None:
    page = Client().get("/approvals/")
    assert page.status_code == 302
    assert page["Location"].startswith("/accounts/login/?next=/approvals/")


def test_the_login_page_signs_in_and_goes_home() -> None:
    make_user("bob")
    client = Client()
    form = client.get("/accounts/login/")
    assert form.status_code == 200
    assert 'name="password"' in form.content.decode()
    page = client.post("/accounts/login/", {"username": "bob", "password": PASSWORD}, follow=True)
    assert page.redirect_chain[-1][0] == "/"
    assert "bob" in page.content.decode()  # the header names the user
    assert "Waiting for your decision" in page.content.decode()


def test_pending_and_history(client: Client) -> None:
    bob = make_user("bob")
    make_user("cy")
    make_group("finance", bob)
    _, mine = start_approval("expense", users=["bob"])
    _, via_group = start_approval("travel", groups=["finance"])
    _, not_his = start_approval("travel_other", users=["cy"])
    _, decided = start_approval("refund", users=["bob", "cy"], quorum=2)
    _, by_mail = start_approval("invoice", emails=["BOB@example.com"])  # his address
    decide_by_link(decided, "bob", "approved")

    html = signed_in("bob").get("/approvals/").content.decode()
    pending_part, history_part = html.split('id="history"')
    assert f"/approvals/{mine.id}/" in pending_part
    assert f"/approvals/{by_mail.id}/" in pending_part
    # Still pending (quorum 2), but bob has decided: history, not waiting for him.
    assert f"/approvals/{decided.id}/" not in pending_part
    assert f"/approvals/{decided.id}/" in history_part
    assert f"/approvals/{via_group.id}/" in pending_part
    assert f"/approvals/{not_his.id}/" not in html
    assert "Waiting for you (3)" in pending_part


def test_closed_requests_are_history(client: Client) -> None:
    make_user("bob")
    _, request = start_approval(users=["bob"])
    decide_by_link(request, "bob", "rejected")
    html = signed_in("bob").get("/approvals/").content.decode()
    pending_part, history_part = html.split('id="history"')
    assert "Nothing waits for your decision" in pending_part
    assert 'class="status rejected">rejected' in history_part


def test_detail_shows_the_request_and_a_form() -> None:
    make_user("bob")
    make_user("cy")
    _, request = start_approval(users=["bob", "cy"], quorum=2)
    decide_by_link(request, "cy", "approved", comment="ok!")
    page = signed_in("bob").get(f"/approvals/{request.id}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "Pay 120 EUR to Acme Paper?" in html
    assert "ok!" in html and "1 of 2 approvals needed" in html
    assert f'action="/approvals/{request.id}/decide/"' in html


def test_deciding_from_the_inbox() -> None:
    make_user("bob")
    run, request = start_approval(users=["bob"])
    bob = signed_in("bob")
    page = bob.post(
        f"/approvals/{request.id}/decide/",
        {"decision": "approved", "comment": "from the inbox"},
        HTTP_USER_AGENT="inbox-browser",
    )
    assert page.status_code == 200
    assert "You approved" in page.content.decode()
    row = Decision.objects.get(request=request)
    assert (row.channel, row.by, row.comment) == ("inbox", "bob", "from the inbox")
    assert row.user.username == "bob" and row.token_id is None
    assert row.user_agent == "inbox-browser" and row.ip == "127.0.0.1"
    assert Run.objects.get(id=run.id).status == "completed"
    # The detail page now says what bob decided, with no form.
    html = bob.get(f"/approvals/{request.id}/").content.decode()
    assert "You approved this on" in html
    assert 'name="decision"' not in html


def test_reject_from_the_inbox_fails_the_step() -> None:
    make_user("bob")
    run, request = start_approval(users=["bob"])
    signed_in("bob").post(f"/approvals/{request.id}/decide/", {"decision": "rejected"})
    step = StepRun.objects.get(run=run, step_id="sign_off")
    assert step.error["class"] == "rejected"


def test_unknown_id_is_a_404_page() -> None:
    make_user("bob")
    bob = signed_in("bob")
    missing = uuid.uuid4()
    page = bob.get(f"/approvals/{missing}/")
    assert page.status_code == 404
    assert "No such approval" in page.content.decode()
    assert bob.post(f"/approvals/{missing}/decide/", {"decision": "approved"}).status_code == 404
    assert bob.get("/approvals/not-a-uuid/").status_code == 404


def test_not_an_approver_gets_the_404_page_of_an_unknown_id() -> None:
    """CONTRACT section 8 (issue 36): the page must not tell that the approval exists."""
    make_user("bob")
    make_user("eve")
    _, request = start_approval(users=["bob"])
    eve = signed_in("eve")
    page = eve.get(f"/approvals/{request.id}/")
    assert page.status_code == 404
    assert "No such approval" in page.content.decode()
    assert "Pay 120 EUR" not in page.content.decode()  # nothing of the request leaks
    assert eve.post(f"/approvals/{request.id}/decide/", {"decision": "approved"}).status_code == 404
    assert not Decision.objects.exists()


def test_a_reader_of_the_run_who_is_no_approver_gets_a_403_page() -> None:
    make_user("bob")
    make_user("vic").user_permissions.add(Permission.objects.get(codename="view_run"))
    _, request = start_approval(users=["bob"])
    vic = signed_in("vic")
    page = vic.get(f"/approvals/{request.id}/")
    assert page.status_code == 403
    assert "Pay 120 EUR" not in page.content.decode()
    assert vic.post(f"/approvals/{request.id}/decide/", {"decision": "approved"}).status_code == 403
    assert not Decision.objects.exists()


def test_deciding_a_closed_request_is_a_409_page() -> None:
    make_user("bob")
    make_user("cy")
    _, request = start_approval(users=["bob", "cy"])
    decide_by_link(request, "cy", "approved")
    bob = signed_in("bob")
    page = bob.post(f"/approvals/{request.id}/decide/", {"decision": "rejected"})
    assert page.status_code == 409
    assert "already approved" in page.content.decode()
    assert Decision.objects.filter(request=request).count() == 1
    # The detail page still shows it (history), without a form.
    detail = bob.get(f"/approvals/{request.id}/")
    assert detail.status_code == 200
    assert 'name="decision"' not in detail.content.decode()


def test_a_second_inbox_decision_is_409() -> None:
    make_user("bob")
    make_user("cy")
    _, request = start_approval(users=["bob", "cy"], quorum=2)
    bob = signed_in("bob")
    assert bob.post(f"/approvals/{request.id}/decide/", {"decision": "approved"}).status_code == 200
    again = bob.post(f"/approvals/{request.id}/decide/", {"decision": "approved"})
    assert again.status_code == 409
    assert Decision.objects.filter(request=request).count() == 1


def test_an_inbox_comment_over_the_limit_is_400() -> None:
    make_user("bob")
    _, request = start_approval(users=["bob"])
    page = signed_in("bob").post(
        f"/approvals/{request.id}/decide/", {"decision": "approved", "comment": "y" * 2001}
    )
    assert page.status_code == 400
    assert "the limit is 2000" in page.content.decode()
    request.refresh_from_db()
    assert request.status == "pending"
    assert not Decision.objects.exists()


def test_a_get_on_decide_is_refused() -> None:
    make_user("bob")
    _, request = start_approval(users=["bob"])
    assert signed_in("bob").get(f"/approvals/{request.id}/decide/").status_code == 405
    request.refresh_from_db()
    assert request.status == "pending"
