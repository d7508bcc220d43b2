"""The in_doubt step-run status against the database (CONTRACT section 13): an at_most_once
attempt whose worker's lease lapsed waits for an operator, who resolves it through
``POST /api/v1/runs/{id}/steps/{step_run_id}/resolve`` (operators only: 404 for those who
cannot see the run, 403 for its viewers; recorded), or its deadline (a timer row) fails it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from runs import services
from runs.engine import timers
from runs.engine.advance import run_advance
from runs.engine.reconcile import advance_stuck
from runs.models import Run, RunAction, StepRun, Timer
from workers.claims import claim_attempt
from workflows import access
from workflows.services import definition_save

from ..test_access import api_for, person

pytestmark = pytest.mark.django_db

PAYOUT = {
    "id": "payout",
    "steps": [
        {
            "id": "pay",
            "kind": "task",
            "effect": "at_most_once",
            "retry": {"max_attempts": 3, "backoff": "none"},
        },
        {"id": "receipt", "kind": "task", "input": {"paid": "${steps.pay.output.paid}"}},
    ],
}


@pytest.fixture
def payout() -> None:
    definition_save(document=PAYOUT)


def in_doubt(user: Any = None) -> tuple[Run, StepRun]:
    """A payout run whose ``pay`` attempt started on a worker that was then lost."""
    run = services.run_start(workflow="payout", input={"amount": 5}, user=user).run
    if not run.steps.exists():
        run_advance(run_id=run.id)
    attempt = run.steps.get(step_id="pay")
    assert claim_attempt(attempt.id, worker="w-lost", now=timezone.now()) is not None
    StepRun.objects.filter(id=attempt.id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    run_advance(run_id=run.id)
    return Run.objects.get(id=run.id), StepRun.objects.get(id=attempt.id)


def resolve(api: APIClient, run: Run, step: Any, body: Any) -> Any:
    run_id = getattr(run, "id", run)
    return api.post(f"/api/v1/runs/{run_id}/steps/{step}/resolve", body, format="json")


def test_a_lost_at_most_once_attempt_is_in_doubt_and_the_run_waits_saying_why(
    payout, api, settings
) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "IN_DOUBT_SECONDS": 600.0}
    before = timezone.now()
    run, pay = in_doubt()
    assert (run.status, pay.status, pay.error["class"]) == ("waiting", "in_doubt", "lost")
    assert pay.finished_at is None and pay.claim is None
    # Not offered again, whatever its retry policy.
    assert list(run.steps.values_list("step_id", "attempt")) == [("pay", 1)]
    timer = Timer.objects.get(run=run, purpose="in_doubt")
    assert timer.step_run_id == pay.id and timer.fired_at is None
    assert before + timedelta(seconds=600) <= timer.fire_at == pay.not_before
    assert timer.fire_at <= timezone.now() + timedelta(seconds=600)

    shown = api.get(f"/api/v1/runs/{run.id}").json()
    step = next(s for s in shown["steps"] if s["id"] == pay.id)
    assert (step["status"], step["idempotency_key"]) == ("in_doubt", pay.idempotency_key)
    assert pay.idempotency_key == f"{run.id}::pay"
    assert pay.idempotency_key in shown["reason"]
    assert f"/api/v1/runs/{run.id}/steps/{pay.id}/resolve" in shown["reason"]
    trace = api.get(f"/api/v1/runs/{run.id}/trace")
    assert trace.status_code == 200, trace.content[:300]
    # Planning again changes nothing: it waits.
    run_advance(run_id=run.id)
    assert StepRun.objects.get(id=pay.id).status == "in_doubt"


def test_an_operator_resolves_it_as_succeeded_and_the_run_goes_on_with_that_output(
    payout, api, user, django_capture_on_commit_callbacks
) -> None:
    run, pay = in_doubt()
    stored = Run.objects.get(id=run.id).stored_bytes
    with django_capture_on_commit_callbacks(execute=False) as sent:
        answer = resolve(api, run, pay.id, {"outcome": "succeeded", "output": {"paid": True}})
    assert answer.status_code == 200, answer.json()
    # The answer's output counts towards what the run stores, as a worker's output does.
    assert Run.objects.get(id=run.id).stored_bytes == stored + len('{"paid":true}')
    assert sent, "the run's advance is asked for on commit"
    pay.refresh_from_db()
    assert (pay.status, pay.output, pay.error) == ("succeeded", {"paid": True}, None)
    assert pay.finished_at is not None
    assert not Timer.objects.filter(run=run, purpose="in_doubt", fired_at__isnull=True).exists()
    action = RunAction.objects.get(run=run, action="resolve")
    assert (action.actor, action.detail) == (
        user,
        {"step_run": pay.id, "step_id": "pay", "outcome": "succeeded"},
    )
    assert answer.json()["actions"][-1]["action"] == "resolve"
    assert answer.json()["actions"][-1]["by"] == user.username

    run_advance(run_id=run.id)
    receipt = run.steps.get(step_id="receipt")
    assert (receipt.status, receipt.input) == ("scheduled", {"paid": True})
    assert Run.objects.get(id=run.id).status == "running"


def test_resolved_as_failed_the_step_fails_without_a_retry_and_the_run_fails(payout, api) -> None:
    run, pay = in_doubt()
    answer = resolve(api, run, pay.id, {"outcome": "failed"})
    assert answer.status_code == 200, answer.json()
    pay.refresh_from_db()
    assert (pay.status, pay.error["class"]) == ("failed", "in_doubt")
    assert "resolved as failed by ada" in pay.error["message"]
    run_advance(run_id=run.id)
    run.refresh_from_db()
    assert (run.status, run.error["class"], run.error["step"]) == ("failed", "in_doubt", "pay")
    # Retry budget left (max_attempts 3), yet never run again: its effect may be half done.
    assert run.steps.filter(step_id="pay").count() == 1


def test_past_its_deadline_a_timer_fails_it(payout, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "IN_DOUBT_SECONDS": 30.0}
    run, pay = in_doubt()
    with time_machine.travel(timezone.now() + timedelta(seconds=20), tick=False):
        timers.fire_due(budget_seconds=5)
    assert StepRun.objects.get(id=pay.id).status == "in_doubt"
    with time_machine.travel(timezone.now() + timedelta(seconds=31), tick=False):
        assert timers.fire_due(budget_seconds=5) == 1
    pay.refresh_from_db()
    assert (pay.status, pay.error["class"]) == ("failed", "in_doubt")
    assert "not resolved by an operator before its deadline" in pay.error["message"]
    run.refresh_from_db()
    assert (run.status, run.error["class"]) == ("failed", "in_doubt")
    assert run.steps.filter(step_id="pay").count() == 1


def test_past_its_deadline_with_its_timer_lost_the_reconciler_fails_it(payout, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "IN_DOUBT_SECONDS": 30.0}
    run, pay = in_doubt()
    Timer.objects.filter(run=run, purpose="in_doubt").delete()
    later = timezone.now() + timedelta(seconds=30 + settings.DJFLOW["LOST_MESSAGE_SECONDS"] + 1)
    Run.objects.filter(id=run.id).update(updated_at=timezone.now() - timedelta(hours=1))
    with time_machine.travel(later, tick=False):
        assert advance_stuck(timezone.now(), 10) == 1
    assert StepRun.objects.get(id=pay.id).status == "failed"


def test_cancelling_the_run_cancels_the_attempt_in_doubt(payout) -> None:
    run, pay = in_doubt()
    services.run_cancel(run_id=run.id)
    assert StepRun.objects.get(id=pay.id).status == "cancelled"
    assert not Timer.objects.filter(run=run, fired_at__isnull=True).exists()


@pytest.mark.parametrize(
    ("role", "code"),
    [("operator", 200), ("author", 200), ("viewer", 403), ("nobody", 404)],
)
def test_only_the_workflows_operators_may_resolve(payout, role: str, code: int) -> None:
    run, pay = in_doubt()
    caller = person(f"{role}_user")
    if role != "nobody":
        access.grant(role, "payout", user=caller)
    answer = resolve(api_for(caller), run, pay.id, {"outcome": "succeeded", "output": 1})
    assert answer.status_code == code, answer.json()
    resolved = StepRun.objects.get(id=pay.id).status == "succeeded"
    assert resolved is (code == 200)
    assert RunAction.objects.filter(run=run, action="resolve").exists() is (code == 200)


def test_a_starter_resolves_the_runs_they_started_but_not_anothers(payout) -> None:
    bob, eve = person("bob"), person("eve")
    for starter in (bob, eve):
        access.grant("starter", "payout", user=starter)
    run, pay = in_doubt(user=bob)
    assert resolve(api_for(eve), run, pay.id, {"outcome": "failed"}).status_code == 404
    assert resolve(api_for(bob), run, pay.id, {"outcome": "failed"}).status_code == 200


def test_anonymous_callers_are_refused(payout, anon_api) -> None:
    run, pay = in_doubt()
    assert resolve(anon_api, run, pay.id, {"outcome": "failed"}).status_code in (401, 403)
    assert StepRun.objects.get(id=pay.id).status == "in_doubt"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "outcome"),
        ({"outcome": "maybe"}, "outcome"),
        ({"outcome": "failed", "output": {"x": 1}}, "output"),
        ({"outcome": "succeeded", "output": 1, "by": "me"}, "by"),
        ([1], "body"),
        ({"outcome": "succeeded", "output": "x" * 1_100_000}, "output"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(payout, api, settings, body, field: str) -> None:
    # A body above the request limit is a 413 first; past it, the output's own 1 MiB bound.
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4_000_000
    run, pay = in_doubt()
    answer = resolve(api, run, pay.id, body)
    assert answer.status_code == 400, answer.content[:300]
    assert field in {error.get("field") for error in answer.json()["errors"]}, answer.json()
    assert StepRun.objects.get(id=pay.id).status == "in_doubt"


def test_an_attempt_not_in_doubt_is_a_409_and_one_of_no_such_run_a_404(payout, api) -> None:
    run, pay = in_doubt()
    assert resolve(api, run, pay.id, {"outcome": "failed"}).status_code == 200
    again = resolve(api, run, pay.id, {"outcome": "succeeded", "output": 1})
    assert again.status_code == 409
    assert "not in_doubt" in again.json()["errors"][0]["message"]
    _, other_pay = in_doubt()
    assert resolve(api, run, other_pay.id, {"outcome": "failed"}).status_code == 404
    assert resolve(api, run, "nope", {"outcome": "failed"}).status_code == 404
    assert StepRun.objects.get(id=other_pay.id).status == "in_doubt"
    assert resolve(api, "not-a-run", pay.id, {"outcome": "failed"}).status_code == 404


def test_the_inspector_shows_the_attempt_in_doubt_with_its_key_and_what_to_do(
    payout, user, settings
) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "IN_DOUBT_SECONDS": 600.0}
    run, pay = in_doubt()
    client = Client()
    client.force_login(user)
    page = client.get(f"/runs/{run.id}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<span class="status s-in_doubt">in_doubt</span>' in html
    assert f"check idempotency key <code>{pay.idempotency_key}</code>" in html
    assert f"/api/v1/runs/{run.id}/steps/{pay.id}/resolve" in html
    assert 'class="node s-in_doubt' in html or "s-in_doubt" in html.split("<svg", 1)[1]
