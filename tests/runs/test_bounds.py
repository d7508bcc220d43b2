"""Bounded work with the database (contract section 9): recursion through subworkflows, the
tree's max_steps, what a request plans inline, and the time budgets of advance, the clock
tick and the reconciler. No worker: advance messages are played by hand (``play``)."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from runs import services
from runs.engine import advance, reconcile
from runs.engine.advance import REQUEST_ACTIONS, run_advance
from runs.engine.timers import fire_due
from runs.models import AdvanceRequest, Run, StepRun, Timer
from workflows.services import definition_save

pytestmark = pytest.mark.django_db


def save(workflow: str, *steps: dict[str, Any], **top: Any) -> None:
    definition_save(document={"id": workflow, "steps": list(steps), **top})


# The spinners' worst case (every iteration taking the branch that never runs) is refused at
# save over the default max_steps (workflows.validation.step_count_errors): they are for the
# planner's rounds and the clock, not for max_steps.
ROOMY = {"max_steps": 100_000}


def sub(step_id: str, workflow: str) -> dict[str, Any]:
    return {"id": step_id, "kind": "subworkflow", "workflow": workflow}


def play(limit: int = 10_000) -> int:
    """What the advance messages sent on commit do: advance every run that asked, until none
    asks. Returns how many advances ran."""
    played = 0
    while played < limit:
        asked = list(AdvanceRequest.objects.values_list("run_id", flat=True)[:100])
        if not asked:
            return played
        for run_id in asked:
            run_advance(run_id=run_id)
            played += 1
    raise AssertionError("advances never settled")


def spin(times: int) -> dict[str, Any]:
    """A loop of conditions that take no branch: engine rows only, no attempt counted."""
    cond = {
        "id": "c",
        "kind": "condition",
        "if": {"path": "input.no", "op": "exists"},
        "then": [{"id": "never", "kind": "sleep", "ms": 0}],
    }
    return {"id": "spin", "kind": "loop", "max_iterations": times, "do": cond}


# --- recursion ----------------------------------------------------------------------------------


def test_a_direct_self_call_is_bounded_never_a_500(api: APIClient) -> None:
    # Today: the child was planned inside the parent's transaction, which started the
    # grandchild, and so on until a RecursionError: a 500 on every start.
    save("rec", sub("again", "rec"))
    answer = api.post("/api/v1/runs", {"workflow": "rec", "input": {}}, format="json")
    assert answer.status_code == 201, answer.content
    play()
    root = Run.objects.get(id=answer.json()["id"])
    assert Run.objects.count() == 9  # the root and 8 subworkflows below it
    assert max(Run.objects.values_list("depth", flat=True)) == 8
    assert root.status == "failed" and root.error["class"] == "invalid_input"
    deepest = Run.objects.get(depth=8)
    assert "at most 8 deep" in deepest.steps.get().error["message"]
    assert set(Run.objects.values_list("root_run_id", flat=True)) == {None, root.id}


def test_mutual_recursion_is_bounded(api: APIClient) -> None:
    save("ping", {"id": "nap", "kind": "sleep", "ms": 0})
    save("pong", sub("back", "ping"))
    save("ping", sub("over", "pong"))
    answer = api.post("/api/v1/runs", {"workflow": "ping", "input": {}}, format="json")
    assert answer.status_code == 201
    play()
    assert Run.objects.count() == 9
    assert Run.objects.get(id=answer.json()["id"]).error["class"] == "invalid_input"


def test_a_chain_of_8_subworkflows_runs_and_of_9_fails() -> None:
    save("link9", {"id": "nap", "kind": "sleep", "ms": 0}, output="deep")
    for n in range(8, -1, -1):
        save(f"link{n}", sub("next", f"link{n + 1}"), output="${steps.next.output}")
    fits = services.run_start(workflow="link1", input={}).run  # 8 below it
    play()
    fits.refresh_from_db()
    assert (fits.status, fits.output) == ("completed", "deep")
    over = services.run_start(workflow="link0", input={}).run  # 9 below it
    play()
    over.refresh_from_db()
    assert over.status == "failed" and over.error["class"] == "invalid_input"


def test_a_fork_of_self_calls_is_bounded() -> None:
    # A parallel of two self-calls forked 813 runs in 12 s, without end.
    save(
        "fork",
        {
            "id": "both",
            "kind": "parallel",
            "branches": {"a": sub("left", "fork"), "b": sub("right", "fork")},
        },
    )
    root = services.run_start(workflow="fork", input={}).run
    play()
    root.refresh_from_db()
    assert root.status == "failed"
    assert root.error["class"] in ("invalid_input", "limit")
    assert Run.objects.count() <= 2**9 - 1
    assert not Run.objects.exclude(status__in=["failed", "cancelled"]).exists()


def test_max_steps_counts_the_attempts_of_the_children() -> None:
    def naps(times: int) -> dict[str, Any]:
        return {
            "id": "naps",
            "kind": "loop",
            "max_iterations": times,
            "do": {"id": "nap", "kind": "sleep", "ms": 0},
        }

    save("inner", naps(9))
    # The parent's subworkflow row is 1 attempt, the child's sleeps 10. "over" fits the child
    # it was saved against (the save refuses a worst case over max_steps); the child's next
    # version, which its unpinned step runs, does not.
    save("fits", sub("child", "inner"), limits={"max_steps": 11})
    save("over", sub("child", "inner"), limits={"max_steps": 10})
    save("inner", naps(10))
    fits = services.run_start(workflow="fits", input={}).run
    over = services.run_start(workflow="over", input={}).run
    play()
    fits.refresh_from_db()
    over.refresh_from_db()
    assert fits.status == "completed"
    assert over.status == "failed" and over.error["class"] == "limit"
    child = Run.objects.get(parent_run=over)
    assert "limits.max_steps (10) reached by the run, its subworkflows" in child.error["message"]


# --- what one request, one advance plans -------------------------------------------------------


def test_a_start_plans_a_few_actions_and_hands_the_rest_to_an_advance(api: APIClient) -> None:
    save("spinner", spin(200))
    answer = api.post("/api/v1/runs", {"workflow": "spinner", "input": {}}, format="json")
    assert answer.status_code == 201
    run_id = answer.json()["id"]
    # Today the request planned all 200 iterations (and a nested loop 1.8 GB of them).
    assert StepRun.objects.filter(run_id=run_id).count() <= REQUEST_ACTIONS + 1
    assert AdvanceRequest.objects.filter(run_id=run_id).exists()
    play()
    assert Run.objects.get(id=run_id).status == "completed"
    assert StepRun.objects.filter(run_id=run_id).count() == 201


def test_an_advance_plans_rounds_for_its_time_then_asks_again(monkeypatch) -> None:
    save("spinner", spin(2000), limits=ROOMY)
    run = services.run_start(workflow="spinner", input={}).run
    before = StepRun.objects.filter(run=run).count()
    run_advance(run_id=run.id, seconds=0)  # one round
    after = StepRun.objects.filter(run=run).count()
    assert after - before == advance.ADVANCE_ACTIONS
    assert AdvanceRequest.objects.filter(run=run).exists()  # it asked for the rest
    monkeypatch.setattr(advance, "ADVANCE_ACTIONS", 100)
    run_advance(run_id=run.id, seconds=60)  # rounds until done
    run.refresh_from_db()
    assert run.status == "completed"


def _due_now(*runs: Run) -> None:
    """Their 1 ms sleeps are over."""
    time.sleep(0.05)
    assert Timer.objects.filter(run__in=runs, purpose="sleep", fire_at__lte=timezone.now())


def test_one_huge_run_does_not_hold_the_clock_tick_from_the_others() -> None:
    nap = {"id": "nap", "kind": "sleep", "ms": 1}
    save("huge", nap, spin(10_000), limits=ROOMY)
    save("small", nap)
    huge = services.run_start(workflow="huge", input={}).run
    small = [services.run_start(workflow="small", input={}).run for _ in range(5)]
    _due_now(huge, *small)
    started = time.monotonic()
    fire_due()
    took = time.monotonic() - started
    print(f"tick with a huge run: {took:.2f} s")
    for run in small:
        run.refresh_from_db()
        assert run.status == "completed"
    # One round of the huge run, the rest asked of a worker: today the tick planned all
    # 10,000 iterations before it got to the others.
    assert StepRun.objects.filter(run=huge).count() <= advance.ADVANCE_ACTIONS + 2
    assert AdvanceRequest.objects.filter(run=huge).exists()


def test_the_tick_hands_runs_to_workers_once_its_time_is_spent(monkeypatch) -> None:
    save("small", {"id": "nap", "kind": "sleep", "ms": 1})
    runs = [services.run_start(workflow="small", input={}).run for _ in range(3)]
    _due_now(*runs)
    sent: list[Any] = []
    monkeypatch.setattr("runs.dispatch.advance_in_batches", lambda ids, size: sent.extend(ids))
    assert fire_due(budget_seconds=0) == 3
    assert sorted(map(str, sent)) == sorted(str(r.id) for r in runs)
    assert all(r.status == "waiting" for r in Run.objects.filter(id__in=[r.id for r in runs]))


def test_the_reconciler_gives_each_run_one_round_within_its_time(monkeypatch) -> None:
    save("spinner", spin(2000), limits=ROOMY)
    run = services.run_start(workflow="spinner", input={}).run
    AdvanceRequest.objects.filter(run=run).update(requested_at=timezone.now() - timedelta(hours=1))
    counts = reconcile.reconcile()
    assert counts["requested"] == 1
    assert StepRun.objects.filter(run=run).count() <= REQUEST_ACTIONS + advance.ADVANCE_ACTIONS + 1
    # Out of time at once: no part runs, the next tick does them.
    assert reconcile.reconcile(budget_seconds=0) == {}
    sent: list[Any] = []
    monkeypatch.setattr("runs.dispatch.advance_many", lambda ids: sent.extend(ids))
    assert reconcile._advance_each({run.id: None}, until=0.0) == 1
    assert sent == [run.id]


def test_a_template_bomb_at_start_fails_the_run_with_invalid_input(api: APIClient) -> None:
    save("bomb", {"id": "a", "kind": "sleep_until", "until": "${input.big}" * 2000})
    started = time.monotonic()
    answer = api.post(
        "/api/v1/runs",
        json.dumps({"workflow": "bomb", "input": {"big": "9" * 100_000}}),
        content_type="application/json",
    )
    assert time.monotonic() - started < 5.0
    assert answer.status_code == 201
    body = answer.json()
    assert body["status"] == "failed" and body["error"]["class"] == "invalid_input"


# --- a plan that reaches a limit beside what it scheduled ---------------------------------------


def par(*branches: dict[str, Any]) -> dict[str, Any]:
    return {"id": "par", "kind": "parallel", "branches": {s["id"]: s for s in branches}}


@pytest.fixture
def sent_offers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The attempts the engine offers to workers (recorded, not sent)."""
    from runs import dispatch

    offered: list[Any] = []
    monkeypatch.setattr(dispatch, "offer_on_commit", lambda step_run, **_: offered.append(step_run))
    monkeypatch.setattr(
        dispatch, "offer_fan_out_on_commit", lambda step_runs, **_: offered.extend(step_runs)
    )
    return offered


@pytest.mark.parametrize(
    "first",
    [
        {"kind": "task", "handler": "tests.noop"},
        {"kind": "wait_event", "event": "go"},
        {"kind": "subworkflow", "workflow": "leaf"},
    ],
    ids=["task", "wait_event", "subworkflow"],
)
def test_a_plan_that_ends_the_run_beside_a_branch_it_began_leaves_nothing_to_run(
    first: dict[str, Any], sent_offers: list[Any]
) -> None:
    """A parallel step's first branch begins, its second is past limits.max_steps: the plan
    ends the run (failed) beside the first. Nothing of it may go on after the end: a task's
    attempt was inserted after the end had closed what was in flight, and offered, so its
    body ran on a failed run; a child run, cancelled by the end, was then planned from a
    stale instance, and the start failed with a 500."""
    save("leaf", {"id": "x", "kind": "task", "handler": "tests.noop"})
    task = {"kind": "task", "handler": "tests.noop"}
    # Refused at save since issue 39 (a worst case of 2 attempts): stored unchecked, as a
    # version saved before it was, for what the planner does with it.
    with mock.patch("workflows.validation.step_count_errors", return_value=[]):
        save("two_over", par({"id": "a", **first}, {"id": "b", **task}), limits={"max_steps": 1})
    run = services.run_start(workflow="two_over", input={}).run
    run.refresh_from_db()
    assert run.status == "failed" and run.error["class"] == "limit"
    assert not StepRun.objects.filter(run=run, status__in=["scheduled", "running"]).exists()
    assert sent_offers == []
    assert not Run.objects.filter(parent_run=run).exclude(status="cancelled").exists()
    play()
    assert not StepRun.objects.exclude(status__in=["failed", "cancelled", "succeeded"]).exists()
