"""The runs API (contract sections 5 and 7) over HTTP, against Postgres.

No worker runs here: the services' messages are sent after commit, and these tests either
capture those callbacks (with ``advance`` messages patched) or never commit at all.
"""

from __future__ import annotations

import base64
import json
import time
from datetime import timedelta
from decimal import Decimal
from typing import Any
from unittest import mock

import pytest
from django.db import connection
from django.forms.models import model_to_dict
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs import services
from runs.engine.advance import run_advance
from runs.models import Run, StepRun
from runs.status import RunStatus, StepStatus

from ..listening import never_contacted
from .factories import RunFactory, StepRunFactory, WorkflowVersionFactory, support_ticket_document

pytestmark = pytest.mark.django_db

RUN_FIELDS = {
    "id",
    "workflow",
    "version",
    "status",
    "input",
    "output",
    "error",
    "correlation",
    "parent",
    "children",
    "cost_usd",
    "created_at",
    "started_at",
    "finished_at",
    "steps",
    "generation",
    "attempts",
    "idempotency_key",
    "deadline_at",
}
STEP_FIELDS = {
    "id",
    "step_id",
    "path",
    "kind",
    "attempt",
    "status",
    "input",
    "output",
    "error",
    "worker",
    "scheduled_at",
    "started_at",
    "finished_at",
    "usage",
    "cost_usd",
    "generation",
    "effect",
    "branch",
}


@pytest.fixture
def version():
    return WorkflowVersionFactory()


@pytest.fixture
def advance_delay():
    """What the on-commit callbacks would send to ``runs.advance``, called as ``delay`` is
    (the run id). The dispatcher sends by name; the task's ``apply_async`` is what sends."""
    delay = mock.Mock()
    with mock.patch("runs.tasks.advance.apply_async") as apply_async:
        apply_async.side_effect = lambda args, kwargs=None, **_: delay(*args, **(kwargs or {}))
        yield delay


def _snapshot(run: Run) -> dict[str, Any]:
    run.refresh_from_db()
    steps = [model_to_dict(s) for s in StepRun.objects.filter(run=run).order_by("id")]
    return {**model_to_dict(run), "updated_at": run.updated_at, "steps": steps}


def _fields(response) -> list[str | None]:
    return [e.get("field") for e in response.json()["errors"]]


# --- start ------------------------------------------------------------------------------------


def test_start_answers_201_with_the_run_and_offers_its_first_step(
    api: APIClient, user, version, django_capture_on_commit_callbacks
) -> None:
    body = {
        "workflow": "support_ticket",
        "input": {"ticket": "Q: where is my parcel?"},
        "correlation": "crm-42",
    }
    with (
        mock.patch("workers.tasks.execute_step.apply_async") as offer,
        django_capture_on_commit_callbacks(execute=True) as callbacks,
    ):
        response = api.post("/api/v1/runs", body, format="json")
    assert response.status_code == 201, response.json()
    run = response.json()
    assert set(run) >= RUN_FIELDS
    assert run["workflow"] == "support_ticket"
    assert run["version"] == version.number == 1
    # The run is started and its first step planned in the same transaction.
    assert run["status"] == RunStatus.RUNNING
    assert run["started_at"] is not None
    assert run["input"] == {"ticket": "Q: where is my parcel?"}
    assert run["correlation"] == "crm-42"
    assert (run["output"], run["error"], run["parent"]) == (None, None, None)
    assert run["children"] == []
    [first] = run["steps"]
    assert (first["step_id"], first["attempt"], first["status"]) == ("classify", 1, "scheduled")
    assert first["input"] == {"ticket": "Q: where is my parcel?"}
    assert run["cost_usd"] == 0.0 and isinstance(run["cost_usd"], float)
    assert run["generation"] == 1
    stored = Run.objects.get(id=run["id"])
    assert stored.created_by == user
    assert len(callbacks) == 1
    offer.assert_called_once()
    assert offer.call_args.args[0] == (first["id"],)
    # Named after no step: the steps it runs show under their own names (workers.task_events).
    assert "shadow" not in offer.call_args.kwargs


def test_past_the_pace_a_start_answers_201_with_the_pending_run_and_a_worker_plans_it(
    api: APIClient, user, version, advance_delay, django_capture_on_commit_callbacks, settings
) -> None:
    """Past START_INLINE_PER_SECOND (0 here: every start) the request inserts the run and
    sends one runs.advance; the worker's advance plans and offers the first step."""
    settings.DJFLOW = {**settings.DJFLOW, "START_INLINE_PER_SECOND": 0}
    body = {
        "workflow": "support_ticket",
        "input": {"ticket": "Q: where is my parcel?"},
        "correlation": "crm-42",
    }
    with (
        mock.patch("workers.tasks.execute_step.apply_async") as offer,
        django_capture_on_commit_callbacks(execute=True) as callbacks,
        CaptureQueriesContext(connection) as queries,
    ):
        response = api.post("/api/v1/runs", body, format="json")
    # Read now: captured_queries reads the connection's log lazily, and the next request
    # clears it (django.db.reset_queries on request_started).
    sql = [q["sql"] for q in queries.captured_queries]
    assert response.status_code == 201, response.json()
    run = response.json()
    assert set(run) >= RUN_FIELDS
    assert run["workflow"] == "support_ticket"
    assert run["version"] == version.number == 1
    # The request inserts the run; a worker plans its first step (one runs.advance message).
    assert run["status"] == RunStatus.PENDING
    assert run["started_at"] is None
    assert run["input"] == {"ticket": "Q: where is my parcel?"}
    assert run["correlation"] == "crm-42"
    assert (run["output"], run["error"], run["parent"]) == (None, None, None)
    assert (run["children"], run["steps"], run["actions"], run["reason"]) == ([], [], [], None)
    assert run["cost_usd"] == 0.0 and isinstance(run["cost_usd"], float)
    assert (run["generation"], run["attempts"]) == (1, 0)
    # The response is the run as created: not read back (nor its journal, actions, children).
    # The log holds the request's statements (its INSERT of the run), so the second
    # assertion can fail.
    assert [q for q in sql if q.startswith('INSERT INTO "runs_run"')], sql
    assert not [q for q in sql if "runs_steprun" in q], sql
    stored = Run.objects.get(id=run["id"])
    assert stored.created_by == user
    assert len(callbacks) == 1
    advance_delay.assert_called_once_with(run["id"])
    offer.assert_not_called()
    # What the worker's advance does with it: the first step, planned and offered.
    with (
        mock.patch("workers.tasks.execute_step.apply_async") as offer,
        django_capture_on_commit_callbacks(execute=True),
    ):
        run_advance(run_id=run["id"])
    read = api.get(f"/api/v1/runs/{run['id']}").json()
    assert read["status"] == RunStatus.RUNNING and read["started_at"] is not None
    [first] = read["steps"]
    assert (first["step_id"], first["attempt"], first["status"]) == ("classify", 1, "scheduled")
    assert first["input"] == {"ticket": "Q: where is my parcel?"}
    offer.assert_called_once()
    assert offer.call_args.args[0] == (first["id"],)
    # Named after no step: the steps it runs show under their own names (workers.task_events).
    assert "shadow" not in offer.call_args.kwargs


def test_starts_are_planned_in_the_request_at_the_pace_then_handed_to_workers(
    api: APIClient, version, settings, django_capture_on_commit_callbacks
) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "START_INLINE_PER_SECOND": 2}
    clock = mock.Mock(return_value=100.0)
    pacer = services.StartPacer(clock=clock)
    body = {"workflow": "support_ticket", "input": {"ticket": "Q"}}

    def start() -> tuple[str, int]:
        with (
            mock.patch.object(services, "inline_starts", pacer),
            mock.patch("workers.tasks.execute_step.apply_async"),
            mock.patch("runs.tasks.advance.apply_async"),
            django_capture_on_commit_callbacks(execute=True),
        ):
            answer = api.post("/api/v1/runs", body, format="json").json()
        return answer["status"], len(answer["steps"])

    # A second's worth planned in the request, then the worker's; half a second later, one more.
    assert [start() for _ in range(3)] == [("running", 1), ("running", 1), ("pending", 0)]
    clock.return_value = 100.5
    assert [start() for _ in range(2)] == [("running", 1), ("pending", 0)]


def test_the_same_idempotency_key_answers_200_with_the_same_run(
    api: APIClient, version, django_capture_on_commit_callbacks
) -> None:
    body = {"workflow": "support_ticket", "input": {"ticket": "Q"}, "idempotency_key": "k-1"}
    first = api.post("/api/v1/runs", body, format="json")
    assert first.status_code == 201
    with django_capture_on_commit_callbacks() as callbacks:
        again = api.post("/api/v1/runs", {**body, "input": {"ticket": "other"}}, format="json")
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["input"] == {"ticket": "Q"}
    assert callbacks == []
    assert Run.objects.count() == 1
    # Another key is another run.
    other = api.post("/api/v1/runs", {**body, "idempotency_key": "k-2"}, format="json")
    assert other.status_code == 201
    assert Run.objects.count() == 2


def test_a_run_pins_the_latest_version_or_the_one_asked_for(api: APIClient) -> None:
    WorkflowVersionFactory()
    WorkflowVersionFactory(document=support_ticket_document(description="second"))
    latest = api.post(
        "/api/v1/runs", {"workflow": "support_ticket", "input": {"ticket": "a"}}, format="json"
    )
    assert latest.json()["version"] == 2
    pinned = api.post(
        "/api/v1/runs",
        {"workflow": "support_ticket", "version": 1, "input": {"ticket": "a"}},
        format="json",
    )
    assert pinned.status_code == 201
    assert pinned.json()["version"] == 1


def test_input_defaults_to_null(api: APIClient) -> None:
    WorkflowVersionFactory(document={"id": "free", "steps": [{"id": "a", "kind": "task"}]})
    response = api.post("/api/v1/runs", {"workflow": "free"}, format="json")
    assert response.status_code == 201
    assert response.json()["input"] is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"workflow": "nope", "input": {}}, "workflow"),
        ({"workflow": "support_ticket", "version": 9, "input": {"ticket": "a"}}, "version"),
        ({"workflow": "nope", "version": 1, "input": {}}, "workflow"),
    ],
)
def test_unknown_workflow_or_version_is_a_404_naming_it(
    api: APIClient, version, body: dict[str, Any], field: str
) -> None:
    response = api.post("/api/v1/runs", body, format="json")
    assert response.status_code == 404
    assert _fields(response) == [field]
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("run_input", "field"),
    [
        ({}, "input.ticket"),
        ({"ticket": 5}, "input.ticket"),
        (None, "input"),
        (["a"], "input"),
    ],
)
def test_input_failing_the_input_schema_is_a_400_naming_the_field(
    api: APIClient, version, run_input: Any, field: str
) -> None:
    response = api.post(
        "/api/v1/runs", {"workflow": "support_ticket", "input": run_input}, format="json"
    )
    assert response.status_code == 400
    assert field in _fields(response)
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"[1, 2]", "body"),
        (b'"a string"', "body"),
        (b"null", "body"),
        (b"42", "body"),
        (b"{not json", "body"),
        (b"{}", "workflow"),
        (b'{"workflow": 5}', "workflow"),
        (b'{"workflow": null}', "workflow"),
        (b'{"workflow": "support_ticket", "colour": "red"}', "colour"),
        (b'{"workflow": "support_ticket", "version": "1"}', "version"),
        (b'{"workflow": "support_ticket", "version": 0}', "version"),
        (b'{"workflow": "support_ticket", "version": true}', "version"),
        (b'{"workflow": "support_ticket", "version": 1.5}', "version"),
        (b'{"workflow": "support_ticket", "version": 99999999999}', "version"),
        (b'{"workflow": "support_ticket", "idempotency_key": 7}', "idempotency_key"),
        (b'{"workflow": "support_ticket", "idempotency_key": ""}', "idempotency_key"),
        (
            b'{"workflow": "support_ticket", "idempotency_key": "%s"}' % (b"k" * 256),
            "idempotency_key",
        ),
        (b'{"workflow": "support_ticket", "correlation": ["a"]}', "correlation"),
        (b'{"workflow": "support_ticket", "input": {"ticket": "a\\u0000b"}}', "input.ticket"),
        (b'{"workflow": "support_ticket", "input": {"t": [1, 1e999]}}', "input"),
        (b'{"workflow": "a\\u0000b"}', "workflow"),
        (b'{"workflow": "support_ticket", "input": {"a\\u0000": [{"b": "\\u0000"}]}}', "input"),
        (b'{"workflow": "support_ticket", "input": {"a": [{"b": "\\u0000"}]}}', "input.a[0].b"),
        # Lone surrogates: stored, they made every answer holding them a 500, for everyone.
        (b'{"workflow": "support_ticket", "input": {"ticket": "Q: \\ud800 x"}}', "input.ticket"),
        (b'{"workflow": "support_ticket", "input": {"t": "\\udfff"}}', "input.t"),
        (b'{"workflow": "support_ticket", "input": {"k\\ud800": {"x": "\\udc00"}}}', "input"),
        (b'{"workflow": "support_ticket", "correlation": "\\ud83d"}', "correlation"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(
    api: APIClient, version, raw: bytes, field: str
) -> None:
    response = api.generic("POST", "/api/v1/runs", raw, content_type="application/json")
    assert response.status_code == 400, response.content
    assert field in _fields(response), response.json()
    assert all(e["message"] for e in response.json()["errors"])
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("depth", "code", "field"),
    [(100, 201, None), (101, 400, "body"), (5000, 400, "body")],
)
def test_input_nested_too_deep_is_a_400_not_a_crash(
    api: APIClient, depth: int, code: int, field: str | None
) -> None:
    WorkflowVersionFactory(document={"id": "free", "steps": [{"id": "a", "kind": "task"}]})
    nested = '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)
    raw = '{"workflow": "free", "input": ' + nested + "}"
    response = api.generic("POST", "/api/v1/runs", raw, content_type="application/json")
    assert response.status_code == code, response.content
    if field is not None:
        assert _fields(response) == [field]


def test_every_unknown_field_is_named(api: APIClient, version) -> None:
    body = {"workflow": "support_ticket", "input": {"ticket": "a"}, "a": 1, "b": 2}
    response = api.post("/api/v1/runs", body, format="json")
    assert response.status_code == 400
    assert sorted(_fields(response)) == ["a", "b"]


def test_authentication_is_required(anon_api: APIClient) -> None:
    run = RunFactory()
    urls = [
        ("get", "/api/v1/runs"),
        ("post", "/api/v1/runs"),
        ("get", f"/api/v1/runs/{run.id}"),
        *[("post", f"/api/v1/runs/{run.id}/{action}") for action in ("cancel", "pause")],
        *[("post", f"/api/v1/runs/{run.id}/{action}") for action in ("resume", "retry")],
    ]
    for method, url in urls:
        response = getattr(anon_api, method)(url, {}, format="json")
        assert response.status_code == 401, url
        assert response.json()["errors"][0]["message"]
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING


def test_a_session_write_without_csrf_is_a_json_403(user, version) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.get("/api/v1/runs").status_code == 200
    response = client.post("/api/v1/runs", {"workflow": "support_ticket"}, format="json")
    assert response.status_code == 403
    assert response.json()["errors"][0]["message"]


# --- list -------------------------------------------------------------------------------------


def _ids(response) -> list[str]:
    return [row["id"] for row in response.json()["results"]]


def test_list_is_newest_first_and_rows_leave_out_the_journal(api: APIClient, version) -> None:
    runs = [RunFactory(version=version) for _ in range(3)]
    StepRunFactory(run=runs[0])
    response = api.get("/api/v1/runs")
    assert response.status_code == 200
    assert set(response.json()) == {"results", "next"}
    assert _ids(response) == [str(r.id) for r in reversed(runs)]
    row = response.json()["results"][0]
    assert RUN_FIELDS - {"steps", "children"} <= set(row)
    assert "steps" not in row
    assert response.json()["next"] is None


def test_list_filters_by_workflow_and_status(api: APIClient, version) -> None:
    other = WorkflowVersionFactory(
        document={"id": "billing", "steps": [{"id": "a", "kind": "task"}]}
    )
    failed = RunFactory(version=version, status=RunStatus.FAILED)
    running = RunFactory(version=version, status=RunStatus.RUNNING)
    billing_failed = RunFactory(version=other, status=RunStatus.FAILED)
    assert _ids(api.get("/api/v1/runs?workflow=support_ticket")) == [
        str(running.id),
        str(failed.id),
    ]
    assert _ids(api.get("/api/v1/runs?status=failed")) == [str(billing_failed.id), str(failed.id)]
    assert _ids(api.get("/api/v1/runs?workflow=billing&status=failed")) == [str(billing_failed.id)]
    assert _ids(api.get("/api/v1/runs?workflow=nothing")) == []


def test_list_pages_with_a_cursor_until_next_is_null(api: APIClient, version) -> None:
    runs = [RunFactory(version=version) for _ in range(7)]
    # Two runs created in the same microsecond still each appear exactly once.
    Run.objects.filter(id__in=[runs[2].id, runs[3].id]).update(created_at=runs[2].created_at)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        url = "/api/v1/runs?limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = api.get(url)
        assert page.status_code == 200, page.json()
        assert len(page.json()["results"]) <= 2
        seen += _ids(page)
        cursor = page.json()["next"]
        pages += 1
        if cursor is None:
            break
    assert pages == 4
    expected = Run.objects.order_by("-created_at", "-id").values_list("id", flat=True)
    assert seen == [str(i) for i in expected]
    assert len(set(seen)) == 7


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("status=exploded", "status"),
        ("cursor=%%%garbage", "cursor"),
        # Well-formed base64, but its position is not a time.
        ("cursor=" + base64.b64encode(b"p=not-a-time").decode(), "cursor"),
        ("workflow=a%00b", "workflow"),
        ("limit=abc", "limit"),
        ("limit=0", "limit"),
        ("limit=-3", "limit"),
        ("limit=501", "limit"),
        ("limit=", "limit"),
        ("limit=2.5", "limit"),
    ],
)
def test_bad_list_queries_are_a_400_naming_the_parameter(
    api: APIClient, query: str, field: str
) -> None:
    RunFactory()
    response = api.get(f"/api/v1/runs?{query}")
    assert response.status_code == 400, response.content
    assert _fields(response) == [field]


# --- detail -----------------------------------------------------------------------------------


def test_read_a_run_with_its_journal_in_order(api: APIClient, version) -> None:
    run = RunFactory(version=version, status=RunStatus.RUNNING, cost_usd=Decimal("0.012345"))
    classify = StepRunFactory(run=run, step_id="classify")
    draft = StepRunFactory(
        run=run,
        step_id="draft",
        kind="agent",
        usage={"input_tokens": 812, "output_tokens": 37},
        cost_usd=Decimal("0.012345"),
    )
    first_send = StepRunFactory(run=run, step_id="send", status=StepStatus.FAILED)
    second_send = StepRunFactory(run=run, step_id="send", attempt=2, status=StepStatus.RUNNING)
    response = api.get(f"/api/v1/runs/{run.id}")
    assert response.status_code == 200
    body = response.json()
    assert set(body) >= RUN_FIELDS
    assert body["cost_usd"] == pytest.approx(0.012345)
    steps = body["steps"]
    assert [s["id"] for s in steps] == [classify.id, draft.id, first_send.id, second_send.id]
    assert all(set(s) >= STEP_FIELDS for s in steps)
    assert [(s["step_id"], s["attempt"], s["status"]) for s in steps] == [
        ("classify", 1, "succeeded"),
        ("draft", 1, "succeeded"),
        ("send", 1, "failed"),
        ("send", 2, "running"),
    ]
    assert steps[0]["output"] == {"kind": "question"}
    assert steps[1]["usage"] == {"input_tokens": 812, "output_tokens": 37}
    assert steps[1]["cost_usd"] == pytest.approx(0.012345)
    assert steps[2]["error"]["class"] == "fatal"
    assert steps[3]["worker"] == "celery@worker-1"
    assert steps[3]["finished_at"] is None


def test_read_a_failed_run_names_its_error(api: APIClient) -> None:
    run = RunFactory(status=RunStatus.FAILED)
    body = api.get(f"/api/v1/runs/{run.id}").json()
    assert body["error"] == {"class": "fatal", "message": "the handler raised", "step": "send"}
    assert body["finished_at"] is not None


def test_parent_and_children(api: APIClient, version) -> None:
    parent = RunFactory(version=version)
    step = StepRunFactory(
        run=parent, step_id="research", kind="subworkflow", status=StepStatus.WAITING
    )
    first = RunFactory(version=version, parent_run=parent, parent_step_run=step)
    second = RunFactory(
        version=version, parent_run=parent, parent_step_run=step, status=RunStatus.COMPLETED
    )
    body = api.get(f"/api/v1/runs/{parent.id}").json()
    assert body["parent"] is None
    assert body["children"] == [
        {"id": str(first.id), "workflow": "support_ticket", "status": "running"},
        {"id": str(second.id), "workflow": "support_ticket", "status": "completed"},
    ]
    child = api.get(f"/api/v1/runs/{first.id}").json()
    assert child["parent"] == {"run": str(parent.id), "step": "research"}
    assert child["children"] == []
    row = next(r for r in api.get("/api/v1/runs").json()["results"] if r["id"] == str(first.id))
    assert row["parent"] == {"run": str(parent.id), "step": "research"}


@pytest.mark.parametrize(
    # "%00" is a 400 before any view (tests/test_nul_paths.py).
    "run_id",
    ["not-a-uuid", "1fb7bd03-940b-46b6-b521-485bf9503555", "12345", "0" * 40],
)
@pytest.mark.parametrize("action", ["", "/cancel", "/pause", "/resume", "/retry"])
def test_unknown_or_malformed_run_ids_are_json_404s(
    api: APIClient, run_id: str, action: str
) -> None:
    RunFactory()
    method = api.get if action == "" else api.post
    response = method(f"/api/v1/runs/{run_id}{action}")
    assert response.status_code == 404, response.content
    assert _fields(response) == ["id"]


# --- cancel -----------------------------------------------------------------------------------


def test_cancel_cancels_in_flight_attempts_and_children_transitively(
    api: APIClient, version
) -> None:
    run = RunFactory(version=version)
    done = StepRunFactory(run=run, step_id="classify")
    running = StepRunFactory(run=run, step_id="draft", kind="agent", status=StepStatus.RUNNING)
    scheduled = StepRunFactory(run=run, step_id="send", status=StepStatus.SCHEDULED)
    sub = StepRunFactory(run=run, step_id="sub", kind="subworkflow", status=StepStatus.WAITING)
    child = RunFactory(version=version, parent_run=run, parent_step_run=sub)
    grandchild = RunFactory(version=version, parent_run=child, status=RunStatus.PAUSED)
    finished_child = RunFactory(version=version, parent_run=run, status=RunStatus.COMPLETED)

    response = api.post(f"/api/v1/runs/{run.id}/cancel")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["status"] == RunStatus.CANCELLED
    assert body["error"]["class"] == "cancelled"
    assert body["finished_at"] is not None
    statuses = {s["id"]: s["status"] for s in body["steps"]}
    assert statuses == {
        done.id: "succeeded",
        running.id: "cancelled",
        scheduled.id: "cancelled",
        sub.id: "cancelled",
    }
    for descendant in (child, grandchild):
        descendant.refresh_from_db()
        assert descendant.status == RunStatus.CANCELLED
        assert descendant.error["class"] == "cancelled"
    finished_child.refresh_from_db()
    assert finished_child.status == RunStatus.COMPLETED
    assert {c["id"]: c["status"] for c in body["children"]} == {
        str(child.id): "cancelled",
        str(finished_child.id): "completed",
    }


@pytest.mark.parametrize("status", [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.TIMED_OUT])
def test_cancel_of_an_ended_run_is_a_409_and_changes_nothing(
    api: APIClient, version, status: str
) -> None:
    run = RunFactory(version=version, status=status)
    StepRunFactory(run=run)
    before = _snapshot(run)
    response = api.post(f"/api/v1/runs/{run.id}/cancel")
    assert response.status_code == 409
    assert _fields(response) == ["status"]
    assert _snapshot(run) == before


def test_cancel_of_a_cancelled_run_is_idempotent_and_changes_nothing(
    api: APIClient, version
) -> None:
    # A client retrying a cancel (its first answer lost) is told the run is cancelled.
    run = RunFactory(version=version, status=RunStatus.CANCELLED)
    StepRunFactory(run=run)
    before = _snapshot(run)
    response = api.post(f"/api/v1/runs/{run.id}/cancel")
    assert response.status_code == 200
    assert response.json()["status"] == RunStatus.CANCELLED
    assert _snapshot(run) == before


# --- pause and resume -------------------------------------------------------------------------


def test_pause_then_resume_enqueues_one_advance(
    api: APIClient, version, advance_delay, django_capture_on_commit_callbacks
) -> None:
    run = RunFactory(version=version, status=RunStatus.WAITING)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        paused = api.post(f"/api/v1/runs/{run.id}/pause")
    assert paused.status_code == 200
    assert paused.json()["status"] == RunStatus.PAUSED
    assert callbacks == []
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        resumed = api.post(f"/api/v1/runs/{run.id}/resume")
    assert resumed.status_code == 200
    assert resumed.json()["status"] == RunStatus.RUNNING
    assert len(callbacks) == 1
    advance_delay.assert_called_once_with(str(run.id))


@pytest.mark.parametrize(
    ("status", "action", "code"),
    [
        (RunStatus.RUNNING, "resume", 409),
        (RunStatus.PENDING, "resume", 409),
        (RunStatus.WAITING, "resume", 409),
        (RunStatus.COMPLETED, "resume", 409),
        (RunStatus.PAUSED, "pause", 409),
        (RunStatus.COMPLETED, "pause", 409),
        (RunStatus.CANCELLED, "pause", 409),
    ],
)
def test_illegal_pause_or_resume_changes_nothing(
    api: APIClient, version, status: str, action: str, code: int, django_capture_on_commit_callbacks
) -> None:
    run = RunFactory(version=version, status=status)
    before = _snapshot(run)
    with django_capture_on_commit_callbacks() as callbacks:
        response = api.post(f"/api/v1/runs/{run.id}/{action}")
    assert response.status_code == code, response.json()
    assert _fields(response) == ["status"]
    assert _snapshot(run) == before
    assert callbacks == []


# --- retry ------------------------------------------------------------------------------------


def test_retry_of_a_failed_run_starts_a_new_generation(
    api: APIClient, version, advance_delay, django_capture_on_commit_callbacks
) -> None:
    run = RunFactory(version=version, status=RunStatus.FAILED)
    StepRunFactory(run=run, step_id="classify")
    StepRunFactory(run=run, step_id="send", status=StepStatus.FAILED)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = api.post(f"/api/v1/runs/{run.id}/retry")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["status"] == RunStatus.RUNNING
    assert body["generation"] == 2
    assert (body["error"], body["finished_at"]) == (None, None)
    # What the first generation did is kept.
    assert [(s["step_id"], s["status"]) for s in body["steps"]] == [
        ("classify", "succeeded"),
        ("send", "failed"),
    ]
    assert len(callbacks) == 1
    advance_delay.assert_called_once_with(str(run.id))


@pytest.mark.parametrize(
    "status",
    [RunStatus.COMPLETED, RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.PAUSED],
)
def test_retry_of_a_run_that_has_not_failed_changes_nothing(
    api: APIClient, version, status: str, django_capture_on_commit_callbacks
) -> None:
    run = RunFactory(version=version, status=status)
    before = _snapshot(run)
    with django_capture_on_commit_callbacks() as callbacks:
        response = api.post(f"/api/v1/runs/{run.id}/retry")
    assert response.status_code == 409
    assert _fields(response) == ["status"]
    assert _snapshot(run) == before
    assert callbacks == []


# --- schema -----------------------------------------------------------------------------------


def test_openapi_documents_the_runs_endpoints(api: APIClient) -> None:
    schema = api.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    paths = json.loads(schema.content)["paths"]
    assert set(paths["/api/v1/runs"]) == {"get", "post"}
    assert {"200", "201", "400", "404"} <= set(paths["/api/v1/runs"]["post"]["responses"])
    for action in ("cancel", "pause", "resume", "retry"):
        responses = paths[f"/api/v1/runs/{{run_id}}/{action}"]["post"]["responses"]
        assert {"200", "404", "409"} <= set(responses)
    assert "steps" in paths["/api/v1/runs"]["get"]["description"]


def test_times_are_iso_8601(api: APIClient) -> None:
    run = RunFactory(status=RunStatus.COMPLETED)
    body = api.get(f"/api/v1/runs/{run.id}").json()
    assert body["finished_at"].endswith("Z") or "+" in body["finished_at"]
    assert run.finished_at - run.created_at == timedelta(seconds=1)


def test_a_valid_surrogate_pair_is_text_and_is_kept(api: APIClient, version) -> None:
    body = b'{"workflow": "support_ticket", "input": {"ticket": "Q: \\ud83d\\ude00 ok"}}'
    response = api.generic("POST", "/api/v1/runs", body, content_type="application/json")
    assert response.status_code == 201, response.content
    assert Run.objects.get().input == {"ticket": "Q: \N{GRINNING FACE} ok"}
    assert api.get("/api/v1/runs").status_code == 200


@pytest.mark.parametrize(
    ("url", "raw", "field"),
    [
        ("/api/v1/events", b'{"name": "n", "key": "k", "payload": {"x": "\\ud800"}}', "payload.x"),
        ("/api/v1/events", b'{"name": "\\udfff", "key": "k"}', "name"),
        (
            "/api/v1/definitions",
            b'{"id": "s", "description": "\\ud800", "steps": []}',
            "description",
        ),
    ],
)
def test_lone_surrogates_are_a_400_on_every_body(
    api: APIClient, url: str, raw: bytes, field: str
) -> None:
    response = api.generic("POST", url, raw, content_type="application/json")
    assert response.status_code == 400, response.content
    assert field in _fields(response), response.json()
    assert "lone surrogate" in json.dumps(response.json())


def test_a_huge_number_or_id_is_refused_in_a_few_words(api: APIClient, version) -> None:
    body = b'{"workflow": "support_ticket", "input": {"n": %s}}' % (b"9" * 5000)
    response = api.generic("POST", "/api/v1/runs", body, content_type="application/json")
    assert response.status_code == 400, response.content
    assert "a number has more than 4300 digits" in response.content.decode()
    assert "sys." not in response.content.decode()
    long_id = "x" * 3000
    response = api.get(f"/api/v1/runs/{long_id}")
    assert response.status_code == 404
    assert len(response.content) < 300, response.content


def test_a_redos_pattern_in_input_schema_answers_within_a_second(api: APIClient) -> None:
    schema = {
        "type": "object",
        "required": ["ticket"],
        "properties": {"ticket": {"type": "string", "pattern": "^(a+)+$"}},
    }
    WorkflowVersionFactory(document=support_ticket_document(input_schema=schema))
    started = time.monotonic()
    response = api.post(
        "/api/v1/runs",
        {"workflow": "support_ticket", "input": {"ticket": "a" * 40 + "!"}},
        format="json",
    )
    assert time.monotonic() - started < 1.0
    assert response.status_code == 400
    assert _fields(response) == ["input.ticket"]
    assert not Run.objects.exists()


def test_a_stored_remote_ref_is_never_fetched_at_start(api: APIClient) -> None:
    """A document saved before remote ``$ref``s were refused still makes no request."""
    version = WorkflowVersionFactory()
    document = version.document
    with never_contacted() as ref:
        document["input_schema"]["properties"]["ticket"] = {"$ref": ref}
        type(version).objects.filter(pk=version.pk).update(document=document)
        response = api.post(
            "/api/v1/runs", {"workflow": "support_ticket", "input": {"ticket": "t"}}, format="json"
        )
    assert response.status_code == 400
    assert _fields(response) == ["input"]
    assert "not local" in response.json()["errors"][0]["message"]
    assert not Run.objects.exists()


def test_a_start_planned_in_the_request_answers_what_a_read_of_it_answers(
    api: APIClient, user, django_capture_on_commit_callbacks
) -> None:
    """POST /runs renders a run it planned from what the start wrote (selectors.run_as_planned)
    without the general read: the answer is the same as GET's, children filtered alike, in
    fewer statements (and no model or tool call read)."""
    from django.contrib.auth import get_user_model

    from workflows import access
    from workflows.services import definition_save

    leaf = {"id": "leaf", "steps": [{"id": "work", "kind": "task"}]}
    definition_save(document=leaf, user=user)
    definition_save(
        document={
            "id": "tree",
            "steps": [
                {"id": "sub", "kind": "subworkflow", "workflow": "leaf", "input": {}},
                {"id": "after", "kind": "task"},
            ],
        },
        user=user,
    )
    definition_save(document={"id": "flat", "steps": [{"id": "one", "kind": "task"}]}, user=user)
    # A starter of "tree" only: the child run of "leaf" is not theirs to see.
    bob = get_user_model().objects.create_user(username="bob", password="a-long-password-2")
    access.grant(access.STARTER, "tree", user=bob)
    access.grant(access.STARTER, "flat", user=bob)
    token, _ = Token.objects.get_or_create(user=bob)
    as_bob = APIClient()
    as_bob.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")

    for client, workflow, children in [
        (api, "flat", 0),
        (api, "tree", 1),
        (as_bob, "tree", 0),
    ]:
        with (
            mock.patch("workers.tasks.execute_step.apply_async"),
            django_capture_on_commit_callbacks(execute=True),
            CaptureQueriesContext(connection) as queries,
        ):
            started = client.post("/api/v1/runs", {"workflow": workflow}, format="json")
        assert started.status_code == 201, started.json()
        # Read now: the next request clears the connection's log (django.db.reset_queries).
        sql = [q["sql"] for q in queries.captured_queries]
        # ... and it holds this request's statements: what is asserted absent below could be seen.
        assert [q for q in sql if q.startswith('INSERT INTO "runs_run"')], sql
        body = started.json()
        read = client.get(f"/api/v1/runs/{body['id']}").json()
        assert body == read, (workflow, body, read)
        assert len(body["children"]) == children
        assert body["status"] in (RunStatus.RUNNING, RunStatus.WAITING) and body["steps"]
        assert not [q for q in sql if "runs_modelcall" in q or "runs_toolcall" in q], sql
        assert not [q for q in sql if "runs_runaction" in q], sql
