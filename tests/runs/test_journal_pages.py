"""GET /runs/{id} is bounded in rows as well as bytes (security review, issue 36): it embeds
the journal's newest DJFLOW_ANSWER_STEPS attempts, oldest first, says how many the journal
holds (``steps_total``), and GET /runs/{id}/steps pages through all of them, oldest first.
Before, a run of 20,000 attempts answered about 10 MB of rows past DJFLOW_MAX_ANSWER_BYTES."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs.models import Run, StepRun
from runs.status import RunStatus, StepStatus
from workflows import access

from ..approvals.builders import make_user
from ..moves import unchecked
from .factories import RunFactory

pytestmark = pytest.mark.django_db


def _journal(run: Run, count: int, **first: Any) -> list[int]:
    """``count`` succeeded attempts of a foreach's item (the first one with ``first``'s
    fields instead), written straight into the journal; their ids, oldest first."""
    now = timezone.now()
    rows = [
        StepRun(
            run=run,
            step_id="item",
            path=f"each[{index}]",
            kind="task",
            attempt=1,
            status=StepStatus.SUCCEEDED,
            input={"index": index},
            output={"echo": index},
            worker="celery@w",
            scheduled_at=now,
            started_at=now,
            finished_at=now,
        )
        for index in range(count)
    ]
    for name, value in first.items():
        setattr(rows[0], name, value)
    with unchecked():
        StepRun.objects.bulk_create(rows, batch_size=2000)
    return list(StepRun.objects.filter(run=run).order_by("id").values_list("id", flat=True))


def test_a_run_of_20000_attempts_answers_its_newest_within_the_bound(api, user):
    run = RunFactory(status=RunStatus.RUNNING, created_by=user)
    ids = _journal(run, 20_000)
    answer = api.get(f"/api/v1/runs/{run.id}")
    assert answer.status_code == 200
    body = answer.json()
    # The old answer embedded all 20,000 rows: about 10 MB.
    assert len(answer.content) < 1_200_000
    assert body["steps_total"] == 20_000
    assert [step["id"] for step in body["steps"]] == ids[-1000:]
    assert body["steps_url"].endswith(f"/api/v1/runs/{run.id}/steps")


def test_the_journal_pages_through_every_attempt_oldest_first(api, user, settings):
    settings.DJFLOW = {**settings.DJFLOW, "ANSWER_STEPS": 100}
    run = RunFactory(status=RunStatus.RUNNING, created_by=user)
    error = {"class": "fatal", "message": "boom", "traceback": "Traceback (most recent ...)"}
    ids = _journal(run, 2_345, status=StepStatus.FAILED, output=None, error=error)
    body = api.get(f"/api/v1/runs/{run.id}").json()
    assert (len(body["steps"]), body["steps_total"]) == (100, 2_345)
    assert [step["id"] for step in body["steps"]] == ids[-100:]
    seen: list[int] = []
    cursor, pages = None, 0
    while True:
        query = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
        page = api.get(f"/api/v1/runs/{run.id}/steps", query)
        assert page.status_code == 200, page.content
        data = page.json()
        seen += [step["id"] for step in data["results"]]
        pages += 1
        cursor = data["next"]
        if cursor is None:
            break
    assert seen == ids and pages == 3
    first = api.get(f"/api/v1/runs/{run.id}/steps", {"limit": 1}).json()["results"][0]
    # The run's operator reads the traceback, as on GET /runs/{id}; values are shown.
    assert first["error"]["traceback"].startswith("Traceback")
    assert first["input"] == {"index": 0}
    # Fifty by default.
    assert len(api.get(f"/api/v1/runs/{run.id}/steps").json()["results"]) == 50


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"cursor": "bm9wZQ=="}, "cursor"),
        # A cursor of GET /runs (a time, not an id).
        ({"cursor": "cD0yMDI2LTAxLTAxKzAwJTNBMDAlM0EwMA=="}, "cursor"),
    ],
)
def test_a_bad_page_query_is_a_400_naming_it(api, user, query, field):
    run = RunFactory(status=RunStatus.RUNNING, created_by=user)
    _journal(run, 3)
    answer = api.get(f"/api/v1/runs/{run.id}/steps", query)
    assert answer.status_code == 400, answer.content
    assert answer.json()["errors"][0]["field"] == field


def test_the_journal_is_404_to_whoever_may_not_read_the_run(api, user, stranger):
    run = RunFactory(status=RunStatus.RUNNING, created_by=user)
    _journal(run, 3)
    assert stranger.get(f"/api/v1/runs/{run.id}/steps").status_code == 404
    assert api.get(f"/api/v1/runs/{run.id}/steps").status_code == 200
    for bad in ("not-a-run", "00000000-0000-0000-0000-000000000000"):
        answer = api.get(f"/api/v1/runs/{bad}/steps")
        assert answer.status_code == 404 and answer.json()["errors"][0]["field"] == "id"


def test_the_reason_names_an_attempt_in_doubt_among_those_not_shown(api, user, settings):
    settings.DJFLOW = {**settings.DJFLOW, "ANSWER_STEPS": 10}
    run = RunFactory(status=RunStatus.RUNNING, created_by=user)
    ids = _journal(
        run,
        50,
        status=StepStatus.IN_DOUBT,
        output=None,
        finished_at=None,
        effect="at_most_once",
        idempotency_key="charge-7",
        not_before=timezone.now() + timedelta(hours=1),
    )
    body = api.get(f"/api/v1/runs/{run.id}").json()
    assert ids[0] not in [step["id"] for step in body["steps"]]
    assert f"step run {ids[0]}" in body["reason"] and "charge-7" in body["reason"]


def test_the_journal_answers_each_role_as_the_run_does(user) -> None:
    """A viewer of the workflow reads the journal without tracebacks; a starter reads the runs
    they started only (another's is a 404, as GET /runs/{id} answers)."""
    run = RunFactory(status=RunStatus.RUNNING, created_by=user)
    error = {"class": "fatal", "message": "boom", "traceback": "Traceback (most recent ...)"}
    _journal(run, 2, status=StepStatus.FAILED, output=None, error=error)

    def client(name: str, role: str) -> APIClient:
        person = make_user(name)
        access.grant(role, run.workflow_id, user=person)
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=person).key}")
        return api

    url = f"/api/v1/runs/{run.id}/steps"
    viewed = client("vera", access.VIEWER).get(url)
    assert viewed.status_code == 200
    assert "traceback" not in viewed.json()["results"][0]["error"]
    assert client("stan", access.STARTER).get(url).status_code == 404
