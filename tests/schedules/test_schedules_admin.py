"""Schedules in the admin: listed to whoever may see their workflow, added, switched off and
deleted through the services (the same checks and 400s as the API, shown on the form)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import PeriodicTask

from schedules import services
from schedules.models import Schedule
from workflows import access
from workflows.services import definition_save

from .test_schedules_api import DOCUMENT, OTHER

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:schedules_schedule_changelist"
ADD = "admin:schedules_schedule_add"


@pytest.fixture(autouse=True)
def _workflows(db):
    definition_save(document=DOCUMENT)
    definition_save(document=OTHER)


def staff(name: str, **roles: str):
    user = get_user_model().objects.create_user(
        username=name, password="a-long-password-1", is_staff=True
    )
    for role, workflow in roles.items():
        access.grant(role, workflow, user=user)
    client = Client()
    client.force_login(user)
    return user, client


def add_form(**values):
    return {
        "workflow_id": "nightly",
        "input": '{"region": "eu", "token": "s3cret"}',
        "cron": "30 6 * * 1-5",
        "every_ms": "",
        "version": "",
        "enabled": "on",
        "catch_up": "",
        **values,
    }


def test_a_starter_adds_a_schedule_through_the_form():
    ada, client = staff("ada", starter="nightly")
    response = client.post(reverse(ADD), add_form(), follow=True)
    assert response.status_code == 200
    schedule = Schedule.objects.get()
    assert schedule.owner == ada and schedule.workflow_id == "nightly"
    assert services.cron_of(schedule.task) == "30 6 * * 1-5"
    page = client.get(reverse(CHANGELIST)).content.decode()
    assert "nightly" in page and "cron 30 6 * * 1-5" in page
    detail = client.get(reverse("admin:schedules_schedule_change", args=[schedule.pk]))
    text = detail.content.decode()
    assert "s3cret" not in text and "••••" in text


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"cron": "99 * * * *"}, "not a cron expression"),
        ({"cron": "", "every_ms": "10"}, "DJFLOW_SCHEDULE_MIN_INTERVAL_MS"),
        ({"input": '{"region": 1}'}, "is not of type"),
        ({"input": "{nope"}, "Malformed JSON"),
        ({"workflow_id": "ledger"}, "unknown workflow"),
        # What JSON parses but Postgres cannot store, or Python cannot walk: the API's
        # parser refuses it (CONTRACT section 9); the form did not, and the save was a 500.
        ({"input": '{"region": "a\\u0000b"}'}, "may not contain"),
        ({"input": '{"region": "\\ud800"}'}, "may not contain"),
        ({"input": '{"region": "eu", "n": NaN}'}, "Malformed JSON"),
        ({"input": "[" * 100_000 + "]" * 100_000}, "nested more than"),
    ],
)
def test_a_refused_add_shows_why_on_the_form(values, words):
    _, client = staff("ada", starter="nightly")
    response = client.post(reverse(ADD), add_form(**values))
    assert response.status_code == 200
    assert words in response.content.decode()
    assert (
        not Schedule.objects.exists()
        and not PeriodicTask.objects.filter(task="schedules.fire").exists()
    )


def test_others_see_only_schedules_of_workflows_they_see_and_change_only_their_own():
    ada, _ = staff("ada", starter="nightly")
    sam, _ = staff("sam", starter="ledger")
    mine = services.schedule_create(
        workflow="nightly", input={"region": "eu"}, cron="0 * * * *", user=ada
    )
    theirs = services.schedule_create(
        workflow="ledger", input={"region": "us"}, cron="0 * * * *", user=sam
    )
    # Another starter of nightly does not see Ada's (a starter reads only their own runs).
    _, carl = staff("carl", starter="nightly")
    listed = carl.get(reverse(CHANGELIST)).content.decode()
    assert f"/admin/schedules/schedule/{mine.pk}/change/" not in listed
    hidden = carl.get(reverse("admin:schedules_schedule_change", args=[mine.pk]))
    assert hidden.status_code == 302
    _, bob = staff("bob", viewer="nightly")
    listed = bob.get(reverse(CHANGELIST)).content.decode()
    assert f"/admin/schedules/schedule/{mine.pk}/change/" in listed
    assert f"/admin/schedules/schedule/{theirs.pk}/change/" not in listed
    unseen = bob.get(reverse("admin:schedules_schedule_change", args=[theirs.pk]))
    assert unseen.status_code == 302  # the admin's answer for an object outside the queryset
    # Bob sees Ada's schedule but may neither switch it off nor delete it.
    change = reverse("admin:schedules_schedule_change", args=[mine.pk])
    assert bob.post(change, {"catch_up": "skip"}).status_code == 403
    delete = reverse("admin:schedules_schedule_delete", args=[mine.pk])
    assert bob.post(delete, {"post": "yes"}).status_code == 403
    assert Schedule.objects.filter(pk=mine.pk).exists()
    _, eve = staff("eve")
    assert eve.get(reverse(CHANGELIST)).status_code == 403
    # Ada switches hers off, then deletes it; beat's periodic task goes with it.
    ada_client = Client()
    ada_client.force_login(ada)
    assert ada_client.post(change, {"catch_up": "skip"}, follow=True).status_code == 200
    mine.refresh_from_db()
    assert mine.task.enabled is False and mine.catch_up == "skip"
    assert ada_client.post(delete, {"post": "yes"}, follow=True).status_code == 200
    assert not Schedule.objects.filter(pk=mine.pk).exists()
    assert not PeriodicTask.objects.filter(pk=mine.task_id).exists()
