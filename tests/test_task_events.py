"""``workers.task_events``'s publisher in a pool process: a connection the broker closed while
it sat idle is replaced once (RabbitMQ closes connections that miss their heartbeats, and no
one sends them for it), and only a broker that stays unreachable pauses the events."""

from __future__ import annotations

import os
from typing import Any

import pytest

from workers import task_events


class FakePublisher:
    """Stands in for ``_Publisher``: records what it publishes, or fails as a closed
    connection does."""

    made: list[FakePublisher] = []
    broken_from_start = False

    def __init__(self, app: Any, hostname: str | None) -> None:
        self.pid = os.getpid()
        self.sent: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
        self.broken = FakePublisher.broken_from_start
        self.closed = False
        FakePublisher.made.append(self)

    def publish(self, task_id: str, events: list[tuple[str, dict[str, Any]]]) -> None:
        if self.broken:
            raise ConnectionResetError("connection closed by the broker")
        self.sent.append((task_id, events))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def publisher(monkeypatch: pytest.MonkeyPatch) -> type[FakePublisher]:
    FakePublisher.made = []
    FakePublisher.broken_from_start = False
    monkeypatch.setattr(task_events, "_Publisher", FakePublisher)
    monkeypatch.setattr(task_events, "_publisher", None)
    monkeypatch.setattr(task_events, "_paused_until", 0.0)
    return FakePublisher


STEP = task_events._Step(7, "run-id", "flow", "fetch", "", 1)


def test_a_connection_closed_while_idle_is_replaced_and_the_event_sent(publisher) -> None:
    events = task_events.StepEvents()
    events._send(STEP, lambda: [("task-started", {})])
    first = publisher.made[0]
    first.broken = True  # the broker closed it while the worker was idle
    events._send(STEP, lambda: [("task-succeeded", {"runtime": 1.0})])
    assert first.closed
    assert len(publisher.made) == 2
    assert publisher.made[1].sent == [(STEP.task_id, [("task-succeeded", {"runtime": 1.0})])]
    assert task_events._paused_until == 0.0  # nothing lost, nothing paused


def test_a_broker_that_stays_unreachable_pauses_events(publisher) -> None:
    events = task_events.StepEvents()
    events._send(STEP, lambda: [("task-started", {})])
    publisher.made[0].broken = True
    publisher.broken_from_start = True
    events._send(STEP, lambda: [("task-succeeded", {})])
    # One new connection was tried (and failed), no more: then events pause.
    assert len(publisher.made) == 2
    assert task_events._publisher is None
    assert task_events._paused_until > 0.0
