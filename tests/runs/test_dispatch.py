"""Tasks are sent by name (issue 13): ``runs.dispatch`` and ``approvals.outbox`` import no
task module, and the messages they send carry what the tasks declare for their sender (name,
queue, ``ignore_result``, time limits), whether or not the sending process imported the
tasks' modules. A web process imports neither ``runs.tasks`` nor ``workers.tasks``: there
Celery sends with ``send_task``, which knows none of a task's declared options."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from django.conf import settings

from approvals import outbox
from config.celery import app
from runs import dispatch

TASKS = (
    "runs.advance",
    "runs.wake_timers",
    "workers.execute_step",
    "workers.advance_runs",
    "approvals.send_mail",
)


@pytest.fixture(params=["imported", "not imported"])
def sent(request) -> Iterator[list[dict[str, Any]]]:
    """The messages published, in order, with on_commit callbacks run at once."""
    # Importing a task's module registers it with the app.
    import approvals.tasks  # noqa: F401
    import runs.tasks  # noqa: F401
    import workers.tasks  # noqa: F401

    messages: list[dict[str, Any]] = []

    def publish(producer: Any, name: str, message: Any, **options: Any) -> None:
        headers, _, (args, kwargs, embed), _ = message
        queue = options.get("queue")
        messages.append(
            {
                "task": name,
                "args": list(args),
                **({"kwargs": kwargs} if kwargs else {}),
                "id": headers["id"],
                "ignore_result": headers["ignore_result"],
                "timelimit": tuple(headers["timelimit"]),
                "queue": getattr(queue, "name", queue),
                "chord": embed.get("chord"),
                "group": headers.get("group"),
                **{key: headers[key] for key in ("eta", "expires") if headers.get(key)},
            }
        )

    with (
        mock.patch.dict(app.tasks),
        mock.patch.object(app.amqp, "send_task_message", side_effect=publish),
        mock.patch("django.db.transaction.on_commit", side_effect=lambda f, robust=False: f()),
    ):
        if request.param == "not imported":
            for name in TASKS:
                del app.tasks[name]
        yield messages


def attempt(id: int) -> Any:
    return SimpleNamespace(id=id, celery_task_id=f"task-{id}", queue="gpu", timeout_ms=5000)


def test_advance_goes_to_the_engine_queue_without_a_result(sent) -> None:
    dispatch.advance_on_commit("r1")
    dispatch.advance_now("r2")
    dispatch.advance_many(["r3", "r4"])
    assert [(m["task"], m["args"], m["queue"], m["ignore_result"]) for m in sent] == [
        ("runs.advance", [run], "engine", True) for run in ("r1", "r2", "r3", "r4")
    ]


def test_fired_runs_go_to_the_engine_queue_in_batches_without_a_result(sent) -> None:
    dispatch.advance_in_batches(["r1", "r2", "r3", "r4", "r5"], size=2)
    assert [(m["task"], m["args"], m["queue"], m["ignore_result"]) for m in sent] == [
        ("workers.advance_runs", [runs], "engine", True)
        for runs in (["r1", "r2"], ["r3", "r4"], ["r5"])
    ]


def test_an_attempt_goes_to_its_queue_with_its_task_id_and_limits(sent) -> None:
    dispatch.offer(attempt(1), workflow_id="w")
    dispatch.offer_on_commit(attempt(2), workflow_id="w")
    soft = 5 + settings.DJFLOW["INLINE_SECONDS"]
    assert sent == [
        {
            "task": "workers.execute_step",
            "args": [n],
            "id": f"task-{n}",
            "ignore_result": True,
            "timelimit": (soft + 10, soft),
            "queue": "gpu",
            "chord": None,
            "group": None,
        }
        for n in (1, 2)
    ]


def test_a_fan_out_is_one_chord_of_messages_whose_body_advances_the_run(sent, settings) -> None:
    """The design card: a fan-out maps onto a chord. Attempts of one queue, time limit and
    priority go FAN_OUT_PER_MESSAGE to a header message, the first one's task id on it,
    keeping no result (the Redis result backend counts a chord's parts without one); every
    header message carries the one body, ``runs.advance`` of the run as a fan-in nudge."""
    settings.DJFLOW = {**settings.DJFLOW, "FAN_OUT_PER_MESSAGE": 2}
    other = SimpleNamespace(id=9, celery_task_id="task-9", queue="cpu", timeout_ms=5000)
    attempts = [attempt(3), attempt(4), other, attempt(5)]
    dispatch.offer_fan_out_on_commit(attempts, run_id="r5", workflow_id="w")
    soft = 5 + settings.DJFLOW["INLINE_SECONDS"]
    bodies = [message.pop("chord") for message in sent]
    groups = {message.pop("group") for message in sent}
    common = {"ignore_result": True, "timelimit": (soft + 10, soft)}
    assert sent == [
        {"task": "workers.execute_step", "args": [3], "kwargs": {"more": [4]}, "id": "task-3",
         "queue": "gpu", **common},
        {"task": "workers.execute_step", "args": [5], "id": "task-5", "queue": "gpu", **common},
        {"task": "workers.execute_step", "args": [9], "id": "task-9", "queue": "cpu", **common},
    ]  # fmt: skip
    assert len(groups) == 1 and None not in groups
    assert all(body == bodies[0] for body in bodies)
    body = bodies[0]
    assert (body["task"], list(body["args"]), body["kwargs"], body["immutable"]) == (
        "runs.advance",
        ["r5"],
        {"fan_in": True},
        True,
    )
    assert body["options"]["ignore_result"] is True
    assert body["options"]["priority"] == dispatch.broker_priority(None)


def test_a_fan_out_goes_without_a_chord_when_chords_are_off(sent, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "FAN_OUT_PER_MESSAGE": 2, "FAN_OUT_CHORDS": False}
    dispatch.offer_fan_out_on_commit(
        [attempt(3), attempt(4), attempt(5)], run_id="r", workflow_id="w"
    )
    assert [(m["args"], m.get("kwargs"), m["chord"], m["group"]) for m in sent] == [
        ([3], {"more": [4]}, None, None),
        ([5], None, None, None),
    ]


def test_a_fan_out_goes_without_a_chord_on_a_result_backend_that_keeps_none(sent, caplog) -> None:
    """rpc:// (or no result backend at all) cannot count a chord: Celery refuses before a
    header message goes out, and the messages go plain (the journal is the fan-in either
    way), said once in the log."""
    from celery.backends.base import DisabledBackend

    dispatch._warned_no_chords = False
    with mock.patch.object(app._local, "backend", DisabledBackend(app), create=True):
        dispatch.offer_fan_out_on_commit([attempt(3)], run_id="r", workflow_id="w")
        dispatch.offer_fan_out_on_commit([attempt(4)], run_id="r", workflow_id="w")
    assert [(m["args"], m["chord"], m["group"]) for m in sent] == [
        ([3], None, None),
        ([4], None, None),
    ]
    assert sum("cannot gather a chord" in r.getMessage() for r in caplog.records) == 1


def test_a_fan_out_on_a_database_result_backend_keeps_its_results_for_chord_unlock(
    sent, tmp_path, settings
) -> None:
    """The embedded default's SQLAlchemy backend has no chord counter: Celery's
    ``celery.chord_unlock`` polls the header's stored results, so header tasks keep one."""
    from celery.backends.database import DatabaseBackend

    settings.EMBEDDED = True  # its one host keeps the one results file
    backend = DatabaseBackend(app=app, url=f"sqlite:///{tmp_path / 'results.sqlite3'}")
    with mock.patch.object(app._local, "backend", backend, create=True):
        dispatch.offer_fan_out_on_commit([attempt(3), attempt(4)], run_id="r7", workflow_id="w")
    unlock = [m for m in sent if m["task"] == "celery.chord_unlock"]
    header = [m for m in sent if m["task"] == "workers.execute_step"]
    assert len(unlock) == 1
    # Bounded: a header task that never stores a success must not keep it polling for good.
    assert unlock[0]["kwargs"]["max_retries"] == 600
    assert unlock[0]["kwargs"]["interval"] == 1.0
    assert [(m["args"], m["ignore_result"]) for m in header] == [([3], False)]
    assert header[0]["chord"]["task"] == "runs.advance"


def test_a_fan_out_of_one_attempt_a_message_when_configured_so(sent, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "FAN_OUT_PER_MESSAGE": 1}
    dispatch.offer_fan_out_on_commit([attempt(3), attempt(4)], run_id="r5", workflow_id="w")
    assert [(m["args"], m["id"], "kwargs" in m) for m in sent] == [
        ([3], "task-3", False),
        ([4], "task-4", False),
    ]


def test_the_rest_of_a_message_goes_one_a_message_or_together(sent) -> None:
    """What a task hands on (workers.batches): one message each, with the message's queue,
    limits and broker priority; or all in one (a worker without the handler)."""
    dispatch.offer_ids([6, 7], queue="gpu", soft_limit=7.0, priority=3)
    dispatch.offer_ids([8, 9, 10], queue="gpu", soft_limit=7.0, priority=3, together=True)
    dispatch.offer_ids([], queue="gpu", soft_limit=7.0, priority=3)
    assert [(m["args"], m.get("kwargs"), m["queue"], m["timelimit"]) for m in sent] == [
        ([6], None, "gpu", (17.0, 7.0)),
        ([7], None, "gpu", (17.0, 7.0)),
        ([8], {"more": [9, 10]}, "gpu", (17.0, 7.0)),
    ]
    assert len({m["id"] for m in sent}) == 3


def test_a_mail_goes_to_the_mail_queue_without_a_result(sent) -> None:
    outbox.offer_on_commit([7, 8])
    assert [(m["task"], m["args"], m["queue"], m["ignore_result"]) for m in sent] == [
        ("approvals.send_mail", [7], "mail", True),
        ("approvals.send_mail", [8], "mail", True),
    ]


def test_a_fan_out_reaches_a_redis_broker_in_one_pipeline(monkeypatch) -> None:
    """Against the real broker: the attempts' messages are on their queue, and on Redis they
    went as one pipeline, not one LPUSH round trip each; the result backend was told the
    chord's size, and the sender subscribed to no header task's result (Celery's own
    ``group.apply_async`` would, one SUBSCRIBE a header task)."""
    import uuid

    import redis

    if app.connection_for_write().transport.driver_type != "redis":
        pytest.skip("kombu batches publishes on Redis only")
    import workers.tasks  # noqa: F401

    queue = f"fan-{uuid.uuid4().hex}"
    attempts = [
        SimpleNamespace(id=n, celery_task_id=f"fan-task-{n}", queue=queue, timeout_ms=5000)
        for n in range(25)
    ]
    direct: list[Any] = []
    real_execute = redis.Redis.execute_command

    def execute_command(client: Any, *args: Any, **options: Any) -> Any:
        direct.append(args[0])
        return real_execute(client, *args, **options)

    subscribed: list[Any] = []
    real_subscribe = redis.client.PubSub.subscribe
    monkeypatch.setattr(redis.Redis, "execute_command", execute_command)
    monkeypatch.setattr(
        redis.client.PubSub,
        "subscribe",
        lambda pubsub, *a, **k: subscribed.append(a) or real_subscribe(pubsub, *a, **k),
    )
    with mock.patch("django.db.transaction.on_commit", side_effect=lambda f, robust=False: f()):
        dispatch.offer_fan_out_on_commit(attempts, run_id="r6", workflow_id="w")
    monkeypatch.setattr(redis.Redis, "execute_command", real_execute)
    assert "LPUSH" not in direct
    assert subscribed == []
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        client = channel.client
        # One list per priority step (a run's priority): the default's messages are on its.
        lists = [channel._q_for_pri(queue, step) for step in channel.priority_steps]
        try:
            messages = [m for key in lists for m in client.lrange(key, 0, -1)]
            waiting = [json.loads(m)["headers"]["id"] for m in messages]
            on_default = client.llen(channel._q_for_pri(queue, dispatch.broker_priority(None)))
        finally:
            client.delete(*lists)
    # FAN_OUT_PER_MESSAGE (10) to a message: three, each with its first attempt's task id.
    assert sorted(waiting) == ["fan-task-0", "fan-task-10", "fan-task-20"]
    assert on_default == 3
    [group_id] = {json.loads(m)["headers"]["group"] for m in messages}
    backend = app.backend
    size_key = backend.get_key_for_group(group_id, ".s")
    try:
        assert int(backend.client.get(size_key)) == 3
    finally:
        backend.client.delete(size_key)


def test_a_runs_priority_orders_its_messages_on_a_redis_queue() -> None:
    """Against the real broker: attempts of runs of priority 5, 9 and 0 offered in that
    order are taken 9, 5, 0 (kombu's Redis transport keeps a list per priority and takes
    from the highest first; the engine turns the run's scale over for it)."""
    import uuid

    if app.connection_for_write().transport.driver_type != "redis":
        pytest.skip("the Redis transport's priority lists")
    import workers.tasks  # noqa: F401

    queue = f"pri-{uuid.uuid4().hex}"

    def attempt(n: int, priority: int) -> Any:
        # What the applier's rows are: loaded with their run (no query for its priority).
        run = SimpleNamespace(priority=priority)
        state = SimpleNamespace(fields_cache={"run": run})
        return SimpleNamespace(
            id=n, celery_task_id=f"pri-{priority}", queue=queue, timeout_ms=5000, _state=state
        )

    for n, priority in enumerate((5, 9, 0)):
        dispatch.offer(attempt(n, priority), workflow_id="w")
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        taken = []
        try:
            for _ in range(3):
                taken.append(channel._get(queue)["headers"]["id"])
        finally:
            channel.client.delete(*[channel._q_for_pri(queue, p) for p in channel.priority_steps])
    assert taken == ["pri-9", "pri-5", "pri-0"]
    assert [dispatch.broker_priority(p) for p in (None, 0, 9)] == [4, 9, 0]


@pytest.fixture
def no_wakes_asked() -> Iterator[None]:
    dispatch._wakes_asked.clear()
    yield
    dispatch._wakes_asked.clear()


def test_a_wake_up_of_the_clock_goes_to_the_timers_queue_at_its_instant(sent) -> None:
    """Between ticks the clock wakes at the next due timer: an ETA message on the clock's
    queue, dropped 5 s past its instant (the tick has fired its timers by then)."""
    eta = datetime(2026, 12, 6, 12, 0, 0, 250000, tzinfo=UTC)
    until = eta + timedelta(seconds=0.5)
    dispatch.wake_timers_at(eta, until=until)
    dispatch.wake_timers_at(eta, until=None)
    assert [(m["task"], m["kwargs"], m["queue"], m["ignore_result"]) for m in sent] == [
        ("runs.wake_timers", {"until": until.timestamp()}, "timers", True),
        ("runs.wake_timers", {"until": None}, "timers", True),
    ]
    for message in sent:
        assert datetime.fromisoformat(message["eta"]) == eta
        assert datetime.fromisoformat(message["expires"]) == eta + timedelta(seconds=5)


def test_a_timer_armed_due_before_the_next_tick_asks_once_for_a_wake_up_at_its_instant(
    sent, settings, no_wakes_asked
) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "TIMER_RESOLUTION_MS": 100}
    now = datetime.now(UTC)
    # 20 ms into a 100 ms slot, 0.3 to 0.4 s from now.
    soon = datetime.fromtimestamp(math.floor(now.timestamp() * 10 + 3) / 10 + 0.02, UTC)
    dispatch.wake_timers_on_commit(soon)
    # The same 100 ms slot (a burst's runs armed for one instant): asked for already.
    dispatch.wake_timers_on_commit(soon + timedelta(milliseconds=1))
    # Past the next tick: the tick's own look finds it.
    dispatch.wake_timers_on_commit(now + timedelta(seconds=1.5))
    [message] = sent
    assert (message["task"], message["kwargs"]) == ("runs.wake_timers", {"until": None})
    eta = datetime.fromisoformat(message["eta"])
    # Rounded up to the resolution: never before the timer is due.
    # Rounded up to the slot's end: never before the timer is due (within float rounding).
    assert abs(eta - (soon + timedelta(milliseconds=80))) <= timedelta(microseconds=2)
    sent.clear()
    dispatch.wake_timers_on_commit(soon + timedelta(milliseconds=100))
    [following] = [datetime.fromisoformat(m["eta"]) for m in sent]
    assert abs(following - (eta + timedelta(milliseconds=100))) <= timedelta(microseconds=2)


def test_no_wake_up_is_asked_with_a_resolution_of_zero(sent, settings, no_wakes_asked) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "TIMER_RESOLUTION_MS": 0}
    dispatch.wake_timers_on_commit(datetime.now(UTC) + timedelta(seconds=0.3))
    assert sent == []


def test_the_instants_asked_for_are_forgotten_once_past(sent, settings, no_wakes_asked) -> None:
    """A long-lived process asks for wake-ups all day: what it remembers stays small."""
    settings.DJFLOW = {**settings.DJFLOW, "TIMER_RESOLUTION_MS": 100}
    past = datetime.now(UTC) - timedelta(seconds=60)
    for index in range(200):
        dispatch.wake_timers_on_commit(past + timedelta(milliseconds=100 * index))
    assert len(sent) == 200
    assert len(dispatch._wakes_asked) <= 65


def test_a_fan_out_goes_without_its_chord_when_the_result_backend_is_down(sent, caplog) -> None:
    """The chord is a nudge: a result backend that does not answer costs the sender a try or
    two (CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS), not Celery's 20 (19 s), and the attempts
    go plain rather than not at all."""
    import socket
    import time

    from celery.backends.redis import RedisBackend

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = RedisBackend(app=app, url=f"redis://127.0.0.1:{port}/0")
    began = time.monotonic()
    with mock.patch.object(app._local, "backend", backend, create=True):
        dispatch.offer_fan_out_on_commit([attempt(3), attempt(4)], run_id="r8", workflow_id="w")
    took = time.monotonic() - began
    assert [(m["args"], m["chord"], m["group"]) for m in sent] == [([3], None, None)]
    assert sent[0]["kwargs"] == {"more": [4]}
    assert took < 5, took
    assert any("sent without its chord" in r.getMessage() for r in caplog.records)


def test_a_per_host_sqlite_result_backend_outside_the_embedded_default_sends_no_chord(
    sent, settings, caplog, tmp_path
) -> None:
    """Each host would count in a SQLite file of its own, and chord_unlock on one would wait
    for results stored on another: the fan-out goes plain, said once."""
    from celery.backends.database import DatabaseBackend

    settings.EMBEDDED = False
    dispatch._warned_no_chords = False
    backend = DatabaseBackend(app=app, url=f"sqlite:///{tmp_path / 'results.sqlite3'}")
    with mock.patch.object(app._local, "backend", backend, create=True):
        dispatch.offer_fan_out_on_commit([attempt(3), attempt(4)], run_id="r9", workflow_id="w")
    assert [(m["task"], m["chord"], m["group"]) for m in sent] == [
        ("workers.execute_step", None, None)
    ]
    assert any("cannot gather a chord" in r.getMessage() for r in caplog.records)
