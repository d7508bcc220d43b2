"""Fan-in end to end: the journal is the fan-in, whatever the chord's body does.

Real Postgres, Redis, ``celery worker`` and ``celery beat`` processes. The engine offers a
fan-out as a Celery chord whose body is an advance of the run (a nudge); here its body is
forced to misbehave (it never fires, fires twice, fires while a retried item is still
pending), a worker is killed in the middle of a 200-item fan-out, and a run with running
children and grandchildren is cancelled; every time the run's result is what the journal
says, each body ran as often as its attempts say (the side table of ``tests.runs.flows``
counts real executions), and nothing starts after a cancel.

The first fan-out of a run is planned by ``run_start`` in this process, so patching
``runs.dispatch.fan_in_body`` here changes the body of its chord (the header stays the
engine's).
"""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import group

from runs import dispatch, services
from runs.models import Run, StepRun
from runs.tasks import advance
from tests.processes import wait_for

from .flows import effects, ensure_effects_table
from .flows_fanin import CHORD_BODY, CHORD_BODY_STEP

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.runs.flows_fanin"]
TERMINAL = ("completed", "failed", "cancelled", "timed_out")
IN_FLIGHT = ("scheduled", "running", "waiting")
LEASE_SECONDS = 3
KNOBS = {
    "DJFLOW_LEASE_SECONDS": str(LEASE_SECONDS),
    "DJFLOW_RECONCILE_SECONDS": "2",
    "DJFLOW_LOST_MESSAGE_SECONDS": "2",
}


@pytest.fixture(autouse=True)
def _effects_table(transactional_db):
    ensure_effects_table()


def start(workflow: str, input: Any = None) -> Run:
    return services.run_start(workflow=workflow, input=input).run


def finished(run_id: Any, timeout: float, logs: Callable[[], str]) -> Run:
    def ended() -> Run | None:
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=timeout, interval=0.1, message=logs)


def chord_bodies(run_id: Any) -> list[float]:
    """When each marked chord body of the run started its advance, in a worker."""
    return [started for _, _, _, started, _ in effects(run_id, CHORD_BODY_STEP)]


# --- 1. the chord, forced to misbehave ----------------------------------------------------


# The engine's own body, kept before any test patches it.
ENGINE_BODY = dispatch.fan_in_body


class Bodies:
    """A stand-in for ``dispatch.fan_in_body``: the engine sends its fan-out as its own chord
    (the header as it builds it), with the body this returns for the run id (the test's
    choice). Counts the chords it was asked for."""

    def __init__(self, body: Callable[[str], Any]) -> None:
        self.body = body
        self.asked = 0

    def __call__(self, run_id: Any, priority: int | None) -> Any:
        self.asked += 1
        return self.body(str(run_id))


def nowhere(run_id: str) -> Any:
    """A body that never fires: sent, when the chord completes, to a queue no worker reads."""
    return marked_advance(run_id).set(queue=f"nobody-{uuid.uuid4().hex}")


def marked_advance(run_id: str) -> Any:
    """The engine's own chord body (``runs.advance`` with ``fan_in``) under a task id the
    worker recognises as a chord body (flows_fanin)."""
    return ENGINE_BODY(run_id, None).set(task_id=f"{CHORD_BODY}{uuid.uuid4()}")


def check_fanout(run: Run, items: list[str], attempts: dict[int, int] | None = None) -> None:
    """The run completed with every item's output in item order; each item has exactly one
    succeeded attempt (its last), each attempt's body ran exactly once, the foreach row was
    opened and closed once, and the step after it ran once."""
    attempts = attempts or {}
    assert run.status == "completed", run.error
    expected = [f"{item}@{attempts.get(i, 1)}" for i, item in enumerate(items)]
    assert run.output == expected
    [fan] = StepRun.objects.filter(run=run, step_id="fan")
    assert (fan.status, fan.attempt, fan.output) == ("succeeded", 1, expected)
    for index in range(len(items)):
        rows = list(StepRun.objects.filter(run=run, path=f"fan[{index}]/").order_by("attempt"))
        tries = attempts.get(index, 1)
        assert [r.attempt for r in rows] == list(range(1, tries + 1))
        assert [r.status for r in rows] == ["failed"] * (tries - 1) + ["succeeded"]
    ran = Counter((step, attempt) for step, attempt, *_ in effects(run.id))
    ran.pop((CHORD_BODY_STEP, 0), None)
    assert ran == {
        **{
            (f"item:{i}", a): 1 for i in range(len(items)) for a in range(1, attempts.get(i, 1) + 1)
        },
        ("after", 1): 1,
    }
    [after] = StepRun.objects.filter(run=run, step_id="after")
    assert (after.status, after.attempt) == ("succeeded", 1)


ITEMS = [f"x{n}" for n in range(12)]


def test_a_chord_body_that_never_fires_changes_nothing(
    monkeypatch, celery_worker, celery_processes
) -> None:
    # No beat: nothing but the items' own completions can advance the run.
    celery_worker(workflow_modules=FLOWS, concurrency=4)
    bodies = Bodies(nowhere)
    monkeypatch.setattr(dispatch, "fan_in_body", bodies)
    run = start("chorded", {"items": ITEMS})
    assert bodies.asked == 1
    run = finished(run.id, timeout=30, logs=celery_processes.logs)
    check_fanout(run, ITEMS)
    assert chord_bodies(run.id) == []


def test_a_chord_body_that_fires_twice_amid_stray_advances_changes_nothing(
    monkeypatch, celery_worker, celery_processes
) -> None:
    celery_worker(workflow_modules=FLOWS, concurrency=4)
    bodies = Bodies(lambda run_id: group(marked_advance(run_id), marked_advance(run_id)))
    monkeypatch.setattr(dispatch, "fan_in_body", bodies)
    run = start("chorded", {"items": ITEMS})
    assert bodies.asked == 1
    # And advances nobody asked for, all through the fan-out, racing the completions.
    strays = 0
    while Run.objects.get(id=run.id).status not in TERMINAL and strays < 2000:
        advance.delay(str(run.id))
        strays += 1
        time.sleep(0.01)
    run = finished(run.id, timeout=30, logs=celery_processes.logs)
    check_fanout(run, ITEMS)
    # Both bodies fired (the second may land after the run completed: it finds nothing).
    bodies = wait_for(lambda: len(chord_bodies(run.id)) == 2 and chord_bodies(run.id), timeout=10)
    print(f"\nchord body fired {len(bodies)} times, {strays} stray advances sent")


def test_a_chord_body_firing_while_a_retry_is_pending_does_not_end_the_fan_out(
    monkeypatch, settings, celery_worker, celery_beat, celery_processes
) -> None:
    # One attempt to a header message (the chord is sent from here): the chord completes
    # once every first attempt has ended, the failed one's included, not when a message
    # that handed its items on returns.
    settings.DJFLOW = {**settings.DJFLOW, "FAN_OUT_PER_MESSAGE": 1}
    celery_worker(workflow_modules=FLOWS, concurrency=4)
    celery_beat()  # the retry's back-off is a timer
    monkeypatch.setattr(dispatch, "fan_in_body", Bodies(marked_advance))
    items = ["a", "b", "flaky", "c", "d"]
    run = start("chorded", {"items": items})
    run = finished(run.id, timeout=30, logs=celery_processes.logs)
    check_fanout(run, items, attempts={2: 2})
    [fired] = chord_bodies(run.id)
    first, second = StepRun.objects.filter(run=run, path="fan[2]/").order_by("attempt")
    assert first.error["class"] == "retryable"
    # The chord completed with the header's tasks, the failed attempt's among them: its body
    # fired after the first attempt failed and before the second was even started.
    assert first.finished_at.timestamp() <= fired < second.started_at.timestamp()
    # The fan-out (and the run) ended only once the second attempt had succeeded.
    [fan] = StepRun.objects.filter(run=run, step_id="fan")
    assert fan.finished_at >= second.finished_at and run.finished_at >= second.finished_at
    print(
        f"\nchord body fired {second.started_at.timestamp() - fired:.2f} s before the retry"
        f" started; run ended {run.finished_at.timestamp() - fired:.2f} s after the body"
    )


# --- 2. a worker killed in a 200-item fan-out ---------------------------------------------


def test_a_worker_killed_in_a_200_item_fan_out_loses_and_doubles_no_output(
    celery_worker, celery_beat, celery_processes
) -> None:
    doomed = celery_worker(workflow_modules=FLOWS, env=KNOBS, concurrency=4)
    celery_beat(env=KNOBS)
    count = 200
    run = start("wide", {"items": list(range(count)), "pause": 0.1})
    wait_for(lambda: len(effects(run.id)) >= 40, timeout=30, message=celery_processes.logs)
    doomed_pids = set(doomed.kill(signal.SIGKILL))
    killed_at = time.time()
    running = StepRun.objects.filter(run=run, status="running", kind="task").count()
    celery_worker(workflow_modules=FLOWS, env=KNOBS, concurrency=8)

    run = finished(run.id, timeout=60, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert [o["item"] for o in run.output] == list(range(count))
    [fan] = StepRun.objects.filter(run=run, step_id="fan")
    assert (fan.status, fan.output) == ("succeeded", run.output)

    executions: dict[int, list[tuple[int, int, float, float | None]]] = {}
    for step, attempt, pid, began, ended in effects(run.id):
        if step.startswith("piece:"):
            executions.setdefault(int(step.split(":")[1]), []).append((attempt, pid, began, ended))
    assert sorted(executions) == list(range(count))  # none missing
    lost = 0
    for index in range(count):
        rows = list(StepRun.objects.filter(run=run, path=f"fan[{index}]/").order_by("attempt"))
        succeeded = [r for r in rows if r.status == "succeeded"]
        assert len(succeeded) == 1, (index, [(r.attempt, r.status) for r in rows])
        assert rows[-1].id == succeeded[0].id
        assert run.output[index] == {"item": index, "attempt": succeeded[0].attempt}
        # Any attempt before it was lost with the worker (at_least_once: offered again).
        assert all(r.status == "failed" and r.error["class"] == "lost" for r in rows[:-1])
        lost += len(rows) - 1
        # The attempt that succeeded ran its body once. A lost attempt ran its body at most
        # once, in the killed worker, before the kill: the kill can land after the claim
        # committed and before the body's first line (CI saw it on RabbitMQ), or after the
        # body and before its result was recorded.
        ran = sorted(executions[index])
        attempts = [a for a, *_ in ran]
        assert len(attempts) == len(set(attempts)), (index, ran)
        assert set(attempts) <= {r.attempt for r in rows}, (index, ran)
        assert attempts[-1] == rows[-1].attempt, (index, ran)
        assert all(pid in doomed_pids and began < killed_at for _, pid, began, _ in ran[:-1])
        assert ran[-1][3] is not None
    assert lost >= 1, "the kill hit no running body"
    unfinished = sum(1 for ran in executions.values() for *_, ended in ran if ended is None)
    assert len(effects(run.id, "after")) == 1
    total = sum(len(v) for v in executions.values())
    took = run.finished_at.timestamp() - killed_at
    print(
        f"\n200 items: {running} running at the kill, {lost} lost and run again,"
        f" {total} executions ({unfinished} cut short); run ended {took:.1f} s after the kill"
    )


def test_a_slow_item_does_not_hold_back_the_items_sent_with_it(
    celery_worker, celery_processes
) -> None:
    """Items go ten to a message (DJFLOW_FAN_OUT_PER_MESSAGE); the first item runs 3 s, and
    the nine sent with it are handed to the other pool process while it runs: every other
    item ends before it does, each ran once, and the output is in item order."""
    celery_worker(workflow_modules=FLOWS, concurrency=2)
    count, slow = 20, 3.0
    run = start("lopsided", {"items": list(range(count)), "slow": slow})
    run = finished(run.id, timeout=60, logs=celery_processes.logs)
    assert run.status == "completed", run.error
    assert run.output == list(range(count))
    ended = {}
    for step, attempt, _, _, finished_at in effects(run.id):
        index = int(step.split(":")[1])
        assert index not in ended and attempt == 1, step
        ended[index] = finished_at
    assert sorted(ended) == list(range(count))
    late = [index for index in range(1, count) if ended[index] >= ended[0]]
    assert late == [], f"items {late} waited for the slow one"


# --- 3. cancelling three generations ------------------------------------------------------


def _tree(root: Run) -> list[Run]:
    """The run (read afresh), its children, their children."""
    frontier = [Run.objects.get(id=root.id)]
    runs = list(frontier)
    while frontier:
        frontier = list(Run.objects.filter(parent_run__in=frontier))
        runs += frontier
    return runs


def test_cancelling_a_parent_cancels_children_and_grandchildren_and_starts_nothing_after(
    celery_worker, celery_beat, celery_processes
) -> None:
    seconds = 2.5
    celery_worker(workflow_modules=FLOWS, env=KNOBS, concurrency=4)
    celery_beat(env=KNOBS)
    top = start("family", {"kids": [0, 1, 2], "seconds": seconds})
    # Three children (each a parallel of its own body and a grandchild), three grandchildren:
    # six bodies of 2.5 s for four pool processes, so four run and two wait in the queue.
    tree = wait_for(lambda: len(_tree(top)) == 7 and _tree(top), timeout=20)
    ids = [r.id for r in tree]
    wait_for(
        lambda: StepRun.objects.filter(run_id__in=ids, status="running", kind="task").count() == 4,
        timeout=20,
        message=celery_processes.logs,
    )
    in_flight = set(
        StepRun.objects.filter(run_id__in=ids, status__in=IN_FLIGHT).values_list("id", flat=True)
    )
    services.run_cancel(run_id=top.id)
    cancelled_at = time.time()

    # The running bodies end (their results refused), the queued attempts' messages arrive,
    # the reconciler passes twice: none of it may start anything.
    time.sleep(seconds + 3)
    tree = _tree(top)
    assert len(tree) == 7
    assert {r.status for r in tree} == {"cancelled"}, [(r.workflow_id, r.status) for r in tree]
    rows = StepRun.objects.filter(run_id__in=ids)
    assert not rows.filter(status__in=IN_FLIGHT).exists()
    assert set(rows.filter(id__in=in_flight).values_list("status", flat=True)) == {"cancelled"}
    # Every kind of row was in flight: worker attempts, subworkflow rows, foreach, parallel.
    kinds = Counter(rows.filter(id__in=in_flight).values_list("kind", flat=True))
    # Six bodies, four running; the two waiting ones may be planned, or (bounded work: a start
    # plans a few actions inline, an advance task queued behind the four busy pool processes
    # plans the rest) one may not be yet. Either way nothing starts after the cancel.
    assert kinds["task"] in (5, 6), kinds
    assert {**kinds, "task": 6} == {"task": 6, "subworkflow": 6, "foreach": 1, "parallel": 3}
    assert not rows.filter(kind="task", output__isnull=False).exists()
    started = [(step, began, ended) for run in tree for step, _, _, began, ended in effects(run.id)]
    late = [(step, began - cancelled_at) for step, began, _ in started if began > cancelled_at]
    assert late == [], late
    # Only the four bodies running at the cancel ever started; no step after them did.
    assert len(started) == 4 and {s for s, _, _ in started} <= {"leaf_work", "mid_work"}
    # The four bodies running at the cancel did finish: their results were refused.
    assert all(ended is not None and ended > cancelled_at for _, _, ended in started)
    print(f"\ncancel: {len(in_flight)} rows in flight, {len(started)} bodies were running")
