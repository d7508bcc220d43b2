"""Model calls in the API (CONTRACT section 10): each attempt of a run lists its calls (what
they cost, where their prompt and reply are), and ``GET /runs/{id}/calls/{call}`` has the
prompt and reply, for whoever may read the run, with the run's secrets masked."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs.engine import calls, contents, costs
from runs.models import ModelCall, Run
from runs.status import StepStatus
from tests.runs.factories import RunFactory, StepRunFactory, WorkflowVersionFactory
from tests.runs.factories import support_ticket_document as document

pytestmark = pytest.mark.django_db

LONG = "word " * 50_000  # 250,000 characters: a run's representation must not carry it


def _called(run: Run, **call: Any) -> ModelCall:
    attempt = StepRunFactory(run=run, step_id="draft", kind="recipe", status=StepStatus.RUNNING)
    held = costs.reserve(step_run_id=attempt.id, run_id=run.id, amount=Decimal("0.01"))
    values = {
        "provider": "openai",
        "model": "gpt-4o-mini",
        "prompt": {"system": "Be brief.", "messages": [{"role": "user", "content": LONG}]},
        "reply": {"text": "hello"},
        "status": "ok",
        "input_tokens": 12,
        "output_tokens": 3,
        "cost_usd": Decimal("0.000004"),
        **call,
    }
    return calls.call_record(reservation=held, call=calls.Call(**values))


def test_a_run_lists_its_calls_without_their_texts(api: APIClient) -> None:
    run = RunFactory()
    call = _called(run)
    response = api.get(f"/api/v1/runs/{run.id}")
    assert response.status_code == 200
    [attempt] = [s for s in response.json()["steps"] if s["model_calls"]]
    [listed] = attempt["model_calls"]
    assert listed["url"] == f"/api/v1/runs/{run.id}/calls/{call.id}"
    # The digest of the whole prompt, though it is stored as its messages.
    assert listed["prompt_digest"] == calls.digest(contents.body(call.prompt))
    assert listed["prompt_size"] > 250_000 and listed["reply_size"] > 0
    assert (listed["input_tokens"], listed["cost_usd"]) == (12, 0.000004)
    assert "prompt" not in listed and LONG[:100] not in response.content.decode()


def test_the_call_has_its_prompt_and_reply(api: APIClient) -> None:
    run = RunFactory()
    call = _called(run)
    response = api.get(f"/api/v1/runs/{run.id}/calls/{call.id}")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["prompt"]["system"] == "Be brief."
    assert body["prompt"]["messages"][0]["content"] == LONG
    assert body["reply"]["text"] == "hello"
    assert body["prompt"]["digest"] == body["prompt_digest"]


def test_a_call_of_a_run_the_caller_may_not_read_is_a_404(db: Any) -> None:
    run = RunFactory()
    call = _called(run)
    stranger = get_user_model().objects.create_user(username="eve", password="a-long-pw-1")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=stranger).key}")
    response = client.get(f"/api/v1/runs/{run.id}/calls/{call.id}")
    assert response.status_code == 404
    assert [e["field"] for e in response.json()["errors"]] == ["id"]


def test_a_call_of_another_run_is_a_404_naming_it(api: APIClient) -> None:
    run, other = RunFactory(), RunFactory()
    call = _called(other)
    response = api.get(f"/api/v1/runs/{run.id}/calls/{call.id}")
    assert response.status_code == 404
    assert [e["field"] for e in response.json()["errors"]] == ["call"]
    # An id past any integer column is no call either, never a 500.
    huge = api.get(f"/api/v1/runs/{other.id}/calls/{'9' * 40}")
    assert huge.status_code == 404
    assert [e["field"] for e in huge.json()["errors"]] == ["call"]


def test_a_secret_in_a_prompt_shows_masked(api: APIClient) -> None:
    schema = {
        "type": "object",
        "properties": {"ticket": {"type": "string"}, "key": {"type": "string", "writeOnly": True}},
    }
    version = WorkflowVersionFactory(document=document(input_schema=schema))
    token = "[secret:0123456789abcdef0123]"
    run = RunFactory(version=version, secrets="sealed", input={"ticket": "x", "key": token})
    call = _called(
        run, prompt={"system": None, "messages": [{"role": "user", "content": f"key={token}"}]}
    )
    body = api.get(f"/api/v1/runs/{run.id}/calls/{call.id}").json()
    assert body["prompt"]["messages"][0]["content"] == "key=••••"


RETRIEVED = {
    "kb": "answers",
    "query": "export crashes",
    "hits": [
        {"key": "T-1", "version": 2, "score": 0.6},
        {"key": "T-9", "version": 1, "score": 0.1},
    ],
}


def test_what_a_context_retrieved_shows_on_the_call_in_the_api_and_the_admin(
    api: APIClient, admin_client: Any
) -> None:
    run, other = RunFactory(), RunFactory()
    with_context = _called(run, retrieved=RETRIEVED)
    without = _called(other)
    listed = {
        call["id"]: call
        for shown in (run, other)
        for step in api.get(f"/api/v1/runs/{shown.id}").json()["steps"]
        for call in step["model_calls"]
    }
    assert listed[with_context.id]["retrieved"] == RETRIEVED
    assert listed[without.id]["retrieved"] is None
    detail = api.get(f"/api/v1/runs/{run.id}/calls/{with_context.id}").json()
    assert detail["retrieved"] == RETRIEVED
    page = admin_client.get(f"/admin/runs/steprun/{with_context.step_run_id}/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "retrieved (knowledge base, query" in text.lower() and "T-1" in text
