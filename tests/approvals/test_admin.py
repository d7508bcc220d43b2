"""The approvals admin: requests with their approvers and decisions, the decision audit,
notifications and mails; all read-only."""

from __future__ import annotations

import pytest
from django.contrib.admin.sites import site
from django.test import Client

from approvals.models import ApprovalRequest, Decision, Mail, Notification

from .builders import approver, decide_by_link, make_group, make_user, start_approval

pytestmark = pytest.mark.django_db

MODELS = (ApprovalRequest, Decision, Notification, Mail)


@pytest.fixture
def decided():
    make_user("bob")
    make_group("finance", make_user("cy"))
    run, request = start_approval(users=["bob"], then_handoff="finance")
    decide_by_link(
        request,
        "bob",
        comment="audited",
        REMOTE_ADDR="192.0.2.9",
        HTTP_USER_AGENT="audit-agent/2",
    )
    return run, request


@pytest.fixture
def root(admin_user) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


def test_the_request_list_and_page_load(root: Client, decided) -> None:
    run, request = decided
    listing = root.get("/admin/approvals/approvalrequest/")
    assert listing.status_code == 200
    html = listing.content.decode()
    assert "sign_off" in html and "expense" in html and str(run.id) in html
    page = root.get(f"/admin/approvals/approvalrequest/{request.id}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    # The inlines: the approver and the decision with its audit fields.
    assert "bob" in html and "audited" in html
    assert "192.0.2.9" in html and "audit-agent/2" in html
    assert 'name="_save"' not in html  # nothing to save


def test_the_decision_audit_shows_ip_and_agent(root: Client, decided) -> None:
    _, request = decided
    row = Decision.objects.get(request=request)
    html = root.get("/admin/approvals/decision/").content.decode()
    assert "192.0.2.9" in html
    assert "audit-agent/2" in html
    page = root.get(f"/admin/approvals/decision/{row.id}/change/")
    assert page.status_code == 200
    assert "audit-agent/2" in page.content.decode()


def test_the_admin_never_shows_a_token_id(root: Client, decided) -> None:
    """With the SECRET_KEY, an approver's token id is all it takes to make their link: no
    list, page, inline or search of the admin gives it away."""
    _, request = decided
    make_user("cy2")
    _, other = start_approval("second", users=["cy2"], emails=["ext@example.org"])
    secrets = {str(p.token_id) for p in [*request.people.all(), *other.people.all()]}
    decision = Decision.objects.get(request=request)
    assert decision.token_id == approver(request, "bob").token_id  # the audit keeps it
    assert len(secrets) == 3  # bob's, cy2's and ext's
    pages = [
        "/admin/approvals/approvalrequest/",
        f"/admin/approvals/approvalrequest/{request.id}/change/",
        f"/admin/approvals/approvalrequest/{other.id}/change/",
        "/admin/approvals/decision/",
        f"/admin/approvals/decision/{decision.id}/change/",
        "/admin/approvals/mail/",
        *(f"/admin/approvals/mail/{m.id}/change/" for m in Mail.objects.all()),
    ]
    for path in pages:
        page = root.get(path)
        assert page.status_code == 200, path
        html = page.content.decode()
        for secret in secrets:
            assert secret not in html, path
            # Nor with the dashes dropped, as a UUID field may be rendered.
            assert secret.replace("-", "") not in html, path
    # A token id searched for finds nothing (a search hit would confirm a guess).
    searched = root.get("/admin/approvals/decision/", {"q": str(decision.token_id)})
    assert "0 decisions" in searched.content.decode()
    assert "audit-agent/2" not in searched.content.decode()


def test_notifications_and_mails_lists_load(root: Client, decided) -> None:
    assert Notification.objects.filter(kind="handoff").exists()
    notes = root.get("/admin/approvals/notification/")
    assert notes.status_code == 200
    assert "Hand-off from expense" in notes.content.decode()
    mails = root.get("/admin/approvals/mail/")
    assert mails.status_code == 200
    assert "bob@example.com" in mails.content.decode()
    mail = Mail.objects.first()
    assert root.get(f"/admin/approvals/mail/{mail.id}/change/").status_code == 200


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_no_add_change_or_delete(root: Client, decided, admin_user, model) -> None:
    model_admin = site._registry[model]
    request = root.get("/admin/").wsgi_request
    request.user = admin_user
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request)
    assert not model_admin.has_delete_permission(request)
    name = model._meta.model_name
    assert root.get(f"/admin/approvals/{name}/add/").status_code == 403
    row = model.objects.first()
    assert root.get(f"/admin/approvals/{name}/{row.pk}/delete/").status_code == 403
    assert root.post(f"/admin/approvals/{name}/{row.pk}/change/", {}).status_code == 403
    assert model.objects.filter(pk=row.pk).exists()
    listing = root.get(f"/admin/approvals/{name}/").content.decode()
    assert f"/admin/approvals/{name}/add/" not in listing
    assert "delete_selected" not in listing


def test_a_view_only_operator_sees_but_cannot_act(decided) -> None:
    from django.contrib.auth.models import Permission

    staff = make_user("op", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_decision"))
    client = Client()
    client.force_login(staff)
    assert client.get("/admin/approvals/decision/").status_code == 200
    assert client.get("/admin/approvals/approvalrequest/").status_code == 403
