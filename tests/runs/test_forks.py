"""Forks (contract section 16, issue 38): ``POST /runs/{id}/fork`` starts a new run of an
ended run that reuses the recorded outputs of the steps before ``from_step`` and runs the rest,
on another saved version or recipe version if asked. The runs here run in process through the
``djflow`` fixture (the engine's own planner, applier and kinds)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import TestCase
from rest_framework.test import APIClient

from runs import forks
from runs.models import Run, StepRun
from workflows.errors import InvalidInput
from workflows.sdk import workflow
from workflows.services import definition_save, recipe_save

calls: list[str] = []

triage = workflow("fk_triage")
triage.task("fetch")
triage.recipe("draft", recipe="fk_reply")
triage.task("send", input={"text": "${steps.draft.output}", "who": "${steps.fetch.output.who}"})
triage.output({"sent": "${steps.send.output}"})


@triage.handler("fetch")
def fetch(ctx: Any, input: Any, prior: Any) -> Any:
    calls.append("fetch")
    return {"who": f"customer {len(calls)}"}


@triage.handler("send")
def send(ctx: Any, input: Any, prior: Any) -> Any:
    calls.append("send")
    return f"to {input['who']}: {input['text']}"


@pytest.fixture
def recipes(db: Any) -> None:
    for prompt in ("Reply kindly", "Reply tersely"):
        recipe_save(document={"name": "fk_reply", "prompt": prompt, "model": "openai:gpt-4o-mini"})


@pytest.fixture
def other_recipe(db: Any) -> None:
    recipe_save(document={"name": "fk_other", "prompt": "p", "model": "openai:gpt-4o-mini"})


def _fork(djflow: Any, source: Any, **body: Any) -> Run:
    with djflow._settling():
        run = forks.run_fork(run_id=source.id, **body)
    return run


def _replies(request: Any) -> str:
    system = request.system or ""
    return "terse" if "tersely" in str(request.messages) + system else "kind"


def test_a_fork_from_a_middle_step_reuses_the_outputs_before_it(djflow, recipes) -> None:
    calls.clear()
    djflow.model(reply=lambda request: f"reply {len(calls)}")
    source = djflow.start(triage)
    assert source.status == "completed", source.error
    assert calls == ["fetch", "send"]
    fork = _fork(djflow, source, from_step="draft")
    fork.refresh_from_db()
    assert fork.status == "completed", fork.error
    # fetch did not run again: its recorded output fed send's template.
    assert calls == ["fetch", "send", "send"]
    assert fork.forked_from_id == source.id and fork.fork_step == "draft"
    rows = StepRun.objects.filter(run=fork).order_by("id")
    fetched = rows.get(step_id="fetch")
    assert fetched.output == {"who": "customer 1"}
    assert fetched.cost_usd == 0
    assert fork.output == {"sent": "to customer 1: reply 2"}
    # The source is untouched.
    assert StepRun.objects.filter(run_id=source.id).count() == 3


def test_a_fork_from_the_start_runs_every_step(djflow, recipes) -> None:
    calls.clear()
    djflow.model(reply="hello")
    source = djflow.start(triage)
    fork = _fork(djflow, source)
    fork.refresh_from_db()
    assert fork.status == "completed"
    assert calls == ["fetch", "send", "fetch", "send"]
    assert fork.fork_step == ""


def test_a_fork_pins_a_recipe_version_for_its_recipe_steps(djflow, recipes) -> None:
    djflow.model(reply=_replies)
    source = djflow.start(triage)
    assert source.output["sent"].endswith(": terse")  # the newest version, 2
    fork = _fork(djflow, source, from_step="draft", recipes={"fk_reply": 1})
    fork.refresh_from_db()
    assert fork.recipe_pins == {"fk_reply": 1}
    assert fork.output["sent"].endswith(": kind"), fork.output
    call = fork.steps.get(step_id="draft").model_calls.get()
    assert (call.recipe, call.recipe_version) == ("fk_reply", 1)


def test_a_fork_runs_another_saved_version(djflow, recipes) -> None:
    djflow.model(reply="hi")
    source = djflow.start(triage)
    document = triage.document()
    document["output"] = {"sent": "${steps.send.output}", "v": 2}
    saved = definition_save(document=document).version
    fork = _fork(djflow, source, from_step="send", document=saved.number)
    fork.refresh_from_db()
    assert fork.version_id == saved.id
    assert fork.output["v"] == 2


def test_a_dry_run_says_what_would_be_reused_and_starts_nothing(djflow, recipes) -> None:
    djflow.model(reply="hi")
    source = djflow.start(triage)
    before = Run.objects.count()
    preview = forks.run_fork(run_id=source.id, from_step="send", dry_run=True)
    assert preview.reused == ["fetch", "draft"]
    assert preview.rerun == ["send"]
    assert Run.objects.count() == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"from_step": "nope"}, "from_step"),
        ({"from_step": 3}, "from_step"),
        ({"document": 0}, "document"),
        ({"document": 2**40}, "document"),
        ({"recipes": {"fk_reply": 2**40}}, "recipes.fk_reply"),
        ({"document": {"id": "fk_triage"}}, "document"),
        ({"recipes": {"fk_other": 1}}, "recipes.fk_other"),
        ({"recipes": {"fk_reply": "one"}}, "recipes.fk_reply"),
        ({"recipes": []}, "recipes"),
        ({"input": [1]}, "input"),
    ],
)
def test_a_bad_fork_is_a_400_naming_the_field(djflow, recipes, other_recipe, body, field) -> None:
    djflow.model(reply="hi")
    source = djflow.start(triage)
    with pytest.raises(InvalidInput) as raised:
        forks.run_fork(run_id=source.id, **body)
    assert [error.field for error in raised.value.errors] == [field]


waiting = workflow("fk_waiting")
waiting.sleep("nap", ms=60_000)


def test_a_version_not_saved_is_a_404_naming_it(djflow, recipes) -> None:
    from workflows.errors import NotFound

    djflow.model(reply="hi")
    source = djflow.start(triage)
    for body, field in (
        ({"document": 99}, "document"),
        ({"recipes": {"fk_reply": 9}}, "recipes.fk_reply"),
    ):
        with pytest.raises(NotFound) as raised:
            forks.run_fork(run_id=source.id, **body)
        assert [error.field for error in raised.value.errors] == [field]


def test_a_run_not_ended_is_a_409(djflow, admin_user) -> None:
    run = djflow.start(waiting)
    client = APIClient()
    client.force_authenticate(admin_user)
    answer = client.post(f"/api/v1/runs/{run.id}/fork", {}, format="json")
    assert answer.status_code == 409, answer.json()
    assert answer.json()["errors"][0]["field"] == "status"


def test_the_api_forks_and_shows_forked_from(djflow, recipes, admin_user) -> None:
    calls.clear()
    djflow.model(reply="hi")
    source = djflow.start(triage)
    client = APIClient()
    client.force_authenticate(admin_user)
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = client.post(f"/api/v1/runs/{source.id}/fork", {"from_step": "send"}, format="json")
    assert answer.status_code == 201, answer.json()
    djflow.settle()
    body = client.get(f"/api/v1/runs/{answer.json()['id']}").json()
    assert body["forked_from"] == {"run": str(source.id), "step": "send"}
    assert body["status"] == "completed"
    assert calls == ["fetch", "send", "send"]
    preview = client.post(
        f"/api/v1/runs/{source.id}/fork", {"from_step": "send", "dry_run": True}, format="json"
    )
    assert preview.status_code == 200
    assert preview.json()["reused"] == ["fetch", "draft"]


def test_a_stranger_cannot_fork_a_run_they_may_not_read(djflow, recipes, stranger) -> None:
    djflow.model(reply="hi")
    source = djflow.start(triage)
    answer = stranger.post(f"/api/v1/runs/{source.id}/fork", {}, format="json")
    assert answer.status_code == 404, answer.json()
    assert answer.json()["errors"][0]["field"] == "id"


secretive = workflow(
    "fk_secret",
    input_schema={
        "type": "object",
        "properties": {
            "topic": {"type": "string"},
            "key": {"type": "string", "writeOnly": True},
        },
    },
)
secretive.task("use", input={"key": "${input.key}", "topic": "${input.topic}"})


@secretive.handler("use")
def use(ctx: Any, input: Any, prior: Any) -> Any:
    return input["key"][:3]


def test_keeping_a_stored_secret_is_for_its_starter_or_an_author(djflow, admin_user) -> None:
    from django.contrib.auth import get_user_model

    from workflows import access

    source = djflow.start(secretive, input={"topic": "t", "key": "sk-secret-1"}, user=admin_user)
    assert source.status == "completed", source.error
    # Sam reads every run of the workflow and starts runs of it, but did not start this one.
    sam = get_user_model().objects.create_user(username="sam", password="a-long-password-1")
    access.grant("starter", "fk_secret", user=sam)
    access.grant("viewer", "fk_secret", user=sam)
    for body in ({}, {"input": {"topic": "u"}}, {"input": {"topic": "u", "key": "••••"}}):
        with pytest.raises(InvalidInput) as raised:
            forks.run_fork(run_id=source.id, user=sam, **body)
        assert [error.field for error in raised.value.errors] == ["input.key"], body
    # Given again, the fork goes through; the source's starter keeps the stored one.
    mine = _fork(djflow, source, user=sam, input={"topic": "u", "key": "sk-sams-own"})
    mine.refresh_from_db()
    assert mine.status == "completed" and mine.steps.get(step_id="use").output == "sk-"
    theirs = _fork(djflow, source, user=admin_user)
    theirs.refresh_from_db()
    assert theirs.status == "completed", theirs.error
    # The secret is sealed on the fork as on its source: never stored in plaintext.
    assert "sk-secret-1" not in str(Run.objects.filter(id=theirs.id).values().get())


fanned = workflow("fk_fanned")
fanned.foreach("each", items="${input.items}", do={"id": "item", "kind": "task"})
fanned.task("total", input={"seen": "${steps.each.output}"})


@fanned.handler("item")
def item(ctx: Any, input: Any, prior: Any) -> Any:
    calls.append("item")
    return input["item"] * 10 if isinstance(input, dict) and "item" in input else input


@fanned.handler("total")
def total(ctx: Any, input: Any, prior: Any) -> Any:
    calls.append("total")
    return input["seen"]


def test_a_fork_after_a_foreach_reuses_its_output_without_its_items(djflow) -> None:
    calls.clear()
    source = djflow.start(fanned, input={"items": [1, 2, 3]})
    assert source.status == "completed", source.error
    items = calls.count("item")
    fork = _fork(djflow, source, from_step="total")
    fork.refresh_from_db()
    assert fork.status == "completed", fork.error
    assert calls.count("item") == items  # no item ran again
    assert fork.output == source.output
    assert not Run.objects.filter(parent_run_id=fork.id).exists()
