"""``GET /api/v1/runs/{id}/trace`` (CONTRACT section 11): the span tree of a run, in one
process (each attempt run here, offers to workers not sent): its shape, a child run nested
under the step that started it, secrets masked, a recipe's model call with its usage and
cost, who may read it, its bounds and its number of queries."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs import trace
from runs.engine import calls, costs
from runs.models import Run, StepRun
from runs.status import StepStatus
from tests.model_server import ModelServer
from tests.moves import unchecked
from workers.execution import execute
from workflows import access
from workflows.secrets import MASK, TOKEN
from workflows.services import definition_save

from .factories import RunFactory, StepRunFactory, WorkflowVersionFactory
from .test_secrets import KEY, PIN, documents, offers, run_to_the_end

pytestmark = pytest.mark.django_db

SPAN_FIELDS = {
    "id",
    "parent",
    "name",
    "kind",
    "step_id",
    "attempt",
    "start",
    "end",
    "status",
    "attributes",
    "usage",
    "cost_usd",
}

__all__ = ["documents", "offers"]  # fixtures, from the secrets tests


def traced(client: APIClient, run: Any) -> dict[str, Any]:
    answer = client.get(f"/api/v1/runs/{run.id}/trace")
    assert answer.status_code == 200, answer.content
    body: dict[str, Any] = answer.json()
    return body


def by_id(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {span["id"]: span for span in body["spans"]}


def client_for(user: Any) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return client


def test_the_trace_of_a_run_with_a_child_its_shape_and_its_secrets_masked(
    api, documents, offers
) -> None:
    run = run_to_the_end(api)
    answer = api.get(f"/api/v1/runs/{run.id}/trace")
    text = answer.content.decode()
    body = answer.json()
    assert set(body) == {"run", "spans", "truncated"}
    assert body["run"] == str(run.id) and body["truncated"] is None
    for span in body["spans"]:
        assert set(span) == SPAN_FIELDS, span
    spans = by_id(body)
    assert len(spans) == len(body["spans"]), "ids are unique"
    # Every parent is a span of the trace; the run is the one root.
    assert [s["id"] for s in body["spans"] if s["parent"] is None] == [f"run:{run.id}"]
    assert all(s["parent"] in spans for s in body["spans"] if s["parent"] is not None)
    top = spans[f"run:{run.id}"]
    assert (top["kind"], top["name"], top["status"]) == ("run", "vault_flow", "completed")
    # A step, its attempt, the handler's own span under the attempt.
    call_row = run.steps.get(step_id="call")
    step = spans[f"step:{run.id}:call"]
    assert (step["parent"], step["kind"], step["step_id"]) == (top["id"], "step", "call")
    attempt = spans[f"attempt:{call_row.id}"]
    assert (attempt["parent"], attempt["kind"], attempt["attempt"]) == (step["id"], "attempt", 1)
    assert attempt["attributes"]["worker"] == "here"
    [handler] = [s for s in body["spans"] if s["parent"] == attempt["id"]]
    assert (handler["id"], handler["name"], handler["kind"]) == (
        f"span:{call_row.id}:0",
        "service_call",
        "tool",
    )
    assert handler["attributes"]["key"] == MASK
    # The child run nests under the attempt of its subworkflow step, and its steps under it.
    child = Run.objects.get(parent_run=run)
    child_row = run.steps.get(step_id="child")
    child_span = spans[f"run:{child.id}"]
    assert child_span["parent"] == f"attempt:{child_row.id}"
    assert spans[f"attempt:{child_row.id}"]["parent"] == f"step:{run.id}:child"
    assert spans[f"step:{child.id}:use_key"]["parent"] == child_span["id"]
    # The failed step (on_error: continue): its error without the traceback.
    boom = spans[f"attempt:{run.steps.get(step_id='boom').id}"]
    assert boom["status"] == "failed"
    assert set(boom["attributes"]["error"]) == {"class", "message"}
    # Secrets: neither the values nor their tokens, the mask where they were.
    assert KEY not in text and str(PIN) not in text and not TOKEN.search(text)
    assert spans[f"step:{child.id}:use_key"] and MASK in text
    assert top["attributes"]["input"]["creds"]["api_key"] == MASK
    # Stable, deterministic: read again, the same.
    assert api.get(f"/api/v1/runs/{run.id}/trace").json() == body


def test_tracing_a_child_run_shows_it_alone(api, documents, offers) -> None:
    run = run_to_the_end(api)
    child = Run.objects.get(parent_run=run)
    body = traced(api, child)
    spans = by_id(body)
    assert body["spans"][0]["id"] == f"run:{child.id}" and body["spans"][0]["parent"] is None
    assert f"run:{run.id}" not in spans


def test_a_recipes_model_call_is_a_span_with_gen_ai_attributes_usage_and_cost(
    api, offers, monkeypatch
) -> None:
    with ModelServer() as server:
        for name, value in server.openai_env().items():
            monkeypatch.setenv(name, value)
        definition_save(
            document={
                "id": "rx_traced",
                "limits": {"run_timeout_ms": 120_000},
                "steps": [
                    {
                        "id": "ask",
                        "kind": "recipe",
                        "model": "openai:gpt-4o-mini",
                        "prompt": "Say hello to ${input.name}.",
                        "max_tokens": 50,
                    }
                ],
            }
        )
        answer = api.post(
            "/api/v1/runs", {"workflow": "rx_traced", "input": {"name": "Ada"}}, format="json"
        )
        assert answer.status_code == 201, answer.content
        run = Run.objects.get(id=answer.json()["id"])
        execute(StepRun.objects.get(run=run, status="scheduled").id, worker="here")
    run.refresh_from_db()
    assert run.status == "completed", run.error
    row = run.steps.get(step_id="ask")
    [call] = row.model_calls.all()
    body = traced(api, run)
    [span] = [s for s in body["spans"] if s["parent"] == f"attempt:{row.id}"]
    assert span["id"] == f"model_call:{call.id}"
    assert (span["name"], span["kind"], span["status"]) == ("model_call", "model_generation", "ok")
    assert span["usage"]["input_tokens"] == call.input_tokens > 0
    assert span["usage"]["output_tokens"] == call.output_tokens > 0
    assert span["cost_usd"] == pytest.approx(float(call.cost_usd)) and span["cost_usd"] > 0
    attributes = span["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["gen_ai.request.model"] == "gpt-4o-mini"
    assert attributes["gen_ai.usage.input_tokens"] == call.input_tokens
    assert attributes["url"] == f"/api/v1/runs/{run.id}/calls/{call.id}"
    # The handler's span and the call are one span, timed by the span.
    assert span["start"] and span["end"] and span["start"] <= span["end"]
    # The attempt and the step carry the usage and cost too.
    attempt = by_id(body)[f"attempt:{row.id}"]
    assert attempt["usage"]["input_tokens"] == call.input_tokens
    assert by_id(body)[f"step:{run.id}:ask"]["cost_usd"] == pytest.approx(float(row.cost_usd))


def recorded_call(attempt: StepRun, **more: Any) -> Any:
    held = costs.reserve(step_run_id=attempt.id, run_id=attempt.run_id, amount=Decimal("0.01"))
    values = {
        "provider": "openai",
        "model": "gpt-4o-mini",
        "prompt": {"system": None, "messages": [{"role": "user", "content": "hi"}]},
        "reply": {"text": "hello"},
        "status": "ok",
        "input_tokens": 12,
        "output_tokens": 3,
        "cost_usd": Decimal("0.000004"),
        **more,
    }
    return calls.call_record(reservation=held, call=calls.Call(**values))


def test_a_call_no_span_stands_for_is_its_own_span(api) -> None:
    run = RunFactory()
    attempt = StepRunFactory(run=run, step_id="draft", kind="recipe", status=StepStatus.RUNNING)
    call = recorded_call(attempt)
    span = by_id(traced(api, run))[f"model_call:{call.id}"]
    assert span["parent"] == f"attempt:{attempt.id}"
    assert span["usage"] == {"input_tokens": 12, "output_tokens": 3}
    assert span["cost_usd"] == 0.000004 and span["end"] >= span["start"]


def test_steps_inside_a_foreach_have_a_span_per_item_under_their_composite(api) -> None:
    run = RunFactory()
    fan = StepRunFactory(run=run, step_id="fan", kind="foreach")
    items = [StepRunFactory(run=run, step_id="inner", path=f"fan[{n}]/") for n in range(3)]
    spans = by_id(traced(api, run))
    assert spans[f"step:{run.id}:fan"]["parent"] == f"run:{run.id}"
    for n, row in enumerate(items):
        step = spans[f"step:{run.id}:fan[{n}]/inner"]
        assert step["parent"] == f"step:{run.id}:fan"
        assert spans[f"attempt:{row.id}"]["parent"] == step["id"]
    assert spans[f"attempt:{fan.id}"]["parent"] == f"step:{run.id}:fan"


# --- who may read it ----------------------------------------------------------------------------


def person(name: str) -> Any:
    return get_user_model().objects.create_user(username=name, password="a-long-password-1")


def test_a_stranger_gets_a_404_and_a_viewer_the_trace(db) -> None:
    run = RunFactory()
    stranger, viewer = person("sam"), person("vic")
    access.grant("viewer", run.workflow_id, user=viewer)
    for run_id in (run.id, "not-a-uuid", "00000000-0000-0000-0000-000000000000"):
        answer = client_for(stranger).get(f"/api/v1/runs/{run_id}/trace")
        assert answer.status_code == 404
        assert [e["field"] for e in answer.json()["errors"]] == ["id"]
    assert traced(client_for(viewer), run)["run"] == str(run.id)
    assert APIClient().get(f"/api/v1/runs/{run.id}/trace").status_code in (401, 403)


def test_a_child_run_of_a_workflow_the_caller_may_not_read_is_left_out(db) -> None:
    parent = RunFactory()
    other = WorkflowVersionFactory(
        document={"id": "elsewhere", "steps": [{"id": "x", "kind": "sleep", "ms": 1}]}
    )
    step = StepRunFactory(run=parent, step_id="sub", kind="subworkflow")
    child = RunFactory(version=other, workflow_id="elsewhere")
    grandchild = RunFactory(version=parent.version, workflow_id=parent.workflow_id)
    with unchecked():
        Run.objects.filter(id=child.id).update(
            parent_run=parent, parent_step_run=step, root_run=parent, depth=1
        )
        Run.objects.filter(id=grandchild.id).update(parent_run=child, root_run=parent, depth=2)
    StepRunFactory(run=child, step_id="x", kind="sleep")
    viewer = person("vic")
    access.grant("viewer", parent.workflow_id, user=viewer)
    spans = by_id(traced(client_for(viewer), parent))
    # The step that started it is there; the child and all below it are not.
    assert f"attempt:{step.id}" in spans
    assert f"run:{child.id}" not in spans and f"run:{grandchild.id}" not in spans
    assert not [s for s in spans if str(child.id) in s]
    # Whoever may read both sees it nested.
    access.grant("viewer", "elsewhere", user=viewer)
    spans = by_id(traced(client_for(viewer), parent))
    assert spans[f"run:{child.id}"]["parent"] == f"attempt:{step.id}"
    # A child whose starting attempt is unknown nests under its parent run.
    assert spans[f"run:{grandchild.id}"]["parent"] == f"run:{child.id}"
    assert spans[f"step:{child.id}:x"]["parent"] == f"run:{child.id}"


# --- bounds -------------------------------------------------------------------------------------


def test_past_the_span_bound_the_trace_is_cut_and_says_so(api, monkeypatch) -> None:
    run = RunFactory()
    for n in range(10):
        StepRunFactory(run=run, step_id=f"s{n}")
    monkeypatch.setattr(trace, "MAX_SPANS", 6)
    body = traced(api, run)
    assert body["truncated"] == {"reason": "spans", "limit": 6}
    assert len(body["spans"]) == 7
    marker = body["spans"][-1]
    assert (marker["kind"], marker["parent"]) == ("truncated", f"run:{run.id}")


def test_past_the_depth_bound_child_runs_are_cut_and_it_says_so(api) -> None:
    runs = [RunFactory()]
    with unchecked():
        for depth in range(1, trace.MAX_DEPTH + 3):
            row = StepRunFactory(run=runs[-1], step_id="sub", kind="subworkflow")
            child = RunFactory(version=runs[0].version)
            Run.objects.filter(id=child.id).update(
                parent_run=runs[-1], parent_step_run=row, root_run=runs[0], depth=depth
            )
            runs.append(child)
    body = traced(api, runs[0])
    spans = by_id(body)
    assert body["truncated"] == {"reason": "depth", "limit": trace.MAX_DEPTH}
    assert f"run:{runs[trace.MAX_DEPTH].id}" in spans
    assert f"run:{runs[trace.MAX_DEPTH + 1].id}" not in spans
    assert body["spans"][-1]["kind"] == "truncated"


@pytest.mark.parametrize("steps", [3, 60])
def test_the_trace_costs_a_fixed_number_of_queries(
    api, user, django_assert_max_num_queries, steps: int
) -> None:
    run = RunFactory()
    for n in range(steps):
        attempt = StepRunFactory(
            run=run,
            step_id=f"s{n}",
            kind="recipe",
            spans=[{"name": "model_call", "kind": "model_generation", "model": "gpt-4o-mini"}],
        )
        recorded_call(attempt)
    for _ in range(steps // 3):
        child = RunFactory(version=run.version)
        with unchecked():
            Run.objects.filter(id=child.id).update(parent_run=run, root_run=run, depth=1)
        StepRunFactory(run=child, step_id="x")
    api.get(f"/api/v1/runs/{run.id}/trace")  # the user's permissions and the document cached
    with django_assert_max_num_queries(8):
        body = traced(api, run)
    assert len([s for s in body["spans"] if s["kind"] == "model_generation"]) == steps


def test_a_stored_span_that_is_not_an_object_is_skipped(api) -> None:
    run = RunFactory()
    row = StepRunFactory(run=run, spans=["not a span", {"name": "ok"}])
    spans = by_id(traced(api, run))
    assert f"span:{row.id}:1" in spans and f"span:{row.id}:0" not in spans


def test_a_long_input_or_output_is_left_out_and_its_length_said(api) -> None:
    run = RunFactory(input={"text": "x" * (trace.MAX_VALUE_CHARS + 10)})
    row = StepRunFactory(run=run, input={"short": 1}, output="y" * (trace.MAX_VALUE_CHARS * 2))
    spans = by_id(traced(api, run))
    attempt = spans[f"attempt:{row.id}"]["attributes"]
    assert attempt["input"] == {"short": 1}
    assert attempt["output"]["omitted"].startswith(f"{trace.MAX_VALUE_CHARS * 2 + 2} characters")
    assert "omitted" in spans[f"run:{run.id}"]["attributes"]["input"]
    assert "x" * 100 not in api.get(f"/api/v1/runs/{run.id}/trace").content.decode()


def test_a_tool_call_is_one_span_with_the_mcp_tool_span_that_made_it(api) -> None:
    run = RunFactory()
    stored = {
        "name": "mcp_tool",
        "kind": "client",
        "started_at": "2026-01-01T00:00:00+00:00",
        "finished_at": "2026-01-01T00:00:01+00:00",
        "attributes": {"server": "files", "tool": "read"},
    }
    attempt = StepRunFactory(run=run, step_id="fetch", kind="mcp_tool", spans=[stored])
    [made, lone] = calls.tool_calls_record(
        [
            calls.ToolUse(
                step_run_id=attempt.id,
                run_id=run.id,
                server=server,
                tool="read",
                arguments={"path": "/a"},
                result={"is_error": False, "text": "ok"},
                status="ok",
                latency_ms=7,
            )
            for server in ("files", "other")
        ]
    )
    spans = by_id(traced(api, run))
    merged = spans[f"tool_call:{made.id}"]
    assert (merged["parent"], merged["name"], merged["kind"]) == (
        f"attempt:{attempt.id}",
        "mcp_tool",
        "client",
    )
    assert merged["start"] == stored["started_at"] and merged["status"] == "ok"
    assert merged["attributes"]["tool_call"] == made.id
    assert f"span:{attempt.id}:0" not in spans
    # A call no span stands for is its own span, timed back from when it was recorded.
    own = spans[f"tool_call:{lone.id}"]
    assert own["attributes"]["server"] == "other" and own["parent"] == f"attempt:{attempt.id}"


def test_past_the_span_bound_in_runs_the_trace_says_spans(api, monkeypatch) -> None:
    run = RunFactory()
    with unchecked():
        for _ in range(4):
            child = RunFactory(version=run.version)
            Run.objects.filter(id=child.id).update(parent_run=run, root_run=run, depth=1)
    monkeypatch.setattr(trace, "MAX_SPANS", 3)
    body = traced(api, run)
    assert body["truncated"] == {"reason": "spans", "limit": 3}
    assert [s["kind"] for s in body["spans"]] == ["run", "run", "run", "truncated"]


def test_a_body_run_of_a_foreach_item_nests_under_its_items_body_attempt(api) -> None:
    run = RunFactory()
    StepRunFactory(run=run, step_id="fan", kind="foreach")
    bodies = [
        StepRunFactory(run=run, step_id="_body", kind="subworkflow", path=f"fan[{n}]/")
        for n in range(2)
    ]
    children = []
    with unchecked():
        for row in bodies:
            child = RunFactory(version=run.version)
            Run.objects.filter(id=child.id).update(
                parent_run=run, parent_step_run=row, root_run=run, body="fan.do"
            )
            StepRunFactory(run=child, step_id="a")
            children.append(child)
    spans = by_id(traced(api, run))
    for n, (row, child) in enumerate(zip(bodies, children, strict=True)):
        assert spans[f"step:{run.id}:fan[{n}]/_body"]["parent"] == f"step:{run.id}:fan"
        assert spans[f"run:{child.id}"]["parent"] == f"attempt:{row.id}"
        assert spans[f"run:{child.id}"]["attributes"]["body"] == "fan.do"
        assert spans[f"step:{child.id}:a"]["parent"] == f"run:{child.id}"
