"""The schedules API and services on Postgres, no worker: who may create, list, read and
delete (CONTRACT section 8), the 400s naming each field, and the fire (the slot a message
starts, the run's idempotency key, a fire refused at run time recorded on the schedule, the
catch-up after beat was down) with the clock travelled by hand."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from django_celery_beat.models import PeriodicTask
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs.models import Run
from schedules import services
from schedules.models import Schedule
from workflows import access, secrets
from workflows.services import definition_save

pytestmark = pytest.mark.django_db

DOCUMENT = {
    "id": "nightly",
    "input_schema": {
        "type": "object",
        "required": ["region"],
        "properties": {
            "region": {"type": "string"},
            "token": {"type": "string", "writeOnly": True},
        },
    },
    "steps": [{"id": "nap", "kind": "sleep", "ms": 10}],
}
OTHER = {**DOCUMENT, "id": "ledger"}
FIELDS = {"id", "workflow", "version", "input", "cron", "every_ms", "enabled", "next_run_at"}


@pytest.fixture(autouse=True)
def _workflows(db):
    definition_save(document=DOCUMENT)
    definition_save(document=OTHER)


@pytest.fixture(autouse=True)
def _no_messages():
    # A fire's run is planned by a worker (runs.advance after commit); none runs here.
    with mock.patch("runs.dispatch.advance_on_commit"):
        yield


def person(name: str, **roles: str):
    user = get_user_model().objects.create_user(username=name, password="a-long-password-1")
    for role, workflow in roles.items():
        access.grant(role, workflow, user=user)
    return user


def client_of(user) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def create(client: APIClient, **body):
    body = {"workflow": "nightly", "input": {"region": "eu"}, "cron": "0 2 * * *", **body}
    return client.post("/api/v1/schedules", body, format="json")


def fields(response) -> list[str | None]:
    return [e.get("field") for e in response.json()["errors"]]


# --- create and read ---------------------------------------------------------------------


def test_a_starter_creates_a_cron_schedule_beat_will_send():
    ada = person("ada", starter="nightly")
    response = create(client_of(ada), input={"region": "eu", "token": "s3cret"})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert set(body) >= FIELDS
    assert body["workflow"] == "nightly" and body["version"] is None
    assert body["cron"] == "0 2 * * *" and body["every_ms"] is None
    assert body["enabled"] is True and body["owner"] == "ada" and body["catch_up"] == "one"
    # The secret is sealed like a run's: shown masked, stored as a token.
    assert body["input"] == {"region": "eu", "token": "••••"}
    schedule = Schedule.objects.get(pk=body["id"])
    assert "s3cret" not in str(schedule.input) and schedule.secrets
    # Beat's side: a periodic task of schedules.fire with the schedule's id, on the clock's
    # queue, at 02:00.
    task = PeriodicTask.objects.get(pk=schedule.task_id)
    assert task.task == "schedules.fire" and task.queue == "timers"
    assert task.kwargs == f'{{"schedule_id": {schedule.pk}}}'
    assert (task.crontab.minute, task.crontab.hour) == ("0", "2")
    next_run_at = schedule.next_run_at
    assert (next_run_at.hour, next_run_at.minute, next_run_at.second) == (2, 0, 0)
    assert timezone.now() < next_run_at <= timezone.now() + timedelta(days=1)
    assert client_of(ada).get(f"/api/v1/schedules/{schedule.pk}").json() == body


def test_an_interval_schedule_pinned_to_a_version(settings):
    ada = person("ada", starter="nightly")
    response = create(client_of(ada), cron=None, every_ms=90_000, version=1, catch_up="skip")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["every_ms"], body["cron"], body["version"], body["catch_up"]) == (
        90_000,
        None,
        1,
        "skip",
    )
    task = PeriodicTask.objects.get(djflow_schedule__pk=body["id"])
    assert (task.interval.every, task.interval.period) == (90, "seconds")
    # In the longest period that divides it, as the admin shows it; milliseconds kept.
    for every_ms, interval in (
        (7_200_000, (2, "hours")),
        (86_400_000, (1, "days")),
        (61_500, (61_500_000, "microseconds")),
    ):
        made = create(client_of(ada), cron=None, every_ms=every_ms).json()
        assert made["every_ms"] == every_ms
        task = PeriodicTask.objects.get(djflow_schedule__pk=made["id"])
        assert (task.interval.every, task.interval.period) == interval


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"cron": "61 * * * *"}, "cron", "not a cron expression"),
        ({"cron": "* * *"}, "cron", "has 3 fields"),
        ({"cron": "0 2 * * * *"}, "cron", "has 6 fields"),
        ({"cron": "0 0 31 2 *"}, "cron", "never occurs"),
        ({"cron": None}, "cron", "exactly one of cron and every_ms"),
        ({"every_ms": 60_000}, "cron", "exactly one of cron and every_ms"),
        ({"cron": None, "every_ms": 1000}, "every_ms", "DJFLOW_SCHEDULE_MIN_INTERVAL_MS"),
        ({"cron": None, "every_ms": 10**13}, "every_ms", "a year"),
        ({"cron": None, "every_ms": "60000"}, "every_ms", "valid integer"),
        ({"cron": None, "every_ms": 3_000_001}, "every_ms", "whole seconds"),
        ({"input": {"region": 7}}, "input.region", "string"),
        ({"input": {}}, "input.region", "required"),
        ({"catch_up": "all"}, "catch_up", "valid choice"),
        ({"version": 0}, "version", "greater than or equal"),
        ({"colour": "red"}, "colour", "is not a field"),
    ],
)
def test_bad_values_are_400s_naming_the_field(body, field, words):
    response = create(client_of(person("ada", starter="nightly")), **body)
    assert response.status_code == 400, response.json()
    assert field in fields(response), response.json()
    message = next(e["message"] for e in response.json()["errors"] if e.get("field") == field)
    assert words in message
    assert (
        not Schedule.objects.exists()
        and not PeriodicTask.objects.filter(task="schedules.fire").exists()
    )


def test_unknown_version_is_a_404_naming_it():
    response = create(client_of(person("ada", starter="nightly")), version=9)
    assert response.status_code == 404 and fields(response) == ["version"]


def test_a_workflow_holds_a_bounded_number_of_schedules(settings):
    settings.DJFLOW = {**settings.DJFLOW, "SCHEDULES_PER_WORKFLOW": 2}
    ada = client_of(person("ada", starter="nightly"))
    assert create(ada).status_code == 201
    assert create(ada, cron="*/5 * * * *").status_code == 201
    third = create(ada, cron="*/7 * * * *")
    assert third.status_code == 400 and fields(third) == ["workflow"]
    assert "DJFLOW_SCHEDULES_PER_WORKFLOW" in third.json()["errors"][0]["message"]


def test_a_starter_cannot_use_up_the_workflows_schedules(settings):
    """The cap is each owner's (issue 36): a user who may only start the workflow (here by
    the global runs.add_run, which makes one of every workflow) fills their own share and no
    more; the workflow's author and another starter still make theirs, each up to the cap.
    On the cap counted per workflow, the author's first create was the 400."""
    from django.contrib.auth.models import Permission

    settings.DJFLOW = {**settings.DJFLOW, "SCHEDULES_PER_WORKFLOW": 2}
    mallory = person("mallory")
    mallory.user_permissions.add(Permission.objects.get(codename="add_run"))
    starter = client_of(mallory)
    assert create(starter).status_code == 201
    assert create(starter, cron="*/5 * * * *").status_code == 201
    refused = create(starter, cron="*/7 * * * *")
    assert refused.status_code == 400 and fields(refused) == ["workflow"]
    for who in (person("ada", author="nightly"), person("bob", starter="nightly")):
        owner = client_of(who)
        assert create(owner).status_code == 201
        assert create(owner, cron="*/5 * * * *").status_code == 201
        assert create(owner, cron="*/7 * * * *").status_code == 400
    assert Schedule.objects.filter(workflow_id="nightly").count() == 6


# --- who may ---------------------------------------------------------------------------------


def test_only_a_starter_of_the_workflow_may_create():
    stranger = client_of(person("eve"))
    viewer = client_of(person("vic", viewer="nightly"))
    other = client_of(person("sam", starter="ledger"))
    unseen = create(stranger)
    assert unseen.status_code == 404 and fields(unseen) == ["workflow"]
    assert create(other).status_code == 404  # a starter of another workflow sees not this one
    seen = create(viewer)
    assert seen.status_code == 403 and fields(seen) == ["workflow"]
    assert create(stranger, workflow="nowhere").status_code == 404
    assert not Schedule.objects.exists()
    # ... and the one who may, next to them.
    assert create(client_of(person("ada", starter="nightly"))).status_code == 201


def test_users_list_and_read_only_schedules_of_workflows_they_see():
    ada = person("ada", starter="nightly")
    sam = person("sam", starter="ledger")
    mine = create(client_of(ada)).json()["id"]
    theirs = create(client_of(sam), workflow="ledger").json()["id"]
    listed = client_of(ada).get("/api/v1/schedules").json()
    assert [s["id"] for s in listed["results"]] == [mine] and listed["next"] is None
    assert client_of(ada).get(f"/api/v1/schedules/{theirs}").status_code == 404
    stranger = client_of(person("eve"))
    assert stranger.get("/api/v1/schedules").json()["results"] == []
    assert stranger.get(f"/api/v1/schedules/{mine}").status_code == 404
    # A global viewer (runs.view_run) sees every workflow, and so every schedule.
    root = get_user_model().objects.create_superuser(username="root", password="x-long-pass-1")
    both = client_of(root).get("/api/v1/schedules").json()["results"]
    assert {s["id"] for s in both} == {mine, theirs}
    assert [
        s["id"] for s in client_of(root).get("/api/v1/schedules?workflow=ledger").json()["results"]
    ] == [theirs]
    assert client_of(ada).get("/api/v1/schedules/abc").status_code == 404
    assert APIClient().get("/api/v1/schedules").status_code == 401


def test_another_starter_does_not_see_a_schedule_its_viewers_do():
    # A starter reads only the runs they started (CONTRACT section 8); a schedule holds the
    # input of runs its owner starts, and its last run and error: another starter of the
    # workflow may not see it (404, as one unseen), its viewers and operators may.
    ada = person("ada", starter="nightly")
    made = create(client_of(ada), input={"region": "ada-only", "token": "s3cret"}).json()["id"]
    bob = client_of(person("bob", starter="nightly"))
    assert bob.get("/api/v1/schedules").json()["results"] == []
    assert bob.get(f"/api/v1/schedules/{made}").status_code == 404
    assert bob.delete(f"/api/v1/schedules/{made}").status_code == 404
    for role in ("viewer", "operator"):
        reader = client_of(person(f"{role}_user", **{role: "nightly"}))
        assert [s["id"] for s in reader.get("/api/v1/schedules").json()["results"]] == [made]
        shown = reader.get(f"/api/v1/schedules/{made}").json()
        assert shown["input"] == {"region": "ada-only", "token": "••••"}
    # Its owner sees it, with or without the role it was made with.
    access.revoke("starter", "nightly", user=ada)
    assert client_of(ada).get(f"/api/v1/schedules/{made}").status_code == 200


def test_only_the_owner_or_an_operator_deletes():
    ada = person("ada", starter="nightly")
    made = create(client_of(ada)).json()["id"]
    eve = client_of(person("eve"))
    assert eve.delete(f"/api/v1/schedules/{made}").status_code == 404
    bob = client_of(person("bob", viewer="nightly"))  # a viewer: sees, may not delete
    refused = bob.delete(f"/api/v1/schedules/{made}")
    assert refused.status_code == 403 and fields(refused) == ["id"]
    assert Schedule.objects.filter(pk=made).exists()
    assert client_of(ada).delete(f"/api/v1/schedules/{made}").status_code == 204
    assert not Schedule.objects.filter(pk=made).exists()
    assert not PeriodicTask.objects.filter(task="schedules.fire").exists()
    assert client_of(ada).delete(f"/api/v1/schedules/{made}").status_code == 404
    again = create(client_of(ada)).json()["id"]
    oscar = client_of(person("oscar", operator="nightly"))
    assert oscar.delete(f"/api/v1/schedules/{again}").status_code == 204


# --- the fire --------------------------------------------------------------------------------


def make(user, **kwargs) -> Schedule:
    values = {"workflow": "nightly", "input": {"region": "eu", "token": "s3cret"}}
    return services.schedule_create(**{**values, **kwargs}, user=user)


def test_a_create_holds_the_inputs_secrets_so_its_logs_and_error_reports_mask_them():
    # As POST /runs does (workflows.secrets.expose): an error report of the request that
    # made the schedule carries its body, the secret in plain text.
    secrets.forget()
    try:
        make(person("ada", starter="nightly"), cron="0 * * * *")
        assert "s3cret" in secrets.exposed()
    finally:
        secrets.forget()


def test_a_fire_starts_one_run_per_slot_as_the_owner_with_the_input():
    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *")
    slot = schedule.next_run_at
    first = services.schedule_fire(schedule_id=schedule.pk, now=slot + timedelta(milliseconds=30))
    assert first is not None and first.slot == slot
    # Two beats and a redelivery: later messages for the same slot start nothing.
    for later in (40, 300, 5000):
        when = slot + timedelta(milliseconds=later)
        assert services.schedule_fire(schedule_id=schedule.pk, now=when) is None
    run = Run.objects.get()
    assert run.created_by == ada and run.workflow_id == "nightly"
    assert run.idempotency_key == services.slot_key(schedule, slot)
    assert run.correlation == f"schedule:{schedule.pk}"
    # The run's input is the schedule's, its secret sealed again on the run.
    assert run.input["region"] == "eu" and "s3cret" not in str(run.input) and run.secrets
    schedule.refresh_from_db()
    assert (schedule.starts, schedule.missed, schedule.failures) == (1, 0, 0)
    assert schedule.last_run == run and schedule.last_slot_at == slot
    assert schedule.next_run_at == slot + timedelta(hours=1)
    # The next slot starts the next run.
    services.schedule_fire(schedule_id=schedule.pk, now=slot + timedelta(hours=1, seconds=1))
    assert Run.objects.count() == 2


def test_the_slot_key_finds_the_run_should_the_schedule_be_set_back():
    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *")
    slot = schedule.next_run_at
    services.schedule_fire(schedule_id=schedule.pk, now=slot)
    # A restore of an older copy of the row: next_run_at is the fired slot again.
    Schedule.objects.filter(pk=schedule.pk).update(next_run_at=slot)
    assert services.schedule_fire(schedule_id=schedule.pk, now=slot).slot == slot
    assert Run.objects.count() == 1
    assert Schedule.objects.get(pk=schedule.pk).starts == 1


def test_a_fire_the_owner_may_no_longer_make_fails_visibly(caplog):
    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *")
    access.revoke("starter", "nightly", user=ada)
    slot = schedule.next_run_at
    with caplog.at_level("WARNING", logger="schedules.services"):
        decision = services.schedule_fire(schedule_id=schedule.pk, now=slot)
    assert decision is not None and decision.slot == slot
    assert not Run.objects.exists()
    schedule.refresh_from_db()
    assert schedule.failures == 1 and schedule.starts == 0
    assert "unknown workflow 'nightly'" in schedule.last_error and schedule.last_error_at
    assert f"schedule {schedule.pk} (nightly): the start for" in caplog.text
    # The schedule goes on: its next slot is the next hour's.
    assert schedule.next_run_at == slot + timedelta(hours=1)
    shown = client_of(get_user_model().objects.create_superuser("root", password="pw-long-1"))
    body = shown.get(f"/api/v1/schedules/{schedule.pk}").json()
    assert body["failures"] == 1 and "nightly" in body["last_error"]


def test_a_fire_with_the_owner_deleted_or_inactive_fails_visibly():
    ada = person("ada", starter="nightly")
    bob = person("bob", starter="nightly")
    gone = make(ada, cron="0 * * * *")
    idle = make(bob, cron="0 * * * *")
    bob.is_active = False
    bob.save()
    ada.delete()
    for schedule, words in ((gone, "owner was deleted"), (idle, "inactive")):
        services.schedule_fire(schedule_id=schedule.pk, now=schedule.next_run_at)
        schedule.refresh_from_db()
        assert schedule.failures == 1 and words in schedule.last_error
    assert not Run.objects.exists()


def test_an_input_the_latest_version_refuses_fails_visibly():
    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *")
    stricter = {**DOCUMENT, "input_schema": {**DOCUMENT["input_schema"], "required": ["day"]}}
    definition_save(document=stricter)
    services.schedule_fire(schedule_id=schedule.pk, now=schedule.next_run_at)
    schedule.refresh_from_db()
    assert schedule.failures == 1 and "input.day" in schedule.last_error
    assert not Run.objects.exists()


def test_a_timing_edited_on_beats_page_counts_from_then():
    """Someone changes the crontab on django-celery-beat's "Periodic tasks" page from hourly
    to every five minutes: the next message (at a five-minute slot) fires that slot, and
    the schedule goes on every five minutes; nothing counts as missed."""
    from django_celery_beat.models import CrontabSchedule

    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *")
    hourly = schedule.next_run_at
    task = schedule.task
    task.crontab = CrontabSchedule.objects.create(minute="*/5", timezone="UTC")
    task.save()
    slot = hourly + timedelta(minutes=25)  # the hour's slot is still to come
    fire = services.schedule_fire(schedule_id=schedule.pk, now=slot + timedelta(milliseconds=20))
    assert fire is not None and fire.slot == slot and fire.missed == 0
    schedule.refresh_from_db()
    assert schedule.timing == "cron:*/5 * * * * UTC"
    assert schedule.next_run_at == slot + timedelta(minutes=5)
    assert Run.objects.count() == 1


def test_trusted_code_makes_no_ownerless_schedule():
    with pytest.raises(services.Forbidden, match="signed-in user"):
        services.schedule_create(workflow="nightly", input={"region": "eu"}, cron="0 * * * *")


def test_a_disabled_or_deleted_schedule_fires_nothing():
    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *", enabled=False)
    assert services.schedule_fire(schedule_id=schedule.pk, now=schedule.next_run_at) is None
    assert services.schedule_fire(schedule_id=987654, now=timezone.now()) is None
    assert not Run.objects.exists()


@pytest.mark.parametrize(("catch_up", "runs"), [("one", 1), ("skip", 0)])
def test_beat_down_for_hours_then_back(catch_up, runs, settings):
    """Beat was down over three slots of an hourly cron and came back 20 minutes after the
    last: "one" starts one run (for the latest slot), "skip" none; both wait for the next
    slot, and a second message (the other beat's) at return starts nothing more."""
    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *", catch_up=catch_up)
    first = schedule.next_run_at
    back = first + timedelta(hours=2, minutes=20)
    decision = services.schedule_fire(schedule_id=schedule.pk, now=back)
    assert services.schedule_fire(schedule_id=schedule.pk, now=back + timedelta(seconds=1)) is None
    assert Run.objects.count() == runs
    schedule.refresh_from_db()
    assert schedule.next_run_at == first + timedelta(hours=3)
    assert schedule.missed == (2 if catch_up == "one" else 3)
    if runs:
        assert decision.slot == first + timedelta(hours=2)
        assert Run.objects.get().idempotency_key == services.slot_key(schedule, decision.slot)


def test_the_setting_decides_when_the_schedule_does_not(settings):
    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *")
    assert schedule.catch_up is None
    settings.DJFLOW = {**settings.DJFLOW, "SCHEDULE_CATCH_UP": "skip"}
    late = schedule.next_run_at + timedelta(minutes=20)
    services.schedule_fire(schedule_id=schedule.pk, now=late)
    assert not Run.objects.exists()
    assert Schedule.objects.get(pk=schedule.pk).missed == 1


def test_turned_back_on_a_schedule_waits_for_its_next_slot():
    ada = person("ada", starter="nightly")
    schedule = make(ada, cron="0 * * * *")
    services.schedule_change(schedule_id=schedule.pk, user=ada, enabled=False)
    assert PeriodicTask.objects.get(pk=schedule.task_id).enabled is False
    services.schedule_change(schedule_id=schedule.pk, user=ada, enabled=True)
    schedule.refresh_from_db()
    assert schedule.task.enabled and schedule.next_run_at > timezone.now()
    bob = person("bob", viewer="nightly")
    with pytest.raises(services.Forbidden):
        services.schedule_change(schedule_id=schedule.pk, user=bob, enabled=False)


def test_the_sweep_fires_a_slot_whose_message_was_lost(settings):
    """Beat's message for the 10:00 slot was lost (a broker restart): the sweep, every
    RECONCILE_SECONDS, fires it once it is LOST_MESSAGE_SECONDS overdue, and only once."""
    ada = person("ada", starter="nightly")
    lost = make(ada, cron="0 * * * *")
    fine = make(ada, cron="0 * * * *")
    off = make(ada, cron="0 * * * *", enabled=False)
    slot = lost.next_run_at
    # The message for ``fine`` came.
    services.schedule_fire(schedule_id=fine.pk, now=slot + timedelta(milliseconds=50))
    assert services.schedules_sweep(now=slot + timedelta(seconds=5)) == 0  # not overdue yet
    assert services.schedules_sweep(now=slot + timedelta(seconds=25)) == 1
    assert services.schedules_sweep(now=slot + timedelta(seconds=55)) == 0
    started = {run.correlation: run for run in Run.objects.all()}
    assert set(started) == {f"schedule:{lost.pk}", f"schedule:{fine.pk}"}
    assert started[f"schedule:{lost.pk}"].idempotency_key == services.slot_key(lost, slot)
    lost.refresh_from_db()
    assert lost.missed == 0 and lost.next_run_at == slot + timedelta(hours=1)
    off.refresh_from_db()
    assert off.next_run_at == slot


def test_the_sweep_goes_on_past_a_schedule_it_cannot_fire(settings):
    """A schedule whose crontab row was edited by hand to a value Celery cannot read raises
    in its fire: the sweep records it on the schedule, counts it, and fires the others (it
    raised out of the sweep before, every RECONCILE_SECONDS, and fired none after it)."""
    from django_celery_beat.models import CrontabSchedule
    from prometheus_client import REGISTRY

    def failures() -> float:
        labels = {"pass": "schedules.sweep"}
        return REGISTRY.get_sample_value("djflow_pass_failures_total", labels) or 0.0

    ada = person("ada", starter="nightly")
    broken = make(ada, cron="0 * * * *")
    fine = make(ada, cron="0 * * * *")
    slot = broken.next_run_at
    # Its own crontab row (beat's admin shares rows between tasks of one timing).
    tab = CrontabSchedule.objects.create(minute="99", hour="*")
    PeriodicTask.objects.filter(pk=broken.task_id).update(crontab=tab)
    Schedule.objects.filter(pk=broken.pk).update(next_run_at=slot - timedelta(minutes=1))
    before = failures()
    assert services.schedules_sweep(now=slot + timedelta(seconds=25)) == 1
    assert Run.objects.get().correlation == f"schedule:{fine.pk}"
    broken.refresh_from_db()
    assert broken.failures == 1 and broken.last_error.startswith("the sweep: ValueError")
    assert failures() == before + 1


def test_the_sweeps_beat_entry_is_installed_and_repaired(db):
    from django_celery_beat.models import IntervalSchedule

    from schedules.beat import SWEEP, install_beat_entry

    install_beat_entry(IntervalSchedule, PeriodicTask, reconcile_seconds=7)
    install_beat_entry(IntervalSchedule, PeriodicTask, reconcile_seconds=7)
    entry = PeriodicTask.objects.get(name=SWEEP)
    assert (entry.task, entry.queue, entry.interval.every, entry.enabled) == (
        "schedules.sweep",
        "timers",
        7,
        True,
    )
