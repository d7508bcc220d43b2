"""A fan-out's attempts are inserted in multi-row statements (runs.engine.store.insert_attempts),
one per batch rather than one per item, and each offered attempt is the row it names."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from runs import dispatch, services
from runs.engine import store
from runs.models import Run, StepRun
from workflows.services import definition_save

pytestmark = pytest.mark.django_db


@pytest.fixture
def chords(monkeypatch) -> list[list[Any]]:
    offered: list[list[Any]] = []
    monkeypatch.setattr(
        dispatch, "offer_fan_out_on_commit", lambda rows, **_: offered.append(list(rows))
    )
    monkeypatch.setattr(dispatch, "offer_on_commit", lambda *a, **k: None)
    monkeypatch.setattr(dispatch, "advance_on_commit", lambda *a, **k: None)
    return offered


def _fan(items: int) -> tuple[Run, list[str]]:
    """Start a run of a foreach over ``items`` items; the run and the step-run INSERTs."""
    item = {"id": "item", "kind": "task"}
    fan = {"id": "fan", "kind": "foreach", "items": "${input.items}", "do": item}
    definition_save(document={"id": "fan_inserts", "steps": [fan]})
    with CaptureQueriesContext(connection) as queries:
        run = services.run_start(workflow="fan_inserts", input={"items": list(range(items))}).run
    table = StepRun._meta.db_table
    inserts = [
        q["sql"] for q in queries.captured_queries if q["sql"].startswith(f"INSERT INTO {table}")
    ]
    return run, inserts


def test_each_offered_attempt_is_the_row_it_names(chords) -> None:
    run, _ = _fan(7)
    (offered,) = chords
    assert len(offered) == 7
    for attempt in offered:
        row = StepRun.objects.get(id=attempt.id)
        assert (row.path, row.celery_task_id, row.idempotency_key, row.status) == (
            attempt.path,
            attempt.celery_task_id,
            attempt.idempotency_key,
            "scheduled",
        )
    assert [a.path for a in offered] == [f"fan[{i}]/" for i in range(7)]
    run.refresh_from_db()
    assert run.status == "running" and run.attempts == 7


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_items_are_inserted_one_statement_per_batch(chords, monkeypatch) -> None:
    monkeypatch.setattr(store, "INSERT_BATCH", 3)
    _, inserts = _fan(7)
    (offered,) = chords
    assert len(inserts) == 3  # 3 + 3 + 1 rows
    assert len({a.id for a in offered}) == 7
    assert StepRun.objects.filter(kind="task", status="scheduled").count() == 7
