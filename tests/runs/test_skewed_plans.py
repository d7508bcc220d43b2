"""A worker's prepared statements bound by run (runs.engine.sql plans them once, from the
statistics of the moment), planned while one run owned most of the journal: a fresh
install's first big fan-out, analysed by autovacuum as it ran. Each must still read only
its own run's rows: the run-id columns' share of distinct values is fixed
(runs/migrations/0024_run_distribution_statistics.py). Without it, each of these read the
big run's 10,000 rows (or its 2,000 children) to find a small run's few."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from runs.engine import ending, journal, store
from runs.models import Run, StepRun, Timer

from ..moves import unchecked
from .factories import RunFactory, StepRunFactory
from .test_journal_plan import _generic_plan, _read

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif("connection.vendor != 'postgresql'"),
]

BIG = 10_000
CHILDREN = 2_000
RUNS = 2_000


def _one_run_owns_the_journal() -> Run:
    """A run of BIG rows (a foreach's items, most done, some in flight, each with its
    deadline's timer) and CHILDREN child runs, a few small runs, and the tables analysed
    then."""
    later = timezone.now() + timedelta(hours=1)
    big = RunFactory()
    StepRun.objects.bulk_create(
        StepRun(
            run=big,
            step_id="item",
            path=f"each/{index}",
            kind="task",
            attempt=1,
            generation=big.generation,
            status="running" if index % 10 == 0 else "succeeded",
            input={},
        )
        for index in range(BIG)
    )
    Timer.objects.bulk_create(
        Timer(run=big, purpose="step_deadline", key=f"deadline:{index}", fire_at=later)
        for index in range(BIG)
    )
    with unchecked():
        Run.objects.bulk_create(
            Run(
                workflow=big.workflow,
                version=big.version,
                status="running" if index % 2 else "completed",
                input={},
                parent_run=big,
                root_run=big,
            )
            for index in range(CHILDREN)
        )
    for _ in range(3):
        small = RunFactory(workflow=big.workflow, version=big.version)
        StepRunFactory(run=small)
        Timer.objects.create(run=small, purpose="run_deadline", key="run", fire_at=later)
    with connection.cursor() as cursor:
        for table in ("runs_run", "runs_steprun", "runs_timer"):
            cursor.execute(f"ANALYZE {table}")
    return big


def _numbered(sql: str) -> str:
    index = 0
    while "%s" in sql:
        index += 1
        sql = sql.replace("%s", f"${index}", 1)
    return sql


STATEMENTS = {
    "a step's journal read": (
        lambda: journal._sql(journal._JOURNAL_SQL, "postgresql"),
        "uuid, bigint",
        "'{run}', 0",
    ),
    "a batch's journal read": (
        lambda: journal._sql(journal._JOURNALS_SQL, "postgresql"),
        "uuid[], bigint[]",
        "ARRAY['{run}'::uuid], ARRAY[0]",
    ),
    "a fan-out's in-flight probe": (
        lambda: store._in_flight_sql(1),
        "uuid, text, bigint",
        "'{run}', 'task', 0",
    ),
    # The run's id twice: its rows in flight, its children not ended.
    "what a run's end leaves": (
        lambda: ending._left_sql(ending._ONE),
        "uuid, uuid",
        "'{run}', '{run}'",
    ),
    "what a batch's ends leave": (
        lambda: ending._left_sql(ending._SEVERAL),
        "uuid[], uuid[]",
        "ARRAY['{run}'::uuid], ARRAY['{run}'::uuid]",
    ),
    "a run's end dropping its timers": (
        lambda: ending._drop_timers_sql(ending._ONE),
        "uuid",
        "'{run}'",
    ),
    "a batch's ends dropping their timers": (
        lambda: ending._drop_timers_sql(ending._SEVERAL),
        "uuid[]",
        "ARRAY['{run}'::uuid]",
    ),
}


def _small_run(**fields: Any) -> Run:
    """A run of five journal rows, a pending timer and a child run."""
    run = RunFactory(**fields)
    for index in range(5):
        StepRunFactory(run=run, step_id=f"step_{index}")
    Timer.objects.create(run=run, purpose="run_deadline", key="run", fire_at=timezone.now())
    RunFactory(workflow=run.workflow, version=run.version, parent_run=run, root_run=run)
    return run


def _unbounded(run: Run) -> dict[str, list[tuple[str | None, int]]]:
    """Each statement's scans, as a worker's generic plan makes them for ``run``, where one
    reads more than the run's own few rows (its five, its timer, its child)."""
    found = {}
    for name, (build, types, values) in STATEMENTS.items():
        read = _read(_generic_plan(_numbered(build()), types, values.format(run=run.id)))
        if not read or any(rows > 20 for _, rows in read):
            found[name] = read
    return found


def test_a_small_runs_statements_read_its_own_rows_under_skewed_statistics() -> None:
    """Six of the seven read the big run's 10,000 rows or its 2,000 children without
    migration 0024 (the in-flight probe has its partial index)."""
    _one_run_owns_the_journal()
    assert _unbounded(_small_run()) == {}


def _many_runs_since_install() -> None:
    """RUNS runs of five journal rows, a timer and a child each, and the tables' sizes
    counted with no statistics of their run columns: a fresh install, whose migrations
    analysed empty tables (no statistics at all), since vacuumed (which counts the rows and
    takes no statistics). An analyse of one other column each does the same here."""
    later = timezone.now() + timedelta(hours=1)
    first = RunFactory()
    with unchecked():
        runs = [
            first,
            *Run.objects.bulk_create(
                Run(workflow=first.workflow, version=first.version, status="running", input={})
                for _ in range(RUNS - 1)
            ),
        ]
        Run.objects.bulk_create(
            Run(
                workflow=first.workflow,
                version=first.version,
                status="running",
                input={},
                parent_run=run,
                root_run=run,
            )
            for run in runs
        )
    StepRun.objects.bulk_create(
        StepRun(
            run=run,
            step_id=f"step_{index}",
            kind="task",
            attempt=1,
            generation=run.generation,
            status="running" if index == 4 else "succeeded",
            input={},
        )
        for run in runs
        for index in range(5)
    )
    Timer.objects.bulk_create(
        Timer(run=run, purpose="run_deadline", key="run", fire_at=later) for run in runs
    )
    with connection.cursor() as cursor:
        for table, column in (
            ("runs_run", "status"),
            ("runs_steprun", "status"),
            ("runs_timer", "fired_at"),
        ):
            cursor.execute(f"ANALYZE {table} ({column})")


def test_a_runs_statements_read_its_own_rows_with_no_statistics_of_the_run_columns() -> None:
    """Without statistics of the run columns (so without migration 0024's shares either),
    a batch's journal read, written as a join of the runs' array with the journal, was
    planned as a merge join along step_run_journal: every entry before the run's id, a
    random share of the table at each batch (556 to 7,716 of 10,000 in six runs). It
    looks each run's rows up by the run (LATERAL). The run's id is the greatest, after
    every other run's rows in that index."""
    _many_runs_since_install()
    with connection.cursor() as cursor:
        # The case itself: the run columns without statistics (or the shares would apply).
        cursor.execute(
            "SELECT count(*) FROM pg_stats WHERE (tablename, attname) IN"
            " (('runs_steprun', 'run_id'), ('runs_timer', 'run_id'), ('runs_run', 'parent_run_id'))"
        )
        assert cursor.fetchone()[0] == 0
    assert _unbounded(_small_run(id=uuid.UUID(int=2**128 - 1))) == {}
