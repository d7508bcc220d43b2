"""Retry from a step with an edited input on real worker processes (CONTRACT section 11):
a three-step run, completed, retried from its second step with a new input. The first step
keeps its output and does not run again; the second and third run again on the new input as
generation 2; the old attempts stay in the journal; the secret the edit left out is the one
the worker's handler gets again."""

from __future__ import annotations

from typing import Any

import pytest
import requests
from rest_framework.authtoken.models import Token

from runs.models import Run
from tests.processes import wait_for
from workflows.secrets import MASK

from . import flows_retry as flows
from .flows import effects, ensure_effects_table

pytestmark = [pytest.mark.slow]

TERMINAL = ("completed", "failed", "cancelled", "timed_out")


class Api:
    """The user's API client over real HTTP, against the live server."""

    def __init__(self, live_server: Any, user: Any) -> None:
        token, _ = Token.objects.get_or_create(user=user)
        self.base = live_server.url
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Token {token.key}"

    def get(self, path: str) -> requests.Response:
        return self.session.get(f"{self.base}{path}", timeout=20)

    def post(self, path: str, json: Any) -> requests.Response:
        return self.session.post(f"{self.base}{path}", json=json, timeout=20)


def finished(run_id: Any, logs: Any) -> Run:
    def ended() -> Run | None:
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=60, interval=0.1, message=logs)


def test_a_run_retried_from_its_second_step_with_an_edited_input(
    user, live_server, celery_worker, celery_processes
) -> None:
    ensure_effects_table()
    api = Api(live_server, user)
    celery_worker(workflow_modules=["tests.runs.flows_retry"])
    logs = celery_processes.logs
    started = api.post(
        "/api/v1/runs",
        {"workflow": "rerun_flow", "input": {"topic": "old", "key": flows.KEY}},
    )
    assert started.status_code == 201, started.text
    run = finished(started.json()["id"], logs)
    assert run.status == "completed", run.error
    assert run.output["third"] == "old"

    preview = api.post(
        f"/api/v1/runs/{run.id}/retry",
        {"from_step": "two", "input": {"topic": "new"}, "dry_run": True},
    )
    assert preview.status_code == 200, preview.text
    assert (preview.json()["rerun"], preview.json()["kept"]) == (["two", "three"], ["one"])
    assert Run.objects.get(id=run.id).generation == 1  # the dry run changed nothing

    answer = api.post(
        f"/api/v1/runs/{run.id}/retry",
        {"from_step": "two", "input": {"topic": "new"}},
    )
    assert answer.status_code == 200, answer.text
    run = finished(run.id, logs)
    assert run.status == "completed", run.error
    assert run.generation == 2
    # Step one kept its output (made from the old input) and did not run again; two and
    # three ran again, on the new input; the key the edit left out reached the handler.
    assert run.output == {"third": "new", "first": "old", "key": flows.digest(flows.KEY)}
    assert [row[0] for row in effects(run.id)] == ["one", "two", "three", "two", "three"]
    journal = list(
        run.steps.order_by("id").values_list("step_id", "attempt", "generation", "status")
    )
    assert journal == [
        ("one", 1, 1, "succeeded"),
        ("two", 1, 1, "succeeded"),
        ("three", 1, 1, "succeeded"),
        ("two", 2, 2, "succeeded"),
        ("three", 2, 2, "succeeded"),
    ]
    old_two, new_two = run.steps.filter(step_id="two").order_by("attempt")
    assert old_two.output["second"] == "old" and new_two.output["second"] == "new"
    shown = api.get(f"/api/v1/runs/{run.id}").json()
    assert shown["input"] == {"topic": "new", "key": MASK}
    assert shown["actions"][-1]["action"] == "retry"
    assert shown["actions"][-1]["by"] == "ada"
    assert shown["actions"][-1]["detail"]["from_step"] == "two"
    # The trace shows both generations' attempts under their steps.
    spans = api.get(f"/api/v1/runs/{run.id}/trace").json()["spans"]
    two = [s for s in spans if s["kind"] == "attempt" and s["step_id"] == "two"]
    assert [(s["attempt"], s["attributes"]["generation"]) for s in two] == [(1, 1), (2, 2)]
    assert {s["parent"] for s in two} == {f"step:{run.id}:two"}
