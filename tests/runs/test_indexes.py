"""The run list's queries are served by the indexes made for them.

Twenty thousand runs over four workflows and four statuses, analysed: a page of the list
(newest first, optionally by workflow and status) must read its index in order, with no Sort
of the matching rows, which is what keeps it fast at a million.
"""

from __future__ import annotations

import pytest
from django.db import connection

from runs import selectors
from tests.moves import unchecked
from workflows.services import definition_save

pytestmark = pytest.mark.django_db


@pytest.fixture
def many_runs() -> None:
    versions = [
        definition_save(document={"id": f"w{n}", "steps": [{"id": "a", "kind": "task"}]}).version
        for n in range(4)
    ]
    # Rows straight into their statuses: a fixture, not the engine's moves (tests/moves.py).
    with unchecked(), connection.cursor() as cursor:
        for index, version in enumerate(versions):
            cursor.execute(
                "INSERT INTO runs_run (id, workflow_id, version_id, status, input, generation,"
                " attempts, cost_usd, body, created_at, updated_at)"
                " SELECT gen_random_uuid(), %s, %s,"
                " (ARRAY['running','completed','failed','waiting'])[1 + n %% 4],"
                " '{}'::jsonb, 1, 0, 0, '', now() - (4 * n + %s) * interval '1 second', now()"
                " FROM generate_series(1, 5000) AS n",
                [version.workflow_id, version.id, index],
            )
        cursor.execute("ANALYZE runs_run")


@pytest.mark.parametrize(
    ("filters", "index"),
    [
        ({}, "run_newest"),
        ({"status": "running"}, "run_status_newest"),
        ({"workflow": "w1"}, "run_workflow_newest"),
        ({"workflow": "w1", "status": "failed"}, "run_wf_status_newest"),
    ],
)
def test_a_page_of_runs_is_an_index_scan_without_a_sort(many_runs, filters, index) -> None:
    page = selectors.run_list(**filters)[:50]
    sql, params = page.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert index in plan, plan
    assert "Sort" not in plan.split(index)[0], plan


@pytest.mark.parametrize(
    ("table", "column"),
    [
        ("runs_run", "parent_run_id"),
        ("runs_run", "parent_step_run_id"),
        ("runs_steprun", "event_id"),
    ],
)
def test_columns_that_are_mostly_null_have_only_partial_indexes(table, column) -> None:
    """Most runs have no parent and most attempts took no event: a full foreign-key index
    on these columns made every insert write a NULL into it. One partial index each serves
    the lookups (children of a run, the deletes' checks)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = %s AND indexdef LIKE %s",
            [table, f"%({column})%"],
        )
        definitions = [row[0] for row in cursor.fetchall()]
    assert len(definitions) == 1, definitions
    assert f"WHERE ({column} IS NOT NULL)" in definitions[0]
