# A run's journal read in order, and its rows after a settled prefix (runs.engine.journal,
# journal_of(after=)): an index on (run, id), which also serves the run's foreign key, so the
# key's own index goes. Built CONCURRENTLY on Postgres: on a large runs_steprun a plain
# CREATE INDEX would hold every step's writes while it builds.

import django.db.models.deletion
from django.db import migrations, models

INDEX = "step_run_journal"


def create(apps, schema_editor):
    concurrently = " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(
        f"CREATE INDEX{concurrently} IF NOT EXISTS {INDEX} ON runs_steprun (run_id, id)"
    )


def drop(apps, schema_editor):
    concurrently = " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX{concurrently} IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY cannot run inside a transaction.
    atomic = False

    dependencies = [
        ("runs", "0016_run_list_search_indexes"),
    ]

    operations = [
        # The new index first: the run's rows are never without one.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="steprun",
                    index=models.Index(fields=["run", "id"], name=INDEX),
                ),
            ],
            database_operations=[migrations.RunPython(create, drop)],
        ),
        migrations.AlterField(
            model_name="steprun",
            name="run",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="steps",
                to="runs.run",
            ),
        ),
    ]
