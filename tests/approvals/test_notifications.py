"""In-app notifications: the page, the unread count in every page's header, marking read."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from approvals.models import Notification
from runs.models import Run
from runs.services import run_start
from workflows.services import definition_save

from .builders import PASSWORD, make_group, make_user

pytestmark = pytest.mark.django_db


def signed_in(username: str) -> Client:
    client = Client()
    assert client.login(username=username, password=PASSWORD)
    return client


def badge(html: str) -> int | None:
    found = re.search(r'id="unread-count"[^>]*>(\d+)<', html)
    return int(found.group(1)) if found else None


def hand_off(group: str, what: str) -> Run:
    """A run whose only step hands off to ``group`` (an engine step: no worker needed)."""
    definition_save(
        document={
            "id": "ship",
            "steps": [{"id": "tell", "kind": "handoff", "group": group, "message": "${input}"}],
        }
    )
    return run_start(workflow="ship", input=what).run


@pytest.fixture
def people():
    bob, cy = make_user("bob"), make_user("cy")
    make_group("warehouse", bob, cy)
    return bob, cy


def test_a_handoff_shows_on_the_page_and_in_the_badge(people) -> None:
    bob, _ = people
    run = hand_off("warehouse", "Pack order 55")
    run.refresh_from_db()
    assert run.status == "completed"  # a hand-off never blocks
    client = signed_in("bob")
    page = client.get("/notifications/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "Hand-off from ship: tell" in html
    assert "Pack order 55" in html
    assert str(run.id) in html
    assert badge(html) == 1
    note = Notification.objects.get(user=bob)
    assert f'id="notification-{note.id}"' in html
    assert 'class="card unread"' in html


def test_the_badge_is_on_every_page_and_counts_only_mine(people) -> None:
    hand_off("warehouse", "one")
    hand_off("warehouse", "two")
    make_user("eve")
    bob = signed_in("bob")
    for path in ("/approvals/", "/notifications/"):
        assert badge(bob.get(path).content.decode()) == 2
    # eve is not in the group: no badge at all.
    assert badge(signed_in("eve").get("/approvals/").content.decode()) is None


def test_newest_first(people) -> None:
    bob, _ = people
    now = timezone.now()
    Notification.objects.create(
        user=bob, kind="handoff", title="older", created_at=now - timedelta(hours=1)
    )
    Notification.objects.create(user=bob, kind="handoff", title="newer", created_at=now)
    html = signed_in("bob").get("/notifications/").content.decode()
    assert html.index("newer") < html.index("older")


def test_mark_one_read_and_go_back(people) -> None:
    bob, cy = people
    hand_off("warehouse", "first")
    hand_off("warehouse", "second")
    first = Notification.objects.get(user=bob, body="first")
    client = signed_in("bob")
    back = client.post(f"/notifications/{first.id}/read/", {"next": "/notifications/?page=1"})
    assert back.status_code == 302
    assert back["Location"] == "/notifications/?page=1"
    first.refresh_from_db()
    assert first.read_at is not None
    assert Notification.objects.get(user=bob, body="second").read_at is None
    assert badge(client.get("/notifications/").content.decode()) == 1
    # cy's copies are untouched.
    assert Notification.objects.filter(user=cy, read_at__isnull=True).count() == 2


def test_someone_elses_notification_is_not_marked(people) -> None:
    hand_off("warehouse", "theirs")
    _, cy = people
    theirs = Notification.objects.get(user=cy)
    signed_in("bob").post(f"/notifications/{theirs.id}/read/")
    theirs.refresh_from_db()
    assert theirs.read_at is None


def test_mark_all_read(people) -> None:
    bob, _ = people
    hand_off("warehouse", "a")
    hand_off("warehouse", "b")
    client = signed_in("bob")
    done = client.post("/notifications/read/")
    assert done.status_code == 302 and done["Location"] == "/notifications/"
    assert not Notification.objects.filter(user=bob, read_at__isnull=True).exists()
    html = client.get("/notifications/").content.decode()
    assert badge(html) is None
    assert 'class="card unread"' not in html


def test_an_offsite_next_is_not_followed(people) -> None:
    hand_off("warehouse", "x")
    done = signed_in("bob").post("/notifications/read/", {"next": "https://evil.example/"})
    assert done["Location"] == "/notifications/"


def test_marking_read_needs_a_post_and_a_login(people) -> None:
    bob, _ = people
    hand_off("warehouse", "x")
    assert signed_in("bob").get("/notifications/read/").status_code == 405
    anonymous = Client().post("/notifications/read/")
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous["Location"]
    assert Client().get("/notifications/").status_code == 302
    assert Notification.objects.filter(user=bob, read_at__isnull=True).count() == 1
