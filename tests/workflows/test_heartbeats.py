"""Which handlers workers serve (``workflows.heartbeats``), and the start check that reads
it (``START_CHECKS_WORKERS``, on for every test here): a run whose handler no worker has
served within ``UNSERVABLE_SECONDS`` is refused with 400 naming the step's ``handler`` field;
one a worker served in that window but no live worker serves now is accepted and waits for a
worker, its ``reason`` saying for what (CONTRACT section 14)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.utils import timezone

from runs.models import Run, StepRun, Timer
from tests.runs.test_preflight import _command
from workflows import heartbeats, registry
from workflows.errors import InvalidInput
from workflows.models import WorkerHeartbeat
from workflows.sdk import workflow
from workflows.services import definition_save

pytestmark = [pytest.mark.django_db, pytest.mark.start_checks_workers(True)]

HELLO = {"id": "hello", "steps": [{"id": "greet", "kind": "task"}]}
NESTED = {
    "id": "nested",
    "steps": [
        {"id": "first", "kind": "task", "handler": "shared.first"},
        {
            "id": "fan",
            "kind": "parallel",
            "branches": {
                "left": [{"id": "left_step", "kind": "agent", "queue": "gpu"}],
                "right": [{"id": "nap", "kind": "sleep", "ms": 10}],
            },
        },
        {
            "id": "check",
            "kind": "condition",
            "if": {"path": "input.x", "op": "eq", "value": 1},
            "then": [{"id": "then_step", "kind": "task"}],
        },
        {
            "id": "each",
            "kind": "foreach",
            "items": "${input.items}",
            "do": {"id": "item", "kind": "task"},
        },
    ],
}


def beat(
    hostname: str = "w1@test",
    handlers: list[str] | None = None,
    queues: list[str] | None = None,
    seconds_ago: float = 0,
) -> None:
    now = timezone.now()
    heartbeats.heartbeat_record(
        hostname=hostname,
        handlers=handlers if handlers is not None else ["hello.greet"],
        queues=queues if queues is not None else ["default"],
        pid=1,
        started_at=now - timedelta(minutes=1),
        now=now - timedelta(seconds=seconds_ago),
    )


def refused(api, workflow: str = "hello", **body: Any) -> list[dict[str, Any]]:
    response = api.post("/api/v1/runs", {"workflow": workflow, "input": {}, **body}, format="json")
    assert response.status_code == 400, response.json()
    return response.json()["errors"]


def accepted(api, workflow: str = "hello") -> dict[str, Any]:
    response = api.post("/api/v1/runs", {"workflow": workflow, "input": {}}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


@pytest.fixture
def window(settings) -> float:
    """``UNSERVABLE_SECONDS``, set here: these tests step over its edge."""
    settings.DJFLOW = {**settings.DJFLOW, "UNSERVABLE_SECONDS": 60.0}
    return 60.0


WAITS = (
    "waiting for a worker that serves hello.greet (step 'greet', queue 'default'); the step "
    "fails as unservable at "
)


def test_every_task_and_agent_step_is_found_with_its_field_handler_and_queue() -> None:
    found = heartbeats.step_handlers(NESTED)
    assert [(s.field, s.step_id, s.handler, s.queue) for s in found] == [
        ("steps[0].handler", "first", "shared.first", "default"),
        ("steps[1].branches.left[0].handler", "left_step", "nested.left_step", "gpu"),
        ("steps[2].then[0].handler", "then_step", "nested.then_step", "default"),
        ("steps[3].do.handler", "item", "nested.item", "default"),
    ]


def test_a_start_no_live_worker_serves_is_a_400_naming_the_step_and_the_handler(api) -> None:
    definition_save(document=HELLO)
    assert refused(api) == [
        {
            "field": "steps[0].handler",
            "message": "no live worker serves handler 'hello.greet' (step 'greet'); start a "
            "worker that imports it (WORKFLOW_MODULES)",
        }
    ]
    assert not Run.objects.exists()


def test_a_live_worker_that_serves_the_handler_lets_the_run_start(api) -> None:
    definition_save(document=HELLO)
    beat()
    response = api.post("/api/v1/runs", {"workflow": "hello", "input": {}}, format="json")
    assert response.status_code == 201, response.json()


@pytest.mark.parametrize(
    "worker",
    [
        {"seconds_ago": 61},  # gone quiet before the window (60 s)
        {"handlers": ["hello.other"]},
        {"handlers": []},
    ],
)
def test_a_worker_gone_before_the_window_or_without_the_handler_does_not_serve_it(
    api, window, worker
) -> None:
    definition_save(document=HELLO)
    beat(**worker)
    assert [e["field"] for e in refused(api)] == ["steps[0].handler"]


@pytest.mark.parametrize("seconds_ago", [16, 59])  # past its liveness (15 s), in the window
def test_a_worker_gone_quiet_within_the_window_lets_the_run_start_and_wait(
    api, window, seconds_ago
) -> None:
    definition_save(document=HELLO)
    beat(seconds_ago=seconds_ago)  # killed: no stop written
    before = timezone.now()
    run = accepted(api)
    assert run["reason"].startswith(WAITS), run["reason"]
    # The wait started with the run: the step fails as unservable a window after the start
    # unless a worker that serves it is seen.
    [attempt] = StepRun.objects.filter(run_id=run["id"])
    assert (attempt.status, attempt.waiting_for) == ("scheduled", "hello.greet")
    assert before <= attempt.waiting_since <= timezone.now()
    [timer] = Timer.objects.filter(step_run=attempt, purpose="unservable")
    assert timer.fire_at == attempt.waiting_since + timedelta(seconds=window)


@pytest.mark.parametrize(("stopped_ago", "starts"), [(30, True), (61, False)])
def test_a_stopped_worker_served_until_its_stop(api, window, stopped_ago, starts) -> None:
    definition_save(document=HELLO)
    beat(seconds_ago=stopped_ago + 5)
    heartbeats.heartbeat_stop(
        hostname="w1@test", now=timezone.now() - timedelta(seconds=stopped_ago)
    )
    if starts:
        assert accepted(api)["reason"].startswith(WAITS)
    else:
        assert refused(api)[0]["message"] == (
            "no live worker serves handler 'hello.greet' (step 'greet'); start a worker that "
            "imports it (WORKFLOW_MODULES)"
        )
        assert not Run.objects.exists()


def test_a_start_past_the_pace_is_planned_when_it_must_wait(api, window, monkeypatch) -> None:
    """Past StartPacer's pace a worker plans the run; with no live worker that serves it,
    the request plans it, so that the run says what it waits for at once."""
    from runs import services

    monkeypatch.setattr(services.inline_starts, "take", lambda: False)
    definition_save(document=HELLO)
    beat(seconds_ago=20)
    run = accepted(api)
    assert (run["status"], run["reason"][: len(WAITS)]) == ("running", WAITS)
    beat()  # live again: past the pace, the run is only inserted
    assert (accepted(api)["status"], StepRun.objects.count()) == ("pending", 1)


def test_a_run_served_by_a_live_worker_does_not_wait(api, window, django_assert_num_queries):
    definition_save(document=HELLO)
    beat()
    run = accepted(api)
    assert run["reason"] is None
    assert StepRun.objects.get(run_id=run["id"]).waiting_since is None
    # The start's second question (which steps no live worker serves) reads nothing more.
    heartbeats.unserved_errors(document=HELLO)
    with django_assert_num_queries(0):
        assert heartbeats.unlive_steps(document=HELLO) == []


def test_a_worker_that_comes_back_before_the_arming_leaves_the_run_unarmed(
    api, window, monkeypatch
) -> None:
    """Arming asks liveness again under its own read: a worker live by then serves the
    attempt, which waits for nothing."""
    definition_save(document=HELLO)
    beat(seconds_ago=20)
    from runs.engine import unservable

    arm = unservable.unservable_arm

    def back_first(**kwargs: Any) -> bool:
        beat()
        return arm(**kwargs)

    monkeypatch.setattr(unservable, "unservable_arm", back_first)
    run = accepted(api)
    assert run["reason"] is None
    assert not Timer.objects.filter(purpose="unservable").exists()


def test_a_worker_with_the_handler_on_other_queues_is_named_as_such(api) -> None:
    definition_save(document={**HELLO, "steps": [{"id": "greet", "kind": "task", "queue": "io"}]})
    beat(queues=["default", "engine"])
    assert refused(api) == [
        {
            "field": "steps[0].handler",
            "message": "no live worker serves handler 'hello.greet' (step 'greet') on queue 'io'; "
            "start a worker that imports it and consumes that queue (-Q io)",
        }
    ]


def test_every_unserved_step_is_named_at_once_with_the_input_errors(api) -> None:
    definition_save(document={**NESTED, "input_schema": {"type": "object", "required": ["x"]}})
    beat(handlers=["shared.first", "nested.item"])
    errors = refused(api, workflow="nested")
    assert [e["field"] for e in errors] == [
        "input.x",
        "steps[1].branches.left[0].handler",
        "steps[2].then[0].handler",
    ]
    assert "on queue 'gpu'" not in errors[1]["message"]  # nobody has it at all


@pytest.fixture
def own_registry():
    state = registry.snapshot()
    yield
    registry.restore(state)


def test_the_builder_start_is_refused_too(own_registry) -> None:
    greeter = workflow("greeter")

    @greeter.step("hi")
    def hi(ctx: Any, input: Any, prior: Any) -> str:
        return "hi"

    # Registered in this process, which is no worker: nobody serves it.
    with pytest.raises(InvalidInput) as raised:
        greeter.start({})
    [error] = raised.value.errors
    assert (error.field, "'greeter.hi'" in error.message) == ("steps[0].handler", True)
    beat(handlers=["greeter.hi"])
    assert greeter.start({}).status == "running"


@pytest.mark.start_checks_workers(False)
def test_the_check_is_off_when_the_setting_says_so(api) -> None:
    definition_save(document=HELLO)
    beat(seconds_ago=20)
    # Nor is a wait started at once: the engine's own checks (a worker's hand-back, the
    # reconciler) start it, as for any attempt.
    assert accepted(api)["reason"] is None
    assert not Timer.objects.filter(purpose="unservable").exists()


def test_a_heartbeat_again_takes_the_row_over_and_old_rows_are_pruned() -> None:
    beat(handlers=["a"])
    heartbeats.heartbeat_stop(hostname="w1@test")
    beat(handlers=["b"])
    [row] = WorkerHeartbeat.objects.all()
    assert (row.handlers, row.stopped_at) == (["b"], None)
    beat(hostname="old@test", seconds_ago=8 * 86400)
    assert heartbeats.heartbeat_prune(older_than=timezone.now() - timedelta(days=7)) == 1
    assert list(WorkerHeartbeat.objects.values_list("hostname", flat=True)) == ["w1@test"]


def test_served_since_counts_a_worker_seen_then_stopped() -> None:
    start = timezone.now()
    beat()
    heartbeats.heartbeat_stop(hostname="w1@test")
    assert not heartbeats.handler_served(handler="hello.greet", queue="default")
    assert heartbeats.handler_served(handler="hello.greet", queue="default", since=start)
    later = timezone.now() + timedelta(seconds=1)
    assert not heartbeats.handler_served(handler="hello.greet", queue="default", since=later)


# --- The pre-flight's read, kept for LIVE_READ_SECONDS ---------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(heartbeats, "_clock", clock)
    return clock


def test_a_served_answer_is_kept_for_a_moment_then_read_again(
    clock, window, django_assert_num_queries
) -> None:
    beat()
    with django_assert_num_queries(1):
        assert heartbeats.unserved_errors(document=HELLO) == []
    # Another process stops the worker, and says so as of before the window (no heartbeat
    # written here): for LIVE_READ_SECONDS it still counts, as it would have for a start
    # that much earlier.
    gone = timezone.now() - timedelta(seconds=window + 1)
    WorkerHeartbeat.objects.filter(hostname="w1@test").update(stopped_at=gone, last_seen=gone)
    clock.now += heartbeats.LIVE_READ_SECONDS / 2
    with django_assert_num_queries(0):
        assert heartbeats.unserved_errors(document=HELLO) == []
        assert heartbeats.unlive_steps(document=HELLO) == []
    clock.now += heartbeats.LIVE_READ_SECONDS
    with django_assert_num_queries(1):
        [error] = heartbeats.unserved_errors(document=HELLO)
    assert error.field == "steps[0].handler"


def test_an_unserved_answer_is_read_again_so_a_new_worker_serves_at_once(
    clock, django_assert_num_queries
) -> None:
    assert [e.field for e in heartbeats.unserved_errors(document=HELLO)] == ["steps[0].handler"]
    # A worker starts in another process, within the moment the read is kept.
    now = timezone.now()
    WorkerHeartbeat.objects.create(
        hostname="w2@test",
        handlers=["hello.greet"],
        queues=["default"],
        pid=2,
        started_at=now,
        last_seen=now,
    )
    with django_assert_num_queries(1):
        assert heartbeats.unserved_errors(document=HELLO) == []


def test_a_kept_worker_whose_beats_lapse_no_longer_serves(clock, settings, window) -> None:
    live_span = settings.DJFLOW["WORKER_HEARTBEAT_SECONDS"] * settings.DJFLOW["WORKER_LIVE_BEATS"]
    beat(seconds_ago=live_span - 0.5)
    assert heartbeats.unlive_steps(document=HELLO) == []
    # Still within the kept moment, but its last beat is now too old: judged against now.
    later = timezone.now() + timedelta(seconds=1)
    with mock.patch("workflows.heartbeats.timezone.now", return_value=later):
        assert [s.field for s in heartbeats.unlive_steps(document=HELLO)] == ["steps[0].handler"]
        # Not live, but in the window: a start still takes it.
        assert heartbeats.unserved_errors(document=HELLO) == []
    beat(seconds_ago=window - 0.5)
    assert heartbeats.unserved_errors(document=HELLO) == []
    with mock.patch("workflows.heartbeats.timezone.now", return_value=later):
        assert [e.field for e in heartbeats.unserved_errors(document=HELLO)] == ["steps[0].handler"]


def test_a_heartbeat_written_or_stopped_here_is_seen_at_once(clock, api, window) -> None:
    definition_save(document=HELLO)
    beat()
    assert accepted(api)["reason"] is None
    # A stop written here as of before the window: the kept read, which still says served,
    # is dropped.
    before = timezone.now() - timedelta(seconds=window + 1)
    heartbeats.heartbeat_stop(hostname="w1@test", now=before)
    assert refused(api)[0]["field"] == "steps[0].handler"


# --- The command and the admin: refused, or a warning that the run will wait --------------


def test_the_command_warns_of_a_wait_and_refuses_past_the_window(window) -> None:
    definition_save(document=HELLO)
    beat()
    assert _command("hello") == (0, "hello version 1: every check passes\n")
    heartbeats.heartbeat_stop(hostname="w1@test", now=timezone.now() - timedelta(seconds=20))
    code, out = _command("hello")
    assert (code, out.splitlines()) == (
        0,
        [
            "warning: steps[0].handler: no live worker serves handler 'hello.greet' (step "
            "'greet') on queue 'default' now, but one did within the last 60 s: a run is "
            "accepted and waits for a worker, and the step fails as unservable if none serves "
            "it within 60 s",
            "hello version 1: every check passes (a run waits for a worker)",
        ],
    )
    heartbeats.heartbeat_stop(hostname="w1@test", now=timezone.now() - timedelta(seconds=61))
    code, out = _command("hello")
    assert code == 1 and "warning" not in out
    assert "steps[0].handler: no live worker serves handler 'hello.greet'" in out


def test_the_admin_shows_a_wait_as_a_warning_and_a_refusal_as_a_problem(
    admin_client, window
) -> None:
    definition_save(document=HELLO)
    page = "/admin/workflows/workflow/hello/change/"
    beat(seconds_ago=20)
    text = admin_client.get(page).content.decode()
    assert "djflow-preflight-warnings" in text and "djflow-preflight-problems" not in text
    assert "but one did within the last 60 s" in text
    beat(seconds_ago=61)
    text = admin_client.get(page).content.decode()
    assert "djflow-preflight-problems" in text and "djflow-preflight-warnings" not in text
