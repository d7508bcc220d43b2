"""MCP tool calls as recorded (runs.engine.calls.tool_calls_record): each attempt of a run
lists its tool calls without their bodies in the API, the attempt's admin page shows them
whole with the run's secrets masked, and a stranger sees neither."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs.engine import calls
from runs.models import Run, StepRun, ToolCall
from runs.status import StepStatus
from tests.runs.factories import RunFactory, StepRunFactory

pytestmark = pytest.mark.django_db

LONG = "line of a long answer\n" * 20_000  # 440,000 characters
TOKEN = "[secret:0123456789abcdef0123]"


def _called(run: Run, number: int = 1, **use: Any) -> tuple[StepRun, ToolCall]:
    attempt = StepRunFactory(
        run=run, step_id="fetch", kind="mcp_tool", attempt=number, status=StepStatus.RUNNING
    )
    values = {
        "step_run_id": attempt.id,
        "run_id": run.id,
        "server": "docs",
        "tool": "read",
        "arguments": {"path": "/a", "key": TOKEN},
        "result": {"is_error": False, "text": LONG},
        "status": "ok",
        "latency_ms": 12,
        **use,
    }
    [recorded] = calls.tool_calls_record([calls.ToolUse(**values)])
    return attempt, recorded


def test_a_run_lists_its_tool_calls_without_their_bodies(api: APIClient) -> None:
    run = RunFactory()
    _, call = _called(run)
    _called(run, 2, result=None, status="retryable", error={"class": "retryable", "message": "x"})
    response = api.get(f"/api/v1/runs/{run.id}")
    assert response.status_code == 200
    listed = [c for s in response.json()["steps"] for c in s["tool_calls"]]
    assert [(c["server"], c["tool"], c["status"]) for c in listed] == [
        ("docs", "read", "ok"),
        ("docs", "read", "retryable"),
    ]
    first, second = listed
    assert first["arguments_digest"] == calls.digest(call.arguments.body)
    assert first["result_size"] > 440_000 and first["latency_ms"] == 12
    assert (second["result_digest"], second["result_size"]) == (None, None)
    assert second["error"] == {"class": "retryable", "message": "x"}
    assert LONG[:100] not in response.content.decode()


def test_the_admin_shows_the_call_with_secrets_masked(admin_client: Client) -> None:
    run = RunFactory()
    attempt, _ = _called(run)
    page = admin_client.get(reverse("admin:runs_steprun_change", args=[attempt.id]))
    assert page.status_code == 200
    text = page.content.decode()
    assert "tool calls" in text.lower() and "docs" in text and "/a" in text
    assert TOKEN not in text and "••••" in text


def test_a_stranger_sees_no_tool_calls(db: Any) -> None:
    run = RunFactory()
    _called(run)
    stranger = get_user_model().objects.create_user(username="eve", password="a-long-pw-1")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=stranger).key}")
    assert client.get(f"/api/v1/runs/{run.id}").status_code == 404
