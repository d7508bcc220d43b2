"""Tell Postgres's planner how the journal's rows spread over runs, whatever the sample of
the moment says.

A worker plans its prepared statements once, generically, from the statistics of the
moment (runs.engine.sql), and keeps those plans until a table doubles. When autovacuum
analyses the journal while one run owns most of it (a fresh install's first big foreach),
the sample counts a handful of runs, so ``run_id = $1`` looks like a fifth of the table or
more: a step's journal read walked the primary key, a run's end scanned the journal and the
runs, and its timers' delete scanned the timers, each reading the big run's 10,000 rows to
find a small run's five, at every step of every run (tests/runs/test_skewed_plans.py,
bench/README.md). A fixed share of distinct values (``n_distinct``, negative: a fraction
of the rows) keeps the estimate at a run's few rows, as it is for all but the largest runs;
an index on the run answers any run, the largest too.

The values: 20 journal rows a run, 5 timers, and for the parent and root columns a tenth
of the table's rows as distinct values (Postgres counts the NULLs of runs with no parent in
the rows, so a parent's children are estimated at about one). Each counts only as an
estimate. ``ANALYZE`` applies them now rather than at autovacuum's next visit
(a sample of 30,000 rows a table, bounded). Both take a SHARE UPDATE EXCLUSIVE lock, which
reads and writes do not wait for. SQLite has neither and plans each statement anew.
"""

from django.db import migrations

DISTINCT = {
    "runs_steprun": {"run_id": -0.05},
    "runs_timer": {"run_id": -0.2},
    "runs_run": {"parent_run_id": -0.1, "root_run_id": -0.1},
}


def _set(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, columns in DISTINCT.items():
        for column, share in columns.items():
            schema_editor.execute(
                f"ALTER TABLE {table} ALTER COLUMN {column} SET (n_distinct = {share})"
            )
        schema_editor.execute(f"ANALYZE {table}")


def _reset(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, columns in DISTINCT.items():
        for column in columns:
            schema_editor.execute(f"ALTER TABLE {table} ALTER COLUMN {column} RESET (n_distinct)")
        schema_editor.execute(f"ANALYZE {table}")


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0023_timer_unfired_run"),
    ]

    operations = [migrations.RunPython(_set, _reset, elidable=False)]
