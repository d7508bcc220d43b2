"""Security review of forks (CONTRACT sections 8 and 16): attacks on POST /runs/{id}/fork,
each a problem found by the review and fixed (F1 a secret revealed on a version that does not
mark it, F2 a 400 quoting it before the start permission was checked, F3 a row copied under
another top-level step), and what was found sound."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import TestCase
from rest_framework.test import APIClient

from runs import forks
from runs.models import Run
from workflows import access
from workflows.errors import InvalidInput
from workflows.sdk import workflow
from workflows.services import definition_save

SECRET = "sk-attack-secret-value-42"


def _client(user: Any) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _user(name: str) -> Any:
    return get_user_model().objects.create_user(username=name, password="a-long-password-1")


def _fork(djflow: Any, source: Any, **body: Any) -> Run:
    with djflow._settling():
        return forks.run_fork(run_id=source.id, **body)


# --- secrets and another saved version --------------------------------------------------------

keyed = workflow(
    "atk_keyed",
    input_schema={
        "type": "object",
        "properties": {"topic": {"type": "string"}, "key": {"type": "string", "writeOnly": True}},
    },
)
keyed.task("use", input={"topic": "${input.topic}"})


@keyed.handler("use")
def use(ctx: Any, input: Any, prior: Any) -> Any:
    return "ok"


def _plain_version(**key_schema: Any) -> int:
    """A version of atk_keyed whose input_schema does not mark ``key`` writeOnly (as a first
    version before the author marked it, or any version an author saved)."""
    document = keyed.document()
    document["input_schema"] = {
        "type": "object",
        "properties": {"topic": {"type": "string"}, "key": {"type": "string", **key_schema}},
    }
    return definition_save(document=document).version.number


def test_a_fork_onto_a_version_without_writeonly_does_not_reveal_the_secret(
    djflow, admin_user
) -> None:
    source = djflow.start(keyed, input={"topic": "t", "key": SECRET}, user=admin_user)
    assert source.status == "completed", source.error
    plain = _plain_version()
    # Sam reads every run of the workflow and starts runs of it, but did not start this one
    # and is no author: the contract says he may not keep the stored secret.
    sam = _user("sam")
    access.grant("starter", "atk_keyed", user=sam)
    access.grant("viewer", "atk_keyed", user=sam)
    try:
        fork = _fork(djflow, source, user=sam, document=plain)
    except InvalidInput:
        return  # refused: sound
    answer = _client(sam).get(f"/api/v1/runs/{fork.id}")
    assert answer.status_code == 200
    assert SECRET not in answer.content.decode(), answer.json()["input"]


def test_a_viewer_who_may_not_start_gets_403_and_no_secret_in_a_400(djflow, admin_user) -> None:
    source = djflow.start(keyed, input={"topic": "t", "key": SECRET}, user=admin_user)
    # An older version where key is a number (not marked writeOnly): the source's key fails it.
    number = _plain_version(pattern="^[0-9]+$")
    vera = _user("vera")
    access.grant("viewer", "atk_keyed", user=vera)
    answer = _client(vera).post(
        f"/api/v1/runs/{source.id}/fork", {"document": number, "dry_run": True}, format="json"
    )
    assert SECRET not in answer.content.decode(), answer.json()
    assert answer.status_code == 403, answer.json()


# --- copied rows: a step nested in a kept condition, top-level in the fork's version ---------

from workflows.sdk import task, when  # noqa: E402

ran: list[str] = []

moved = workflow("atk_moved")
moved.condition("route", if_=when("input.go", "eq", True), then=[task("z")])
moved.task("b")


@moved.handler("z")
def z(ctx: Any, input: Any, prior: Any) -> Any:
    ran.append("z")
    return f"z #{len(ran)}"


@moved.handler("b")
def b(ctx: Any, input: Any, prior: Any) -> Any:
    ran.append("b")
    return "b"


def test_a_step_moved_out_of_a_kept_condition_runs_in_the_fork(djflow) -> None:
    """Version 2 moves z out of the condition to after b. A fork from b on version 2 says z
    runs again (its dry run lists it in rerun), and so it must: z's row inside the kept
    condition (path "", as a condition's branch steps share its path) is not a row of the
    fork's top-level z."""
    ran.clear()
    source = djflow.start(moved, input={"go": True})
    assert source.status == "completed", source.error
    document = moved.document()
    document["steps"] = [
        {
            "id": "route",
            "kind": "condition",
            "if": {"path": "input.go", "op": "eq", "value": True},
            "then": [{"id": "y", "kind": "task", "handler": "b"}],
        },
        {"id": "b", "kind": "task"},
        {"id": "z", "kind": "task"},
    ]
    document["output"] = {"z": "${steps.z.output}"}
    v2 = djflow.define(document) and 2
    preview = forks.run_fork(run_id=source.id, from_step="b", document=v2, dry_run=True)
    assert "z" in preview.rerun
    ran.clear()
    fork = _fork(djflow, source, from_step="b", document=v2)
    fork.refresh_from_db()
    assert fork.status == "completed", fork.error
    assert ran == ["b", "z"], ran


# --- odd bodies ---------------------------------------------------------------------------------

from workflows.services import recipe_save  # noqa: E402

DEEP: Any = 1
for _ in range(40):
    DEEP = [DEEP]

drafted = workflow("atk_drafted")
drafted.recipe("draft", recipe="atk_reply")


@pytest.mark.parametrize(
    "body",
    [
        {"document": 10**30},
        {"document": 2**31},
        {"document": -(2**63) - 1},
        {"document": 1.5},
        {"recipes": {"atk_reply": 10**30}},
        {"recipes": {"atk_reply": 2**31}},
        {"recipes": {"x" * 5000: 1}},
        {"recipes": {"": 1}},
        {"from_step": ""},
        {"from_step": "draft", "document": 1, "recipes": None},
        {"input": None},
        {"input": {"a": DEEP}},
        {"dry_run": "yes"},
    ],
)
def test_an_odd_fork_body_is_a_4xx_never_a_500(djflow, admin_user, body) -> None:
    recipe_save(document={"name": "atk_reply", "prompt": "p", "model": "openai:gpt-4o-mini"})
    djflow.model(reply="hi")
    source = djflow.start(drafted, user=admin_user)
    assert source.status == "completed", source.error
    client = _client(admin_user)
    client.raise_request_exception = False
    answer = client.post(
        f"/api/v1/runs/{source.id}/fork",
        {**body, "dry_run": True} if "dry_run" not in body else body,
        format="json",
    )
    assert answer.status_code in (200, 400, 404, 409), (answer.status_code, answer.content[:500])


# --- checked and sound -------------------------------------------------------------------------


def test_who_may_fork_what(djflow, admin_user) -> None:
    """Reading the run and starting its workflow: a stranger and a starter of another's run
    get 404, a viewer or an operator who may not start gets 403 (given the secret again, so
    the secret check does not answer first), a starter of their own run forks it and keeps
    its secret; a child run and a running run are 409 (tests/runs/test_forks.py)."""
    source = djflow.start(keyed, input={"topic": "t", "key": SECRET}, user=admin_user)
    body = {"input": {"topic": "t", "key": "given-again"}, "dry_run": True}
    url = f"/api/v1/runs/{source.id}/fork"
    nobody, starter, viewer, operator = (_user(n) for n in ("nobody", "st", "vi", "op"))
    access.grant("starter", "atk_keyed", user=starter)
    access.grant("viewer", "atk_keyed", user=viewer)
    access.grant("operator", "atk_keyed", user=operator)
    for user, status in ((nobody, 404), (starter, 404), (viewer, 403), (operator, 403)):
        answer = _client(user).post(url, body, format="json")
        assert answer.status_code == status, (user.username, answer.json())
        assert SECRET not in answer.content.decode()
    own = djflow.start(keyed, input={"topic": "t", "key": SECRET}, user=starter)
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = _client(starter).post(f"/api/v1/runs/{own.id}/fork", {}, format="json")
    assert answer.status_code == 201, answer.json()
    assert answer.json()["input"]["key"] == "••••"
    assert SECRET not in str(Run.objects.filter(id=answer.json()["id"]).values().get())
