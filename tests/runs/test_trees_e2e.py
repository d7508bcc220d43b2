"""The fork bomb of issue 36 (deliver 6) on real worker and beat processes, over real HTTP: a
parallel of self-calling subworkflows with ``max_steps`` raised to 10,000,000 stops at the
operator's DJFLOW_MAX_TREE_RUNS and fails with class ``limit``; and the cancel of a tree of
several hundred runs that is still growing, under concurrent advances, answers 202 at once
while a worker cancels the rest, every run ending cancelled, with no 503 and no deadlock.
Before, the bomb made about 3,870 runs in 75 s and kept growing, and its cancel answered 503
(a deadlock) three times in a row."""

from __future__ import annotations

import time
from typing import Any

import pytest

from runs import services
from runs.models import Run, RunTree
from runs.status import RUN_TERMINAL, RunStatus
from tests.processes import wait_for
from workflows.services import definition_save

from .test_bulk_e2e import Api

pytestmark = [pytest.mark.slow]

GATE = {"id": "gate", "kind": "wait_event", "event": "go", "key": "never"}


def _self_calling(workflow_id: str, branches: int, *, then: list[Any], **fields: Any) -> None:
    """``workflow_id`` whose latest version starts ``branches`` runs of itself in a parallel
    (its first version, a wait, exists so that the second may name it)."""
    definition_save(document={"id": workflow_id, "steps": [GATE]})
    names = "abcdefghij"[:branches]
    fan = {
        "id": "fan",
        "kind": "parallel",
        **fields,
        "branches": {
            name: {"id": name, "kind": "subworkflow", "workflow": workflow_id} for name in names
        },
    }
    definition_save(
        document={
            "id": workflow_id,
            "limits": {"max_steps": 10_000_000, "run_timeout_ms": 3_600_000},
            "steps": [fan, *then],
        }
    )


def _tree(root_id: Any) -> Any:
    return Run.objects.filter(root_run_id=root_id)


def _no_deadlock(logs: str) -> None:
    assert "deadlock detected" not in logs.lower()
    assert "DeadlockDetected" not in logs


def test_the_fork_bomb_stops_at_the_tree_cap_with_class_limit(
    settings, celery_worker, celery_beat, celery_processes
) -> None:
    cap = 300
    settings.DJFLOW = {**settings.DJFLOW, "MAX_TREE_RUNS": cap}
    _self_calling("bomb", 10, then=[])
    celery_worker(concurrency=3, env={"DJFLOW_MAX_TREE_RUNS": str(cap)})
    celery_beat()
    began = time.monotonic()
    root = services.run_start(workflow="bomb", input={}).run

    def ended() -> Run | None:
        run = Run.objects.get(id=root.id)
        return run if run.status in RUN_TERMINAL else None

    root = wait_for(ended, timeout=180, interval=0.2, message=celery_processes.logs)
    failed_in = time.monotonic() - began
    assert root.status == RunStatus.FAILED
    assert root.error["class"] == "limit", root.error
    assert "DJFLOW_MAX_TREE_RUNS" in root.error["message"]
    wait_for(
        lambda: not _tree(root.id).exclude(status__in=RUN_TERMINAL).exists(),
        timeout=120,
        interval=0.2,
        message=celery_processes.logs,
    )
    settled_in = time.monotonic() - began
    size = _tree(root.id).count()
    assert size <= cap
    assert RunTree.objects.get(root_run_id=root.id).runs == size
    # Nothing keeps growing: a while later the tree is as it was, every run ended.
    time.sleep(3)
    assert _tree(root.id).count() == size
    assert not _tree(root.id).exclude(status__in=RUN_TERMINAL).exists()
    _no_deadlock(celery_processes.logs())
    print(
        f"fork bomb: {size} runs below the root (cap {cap}); the root failed after "
        f"{failed_in:.1f} s, the whole tree ended after {settled_in:.1f} s"
    )


def test_cancelling_a_growing_tree_answers_202_at_once_and_every_run_ends_cancelled(
    user, live_server, celery_worker, celery_beat, celery_processes
) -> None:
    # Three runs of itself per run, all settled, then a wait that never ends: 9,840 runs
    # at full depth, none of which ends on its own.
    _self_calling("grow", 3, then=[GATE | {"id": "hold"}], mode="all_settled")
    celery_worker(concurrency=3, env={"DJFLOW_MAX_TREE_RUNS": "4000"})
    celery_beat()
    api = Api(live_server, user)
    started = api.post("/api/v1/runs", {"workflow": "grow", "input": {}})
    assert started.status_code == 201, started.text
    root_id = started.json()["id"]
    wait_for(
        lambda: _tree(root_id).count() >= 400,
        timeout=180,
        interval=0.1,
        message=celery_processes.logs,
    )
    before = _tree(root_id).count()
    asked = time.monotonic()
    answer = api.post(f"/api/v1/runs/{root_id}/cancel", {})
    answered_in = time.monotonic() - asked
    assert answer.status_code == 202, answer.text
    assert answer.json()["status"] == RunStatus.CANCELLED
    # A second cancel meanwhile changes nothing and answers the same way.
    again = api.post(f"/api/v1/runs/{root_id}/cancel", {})
    assert again.status_code in (200, 202), again.text
    assert again.json()["status"] == RunStatus.CANCELLED

    def all_ended() -> bool:
        return not _tree(root_id).exclude(status__in=RUN_TERMINAL).exists()

    wait_for(all_ended, timeout=180, interval=0.1, message=celery_processes.logs)
    ended_in = time.monotonic() - asked
    size = _tree(root_id).count()
    time.sleep(3)
    assert _tree(root_id).count() == size, "the tree grew after its cancel"
    assert set(_tree(root_id).values_list("status", flat=True)) == {RunStatus.CANCELLED}
    final = api.get(f"/api/v1/runs/{root_id}")
    assert final.status_code == 200
    assert api.post(f"/api/v1/runs/{root_id}/cancel", {}).status_code == 200
    _no_deadlock(celery_processes.logs())
    print(
        f"cancel of a growing tree: {before} runs when asked, {size} in the end; answered "
        f"{answer.status_code} in {answered_in * 1000:.0f} ms; every run cancelled after "
        f"{ended_in:.1f} s"
    )
