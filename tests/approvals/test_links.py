"""The e-mailed link: a GET shows a confirmation page and changes nothing; only the form's
POST decides, once; a used, expired, tampered or foreign token gets a clear page. A user
approver's link works only for that user signed in; a plain address's for whoever holds it,
and once used or closed it shows nothing of the request."""

from __future__ import annotations

import uuid
from datetime import timedelta
from urllib.parse import quote

import pytest
from django.core import signing
from django.test import Client
from django.utils import timezone

from approvals import tokens
from approvals.models import COMMENT_MAX, ApprovalRequest, Decision
from approvals.services import NotApprover, Origin, approval_decide
from runs.models import Run, StepRun
from workflows.errors import NotFound

from .builders import (
    PASSWORD,
    approver,
    decide_by_link,
    link_client,
    link_path,
    make_user,
    start_approval,
)

pytestmark = pytest.mark.django_db

UA = "Mozilla/5.0 (X11; Linux) approver-browser"


@pytest.fixture
def waiting():
    make_user("bob")
    make_user("cy")
    run, request = start_approval(users=["bob", "cy"], emails=["ext@example.org"])
    return run, request


def assert_shows_nothing_of(page, request: ApprovalRequest) -> None:
    """The page names nothing of the request: not its message, details (the step input),
    approvers, decisions or run."""
    html = page.content.decode()
    request.refresh_from_db()
    for secret in (
        "Pay 120 EUR",  # the message
        "Acme Paper",  # the message and the details
        "vendor",  # the details' keys
        "ext@example.org",  # the people
        "cy&#x27;s reasons",  # a decision's comment
        "cy's reasons",
        str(request.run_id),
        "sign_off",
        'id="approvers"',
        'id="decisions"',
        'name="decision"',
    ):
        assert secret not in html, secret


def assert_untouched(request: ApprovalRequest) -> None:
    request.refresh_from_db()
    assert request.status == "pending"
    assert request.closed_at is None
    assert not Decision.objects.filter(request=request).exists()
    assert not request.people.filter(used_at__isnull=False).exists()
    assert Run.objects.get(id=request.run_id).status == "pending_approval"


def test_confirm_page_shows_what_is_asked(client: Client, waiting) -> None:
    run, request = waiting
    bob = approver(request, "bob")
    page = link_client(bob).get(link_path(bob))
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
    decide_by_link(request, "cy", comment="numbers check out")
    bob = approver(request, "bob")
    html = link_client(bob).get(link_path(bob)).content.decode()
    assert "numbers check out" in html
    assert "1 of 2 approvals needed" in html
    assert "waiting for 1 more approval" in html


def test_a_get_changes_nothing_however_often(client: Client, waiting) -> None:
    _, request = waiting
    for label in ("bob", "ext@example.org"):
        person = approver(request, label)
        path, browser = link_path(person), link_client(person)
        # A mail scanner prefetches, a preview pane opens, the person opens it: all GETs.
        for _ in range(3):
            assert browser.get(path).status_code == 200
            assert browser.head(path).status_code == 200
            assert client.get(path).status_code in (200, 302)  # anonymous: 302 for bob's
    assert_untouched(request)


def test_approve_resumes_the_run_and_writes_the_audit_row(client: Client, waiting) -> None:
    run, request = waiting
    bob = approver(request, "bob")
    page = link_client(bob).post(
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
    assert row.user == bob.user  # a user's link works for that user, signed in
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
    bob = approver(request, "bob")
    path, browser = link_path(bob), link_client(bob)
    assert browser.post(path, {"decision": "approved"}).status_code == 200

    for method in (browser.get, browser.post):
        page = method(path, {"decision": "approved"})
        assert page.status_code == 410
        assert "This link has already been used" in page.content.decode()
        assert "It was used on" in page.content.decode()
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
    bob = approver(request, "bob")
    path, browser = link_path(bob), link_client(bob)
    page = browser.get(path)
    assert page.status_code == 410
    assert "This approval has expired" in page.content.decode()
    assert browser.post(path, {"decision": "approved"}).status_code == 410
    assert_untouched(request)


def test_an_expired_request_says_so(client: Client, waiting) -> None:
    _, request = waiting
    ApprovalRequest.objects.filter(id=request.id).update(status="expired")
    for label in ("bob", "ext@example.org"):
        person = approver(request, label)
        page = link_client(person).get(link_path(person))
        assert page.status_code == 410
        assert "This approval has expired" in page.content.decode()


def test_a_request_decided_by_someone_else_is_409(client: Client, waiting) -> None:
    _, request = waiting
    decide_by_link(request, "cy", comment="cy's reasons")
    for label in ("bob", "ext@example.org"):
        person = approver(request, label)
        path, browser = link_path(person), link_client(person)
        page = browser.get(path)
        assert page.status_code == 409
        assert "This approval is closed" in page.content.decode()
        assert_shows_nothing_of(page, request)
        post = browser.post(path, {"decision": "rejected"})
        assert post.status_code == 409
        assert_shows_nothing_of(post, request)
    assert Decision.objects.filter(request=request).count() == 1


def test_a_cancelled_request_is_409(client: Client, waiting) -> None:
    _, request = waiting
    ApprovalRequest.objects.filter(id=request.id).update(status="cancelled")
    for label in ("bob", "ext@example.org"):
        person = approver(request, label)
        page = link_client(person).get(link_path(person))
        assert page.status_code == 409
        assert "This approval is closed" in page.content.decode()
        assert_shows_nothing_of(page, request)


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
    bob = approver(request, "bob")
    strict.force_login(bob.user)
    path = link_path(bob)
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
    page = decide_by_link(request, "bob", comment=too_long)
    assert page.status_code == 400
    html = page.content.decode()
    assert "comment: is 2001 characters; the limit is 2000" in html
    assert 'name="decision" value="approved"' in html  # the form is back
    assert too_long in html  # with what was typed
    assert_untouched(request)


@pytest.mark.parametrize("who", ["bob", "ext@example.org"])
def test_nul_in_a_comment_rerenders_the_form_with_400(client: Client, waiting, who) -> None:
    """An anonymous link holder's form, or a signed-in approver's: NUL never reaches the
    database (it was a 500)."""
    _, request = waiting
    page = decide_by_link(request, who, comment="fine\x00by me")
    assert page.status_code == 400
    assert "comment: may not hold NUL characters" in page.content.decode()
    assert_untouched(request)


def test_a_post_without_a_decision_is_400(client: Client, waiting) -> None:
    _, request = waiting
    page = decide_by_link(request, "ext@example.org", "maybe")
    assert page.status_code == 400
    assert "decision: must be one of approved, rejected" in page.content.decode()
    assert_untouched(request)


def test_quorum_progress_after_a_link_decision(client: Client) -> None:
    make_user("bob")
    make_user("cy")
    make_user("dee")
    run, request = start_approval(users=["bob", "cy", "dee"], quorum=2)
    first = decide_by_link(request, "bob")
    assert "still waiting for 1 more approval" in first.content.decode()
    assert Run.objects.get(id=run.id).status == "pending_approval"
    second = decide_by_link(request, "dee")
    assert 'class="status approved">approved' in second.content.decode()
    assert Run.objects.get(id=run.id).status == "completed"


# --- whose link it is ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["get", "head", "post"])
def test_a_users_link_sends_an_anonymous_visitor_to_sign_in(waiting, method: str) -> None:
    """Whoever got bob's mail (a forward, a shared mailbox, a leaked log) is not bob: the
    link asks them to sign in first, and shows and decides nothing."""
    _, request = waiting
    path = link_path(approver(request, "bob"))
    page = getattr(Client(), method)(path, {"decision": "approved"})
    assert page.status_code == 302
    assert page["Location"] == f"/accounts/login/?next={quote(path)}"
    assert_shows_nothing_of(page, request)
    assert_untouched(request)


def test_signing_in_from_the_link_leads_back_to_it_and_the_audit_names_the_user(waiting) -> None:
    _, request = waiting
    bob = approver(request, "bob")
    browser = Client()
    sign_in = browser.get(link_path(bob), follow=True)
    assert sign_in.redirect_chain[-1][0].startswith("/accounts/login/")
    back = browser.post(
        sign_in.redirect_chain[-1][0],
        {"username": "bob", "password": PASSWORD},
        follow=True,
    )
    assert back.redirect_chain[-1][0] == link_path(bob)
    assert "Pay 120 EUR to Acme Paper?" in back.content.decode()
    assert browser.post(link_path(bob), {"decision": "approved"}).status_code == 200
    row = Decision.objects.get(request=request)
    assert (row.by, row.user, row.channel) == ("bob", bob.user, "link")


@pytest.mark.parametrize("method", ["get", "post"])
def test_a_users_link_opened_by_another_user_is_403(waiting, method: str) -> None:
    """cy is an approver of the same request, and signed in: bob's link is still not hers
    (before, her click recorded a decision by bob, with cy as the user)."""
    _, request = waiting
    cy = Client()
    cy.force_login(approver(request, "cy").user)
    page = getattr(cy, method)(link_path(approver(request, "bob")), {"decision": "approved"})
    assert page.status_code == 403
    assert "This link is for another user" in page.content.decode()
    assert_shows_nothing_of(page, request)
    assert_untouched(request)


def test_the_service_refuses_a_users_link_for_anyone_else(waiting) -> None:
    """The view's check, once more where the decision is recorded."""
    _, request = waiting
    bob, cy = approver(request, "bob"), approver(request, "cy")
    for user in (None, cy.user):
        with pytest.raises(NotApprover):
            approval_decide(
                request_id=request.id,
                approver_id=bob.id,
                decision="approved",
                origin=Origin("link"),
                user=user,
            )
    assert_untouched(request)


def test_the_link_of_a_user_deleted_since_decides_nothing(waiting) -> None:
    """The approver row keeps the address it was mailed to, but it was a user's link: it does
    not turn into a plain address's link that works for whoever holds it."""
    _, request = waiting
    bob = approver(request, "bob")
    bob.user.delete()
    bob.refresh_from_db()
    assert (bob.user, bob.email) == (None, "bob@example.com")
    for method in ("get", "post"):
        page = getattr(Client(), method)(link_path(bob), {"decision": "approved"})
        assert page.status_code == 410
        assert "no longer works" in page.content.decode()
        assert_shows_nothing_of(page, request)
    with pytest.raises(NotApprover):
        approval_decide(
            request_id=request.id, approver_id=bob.id, decision="approved", origin=Origin("link")
        )
    # Nor does a new account with his old address inherit his vote.
    heir = make_user("bob2", email="BOB@example.com")
    with pytest.raises(NotFound):  # to him, as if there were no such approval
        approval_decide(
            request_id=request.id, decision="approved", origin=Origin("inbox"), user=heir
        )
    assert_untouched(request)


def test_a_plain_address_link_works_for_whoever_holds_it(waiting) -> None:
    """Anonymous or signed in as anyone: the link is the credential. The audit names the
    address, and the signed-in user who clicked, if any."""
    _, request = waiting
    ext = approver(request, "ext@example.org")
    assert Client().get(link_path(ext)).status_code == 200
    cy = Client()
    cy.force_login(approver(request, "cy").user)
    assert cy.get(link_path(ext)).status_code == 200
    assert cy.post(link_path(ext), {"decision": "approved"}).status_code == 200
    row = Decision.objects.get(request=request)
    assert (row.by, row.user) == ("ext@example.org", approver(request, "cy").user)


def test_a_used_plain_address_link_shows_nothing_of_the_request(waiting) -> None:
    make_user("dee")
    _, request = start_approval("quorum", users=["dee"], emails=["ext@example.org"], quorum=2)
    ext = approver(request, "ext@example.org")
    path = link_path(ext)
    decided = Client().post(path, {"decision": "approved", "comment": "cy's reasons"})
    assert decided.status_code == 200
    # Later, whoever finds the mail: the request is still open (quorum 2), the link is used.
    for method in (Client().get, Client().post):
        page = method(path, {"decision": "approved"})
        assert page.status_code == 410
        assert "This link has already been used" in page.content.decode()
        assert_shows_nothing_of(page, request)


def test_an_expired_plain_address_link_shows_nothing_of_the_request(waiting) -> None:
    _, request = waiting
    ApprovalRequest.objects.filter(id=request.id).update(
        deadline=timezone.now() - timedelta(seconds=1)
    )
    page = Client().get(link_path(approver(request, "ext@example.org")))
    assert page.status_code == 410
    assert_shows_nothing_of(page, request)


# --- what the answers let others keep ------------------------------------------------------


def assert_private(page) -> None:
    assert "no-store" in page["Cache-Control"]
    # Other sites get no Referer (not no-referrer: see approvals.views.private).
    assert page["Referrer-Policy"] == "same-origin"


def test_every_link_answer_is_no_store_and_sends_no_referrer_to_other_sites(waiting) -> None:
    _, request = waiting
    bob, ext = approver(request, "bob"), approver(request, "ext@example.org")
    cy = Client()
    cy.force_login(approver(request, "cy").user)
    answers = [
        link_client(bob).get(link_path(bob)),  # the confirmation page
        link_client(bob).head(link_path(bob)),
        Client().get(link_path(bob)),  # to the sign-in page
        cy.get(link_path(bob)),  # someone else's
        Client().get("/approvals/link/not-a-token/"),  # tampered
        Client().post(link_path(ext), {"decision": "maybe"}),  # a form error
        Client().post(link_path(ext), {"decision": "approved"}),  # decided
        Client().get(link_path(ext)),  # used
        link_client(bob).get(link_path(bob)),  # closed
    ]
    assert [a.status_code for a in answers] == [200, 200, 302, 403, 400, 400, 200, 410, 409]
    for answer in answers:
        assert_private(answer)


def test_every_inbox_and_notification_answer_is_no_store_and_private_to_the_site(waiting) -> None:
    _, request = waiting
    bob = Client()
    bob.force_login(approver(request, "bob").user)
    answers = [
        Client().get("/approvals/"),  # to the sign-in page
        bob.get("/approvals/"),
        bob.get(f"/approvals/{request.id}/"),
        bob.get(f"/approvals/{uuid.uuid4()}/"),
        bob.post(f"/approvals/{request.id}/decide/", {"decision": "maybe"}),
        bob.post(f"/approvals/{request.id}/decide/", {"decision": "approved"}),
        bob.get("/notifications/"),
        bob.post("/notifications/read/"),
    ]
    assert [a.status_code for a in answers] == [302, 200, 200, 404, 400, 200, 200, 302]
    for answer in answers:
        assert_private(answer)


def test_a_looser_site_wide_referrer_policy_does_not_reach_approval_pages(waiting, settings):
    settings.SECURE_REFERRER_POLICY = "unsafe-url"
    _, request = waiting
    ext = approver(request, "ext@example.org")
    assert Client().get("/accounts/login/")["Referrer-Policy"] == "unsafe-url"
    assert_private(Client().get(link_path(ext)))
