"""Events, waits, timers and the reconciler, in the database (no worker: these documents
hold only engine steps, so the engine itself runs them to the end)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from runs import services
from runs.engine import timers
from runs.engine.advance import run_advance
from runs.engine.reconcile import reconcile
from runs.models import Event, Run, StepRun, Timer
from workflows import sdk
from workflows.services import definition_save

pytestmark = pytest.mark.django_db


def wait(step_id: str, event: str = "approved", key: str = "${input.ticket}", **more: Any) -> dict:
    return {"id": step_id, "kind": "wait_event", "event": event, "key": key, **more}


def save(*steps: dict[str, Any], workflow: str = "waits", **top: Any) -> None:
    definition_save(document={"id": workflow, "steps": list(steps), **top})


def start(ticket: Any = "T-1", workflow: str = "waits", **more: Any) -> Run:
    return services.run_start(workflow=workflow, input={"ticket": ticket, **more}).run


def fresh(run: Run) -> Run:
    return Run.objects.get(id=run.id)


def send(name: str = "approved", key: str = "T-1", payload: Any = None) -> int:
    return services.event_send(name=name, key=key, payload=payload)[1]


def fire_now(run: Run) -> int:
    """Bring the timers of the run's waiting rows (and their due times) to now, then tick."""
    past = timezone.now() - timedelta(milliseconds=1)
    Timer.objects.filter(run=run, fired_at__isnull=True, step_run__isnull=False).update(
        fire_at=past
    )
    StepRun.objects.filter(run=run, status="waiting", not_before__isnull=False).update(
        not_before=past
    )
    return timers.fire_due()


# --- waits take events ----------------------------------------------------------------------


def test_a_waiting_run_shows_waiting_and_an_event_resumes_it_with_its_payload() -> None:
    save(wait("approval"), output="${steps.approval.output}")
    run = start()
    assert fresh(run).status == "waiting"
    assert send(payload={"by": "ann"}) == 1
    run = fresh(run)
    assert (run.status, run.output) == ("completed", {"by": "ann"})
    row = run.steps.get()
    assert row.status == "succeeded" and row.event.payload == {"by": "ann"}


def test_an_event_sent_after_the_run_started_but_before_its_wait_is_taken() -> None:
    save(wait("first", event="a"), wait("second", event="b"), output="${steps.second.output}")
    run = start()
    assert send("b", payload="early") == 0  # nobody waits on b yet: kept
    assert send("a") == 1
    run = fresh(run)
    assert (run.status, run.output) == ("completed", "early")


def test_an_event_sent_before_the_run_started_is_not_taken() -> None:
    save(wait("approval"))
    send()
    run = start()
    assert fresh(run).status == "waiting"


def test_two_runs_with_different_keys_each_take_only_their_own() -> None:
    save(wait("approval"), output="${steps.approval.output}")
    one, two = start("T-1"), start("T-2")
    assert send(key="T-2", payload=2) == 1
    assert (fresh(one).status, fresh(two).status, fresh(two).output) == ("waiting", "completed", 2)
    assert send(key="T-1", payload=1) == 1
    assert (fresh(one).status, fresh(one).output) == ("completed", 1)


def test_one_event_resumes_every_run_waiting_on_it() -> None:
    save(wait("approval"))
    runs = [start(), start()]
    assert send() == 2
    assert {fresh(run).status for run in runs} == {"completed"}


def test_a_run_waiting_twice_on_one_key_takes_two_events_oldest_first() -> None:
    save(wait("one"), wait("two"), output=["${steps.one.output}", "${steps.two.output}"])
    run = start()
    assert send(payload=1) == 1
    assert fresh(run).status == "waiting"  # the first event is consumed by the first wait
    assert send(payload=2) == 1
    assert fresh(run).output == [1, 2]


def test_a_stored_event_is_taken_oldest_first() -> None:
    save(wait("gate", event="go"), wait("one"), output="${steps.one.output}")
    run = start()
    send(payload="older")
    send(payload="newer")
    send("go")
    assert fresh(run).output == "older"


def test_a_key_resolved_to_a_number_matches_its_text() -> None:
    save(wait("approval"))
    run = start(42)
    assert send(key="42") == 1 and fresh(run).status == "completed"


def test_the_builder_sends_events() -> None:
    save(wait("approval"))
    run = start()
    assert sdk.send_event("approved", "T-1", {"ok": True}) == 1
    assert fresh(run).steps.get().output == {"ok": True}


# --- time-outs, sleeps and timers ------------------------------------------------------------


def test_a_wait_time_out_fails_the_run_with_class_timeout() -> None:
    save(wait("approval", timeout_ms=60_000))
    run = start()
    timer = Timer.objects.get(run=run, purpose="wait_timeout")
    assert timer.step_run == run.steps.get()
    assert fire_now(run) == 1
    run = fresh(run)
    assert (run.status, run.error["class"], run.error["step"]) == ("failed", "timeout", "approval")
    assert run.steps.get().status == "timed_out"
    # The run is over: its deadline timer went with it; a late event resumes nothing.
    assert not Timer.objects.filter(run=run, fired_at__isnull=True).exists()
    assert send() == 0


def test_a_wait_time_out_with_continue_goes_on() -> None:
    save(
        wait("approval", timeout_ms=60_000, on_error="continue"),
        {"id": "nap", "kind": "sleep", "ms": 0},
        output="${steps.approval.error.class}",
    )
    run = start()
    fire_now(run)
    run = fresh(run)
    assert (run.status, run.output) == ("completed", "timeout")


def test_an_event_racing_the_time_out_resumes_the_wait_only_once() -> None:
    save(wait("approval", timeout_ms=60_000), output="${steps.approval.output}")
    run = start()
    assert send(payload="in time") == 1
    # The time-out timer was deleted with the run's end; firing finds nothing to do.
    assert fire_now(run) == 0
    run = fresh(run)
    assert (run.status, run.output) == ("completed", "in time")
    assert run.steps.count() == 1


def test_a_sleep_waits_for_its_timer_then_the_run_goes_on() -> None:
    save({"id": "nap", "kind": "sleep", "ms": 60_000}, output="done")
    run = start()
    assert fresh(run).status == "waiting"
    assert timers.fire_due() == 0  # not due yet
    assert fire_now(run) == 1
    assert (fresh(run).status, fresh(run).output) == ("completed", "done")
    timer = Timer.objects.get(run=run, purpose="sleep")
    assert timer.fires == 1 and timer.fired_at is not None
    # A second tick claims nothing: the claim is conditional on fired_at.
    assert timers.fire_due() == 0
    assert Timer.objects.get(id=timer.id).fires == 1


def test_a_sleep_until_in_the_past_completes_within_the_start() -> None:
    save({"id": "nap", "kind": "sleep_until", "until": "${input.at}"}, output="over")
    run = start(at="2020-01-01T00:00:00Z")
    assert (fresh(run).status, fresh(run).output) == ("completed", "over")
    assert not Timer.objects.filter(run=run, purpose="sleep").exists()


def test_a_sleep_until_that_is_not_a_time_fails_naming_until() -> None:
    save({"id": "nap", "kind": "sleep_until", "until": "${input.at}"})
    run = fresh(start(at="tomorrow-ish"))
    assert (run.status, run.error["class"]) == ("failed", "invalid_input")
    assert "until" in run.error["message"] and "tomorrow-ish" in run.error["message"]


def test_the_run_deadline_is_a_timer_and_times_the_run_out() -> None:
    save({"id": "nap", "kind": "sleep", "ms": 60_000}, limits={"run_timeout_ms": 120_000})
    run = start()
    deadline = Timer.objects.get(run=run, purpose="run_deadline")
    assert deadline.fire_at == fresh(run).deadline_at
    Timer.objects.filter(run=run, purpose="sleep").update(
        fire_at=timezone.now() + timedelta(days=1)
    )
    Run.objects.filter(id=run.id).update(deadline_at=timezone.now() - timedelta(seconds=1))
    Timer.objects.filter(id=deadline.id).update(fire_at=timezone.now() - timedelta(seconds=1))
    assert timers.fire_due() == 1
    run = fresh(run)
    assert (run.status, run.error["class"]) == ("timed_out", "timeout")
    assert run.steps.get().status == "cancelled"


def test_cancelling_a_waiting_run_removes_its_timers_and_its_wait() -> None:
    save(wait("approval", timeout_ms=60_000))
    run = start()
    services.run_cancel(run_id=run.id)
    assert not Timer.objects.filter(run=run, fired_at__isnull=True).exists()
    assert run.steps.get().status == "cancelled"
    assert send() == 0


def test_a_paused_run_keeps_an_event_and_goes_on_when_resumed() -> None:
    save(wait("approval"), output="${steps.approval.output}")
    run = start()
    services.run_pause(run_id=run.id)
    assert send(payload="while paused") == 1
    assert fresh(run).status == "paused"
    services.run_resume(run_id=run.id)
    run_advance(run_id=run.id)  # what the advance message sent on commit does
    run = fresh(run)
    assert (run.status, run.output) == ("completed", "while paused")


# --- the reconciler ----------------------------------------------------------------------------


def test_the_reconciler_gives_a_wait_an_event_it_missed() -> None:
    save(wait("approval"), output="${steps.approval.output}")
    run = start()
    row = run.steps.get()
    # An event stored without its delivery resuming anyone (a web process that died).
    Event.objects.create(name="approved", key="T-1", wait_key=row.wait_key, payload="late")
    assert reconcile()["missed_events"] == 1
    assert (fresh(run).status, fresh(run).output) == ("completed", "late")
    assert reconcile()["missed_events"] == 0


def test_the_reconciler_advances_a_run_whose_timer_fired_but_whose_advance_was_lost(
    settings,
) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "LOST_MESSAGE_SECONDS": 0}
    save({"id": "nap", "kind": "sleep", "ms": 60_000}, output="woke")
    run = start()
    past = timezone.now() - timedelta(seconds=1)
    StepRun.objects.filter(run=run).update(not_before=past)
    Timer.objects.filter(run=run, purpose="sleep").update(fire_at=past, fired_at=past, fires=1)
    assert reconcile()["stuck_runs"] == 1
    assert (fresh(run).status, fresh(run).output) == ("completed", "woke")


def test_the_reconciler_leaves_a_run_whose_timer_the_tick_just_fired_to_its_advance(
    settings,
) -> None:
    """In a burst of due timers the fired runs' advances wait in a queue: a run whose timer
    fired within LOST_MESSAGE_SECONDS is not advanced a second time by the reconciler."""
    settings.DJFLOW = {**settings.DJFLOW, "LOST_MESSAGE_SECONDS": 10}
    save({"id": "nap", "kind": "sleep", "ms": 60_000}, output="woke")
    run = start()
    long_ago, just_now = timezone.now() - timedelta(seconds=60), timezone.now()
    Run.objects.filter(id=run.id).update(updated_at=long_ago)
    StepRun.objects.filter(run=run).update(not_before=long_ago)
    timer = Timer.objects.filter(run=run, purpose="sleep")
    timer.update(fire_at=long_ago, fired_at=just_now, fires=1)
    assert reconcile()["stuck_runs"] == 0
    assert fresh(run).status == "waiting"
    # The advance never came: once the timer fired that long ago, the reconciler does it.
    timer.update(fired_at=just_now - timedelta(seconds=11))
    assert reconcile()["stuck_runs"] == 1
    assert (fresh(run).status, fresh(run).output) == ("completed", "woke")


def test_the_reconciler_leaves_a_run_that_is_still_sleeping_alone(settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "LOST_MESSAGE_SECONDS": 0}
    save({"id": "nap", "kind": "sleep", "ms": 60_000})
    run = start()
    before = fresh(run).updated_at
    assert reconcile()["stuck_runs"] == 0
    assert fresh(run).updated_at == before


def test_a_second_reconciler_does_nothing_while_one_runs() -> None:
    params = connection.get_connection_params()
    other = psycopg.connect(
        **{k: v for k, v in params.items() if k in ("host", "port", "user", "dbname", "password")},
        autocommit=True,
    )
    try:
        other.execute("SELECT pg_advisory_lock(%s)", [0x646A666C6F77])
        assert reconcile() == {}
        other.execute("SELECT pg_advisory_unlock(%s)", [0x646A666C6F77])
        assert reconcile() != {}
    finally:
        other.close()


def test_the_reconciler_prunes_fired_timers_past_their_retention(settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "TIMER_RETENTION_SECONDS": 60}
    save({"id": "nap", "kind": "sleep", "ms": 60_000})
    run = start()
    old = timezone.now() - timedelta(minutes=2)
    Timer.objects.filter(run=run, purpose="sleep").update(fired_at=old, fires=1)
    assert reconcile()["timers_pruned"] == 1
    assert Timer.objects.filter(run=run, purpose="run_deadline").exists()  # unfired: kept


# --- POST /api/v1/events ----------------------------------------------------------------------


def test_the_events_api_answers_how_many_waits_it_resumed(api: APIClient) -> None:
    save(wait("approval"))
    run = start()
    response = api.post(
        "/api/v1/events", {"name": "approved", "key": "T-1", "payload": [1]}, format="json"
    )
    assert response.status_code == 200
    assert response.json()["matched"] == 1
    assert Event.objects.get(id=response.json()["id"]).payload == [1]
    assert fresh(run).status == "completed"
    again = api.post("/api/v1/events", {"name": "approved", "key": "T-1"}, format="json")
    assert (again.status_code, again.json()["matched"]) == (200, 0)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"key": "k"}, "name"),
        ({"name": "", "key": "k"}, "name"),
        ({"name": 7, "key": "k"}, "name"),
        ({"name": "x" * 201, "key": "k"}, "name"),
        ({"name": "n"}, "key"),
        ({"name": "n", "key": 42}, "key"),
        ({"name": "n", "key": "k" * 501}, "key"),
        ({"name": "n", "key": "k", "extra": 1}, "extra"),
        (["name"], "body"),
    ],
)
def test_a_bad_event_is_a_400_naming_the_field_and_nothing_is_stored(
    api: APIClient, body: Any, field: str
) -> None:
    response = api.post("/api/v1/events", body, format="json")
    assert response.status_code == 400
    assert field in {error.get("field") for error in response.json()["errors"]}
    assert not Event.objects.exists()


def test_the_events_api_needs_authentication(anon_api: APIClient) -> None:
    response = anon_api.post("/api/v1/events", {"name": "n", "key": "k"}, format="json")
    assert response.status_code in (401, 403)
    assert not Event.objects.exists()


def test_the_service_refuses_what_the_api_would(db) -> None:
    from workflows.errors import InvalidInput

    with pytest.raises(InvalidInput) as caught:
        services.event_send(name="", key=None)
    assert {error.field for error in caught.value.errors} == {"name", "key"}


# --- the embedded default's path, and the admin ------------------------------------------------


def test_the_tick_claims_each_timer_once_on_the_portable_path_too() -> None:
    from unittest import mock

    save({"id": "nap", "kind": "sleep", "ms": 60_000}, output="done")
    run = start()
    past = timezone.now() - timedelta(milliseconds=1)
    Timer.objects.filter(run=run, purpose="sleep").update(fire_at=past)
    StepRun.objects.filter(run=run).update(not_before=past)
    with mock.patch("runs.engine.timers.connection", mock.Mock(vendor="sqlite")):
        assert timers.fire_due() == 1
        assert timers.fire_due() == 0
    assert fresh(run).status == "completed"
    assert Timer.objects.get(run=run, purpose="sleep").fires == 1


def test_events_and_timers_are_listed_read_only_in_the_admin(admin_client) -> None:
    from django.urls import reverse

    save(wait("approval"))
    run = start()
    event, matched = services.event_send(name="approved", key="T-1", payload={"by": "ann"})
    assert matched == 1
    listing = admin_client.get(reverse("admin:runs_event_changelist"))
    assert listing.status_code == 200 and b"approved" in listing.content
    page = admin_client.get(reverse("admin:runs_event_change", args=[event.id]))
    assert page.status_code == 200
    assert str(run.id).encode() in page.content and b"ann" in page.content
    assert admin_client.get(reverse("admin:runs_event_add")).status_code == 403
    timers_page = admin_client.get(reverse("admin:runs_timer_changelist"))
    assert timers_page.status_code == 200 and b"run_deadline" in timers_page.content


def _claimed_one_task() -> tuple[Run, Any]:
    from unittest import mock

    from workers.claims import claim_attempt

    save({"id": "work", "kind": "task", "timeout_ms": 1000}, workflow="one_task")
    with mock.patch("workers.tasks.execute_step.apply_async"):
        run = start(workflow="one_task")
    attempt = run.steps.get()
    return run, claim_attempt(attempt.id, worker="w1", now=timezone.now())


def test_a_claim_sets_no_timer_and_a_stale_claim_records_nothing() -> None:
    from runs.engine.store import record_result

    _, claimed = _claimed_one_task()
    # The deadline and the lease are on the attempt's row; the tick reads the lease index.
    assert not Timer.objects.filter(step_run_id=claimed.id).exists()
    row = StepRun.objects.get(id=claimed.id)
    grace = timedelta(seconds=5)  # DEADLINE_GRACE_SECONDS
    assert row.lease_expires_at <= row.deadline_at + grace
    assert not record_result(claimed.id, uuid.uuid4(), {"status": "succeeded"})
    assert StepRun.objects.get(id=claimed.id).status == "running"
    assert record_result(claimed.id, claimed.claim, {"status": "succeeded"})
    assert StepRun.objects.get(id=claimed.id).status == "succeeded"


def test_the_run_is_locked_and_the_result_recorded_in_one_statement_fenced_by_the_claim():
    from django.db import transaction

    from runs.engine.advance import lock_run_recording

    run, claimed = _claimed_one_task()
    with transaction.atomic():
        locked, recorded = lock_run_recording(
            run.id, claimed.id, uuid.uuid4(), {"status": "succeeded"}
        )
    assert (locked.id, locked.status, recorded) == (run.id, "running", False)
    assert StepRun.objects.get(id=claimed.id).status == "running"
    with transaction.atomic():
        locked, recorded = lock_run_recording(
            run.id, claimed.id, claimed.claim, {"status": "succeeded", "output": {"n": 1}}
        )
    assert (locked.id, recorded) == (run.id, True)
    # The run as the ORM reads it, field for field (JSON and encrypted fields converted).
    assert {f.attname: getattr(locked, f.attname) for f in Run._meta.concrete_fields} == {
        f.attname: getattr(fresh(run), f.attname) for f in Run._meta.concrete_fields
    }
    assert StepRun.objects.get(id=claimed.id).output == {"n": 1}
    assert lock_run_recording(uuid.uuid4(), claimed.id, claimed.claim, {"status": "failed"}) == (
        None,
        False,
    )


def test_a_lock_and_record_the_database_refuses_raises_djangos_error_and_rolls_back():
    """The statement goes in psycopg's pipeline mode (its BEGIN with it): an error there is
    still Django's (the recording's retry on OperationalError catches Django's classes), and
    the transaction is rolled back whole."""
    from django.db import IntegrityError, transaction

    from runs.engine.advance import lock_run_recording

    run, claimed = _claimed_one_task()
    with pytest.raises(IntegrityError), transaction.atomic():
        # A negative attempt number breaks the column's CHECK constraint in Postgres.
        lock_run_recording(
            run.id, claimed.id, claimed.claim, {"status": "succeeded", "attempt": -1}
        )
    assert StepRun.objects.get(id=claimed.id).status == "running"
    with transaction.atomic():
        assert lock_run_recording(run.id, claimed.id, claimed.claim, {"status": "succeeded"})[1]


def test_the_tick_times_out_an_attempt_past_its_deadline_plus_grace() -> None:
    run, claimed = _claimed_one_task()
    row = StepRun.objects.get(id=claimed.id)
    # Not yet: the lease has not lapsed.
    assert timers.lapsed_leases(timezone.now(), 100) == []
    lapsed_at = row.lease_expires_at
    assert timers.lapsed_leases(lapsed_at, 100) == [run.id]
    # The body hung: its worker never reported. The tick at the lapse times it out.
    StepRun.objects.filter(id=claimed.id).update(
        deadline_at=timezone.now() - timedelta(seconds=10),
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    timers.fire_due(budget_seconds=5)
    row = StepRun.objects.get(id=claimed.id)
    assert row.status == "timed_out", row.error
    assert fresh(run).status in ("failed", "running")  # retried or failed by its policy
    assert timers.lapsed_leases(timezone.now(), 100) == []


def test_the_tick_gives_up_an_attempt_whose_worker_was_lost_and_leaves_old_lapses() -> None:
    _, claimed = _claimed_one_task()
    # A lease that lapsed long ago is the reconciler's (the tick looks 10 s back): a lapse
    # the planner leaves alone (a paused run's) is not advanced at every tick.
    StepRun.objects.filter(id=claimed.id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=timers.LEASE_LAPSE_WINDOW + 5)
    )
    assert timers.lapsed_leases(timezone.now(), 100) == []
    timers.fire_due(budget_seconds=5)
    assert StepRun.objects.get(id=claimed.id).status == "running"
    reconcile()
    row = StepRun.objects.get(id=claimed.id)
    assert row.status == "failed" and "lost" in row.error["message"], row.error
    # A fresh lapse is the tick's.
    _, claimed2 = _claimed_one_task()
    StepRun.objects.filter(id=claimed2.id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    timers.fire_due(budget_seconds=5)
    row = StepRun.objects.get(id=claimed2.id)
    assert row.status == "failed" and "lost" in row.error["message"], row.error


def test_an_attempt_given_up_by_the_tick_has_what_it_reserved_charged_at_once() -> None:
    from decimal import Decimal

    run, claimed = _claimed_one_task()
    StepRun.objects.filter(id=claimed.id).update(
        reserved_usd=Decimal("0.25"), lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    timers.fire_due(budget_seconds=5)
    row = StepRun.objects.get(id=claimed.id)
    assert row.status == "failed" and "lost" in row.error["message"]
    # Charged in the advance that gave it up, not at the reconciler's next pass.
    assert (row.reserved_usd, row.cost_usd) == (0, Decimal("0.25"))
    assert fresh(run).cost_usd == Decimal("0.25")


def test_the_reconciler_advances_a_run_whose_advance_request_went_unanswered(settings) -> None:
    from runs.engine.store import request_advance
    from runs.models import AdvanceRequest

    settings.DJFLOW = {**settings.DJFLOW, "LOST_MESSAGE_SECONDS": 0}
    save({"id": "nap", "kind": "sleep", "ms": 60_000})
    run = start()
    assert request_advance(run.id) is True
    assert request_advance(run.id) is False  # one pending request per run
    assert reconcile()["requested"] == 1
    assert not AdvanceRequest.objects.filter(run=run).exists()


@pytest.mark.parametrize(
    "until",
    [
        "2030-01-01T00:00:00+99:00",
        "2030-01-01T00:00:00+20:00",
        "2030-01-01T00:00:00-16:00",
        "9999-12-31T23:59:59-10:00",
        "0001-01-01T00:00:00+05:00",
        "10000-01-01T00:00:00Z",
        10**20,
        253402300800000,
        "99999999999999999999",
    ],
)
def test_a_sleep_until_beyond_what_can_be_represented_fails_once(until: Any) -> None:
    save({"id": "nap", "kind": "sleep_until", "until": "${input.at}"})
    run = fresh(start(at=until))
    assert (run.status, run.error["class"], run.error["step"]) == ("failed", "invalid_input", "nap")
    assert "until" in run.error["message"] and str(until) in run.error["message"]
    assert StepRun.objects.filter(run=run).count() == 1
    reconcile()
    assert fresh(run).status == "failed"
    assert StepRun.objects.filter(run=run).count() == 1


def test_a_sleep_until_the_last_representable_moment_waits() -> None:
    save({"id": "nap", "kind": "sleep_until", "until": "${input.at}"})
    run = start(at="9999-12-31T23:59:59.999+00:00")
    reconcile()
    assert fresh(run).status == "waiting"
    timer = Timer.objects.get(run=run, purpose="sleep")
    assert timer.fire_at.year == 9999
