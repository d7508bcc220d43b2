"""The advance request of a fan-out (runs.engine.store): a completion that finds a request
pending is seen by the advance that takes it away, however their transactions interleave.

Two real Postgres connections (threads); no broker: the messages the engine would send are
only counted.
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from runs import dispatch, services
from runs.engine.advance import run_advance
from runs.models import AdvanceRequest, Run, StepRun
from workers import execution
from workers.claims import Claimed, claim_attempt
from workflows.services import definition_save

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def advances(monkeypatch) -> list[str]:
    """Advance messages the engine asked for; offers of attempts are dropped (no worker)."""
    asked: list[str] = []
    monkeypatch.setattr(dispatch, "advance_on_commit", lambda run_id: asked.append(str(run_id)))
    monkeypatch.setattr(dispatch, "offer_on_commit", lambda *a, **k: None)
    monkeypatch.setattr(dispatch, "offer_fan_out_on_commit", lambda *a, **k: None)
    return asked


def _pair() -> tuple[Run, Claimed, Claimed]:
    """A run in a foreach of two items, both attempts claimed by a worker."""
    item = {"id": "item", "kind": "task"}
    fan = {"id": "fan", "kind": "foreach", "items": [0, 1], "do": item}
    definition_save(document={"id": "pair", "steps": [fan]})
    run = services.run_start(workflow="pair").run
    rows = StepRun.objects.filter(run=run, kind="task").order_by("path")
    first, second = (claim_attempt(r.id, worker="w", now=timezone.now()) for r in rows)
    assert first is not None and second is not None
    return run, first, second


def _recorded(output: Any) -> dict[str, Any]:
    return {
        "status": "succeeded",
        "output": output,
        "error": None,
        "finished_at": timezone.now(),
        "lease_expires_at": None,
        "usage": {},
        "spans": [],
        "cost_usd": Decimal("0"),
    }


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_a_completion_still_committing_when_the_advance_takes_the_request_is_seen(
    advances, monkeypatch
) -> None:
    run, first, second = _pair()
    # Here every completion asks (as a failure, or one in a capped fan-out, does): the race
    # is between asking and the advance taking the request away.
    monkeypatch.setattr(execution, "_may_change_the_plan", lambda row, status: True)
    execution._record_inside(first, first.claim, _recorded("a"), 0)
    assert advances == [str(run.id)]  # the first completion asked; its message is on its way

    # The second completion finds that request pending, then is slow to commit: the advance
    # the first one asked for takes the request away and reads the journal meanwhile.
    found_pending = threading.Event()
    real_request = execution.request_advance

    def slow_to_commit(run_id: Any) -> bool:
        pending = real_request(run_id)
        found_pending.set()
        time.sleep(0.5)
        return pending

    monkeypatch.setattr(execution, "request_advance", slow_to_commit)

    def complete_second() -> None:
        try:
            execution._record_inside(second, second.claim, _recorded("b"), 0)
        finally:
            connection.close()

    thread = threading.Thread(target=complete_second)
    thread.start()
    assert found_pending.wait(5)
    run_advance(run_id=run.id)
    thread.join(10)
    assert not thread.is_alive()

    run.refresh_from_db()
    # Either that advance saw the second result, or the second completion asked again: a
    # result nobody will look at would leave the foreach open until the run's deadline.
    pending = AdvanceRequest.objects.filter(run_id=run.id).exists()
    assert run.status == "completed" or (pending and advances.count(str(run.id)) == 2), (
        run.status,
        pending,
        advances,
    )
    if run.status != "completed":
        run_advance(run_id=run.id)
        run.refresh_from_db()
    assert (run.status, run.output) == ("completed", ["a", "b"])


def test_a_success_asks_only_when_nothing_else_of_the_run_is_in_flight(advances) -> None:
    run, first, second = _pair()
    execution._record_inside(first, first.claim, _recorded("a"), 0)
    assert advances == []  # the other item still runs: nothing for a plan to do yet
    execution._record_inside(second, second.claim, _recorded("b"), 0)
    assert advances == [str(run.id)]
    run_advance(run_id=run.id)
    run.refresh_from_db()
    assert (run.status, run.output) == ("completed", ["a", "b"])


def test_a_failure_asks_at_once(advances) -> None:
    run, first, _ = _pair()
    failure = {**_recorded(None), "status": "failed", "error": {"class": "fatal", "message": "x"}}
    execution._record_inside(first, first.claim, failure, 0)
    assert advances == [str(run.id)]


def test_a_success_in_a_capped_fan_out_asks_at_once(advances) -> None:
    item = {"id": "item", "kind": "task"}
    fan = {"id": "fan", "kind": "foreach", "items": [0, 1, 2], "concurrency": 2, "do": item}
    definition_save(document={"id": "capped_pair", "steps": [fan]})
    run = services.run_start(workflow="capped_pair").run
    rows = StepRun.objects.filter(run=run, kind="task").order_by("path")
    first = claim_attempt(rows[0].id, worker="w", now=timezone.now())
    claim_attempt(rows[1].id, worker="w", now=timezone.now())
    execution._record_inside(first, first.claim, _recorded("a"), 0)
    assert advances == [str(run.id)]  # a slot is free: the third item may start


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_the_last_two_successes_committing_at_once_ask_at_least_once(advances, monkeypatch) -> None:
    """Completions take no lock: each looks for others in flight after its commit. Both of
    the last two look only once both have committed (a barrier): had either looked before
    its commit, it would see the other running, and nobody would ask."""
    run, first, second = _pair()
    both_committed = threading.Barrier(2, timeout=10)
    real_look = execution._nothing_else_in_flight

    def look_once_both_committed(row: Claimed) -> bool:
        both_committed.wait()
        return real_look(row)

    monkeypatch.setattr(execution, "_nothing_else_in_flight", look_once_both_committed)

    def complete(row: Claimed, output: str) -> None:
        try:
            execution._record_inside(row, row.claim, _recorded(output), 0)
        finally:
            connection.close()

    threads = [
        threading.Thread(target=complete, args=pair) for pair in ((first, "a"), (second, "b"))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert not any(thread.is_alive() for thread in threads)
    # Both saw nothing else in flight; the request is made once, the message sent once.
    assert advances == [str(run.id)]
    run_advance(run_id=run.id)
    run.refresh_from_db()
    assert (run.status, run.output) == ("completed", ["a", "b"])


def test_a_success_whose_look_fails_leaves_the_run_to_the_reconciler(advances, monkeypatch) -> None:
    """The result is committed before the look: a database error there is not the
    attempt's, and must not make the worker record it again (it would find it dropped)."""
    from django.db import OperationalError

    _, first, second = _pair()
    execution._record_inside(first, first.claim, _recorded("a"), 0)

    def broken(row: Claimed) -> bool:
        raise OperationalError("the server closed the connection")

    monkeypatch.setattr(execution, "_nothing_else_in_flight", broken)
    assert execution._record_inside(second, second.claim, _recorded("b"), 0) == ("succeeded", None)
    assert advances == []
    assert StepRun.objects.get(id=second.id).status == "succeeded"
