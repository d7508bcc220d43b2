"""One bad run never stalls the others, on a real worker and beat (issue 36): a poison run
(tests/runs/test_pass_isolation.py) planted beside a run waiting for a concurrency slot that
is free and a wait that missed its event; the beat's clock and reconciler, run by the worker,
mark the poison and repair the others, tick after tick."""

from __future__ import annotations

import pytest

from runs import services
from runs.engine import isolation
from runs.engine.plan import wait_key
from runs.models import Event, Run, RunAction, RunFault
from tests.processes import wait_for
from workflows.services import definition_save

from .test_pass_isolation import QUEUED, WAITER, napping

pytestmark = [pytest.mark.slow]

KNOBS = {"DJFLOW_RECONCILE_SECONDS": "2", "DJFLOW_LOST_MESSAGE_SECONDS": "1"}
NAPPER = {"id": "napper", "steps": [{"id": "nap", "kind": "sleep", "ms": 120_000}]}


def test_the_beats_passes_mark_a_poison_run_and_repair_the_others(
    transactional_db, celery_worker, celery_beat, celery_processes
) -> None:
    for document in (NAPPER, WAITER, QUEUED):
        definition_save(document=document)
    poison = napping(due=True, poison=True)
    healthy = napping(due=True)
    holder = services.run_start(workflow="queued", input={"n": "0"}).run
    waiting = services.run_start(workflow="queued", input={"n": "1"}).run
    Run.objects.filter(id=holder.id).update(status="cancelled")
    listener = services.run_start(workflow="waiter", input={}).run
    Event.objects.create(name="go", key="k", wait_key=wait_key("go", "k"), payload={"ok": 1})

    celery_worker(env=KNOBS, concurrency=2)
    celery_beat(env=KNOBS)

    def repaired() -> bool:
        runs = {run.id: run for run in Run.objects.filter(id__in=[healthy.id, waiting.id])}
        return (
            runs[healthy.id].status == "completed"
            and runs[waiting.id].admitted_at is not None
            and Run.objects.get(id=listener.id).status == "completed"
        )

    wait_for(repaired, timeout=60, message=celery_processes.logs)
    wait_for(
        lambda: RunAction.objects.filter(run=poison, action=isolation.PASS_FAILED).exists(),
        timeout=30,
        message=celery_processes.logs,
    )
    # The waiting run, admitted, was advanced into its wait.
    wait_for(lambda: Run.objects.get(id=waiting.id).status == "waiting", timeout=30)
    assert Run.objects.get(id=poison.id).status == "running"
    passes = set(RunFault.objects.filter(run=poison).values_list("pass_name", flat=True))
    assert passes <= {"timers.advance", "reconcile.advance"} and passes
    assert str(poison.id) in celery_processes.logs()
