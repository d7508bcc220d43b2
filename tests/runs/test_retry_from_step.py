"""Retry from a step with an edited input, and its dry run (CONTRACT section 11,
``POST /runs/{id}/retry {from_step, input, dry_run}``), in one process: each attempt is run
here (offers to workers are not sent). On real worker processes: ``test_retry_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from unittest import mock

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs import services
from runs.engine.plan import AttemptView, Open, RunView, Schedule, Skip, plan
from runs.models import Run, RunAction, StepRun
from runs.status import RunStatus
from tests.moves import unchecked
from workers.execution import execute
from workflows import access, registry
from workflows.secrets import MASK, TOKEN

from . import flows_retry as flows
from .flows import effects, ensure_effects_table

pytestmark = pytest.mark.django_db

INPUT = {"topic": "old", "key": flows.KEY}


@pytest.fixture(autouse=True)
def saved(db: Any) -> Iterator[None]:
    ensure_effects_table()
    for step_id, fn in [("one", flows.one), ("two", flows.two), ("three", flows.three)]:
        registry.register("rerun_flow", step_id, fn)
    flows.rerun.save()
    with mock.patch("workers.tasks.execute_step.apply_async"):
        yield


def drive(run_id: Any) -> Run:
    """Run every scheduled attempt here until none is left."""
    for _ in range(20):
        row = StepRun.objects.filter(run_id=run_id, status="scheduled").first()
        if row is None:
            break
        execute(row.id, worker="here")
    return Run.objects.get(id=run_id)


def advanced(run_id: Any) -> Run:
    """The advance a retry sends after commit, made here."""
    from runs.engine.advance import run_advance

    run_advance(run_id=run_id)
    return drive(run_id)


def completed_run(api: APIClient) -> Run:
    answer = api.post("/api/v1/runs", {"workflow": "rerun_flow", "input": INPUT}, format="json")
    assert answer.status_code == 201, answer.content
    run = drive(answer.json()["id"])
    assert run.status == "completed", run.error
    return run


def journal(run: Run) -> list[tuple[str, int, int, str]]:
    return list(run.steps.order_by("id").values_list("step_id", "attempt", "generation", "status"))


def every_row() -> str:
    rows = []
    for model in apps.get_models(include_auto_created=True):
        rows.extend(repr(row) for row in model._base_manager.order_by("pk").values())
    return "\n".join(rows)


def client_for(user: Any) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return client


def person(name: str, role: str | None = None) -> Any:
    someone = get_user_model().objects.create_user(username=name, password="a-long-password-1")
    if role is not None:
        access.grant(role, "rerun_flow", user=someone)
    return someone


def retry(api: APIClient, run: Run, body: Any = None) -> Any:
    return api.post(f"/api/v1/runs/{run.id}/retry", body, format="json")


def fields(answer: Any) -> list[str | None]:
    return [error.get("field") for error in answer.json()["errors"]]


# --- retry from a step --------------------------------------------------------------------------


def test_a_completed_run_reruns_from_a_step_against_the_edited_input(api, user) -> None:
    run = completed_run(api)
    first_output = run.steps.get(step_id="one").output
    answer = retry(api, run, {"from_step": "two", "input": {"topic": "new"}})
    assert answer.status_code == 200, answer.content
    assert answer.json()["status"] == "running" and answer.json()["generation"] == 2
    run = advanced(run.id)
    assert run.status == "completed", run.error
    # One kept its output (from the old input); two and three ran again on the new one.
    assert run.output == {"third": "new", "first": "old", "key": flows.digest(flows.KEY)}
    assert run.steps.get(step_id="one").output == first_output == {"first": "old"}
    assert journal(run) == [
        ("one", 1, 1, "succeeded"),
        ("two", 1, 1, "succeeded"),
        ("three", 1, 1, "succeeded"),
        ("two", 2, 2, "succeeded"),
        ("three", 2, 2, "succeeded"),
    ]
    assert [row[0] for row in effects(run.id)] == ["one", "two", "three", "two", "three"]
    # The secret the edit left out was kept: the handler got the same key.
    assert run.steps.get(step_id="two", attempt=2).output["key"] == flows.digest(flows.KEY)
    assert run.reruns == [{"generation": 2, "from_step": "two"}]
    action = RunAction.objects.get(run=run, action="retry")
    assert action.actor_name == "ada"
    assert action.detail["from_step"] == "two" and action.detail["generation"] == 2
    assert action.detail["input_changes"] == [
        {"field": "input.topic", "before": "old", "after": "new"}
    ]
    shown = api.get(f"/api/v1/runs/{run.id}").json()
    assert shown["input"] == {"topic": "new", "key": MASK}
    assert shown["actions"][-1]["detail"]["from_step"] == "two"
    # The trace marks the superseded attempts.
    spans = api.get(f"/api/v1/runs/{run.id}/trace").json()["spans"]
    marked = {
        (s["step_id"], s["attempt"]): s["attributes"]["superseded"]
        for s in spans
        if s["kind"] == "attempt"
    }
    assert marked == {
        ("one", 1): False,
        ("two", 1): True,
        ("three", 1): True,
        ("two", 2): False,
        ("three", 2): False,
    }


def test_a_second_retry_from_an_earlier_step_supersedes_both_generations(api) -> None:
    run = completed_run(api)
    assert retry(api, run, {"from_step": "three"}).status_code == 200
    run = advanced(run.id)
    assert retry(api, run, {"from_step": "one", "input": {"topic": "third"}}).status_code == 200
    run = advanced(run.id)
    assert run.status == "completed" and run.generation == 3
    assert run.output["third"] == "third" and run.output["first"] == "third"
    assert [(s, a, g) for s, a, g, _ in journal(run)][-3:] == [
        ("one", 2, 3),
        ("two", 2, 3),
        ("three", 3, 3),
    ]


def test_a_failed_cancelled_or_timed_out_run_may_be_retried_from_a_step(api) -> None:
    for status in (RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMED_OUT):
        run = completed_run(api)
        with unchecked():
            Run.objects.filter(id=run.id).update(status=status)
        answer = retry(api, run, {"from_step": "three"})
        assert answer.status_code == 200, (status, answer.content)
        assert advanced(run.id).status == "completed"


def test_a_secret_sent_masked_is_kept_and_a_new_one_replaces_it(api) -> None:
    run = completed_run(api)
    stored = Run.objects.get(id=run.id).input["key"]
    preview = retry(api, run, {"from_step": "two", "input": {"topic": "x", "key": MASK}})
    assert preview.status_code == 200
    run = advanced(run.id)
    assert Run.objects.get(id=run.id).input["key"] == stored  # the same token: unchanged
    answer = retry(
        api,
        run,
        {"from_step": "two", "input": {"topic": "x", "key": "sk-other"}, "dry_run": True},
    )
    assert answer.json()["input_changes"] == [{"field": "input.key", "before": MASK, "after": MASK}]
    assert "sk-other" not in answer.content.decode() and not TOKEN.search(answer.content.decode())


def test_a_step_inside_a_body_reruns_its_enclosing_top_level_step() -> None:
    document = {
        "id": "nest",
        "steps": [
            {"id": "a", "kind": "task", "handler": "h"},
            {
                "id": "fan",
                "kind": "foreach",
                "items": "${input.items}",
                "do": {"id": "inner", "kind": "task", "handler": "h"},
            },
            {"id": "last", "kind": "task", "handler": "h", "when": {"path": "input.go"}},
        ],
    }
    old = [
        AttemptView(1, "a", 1, "succeeded", output=1),
        AttemptView(2, "fan", 1, "succeeded", kind="foreach", output=[1]),
        AttemptView(3, "inner", 1, "succeeded", path="fan[0]/", output=1),
        AttemptView(4, "last", 1, "succeeded", output=2),
    ]
    view = RunView(
        id="r",
        status="running",
        input={"items": [5, 6], "go": False},
        correlation=None,
        generation=2,
        started_at=None,
        deadline_at=None,
        reruns=((2, "fan"),),
    )
    now = datetime(2026, 1, 1, tzinfo=UTC)
    planned = plan(document, view, old, now)
    # The foreach opens again (attempt 2), its items run again (item 0 numbered on from 1).
    [opened] = [a for a in planned.of(Open) if a.step_id == "fan"]
    assert opened.attempt == 2 and opened.generation == 2
    scheduled = {(a.path, a.step_id): a.attempt for a in planned.of(Schedule)}
    assert scheduled == {("fan[0]/", "inner"): 2, ("fan[1]/", "inner"): 1}
    # Planned on to its end (the items succeeded): the guard of "last" is evaluated afresh.
    done = [
        *old,
        AttemptView(5, "fan", 2, "running", kind="foreach", generation=2),
        AttemptView(6, "inner", 2, "succeeded", path="fan[0]/", generation=2, output=7),
        AttemptView(7, "inner", 1, "succeeded", path="fan[1]/", generation=2, output=8),
    ]
    planned = plan(document, view, done, now)
    [skip] = planned.of(Skip)
    assert (skip.step_id, skip.attempt) == ("last", 2)
    # "a", before it, is kept: nothing is planned for it.
    assert not [a for a in planned.actions if getattr(a, "step_id", None) == "a"]


def test_a_nested_from_step_is_taken_as_its_top_level_step(api) -> None:
    from runs.retries import restart_at

    steps = [
        {"id": "a", "kind": "task"},
        {"id": "c", "kind": "condition", "if": {}, "then": [{"id": "b", "kind": "task"}]},
    ]
    assert restart_at(steps, [], "b") == "c"


# --- the dry run --------------------------------------------------------------------------------


def test_the_dry_run_answers_what_would_change_and_changes_nothing(api) -> None:
    run = completed_run(api)
    before = every_row()
    answer = retry(api, run, {"from_step": "two", "input": {"topic": "new"}, "dry_run": True})
    assert answer.status_code == 200, answer.content
    assert answer.json() == {
        "dry_run": True,
        "generation": 2,
        "restart_at": "two",
        "rerun": ["two", "three"],
        "kept": ["one"],
        "input_changes": [{"field": "input.topic", "before": "old", "after": "new"}],
        "step_inputs": [
            {
                "step": "two",
                "path": "",
                "before": {"topic": "old", "key": MASK},
                "after": {"topic": "new", "key": MASK},
            }
        ],
    }
    assert every_row() == before


def test_the_dry_run_of_a_plain_retry_names_the_failed_step(api) -> None:
    run = completed_run(api)
    with unchecked():
        Run.objects.filter(id=run.id).update(status=RunStatus.FAILED)
        StepRun.objects.filter(run=run, step_id="three").update(status="failed")
    answer = retry(api, run, {"dry_run": True})
    assert answer.status_code == 200, answer.content
    assert (answer.json()["rerun"], answer.json()["kept"]) == (["three"], ["one", "two"])
    assert answer.json()["input_changes"] == []


def test_the_service_answers_a_preview(api) -> None:
    run = completed_run(api)
    preview = services.run_retry(run_id=run.id, from_step="one", dry_run=True)
    assert isinstance(preview, services.RetryPreview)
    assert preview.rerun == ["one", "two", "three"] and preview.kept == []


# --- what is refused ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"from_step": "nope"}, "from_step"),
        ({"from_step": 3}, "from_step"),
        ({"from_step": "two", "input": [1]}, "input"),
        ({"from_step": "two", "input": "text"}, "input"),
        ({"from_step": "two", "input": None}, "input"),
        ({"from_step": "two", "input": {"topic": ""}}, "input.topic"),
        ({"from_step": "two", "input": {"topic": "x", "key": "not-sk"}}, "input.key"),
        ({"from_step": "two", "input": {"topic": "x", "extra": 1}}, "input"),
        ({"from_step": "two", "dry_run": "yes"}, "dry_run"),
        ({"from_step": "two", "when": "now"}, "when"),
        ([1], "body"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(api, body: Any, field: str) -> None:
    run = completed_run(api)
    before = every_row()
    answer = retry(api, run, body)
    assert answer.status_code == 400, answer.content
    assert field in fields(answer)
    assert flows.KEY not in answer.content.decode()
    assert every_row() == before


@pytest.mark.parametrize("status", ["pending", "running", "waiting", "pending_approval", "paused"])
def test_a_run_that_has_not_ended_is_a_409(api, status: str) -> None:
    run = completed_run(api)
    with unchecked():
        Run.objects.filter(id=run.id).update(status=status)
    for body in ({"from_step": "two"}, {"from_step": "two", "dry_run": True}, None):
        answer = retry(api, run, body)
        assert answer.status_code == 409, (body, answer.content)
        assert fields(answer) == ["status"]


def test_a_plain_retry_of_a_completed_run_is_a_409(api) -> None:
    run = completed_run(api)
    answer = retry(api, run, {"input": {"topic": "x"}})
    assert answer.status_code == 409 and fields(answer) == ["status"]
    assert retry(api, run).status_code == 409


def test_a_child_run_is_retried_through_its_parent(api) -> None:
    parent, child = completed_run(api), completed_run(api)
    with unchecked():
        Run.objects.filter(id=child.id).update(parent_run=parent, root_run=parent)
    answer = retry(api, child, {"from_step": "two"})
    assert answer.status_code == 409 and fields(answer) == ["id"]


def test_a_viewer_gets_a_403_a_stranger_a_404(api) -> None:
    run = completed_run(api)
    viewer, stranger = client_for(person("vic", "viewer")), client_for(person("sam"))
    before = every_row()
    for client, code in ((viewer, 403), (stranger, 404)):
        for body in ({"from_step": "two"}, {"from_step": "two", "dry_run": True}):
            answer = retry(client, run, body)
            assert answer.status_code == code, answer.content
    assert retry(stranger, run, {"from_step": "nope"}).status_code == 404
    assert every_row() == before
    operator = client_for(person("opal", "operator"))
    assert retry(operator, run, {"from_step": "two", "dry_run": True}).status_code == 200


def test_an_unknown_or_malformed_run_is_a_404(api) -> None:
    for run_id in ("not-a-uuid", "00000000-0000-0000-0000-000000000000"):
        answer = api.post(f"/api/v1/runs/{run_id}/retry", {"from_step": "two"}, format="json")
        assert answer.status_code == 404 and fields(answer) == ["id"]


def test_a_step_before_from_step_that_did_not_settle_runs_again_too(api) -> None:
    run = completed_run(api)
    with unchecked():
        Run.objects.filter(id=run.id).update(status=RunStatus.CANCELLED)
        StepRun.objects.filter(run=run, step_id="two").update(status="cancelled")
    answer = retry(api, run, {"from_step": "three", "dry_run": True})
    assert (answer.json()["rerun"], answer.json()["kept"]) == (["two", "three"], ["one"])
    assert retry(api, run, {"from_step": "three"}).status_code == 200
    run = advanced(run.id)
    assert run.status == "completed", run.error
    assert [(s, a, g) for s, a, g, _ in journal(run)][-2:] == [("two", 2, 2), ("three", 2, 2)]


def test_an_edit_of_a_run_whose_secrets_this_key_cannot_open_is_a_409(api, settings) -> None:
    run = completed_run(api)
    settings.DJFLOW_FIELD_KEY = ["another-key-of-at-least-32-characters!"]
    answer = retry(api, run, {"from_step": "two", "input": {"topic": "x"}})
    assert answer.status_code == 409 and fields(answer) == ["input"]
    assert "DJFLOW_FIELD_KEY" in answer.json()["errors"][0]["message"]


def test_an_operator_who_is_neither_author_nor_starter_gives_the_secrets_again(api) -> None:
    """Editing the input while keeping a stored secret would let an operator point the
    secret somewhere of their choosing (a step's address, say) without ever seeing it: only
    the workflow's authors (their code has the secret anyway) and the run's starter (who gave
    it) keep it; an operator names it again."""
    run = completed_run(api)  # started by `api`'s user, the workflow's author
    olga = client_for(person("olga", "operator"))
    for kept in ({"topic": "elsewhere"}, {"topic": "elsewhere", "key": MASK}):
        for dry_run in (True, False):
            answer = retry(olga, run, {"from_step": "two", "input": kept, "dry_run": dry_run})
            assert answer.status_code == 400, answer.content
            assert fields(answer) == ["input.key"]
            assert "give it again" in answer.json()["errors"][0]["message"]
    assert Run.objects.get(id=run.id).generation == 1
    # The same input (nothing edited) keeps it: that is a plain retry from the step.
    same = retry(olga, run, {"from_step": "two", "input": {"topic": "old"}, "dry_run": True})
    assert same.status_code == 200, same.content
    # The secret given again: the edit goes through.
    again = {"topic": "elsewhere", "key": "sk-given-again-1"}
    answer = retry(olga, run, {"from_step": "two", "input": again, "dry_run": True})
    assert answer.status_code == 200, answer.content
    # The starter (here also the author) keeps it without naming it.
    assert retry(api, run, {"from_step": "two", "input": {"topic": "x"}}).status_code == 200


def _locks(sql: str) -> bool:
    """A row lock, whichever strength (runs are locked FOR NO KEY UPDATE since issue 36)."""
    return "FOR UPDATE" in sql or "FOR NO KEY UPDATE" in sql


def test_a_dry_run_takes_no_lock_and_a_retry_does(api) -> None:
    """A preview writes nothing: holding the run's row lock would keep its workers from
    recording while it plans."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    run = completed_run(api)
    body = {"from_step": "two", "input": {"topic": "x"}}
    # Each capture is read before the next request, which clears the connection's query log
    # (django.db.reset_queries on request_started) that captured_queries reads lazily.
    with CaptureQueriesContext(connection) as preview:
        assert retry(api, run, {**body, "dry_run": True}).status_code == 200
    previewed = [q["sql"] for q in preview.captured_queries]
    # The preview read the run (the log is this request's), and locked nothing.
    assert [q for q in previewed if 'FROM "runs_run"' in q], previewed
    assert not [q for q in previewed if _locks(q)], previewed
    with CaptureQueriesContext(connection) as real:
        assert retry(api, run, body).status_code == 200
    retried = [q["sql"] for q in real.captured_queries]
    assert [q for q in retried if _locks(q)], retried
