"""An ``on_failure`` handler on a real worker process (CONTRACT section 13): a run whose step
fails (its retries spent) runs the handler's steps, which read ``${error}``, and completes
with the last one's output; a handler that fails leaves the run failed with the original
error and its own beside it. The handler's rows are journal rows of their own path."""

from __future__ import annotations

import pytest

from runs import services
from runs.models import Run
from tests.processes import wait_for

from .flows import effects, ensure_effects_table

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.runs.flows_failure"]
TERMINAL = ("completed", "failed", "cancelled", "timed_out")


def test_an_on_failure_handler_completes_the_run_or_fails_beside_the_original_error(
    celery_worker, celery_processes
) -> None:
    ensure_effects_table()
    celery_worker(workflow_modules=FLOWS)
    saved = services.run_start(workflow="refund_on_failure", input={"card": "4242"}).run
    broken = services.run_start(workflow="refund_on_failure", input={"card": "refunds-broken"}).run

    def ended() -> list[Run] | None:
        runs = [Run.objects.get(id=saved.id), Run.objects.get(id=broken.id)]
        return runs if all(r.status in TERMINAL for r in runs) else None

    saved, broken = wait_for(ended, timeout=60, interval=0.1, message=celery_processes.logs)

    assert saved.status == "completed", saved.error
    assert saved.error is None
    why = "card 4242 declined"
    assert saved.output == {
        "notified": True,
        "refunded": "4242",
        "because": why,
        "of": "charge",
    }
    journal = list(saved.steps.order_by("id").values_list("path", "step_id", "attempt", "status"))
    assert journal == [
        ("", "reserve", 1, "succeeded"),
        ("", "charge", 1, "failed"),
        ("", "charge", 2, "failed"),
        ("_on_failure[1]/", "refund", 1, "succeeded"),
        ("_on_failure[1]/", "notify", 1, "succeeded"),
    ]
    refund = saved.steps.get(step_id="refund")
    assert refund.input == {"why": why, "class": "retryable", "step": "charge", "card": "4242"}
    assert [step for step, *_ in effects(saved.id)] == [
        "reserve",
        "charge",
        "charge",
        "refund",
        "notify",
    ]

    assert broken.status == "failed"
    assert (broken.error["class"], broken.error["step"]) == ("retryable", "charge")
    assert broken.error["on_failure"] == {
        "class": "fatal",
        "message": "the refund service is down",
        "step": "refund",
    }
    assert not broken.steps.filter(step_id="notify").exists()
