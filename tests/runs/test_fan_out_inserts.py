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


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_a_batch_stores_each_value_as_a_row_of_its_own_would(chords) -> None:
    """The multi-row INSERT (one typed array a column) writes every kind of value the
    single-row one writes: JSON of every shape and JSON null, NULL, text past the ASCII
    range, decimals, timestamps, UUIDs, in the order given."""
    import datetime
    import decimal
    import uuid

    run, _ = _fan(1)
    when = datetime.datetime(2026, 12, 4, 21, 0, 0, 123456, tzinfo=datetime.UTC)
    # Every column as the engine writes an item's, from the one it wrote.
    item = StepRun.objects.get(run=run, kind="task")
    base = {f.attname: getattr(item, f.attname) for f in StepRun._meta.concrete_fields}
    del base["id"]
    shapes: list[dict[str, Any]] = [
        {"input": {"a": [1, 2.5, None, "é€😀"], "b": {"c": True}}, "claim": uuid.uuid4()},
        {"input": None, "claim": None},
        {"input": "text", "claim": None, "cost_usd": decimal.Decimal("0.000123")},
        {"input": [], "claim": None, "not_before": when + datetime.timedelta(seconds=5)},
    ]
    rows = [
        {**base, "path": f"x[{i}]/", "cost_usd": decimal.Decimal(0), "not_before": None, **shape}
        for i, shape in enumerate(shapes)
    ]
    many = store.insert_attempts(rows)
    alone = [store.insert_attempt({**row, "path": f"y{row['path']}"}) for row in rows]
    fields = ["path", "input", "claim", "cost_usd", "not_before", "scheduled_at", "timeout_ms"]
    stored = StepRun.objects.filter(id__in=many + alone).values("id", *fields)
    read = {row["id"]: row for row in stored}
    assert [read[i]["path"] for i in many] == [f"x[{i}]/" for i in range(len(shapes))]
    for batched, single in zip(many, alone, strict=True):
        a, b = dict(read[batched]), dict(read[single])
        assert b.pop("path") == "y" + a.pop("path")
        a.pop("id"), b.pop("id")
        assert a == b
    assert read[many[0]]["input"] == shapes[0]["input"]
    assert read[many[2]]["cost_usd"] == decimal.Decimal("0.000123")


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_a_batchs_statement_is_the_same_text_for_any_number_of_rows(chords) -> None:
    """One array a column: the text does not grow with the rows, so Postgres parses it once
    (a VALUES list of 500 rows was 15,000 placeholders, split and parsed again each time)."""
    _, two = _fan(2)
    _, seven = _fan(7)
    assert len(two) == len(seven) == 1
    assert two[0] == seven[0]
    assert "UNNEST" in two[0] and "%s" not in two[0].split("UNNEST", 1)[0]
