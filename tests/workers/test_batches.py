"""A fan-out's attempts sent several to a message (``runs.dispatch.offer_fan_out_on_commit``)
are run one after another by the task that takes the message, each claimed on its own; the
rest goes to other workers when the task's budget is spent, and at once when one attempt runs
long (``workers.batches``), so a slow item never holds the others of its message back."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from runs import dispatch, services
from runs.engine import journal
from runs.models import StepRun
from tests.processes import wait_for
from workers import batches, execution
from workflows.sdk import handler, task, workflow
from workflows.services import definition_save

pytestmark = pytest.mark.django_db(transaction=True)

RAN: list[Any] = []
SLOW: set[int] = set()


@handler("batches_test.item")
def item(ctx: Any, input: Any, prior: Any) -> Any:
    RAN.append((input, threading.current_thread().name))
    if input in SLOW:
        time.sleep(0.6)
    return input


@pytest.fixture
def offered(monkeypatch, settings) -> list[tuple[list[int], dict[str, Any]]]:
    """The fan-out's messages are not sent (the test runs their attempts itself); what a
    task hands on is recorded."""
    settings.DJFLOW = {**settings.DJFLOW, "CHECK_PREFIX": False}
    journal.forget_prefixes()
    RAN.clear()
    SLOW.clear()
    handed: list[tuple[list[int], dict[str, Any]]] = []
    monkeypatch.setattr(dispatch, "offer_fan_out_on_commit", lambda *a, **k: None)
    monkeypatch.setattr(dispatch, "advance_on_commit", lambda *a, **k: None)
    monkeypatch.setattr(
        dispatch, "offer_ids", lambda ids, **options: handed.append((list(ids), options))
    )
    return handed


def _items(count: int) -> list[int]:
    """Start a run of a foreach over ``count`` items; its item attempts' ids, in order."""
    flow = workflow("batches_test", limits={"run_timeout_ms": 3_600_000})
    flow.foreach("fan", items="${input.items}", do=task("item", handler="batches_test.item"))
    definition_save(document=flow.document())
    run = services.run_start(workflow="batches_test", input={"items": list(range(count))}).run
    return list(
        StepRun.objects.filter(run=run, kind="task").order_by("id").values_list("id", flat=True)
    )


def test_a_message_runs_its_attempts_one_after_another_each_claimed(offered) -> None:
    first, *more = _items(5)
    # One attempt claimed meanwhile by another worker (a duplicate of its message): skipped.
    StepRun.objects.filter(id=more[1]).update(status="running", worker="elsewhere")
    outcome = execution.execute(first, worker="w1", more=more, queue="default", soft_limit=32)
    assert outcome == "succeeded"
    assert [input for input, _ in RAN] == [0, 1, 3, 4]
    rows = dict(StepRun.objects.filter(id__in=[first, *more]).values_list("id", "worker"))
    assert [rows[i] for i in [first, *more]] == ["w1", "w1", "elsewhere", "w1", "w1"]
    assert offered == []


def test_past_the_tasks_budget_the_rest_is_offered_one_a_message(offered, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "INLINE_MAX_STEPS": 2}
    first, *more = _items(5)
    execution.execute(first, worker="w1", more=more, queue="gpu", soft_limit=32, priority=3)
    assert [input for input, _ in RAN] == [0, 1, 2]
    assert offered == [(more[2:], {"queue": "gpu", "soft_limit": 32, "priority": 3})]
    left = StepRun.objects.filter(id__in=more[2:]).values_list("status", flat=True)
    assert list(left) == ["scheduled", "scheduled"]


def test_a_slow_attempt_hands_the_rest_on_while_it_runs(offered) -> None:
    """The rest is offered by the hand-off thread during the slow attempt (not after it),
    and the task stops after it: nobody waits for a slow item but the item itself."""
    first, *more = _items(4)
    SLOW.add(0)
    began = time.monotonic()
    seen: list[float] = []
    real = dispatch.offer_ids

    def timed(ids: list[int], **options: Any) -> None:
        seen.append(time.monotonic() - began)
        real(ids, **options)

    dispatch.offer_ids = timed  # type: ignore[assignment]
    try:
        execution.execute(first, worker="w1", more=more, queue="default", soft_limit=32)
    finally:
        dispatch.offer_ids = real  # type: ignore[assignment]
    assert [input for input, _ in RAN] == [0]
    assert [ids for ids, _ in offered] == [more]
    (when,) = seen
    assert batches.HAND_OFF_SECONDS <= when < 0.6, when
    left = StepRun.objects.filter(id__in=more).values_list("status", flat=True)
    assert set(left) == {"scheduled"}


def test_a_fast_message_hands_nothing_on(offered) -> None:
    first, *more = _items(10)
    execution.execute(first, worker="w1", more=more, queue="default", soft_limit=32)
    time.sleep(2 * batches._LOOK_SECONDS)
    assert len(RAN) == 10 and offered == []


def test_a_message_this_worker_cannot_serve_goes_on_together(offered, monkeypatch) -> None:
    """A worker without the handler hands its attempt back and the rest goes on in one
    message, for a worker that has it."""
    first, *more = _items(3)
    monkeypatch.setattr(execution, "_hand_back", lambda *a, **k: None)
    monkeypatch.setattr(execution.kinds, "get", lambda name: None)
    with pytest.raises(execution.HandedBack):
        execution.execute(first, worker="w1", more=more, queue="default", soft_limit=32)
    assert offered == [
        (more, {"queue": "default", "soft_limit": 32, "priority": None, "together": True})
    ]
    assert RAN == []


def test_what_a_message_carries_is_bounded_before_anything_acts_on_it(caplog) -> None:
    """A message comes from the broker: a malformed ``more`` is ignored whole (its attempts
    stay scheduled for the reconciler), a longer one than a message may carry is cut."""
    assert batches.bounded(None) == [] and batches.bounded([]) == []
    assert batches.bounded([4, 5]) == [4, 5]
    for malformed in (["4"], [4, None], [True], "4,5", {"a": 1}, [4.0]):
        assert batches.bounded(malformed) == [], malformed
    long = list(range(10_000))
    assert batches.bounded(long) == list(range(batches.MAX_PER_MESSAGE - 1))
    assert "carries 10001 attempts" in caplog.text


def test_a_fan_out_is_never_sent_more_to_a_message_than_a_worker_takes(settings) -> None:
    # Without the chord: its messages are cut the same way, and the stand-in signatures
    # below are no Celery signatures a chord could freeze.
    settings.DJFLOW = {**settings.DJFLOW, "FAN_OUT_PER_MESSAGE": 10_000, "FAN_OUT_CHORDS": False}
    sent: list[Any] = []

    class Signature:
        def __init__(self, args: Any, kwargs: Any) -> None:
            sent.append((args, kwargs))

        def apply_async(self, **_: Any) -> None:
            pass

    from types import SimpleNamespace
    from unittest import mock

    attempts = [SimpleNamespace(id=n, queue="q", timeout_ms=1000) for n in range(250)]
    with (
        mock.patch.object(
            dispatch,
            "_execute_signature",
            lambda step_run, kwargs=None, **_: Signature(step_run.id, kwargs),
        ),
        mock.patch("django.db.transaction.on_commit", side_effect=lambda f, robust=False: f()),
    ):
        dispatch.offer_fan_out_on_commit(attempts, run_id="r", workflow_id="w")
    assert [first for first, _ in sent] == [0, 100, 200]
    assert all(len(kwargs["more"]) <= batches.MAX_PER_MESSAGE - 1 for _, kwargs in sent)


def test_a_task_stopped_by_an_error_hands_the_rest_of_its_message_on(offered, monkeypatch) -> None:
    """A database error (or Celery's time limit) that ends the task: the rest of its message
    is offered at once, not left for the reconciler."""
    from django.db import OperationalError

    first, *more = _items(4)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("the database went away")

    monkeypatch.setattr(execution, "_execute_one", broken)
    with pytest.raises(OperationalError):
        execution.execute(first, worker="w1", more=more, queue="default", soft_limit=32)
    assert offered == [(more, {"queue": "default", "soft_limit": 32, "priority": None})]


def test_an_attempt_of_the_rest_handed_back_sends_what_is_left_on_together(
    offered, monkeypatch
) -> None:
    """The first attempt ran; the second one is handed back (this worker lacks its handler
    by then, or every model slot is taken): the two after it go on in one message."""
    first, *more = _items(4)
    real = execution._execute_one

    def second_handed_back(step_run_id: int, *args: Any, **kwargs: Any) -> Any:
        if step_run_id == more[0]:
            return execution.HANDED_BACK, None
        return real(step_run_id, *args, **kwargs)

    monkeypatch.setattr(execution, "_execute_one", second_handed_back)
    execution.execute(first, worker="w1", more=more, queue="default", soft_limit=32)
    assert [input for input, _ in RAN] == [0]
    assert offered == [
        (more[1:], {"queue": "default", "soft_limit": 32, "priority": None, "together": True})
    ]


def test_a_hand_off_the_broker_refuses_leaves_the_attempts_scheduled(caplog) -> None:
    """The thread's offer fails (the broker is down): logged, nothing raised in the worker
    (the attempts are still scheduled in the journal: the reconciler offers them again)."""

    def refused(ids: list[int]) -> None:
        raise ConnectionError("the broker is down")

    rest = batches.Rest([7, 8], refused)
    rest.running()
    deadline = time.monotonic() + batches.HAND_OFF_SECONDS + 1.0
    while rest.ids and time.monotonic() < deadline:
        time.sleep(batches._LOOK_SECONDS)
    rest.ran()
    assert rest.ids == []  # taken by the thread, which tried to offer them
    # The thread logs after it took the ids and its offer raised: on a busy machine that is
    # a moment after the loop above saw them gone.
    wait_for(
        lambda: "could not hand off the rest of a message" in caplog.text,
        timeout=5,
        message=lambda: caplog.text,
    )
