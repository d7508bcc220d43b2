"""POST /api/v1/runs/forecast, its history, the start page's and the admin's forecast
(contract section 17); each kind of bound forecast, then run in process (the ``djflow``
fixture, stubbed model replies) to check the cost the run had lies within [min, max]."""

from __future__ import annotations

from typing import Any

import pytest

from runs import forecasts
from runs.models import Run
from workflows import access
from workflows.models import WorkflowVersion
from workflows.services import definition_save

MODEL = "openai:gpt-4o-mini"
PRICES = {MODEL: {"input": 1, "output": 2}}  # USD a million tokens


@pytest.fixture
def priced(settings: Any) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "PRICES": PRICES}


def recipe(step_id: str, **more: Any) -> dict[str, Any]:
    return {
        "id": step_id,
        "kind": "recipe",
        "prompt": "Say hi",
        "model": MODEL,
        "max_tokens": 50,
        "retry": {"max_attempts": 2, "backoff": "none"},
        **more,
    }


def task(step_id: str, **more: Any) -> dict[str, Any]:
    return {"id": step_id, "kind": "task", "handler": f"fc.{step_id}", **more}


def within(run_cost: Any, answer: dict[str, Any]) -> None:
    cost = float(run_cost)
    assert answer["min"] <= cost <= answer["max"], (cost, answer)


def forecast_of(workflow: str, **given: Any) -> dict[str, Any]:
    version = WorkflowVersion.objects.resolve(workflow)
    assert version is not None
    return forecasts.version_forecast(version, **given).as_json()


CASES = {
    "foreach_unknown": (
        [
            {
                "id": "each",
                "kind": "foreach",
                "items": "${input.xs}",
                "max_items": 5,
                "do": recipe("ask"),
            }
        ],
        {"xs": [1, 2, 3]},
        False,
    ),
    "foreach_known": (
        [
            {
                "id": "each",
                "kind": "foreach",
                "items": "${input.xs}",
                "max_items": 5,
                "do": recipe("ask"),
            }
        ],
        {"xs": [1, 2, 3]},
        True,
    ),
    "loop": (
        [
            {
                "id": "again",
                "kind": "loop",
                "max_iterations": 4,
                "until": {"path": "iter.index", "op": "eq", "value": 1},
                "do": recipe("ask"),
            }
        ],
        {},
        False,
    ),
    "condition": (
        [
            {
                "id": "which",
                "kind": "condition",
                "if": {"path": "input.big", "op": "eq", "value": True},
                "then": [recipe("a"), recipe("b")],
                "else": [recipe("c")],
            }
        ],
        {"big": True},
        False,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_bound_forecasts_a_range_the_run_then_costs_within(djflow, priced, name) -> None:
    steps, given, known = CASES[name]
    workflow = f"fc_{name}"
    djflow.define({"id": workflow, "steps": steps})
    djflow.model(reply="hello there")
    answer = forecast_of(workflow, input=given, input_given=known)
    run = djflow.start(workflow, input=given)
    assert run.status == "completed", run.error
    assert run.cost_usd > 0
    within(run.cost_usd, answer["cost_usd"])
    attempts = Run.objects.get(id=run.id).attempts
    assert answer["steps"]["min"] <= attempts <= answer["steps"]["max"]
    if known:
        assert answer["steps"] == {"min": 3, "max": 6}  # 3 items, 2 attempts each at most


def test_retries_are_within_the_forecast_too(djflow, priced) -> None:
    djflow.define({"id": "fc_retry", "steps": [recipe("ask")]})
    from workflows.sdk import StepFailure

    def flaky(request: Any) -> str:
        flaky.calls += 1  # type: ignore[attr-defined]
        if flaky.calls == 1:  # type: ignore[attr-defined]
            raise StepFailure("busy", class_="retryable")
        return "ok"

    flaky.calls = 0  # type: ignore[attr-defined]
    djflow.model(reply=flaky)
    answer = forecast_of("fc_retry")
    assert answer["steps"] == {"min": 1, "max": 2}
    run = djflow.start("fc_retry")
    djflow.advance(60)
    assert run.status == "completed", run.error
    within(run.cost_usd, answer["cost_usd"])


def test_a_subworkflows_calls_are_the_steps_and_within_the_forecast(djflow, priced) -> None:
    djflow.define({"id": "fc_child", "steps": [recipe("inner")]})
    djflow.define(
        {"id": "fc_parent", "steps": [{"id": "sub", "kind": "subworkflow", "workflow": "fc_child"}]}
    )
    djflow.model(reply="hi")
    answer = forecast_of("fc_parent")
    assert answer["steps"] == {"min": 2, "max": 3}
    [sub] = answer["per_step"]
    assert sub["calls"] == {"min": 1, "max": 2}
    run = djflow.start("fc_parent")
    assert run.status == "completed", run.error
    spent = sum(r.cost_usd for r in Run.objects.filter(parent_run_id=run.id))
    within(spent, answer["cost_usd"])


def test_expected_is_the_median_of_the_last_completed_runs(djflow, priced) -> None:
    djflow.define({"id": "fc_history", "steps": [recipe("ask")]})
    djflow.model(reply="a reply")
    for _ in range(3):
        djflow.start("fc_history")
    answer = forecast_of("fc_history")
    spent = float(Run.objects.filter(workflow_id="fc_history").first().cost_usd)
    assert answer["cost_usd"]["expected"] == pytest.approx(spent)
    assert answer["per_step"][0]["cost_usd"]["expected"] == pytest.approx(spent)


# --- the API ------------------------------------------------------------------------------


@pytest.fixture
def flow(db) -> None:
    definition_save(
        document={
            "id": "fc_api",
            "steps": [
                {
                    "id": "each",
                    "kind": "foreach",
                    "items": "${input.xs}",
                    "max_items": 10,
                    "do": {"id": "t", "kind": "sleep", "ms": 1},
                },
                {"id": "ag", "kind": "agent", "handler": "fc.agent"},
            ],
        }
    )


def test_the_api_answers_the_contracts_shape(api, flow) -> None:
    response = api.post(
        "/api/v1/runs/forecast", {"workflow": "fc_api", "input": {"xs": [1, 2]}}, format="json"
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["steps"] == {"min": 3, "max": 3}
    assert body["cost_usd"]["max"] is None and body["cost_usd"]["min"] == 0
    assert any("agent" in reason for reason in body["unbounded"])
    assert [s["step_id"] for s in body["per_step"]] == ["t", "ag"]
    assert set(body["per_step"][0]) >= {"step_id", "calls", "cost_usd"}
    without = api.post("/api/v1/runs/forecast", {"workflow": "fc_api"}, format="json").json()
    assert without["steps"] == {"min": 1, "max": 11}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "workflow"),
        ({"workflow": "fc_api", "colour": 1}, "colour"),
        ({"workflow": 7}, "workflow"),
        ({"workflow": "fc_api", "version": "x"}, "version"),
        ([], "body"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(api, flow, body, field) -> None:
    response = api.post("/api/v1/runs/forecast", body, format="json")
    assert response.status_code == 400
    assert field in {error["field"] for error in response.json()["errors"]}


def test_an_unknown_workflow_or_version_is_a_404_naming_it(api, flow) -> None:
    response = api.post("/api/v1/runs/forecast", {"workflow": "nope"}, format="json")
    assert (response.status_code, response.json()["errors"][0]["field"]) == (404, "workflow")
    response = api.post(
        "/api/v1/runs/forecast", {"workflow": "fc_api", "version": 9}, format="json"
    )
    assert (response.status_code, response.json()["errors"][0]["field"]) == (404, "version")


def test_only_starters_may_ask(flow, stranger, django_user_model) -> None:
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    assert (
        stranger.post("/api/v1/runs/forecast", {"workflow": "fc_api"}, format="json").status_code
        == 404
    )
    vic = django_user_model.objects.create_user(username="vic", password="a-long-password-1")
    access.grant(access.VIEWER, "fc_api", user=vic)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=vic).key}")
    assert (
        client.post("/api/v1/runs/forecast", {"workflow": "fc_api"}, format="json").status_code
        == 403
    )
    access.grant(access.STARTER, "fc_api", user=vic)
    assert (
        client.post("/api/v1/runs/forecast", {"workflow": "fc_api"}, format="json").status_code
        == 200
    )


def test_the_start_page_and_the_admin_show_the_forecast(client, user, admin_user, flow) -> None:
    client.force_login(user)
    page = client.get("/workflows/fc_api/start")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="forecast"' in html and 'id="forecast-steps">1&ndash;11<' in html
    assert "its model use is not known" in html
    client.force_login(admin_user)
    version = WorkflowVersion.objects.get(workflow_id="fc_api")
    html = client.get(f"/admin/workflows/workflowversion/{version.pk}/change/").content.decode()
    assert 'id="forecast-steps">1&ndash;11<' in html


def test_a_document_over_max_steps_is_a_400_at_save_naming_the_field(api) -> None:
    document = {
        "id": "fc_big",
        "steps": [
            {
                "id": "l",
                "kind": "loop",
                "max_iterations": 600,
                "do": [
                    {"id": "t", "kind": "sleep", "ms": 1},
                    {"id": "u", "kind": "sleep", "ms": 1},
                ],
            }
        ],
    }
    response = api.post("/api/v1/definitions", document, format="json")
    assert response.status_code == 400
    [error] = response.json()["errors"]
    assert error["field"] == "steps[0].max_iterations"
    assert "1800 step attempts" in error["message"]
    document["limits"] = {"max_steps": 1800}
    assert api.post("/api/v1/definitions", document, format="json").status_code == 201


def test_the_history_is_read_in_two_queries(django_assert_max_num_queries, flow) -> None:
    with django_assert_max_num_queries(3):
        forecasts.history("fc_api")
