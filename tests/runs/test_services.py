"""Run services: failure paths that the API does not reach on its own."""

from __future__ import annotations

from unittest import mock

import pytest
from django.db import IntegrityError
from rest_framework.test import APIClient

from runs import services
from runs.models import Run
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
        mock.patch("runs.tasks.advance.delay", side_effect=ConnectionError("broker down")),
        django_capture_on_commit_callbacks(execute=True),
    ):
        response = api.post(
            "/api/v1/runs", {"workflow": "support_ticket", "input": {"ticket": "Q"}}, format="json"
        )
    assert response.status_code == 201
    run = Run.objects.get()
    # The sweep advances it once wake_at passes.
    assert run.status == "pending" and run.wake_at is not None
