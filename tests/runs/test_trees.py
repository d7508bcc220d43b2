"""A tree of runs has an operator's cap (issue 36, deliver 6; runs.engine.trees), and a
cancel never waits for a run of its tree (runs.engine.ending): the total refused past
DJFLOW_MAX_TREE_RUNS with class limit, starts past the pace waiting behind a timer, the
count race-free under concurrent starts, limits.max_steps under DJFLOW_MAX_STEPS_CEILING,
and the cancel of a tree answering 200 (all ended inline) or 202 (the rest ended by
runs.end_tree), idempotently, without the deadlock the old FOR UPDATE made. The fork bomb
and a large cancel on real worker processes are tests/runs/test_trees_e2e.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import time_machine
from django.db import connection, transaction
from django.utils import timezone

from runs import services
from runs.engine import reconcile, trees
from runs.engine.advance import lock_run, run_advance
from runs.engine.store import request_advance
from runs.engine.timers import fire_due
from runs.models import Run, RunAction, RunTree, StepRun, Timer, TimerPurpose
from runs.status import RUN_TERMINAL, RunStatus
from workflows.services import definition_save

from ..moves import unchecked

GATE = {"id": "gate", "kind": "wait_event", "event": "go", "key": "k"}


def _tunables(settings: Any, **values: Any) -> None:
    # A new dict: the settings fixture restores attributes, not a dict changed in place.
    settings.DJFLOW = {**settings.DJFLOW, **values}


def _fan(workflow_id: str, target: str, branches: int, **fields: Any) -> dict[str, Any]:
    names = "abcdefghij"[:branches]
    return {
        "id": workflow_id,
        "limits": {"max_steps": 10_000_000},
        "steps": [
            {
                "id": "fan",
                "kind": "parallel",
                **fields,
                "branches": {
                    name: {"id": name, "kind": "subworkflow", "workflow": target} for name in names
                },
            }
        ],
    }


def _bomb(branches: int = 3) -> None:
    """A workflow whose latest version starts ``branches`` runs of itself (its first
    version, a wait, exists so that the second may name it)."""
    definition_save(document={"id": "bomb", "steps": [GATE]})
    definition_save(document=_fan("bomb", "bomb", branches))


def _drive(passes: int = 40) -> int:
    """Advance every live run, as workers would, until nothing changes (or ``passes``);
    returns how many passes it took. A child waiting for its tree's pace is left alone."""
    last = None
    for done in range(passes):
        live = (
            Run.objects.exclude(status__in=RUN_TERMINAL)
            .exclude(timers__purpose=TimerPurpose.TREE_PACE, timers__fired_at__isnull=True)
            .values_list("id", flat=True)
        )
        for run_id in list(live):
            run_advance(run_id=run_id)
        state = (
            Run.objects.count(),
            StepRun.objects.count(),
            Run.objects.filter(status__in=RUN_TERMINAL).count(),
        )
        if state == last:
            return done
        last = state
    return passes


def _tree(root: Run) -> Any:
    return Run.objects.filter(root_run_id=root.id)


# --- the total ---------------------------------------------------------------------------------


def test_a_fork_bomb_stops_at_the_tree_cap_and_fails_with_class_limit(db, settings) -> None:
    _tunables(settings, MAX_TREE_RUNS=12)
    _bomb(branches=3)
    root = services.run_start(workflow="bomb", input={}).run
    _drive()
    # Three levels would be 39 runs below the root, eight 9,840: the cap is the most started.
    assert _tree(root).count() == 12
    assert RunTree.objects.get(root_run=root).runs == 12
    root.refresh_from_db()
    assert root.status == RunStatus.FAILED
    assert root.error["class"] == "limit"
    assert "DJFLOW_MAX_TREE_RUNS" in root.error["message"]
    # The refused start failed its step with class limit, naming the cap.
    refused = StepRun.objects.filter(kind="subworkflow", error__class="limit").first()
    assert refused is not None
    assert "has started 12 runs" in refused.error["message"]
    # Nothing keeps going: every run of the tree ended, and more passes start nothing.
    assert not _tree(root).exclude(status__in=RUN_TERMINAL).exists()
    _drive()
    assert _tree(root).count() == 12


def test_a_retried_root_counts_its_tree_afresh(db, settings) -> None:
    """The count is per generation of the root: a tree that once reached the cap is not
    refused its first start when an operator retries it (it was, for good)."""
    _tunables(settings, MAX_TREE_RUNS=12)
    _bomb(branches=3)
    root = services.run_start(workflow="bomb", input={}).run
    _drive()
    root.refresh_from_db()
    assert (root.status, _tree(root).count()) == (RunStatus.FAILED, 12)
    services.run_retry(run_id=root.id)
    _drive()
    root.refresh_from_db()
    # The new generation started a tree of its own, up to the cap again, and no more.
    assert root.generation == 2
    assert (root.status, root.error["class"]) == (RunStatus.FAILED, "limit")
    assert _tree(root).count() == 24
    assert RunTree.objects.get(root_run=root).runs == 12


def test_a_retried_roots_count_keeps_the_runs_of_its_tree_not_ended(db, settings) -> None:
    """Leftovers the sweep has not ended yet count, paused ones too (a paused run is live and
    may be resumed): a retry's fresh count never lets the tree pass the cap."""
    _tunables(settings, MAX_TREE_RUNS=12)
    _bomb(branches=3)
    root = services.run_start(workflow="bomb", input={}).run
    _drive()
    leftovers = list(_tree(root).values_list("id", flat=True)[:3])
    with unchecked():
        Run.objects.filter(id__in=leftovers[:2]).update(status=RunStatus.PAUSED)
        Run.objects.filter(id=leftovers[2]).update(status=RunStatus.RUNNING)
    services.run_retry(run_id=root.id)
    assert RunTree.objects.get(root_run=root).runs == 3


def test_a_start_in_a_tree_whose_root_has_ended_is_not_made(db, settings) -> None:
    _tunables(settings, CANCEL_INLINE_RUNS=0)
    _bomb(branches=2)
    root = services.run_start(workflow="bomb", input={}).run
    # Planned in the request while its budget lasted; this one is left to a worker.
    child = _tree(root).filter(status=RunStatus.PENDING).first()
    assert child is not None
    services.run_cancel(run_id=root.id)
    # The child's advance after its root's cancel (before the sweep reached it) starts no
    # run: the tree stops growing at once.
    before = _tree(root).count()
    run_advance(run_id=child.id)
    assert _tree(root).count() == before
    trees.end_tree(root_id=root.id)
    assert not _tree(root).exclude(status=RunStatus.CANCELLED).exists()


def test_concurrent_starts_in_one_tree_never_pass_the_cap_together(
    transactional_db, settings
) -> None:
    _tunables(settings, MAX_TREE_RUNS=5)
    definition_save(document={"id": "leaf", "steps": [GATE]})
    root = services.run_start(workflow="leaf", input={}).run
    starts, barrier = 8, threading.Barrier(8)
    answers: list[Any] = []

    def start() -> None:
        try:
            with transaction.atomic():
                barrier.wait(5)
                admission = trees.admit(root, timezone.now())
                # Held a moment, as a start's transaction goes on after the count.
                time.sleep(0.05)
            answers.append(admission)
        finally:
            connection.close()

    threads = [threading.Thread(target=start) for _ in range(starts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(answers) == starts
    assert sum(answer.refused is None for answer in answers) == 5
    assert RunTree.objects.get(root_run=root).runs == 5


# --- the pace ----------------------------------------------------------------------------------


def test_starts_past_the_pace_wait_behind_a_timer_and_the_reconciler_leaves_them(
    db, settings
) -> None:
    # 2 a minute: an interval of 30 s, a minute's worth (3 starts) at once.
    _tunables(settings, MAX_TREE_RUNS_PER_MINUTE=2)
    definition_save(document={"id": "leaf", "steps": [GATE]})
    definition_save(document=_fan("five", "leaf", 5))
    began = timezone.now()
    root = services.run_start(workflow="five", input={}).run
    _drive()
    children = list(_tree(root).order_by("created_at"))
    assert len(children) == 5
    paced = Timer.objects.filter(purpose=TimerPurpose.TREE_PACE).order_by("fire_at")
    assert [timer.run_id for timer in paced] == [c.id for c in children[3:]]
    waits = [(timer.fire_at - began).total_seconds() for timer in paced]
    assert 29 < waits[0] < 32 and 59 < waits[1] < 62, waits
    assert [c.status for c in children[:3]] == [RunStatus.WAITING] * 3
    assert [c.status for c in children[3:]] == [RunStatus.PENDING] * 2
    # Quiet on purpose: the reconciler's look for stuck runs passes them by.
    with time_machine.travel(began + timedelta(seconds=20), tick=False):
        assert reconcile.advance_stuck(timezone.now(), 100) == 0
    # At its turn, the first is planned; the second waits on.
    with time_machine.travel(began + timedelta(seconds=33), tick=False):
        fire_due(budget_seconds=5)
    statuses = [Run.objects.get(id=c.id).status for c in children[3:]]
    assert statuses == [RunStatus.WAITING, RunStatus.PENDING]


# --- limits.max_steps --------------------------------------------------------------------------


def test_max_steps_counts_at_most_the_operators_ceiling(db, settings) -> None:
    _tunables(settings, MAX_STEPS_CEILING=5)
    nap = {"id": "nap", "kind": "sleep", "ms": 0}
    definition_save(
        document={
            "id": "long",
            "limits": {"max_steps": 10_000_000},
            "steps": [{"id": "spin", "kind": "loop", "max_iterations": 20, "do": nap}],
        }
    )
    run = services.run_start(workflow="long", input={}).run
    _drive(passes=60)
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["class"] == "limit"
    assert "DJFLOW_MAX_STEPS_CEILING" in run.error["message"]


# --- cancel ------------------------------------------------------------------------------------


def _waiting_tree(branches: int) -> Run:
    definition_save(document={"id": "leaf", "steps": [GATE]})
    definition_save(document=_fan("wide", "leaf", branches))
    root = services.run_start(workflow="wide", input={}).run
    _drive()
    assert _tree(root).filter(status=RunStatus.WAITING).count() == branches
    return root


def test_a_small_tree_is_cancelled_in_the_request_200(api, settings) -> None:
    root = _waiting_tree(4)
    answer = api.post(f"/api/v1/runs/{root.id}/cancel")
    assert answer.status_code == 200, answer.content
    assert answer.json()["status"] == RunStatus.CANCELLED
    assert set(_tree(root).values_list("status", flat=True)) == {RunStatus.CANCELLED}


def test_a_large_tree_answers_202_and_a_task_cancels_the_rest_idempotently(
    api, settings, django_capture_on_commit_callbacks, monkeypatch
) -> None:
    _tunables(settings, CANCEL_INLINE_RUNS=3)
    sent: list[str] = []
    monkeypatch.setattr("runs.dispatch.end_tree_now", lambda root: sent.append(str(root)))
    root = _waiting_tree(8)
    with django_capture_on_commit_callbacks(execute=True):
        answer = api.post(f"/api/v1/runs/{root.id}/cancel")
    assert answer.status_code == 202, answer.content
    body = answer.json()
    assert body["status"] == RunStatus.CANCELLED
    assert sent == [str(root.id)]
    # A tree that started more runs than the budget: all below it are the task's.
    assert _tree(root).filter(status=RunStatus.CANCELLED).count() == 0
    # A second cancel while the task has not run: the same answer, nothing recorded again.
    with django_capture_on_commit_callbacks(execute=True):
        again = api.post(f"/api/v1/runs/{root.id}/cancel")
    assert again.status_code == 202
    assert RunAction.objects.filter(run=root, action="cancel").count() == 1
    assert trees.end_tree(root_id=root.id) == 8
    assert set(_tree(root).values_list("status", flat=True)) == {RunStatus.CANCELLED}
    child = _tree(root).first()
    assert child.error["message"] == f"parent run {root.id} was cancelled"
    # Once it is all ended: 200, still nothing recorded, and the task finds nothing.
    third = api.post(f"/api/v1/runs/{root.id}/cancel")
    assert third.status_code == 200
    assert third.json()["status"] == RunStatus.CANCELLED
    assert RunAction.objects.filter(run=root, action="cancel").count() == 1
    assert trees.end_tree(root_id=root.id) == 0


def test_a_cancel_of_a_completed_run_is_still_a_409(api) -> None:
    definition_save(document={"id": "nothing", "steps": [{"id": "n", "kind": "sleep", "ms": 0}]})
    run = services.run_start(workflow="nothing", input={}).run
    _drive()
    assert Run.objects.get(id=run.id).status == RunStatus.COMPLETED
    assert api.post(f"/api/v1/runs/{run.id}/cancel").status_code == 409


def test_a_cancel_waits_for_no_run_of_its_tree_and_never_deadlocks(
    transactional_db, settings, monkeypatch
) -> None:
    """A child's own advance holds its row and then writes a row that references the root
    (an advance request, a grandchild's start). The cancel used to lock the root FOR UPDATE,
    which such an insert waits for, then wait for the child: a deadlock, the cancel's 503."""
    monkeypatch.setattr("runs.dispatch.end_tree_now", lambda root_id: None)
    root = _waiting_tree(2)
    child = _tree(root).first()
    held, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def childs_advance() -> None:
        try:
            with transaction.atomic():
                lock_run(child.id)
                held.set()
                go.wait(5)
                request_advance(root.id)
        except BaseException as error:  # reported by the test
            errors.append(error)
        finally:
            connection.close()

    def cancel() -> None:
        try:
            services.run_cancel(run_id=root.id)
        except BaseException as error:  # reported by the test
            errors.append(error)
        finally:
            connection.close()

    advancing = threading.Thread(target=childs_advance)
    advancing.start()
    assert held.wait(5)
    began = time.monotonic()
    cancelling = threading.Thread(target=cancel)
    cancelling.start()
    time.sleep(0.3)  # the cancel is at the child by now (or done)
    go.set()
    cancelling.join(15)
    advancing.join(15)
    took = time.monotonic() - began
    assert errors == []
    assert took < 1.0, f"the cancel waited {took:.2f} s"
    assert Run.objects.get(id=root.id).status == RunStatus.CANCELLED
    # The held child was left to the tree's task, which ends it now that it is free.
    assert trees.end_tree(root_id=root.id) == 1
    assert set(_tree(root).values_list("status", flat=True)) == {RunStatus.CANCELLED}


def test_the_reconciler_sends_the_task_again_for_a_tree_left_behind(
    db, settings, monkeypatch
) -> None:
    """Its runs.end_tree message lost: the tree's runs stay live below a cancelled root
    until the reconciler finds them quiet and sends the task again."""
    _tunables(settings, CANCEL_INLINE_RUNS=0)
    sent: list[str] = []
    monkeypatch.setattr("runs.dispatch.end_tree_now", lambda root: sent.append(str(root)))
    root = _waiting_tree(3)
    services.run_cancel(run_id=root.id)  # its message never sent (on_commit, not run here)
    assert trees.resume_orphaned(timezone.now(), 100) == 0  # not quiet yet
    with time_machine.travel(timezone.now() + timedelta(seconds=15), tick=False):
        assert trees.resume_orphaned(timezone.now(), 100) == 1
    assert sent == [str(root.id)]
    assert trees.end_tree(root_id=root.id) == 3
    with time_machine.travel(timezone.now() + timedelta(seconds=15), tick=False):
        assert trees.resume_orphaned(timezone.now(), 100) == 0
