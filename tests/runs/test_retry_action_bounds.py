"""A retry's recorded input changes are bounded, and the run's resource embeds its actions
within DJFLOW_MAX_ANSWER_BYTES (security review, issue 36): a starter retrying her own run
with a new 1,000,000-character input eight times stored 15 MB of action details, uncharged to
the run's stored_bytes, and GET /runs/{id} answered all 15 MB."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from runs.models import Run, RunAction
from tests.runs.test_retry_from_step import (  # noqa: F401
    INPUT,
    advanced,
    client_for,
    drive,
    person,
    retry,
    saved,
)
from workflows.templates import encoded_size

pytestmark = pytest.mark.django_db


def detail_bytes(run: Run) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(octet_length(detail::text)), 0) FROM runs_runaction"
            " WHERE run_id = %s",
            [run.id],
        )
        return int(cursor.fetchone()[0])


def started(api: Any) -> Run:
    answer = api.post("/api/v1/runs", {"workflow": "rerun_flow", "input": INPUT}, format="json")
    assert answer.status_code == 201, answer.content
    run = drive(answer.json()["id"])
    assert run.status == "completed", run.error
    return run


def test_a_starter_retrying_with_a_huge_input_stores_and_answers_little(settings) -> None:
    settings.DJFLOW = {**settings.DJFLOW, "MAX_RUN_BYTES": 16 * 1024 * 1024}
    api = client_for(person("sam", "starter"))
    run = started(api)
    for i in range(8):
        topic = "AB"[i % 2] * 1_000_000
        answer = retry(api, run, {"from_step": "three", "input": {"topic": topic}})
        assert answer.status_code == 200, answer.content[:300]
        run = advanced(run.id)
    run.refresh_from_db()
    assert run.generation == 9 and run.input["topic"] == "B" * 1_000_000
    stored = detail_bytes(run)
    assert stored < 8 * 2_000, stored  # was 15,001,075
    last = RunAction.objects.filter(run=run, action="retry").order_by("-id").first()
    assert last.detail["input_changes"] == [
        {"field": "input.topic", "before": {"bytes": 1_000_002}, "after": {"bytes": 1_000_002}}
    ]
    # What the actions keep counts towards the run's stored bytes.
    kept = sum(encoded_size(a.detail) for a in RunAction.objects.filter(run=run))
    assert 0 < kept <= run.stored_bytes < 20_000, (kept, run.stored_bytes)
    first = RunAction.objects.filter(run=run, action="retry").order_by("id").first()
    assert first.detail["input_changes"][0]["before"] == "old"
    got = api.get(f"/api/v1/runs/{run.id}")
    assert got.status_code == 200
    assert len(got.content) < settings.DJFLOW["MAX_ANSWER_BYTES"], len(got.content)
    assert len(got.content) < 200_000, len(got.content)  # was 15,009,901
    # The whole input is still the run's to read.
    whole = api.get(f"/api/v1/runs/{run.id}/input")
    assert whole.status_code == 200 and whole.json()["value"]["topic"] == "B" * 1_000_000


def test_the_changed_paths_are_capped_and_the_dry_run_bounded(settings) -> None:
    from runs import services
    from runs.services import RETRY_CHANGE_PATHS

    settings.DJFLOW = {**settings.DJFLOW, "ANSWER_VALUE_BYTES": 1000}
    api = client_for(person("sam", "starter"))
    run = started(api)
    dry = retry(api, run, {"from_step": "three", "input": {"topic": "x" * 5000}, "dry_run": True})
    assert dry.status_code == 200, dry.content[:300]
    assert dry.json()["input_changes"] == [
        {"field": "input.topic", "before": "old", "after": {"bytes": 5002}}
    ]
    # A change of many paths: the first RETRY_CHANGE_PATHS are recorded, the rest counted.
    recorded = services._recorded_changes(
        [{"field": f"input.topic.k{n}", "before": None, "after": n} for n in range(500)]
    )
    assert len(recorded["input_changes"]) == RETRY_CHANGE_PATHS
    assert recorded["input_changes_omitted"] == 500 - RETRY_CHANGE_PATHS
    assert recorded["input_changes"][0] == {"field": "input.topic.k0", "before": None, "after": 0}


def test_the_resource_shows_the_newest_actions_and_cuts_a_large_old_detail(settings) -> None:
    from runs.serializers import SHOWN_ACTIONS

    api = client_for(person("sam", "starter"))
    run = started(api)
    # As an older release recorded a retry: the input's values raw.
    RunAction.objects.create(
        run=run,
        action="retry",
        detail={
            "generation": 2,
            "input_changes": [{"field": "input.topic", "before": "a" * 100_000, "after": "b"}],
        },
    )
    for n in range(SHOWN_ACTIONS + 5):
        RunAction.objects.create(run=run, action="resume", detail={"n": n})
    shown = api.get(f"/api/v1/runs/{run.id}").json()["actions"]
    assert len(shown) == SHOWN_ACTIONS
    assert [a["detail"]["n"] for a in shown] == list(range(5, SHOWN_ACTIONS + 5))
    RunAction.objects.filter(run=run, action="resume").delete()
    [old] = api.get(f"/api/v1/runs/{run.id}").json()["actions"]
    assert old["detail"]["generation"] == 2
    assert set(old["detail"]["input_changes"]) == {"bytes"}
