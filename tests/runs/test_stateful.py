"""Hypothesis stateful tests of the run services against the run invariants.

A ``RuleBasedStateMachine`` starts runs of ``tests/runs/flows_stateful.py`` (a worker step, a
wait for an event, an approval, an ``at_most_once`` step) and, in any order Hypothesis
draws, cancels, pauses, resumes, retries them, sends their events, decides their approvals,
and kills the worker of an attempt (claimed, then its lease lapses before any result). The
engine's messages are not sent: the machine delivers them itself, as rules of their own, in
any order and any number of times (``work``: a worker runs the run's offered attempt;
``advance``: an advance message arrives), so a message that comes late, twice or never is
part of what is drawn.

After every rule:

- each run's status moved only along ``runs/status.py``'s table (every single move is also
  checked by the test database's triggers, ``tests/moves.py``), and a run that had ended is
  still ended unless the rule was an operator's retry of it;
- an operator's action succeeded exactly when the table allows it from the status before;
- an ended run has ``finished_at``, no attempt scheduled, running or waiting, no timer left,
  no approval pending; a live run has no ``finished_at`` and one step in flight at most (the
  document is a sequence);
- a completed run's output is what its input says; a failed one failed for a reason drawn
  (a rejection, or an at_most_once attempt whose worker was lost);
- no body ran while its run had ended (cancelled above all), and the ``at_most_once`` body
  ran at most once in a generation of the run.

At the end of each example every run is driven to its end (resumed, its event sent, its
approval granted, its attempts run): nothing is stuck.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from approvals.models import ApprovalRequest
from approvals.services import Origin, approval_decide
from runs import services
from runs.engine.advance import run_advance
from runs.models import Run, StepRun, Timer
from runs.status import RUN_MOVES, RUN_TERMINAL, STEP_IN_FLIGHT, RunStatus
from workers.claims import claim_attempt
from workers.execution import execute
from workflows.errors import Conflict

from . import flows_stateful as flows

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

_numbers = itertools.count(1)
# What the examples did (operator actions by the status they met, status moves seen): the
# test asserts the interesting ones happened, so it cannot pass by never reaching them.
SEEN: Counter[str] = Counter()
SOMETIMES = st.integers(0, 2).map(lambda drawn: drawn == 0)


def _closure(sources: set[str]) -> set[str]:
    """Every status reachable from ``sources`` by moves that do not start from an ended run
    (a retry is the only move out of one, made by its own rule)."""
    seen, todo = set(sources), list(sources)
    while todo:
        here = todo.pop()
        if here in RUN_TERMINAL:
            continue
        for there in RUN_MOVES[here]:
            if there not in seen:
                seen.add(there)
                todo.append(there)
    return seen


@dataclass
class Tracked:
    n: int
    status: str


class RunMachine(RuleBasedStateMachine):
    user: Any = None
    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[str, Tracked] = {}
        self.retried: str | None = None
        flows.EXECUTIONS.clear()

    # --- the operator's and the world's actions --------------------------------------------

    @precondition(lambda self: len(self.tracked) < 2)
    @rule(target=runs)
    def start(self) -> str:
        n = next(_numbers)
        run = services.run_start(
            workflow=flows.WORKFLOW, input={"n": n, "key": f"k{n}"}, user=self.user
        ).run
        self.tracked[str(run.id)] = Tracked(n, run.status)
        return str(run.id)

    @rule(run=runs)
    def work(self, run: str) -> None:
        """A worker takes the run's offered attempt (its message arrives)."""
        offered = StepRun.objects.filter(run_id=run, status="scheduled").order_by("id").first()
        if offered is not None:
            execute(offered.id, worker="here")

    @rule(run=runs)
    def advance(self, run: str) -> None:
        """An advance message for the run arrives (again, or late)."""
        run_advance(run_id=run)

    @rule(run=runs, act=SOMETIMES)
    def kill(self, run: str, act: bool) -> None:
        """A worker claims the run's offered attempt and is lost before it records anything:
        its lease lapses, and the next advance finds it."""
        if not act:
            return
        offered = StepRun.objects.filter(run_id=run, status="scheduled").order_by("id").first()
        if offered is None:
            return
        now = timezone.now()
        if claim_attempt(offered.id, worker="doomed", now=now) is None:
            return
        StepRun.objects.filter(id=offered.id).update(lease_expires_at=now - timedelta(seconds=1))
        run_advance(run_id=run)

    def _resolve(self, run: str, outcome: str) -> None:
        """An operator answers for an at_most_once attempt left in doubt by a kill: it
        succeeded (with the output its body would have returned) or it failed. Not a rule:
        one more rule changes the derandomized walk, which then no longer reached a
        completion; the end of each example resolves (tests/runs/test_in_doubt.py has the
        resolve's own tests)."""
        doubtful = StepRun.objects.filter(run_id=run, status="in_doubt").first()
        if doubtful is None:
            return
        n = self.tracked[run].n
        output = n + flows.event_value(n) if outcome == "succeeded" else None
        services.step_run_resolve(
            run_id=run, step_run_id=doubtful.id, outcome=outcome, output=output, user=self.user
        )
        SEEN[f"in doubt resolved {outcome}"] += 1

    # Rules are drawn alike, and a cancel drawn as often as a worker's step would end most
    # runs before their waits: cancel, pause and kill act on a third of their draws.
    @rule(run=runs, act=SOMETIMES)
    def cancel(self, run: str, act: bool) -> None:
        if act:
            # A second cancel is idempotent: accepted, and the run stays as it was.
            self._operate(
                services.run_cancel, run, RunStatus.CANCELLED, same_from={RunStatus.CANCELLED}
            )

    @rule(run=runs, act=SOMETIMES)
    def pause(self, run: str, act: bool) -> None:
        if act:
            self._operate(services.run_pause, run, RunStatus.PAUSED)

    @rule(run=runs)
    def resume(self, run: str) -> None:
        # Only a paused run resumes, though the table lets others become running.
        self._operate(services.run_resume, run, RunStatus.RUNNING, only_from={RunStatus.PAUSED})

    @rule(run=runs)
    def retry(self, run: str) -> None:
        # A plain retry (from the failed step) is a failed run's alone.
        if self._operate(services.run_retry, run, RunStatus.RUNNING, only_from={"failed"}):
            self.retried = run

    @rule(run=runs)
    def event(self, run: str) -> None:
        n = self.tracked[run].n
        services.event_send(
            name=flows.EVENT,
            key=f"k{n}",
            payload={"value": flows.event_value(n)},
            user=self.user,
        )

    @rule(run=runs, decision=st.sampled_from(["approved", "rejected"]))
    def decide(self, run: str, decision: str) -> None:
        request = ApprovalRequest.objects.filter(run_id=run, status="pending").first()
        if request is not None:
            approval_decide(
                request_id=request.id, decision=decision, origin=Origin("api"), user=self.user
            )

    def _operate(
        self,
        action: Callable[..., Any],
        run: str,
        target: str,
        only_from: set[str] | None = None,
        same_from: frozenset[str] | set[str] = frozenset(),
    ) -> bool:
        before = Run.objects.get(id=run).status
        allowed = target in RUN_MOVES[before] and (only_from is None or before in only_from)
        allowed = allowed or before in same_from
        try:
            action(run_id=run, user=self.user)
        except Conflict as refused:
            assert not allowed, f"{action.__name__} of a {before} run refused: {refused.errors}"
            SEEN[f"{action.__name__} of a {before} run: refused"] += 1
            return False
        assert allowed, f"{action.__name__} of a {before} run was accepted"
        SEEN[f"{action.__name__} of a {before} run: done"] += 1
        return True

    # --- the invariants ---------------------------------------------------------------------

    @invariant()
    def statuses_move_along_the_table(self) -> None:
        statuses = {
            str(run_id): status
            for run_id, status in Run.objects.filter(id__in=self.tracked).values_list(
                "id", "status"
            )
        }
        for run_id, tracked in self.tracked.items():
            now = statuses[run_id]
            if now != tracked.status:
                if tracked.status in RUN_TERMINAL:
                    assert self.retried == run_id, f"{run_id}: ended {tracked.status}, now {now}"
                    assert now in _closure({RunStatus.RUNNING}), (tracked.status, now)
                else:
                    assert now in _closure({tracked.status}) - {tracked.status}, (
                        tracked.status,
                        now,
                    )
            if now != tracked.status:
                SEEN[f"{tracked.status} -> {now}"] += 1
            tracked.status = now
        self.retried = None

    @invariant()
    def ended_and_live_runs_are_consistent(self) -> None:
        for run_id, tracked in self.tracked.items():
            self._check_run(run_id, tracked.n)

    @invariant()
    def no_body_ran_after_its_run_ended_nor_at_most_once_twice(self) -> None:
        for run_id, step_id, attempt, status, _ in flows.EXECUTIONS:
            assert status not in RUN_TERMINAL, f"{step_id} #{attempt} of {run_id} ran {status}"
        last = Counter(
            (run_id, generation)
            for run_id, step_id, _, _, generation in flows.EXECUTIONS
            if step_id == "last"
        )
        assert all(times == 1 for times in last.values()), last

    def _check_run(self, run_id: str, n: int) -> None:
        run = Run.objects.get(id=run_id)
        steps = list(run.steps.values_list("step_id", "status", "generation"))
        in_flight = [s for s in steps if s[1] in STEP_IN_FLIGHT]
        pending = ApprovalRequest.objects.filter(run_id=run_id, status="pending").count()
        if run.status in RUN_TERMINAL:
            assert run.finished_at is not None, run_id
            assert not in_flight, (run_id, run.status, in_flight)
            assert not Timer.objects.filter(run_id=run_id, fired_at__isnull=True).exists()
            assert pending == 0, (run_id, run.status)
        else:
            assert run.finished_at is None, (run_id, run.status)
            assert len(in_flight) <= 1, (run_id, run.status, in_flight)
            assert pending <= 1, (run_id, run.status)
        if run.status == RunStatus.COMPLETED:
            assert run.output == flows.expected_output(n), (run_id, run.output)
            SEEN["a run completed with its expected output"] += 1
        if run.status == RunStatus.FAILED:
            assert (run.error or {}).get("class") in ("rejected", "lost", "in_doubt"), (
                run_id,
                run.error,
            )
        if run.status == RunStatus.CANCELLED:
            assert (run.error or {}).get("class") == "cancelled", (run_id, run.error)

    # --- the end of an example --------------------------------------------------------------

    def teardown(self) -> None:
        """Drive every run to its end: nothing may be stuck."""
        for run_id, tracked in self.tracked.items():
            for _ in range(30):
                status = Run.objects.get(id=run_id).status
                if status in RUN_TERMINAL:
                    break
                if status == RunStatus.PAUSED:
                    services.run_resume(run_id=run_id, user=self.user)
                # A kill of the at_most_once step leaves it in doubt until an operator acts.
                self._resolve(run_id, "failed")
                self.advance(run_id)
                self.work(run_id)
                self.event(run_id)
                self.decide(run_id, "approved")
            run = Run.objects.get(id=run_id)
            assert run.status in RUN_TERMINAL, f"run {run_id} is stuck {run.status}"
            self._check_run(run_id, tracked.n)
        self.no_body_ran_after_its_run_ended_nor_at_most_once_twice()


@pytest.fixture
def machine_user(user: Any) -> Iterator[Any]:
    flows.flow.save()
    # Messages are the machine's rules: nothing reaches a broker.
    with (
        mock.patch("workers.tasks.execute_step.apply_async"),
        mock.patch("runs.tasks.advance.apply_async"),
    ):
        yield user


def test_operations_on_runs_keep_the_invariants(machine_user: Any) -> None:
    RunMachine.user = machine_user
    run_state_machine_as_test(
        RunMachine,
        settings=settings(
            max_examples=25,
            stateful_step_count=60,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    # The walk reached what the invariants are about. Its outcomes depend on the database
    # and the clock as well as on its draws, so which operator actions it reaches moves from
    # one run to the next: required are a completion checked against its expected output,
    # and operator actions accepted.
    reached = {"a run completed with its expected output"}
    accepted = sum(count for name, count in SEEN.items() if name.endswith(": done"))
    assert accepted >= 10, sorted(SEEN.items())
    assert reached <= set(SEEN), sorted(reached - set(SEEN))
