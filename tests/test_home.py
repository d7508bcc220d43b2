"""``/``: the sign-in page for strangers; for a signed-in person, what waits for them, the
runs they may see and the way to the admin and the API docs."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client

from tests.approvals.builders import make_user, start_approval
from tests.runs.factories import RunFactory
from workflows import access

pytestmark = pytest.mark.django_db
PASSWORD = "a-long-password-1"


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _person(username: str, *, staff: bool = False, perms: tuple[str, ...] = ()):
    user = get_user_model().objects.create_user(
        username=username, password=PASSWORD, is_staff=staff
    )
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


def test_a_stranger_is_sent_to_sign_in() -> None:
    page = Client().get("/")
    assert page.status_code == 302
    assert page["Location"] == "/accounts/login/?next=/"


def test_a_starter_sees_only_the_runs_they_started() -> None:
    ada, bob = _person("ada"), _person("bob")
    mine = RunFactory(created_by=ada)
    theirs = RunFactory(created_by=bob, workflow=mine.workflow, version=mine.version)
    # Without a role on the workflow, not even one's own runs show.
    assert str(mine.id) not in _client(ada).get("/").content.decode()
    access.grant(access.STARTER, mine.workflow_id, user=ada)
    page = _client(ada).get("/")
    assert page.status_code == 200
    body = page.content.decode()
    assert "Runs you may see" in body
    assert str(mine.id) in body
    assert str(theirs.id) not in body
    # No way into the admin for someone who cannot use it.
    assert "/admin/" not in body
    assert "/api/v1/docs/" in body


def test_a_viewer_sees_every_run_linked_to_its_inspector_and_staff_to_the_admin() -> None:
    runs = [RunFactory(), RunFactory()]
    viewer = _person("vic", perms=("view_run",))
    body = _client(viewer).get("/").content.decode()
    assert "Newest runs" in body
    assert all(f'href="/runs/{run.id}/"' in body for run in runs)
    assert "/admin/runs/run/" not in body  # not staff: the admin would refuse them
    staff = _person("sam", staff=True, perms=("view_run",))
    body = _client(staff).get("/").content.decode()
    assert 'href="/admin/runs/run/"' in body
    assert 'href="/admin/"' in body


def test_home_links_to_the_runs_list() -> None:
    ada = _person("ada")
    body = _client(ada).get("/").content.decode()
    assert '<a href="/runs/" id="all-runs">All runs</a>' in body
    assert _client(ada).get("/runs/").status_code == 200


def test_the_admin_view_site_link_leads_home() -> None:
    root = get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)
    client = _client(root)
    admin = client.get("/admin/").content.decode()
    assert 'href="/"' in admin  # "View site"
    assert client.get("/").status_code == 200


def test_home_lists_approvals_waiting_for_the_user() -> None:
    bob = make_user("bob")
    _, approval = start_approval(users=["bob"], amount=30, vendor="Acme Paper")
    body = _client(bob).get("/").content.decode()
    assert "Waiting for your decision (1)" in body
    assert f"/approvals/{approval.id}/" in body
    assert "Pay 30 EUR to Acme Paper?" in body
    # Someone else's approval is not theirs to see.
    assert "Waiting for your decision (0)" in _client(make_user("cy")).get("/").content.decode()
