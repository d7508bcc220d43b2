"""Decisions are race-free (issue 6, item 7), with real concurrency: threads on separate
database connections, committed transactions, the run's row lock deciding who goes first.

Each race is run several times; every iteration checks that there was one outcome and that
the run advanced once (one attempt of the step after the approval, one ``attempts`` count).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from approvals.models import ApprovalRequest, Decision
from approvals.services import Origin, RequestClosed, approval_decide
from runs import services
from runs.engine.advance import run_advance
from runs.models import Run, StepRun, Timer
from workflows.services import definition_save

pytestmark = pytest.mark.django_db(transaction=True)

ROUNDS = 10
HOUR = 3_600_000


@pytest.fixture
def approvers(transactional_db) -> None:
    make = get_user_model().objects.create_user
    for name in ("ann", "bob"):
        make(username=name, email=f"{name}@example.com")


def save(workflow: str, **gate: Any) -> None:
    gate.setdefault("approvers", {"users": ["ann", "bob"]})
    definition_save(
        document={
            "id": workflow,
            "limits": {"run_timeout_ms": 24 * HOUR},
            "steps": [
                {"id": "gate", "kind": "approval", **gate},
                {"id": "after", "kind": "task"},
            ],
        }
    )


def start(workflow: str) -> tuple[Run, ApprovalRequest]:
    run = services.run_start(workflow=workflow, input={}).run
    return run, ApprovalRequest.objects.get(run=run)


def decide(request_id: Any, who: str) -> None:
    approval_decide(
        request_id=request_id,
        decision="approved",
        origin=Origin("api"),
        user=get_user_model().objects.get(username=who),
    )


def race(*jobs: Callable[[], Any]) -> list[Any]:
    """Run the jobs at once, each in its own thread (and database connection); what each
    returned, or the exception it raised."""
    barrier = threading.Barrier(len(jobs))
    results: list[Any] = [None] * len(jobs)

    def work(index: int, job: Callable[[], Any]) -> None:
        try:
            barrier.wait(timeout=10)
            results[index] = job()
        except Exception as error:  # the outcome under test
            results[index] = error
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    return results


def kinds(results: list[Any]) -> list[str]:
    return sorted(type(r).__name__ if isinstance(r, Exception) else "ok" for r in results)


def assert_advanced_once(run: Run) -> None:
    gate = StepRun.objects.get(run=run, step_id="gate")
    assert gate.status == "succeeded"
    assert gate.output["decision"] == "approved"
    after = StepRun.objects.filter(run=run, step_id="after")
    assert after.count() == 1 and after.get().status == "scheduled"
    run = Run.objects.get(id=run.id)
    assert (run.status, run.attempts) == ("running", 1)


def test_two_approvers_at_the_same_moment_one_decision_counts(approvers) -> None:
    save("race_two")
    for _ in range(ROUNDS):
        run, request = start("race_two")
        results = race(partial(decide, request.id, "ann"), partial(decide, request.id, "bob"))
        assert kinds(results) == ["RequestClosed", "ok"], results
        assert Decision.objects.filter(request=request).count() == 1
        winner = Decision.objects.get(request=request).by
        assert ApprovalRequest.objects.get(id=request.id).status == "approved"
        assert StepRun.objects.get(run=run, step_id="gate").output["by"] == winner
        assert_advanced_once(run)


def test_a_double_submit_counts_once(approvers) -> None:
    save("double_one")  # quorum 1: the second submit finds the request closed
    save("double_two", quorum=2)  # quorum 2: it finds the vote already counted
    for index in range(ROUNDS):
        workflow = "double_one" if index % 2 == 0 else "double_two"
        run, request = start(workflow)
        results = race(partial(decide, request.id, "ann"), partial(decide, request.id, "ann"))
        refused = "RequestClosed" if workflow == "double_one" else "AlreadyDecided"
        assert kinds(results) == sorted([refused, "ok"]), results
        assert Decision.objects.filter(request=request).count() == 1
        if workflow == "double_one":
            assert_advanced_once(run)
        else:
            assert ApprovalRequest.objects.get(id=request.id).status == "pending"
            assert StepRun.objects.get(run=run, step_id="gate").status == "waiting"
            assert not StepRun.objects.filter(run=run, step_id="after").exists()
            # bob's vote closes it; the run goes on once.
            decide(request.id, "bob")
            assert_advanced_once(run)


def test_a_decision_racing_the_deadline_has_one_outcome(approvers) -> None:
    save("deadline", timeout_ms=HOUR)
    seen: Counter[str] = Counter()
    rng = random.Random(6)
    for _ in range(ROUNDS * 2):
        run, request = start("deadline")
        # The deadline falls in the middle of the race: the decision comes a little before
        # or a little after it, and the deadline's advance right after it.
        deadline = timezone.now() + timedelta(milliseconds=60)
        StepRun.objects.filter(run=run, step_id="gate").update(not_before=deadline)
        ApprovalRequest.objects.filter(id=request.id).update(deadline=deadline)
        Timer.objects.filter(run=run, purpose="approval_timeout").update(fire_at=deadline)
        decide_at = deadline + timedelta(milliseconds=rng.uniform(-40, 10))

        def expire(run_id: Any = run.id, at: Any = deadline) -> Any:
            pause(at)
            return run_advance(run_id=run_id)

        def approve(request_id: Any = request.id, at: Any = decide_at) -> Any:
            pause(at)
            return decide(request_id, "ann")

        expired, approved = race(expire, approve)
        assert not isinstance(expired, Exception), expired
        gate = StepRun.objects.get(run=run, step_id="gate")
        state = ApprovalRequest.objects.get(id=request.id).status
        if isinstance(approved, Exception):
            assert isinstance(approved, RequestClosed), approved
            assert (state, gate.status, gate.error["class"]) == ("expired", "timed_out", "timeout")
            assert not Decision.objects.filter(request=request).exists()
            assert not StepRun.objects.filter(run=run, step_id="after").exists()
            assert Run.objects.get(id=run.id).status == "failed"
            seen["expired"] += 1
        else:
            assert state == "approved"
            assert Decision.objects.filter(request=request).count() == 1
            assert_advanced_once(run)
            seen["approved"] += 1
    # Both outcomes are possible; whichever happened, it happened alone (checked above).
    assert sum(seen.values()) == ROUNDS * 2


def test_the_deadline_tick_and_a_decision_in_the_same_instant(approvers) -> None:
    # The timer already due and the decision sent at the same moment: the decision is
    # refused (its deadline has passed) whoever takes the run's lock first.
    save("deadline_past", timeout_ms=HOUR)
    for _ in range(ROUNDS):
        run, request = start("deadline_past")
        past = timezone.now() - timedelta(milliseconds=1)
        StepRun.objects.filter(run=run, step_id="gate").update(not_before=past)
        ApprovalRequest.objects.filter(id=request.id).update(deadline=past)
        expired, approved = race(
            lambda run_id=run.id: run_advance(run_id=run_id),
            lambda request_id=request.id: decide(request_id, "ann"),
        )
        assert isinstance(approved, RequestClosed) and not isinstance(expired, Exception)
        assert ApprovalRequest.objects.get(id=request.id).status == "expired"
        assert StepRun.objects.get(run=run, step_id="gate").status == "timed_out"
        assert not Decision.objects.filter(request=request).exists()


def pause(until: Any) -> None:
    left = (until - timezone.now()).total_seconds()
    if left > 0:
        time.sleep(left)


def test_races_leave_no_request_open_twice(approvers) -> None:
    # Three approvers' worth of votes at once on a quorum-2 request: exactly two count
    # only when no rejection came first; here all approve, so the first two close it.
    get_user_model().objects.create_user(username="cy", email="cy@example.com")
    save("three", approvers={"users": ["ann", "bob", "cy"]}, quorum=2)
    for _ in range(ROUNDS // 2):
        run, request = start("three")
        results = race(*(partial(decide, request.id, who) for who in ("ann", "bob", "cy")))
        assert kinds(results) == ["RequestClosed", "ok", "ok"], results
        assert Decision.objects.filter(request=request).count() == 2
        assert_advanced_once(run)
