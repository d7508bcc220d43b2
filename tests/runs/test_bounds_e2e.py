"""One huge run does not starve the others (contract section 9), on real `celery worker` and
`celery beat` processes: a run that plans 10,000 engine rows is planned by advance tasks of
about a second each, each queueing the next behind the other work, so small runs started
after it end while it is still being planned."""

from __future__ import annotations

import time

import pytest

from runs import services
from runs.models import Run, StepRun
from tests.processes import wait_for
from workflows.services import definition_save

pytestmark = [pytest.mark.slow]


def spin(times: int) -> dict:
    cond = {
        "id": "c",
        "kind": "condition",
        "if": {"path": "input.no", "op": "exists"},
        "then": [{"id": "never", "kind": "sleep", "ms": 0}],
    }
    return {"id": "spin", "kind": "loop", "max_iterations": times, "do": cond}


def test_small_runs_end_while_a_huge_one_is_still_planned(celery_worker, celery_beat) -> None:
    # Its worst case (the branch taken every time) is 10,000 attempts: allowed at save.
    definition_save(
        document={"id": "huge", "limits": {"max_steps": 10_000}, "steps": [spin(10_000)]}
    )
    definition_save(document={"id": "small", "steps": [{"id": "nap", "kind": "sleep", "ms": 300}]})
    worker = celery_worker(concurrency=1)
    celery_beat()
    started = time.monotonic()
    huge = services.run_start(workflow="huge", input={}).run
    start_took = time.monotonic() - started
    small = [services.run_start(workflow="small", input={}).run.id for _ in range(5)]

    def smalls_done() -> bool:
        return Run.objects.filter(id__in=small, status="completed").count() == len(small)

    wait_for(smalls_done, timeout=60, interval=0.1, message=worker.logs)
    smalls_took = time.monotonic() - started
    planned_then = StepRun.objects.filter(run=huge).count()
    huge.refresh_from_db()
    assert huge.status == "running", "the huge run ended before the small ones"
    wait_for(
        lambda: Run.objects.get(id=huge.id).status == "completed",
        timeout=300,
        interval=0.5,
        message=worker.logs,
    )
    print(
        f"start of the huge run {start_took:.2f} s; 5 small runs ended after {smalls_took:.1f} s "
        f"with {planned_then} of 10,001 rows of the huge run planned; the huge run ended after "
        f"{time.monotonic() - started:.1f} s"
    )
    assert StepRun.objects.filter(run=huge).count() == 10_001
