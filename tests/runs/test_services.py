"""Run services: failure paths that the API does not reach on its own."""

from __future__ import annotations

from unittest import mock

import pytest
from django.db import IntegrityError
from rest_framework.test import APIClient

from runs import services
from runs.engine.reconcile import reconcile
from runs.models import Run, StepRun
from workflows.errors import NotFound

from .factories import WorkflowVersionFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("action", ["run_cancel", "run_pause", "run_resume", "run_retry"])
def test_a_malformed_run_id_is_not_found_naming_the_id(action: str) -> None:
    with pytest.raises(NotFound) as caught:
        getattr(services, action)(run_id="not-a-uuid")
    assert caught.value.errors[0].field == "id"


def test_an_insert_failure_without_an_idempotency_key_is_not_hidden() -> None:
    WorkflowVersionFactory()
    with (
        mock.patch.object(Run.objects, "create", side_effect=IntegrityError("boom")),
        pytest.raises(IntegrityError),
    ):
        services.run_start(workflow="support_ticket", input={"ticket": "Q"})


def test_a_broker_outage_does_not_fail_a_committed_start(
    api: APIClient, django_capture_on_commit_callbacks
) -> None:
    WorkflowVersionFactory()
    with (
        mock.patch(
            "workers.tasks.execute_step.apply_async", side_effect=ConnectionError("broker down")
        ),
        django_capture_on_commit_callbacks(execute=True),
    ):
        response = api.post(
            "/api/v1/runs", {"workflow": "support_ticket", "input": {"ticket": "Q"}}, format="json"
        )
    assert response.status_code == 201
    run = Run.objects.get()
    # The attempt stays scheduled; the reconciler offers it again once its message counts as lost.
    assert run.status == "running"
    assert run.steps.get().status == "scheduled"


BROKER_DOWN = ConnectionError("broker down")


def test_a_start_handed_to_a_worker_survives_a_lost_advance_message(
    api: APIClient, django_capture_on_commit_callbacks, settings
) -> None:
    """Past the pace the API's start sends one runs.advance message; lost, the reconciler
    advances the pending run once it has been quiet LOST_MESSAGE_SECONDS: the run is not lost."""
    settings.DJFLOW = {**settings.DJFLOW, "START_INLINE_PER_SECOND": 0}
    WorkflowVersionFactory()
    with (
        mock.patch("runs.tasks.advance.apply_async", side_effect=BROKER_DOWN) as advance,
        mock.patch("workers.tasks.execute_step.apply_async", side_effect=BROKER_DOWN),
        django_capture_on_commit_callbacks(execute=True),
    ):
        response = api.post(
            "/api/v1/runs", {"workflow": "support_ticket", "input": {"ticket": "Q"}}, format="json"
        )
    assert response.status_code == 201
    advance.assert_called_once()
    run = Run.objects.get()
    assert run.status == "pending" and not run.steps.exists()
    # Not before the message counts as lost: a reconciler must not race a message in flight.
    with django_capture_on_commit_callbacks(execute=True):
        reconcile()
    run.refresh_from_db()
    assert run.status == "pending" and not run.steps.exists()
    settings.DJFLOW = {**settings.DJFLOW, "LOST_MESSAGE_SECONDS": 0}
    with (
        mock.patch("workers.tasks.execute_step.apply_async") as offer,
        django_capture_on_commit_callbacks(execute=True),
    ):
        reconcile()
    run.refresh_from_db()
    assert run.status == "running"
    attempt = run.steps.get()
    assert (attempt.step_id, attempt.status) == ("classify", "scheduled")
    offer.assert_called_once()
    assert offer.call_args.args[0] == (attempt.id,)


def test_the_reconciler_offers_again_an_attempt_whose_message_was_lost(
    django_capture_on_commit_callbacks, settings
) -> None:
    WorkflowVersionFactory()
    with mock.patch("workers.tasks.execute_step.apply_async"):
        run = services.run_start(workflow="support_ticket", input={"ticket": "Q"}).run
    attempt = run.steps.get()
    settings.DJFLOW = {**settings.DJFLOW, "LOST_MESSAGE_SECONDS": 0}
    with (
        mock.patch("workers.tasks.execute_step.apply_async") as offer,
        django_capture_on_commit_callbacks(execute=True),
    ):
        reconcile()
    offer.assert_called_once()
    assert offer.call_args.args[0] == (attempt.id,)
    # A claimed attempt is not offered again.
    StepRun.objects.filter(id=attempt.id).update(status="running")
    with (
        mock.patch("workers.tasks.execute_step.apply_async") as offer,
        django_capture_on_commit_callbacks(execute=True),
    ):
        reconcile()
    offer.assert_not_called()


def test_an_unavailable_database_is_a_503_not_a_500(api: APIClient) -> None:
    from django.db import OperationalError

    WorkflowVersionFactory()
    with mock.patch("runs.services.run_start", side_effect=OperationalError("database is locked")):
        response = api.post(
            "/api/v1/runs", {"workflow": "support_ticket", "input": {"ticket": "Q"}}, format="json"
        )
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert response.json()["errors"][0]["message"].startswith("the database is unavailable")
    assert not Run.objects.exists()
