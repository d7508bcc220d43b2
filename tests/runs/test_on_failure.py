"""A document's on_failure steps against the database: what a retry may start from."""

from __future__ import annotations

import pytest
from django.test import Client

from runs import services
from runs.status import RunStatus
from workflows.errors import InvalidInput

from .factories import RunFactory, StepRunFactory, WorkflowVersionFactory

pytestmark = pytest.mark.django_db

DOCUMENT = {
    "id": "tidy_up",
    "steps": [{"id": "work", "kind": "task"}],
    "on_failure": [{"id": "tidy", "kind": "task", "input": "${error}"}],
}


def test_a_retry_from_an_on_failure_step_is_a_400_naming_from_step() -> None:
    run = RunFactory(version=WorkflowVersionFactory(document=DOCUMENT), status=RunStatus.FAILED)
    with pytest.raises(InvalidInput) as caught:
        services.run_retry(run_id=run.id, from_step="tidy")
    [error] = caught.value.errors
    assert error.field == "from_step" and "is an on_failure step" in error.message
    with pytest.raises(InvalidInput) as caught:
        services.run_retry(run_id=run.id, from_step="nope")
    assert "is not a step of tidy_up" in caught.value.errors[0].message


def test_the_inspector_draws_the_handler_and_lists_its_attempts(user, api) -> None:
    run = RunFactory(version=WorkflowVersionFactory(document=DOCUMENT), status=RunStatus.COMPLETED)
    StepRunFactory(run=run, step_id="work", status="failed")
    tidy = StepRunFactory(run=run, step_id="tidy", path="_on_failure[1]/", status="succeeded")
    client = Client()
    client.force_login(user)
    page = client.get(f"/runs/{run.id}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-step="on_failure" data-kind="on_failure" data-status="succeeded"' in html
    assert 'data-step="tidy" data-kind="task" data-status="succeeded"' in html
    assert f'id="attempt-{tidy.id}"' in html
    trace = api.get(f"/api/v1/runs/{run.id}/trace").json()
    names = {span.get("step_id") for span in trace["spans"]}
    assert {"work", "tidy"} <= names, trace
