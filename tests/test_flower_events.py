"""Flower's view of runs (``workers.task_events``): every step a worker runs, the ones it runs
inline included, is a task of its own in Celery's event stream, read here the way Flower
reads it (an event receiver feeding Flower's ``EventsState``), from a real worker.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states
from flower.events import EventsState

from config.celery import app
from runs import services
from runs.models import Run, StepRun
from tests.flows_flower import SECRET, STEP_SECONDS
from tests.processes import CeleryProcess, CeleryProcesses, wait_for, worker_process
from workers.task_events import CARRIER, step_task_id

pytestmark = [pytest.mark.slow]

FLOWS = ["tests.flows_flower"]
TERMINAL = ("completed", "failed", "cancelled", "timed_out")
READY = frozenset({states.SUCCESS, states.FAILURE, states.RETRY, states.REVOKED, "REJECTED"})


class FlowerView:
    """Celery's event stream as Flower consumes it: a receiver on the event exchange feeding
    Flower's own state, in a thread; ``events`` keeps every event as it arrived."""

    def __init__(self) -> None:
        self.state = EventsState()
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._capture, daemon=True)

    def _capture(self) -> None:
        ready = self.ready

        class Receiver(app.events.Receiver):  # type: ignore[name-defined,misc]
            def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
                super().on_consume_ready(*args, **kwargs)
                ready.set()

        with app.connection_for_read() as connection:
            self.receiver = Receiver(connection, handlers={"*": self._on_event}, app=app)
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.events.append(dict(event))
            self.state.event(event)

    def start(self) -> FlowerView:
        self.thread.start()
        assert self.ready.wait(10), "the event receiver did not start consuming"
        return self

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(5)

    def tasks(self, run: Run) -> list[Any]:
        """The run's steps as Flower lists them, in the order they were received."""
        with self.lock:
            found = [t for t in self.state.tasks.values() if str(run.id) in (t.kwargs or "")]
        return sorted(found, key=lambda t: t.received or 0)

    def task(self, task_id: str) -> Any:
        with self.lock:
            return self.state.tasks.get(task_id)

    def task_events(self) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e["type"].startswith("task-")]

    def wait_for_states(self, run: Run, expected: list[tuple[str, str]]) -> list[Any]:
        """Wait until the run's tasks are ``expected`` ((name, state) in order), all done."""

        def seen() -> list[Any] | None:
            tasks = self.tasks(run)
            got = [(t.name, t.state) for t in tasks]
            return tasks if got == expected else None

        return wait_for(
            seen,
            timeout=15,
            message=lambda: f"{expected}, got {[(t.name, t.state) for t in self.tasks(run)]}",
        )


@pytest.fixture
def flower() -> Iterator[FlowerView]:
    view = FlowerView().start()
    try:
        yield view
    finally:
        view.stop()


def start(workflow: str) -> Run:
    return services.run_start(workflow=workflow, input={"api_key": SECRET}).run


def finished(run: Run, processes: CeleryProcesses) -> Run:
    def ended() -> Run | None:
        current = Run.objects.get(id=run.id)
        return current if current.status in TERMINAL else None

    return wait_for(ended, timeout=30, interval=0.05, message=processes.logs)


def attempts(run: Run) -> list[StepRun]:
    return list(StepRun.objects.filter(run=run).order_by("id"))


def test_three_inline_steps_show_as_three_tasks_with_their_own_state_and_runtime(
    celery_worker, celery_processes, flower: FlowerView
) -> None:
    worker = celery_worker(workflow_modules=FLOWS, extra_args=["-E"])
    run = finished(start("flower_three"), celery_processes)
    assert run.status == "completed", run.error
    steps = attempts(run)
    names = ["flower_three.fetch", "flower_three.think", "flower_three.reply"]
    tasks = flower.wait_for_states(run, [(name, states.SUCCESS) for name in names])

    # One message ran all three: the first step's carrier, and no other.
    carrier = wait_for(lambda: flower.task(steps[0].celery_task_id), timeout=5)
    assert carrier.name == CARRIER and carrier.args == repr((steps[0].id,))
    wait_for(lambda: carrier.state == states.SUCCESS, timeout=5)
    assert {flower.task(step.celery_task_id) for step in steps[1:]} == {None}
    assert len({step.worker for step in steps}) == 1

    for step, task in zip(steps, tasks, strict=True):
        assert task.uuid == step_task_id(step.id, step.attempt)
        assert task.args == repr((step.id,))
        assert f"'attempt': {step.attempt}" in task.kwargs
        assert str(step.id) in task.result
        assert task.worker.hostname == worker.hostname
        assert task.parent_id == carrier.uuid
        assert task.received and task.started and task.succeeded
        # Its own runtime: its body's sleep, not the carrier's three.
        assert STEP_SECONDS <= task.runtime < carrier.runtime, (task.runtime, carrier.runtime)
    assert sum(t.runtime for t in tasks) <= carrier.runtime
    # Inputs may hold secrets: no event carries one.
    assert SECRET not in json.dumps(flower.task_events(), default=str)


def test_a_failing_step_shows_failure_and_one_retried_shows_retry(
    celery_worker, celery_processes, flower: FlowerView
) -> None:
    celery_worker(workflow_modules=FLOWS, extra_args=["-E"])
    failed = finished(start("flower_fails"), celery_processes)
    assert failed.status == "failed"
    _, explode = flower.wait_for_states(
        failed,
        [("flower_fails.prepare", states.SUCCESS), ("flower_fails.explode", states.FAILURE)],
    )
    assert explode.exception == "fatal: ValueError: the model answered nonsense"
    assert explode.runtime > 0

    retried = finished(start("flower_retries"), celery_processes)
    assert retried.status == "completed", retried.error
    first, second = flower.wait_for_states(
        retried,
        [("flower_retries.wobbly", states.RETRY), ("flower_retries.wobbly", states.SUCCESS)],
    )
    assert first.exception == "retryable: busy, try again"
    assert (first.retries, second.retries) == (0, 1)
    assert first.uuid != second.uuid


def _assert_no_task_events(flower: FlowerView, runs: list[Run]) -> None:
    """No task event at all, and the stream works: an event sent now arrives."""
    time.sleep(1.0)  # events of the finished runs would be in flight by now
    assert flower.task_events() == []
    probe = str(uuid.uuid4())
    with app.events.default_dispatcher(hostname="probe@test") as dispatcher:
        dispatcher.send("task-received", uuid=probe, name="probe")
    wait_for(lambda: flower.task(probe), timeout=5, message="the probe event")
    assert all(not flower.tasks(run) for run in runs)


def test_without_task_events_none_are_sent(
    celery_worker, celery_processes, flower: FlowerView
) -> None:
    celery_worker(workflow_modules=FLOWS)
    runs = [finished(start(name), celery_processes) for name in ("flower_three", "flower_fails")]
    assert [run.status for run in runs] == ["completed", "failed"]
    _assert_no_task_events(flower, runs)


def test_task_events_follow_enable_and_disable_events_at_run_time(
    celery_processes: CeleryProcesses, flower: FlowerView
) -> None:
    """Flower's way: a worker started without -E, told ``enable_events`` at run time (Flower
    sends it every 5 s), then ``disable_events``. The pool children hear neither command;
    the main process's decision reaches them with each message."""
    process = worker_process(
        env=celery_processes.env(workflow_modules=FLOWS), workdir=celery_processes.workdir
    )
    # Worker heartbeats on: a worker sending no events at all has nothing to enable.
    process.argv.remove("--without-heartbeat")
    worker: CeleryProcess = process.start()
    celery_processes.processes.append(worker)
    worker.wait_ready()

    quiet = finished(start("flower_three"), celery_processes)
    _assert_no_task_events(flower, [quiet])

    [reply] = app.control.enable_events(destination=[worker.hostname], reply=True, timeout=5)
    assert reply[worker.hostname]["ok"] == "task events enabled", reply
    shown = finished(start("flower_three"), celery_processes)
    flower.wait_for_states(
        shown,
        [(f"flower_three.{step}", states.SUCCESS) for step in ("fetch", "think", "reply")],
    )

    app.control.disable_events(destination=[worker.hostname], reply=True, timeout=5)
    count = len(flower.task_events())
    hidden = finished(start("flower_three"), celery_processes)
    time.sleep(1.0)
    assert flower.tasks(hidden) == []
    assert len(flower.task_events()) == count


def test_the_clock_tick_stays_out_of_flowers_list(
    celery_worker, celery_processes, flower: FlowerView
) -> None:
    """Flower keeps the newest 10,000 tasks; a tick every second would push every step out
    of its list within three hours. The tick sends no events; the reconciler, every 30 s,
    does. Both go to the timers queue, in order: once the reconciler shows, the tick ran."""
    celery_worker(workflow_modules=FLOWS, extra_args=["-E"])
    app.send_task("runs.fire_timers")
    reconcile = app.send_task("runs.reconcile")
    wait_for(
        lambda: (task := flower.task(reconcile.id)) is not None and task.state == states.SUCCESS,
        timeout=15,
        message=celery_processes.logs,
    )
    assert [e for e in flower.task_events() if e.get("name") == "runs.fire_timers"] == []
