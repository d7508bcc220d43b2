"""A document's on_failure steps against the database: what a retry may start from."""

from __future__ import annotations

import pytest

from runs import services
from runs.status import RunStatus
from workflows.errors import InvalidInput

from .factories import RunFactory, WorkflowVersionFactory

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
