"""Celery task events for every step a worker runs, so Flower shows each one by name.

``workers.execute_step`` (the carrier) runs one attempt and then, while it pays, the run's
next ones in the same task (``execution.execute``). Celery reports only the carrier; this
module reports each attempt the carrier runs as a task of its own, named
``<workflow>.<step>``: ``task-received`` and ``task-started`` before the body, then
``task-succeeded``; ``task-failed``, or ``task-retried`` when a next attempt is already due or
waits for its back-off; ``task-revoked`` when the attempt was not (or no longer) this
worker's (claimed by another delivery, given up meanwhile); ``task-retried`` for any other
outcome (handed back: this worker lacks the handler), so a hand-back never shows as SUCCESS.

The first attempt gets its task too, and the carrier keeps its own name
(``workers.execute_step``, no ``shadow``): every step then appears exactly once under its
name, with its own state and runtime. Named after its first step, the carrier would show
that step twice, or once with the carrier's state (SUCCESS when the step failed: a failed
step is a journal entry, not a failed task) and the runtime of every step it ran.

A step's task id is ``uuid5(STEP_TASK_NAMESPACE, "<step run id>/<attempt>")`` (see
``step_task_id``), its argument the step run id, its parent the carrier: an operator goes
from a Flower row to the journal and back. Arguments are ids only: a step's input may hold
secrets.

Events are sent only when the worker sends task events for the carrier. In prefork, Celery's
own task events are sent by the worker's main process, whose dispatcher alone knows ``-E``,
``worker_send_task_events`` and the ``enable_events``/``disable_events`` control commands
received since (Flower sends ``enable_events`` every 5 s); a pool child sees none of them.
So the main process writes its decision into the carrier's request when it receives the
message (``mark_carrier``, on ``task_received``, the moment Celery decides on the carrier's
own ``task-received``), and the pool child reads it from the task's request.

Each pool process publishes through one producer on a connection of its own, made on first
use: no connection per event, no retry, no buffer. A step costs two messages: received and
started together before the body, its end after. A failure to publish never fails a step:
it is logged at debug and events pause for ``PAUSE_SECONDS`` (a broker that is down costs
one failed connect, not one per event).

Cost with events on, Redis and Postgres on loopback, this project's 2-core machine (median
of 5 x 3,000 steps in one process): 0.37 ms per step for its two messages (0.73 ms with
Celery's ``EventDispatcher`` from the producer pool, one message per event: 0.18 ms each,
0.07 ms more per pool acquire), plus 0.11 ms per carrier for the read naming its first
attempt. With events off (no ``-E``, no enable_events): 0.2 us per attempt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from celery import current_task
from celery.events import Event
from celery.events.event import get_exchange
from celery.utils.nodenames import anon_nodename
from celery.utils.time import utcoffset
from kombu import Producer

from runs.models import StepRun, Timer
from runs.status import StepStatus
from workflows.secrets import shown_text

logger = logging.getLogger(__name__)

CARRIER = "workers.execute_step"
# The request header the main process sets on a carrier (read as an attribute of the task's
# request in the pool child).
HEADER = "djflow_task_events"
STEP_TASK_NAMESPACE = uuid.UUID("6f1f4c1e-6c55-4d7e-9a1b-3f0e6d1b2a77")
PAUSE_SECONDS = 30.0
_FAILED = frozenset({StepStatus.FAILED, StepStatus.TIMED_OUT})
_NOT_OURS = frozenset({"not-scheduled", "dropped"})

Outcome = TypeVar("Outcome", bound=tuple[str, Any])
_paused_until = 0.0
_publisher: _Publisher | None = None


def step_task_id(step_run_id: int, attempt: int) -> str:
    """The Flower task id of one attempt: the same in every worker and every process."""
    return str(uuid.uuid5(STEP_TASK_NAMESPACE, f"{step_run_id}/{attempt}"))


# --- The worker's main process -------------------------------------------------------------


def mark_carrier(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_received`` receiver (main process): tell the carrier's pool child whether this
    worker sends task events now, with the test Celery applies to its own events."""
    if request is None or request.task.name != CARRIER:
        return
    dispatcher = getattr(sender, "event_dispatcher", None)
    request.request_dict[HEADER] = bool(
        dispatcher is not None
        and dispatcher.enabled
        # An empty set means every group (-E); otherwise enable_events adds "task".
        and (not dispatcher.groups or "task" in dispatcher.groups)
        and request.task.send_events
    )


# --- The pool child ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    id: int
    run_id: Any
    workflow_id: str
    step_id: str
    path: str
    attempt: int

    @property
    def task_id(self) -> str:
        return step_task_id(self.id, self.attempt)


class StepEvents:
    """The events of the attempts one carrier runs; does nothing when the worker sends no
    task events for it (or outside a Celery task)."""

    def __init__(self, task: Any = None) -> None:
        request = getattr(task, "request", None)
        self.on = bool(getattr(request, HEADER, False))
        self.app = getattr(task, "app", None)
        self.hostname = getattr(request, "hostname", None)
        self.carrier_id = getattr(request, "id", None)
        self.root_id = getattr(request, "root_id", None) or self.carrier_id

    @classmethod
    def for_current_task(cls) -> StepEvents:
        return cls(current_task)

    def around(
        self, step_run_id: int, held: tuple[StepRun, str] | None, attempt: Callable[[], Outcome]
    ) -> Outcome:
        """Run ``attempt`` (one ``_execute_one``), reporting it as a task of its own.

        ``held`` is the attempt as the previous step's transaction wrote it (the step's name
        without a query); for the carrier's first attempt it is None and one indexed read
        names it (only while events are on).
        """
        step = None
        if self.on and time.monotonic() >= _paused_until:
            step = self._identify(step_run_id, held)
        if step is None:
            return attempt()
        self._send(step, lambda: [("task-received", self._received(step)), ("task-started", {})])
        started = time.monotonic()
        try:
            result = attempt()
        except BaseException as exc:
            runtime = time.monotonic() - started
            failed = {"exception": repr(exc)[:200], "runtime": runtime}
            self._send(step, lambda: [("task-failed", failed)])
            raise
        runtime = time.monotonic() - started
        self._send(step, lambda: [self._ended(step, result[0], result[1], runtime)])
        return result

    def _identify(self, step_run_id: int, held: tuple[StepRun, str] | None) -> _Step | None:
        if held is not None:
            row, workflow_id = held
            return _Step(row.id, row.run_id, workflow_id, row.step_id, row.path, row.attempt)
        try:
            found = (
                StepRun.objects.filter(id=step_run_id, status=StepStatus.SCHEDULED)
                .values_list("run_id", "run__workflow_id", "step_id", "path", "attempt")
                .first()
            )
        except Exception:
            logger.debug(
                "no task events for attempt %s: reading it failed", step_run_id, exc_info=True
            )
            return None
        # Not scheduled: a duplicate delivery; the claim will say so and nothing runs.
        return None if found is None else _Step(step_run_id, *found)

    def _publish(self, step: _Step, built: list[tuple[str, dict[str, Any]]]) -> None:
        global _publisher
        if _publisher is None or _publisher.pid != os.getpid():
            _publisher = _Publisher(self.app, self.hostname)
        _publisher.publish(step.task_id, built)

    def _received(self, step: _Step) -> dict[str, Any]:
        kwargs = {"run_id": str(step.run_id), "attempt": step.attempt}
        if step.path:
            kwargs["path"] = step.path
        return {
            "name": f"{step.workflow_id}.{step.step_id}",
            "args": repr((step.id,)),
            "kwargs": repr(kwargs),
            "parent_id": self.carrier_id,
            "root_id": self.root_id,
            "retries": step.attempt - 1,
            "eta": None,
            "expires": None,
        }

    def _ended(
        self, step: _Step, outcome: str, held: Any, runtime: float
    ) -> tuple[str, dict[str, Any]]:
        if outcome == StepStatus.SUCCEEDED:
            result = repr({"step_run_id": step.id, "status": outcome})
            return "task-succeeded", {"result": result, "runtime": runtime}
        if outcome in _FAILED:
            error, retried = _failure(step, held)
            kind = "task-retried" if retried else "task-failed"
            return kind, {"exception": error, "runtime": runtime}
        if outcome in _NOT_OURS:
            return "task-revoked", {"terminated": False, "expired": False, "runtime": runtime}
        # Handed back: offered again (task-rejected would rank below task-started in
        # Celery's event state, and Flower would show STARTED for ever).
        handed_back = "handed back: this worker lacks the handler"
        return "task-retried", {"exception": handed_back, "runtime": runtime}

    def _send(self, step: _Step, events: Callable[[], list[tuple[str, dict[str, Any]]]]) -> None:
        """Publish the ``events()`` of ``step`` in one message; a failure (to build them or
        to publish them) is logged and pauses events, never raised."""
        global _publisher, _paused_until
        try:
            built = events()
            try:
                self._publish(step, built)
            except Exception:
                if _publisher is None:
                    raise
                # A connection kept since an earlier step may have been closed by the broker
                # meanwhile: RabbitMQ closes one that misses its heartbeats, and nothing sends
                # them for a publisher in a pool process. One new connection, then pause.
                _publisher.close()
                _publisher = None
                self._publish(step, built)
        except Exception:
            _paused_until = time.monotonic() + PAUSE_SECONDS
            if _publisher is not None:
                _publisher.close()
            _publisher = None
            logger.debug(
                "task events for attempt %s not sent; pausing them %gs",
                step.id,
                PAUSE_SECONDS,
                exc_info=True,
            )


class _Publisher:
    """One producer per pool process, on a connection of its own, publishing like Celery's
    ``EventDispatcher`` (same exchange, serializer, headers, transient delivery), except that
    a step's events that go together go as one ``task.multi`` message, as Celery's own
    buffered task events do (a receiver takes a list as events in order)."""

    def __init__(self, app: Any, hostname: str | None) -> None:
        self.pid = os.getpid()
        self.hostname = hostname or anon_nodename()
        self.clock = app.clock
        self.connection = app.connection_for_write()
        self.exchange = get_exchange(self.connection, name=app.conf.event_exchange)
        self.producer = Producer(
            self.connection,
            exchange=self.exchange,
            serializer=app.conf.event_serializer,
            auto_declare=False,
        )

    def publish(self, task_id: str, events: list[tuple[str, dict[str, Any]]]) -> None:
        batch = [
            Event(
                kind,
                uuid=task_id,
                hostname=self.hostname,
                utcoffset=utcoffset(),
                pid=self.pid,
                clock=self.clock.forward(),
                **fields,
            )
            for kind, fields in events
        ]
        single = len(batch) == 1
        self.producer.publish(
            batch[0] if single else batch,
            routing_key=events[0][0].replace("-", ".") if single else "task.multi",
            exchange=self.exchange.name,
            declare=[self.exchange],
            headers={"hostname": self.hostname},
            delivery_mode=1,
            retry=False,
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.connection.release()


def _failure(step: _Step, held: Any) -> tuple[str, bool]:
    """The failed attempt's error as Flower shows it, and whether the step is tried again
    (a next attempt already held or written, or a back-off timer set for this one).

    Inside a composite step the run is advanced later, by another task: such a failure
    shows FAILURE even when a retry follows (the retry shows as a task of its own).
    """
    if held is not None:
        row = held[0]
        if (row.run_id, row.path, row.step_id) == (step.run_id, step.path, step.step_id):
            return _error_text(step), True
    retried = (
        Timer.objects.filter(run_id=step.run_id, key=f"retry:{step.id}").exists()
        or StepRun.objects.filter(
            run_id=step.run_id, path=step.path, step_id=step.step_id, attempt=step.attempt + 1
        ).exists()
    )
    return _error_text(step), retried


def _error_text(step: _Step) -> str:
    error = StepRun.objects.filter(id=step.id).values_list("error", flat=True).first() or {}
    return shown_text(f"{error.get('class', 'fatal')}: {error.get('message', '')}")[:200]
