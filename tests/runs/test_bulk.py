"""Bulk cancel and retry (``POST /runs/cancel``, ``/runs/retry``, ``manage.py
start|cancel|retry``; runs.bulk): the count at request time, the batches (each its own
transaction, idempotent on a second delivery), the audit, the filters (the list's own, at
least one), and who may touch which runs. The end-to-end test on a real worker is
tests/runs/test_bulk_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any
from unittest import mock

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone
from rest_framework.test import APIClient

from runs import bulk
from runs.models import BulkAction, Run, RunAction
from runs.status import RunStatus, StepStatus
from workflows import access

from ..moves import unchecked
from ..test_access import api_for, person
from .factories import RunFactory, StepRunFactory, WorkflowVersionFactory, support_ticket_document


@pytest.fixture
def version(db):
    return WorkflowVersionFactory()


@pytest.fixture
def other_version(db):
    return WorkflowVersionFactory(document=support_ticket_document(id="billing"))


@pytest.fixture
def sent() -> Iterator[mock.Mock]:
    """The batch messages the on-commit callbacks send (bulk id, batch number)."""
    with mock.patch("runs.bulk.send") as send:
        yield send


def _fields(response: Any) -> list[str | None]:
    return [e.get("field") for e in response.json()["errors"]]


def _all_batches(bulk_id: Any) -> BulkAction:
    """Run the batches as the worker would, one message after another."""
    batch = 0
    while bulk.bulk_action_batch(bulk_id=bulk_id, batch=batch, send_next=False):
        batch += 1
    return BulkAction.objects.get(id=bulk_id)


def _statuses(runs: list[Run]) -> list[str]:
    return [Run.objects.get(id=run.id).status for run in runs]


# --- the request and the batches ----------------------------------------------------------


def test_a_bulk_cancel_counts_at_request_time_then_batches_cancel_and_audit(
    api: APIClient, user, version, other_version, sent, settings, django_capture_on_commit_callbacks
) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "BULK_BATCH": 2}
    live = [
        RunFactory(version=version, status=status)
        for status in (
            RunStatus.RUNNING,
            RunStatus.WAITING,
            RunStatus.PENDING,
            RunStatus.PAUSED,
            RunStatus.PENDING_APPROVAL,
        )
    ]
    for run in live:
        StepRunFactory(run=run, step_id="classify", status=StepStatus.SCHEDULED)
    ended = RunFactory(version=version, status=RunStatus.COMPLETED)
    elsewhere = RunFactory(version=other_version, status=RunStatus.RUNNING)

    with django_capture_on_commit_callbacks(execute=True):
        response = api.post("/api/v1/runs/cancel", {"workflow": "support_ticket"}, format="json")
    assert response.status_code == 202, response.json()
    body = response.json()
    assert (body["affected"], body["dry_run"]) == (5, False)
    action = BulkAction.objects.get(id=body["id"])
    assert (action.action, action.affected, action.requested_by) == ("cancel", 5, user)
    assert action.filters == {"workflow": "support_ticket"}
    # The request cancelled nothing: a worker does, batch by batch.
    assert set(_statuses(live)) != {RunStatus.CANCELLED}
    sent.assert_called_once_with(action.id, 0)

    sent.reset_mock()
    with django_capture_on_commit_callbacks(execute=True):
        assert bulk.bulk_action_batch(bulk_id=action.id, batch=0) is True
    sent.assert_called_once_with(action.id, 1)
    assert sorted(_statuses(live)).count(RunStatus.CANCELLED) == 2
    # The same message again (a redelivery) does nothing: its batch is done.
    sent.reset_mock()
    with django_capture_on_commit_callbacks(execute=True):
        assert bulk.bulk_action_batch(bulk_id=action.id, batch=0) is False
    sent.assert_not_called()
    assert sorted(_statuses(live)).count(RunStatus.CANCELLED) == 2

    with django_capture_on_commit_callbacks(execute=True):
        assert bulk.bulk_action_batch(bulk_id=action.id, batch=1) is True
        assert bulk.bulk_action_batch(bulk_id=action.id, batch=2) is False
    action.refresh_from_db()
    assert (action.done, action.skipped, action.batches) == (5, 0, 3)
    assert action.finished_at is not None
    assert _statuses(live) == [RunStatus.CANCELLED] * 5
    assert _statuses([ended, elsewhere]) == [RunStatus.COMPLETED, RunStatus.RUNNING]
    # Audited as a single cancel is, with the bulk action's id: who, and when.
    actions = RunAction.objects.filter(run__in=live)
    assert actions.count() == 5
    for row in actions:
        assert (row.action, row.actor, row.actor_name) == ("cancel", user, "ada")
        assert row.detail == {"bulk": str(action.id)}
        assert action.requested_at <= row.created_at
    # And shown on the run, as the API shows its actions.
    shown = api.get(f"/api/v1/runs/{live[0].id}").json()
    assert [(a["action"], a["by"], a["detail"]) for a in shown["actions"]] == [
        ("cancel", "ada", {"bulk": str(action.id)})
    ]
    # Its in-flight attempts were cancelled too (the single cancel's own service did it).
    assert not Run.objects.get(id=live[0].id).steps.exclude(status=StepStatus.CANCELLED).exists()


def test_runs_created_after_the_request_and_runs_ended_meanwhile_are_not_touched(
    api: APIClient, version, sent
) -> None:
    first = RunFactory(version=version, status=RunStatus.RUNNING)
    ends = RunFactory(version=version, status=RunStatus.RUNNING)
    response = api.post("/api/v1/runs/cancel", {"status": "running"}, format="json")
    assert response.json()["affected"] == 2
    later = RunFactory(version=version, status=RunStatus.RUNNING)
    with unchecked():
        Run.objects.filter(id=ends.id).update(status=RunStatus.COMPLETED)
    action = _all_batches(response.json()["id"])
    assert _statuses([first, ends, later]) == [
        RunStatus.CANCELLED,
        RunStatus.COMPLETED,
        RunStatus.RUNNING,
    ]
    assert (action.affected, action.done, action.skipped) == (2, 1, 1)


def test_a_bulk_retry_retries_failed_top_level_runs_only(
    api: APIClient, user, version, sent, django_capture_on_commit_callbacks
) -> None:
    failed = RunFactory(version=version, status=RunStatus.FAILED)
    StepRunFactory(run=failed, step_id="send", status=StepStatus.FAILED)
    sub = StepRunFactory(run=failed, step_id="sub", kind="subworkflow", status=StepStatus.FAILED)
    child = RunFactory(
        version=version, status=RunStatus.FAILED, parent_run=failed, parent_step_run=sub
    )
    completed = RunFactory(version=version, status=RunStatus.COMPLETED)
    with mock.patch("runs.tasks.advance.apply_async"):
        response = api.post("/api/v1/runs/retry", {"workflow": "support_ticket"}, format="json")
        assert response.json()["affected"] == 1, response.json()
        action = _all_batches(response.json()["id"])
    failed.refresh_from_db()
    assert (failed.status, failed.generation) == (RunStatus.RUNNING, 2)
    assert _statuses([child, completed]) == [RunStatus.FAILED, RunStatus.COMPLETED]
    row = RunAction.objects.get(run=failed)
    assert (row.action, row.actor) == ("retry", user)
    assert row.detail == {"generation": 2, "bulk": str(action.id)}


def test_a_run_a_batch_fails_on_is_marked_and_the_batch_goes_on(user, version, sent) -> None:
    """A bulk retry of three failed runs, one of which the database refuses to change (a
    trigger, as a DBA's rule or a constraint would): the other two are retried, the refused
    one logged, counted, marked and skipped, and the action finishes. Before, the database
    error rolled the whole batch back, and the reconciler's re-offer ran it into the same run
    again, forever."""
    from runs.models import RunFault

    from .refusals import refuse

    runs = [RunFactory(version=version, status=RunStatus.FAILED) for _ in range(3)]
    for run in runs:
        StepRunFactory(run=run, step_id="send", status=StepStatus.FAILED)
    poison = runs[1]
    refuse(table="runs_run", event="UPDATE", column="id", value=poison.id)
    started = bulk.bulk_action_start(action="retry", user=user, send=False, status="failed")
    assert started.action is not None
    with mock.patch("runs.tasks.advance.apply_async"):
        action = _all_batches(started.action.id)
    assert action.finished_at is not None and (action.done, action.skipped) == (2, 1)
    assert _statuses(runs) == [RunStatus.RUNNING, RunStatus.FAILED, RunStatus.RUNNING]
    fault = RunFault.objects.get(run=poison)
    assert fault.pass_name == "bulk_action" and "refused by a trigger" in fault.error
    assert list(RunAction.objects.filter(run=poison).values_list("action", flat=True)) == [
        "pass_failed"
    ]


def test_a_dry_run_counts_and_changes_nothing(api: APIClient, version, sent) -> None:
    runs = [RunFactory(version=version, status=RunStatus.RUNNING) for _ in range(3)]
    response = api.post(
        "/api/v1/runs/cancel", {"workflow": "support_ticket", "dry_run": True}, format="json"
    )
    assert response.status_code == 200
    assert response.json() == {"affected": 3, "id": None, "dry_run": True}
    assert not BulkAction.objects.exists()
    assert _statuses(runs) == [RunStatus.RUNNING] * 3
    sent.assert_not_called()


def test_nothing_matched_is_affected_0_and_no_action(api: APIClient, version, sent) -> None:
    response = api.post("/api/v1/runs/cancel", {"workflow": "nope"}, format="json")
    assert (response.status_code, response.json()["affected"]) == (200, 0)
    assert not BulkAction.objects.exists()


def test_the_filters_are_the_lists_own(api: APIClient, version, sent) -> None:
    now = timezone.now()
    old = RunFactory(version=version, created_at=now - timedelta(days=3), account="acme")
    mid = RunFactory(version=version, created_at=now - timedelta(days=2), account="acme")
    RunFactory(version=version, created_at=now - timedelta(days=2), account="globex")
    RunFactory(version=version, created_at=now - timedelta(hours=1), account="acme")
    window = {
        "account": "acme",
        "created_after": (now - timedelta(days=4)).isoformat(),
        "created_before": (now - timedelta(days=1)).isoformat(),
    }
    listed = api.get("/api/v1/runs", window)
    assert listed.status_code == 200, listed.json()
    assert [r["id"] for r in listed.json()["results"]] == [str(mid.id), str(old.id)]
    response = api.post("/api/v1/runs/cancel", window, format="json")
    assert response.json()["affected"] == 2
    _all_batches(response.json()["id"])
    assert set(Run.objects.filter(status=RunStatus.CANCELLED)) == {old, mid}


# --- bad requests -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/v1/runs/cancel", "/api/v1/runs/retry"])
@pytest.mark.parametrize("body", [{}, {"dry_run": True}, {"dry_run": False}])
def test_a_request_with_no_filter_is_a_400_naming_the_filters(
    api: APIClient, version, sent, path: str, body: dict[str, Any]
) -> None:
    running = RunFactory(version=version, status=RunStatus.RUNNING)
    response = api.post(path, body, format="json")
    assert response.status_code == 400
    assert _fields(response) == ["filters"]
    assert "workflow" in response.json()["errors"][0]["message"]
    assert _statuses([running]) == [RunStatus.RUNNING]
    assert not BulkAction.objects.exists()


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/v1/runs/cancel", {"status": "completed"}, "status"),
        ("/api/v1/runs/retry", {"status": "running"}, "status"),
        ("/api/v1/runs/cancel", {"status": "bogus"}, "status"),
        ("/api/v1/runs/cancel", {"workflow": "x", "colour": "red"}, "colour"),
        ("/api/v1/runs/cancel", {"created_after": "yesterday"}, "created_after"),
        (
            "/api/v1/runs/cancel",
            {"created_after": "2026-01-02T00:00:00Z", "created_before": "2026-01-01T00:00:00Z"},
            "created_before",
        ),
        ("/api/v1/runs/cancel", {"workflow": "x" * 101}, "workflow"),
        ("/api/v1/runs/retry", {"workflow": "x", "dry_run": "perhaps"}, "dry_run"),
        ("/api/v1/runs/cancel", ["workflow"], "body"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(
    api: APIClient, sent, path: str, body: Any, field: str
) -> None:
    response = api.post(path, body, format="json")
    assert response.status_code == 400, response.json()
    assert _fields(response) == [field]
    assert not BulkAction.objects.exists()


@pytest.mark.parametrize("path", ["/api/v1/runs/cancel", "/api/v1/runs/retry"])
def test_authentication_is_required(anon_api: APIClient, path: str) -> None:
    assert anon_api.post(path, {"workflow": "x"}, format="json").status_code == 401


# --- who may touch which runs -------------------------------------------------------------


@pytest.fixture
def team(version) -> dict[str, Any]:
    """Bob and Carol start runs of support_ticket (starters: each operates their own),
    Olga operates every run of it, Vic only reads them, Nadia holds no role."""
    people = {name: person(name) for name in ("bob", "carol", "olga", "vic", "nadia")}
    access.grant("starter", "support_ticket", user=people["bob"])
    access.grant("starter", "support_ticket", user=people["carol"])
    access.grant("operator", "support_ticket", user=people["olga"])
    access.grant("viewer", "support_ticket", user=people["vic"])
    return people


def _runs_of(version: Any, user: Any, n: int, status: str = RunStatus.RUNNING) -> list[Run]:
    return [RunFactory(version=version, status=status, created_by=user) for _ in range(n)]


def test_an_ordinary_users_bulk_cancel_touches_none_of_anothers_runs(version, team, sent) -> None:
    bobs = _runs_of(version, team["bob"], 2)
    carols = _runs_of(version, team["carol"], 3)
    response = api_for(team["bob"]).post(
        "/api/v1/runs/cancel", {"workflow": "support_ticket"}, format="json"
    )
    assert response.json()["affected"] == 2
    _all_batches(response.json()["id"])
    assert _statuses(bobs) == [RunStatus.CANCELLED] * 2
    assert _statuses(carols) == [RunStatus.RUNNING] * 3
    assert not RunAction.objects.filter(run__in=carols).exists()


@pytest.mark.parametrize(("name", "affected"), [("olga", 5), ("vic", 0), ("nadia", 0)])
def test_an_operator_affects_every_run_a_viewer_or_stranger_none(
    version, team, sent, name: str, affected: int
) -> None:
    runs = _runs_of(version, team["bob"], 2) + _runs_of(version, team["carol"], 3)
    response = api_for(team[name]).post("/api/v1/runs/cancel", {"status": "running"}, format="json")
    assert response.json()["affected"] == affected
    if affected:
        _all_batches(response.json()["id"])
    assert _statuses(runs).count(RunStatus.CANCELLED) == affected


def test_a_permission_lost_before_the_batch_leaves_the_run_alone(version, team, sent) -> None:
    runs = _runs_of(version, team["carol"], 2)
    response = api_for(team["olga"]).post(
        "/api/v1/runs/cancel", {"workflow": "support_ticket"}, format="json"
    )
    assert response.json()["affected"] == 2
    access.revoke("operator", "support_ticket", user=team["olga"])
    action = _all_batches(response.json()["id"])
    assert _statuses(runs) == [RunStatus.RUNNING] * 2
    assert (action.done, action.skipped, action.finished_at is not None) == (0, 2, True)


def test_an_action_whose_requester_was_deleted_does_nothing_more(version, team, sent) -> None:
    runs = _runs_of(version, team["carol"], 2)
    response = api_for(team["olga"]).post(
        "/api/v1/runs/cancel", {"workflow": "support_ticket"}, format="json"
    )
    team["olga"].delete()
    action = _all_batches(response.json()["id"])
    # Not "trusted code acting for no one": no one is left to act for.
    assert _statuses(runs) == [RunStatus.RUNNING] * 2
    assert (action.done, action.finished_at is not None) == (0, True)


# --- a lost message -----------------------------------------------------------------------


def test_the_reconciler_offers_an_idle_action_again_once(version, user, sent, settings) -> None:
    RunFactory(version=version, status=RunStatus.RUNNING)
    started = bulk.bulk_action_start(action="cancel", user=user, send=False, status="running")
    assert started.action is not None
    now = timezone.now()
    assert bulk.reoffer_idle(now, 10) == 0  # just asked for: its message may be on its way
    later = now + timedelta(seconds=settings.DJFLOW["LOST_MESSAGE_SECONDS"] + 1)
    assert bulk.reoffer_idle(later, 10) == 1
    sent.assert_called_once_with(started.action.id, 0)
    assert bulk.reoffer_idle(later, 10) == 0  # claimed: offered once
    _all_batches(started.action.id)
    assert bulk.reoffer_idle(later + timedelta(hours=1), 10) == 0  # finished


# --- the commands -------------------------------------------------------------------------


def _call(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.mark.start_checks_workers(False)
def test_start_prints_the_run_id_and_answers_to_the_users_permissions(version, team, user) -> None:
    out = _call("start", "support_ticket", "--input", '{"ticket": "T-9"}', "--user", "bob")
    run = Run.objects.get(id=out.strip())
    assert (run.created_by, run.input) == (team["bob"], {"ticket": "T-9"})
    with pytest.raises(CommandError, match="workflow"):
        _call("start", "support_ticket", "--input", '{"ticket": "T-9"}', "--user", "vic")
    with pytest.raises(CommandError, match=r"input\.ticket"):
        _call("start", "support_ticket", "--input", "{}", "--user", "bob")
    with pytest.raises(CommandError, match="--input: Malformed JSON"):
        _call("start", "support_ticket", "--input", "{", "--user", "bob")
    with pytest.raises(CommandError, match="no active user 'ghost'"):
        _call("start", "support_ticket", "--user", "ghost")
    urgent = _call(
        "start",
        "support_ticket",
        "--input",
        '{"ticket": "T-1"}',
        "--priority",
        "9",
        "--user",
        "bob",
    )
    assert Run.objects.get(id=urgent.strip()).priority == 9
    with pytest.raises(CommandError, match="priority"):
        _call("start", "support_ticket", "--input", "{}", "--priority", "10", "--user", "bob")


@pytest.mark.parametrize(
    "text",
    ['{"ticket": "T\\u0000"}', '{"ticket": "\\ud800"}', '{"ticket": NaN}', "[" * 100_000],
)
def test_start_refuses_an_input_the_api_would_refuse_naming_it(version, team, text) -> None:
    # The API's parser refuses these (CONTRACT section 9); here they reached the database
    # (a DataError) or the parser's recursion, a traceback instead of the command's error.
    with pytest.raises(CommandError, match="--input"):
        _call("start", "support_ticket", "--input", text, "--user", "bob")
    assert not Run.objects.exists()


def test_cancel_and_retry_commands_act_as_the_named_user(version, team, sent) -> None:
    bobs = _runs_of(version, team["bob"], 2)
    carols = _runs_of(version, team["carol"], 1)
    dry = _call("cancel", "--workflow", "support_ticket", "--dry-run", "--user", "bob")
    assert dry.splitlines() == ["affected: 2"]
    assert _statuses(bobs) == [RunStatus.RUNNING] * 2
    out = _call("cancel", "--workflow", "support_ticket", "--user", "bob").splitlines()
    assert (out[0], out[2], out[3]) == ("affected: 2", "cancelled: 2", "passed over: 0")
    assert _statuses(bobs) == [RunStatus.CANCELLED] * 2
    assert _statuses(carols) == [RunStatus.RUNNING]
    assert RunAction.objects.filter(run__in=bobs, actor=team["bob"]).count() == 2
    sent.assert_not_called()  # done in the foreground, no worker needed

    failed = _runs_of(version, team["carol"], 1, status=RunStatus.FAILED)
    with mock.patch("runs.tasks.advance.apply_async"):
        out = _call("retry", "--status", "failed", "--user", "carol").splitlines()
    assert (out[0], out[2]) == ("affected: 1", "retried: 1")
    assert _statuses(failed) == [RunStatus.RUNNING]


def test_a_command_does_every_batch_in_the_foreground(version, team, sent, settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "BULK_BATCH": 2}
    runs = _runs_of(version, team["bob"], 5)
    out = _call("cancel", "--workflow", "support_ticket", "--user", "olga").splitlines()
    assert (out[0], out[2]) == ("affected: 5", "cancelled: 5")
    assert _statuses(runs) == [RunStatus.CANCELLED] * 5
    assert BulkAction.objects.get().batches == 3
    sent.assert_not_called()


def test_the_bulk_commands_refuse_what_the_api_refuses(version, team, sent) -> None:
    with pytest.raises(CommandError, match="filters: name at least one filter"):
        _call("cancel", "--user", "olga")
    with pytest.raises(CommandError, match="--created-after"):
        _call("cancel", "--created-after", "soon", "--user", "olga")
    with pytest.raises(CommandError, match="status: a completed run cannot be cancelled"):
        _call("cancel", "--status", "completed", "--user", "olga")
    with pytest.raises(CommandError, match="no active user"):
        _call("cancel", "--workflow", "support_ticket", "--user", "ghost")


def test_the_background_flag_hands_the_batches_to_workers(version, team, sent) -> None:
    _runs_of(version, team["bob"], 1)
    out = _call("cancel", "--workflow", "support_ticket", "--background", "--user", "olga")
    action = BulkAction.objects.get()
    assert out.splitlines() == ["affected: 1", f"bulk action: {action.id}"]
    assert action.finished_at is None


def test_openapi_documents_the_bulk_endpoints(api: APIClient) -> None:
    schema = api.get("/api/v1/schema/", {"format": "json"}).json()
    for name in ("cancel", "retry"):
        operation = schema["paths"][f"/api/v1/runs/{name}"]["post"]
        assert operation["operationId"] == f"runs_bulk_{name}"
        assert "at least one" in operation["description"]
        assert {"202", "200", "400"} <= set(operation["responses"])


def test_the_bulk_actions_take_every_filter_of_the_list_and_only_those() -> None:
    """One list of filters: a filter added to GET /runs is a filter of the bulk actions."""
    from runs.selectors import RUN_LIST_FILTERS
    from runs.serializers import BulkRunsSerializer, RunListQuerySerializer

    assert set(RunListQuerySerializer().fields) == set(RUN_LIST_FILTERS) == set(bulk.FILTERS)
    assert set(BulkRunsSerializer().fields) == {*RUN_LIST_FILTERS, "dry_run"}


def test_the_requester_reads_the_actions_progress_and_no_one_else(
    version, team, sent, admin_user
) -> None:
    _runs_of(version, team["bob"], 2)
    bob = api_for(team["bob"])
    action_id = bob.post("/api/v1/runs/cancel", {"workflow": "support_ticket"}, format="json")
    path = f"/api/v1/runs/bulk/{action_id.json()['id']}"
    before = bob.get(path)
    assert before.status_code == 200
    assert before.json() | {"requested_at": None} == {
        "id": action_id.json()["id"],
        "action": "cancel",
        "filters": {"workflow": "support_ticket"},
        "requested_by": "bob",
        "requested_at": None,
        "affected": 2,
        "done": 0,
        "skipped": 0,
        "batches": 0,
        "finished_at": None,
    }
    _all_batches(action_id.json()["id"])
    after = bob.get(path).json()
    assert (after["done"], after["batches"], after["finished_at"] is not None) == (2, 1, True)
    # Another user, even the workflow's operator, does not learn it exists; a superuser does.
    assert api_for(team["olga"]).get(path).status_code == 404
    assert api_for(admin_user).get(path).status_code == 200
    missing = bob.get("/api/v1/runs/bulk/not-a-uuid")
    assert (missing.status_code, _fields(missing)) == (404, ["id"])
    assert APIClient().get(path).status_code == 401


@pytest.mark.parametrize("name", ["cancel", "retry"])
def test_reading_a_run_named_like_a_bulk_action_is_a_404_not_a_405(api: APIClient, name) -> None:
    """GET /runs/{id} documents 200, 401 and 404: a run id that is a bulk route's name reads
    no run (schemathesis drew it and got the bulk route's 405)."""
    response = api.get(f"/api/v1/runs/{name}")
    assert response.status_code == 404, response.content
    assert list(response.json()) == ["errors"]
