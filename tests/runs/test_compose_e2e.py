"""parallel, foreach and loop end to end on a real worker (Postgres, Redis, celery worker)."""

from __future__ import annotations

import pytest

from runs import services
from runs.models import Run, StepRun
from tests.processes import wait_for

from .flows import effects, ensure_effects_table
from .test_e2e import finished, start

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.runs.flows_compose"]


@pytest.fixture(autouse=True)
def _effects_table(transactional_db):
    ensure_effects_table()


def test_foreach_with_mixed_outcomes_keeps_item_order(
    celery_worker, celery_beat, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS, concurrency=4)
    # The flaky item's retry waits 200 ms on a timer, fired by the clock's tick. Without beat
    # it ran only when another item happened to finish after those 200 ms (the run planned
    # again then); items sent several to a message finish sooner than that.
    celery_beat()
    items = ["a", "flaky", "broken", "b", "c", "d", "e"]
    run = finished(start("fanout", {"items": items}).id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    # The broken item went on as null (on_error: continue); the flaky one was retried.
    assert run.output == ["a!", "flaky!", None, "b!", "c!", "d!", "e!"]
    flaky = StepRun.objects.filter(run=run, path="fan[1]/").order_by("attempt")
    assert [(s.attempt, s.status) for s in flaky] == [(1, "failed"), (2, "succeeded")]
    assert StepRun.objects.get(run=run, path="fan[2]/").error["class"] == "fatal"
    ran = [step for step, *_ in effects(run.id)]
    assert sorted(ran) == sorted([f"work:{item}" for item in items] + ["work:flaky"])
    fan = StepRun.objects.get(run=run, step_id="fan")
    assert (fan.kind, fan.status, fan.path) == ("foreach", "succeeded", "")


def test_concurrency_three_over_thirty_items_never_runs_more_than_three(
    celery_worker, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS, concurrency=6)
    run = finished(start("capped", {"items": list(range(30))}).id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert StepRun.objects.get(run=run, step_id="fan").output == list(range(30))
    spans = [(started, ended) for _, _, _, started, ended in effects(run.id)]
    assert len(spans) == 30
    # At every start, count the bodies running at that moment.
    most = max(sum(1 for s, e in spans if s <= moment < e) for moment, _ in spans)
    assert most <= 3
    assert most >= 2  # the cap was used, not serialised to one


def test_a_loop_ends_by_until_with_iter_index_and_previous(celery_worker, celery_processes) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = finished(start("counting", {}).id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == {"n": 2, "had": {"n": 1, "had": {"n": 0, "had": None}}}
    rows = StepRun.objects.filter(run=run, step_id="tick").order_by("id")
    assert [r.path for r in rows] == ["lp[0]/", "lp[1]/", "lp[2]/"]


def test_parallel_branches_with_a_nested_foreach(celery_worker, celery_processes) -> None:
    celery_worker(workflow_modules=FLOWS, concurrency=4)
    run = finished(start("fork", {"x": 4}).id, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == {"left": 40, "right": [2, 4, 6], "failing": None}
    par = StepRun.objects.get(run=run, step_id="par")
    assert par.status == "succeeded"
    # Every branch attempt was journaled before any was offered (one plan, one transaction).
    first = StepRun.objects.filter(run=run, path__startswith="par[").order_by("id")
    assert {r.scheduled_at for r in first if r.kind == "task" and r.path != "par[right]/"} | {
        StepRun.objects.get(run=run, step_id="many").scheduled_at
    } == {par.scheduled_at}


def test_a_loop_ends_by_max_iterations(celery_worker, celery_processes) -> None:
    celery_worker(workflow_modules=FLOWS)
    run = finished(start("endless", {}).id, logs=celery_processes.logs)
    assert (run.status, run.output) == ("completed", {"n": 20})
    assert StepRun.objects.filter(run=run, step_id="spin").count() == 3


def test_three_levels_with_a_wait_at_the_bottom_resumed_by_an_event(
    celery_worker, celery_beat, celery_processes
) -> None:
    from workflows.services import definition_save

    bottom = {
        "id": "bottom",
        "steps": [
            {
                "id": "both",
                "kind": "parallel",
                "branches": {
                    "wait": {"id": "deep", "kind": "wait_event", "event": "go", "key": "${input}"},
                    "nap": {"id": "nap", "kind": "sleep", "ms": 300},
                },
            }
        ],
        "output": "${steps.both.output.wait}",
    }
    top = {
        "id": "top",
        "steps": [
            {
                "id": "fan",
                "kind": "foreach",
                "items": "${input.keys}",
                "do": {"id": "mid", "kind": "subworkflow", "workflow": "bottom"},
            }
        ],
    }
    definition_save(document=bottom)
    definition_save(document=top)
    celery_worker(workflow_modules=FLOWS)
    celery_beat()
    run = start("top", {"keys": ["k1", "k2"]})

    def all_waiting() -> bool:
        grandchildren = StepRun.objects.filter(step_id="deep", status="waiting").count()
        return grandchildren == 2

    wait_for(all_waiting, timeout=20, message=celery_processes.logs)
    assert Run.objects.get(id=run.id).status == "waiting"
    assert services.event_send(name="go", key="k2", payload="two")[1] == 1
    assert services.event_send(name="go", key="k1", payload="one")[1] == 1
    run = finished(run.id, logs=celery_processes.logs)
    assert (run.status, run.output) == ("completed", ["one", "two"])
