"""A handler's output over 1 MiB fails its attempt with class invalid_input (contract section
9), run in this process (the worker's own code path, without a worker process)."""

from __future__ import annotations

import pytest

from runs import services
from runs.engine.plan import MAX_VALUE_BYTES
from runs.models import StepRun
from workers.execution import execute
from workflows.sdk import workflow
from workflows.services import definition_save

pytestmark = pytest.mark.django_db

# The handler returns a string whose compact JSON is the input's size in bytes.
sized = workflow("sized_output")


@sized.step("make")
def make(ctx, input, prior):
    return "x" * (input["bytes"] - 2)


@pytest.mark.parametrize(
    ("size", "status"), [(MAX_VALUE_BYTES, "succeeded"), (MAX_VALUE_BYTES + 1, "failed")]
)
def test_an_output_of_1_mib_is_kept_and_one_byte_more_fails_the_step(size: int, status: str):
    definition_save(document=sized.document())
    run = services.run_start(workflow="sized_output", input={"bytes": size}).run
    attempt = StepRun.objects.get(run=run, step_id="make")
    execute(attempt.id, worker="in-process")
    attempt.refresh_from_db()
    run.refresh_from_db()
    assert attempt.status == status
    if status == "failed":
        assert attempt.error["class"] == "invalid_input"
        assert "over 1048576 bytes" in attempt.error["message"]
        assert attempt.output is None
        assert (run.status, run.error["class"]) == ("failed", "invalid_input")
    else:
        assert run.status == "completed" and len(run.output) == size - 2
