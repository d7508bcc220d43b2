"""The journal's read as a worker's prepared cursor plans it (runs.engine.sql: once, from
the statistics of the moment): a step reads its run's rows and the child runs of its
waiting subworkflow rows, never the table's other child runs."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from runs.engine import journal
from runs.models import Run, StepRun

from ..moves import unchecked
from .factories import RunFactory, StepRunFactory
from .test_timer_claim import _scans

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif("connection.vendor != 'postgresql'"),
]

CHILDREN = 2000


def _children_elsewhere() -> None:
    """Other runs' subworkflow steps (five each), each with its child run, made after the
    tables were analysed (subworkflows not used yet then, or rare)."""
    first = RunFactory()
    with unchecked():
        more = Run.objects.bulk_create(
            Run(workflow=first.workflow, version=first.version, status="running", input={})
            for _ in range(CHILDREN // 5 - 1)
        )
    others = [first, *more]
    with unchecked():
        steps = StepRun.objects.bulk_create(
            StepRun(
                run=other,
                step_id=f"child_{index}",
                kind="subworkflow",
                attempt=1,
                generation=other.generation,
                status="succeeded",
                input={},
            )
            for other in others
            for index in range(5)
        )
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE runs_run")
            cursor.execute("ANALYZE runs_steprun")
        Run.objects.bulk_create(
            Run(
                workflow=step.run.workflow,
                version=step.run.version,
                status="completed",
                input={},
                parent_run=step.run,
                root_run=step.run,
                parent_step_run=step,
            )
            for step in steps
        )


def _read(plan: dict[str, Any]) -> list[tuple[str | None, int]]:
    return [
        (
            node.get("Index Name") or node.get("Relation Name"),
            (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"],
        )
        for node in _scans(plan)
    ]


def _generic_plan(sql: str, types: str, values: str) -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE journal_read({types}) AS {sql}")
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE journal_read({values})")
        plan = cursor.fetchone()[0][0]["Plan"]
        cursor.execute("DEALLOCATE journal_read")
    return plan


@pytest.mark.parametrize("several", [False, True], ids=["a step's", "a batch's"])
def test_a_journal_read_reads_only_its_runs_rows_and_their_children(several: bool) -> None:
    """With statistics taken before there were child runs, a step's read joined its rows
    to the index of every child run (run_parent_step_run) in a merge join, reading every
    child run whose step came before its own last row, at every step: 2,001 here. Each row
    now looks up its own child, only a waiting subworkflow's."""
    _children_elsewhere()
    run = RunFactory()
    waiting = StepRunFactory(run=run, step_id="sub", kind="subworkflow", status="waiting")
    child = RunFactory(
        workflow=run.workflow,
        version=run.version,
        parent_run=run,
        root_run=run,
        parent_step_run=waiting,
    )
    for index in range(4):
        StepRunFactory(run=run, step_id=f"step_{index}")
    if several:
        sql = journal._sql(journal._JOURNALS_SQL, "postgresql").replace("%s", "$1", 1)
        plan = _generic_plan(
            sql.replace("%s", "$2", 1), "uuid[], bigint[]", f"ARRAY['{run.id}'::uuid], ARRAY[0]"
        )
    else:
        sql = journal._sql(journal._JOURNAL_SQL, "postgresql")
        plan = _generic_plan(
            sql.replace("%s", "$1", 1).replace("%s", "$2", 1), "uuid, bigint", f"'{run.id}', 0"
        )
    read = _read(plan)
    # The run's five rows, its one child: not the 2,000 others'.
    assert read and all(rows <= 10 for _, rows in read), read
    rows = journal.journal_of(run.id)
    assert len(rows) == 5
    assert [(view.step_id, view.child["id"]) for view in rows if view.child] == [
        ("sub", str(child.id))
    ]
